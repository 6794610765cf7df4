"""The pure-PyTorch sgl_kernel CPU stand-ins (titan_spec/rollout/sglang/server/
titan_spec_sglang_cpu.py) against plain dense references. Runs with torch only: without
sgl_kernel, apply() defines the ops itself."""

import os
import sys

import pytest
import torch

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "titan_spec/rollout/sglang/server")
)
import titan_spec_sglang_cpu as cpu  # noqa: E402

ops = torch.ops.sgl_kernel


@pytest.fixture(scope="module", autouse=True)
def _applied():
    cpu.apply()


def test_apply_is_idempotent_and_names_every_op():
    first = cpu.apply()
    assert cpu.apply() is first
    for name in cpu.OPS:
        assert hasattr(ops, name), name


def _dense_attention(q_QHD, k_KHD, v_KHD, allowed_QK, scale):
    group = q_QHD.shape[1] // k_KHD.shape[1]
    k, v = k_KHD.repeat_interleave(group, 1), v_KHD.repeat_interleave(group, 1)
    s_HQK = torch.einsum("qhd,khd->hqk", q_QHD, k) * scale
    p_HQK = s_HQK.masked_fill(~allowed_QK, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", p_HQK, v)


def _pool(n_slots=40, n_kv=2, d=16, rows=4, pool_len=24):
    g = torch.Generator().manual_seed(0)
    k_buf = torch.randn(n_slots, n_kv, d, generator=g)
    v_buf = torch.randn(n_slots, n_kv, d, generator=g)
    req_to_token = torch.randperm(n_slots, generator=g).repeat(3)[: rows * pool_len].view(rows, pool_len).int()
    return k_buf, v_buf, req_to_token


def test_decode_attention_matches_dense_and_writes_the_new_kv():
    k_buf, v_buf, req_to_token = _pool()
    seq_lens = torch.tensor([5, 9])
    rows = torch.tensor([2, 0])
    n_q, d = 4, 16
    q = torch.randn(2, n_q, d)
    key, value = torch.randn(2, 2, d), torch.randn(2, 2, d)
    loc = torch.stack([req_to_token[r, n - 1] for r, n in zip(rows, seq_lens)]).long()
    k_ref, v_ref = k_buf.clone(), v_buf.clone()
    k_ref[loc], v_ref[loc] = key, value
    out = torch.empty_like(q)
    logits = torch.empty(2, n_q, 8, d + 1)
    ops.decode_attention_cpu(
        q, k_buf, v_buf, 1.0, 1.0, out, key, value, loc, logits, req_to_token, rows, seq_lens,
        0.25, 0.0, False, 0, None, None,
    )  # fmt: skip
    assert torch.equal(k_buf, k_ref) and torch.equal(v_buf, v_ref)
    for i, (r, n) in enumerate(zip(rows.tolist(), seq_lens.tolist())):
        slots = req_to_token[r, :n].long()
        want = _dense_attention(q[i : i + 1], k_ref[slots], v_ref[slots], torch.ones(1, n, dtype=torch.bool), 0.25)
        torch.testing.assert_close(out[i : i + 1], want)


def test_extend_attention_matches_dense_causal_over_prefix_and_new_tokens():
    k_buf, v_buf, req_to_token = _pool()
    seq_lens, ext_lens = torch.tensor([7, 4]), torch.tensor([3, 4])  # prefixes 4 and 0
    starts = torch.tensor([0, 3])
    rows = torch.tensor([1, 3])
    n_tok, n_q, d = int(ext_lens.sum()), 4, 16
    q, k_new, v_new = torch.randn(n_tok, n_q, d), torch.randn(n_tok, 2, d), torch.randn(n_tok, 2, d)
    out = torch.empty_like(q)
    ops.extend_attention_cpu(
        q, k_new, v_new, out, k_buf, v_buf, 1.0, 1.0, req_to_token, rows, seq_lens, ext_lens, starts, 4,
        0.25, 0.0, False, 0, None, None, None, True,
    )  # fmt: skip
    for r, n, e, s in zip(rows.tolist(), seq_lens.tolist(), ext_lens.tolist(), starts.tolist()):
        prefix = req_to_token[r, : n - e].long()
        k = torch.cat([k_buf[prefix], k_new[s : s + e]])
        v = torch.cat([v_buf[prefix], v_new[s : s + e]])
        allowed = torch.arange(n).view(1, -1) <= torch.arange(n - e, n).view(-1, 1)
        torch.testing.assert_close(out[s : s + e], _dense_attention(q[s : s + e], k, v, allowed, 0.25))


def test_slot_bookkeeping_round_trips():
    req_to_token = torch.zeros(3, 10, dtype=torch.int32)
    rows, start, end = torch.tensor([2, 0]), torch.tensor([1, 4]), torch.tensor([4, 6])
    locs = torch.tensor([11, 12, 13, 21, 22])
    ops.assign_req_to_token_pool_cpu(rows, req_to_token, start, end, locs, 10)
    assert req_to_token[2, 1:4].tolist() == [11, 12, 13] and req_to_token[0, 4:6].tolist() == [21, 22]
    back = torch.empty(5, dtype=torch.int64)
    ops.assign_extend_cache_locs_cpu(rows, req_to_token, start, end, back, 10)
    assert back.tolist() == locs.tolist()

    table = torch.arange(30, dtype=torch.int32).view(3, 10)
    seq_lens, topk, steps = torch.tensor([2, 5]), 2, 2
    draft = torch.empty(2 * topk * steps, dtype=torch.int64)
    ops.assign_draft_cache_locs_contiguous_cpu(rows, table, seq_lens, draft, 10, topk, steps)
    assert draft.tolist() == [22, 23, 24, 25, 5, 6, 7, 8]
    meta = ops.build_draft_decode_metadata_cpu(table, rows, seq_lens, topk, steps, 10)
    assert meta.shape == (4, 10)
    # row b*topk+k: the prefix, then candidate k's num_steps draft slots
    assert meta[0, :4].tolist() == [20, 21, 22, 23] and meta[1, :4].tolist() == [20, 21, 24, 25]
    assert meta[3, :7].tolist() == [0, 1, 2, 3, 4, 7, 8]


def test_accept_and_bonus_gathers():
    accept_index = torch.tensor([[0, 1, -1, -1], [4, -1, -1, -1]], dtype=torch.int32)
    out_cache_loc = torch.arange(100, 108)
    packed = torch.zeros(8, dtype=torch.int64)
    ops.fill_accept_out_cache_loc_cpu(accept_index.view(-1), out_cache_loc, packed)
    assert packed[:3].tolist() == [100, 101, 104]
    accept_tokens = torch.tensor([[7, 8, 9, 0], [5, 6, 0, 0]], dtype=torch.int32)
    bonus = torch.empty(2, dtype=torch.int32)
    ops.fill_bonus_tokens_cpu(accept_tokens, torch.tensor([3, 1], dtype=torch.int32), bonus, 4)
    assert bonus.tolist() == [9, 5]


def test_copy_all_layer_kv_cache_moves_slots_in_every_buffer():
    bufs = [torch.randn(12, 2, 8), torch.randn(12, 2, 8).to(torch.bfloat16)]
    want = [b.clone() for b in bufs]
    tgt, src = torch.tensor([3, 4]), torch.tensor([4, 9])  # overlapping: 4 is read before written
    for w in want:
        w[tgt] = w[src].clone()
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64)
    strides = torch.tensor([b.stride(0) * b.element_size() for b in bufs])
    ops.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    for b, w in zip(bufs, want):
        assert torch.equal(b, w)


