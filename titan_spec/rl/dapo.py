"""DAPO (Yu et al. 2025, arXiv 2503.14476): PPO-clip with clip-higher, token-level
aggregation, overlong filtering and soft overlong punishment (``rl.loss = "dapo"``).

Shape legend: P = prompts, G = group size, B = packed rows, L = row length.

What DAPO changes against the GRPO paper, and where each piece is here:

- **Decoupled clip (clip-higher)**: the ratio is clipped to [1 - eps_low, 1 + eps_high]
  with eps_high > eps_low (the paper: 0.2 / 0.28), so low-probability tokens can grow.
  ``rl.clip_low`` / ``rl.clip_high``; the same bounds ``grpo`` uses (both are
  ``grpo.ppo_clip_loss``).
- **Token-level aggregation**: the sum over every completion token of the batch divided by
  their count, so a long completion weighs by its tokens (the GRPO paper averages each
  sequence first). titan_spec's ``grpo`` ALREADY aggregates this way (``ppo_clip_loss``
  over the global token count, as torchtitan normalizes its LM loss); ``dapo`` keeps it.
- **Overlong filtering** (``rl.overlong_filter``): completions cut at ``rl.max_new_tokens``
  (finish_reason "length") take no part in the policy loss, neither its sum nor its
  token count: a truncated answer is not punished for being unfinished. The draft still
  trains on their tokens (the policy's distribution there is still a valid target).
- **Soft overlong punishment** (``rl.overlong_buffer`` > 0): before the advantages, a
  completion of |y| tokens gets the length reward of the paper's eq. (13) added,
  ``min(0, ((L_max - L_cache) - |y|) / L_cache) * rl.overlong_penalty`` with
  L_max = rl.max_new_tokens and L_cache = rl.overlong_buffer: 0 up to L_max - L_cache,
  then falling linearly to -penalty at L_max (a completion never exceeds L_max here).
  The logged ``rl/reward`` stays the task's reward.

Not here: DAPO's dynamic sampling (resampling groups whose rewards are all equal).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchtitan.components.loss import IGNORE_INDEX

from titan_spec.rl.grpo import PolicyLossOutput, ppo_clip_loss, token_logprobs

__all__ = ["DAPOPolicyLoss", "overlong_penalty"]


def overlong_penalty(lengths_PG: torch.Tensor, max_new_tokens: int, buffer: int, penalty: float) -> torch.Tensor:
    """DAPO's soft overlong punishment of completions of ``lengths_PG`` tokens (<= 0)."""
    if buffer <= 0:
        return torch.zeros_like(lengths_PG, dtype=torch.float32)
    expected = max_new_tokens - buffer
    return ((expected - lengths_PG.float()) / buffer).clamp(max=0.0) * penalty


@dataclass
class DAPOPolicyLoss:
    """DAPO's policy loss of one minibatch (a ``co_training.PolicyLoss``): PPO-clip at the
    rollout temperature against the behaviour log-probs, over the completion tokens that
    ``keep_BL`` keeps (overlong filtering), divided by their global count ``kept_tokens``."""

    behaviour_logp_BL: torch.Tensor
    advantages_BL: torch.Tensor
    keep_BL: torch.Tensor
    """1 on the tokens of completions that take part (0: filtered as overlong)."""
    kept_tokens: torch.Tensor
    """The kept completion tokens over all data-parallel ranks (the normalizer)."""
    rl: object
    """The [rl] section (temperature, clip_low, clip_high, kl_beta)."""
    ref_logp_BL: torch.Tensor | None = None

    @staticmethod
    def keep(values_BL: dict[str, torch.Tensor], rl) -> torch.Tensor:
        """1 on the tokens that take part: all, or (rl.overlong_filter) those of completions
        not cut at the budget."""
        if rl.overlong_filter:
            return 1.0 - values_BL["truncated"]
        return torch.ones_like(values_BL["advantages"])

    @classmethod
    def counts(cls, values_BL: dict[str, torch.Tensor], targets_BL: torch.Tensor, rl) -> dict[str, torch.Tensor]:
        """The kept completion tokens of the (unsharded) minibatch (rl/losses.py)."""
        return {"kept": (targets_BL & (cls.keep(values_BL, rl) > 0)).sum()}

    @classmethod
    def from_values(cls, values: dict[str, torch.Tensor], counts: dict, rl, ref_logp_BL=None) -> "DAPOPolicyLoss":
        return cls(values["behaviour_logp"], values["advantages"], cls.keep(values, rl), counts["kept"], rl, ref_logp_BL)

    def __call__(self, logits_BLV, labels_BL, global_valid_tokens) -> tuple[torch.Tensor, PolicyLossOutput]:
        del global_valid_tokens  # the kept tokens' count replaces it
        rl = self.rl
        mask_T = ((labels_BL != IGNORE_INDEX) & (self.keep_BL > 0)).reshape(-1)
        out = ppo_clip_loss(
            token_logprobs(logits_BLV, labels_BL, rl.temperature).reshape(-1),
            self.behaviour_logp_BL.reshape(-1), self.advantages_BL.reshape(-1), mask_T, self.kept_tokens,
            clip_low=rl.clip_low, clip_high=rl.clip_high,
            ref_logp_T=None if self.ref_logp_BL is None else self.ref_logp_BL.reshape(-1), kl_beta=rl.kl_beta,
        )
        return out.loss, out
