# Benchmark report: draft kinds side by side, from RL runs that differ only in the draft.
#
# Each run's own report (rl/report.py, <dump>/summary.md) compares its co-trained draft with its
# frozen starting draft and with plain decoding on the same prompts at every baseline step
# (rl.baseline_interval). This puts several such runs next to each other, baseline step by
# baseline step: the default chain with EAGLE-3 and with DFlash (train_configs/debug_cpu.toml vs
# debug_cpu_dflash.toml: the same SFT policy, task, task seed and steps), so the kinds compare
# co-trained and frozen, at fixed K (the drafts' quality at equal depth) and under adaptive depth
# (what the engine achieved), with tokens/s against plain decoding in the same step.
#
# Usage: PYTHONPATH=. python bench/draft_kinds.py eagle3=outputs/debug_cpu/rl_eagle3 \
#            dflash=outputs/debug_cpu/rl_dflash [--out bench/results/draft_kinds.json]

import argparse
import json
import os
import sys

COLUMNS = (
    ("rollout/accept_len_fixed", "fixed K co-trained"),
    ("rollout/accept_len_frozen_fixed", "fixed K frozen"),
    ("rollout/accept_len", "adaptive co-trained"),
    ("rollout/accept_len_frozen", "adaptive frozen"),
)


def baseline_rows(dump: str) -> dict[int, dict]:
    """{step: metrics row} of the run's baseline steps (the rows that carry the frozen draft's)."""
    path = os.path.join(dump, "metrics.jsonl")
    if not os.path.isfile(path):
        raise SystemExit(f"{dump}: no metrics.jsonl (an RL run's dump folder?)")
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    return {r["step"]: r for r in rows if "rollout/accept_len_frozen_fixed" in r}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="draft kinds side by side, from RL runs' baseline steps")
    p.add_argument("runs", nargs="+", help="NAME=DUMP_FOLDER of an RL run")
    p.add_argument("--out", default="bench/results/draft_kinds.json")
    args = p.parse_args(argv)
    runs = dict(r.split("=", 1) for r in args.runs)
    table = {name: baseline_rows(dump) for name, dump in runs.items()}
    steps = sorted(set.intersection(*(set(t) for t in table.values())))
    if not steps:
        raise SystemExit("the runs share no baseline step")
    result = {"runs": runs, "steps": steps, "rows": []}
    head = (
        "| step | "
        + " | ".join(f"{n}: {c}" for n in runs for _, c in COLUMNS)
        + " | "
        + " | ".join(f"{n}: co-trained tok/s vs plain" for n in runs)
        + " |"
    )
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for s in steps:
        row = {"step": s}
        cells = []
        for n in runs:
            r = table[n][s]
            row[n] = {key: r[key] for key, _ in COLUMNS}
            row[n]["tok_s_vs_plain"] = r["rollout/tokens_per_s"] / r["rollout/tokens_per_s_nospec"]
            cells += [f"{r[key]:.2f}" for key, _ in COLUMNS]
        result["rows"].append(row)
        print(
            f"| {s} | "
            + " | ".join(cells)
            + " | "
            + " | ".join(f"{row[n]['tok_s_vs_plain']:.2f}x" for n in runs)
            + " |"
        )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
