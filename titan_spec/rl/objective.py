"""The clipped policy-gradient objective every ``rl.loss`` shares, one token at a time.

Per completion token t of completion i, with policy log-prob logp_t, behaviour log-prob b_t
(the ratio's denominator: the engine's, or the trainer's recomputed, ``rl.behaviour_logprobs``)
and the completion's advantage A:

    r_t    = exp(logp_t - b_t)                                    (grpo, dapo)
           = exp(sg[log s_i] + logp_t - sg[logp_t]),              (gspo: value s_i, the
             log s_i = mean over i's tokens of (logp - b)          sequence ratio, per token)
    pg_t   = max(-A r_t, -A clip(r_t, 1 - eps_low, 1 + eps_high))  PPO-clip
    pg_t   = min(pg_t, -A c)  where A < 0                          dual-clip (rl.dual_clip = c)
    loss_t = w_tis_t * pg_t + beta * kl_t                          TIS (rl.tis), KL (rl.kl_estimator)
    loss   = sum_t agg_t * loss_t                                   aggregation (rl.loss_agg)

with the aggregation written as a per-token weight agg_t over the counts of the WHOLE
minibatch summed over the data-parallel ranks (N tokens, S completions), so the shards of
context parallelism and the microbatches of pipeline parallelism add up to the whole
minibatch's loss whatever the mode:

    token-mean               1 / N
    seq-mean-token-mean      1 / (S * n_i)      n_i = completion i's tokens ("seq_tokens")
    seq-mean-token-sum       1 / S
    seq-mean-token-sum-norm  1 / (S * norm)     norm = rl.loss_agg_norm or rl.max_new_tokens

The statistics follow verl and TRL: ``clip_fraction`` counts the tokens where the clip
takes effect (the clipped term is the larger loss: the ratio left the band on the side
the advantage pushes it), ``dual_clip_fraction`` those where the dual cap does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchtitan.components.loss import IGNORE_INDEX

from titan_spec.rl.logprobs import token_logprobs

__all__ = [
    "PolicyLossOutput",
    "policy_objective",
    "aggregation_weights",
    "kl_estimate",
    "resolved_agg",
    "MAX_LOG_RATIO",
    "MAX_SEQ_LOG_RATIO",
    "KL_CLAMP",
    "ClippedPolicyLoss",
]

MAX_LOG_RATIO = 20.0
"""Cap on |logp - b| per token before the exp (verl's): a token far off the behaviour policy
gives a large finite ratio (its loss is clipped anyway), never inf * 0 = nan."""

MAX_SEQ_LOG_RATIO = 10.0
"""Cap on GSPO's log s_i (verl's): keeps the sequence ratio finite far off-policy."""

KL_CLAMP = 10.0
"""k3 per token is clamped to [-KL_CLAMP, KL_CLAMP] (verl's low_var_kl), its log-ratio to
[-MAX_LOG_RATIO, MAX_LOG_RATIO] before the exp."""

DEFAULT_AGG = {"grpo": "token-mean", "dapo": "token-mean", "gspo": "seq-mean-token-mean"}
"""rl.loss_agg = "default" per rl.loss: token-level for PPO-clip (titan_spec's and DAPO's
choice, torchtitan's LM normalization), per-sequence for GSPO (its paper's)."""


def resolved_agg(rl) -> str:
    """rl.loss_agg with "default" resolved for rl.loss."""
    return DEFAULT_AGG[rl.loss] if rl.loss_agg == "default" else rl.loss_agg


@dataclass
class PolicyLossOutput:
    loss: torch.Tensor
    """This rank's share of the minibatch's loss (the shares sum to the whole minibatch's)."""
    clip_fraction: torch.Tensor
    """Fraction of this rank's tokens where the PPO clip takes effect (detached; verl's
    pg_clipfrac, TRL's clip_ratio/region_mean)."""
    dual_clip_fraction: torch.Tensor
    """Fraction of this rank's tokens where the dual-clip cap takes effect (detached; 0 off)."""
    kl: torch.Tensor
    """Mean KL estimate to the reference over this rank's tokens (detached; 0 without one)."""
    ratio_dev: torch.Tensor
    """max |r - 1| over this rank's tokens (detached)."""
    logp_diff_mean: torch.Tensor
    """Mean |logp - b| over this rank's tokens (detached): at the step's first update, with
    the engine's log-probs as b, the engine/trainer mismatch."""
    logp_diff_max: torch.Tensor
    """max |logp - b| over this rank's tokens (detached)."""
    out_of_band: torch.Tensor
    """Fraction of this rank's tokens whose per-token ratio exp(logp - b) lies outside
    [1 - eps_low, 1 + eps_high], whatever the advantage (detached)."""


def kl_estimate(logp_T: torch.Tensor, ref_logp_T: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from samples of the policy, d = logp - ref:
    k1 = d (unbiased, high variance, can be negative), k2 = d^2 / 2, k3 = exp(-d) + d - 1
    (unbiased, >= 0; Schulman's low-variance estimator, verl's low_var_kl with its clamps)."""
    d_T = logp_T - ref_logp_T
    if estimator == "k1":
        return d_T
    if estimator == "k2":
        return 0.5 * d_T.square()
    if estimator == "k3":
        neg_T = (-d_T).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        return (torch.exp(neg_T) - neg_T - 1.0).clamp(-KL_CLAMP, KL_CLAMP)
    raise ValueError(f"rl.kl_estimator = {estimator!r} is not allowed; it must be one of 'k1', 'k2', 'k3'")


def aggregation_weights(
    mask_T: torch.Tensor, seq_tokens_T: torch.Tensor, counts: dict, agg: str, norm: float, dtype: torch.dtype
) -> torch.Tensor:
    """agg_t of the module docstring: each kept token's weight in the minibatch's loss.
    ``counts``: "tokens" N and "sequences" S of the kept completions over all data-parallel
    ranks; ``seq_tokens_T``: each token's completion length n_i."""
    m_T = mask_T.to(dtype)
    n = torch.as_tensor(counts["tokens"], dtype=dtype, device=m_T.device).clamp(min=1)
    s = torch.as_tensor(counts["sequences"], dtype=dtype, device=m_T.device).clamp(min=1)
    if agg == "token-mean":
        return m_T / n
    if agg == "seq-mean-token-mean":
        return m_T / (s * seq_tokens_T.to(dtype).clamp(min=1))
    if agg == "seq-mean-token-sum":
        return m_T / s
    if agg == "seq-mean-token-sum-norm":
        return m_T / (s * norm)
    raise ValueError(f"rl.loss_agg = {agg!r} is not allowed")


def _sequence_log_ratio(log_ratio_T: torch.Tensor, seq_T: torch.Tensor, mask_T: torch.Tensor) -> torch.Tensor:
    """GSPO per token: log s_i of the token's completion (the mean of its tokens' log-ratios,
    detached) + logp_t - sg[logp_t], so the value is log s_i and the gradient d logp_t."""
    dt = log_ratio_T.dtype
    m_T = mask_T.to(dt)
    seq_T = (seq_T.round().long() * mask_T.long()).reshape(-1)
    S = int(seq_T.max()) + 1 if seq_T.numel() else 1
    zeros_Sq = torch.zeros(S, dtype=dt, device=log_ratio_T.device)
    count_Sq = zeros_Sq.index_add(0, seq_T, m_T).clamp(min=1)
    log_s_Sq = zeros_Sq.index_add(0, seq_T, log_ratio_T.detach() * m_T) / count_Sq
    return (log_ratio_T - log_ratio_T.detach() + log_s_Sq[seq_T]).clamp(max=MAX_SEQ_LOG_RATIO)


def policy_objective(
    logp_T: torch.Tensor,
    values_T: dict[str, torch.Tensor],
    mask_T: torch.Tensor,
    counts: dict,
    rl,
    *,
    sequence_ratio: bool = False,
    ref_logp_T: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """The module docstring's loss over one rank's tokens. ``values_T``: "behaviour_logp",
    "advantages", and as the settings need them "seq_index" (gspo), "seq_tokens"
    (seq-mean aggregations), "tis_weight" (rl.tis); ``mask_T`` selects the tokens that take
    part; ``rl``: the [rl] section."""
    dt = logp_T.dtype
    m_T = mask_T.to(dt)
    adv_T = values_T["advantages"].to(dt)
    diff_T = logp_T - values_T["behaviour_logp"].to(dt)
    log_ratio_T = diff_T.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    if sequence_ratio:
        log_ratio_T = _sequence_log_ratio(log_ratio_T, values_T["seq_index"], mask_T)
    ratio_T = torch.exp(log_ratio_T)
    unclipped_T = -adv_T * ratio_T
    clipped_T = -adv_T * ratio_T.clamp(1.0 - rl.clip_low, 1.0 + rl.clip_high)
    pg_T = torch.maximum(unclipped_T, clipped_T)
    dual_T = torch.zeros_like(m_T, dtype=torch.bool)
    if rl.dual_clip:
        cap_T = -adv_T * rl.dual_clip
        dual_T = (adv_T < 0) & (pg_T > cap_T)
        pg_T = torch.where(adv_T < 0, torch.minimum(pg_T, cap_T), pg_T)
    if "tis_weight" in values_T:
        pg_T = pg_T * values_T["tis_weight"].to(dt)
    loss_T = pg_T
    kl = torch.zeros((), dtype=dt, device=logp_T.device)
    if ref_logp_T is not None and rl.kl_beta > 0:
        kl_T = kl_estimate(logp_T, ref_logp_T.to(dt), rl.kl_estimator)
        loss_T = loss_T + rl.kl_beta * kl_T
        kl = (kl_T * m_T).sum().detach() / m_T.sum().clamp(min=1)
    norm = float(rl.loss_agg_norm or rl.max_new_tokens)
    agg_T = aggregation_weights(mask_T, values_T.get("seq_tokens", m_T), counts, resolved_agg(rl), norm, dt)
    loss = (loss_T * agg_T).sum()
    with torch.no_grad():
        n = m_T.sum().clamp(min=1)
        frac = lambda b_T: (b_T.to(dt) * m_T).sum() / n
        token_ratio_T = torch.exp(diff_T.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
        abs_diff_T = diff_T.abs() * m_T
        out = PolicyLossOutput(
            loss=loss,
            clip_fraction=frac(clipped_T > unclipped_T),
            dual_clip_fraction=frac(dual_T),
            kl=kl,
            ratio_dev=((ratio_T - 1.0).abs() * m_T).max() if m_T.numel() else torch.zeros((), dtype=dt),
            logp_diff_mean=abs_diff_T.sum() / n,
            logp_diff_max=abs_diff_T.max() if m_T.numel() else torch.zeros((), dtype=dt),
            out_of_band=frac((token_ratio_T < 1.0 - rl.clip_low) | (token_ratio_T > 1.0 + rl.clip_high)),
        )
    return out


@dataclass
class ClippedPolicyLoss:
    """The policy loss of one minibatch (a ``training.co_training.PolicyLoss``): the policy's
    log-probs at the rollout temperature from the logits, ``policy_objective`` over the
    tokens that ``keep`` keeps. rl/grpo.py, rl/dapo.py and rl/gspo.py are its kinds (the
    registry: rl/losses.py)."""

    values_BL: dict[str, torch.Tensor]
    """The per-token values (RLTrainer.token_values) of this rank's shard or microbatch."""
    totals: dict[str, torch.Tensor]
    """"tokens" and "sequences" kept in the WHOLE minibatch, over all data-parallel ranks."""
    rl: object
    """The [rl] section."""
    ref_logp_BL: torch.Tensor | None = None

    sequence_ratio = False
    """True: GSPO's sequence-level ratio (a class attribute of each kind)."""

    @staticmethod
    def keep(values_BL: dict[str, torch.Tensor], rl) -> torch.Tensor:
        """1 on the tokens that take part in the loss (every completion token here)."""
        return torch.ones_like(values_BL["advantages"])

    @classmethod
    def counts(cls, values_BL: dict[str, torch.Tensor], targets_BL: torch.Tensor, rl) -> dict[str, torch.Tensor]:
        """The kept tokens and completions of the (unsharded) minibatch (rl/losses.py)."""
        kept_BL = targets_BL & (cls.keep(values_BL, rl) > 0)
        return {"tokens": kept_BL.sum(), "sequences": torch.unique(values_BL["seq_index"][kept_BL]).numel()}

    @classmethod
    def from_values(cls, values: dict[str, torch.Tensor], counts: dict, rl, ref_logp_BL=None) -> "ClippedPolicyLoss":
        return cls(values, counts, rl, ref_logp_BL)

    def __call__(self, logits_BLV, labels_BL, global_valid_tokens) -> tuple[torch.Tensor, PolicyLossOutput]:
        del global_valid_tokens  # the kept tokens' count (self.totals) replaces it
        rl = self.rl
        mask_T = ((labels_BL != IGNORE_INDEX) & (self.keep(self.values_BL, rl) > 0)).reshape(-1)
        out = policy_objective(
            token_logprobs(logits_BLV, labels_BL, rl.temperature).reshape(-1),
            {k: v.reshape(-1) for k, v in self.values_BL.items()},
            mask_T,
            self.totals,
            rl,
            sequence_ratio=self.sequence_ratio,
            ref_logp_T=None if self.ref_logp_BL is None else self.ref_logp_BL.reshape(-1),
        )
        return out.loss, out
