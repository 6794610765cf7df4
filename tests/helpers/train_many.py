"""Several training runs in ONE torchrun launch (tests): imports and process start-up,
most of a small CPU run's time, are paid once.

    python -m torch.distributed.run --nproc_per_node=N tests/helpers/train_many.py JSON

JSON: [[override, ...], ...]; each list is a full set of titan_spec CLI arguments
(--config included). The runs share the process group; each builds its own trainer,
trains, exports and closes, as ``python -m titan_spec.train`` does.
"""

import json
import sys
import time

import titan_spec  # noqa: F401  (CPU shims before torchtitan)
import torch
import torchtitan.trainer
from torchtitan.tools.logging import init_logger

from titan_spec.config import load_config
from titan_spec.train import to_trainer_config


class _NoEndSleep:
    """torchtitan's Trainer.train ends with a 2 s sleep on rank 0 "for other ranks to complete";
    here the barrier after each run does that, so the sleep is skipped (2 s per run)."""

    def __getattr__(self, name):
        return getattr(time, name)

    @staticmethod
    def sleep(seconds: float) -> None:
        pass


def main() -> None:
    init_logger()
    torchtitan.trainer.time = _NoEndSleep()
    for argv in json.loads(sys.argv[1]):
        i = argv.index("--config")
        path = argv[i + 1]
        cfg = load_config(path, argv[:i] + argv[i + 2:])
        trainer = to_trainer_config(cfg).build()
        try:
            trainer.train()
        finally:
            trainer.close()
        torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
