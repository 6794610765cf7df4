"""Draft export/import in the format SGLang's ``LlamaForCausalLMEagle3`` and SpecForge use.

A draft directory holds ``config.json`` (a Llama config with ``architectures =
["LlamaForCausalLMEagle3"]``, ``draft_vocab_size``, ``target_hidden_size`` and the tap
ids both under ``eagle_config.eagle_aux_hidden_state_layer_ids`` (SGLang) and top-level
(vLLM)) and ``model.safetensors`` with exactly ``fc.weight``, ``midlayer.*``,
``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d``. SGLang loads the embedding from the
target, so none is written. Writes are atomic (temporary directory, then rename).

The top-level id list is NOT what vLLM should read as is: vLLM takes id j as the input of
layer j (SGLang adds the 1 to eagle_config's ids itself), so tap id k is vLLM's k + 1;
titan_spec's vLLM engine starts vLLM from a copy of the config with k + 1
(rollout/vllm/serving.py ``served_draft_dir``).

A full-vocabulary draft (draft_vocab_size == vocab_size) is written WITHOUT ``d2t`` and
``t2d``: its maps are the identity and carry nothing, and vLLM refuses a d2t there (its
EAGLE-3 draft has a ``draft_id_to_target_id`` parameter only when the vocabularies differ,
vllm/model_executor/models/llama_eagle3.py: "There is no module or parameter named
'draft_id_to_target_id'"). SGLang's LlamaForCausalLMEagle3.load_weights reads d2t only when
present (``hot_token_id`` stays None: the draft's ids are the target's). Loading such a
directory restores the identity maps.
"""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from titan_spec.models.draft.directory import check_vocab_maps, config_field, is_int, read_config_json, weights_file
from titan_spec.models.draft.eagle3.model import DraftArch, Eagle3Draft
from titan_spec.models.hf_io import write_safetensors_dir
from titan_spec.models.safetensors_header import read_safetensors_header

