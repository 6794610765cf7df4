"""The end-of-run RL report: a summary table and PNG plots from the run's metrics.jsonl.

Written next to the TensorBoard logs (``<dump_folder>/plots``): reward over steps,
acceptance length of the co-trained vs the frozen draft, rollout tokens/s of the three
engines. A resumed run appends to metrics.jsonl; the last row of each step wins.
"""

from __future__ import annotations

import json
import os

__all__ = ["read_metrics", "summary_table", "write_report"]


def read_metrics(dump_folder: str) -> list[dict]:
    rows: dict[int, dict] = {}
    with open(os.path.join(dump_folder, "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            rows[row["step"]] = row
    return [rows[k] for k in sorted(rows)]


def _mean(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]  # null: a non-finite value (nonfinite)
    return sum(vals) / len(vals) if vals else None


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def summary_table(rows: list[dict], window: int = 10) -> str:
    """Start (first ``window`` steps) vs end (last ``window``) of the RL metrics."""
    rl = [r for r in rows if "rl/reward" in r]
    if not rl:
        return "(no RL steps logged)"
    head, tail = rl[:window], rl[-window:]
    base = [r for r in rl if "rollout/accept_len_frozen" in r or "rollout/tokens_per_s_nospec" in r]
    b_head, b_tail = base[:1], base[-1:]
    lines = [
        f"RL steps {rl[0]['step']}..{rl[-1]['step']} (start = first {len(head)}, end = last {len(tail)}; "
        f"baselines at the first and last measured step)",
        "| metric | start | end |",
        "| --- | --- | --- |",
        f"| reward | {_fmt(_mean(head, 'rl/reward'))} | {_fmt(_mean(tail, 'rl/reward'))} |",
        f"| acceptance length, co-trained draft (same prompts) | {_fmt(_mean(b_head, 'rollout/accept_len'))} "
        f"| {_fmt(_mean(b_tail, 'rollout/accept_len'))} |",
        f"| acceptance length, frozen draft | {_fmt(_mean(b_head, 'rollout/accept_len_frozen'))} "
        f"| {_fmt(_mean(b_tail, 'rollout/accept_len_frozen'))} |",
        "| acceptance length, no speculation | 1.000 | 1.000 |",
        f"| rollout tokens/s, co-trained | {_fmt(_mean(head, 'rollout/tokens_per_s'), '.0f')} "
        f"| {_fmt(_mean(tail, 'rollout/tokens_per_s'), '.0f')} |",
        f"| rollout tokens/s, frozen draft | {_fmt(_mean(b_head, 'rollout/tokens_per_s_frozen'), '.0f')} "
        f"| {_fmt(_mean(b_tail, 'rollout/tokens_per_s_frozen'), '.0f')} |",
        f"| rollout tokens/s, no speculation | {_fmt(_mean(b_head, 'rollout/tokens_per_s_nospec'), '.0f')} "
        f"| {_fmt(_mean(b_tail, 'rollout/tokens_per_s_nospec'), '.0f')} |",
    ]
    for key, name in (("time/push_s", "weight push"), ("time/rollout_s", "rollout"), ("time/train_s", "train"),
                      ("time/step_s", "step")):
        lines.append(f"| {name} s/step | {_fmt(_mean(head, key))} | {_fmt(_mean(tail, key))} |")
    return "\n".join(lines)


def _plot(path: str, title: str, ylabel: str, series: list[tuple[str, list[int], list[float]]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for label, xs, ys in series:
        if xs:
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, label=label)
    ax.set_title(title)
    ax.set_xlabel("RL step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def write_report(dump_folder: str) -> str:
    """Writes summary.md and plots/*.png under ``dump_folder``; returns the table."""
    rows = read_metrics(dump_folder)
    table = summary_table(rows)
    plots = os.path.join(dump_folder, "plots")
    os.makedirs(plots, exist_ok=True)
    base = [r for r in rows if "rollout/accept_len_frozen" in r or "rollout/tokens_per_s_nospec" in r]
    _plot(os.path.join(plots, "reward.png"), "Reward (exact match)", "mean reward",
          [("reward", *_series(rows, "rl/reward"))])
    _plot(os.path.join(plots, "acceptance.png"), "Acceptance length (tokens per verify step)", "tokens",
          [("co-trained draft", *_series(base, "rollout/accept_len")),
           ("frozen draft", *_series(base, "rollout/accept_len_frozen"))])
    _plot(os.path.join(plots, "rollout_tps.png"), "Rollout throughput", "tokens/s",
          [("co-trained draft", *_series(base, "rollout/tokens_per_s")),
           ("frozen draft", *_series(base, "rollout/tokens_per_s_frozen")),
           ("no speculation", *_series(base, "rollout/tokens_per_s_nospec"))])
    with open(os.path.join(dump_folder, "summary.md"), "w") as f:
        f.write(table + "\n")
    return table