@pytest.mark.parametrize("mask_mode", [0, 1])
def test_build_tree_of_a_topk1_chain(mask_mode):
    bs, steps, n = 2, 3, 4
    seq_lens = torch.tensor([5, 2])
    parent_list = torch.tensor([[-1, 0, 1]] * bs)  # topk=1: step s's pick descends from step s-1's
    selected = torch.tensor([[0, 1, 2]] * bs)
    if mask_mode == 1:
        mask = torch.zeros(bs * n * n, dtype=torch.bool)
    else:
        mask = torch.ones(int(seq_lens.sum()) * n + bs * n * n, dtype=torch.bool)
    positions = torch.empty(bs * n, dtype=torch.int64)
    index, next_tok, sibling = torch.full((3, bs, n), -1, dtype=torch.int64)
    ops.build_tree_kernel_efficient_cpu(
        parent_list, selected, seq_lens, mask, positions, index, next_tok, sibling, 1, steps, n, mask_mode
    )
    assert positions.tolist() == [5, 6, 7, 8, 2, 3, 4, 5]
    assert index.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert next_tok.tolist() == [[1, 2, 3, -1]] * bs and sibling.tolist() == [[-1] * n] * bs
    chain = torch.tril(torch.ones(n, n, dtype=torch.bool))
    if mask_mode == 1:
        assert torch.equal(mask.view(bs, n, n), chain.expand(bs, n, n))
    else:
        offset = 0
        for s in seq_lens.tolist():
            block = mask[offset : offset + n * (s + n)].view(n, s + n)
            assert block[:, :s].all() and torch.equal(block[:, s:], chain)
            offset += n * (s + n)


