# Benchmark: the built-in rollout engine, speculative vs plain decoding, adaptive speculation
# depth vs every fixed depth, and (--vs-draft) one draft kind against another.
#
# Measures completion tokens/s and acceptance length (completion tokens / target forwards,
# the prefill included; "sglang_accept" excludes the prefill as SGLang's spec_verify_ct does)
# for batch sizes 1/8/32/64, greedy and T = 1, side by side in one process:
#   plain      K = 0 (autoregressive decoding, same engine, same KV cache)
#   fixed_k    K = k draft tokens every round, k = 1..--num-draft-tokens, trained draft
#              (offline, SGLang-format directory); "trained" in earlier versions = fixed_K_max
#   adaptive   speculative.depth = "adaptive": each round picks K in 0..--num-draft-tokens
#              (rollout/builtin/depth.py); its cost table is measured during the warm-up
#              (not timed) and shared by the adaptive engines; "draft_k" = the mean K it
#              proposed per verify round
#   untrained  (--untrained) fixed K_max and adaptive with a freshly initialized draft of the
#              same shape: what a stale draft costs
#   distilled  (optional, --distill-steps N) the trained draft fine-tuned by TTT on the
#              policy's own rollouts, fixed K_max
#   <kind>_fixed_k, <kind>_adaptive  (--vs-draft DIR, --vs-draft-kind KIND) a second draft, of
#              another kind (default: a DFlash block draft), at every fixed K and adaptive, in the
#              same interleaved passes on the same prompts; its adaptive engine has its own cost
#              table (a block costs what it costs). "kinds" in the JSON compares the two drafts.
#   dspark_confidence  (--vs-draft-kind dspark) the DSpark draft at speculative.depth =
#              "confidence": its confidence head picks each round's K (rollout/builtin/depth.py)
# Every timed pass runs --requests prompts (or `batch`, when larger) through each engine,
# `batch` per generate call (batch 1: one request after another), so acceptance and tokens/s
# are not one prompt's, and adaptive depth carries its acceptance estimate from call to call
# as it does from RL step to RL step. For every (temperature, batch) the engines take turns
# batch by batch (batch i of every engine back to back), `--repeats` passes; a ratio
# (speedup, adaptive / best fixed) is the median over passes of the ratio within one pass,
# so load that comes and goes on a busy machine falls on all engines alike.
#
# Models: --policy (HF dir) and --draft (draft dir). Defaults: the embedded default's SFT
# policy and offline draft (outputs/debug_cpu/sft/hf, outputs/debug_cpu/draft/draft), trained
# here first when missing with
#   CONFIG_FILE=train_configs/debug_cpu_draft.toml ./run_train.sh   (runs the SFT it requires)
# (about 6 minutes on 2 CPU cores).
#
# Prompts come from the [task] of --task-config (default: the default chain's SFT config).
# The benchmark chain (train_configs/bench_rollout_sft.toml -> bench_rollout_draft.toml)
# trains a policy and offline draft on 8-operand problems whose completions are about 27
# tokens; bench it with
#   --policy outputs/bench_rollout/sft/hf --draft outputs/bench_rollout/draft/draft
#   --task-config train_configs/bench_rollout_sft.toml --stop-at-eos
# Completions run to --max-new-tokens without stopping (steady-state decoding, much of it
# past <eos>, text neither model was trained on); --stop-at-eos stops at <eos> (the
# task's real completions).
#
# Usage: PYTHONPATH=. python bench/rollout.py [--quick] [--out PATH] [--compile]

import argparse
import dataclasses
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

import titan_spec  # noqa: E402,F401
from titan_spec.data.tokenizer import CharTokenizer  # noqa: E402
from titan_spec.models.draft import draft_kind  # noqa: E402
from titan_spec.rollout import SamplingParams, BuiltinEngineConfig, BuiltinRolloutEngine  # noqa: E402
from titan_spec.rollout.builtin.depth import RoundCosts  # noqa: E402
from titan_spec.config import load_config  # noqa: E402
from titan_spec.data.tasks import build_task  # noqa: E402


