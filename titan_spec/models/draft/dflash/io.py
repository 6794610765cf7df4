"""DFlash draft export/import in the layout vLLM 0.32 loads (``speculative_config = {"method":
"dflash", "model": DIR}``; vllm/model_executor/models/qwen3_dflash.py ``DFlashQwen3ForCausalLM``).

A draft directory holds:
  - ``config.json``: a Qwen3 config with ``architectures = ["DFlashDraftModel"]``,
    ``num_hidden_layers`` = the draft's layers, ``block_size``, ``draft_vocab_size``,
    ``target_hidden_size`` and ``dflash_config = {"mask_token_id", "target_layer_ids"}``.
    ``target_layer_ids`` are titan_spec's tap ids as they are (the output of layer k):
    vLLM adds the 1 itself (vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py).
  - ``model.safetensors``: ``fc.weight``, ``hidden_norm.weight``, ``layers.N.*`` (Qwen3 names,
    q/k norms), ``norm.weight``, ``lm_head.weight`` (the draft's own: vLLM then does not share
    the target's), and ``d2t`` / ``t2d`` only for a reduced draft vocabulary (vLLM maps d2t to
    ``draft_id_to_target_id`` and skips t2d; a full-vocabulary draft has no such parameter).
  - ``mask_embedding.pt``: ``{"mask_token_id": id, "embedding": [H]}``, the trained embedding
    of a masked position, which vLLM substitutes for embed_tokens[mask_token_id]
    (``DFlashQwen3ForCausalLM._read_mask_embedding``).
No embedding is written: the known token is embedded by the target. Writes are atomic.

A directory SpecForge writes has neither ``lm_head.weight`` nor ``mask_embedding.pt``: SpecForge
trains with the target's frozen lm_head and the target's embedding row of mask_token_id, and
vLLM serves it so (it shares the target's head and embeds a masked position by that row).
Loading one fills either missing piece from the policy's HF checkpoint in the same way
(``load_dflash_into(..., target_dir)``); the draft then trains its own copies from there.
"""

from __future__ import annotations

import dataclasses
import json
import os

import torch
from safetensors.torch import load_file

from titan_spec.models.draft.dflash.model import DFlashArch, DFlashDraft
from titan_spec.models.draft.directory import check_vocab_maps, config_field, is_int, read_config_json, weights_file
from titan_spec.models.hf_io import read_hf_head, write_safetensors_dir
from titan_spec.models.safetensors_header import read_safetensors_header

__all__ = [
    "MASK_FILE",
    "check_dflash_weights",
    "dflash_config_json",
    "dflash_mismatches",
    "export_keys",
    "load_dflash_into",
    "read_dflash_arch",
    "save_dflash",
    "shares_target_head",
]

ARCHITECTURE = DFlashArch.architecture
MASK_FILE = "mask_embedding.pt"
VOCAB_MAP_KEYS = ("d2t", "t2d")


def export_keys(a: DFlashArch) -> tuple[str, ...]:
    """The tensors of model.safetensors for architecture ``a`` (the mask embedding has its own file)."""
    layer = (
        "input_layernorm.weight",
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "self_attn.q_norm.weight",
        "self_attn.k_norm.weight",
        "post_attention_layernorm.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
    )
    keys = (
        "fc.weight",
        "hidden_norm.weight",
        *(f"layers.{i}.{k}" for i in range(a.n_layers) for k in layer),
        "norm.weight",
        "lm_head.weight",
        *a.head_keys(),
    )
    return keys if a.draft_vocab_size == a.vocab_size else keys + VOCAB_MAP_KEYS


def dflash_config_json(a: DFlashArch, dtype: torch.dtype = torch.float32) -> dict:
    return {
        "architectures": [a.architecture],
        "model_type": "qwen3",
        "hidden_size": a.hidden,
        "intermediate_size": a.intermediate,
        "num_attention_heads": a.n_heads,
        "num_key_value_heads": a.n_kv_heads,
        "head_dim": a.head_dim,
        "num_hidden_layers": a.n_layers,
        "vocab_size": a.vocab_size,
        "draft_vocab_size": a.draft_vocab_size,
        "target_hidden_size": a.target_hidden,
        "rms_norm_eps": a.norm_eps,
        "rope_theta": a.rope_theta,
        "max_position_embeddings": a.max_seq_len,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "block_size": a.block_size,
        "dflash_config": {"mask_token_id": a.mask_token_id, "target_layer_ids": list(a.tap_layer_ids)},
        **a.config_extra(),
    }


