# Benchmark: RL with the co-trained draft vs the frozen draft vs no speculation.
#
# Runs the embedded default's RL config (train_configs/debug_cpu.toml: GRPO on the trace
# task) three times from the same warm start (its SFT policy and offline draft, trained first
# when missing), each for --steps RL steps (default: the config's), with the same seeds
# (rollouts are seeded by task seed, step and rank):
#   co-trained  the default: speculative rollouts, the draft trained from every step's forward
#   frozen      --draft.co_train false: speculative rollouts with the starting draft, never trained
#   no-spec     --draft.enable false --speculative.enabled false: plain decoding
# Prints the three side by side (reward start/end, acceptance start/end, median seconds per
# step of push / rollout / train / total, rollout and step ratios to no-spec), the co-trained
# run's in-run acceptance on the same prompts (co-trained vs frozen draft), its drift (KL to
# the starting policy, completion length), and what the step ratio would be where rollouts
# take a larger share of the step (from the measured per-phase costs). JSON to --out; the
# report of the three (summary.md, plots/ with the three runs' reward and rollout time) is
# written into the co-trained run's folder and its plots copied next to the JSON.
#
# The three runs are sequential, so a busy machine can tilt the time ratios; the co-trained
# run's in-run baselines (same prompts, same seed, back to back) are the side-by-side
# acceptance comparison.
#
# Usage: PYTHONPATH=. python bench/rl_baselines.py [--steps N] [--out bench/results/rl_baselines.json]

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
from titan_spec.rl.report import read_metrics, variant_summary, write_report  # noqa: E402

VARIANTS = {
    "co-trained": [],
    "frozen": ["--draft.co_train", "false"],
    "no-spec": ["--draft.enable", "false", "--speculative.enabled", "false"],
}
SHARES = (0.5, 0.7, 0.9)
"""Rollout shares of a no-speculation step for the projection (GPU RL of large models spends
most of a step generating)."""


def _parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=0, help="RL steps per variant (0 = the config's training.steps)")
    p.add_argument("--variants", default="co-trained,frozen,no-spec")
    p.add_argument("--dump", default=str(REPO_ROOT / "outputs/bench_rl"))
    p.add_argument("--out", default=str(REPO_ROOT / "bench/results/rl_baselines.json"))
    p.add_argument("--extra", default="", help="more overrides for every variant, space-separated")
    p.add_argument(
        "--reuse",
        action="store_true",
        help="a variant whose dump folder holds a finished run (DONE) is read, not rerun "
        "(run the variants in parallel, then once more with --reuse for the table)",
    )
    return p.parse_args(argv)


def _warm_start():
    done = [REPO_ROOT / "outputs/debug_cpu/sft/DONE", REPO_ROOT / "outputs/debug_cpu/draft/DONE"]
    if not all(d.exists() for d in done):
        print("training the warm start: CONFIG_FILE=train_configs/debug_cpu_draft.toml ./run_train.sh", flush=True)
        subprocess.run(
            [str(REPO_ROOT / "run_train.sh")],
            cwd=REPO_ROOT,
            check=True,
            env=dict(os.environ, CONFIG_FILE="train_configs/debug_cpu_draft.toml"),
        )


def _run(name: str, dump: str, steps: int, extra: list[str]) -> list[dict]:
    shutil.rmtree(dump, ignore_errors=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=1",
        "-m",
        "titan_spec.train",
        "--config",
        "train_configs/debug_cpu.toml",
        "--job.dump_folder",
        dump,
        *(["--training.steps", str(steps)] if steps else []),
        "--checkpoint.enable",
        "false",
        "--rollout.progress",
        "false",
        *VARIANTS[name],
        *extra,
    ]
    print(f"[{name}] {' '.join(cmd)}", flush=True)
    t0 = time.time()
    out = subprocess.run(
        cmd,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONPATH=str(REPO_ROOT)),
    )
    if out.returncode:
        raise SystemExit(f"[{name}] failed:\n{out.stderr[-4000:]}")
    print(f"[{name}] {time.time() - t0:.0f} s", flush=True)
    return read_metrics(dump)


