# Benchmark: EAGLE-3 TTT attention (ttt_attention) vs dense-mask attention.
#
# Shape suffix legend:
#   S = packed tokens per batch, N = query heads, K = kv heads, H = head dim,
#   J = branch steps so far, A = all keys of a step (trunk + branch = S*(J+1))
#
# One iteration is a full TTT unroll: steps j = 0..T-1 run forward, their
# losses are summed, and one backward runs at the end, as in draft training.
# That is what makes dense masks hurt: every step keeps its [N, S, S*(j+1)]
# probabilities alive until the backward.
#
# Variants:
#   ttt         titan_spec ttt_attention (varlen trunk + diagonal branch + LSE merge)
#   dense       explicit scores + float bias [S, S*(j+1)] + softmax (eager HF /
#               SpecForge style)
#   dense_sdpa  F.scaled_dot_product_attention with the boolean [S, S*(j+1)] mask
#   causal_x_T  the inherent cost: T plain causal attentions over the trunk (SDPA with
#               is_causal, whichever kernel SDPA picks: cuDNN's on an H200 in bf16), no
#               branch keys at all
#   causal_fa2_x_T  the same on SDPA's FlashAttention-2 backend only: the kernel the
#               ttt trunk runs on CUDA without the flash_attn package, so ttt / this is
#               the branch and merge's cost at equal trunk kernel
#
# --device cuda --dtype bfloat16 runs the same unroll on the GPU (scripts/gpu_check.sh):
# times are synchronized wall times and peak memory is torch.cuda.max_memory_allocated
# above what was allocated before the first unroll.
#
# Each (variant, S) runs in a fresh subprocess so the RSS high-water mark
# (getrusage ru_maxrss) belongs to that configuration alone.
#
# Usage: PYTHONPATH=. python bench/ttt_attention.py [--quick] [--compile] [--out PATH]

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
GIB = 1024**3
VARIANTS = ("ttt", "dense", "dense_sdpa")
REFERENCE = "causal_x_T"
REFERENCE_FA2 = "causal_fa2_x_T"


