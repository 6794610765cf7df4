# Context parallelism: zigzag layout, ring + branch attention against a dense
# single-process float64 reference, on real gloo process groups.
#
# Shape suffix legend:
#   T = global packed tokens, R = local rows, N = query heads, K = kv heads,
#   H = head dim, J = TTT branch steps

import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from test_attention import dense_ttt
from titan_spec.parallelisms.context_parallel import (
    CPMetadata,
    ZigzagLayout,
    ring_attention,
    ring_blocks,
    zigzag_shard,
    zigzag_unshard,
)
from titan_spec.platform import exit_process

ATOL = 1e-5

# Global document lengths. "short" has documents shorter than 2*cp (one token,
# two tokens) and lengths that need padding for every cp; "long" is one
# document; "mixed" both.
LAYOUTS = {
    "short": (1, 2, 3, 1, 5),
    "long": (24,),
    "mixed": (9, 1, 16, 2, 7),
}
HEADS = {"gqa": (4, 2), "mha": (2, 2)}
BRANCH_STEPS = (0, 2, 6)  # TTT steps 1, 3 and 7


def _init(rank: int, world: int, init_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)


def _close(actual, expected, what):
    assert actual.shape == expected.shape, f"{what}: {actual.shape} vs {expected.shape}"
    err = (actual.double() - expected.double()).abs().max().item() if actual.numel() else 0.0
    assert err <= ATOL, f"{what}: max abs err {err:.3g}"


def _case(layout_name, heads, J, H=8, seed=0):
    doc_lens = LAYOUTS[layout_name]
    (N, K), T = HEADS[heads], sum(doc_lens)
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=gen)
    inputs = (rand(T, N, H), rand(T, K, H), rand(T, K, H), rand(J, T, K, H), rand(J, T, K, H))
    return doc_lens, inputs, rand(T, N, H)


def _check_ring(rank, group, doc_lens, inputs, w_TNH, what):
    cp = dist.get_world_size(group)
    layout = ZigzagLayout(doc_lens, cp)
    cu_host = [0]
    for length in doc_lens:
        cu_host.append(cu_host[-1] + length)
    scale = 1.0 / math.sqrt(inputs[0].shape[-1])

    # Reference: dense float64 on the whole stream, in one process.
    ref_in = [x.double().requires_grad_() for x in inputs]
    ref_out, ref_lse = dense_ttt(*ref_in, tuple(cu_host), scale)
    ref_grads = torch.autograd.grad((ref_out * w_TNH.double()).sum(), ref_in)

    q, k0, v0, kb, vb = inputs
    shard = lambda x: zigzag_shard(x, layout, rank)
    local = [shard(q), shard(k0), shard(v0)]
    local += [
        torch.stack([shard(x) for x in b]) if len(b) else b.new_zeros(0, layout.local_len, *b.shape[2:])
        for b in (kb, vb)
    ]
    local = [x.requires_grad_() for x in local]
    meta = CPMetadata.build(layout, group, "cpu")
    out_RNH, lse_NR = ring_attention(local[0], local[1], local[2], meta, scale, local[3], local[4])
    grads = torch.autograd.grad((out_RNH * shard(w_TNH)).sum(), local)

    unshard = lambda x: zigzag_unshard(x, layout, group)
    _close(unshard(out_RNH.detach()), ref_out, f"{what} out")
    _close(unshard(lse_NR.t().contiguous()).t(), ref_lse, f"{what} lse")
    for name, g, rg in zip(("q", "k0", "v0"), grads[:3], ref_grads[:3]):
        _close(unshard(g), rg, f"{what} d{name}")
    for name, g, rg in zip(("kb", "vb"), grads[3:], ref_grads[3:]):
        full = torch.stack([unshard(x) for x in g]) if len(g) else g.new_zeros(rg.shape)
        _close(full, rg, f"{what} d{name}")


def _numerics_worker(rank, world, init_file):
    _init(rank, world, init_file)
    group = dist.group.WORLD
    for layout_name in sorted(LAYOUTS):
        for heads in sorted(HEADS):
            for J in BRANCH_STEPS:
                doc_lens, inputs, w = _case(layout_name, heads, J, seed=100 * J + len(heads))
                _check_ring(rank, group, doc_lens, inputs, w, f"cp={world} {layout_name} {heads} J={J}")
    exit_process(0)


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_branch_attention_matches_dense(cp, tmp_path):
    """out, lse and all five grads of ring + branch attention equal dense fp64."""
    mp.spawn(_numerics_worker, args=(cp, str(tmp_path / "init")), nprocs=cp)


