"""What the SGLang engine is fed: weight names, and the policy/draft pair it may serve.

SGLang loads HF names for the target (``Qwen3ForCausalLM`` / ``LlamaForCausalLM``
``load_weights`` in sglang/srt/models/qwen3.py, llama.py) and SpecForge export names for
the EAGLE-3 draft (``LlamaForCausalLMEagle3.load_weights`` in
sglang/srt/models/llama_eagle3.py maps ``midlayer.*`` -> ``layers.0.*`` and prefixes
``model.``). titan_spec's trainer holds torchtitan names for the policy (mapped with
torchtitan's own state-dict adapters, as the HF export does) and the export names for
the draft (``Eagle3Draft.state_dict()`` already uses them; DESIGN.md, draft conventions).

Every mapping is checked name by name: a name that does not map is an error, never a
silent drop, because a dropped weight would leave SGLang serving a stale tensor.
"""

from __future__ import annotations

import os

import torch
from torch.distributed.tensor import DTensor

from titan_spec.models.draft_io import EXPORT_KEYS, read_draft_arch
from titan_spec.models.hf_io import _adapter, read_hf_arch
from titan_spec.models.registry import Arch, build_target_config
from titan_spec.rl.rollout.base import NamedTensors, named_tensor_items

__all__ = ["policy_to_hf_names", "draft_to_export_names", "check_draft_fits_policy"]


def _full(t: torch.Tensor) -> torch.Tensor:
    # FSDP-sharded parameters arrive as DTensors: gather (a collective on every rank).
    return t.full_tensor() if isinstance(t, DTensor) else t


def policy_to_hf_names(named_tensors: NamedTensors, arch: Arch) -> list[tuple[str, torch.Tensor]]:
    """torchtitan policy names -> the HF names SGLang's target model loads.

    Goes through torchtitan's state-dict adapter one name at a time, so every input
    name is accounted for (Llama's q/k permutation is per tensor, so this is exact).
    A tied ``lm_head.weight`` is dropped: with ``tie_word_embeddings`` SGLang's lm_head
    is the embedding and the adapter writes no lm_head either.
    """
    adapter = _adapter(arch, build_target_config(arch))
    out: list[tuple[str, torch.Tensor]] = []
    unknown = []
    for name, tensor in named_tensor_items(named_tensors):
        hf = adapter.to_hf({name: _full(tensor)})
        if not hf:
            if name == "lm_head.weight" and arch.tie_embeddings:
                continue
            unknown.append(name)
            continue
        out.extend(hf.items())
    if unknown:
        raise ValueError(
            f"policy weights: {len(unknown)} name(s) have no HF name for SGLang "
            f"({', '.join(unknown[:4])}{', ...' if len(unknown) > 4 else ''}); "
            "push the trainer's torchtitan state dict (tok_embeddings.*, layers.N.*, norm.*, lm_head.*)"
        )
    return out


def draft_to_export_names(named_tensors: NamedTensors) -> list[tuple[str, torch.Tensor]]:
    """Draft state dict -> the SpecForge/SGLang export names (DESIGN.md's exact list).

    The trainer's draft already uses those names; an embedding (some SpecForge
    checkpoints carry the frozen target embedding) is dropped because SGLang's draft
    shares the target's. Anything else is an error. Partial pushes are allowed.
    """
    out, unknown = [], []
    for name, tensor in named_tensor_items(named_tensors):
        if name.endswith("embed_tokens.weight"):
            continue
        if name not in EXPORT_KEYS:
            unknown.append(name)
            continue
        out.append((name, _full(tensor)))
    if unknown:
        raise ValueError(
            f"draft weights: unknown name(s) {unknown[:4]}{'...' if len(unknown) > 4 else ''}; "
            f"allowed: {', '.join(EXPORT_KEYS)}"
        )
    return out


def check_draft_fits_policy(policy_path: str, draft_path: str) -> None:
    """Raise ValueError (one line) unless SGLang can serve this draft with this policy.

    SGLang's EAGLE-3 draft reads the target's embedding (so its hidden size is the
    target's), maps its vocabulary through d2t into the target's, and takes three
    tapped layers of the target, which must exist.
    """
    if not os.path.isdir(draft_path):
        raise ValueError(f"draft directory {draft_path!r} does not exist; export one with save_draft or --draft.export_dir")
    policy = read_hf_arch(policy_path)
    draft = read_draft_arch(draft_path)
    if not os.path.isfile(os.path.join(draft_path, "model.safetensors")):
        raise ValueError(f"draft directory {draft_path!r} has no model.safetensors")
    bad = draft.misfits(policy.vocab_size, policy.dim)
    if draft.draft_vocab_size > policy.vocab_size:
        bad.append(f"draft_vocab_size {draft.draft_vocab_size} > policy vocab {policy.vocab_size}")
    taps = list(draft.tap_layer_ids)
    if len(taps) != 3 or any(not 0 <= i < policy.n_layers for i in taps):
        bad.append(f"tap ids {taps} are not three layers of the {policy.n_layers}-layer policy")
    if bad:
        raise ValueError(f"draft directory {draft_path} does not fit the policy {policy_path}: {'; '.join(bad)}")
