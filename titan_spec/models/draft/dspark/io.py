"""DSpark draft export/import in the layout vLLM 0.32 loads (``speculative_config = {"method":
"dspark", "model": DIR}``; vllm/model_executor/models/qwen3_dspark.py ``Qwen3DSparkForCausalLM``).

DFlash's directory (models/draft/dflash/io.py) with ``architectures = ["Qwen3DSparkModel"]``,
``markov_rank``, ``enable_confidence_head`` and ``confidence_head_with_markov = true`` in
config.json and ``markov_head.markov_w1.weight`` [V, Mr], ``markov_head.markov_w2.weight``
[Vd, Mr], ``confidence_head.proj.weight`` [1, H + Mr] and ``.bias`` [1] beside the backbone's
tensors. vLLM embeds a masked row by the target's embedding of mask_token_id and ignores
mask_embedding.pt; titan_spec trains and reads the draft's own (as for DFlash).
"""

from __future__ import annotations

import torch

from titan_spec.models.draft.dflash.io import (
    check_dflash_weights,
    dflash_mismatches,
    load_dflash_into,
    read_dflash_arch,
    save_dflash,
)
from titan_spec.models.draft.dspark.model import DSparkArch, DSparkDraft

__all__ = ["check_dspark_weights", "dspark_mismatches", "load_dspark_into", "read_dspark_arch", "save_dspark"]


def read_dspark_arch(path: str) -> DSparkArch:
    return read_dflash_arch(path, DSparkArch)


def dspark_mismatches(found: DSparkArch, want: DSparkArch) -> list[str]:
    return dflash_mismatches(found, want)


def check_dspark_weights(path: str, arch: DSparkArch) -> None:
    check_dflash_weights(path, arch, DSparkDraft)


def save_dspark(draft: DSparkDraft, path: str, dtype: torch.dtype = torch.float32) -> None:
    save_dflash(draft, path, dtype)


def load_dspark_into(draft: DSparkDraft, path: str, target_dir: str | None = None) -> None:
    load_dflash_into(draft, path, target_dir)
