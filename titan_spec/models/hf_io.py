"""HF checkpoint import/export for the target, through torchtitan's state-dict adapters.

A checkpoint directory is ``config.json`` plus ``model.safetensors`` or shards named
by ``model.safetensors.index.json``. Reading checks the files and the architecture
before touching the model; writing goes to a temporary directory that is renamed
into place, so an interrupted export never leaves a half-written checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor

from titan_spec.platform import load_full_state_dict
from titan_spec.models.moe import expert_biases
from titan_spec.models.registry import Arch, arch_from_hf_config, arch_to_hf_config, build_target_config
from titan_spec.models.safetensors_header import HFCheckpointError, read_safetensors_header, read_tensor

__all__ = [
    "read_hf_arch",
    "read_hf_state_dict",
    "load_hf_into",
    "save_hf",
    "write_safetensors_dir",
    "HFCheckpointError",
    "check_hf_weights",
    "expected_hf_shapes",
    "check_no_routing_bias",
]

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


def read_hf_arch(path: str) -> Arch:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        raise HFCheckpointError(f"HF checkpoint {path!r} is not a directory")
    if not os.path.isfile(cfg_path):
        raise HFCheckpointError(f"HF checkpoint {path!r} has no config.json")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except json.JSONDecodeError as e:
        raise HFCheckpointError(f"{cfg_path}: not valid JSON ({e})") from None
    try:
        return arch_from_hf_config(cfg, where=cfg_path)
    except ValueError as e:
        raise HFCheckpointError(str(e)) from None


def _weight_files(path: str) -> list[str]:
    index = os.path.join(path, _INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        missing = [n for n in names if not os.path.isfile(os.path.join(path, n))]
        if missing:
            raise HFCheckpointError(f"{path}: {_INDEX} names missing shard(s): {', '.join(missing)}")
        return [os.path.join(path, n) for n in names]
    single = os.path.join(path, _SINGLE)
    if os.path.isfile(single):
        return [single]
    raise HFCheckpointError(f"{path}: no {_SINGLE} and no {_INDEX}; only safetensors checkpoints are read")


def expected_hf_shapes(arch: Arch) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor a checkpoint of ``arch`` holds: the module tree the
    trainer builds (on the meta device, nothing allocated) through torchtitan's adapter,
    i.e. exactly the names and shapes ``load_hf_into`` will need."""
    model_config = build_target_config(arch)
    with torch.device("meta"):
        model = model_config.build()
    hf = _adapter(arch, model_config).to_hf(model.state_dict())
    return {k: tuple(v.shape) for k, v in hf.items()}


def check_hf_weights(path: str, arch: Arch) -> None:
    """The safetensors of an HF checkpoint directory hold the tensors of ``arch`` (its
    config.json): every file's header is read and checked (not the data), so a missing,
    corrupt or truncated file, a missing or extra tensor, or a wrong shape is one
    HFCheckpointError before anything is built."""
    found: dict[str, tuple[str, tuple[int, ...]]] = {}
    for file in _weight_files(path):
        found.update(read_safetensors_header(file))
    want = expected_hf_shapes(arch)
    if arch.tie_embeddings and "lm_head.weight" in found and "lm_head.weight" not in want:
        want["lm_head.weight"] = want["model.embed_tokens.weight"]  # a tied head some exporters write too
    missing, extra = sorted(set(want) - set(found)), sorted(set(found) - set(want))
    if missing or extra:
        raise HFCheckpointError(
            f"{path}: the safetensors do not hold the tensors of the architecture in its config.json "
            f"(missing {missing[:3]}{'...' if len(missing) > 3 else ''}, "
            f"unexpected {extra[:3]}{'...' if len(extra) > 3 else ''})"
        )
    bad = [
        f"{k} {list(found[k][1])} (config.json needs {list(want[k])})" for k in sorted(want) if found[k][1] != want[k]
    ]
    if bad:
        raise HFCheckpointError(
            f"{path}: tensor shapes do not match its config.json: {'; '.join(bad[:3])}{'; ...' if len(bad) > 3 else ''}"
        )