def _parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="rollout engine: speculative vs plain decoding")
    p.add_argument("--policy", default="", help="HF policy dir (default: outputs/debug_cpu/hf, else train one)")
    p.add_argument("--draft", default="", help="draft dir (default: outputs/offline_draft/draft, else train one)")
    p.add_argument("--draft-kind", default="eagle3", help="the kind of --draft (draft.kind)")
    p.add_argument("--vs-draft", default="", help="a second draft dir, benched beside --draft on the same prompts")
    p.add_argument("--vs-draft-kind", default="dflash", help="the kind of --vs-draft")
    p.add_argument("--num-draft-tokens", type=int, default=4, help="K_max: fixed K = 1..K_max and adaptive's maximum")
    p.add_argument("--batch-sizes", default="1,8,32,64")
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per engine (median reported)")
    p.add_argument(
        "--requests",
        type=int,
        default=32,
        help="requests per timed run, generated `batch` at a time (batch 1: one after another)",
    )
    p.add_argument("--stop-at-eos", action="store_true", help="stop completions at <eos>")
    p.add_argument(
        "--task-config",
        default=str(REPO_ROOT / "train_configs/debug_cpu_sft.toml"),
        help="TOML whose [task] makes the prompts (and the distillation data)",
    )
    p.add_argument("--distill-steps", type=int, default=0, help="also bench a draft fine-tuned on rollouts")
    p.add_argument("--untrained", action="store_true", help="also bench a random draft (fixed K_max and adaptive)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model steps (slow first call)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (0 = torch's default)")
    p.add_argument("--device", default="cpu", help="where the engines run: cpu or cuda (scripts/gpu_check.sh)")
    p.add_argument("--quick", action="store_true", help="batch 1 and 8, 32 new tokens, 1 repeat")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(REPO_ROOT / "bench/results/rollout.json"))
    args = p.parse_args(argv)
    if args.quick:
        args.batch_sizes, args.max_new_tokens, args.repeats, args.requests = "1,8", 32, 1, 8
    return args


def resolve_models(args) -> tuple[str, str]:
    policy = args.policy or str(REPO_ROOT / "outputs/debug_cpu/sft/hf")
    draft = args.draft or str(REPO_ROOT / "outputs/debug_cpu/draft/draft")
    for given, path in ((args.policy, policy), (args.draft, draft)):
        if given and not os.path.isfile(os.path.join(path, "config.json")):
            raise SystemExit(f"{given}: no config.json")
    if not (os.path.isfile(os.path.join(policy, "config.json")) and os.path.isfile(os.path.join(draft, "config.json"))):
        cmd = [str(REPO_ROOT / "run_train.sh")]
        print("training the default SFT policy and its offline draft:", " ".join(cmd), flush=True)
        subprocess.run(
            cmd, cwd=REPO_ROOT, check=True, env=dict(os.environ, CONFIG_FILE="train_configs/debug_cpu_draft.toml")
        )
    return policy, draft


def tokenizer_for(policy: str) -> CharTokenizer:
    # The run's tokenizer.json sits in its dump folder, the parent of the exported HF dir.
    for d in (policy, os.path.dirname(os.path.abspath(policy))):
        if os.path.isfile(os.path.join(d, "tokenizer.json")):
            return CharTokenizer(tokenizer_path=d)
    return CharTokenizer()


def task_of(config_path: str):
    """The task a policy was trained on: the [task] of its training config."""
    return build_task(load_config(config_path).task)


