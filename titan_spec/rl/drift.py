"""How far RL has moved the policy from where it started, measured on each step's rollouts.

The rollouts of a step are sampled from the policy of that step (the weights pushed before
it: the behaviour policy), so for completion tokens y_t ~ pi(. | y_<t) and the frozen copy
of the policy as it was before any RL update (``RLTrainer.reference``, the same copy the
optional KL penalty uses):

    k1 = mean_t [ log pi(y_t) - log pi_start(y_t) ]                  (sampled-token estimate)
    k3 = mean_t [ exp(d_t) - d_t - 1 ],  d_t = log pi_start(y_t) - log pi(y_t)

are both unbiased estimates of KL(pi || pi_start) per completion token (k3 is never
negative and has the lower variance; k1 is the definition read off the samples). Both are
exactly 0 while the policy still is the starting one (step 1, before any update), up to the
~1e-6 by which the engine's and the trainer's log-probs of the same tokens differ.

log pi(y_t) is the behaviour log-prob the engine sampled with, so every PPO epoch and
minibatch of a step measures the same policy; sums over several epochs keep the same mean.
"""

from __future__ import annotations

import torch
from torchtitan.components.loss import IGNORE_INDEX

__all__ = ["DriftMeter", "percentile_from_counts"]


class DriftMeter:
    """Sums of k1, k3 and completion tokens over the minibatches of one step."""

    def __init__(self):
        self.sums = {"drift_k1": 0.0, "drift_k3": 0.0, "drift_tokens": 0.0}

    @torch.no_grad()
    def add(self, behaviour_logp_BL: torch.Tensor, start_logp_BL: torch.Tensor, labels_BL: torch.Tensor) -> None:
        """One minibatch: the log-probs (at the rollout temperature) of the label tokens under
        the behaviour policy and the starting policy; only completion tokens count."""
        mask = (labels_BL != IGNORE_INDEX).to(torch.float64)
        k1 = (behaviour_logp_BL.double() - start_logp_BL.double()) * mask
        d = -k1
        self.sums["drift_k1"] += float(k1.sum())
        self.sums["drift_k3"] += float(((torch.exp(d) - d - 1.0) * mask).sum())
        self.sums["drift_tokens"] += float(mask.sum())

    def take(self) -> dict[str, float]:
        """The step's sums (to be reduced over ranks by SUM); resets the meter."""
        out, self.sums = self.sums, {k: 0.0 for k in self.sums}
        return out


def percentile_from_counts(counts: list[float], q: float) -> float:
    """The smallest value v with at least q of the mass at <= v, from counts[v] (a histogram
    of integer values 0..len-1, e.g. completion lengths summed over ranks)."""
    total = sum(counts)
    if total <= 0:
        return 0.0
    seen = 0.0
    for v, c in enumerate(counts):
        seen += c
        if seen >= q * total - 1e-9:
            return float(v)
    return float(len(counts) - 1)
