# Benchmark: what adaptive depth's probes (rollout/builtin/depth.py, PROBE_EVERY) cost with a
# useless draft, and what adaptive depth gains with a useful one; side by side in one process.
#
# Engines over one target (the tiny Qwen3 flavor, vocab 256, unit-variance projections as in
# tests/test_rollout_engine.py, so its distributions are peaked), K_max = --num-draft-tokens:
#   plain            K = 0 (autoregressive decoding, same engine code)
#   random_adaptive  adaptive depth, a freshly initialized (random) draft: falls to K = 0
#                    after its first rounds, then one round in PROBE_EVERY probes at
#                    K = PROBE_DEPTH
#   random_noprobe   the same with probes off (its estimate's ``depth`` returns the choice):
#                    what K = 0 with a draft costs by itself, the idle decay's re-probes in
#   random_fixed     fixed K_max, the same random draft (what adaptive depth avoids paying)
#   fitted_adaptive  adaptive depth, a draft fitted to the target by TTT on its own greedy
#                    completions of the benchmark's prompts (a useful draft)
# The adaptive engines share one cost table, measured during the warm-up (not timed); the
# warm-up also runs every adaptive engine to its steady state (the random one to K = 0 with
# its probes), and the estimates carry from call to call as they do from RL step to RL step.
# Each pass: every engine decodes the same --requests prompts, --batch per generate call,
# the engines in turn call by call (rotated per pass), so load that comes and goes falls on
# all alike; a ratio to plain is the median over all calls of the ratio to plain's call of
# the same prompts in the same pass.
# Reported: wall-clock tokens/s and tokens per CPU second of the engine's thread
# (calibrate.round_clock, which other processes' load does not inflate), K per round, and what
# a probe round costs: median probe round / median K = 0 round (thread CPU time) of
# random_adaptive, and so its share of plain decoding, (that - 1) / PROBE_EVERY.
#
# Usage: PYTHONPATH=. python bench/depth_revisit.py [--batch 8] [--repeats 8] [--out PATH]

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

import titan_spec  # noqa: E402,F401
from titan_spec.models.draft.eagle3.model import DraftArch, Eagle3Draft  # noqa: E402
from titan_spec.models.draft.eagle3.ttt import ttt_inputs_for_sequences  # noqa: E402
from titan_spec.models.registry import build_target_config, flavor_arch  # noqa: E402
from titan_spec.rollout import SamplingParams, BuiltinEngineConfig, BuiltinRolloutEngine  # noqa: E402
from titan_spec.rollout.builtin.depth import PROBE_DEPTH, PROBE_EVERY, RoundCosts  # noqa: E402

TAPS = (1, 3, 4)


def _parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="adaptive depth: probe cost with a random draft, gain with a fitted one")
    p.add_argument("--num-draft-tokens", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--requests", type=int, default=16, help="prompts per pass, --batch per generate call")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=12, help="timed passes")
    p.add_argument("--fit-steps", type=int, default=60, help="TTT steps of the fitted draft")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(REPO_ROOT / "bench/results/depth_revisit.json"))
    return p.parse_args(argv)


def build_target(seed: int):
    torch.manual_seed(seed)
    arch = flavor_arch("qwen3", "tiny")
    model = build_target_config(arch, tap_layer_ids=TAPS, max_seq_len=512).build()
    model.init_weights(buffer_device=None)
    with torch.no_grad():  # torchtitan's init gives near-uniform outputs; these are peaked
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]))
    return model.eval(), arch


def new_draft(arch, seed: int) -> Eagle3Draft:
    torch.manual_seed(seed)
    d = Eagle3Draft(DraftArch.from_target(arch, TAPS, arch.vocab_size))
    d.reset_parameters()
    return d.eval()


def fit_draft(target, arch, prompts, max_new_tokens: int, steps: int, seed: int) -> Eagle3Draft:
    """TTT (3 steps deep) on the target's greedy completions of ``prompts``."""
    plain = BuiltinRolloutEngine(target, None, BuiltinEngineConfig(num_draft_tokens=0))
    done = plain.generate(prompts, SamplingParams(0.0, max_new_tokens=max_new_tokens))
    seqs = [r.prompt_ids + r.output_ids for r in done]
    draft = new_draft(arch, seed)
    draft.train()
    inputs = ttt_inputs_for_sequences(target, draft, seqs, 3)
    opt = torch.optim.AdamW(draft.parameters(), lr=2e-2)
    for _ in range(steps):
        loss = draft(*inputs).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return draft.eval()


