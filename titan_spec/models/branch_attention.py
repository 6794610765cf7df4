# EAGLE-3 training-time-test (TTT) attention.
#
# At TTT step j the draft query at packed row t attends to
#   (a) trunk: the step-0 keys k0 at rows <= t of its document (document
#       causal, exactly doc_attention), and
#   (b) branch: the keys k_1[t] .. k_j[t] that steps 1..j produced at the SAME
#       row t (a diagonal: each row only sees its own branch history).
# Both parts share one softmax. We never build the (T x T*(Sb+1)) mask: the
# trunk runs through varlen flash kernels and the branch part is Sb dot
# products per row, then the two are merged with their log-sum-exps.
#
# The backward must use the MERGED (out, lse) for every part. Using the trunk's
# partial lse in its backward (SpecForge PR #536) silently drops the branch
# keys' share of the softmax normaliser. Ring attention (context parallel) can
# swap trunk_partials / trunk_backward for per-chunk versions and reuse
# branch_part, branch_backward and merge_partials unchanged.

import math

import torch

from titan_spec.models.attention import DocMetadata
from titan_spec.models.attention_blocks import merge_partials

__all__ = [
    "branch_backward",
    "branch_part",
    "trunk_backward",
    "trunk_partials",
    "ttt_attention",
]