def _parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seqlens", default="2048,4096,8192,16384")
    p.add_argument("--quick", action="store_true", help="only S = 2048, 4096")
    p.add_argument("--steps", type=int, default=7, help="TTT steps per unroll")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--doc-len", type=int, default=0, help="0 = one document per batch")
    p.add_argument("--iters", type=int, default=2, help="timed iterations")
    p.add_argument("--threads", type=int, default=0, help="torch threads, 0 = default")
    p.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"also: {REFERENCE}, {REFERENCE_FA2} (the references)"
    )
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--mem-limit-gib", type=float, default=8.0)
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile each step's attention (as the trainer under compile.enable); "
        "the cold unroll holds the compile, the timed ones not",
    )
    p.add_argument("--out", default=str(REPO_ROOT / "bench/results/ttt_attention.json"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", default="ttt", help=argparse.SUPPRESS)
    p.add_argument("--seqlen", type=int, default=2048, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def estimate_bytes(variant: str, S: int, args: argparse.Namespace) -> int:
    """Rough peak of the O(S^2) tensors, to skip configs that cannot fit."""
    T, N = args.steps, args.heads
    kept_steps = T * (T + 1) // 2  # sum over steps of (j + 1) key blocks
    if variant == "dense":
        # probs of every step kept for backward, plus scores/grad transients
        # and the fp32 bias + bool mask of the widest step.
        return 4 * N * S * S * (kept_steps + 2 * T) + 5 * S * S * T
    if variant == "dense_sdpa":
        # SDPA keeps each step's mask for backward and may turn a bool mask
        # into a float bias internally.
        return 5 * S * S * kept_steps + 4 * S * S * T
    return 0


# ---------------------------------------------------------------------------
# Worker: one (variant, S) configuration in its own process.
# ---------------------------------------------------------------------------


def _current_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _cpu_seconds() -> float:
    # user + sys of this process: less sensitive than wall time to other jobs
    # sharing the cores, though not to cache / memory-bandwidth contention.
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _worker(args: argparse.Namespace) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from titan_spec.models.attention import DocMetadata
    from titan_spec.models.branch_attention import ttt_attention

    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    dt = getattr(torch, args.dtype)
    torch.set_default_device(args.device)
    torch.manual_seed(0)
    S, T, N, K, H = args.seqlen, args.steps, args.heads, args.kv_heads, args.head_dim
    scale = 1.0 / math.sqrt(H)
    doc_len = args.doc_len or S
    cu_host = tuple(range(0, S, doc_len)) + (S,)
    cu = torch.tensor(cu_host, dtype=torch.int32)
    meta = DocMetadata(cu, cu.to("cpu", copy=True))  # a distinct host copy, as models/attention.py makes it
    leaf = lambda *shape: torch.randn(*shape, dtype=dt).requires_grad_()
    q_SNH = [leaf(S, N, H) for _ in range(T)]
    k_SKH = [leaf(S, K, H) for _ in range(T)]
    v_SKH = [leaf(S, K, H) for _ in range(T)]
    w_SNH = torch.randn(S, N, H, dtype=dt)

    def trunk_mask_SS() -> torch.Tensor:
        doc_S = torch.arange(S) // doc_len
        pos_S = torch.arange(S)
        return (doc_S[:, None] == doc_S[None, :]) & (pos_S[None, :] <= pos_S[:, None])

    def step_ttt(j: int) -> torch.Tensor:
        kb_JSKH = torch.stack(k_SKH[1 : j + 1]) if j else k_SKH[0].new_empty(0, S, K, H)
        vb_JSKH = torch.stack(v_SKH[1 : j + 1]) if j else v_SKH[0].new_empty(0, S, K, H)
        return ttt_attention(q_SNH[j], k_SKH[0], v_SKH[0], kb_JSKH, vb_JSKH, meta, scale)

    def step_mask_SA(j: int) -> torch.Tensor:
        eye_SS = torch.eye(S, dtype=torch.bool)
        return torch.cat([trunk_mask_SS()] + [eye_SS] * j, dim=1)

    def step_dense(j: int) -> torch.Tensor:
        k_ANH = torch.cat(k_SKH[: j + 1]).repeat_interleave(N // K, 1)
        v_ANH = torch.cat(v_SKH[: j + 1]).repeat_interleave(N // K, 1)
        bias_SA = torch.zeros(S, S * (j + 1)).masked_fill_(~step_mask_SA(j), -math.inf)
        s_NSA = torch.einsum("snh,anh->nsa", q_SNH[j], k_ANH) * scale + bias_SA
        p_NSA = torch.softmax(s_NSA, dim=-1)
        return torch.einsum("nsa,anh->snh", p_NSA, v_ANH)

    def step_sdpa(j: int) -> torch.Tensor:
        q_1NSH = q_SNH[j].transpose(0, 1).unsqueeze(0)
        k_1KAH = torch.cat(k_SKH[: j + 1]).transpose(0, 1).unsqueeze(0)
        v_1KAH = torch.cat(v_SKH[: j + 1]).transpose(0, 1).unsqueeze(0)
        out_1NSH = F.scaled_dot_product_attention(
            q_1NSH,
            k_1KAH,
            v_1KAH,
            attn_mask=step_mask_SA(j),
            scale=scale,
            enable_gqa=True,
        )
        return out_1NSH[0].transpose(0, 1)

    def step_causal(j: int) -> torch.Tensor:
        q_1NSH = q_SNH[j].transpose(0, 1).unsqueeze(0)
        k_1KSH = k_SKH[0].transpose(0, 1).unsqueeze(0)
        v_1KSH = v_SKH[0].transpose(0, 1).unsqueeze(0)
        out_1NSH = F.scaled_dot_product_attention(q_1NSH, k_1KSH, v_1KSH, is_causal=True, scale=scale, enable_gqa=True)
        return out_1NSH[0].transpose(0, 1)

    def step_causal_fa2(j: int) -> torch.Tensor:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return step_causal(j)

    step = {
        "ttt": step_ttt,
        "dense": step_dense,
        "dense_sdpa": step_sdpa,
        REFERENCE: step_causal,
        REFERENCE_FA2: step_causal_fa2,
    }[args.variant]
    if args.compile:
        step = torch.compile(step)
    params = q_SNH + k_SKH + v_SKH

    def unroll() -> None:
        loss = sum((step(j).float() * w_SNH).sum() for j in range(T))
        loss.backward()
        for p in params:
            p.grad = None
        if cuda:
            torch.cuda.synchronize()  # wall times of the whole unroll, not of its launch

    # The first (cold) unroll gives the memory number; the high-water mark
    # would otherwise be hidden by the warm runs' identical peak.
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else _current_rss_bytes()
    t0 = time.perf_counter()
    unroll()
    cold_s = time.perf_counter() - t0
    peak_delta = (torch.cuda.max_memory_allocated() if cuda else _peak_rss_bytes()) - base

    times, cpu_times = [], []
    for _ in range(args.iters):
        t0, c0 = time.perf_counter(), _cpu_seconds()
        unroll()
        times.append(time.perf_counter() - t0)
        cpu_times.append(_cpu_seconds() - c0)
    # min, not median: on a shared machine other jobs only ever add time.
    best = min(range(len(times)), key=times.__getitem__) if times else None
    return {
        "status": "ok",
        "time_s": times[best] if times else cold_s,
        "cpu_s": cpu_times[best] if times else None,
        "cold_time_s": cold_s,
        "peak_mem_gib": peak_delta / GIB,
        "threads": torch.get_num_threads(),
    }


# ---------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------


def _run_config(variant: str, S: int, args: argparse.Namespace) -> dict:
    row = {"variant": variant, "seqlen": S}
    est = estimate_bytes(variant, S, args)
    row["est_gib"] = est / GIB
    if est > args.mem_limit_gib * GIB:
        note = f"skipped (would allocate {est / GIB:.1f} GiB)"
        row.update(status="skipped", note=note)
        return row
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        "--variant",
        variant,
        "--seqlen",
        str(S),
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
        str(args.iters),
        "--threads",
        str(args.threads),
        "--device",
        args.device,
        "--dtype",
        args.dtype,
        *(["--compile"] if args.compile else []),
    ]
    return run_worker(cmd, row)


def run_worker(cmd: list[str], row: dict, **env_extra: str) -> dict:
    """Run one measurement in a fresh process (its own RSS high-water mark); the worker's
    last stdout line is a JSON row merged into ``row`` (or a 'failed' status with the cause)."""
    env = dict(os.environ, **env_extra)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["?"]
        row.update(status="failed", note=f"rc={proc.returncode}: {tail[0][:160]}")
        return row
    row.update(json.loads(proc.stdout.strip().splitlines()[-1]))
    return row


def _print_table(rows: list[dict], args: argparse.Namespace) -> None:
    print(
        f"TTT attention fwd+bwd, one unroll = {args.steps} steps "
        f"(j = 0..{args.steps - 1}), "
        f"N={args.heads} K={args.kv_heads} H={args.head_dim}, {args.dtype}, {args.device}, "
        f"doc_len={'S' if not args.doc_len else args.doc_len}, "
        f"threads={args.threads or 'default'}{', compiled' if args.compile else ''}"
    )
    print(
        "time: fastest of --iters warm unrolls, wall and process CPU (user+sys) "
        "seconds.\npeak mem: RSS high-water mark (getrusage ru_maxrss) minus RSS "
        "before the first unroll, fresh process per row\n"
        "(torch CPU tensors live outside tracemalloc; the cold unroll sets the peak)."
    )
    header = f"{'S':>6}  {'variant':<14}  {'wall s/unroll':>13}  {'cpu s/unroll':>12}  {'peak mem GiB':>12}  note"
    print(header)
    print("-" * len(header))
    for r in rows:
        if r["status"] == "ok":
            t, c = f"{r['time_s']:.3f}", f"{r['cpu_s']:.3f}"
            m = f"{r['peak_mem_gib']:.3f}"
        else:
            t, c, m = "-", "-", "-"
        print(f"{r['seqlen']:>6}  {r['variant']:<14}  {t:>13}  {c:>12}  {m:>12}  {r.get('note', '')}")


def main(argv=None) -> None:
    args = _parse_args(argv)
    if args.worker:
        print(json.dumps(_worker(args)))
        return
    seqlens = [2048, 4096] if args.quick else [int(s) for s in args.seqlens.split(",")]
    variants = [v for v in args.variants.split(",") if v]
    rows = []
    for S in seqlens:
        for variant in variants:
            rows.append(_run_config(variant, S, args))
            status = rows[-1]["status"]
            print(f"  done S={S} {variant}: {status}", file=sys.stderr, flush=True)
    _print_table(rows, args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    hidden = ("worker", "variant", "seqlen")
    config = {k: v for k, v in vars(args).items() if k not in hidden}
    method = "peak mem = ru_maxrss - RSS before first unroll, fresh subprocess per row"
    report = {"config": config, "method": method, "results": rows}
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
