# EAGLE-3 training-time-test (TTT) attention.
#
# Shape suffix legend:
#   T = packed tokens, N = query heads, K = kv heads (GQA: N % K == 0),
#   G = N // K, H = head dim, J = branch steps so far (0 .. TTT steps - 1),
#   P = partials
#
# At TTT step j the draft query at packed row t attends to
#   (a) trunk: the step-0 keys k0 at rows <= t of its document (document
#       causal, exactly doc_attention), and
#   (b) branch: the keys k_1[t] .. k_j[t] that steps 1..j produced at the SAME
#       row t (a diagonal: each row only sees its own branch history).
# Both parts share one softmax. We never build the (T x T*(J+1)) mask: the
# trunk runs through varlen flash kernels and the branch part is J dot
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


def _heads_split(x_TNH: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    T, N, H = x_TNH.shape
    return x_TNH.float().reshape(T, num_kv_heads, N // num_kv_heads, H)


# The branch math is a handful (J <= TTT steps) of per-row dot products. As
# einsum it lowers to a bmm over T*K tiny (G x H) @ (H x J) matrices, which on
# CPU was ~100x slower than the flash trunk; a short loop over J of broadcast
# multiply + reduce is fast everywhere and keeps temporaries at q's size.


def _row_dot(a_TKGH: torch.Tensor, b_TKH: torch.Tensor) -> torch.Tensor:
    return (a_TKGH * b_TKH.float().unsqueeze(2)).sum(-1)


def _branch_scores(
    q_TKGH: torch.Tensor, kb_JTKH: torch.Tensor, scale: float
) -> torch.Tensor:
    # Query head n reads kv head n // G: split N into (K, G) instead of
    # repeating kv heads.
    return torch.stack([_row_dot(q_TKGH, kb_TKH) for kb_TKH in kb_JTKH]) * scale


def _lse_TKG(lse_NT: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    N, T = lse_NT.shape
    return lse_NT.float().t().reshape(T, num_kv_heads, N // num_kv_heads)


def branch_part(
    q_TNH: torch.Tensor,
    kb_JTKH: torch.Tensor,
    vb_JTKH: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Diagonal branch attention: row t attends to kb[0..J-1, t] only.

    Returns (out_TNH in q's dtype, lse_NT fp32), computed in fp32 with no
    T x T tensor. With J = 0 there is no key: out = 0, lse = -inf.
    """
    T, N, _ = q_TNH.shape
    J, _, K, Hv = vb_JTKH.shape
    if J == 0:
        out_TNH = q_TNH.new_zeros(T, N, Hv)
        lse_NT = q_TNH.new_full((N, T), -math.inf, dtype=torch.float32)
        return out_TNH, lse_NT
    s_JTKG = _branch_scores(_heads_split(q_TNH, K), kb_JTKH, scale)
    lse_TKG = torch.logsumexp(s_JTKG, 0)
    p_JTKG = torch.exp(s_JTKG - lse_TKG)
    out_TKGH = sum(
        p_TKG.unsqueeze(-1) * vb_TKH.float().unsqueeze(2)
        for p_TKG, vb_TKH in zip(p_JTKG, vb_JTKH)
    )
    out_TNH = out_TKGH.reshape(T, N, Hv).to(q_TNH.dtype)
    return out_TNH, lse_TKG.reshape(T, N).t().contiguous()


def branch_backward(
    dout_TNH: torch.Tensor,
    q_TNH: torch.Tensor,
    kb_JTKH: torch.Tensor,
    vb_JTKH: torch.Tensor,
    out_TNH: torch.Tensor,
    lse_NT: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Branch part's share of the merged-softmax gradient: (dq, dkb, dvb).

    out_TNH / lse_NT must be the MERGED ones over all parts; then
    dS = P * (dP - rowsum(dout * out)) with P = exp(S - lse) is exact.
    """
    J, T, K, Hv = vb_JTKH.shape
    if J == 0:
        return tuple(torch.zeros_like(x) for x in (q_TNH, kb_JTKH, vb_JTKH))
    q_TKGH = _heads_split(q_TNH, K)
    dout_TKGH = _heads_split(dout_TNH, K)
    lse_TKG = _lse_TKG(lse_NT, K)
    delta_TKG = (dout_TKGH * _heads_split(out_TNH, K)).sum(-1)
    dq_TKGH = torch.zeros_like(q_TKGH)
    dkb, dvb = [], []
    for kb_TKH, vb_TKH in zip(kb_JTKH, vb_JTKH):
        p_TKG = torch.exp(_row_dot(q_TKGH, kb_TKH) * scale - lse_TKG)
        ds_TKG = p_TKG * (_row_dot(dout_TKGH, vb_TKH) - delta_TKG) * scale
        dq_TKGH = dq_TKGH + ds_TKG.unsqueeze(-1) * kb_TKH.float().unsqueeze(2)
        dkb.append((ds_TKG.unsqueeze(-1) * q_TKGH).sum(2))
        dvb.append((p_TKG.unsqueeze(-1) * dout_TKGH).sum(2))
    return (
        dq_TKGH.reshape(q_TNH.shape).to(q_TNH.dtype),
        torch.stack(dkb).to(kb_JTKH.dtype),
        torch.stack(dvb).to(vb_JTKH.dtype),
    )


def trunk_partials(
    q_TNH: torch.Tensor,
    k0_TKH: torch.Tensor,
    v0_TKH: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_cpu: torch.Tensor,
    scale: float,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Trunk (document-causal) attention as a list of (out_TNH, lse_NT) partials.

    One partial locally; a ring implementation returns one per kv chunk.
    """
    out_TNH, lse_NT = torch.ops.titan_spec.doc_attn_fwd(
        q_TNH, k0_TKH, v0_TKH, cu_seqlens, cu_seqlens_cpu, scale
    )
    return [(out_TNH, lse_NT)]


def trunk_backward(
    dout_TNH: torch.Tensor,
    q_TNH: torch.Tensor,
    k0_TKH: torch.Tensor,
    v0_TKH: torch.Tensor,
    out_TNH: torch.Tensor,
    lse_NT: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_cpu: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Trunk's share of the merged-softmax gradient, fed the MERGED (out, lse)."""
    return torch.ops.titan_spec.doc_attn_bwd(
        dout_TNH, q_TNH, k0_TKH, v0_TKH, out_TNH, lse_NT,
        cu_seqlens, cu_seqlens_cpu, scale,
    )


class _TTTAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, q_TNH, k0_TKH, v0_TKH, kb_JTKH, vb_JTKH, cu_seqlens, cu_host, scale
    ):
        partials = trunk_partials(q_TNH, k0_TKH, v0_TKH, cu_seqlens, cu_host, scale)
        partials.append(branch_part(q_TNH, kb_JTKH, vb_JTKH, scale))
        out_TNH, lse_NT = merge_partials(
            [out for out, _ in partials], [lse for _, lse in partials]
        )
        # The merge leaves out in (N, T, H) memory order. Returned so, torch 2.11's
        # dynamo hands this backward a zero dout (every gradient 0 when compiled);
        # the o-projection's reshape would copy it to this layout anyway.
        out_TNH = out_TNH.contiguous()
        ctx.save_for_backward(
            q_TNH, k0_TKH, v0_TKH, kb_JTKH, vb_JTKH, cu_seqlens, cu_host, out_TNH, lse_NT
        )
        ctx.scale = scale
        return out_TNH

    @staticmethod
    def backward(ctx, dout_TNH):
        q_TNH, k0_TKH, v0_TKH, kb_JTKH, vb_JTKH, cu_seqlens, cu_host, out_TNH, lse_NT = (
            ctx.saved_tensors
        )
        dq_trunk_TNH, dk0_TKH, dv0_TKH = trunk_backward(
            dout_TNH, q_TNH, k0_TKH, v0_TKH, out_TNH, lse_NT,
            cu_seqlens, cu_host, ctx.scale,
        )
        dq_branch_TNH, dkb_JTKH, dvb_JTKH = branch_backward(
            dout_TNH, q_TNH, kb_JTKH, vb_JTKH, out_TNH, lse_NT, ctx.scale
        )
        dq_TNH = dq_trunk_TNH + dq_branch_TNH
        return dq_TNH, dk0_TKH, dv0_TKH, dkb_JTKH, dvb_JTKH, None, None, None


def ttt_attention(
    q_TNH: torch.Tensor,
    k0_TKH: torch.Tensor,
    v0_TKH: torch.Tensor,
    kb_JTKH: torch.Tensor,
    vb_JTKH: torch.Tensor,
    meta: DocMetadata,
    scale: float,
) -> torch.Tensor:
    """EAGLE-3 TTT attention at step j = J: one softmax over trunk + branch keys.

    q_TNH: the step-j draft queries; k0/v0_TKH: step-0 keys/values (trunk);
    kb/vb_JTKH: keys/values of steps 1..J at the same rows (J may be 0).
    Differentiable w.r.t. q, k0, v0, kb, vb. Returns out_TNH in q's dtype.
    meta may also be a context-parallel shard (parallelisms/context_parallel.CPMetadata),
    which runs the trunk over its ring.
    """
    if not isinstance(meta, DocMetadata):
        return meta.ttt_attention(q_TNH, k0_TKH, v0_TKH, kb_JTKH, vb_JTKH, scale)
    return _TTTAttention.apply(
        q_TNH, k0_TKH, v0_TKH, kb_JTKH, vb_JTKH,
        meta.cu_seqlens, meta.cu_seqlens_cpu, scale,
    )
