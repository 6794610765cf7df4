# Tests for document-causal attention and EAGLE-3 TTT branch attention.
#
# Shape suffix legend:
#   B = batch rows, L = row length, T = packed tokens, N = query heads,
#   K = kv heads, H = head dim, J = branch steps, S = all keys (trunk + branch)
#
# Every check is against an independent dense float64 reference that builds
# the explicit boolean (query row, key) mask over trunk and branch keys and
# runs a masked softmax. The implementation runs in fp32.

import math

import pytest
import torch

from titan_spec.models import attention_blocks
from titan_spec.models.attention import (
    DocCausalAttention,
    DocMetadata,
    doc_attention,
    doc_metadata_from_positions,
)
from titan_spec.models.attention_blocks import document_blocks, merge_partials
from titan_spec.models.branch_attention import branch_part, ttt_attention

ATOL = 1e-5


# ---------------------------------------------------------------------------
# Dense float64 reference
# ---------------------------------------------------------------------------


def _doc_ids_T(cu_host: tuple[int, ...]) -> torch.Tensor:
    lens = torch.tensor([e - s for s, e in zip(cu_host[:-1], cu_host[1:])])
    return torch.repeat_interleave(torch.arange(len(lens)), lens)


def dense_mask_TS(cu_host: tuple[int, ...], J: int) -> torch.Tensor:
    """[T, T + J*T] bool: trunk keys (same doc, causal), then J diagonal blocks."""
    doc_T = _doc_ids_T(cu_host)
    T = doc_T.numel()
    rows_T = torch.arange(T)
    trunk_TT = (doc_T[:, None] == doc_T[None, :]) & (rows_T[None, :] <= rows_T[:, None])
    branch_TT = torch.eye(T, dtype=torch.bool)
    return torch.cat([trunk_TT] + [branch_TT] * J, dim=1)


