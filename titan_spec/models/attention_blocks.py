# The attention kernel: softmax attention over a list of blocks, returning the LSE.
#
# Shape suffix legend:
#   R = rows of the stream the blocks index (q and k/v alike: the packed tokens
#       of doc attention, the local rows of a context-parallel rank),
#   N = query heads, K = kv heads (GQA: N % K == 0), G = N // K, H = head dim,
#   L = query rows of one block, M = key rows of one block, P = partials merged
#
# A block (q_start, q_end, k_start, k_end, causal) lets the queries q[q_start:q_end]
# attend to the keys k[k_start:k_end]; a causal block is square and query i of
# it sees keys 0..i of its range. Document attention is the causal block of
# every document on itself (document_blocks); a ring step of context
# parallelism is the blocks of the local queries against one source rank's
# keys (parallelisms/context_parallel.ring_blocks). Rows in no block get out = 0
# and lse = -inf, which merge_partials treats as "no key".
#
# The forward returns the per-row log-sum-exp so callers (ring steps, the
# EAGLE-3 TTT branch part) merge partial softmaxes exactly; the backward takes
# (out, lse) as inputs instead of recomputing them, so it can be fed the
# MERGED ones and then yields this part's exact share of the merged gradient.
#
# Backends, picked by blocks_fwd / blocks_bwd: CUDA fp16/bf16 -> one FA2 varlen
# call over all blocks; CPU -> the aten flash kernels per block; anything else
# (CUDA fp32/fp64) -> fp32 math per block.

import math

import torch

__all__ = [
    "Block",
    "blocks_bwd",
    "blocks_fwd",
    "document_blocks",
    "merge_partials",
]

Block = tuple[int, int, int, int, bool]
"""(q_start, q_end, k_start, k_end, causal): rows of the stream, ends exclusive."""


def document_blocks(cu_host) -> list[Block]:
    """The causal self-blocks of a packed stream's non-empty documents (cu_seqlens offsets)."""
    return [(s, e, s, e, True) for s, e in zip(cu_host[:-1], cu_host[1:]) if e > s]


def _check_blocks(blocks: list[Block], q_rows: int, k_rows: int) -> None:
    # Every backend relies on this: out/lse and dq are written per block by plain
    # copy (no query row in two blocks), dk/dv too (no key row in two blocks), and
    # the varlen kernels take one causal flag per call.
    q_end = k_end = 0
    for qs, qe, ks, ke, causal in blocks:
        if not (q_end <= qs < qe <= q_rows and k_end <= ks < ke <= k_rows):
            raise ValueError(
                f"attention blocks must be non-empty, in order and disjoint in query and key rows "
                f"within {q_rows} x {k_rows}: {(qs, qe, ks, ke)} after rows q < {q_end}, k < {k_end}"
            )
        if causal and qe - qs != ke - ks:
            raise ValueError(f"a causal attention block must be square: {(qs, qe, ks, ke)}")
        if causal != blocks[0][4]:
            raise ValueError("all attention blocks of one call must share one causal flag")
        q_end, k_end = qe, ke


def _to_1NLH(x_RNH: torch.Tensor, s: int, e: int) -> torch.Tensor:
    # aten SDPA kernels want [B, N, L, H]; a strided view is fine (checked:
    # the CPU flash fwd/bwd give bit-identical results for views and copies).
    return x_RNH[s:e].transpose(0, 1).unsqueeze(0)


