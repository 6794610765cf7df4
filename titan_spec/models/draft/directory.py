"""What every draft kind's directory reader shares: its config.json, read with one-line errors,
its fields checked by name, its weights file and its vocabulary map (d2t).

A kind's directory reader (models/draft/<kind>/io.py) names its architecture; a directory of
another kind is then one line naming the kind it is, so a DFlash directory given to
``draft.kind = "eagle3"`` (or the reverse) says which ``draft.kind`` it needs.
"""

from __future__ import annotations

import json
import math
import os

import torch

from titan_spec.models.safetensors_header import read_tensor

__all__ = [
    "KIND_OF_ARCHITECTURE",
    "check_vocab_maps",
    "config_field",
    "is_int",
    "kind_of_directory",
    "read_config_json",
    "weights_file",
]

KIND_OF_ARCHITECTURE = {
    "LlamaForCausalLMEagle3": "eagle3",
    "DFlashDraftModel": "dflash",
    "Qwen3DSparkModel": "dspark",
}
"""config.json ``architectures`` -> the draft.kind that reads it."""

_NAMES = {"eagle3": "an EAGLE-3", "dflash": "a DFlash", "dspark": "a DSpark"}


def kind_of_directory(path: str, default: str = "eagle3") -> str:
    """The draft.kind whose directory ``path`` is, by its config.json's ``architectures``;
    ``default`` when it names none of them or cannot be read (its kind's reader then says why)."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            archs = json.load(f).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return default
    return next((KIND_OF_ARCHITECTURE[a] for a in archs if a in KIND_OF_ARCHITECTURE), default)


def read_config_json(path: str, architecture: str, kind: str) -> tuple[str, dict]:
    """(config.json's path, its fields) of a draft directory whose ``architectures`` names
    ``architecture`` (the kind ``kind`` reads); ValueError (one line) otherwise."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"draft directory {path!r} has no config.json")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_path}: not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{cfg_path}: not a JSON object of config fields")
    archs = cfg.get("architectures") or []
    if architecture not in archs:
        other = next((KIND_OF_ARCHITECTURE[a] for a in archs if a in KIND_OF_ARCHITECTURE), None)
        hint = (
            f" (it is {_NAMES[other]} draft: set draft.kind = {other!r}, or give {_NAMES[kind]} draft directory)"
            if other
            else f" (draft.kind = {kind!r} reads {architecture} directories)"
        )
        raise ValueError(f"{cfg_path}: architectures {archs} is not {architecture}{hint}")
    return cfg_path, cfg


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # JSON true is not a size


def config_field(cfg_path: str, cfg: dict, name: str, default=None, kind=int):
    """config.json's ``name``, a positive integer (``kind`` float: a positive finite number):
    one line naming the file and the field otherwise. ``default`` stands in for a field that is
    absent or null (HF writes null for 'derive it'); without one, the field is required."""
    value = cfg.get(name)
    if value is None:
        if default is None:
            what = "missing" if name not in cfg else "null"
            raise ValueError(
                f"{cfg_path}: field {name!r} is {what}; it must be a positive {'integer' if kind is int else 'number'}"
            )
        return default
    ok = (
        is_int(value)
        if kind is int
        else (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value))
    )
    if not ok or value <= 0:
        raise ValueError(
            f"{cfg_path}: {name} = {json.dumps(value)} is not allowed; it must be a positive "
            f"{'integer' if kind is int else 'number'}"
        )
    return kind(value)


def weights_file(path: str) -> str:
    file = os.path.join(path, "model.safetensors")
    if not os.path.isfile(file):
        raise ValueError(f"draft directory {path!r} has no model.safetensors")
    return file


def check_vocab_maps(file: str, arch) -> None:
    """d2t maps each draft id i to the target id i + d2t[i]: those ids must be distinct ids of
    the target vocabulary (the engines index the target's logits with them; the built-in
    engine refuses such a draft only when it starts). Only d2t is read (a few KB)."""
    d2t = read_tensor(file, "d2t")
    if d2t.is_floating_point() or d2t.dtype == torch.bool:
        raise ValueError(f"{file}: d2t has dtype {d2t.dtype}; it must hold integer id offsets")
    ids = torch.arange(d2t.numel()) + d2t.to(torch.long)
    outside = ((ids < 0) | (ids >= arch.vocab_size)).nonzero().flatten()
    if outside.numel():
        i = int(outside[0])
        raise ValueError(
            f"{file}: d2t maps {outside.numel()} draft id(s) outside the target vocabulary "
            f"0..{arch.vocab_size - 1} (first: draft id {i} -> {int(ids[i])}); target id = i + d2t[i] "
            "must be a target id"
        )
    if ids.unique().numel() != ids.numel():
        values, counts = ids.unique(return_counts=True)
        repeated = values[counts > 1]
        raise ValueError(
            f"{file}: d2t maps several draft ids onto the same target id ({repeated.numel()} repeated, "
            f"first: {int(repeated[0])}); each draft id must have its own target id"
        )