def dense_attention(q_TNH, k_SKH, v_SKH, mask_TS, scale):
    """Masked softmax attention in float64. Returns (out_TNH, lse_NT)."""
    N, K = q_TNH.shape[1], k_SKH.shape[1]
    k_SNH = k_SKH.double().repeat_interleave(N // K, 1)
    v_SNH = v_SKH.double().repeat_interleave(N // K, 1)
    s_NTS = torch.einsum("tnh,snh->nts", q_TNH.double(), k_SNH) * scale
    s_NTS = s_NTS.masked_fill(~mask_TS, -math.inf)
    lse_NT = torch.logsumexp(s_NTS, -1)
    p_NTS = torch.exp(s_NTS - lse_NT[..., None])
    return torch.einsum("nts,snh->tnh", p_NTS, v_SNH), lse_NT


def dense_ttt(q_TNH, k0_TKH, v0_TKH, kb_JTKH, vb_JTKH, cu_host, scale):
    J, T = kb_JTKH.shape[0], q_TNH.shape[0]
    k_SKH = torch.cat([k0_TKH, kb_JTKH.reshape(J * T, *kb_JTKH.shape[2:])])
    v_SKH = torch.cat([v0_TKH, vb_JTKH.reshape(J * T, *vb_JTKH.shape[2:])])
    return dense_attention(q_TNH, k_SKH, v_SKH, dense_mask_TS(cu_host, J), scale)


def _meta(cu_host: tuple[int, ...]) -> DocMetadata:
    cu = torch.tensor(cu_host, dtype=torch.int32)
    return DocMetadata(cu, cu.clone())


def _rand(*shape, gen):
    return torch.randn(*shape, generator=gen, dtype=torch.float32)


def _close(actual, expected, what):
    assert actual.shape == expected.shape, f"{what}: {actual.shape} vs {expected.shape}"
    if actual.numel() == 0:
        return
    err = (actual.double() - expected.double()).abs().max().item()
    assert err <= ATOL, f"{what}: max abs err {err:.3g}"


# Packed layouts as host cu_seqlens offsets. B > 1 rows come from positions below.
LAYOUTS = {
    "one_doc": (0, 7),
    "mixed": (0, 1, 5, 6, 9, 13),  # includes two length-1 docs
    "singletons": (0, 1, 2, 3),
}


def _positions_layout() -> tuple[int, ...]:
    # B=2 rows of L=6; row 1 continues nothing from row 0 even though it does
    # not start at position 0.
    positions_BL = torch.tensor([[0, 1, 2, 0, 1, 0], [3, 4, 0, 1, 2, 3]])
    meta = doc_metadata_from_positions(positions_BL)
    cu = tuple(meta.cu_seqlens_cpu.tolist())
    assert cu == (0, 3, 5, 6, 8, 12) and meta.cu_seqlens.tolist() == list(cu)
    assert meta.cu_seqlens.dtype == torch.int32
    return cu


LAYOUTS["rows_B2"] = _positions_layout()


# ---------------------------------------------------------------------------
# TTT attention vs dense: outputs and all five gradients
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("heads", [(4, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("H", [8, 16])
def test_ttt_attention_matches_dense(layout, heads, H):
    cu_host = LAYOUTS[layout]
    N, K = heads
    T = cu_host[-1]
    scale = 1.0 / math.sqrt(H)
    meta = _meta(cu_host)
    gen = torch.Generator().manual_seed(1000 * len(cu_host) + 10 * N * K + H)
    # J = 0..6 is TTT steps 1..7.
    for J in range(7):
        q = _rand(T, N, H, gen=gen).requires_grad_()
        k0, v0 = (_rand(T, K, H, gen=gen).requires_grad_() for _ in range(2))
        kb, vb = (_rand(J, T, K, H, gen=gen).requires_grad_() for _ in range(2))
        w_TNH = _rand(T, N, H, gen=gen)
        inputs = (q, k0, v0, kb, vb)

        out = ttt_attention(q, k0, v0, kb, vb, meta, scale)
        grads = torch.autograd.grad((out * w_TNH).sum(), inputs)

        ref_inputs = [x.detach().double().requires_grad_() for x in inputs]
        ref_out, _ = dense_ttt(*ref_inputs, cu_host, scale)
        ref_grads = torch.autograd.grad((ref_out * w_TNH.double()).sum(), ref_inputs)

        _close(out, ref_out, f"J={J} out")
        # Row-major, as the merge does not leave it: torch 2.11's dynamo passes a zero
        # gradient to an autograd.Function whose output is in another memory order.
        assert out.is_contiguous(), out.stride()
        for name, g, rg in zip(("q", "k0", "v0", "kb", "vb"), grads, ref_grads):
            _close(g, rg, f"J={J} d{name}")


@pytest.mark.parametrize("J", [0, 1, 3])
def test_branch_part_and_merge_match_dense_lse(J):
    cu_host, N, K, H = LAYOUTS["mixed"], 4, 2, 8
    T, scale = cu_host[-1], 0.3
    gen = torch.Generator().manual_seed(J)
    q = _rand(T, N, H, gen=gen)
    k0, v0 = _rand(T, K, H, gen=gen), _rand(T, K, H, gen=gen)
    kb, vb = _rand(J, T, K, H, gen=gen), _rand(J, T, K, H, gen=gen)

    out_t, lse_t = doc_attention(q, k0, v0, _meta(cu_host), scale)
    ref_out_t, ref_lse_t = dense_ttt(q, k0, v0, kb[:0], vb[:0], cu_host, scale)
    _close(out_t, ref_out_t, "trunk out")
    _close(lse_t, ref_lse_t, "trunk lse")

    out_b, lse_b = branch_part(q, kb, vb, scale)
    if J == 0:
        assert torch.all(out_b == 0) and torch.all(torch.isneginf(lse_b))
    else:
        diag_TS = torch.eye(T, dtype=torch.bool).repeat(1, J)
        flat = lambda x: x.reshape(J * T, K, H)
        ref_out_b, ref_lse_b = dense_attention(q, flat(kb), flat(vb), diag_TS, scale)
        _close(out_b, ref_out_b, "branch out")
        _close(lse_b, ref_lse_b, "branch lse")

    out, lse = merge_partials([out_t, out_b], [lse_t, lse_b])
    ref_out, ref_lse = dense_ttt(q, k0, v0, kb, vb, cu_host, scale)
    _close(out, ref_out, "merged out")
    _close(lse, ref_lse, "merged lse")


# ---------------------------------------------------------------------------
# doc_attn_bwd consumes an externally merged (out, lse)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["op", "math"])
@pytest.mark.parametrize("heads", [(4, 2), (2, 2)], ids=["gqa", "mha"])
def test_doc_attn_bwd_uses_given_merged_out_and_lse(backend, heads):
    cu_host, (N, K), H, J = LAYOUTS["mixed"], heads, 16, 2
    T, scale = cu_host[-1], 0.25
    gen = torch.Generator().manual_seed(7)
    q, k, v = _rand(T, N, H, gen=gen), _rand(T, K, H, gen=gen), _rand(T, K, H, gen=gen)
    # Extra keys outside this document-causal part (any mask would do; use the
    # TTT diagonal) stand in for the other parts of a ring / branch merge.
    kx, vx = _rand(J, T, K, H, gen=gen), _rand(J, T, K, H, gen=gen)
    dout = _rand(T, N, H, gen=gen)

    # Reference: q enters the trunk scores and the extra scores as separate
    # leaves, so autograd hands back the trunk's share of dq by itself.
    q_trunk, q_extra, k_r, v_r = (x.double().requires_grad_() for x in (q, q, k, v))
    rep = lambda x: x.double().reshape(-1, K, H).repeat_interleave(N // K, 1)
    s_trunk = torch.einsum("tnh,snh->nts", q_trunk, rep(k_r)) * scale
    kx_r, vx_r = rep(kx), rep(vx)
    s_extra = torch.einsum("tnh,snh->nts", q_extra, kx_r) * scale
    mask = dense_mask_TS(cu_host, J)
    s_all = torch.cat([s_trunk, s_extra], -1).masked_fill(~mask, -math.inf)
    lse_ref = torch.logsumexp(s_all, -1)
    p_all = torch.exp(s_all - lse_ref[..., None])
    v_all = torch.cat([rep(v_r), vx_r])
    out_ref = torch.einsum("nts,snh->tnh", p_all, v_all)
    dq_ref, dk_ref, dv_ref = torch.autograd.grad((out_ref * dout.double()).sum(), (q_trunk, k_r, v_r))

    out_m, lse_m = out_ref.detach().float(), lse_ref.detach().float()
    meta = _meta(cu_host)
    if backend == "op":
        dq, dk, dv = torch.ops.titan_spec.doc_attn_bwd(
            dout, q, k, v, out_m, lse_m, meta.cu_seqlens, meta.cu_seqlens_cpu, scale
        )
    else:
        dq, dk, dv = attention_blocks._math_bwd(dout, q, k, v, out_m, lse_m, document_blocks(cu_host), scale)
    _close(dq, dq_ref, "dq")
    _close(dk, dk_ref, "dk")
    _close(dv, dv_ref, "dv")

    # And it must NOT be what you get from the trunk's own partial lse (the
    # SpecForge #536 bug): the test above would be vacuous otherwise.
    out_p, lse_p = doc_attention(q, k, v, meta, scale)
    dq_bad, _, _ = torch.ops.titan_spec.doc_attn_bwd(
        dout, q, k, v, out_p, lse_p, meta.cu_seqlens, meta.cu_seqlens_cpu, scale
    )
    assert (dq_bad.double() - dq_ref).abs().max() > 1e-2


def test_math_fallback_forward_matches_dense():
    cu_host, N, K, H = LAYOUTS["rows_B2"], 4, 2, 8
    T, scale = cu_host[-1], 0.35
    gen = torch.Generator().manual_seed(3)
    q, k, v = _rand(T, N, H, gen=gen), _rand(T, K, H, gen=gen), _rand(T, K, H, gen=gen)
    out, lse = attention_blocks._math_fwd(q, k, v, document_blocks(cu_host), scale)
    ref_out, ref_lse = dense_attention(q, k, v, dense_mask_TS(cu_host, 0), scale)
    _close(out, ref_out, "out")
    _close(lse, ref_lse, "lse")


# ---------------------------------------------------------------------------
# The block kernel on blocks that are not documents (the ring's shapes)
# ---------------------------------------------------------------------------

# (q_start, q_end, k_start, k_end, causal) over 14 query rows and 11 key rows:
# query rows 3-4 and keys 0-1 are in no block, key ranges are offset from the
# query ranges, and unmasked blocks have L != M.
BLOCK_LISTS = {
    "unmasked": [(0, 3, 2, 7, False), (5, 9, 7, 8, False), (9, 14, 8, 11, False)],
    "causal_shifted": [(0, 4, 3, 7, True), (6, 9, 8, 11, True)],
}


def _blocks_mask(blocks, q_rows, k_rows):
    mask_RS = torch.zeros(q_rows, k_rows, dtype=torch.bool)
    for qs, qe, ks, ke, causal in blocks:
        for i in range(qs, qe):
            for j in range(ks, ke):
                mask_RS[i, j] = not causal or j - ks <= i - qs
    return mask_RS


@pytest.mark.parametrize("backend", ["cpu", "math"])
@pytest.mark.parametrize("name", sorted(BLOCK_LISTS))
def test_block_kernel_matches_dense_on_offset_blocks(backend, name):
    blocks, (N, K, H), scale = BLOCK_LISTS[name], (4, 2, 8), 0.4
    gen = torch.Generator().manual_seed(21)
    q, dout = _rand(14, N, H, gen=gen), _rand(14, N, H, gen=gen)
    k, v = _rand(11, K, H, gen=gen), _rand(11, K, H, gen=gen)
    fwd = getattr(attention_blocks, f"_{backend}_fwd")
    bwd = getattr(attention_blocks, f"_{backend}_bwd")
    out, lse = fwd(q, k, v, blocks, scale)
    dq, dk, dv = bwd(dout, q, k, v, out, lse, blocks, scale)

    mask_RS = _blocks_mask(blocks, 14, 11)
    rows = mask_RS.any(1)
    ref_in = [x.double().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = dense_attention(ref_in[0][rows], ref_in[1], ref_in[2], mask_RS[rows], scale)
    ref_dq, ref_dk, ref_dv = torch.autograd.grad((ref_out * dout[rows].double()).sum(), ref_in)
    _close(out[rows], ref_out, "out")
    _close(lse[:, rows], ref_lse, "lse")
    # A row in no block has no key: out 0, lse -inf, no gradient.
    assert torch.all(out[~rows] == 0) and torch.all(torch.isneginf(lse[:, ~rows]))
    _close(dq, ref_dq, "dq")
    _close(dk, ref_dk, "dk")
    _close(dv, ref_dv, "dv")


@pytest.mark.parametrize(
    "blocks",
    [
        [(0, 4, 0, 4, False), (2, 6, 4, 8, False)],  # a query row in two blocks
        [(0, 4, 0, 4, False), (4, 8, 2, 6, False)],  # a key row in two blocks
        [(4, 8, 4, 8, False), (0, 4, 0, 4, False)],  # out of order
        [(0, 4, 0, 4, True), (4, 8, 4, 8, False)],  # two causal flags
        [(0, 4, 0, 3, True)],  # causal but not square
        [(0, 4, 4, 4, False)],  # empty
        [(6, 10, 0, 4, False)],  # past the last row
    ],
)
def test_block_kernel_rejects_blocks_outside_its_contract(blocks):
    gen = torch.Generator().manual_seed(0)
    q, k, v = _rand(8, 2, 8, gen=gen), _rand(8, 2, 8, gen=gen), _rand(8, 2, 8, gen=gen)
    with pytest.raises(ValueError, match="attention block"):
        attention_blocks.blocks_fwd(q, k, v, blocks, 0.3)
    with pytest.raises(ValueError, match="attention block"):
        attention_blocks.blocks_bwd(q, q, k, v, q, q[:, :, 0].t(), blocks, 0.3)


# ---------------------------------------------------------------------------
# merge_partials
# ---------------------------------------------------------------------------


def test_merge_partials_all_neg_inf_row_is_zero_not_nan():
    T, N, H = 3, 2, 4
    gen = torch.Generator().manual_seed(0)
    outs = [_rand(T, N, H, gen=gen).requires_grad_() for _ in range(3)]
    lses = [_rand(N, T, gen=gen).requires_grad_() for _ in range(3)]
    with torch.no_grad():
        for p, (o, l) in enumerate(zip(outs, lses)):
            l[:, 1] = -math.inf  # row 1 has no key in any part
            if p == 0:
                o[1] = float("nan")  # garbage in an empty part must not leak
        lses[2][0, 2] = -math.inf  # one empty part on an otherwise valid row

    out, lse = merge_partials(outs, lses)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.all(out[1] == 0)
    assert torch.all(torch.isneginf(lse[:, 1]))

    lse_PNT = torch.stack([l.detach() for l in lses]).double()
    ref_lse = torch.logsumexp(lse_PNT, 0)
    w_PNT = torch.exp(lse_PNT - ref_lse).nan_to_num(0.0)
    ref_out = sum(w.t()[..., None] * o.detach().double().nan_to_num(0.0) for w, o in zip(w_PNT, outs))
    for t in (0, 2):
        _close(out[t], ref_out[t], f"out row {t}")
        _close(lse[:, t], ref_lse[:, t], f"lse row {t}")

    grads = torch.autograd.grad(out.sum() + lse[:, [0, 2]].sum(), outs + lses)
    assert all(torch.isfinite(g).all() for g in grads)


# ---------------------------------------------------------------------------
# torchtitan module + compile
# ---------------------------------------------------------------------------


def _module_inputs(gen, B=2, L=6, N=4, K=2, H=8):
    q = _rand(B, L, N, H, gen=gen).requires_grad_()
    k = _rand(B, L, K, H, gen=gen).requires_grad_()
    v = _rand(B, L, K, H, gen=gen).requires_grad_()
    positions = torch.tensor([[0, 1, 2, 0, 1, 0], [3, 4, 0, 1, 2, 3]])
    return q, k, v, doc_metadata_from_positions(positions)


def test_doc_causal_attention_module_matches_dense():
    module = DocCausalAttention.Config().build()
    assert isinstance(module, DocCausalAttention)
    gen = torch.Generator().manual_seed(11)
    q, k, v, meta = _module_inputs(gen)
    B, L, N, H = q.shape
    w = _rand(B, L, N, H, gen=gen)
    out = module(q, k, v, attention_masks=meta, enable_gqa=True)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))

    flat = lambda x: x.detach().double().reshape(B * L, x.shape[2], H).requires_grad_()
    rq, rk, rv = flat(q), flat(k), flat(v)
    mask = dense_mask_TS(tuple(meta.cu_seqlens_cpu.tolist()), 0)
    ref_out, _ = dense_attention(rq, rk, rv, mask, 1.0 / math.sqrt(H))
    ref_loss = (ref_out * w.double().reshape(B * L, N, H)).sum()
    ref_grads = torch.autograd.grad(ref_loss, (rq, rk, rv))
    _close(out.reshape(B * L, N, H), ref_out, "out")
    for g, rg in zip(grads, ref_grads):
        _close(g.reshape(rg.shape), rg, "grad")

    with pytest.raises(AssertionError):
        module(q, k, v, attention_masks=meta)  # GQA without enable_gqa


def test_compile_fullgraph_aot_eager():
    torch._dynamo.reset()
    module = DocCausalAttention.Config().build()
    gen = torch.Generator().manual_seed(5)
    q, k, v, meta = _module_inputs(gen)
    T = q.shape[0] * q.shape[1]
    kb = _rand(2, T, 2, 8, gen=gen).requires_grad_()
    vb = _rand(2, T, 2, 8, gen=gen).requires_grad_()

    def step(q, k, v, kb, vb, meta):
        # Module output feeds TTT attention as its queries: both ops in one graph.
        out = module(q, k, v, attention_masks=meta, scale=0.3, enable_gqa=True)
        out_TNH = ttt_attention(
            out.reshape(T, 4, 8),
            k.reshape(T, 2, 8),
            v.reshape(T, 2, 8),
            kb,
            vb,
            meta,
            0.3,
        )
        return (out_TNH * out_TNH).sum()

    inputs = (q, k, v, kb, vb)
    loss = step(*inputs, meta)
    grads = torch.autograd.grad(loss, inputs)

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    c_loss = compiled(*inputs, meta)
    c_grads = torch.autograd.grad(c_loss, inputs)
    _close(c_loss, loss, "loss")
    for g, cg in zip(grads, c_grads):
        _close(cg, g, "grad")


def test_custom_ops_opcheck():
    cu_host, N, K, H = LAYOUTS["mixed"], 4, 2, 8
    T = cu_host[-1]
    gen = torch.Generator().manual_seed(2)
    q = _rand(T, N, H, gen=gen).requires_grad_()
    k, v = (_rand(T, K, H, gen=gen).requires_grad_() for _ in range(2))
    cu = torch.tensor(cu_host, dtype=torch.int32)
    fwd_args = (q, k, v, cu, cu.clone(), 0.3)
    tests = (
        "test_schema",
        "test_autograd_registration",
        "test_faketensor",
        "test_aot_dispatch_dynamic",
    )
    fwd_op = torch.ops.titan_spec.doc_attn_fwd
    bwd_op = torch.ops.titan_spec.doc_attn_bwd
    torch.library.opcheck(fwd_op.default, fwd_args, test_utils=tests)
    out, lse = fwd_op(*fwd_args)
    bwd_args = (_rand(T, N, H, gen=gen), q.detach(), k.detach(), v.detach(), out.detach(), lse, cu, cu.clone(), 0.3)
    torch.library.opcheck(bwd_op.default, bwd_args, test_utils=tests)


def test_expanded_and_transposed_dout():
    # out.sum() hands the backward a stride-0 expanded dout; layouts like that
    # must give the same gradients as a dense dout of ones.
    cu_host, N, K, H, J = LAYOUTS["mixed"], 4, 2, 8, 2
    T = cu_host[-1]
    gen = torch.Generator().manual_seed(9)
    inputs = [
        _rand(T, N, H, gen=gen),
        _rand(T, K, H, gen=gen),
        _rand(T, K, H, gen=gen),
        _rand(J, T, K, H, gen=gen),
        _rand(J, T, K, H, gen=gen),
    ]
    inputs = [x.requires_grad_() for x in inputs]
    meta = _meta(cu_host)
    g_expanded = torch.autograd.grad(ttt_attention(*inputs, meta, 0.3).sum(), inputs)
    ones = torch.ones(N, T, H).transpose(0, 1)
    loss = (ttt_attention(*inputs, meta, 0.3) * ones).sum()
    g_dense = torch.autograd.grad(loss, inputs)
    for a, b in zip(g_expanded, g_dense):
        _close(a, b, "grad")