def save_dflash(draft: DFlashDraft, path: str, dtype: torch.dtype = torch.float32) -> None:
    sd, a = draft.state_dict(), draft.arch
    keys = export_keys(a)
    if "d2t" not in keys and (sd["d2t"].any() or not sd["t2d"].all()):
        raise ValueError(
            "a full-vocabulary draft must map every id to itself (d2t all 0, t2d all true) to be exported "
            "without its maps; this one permutes the vocabulary"
        )
    tensors = {k: (sd[k].to(dtype) if sd[k].is_floating_point() else sd[k]).detach().cpu().contiguous() for k in keys}
    mask = {"mask_token_id": a.mask_token_id, "embedding": sd["mask_embedding"].detach().to(dtype).cpu().clone()}
    write_safetensors_dir(
        path, tensors, dflash_config_json(a, dtype), extra=lambda tmp: torch.save(mask, os.path.join(tmp, MASK_FILE))
    )


def read_dflash_arch(path: str, arch_cls: type[DFlashArch] = DFlashArch):
    cfg_path, cfg = read_config_json(path, arch_cls.architecture, arch_cls.kind)
    dc = cfg.get("dflash_config")
    if not isinstance(dc, dict):
        raise ValueError(
            f"{cfg_path}: dflash_config is {json.dumps(dc)}; it must be an object with mask_token_id "
            "and target_layer_ids"
        )
    ids = dc.get("target_layer_ids")
    if not (isinstance(ids, list) and ids and all(is_int(i) and i >= 0 for i in ids)):
        raise ValueError(
            f"{cfg_path}: dflash_config.target_layer_ids = {json.dumps(ids)} is not allowed; it must be a "
            "non-empty list of layer ids (integers >= 0)"
        )
    mask_id = dc.get("mask_token_id")
    if not (is_int(mask_id) and mask_id >= 0):
        raise ValueError(
            f"{cfg_path}: dflash_config.mask_token_id = {json.dumps(mask_id)} is not allowed; it must be "
            "a token id (an integer >= 0)"
        )
    hidden, heads = config_field(cfg_path, cfg, "hidden_size"), config_field(cfg_path, cfg, "num_attention_heads")
    vocab = config_field(cfg_path, cfg, "vocab_size")
    return arch_cls(
        **arch_cls.extra_from_config(cfg_path, cfg),
        hidden=hidden,
        n_heads=heads,
        n_kv_heads=config_field(cfg_path, cfg, "num_key_value_heads", heads),
        head_dim=config_field(cfg_path, cfg, "head_dim", hidden // heads),
        intermediate=config_field(cfg_path, cfg, "intermediate_size"),
        n_layers=config_field(cfg_path, cfg, "num_hidden_layers"),
        target_hidden=config_field(cfg_path, cfg, "target_hidden_size", hidden),
        vocab_size=vocab,
        draft_vocab_size=config_field(cfg_path, cfg, "draft_vocab_size", vocab),
        rope_theta=config_field(cfg_path, cfg, "rope_theta", 1e6, float),
        norm_eps=config_field(cfg_path, cfg, "rms_norm_eps", 1e-6, float),
        max_seq_len=config_field(cfg_path, cfg, "max_position_embeddings", 2048),
        tap_layer_ids=tuple(ids),
        block_size=config_field(cfg_path, cfg, "block_size"),
        mask_token_id=mask_id,
    )


def dflash_mismatches(found: DFlashArch, want: DFlashArch) -> list[str]:
    """Why a directory of architecture ``found`` cannot initialize the draft ``want`` ([] = it fits)."""
    checks = [
        "target_hidden",
        "hidden",
        "vocab_size",
        "draft_vocab_size",
        "n_heads",
        "n_kv_heads",
        "head_dim",
        "intermediate",
        "n_layers",
        "block_size",
        "mask_token_id",
    ]
    checks += [
        f.name for f in dataclasses.fields(want) if f.name not in {g.name for g in dataclasses.fields(DFlashArch)}
    ]
    names = {
        "n_layers": "layers (draft.dflash.num_layers)",
        "block_size": "block_size (draft.dflash.block_size)",
        "mask_token_id": "mask_token_id (draft.dflash.mask_token_id)",
    }
    bad = [
        f"{names.get(k, k)}: directory {getattr(found, k)} vs target/config {getattr(want, k)}"
        for k in checks
        if getattr(found, k) != getattr(want, k)
    ]
    if tuple(found.tap_layer_ids) != tuple(want.tap_layer_ids):
        bad.append(f"tap ids: directory {list(found.tap_layer_ids)} vs config {list(want.tap_layer_ids)}")
    return bad


def _check_names(path: str, names, arch: DFlashArch) -> None:
    names = {k for k in names if not k.endswith("embed_tokens.weight")}  # the target's, if a checkpoint carries it
    want = set(export_keys(arch))
    missing, unexpected = sorted(want - names), sorted(names - want - set(VOCAB_MAP_KEYS))
    if missing == ["lm_head.weight"] and arch.draft_vocab_size == arch.vocab_size:
        missing = []  # SpecForge's layout: the target's head (module docstring)
    if missing or unexpected:
        raise ValueError(f"draft directory {path}: missing {missing[:4]}, unexpected {unexpected[:4]}")


def shares_target_head(path: str) -> bool:
    """The directory lacks lm_head.weight or mask_embedding.pt (SpecForge's layout): loading it
    needs the target's head or embedding."""
    names = read_safetensors_header(weights_file(path))
    return "lm_head.weight" not in names or not os.path.isfile(os.path.join(path, MASK_FILE))


def check_dflash_weights(path: str, arch: DFlashArch, draft_cls: type[DFlashDraft] = DFlashDraft) -> None:
    """Names and shapes of model.safetensors (header only) and the mask embedding file."""
    found = read_safetensors_header(weights_file(path))
    _check_names(path, found, arch)
    with torch.device("meta"):
        want = {k: tuple(v.shape) for k, v in draft_cls(arch).state_dict().items()}
    bad = [
        f"{k} {list(found[k][1])} (needs {list(want[k])})"
        for k in export_keys(arch)
        if k in found and found[k][1] != want[k]
    ]
    if bad:
        raise ValueError(
            f"draft directory {path}: tensor shapes do not match its config.json and the target: "
            f"{'; '.join(bad[:3])}{'; ...' if len(bad) > 3 else ''}"
        )
    if "d2t" in found:
        check_vocab_maps(weights_file(path), arch)
    if os.path.isfile(os.path.join(path, MASK_FILE)):
        _mask_embedding(path, arch)


def _mask_embedding(path: str, arch: DFlashArch) -> torch.Tensor:
    file = os.path.join(path, MASK_FILE)
    try:
        state = torch.load(file, weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is the same one line
        raise ValueError(f"{file}: not a readable torch file: {type(e).__name__}") from None
    emb = state.get("embedding") if isinstance(state, dict) else state
    if not isinstance(emb, torch.Tensor) or emb.numel() != arch.hidden:
        raise ValueError(f"{file}: the embedding must be a tensor of {arch.hidden} values (hidden_size)")
    if isinstance(state, dict) and state.get("mask_token_id", arch.mask_token_id) != arch.mask_token_id:
        raise ValueError(
            f"{file}: mask_token_id {state.get('mask_token_id')} != dflash_config.mask_token_id {arch.mask_token_id}"
        )
    return emb.reshape(-1)


def load_dflash_into(draft: DFlashDraft, path: str, target_dir: str | None = None) -> None:
    """Initialize ``draft`` from a DFlash directory after checking that it fits the draft built
    for the target and the config. A missing lm_head or mask embedding (SpecForge's layout) is
    the target's, read from its HF checkpoint ``target_dir``."""
    bad = dflash_mismatches(read_dflash_arch(path, type(draft.arch)), draft.arch)
    if bad:
        raise ValueError(f"draft directory {path} does not match the target: {'; '.join(bad)}")
    sd = {k: v for k, v in load_file(weights_file(path)).items() if not k.endswith("embed_tokens.weight")}
    _check_names(path, sd, draft.arch)
    if "d2t" not in sd:  # a full-vocabulary draft: the identity maps
        sd["d2t"] = torch.zeros(draft.arch.draft_vocab_size, dtype=torch.long)
        sd["t2d"] = torch.ones(draft.arch.vocab_size, dtype=torch.bool)
    has_mask = os.path.isfile(os.path.join(path, MASK_FILE))
    if "lm_head.weight" not in sd or not has_mask:
        if not target_dir:
            raise ValueError(
                f"draft directory {path} has no lm_head.weight or no {MASK_FILE} (SpecForge's layout): it shares "
                "the target's, so loading it needs the policy's HF directory (model.hf_checkpoint)"
            )
        head_VD, embed_VD = read_hf_head(target_dir)
        sd.setdefault("lm_head.weight", head_VD)
        if not has_mask:
            sd["mask_embedding"] = embed_VD[draft.arch.mask_token_id]
    if has_mask:
        sd["mask_embedding"] = _mask_embedding(path, draft.arch)
    own = draft.state_dict()
    bad = [f"{k} {list(sd[k].shape)} (needs {list(v.shape)})" for k, v in own.items() if sd[k].shape != v.shape]
    if bad:
        raise ValueError(f"draft directory {path} (with the target's head from {target_dir}): {'; '.join(bad[:3])}")
    with torch.no_grad():
        for k, v in own.items():
            v.copy_(sd[k].to(v.dtype))
