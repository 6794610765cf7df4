"""The finiteness guard of every optimizer step (policy and draft), and the fault-injection hook.

Invariants: a step whose loss or gradient norm is not finite never reaches the weights or the
optimizer state (``StepGuard.check`` decides; the caller skips ``optimizer.step()`` and zeroes
the gradients), yet its batch is consumed and the step counter and LR schedule advance, so
step numbers, checkpoints, data order and LRs stay those of a run where nothing went wrong
(Adam's own step count does not advance: its bias correction is a run's without that step).
The decision is the same on every rank: the global gradient norm, and the loss flag
all-reduced (MAX). After ``max_consecutive`` skips in a row the run stops with
``NonFiniteStop`` in one line. ``fault()`` is the ONE reader of ``TITAN_SPEC_FAULTS``, the
tests' fault hook (docs/RELIABILITY.md lists its entries); a run without it is unaffected.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torchtitan.tools.logging import logger

__all__ = ["StepGuard", "NonFiniteStop", "fault", "global_grad_norm", "inject_nan_grad"]

FAULTS_ENV = "TITAN_SPEC_FAULTS"


class NonFiniteStop(RuntimeError):
    """The run stops: too many consecutive non-finite steps (the message is one line)."""


def fault(name: str, step: int) -> bool:
    """Whether the test hook ``TITAN_SPEC_FAULTS`` asks for fault ``name`` at ``step``."""
    for entry in os.environ.get(FAULTS_ENV, "").split(","):
        entry = entry.strip()
        if entry and "@" in entry:
            n, s = entry.split("@", 1)
            if n == name and s.strip() == str(step):
                return True
    return False


def inject_nan_grad(params: list[torch.nn.Parameter]) -> bool:
    """Set the first element of the first non-empty local gradient to NaN (test hook)."""
    for p in params:
        g = p.grad
        if g is None:
            continue
        local = g.to_local() if isinstance(g, DTensor) else g
        if local.numel():
            local.view(-1)[0] = float("nan")
            return True
    return False


@torch.no_grad()
def global_grad_norm(params: list[torch.nn.Parameter], device: torch.device, pp_mesh=None) -> torch.Tensor:
    """The 2-norm of all gradients, reduced like torchtitan's clip_grad_norm_ (DTensor
    shards over their mesh, then the pipeline stages), so every rank gets the same value.
    Under expert parallelism the experts' gradients live on another mesh than the rest:
    each mesh's norm is reduced on its own and the two combined, as torchtitan's
    ``_clip_grad_norm_with_ep`` does (one mesh: a single reduction)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros((), device=device)
    groups: dict[object, list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    norms = []
    for group in groups.values():
        n = torch.nn.utils.get_total_norm(group, 2.0, False, True)
        norms.append(n.full_tensor() if isinstance(n, DTensor) else n)
    norm = norms[0] if len(norms) == 1 else sum(n**2 for n in norms) ** 0.5
    if pp_mesh is not None:
        norm = norm**2
        dist.all_reduce(norm, op=dist.ReduceOp.SUM, group=pp_mesh.get_group())
        norm = norm**0.5
    return norm


@dataclass
class StepGuard:
    """Counts skipped steps of one model ("policy" or "draft") and decides each step."""

    name: str
    max_consecutive: int
    skipped: int = 0
    """Steps skipped so far (cumulative, checkpointed)."""
    consecutive: int = 0
    """Skips in a row up to the last step (reset by a good step)."""
    last_reason: str = field(default="", repr=False)
    last_loss_bad: bool = field(default=False, repr=False)
    """Whether the last checked step's loss (not only its gradient norm) was non-finite."""

    def check(self, loss: torch.Tensor | None, grad_norm: torch.Tensor, group=None) -> bool:
        """True when the step may be applied. ``grad_norm`` must already be the global norm
        (a tensor on the training device); the loss's finiteness is all-reduced over ``group``
        (None = no reduction)."""
        loss_bad = 0.0 if loss is None else float(not bool(torch.isfinite(loss.detach()).all()))
        flags = torch.tensor([loss_bad, float(not math.isfinite(float(grad_norm)))], dtype=torch.float32)
        if group is not None and dist.is_initialized():
            flags = flags.to(grad_norm.device)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        loss_bad, norm_bad = (bool(v) for v in flags.cpu().tolist())
        self.last_loss_bad = loss_bad
        if not (loss_bad or norm_bad):
            self.consecutive = 0
            return True
        self.skipped += 1
        self.consecutive += 1
        what = " and ".join(
            w for w, bad in ((f"{self.name} loss", loss_bad), (f"{self.name} gradient norm", norm_bad)) if bad
        )
        self.last_reason = what
        return False

    def skip_message(self, step: int) -> str:
        return (
            f"step {step}: the {self.last_reason} is not finite; the {self.name} optimizer step is skipped "
            f"({self.consecutive} in a row, {self.skipped} in all)"
        )

    def stop_message(self, step: int, last_good: str) -> str:
        """The one line the run stops with at the limit (``last_reason`` is empty on a rank
        without this model, e.g. the draft's guard on a pipeline stage before the last)."""
        what = self.last_reason or f"{self.name} loss or gradient norm"
        return (
            f"stopped at step {step}: the {what} was not finite for {self.max_consecutive} consecutive steps "
            f"(training.max_consecutive_skips = {self.max_consecutive}); last good checkpoint: {last_good}"
        )

    def log_skip(self, step: int) -> None:
        logger.warning(self.skip_message(step))

    def state_dict(self) -> dict[str, int]:
        return {"skipped": self.skipped, "consecutive": self.consecutive}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.skipped, self.consecutive = int(sd["skipped"]), int(sd["consecutive"])
