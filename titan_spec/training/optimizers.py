"""The co-training optimizer step and LR schedule as torchtitan components.

torchtitan's ``Trainer.train_step`` ends with ``optimizers.step()`` and
``lr_schedulers.step()`` right after its clip; titan_spec's RL update calls the same two.
With a draft those calls mean more than the policy's AdamW step, so they are these two
subclasses of torchtitan's containers (its documented way to customise them: "inherit from
this class and extend the functionality"), built from the trainer config like the plain
ones (``to_trainer_config``), and called plainly by whoever steps:

    optimizers.step()      the finiteness guard (finite.py) decides the policy's step:
                           applied, or skipped with its gradients dropped; then the
                           draft's own step (its clipping and guard, draft.py); then the
                           joint stop: after training.max_consecutive_skips skips in a row
                           of either model every rank raises NonFiniteStop together.
    lr_schedulers.step()   the policy's schedules, then the draft's.

This container's step hooks (torchtitan's MoE load-balancing bias update, a pre-hook) run
around the whole joint step, so also on a skipped step: a skipped step is otherwise a normal
step (finite.py), and the bias update reads the step's routing counts, not its gradients.

What the guard reads (the step's loss and its global pre-clip gradient norm) is handed in
by the trainer with ``record(...)`` after the step's last backward, before torchtitan's
clip (which would hide a non-finite norm); the draft joins with ``join_draft``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer

from titan_spec.training.finite import NonFiniteStop, StepGuard

__all__ = ["CoTrainingLRSchedulers", "CoTrainingOptimizers"]


class CoTrainingOptimizers(OptimizersContainer):
    """The policy's optimizers (torchtitan's container) with the guarded joint step."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        max_consecutive_skips: int = 3
        """Non-finite steps in a row (of the policy or of the draft) before the run stops
        (training.max_consecutive_skips)."""

    def __init__(self, config: Config, *, model_parts: list[torch.nn.Module]) -> None:
        super().__init__(config, model_parts=model_parts)
        self.guard = StepGuard("policy", config.max_consecutive_skips)
        self.draft = None
        """The draft's training side (draft.DraftTraining) stepped after the policy, or None."""
        self._last_good: Callable[[], str] = lambda: "none (checkpoint.enable = false)"
        self._step, self._loss, self._grad_norm = 0, None, None
        self.loss_was_finite = True
        """Whether the last step's policy loss was finite (every rank agrees; the metrics say nan when not)."""

    def join_draft(self, draft, last_good: Callable[[], str]) -> None:
        """The draft steps with the policy; ``last_good`` names the last good checkpoint for
        the stop message."""
        self.draft, self._last_good = draft, last_good

    def record(self, step: int, loss: torch.Tensor | None, pre_clip_grad_norm: torch.Tensor) -> None:
        """What the next ``step()`` decides on: the step number, its policy loss (the sum of
        its forward/backward calls' losses) and its global gradient norm before clipping."""
        self._step, self._loss, self._grad_norm = step, loss, pre_clip_grad_norm

    def step(self, closure=None) -> None:
        assert closure is None, "the co-training step takes no closure"
        guard = self.guard
        ok = guard.check(self._loss, self._grad_norm, dist.group.WORLD)
        self.loss_was_finite = not guard.last_loss_bad
        if ok:
            # OptimizersContainer.step's body; not super().step(): torch hook-wraps each class's
            # step, so a wrapped parent step would run the step hooks a second time.
            for optimizer in self.optimizers:
                optimizer.step()
        else:
            guard.log_skip(self._step)
            self.zero_grad(set_to_none=True)
        if self.draft is not None:
            self.draft.step(self._step)
        # Stop on every rank together (under PP the draft lives on the last stage only).
        draft_guard = self.draft.guard if self.draft is not None else None
        limit = guard.max_consecutive
        device = self._grad_norm.device if self._grad_norm is not None else torch.device("cpu")
        flags = torch.tensor([
            float(guard.consecutive >= limit),
            float(draft_guard is not None and draft_guard.consecutive >= limit),
        ], device=device)  # on the device: NCCL has no CPU tensors
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        flags = flags.cpu()
        if flags.any():
            stopped = guard if flags[0] else (draft_guard or StepGuard("draft", limit))
            raise NonFiniteStop(stopped.stop_message(self._step, self._last_good()))


class CoTrainingLRSchedulers(LRSchedulersContainer):
    """torchtitan's LR schedules of the policy, stepped together with the draft's."""

    @dataclass(kw_only=True, slots=True)
    class Config(LRSchedulersContainer.Config):
        def build(self, *, optimizers, training_steps):
            # torchtitan's build makes the policy's schedules (its warmup/decay lambda); this
            # container takes them over.
            plain = LRSchedulersContainer.Config.build(self, optimizers=optimizers, training_steps=training_steps)
            return CoTrainingLRSchedulers(plain)

    def __init__(self, plain: LRSchedulersContainer) -> None:
        self.schedulers = plain.schedulers
        self.draft = None
        """The draft's training side (its ``scheduler`` steps with the policy's), or None."""

    def join_draft(self, draft) -> None:
        self.draft = draft

    def step(self) -> None:
        super().step()
        if self.draft is not None:
            self.draft.scheduler.step()
