# Benchmark: per-rank peak memory and time of the draft's TTT attention
# (forward + backward of a whole unroll) under context parallelism.
#
# Shape suffix legend:
#   S = global packed tokens, R = rows on one rank (S/cp + padding),
#   N = query heads, K = kv heads, H = head dim, J = branch steps
#
# Variants:
#   ring       titan_spec's zigzag ring + local branch attention (cp >= 2);
#              at cp = 1 the local ttt_attention the trainer uses there
#   allgather  every rank all-gathers the whole trunk K/V, attends its zigzag
#              queries to it (document-causal flash blocks, no mask tensor),
#              merges the branch part, and reduce-scatters dK/dV (cp >= 2)
#   dense      one process materializing the (S x S*(j+1)) additive bias per
#              step, as ModelOpt's Megatron EAGLE does (bench/ttt_attention.py's
#              `dense` worker); rows that would not fit are skipped and show
#              the analytic estimate of their O(S^2) tensors instead
#
# One unroll = TTT steps j = 0..T-1 forward, losses summed, one backward, as in
# draft training. Each (variant, S, cp) runs in a fresh subprocess that spawns
# cp ranks (gloo); per rank, peak memory = RSS high-water mark (getrusage
# ru_maxrss) minus RSS after process-group init and before any input exists,
# so the rank's inputs count. The table shows the largest rank.
#
# Usage: PYTHONPATH=. python bench/cp_memory.py [--seqlens 8192,16384,32768]

import argparse
import json
import math
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
GIB = 1024**3


