# Benchmark (readability): what one RL step of the embedded default runs, as a call trace.
#
# One process builds the default RL run (train_configs/debug_cpu.toml, its warm start and
# offline draft from a finished ./run_train.sh chain), then traces ONE train_step with
# sys.setprofile: every Python call whose code lives in the titan_spec package. Reported:
#   files       titan_spec files entered
#   functions   distinct titan_spec functions called
#   switches    calls from a titan_spec function into one in ANOTHER titan_spec file
#   calls       titan_spec calls in all
# each counted twice: over every titan_spec call ("all"), and at the step's level ("step"):
# the calls a reader of the step follows, down to the seams: the rollout engine behind its
# protocol and the models behind their forward and loss are entered (counted) but their
# insides are not (a call from rollout/ or models/ into rollout/ or models/ is skipped). And
# the top files by calls. Setup (config, build, warm start) is not traced; the step is
# step 1 (with the default's baselines: frozen draft and no speculation).
# The same script traces an older checkout (its own titan_spec on PYTHONPATH) for a
# before/after comparison.
#
# Usage: PYTHONPATH=. python bench/step_trace.py [--out bench/results/step_trace.json] [--config FILE]

import argparse
import json
import os
import socket
import sys
from collections import Counter
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="call trace of one RL step")
    p.add_argument("--config", default="train_configs/debug_cpu.toml")
    p.add_argument("--out", default="bench/results/step_trace.json")
    p.add_argument("--dump", default="/tmp/titan_spec_step_trace")
    args, overrides = p.parse_known_args(argv)
    os.environ.update(
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
    )
    import titan_spec  # noqa: F401
    from titan_spec.config import load_config

    try:
        from titan_spec.preflight import validate_run
    except ImportError:  # a checkout from before titan_spec/preflight/
        from titan_spec.train import validate_run
    pkg = os.path.dirname(os.path.abspath(titan_spec.__file__)) + os.sep
    cfg = load_config(
        args.config,
        [
            "--job.dump_folder",
            args.dump,
            "--training.steps",
            "1",
            "--checkpoint.enable",
            "false",
            "--rollout.progress",
            "false",
            *overrides,
        ],
        check_paths=False,
    )
    trainer = validate_run(cfg).build()
    trainer.step = 1  # what torchtitan's train() does before calling train_step

    below = ("rollout/", "models/")  # behind the engine protocol and the models' forward / loss
    levels = {name: {"calls": Counter(), "funcs": set(), "switches": 0, "pairs": Counter()} for name in ("all", "step")}

    def profile(frame, event, arg):
        if event != "call":
            return
        f = frame.f_code.co_filename
        if not f.startswith(pkg):
            return
        rel = f[len(pkg) :]
        caller = frame.f_back
        while caller is not None and not caller.f_code.co_filename.startswith(pkg):
            caller = caller.f_back  # through torchtitan / torch frames to the titan_spec caller
        crel = caller.f_code.co_filename[len(pkg) :] if caller is not None else None
        inside = crel is not None and crel.startswith(below) and rel.startswith(below)
        for name, lv in levels.items():
            if name == "step" and inside:
                continue
            lv["calls"][rel] += 1
            lv["funcs"].add((rel, frame.f_code.co_qualname))
            if crel is not None and crel != rel:
                lv["switches"] += 1
                lv["pairs"][f"{crel} -> {rel}"] += 1

    sys.setprofile(profile)
    try:
        trainer.train_step(iter(()))
    finally:
        sys.setprofile(None)
    trainer.close()
    result = {}
    print(f"{'level':>6} {'files':>6} {'functions':>10} {'switches':>9} {'calls':>7}")
    for name, lv in levels.items():
        r = result[name] = {
            "files": len(lv["calls"]),
            "functions": len(lv["funcs"]),
            "switches": lv["switches"],
            "calls": sum(lv["calls"].values()),
            "by_file": dict(lv["calls"].most_common()),
            "switch_pairs": dict(lv["pairs"].most_common()),
            "function_names": sorted(f"{f}:{q}" for f, q in lv["funcs"]),
        }
        print(f"{name:>6} {r['files']:>6} {r['functions']:>10} {r['switches']:>9} {r['calls']:>7}")
    for f, n in levels["step"]["calls"].most_common(12):
        print(f"  {n:>8}  {f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