__all__ = [
    "EXPORT_KEYS",
    "VOCAB_MAP_KEYS",
    "export_keys",
    "draft_config_json",
    "save_draft",
    "read_draft_arch",
    "load_draft_into",
    "draft_mismatches",
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

VOCAB_MAP_KEYS = ("d2t", "t2d")


def export_keys(a: DraftArch) -> tuple[str, ...]:
    """The tensors a draft directory of architecture ``a`` holds: EXPORT_KEYS, less the
    vocabulary maps for a full-vocabulary draft (module docstring)."""
    if a.draft_vocab_size == a.vocab_size:
        return tuple(k for k in EXPORT_KEYS if k not in VOCAB_MAP_KEYS)
    return EXPORT_KEYS


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
    keys = export_keys(draft.arch)
    if keys != EXPORT_KEYS and (sd["d2t"].any() or not sd["t2d"].all()):
        raise ValueError(
            "a full-vocabulary draft must map every id to itself (d2t all 0, t2d all true) to be exported "
            "without its maps; this one permutes the vocabulary"
        )
    tensors = {k: (sd[k].to(dtype) if sd[k].is_floating_point() else sd[k]).detach().cpu().contiguous() for k in keys}
    write_safetensors_dir(path, tensors, draft_config_json(draft.arch, dtype))


def read_draft_arch(path: str) -> DraftArch:
    cfg_path, cfg = read_config_json(path, "LlamaForCausalLMEagle3", "eagle3")
    eagle = cfg.get("eagle_config") or {}
    ids_field = "eagle_config.eagle_aux_hidden_state_layer_ids"
    ids = eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, dict) else None
    if not ids:
        ids_field, ids = "eagle_aux_hidden_state_layer_ids", cfg.get("eagle_aux_hidden_state_layer_ids")
    if ids and not (isinstance(ids, list) and all(is_int(i) and i >= 0 for i in ids)):
        raise ValueError(
            f"{cfg_path}: {ids_field} = {json.dumps(ids)} is not allowed; it must be a list of layer ids "
            "(integers >= 0)"
        )
    hidden, heads = config_field(cfg_path, cfg, "hidden_size"), config_field(cfg_path, cfg, "num_attention_heads")
    vocab = config_field(cfg_path, cfg, "vocab_size")
    return DraftArch(
        hidden=hidden,
        n_heads=heads,
        n_kv_heads=config_field(cfg_path, cfg, "num_key_value_heads", heads),
        head_dim=config_field(cfg_path, cfg, "head_dim", hidden // heads),
        intermediate=config_field(cfg_path, cfg, "intermediate_size"),
        target_hidden=config_field(cfg_path, cfg, "target_hidden_size", hidden),
        vocab_size=vocab,
        draft_vocab_size=config_field(cfg_path, cfg, "draft_vocab_size", vocab),
        rope_theta=config_field(cfg_path, cfg, "rope_theta", 10000.0, float),
        norm_eps=config_field(cfg_path, cfg, "rms_norm_eps", 1e-6, float),
        max_seq_len=config_field(cfg_path, cfg, "max_position_embeddings", 2048),
        tap_layer_ids=tuple(ids) if ids else (),
    )


def draft_mismatches(found: DraftArch, want: DraftArch) -> list[str]:
    """Why a draft directory of architecture ``found`` cannot initialize the draft ``want``
    (built for the target and the config): [] = it fits."""
    checks = [
        "target_hidden",
        "hidden",
        "vocab_size",
        "draft_vocab_size",
        "n_heads",
        "n_kv_heads",
        "head_dim",
        "intermediate",
    ]
    bad = [
        f"{k}: directory {getattr(found, k)} vs target/config {getattr(want, k)}"
        for k in checks
        if getattr(found, k) != getattr(want, k)
    ]
    if found.tap_layer_ids and tuple(found.tap_layer_ids) != tuple(want.tap_layer_ids):
        bad.append(f"tap ids: directory {list(found.tap_layer_ids)} vs config {list(want.tap_layer_ids)}")
    return bad


def _check_names(path: str, names, full_vocab: bool = False) -> None:
    # Some SpecForge checkpoints carry the (frozen) embedding; it is the target's, dropped.
    # A full-vocabulary draft may omit its (identity) vocabulary maps (module docstring).
    names = {k for k in names if not k.endswith("embed_tokens.weight")}
    optional = set(VOCAB_MAP_KEYS) if full_vocab else set()
    missing, unexpected = sorted(set(EXPORT_KEYS) - names - optional), sorted(names - set(EXPORT_KEYS))
    if missing or unexpected:
        raise ValueError(f"draft directory {path}: missing {missing}, unexpected {unexpected}")


def check_draft_weights(path: str, arch: DraftArch) -> None:
    """The draft directory's model.safetensors holds exactly the export tensors of ``arch``
    with their shapes (header only, no data read; a corrupt or truncated file is named)."""
    found = read_safetensors_header(weights_file(path))
    _check_names(path, found, arch.draft_vocab_size == arch.vocab_size)
    with torch.device("meta"):
        want = {k: tuple(v.shape) for k, v in Eagle3Draft(arch).state_dict().items()}
    bad = [
        f"{k} {list(found[k][1])} (needs {list(want[k])})" for k in EXPORT_KEYS if k in found and found[k][1] != want[k]
    ]
    if bad:
        raise ValueError(
            f"draft directory {path}: tensor shapes do not match its config.json and the target: "
            f"{'; '.join(bad[:3])}{'; ...' if len(bad) > 3 else ''}"
        )
    if "d2t" in found:
        check_vocab_maps(weights_file(path), arch)


def load_draft_into(draft: Eagle3Draft, path: str) -> None:
    """Initialize ``draft`` from a SpecForge/SGLang draft directory, after checking that it
    fits the target the draft was built for (hidden sizes, vocabularies, heads, tap ids)."""
    found = read_draft_arch(path)
    bad = draft_mismatches(found, draft.arch)
    if bad:
        raise ValueError(f"draft directory {path} does not match the target: {'; '.join(bad)}")
    sd = load_file(weights_file(path))
    sd = {k: v for k, v in sd.items() if not k.endswith("embed_tokens.weight")}
    full_vocab = draft.arch.draft_vocab_size == draft.arch.vocab_size
    _check_names(path, sd, full_vocab)
    if full_vocab:  # maps omitted by the exporter: the identity
        sd.setdefault("d2t", torch.zeros(draft.arch.draft_vocab_size, dtype=torch.long))
        sd.setdefault("t2d", torch.ones(draft.arch.vocab_size, dtype=torch.bool))
    own = draft.state_dict()
    with torch.no_grad():
        for k in EXPORT_KEYS:
            own[k].copy_(sd[k].to(own[k].dtype))
