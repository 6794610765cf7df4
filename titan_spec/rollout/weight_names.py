"""What the SGLang engine is fed: weight names, and the policy/draft pair it may serve.

SGLang loads HF names for the target (``Qwen3ForCausalLM`` / ``LlamaForCausalLM``
``load_weights`` in sglang/srt/models/qwen3.py, llama.py) and SpecForge export names for
the EAGLE-3 draft (``LlamaForCausalLMEagle3.load_weights`` in
sglang/srt/models/llama_eagle3.py maps ``midlayer.*`` -> ``layers.0.*`` and prefixes
``model.``). titan_spec's trainer holds torchtitan names for the policy (mapped with
torchtitan's own state-dict adapters, as the HF export does) and the export names for
the draft (``Eagle3Draft.state_dict()`` already uses them; docs/ARCHITECTURE.md, "Draft (EAGLE-3, SGLang/SpecForge layout)").

Every mapping is checked name by name: a name that does not map is an error, never a
silent drop, because a dropped weight would leave SGLang serving a stale tensor.
"""

from __future__ import annotations

import json
import os

import torch
from torch.distributed.tensor import DTensor

from titan_spec.config.draft_kinds import DRAFT_KINDS, tap_ids_problem
from titan_spec.models.draft.eagle3.io import EXPORT_KEYS, read_draft_arch
from titan_spec.models.hf_io import _adapter, check_no_routing_bias, read_hf_arch
from titan_spec.models.registry import Arch, build_target_config
from titan_spec.models.target import default_tap_layer_ids
from titan_spec.rollout.base import NamedTensors, named_tensor_items

__all__ = [
    "policy_to_hf_names",
    "draft_to_export_names",
    "check_draft_fits_policy",
    "sglang_tap_misfit",
    "served_tap_ids",
]


def _full(t: torch.Tensor) -> torch.Tensor:
    # FSDP-sharded parameters arrive as DTensors: gather (a collective on every rank).
    return t.full_tensor() if isinstance(t, DTensor) else t


