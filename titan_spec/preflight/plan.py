"""The run plan: every config of a job.requires chain validated completely before anything
runs (``plan_runs``), one config (``validate_run``), and a config checked against its
directories' config files alone (``weightless_inputs``, ``--check --no-weights``)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from titan_spec.config import ConfigError, TitanSpecConfig, load_config, locate
from titan_spec.models.draft import draft_kind
from titan_spec.models.hf_io import read_hf_arch
from titan_spec.models.registry import arch_from_hf_config, arch_to_hf_config, parameter_count
from titan_spec.preflight.inputs import check_free_space, check_inputs
from titan_spec.preflight.resolve import Made, resolve_tokenizer
from titan_spec.preflight.torch_support import check_torch_support
from titan_spec.preflight.trainer_config import to_trainer_config
from titan_spec.training.draft import under_dump_folder

if TYPE_CHECKING:
    from titan_spec.training.trainer import SpecTrainer

__all__ = ["validate_run", "plan_runs", "weightless_inputs"]


def validate_run(cfg: TitanSpecConfig, made: dict[str, Made] | None = None, disk: bool = True) -> "SpecTrainer.Config":
    """Everything checkable before a run starts, for a loaded config: its input files
    (HF safetensors headers, the draft directory, the task file) and its architecture
    (tap ids, draft vocab, seq_len, draft dimensions against the target). ``made``: inputs
    an earlier run of the chain writes, checked against what it will write. Errors name
    where the value at fault came from (the TOML file or the command line). ``disk``: the
    dump folder's disk has room for the first checkpoint (False: a config checked apart from
    the machine it will run on, ``--check --no-weights``)."""
    try:
        check_inputs(cfg, made)
        config = to_trainer_config(cfg, made)
        # After the config's own errors (another torch fixes none of them), before any start.
        check_torch_support(cfg)
        if disk:
            check_free_space(cfg, *_parameters(cfg, config))
        return config
    except ValueError as e:  # ConfigError, and the registry's ValueErrors (an unknown flavor)
        raise locate(cfg, e if isinstance(e, ConfigError) else ConfigError(str(e))) from None


def _parameters(cfg: TitanSpecConfig, config) -> tuple[int, int]:
    """The policy's and the draft's parameters (built on the meta device: nothing allocated)."""
    draft = 0
    if config.draft_arch is not None:
        with torch.device("meta"):
            draft = sum(p.numel() for p in draft_kind(cfg.draft.kind).build(config.draft_arch).parameters())
    return parameter_count(config.arch), draft


def plan_runs(path: str, overrides: list[str] | None = None) -> list[str]:
    """The configs run_train.sh runs for ``path``, in order: the runs it requires
    (``job.requires``, recursively) that have not finished (no DONE in their dump folder),
    then ``path`` itself with the command-line overrides.

    Every config of the chain is validated COMPLETELY here, before anything runs and
    without writing anything: an input that an earlier run of the chain writes (its
    job.export_hf or draft.export_dir) is checked against the architecture that run's
    config gives it (``Made``); any other input path inside a pending run's dump folder is
    an error (nothing will be there); every other input is read and checked now."""
    order: list[tuple[str, TitanSpecConfig]] = []

    def visit(p: str, ov: list[str] | None, chain: tuple[str, ...]) -> None:
        if p in chain:
            raise ConfigError(f"job.requires forms a cycle: {' -> '.join((*chain, p))}")
        cfg = load_config(p, ov, check_paths=False)
        for req in cfg.job.requires:
            req_path = os.path.normpath(os.path.join(os.path.dirname(p), req))
            if not os.path.isfile(req_path):
                raise ConfigError(f"{p}: job.requires names {req!r}, but {req_path} does not exist")
            req_cfg = load_config(req_path, None, check_paths=False)
            if not os.path.isfile(os.path.join(req_cfg.job.dump_folder, "DONE")):
                visit(req_path, None, (*chain, p))
        if all(p != q for q, _ in order):
            order.append((p, cfg))

    visit(path, overrides, ())
    made: dict[str, Made] = {}
    pending: list[tuple[str, str]] = []  # (dump folder + os.sep, config) of the runs planned so far
    for p, cfg in order:
        for key in ("model.hf_checkpoint", "draft.init_from"):
            d = getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1])
            inside = next((run for dump, run in pending if (os.path.abspath(d) + os.sep).startswith(dump)), None)
            if d and inside and os.path.abspath(d) not in made:
                writes = [k for k, m in made.items() if m.run == inside]
                raise locate(
                    cfg,
                    ConfigError(
                        f"{key} {d!r} is inside the dump folder of {inside}, which runs first but writes no "
                        f"checkpoint there; it writes {writes or 'no export (set its job.export_hf / draft.export_dir)'}",
                        key=key,
                    ),
                )
        tc = validate_run(cfg, made)
        dump = os.path.abspath(cfg.job.dump_folder)
        pending.append((dump + os.sep, p))
        if cfg.job.export_hf:
            # What save_hf writes and read_hf_arch reads back: the config.json round trip.
            arch = arch_from_hf_config(arch_to_hf_config(tc.arch))
            made[os.path.abspath(under_dump_folder(dump, cfg.job.export_hf))] = Made(
                run=p, hf=arch, tokenizer=resolve_tokenizer(cfg, made)
            )
        if tc.draft_arch is not None and cfg.draft.export_dir:
            made[os.path.abspath(under_dump_folder(dump, cfg.draft.export_dir))] = Made(run=p, draft=tc.draft_arch)
    return [p for p, _ in order]


def weightless_inputs(cfg: TitanSpecConfig) -> dict[str, Made]:
    """The config's HF and draft directories as promised inputs (``Made``): their config
    files are read and checked as usual, their weight files are not (``--check --no-weights``)."""
    made = {}
    if cfg.model.hf_checkpoint and os.path.isdir(cfg.model.hf_checkpoint):
        try:
            made[os.path.abspath(cfg.model.hf_checkpoint)] = Made(
                run="--no-weights", hf=read_hf_arch(cfg.model.hf_checkpoint), tokenizer=resolve_tokenizer(cfg)
            )
        except ValueError as e:
            raise locate(cfg, ConfigError(f"model.hf_checkpoint: {e}", key="model.hf_checkpoint")) from None
    if cfg.draft.init_from and os.path.isdir(cfg.draft.init_from):
        try:
            made[os.path.abspath(cfg.draft.init_from)] = Made(
                run="--no-weights", draft=draft_kind(cfg.draft.kind).read_arch(cfg.draft.init_from)
            )
        except ValueError as e:
            raise locate(cfg, ConfigError(f"draft.init_from: {e}", key="draft.init_from")) from None
    return made
