# The attention kernel: softmax attention over a list of blocks, returning the LSE.
#
# Shape letters (titan_spec/shapes.py): R is whatever stream the blocks index, the packed
# tokens of document attention or a context-parallel rank's local rows.
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


def _to_1NLH(x_RNHd: torch.Tensor, s: int, e: int) -> torch.Tensor:
    # aten SDPA kernels want [B, N, rows, Hd]; a strided view is fine (checked:
    # the CPU flash fwd/bwd give bit-identical results for views and copies).
    return x_RNHd[s:e].transpose(0, 1).unsqueeze(0)


def _fold_gqa(dx_RNHd: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    # Query head n read kv head n // Gq, so the kv grad is the sum over its Gq heads.
    R, N, H = dx_RNHd.shape
    if N == num_kv_heads:
        return dx_RNHd
    dx_RKvGqHd = dx_RNHd.float().view(R, num_kv_heads, N // num_kv_heads, H)
    return dx_RKvGqHd.sum(2).to(dx_RNHd.dtype)


def _repeat_kv(x_RKvHd: torch.Tensor, num_heads: int) -> torch.Tensor:
    K = x_RKvHd.shape[1]
    return x_RKvHd if K == num_heads else x_RKvHd.repeat_interleave(num_heads // K, 1)


# ---------------------------------------------------------------------------
# CPU: the aten flash kernels, one call per block (they take Lq != Lk).
#
# _scaled_dot_product_flash_attention_for_cpu_backward (torch 2.14.1 schema:
# grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *,
# attn_mask, scale) uses the given logsumexp for P = exp(S*scale - lse) and
# rowsum(grad_out * out) for the softmax correction; it does not recompute
# either, so an externally merged (out, lse) gives the exact gradient of the
# merged softmax. tests/test_attention.py checks this property.
# ---------------------------------------------------------------------------


def _cpu_fwd(q_RNHd, k_RKvHd, v_RKvHd, blocks, scale):
    R, N, _ = q_RNHd.shape
    k_RNHd, v_RNHd = _repeat_kv(k_RKvHd, N), _repeat_kv(v_RKvHd, N)
    out_RNHd = q_RNHd.new_zeros(R, N, v_RKvHd.shape[-1])
    lse_NR = q_RNHd.new_full((N, R), -math.inf, dtype=torch.float32)
    for qs, qe, ks, ke, causal in blocks:
        out_1NLqHd, lse_1NLq = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            _to_1NLH(q_RNHd, qs, qe),
            _to_1NLH(k_RNHd, ks, ke),
            _to_1NLH(v_RNHd, ks, ke),
            0.0,
            causal,
            scale=scale,
        )
        out_RNHd[qs:qe] = out_1NLqHd[0].transpose(0, 1)
        lse_NR[:, qs:qe] = lse_1NLq[0]
    return out_RNHd, lse_NR


def _cpu_bwd(dout_RNHd, q_RNHd, k_RKvHd, v_RKvHd, out_RNHd, lse_NR, blocks, scale):
    R, N, _ = q_RNHd.shape
    K = k_RKvHd.shape[1]
    k_RNHd, v_RNHd = _repeat_kv(k_RKvHd, N), _repeat_kv(v_RKvHd, N)
    # The kernel wants lse in its accumulation dtype (fp64 only for fp64 inputs)
    # and grad_out / out in the input dtype.
    lse_dtype = torch.float64 if q_RNHd.dtype == torch.float64 else torch.float32
    lse_NR = lse_NR.to(lse_dtype)
    dout_RNHd = dout_RNHd.to(q_RNHd.dtype)
    out_RNHd = out_RNHd.to(q_RNHd.dtype)
    dq_RNHd = torch.zeros_like(q_RNHd)
    dk_RNHd = torch.zeros_like(k_RNHd)
    dv_RNHd = torch.zeros_like(v_RNHd)
    for qs, qe, ks, ke, causal in blocks:
        dq_1NLqHd, dk_1NLkHd, dv_1NLkHd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _to_1NLH(dout_RNHd, qs, qe),
            _to_1NLH(q_RNHd, qs, qe),
            _to_1NLH(k_RNHd, ks, ke),
            _to_1NLH(v_RNHd, ks, ke),
            _to_1NLH(out_RNHd, qs, qe),
            lse_NR[:, qs:qe].unsqueeze(0),
            0.0,
            causal,
            scale=scale,
        )
        # Plain copies: _check_blocks guarantees no row is in two blocks.
        dq_RNHd[qs:qe] = dq_1NLqHd[0].transpose(0, 1)
        dk_RNHd[ks:ke] = dk_1NLkHd[0].transpose(0, 1)
        dv_RNHd[ks:ke] = dv_1NLkHd[0].transpose(0, 1)
    return dq_RNHd, _fold_gqa(dk_RNHd, K), _fold_gqa(dv_RNHd, K)


# ---------------------------------------------------------------------------
# Math fallback (fp32 accumulation, O(Lq*Lk) per block). Used on CUDA for dtypes
# flash kernels reject (fp32/fp64); kept device-agnostic so the CPU tests
# exercise it too. Query heads split as (K, G) instead of repeating kv heads.
# ---------------------------------------------------------------------------


def _math_scores(q_RNHd, k_RKvHd, block, scale):
    qs, qe, ks, ke, causal = block
    K = k_RKvHd.shape[1]
    L, N, H = qe - qs, q_RNHd.shape[1], q_RNHd.shape[2]
    q_LqKvGqHd = q_RNHd[qs:qe].float().reshape(L, K, N // K, H)
    s_KvGqLqLk = torch.einsum("lkgh,mkh->kglm", q_LqKvGqHd, k_RKvHd[ks:ke].float()) * scale
    if not causal:
        return s_KvGqLqLk
    future_LqLk = torch.ones(L, L, dtype=torch.bool, device=q_RNHd.device).triu(1)
    return s_KvGqLqLk.masked_fill(future_LqLk, -math.inf)


def _math_fwd(q_RNHd, k_RKvHd, v_RKvHd, blocks, scale):
    R, N, _ = q_RNHd.shape
    Hv = v_RKvHd.shape[-1]
    out_RNHd = q_RNHd.new_zeros(R, N, Hv)
    lse_NR = q_RNHd.new_full((N, R), -math.inf, dtype=torch.float32)
    for block in blocks:
        qs, qe, ks, ke, _ = block
        s_KvGqLqLk = _math_scores(q_RNHd, k_RKvHd, block, scale)
        lse_KvGqLq = torch.logsumexp(s_KvGqLqLk, -1)
        p_KvGqLqLk = torch.exp(s_KvGqLqLk - lse_KvGqLq.unsqueeze(-1))
        out_LqKvGqHd = torch.einsum("kglm,mkh->lkgh", p_KvGqLqLk, v_RKvHd[ks:ke].float())
        out_RNHd[qs:qe] = out_LqKvGqHd.reshape(qe - qs, N, Hv)
        lse_NR[:, qs:qe] = lse_KvGqLq.reshape(N, qe - qs)
    return out_RNHd, lse_NR


def _math_bwd(dout_RNHd, q_RNHd, k_RKvHd, v_RKvHd, out_RNHd, lse_NR, blocks, scale):
    R, N, H = q_RNHd.shape
    K, Hv = k_RKvHd.shape[1], v_RKvHd.shape[-1]
    G = N // K
    dq_RNHd = torch.zeros(R, N, H, dtype=torch.float32, device=q_RNHd.device)
    dk_RKvHd = torch.zeros(k_RKvHd.shape[0], K, H, dtype=torch.float32, device=q_RNHd.device)
    dv_RKvHd = torch.zeros(v_RKvHd.shape[0], K, Hv, dtype=torch.float32, device=q_RNHd.device)
    for block in blocks:
        qs, qe, ks, ke, _ = block
        L = qe - qs
        s_KvGqLqLk = _math_scores(q_RNHd, k_RKvHd, block, scale)
        # The given (possibly merged) lse, never a recomputed one.
        lse_KvGqLq = lse_NR[:, qs:qe].float().reshape(K, G, L)
        p_KvGqLqLk = torch.exp(s_KvGqLqLk - lse_KvGqLq.unsqueeze(-1))
        dout_LqKvGqHd = dout_RNHd[qs:qe].float().reshape(L, K, G, Hv)
        out_LqKvGqHd = out_RNHd[qs:qe].float().reshape(L, K, G, Hv)
        delta_KvGqLq = (dout_LqKvGqHd * out_LqKvGqHd).sum(-1).permute(1, 2, 0)
        dp_KvGqLqLk = torch.einsum("lkgh,mkh->kglm", dout_LqKvGqHd, v_RKvHd[ks:ke].float())
        ds_KvGqLqLk = p_KvGqLqLk * (dp_KvGqLqLk - delta_KvGqLq.unsqueeze(-1)) * scale
        q_LqKvGqHd = q_RNHd[qs:qe].float().reshape(L, K, G, H)
        dq_LqKvGqHd = torch.einsum("kglm,mkh->lkgh", ds_KvGqLqLk, k_RKvHd[ks:ke].float())
        dq_RNHd[qs:qe] = dq_LqKvGqHd.reshape(L, N, H)
        dk_RKvHd[ks:ke] = torch.einsum("kglm,lkgh->mkh", ds_KvGqLqLk, q_LqKvGqHd)
        dv_RKvHd[ks:ke] = torch.einsum("kglm,lkgh->mkh", p_KvGqLqLk, dout_LqKvGqHd)
    return dq_RNHd.to(q_RNHd.dtype), dk_RKvHd.to(k_RKvHd.dtype), dv_RKvHd.to(v_RKvHd.dtype)


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


def _use_cuda_flash(q_RNHd: torch.Tensor) -> bool:
    return q_RNHd.is_cuda and q_RNHd.dtype in (torch.float16, torch.bfloat16)


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


def _rows(x_RNHd: torch.Tensor, idx: torch.Tensor | None) -> torch.Tensor:
    return x_RNHd if idx is None else x_RNHd[idx]


def _cuda_fwd(q_RNHd, k_RKvHd, v_RKvHd, blocks, scale, cu_seqlens):
    R, N, _ = q_RNHd.shape
    if not blocks:
        out_RNHd = q_RNHd.new_zeros(R, N, v_RKvHd.shape[-1])
        return out_RNHd, q_RNHd.new_full((N, R), -math.inf, dtype=torch.float32)
    q_idx, k_idx, cu_q, cu_k, max_q, max_k, causal = _varlen_plan(
        blocks, R, k_RKvHd.shape[0], q_RNHd.device, cu_seqlens
    )
    q = _rows(q_RNHd, q_idx).contiguous()
    k, v = _rows(k_RKvHd, k_idx).contiguous(), _rows(v_RKvHd, k_idx).contiguous()
    if _fa_varlen_fwd is not None and q.shape[-1] % 8 == 0:
        out, lse, _, _ = _fa_varlen_fwd(
            q,
            k,
            v,
            cu_q,
            cu_k,
            max_q,
            max_k,
            dropout_p=0.0,
            softmax_scale=scale,
            causal=causal,
        )
    else:
        out, lse, _, _, _ = torch.ops.aten._flash_attention_forward(
            q,
            k,
            v,
            cu_q,
            cu_k,
            max_q,
            max_k,
            0.0,
            causal,
            False,
            scale=scale,
        )
    if q_idx is None:
        return out, lse.float()
    out_RNHd = q_RNHd.new_zeros(R, N, v_RKvHd.shape[-1])
    lse_NR = q_RNHd.new_full((N, R), -math.inf, dtype=torch.float32)
    out_RNHd[q_idx] = out
    lse_NR[:, q_idx] = lse.float()
    return out_RNHd, lse_NR


def _cuda_bwd(dout_RNHd, q_RNHd, k_RKvHd, v_RKvHd, out_RNHd, lse_NR, blocks, scale, cu_seqlens):
    if not blocks:
        return tuple(torch.zeros_like(x) for x in (q_RNHd, k_RKvHd, v_RKvHd))
    q_idx, k_idx, cu_q, cu_k, max_q, max_k, causal = _varlen_plan(
        blocks, q_RNHd.shape[0], k_RKvHd.shape[0], q_RNHd.device, cu_seqlens
    )
    dtype = q_RNHd.dtype
    dout = _rows(dout_RNHd, q_idx).to(dtype).contiguous()
    out = _rows(out_RNHd, q_idx).to(dtype).contiguous()
    q = _rows(q_RNHd, q_idx).contiguous()
    k, v = _rows(k_RKvHd, k_idx).contiguous(), _rows(v_RKvHd, k_idx).contiguous()
    lse = (lse_NR if q_idx is None else lse_NR[:, q_idx]).float().contiguous()
    if _fa_varlen_bwd is not None and q.shape[-1] % 8 == 0:
        dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
        _fa_varlen_bwd(  # writes dq, dk, dv in place
            dout,
            q,
            k,
            v,
            out,
            lse,
            dq,
            dk,
            dv,
            cu_q,
            cu_k,
            max_q,
            max_k,
            dropout_p=0.0,
            softmax_scale=scale,
            causal=causal,
            window_size_left=-1,
            window_size_right=-1,
            softcap=0.0,
            alibi_slopes=None,
            deterministic=False,
        )
    else:
        # No dropout, so the rng state is never read; it only has to exist.
        rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)
        unused = torch.empty(0, device=q.device)
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            dout,
            q,
            k,
            v,
            out,
            lse,
            cu_q,
            cu_k,
            max_q,
            max_k,
            0.0,
            causal,
            rng_state,
            unused,
            scale=scale,
        )
    if q_idx is None:
        return dq, dk, dv
    dq_RNHd, dk_RKvHd, dv_RKvHd = (torch.zeros_like(x) for x in (q_RNHd, k_RKvHd, v_RKvHd))
    dq_RNHd[q_idx] = dq
    dk_RKvHd[k_idx] = dk
    dv_RKvHd[k_idx] = dv
    return dq_RNHd, dk_RKvHd, dv_RKvHd