def _layout_and_compile_worker(rank, world, init_file):
    _init(rank, world, init_file)
    group = dist.group.WORLD
    # unshard(shard(x)) == x, for int and float streams and trailing dims.
    for doc_lens in LAYOUTS.values():
        layout = ZigzagLayout(doc_lens, world)
        T = sum(doc_lens)
        for x in (torch.arange(T) * 7 + 3, torch.randn(T, 3, 2, generator=torch.Generator().manual_seed(T))):
            x_R = zigzag_shard(x, layout, rank, pad_value=-1)
            assert x_R.shape[0] == layout.local_len
            assert torch.equal(zigzag_unshard(x_R, layout, group), x)
        # Positions of the real rows are the global ones.
        pos_T = torch.cat([torch.arange(n) for n in doc_lens])
        real = layout.global_index(rank) >= 0
        assert torch.equal(layout.local_positions(rank)[real], zigzag_shard(pos_T, layout, rank)[real])

    # The TTT unroll's cross-shard rows: for every step j < 7 and local row t, the
    # [local; halo] lookup yields global row t+1+j, valid exactly when that row is in
    # t's document and has a label. Chunks shorter than the step count included.
    from torchtitan.components.loss import IGNORE_INDEX

    from titan_spec.models.draft.halo import TTTHalo

    for doc_lens in ((1, 2, 3, 1, 5), (9, 1, 16, 2, 7), (30,)):
        layout = ZigzagLayout(doc_lens, world)
        T = sum(doc_lens)
        labels_T = torch.arange(T) * 10
        labels_T[::4] = IGNORE_INDEX
        meta = CPMetadata.build(layout, group, "cpu")
        halo = TTTHalo(meta, 7, "cpu")
        g_R = layout.global_index(rank)
        rows_E = halo.extend(g_R)
        labels_E = halo.extend(zigzag_shard(labels_T, layout, rank, pad_value=IGNORE_INDEX))
        doc_T = torch.repeat_interleave(torch.arange(len(doc_lens)), torch.tensor(doc_lens))
        for j, (src_R, valid_R) in enumerate(halo.shifts(labels_E)):
            for t, g in enumerate(g_R.tolist()):
                want = g >= 0 and g + 1 + j < T and doc_T[g + 1 + j] == doc_T[g] and labels_T[g + 1 + j] != IGNORE_INDEX
                assert bool(valid_R[t]) == bool(want), (doc_lens, j, t)
                if want:
                    assert rows_E[src_R[t]] == g + 1 + j, (doc_lens, j, t)

    # torch.compile sees the ring as one opaque op: fullgraph, same numbers.
    doc_lens, inputs, w = _case("mixed", "gqa", 2, seed=5)
    layout = ZigzagLayout(doc_lens, world)
    meta = CPMetadata.build(layout, group, "cpu")
    shard = lambda x: zigzag_shard(x, layout, rank)
    q, k0, v0 = (shard(x).requires_grad_() for x in inputs[:3])
    kb, vb = (torch.stack([shard(x) for x in b]).requires_grad_() for b in inputs[3:])

    def step(q, k0, v0, kb, vb):
        out, lse = ring_attention(q, k0, v0, meta, 0.3, kb, vb)
        return (out * out).sum() + lse.sum()

    args = (q, k0, v0, kb, vb)
    # Schema, fake and autograd registrations agree with the real op (every rank runs
    # the same checks, so the collectives inside line up).
    tests = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    op_args = (*args, meta.local.cu_seqlens_cpu, meta.group_name, 0.3)
    torch.library.opcheck(torch.ops.titan_spec.ring_attn_fwd.default, op_args, test_utils=tests)
    grads = torch.autograd.grad(step(*args), args)
    torch._dynamo.reset()
    c_grads = torch.autograd.grad(torch.compile(step, backend="aot_eager", fullgraph=True)(*args), args)
    for g, cg in zip(grads, c_grads):
        _close(cg, g, "compiled grad")
    exit_process(0)


def test_zigzag_roundtrip_and_compile(tmp_path):
    mp.spawn(_layout_and_compile_worker, args=(2, str(tmp_path / "init")), nprocs=2)


# ---------------------------------------------------------------------------
# Work balance: pure layout arithmetic, no processes
# ---------------------------------------------------------------------------


