"""The engine/trainer mismatch: how far the rollout engine's log-probs are from the trainer's
at the same weights, and its correction by truncated importance sampling (TIS).

An engine with other kernels, precision or sampling code than the trainer (SGLang, vLLM,
bf16) samples from a slightly different distribution pi_engine than the trainer's pi at the
same weights. Two consequences, two settings:

- the PPO ratio against the engine's log-probs is not 1 at the first update: the clip acts
  on noise. ``rl.behaviour_logprobs = "recompute"`` takes the denominator from the trainer
  (verl and TRL always do: old_log_prob).
- the samples are still pi_engine's, so the policy gradient is biased. TIS (Yao et al.
  2025, "Your efficient RL framework secretly brings you off-policy RL training"; verl's
  rollout correction) weights each token's policy-gradient loss by
      token:    w_t = min(pi(y_t) / pi_engine(y_t), C)
      sequence: w_i = min(prod_t pi(y_t) / pi_engine(y_t), C)   on every token of i
  at the step's starting weights (detached), C = rl.tis_cap.

The mismatch is logged either way: from the recompute forward, or (rl.behaviour_logprobs =
"engine") from the step's first update, whose forward runs at the same starting weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

__all__ = ["MismatchSums", "tis_weights"]


@dataclass
class MismatchSums:
    """Sums over one rank's tokens of |logp_trainer - logp_engine| (summed over the ranks
    that train on data, the max maxed), for rl/logp_mismatch_*."""

    tokens: float = 0.0
    diff_sum: float = 0.0
    diff_max: float = 0.0
    out_of_band: float = 0.0
    """Tokens whose ratio pi / pi_engine lies outside the PPO clip band [1 - clip_low,
    1 + clip_high]: the clip would act on them from the mismatch alone."""

    @classmethod
    def of(cls, trainer_logp: torch.Tensor, engine_logp: torch.Tensor, mask: torch.Tensor, rl) -> "MismatchSums":
        m = mask.to(torch.float64)
        d = (trainer_logp.double() - engine_logp.double()) * m
        band = (d < math.log1p(-rl.clip_low)) | (d > math.log1p(rl.clip_high))
        return cls(
            float(m.sum()),
            float(d.abs().sum()),
            float(d.abs().max()) if d.numel() else 0.0,
            float((band.double() * m).sum()),
        )

    @classmethod
    def from_update(cls, u) -> "MismatchSums":
        """From an update's stats (``UpdateStats``: its shard's mean, max and out-of-band
        fraction of |logp - b|)."""
        return cls(
            u.policy_tokens, u.logp_diff_mean * u.policy_tokens, u.logp_diff_max, u.out_of_band * u.policy_tokens
        )

    def __add__(self, other: "MismatchSums") -> "MismatchSums":
        return MismatchSums(
            self.tokens + other.tokens,
            self.diff_sum + other.diff_sum,
            max(self.diff_max, other.diff_max),
            self.out_of_band + other.out_of_band,
        )

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def tis_weights(
    trainer_logp_BL: torch.Tensor,
    engine_logp_BL: torch.Tensor,
    seq_index_BL: torch.Tensor,
    targets_BL: torch.Tensor,
    level: str,
    cap: float,
) -> torch.Tensor:
    """The TIS weight of every label token of a whole minibatch (0 off the completions): per
    token, or per completion (``seq_index``, 1-based) from the sum of its log-ratios."""
    m_BL = targets_BL.to(trainer_logp_BL.dtype)
    log_w_BL = (trainer_logp_BL - engine_logp_BL) * m_BL
    if level == "sequence":
        seq_BL = seq_index_BL.round().long() * targets_BL.long()
        S = int(seq_BL.max()) + 1 if seq_BL.numel() else 1
        log_w_Sq = torch.zeros(S, dtype=log_w_BL.dtype, device=log_w_BL.device).index_add(
            0, seq_BL.reshape(-1), log_w_BL.reshape(-1)
        )
        log_w_BL = log_w_Sq[seq_BL]
    elif level != "token":
        raise ValueError(f"rl.tis = {level!r} is not allowed; it must be one of 'off', 'token', 'sequence'")
    # The cap before the exp: a far off-policy sequence's product overflows, its weight is C.
    return torch.exp(log_w_BL.clamp(max=math.log(cap))) * m_BL