def _parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="CP TTT attention memory/time")
    p.add_argument("--seqlens", default="2048,8192,16384,32768")
    p.add_argument("--cps", default="1,2,4")
    p.add_argument("--variants", default="ring,allgather,dense")
    p.add_argument("--steps", type=int, default=7, help="TTT steps per unroll")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--doc-len", type=int, default=1024, help="tokens per packed document")
    p.add_argument("--mem-limit-gib", type=float, default=8.0)
    p.add_argument("--out", default=str(REPO_ROOT / "bench/results/cp_memory.json"))
    p.add_argument("--merge", default="", help="comma-separated result JSONs: print and plot them, run nothing")
    p.add_argument("--plot", default="", help="write a PNG of per-rank peak memory vs S here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", default="ring", help=argparse.SUPPRESS)
    p.add_argument("--seqlen", type=int, default=2048, help=argparse.SUPPRESS)
    p.add_argument("--cp", type=int, default=1, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


# ---------------------------------------------------------------------------
# The all-gather-K/V baseline
# ---------------------------------------------------------------------------


def _allgather_attention():
    import torch
    import torch.distributed as dist

    from titan_spec.models.attention_blocks import blocks_bwd, blocks_fwd, merge_partials
    from titan_spec.models.branch_attention import branch_backward, branch_part

    def blocks(layout, rank):
        # Local query chunk i of a document vs the gathered, padded document:
        # keys of earlier chunks unmasked, its own chunk causal. Three block
        # lists because a block list may not repeat query or key rows, nor mix
        # causal and unmasked blocks (models/attention_blocks.py).
        full = ([], [])  # per local chunk: both see the document's first keys
        causal = []
        cu_l, g = layout.local_cu_seqlens, 0
        for a, c in zip(cu_l[:-1], layout.chunk_lens):
            for j, chunk in enumerate((rank, 2 * layout.cp - 1 - rank)):
                qs = a + j * c
                if chunk and c:
                    full[j].append((qs, qs + c, g, g + chunk * c, False))
                if c:
                    causal.append((qs, qs + c, g + chunk * c, g + (chunk + 1) * c, True))
            g += 2 * layout.cp * c
        return (*full, causal)

    def gather_order(layout):
        # Gathered rows come rank-major; reorder them into padded document order.
        idx, n = [], layout.local_len
        for d, (a, c) in enumerate(zip(layout.local_cu_seqlens[:-1], layout.chunk_lens)):
            for chunk in range(2 * layout.cp):
                rank = chunk if chunk < layout.cp else 2 * layout.cp - 1 - chunk
                off = a if chunk < layout.cp else a + c
                idx.append(torch.arange(rank * n + off, rank * n + off + c))
        return torch.cat(idx)

    class AllGatherTTT(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k0, v0, kb, vb, layout, group, scale):
            rank, cp = dist.get_rank(group), dist.get_world_size(group)
            order = gather_order(layout)
            parts = [torch.empty_like(torch.cat([k0, v0], 1)) for _ in range(cp)]
            dist.all_gather(parts, torch.cat([k0, v0], 1), group=group)
            kv = torch.cat(parts)[order]
            k, v = kv[:, : k0.shape[1]], kv[:, k0.shape[1] :]
            parts = [blocks_fwd(q, k, v, bl, scale) for bl in blocks(layout, rank)]
            parts.append(branch_part(q, kb, vb, scale))
            out, lse = merge_partials([o for o, _ in parts], [lse for _, lse in parts])
            ctx.save_for_backward(q, k, v, kb, vb, out, lse, order)
            ctx.layout, ctx.group, ctx.scale = layout, group, scale
            ctx.kv_heads = k0.shape[1]
            return out

        @staticmethod
        def backward(ctx, dout):
            q, k, v, kb, vb, out, lse, order = ctx.saved_tensors
            rank = dist.get_rank(ctx.group)
            dq, dkb, dvb = branch_backward(dout, q, kb, vb, out, lse, ctx.scale)
            dkv = torch.zeros(k.shape[0], 2 * ctx.kv_heads, k.shape[2])
            for bl in blocks(ctx.layout, rank):
                dq_i, dk_i, dv_i = blocks_bwd(dout, q, k, v, out, lse, bl, ctx.scale)
                dq = dq + dq_i
                dkv += torch.cat([dk_i, dv_i], 1)
            # Back to rank-major order, then every rank keeps the sum of its rows.
            rank_major = torch.empty_like(dkv)
            rank_major[order] = dkv
            mine = torch.empty_like(rank_major[: ctx.layout.local_len])
            dist.reduce_scatter(mine, list(rank_major.chunk(dist.get_world_size(ctx.group))), group=ctx.group)
            K = ctx.kv_heads
            return dq, mine[:, :K].contiguous(), mine[:, K:].contiguous(), dkb, dvb, None, None, None

    return AllGatherTTT.apply


# ---------------------------------------------------------------------------
# Worker: one rank of one (variant, S, cp) configuration
# ---------------------------------------------------------------------------


def _rank_main(rank: int, args: argparse.Namespace, init_file: str, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=args.cp)
    from titan_spec.models.attention import DocMetadata
    from titan_spec.models.branch_attention import ttt_attention
    from titan_spec.parallelisms.context_parallel import CPMetadata, ZigzagLayout, ring_attention
    from titan_spec.platform import exit_process

    group = dist.group.WORLD
    S, T, N, K, H, cp = args.seqlen, args.steps, args.heads, args.kv_heads, args.head_dim, args.cp
    scale = 1.0 / math.sqrt(H)
    layout = ZigzagLayout(tuple(min(args.doc_len, S - s) for s in range(0, S, args.doc_len)), cp)
    allgather = _allgather_attention() if args.variant == "allgather" else None
    dist.barrier()
    base = _rss_bytes()

    torch.manual_seed(rank)
    R = layout.local_len if cp > 1 else S
    leaf = lambda *shape: torch.randn(*shape).requires_grad_()
    q = [leaf(R, N, H) for _ in range(T)]
    k = [leaf(R, K, H) for _ in range(T)]
    v = [leaf(R, K, H) for _ in range(T)]
    w = torch.randn(R, N, H)
    meta_local = layout.local_metadata("cpu") if cp > 1 else None
    if cp == 1:
        cu = torch.tensor([0, *(min(s + args.doc_len, S) for s in range(0, S, args.doc_len))], dtype=torch.int32)
        meta_local = DocMetadata(cu, cu.clone())
    cp_meta = CPMetadata(layout, meta_local, group, group.group_name)

    def step(j):
        kb = torch.stack(k[1 : j + 1]) if j else k[0].new_empty(0, R, K, H)
        vb = torch.stack(v[1 : j + 1]) if j else v[0].new_empty(0, R, K, H)
        if cp == 1:
            return ttt_attention(q[j], k[0], v[0], kb, vb, meta_local, scale)
        if allgather is not None:
            return allgather(q[j], k[0], v[0], kb, vb, layout, group, scale)
        return ring_attention(q[j], k[0], v[0], cp_meta, scale, kb, vb)[0]

    def unroll():
        loss = sum((step(j) * w).sum() for j in range(T))
        loss.backward()
        for p in q + k + v:
            p.grad = None

    dist.barrier()
    t0 = time.perf_counter()
    unroll()
    dist.barrier()
    cold = time.perf_counter() - t0
    peak = _peak_rss_bytes() - base
    t0 = time.perf_counter()
    unroll()
    dist.barrier()
    warm = time.perf_counter() - t0
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "peak_mem_gib": peak / GIB, "cold_s": cold, "time_s": warm, "rows": R}, f)
    exit_process(0)


