# Benchmark: asynchronous RL (rl.async_steps = 1) against the synchronous step, on the vLLM
# default config (train_configs/debug_cpu_vllm.toml: GRPO on the trace task, rollouts served
# by vLLM on CPU, the EAGLE-3 draft co-trained), in one run of this script.
#
# Both variants run the same steps from the same warm start with the same seeds (rollouts
# are seeded by task seed, step and rank), one after the other, each with the vLLM server on
# core --server-cpus (rollout.vllm.cpus: taskset, and vLLM's worker threads bound there) and
# the trainer on core --trainer-cpus (taskset, OMP_NUM_THREADS=1):
#   sync   rl.async_steps = 0: push, generate, score, train, one after the other
#   async  rl.async_steps = 1: step t trains while the server generates step t+1's batch
#          from the weights after step t-1 (titan_spec/rl/rollout_queue.py)
# Medians over the steps after the first two (step 1 pays warm-up; the async run's step 2
# trains on a batch queued at step 1) and without the baseline steps (rl.baseline_interval:
# two more server calls and pushes):
#   sync   generate = time/push_s + time/rollout_s, train = time/train_s, step = time/step_s
#   async  wait = time/rollout_wait_s (the step's wait for its batch, weights copied for the
#          next job included), train = time/train_s, step = time/step_s (wait + train)
# The overlap's physical limit is max(generate, train) of the synchronous phases: the goal is
# async step <= 1.15x that; the ratio to the synchronous step is the speedup. Also: reward
# and co-trained acceptance of both runs (start/end means, and one plot of both), the
# frozen-draft baseline at the last baseline step, and the async run's policy lag.
#
# Usage: PYTHONPATH=. python bench/rl_async.py [--steps 40] [--out bench/results/rl_async.json]

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
sys.path.insert(0, str(REPO_ROOT))
from titan_spec.rl.report import read_metrics  # noqa: E402

CONFIG = "train_configs/debug_cpu_vllm.toml"
VARIANTS = {"sync": ["--rl.async_steps", "0"], "async": ["--rl.async_steps", "1"]}
GOAL = 1.15
"""The async step against max(generate, train) of the synchronous step's phases."""


def _parse_args(argv=None):
    p = argparse.ArgumentParser(description="asynchronous vs synchronous RL on the vLLM default config")
    p.add_argument("--steps", type=int, default=40, help="RL steps per variant")
    p.add_argument("--trainer-cpus", default="1", help="taskset -c list for the trainer")
    p.add_argument("--server-cpus", default="0", help="rollout.vllm.cpus: the vLLM server's cores")
    p.add_argument("--dump", default=str(REPO_ROOT / "outputs/bench_rl_async"))
    p.add_argument("--out", default=str(REPO_ROOT / "bench/results/rl_async.json"))
    return p.parse_args(argv)


def _warm_start() -> None:
    done = [REPO_ROOT / "outputs/debug_cpu_vllm/sft/DONE", REPO_ROOT / "outputs/debug_cpu_vllm/draft/DONE"]
    if not all(d.exists() for d in done):
        print("training the warm start: CONFIG_FILE=train_configs/debug_cpu_vllm_draft.toml ./run_train.sh", flush=True)
        subprocess.run(
            [str(REPO_ROOT / "run_train.sh")],
            cwd=REPO_ROOT,
            check=True,
            env=dict(os.environ, CONFIG_FILE="train_configs/debug_cpu_vllm_draft.toml"),
        )


def _run(name: str, dump: str, args) -> tuple[list[dict], float]:
    shutil.rmtree(dump, ignore_errors=True)
    cmd = [
        "taskset",
        "-c",
        args.trainer_cpus,
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=1",
        "-m",
        "titan_spec.train",
        "--config",
        CONFIG,
        "--job.dump_folder",
        dump,
        "--training.steps",
        str(args.steps),
        "--checkpoint.enable",
        "false",
        "--rollout.progress",
        "false",
        "--job.export_hf",
        "",
        "--draft.export_dir",
        "",
        "--rollout.vllm.cpus",
        json.dumps(args.server_cpus),
        *VARIANTS[name],
    ]
    print(f"[{name}] {' '.join(cmd)}", flush=True)
    t0 = time.time()
    out = subprocess.run(
        cmd,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT), HF_HUB_OFFLINE="1"),
    )
    if out.returncode:
        raise SystemExit(f"[{name}] failed:\n{out.stderr[-4000:]}")
    wall = time.time() - t0
    print(f"[{name}] {wall:.0f} s", flush=True)
    return read_metrics(dump), wall


