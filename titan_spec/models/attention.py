# Document-causal attention over a packed token stream, returning the LSE.
#
# Shape suffix legend:
#   B = batch rows, L = row length, T = packed tokens (B*L),
#   N = query heads, K = kv heads (GQA: N % K == 0), G = N // K,
#   H = head dim, D = documents, P = partials being merged
#
# A packed batch is one flat stream of T tokens cut into D documents by
# cu_seqlens ([D+1], int32, 0 .. T). A query attends causally to the keys of
# its own document only. The forward returns the per-row log-sum-exp (lse) so
# that callers (EAGLE-3 TTT branch attention, ring attention) can merge
# several partial softmaxes exactly, and the backward takes (out, lse) as
# inputs instead of recomputing them, so it can be fed the *merged* ones.

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from torchtitan.protocols.module import Module

__all__ = [
    "DocCausalAttention",
    "DocMetadata",
    "doc_attention",
    "doc_metadata_from_positions",
    "merge_partials",
]


class DocMetadata(NamedTuple):
    """Document boundaries of a packed token stream.

    cu_seqlens: int32 [D+1] on the compute device, 0 .. T.
    cu_seqlens_cpu: the same offsets in a CPU tensor, so per-document loops and
        kernel launch parameters need no device sync. A tensor, not a tuple of
        ints: torch.compile would guard on every int and recompile for each new
        packing layout, while tensors flow into the (opaque) custom ops as data.
    """

    cu_seqlens: torch.Tensor
    cu_seqlens_cpu: torch.Tensor

    @property
    def cu_seqlens_host(self) -> tuple[int, ...]:
        return tuple(int(x) for x in self.cu_seqlens_cpu.tolist())

    @property
    def max_seqlen(self) -> int:
        return int((self.cu_seqlens_cpu[1:] - self.cu_seqlens_cpu[:-1]).max())


def doc_metadata_from_positions(positions_BL: torch.Tensor) -> DocMetadata:
    """Document metadata for a [B, L] batch viewed as one stream of B*L tokens.

    A document starts wherever position == 0 and at the start of every row
    (a row never continues the previous row's document). Syncs to host once.
    """
    B, L = positions_BL.shape
    starts_BL = positions_BL == 0
    starts_BL[:, 0] = True
    starts_T = starts_BL.reshape(-1).nonzero().squeeze(1)
    end = torch.tensor([B * L], device=positions_BL.device, dtype=starts_T.dtype)
    cu_seqlens = torch.cat([starts_T, end]).to(torch.int32)
    # A distinct tensor even on CPU: autograd.Function under dynamo rejects one tensor passed twice.
    return DocMetadata(cu_seqlens, cu_seqlens.to("cpu", copy=True))


def _doc_ranges(cu_host: list[int]) -> list[tuple[int, int]]:
    return [(s, e) for s, e in zip(cu_host[:-1], cu_host[1:]) if e > s]


def _to_1NLH(x_TNH: torch.Tensor, s: int, e: int) -> torch.Tensor:
    # aten SDPA kernels want [B, N, L, H]; a strided view is fine (checked:
    # the CPU flash fwd/bwd give bit-identical results for views and copies).
    return x_TNH[s:e].transpose(0, 1).unsqueeze(0)


