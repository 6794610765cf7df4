"""Draft export/import in the format SGLang's ``LlamaForCausalLMEagle3`` and SpecForge use.

A draft directory holds ``config.json`` (a Llama config with ``architectures =
["LlamaForCausalLMEagle3"]``, ``draft_vocab_size``, ``target_hidden_size`` and the tap
ids both under ``eagle_config.eagle_aux_hidden_state_layer_ids`` (SGLang) and top-level
(vLLM)) and ``model.safetensors`` with exactly ``fc.weight``, ``midlayer.*``,
``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d``. SGLang loads the embedding from the
target, so none is written. Writes are atomic (temporary directory, then rename).
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file

from titan_spec.models.draft.eagle3.model import DraftArch, Eagle3Draft
from titan_spec.models.hf_io import read_safetensors_header, write_safetensors_dir

__all__ = [
    "EXPORT_KEYS", "draft_config_json", "save_draft", "read_draft_arch", "load_draft_into", "draft_mismatches",
    "check_draft_weights",
]

EXPORT_KEYS = (
    "fc.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
)


def draft_config_json(a: DraftArch, dtype: torch.dtype = torch.float32) -> dict:
    ids = list(a.tap_layer_ids)
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": a.hidden,
        "intermediate_size": a.intermediate,
        "num_attention_heads": a.n_heads,
        "num_key_value_heads": a.n_kv_heads,
        "head_dim": a.head_dim,
        "num_hidden_layers": 1,
        "vocab_size": a.vocab_size,
        "draft_vocab_size": a.draft_vocab_size,
        "target_hidden_size": a.target_hidden,
        "rms_norm_eps": a.norm_eps,
        "rope_theta": a.rope_theta,
        "max_position_embeddings": a.max_seq_len,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
        "eagle_aux_hidden_state_layer_ids": ids,
    }


def save_draft(draft: Eagle3Draft, path: str, dtype: torch.dtype = torch.float32) -> None:
    sd = draft.state_dict()
    tensors = {
        k: (sd[k].to(dtype) if sd[k].is_floating_point() else sd[k]).detach().cpu().contiguous() for k in EXPORT_KEYS
    }
    write_safetensors_dir(path, tensors, draft_config_json(draft.arch, dtype))


def read_draft_arch(path: str) -> DraftArch:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"draft directory {path!r} has no config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    if "LlamaForCausalLMEagle3" not in cfg.get("architectures", []):
        raise ValueError(f"{cfg_path}: architectures {cfg.get('architectures')} is not LlamaForCausalLMEagle3")
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or cfg.get(
        "eagle_aux_hidden_state_layer_ids"
    )
    try:
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        return DraftArch(
            hidden=hidden, n_heads=heads, n_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads), intermediate=int(cfg["intermediate_size"]),
            target_hidden=int(cfg.get("target_hidden_size") or hidden), vocab_size=int(cfg["vocab_size"]),
            draft_vocab_size=int(cfg.get("draft_vocab_size") or cfg["vocab_size"]),
            rope_theta=float(cfg.get("rope_theta", 10000.0)), norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_seq_len=int(cfg.get("max_position_embeddings", 2048)),
            tap_layer_ids=tuple(int(i) for i in ids) if ids else (),
        )
    except KeyError as e:
        raise ValueError(f"{cfg_path}: missing field {e.args[0]!r}") from None


def draft_mismatches(found: DraftArch, want: DraftArch) -> list[str]:
    """Why a draft directory of architecture ``found`` cannot initialize the draft ``want``
    (built for the target and the config): [] = it fits."""
    checks = ["target_hidden", "hidden", "vocab_size", "draft_vocab_size", "n_heads", "n_kv_heads", "head_dim", "intermediate"]
    bad = [f"{k}: directory {getattr(found, k)} vs target/config {getattr(want, k)}" for k in checks if getattr(found, k) != getattr(want, k)]
    if found.tap_layer_ids and tuple(found.tap_layer_ids) != tuple(want.tap_layer_ids):
        bad.append(f"tap ids: directory {list(found.tap_layer_ids)} vs config {list(want.tap_layer_ids)}")
    return bad


def _weights_file(path: str) -> str:
    file = os.path.join(path, "model.safetensors")
    if not os.path.isfile(file):
        raise ValueError(f"draft directory {path!r} has no model.safetensors")
    return file


def _check_names(path: str, names) -> None:
    # Some SpecForge checkpoints carry the (frozen) embedding; it is the target's, dropped.
    names = {k for k in names if not k.endswith("embed_tokens.weight")}
    missing, unexpected = sorted(set(EXPORT_KEYS) - names), sorted(names - set(EXPORT_KEYS))
    if missing or unexpected:
        raise ValueError(f"draft directory {path}: missing {missing}, unexpected {unexpected}")


def check_draft_weights(path: str, arch: DraftArch) -> None:
    """The draft directory's model.safetensors holds exactly the export tensors of ``arch``
    with their shapes (header only, no data read; a corrupt or truncated file is named)."""
    found = read_safetensors_header(_weights_file(path))
    _check_names(path, found)
    with torch.device("meta"):
        want = {k: tuple(v.shape) for k, v in Eagle3Draft(arch).state_dict().items()}
    bad = [f"{k} {list(found[k][1])} (needs {list(want[k])})" for k in EXPORT_KEYS if found[k][1] != want[k]]
    if bad:
        raise ValueError(f"draft directory {path}: tensor shapes do not match its config.json and the target: "
                         f"{'; '.join(bad[:3])}{'; ...' if len(bad) > 3 else ''}")


def load_draft_into(draft: Eagle3Draft, path: str) -> None:
    """Initialize ``draft`` from a SpecForge/SGLang draft directory, after checking that it
    fits the target the draft was built for (hidden sizes, vocabularies, heads, tap ids)."""
    found = read_draft_arch(path)
    bad = draft_mismatches(found, draft.arch)
    if bad:
        raise ValueError(f"draft directory {path} does not match the target: {'; '.join(bad)}")
    sd = load_file(_weights_file(path))
    sd = {k: v for k, v in sd.items() if not k.endswith("embed_tokens.weight")}
    _check_names(path, sd)
    own = draft.state_dict()
    with torch.no_grad():
        for k in EXPORT_KEYS:
            own[k].copy_(sd[k].to(own[k].dtype))