def read_hf_head(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(lm_head [V, D], embed_tokens [V, D]) of the HF checkpoint at ``path``, read alone (the
    rest of its files is not): what a draft that shares the target's head and embedding needs.
    A tied checkpoint without lm_head.weight gives the embedding twice."""
    where: dict[str, str] = {}
    for file in _weight_files(path):
        for name in read_safetensors_header(file):
            where[name] = file
    embed_name = "model.embed_tokens.weight"
    if embed_name not in where:
        raise HFCheckpointError(f"{path}: no {embed_name} in its safetensors")
    embed_VD = read_tensor(where[embed_name], embed_name)
    head_VD = read_tensor(where["lm_head.weight"], "lm_head.weight") if "lm_head.weight" in where else embed_VD
    return head_VD, embed_VD


def read_hf_state_dict(path: str) -> dict[str, torch.Tensor]:
    sd: dict[str, torch.Tensor] = {}
    for file in _weight_files(path):
        sd.update(load_file(file))
    return sd


def _adapter(arch: Arch, model_config):
    if arch.family == "qwen3":
        from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter as A
    else:
        from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter as A
    return A(model_config, None)


def load_hf_into(model: nn.Module, path: str, arch: Arch, stage: bool = False) -> None:
    """Load an HF checkpoint into a (possibly FSDP-sharded) target built for ``arch``.
    ``stage``: ``model`` is one pipeline stage's part of it, which takes the checkpoint's
    tensors of the modules it holds (every one of them; the rest belong to other stages)."""
    found = read_hf_arch(path)
    if found != arch:
        diff = [
            f"{k}: checkpoint {getattr(found, k)!r} vs model {getattr(arch, k)!r}"
            for k in arch.__dataclass_fields__
            if getattr(found, k) != getattr(arch, k)
        ]
        raise HFCheckpointError(f"{path} does not match the target: {'; '.join(diff)}")
    hf_sd = read_hf_state_dict(path)
    sd = _adapter(arch, getattr(model, "config", None) or build_target_config(arch)).from_hf(hf_sd)
    # HF Qwen3-MoE has no routing bias: the model's bias buffers start at 0 (HF's routing).
    for k, v in expert_biases(model.state_dict()).items():
        sd.setdefault(k, torch.zeros(v.shape, dtype=v.dtype))
    if stage:
        own = model.state_dict()
        sd = {k: v for k, v in sd.items() if k in own}
    try:
        load_full_state_dict(model, sd)
    except ValueError as e:
        raise HFCheckpointError(f"{path}: {e}") from None


def save_hf(model: nn.Module, path: str, arch: Arch, dtype: torch.dtype = torch.float32, tokenizer=None) -> None:
    """Write ``model`` as an HF checkpoint at ``path`` (atomically: tmp dir, then rename).
    ``tokenizer`` (anything with ``save(folder)`` and ``eos_id``): its files go into the same
    directory, and its EOS / BOS / pad ids into config.json, so the checkpoint serves
    (SGLang, transformers) and trains again with the ids it was trained on.

    Collective under FSDP (every rank must call it); rank 0 writes.
    """
    sd = {k: (v.full_tensor() if isinstance(v, DTensor) else v).cpu() for k, v in model.state_dict().items()}
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return
    check_no_routing_bias(sd, f"the HF export to {path}")
    hf_sd = _adapter(arch, getattr(model, "config", None) or build_target_config(arch)).to_hf(sd)
    hf_sd = {k: v.detach().to(dtype).contiguous() for k, v in hf_sd.items()}
    cfg = arch_to_hf_config(arch)
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    if tokenizer is not None:
        for name in ("eos", "bos", "pad"):
            if getattr(tokenizer, f"{name}_id", None) is not None:
                cfg[f"{name}_token_id"] = int(getattr(tokenizer, f"{name}_id"))
    write_safetensors_dir(path, hf_sd, cfg, extra=tokenizer.save if tokenizer is not None else None)


def check_no_routing_bias(state: dict[str, torch.Tensor], what: str) -> None:
    """ValueError when a MoE target's routing bias (torchtitan's load balancing, models/moe.py)
    has moved off 0: HF Qwen3-MoE (and SGLang's) has no place for it, so ``what`` would
    route tokens differently from the trained model."""
    moved = [
        k
        for k, v in expert_biases(state).items()
        if bool(((v.full_tensor() if isinstance(v, DTensor) else v) != 0).any())
    ]
    if moved:
        raise ValueError(
            f"{what}: the routing bias of {len(moved)} MoE layer(s) ({moved[0]}, ...) is not 0 "
            "(model.moe_load_balance_coeff > 0 trained it); HF Qwen3-MoE has no routing bias, so it would "
            "route tokens differently from the trained model"
        )


def _publish(path: str) -> None:
    """World-readable like any directory the run makes (mkdtemp makes 0700): the umask's
    modes, 0755 / 0644 under the usual umask 022."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o777 & ~umask)
    for name in os.listdir(path):
        os.chmod(os.path.join(path, name), 0o666 & ~umask)


def write_safetensors_dir(path: str, tensors: dict[str, torch.Tensor], config: dict, extra=None) -> None:
    """``config.json`` + ``model.safetensors`` (+ what ``extra(tmp_dir)`` writes: the
    tokenizer's files) written to a temporary sibling directory that replaces ``path`` only
    when complete: an interrupted write leaves the old directory (or nothing), never a
    half-written one."""
    parent = os.path.dirname(os.path.abspath(path)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=parent)
    try:
        save_file(tensors, os.path.join(tmp, _SINGLE), metadata={"format": "pt"})
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        if extra is not None:
            extra(tmp)
        _publish(tmp)
        if os.path.exists(path):
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