def policy_to_hf_names(named_tensors: NamedTensors, arch: Arch) -> list[tuple[str, torch.Tensor]]:
    """torchtitan policy names -> the HF names SGLang's target model loads.

    Goes through torchtitan's state-dict adapter one name at a time, so every input
    name is accounted for (Llama's q/k permutation is per tensor, so this is exact).
    A tied ``lm_head.weight`` is dropped: with ``tie_word_embeddings`` SGLang's lm_head
    is the embedding and the adapter writes no lm_head either. A MoE layer's routing bias
    (models/moe.py) is dropped while it is 0 (HF's routing) and an error once it moved
    (SGLang's Qwen3-MoE has none).
    """
    adapter = _adapter(arch, build_target_config(arch))
    out: list[tuple[str, torch.Tensor]] = []
    unknown = []
    for name, tensor in named_tensor_items(named_tensors):
        hf = adapter.to_hf({name: _full(tensor)})
        if not hf:
            if name == "lm_head.weight" and arch.tie_embeddings:
                continue
            if name.endswith("moe.expert_bias_E"):  # MoE routing bias: HF has none; it must be 0
                check_no_routing_bias({name: tensor}, "the policy weights for SGLang")
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
    """Draft state dict -> the SpecForge/SGLang export names (the exact list: models/draft/eagle3/io.py EXPORT_KEYS).

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
    maps = {n: t for n, t in out if n in ("d2t", "t2d")}
    if len(maps) == 2 and bool(maps["t2d"].all()) and not bool(maps["d2t"].any()):
        # A full vocabulary's identity maps: the exporter omits them and neither server holds
        # them (models/draft/eagle3/io.py says why vLLM refuses a d2t there).
        out = [(n, t) for n, t in out if n not in maps]
    return out


def sglang_tap_misfit(taps, n_layers: int) -> str | None:
    """Why SGLang cannot feed these tap ids to the draft, or None.

    SGLang captures tap id k as the INPUT of decoder layer k + 1 (``layers_to_capture =
    [k + 1 for k in ids]`` in sglang/srt/models/qwen3.py and llama.py), so the last layer
    (id L - 1) has no later layer whose input would carry it: its aux state never arrives
    and ``fc`` sees two states instead of three. Valid ids are 0..L-2. The generic checks
    (EAGLE-3's three distinct ids) are titan_spec.config.draft_kinds.tap_ids_problem's.
    """
    taps = list(taps)
    why = tap_ids_problem(taps, count=DRAFT_KINDS["eagle3"])
    if why:
        return why
    bad = [i for i in taps if not 0 <= i < n_layers - 1]
    if bad:
        return (
            f"tap ids {taps} cannot be served by SGLang: it captures tap id k at the input of layer k+1, "
            f"so ids must be in 0..{n_layers - 2} for the {n_layers}-layer policy"
        )
    return None


def served_tap_ids(draft_config: dict, n_layers: int) -> tuple[int, ...]:
    """The tap ids SGLang 0.5.23 captures for a draft config.json: only
    ``eagle_config["eagle_aux_hidden_state_layer_ids"]``
    (model_executor/model_runner_components/spec_aux_hidden_state.py), else its default
    capture layers [2, L//2, L-3], i.e. tap ids (1, L//2 - 1, L - 4) (e.g. SpecForge's
    configs/qwen3-8b-eagle3.json, which has no eagle_config). A top-level
    ``eagle_aux_hidden_state_layer_ids`` only sizes the draft; it is never captured."""
    ids = (draft_config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return tuple(int(i) for i in ids) if ids else default_tap_layer_ids(n_layers)


def _draft_config(draft_path: str) -> dict:
    with open(os.path.join(draft_path, "config.json")) as f:
        return json.load(f)


def sglang_config_misfit(draft_config: dict, n_layers: int) -> str | None:
    """Why SGLang would not feed this draft the taps its config names, or None: a top-level
    id list other than the served one (the trainer and the built-in engine may read it,
    SGLang does not), or ``use_aux_hidden_state`` false (SGLang then captures nothing)."""
    eagle = draft_config.get("eagle_config") or {}
    if eagle.get("use_aux_hidden_state") is False or draft_config.get("use_aux_hidden_state") is False:
        return "use_aux_hidden_state = false: SGLang captures no aux hidden states for the EAGLE-3 draft"
    served, top = served_tap_ids(draft_config, n_layers), draft_config.get("eagle_aux_hidden_state_layer_ids")
    if top and tuple(int(i) for i in top) != served:
        return (
            f"top-level eagle_aux_hidden_state_layer_ids {[int(i) for i in top]} is not what SGLang serves: "
            f"SGLang serves {list(served)} (eagle_config's ids, else its default)"
        )
    return None


def check_draft_fits_policy(policy_path: str, draft_path: str) -> None:
    """Raise ValueError (one line) unless SGLang can serve this draft with this policy.

    SGLang's EAGLE-3 draft reads the target's embedding (so its hidden size is the
    target's), maps its vocabulary through d2t into the target's, and takes three
    tapped layers of the target, which it must be able to capture (``sglang_tap_misfit``).
    """
    if not os.path.isdir(draft_path):
        raise ValueError(
            f"draft directory {draft_path!r} does not exist; export one with save_draft or --draft.export_dir"
        )
    policy = read_hf_arch(policy_path)
    draft = read_draft_arch(draft_path)
    if not os.path.isfile(os.path.join(draft_path, "model.safetensors")):
        raise ValueError(f"draft directory {draft_path!r} has no model.safetensors")
    bad = draft.misfits(policy.vocab_size, policy.dim)
    if draft.draft_vocab_size > policy.vocab_size:
        bad.append(f"draft_vocab_size {draft.draft_vocab_size} > policy vocab {policy.vocab_size}")
    draft_config = _draft_config(draft_path)
    for why in (
        sglang_config_misfit(draft_config, policy.n_layers),
        sglang_tap_misfit(served_tap_ids(draft_config, policy.n_layers), policy.n_layers),
    ):
        if why:
            bad.append(why)
    if bad:
        raise ValueError(f"draft directory {draft_path} does not fit the policy {policy_path}: {'; '.join(bad)}")
