# Benchmark: RL with the co-trained draft vs the frozen draft vs no speculation.
#
# Runs the embedded default's RL config (train_configs/debug_cpu.toml) three times from the
# same warm start (its SFT policy and offline draft, trained first when missing), each for
# --steps RL steps:
#   cotrained  the default: speculative rollouts, the draft trained from every step's forward
#   frozen     --draft.co_train false: speculative rollouts with the starting draft, never trained
#   nospec     --draft.enable false --speculative.enabled false: plain decoding
# and prints one table: reward start/end, acceptance length start/end (the co-trained run's
# in-run frozen baseline on the same prompts included), median seconds per step (push,
# rollout, train, total) and the step-time ratio against nospec. JSON to --out; the
# co-trained run's plots are copied next to it.
#
# The three runs are sequential, so a busy machine can tilt the step-time ratio; the
# co-trained run's in-run baselines (same prompts, same seed, back to back) are the
# side-by-side acceptance comparison.
#
# Usage: PYTHONPATH=. python bench/rl_baselines.py [--steps 100] [--out bench/results/rl_baselines.json]

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
VARIANTS = {
    "cotrained": [],
    "frozen": ["--draft.co_train", "false"],
    "nospec": ["--draft.enable", "false", "--speculative.enabled", "false"],
}


def _parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--variants", default="cotrained,frozen,nospec")
    p.add_argument("--dump", default=str(REPO_ROOT / "outputs/bench_rl"))
    p.add_argument("--out", default=str(REPO_ROOT / "bench/results/rl_baselines.json"))
    p.add_argument("--extra", default="", help="more overrides for every variant, space-separated")
    return p.parse_args(argv)


def _warm_start():
    done = [REPO_ROOT / "outputs/debug_cpu/sft/DONE", REPO_ROOT / "outputs/debug_cpu/draft/DONE"]
    if not all(d.exists() for d in done):
        print("training the warm start: CONFIG_FILE=train_configs/debug_cpu_draft.toml ./run_train.sh", flush=True)
        subprocess.run([str(REPO_ROOT / "run_train.sh")], cwd=REPO_ROOT, check=True,
                       env=dict(os.environ, CONFIG_FILE="train_configs/debug_cpu_draft.toml"))


def _run(name: str, dump: str, steps: int, extra: list[str]) -> list[dict]:
    shutil.rmtree(dump, ignore_errors=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
           "-m", "titan_spec.train", "--config", "train_configs/debug_cpu.toml", "--job.dump_folder", dump,
           "--training.steps", str(steps), "--checkpoint.enable", "false", "--rollout.progress", "false",
           *VARIANTS[name], *extra]
    print(f"[{name}] {' '.join(cmd)}", flush=True)
    t0 = time.time()
    out = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONPATH=str(REPO_ROOT)))
    if out.returncode:
        raise SystemExit(f"[{name}] failed:\n{out.stderr[-4000:]}")
    print(f"[{name}] {time.time() - t0:.0f} s", flush=True)
    from titan_spec.rl.report import read_metrics

    return read_metrics(dump)


def _mean(rows, key):
    vals = [r[key] for r in rows if key in r]
    return sum(vals) / len(vals) if vals else float("nan")


def _median(rows, key):
    vals = [r[key] for r in rows if key in r]
    return statistics.median(vals) if vals else float("nan")


def summarize(name: str, rows: list[dict], window: int = 10) -> dict:
    body = rows[1:]  # step 1 pays one-off warm-up costs
    base = [r for r in rows if "rollout/accept_len_frozen" in r]
    out = {
        "variant": name, "steps": len(rows),
        "reward_start": _mean(rows[:window], "rl/reward"), "reward_end": _mean(rows[-window:], "rl/reward"),
        "accept_start": _mean(rows[:window], "rollout/accept_len"), "accept_end": _mean(rows[-window:], "rollout/accept_len"),
        "push_s": _median(body, "time/push_s"), "rollout_s": _median(body, "time/rollout_s"),
        "train_s": _median(body, "time/train_s"), "step_s": _median(body, "time/step_s"),
        "rollout_tok_s": _median(body, "rollout/tokens_per_s"),
    }
    if base:
        out["inrun_accept_cotrained"] = [(r["step"], r["rollout/accept_len"]) for r in base]
        out["inrun_accept_frozen"] = [(r["step"], r["rollout/accept_len_frozen"]) for r in base]
    return out


def main(argv=None) -> int:
    args = _parse_args(argv)
    _warm_start()
    extra = args.extra.split() if args.extra else []
    results = {}
    for name in args.variants.split(","):
        dump = os.path.join(args.dump, name)
        results[name] = summarize(name, _run(name, dump, args.steps, extra))
        if name == "cotrained":
            plots = os.path.join(os.path.dirname(os.path.abspath(args.out)), "rl_plots")
            shutil.copytree(os.path.join(dump, "plots"), plots, dirs_exist_ok=True)
    nospec = results.get("nospec", {}).get("step_s")
    print("\n| variant | reward start | reward end | accept start | accept end | push s | rollout s | train s "
          "| step s | step vs nospec | rollout tok/s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results.values():
        ratio = f"{r['step_s'] / nospec:.2f}x" if nospec else "-"
        print(f"| {r['variant']} | {r['reward_start']:.3f} | {r['reward_end']:.3f} | {r['accept_start']:.2f} "
              f"| {r['accept_end']:.2f} | {r['push_s']:.3f} | {r['rollout_s']:.3f} | {r['train_s']:.3f} "
              f"| {r['step_s']:.3f} | {ratio} | {r['rollout_tok_s']:.0f} |")
    co = results.get("cotrained", {})
    if "inrun_accept_frozen" in co:
        print("\nIn-run acceptance length on the same prompts (co-trained run): step: co-trained / frozen")
        for (s, a), (_, b) in zip(co["inrun_accept_cotrained"], co["inrun_accept_frozen"]):
            print(f"  {s:>4}: {a:.2f} / {b:.2f}  ({a / b:.2f}x)")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"benchmark": "rl_baselines", "steps": args.steps, "extra": extra, "results": results}, f, indent=2)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