def _worker(args: argparse.Namespace) -> dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank_main, args=(args, os.path.join(tmp, "init"), tmp), nprocs=args.cp)
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(args.cp)]
    return {
        "status": "ok",
        "peak_mem_gib": max(r["peak_mem_gib"] for r in ranks),
        "peak_mem_gib_per_rank": [r["peak_mem_gib"] for r in ranks],
        "time_s": max(r["time_s"] for r in ranks),
        "rows_per_rank": ranks[0]["rows"],
    }


# ---------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------


def _dense_row(S: int, args: argparse.Namespace) -> dict:
    sys.path.insert(0, str(Path(__file__).parent))
    import ttt_attention as dense_bench  # bench/ttt_attention.py

    targs = dense_bench._parse_args(
        [
            "--steps",
            str(args.steps),
            "--heads",
            str(args.heads),
            "--kv-heads",
            str(args.kv_heads),
            "--head-dim",
            str(args.head_dim),
            "--doc-len",
            str(args.doc_len),
            "--iters",
            "1",
            "--threads",
            "1",
            "--mem-limit-gib",
            str(args.mem_limit_gib),
        ]
    )
    row = dense_bench._run_config("dense", S, targs)
    return {
        "variant": "dense",
        "seqlen": S,
        "cp": 1,
        **{k: v for k, v in row.items() if k not in ("variant", "seqlen")},
    }


def _run_config(variant: str, S: int, cp: int, args: argparse.Namespace) -> dict:
    if variant == "dense":
        return _dense_row(S, args)
    row = {"variant": variant, "seqlen": S, "cp": cp}
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        "--variant",
        variant,
        "--seqlen",
        str(S),
        "--cp",
        str(cp),
        "--steps",
        str(args.steps),
        "--heads",
        str(args.heads),
        "--kv-heads",
        str(args.kv_heads),
        "--head-dim",
        str(args.head_dim),
        "--doc-len",
        str(args.doc_len),
    ]
    sys.path.insert(0, str(Path(__file__).parent))
    from ttt_attention import run_worker  # bench/ttt_attention.py

    return run_worker(cmd, row, OMP_NUM_THREADS="1")


