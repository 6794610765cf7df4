"""The custom weight loaders SGLang runs inside its model runners for live weight pushes.

SGLang 0.5.23 calls ``dynamic_import(load_format)(model, named_tensors)`` when an
``update_weights_from_tensor`` request names a load_format listed in the server's
``custom_weight_loader`` (sglang/srt/model_executor/model_runner_components/
weight_updater.py, ``WeightUpdater.update_weights_from_tensor``). With EAGLE-3 the
scheduler makes that call on the target's runner AND the draft's runner unless the
request's ``selector`` narrows it (sglang/srt/managers/scheduler_components/
weight_updater.py, ``_select_runners``), and each model's ``load_weights`` happily takes
the other's names: the Qwen3 target prefixes a draft ``norm.weight`` to
``model.norm.weight`` (sglang/srt/models/qwen3.py), and the EAGLE-3 draft maps a target
``model.norm.weight`` onto its own norm and ``model.layers.0.self_attn.q_proj.weight``
onto its midlayer (sglang/srt/models/llama_eagle3.py). Same shapes load silently.

So each loader first asks which model it was handed and does nothing on the other one,
whatever the selector did, and refuses names that belong to the other model. The engine sends the policy with ``load_target_weights`` and
the draft with ``load_draft_weights`` (and the matching selector as a second guard).

This module runs in SGLang's scheduler processes (the SGLang environment, with this folder
on the server's PYTHONPATH, so it is imported as a top-level module); it needs torch only.
"""

from __future__ import annotations

import torch

__all__ = ["TARGET_LOADER", "DRAFT_LOADER", "is_eagle3_draft", "load_target_weights", "load_draft_weights"]

TARGET_LOADER = "titan_spec_sglang_loaders.load_target_weights"
DRAFT_LOADER = "titan_spec_sglang_loaders.load_draft_weights"

# Draft export names (docs/ARCHITECTURE.md). "lm_head.weight" is also a target name: it is told
# apart by the model that receives it, not by its name.
_DRAFT_ONLY = ("fc.", "midlayer.", "layers.0.")
_DRAFT_ONLY_EXACT = ("norm.weight", "d2t", "t2d")
_DRAFT_NAMES_EXACT = ("fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d")


def is_eagle3_draft(model) -> bool:
    """SGLang's EAGLE-3 draft classes carry "Eagle3" in their name (LlamaForCausalLMEagle3,
    Eagle3DeepseekV2ForCausalLM in sglang/srt/models/), and so do the ``architectures`` of an
    EAGLE-3 draft's config.json; no target class does."""
    archs = getattr(getattr(model, "config", None), "architectures", None) or []
    return "Eagle3" in type(model).__name__ or any("Eagle3" in str(a) for a in archs)


def _is_draft_name(name: str) -> bool:
    return name.startswith(_DRAFT_ONLY) or name in _DRAFT_ONLY_EXACT


def load_target_weights(model, named_tensors) -> None:
    """Policy push: load HF target names into the target; do nothing at all on the draft
    model (its embedding is the target's tensor, so the target's update reaches it).

    A push that carries draft names is refused rather than filtered: ``lm_head.weight``
    is a name of both models, so once draft tensors are in the list the target's head
    cannot be told from the draft's, and a same-shaped wrong head would load silently.
    """
    if is_eagle3_draft(model):
        return
    pairs = list(named_tensors)
    draft_names = [n for n, _ in pairs if _is_draft_name(n)]
    if draft_names:
        raise ValueError(
            f"policy push carries draft names {draft_names[:4]}; push the draft separately "
            f"with load_format {DRAFT_LOADER!r}"
        )
    model.load_weights(pairs)


def load_draft_weights(model, named_tensors) -> None:
    """Draft push: load export names (fc.weight, midlayer.*, norm.weight, lm_head.weight)
    into the EAGLE-3 draft; do nothing on the target.

    ``d2t`` is checked, not loaded: SGLang's EAGLE worker copies the draft->target id map
    once at start (sglang/srt/speculative/eagle_worker_v2.py, ``init_lm_head``), so a push
    that changes it would be ignored while the new lm_head is used: refuse it instead.
    """
    if not is_eagle3_draft(model):
        return
    pairs = list(named_tensors)
    bad = [n for n, _ in pairs if not (n.startswith(_DRAFT_ONLY) or n in _DRAFT_NAMES_EXACT)]
    if bad:
        raise ValueError(
            f"draft push: {bad[:4]} are not EAGLE-3 draft export names (fc.weight, midlayer.*, norm.weight, lm_head.weight, d2t, t2d)"
        )
    hot = getattr(model, "hot_token_id", None)
    for name, t in pairs:
        if name == "d2t" and hot is not None:
            new = t.detach().cpu().long() + torch.arange(t.numel())
            if new.shape != hot.shape or not torch.equal(new, hot.detach().cpu().long()):
                raise ValueError(
                    "draft push: d2t differs from the one SGLang loaded at start; the draft "
                    "vocabulary is fixed for the server's lifetime (restart it to change it)"
                )
    model.load_weights([(n, t) for n, t in pairs if n not in ("d2t", "t2d")])