def _median(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def _mean(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return sum(vals) / len(vals) if vals else None


def phases(rows: list[dict]) -> dict:
    """Median seconds per step over the timed steps (after step 2, no baseline step)."""
    timed = [r for r in rows if r["step"] > 2 and "rollout/accept_len_frozen" not in r]
    gen = [r["time/push_s"] + r["time/rollout_s"] for r in timed]
    return {
        "timed_steps": len(timed),
        "generate_s": statistics.median(gen) if gen else None,
        "train_s": _median(timed, "time/train_s"),
        "wait_s": _median(timed, "time/rollout_wait_s"),
        "step_s": _median(timed, "time/step_s"),
    }


def outcome(rows: list[dict], window: int = 10) -> dict:
    base = [r for r in rows if "rollout/accept_len_frozen" in r]
    last = base[-1] if base else {}
    return {
        "reward_start": _mean(rows[:window], "rl/reward"),
        "reward_end": _mean(rows[-window:], "rl/reward"),
        "accept_start": _mean(rows[:window], "rollout/accept_len"),
        "accept_end": _mean(rows[-window:], "rollout/accept_len"),
        "accept_last_baseline": last.get("rollout/accept_len"),
        "frozen_last_baseline": last.get("rollout/accept_len_frozen"),
        "last_baseline_step": last.get("step"),
        "policy_lag_max": max((r.get("rl/policy_lag", 0) for r in rows), default=0),
    }


def _plot(path: Path, runs: dict[str, list[dict]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 3.8))
    for name, rows in runs.items():
        steps = [r["step"] for r in rows]
        axes[0].plot(steps, [r["rl/reward"] for r in rows], label=name)
        axes[1].plot(steps, [r["rollout/accept_len"] for r in rows], label=f"{name}, co-trained")
        base = [r for r in rows if "rollout/accept_len_frozen" in r]
        axes[1].plot(
            [r["step"] for r in base],
            [r["rollout/accept_len_frozen"] for r in base],
            "o--",
            label=f"{name}, frozen (same prompts)",
        )
    axes[0].set(title="reward", xlabel="RL step")
    axes[1].set(title="acceptance length (tokens per verify, vLLM)", xlabel="RL step")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _f(x, fmt=".3f") -> str:
    return "-" if x is None else format(x, fmt)


def main(argv=None) -> int:
    args = _parse_args(argv)
    _warm_start()
    runs, walls = {}, {}
    for name in VARIANTS:
        runs[name], walls[name] = _run(name, os.path.join(args.dump, name), args)
    sync, asyn = phases(runs["sync"]), phases(runs["async"])
    limit = max(sync["generate_s"], sync["train_s"])
    result = {
        "config": CONFIG,
        "steps": args.steps,
        "trainer_cpus": args.trainer_cpus,
        "server_cpus": args.server_cpus,
        "date": time.strftime("%Y-%m-%d"),
        "wall_s": walls,
        "sync": {**sync, **outcome(runs["sync"])},
        "async": {**asyn, **outcome(runs["async"])},
        "overlap_limit_s": limit,
        "async_vs_limit": asyn["step_s"] / limit,
        "async_vs_sync": asyn["step_s"] / sync["step_s"],
        "goal_async_vs_limit": GOAL,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    _plot(out.with_suffix(".png"), runs)
    s, a = result["sync"], result["async"]
    print(
        f"\n{CONFIG}, {args.steps} steps per variant; medians over {s['timed_steps']} / {a['timed_steps']} timed steps "
        f"(after step 2, no baseline step); trainer on cores {args.trainer_cpus}, vLLM on {args.server_cpus}"
    )
    print("| | sync | async |\n| --- | --- | --- |")
    print(f"| generate s/step (push + rollout) | {_f(s['generate_s'])} | overlapped |")
    print(f"| wait for the batch s/step | - | {_f(a['wait_s'])} |")
    print(f"| train s/step | {_f(s['train_s'])} | {_f(a['train_s'])} |")
    print(f"| step s | {_f(s['step_s'])} | {_f(a['step_s'])} |")
    print(
        f"| reward, start -> end | {_f(s['reward_start'])} -> {_f(s['reward_end'])} | "
        f"{_f(a['reward_start'])} -> {_f(a['reward_end'])} |"
    )
    print(
        f"| acceptance, co-trained, start -> end | {_f(s['accept_start'], '.2f')} -> {_f(s['accept_end'], '.2f')} | "
        f"{_f(a['accept_start'], '.2f')} -> {_f(a['accept_end'], '.2f')} |"
    )
    print(
        f"| co-trained / frozen at the last baseline step | {_f(s['accept_last_baseline'], '.2f')} / "
        f"{_f(s['frozen_last_baseline'], '.2f')} | {_f(a['accept_last_baseline'], '.2f')} / "
        f"{_f(a['frozen_last_baseline'], '.2f')} |"
    )
    print(f"| policy lag, steps (max) | {s['policy_lag_max']:.0f} | {a['policy_lag_max']:.0f} |")
    print(
        f"\nasync step / max(generate, train) of the sync step = {result['async_vs_limit']:.2f} (goal <= {GOAL}); "
        f"async step / sync step = {result['async_vs_sync']:.2f}"
    )
    print(f"JSON: {out}; plot: {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