def test_verify_tree_greedy_on_chains_matches_a_loop():
    g = torch.Generator().manual_seed(0)
    bs, n = 6, 4
    candidates = torch.randint(0, 3, (bs, n), generator=g)
    target = torch.randint(0, 3, (bs, n), generator=g)
    index = torch.arange(bs * n).view(bs, n)
    next_tok = torch.tensor([[1, 2, 3, -1]] * bs)
    sibling = torch.full((bs, n), -1)
    predicts = torch.zeros(bs * n, dtype=torch.int32)
    accept_index = torch.full((bs, n), -1, dtype=torch.int32)
    accept_num = torch.zeros(bs, dtype=torch.int32)
    ops.verify_tree_greedy_cpu(predicts, accept_index, accept_num, candidates, index, next_tok, sibling, target)
    for b in range(bs):
        k = 0  # a chain accepts draft j while it equals the target's token after draft j-1
        while k + 1 < n and candidates[b, k + 1] == target[b, k]:
            k += 1
        assert accept_num[b] == k
        assert accept_index[b].tolist() == [b * n + j for j in range(k + 1)] + [-1] * (n - k - 1)
        assert predicts[b * n : b * n + k + 1].tolist() == target[b, : k + 1].tolist()


def _chain_sample(target_probs, drafts, n):
    """n draws of the sampled-verify stand-in on one chain (root + len(drafts) drafts) with
    these target rows, as n requests of one batch; returns the committed tokens [n, depth + 1]
    padded with -1 and the accepted counts."""
    depth = len(drafts)
    nodes = depth + 1
    candidates = torch.tensor([[0] + drafts] * n)
    index = torch.arange(n * nodes).view(n, nodes)
    next_tok = torch.tensor([list(range(1, nodes)) + [-1]] * n)
    sibling = torch.full((n, nodes), -1)
    predicts = torch.zeros(n * nodes, dtype=torch.int32)
    accept_index = torch.full((n, nodes), -1, dtype=torch.int32)
    accept_num = torch.zeros(n, dtype=torch.int32)
    g = torch.Generator().manual_seed(1)
    coins, final = torch.rand(n, nodes, generator=g), torch.rand(n, generator=g)
    probs = target_probs.expand(n, -1, -1).contiguous()
    cpu.tree_speculative_sampling_target_only_cpu(
        predicts, accept_index, accept_num, candidates, index, next_tok, sibling,
        coins, final, probs, torch.zeros_like(probs),
    )  # fmt: skip
    out = torch.full((n, nodes), -1)
    for b in range(n):
        k = int(accept_num[b])
        out[b, : k + 1] = predicts[accept_index[b, : k + 1].long()]
    return out, accept_num