def _fold_gqa(dx_RNH: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    # Query head n read kv head n // G, so the kv grad is the sum over its G heads.
    R, N, H = dx_RNH.shape
    if N == num_kv_heads:
        return dx_RNH
    dx_RKGH = dx_RNH.float().view(R, num_kv_heads, N // num_kv_heads, H)
    return dx_RKGH.sum(2).to(dx_RNH.dtype)


def _repeat_kv(x_RKH: torch.Tensor, num_heads: int) -> torch.Tensor:
    K = x_RKH.shape[1]
    return x_RKH if K == num_heads else x_RKH.repeat_interleave(num_heads // K, 1)


# ---------------------------------------------------------------------------
# CPU: the aten flash kernels, one call per block (they take L != M).
#
# _scaled_dot_product_flash_attention_for_cpu_backward (torch 2.14.1 schema:
# grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *,
# attn_mask, scale) uses the given logsumexp for P = exp(S*scale - lse) and
# rowsum(grad_out * out) for the softmax correction; it does not recompute
# either, so an externally merged (out, lse) gives the exact gradient of the
# merged softmax. tests/test_attention.py checks this property.
# ---------------------------------------------------------------------------


def _cpu_fwd(q_RNH, k_RKH, v_RKH, blocks, scale):
    R, N, _ = q_RNH.shape
    k_RNH, v_RNH = _repeat_kv(k_RKH, N), _repeat_kv(v_RKH, N)
    out_RNH = q_RNH.new_zeros(R, N, v_RKH.shape[-1])
    lse_NR = q_RNH.new_full((N, R), -math.inf, dtype=torch.float32)
    for qs, qe, ks, ke, causal in blocks:
        out_1NLH, lse_1NL = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            _to_1NLH(q_RNH, qs, qe),
            _to_1NLH(k_RNH, ks, ke),
            _to_1NLH(v_RNH, ks, ke),
            0.0,
            causal,
            scale=scale,
        )
        out_RNH[qs:qe] = out_1NLH[0].transpose(0, 1)
        lse_NR[:, qs:qe] = lse_1NL[0]
    return out_RNH, lse_NR


def _cpu_bwd(dout_RNH, q_RNH, k_RKH, v_RKH, out_RNH, lse_NR, blocks, scale):
    R, N, _ = q_RNH.shape
    K = k_RKH.shape[1]
    k_RNH, v_RNH = _repeat_kv(k_RKH, N), _repeat_kv(v_RKH, N)
    # The kernel wants lse in its accumulation dtype (fp64 only for fp64 inputs)
    # and grad_out / out in the input dtype.
    lse_dtype = torch.float64 if q_RNH.dtype == torch.float64 else torch.float32
    lse_NR = lse_NR.to(lse_dtype)
    dout_RNH = dout_RNH.to(q_RNH.dtype)
    out_RNH = out_RNH.to(q_RNH.dtype)
    dq_RNH = torch.zeros_like(q_RNH)
    dk_RNH = torch.zeros_like(k_RNH)
    dv_RNH = torch.zeros_like(v_RNH)
    for qs, qe, ks, ke, causal in blocks:
        dq_1NLH, dk_1NMH, dv_1NMH = (
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                _to_1NLH(dout_RNH, qs, qe),
                _to_1NLH(q_RNH, qs, qe),
                _to_1NLH(k_RNH, ks, ke),
                _to_1NLH(v_RNH, ks, ke),
                _to_1NLH(out_RNH, qs, qe),
                lse_NR[:, qs:qe].unsqueeze(0),
                0.0,
                causal,
                scale=scale,
            )
        )
        # Plain copies: _check_blocks guarantees no row is in two blocks.
        dq_RNH[qs:qe] = dq_1NLH[0].transpose(0, 1)
        dk_RNH[ks:ke] = dk_1NMH[0].transpose(0, 1)
        dv_RNH[ks:ke] = dv_1NMH[0].transpose(0, 1)
    return dq_RNH, _fold_gqa(dk_RNH, K), _fold_gqa(dv_RNH, K)


# ---------------------------------------------------------------------------
# Math fallback (fp32 accumulation, O(L*M) per block). Used on CUDA for dtypes
# flash kernels reject (fp32/fp64); kept device-agnostic so the CPU tests
# exercise it too. Query heads split as (K, G) instead of repeating kv heads.
# ---------------------------------------------------------------------------


def _math_scores(q_RNH, k_RKH, block, scale):
    qs, qe, ks, ke, causal = block
    K = k_RKH.shape[1]
    L, N, H = qe - qs, q_RNH.shape[1], q_RNH.shape[2]
    q_LKGH = q_RNH[qs:qe].float().reshape(L, K, N // K, H)
    s_KGLM = torch.einsum("lkgh,mkh->kglm", q_LKGH, k_RKH[ks:ke].float()) * scale
    if not causal:
        return s_KGLM
    future_LL = torch.ones(L, L, dtype=torch.bool, device=q_RNH.device).triu(1)
    return s_KGLM.masked_fill(future_LL, -math.inf)


def _math_fwd(q_RNH, k_RKH, v_RKH, blocks, scale):
    R, N, _ = q_RNH.shape
    Hv = v_RKH.shape[-1]
    out_RNH = q_RNH.new_zeros(R, N, Hv)
    lse_NR = q_RNH.new_full((N, R), -math.inf, dtype=torch.float32)
    for block in blocks:
        qs, qe, ks, ke, _ = block
        s_KGLM = _math_scores(q_RNH, k_RKH, block, scale)
        lse_KGL = torch.logsumexp(s_KGLM, -1)
        p_KGLM = torch.exp(s_KGLM - lse_KGL.unsqueeze(-1))
        out_LKGH = torch.einsum("kglm,mkh->lkgh", p_KGLM, v_RKH[ks:ke].float())
        out_RNH[qs:qe] = out_LKGH.reshape(qe - qs, N, Hv)
        lse_NR[:, qs:qe] = lse_KGL.reshape(N, qe - qs)
    return out_RNH, lse_NR


def _math_bwd(dout_RNH, q_RNH, k_RKH, v_RKH, out_RNH, lse_NR, blocks, scale):
    R, N, H = q_RNH.shape
    K, Hv = k_RKH.shape[1], v_RKH.shape[-1]
    G = N // K
    dq_RNH = torch.zeros(R, N, H, dtype=torch.float32, device=q_RNH.device)
    dk_RKH = torch.zeros(k_RKH.shape[0], K, H, dtype=torch.float32, device=q_RNH.device)
    dv_RKH = torch.zeros(v_RKH.shape[0], K, Hv, dtype=torch.float32, device=q_RNH.device)
    for block in blocks:
        qs, qe, ks, ke, _ = block
        L = qe - qs
        s_KGLM = _math_scores(q_RNH, k_RKH, block, scale)
        # The given (possibly merged) lse, never a recomputed one.
        lse_KGL = lse_NR[:, qs:qe].float().reshape(K, G, L)
        p_KGLM = torch.exp(s_KGLM - lse_KGL.unsqueeze(-1))
        dout_LKGH = dout_RNH[qs:qe].float().reshape(L, K, G, Hv)
        out_LKGH = out_RNH[qs:qe].float().reshape(L, K, G, Hv)
        delta_KGL = (dout_LKGH * out_LKGH).sum(-1).permute(1, 2, 0)
        dp_KGLM = torch.einsum("lkgh,mkh->kglm", dout_LKGH, v_RKH[ks:ke].float())
        ds_KGLM = p_KGLM * (dp_KGLM - delta_KGL.unsqueeze(-1)) * scale
        q_LKGH = q_RNH[qs:qe].float().reshape(L, K, G, H)
        dq_LKGH = torch.einsum("kglm,mkh->lkgh", ds_KGLM, k_RKH[ks:ke].float())
        dq_RNH[qs:qe] = dq_LKGH.reshape(L, N, H)
        dk_RKH[ks:ke] = torch.einsum("kglm,lkgh->mkh", ds_KGLM, q_LKGH)
        dv_RKH[ks:ke] = torch.einsum("kglm,lkgh->mkh", p_KGLM, dout_LKGH)
    return dq_RNH.to(q_RNH.dtype), dk_RKH.to(k_RKH.dtype), dv_RKH.to(v_RKH.dtype)


# ---------------------------------------------------------------------------
# CUDA (fp16/bf16): FA2 varlen kernels, one call over all blocks (a block is a
# varlen sequence; cu_seqlens_q != cu_seqlens_k is allowed). They take GQA
# natively, return lse as [N, R] fp32, and their backward consumes the given
# (out, lse) rather than recomputing them. Prefer the flash_attn package
# (pinned 2.8.x in the `gpu` extra); otherwise the FA2 build bundled in the
# PyTorch CUDA wheel, the one torch.nn.attention.varlen calls. Untested here:
# no GPU on the CI machines.
# ---------------------------------------------------------------------------

try:
    from flash_attn.flash_attn_interface import (
        _wrapped_flash_attn_varlen_backward as _fa_varlen_bwd,
        _wrapped_flash_attn_varlen_forward as _fa_varlen_fwd,
    )
except (ImportError, OSError):  # not installed, or built for another CUDA
    _fa_varlen_fwd = _fa_varlen_bwd = None


def _use_cuda_flash(q_RNH: torch.Tensor) -> bool:
    return q_RNH.is_cuda and q_RNH.dtype in (torch.float16, torch.bfloat16)


def _tiles_rows(blocks: list[Block], q_rows: int, k_rows: int) -> bool:
    # Self-blocks back to back over every row (doc attention, a ring step on
    # the rank's own shard): the varlen batch is the tensors themselves.
    row = 0
    for qs, qe, ks, ke, _ in blocks:
        if not (qs == ks == row and qe == ke):
            return False
        row = qe
    return row == q_rows == k_rows


def _varlen_plan(blocks, q_rows, k_rows, device, cu_seqlens):
    """(q_idx, k_idx, cu_q, cu_k, max_q, max_k, causal) of the blocks' varlen batch.

    q_idx / k_idx are None when the blocks tile all rows (no gather needed);
    then the given device cu_seqlens, if any, is used as-is for both sides.
    """
    max_q = max(qe - qs for qs, qe, _, _, _ in blocks)
    max_k = max(ke - ks for _, _, ks, ke, _ in blocks)
    causal = blocks[0][4]
    if _tiles_rows(blocks, q_rows, k_rows):
        if cu_seqlens is None:
            cu_host = [0] + [qe for _, qe, _, _, _ in blocks]
            cu_seqlens = torch.tensor(cu_host, dtype=torch.int32, device=device)
        return None, None, cu_seqlens, cu_seqlens, max_q, max_k, causal
    # Rows of the blocks gathered into contiguous varlen batches. No row is in
    # two blocks (_check_blocks), so scatter-back is a plain copy.
    q_idx = torch.cat([torch.arange(qs, qe) for qs, qe, _, _, _ in blocks]).to(device)
    k_idx = torch.cat([torch.arange(ks, ke) for _, _, ks, ke, _ in blocks]).to(device)
    cu_q = [0]
    cu_k = [0]
    for qs, qe, ks, ke, _ in blocks:
        cu_q.append(cu_q[-1] + qe - qs)
        cu_k.append(cu_k[-1] + ke - ks)
    as_cu = lambda cu: torch.tensor(cu, dtype=torch.int32, device=device)
    return q_idx, k_idx, as_cu(cu_q), as_cu(cu_k), max_q, max_k, causal


def _rows(x_RNH: torch.Tensor, idx: torch.Tensor | None) -> torch.Tensor:
    return x_RNH if idx is None else x_RNH[idx]


def _cuda_fwd(q_RNH, k_RKH, v_RKH, blocks, scale, cu_seqlens):
    R, N, _ = q_RNH.shape
    if not blocks:
        out_RNH = q_RNH.new_zeros(R, N, v_RKH.shape[-1])
        return out_RNH, q_RNH.new_full((N, R), -math.inf, dtype=torch.float32)
    q_idx, k_idx, cu_q, cu_k, max_q, max_k, causal = _varlen_plan(
        blocks, R, k_RKH.shape[0], q_RNH.device, cu_seqlens
    )
    q = _rows(q_RNH, q_idx).contiguous()
    k, v = _rows(k_RKH, k_idx).contiguous(), _rows(v_RKH, k_idx).contiguous()
    if _fa_varlen_fwd is not None and q.shape[-1] % 8 == 0:
        out, lse, _, _ = _fa_varlen_fwd(
            q, k, v, cu_q, cu_k, max_q, max_k,
            dropout_p=0.0, softmax_scale=scale, causal=causal,
        )
    else:
        out, lse, _, _, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale,
        )
    if q_idx is None:
        return out, lse.float()
    out_RNH = q_RNH.new_zeros(R, N, v_RKH.shape[-1])
    lse_NR = q_RNH.new_full((N, R), -math.inf, dtype=torch.float32)
    out_RNH[q_idx] = out
    lse_NR[:, q_idx] = lse.float()
    return out_RNH, lse_NR


def _cuda_bwd(dout_RNH, q_RNH, k_RKH, v_RKH, out_RNH, lse_NR, blocks, scale, cu_seqlens):
    if not blocks:
        return tuple(torch.zeros_like(x) for x in (q_RNH, k_RKH, v_RKH))
    q_idx, k_idx, cu_q, cu_k, max_q, max_k, causal = _varlen_plan(
        blocks, q_RNH.shape[0], k_RKH.shape[0], q_RNH.device, cu_seqlens
    )
    dtype = q_RNH.dtype
    dout = _rows(dout_RNH, q_idx).to(dtype).contiguous()
    out = _rows(out_RNH, q_idx).to(dtype).contiguous()
    q = _rows(q_RNH, q_idx).contiguous()
    k, v = _rows(k_RKH, k_idx).contiguous(), _rows(v_RKH, k_idx).contiguous()
    lse = (lse_NR if q_idx is None else lse_NR[:, q_idx]).float().contiguous()
    if _fa_varlen_bwd is not None and q.shape[-1] % 8 == 0:
        dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
        _fa_varlen_bwd(  # writes dq, dk, dv in place
            dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, max_q, max_k,
            dropout_p=0.0, softmax_scale=scale, causal=causal,
            window_size_left=-1, window_size_right=-1, softcap=0.0,
            alibi_slopes=None, deterministic=False,
        )
    else:
        # No dropout, so the rng state is never read; it only has to exist.
        rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)
        unused = torch.empty(0, device=q.device)
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, causal,
            rng_state, unused, scale=scale,
        )
    if q_idx is None:
        return dq, dk, dv
    dq_RNH, dk_RKH, dv_RKH = (torch.zeros_like(x) for x in (q_RNH, k_RKH, v_RKH))
    dq_RNH[q_idx] = dq
    dk_RKH[k_idx] = dk
    dv_RKH[k_idx] = dv
    return dq_RNH, dk_RKH, dv_RKH