# ---------------------------------------------------------------------------
# The kernel
# ---------------------------------------------------------------------------


def blocks_fwd(
    q_RNHd: torch.Tensor,
    k_RKvHd: torch.Tensor,
    v_RKvHd: torch.Tensor,
    blocks: list[Block],
    scale: float,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q over the blocks: (out_RNHd in q's dtype, lse_NR fp32).

    blocks: in order of rows, no query row and no key row in two blocks, one
    causal flag for all (ValueError otherwise). Rows in no block get out = 0,
    lse = -inf. cu_seqlens: optionally the device offsets the blocks were made
    from by document_blocks; the CUDA path then uses them instead of a copy.
    """
    _check_blocks(blocks, q_RNHd.shape[0], k_RKvHd.shape[0])
    if _use_cuda_flash(q_RNHd):
        return _cuda_fwd(q_RNHd, k_RKvHd, v_RKvHd, blocks, scale, cu_seqlens)
    if q_RNHd.device.type == "cpu":
        return _cpu_fwd(q_RNHd, k_RKvHd, v_RKvHd, blocks, scale)
    return _math_fwd(q_RNHd, k_RKvHd, v_RKvHd, blocks, scale)


def blocks_bwd(
    dout_RNHd: torch.Tensor,
    q_RNHd: torch.Tensor,
    k_RKvHd: torch.Tensor,
    v_RKvHd: torch.Tensor,
    out_RNHd: torch.Tensor,
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
    _check_blocks(blocks, q_RNHd.shape[0], k_RKvHd.shape[0])
    args = (dout_RNHd, q_RNHd, k_RKvHd, v_RKvHd, out_RNHd, lse_NR, blocks, scale)
    if _use_cuda_flash(q_RNHd):
        return _cuda_bwd(*args, cu_seqlens)
    if q_RNHd.device.type == "cpu":
        return _cpu_bwd(*args)
    return _math_bwd(*args)


def merge_partials(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact log-sum-exp merge of partial softmax attentions over disjoint keys.

    outs: [R, N, Hd] each; lses: [N, R] each. Returns (out_RNHd in outs[0]'s
    dtype, lse_NR fp32). Rows where every part is -inf (no key at all) give
    out = 0 and lse = -inf, and never produce NaN, forward or backward.
    """
    lse_PtNR = torch.stack([lse.float() for lse in lses])
    # The shift only stabilises exp(); the result does not depend on it, so it
    # carries no gradient. For all -inf rows use 0 so exp sees -inf - 0, not
    # -inf - -inf = NaN.
    shift_NR = lse_PtNR.detach().amax(0)
    shift_NR = torch.where(torch.isneginf(shift_NR), 0.0, shift_NR)
    w_PtNR = torch.exp(lse_PtNR - shift_NR)
    wsum_NR = w_PtNR.sum(0)
    has_key_NR = wsum_NR > 0
    wsum_NR = torch.where(has_key_NR, wsum_NR, 1.0)
    lse_NR = torch.where(has_key_NR, shift_NR + torch.log(wsum_NR), -math.inf)
    out_RNHd = None
    for out_p_RNHd, w_NR in zip(outs, (w_PtNR / wsum_NR).unbind(0)):
        w_RN1 = w_NR.t().unsqueeze(-1)
        # A part with no key may hold garbage (even NaN) in out; 0 * NaN = NaN,
        # so drop it by selection rather than by weight.
        term_RNHd = torch.where(w_RN1 > 0, out_p_RNHd.float(), 0.0) * w_RN1
        out_RNHd = term_RNHd if out_RNHd is None else out_RNHd + term_RNHd
    return out_RNHd.to(outs[0].dtype), lse_NR