def test_sampled_verify_on_a_chain_draws_from_the_target():
    """Target-only rejection sampling with a deterministic draft: token 1 follows target row 0
    whatever the draft proposed, token 2 follows row 1 given token 1 = draft 1, and each draft
    is accepted with its target probability (chi-square, p > 1e-3; power against another row)."""
    from helpers.chi2 import chi2_groups, chi2_pvalue

    g = torch.Generator().manual_seed(0)
    probs_LV = torch.softmax(torch.randn(3, 7, generator=g) * 1.5, -1)
    drafts, n = [2, 5], 6000
    out, accepted = _chain_sample(probs_LV, drafts, n)
    assert chi2_pvalue(*chi2_groups([(torch.bincount(out[:, 0], minlength=7), probs_LV[0])])) > 1e-3
    hit = out[:, 0] == drafts[0]
    assert chi2_pvalue(*chi2_groups([(torch.bincount(out[hit, 1], minlength=7), probs_LV[1])])) > 1e-3
    assert chi2_pvalue(*chi2_groups([(torch.bincount(out[hit, 1], minlength=7), probs_LV[2])])) < 1e-6
    # accepted counts: 0 w.p. 1 - p0(d1), 1 w.p. p0(d1) (1 - p1(d2)), 2 w.p. p0(d1) p1(d2)
    a, b = float(probs_LV[0, drafts[0]]), float(probs_LV[1, drafts[1]])
    expect = torch.tensor([1 - a, a * (1 - b), a * b])
    assert chi2_pvalue(*chi2_groups([(torch.bincount(accepted, minlength=3), expect)])) > 1e-3
    # a rejected draft is never the token committed in its place
    assert not (out[~hit, 0] == drafts[0]).any()


def test_sampled_verify_with_a_one_hot_target_is_greedy():
    """A row renormalized to top_k = 1 (how SGLang sends a greedy request in a sampled batch)
    commits exactly the argmax chain, like the greedy verifier."""
    probs_LV = torch.zeros(3, 7)
    probs_LV[0, 2] = probs_LV[1, 4] = probs_LV[2, 6] = 1.0
    out, accepted = _chain_sample(probs_LV, [2, 5], 500)
    assert (accepted == 1).all() and (out[:, :2] == torch.tensor([2, 4])).all() and (out[:, 2] == -1).all()


def test_top_k_and_top_p_renorm_match_a_direct_rule():
    g = torch.Generator().manual_seed(2)
    probs_RV = torch.softmax(torch.randn(5, 11, generator=g) * 2, -1)
    top_ks = torch.tensor([1, 3, 11, 20, 5])
    got = cpu.top_k_renorm_prob_cpu(probs_RV, top_ks)
    top_ps = torch.tensor([0.1, 0.5, 0.9, 1.0, 0.7])
    got_p = cpu.top_p_renorm_prob_cpu(probs_RV, top_ps)
    for r in range(5):
        order = probs_RV[r].argsort(descending=True).tolist()
        keep = torch.zeros(11, dtype=torch.bool)
        keep[order[: int(top_ks[r])]] = True
        ref = torch.where(keep, probs_RV[r], 0.0)
        torch.testing.assert_close(got[r], ref / ref.sum())
        keep, mass = torch.zeros(11, dtype=torch.bool), 0.0
        for t in order:  # a token stays while the mass before it is at most top_p
            if mass > float(top_ps[r]):
                break
            keep[t], mass = True, mass + float(probs_RV[r, t])
        ref = torch.where(keep, probs_RV[r], 0.0)
        torch.testing.assert_close(got_p[r], ref / ref.sum())