def distill(
    engine: BuiltinRolloutEngine,
    tok: CharTokenizer,
    task,
    steps: int,
    seed: int,
    max_new_tokens: int = 64,
    stop: tuple[int, ...] = (),
) -> dict:
    """Fine-tune the engine's draft by TTT on the policy's own rollouts (greedy and T=1, on
    prompts other than the benchmark's): the distribution co-training keeps the draft on.
    Returns the new draft state dict."""
    from titan_spec.models.draft.eagle3.ttt import ttt_inputs_for_sequences

    rng = random.Random(seed + 7)
    prompts = [tok.encode(task.sample(rng).prompt, add_bos=True) for _ in range(64)]
    plain = BuiltinRolloutEngine(engine.target, None, BuiltinEngineConfig(num_draft_tokens=0))
    seqs = []
    for T in (0.0, 1.0):
        out = plain.generate(prompts, SamplingParams(T, max_new_tokens=max_new_tokens, stop_token_ids=stop, seed=seed))
        seqs += [r.prompt_ids + r.output_ids for r in out]
    draft = engine.draft
    draft.train()
    opt = torch.optim.AdamW(draft.parameters(), lr=1e-3)
    model = engine.target
    for step in range(steps):
        batch = [seqs[(step * 16 + i) % len(seqs)] for i in range(16)]
        loss = draft(*ttt_inputs_for_sequences(model, draft, batch, 4)).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    draft.eval()
    return {k: v.detach().clone() for k, v in draft.state_dict().items()}


def run_interleaved(engines: dict, prompts, sp, batch: int) -> dict[str, dict]:
    """One pass of every engine over ``prompts``, ``batch`` at a time, the engines taking turns
    chunk by chunk (chunk i of every engine back to back, seed sp.seed + i), so that load
    which comes and goes on a shared machine falls on all of them alike. Per engine: tokens,
    seconds, tokens/s (wall and this process's CPU time), acceptance, mean draft K."""
    outs = {name: [] for name in engines}
    wall = dict.fromkeys(engines, 0.0)
    cpu = dict.fromkeys(engines, 0.0)
    for i, lo in enumerate(range(0, len(prompts), batch)):
        chunk_sp = dataclasses.replace(sp, seed=sp.seed + i)
        for name, engine in engines.items():
            t0, c0 = time.perf_counter(), time.process_time()
            outs[name] += engine.generate(prompts[lo : lo + batch], chunk_sp)
            wall[name] += time.perf_counter() - t0
            cpu[name] += time.process_time() - c0
    res = {}
    for name, out in outs.items():
        tokens = sum(len(r.output_ids) for r in out)
        steps = sum(r.verify_steps for r in out)
        # SGLang counts the verify forwards after the prefill (completion_tokens / spec_verify_ct).
        sglang_steps = sum(max(r.verify_steps - 1, 1) for r in out)
        rounds = sum(r.verify_steps - 1 for r in out)
        # Tokens per CPU-second of this process: what the run costs on a machine shared with
        # other jobs (their load stretches the wall time, not this process's CPU time).
        res[name] = {
            "tokens": tokens,
            "seconds": wall[name],
            "tok_s": tokens / wall[name],
            "tok_cpu_s": tokens / cpu[name],
            "accept_len": tokens / steps,
            "sglang_accept": tokens / sglang_steps,
            "draft_k": sum(r.drafted_tokens for r in out) / max(rounds, 1),
        }
    return res


