"""GSPO (Zheng et al. 2025, arXiv 2507.18071): the importance ratio of a whole sequence,
clipped per sequence (``rl.loss = "gspo"``).

Per completion i of |y_i| tokens with advantage A_i, policy log-probs logp_t and behaviour
log-probs b_t:

    s_i    = exp( (1/|y_i|) sum_t (logp_t - b_t) )     (the geometric mean of the token ratios)
    loss_i = -min(s_i * A_i, clip(s_i, 1 - eps_low, 1 + eps_high) * A_i)
    loss   = sum_i loss_i / (completions over all data-parallel ranks)

so every token of a sequence gets the gradient s_i * A_i / |y_i| * d logp_t (none when the
sequence is clipped), the paper's eq. (5)-(7). It is written per token as verl writes it
(``s_i,t = sg[s_i] * pi_t / sg[pi_t]``, rl/objective.py), aggregated
"seq-mean-token-mean" by default: the same value and gradient, and then dual-clip, TIS and
the other aggregations apply as they do to the token-level losses. As verl does, log s_i is
capped at 10 before the exp. The paper's clip ranges are tiny because s_i is a per-token
geometric mean: eps_low = 3e-4, eps_high = 4e-4 (set ``rl.clip_low`` / ``rl.clip_high``).
Sequences are found by the per-token ``seq_index`` the trainer packs (1-based per rank's
minibatch, 0 off the completions); a sequence must lie whole on one rank (config
validation refuses GSPO under context parallelism).
"""

from __future__ import annotations

from titan_spec.rl.objective import ClippedPolicyLoss

__all__ = ["GSPOPolicyLoss"]


class GSPOPolicyLoss(ClippedPolicyLoss):
    """GSPO's policy loss: the sequence ratio per token over every completion token."""

    sequence_ratio = True
