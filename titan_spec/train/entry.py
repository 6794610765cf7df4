"""The entry point of ``python -m titan_spec.train --config FILE [--section.key value ...]``.

Everything checkable before a run starts is checked by ``titan_spec.preflight`` (for every
run of a ``job.requires`` chain with ``--plan``, before torchrun starts any rank), which also
turns the config into torchtitan's ``Trainer.Config``; then the trainer
(``titan_spec.training.trainer.SpecTrainer`` for SFT and offline draft training,
``titan_spec.rl.step.RLTrainer`` for RL) trains, exports and closes.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import titan_spec  # noqa: F401  (CPU shims before torchtitan)
import torch
from torch.distributed.elastic.multiprocessing.errors import record
from torchtitan.tools.logging import init_logger

from titan_spec.config import ConfigError, load_config
from titan_spec.train.launch import report_stop

if TYPE_CHECKING:
    from titan_spec.training.trainer import SpecTrainer

# The preflight, the models and the trainer are imported once the config has loaded (in
# main and train_and_close): they are most of titan_spec's import time, which a typo in a
# key or value should not wait for. Their errors and stops
# are still raised and reported here.

__all__ = ["main", "train_and_close"]


@record  # under torchrun, an exception is written to its error file (titan_spec/train/launch.py reads it)
def main(argv: list[str] | None = None) -> int:
    """``--check``: validate the config (and the HF/draft directories it names) and exit;
    ``--check --no-weights``: the same without reading weight files (``weightless_inputs``:
    a GPU recipe checked where its checkpoint is not, e.g. against config.json files alone),
    printing the target's parameter counts (built on the meta device);
    ``--plan``: print the configs to run for it, one per line (job.requires first).
    run_train.sh does both in one process before torchrun starts any rank."""
    argv = list(sys.argv[1:] if argv is None else argv)
    check_only, plan_only, no_weights = "--check" in argv, "--plan" in argv, "--no-weights" in argv
    for flag in ("--check", "--plan", "--no-weights"):
        if flag in argv:
            argv.remove(flag)
    path = None
    if "--config" in argv:
        i = argv.index("--config")
        path = argv[i + 1] if i + 1 < len(argv) else None
        del argv[i : i + 2]
    try:
        if no_weights and not check_only:
            raise ConfigError("--no-weights goes with --check only (a run reads its weights)")
        cfg = load_config(path or "", argv, check_paths=False)  # the config's own errors, before the imports below
        from titan_spec.preflight import plan_runs, validate_run, weightless_inputs

        if plan_only:  # the whole job.requires chain (this config's again, with its inputs)
            print("\n".join(plan_runs(path or "", argv)))
            return 0
        trainer_config = validate_run(cfg, weightless_inputs(cfg) if no_weights else None, disk=not no_weights)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        report_stop(f"titan_spec: config error: {e}")
        return 2
    if check_only:
        if no_weights:
            from titan_spec.models.registry import active_parameter_count, parameter_count

            arch = trainer_config.arch
            print(
                f"titan_spec: {path}: checked without its weight files; the target has "
                f"{parameter_count(arch):,} parameters, {active_parameter_count(arch):,} active per token"
            )
        return 0
    init_logger()
    try:
        return train_and_close(trainer_config)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def train_and_close(trainer_config: "SpecTrainer.Config") -> int:
    """Build, train (export, DONE) and close one run; the exit status. A run stopped by the
    finiteness guard, by a checkpoint it cannot resume from or write, or by a reward that
    raised prints one line and returns 1 (no DONE: run_train.sh does not treat it as finished)."""
    from titan_spec.data.rewards import RewardError
    from titan_spec.training.checkpoint import CheckpointCorrupt, CheckpointWriteFailed
    from titan_spec.training.finite import NonFiniteStop

    trainer = None
    try:
        trainer = trainer_config.build()
        trainer.train()
    except (NonFiniteStop, CheckpointCorrupt, CheckpointWriteFailed, RewardError) as e:
        report_stop(f"titan_spec: {e}")
        return 1
    finally:
        if trainer is not None:
            trainer.close()
    return 0
