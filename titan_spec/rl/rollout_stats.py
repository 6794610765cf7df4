"""What one rank's generate call cost and yielded: ``RolloutStats``, the record the worker's
calls and the baselines' calls return and the step's metrics sum (rl/step_metrics.py)."""

from __future__ import annotations

from dataclasses import dataclass

from titan_spec.rollout.base import Rollout

__all__ = ["RolloutStats"]


@dataclass
class RolloutStats:
    """What one generate call cost and yielded (this rank)."""

    tokens: int
    verify_steps: int
    seconds: float
    drafted_tokens: int = 0
    """Draft tokens proposed (Rollout.drafted_tokens summed)."""
    rounds: int = 0
    """Verify rounds after the prefills (verify_steps - one per request): drafted_tokens /
    rounds is the mean depth, ``rollout/draft_k``."""
    priced_s: float = 0.0
    """At baseline steps (rl/baselines.py): the call's decode rounds priced by adaptive
    depth's round-cost table (seconds per round by K and rows, measured once, then frozen;
    the prefill, the same for every engine of a call, left out); 0 where there is no table,
    no rounds to price or no baseline step. One clock for every engine of a baseline step,
    free of the load that moves wall seconds from call to call on a shared CPU."""

    @classmethod
    def of(cls, rollouts: list[Rollout], seconds: float, priced_s: float = 0.0) -> "RolloutStats":
        steps = sum(r.verify_steps for r in rollouts)
        return cls(
            sum(len(r.output_ids) for r in rollouts),
            steps,
            seconds,
            sum(r.drafted_tokens for r in rollouts),
            steps - len(rollouts),
            priced_s,
        )

    @classmethod
    def combined(cls, shares: list["RolloutStats"]) -> "RolloutStats":
        """Shares generated side by side (rl/sharing.py): their tokens and verify steps
        add up, their seconds are the slowest share's."""
        if len(shares) == 1:
            return shares[0]
        return cls(
            sum(s.tokens for s in shares),
            sum(s.verify_steps for s in shares),
            max(s.seconds for s in shares),
            sum(s.drafted_tokens for s in shares),
            sum(s.rounds for s in shares),
            max(s.priced_s for s in shares),
        )