def _fold_gqa(dx_TNH: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    # Query head n read kv head n // G, so the kv grad is the sum over its G heads.
    T, N, H = dx_TNH.shape
    if N == num_kv_heads:
        return dx_TNH
    dx_TKGH = dx_TNH.float().view(T, num_kv_heads, N // num_kv_heads, H)
    return dx_TKGH.sum(2).to(dx_TNH.dtype)


def _repeat_kv(x_TKH: torch.Tensor, num_heads: int) -> torch.Tensor:
    K = x_TKH.shape[1]
    return x_TKH if K == num_heads else x_TKH.repeat_interleave(num_heads // K, 1)


# ---------------------------------------------------------------------------
# CPU: per-document aten flash kernels.
#
# _scaled_dot_product_flash_attention_for_cpu_backward (torch 2.14.1 schema:
# grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *,
# attn_mask, scale) uses the given logsumexp for P = exp(S*scale - lse) and
# rowsum(grad_out * out) for the softmax correction; it does not recompute
# either, so an externally merged (out, lse) gives the exact gradient of the
# merged softmax. tests/test_attention.py checks this property.
# ---------------------------------------------------------------------------


def _cpu_fwd(q_TNH, k_TKH, v_TKH, cu_host, scale):
    T, N, _ = q_TNH.shape
    k_TNH, v_TNH = _repeat_kv(k_TKH, N), _repeat_kv(v_TKH, N)
    out_TNH = q_TNH.new_zeros(T, N, v_TKH.shape[-1])
    lse_NT = q_TNH.new_full((N, T), -math.inf, dtype=torch.float32)
    for s, e in _doc_ranges(cu_host):
        out_1NLH, lse_1NL = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            _to_1NLH(q_TNH, s, e),
            _to_1NLH(k_TNH, s, e),
            _to_1NLH(v_TNH, s, e),
            0.0,
            True,
            scale=scale,
        )
        out_TNH[s:e] = out_1NLH[0].transpose(0, 1)
        lse_NT[:, s:e] = lse_1NL[0]
    return out_TNH, lse_NT


def _cpu_bwd(dout_TNH, q_TNH, k_TKH, v_TKH, out_TNH, lse_NT, cu_host, scale):
    T, N, _ = q_TNH.shape
    K = k_TKH.shape[1]
    k_TNH, v_TNH = _repeat_kv(k_TKH, N), _repeat_kv(v_TKH, N)
    # The kernel wants lse in its accumulation dtype (fp64 only for fp64 inputs)
    # and grad_out / out in the input dtype.
    lse_dtype = torch.float64 if q_TNH.dtype == torch.float64 else torch.float32
    lse_NT = lse_NT.to(lse_dtype)
    dout_TNH = dout_TNH.to(q_TNH.dtype)
    out_TNH = out_TNH.to(q_TNH.dtype)
    dq_TNH = torch.zeros_like(q_TNH)
    dk_TNH = torch.zeros_like(k_TNH)
    dv_TNH = torch.zeros_like(v_TNH)
    for s, e in _doc_ranges(cu_host):
        dq_1NLH, dk_1NLH, dv_1NLH = (
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                _to_1NLH(dout_TNH, s, e),
                _to_1NLH(q_TNH, s, e),
                _to_1NLH(k_TNH, s, e),
                _to_1NLH(v_TNH, s, e),
                _to_1NLH(out_TNH, s, e),
                lse_NT[:, s:e].unsqueeze(0),
                0.0,
                True,
                scale=scale,
            )
        )
        dq_TNH[s:e] = dq_1NLH[0].transpose(0, 1)
        dk_TNH[s:e] = dk_1NLH[0].transpose(0, 1)
        dv_TNH[s:e] = dv_1NLH[0].transpose(0, 1)
    return dq_TNH, _fold_gqa(dk_TNH, K), _fold_gqa(dv_TNH, K)


# ---------------------------------------------------------------------------
# Math fallback (fp32 accumulation, O(L^2) per document). Used on CUDA for
# dtypes flash kernels reject (fp32/fp64); kept device-agnostic so the CPU
# tests exercise it too.
# ---------------------------------------------------------------------------


def _math_scores(q_TNH, k_TKH, s, e, scale):
    K = k_TKH.shape[1]
    L, N, H = e - s, q_TNH.shape[1], q_TNH.shape[2]
    q_LKGH = q_TNH[s:e].float().reshape(L, K, N // K, H)
    s_KGLL = torch.einsum("lkgh,mkh->kglm", q_LKGH, k_TKH[s:e].float()) * scale
    future_LL = torch.ones(L, L, dtype=torch.bool, device=q_TNH.device).triu(1)
    return s_KGLL.masked_fill(future_LL, -math.inf)


def _math_fwd(q_TNH, k_TKH, v_TKH, cu_host, scale):
    T, N, _ = q_TNH.shape
    K, Hv = k_TKH.shape[1], v_TKH.shape[-1]
    out_TNH = q_TNH.new_zeros(T, N, Hv)
    lse_NT = q_TNH.new_full((N, T), -math.inf, dtype=torch.float32)
    for s, e in _doc_ranges(cu_host):
        s_KGLL = _math_scores(q_TNH, k_TKH, s, e, scale)
        lse_KGL = torch.logsumexp(s_KGLL, -1)
        p_KGLL = torch.exp(s_KGLL - lse_KGL.unsqueeze(-1))
        out_LKGH = torch.einsum("kglm,mkh->lkgh", p_KGLL, v_TKH[s:e].float())
        out_TNH[s:e] = out_LKGH.reshape(e - s, N, Hv)
        lse_NT[:, s:e] = lse_KGL.reshape(N, e - s)
    return out_TNH, lse_NT


def _math_bwd(dout_TNH, q_TNH, k_TKH, v_TKH, out_TNH, lse_NT, cu_host, scale):
    T, N, H = q_TNH.shape
    K, Hv = k_TKH.shape[1], v_TKH.shape[-1]
    G = N // K
    dq_TNH = torch.zeros(T, N, H, dtype=torch.float32, device=q_TNH.device)
    dk_TKH = torch.zeros(T, K, H, dtype=torch.float32, device=q_TNH.device)
    dv_TKH = torch.zeros(T, K, Hv, dtype=torch.float32, device=q_TNH.device)
    for s, e in _doc_ranges(cu_host):
        L = e - s
        s_KGLL = _math_scores(q_TNH, k_TKH, s, e, scale)
        # The given (possibly merged) lse, never a recomputed one.
        lse_KGL = lse_NT[:, s:e].float().reshape(K, G, L)
        p_KGLL = torch.exp(s_KGLL - lse_KGL.unsqueeze(-1))
        dout_LKGH = dout_TNH[s:e].float().reshape(L, K, G, Hv)
        out_LKGH = out_TNH[s:e].float().reshape(L, K, G, Hv)
        delta_KGL = (dout_LKGH * out_LKGH).sum(-1).permute(1, 2, 0)
        dp_KGLL = torch.einsum("lkgh,mkh->kglm", dout_LKGH, v_TKH[s:e].float())
        ds_KGLL = p_KGLL * (dp_KGLL - delta_KGL.unsqueeze(-1)) * scale
        q_LKGH = q_TNH[s:e].float().reshape(L, K, G, H)
        dq_LKGH = torch.einsum("kglm,mkh->lkgh", ds_KGLL, k_TKH[s:e].float())
        dq_TNH[s:e] = dq_LKGH.reshape(L, N, H)
        dk_TKH[s:e] = torch.einsum("kglm,lkgh->mkh", ds_KGLL, q_LKGH)
        dv_TKH[s:e] = torch.einsum("kglm,lkgh->mkh", p_KGLL, dout_LKGH)
    return dq_TNH.to(q_TNH.dtype), dk_TKH.to(k_TKH.dtype), dv_TKH.to(v_TKH.dtype)


# ---------------------------------------------------------------------------
# CUDA (fp16/bf16): FA2 varlen kernels, which take GQA natively, return lse as
# [N, T] fp32, and whose backward consumes the given (out, lse) rather than
# recomputing them. Prefer the flash_attn package (pinned 2.8.x in the `gpu`
# extra); otherwise the FA2 build bundled in the PyTorch CUDA wheel, the one
# torch.nn.attention.varlen calls. Untested here: no GPU on the CI machines.
# ---------------------------------------------------------------------------

try:
    from flash_attn.flash_attn_interface import (
        _wrapped_flash_attn_varlen_backward as _fa_varlen_bwd,
        _wrapped_flash_attn_varlen_forward as _fa_varlen_fwd,
    )
except (ImportError, OSError):  # not installed, or built for another CUDA
    _fa_varlen_fwd = _fa_varlen_bwd = None


def _use_cuda_flash(q_TNH: torch.Tensor) -> bool:
    return q_TNH.is_cuda and q_TNH.dtype in (torch.float16, torch.bfloat16)


def _max_len(cu_host: list[int]) -> int:
    return max((e - s for s, e in _doc_ranges(cu_host)), default=0)


def _cuda_fwd(q_TNH, k_TKH, v_TKH, cu_seqlens, cu_host, scale):
    q_TNH, k_TKH, v_TKH = (x.contiguous() for x in (q_TNH, k_TKH, v_TKH))
    L = _max_len(cu_host)
    if _fa_varlen_fwd is not None and q_TNH.shape[-1] % 8 == 0:
        out_TNH, lse_NT, _, _ = _fa_varlen_fwd(
            q_TNH, k_TKH, v_TKH, cu_seqlens, cu_seqlens, L, L,
            dropout_p=0.0, softmax_scale=scale, causal=True,
        )
        return out_TNH, lse_NT
    out_TNH, lse_NT, _, _, _ = torch.ops.aten._flash_attention_forward(
        q_TNH, k_TKH, v_TKH, cu_seqlens, cu_seqlens, L, L, 0.0, True, False,
        scale=scale,
    )
    return out_TNH, lse_NT.float()


def _cuda_bwd(
    dout_TNH, q_TNH, k_TKH, v_TKH, out_TNH, lse_NT, cu_seqlens, cu_host, scale
):
    dtype = q_TNH.dtype
    dout_TNH, out_TNH = dout_TNH.to(dtype).contiguous(), out_TNH.to(dtype).contiguous()
    q_TNH, k_TKH, v_TKH = (x.contiguous() for x in (q_TNH, k_TKH, v_TKH))
    lse_NT = lse_NT.float().contiguous()
    L = _max_len(cu_host)
    if _fa_varlen_bwd is not None and q_TNH.shape[-1] % 8 == 0:
        dq, dk, dv = (torch.empty_like(x) for x in (q_TNH, k_TKH, v_TKH))
        _fa_varlen_bwd(  # writes dq, dk, dv in place
            dout_TNH, q_TNH, k_TKH, v_TKH, out_TNH, lse_NT, dq, dk, dv,
            cu_seqlens, cu_seqlens, L, L,
            dropout_p=0.0, softmax_scale=scale, causal=True,
            window_size_left=-1, window_size_right=-1, softcap=0.0,
            alibi_slopes=None, deterministic=False,
        )
        return dq, dk, dv
    # No dropout, so the rng state is never read; it only has to exist.
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q_TNH.device)
    unused = torch.empty(0, device=q_TNH.device)
    return torch.ops.aten._flash_attention_backward(
        dout_TNH, q_TNH, k_TKH, v_TKH, out_TNH, lse_NT, cu_seqlens, cu_seqlens,
        L, L, 0.0, True, rng_state, unused, scale=scale,
    )


# ---------------------------------------------------------------------------
# Custom ops: opaque to torch.compile, so the per-document Python loops and
# the host offsets never get traced.
# ---------------------------------------------------------------------------


@torch.library.custom_op("titan_spec::doc_attn_fwd", mutates_args=())
def doc_attn_fwd(
    q_TNH: torch.Tensor,
    k_TKH: torch.Tensor,
    v_TKH: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_cpu: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Document-causal attention. Returns (out_TNH, lse_NT fp32).

    Rows with no key (impossible for causal self-attention, but possible for
    empty documents in cu_seqlens) get out = 0 and lse = -inf.
    """
    cu_host = cu_seqlens_cpu.tolist()
    if _use_cuda_flash(q_TNH):
        return _cuda_fwd(q_TNH, k_TKH, v_TKH, cu_seqlens, cu_host, scale)
    if q_TNH.device.type == "cpu":
        return _cpu_fwd(q_TNH, k_TKH, v_TKH, cu_host, scale)
    return _math_fwd(q_TNH, k_TKH, v_TKH, cu_host, scale)


@doc_attn_fwd.register_fake
def _doc_attn_fwd_fake(q_TNH, k_TKH, v_TKH, cu_seqlens, cu_seqlens_cpu, scale):
    T, N, _ = q_TNH.shape
    out_TNH = q_TNH.new_empty(T, N, v_TKH.shape[-1])
    lse_NT = q_TNH.new_empty(N, T, dtype=torch.float32)
    return out_TNH, lse_NT


@torch.library.custom_op("titan_spec::doc_attn_bwd", mutates_args=())
def doc_attn_bwd(
    dout_TNH: torch.Tensor,
    q_TNH: torch.Tensor,
    k_TKH: torch.Tensor,
    v_TKH: torch.Tensor,
    out_TNH: torch.Tensor,
    lse_NT: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_cpu: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of document-causal attention.

    Uses the given out and lse as-is: dS = P * (dP - rowsum(dout * out)) with
    P = exp(S * scale - lse). Passing the merged (out, lse) of several parts
    yields this part's exact contribution to the merged softmax's gradient.
    """
    args = (dout_TNH, q_TNH, k_TKH, v_TKH, out_TNH, lse_NT)
    cu_host = cu_seqlens_cpu.tolist()
    if _use_cuda_flash(q_TNH):
        return _cuda_bwd(*args, cu_seqlens, cu_host, scale)
    if q_TNH.device.type == "cpu":
        return _cpu_bwd(*args, cu_host, scale)
    return _math_bwd(*args, cu_host, scale)


@doc_attn_bwd.register_fake
def _doc_attn_bwd_fake(
    dout_TNH, q_TNH, k_TKH, v_TKH, out_TNH, lse_NT, cu_seqlens, cu_seqlens_cpu, scale
):
    return torch.empty_like(q_TNH), torch.empty_like(k_TKH), torch.empty_like(v_TKH)


def _fwd_setup_context(ctx, inputs, output) -> None:
    q_TNH, k_TKH, v_TKH, cu_seqlens, cu_seqlens_cpu, scale = inputs
    out_TNH, lse_NT = output
    # lse is an output for merging, not a differentiable one: a dlse term
    # cannot be fed to the fused flash backward. Callers that merge partials
    # must use an explicit backward with the merged lse (see
    # branch_attention.py) instead of autograd through merge_partials.
    ctx.mark_non_differentiable(lse_NT)
    ctx.save_for_backward(q_TNH, k_TKH, v_TKH, out_TNH, lse_NT, cu_seqlens, cu_seqlens_cpu)
    ctx.scale = scale


def _fwd_backward(ctx, dout_TNH, _dlse_NT):
    q_TNH, k_TKH, v_TKH, out_TNH, lse_NT, cu_seqlens, cu_seqlens_cpu = ctx.saved_tensors
    dq, dk, dv = torch.ops.titan_spec.doc_attn_bwd(
        dout_TNH, q_TNH, k_TKH, v_TKH, out_TNH, lse_NT,
        cu_seqlens, cu_seqlens_cpu, ctx.scale,
    )
    return dq, dk, dv, None, None, None


doc_attn_fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)


def doc_attention(
    q_TNH: torch.Tensor,
    k_TKH: torch.Tensor,
    v_TKH: torch.Tensor,
    meta: DocMetadata,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable document-causal attention: (out_TNH, lse_NT fp32).

    Gradients flow to q, k, v through out only; lse is returned marked
    non-differentiable (requires_grad=False) and exists for exact merging.
    """
    return torch.ops.titan_spec.doc_attn_fwd(
        q_TNH, k_TKH, v_TKH, meta.cu_seqlens, meta.cu_seqlens_cpu, scale
    )


def merge_partials(
    outs: list[torch.Tensor], lses: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact log-sum-exp merge of partial softmax attentions over disjoint keys.

    outs: [T, N, H] each; lses: [N, T] each. Returns (out_TNH in outs[0]'s
    dtype, lse_NT fp32). Rows where every part is -inf (no key at all) give
    out = 0 and lse = -inf, and never produce NaN, forward or backward.
    """
    lse_PNT = torch.stack([lse.float() for lse in lses])
    # The shift only stabilises exp(); the result does not depend on it, so it
    # carries no gradient. For all -inf rows use 0 so exp sees -inf - 0, not
    # -inf - -inf = NaN.
    shift_NT = lse_PNT.detach().amax(0)
    shift_NT = torch.where(torch.isneginf(shift_NT), 0.0, shift_NT)
    w_PNT = torch.exp(lse_PNT - shift_NT)
    wsum_NT = w_PNT.sum(0)
    has_key_NT = wsum_NT > 0
    wsum_NT = torch.where(has_key_NT, wsum_NT, 1.0)
    lse_NT = torch.where(has_key_NT, shift_NT + torch.log(wsum_NT), -math.inf)
    out_TNH = None
    for out_p_TNH, w_NT in zip(outs, (w_PNT / wsum_NT).unbind(0)):
        w_TN1 = w_NT.t().unsqueeze(-1)
        # A part with no key may hold garbage (even NaN) in out; 0 * NaN = NaN,
        # so drop it by selection rather than by weight.
        term_TNH = torch.where(w_TN1 > 0, out_p_TNH.float(), 0.0) * w_TN1
        out_TNH = term_TNH if out_TNH is None else out_TNH + term_TNH
    return out_TNH.to(outs[0].dtype), lse_NT


class DocCausalAttention(Module):
    """Inner attention: causal within each document of a packed batch.

    Drop-in for torchtitan's VarlenAttention: takes [B, L, N, H] q/k/v and a
    DocMetadata as attention_masks, and works on CPU (tests) and GPU.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        pass

    def __init__(self, config: Config) -> None:
        super().__init__()

    def forward(
        self,
        q_BLNH: torch.Tensor,
        k_BLNH: torch.Tensor,
        v_BLNH: torch.Tensor,
        *,
        attention_masks: DocMetadata,
        scale: float | None = None,
        enable_gqa: bool = False,
        **kwargs,
    ) -> torch.Tensor:
        B, L, N, H = q_BLNH.shape
        K, Hv = k_BLNH.shape[2], v_BLNH.shape[-1]
        assert enable_gqa or N == K, f"{N} query heads vs {K} kv heads needs enable_gqa"
        assert N % K == 0, f"{N} query heads is not a multiple of {K} kv heads"
        scale = 1.0 / math.sqrt(H) if scale is None else scale
        if not isinstance(attention_masks, DocMetadata):
            # A context-parallel shard (parallelisms/context_parallel.CPMetadata)
            # brings its ring attention.
            out_TNH = attention_masks.attention(
                q_BLNH.reshape(B * L, N, H), k_BLNH.reshape(B * L, K, H),
                v_BLNH.reshape(B * L, K, Hv), scale,
            )
            return out_TNH.view(B, L, N, Hv)
        out_TNH, _ = doc_attention(
            q_BLNH.reshape(B * L, N, H),
            k_BLNH.reshape(B * L, K, H),
            v_BLNH.reshape(B * L, K, Hv),
            attention_masks,
            scale,
        )
        return out_TNH.view(B, L, N, Hv)
