# Benchmark: how long a user waits for a refused config (docs/RELIABILITY.md, issue 31).
#
# Runs the real `python -m titan_spec.train --plan --config train_configs/debug_cpu.toml ARGS`
# (what run_train.sh runs first) for a few kinds of bad input, each --repeats times, checkouts
# in turns (--checkouts NAME=DIR,...: e.g. this tree and a worktree of an older commit, each with
# its own titan_spec, the same Python), and reports the median wall seconds per kind and
# checkout. Every run must exit 2 with one `titan_spec: config error:` line, or the benchmark
# stops: a refusal that is fast but wrong measures nothing.
#
#   typo_key      --training.stpes 3        (an unknown key: "did you mean")
#   bad_type      --training.steps x        (a value of the wrong type)
#   bad_choice    --rl.loss foo             (a value outside its allowed set)
#   cross_field   --rl.group_size 1         (a rule between keys: validate.py)
#   missing_dir   --model.hf_checkpoint DIR (an input: the preflight reads the directory)
#
# Usage: PYTHONPATH=. python bench/plan_refusal.py [--repeats 5] [--checkouts new=.,old=/tmp/old]
#        [--out bench/results/plan_refusal.json]

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CASES = {
    "typo_key": ["--training.stpes", "3"],
    "bad_type": ["--training.steps", "x"],
    "bad_choice": ["--rl.loss", "foo"],
    "cross_field": ["--rl.group_size", "1"],
    "missing_dir": ["--model.hf_checkpoint", "/nonexistent/titan_spec_bench"],
}


def refuse(root: str, args: list[str]) -> float:
    """Wall seconds of one refused --plan in checkout ``root``; raises if it was not refused
    with exactly one config-error line."""
    env = dict(os.environ, PYTHONPATH=os.path.abspath(root), HF_HUB_OFFLINE="1")
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "titan_spec.train", "--plan", "--config", "train_configs/debug_cpu.toml", *args],
        capture_output=True,
        text=True,
        cwd=root,
        env=env,
        timeout=300,
    )
    wall = time.perf_counter() - t0
    ours = [ln for ln in out.stderr.splitlines() if ln.startswith("titan_spec: config error:")]
    if out.returncode != 2 or len(ours) != 1:
        raise SystemExit(
            f"{root} {' '.join(args)}: exit {out.returncode}, not one config-error line:\n{out.stderr[-2000:]}"
        )
    return wall


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="wall seconds of a refused --plan")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--checkouts", default="this=.", help="NAME=DIR,... run in turns")
    p.add_argument("--out", default="bench/results/plan_refusal.json")
    args = p.parse_args(argv)
    checkouts = dict(item.split("=", 1) for item in args.checkouts.split(","))
    walls = {(case, name): [] for case in CASES for name in checkouts}
    for _ in range(args.repeats):
        for case, case_args in CASES.items():
            for name, root in checkouts.items():
                walls[case, name].append(refuse(root, case_args))
    names = list(checkouts)
    print(f"{'case':<12}" + "".join(f"{n + ' s':>12}" for n in names) + ("   ratio" if len(names) == 2 else ""))
    result = {"repeats": args.repeats, "checkouts": checkouts, "median_s": {}}
    for case in CASES:
        med = {n: statistics.median(walls[case, n]) for n in names}
        result["median_s"][case] = med
        ratio = f"   {med[names[0]] / med[names[1]]:.2f}x" if len(names) == 2 else ""
        print(f"{case:<12}" + "".join(f"{med[n]:>12.2f}" for n in names) + ratio)
    result["walls"] = {f"{c}/{n}": w for (c, n), w in walls.items()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