def summarize(name: str, rows: list[dict], window: int = 10) -> dict:
    out = {"variant": name, "steps": len(rows), **variant_summary(rows, window)}
    base = [r for r in rows if "rollout/accept_len_frozen" in r]
    if base:
        out["inrun_accept"] = [(r["step"], r["rollout/accept_len"], r["rollout/accept_len_frozen"]) for r in base]
    drift = [
        (
            r["step"],
            r.get("drift/kl"),
            r.get("drift/kl_k3"),
            r.get("rollout/completion_len"),
            r.get("rollout/completion_len_p90"),
        )
        for r in rows
        if "rollout/completion_len" in r
    ]
    if drift:
        out["drift"] = drift
    return out


def _f(x, fmt=".3f"):
    return "-" if x is None else format(x, fmt)


def projection(co: dict, ns: dict) -> list[tuple[float, float]]:
    """(rollout share of a no-spec step, projected co-trained / no-spec step ratio): the
    measured rollout speedup and the measured train-phase overhead of co-training, with the
    rollout phase scaled to take that share of the no-spec step."""
    roll, train = co["rollout_s"] / ns["rollout_s"], co["train_s"] / ns["train_s"]
    return [(f, f * roll + (1 - f) * train) for f in SHARES]


def main(argv=None) -> int:
    args = _parse_args(argv)
    _warm_start()
    extra = args.extra.split() if args.extra else []
    results, rows = {}, {}
    for name in args.variants.split(","):
        dump = os.path.join(args.dump, name)
        if args.reuse and os.path.isfile(os.path.join(dump, "DONE")):
            print(f"[{name}] reusing the finished run in {dump}", flush=True)
            rows[name] = read_metrics(dump)
        else:
            rows[name] = _run(name, dump, args.steps, extra)
        results[name] = summarize(name, rows[name])
    ns = results.get("no-spec")
    print(
        "\n| variant | reward start | reward end | accept start | accept end | push s | rollout s | train s "
        "| step s | rollout vs no-spec | step vs no-spec | completion len (end) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results.values():
        ratios = [f"{r[k] / ns[k]:.2f}x" if ns and r[k] and ns[k] else "-" for k in ("rollout_s", "step_s")]
        print(
            f"| {r['variant']} | {_f(r['reward_start'])} | {_f(r['reward_end'])} | {_f(r['accept_start'], '.2f')} "
            f"| {_f(r['accept_end'], '.2f')} | {_f(r['push_s'])} | {_f(r['rollout_s'])} | {_f(r['train_s'])} "
            f"| {_f(r['step_s'])} | {ratios[0]} | {ratios[1]} | {_f(r['completion_len_end'], '.1f')} |"
        )
    co = results.get("co-trained", {})
    if "inrun_accept" in co:
        print("\nIn-run acceptance length on the same prompts (co-trained run): step: co-trained / frozen")
        for s, a, b in co["inrun_accept"]:
            print(f"  {s:>4}: {a:.2f} / {b:.2f}  ({a / b:.2f}x)")
    if "drift" in co:
        print("\nDrift of the co-trained run: step: KL log-ratio / KL k3 / completion len mean / p90")
        for s, k1, k3, m, p in co["drift"][:: max(1, len(co["drift"]) // 10)] + co["drift"][-1:]:
            print(f"  {s:>4}: {_f(k1, '.4f')} / {_f(k3, '.4f')} / {_f(m, '.1f')} / {_f(p, '.0f')}")
    if co and ns:
        proj = projection(co, ns)
        results["projection"] = proj
        print(
            "\nStep ratio co-trained / no-spec if rollouts took a larger share of the no-spec step "
            f"(measured: rollout {co['rollout_s'] / ns['rollout_s']:.2f}x, train {co['train_s'] / ns['train_s']:.2f}x, "
            f"rollout share here {ns['rollout_s'] / ns['step_s']:.2f}):"
        )
        for f, ratio in proj:
            print(f"  rollout share {f:.0%}: {ratio:.2f}x")
    if "co-trained" in rows:
        dump = os.path.join(args.dump, "co-trained")
        write_report(dump, runs=rows)
        plots = os.path.join(os.path.dirname(os.path.abspath(args.out)), "rl_plots")
        shutil.copytree(os.path.join(dump, "plots"), plots, dirs_exist_ok=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"benchmark": "rl_baselines", "steps": args.steps, "extra": extra, "results": results}, f, indent=2)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