def _pairs(rank, cp, layout, src):
    """(doc, q_pos, k_pos) pairs the ring computes for rank's queries vs src's keys."""
    cu = layout.local_cu_seqlens
    q_pos, k_pos = layout.local_positions(rank).tolist(), layout.local_positions(src).tolist()
    doc_of = [d for d, c in enumerate(layout.chunk_lens) for _ in range(2 * c)]
    out = set()
    for qs, qe, ks, ke, causal in ring_blocks(cu, rank, src):
        for i in range(qs, qe):
            for j in range(ks, ke):
                if causal and j - ks > i - qs:
                    continue
                assert doc_of[i] == doc_of[j]
                out.add((doc_of[i], q_pos[i], k_pos[j]))
    return out


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("doc_lens", [(64,), (40, 8, 3, 16, 1), (13, 29, 6)])
def test_ring_work_is_balanced_and_exact(cp, doc_lens):
    layout = ZigzagLayout(doc_lens, cp)
    work = []
    for rank in range(cp):
        computed = [p for src in range(cp) for p in _pairs(rank, cp, layout, src)]
        # Exactly the document-causal pairs of this rank's queries, each once.
        pos_R = layout.local_positions(rank).tolist()
        doc_R = [d for d, c in enumerate(layout.chunk_lens) for _ in range(2 * c)]
        expected = {(d, p, kp) for d, p in zip(doc_R, pos_R) for kp in range(p + 1)}
        assert len(computed) == len(set(computed)) and set(computed) == expected
        work.append(len(computed))
    assert max(work) <= 1.1 * min(work), f"per-rank query-key pairs {work}"

    # The same count for a plain contiguous split of each padded document is
    # badly skewed (the last rank does ~2*cp-1 times the first one's work):
    # the zigzag is what balances, not the counting.
    naive = [0] * cp
    for c in layout.chunk_lens:
        per_rank = 2 * c
        for rank in range(cp):
            lo = rank * per_rank
            naive[rank] += sum(p + 1 for p in range(lo, lo + per_rank))
    assert max(naive) > 1.5 * min(naive)


# ---------------------------------------------------------------------------
# The target under CP: compiled blocks, ring attention, against one process
# ---------------------------------------------------------------------------


def _target_worker(rank, world, init_file):
    _init(rank, world, init_file)
    import torch._dynamo

    import titan_spec  # noqa: F401
    from titan_spec.models.attention import doc_metadata_from_positions
    from titan_spec.models.registry import build_target_config, flavor_arch

    group = dist.group.WORLD
    torch.manual_seed(0)
    arch = flavor_arch("qwen3", "tiny")
    build = lambda: build_target_config(arch, tap_layer_ids=(1, 3, 4), max_seq_len=256).build()
    model, ref = build(), build()
    model.init_weights(buffer_device=None)
    ref.load_state_dict(model.state_dict())
    torch._dynamo.reset()
    for name, block in model.layers.named_children():
        model.layers.register_module(name, torch.compile(block, backend="aot_eager", fullgraph=True))

    compiles = []
    for i, lens in enumerate([(40, 24, 64), (7, 1, 50, 70), (3, 5, 8, 13, 21, 34, 44)]):
        g = torch.Generator().manual_seed(i)
        pos_T = torch.cat([torch.arange(n) for n in lens])
        tok_T = torch.randint(0, arch.vocab_size, pos_T.shape, generator=g)
        w_TV = torch.randn(pos_T.numel(), arch.vocab_size, generator=g)
        layout = ZigzagLayout(lens, world)
        meta = CPMetadata.build(layout, group, "cpu")
        shard = lambda x: zigzag_shard(x, layout, rank)
        before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        logits, taps = model(shard(tok_T)[None], layout.local_positions(rank)[None], meta)
        (logits[0] * shard(w_TV)).sum().backward()
        compiles.append(torch._dynamo.utils.counters["stats"]["unique_graphs"] - before)

        ref_logits, ref_taps = ref(tok_T[None], pos_T[None], doc_metadata_from_positions(pos_T[None]))
        (ref_logits[0] * w_TV).sum().backward()
        unshard = lambda x: zigzag_unshard(x[0].detach(), layout, group)
        torch.testing.assert_close(unshard(logits), ref_logits[0], atol=1e-5, rtol=1e-5)
        for a, b in zip(taps.hidden, ref_taps.hidden):
            torch.testing.assert_close(unshard(a), b[0], atol=1e-5, rtol=1e-5)
        # Parameter grads: each rank holds its shard's share; their sum is the full grad.
        for (name, p), (_, rp) in zip(model.named_parameters(), ref.named_parameters()):
            grad = p.grad.clone()
            dist.all_reduce(grad, group=group)
            torch.testing.assert_close(grad, rp.grad, atol=1e-4, rtol=1e-4, msg=name)
            p.grad, rp.grad = None, None
    # Whole-graph blocks (fullgraph) and no recompilation once shapes went dynamic.
    assert compiles[2] == 0, compiles
    exit_process(0)


def test_target_under_cp_matches_one_process_compiled(tmp_path):
    """The policy's forward (logits, taps) and parameter grads under cp = 2, with
    torchtitan-style per-block torch.compile, equal the single-process eager model."""
    mp.spawn(_target_worker, args=(2, str(tmp_path / "init")), nprocs=2)