def _print_table(rows: list[dict], args: argparse.Namespace) -> None:
    print(
        f"TTT attention fwd+bwd per unroll ({args.steps} steps), N={args.heads} K={args.kv_heads} "
        f"H={args.head_dim}, fp32, CPU, documents of {args.doc_len} tokens, one thread per rank.\n"
        "peak mem: max over ranks of (ru_maxrss - RSS before inputs), fresh processes per row;\n"
        "time: warm unroll wall seconds of the slowest rank (ranks share 2 cores: cp > 2 oversubscribes)."
    )
    ones = {r["seqlen"]: r for r in rows if r["variant"] == "ring" and r["cp"] == 1 and r["status"] == "ok"}
    header = f"{'S':>6}  {'variant':<10} {'cp':>2}  {'s/unroll':>8}  {'peak GiB/rank':>13}  {'vs cp=1':>7}  note"
    print(header)
    print("-" * len(header))
    for r in rows:
        ok = r["status"] == "ok"
        t = f"{r['time_s']:.2f}" if ok else "-"
        m = f"{r['peak_mem_gib']:.3f}" if ok else "-"
        base = ones.get(r["seqlen"])
        ratio = f"{r['peak_mem_gib'] / base['peak_mem_gib']:.2f}x" if ok and base else "-"
        note = r.get("note", "")
        print(f"{r['seqlen']:>6}  {r['variant']:<10} {r['cp']:>2}  {t:>8}  {m:>13}  {ratio:>7}  {note}")


def _plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = [
        ("ring", 1, "titan_spec, cp=1 (local TTT attention)"),
        ("ring", 2, "titan_spec ring, cp=2"),
        ("ring", 4, "titan_spec ring, cp=4"),
        ("allgather", 2, "all-gather K/V, cp=2"),
        ("allgather", 4, "all-gather K/V, cp=4"),
        ("dense", 1, "dense (S x S(j+1)) bias, 1 process"),
    ]
    for variant, cp, label in series:
        pts = sorted(
            (r["seqlen"], r["peak_mem_gib"] if r["status"] == "ok" else r.get("est_gib"))
            for r in rows
            if r["variant"] == variant and r["cp"] == cp
        )
        pts = [(x, y) for x, y in pts if y]
        if not pts:
            continue
        xs, ys = zip(*pts)
        style = "--" if variant == "dense" else "-"
        ax.plot(xs, ys, style, marker="o", label=label + (" (>2K: estimate)" if variant == "dense" else ""))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("packed tokens S (global)")
    ax.set_ylabel("peak memory per rank, GiB")
    ax.set_title("TTT attention fwd+bwd, 7 steps, per-rank peak (CPU, RSS)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv=None) -> None:
    args = _parse_args(argv)
    if args.worker:
        print(json.dumps(_worker(args)))
        return
    if args.merge:
        # Later files win for the same (variant, S, cp): reruns replace failed rows.
        merged = {}
        for path in args.merge.split(","):
            for r in json.loads(Path(path).read_text())["results"]:
                merged[(r["variant"], r["seqlen"], r["cp"])] = r
        order = {"ring": 0, "allgather": 1, "dense": 2}
        rows = sorted(merged.values(), key=lambda r: (r["seqlen"], order[r["variant"]], r["cp"]))
        _print_table(rows, args)
        if args.plot:
            _plot(rows, args.plot)
        return
    variants = [v for v in args.variants.split(",") if v]
    cps = [int(c) for c in args.cps.split(",")]
    rows = []
    for S in (int(s) for s in args.seqlens.split(",")):
        for variant in variants:
            for cp in cps:
                if (variant == "dense" and cp != 1) or (variant == "allgather" and cp == 1):
                    continue
                rows.append(_run_config(variant, S, cp, args))
                print(f"  done S={S} {variant} cp={cp}: {rows[-1]['status']}", file=sys.stderr, flush=True)
    _print_table(rows, args)
    if args.plot:
        _plot(rows, args.plot)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in vars(args).items() if k not in ("worker", "variant", "seqlen", "cp")}
    out.write_text(json.dumps({"config": config, "uptime": os.getloadavg(), "results": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