def main(argv=None) -> int:
    args = _parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    policy, draft_dir = resolve_models(args)
    tok = tokenizer_for(policy)
    K = args.num_draft_tokens
    batches = [int(b) for b in args.batch_sizes.split(",")]
    temps = [float(t) for t in args.temperatures.split(",")]
    costs = RoundCosts()  # shared by the adaptive engines (same model shapes)

    def engine(k, depth="fixed", draft_dir_=draft_dir, kind=args.draft_kind, costs_=costs):
        cfg = BuiltinEngineConfig(num_draft_tokens=k, depth=depth, compile=args.compile)
        e = BuiltinRolloutEngine.from_pretrained(
            policy,
            draft_dir_ if k else None,
            cfg,
            draft_kind_name=kind,
            max_seq_len=max(512, 64 + args.max_new_tokens + 2 * K + 16),
            device=args.device,
        )
        e.costs = costs_
        return e

    engines = {"plain": engine(0)}
    engines |= {f"fixed_{k}": engine(k) for k in range(1, K + 1)}
    engines["adaptive"] = engine(K, "adaptive")
    if args.untrained:
        engines["untrained"] = engine(K)
        engines["untrained_adaptive"] = engine(K, "adaptive")
        with torch.no_grad():
            torch.manual_seed(args.seed)
            fresh = draft_kind(args.draft_kind).build(engines["adaptive"].draft.arch)
            fresh.reset_parameters()
            sd = engines["adaptive"].draft.state_dict()
            new = {k: v for k, v in fresh.state_dict().items() if k not in ("d2t", "t2d")} | {
                "d2t": sd["d2t"],
                "t2d": sd["t2d"],
            }
            for name in ("untrained", "untrained_adaptive"):
                engines[name].update_draft_weights(new, version=1)
    vs = args.vs_draft_kind if args.vs_draft else ""
    vs_costs = RoundCosts()
    if vs:
        engines |= {
            f"{vs}_fixed_{k}": engine(k, draft_dir_=args.vs_draft, kind=vs, costs_=vs_costs) for k in range(1, K + 1)
        }
        engines[f"{vs}_adaptive"] = engine(K, "adaptive", args.vs_draft, vs, vs_costs)
        if vs == "dspark":  # its confidence head picks each round's K (speculative.depth = "confidence")
            engines[f"{vs}_confidence"] = engine(K, "confidence", args.vs_draft, vs, vs_costs)
    if args.distill_steps:
        engines["distilled"] = engine(K)
        t0 = time.perf_counter()
        distill(
            engines["distilled"],
            tok,
            task_of(args.task_config),
            args.distill_steps,
            args.seed,
            args.max_new_tokens,
            (tok.eos_id,) if args.stop_at_eos else (),
        )
        print(f"distilled the draft on policy rollouts: {args.distill_steps} steps, {time.perf_counter() - t0:.0f}s")

    task, rng = task_of(args.task_config), random.Random(args.seed)
    stop = (tok.eos_id,) if args.stop_at_eos else ()
    rows = []
    for T in temps:
        for B in batches:
            # At least --requests prompts, whole batches, so batch 1 is not one prompt's luck.
            n = -(-max(B, args.requests) // B) * B
            prompts = [tok.encode(task.sample(rng).prompt, add_bos=True) for _ in range(n)]
            sp = SamplingParams(T, max_new_tokens=args.max_new_tokens, stop_token_ids=stop, seed=args.seed)
            for e in engines.values():  # warm-up (and compile, when on; adaptive: measures its costs)
                e.generate(prompts[:B], SamplingParams(T, max_new_tokens=8, seed=0))
            passes = [run_interleaved(engines, prompts, sp, B) for _ in range(args.repeats)]
            for name in engines:
                rs = [p[name] for p in passes]
                # Speedups: median over passes of the ratio to plain IN THE SAME PASS.
                ratio = lambda key: statistics.median(p[name][key] / p["plain"][key] for p in passes)  # noqa: E731
                rows.append(
                    {
                        "temperature": T,
                        "batch": B,
                        "engine": name,
                        "K": 0 if name == "plain" else int(name.rsplit("_", 1)[1]) if "fixed_" in name else K,
                        "tok_s": statistics.median(r["tok_s"] for r in rs),
                        "accept_len": statistics.median(r["accept_len"] for r in rs),
                        "sglang_accept": statistics.median(r["sglang_accept"] for r in rs),
                        "draft_k": statistics.median(r["draft_k"] for r in rs),
                        "speedup": ratio("tok_s"),
                        "tok_cpu_s": statistics.median(r["tok_cpu_s"] for r in rs),
                        "speedup_cpu": ratio("tok_cpu_s"),
                        "tokens": rs[0]["tokens"],
                        "requests": len(prompts),
                        "repeats": len(rs),
                        "pass_tok_s": [r["tok_s"] for r in rs],
                        "pass_tok_cpu_s": [r["tok_cpu_s"] for r in rs],
                    }
                )
                print(_row(rows[-1]), flush=True)

    summary = _summary(rows, K)
    summary_cpu = _summary(rows, K, "tok_cpu_s")
    kinds = _kinds(rows, K, args.draft_kind, vs) if vs else []
    result = {
        "benchmark": "rollout_engine",
        "policy": policy,
        "draft": draft_dir,
        "draft_kind": args.draft_kind,
        "vs_draft": args.vs_draft,
        "vs_draft_kind": vs,
        "kinds": kinds,
        "num_draft_tokens": K,
        "max_new_tokens": args.max_new_tokens,
        "stop_at_eos": args.stop_at_eos,
        "task_config": args.task_config,
        "compile": args.compile,
        "threads": torch.get_num_threads(),
        "device": args.device,
        "distill_steps": args.distill_steps,
        "requests": args.requests,
        "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "torch": torch.__version__,
        "rows": rows,
        "adaptive_vs_fixed": summary,
        "adaptive_vs_fixed_cpu": summary_cpu,
        "round_costs_ms": {
            m: {str(b): [round(x * 1e3, 3) for x in r] for b, r in rb.items()} for m, rb in costs.table.items()
        },
        "vs_round_costs_ms": {
            m: {str(b): [round(x * 1e3, 3) for x in r] for b, r in rb.items()} for m, rb in vs_costs.table.items()
        },
    }
    print()
    print(_table(rows))
    print()
    print("wall clock:")
    print(_summary_table(summary))
    print("\nthis process's CPU time (other jobs' load does not stretch it):")
    print(_summary_table(summary_cpu))
    if kinds:
        print(f"\ndraft kinds on the same prompts ({args.draft_kind} vs {vs}; speedups against plain, same passes):")
        print(_kinds_table(kinds, K))
    for title, table in ((args.draft_kind, result["round_costs_ms"]), (vs, result["vs_round_costs_ms"])):
        if table:
            print(f"\n{title} round costs (ms per round at K = 0..K_max, frozen after the warm-up):")
        for m, rb in table.items():
            for b, r in rb.items():
                print(f"  {m:>8} batch {b:>3}: {r}  (x plain: {[round(x / r[0], 2) for x in r]})")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\nwrote {args.out}")
    return 0


def _summary(rows: list[dict], K: int, key: str = "tok_s") -> list[dict]:
    """Per (T, batch): adaptive against plain and against the best fixed K of that cell
    (key: "tok_s" wall clock, "tok_cpu_s" this process's CPU time). Every ratio is the median
    over passes of the ratio within one pass (the engines' runs of a pass are interleaved)."""
    out = []
    cells = sorted({(r["temperature"], r["batch"]) for r in rows})
    for T, B in cells:
        cell = {r["engine"]: r for r in rows if (r["temperature"], r["batch"]) == (T, B)}
        per_pass = {name: r[f"pass_{key}"] for name, r in cell.items()}
        vs = lambda a, b: statistics.median(x / y for x, y in zip(per_pass[a], per_pass[b]))  # noqa: E731
        fixed = {k: vs(f"fixed_{k}", "plain") for k in range(1, K + 1) if f"fixed_{k}" in cell}
        best_k = max(fixed, key=fixed.get)
        a = cell["adaptive"]
        row = {
            "clock": key,
            "temperature": T,
            "batch": B,
            "plain_tok_s": cell["plain"][key],
            "adaptive_tok_s": a[key],
            "adaptive_vs_plain": vs("adaptive", "plain"),
            "adaptive_draft_k": a["draft_k"],
            "best_fixed_k": best_k,
            "best_fixed_vs_plain": fixed[best_k],
            "adaptive_vs_best_fixed": vs("adaptive", f"fixed_{best_k}"),
            "fixed_vs_plain": fixed,
        }
        if "untrained_adaptive" in cell:
            row["untrained_adaptive_vs_plain"] = vs("untrained_adaptive", "plain")
            row["untrained_adaptive_draft_k"] = cell["untrained_adaptive"]["draft_k"]
            row["untrained_fixed_vs_plain"] = vs("untrained", "plain")
        out.append(row)
    return out


def _kinds(rows: list[dict], K: int, main: str, vs: str) -> list[dict]:
    """Per (T, batch): both drafts' acceptance length and speedup at fixed K_max and adaptive
    (``main``'s engines are fixed_k / adaptive, ``vs``'s <vs>_fixed_k / <vs>_adaptive)."""
    out = []
    for T, B in sorted({(r["temperature"], r["batch"]) for r in rows}):
        cell = {r["engine"]: r for r in rows if (r["temperature"], r["batch"]) == (T, B)}
        row = {"temperature": T, "batch": B}
        for kind, prefix in ((main, ""), (vs, f"{vs}_")):
            fixed, adaptive = cell[f"{prefix}fixed_{K}"], cell[f"{prefix}adaptive"]
            row[kind] = {
                "accept_len_fixed": fixed["accept_len"],
                "speedup_fixed": fixed["speedup"],
                "accept_len_adaptive": adaptive["accept_len"],
                "speedup_adaptive": adaptive["speedup"],
                "draft_k_adaptive": adaptive["draft_k"],
            }
            if f"{prefix}confidence" in cell:
                conf = cell[f"{prefix}confidence"]
                row[kind] |= {
                    "accept_len_confidence": conf["accept_len"],
                    "speedup_confidence": conf["speedup"],
                    "draft_k_confidence": conf["draft_k"],
                }
        out.append(row)
    return out


def _kinds_table(kinds: list[dict], K: int) -> str:
    names = [k for k in kinds[0] if k not in ("temperature", "batch")]
    head = (
        "|    T | batch | " + " | ".join(f"{n}: accept len K={K} / speedup / adaptive (draft_k)" for n in names) + " |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in kinds:
        lines.append(
            f"| {r['temperature']:>4g} | {r['batch']:>5} | "
            + " | ".join(
                f"{r[n]['accept_len_fixed']:.2f} / {r[n]['speedup_fixed']:.2f}x / {r[n]['speedup_adaptive']:.2f}x "
                f"({r[n]['draft_k_adaptive']:.2f})"
                + (
                    f" / confidence {r[n]['accept_len_confidence']:.2f}, {r[n]['speedup_confidence']:.2f}x "
                    f"({r[n]['draft_k_confidence']:.2f})"
                    if "accept_len_confidence" in r[n]
                    else ""
                )
                for n in names
            )
            + " |"
        )
    return "\n".join(lines)


def _summary_table(summary: list[dict]) -> str:
    ks = sorted(summary[0]["fixed_vs_plain"])
    u = "untrained_adaptive_vs_plain" in summary[0]
    head = (
        "|    T | batch | plain tok/s | "
        + " | ".join(f"K={k}" for k in ks)
        + " | adaptive | draft_k | best fixed | adaptive / best |"
        + (" untrained: fixed / adaptive (draft_k) |" if u else "")
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for s in summary:
        lines.append(
            f"| {s['temperature']:>4g} | {s['batch']:>5} | {s['plain_tok_s']:>11.1f} | "
            + " | ".join(f"{s['fixed_vs_plain'][k]:.2f}x" for k in ks)
            + f" | {s['adaptive_vs_plain']:.2f}x | {s['adaptive_draft_k']:.2f} | K={s['best_fixed_k']} "
            f"| {s['adaptive_vs_best_fixed']:.3f} |"
            + (
                f" {s['untrained_fixed_vs_plain']:.2f}x / {s['untrained_adaptive_vs_plain']:.2f}x "
                f"({s['untrained_adaptive_draft_k']:.2f}) |"
                if u
                else ""
            )
        )
    return "\n".join(lines)


def _row(r: dict) -> str:
    return (
        f"| {r['temperature']:>4g} | {r['batch']:>5} | {r['engine']:<18} | {r['K']:>1} | {r['tok_s']:>8.1f} "
        f"| {r['accept_len']:>10.2f} | {r['sglang_accept']:>13.2f} | {r['draft_k']:>7.2f} | {r['speedup']:>7.2f}x |"
    )


def _table(rows: list[dict]) -> str:
    head = "|    T | batch | engine             | K |    tok/s | accept len | sglang accept | draft_k | speedup |\n"
    head += "|------|-------|--------------------|---|----------|------------|---------------|---------|---------|"
    return "\n".join([head] + [_row(r) for r in rows])


if __name__ == "__main__":
    sys.exit(main())
