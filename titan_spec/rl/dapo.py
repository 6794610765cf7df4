"""DAPO (Yu et al. 2025, arXiv 2503.14476): PPO-clip with clip-higher, token-level
aggregation, overlong filtering and soft overlong punishment (``rl.loss = "dapo"``).

What DAPO changes against the GRPO paper, and where each piece is here:

- **Decoupled clip (clip-higher)**: the ratio is clipped to [1 - eps_low, 1 + eps_high]
  with eps_high > eps_low (the paper: 0.2 / 0.28), so low-probability tokens can grow.
  ``rl.clip_low`` / ``rl.clip_high``; the same bounds ``grpo`` uses (both are
  rl/objective.py's clipped objective).
- **Token-level aggregation**: the sum over every completion token of the batch divided by
  their count, so a long completion weighs by its tokens (the GRPO paper averages each
  sequence first). titan_spec's ``grpo`` ALREADY aggregates this way by default
  (rl.loss_agg = "token-mean", as torchtitan normalizes its LM loss); ``dapo`` keeps it.
- **Overlong filtering** (``rl.dapo.overlong_filter``): completions cut at ``rl.max_new_tokens``
  (finish_reason "length") take no part in the policy loss, neither its sum nor its
  token count: a truncated answer is not punished for being unfinished. The draft still
  trains on their tokens (the policy's distribution there is still a valid target).
- **Soft overlong punishment** (``rl.dapo.overlong_buffer`` > 0): before the advantages, a
  completion of |y| tokens gets the length reward of the paper's eq. (13) added,
  ``min(0, ((L_max - L_cache) - |y|) / L_cache) * rl.dapo.overlong_penalty`` with
  L_max = rl.max_new_tokens and L_cache = rl.dapo.overlong_buffer: 0 up to L_max - L_cache,
  then falling linearly to -penalty at L_max (a completion never exceeds L_max here).
  The logged ``rl/reward`` stays the task's reward.

- **Dynamic sampling** (``rl.dynamic_sampling``): groups whose rewards are all equal are
  dropped and more prompts generated (rl/dynamic_sampling.py, in the step's generation).
"""

from __future__ import annotations

import torch

from titan_spec.rl.objective import ClippedPolicyLoss

__all__ = ["DAPOPolicyLoss", "overlong_penalty"]


def overlong_penalty(lengths_PG: torch.Tensor, max_new_tokens: int, buffer: int, penalty: float) -> torch.Tensor:
    """DAPO's soft overlong punishment of completions of ``lengths_PG`` tokens (<= 0)."""
    if buffer <= 0:
        return torch.zeros_like(lengths_PG, dtype=torch.float32)
    expected = max_new_tokens - buffer
    return ((expected - lengths_PG.float()) / buffer).clamp(max=0.0) * penalty


class DAPOPolicyLoss(ClippedPolicyLoss):
    """DAPO's policy loss: PPO-clip per token over the completion tokens ``keep`` keeps
    (overlong filtering); its normalizers count only those."""

    @staticmethod
    def keep(values_BL: dict[str, torch.Tensor], rl) -> torch.Tensor:
        """1 on the tokens that take part: all, or (rl.dapo.overlong_filter) those of completions
        not cut at the budget."""
        if rl.dapo.overlong_filter:
            return 1.0 - values_BL["truncated"]
        return torch.ones_like(values_BL["advantages"])