def _heads_split(x_TNHd: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    T, N, H = x_TNHd.shape
    return x_TNHd.float().reshape(T, num_kv_heads, N // num_kv_heads, H)


# The branch math is a handful (J <= TTT steps) of per-row dot products. As
# einsum it lowers to a bmm over T*K tiny (G x H) @ (H x J) matrices, which on
# CPU is far slower than the flash trunk; a short loop over J of broadcast
# multiply + reduce is fast everywhere and keeps temporaries at q's size.


def _row_dot(a_TKvGqHd: torch.Tensor, b_TKvHd: torch.Tensor) -> torch.Tensor:
    return (a_TKvGqHd * b_TKvHd.float().unsqueeze(2)).sum(-1)


def _branch_scores(q_TKvGqHd: torch.Tensor, kb_SbTKvHd: torch.Tensor, scale: float) -> torch.Tensor:
    # Query head n reads kv head n // Gq: split N into (Kv, Gq) instead of
    # repeating kv heads.
    return torch.stack([_row_dot(q_TKvGqHd, kb_TKvHd) for kb_TKvHd in kb_SbTKvHd]) * scale


def _lse_TKvGq(lse_NT: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    N, T = lse_NT.shape
    return lse_NT.float().t().reshape(T, num_kv_heads, N // num_kv_heads)


def branch_part(
    q_TNHd: torch.Tensor,
    kb_SbTKvHd: torch.Tensor,
    vb_SbTKvHd: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Diagonal branch attention: row t attends to kb[0..J-1, t] only.

    Returns (out_TNHd in q's dtype, lse_NT fp32), computed in fp32 with no
    T x T tensor. With Sb = 0 there is no key: out = 0, lse = -inf.
    """
    T, N, _ = q_TNHd.shape
    J, _, K, Hv = vb_SbTKvHd.shape
    if J == 0:
        out_TNHd = q_TNHd.new_zeros(T, N, Hv)
        lse_NT = q_TNHd.new_full((N, T), -math.inf, dtype=torch.float32)
        return out_TNHd, lse_NT
    s_SbTKvGq = _branch_scores(_heads_split(q_TNHd, K), kb_SbTKvHd, scale)
    lse_TKvGq = torch.logsumexp(s_SbTKvGq, 0)
    p_SbTKvGq = torch.exp(s_SbTKvGq - lse_TKvGq)
    out_TKvGqHd = sum(
        p_TKvGq.unsqueeze(-1) * vb_TKvHd.float().unsqueeze(2) for p_TKvGq, vb_TKvHd in zip(p_SbTKvGq, vb_SbTKvHd)
    )
    out_TNHd = out_TKvGqHd.reshape(T, N, Hv).to(q_TNHd.dtype)
    return out_TNHd, lse_TKvGq.reshape(T, N).t().contiguous()


def branch_backward(
    dout_TNHd: torch.Tensor,
    q_TNHd: torch.Tensor,
    kb_SbTKvHd: torch.Tensor,
    vb_SbTKvHd: torch.Tensor,
    out_TNHd: torch.Tensor,
    lse_NT: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Branch part's share of the merged-softmax gradient: (dq, dkb, dvb).

    out_TNHd / lse_NT must be the MERGED ones over all parts; then
    dS = P * (dP - rowsum(dout * out)) with P = exp(S - lse) is exact.
    """
    J, T, K, Hv = vb_SbTKvHd.shape
    if J == 0:
        return tuple(torch.zeros_like(x) for x in (q_TNHd, kb_SbTKvHd, vb_SbTKvHd))
    q_TKvGqHd = _heads_split(q_TNHd, K)
    dout_TKvGqHd = _heads_split(dout_TNHd, K)
    lse_TKvGq = _lse_TKvGq(lse_NT, K)
    delta_TKvGq = (dout_TKvGqHd * _heads_split(out_TNHd, K)).sum(-1)
    dq_TKvGqHd = torch.zeros_like(q_TKvGqHd)
    dkb, dvb = [], []
    for kb_TKvHd, vb_TKvHd in zip(kb_SbTKvHd, vb_SbTKvHd):
        p_TKvGq = torch.exp(_row_dot(q_TKvGqHd, kb_TKvHd) * scale - lse_TKvGq)
        ds_TKvGq = p_TKvGq * (_row_dot(dout_TKvGqHd, vb_TKvHd) - delta_TKvGq) * scale
        dq_TKvGqHd = dq_TKvGqHd + ds_TKvGq.unsqueeze(-1) * kb_TKvHd.float().unsqueeze(2)
        dkb.append((ds_TKvGq.unsqueeze(-1) * q_TKvGqHd).sum(2))
        dvb.append((p_TKvGq.unsqueeze(-1) * dout_TKvGqHd).sum(2))
    return (
        dq_TKvGqHd.reshape(q_TNHd.shape).to(q_TNHd.dtype),
        torch.stack(dkb).to(kb_SbTKvHd.dtype),
        torch.stack(dvb).to(vb_SbTKvHd.dtype),
    )


def trunk_partials(
    q_TNHd: torch.Tensor,
    k0_TKvHd: torch.Tensor,
    v0_TKvHd: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_cpu: torch.Tensor,
    scale: float,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Trunk (document-causal) attention as a list of (out_TNHd, lse_NT) partials.

    One partial locally; a ring implementation returns one per kv chunk.
    """
    out_TNHd, lse_NT = torch.ops.titan_spec.doc_attn_fwd(q_TNHd, k0_TKvHd, v0_TKvHd, cu_seqlens, cu_seqlens_cpu, scale)
    return [(out_TNHd, lse_NT)]


def trunk_backward(
    dout_TNHd: torch.Tensor,
    q_TNHd: torch.Tensor,
    k0_TKvHd: torch.Tensor,
    v0_TKvHd: torch.Tensor,
    out_TNHd: torch.Tensor,
    lse_NT: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_cpu: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Trunk's share of the merged-softmax gradient, fed the MERGED (out, lse)."""
    return torch.ops.titan_spec.doc_attn_bwd(
        dout_TNHd,
        q_TNHd,
        k0_TKvHd,
        v0_TKvHd,
        out_TNHd,
        lse_NT,
        cu_seqlens,
        cu_seqlens_cpu,
        scale,
    )


class _TTTAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_TNHd, k0_TKvHd, v0_TKvHd, kb_SbTKvHd, vb_SbTKvHd, cu_seqlens, cu_host, scale):
        partials = trunk_partials(q_TNHd, k0_TKvHd, v0_TKvHd, cu_seqlens, cu_host, scale)
        partials.append(branch_part(q_TNHd, kb_SbTKvHd, vb_SbTKvHd, scale))
        out_TNHd, lse_NT = merge_partials([out for out, _ in partials], [lse for _, lse in partials])
        # The merge leaves out in (N, T, H) memory order. Returned so, torch 2.11's
        # dynamo hands this backward a zero dout (every gradient 0 when compiled);
        # the o-projection's reshape would copy it to this layout anyway.
        out_TNHd = out_TNHd.contiguous()
        ctx.save_for_backward(q_TNHd, k0_TKvHd, v0_TKvHd, kb_SbTKvHd, vb_SbTKvHd, cu_seqlens, cu_host, out_TNHd, lse_NT)
        ctx.scale = scale
        return out_TNHd

    @staticmethod
    def backward(ctx, dout_TNHd):
        q_TNHd, k0_TKvHd, v0_TKvHd, kb_SbTKvHd, vb_SbTKvHd, cu_seqlens, cu_host, out_TNHd, lse_NT = ctx.saved_tensors
        dq_trunk_TNHd, dk0_TKvHd, dv0_TKvHd = trunk_backward(
            dout_TNHd,
            q_TNHd,
            k0_TKvHd,
            v0_TKvHd,
            out_TNHd,
            lse_NT,
            cu_seqlens,
            cu_host,
            ctx.scale,
        )
        dq_branch_TNHd, dkb_SbTKvHd, dvb_SbTKvHd = branch_backward(
            dout_TNHd, q_TNHd, kb_SbTKvHd, vb_SbTKvHd, out_TNHd, lse_NT, ctx.scale
        )
        dq_TNHd = dq_trunk_TNHd + dq_branch_TNHd
        return dq_TNHd, dk0_TKvHd, dv0_TKvHd, dkb_SbTKvHd, dvb_SbTKvHd, None, None, None


def ttt_attention(
    q_TNHd: torch.Tensor,
    k0_TKvHd: torch.Tensor,
    v0_TKvHd: torch.Tensor,
    kb_SbTKvHd: torch.Tensor,
    vb_SbTKvHd: torch.Tensor,
    meta: DocMetadata,
    scale: float,
) -> torch.Tensor:
    """EAGLE-3 TTT attention at step j = J: one softmax over trunk + branch keys.

    q_TNHd: the step-j draft queries; k0/v0_TKvHd: step-0 keys/values (trunk);
    kb/vb_SbTKvHd: keys/values of steps 1..J at the same rows (J may be 0).
    Differentiable w.r.t. q, k0, v0, kb, vb. Returns out_TNHd in q's dtype.
    meta may also be a context-parallel shard (parallelisms/context_parallel.CPMetadata),
    which runs the trunk over its ring.
    """
    if not isinstance(meta, DocMetadata):
        return meta.ttt_attention(q_TNHd, k0_TKvHd, v0_TKvHd, kb_SbTKvHd, vb_SbTKvHd, scale)
    return _TTTAttention.apply(
        q_TNHd,
        k0_TKvHd,
        v0_TKvHd,
        kb_SbTKvHd,
        vb_SbTKvHd,
        meta.cu_seqlens,
        meta.cu_seqlens_cpu,
        scale,
    )