def _time_rounds(engine, out: list) -> None:
    """Appends (K, thread CPU seconds) of each of ``engine``'s rounds to ``out``: from one
    round's depth choice to the next one's in the same generate call (one batch a call
    here; a call's last round is not timed)."""
    choose, last = engine._depth, {}

    def timed(*a, **k):
        now = time.thread_time()
        if last.get("depths") is engine.last_depths:  # the same call: its last round ended
            out.append((last["K"], now - last["t"]))
        K = choose(*a, **k)
        last.update(depths=engine.last_depths, K=K, t=now)
        return K

    engine._depth = timed


def one_call(engine, prompts, sp) -> dict:
    t0, c0 = time.perf_counter(), time.thread_time()
    out = engine.generate(prompts, sp)
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    return {
        "wall": wall,
        "cpu": cpu,
        "tokens": sum(len(r.output_ids) for r in out),
        "forwards": sum(r.verify_steps for r in out),
        "depths": list(engine.last_depths),
        "outputs": [r.output_ids for r in out],
    }


def main(argv=None) -> int:
    args = _parse_args(argv)
    torch.set_num_threads(args.threads)
    K = args.num_draft_tokens
    t_start = time.perf_counter()
    target, arch = build_target(args.seed)
    g = torch.Generator().manual_seed(args.seed + 1)
    prompts = [
        torch.randint(0, arch.vocab_size, (int(n),), generator=g).tolist()
        for n in torch.randint(4, 17, (args.requests,), generator=g)
    ]
    fitted = fit_draft(target, arch, prompts, args.max_new_tokens, args.fit_steps, args.seed)
    t_fit = time.perf_counter() - t_start
    sp = SamplingParams(0.0, max_new_tokens=args.max_new_tokens)
    costs = RoundCosts()
    adaptive = BuiltinEngineConfig(num_draft_tokens=K, depth="adaptive")
    random_draft = new_draft(arch, args.seed + 7)
    engines = {
        "plain": BuiltinRolloutEngine(target, None, BuiltinEngineConfig(num_draft_tokens=0)),
        "random_adaptive": BuiltinRolloutEngine(target, random_draft, adaptive, costs=costs),
        "random_noprobe": BuiltinRolloutEngine(target, random_draft, adaptive, costs=costs),
        "random_fixed": BuiltinRolloutEngine(target, random_draft, BuiltinEngineConfig(num_draft_tokens=K)),
        "fitted_adaptive": BuiltinRolloutEngine(target, fitted, adaptive, costs=costs),
    }
    engines["random_noprobe"].acceptance.of(sp).depth = lambda k: k  # this estimate never probes
    rounds_s: list[tuple[int, float]] = []  # random_adaptive's (K, thread CPU s) per round
    _time_rounds(engines["random_adaptive"], rounds_s)
    chunks = [prompts[i : i + args.batch] for i in range(0, len(prompts), args.batch)]
    # Warm-up (not timed): measures the cost table, runs the estimates to their steady state.
    for _ in range(2):
        for e in engines.values():
            for c in chunks:
                e.generate(c, sp)
    names = list(engines)
    passes = {n: [] for n in names}
    pairs = {n: {"tok_s": [], "tok_cpu_s": []} for n in names}  # per call: ratio to plain's call
    probe_pairs: list[float] = []  # per call: random_adaptive / random_noprobe, thread CPU
    rounds_s.clear()
    for rep in range(args.repeats):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        calls = {n: [] for n in names}
        for c in chunks:
            for n in order:
                calls[n].append(one_call(engines[n], c, sp))
        for n in names:
            cs = calls[n]
            depths = [k for x in cs for k in x["depths"]]
            passes[n].append(
                {
                    "tok_s": sum(x["tokens"] for x in cs) / sum(x["wall"] for x in cs),
                    "tok_cpu_s": sum(x["tokens"] for x in cs) / sum(x["cpu"] for x in cs),
                    "accept_len": sum(x["tokens"] for x in cs) / sum(x["forwards"] for x in cs),
                    "draft_k": sum(depths) / len(depths),
                    "rounds": len(depths),
                    "drafting_rounds": sum(k > 0 for k in depths),
                }
            )
        for n in names:
            for x, y in zip(calls[n], calls["plain"]):
                pairs[n]["tok_s"].append((x["tokens"] / x["wall"]) / (y["tokens"] / y["wall"]))
                pairs[n]["tok_cpu_s"].append((x["tokens"] / x["cpu"]) / (y["tokens"] / y["cpu"]))
        for x, y in zip(calls["random_adaptive"], calls["random_noprobe"]):
            probe_pairs.append((x["tokens"] / x["cpu"]) / (y["tokens"] / y["cpu"]))
        exact = all(calls[n][i]["outputs"] == calls["plain"][i]["outputs"] for n in names for i in range(len(chunks)))
        if not exact:
            raise SystemExit("greedy speculative output differs from plain decoding")

    def vs_plain(n: str, key: str) -> float:
        """Median over calls of the ratio to plain's call of the same prompts in the same
        pass (seconds apart: load that comes and goes mostly cancels)."""
        return statistics.median(pairs[n][key])

    rows = []
    for n in names:
        ps = passes[n]
        rows.append(
            {
                "engine": n,
                "tok_s": statistics.median(p["tok_s"] for p in ps),
                "tok_cpu_s": statistics.median(p["tok_cpu_s"] for p in ps),
                "vs_plain": vs_plain(n, "tok_s"),
                "vs_plain_cpu": vs_plain(n, "tok_cpu_s"),
                "accept_len": statistics.median(p["accept_len"] for p in ps),
                "draft_k": statistics.median(p["draft_k"] for p in ps),
                "drafting_rounds_share": sum(p["drafting_rounds"] for p in ps) / sum(p["rounds"] for p in ps),
                "pass_tok_s": [p["tok_s"] for p in ps],
                "pass_tok_cpu_s": [p["tok_cpu_s"] for p in ps],
                "call_vs_plain": pairs[n]["tok_s"],
                "call_vs_plain_cpu": pairs[n]["tok_cpu_s"],
            }
        )
    table = costs.state_dict()["greedy"]
    print(
        f"qwen3/tiny (vocab {arch.vocab_size}), greedy, batch {args.batch}, {args.requests} prompts a pass, "
        f"{args.max_new_tokens} new tokens, K_max = {K}, PROBE_EVERY = {PROBE_EVERY}, {args.repeats} passes, "
        f"{torch.get_num_threads()} thread(s); fit {t_fit:.0f} s"
    )
    print(
        "| engine          |  tok/s | vs plain | tok/CPU-s | vs plain (CPU) | accept len | draft_k | drafting rounds |"
    )
    print(
        "|-----------------|--------|----------|-----------|----------------|------------|---------|-----------------|"
    )
    for r in rows:
        print(
            f"| {r['engine']:<15} | {r['tok_s']:>6.0f} | {r['vs_plain']:>7.3f}x | {r['tok_cpu_s']:>9.0f} "
            f"| {r['vs_plain_cpu']:>13.3f}x | {r['accept_len']:>10.2f} | {r['draft_k']:>7.2f} "
            f"| {100 * r['drafting_rounds_share']:>14.1f}% |"
        )
    print("round costs (x plain step, K = 0..K_max, measured by the engine):")
    ratios = {}
    for b, row in sorted(table.items(), key=lambda kv: int(kv[0])):
        ratios[b] = [x / row[0] for x in row]
        print(f"  batch {b:>3}: {[round(x, 2) for x in ratios[b]]}")
    probe = statistics.median(t for k, t in rounds_s if k) / statistics.median(t for k, t in rounds_s if not k)
    n_probes = sum(k > 0 for k, _ in rounds_s)
    print(
        f"random_adaptive: {n_probes} probe rounds (K = {PROBE_DEPTH}) of {len(rounds_s)}; a probe round = "
        f"{probe:.2f} K = 0 rounds (median, thread CPU), so probes cost (that - 1) / PROBE_EVERY = "
        f"{100 * (probe - 1) / PROBE_EVERY:.2f}% of plain decoding"
    )
    print(
        f"random_adaptive / random_noprobe (what the probes cost, per call, thread CPU): median "
        f"{statistics.median(probe_pairs):.3f}x over {len(probe_pairs)} calls"
    )
    result = {
        "benchmark": "depth_revisit",
        "num_draft_tokens": K,
        "batch": args.batch,
        "requests": args.requests,
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "probe_every": PROBE_EVERY,
        "fit_steps": args.fit_steps,
        "threads": torch.get_num_threads(),
        "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "torch": torch.__version__,
        "probe_depth": PROBE_DEPTH,
        "rows": rows,
        "round_cost_ratios": ratios,
        "probe_round_vs_plain_round": probe,
        "probe_rounds": n_probes,
        "random_adaptive_rounds": len(rounds_s),
        "probe_cost_estimate": (probe - 1) / PROBE_EVERY,
        "adaptive_vs_noprobe_cpu": statistics.median(probe_pairs),
        "call_adaptive_vs_noprobe_cpu": probe_pairs,
        "seconds": time.perf_counter() - t_start,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out} ({result['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
