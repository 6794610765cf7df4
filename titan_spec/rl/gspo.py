"""GSPO (Zheng et al. 2025, arXiv 2507.18071): the importance ratio of a whole sequence,
clipped per sequence (``rl.loss = "gspo"``).

Shape legend: T = packed tokens, S = sequences (completions) of this rank's minibatch,
B = packed rows, L = row length.

Per completion i of |y_i| tokens with advantage A_i, policy log-probs logp_t and behaviour
log-probs b_t:

    s_i    = exp( (1/|y_i|) sum_t (logp_t - b_t) )     (the geometric mean of the token ratios)
    loss_i = -min(s_i * A_i, clip(s_i, 1 - eps_low, 1 + eps_high) * A_i)
    loss   = sum_i loss_i / (completions over all data-parallel ranks)

so every token of a sequence gets the gradient s_i * A_i / |y_i| * d logp_t (none when the
sequence is clipped), the paper's eq. (5)-(7). verl writes the same objective per token
(``s_i,t = sg[s_i] * pi_t / sg[pi_t]``, aggregated "seq-mean-token-mean"): equal value and
gradient. As verl does, log s_i is capped at 10 before the exp (a far off-policy sequence
gives a large finite ratio, not inf). The paper's clip ranges are tiny because s_i is a
per-token geometric mean: eps_low = 3e-4, eps_high = 4e-4 (set ``rl.clip_low`` /
``rl.clip_high``). The optional k3 KL to the reference is averaged per sequence like the
ratio. Sequences are found by the per-token ``seq_index`` the trainer packs (1-based per
rank's minibatch, 0 off the completions); a sequence must lie whole on one rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchtitan.components.loss import IGNORE_INDEX

from titan_spec.rl.grpo import PolicyLossOutput, token_logprobs

__all__ = ["GSPOPolicyLoss", "gspo_loss", "MAX_LOG_RATIO"]

MAX_LOG_RATIO = 10.0
"""Cap on log s_i (verl's): keeps the ratio finite for a sequence far off the behaviour policy."""


def gspo_loss(
    logp_T: torch.Tensor,
    behaviour_logp_T: torch.Tensor,
    advantages_T: torch.Tensor,
    mask_T: torch.Tensor,
    seq_T: torch.Tensor,
    global_sequences: torch.Tensor | int,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    ref_logp_T: torch.Tensor | None = None,
    kl_beta: float = 0.0,
) -> PolicyLossOutput:
    """GSPO over packed tokens: ``mask_T`` selects completion tokens, ``seq_T`` (integer
    valued) names each token's sequence. Stats: ``clip_fraction`` is the share of this
    rank's completion TOKENS whose sequence was clipped (token-weighted like PPO's, so the
    trainer's reduction over ranks is the same), ``ratio_dev`` is max |s_i - 1|."""
    dt = logp_T.dtype
    m_T = mask_T.to(dt)
    seq_T = (seq_T.round().long() * mask_T.long()).reshape(-1)
    S = int(seq_T.max()) + 1 if seq_T.numel() else 1
    count_S = torch.zeros(S, dtype=dt, device=logp_T.device).index_add(0, seq_T, m_T)
    present_S = count_S > 0
    denom_S = count_S.clamp(min=1)

    def seq_mean(x_T: torch.Tensor) -> torch.Tensor:
        return torch.zeros(S, dtype=dt, device=logp_T.device).index_add(0, seq_T, x_T * m_T) / denom_S

    log_s_S = seq_mean(logp_T - behaviour_logp_T)
    s_S = torch.exp(log_s_S.clamp(max=MAX_LOG_RATIO))
    adv_S = seq_mean(advantages_T.to(dt))  # one advantage per completion: its tokens' mean is it
    per_seq_S = -torch.minimum(s_S * adv_S, s_S.clamp(1.0 - clip_low, 1.0 + clip_high) * adv_S)
    kl = torch.zeros((), dtype=dt, device=logp_T.device)
    if ref_logp_T is not None and kl_beta > 0:
        d_T = ref_logp_T - logp_T
        kl_S = seq_mean(torch.exp(d_T) - d_T - 1.0)
        per_seq_S = per_seq_S + kl_beta * kl_S
        kl = (kl_S * count_S).sum().detach() / count_S.sum().clamp(min=1)
    norm = torch.as_tensor(global_sequences, dtype=dt, device=logp_T.device).clamp(min=1)
    loss = (per_seq_S * present_S.to(dt)).sum() / norm
    with torch.no_grad():
        clipped_S = ((s_S < 1.0 - clip_low) | (s_S > 1.0 + clip_high)) & present_S
        clip_fraction = (clipped_S.to(dt) * count_S).sum() / count_S.sum().clamp(min=1)
        dev_S = (s_S - 1.0).abs() * present_S.to(dt)
        ratio_dev = dev_S.max() if dev_S.numel() else torch.zeros((), dtype=dt)
    return PolicyLossOutput(loss=loss, clip_fraction=clip_fraction, kl=kl, ratio_dev=ratio_dev)


@dataclass
class GSPOPolicyLoss:
    """GSPO's policy loss of one minibatch (a ``co_training.PolicyLoss``)."""

    behaviour_logp_BL: torch.Tensor
    advantages_BL: torch.Tensor
    seq_index_BL: torch.Tensor
    """Each label token's completion (1-based within this rank's minibatch; 0 elsewhere)."""
    global_sequences: torch.Tensor
    """The minibatch's completions over all data-parallel ranks (the normalizer)."""
    rl: object
    """The [rl] section (temperature, clip_low, clip_high, kl_beta)."""
    ref_logp_BL: torch.Tensor | None = None

    @staticmethod
    def counts(values_BL: dict[str, torch.Tensor], targets_BL: torch.Tensor, rl) -> dict[str, int]:
        """The completions of the (unsharded) minibatch (rl/losses.py)."""
        return {"sequences": torch.unique(values_BL["seq_index"][targets_BL]).numel()}

    @classmethod
    def from_values(cls, values: dict[str, torch.Tensor], counts: dict, rl, ref_logp_BL=None) -> "GSPOPolicyLoss":
        return cls(values["behaviour_logp"], values["advantages"], values["seq_index"], counts["sequences"], rl,
                   ref_logp_BL)

    def __call__(self, logits_BLV, labels_BL, global_valid_tokens) -> tuple[torch.Tensor, PolicyLossOutput]:
        del global_valid_tokens  # GSPO averages over sequences, not tokens
        rl = self.rl
        out = gspo_loss(
            token_logprobs(logits_BLV, labels_BL, rl.temperature).reshape(-1),
            self.behaviour_logp_BL.reshape(-1), self.advantages_BL.reshape(-1),
            (labels_BL != IGNORE_INDEX).reshape(-1), self.seq_index_BL.reshape(-1), self.global_sequences,
            clip_low=rl.clip_low, clip_high=rl.clip_high,
            ref_logp_T=None if self.ref_logp_BL is None else self.ref_logp_BL.reshape(-1), kl_beta=rl.kl_beta,
        )
        return out.loss, out
