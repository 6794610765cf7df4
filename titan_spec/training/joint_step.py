"""The joint update of the policy and the draft, ONE code path for SFT and RL.

    step(k, loss, grad_norm)  the guard (finite.py) applies the policy's step or skips it (its
                              gradients dropped) on the step's loss and its global pre-clip
                              gradient norm; then the draft's step (its own clip and guard,
                              draft.py); then the joint stop: NonFiniteStop on every rank after
                              training.max_consecutive_skips skips in a row of either model.
    step_schedules()          the policy's LR schedules, then the draft's.

The policy's containers are torchtitan's, as its Trainer built them (the checkpointer keeps them).
RL's update calls both after its clip, with the norm clip_grad_norm_ returned (also when it is not
finite). torchtitan's Trainer.train_step (SFT) clips inline and then calls self.optimizers.step()
and self.lr_schedulers.step() with no arguments, with no smaller seam between its clip and its log
and no way out for the clip's norm: ``TorchtitanCalls`` are the same two functions under those
names, their inputs read from the trainer (the SFT guard reduces the pre-clip norm itself).

A skipped step still runs the policy container's step, with no gradients (its optimizers change
nothing), so its hooks (torchtitan's MoE bias update, which reads routing counts) run every step.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer

from titan_spec.training.finite import NonFiniteStop, StepGuard

__all__ = ["JointStep", "TorchtitanCalls"]


class JointStep:
    """The guarded policy step, the draft's step and both schedules, in that order."""

    def __init__(
        self,
        policy: OptimizersContainer,
        policy_schedules: LRSchedulersContainer,
        draft,
        *,
        max_consecutive_skips: int,
        last_good: Callable[[], str],
    ) -> None:
        """``draft``: the draft's training side (draft.DraftTraining, its own optimizer and
        schedule) or None; ``last_good()``: the last good checkpoint, for the stop message."""
        self.policy, self.policy_schedules, self.draft = policy, policy_schedules, draft
        self.guard = StepGuard("policy", max_consecutive_skips)
        self._last_good = last_good
        self.loss_was_finite = True
        """Whether the last step's policy loss was finite (every rank agrees; the metrics say nan when not)."""

    def step(self, step: int, loss: torch.Tensor | None, grad_norm: torch.Tensor) -> None:
        """One optimizer step of both models: ``loss`` is the step's policy loss (the sum of
        its forward/backward calls' losses), ``grad_norm`` its global pre-clip gradient norm."""
        guard = self.guard
        ok = guard.check(loss, grad_norm, dist.group.WORLD)
        self.loss_was_finite = not guard.last_loss_bad
        if not ok:
            guard.log_skip(step)
            self.policy.zero_grad(set_to_none=True)
        self.policy.step()
        if self.draft is not None:
            self.draft.step(step)
        self._stop_at_limit(step, grad_norm.device)

    def _stop_at_limit(self, step: int, device: torch.device) -> None:
        # Every rank stops together (under PP the draft lives on the last stage only).
        draft_guard = self.draft.guard if self.draft is not None else None
        limit = self.guard.max_consecutive
        flags = torch.tensor(
            [
                float(self.guard.consecutive >= limit),
                float(draft_guard is not None and draft_guard.consecutive >= limit),
            ],
            device=device,
        )  # on the device: NCCL has no CPU tensors
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        flags = flags.cpu()
        if flags.any():
            stopped = self.guard if flags[0] else (draft_guard or StepGuard("draft", limit))
            raise NonFiniteStop(stopped.stop_message(step, self._last_good()))

    def step_schedules(self) -> None:
        """The policy's LR schedules, then the draft's (an RL step takes several optimizer
        steps on one schedule step)."""
        self.policy_schedules.step()
        if self.draft is not None:
            self.draft.scheduler.step()


class TorchtitanCalls:
    """``optimizers`` and ``schedules``: what torchtitan's Trainer.train_step (SFT) calls under
    the names ``self.optimizers`` and ``self.lr_schedulers``, the joint step's two functions."""

    def __init__(self, joint: JointStep, inputs: Callable[[], tuple[int, torch.Tensor | None, torch.Tensor]]):
        """``inputs()``: the step's (step number, policy loss, global pre-clip gradient norm)."""
        self.optimizers = _Optimizers(joint, inputs)
        self.schedules = _Schedules(joint)


class _Optimizers:
    def __init__(self, joint: JointStep, inputs) -> None:
        self._joint, self._inputs = joint, inputs
        self.container = joint.policy
        """torchtitan's container of the policy's optimizers."""

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return self.container.optimizers

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.container.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        self._joint.step(*self._inputs())


class _Schedules:
    def __init__(self, joint: JointStep) -> None:
        self._joint = joint
        self.container = joint.policy_schedules
        """torchtitan's container of the policy's LR schedules."""

    def get_metrics(self) -> dict:
        return self.container.get_metrics()

    def step(self) -> None:
        self._joint.step_schedules()
