"""The step's metrics: torchtitan's MetricsProcessor plus metrics.jsonl and the trainer's own.

``CoTrainingMetrics`` is built from the trainer config like torchtitan's processor
(``to_trainer_config``) and called the same way (``metrics_processor.log(...)``, from
torchtitan's ``train_step`` or the RL step). What it adds:

- the trainer's step metrics (``Config.step_metrics``, given as the trainer is built: the draft's loss and accuracy per TTT step, the
  guard's skip count, the RL step's metrics) next to torchtitan's, on the console, in
  TensorBoard and in the row; ``loss`` / ``max_loss`` among them replace torchtitan's
  reductions (a skipped non-finite step's true loss; CP's max over pooled shards);
- one strict-JSON row per logged step in ``<dump_folder>/metrics.jsonl``, full precision,
  non-finite values written as null and named in the row's ``nonfinite`` list, written by
  one rank (the first of the last pipeline stage, where the loss is seen);
- ``trim``: a resumed run drops the rows of the steps it redoes (and a torn last line);
- ``count_data``: the RL step's rollouts are its data loading in torchtitan's throughput
  account (its batch generator counts a data iterator's).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torchtitan.components.metrics import MetricsProcessor

__all__ = ["CoTrainingMetrics"]


class CoTrainingMetrics(MetricsProcessor):
    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        step_metrics: Callable[[], dict[str, Any]] = dict
        """The trainer's metrics of the step being logged (collective: every rank calls it at
        every log); the trainer passes its own ``step_metrics``."""

    def __init__(self, config: Config, *, dump_folder: str = "./outputs", **kwargs) -> None:
        super().__init__(config, dump_folder=dump_folder, **kwargs)
        self.path = os.path.join(dump_folder, "metrics.jsonl")
        self._step_metrics = config.step_metrics

    def is_writer(self) -> bool:
        """The first rank of the last pipeline stage (torchtitan's loss-visible rank)."""
        pd = self.parallel_dims
        return torch.distributed.get_rank() == (pd.world_size // pd.pp) * (pd.pp - 1)

    def count_data(self, seconds: float, tokens: int) -> None:
        """A step's data loading outside a data iterator (the RL step's rollouts)."""
        self.data_loading_times.append(seconds)
        self.ntokens_since_last_log += tokens

    def log(
        self,
        step: int,
        global_avg_loss: float,
        global_max_loss: float,
        grad_norm: float,
        extra_metrics: dict[str, Any] | None = None,
    ) -> None:
        own = self._step_metrics()
        global_avg_loss = own.pop("loss", global_avg_loss)
        global_max_loss = own.pop("max_loss", global_max_loss)
        extra_metrics = {**(extra_metrics or {}), **own}
        super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra_metrics)
        if self.is_writer():
            row = {"step": step, "loss": global_avg_loss, "max_loss": global_max_loss, "grad_norm": grad_norm}
            row.update({k: v for k, v in extra_metrics.items() if isinstance(v, (int, float))})
            bad = [k for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)]
            row.update({k: None for k in bad})
            if bad:
                row["nonfinite"] = bad
            with open(self.path, "a") as f:
                f.write(json.dumps(row, allow_nan=False) + "\n")

    def trim(self, last_step: int) -> None:
        """Keep the metrics.jsonl rows of steps <= last_step (the steps this run does not
        redo) and drop a torn last line, so a resumed run writes each step's row once."""
        if not self.is_writer() or not os.path.exists(self.path):
            return
        kept = []
        with open(self.path) as f:
            for line in f:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut by a kill
                if row.get("step", 0) <= last_step:
                    kept.append(json.dumps(row, allow_nan=False) + "\n")
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(kept)
        os.replace(tmp, self.path)
