"""Several training runs in ONE torchrun launch (tests): imports and process start-up,
most of a small CPU run's time, are paid once.

    python -m torch.distributed.run --nproc_per_node=N tests/helpers/train_many.py JSON

JSON: [[override, ...], ...]; each list is a full set of titan_spec CLI arguments
(--config included). The runs share the process group; each builds its own trainer,
trains, exports and closes, as ``python -m titan_spec.train`` does (train_and_close: a run
stopped by the finiteness guard prints its line, then "train_many: DUMP exit 1", and the next
run starts). An entry may also be
{"argv": [...], "env": {...}}: environment variables set for that run only (test hooks
such as TITAN_SPEC_FAULTS, titan_spec/training/finite.py).
"""

import json
import os
import sys
import time

import titan_spec  # noqa: F401  (CPU shims before torchtitan)
import torch
import torchtitan.trainer
from torchtitan.tools.logging import init_logger

from titan_spec import platform
from titan_spec.config import load_config
from titan_spec.preflight import to_trainer_config
from titan_spec.train.entry import train_and_close


class _NoEndSleep:
    """torchtitan's Trainer.train ends with a 2 s sleep on rank 0 "for other ranks to complete";
    here the barrier after each run does that, so the sleep is skipped (2 s per run)."""

    def __getattr__(self, name):
        return getattr(time, name)

    @staticmethod
    def sleep(seconds: float) -> None:
        pass


def main() -> int:
    init_logger()
    torchtitan.trainer.time = _NoEndSleep()
    worst = 0
    for argv in json.loads(sys.argv[1]):
        env = {}
        if isinstance(argv, dict):
            argv, env = argv["argv"], argv.get("env", {})
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        i = argv.index("--config")
        path = argv[i + 1]
        cfg = load_config(path, argv[:i] + argv[i + 2 :])
        try:
            rc = train_and_close(to_trainer_config(cfg))
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        sys.stdout.write(f"train_many: {cfg.job.dump_folder} exit {rc}\n")  # one write per rank: lines stay whole
        sys.stdout.flush()
        worst = max(worst, rc)
        torch.distributed.barrier()
    return worst  # nonzero when any run stopped


if __name__ == "__main__":
    platform.exit_process(main())