# ---------------------------------------------------------------------------
# The kernel
# ---------------------------------------------------------------------------


def blocks_fwd(
    q_RNH: torch.Tensor,
    k_RKH: torch.Tensor,
    v_RKH: torch.Tensor,
    blocks: list[Block],
    scale: float,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q over the blocks: (out_RNH in q's dtype, lse_NR fp32).

    blocks: in order of rows, no query row and no key row in two blocks, one
    causal flag for all (ValueError otherwise). Rows in no block get out = 0,
    lse = -inf. cu_seqlens: optionally the device offsets the blocks were made
    from by document_blocks; the CUDA path then uses them instead of a copy.
    """
    _check_blocks(blocks, q_RNH.shape[0], k_RKH.shape[0])
    if _use_cuda_flash(q_RNH):
        return _cuda_fwd(q_RNH, k_RKH, v_RKH, blocks, scale, cu_seqlens)
    if q_RNH.device.type == "cpu":
        return _cpu_fwd(q_RNH, k_RKH, v_RKH, blocks, scale)
    return _math_fwd(q_RNH, k_RKH, v_RKH, blocks, scale)


def blocks_bwd(
    dout_RNH: torch.Tensor,
    q_RNH: torch.Tensor,
    k_RKH: torch.Tensor,
    v_RKH: torch.Tensor,
    out_RNH: torch.Tensor,
    lse_NR: torch.Tensor,
    blocks: list[Block],
    scale: float,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of blocks_fwd, in q's / k's / v's dtype.

    Uses the given out and lse as-is: dS = P * (dP - rowsum(dout * out)) with
    P = exp(S * scale - lse). Passing the merged (out, lse) of several parts
    yields this part's exact contribution to the merged softmax's gradient.
    """
    _check_blocks(blocks, q_RNH.shape[0], k_RKH.shape[0])
    args = (dout_RNH, q_RNH, k_RKH, v_RKH, out_RNH, lse_NR, blocks, scale)
    if _use_cuda_flash(q_RNH):
        return _cuda_bwd(*args, cu_seqlens)
    if q_RNH.device.type == "cpu":
        return _cpu_bwd(*args)
    return _math_bwd(*args)


def merge_partials(
    outs: list[torch.Tensor], lses: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact log-sum-exp merge of partial softmax attentions over disjoint keys.

    outs: [R, N, H] each; lses: [N, R] each. Returns (out_RNH in outs[0]'s
    dtype, lse_NR fp32). Rows where every part is -inf (no key at all) give
    out = 0 and lse = -inf, and never produce NaN, forward or backward.
    """
    lse_PNR = torch.stack([lse.float() for lse in lses])
    # The shift only stabilises exp(); the result does not depend on it, so it
    # carries no gradient. For all -inf rows use 0 so exp sees -inf - 0, not
    # -inf - -inf = NaN.
    shift_NR = lse_PNR.detach().amax(0)
    shift_NR = torch.where(torch.isneginf(shift_NR), 0.0, shift_NR)
    w_PNR = torch.exp(lse_PNR - shift_NR)
    wsum_NR = w_PNR.sum(0)
    has_key_NR = wsum_NR > 0
    wsum_NR = torch.where(has_key_NR, wsum_NR, 1.0)
    lse_NR = torch.where(has_key_NR, shift_NR + torch.log(wsum_NR), -math.inf)
    out_RNH = None
    for out_p_RNH, w_NR in zip(outs, (w_PNR / wsum_NR).unbind(0)):
        w_RN1 = w_NR.t().unsqueeze(-1)
        # A part with no key may hold garbage (even NaN) in out; 0 * NaN = NaN,
        # so drop it by selection rather than by weight.
        term_RNH = torch.where(w_RN1 > 0, out_p_RNH.float(), 0.0) * w_RN1
        out_RNH = term_RNH if out_RNH is None else out_RNH + term_RNH
    return out_RNH.to(outs[0].dtype), lse_NR
