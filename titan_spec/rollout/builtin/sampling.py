"""The built-in engine's sampling: the sampling distribution, one draw per row, the
speculative acceptance rule and the behaviour log-probs.

Shape letters (titan_spec/shapes.py): here T is the flat rows of logits, one token drawn per row,
and a verify call's L is K + 1.

Speculative sampling (Leviathan et al. / Chen et al.): accept draft d_i with probability
min(1, p_i(d_i) / q_i(d_i)); at the first rejection sample from normalize(max(0, p_i - q_i));
if all K pass, sample a bonus token from p_{K+1}. The output then follows the target's
(tempered, top-k/top-p filtered) distribution p exactly, whatever the draft's q. Greedy
(T = 0) is the one-hot case: accept iff d_i == argmax p_i. Every draw of a call comes from
the call's one generator, in a fixed order, so a seeded call repeats exactly.
"""

from __future__ import annotations

import torch

from titan_spec.rollout.base import SamplingParams

__all__ = ["accept", "behaviour_logprobs", "filtered_probs", "sample", "sample_rows", "speculative_accept"]


def filtered_probs(logits_TV: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """The sampling distribution: softmax(logits / T) after top-k and top-p; one-hot at T = 0."""
    if sampling.greedy:
        return torch.zeros_like(logits_TV, dtype=torch.float32).scatter_(-1, logits_TV.argmax(-1, keepdim=True), 1.0)
    logits_TV = logits_TV.float() / sampling.temperature
    V = logits_TV.shape[-1]
    if 0 < sampling.top_k < V:
        kth_T1 = logits_TV.topk(sampling.top_k, dim=-1).values[..., -1:]
        logits_TV = logits_TV.masked_fill(logits_TV < kth_T1, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_TV, order_TV = logits_TV.sort(dim=-1, descending=True)
        p_sorted_TV = sorted_TV.softmax(-1)
        # Drop a token when the mass strictly before it already reaches top_p (the top one stays).
        drop_TV = (p_sorted_TV.cumsum(-1) - p_sorted_TV) >= sampling.top_p
        logits_TV = logits_TV.scatter(-1, order_TV, sorted_TV.masked_fill(drop_TV, float("-inf")))
    return logits_TV.softmax(-1)


def sample_rows(probs_TV: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
    """One index per row, drawn with probability proportional to the row's (non-negative,
    not necessarily normalized) entries: the inverse CDF at one uniform per row.

    Why not torch.multinomial: on CPU it draws one exponential per vocabulary entry, which
    dominates at a real vocabulary's size, and a speculative round samples K + 1 times. The CDF is summed in float64 and the uniform is float32
    (< 1 - 2**-24), so u * total < total exactly: the index found is one whose entry is
    > 0 (a zero entry spans an empty interval of the CDF)."""
    cdf_TV = probs_TV.double().cumsum(-1)
    u_T1 = torch.rand(probs_TV.shape[0], 1, device=probs_TV.device, generator=gen) * cdf_TV[:, -1:]
    return torch.searchsorted(cdf_TV, u_T1, right=True)[:, 0]


def sample(logits_TV: torch.Tensor, sp: SamplingParams, gen: torch.Generator | None):
    """One token per row from the sampling distribution -> (idx_T, probs_TV); greedy: the
    argmax and None (no softmax: the one-hot needs none)."""
    if sp.greedy:
        return logits_TV.argmax(-1), None
    probs_TV = filtered_probs(logits_TV, sp)
    return sample_rows(probs_TV, gen), probs_TV


def speculative_accept(
    p_BLV: torch.Tensor,
    d_BK: torch.Tensor,
    d_idx_BK: torch.Tensor,
    q_BKVd: torch.Tensor,
    d2t_Vd: torch.Tensor,
    gen: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampled acceptance rule (module docstring) on plain tensors, K >= 1.

    p_BLV: the target's sampling distributions p_1..p_{K+1} (filtered_probs of the verify
    logits); d_BK / d_idx_BK: the draft tokens as target / draft-vocab ids; q_BKVd: the
    draft distributions they were sampled from; d2t_Vd: target id of each draft id.
    Returns (a_B accepted draft tokens, new_BL: the a+1 committed tokens, left-aligned;
    entries past a+1 are filler). Draws u_BK first, then one sample_rows draw per row.
    """
    B, L, V = p_BLV.shape
    K = L - 1
    rows_B = torch.arange(B, device=p_BLV.device)
    p_d_BK = p_BLV[:, :K].gather(-1, d_BK[..., None])[..., 0]
    q_d_BK = q_BKVd.gather(-1, d_idx_BK[..., None])[..., 0]  # > 0: d was sampled from q
    u_BK = torch.rand(B, K, device=p_BLV.device, generator=gen)
    ok_BK = (u_BK * q_d_BK < p_d_BK).long()  # u < p/q, i.e. accept with prob min(1, p/q)
    a_B = ok_BK.cumprod(1).sum(1)
    # Residual at the first rejection a < K: max(0, p_a - q_a) with q mapped to target ids;
    # at a == K the padded q row is zero, so the residual is p_{K+1}: the bonus token.
    q_pad_BLVd = torch.cat([q_BKVd, q_BKVd.new_zeros(B, 1, q_BKVd.shape[-1])], dim=1)
    q_a_BV = torch.zeros(B, V, device=p_BLV.device, dtype=p_BLV.dtype)
    q_a_BV.scatter_(1, d2t_Vd.expand(B, -1), q_pad_BLVd[rows_B, a_B])
    p_a_BV = p_BLV[rows_B, a_B]
    r_BV = (p_a_BV - q_a_BV).clamp(min=0)
    # p == q up to rounding: a rejection (probability ~0) falls back to p itself.
    r_BV = torch.where(r_BV.sum(-1, keepdim=True) > 0, r_BV, p_a_BV)
    y_B = sample_rows(r_BV, gen)
    new_BL = torch.cat([d_BK, d_BK[:, :1]], dim=1)
    new_BL[rows_B, a_B] = y_B
    return a_B, new_BL


def accept(logits_BLV, d_BK, d_idx_BK, q_BKVd, d2t_Vd, sp: SamplingParams, gen):
    """A round's verify logits over [pending token, d_1..d_K] -> (a_B accepted draft
    tokens, new_BL: the a+1 committed tokens, left-aligned). K = 0 (d_BK None): one token
    from p_1, a plain decode step."""
    B, L, V = logits_BLV.shape
    K = L - 1
    if sp.greedy:
        arg_BL = logits_BLV.argmax(-1)
        if K == 0:
            return torch.zeros(B, dtype=torch.long, device=arg_BL.device), arg_BL
        # Accepted draft tokens equal the target's argmax, and so does the token after them.
        match_BK = (d_BK == arg_BL[:, :K]).long()
        return match_BK.cumprod(1).sum(1), arg_BL
    p_BLV = filtered_probs(logits_BLV, sp)
    if K == 0:
        return torch.zeros(B, dtype=torch.long, device=p_BLV.device), sample_rows(p_BLV[:, 0], gen)[:, None]
    return speculative_accept(p_BLV, d_BK, d_idx_BK, q_BKVd, d2t_Vd, gen)


def behaviour_logprobs(logits_BLV: torch.Tensor, tokens_BL: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """log_softmax(logits / T) at the emitted tokens, before top-k/top-p: what RL's
    importance ratio reads. Greedy uses T = 1 (a one-hot would give 0 / -inf, useless to RL)."""
    t = sampling.temperature if not sampling.greedy else 1.0
    logits_BLV = logits_BLV.float()
    logp_BLV = torch.log_softmax(logits_BLV / t if t != 1.0 else logits_BLV, dim=-1)
    return logp_BLV.gather(-1, tokens_BL[..., None])[..., 0]
