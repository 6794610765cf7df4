"""The end-of-run RL report: summary tables and PNG plots from the run's metrics.jsonl.

Written next to the TensorBoard logs: ``<dump_folder>/summary.md`` and
``<dump_folder>/plots/*.png`` (rl/plots.py draws them). Two tables:

- start vs end of the run: reward, acceptance length (under the engine's depth choice, and
  each draft at fixed K: the drafts' quality at equal depth), completion length and its
  tail, the drift from the starting policy (rl/drift.py), the time split (with
  rl.async_steps: the wait for the batch and the policy lag); and the headline:
  co-trained / frozen acceptance at fixed K at the end, the adaptive-depth ratio beside it;
- the three rollout variants side by side (co-trained draft / frozen draft / no
  speculation): reward, acceptance length, rollout and step seconds, each with its ratio to
  no speculation. From one run these are the in-run baselines (the step's prompts again
  through the frozen pre-RL draft and without speculation, at rl.baseline_interval steps:
  acceptance and rollout time only, the other cells "-"); bench/rl_baselines.py passes
  three whole runs (``runs``) and every cell is filled.

A missing metric or variant prints "-" rather than failing (tests/test_rl_report.py).
A resumed run appends to metrics.jsonl; the last row of each step wins.
"""

from __future__ import annotations

import json
import os
import statistics

from titan_spec.rl.plots import write_plots

__all__ = ["read_metrics", "summary_table", "variant_summary", "variants_table", "inrun_variants", "write_report"]

VARIANTS = ("co-trained", "frozen", "no-spec")


def read_metrics(dump_folder: str) -> list[dict]:
    rows: dict[int, dict] = {}
    with open(os.path.join(dump_folder, "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            rows[row["step"]] = row
    return [rows[k] for k in sorted(rows)]


def _vals(rows: list[dict], key: str) -> list[float]:
    return [r[key] for r in rows if r.get(key) is not None]  # null: a non-finite value


def _mean(rows: list[dict], key: str) -> float | None:
    vals = _vals(rows, key)
    return sum(vals) / len(vals) if vals else None


def _median(rows: list[dict], key: str) -> float | None:
    vals = _vals(rows, key)
    return statistics.median(vals) if vals else None


def _fmt(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def _baseline_rows(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "rollout/accept_len_frozen" in r or "rollout/tokens_per_s_nospec" in r]


def summary_table(rows: list[dict], window: int = 10) -> str:
    """Start (first ``window`` steps) vs end (last ``window``) of the RL metrics."""
    rl = [r for r in rows if "rl/reward" in r]
    if not rl:
        return "(no RL steps logged)"
    # The start and end windows never overlap (a short run splits in halves), and the
    # seconds rows leave out step 1, which pays one-off warm-up (adaptive depth's cost
    # calibration, first allocations): "start" seconds are steps 2..window+1.
    window = max(1, min(window, len(rl) // 2))
    head, tail = rl[:window], rl[-window:]
    warm = rl[1 : window + 1] or head
    base = _baseline_rows(rl)
    b_head, b_tail = base[:1], base[-1:]
    k_fixed = next((int(r["rollout/fixed_k"]) for r in base if r.get("rollout/fixed_k") is not None), "K")

    def row(name, key, src=(head, tail), fmt=".3f"):
        return f"| {name} | {_fmt(_mean(src[0], key), fmt)} | {_fmt(_mean(src[1], key), fmt)} |"

    lines = [
        f"RL steps {rl[0]['step']}..{rl[-1]['step']} (start = first {len(head)}, end = last {len(tail)}; "
        f"acceptance on the same prompts at the first and last baseline step; seconds from step 2)",
        "| metric | start | end |",
        "| --- | --- | --- |",
        row("reward", "rl/reward"),
        row("acceptance length, co-trained draft (same prompts)", "rollout/accept_len", (b_head, b_tail)),
        row("acceptance length, frozen draft (same prompts)", "rollout/accept_len_frozen", (b_head, b_tail)),
        row(
            f"acceptance at fixed K = {k_fixed}, co-trained draft (same prompts)",
            "rollout/accept_len_fixed",
            (b_head, b_tail),
        ),
        row(
            f"acceptance at fixed K = {k_fixed}, frozen draft (same prompts)",
            "rollout/accept_len_frozen_fixed",
            (b_head, b_tail),
        ),
        row("acceptance length, co-trained draft (every step)", "rollout/accept_len"),
        row("completion length, mean tokens", "rollout/completion_len", fmt=".1f"),
        row("completion length, p90 tokens", "rollout/completion_len_p90", fmt=".1f"),
        row("completion length, max tokens", "rollout/completion_len_max", fmt=".0f"),
        row("KL(policy || start) per token, sampled log-ratio", "drift/kl", fmt=".4f"),
        row("KL(policy || start) per token, k3", "drift/kl_k3", fmt=".4f"),
    ]
    if any(r.get("rollout/draft_k") is not None for r in rl):  # absent without speculation
        lines.append(row("draft tokens per round (adaptive K)", "rollout/draft_k", fmt=".2f"))
    if any(r.get("rollout/depth_regret") is not None for r in base):  # absent at fixed depth
        lines.append(
            row(
                "adaptive depth's regret vs the best fixed K (same prompts)",
                "rollout/depth_regret",
                (b_head, b_tail),
                fmt="+.3f",
            )
        )
    if not any(r.get("rollout/accept_len_fixed") is not None for r in base):  # older runs, co_train off
        lines = [ln for ln in lines if "at fixed K" not in ln]
    for key, name in (
        ("time/push_s", "weight push"),
        ("time/rollout_s", "rollout"),
        ("time/train_s", "train"),
        ("time/step_s", "step"),
    ):
        lines.append(row(f"{name} s/step", key, (warm, tail)))
    if any(r.get("time/rollout_wait_s") is not None for r in rl):
        # rl.async_steps: push and rollout ran beside earlier steps' training; a step paid
        # only its wait for them (bench/rl_async.py sets this against a synchronous run).
        lines.append(
            row("wait for the batch s/step (async; push and rollout overlapped)", "time/rollout_wait_s", (warm, tail))
        )
        lines.append(row("policy lag, steps (async)", "rl/policy_lag", fmt=".1f"))
    headline = _headline(b_tail[0] if b_tail else {}, k_fixed)
    regret = _regret_line(base)
    return "\n".join(lines + [x for x in (headline, regret) if x])


def _regret_line(base: list[dict]) -> str:
    """Adaptive depth against the best fixed K of each baseline call (rl/step.py
    rollout/depth_regret), over the baseline steps after the first (whose adaptive call
    pays the cost calibration)."""
    rows = [r for r in base[1:] if r.get("rollout/depth_regret") is not None]
    if not rows:
        return ""
    regrets = [r["rollout/depth_regret"] for r in rows]
    best = [int(r["rollout/best_fixed_k"]) for r in rows]
    wall = _median(rows, "rollout/depth_regret_wall")
    return (
        f"Adaptive depth vs the best fixed K of the same call, {len(rows)} baseline steps after the first, "
        f"rounds priced by the engine's round-cost table: regret median {statistics.median(regrets):+.3f}, "
        f"worst {max(regrets):+.3f} (positive = the best single K was that much faster); best fixed K per "
        f"step: {best}; by wall seconds (noisy: the best of K_max + 1 calls) median {_fmt(wall, '+.3f')}."
    )


def _headline(last: dict, k) -> str:
    """Co-trained vs frozen at the last baseline step: at fixed K (the drafts) and under the
    engine's depth choice (what the engine achieved), each as a ratio."""

    def ratio(a, b):
        x, y = last.get(a), last.get(b)
        return f"{x / y:.2f}x" if x is not None and y else None

    fixed = ratio("rollout/accept_len_fixed", "rollout/accept_len_frozen_fixed")
    if fixed is None:
        return ""
    adaptive = ratio("rollout/accept_len", "rollout/accept_len_frozen")
    return (
        f"\nAt the last baseline step the co-trained draft accepts {fixed} the frozen draft's tokens per "
        f"verify at fixed K = {k} (the drafts' quality at equal depth); under the engine's own depth choice "
        f"{adaptive or '-'} (what the engine achieved: a draft it keeps at K = 0 counts 1.00)."
    )


def variant_summary(rows: list[dict], window: int = 10) -> dict:
    """One variant's numbers from a whole run's rows (median seconds over steps 2.., step 1
    paying one-off warm-up): reward start/end (means of the first/last ``window`` steps),
    acceptance start/end, rollout and step seconds."""
    rl = [r for r in rows if "rl/reward" in r]
    body = rl[1:] or rl
    return {
        "reward_start": _mean(rl[:window], "rl/reward"),
        "reward_end": _mean(rl[-window:], "rl/reward"),
        "accept_start": _mean(rl[:window], "rollout/accept_len"),
        "accept_end": _mean(rl[-window:], "rollout/accept_len"),
        "rollout_s": _median(body, "time/rollout_s"),
        "step_s": _median(body, "time/step_s"),
        "train_s": _median(body, "time/train_s"),
        "push_s": _median(body, "time/push_s"),
        "completion_len_end": _mean(rl[-window:], "rollout/completion_len"),
    }


def inrun_variants(rows: list[dict]) -> dict[str, dict]:
    """The three variants from ONE run's in-run baselines (same prompts, same seed, back to
    back, at the baseline steps): acceptance and rollout seconds, and the rollout ratio to no
    speculation as the median over those steps of the ratio within each step (load that
    comes and goes between steps cancels in it); no reward or step time (the baselines do
    not train)."""
    base = _baseline_rows(rows)
    if not base:
        return {"co-trained": variant_summary(rows)}
    b1, b2 = base[:1], base[-1:]
    med = base[1:] or base

    def v(accept, rollout_s):
        per_step = [
            r[rollout_s] / r["time/rollout_s_nospec"]
            for r in med
            if r.get(rollout_s) is not None and r.get("time/rollout_s_nospec")
        ]
        return {
            "accept_start": _mean(b1, accept) if accept else 1.0,
            "accept_end": _mean(b2, accept) if accept else 1.0,
            "rollout_s": _median(med, rollout_s),
            "rollout_vs_nospec": statistics.median(per_step) if per_step else None,
        }

    co = {**variant_summary(rows), **v("rollout/accept_len", "time/rollout_s")}
    out = {"co-trained": co}
    if any("rollout/accept_len_frozen" in r for r in base):
        out["frozen"] = v("rollout/accept_len_frozen", "time/rollout_s_frozen")
    if any("time/rollout_s_nospec" in r for r in base):
        out["no-spec"] = v(None, "time/rollout_s_nospec")
    return out


def variants_table(variants: dict[str, dict], title: str) -> str:
    """Side by side: one column per variant (missing variants and cells print "-"), ratios to
    no speculation where it was measured."""
    names = [n for n in VARIANTS if n in variants] + [n for n in variants if n not in VARIANTS]
    nospec = variants.get("no-spec", {})

    def ratio(v, key):
        if key == "rollout_s" and v.get("rollout_vs_nospec") is not None:  # step by step (inrun_variants)
            return f"{v['rollout_vs_nospec']:.2f}x"
        a, b = v.get(key), nospec.get(key)
        return f"{a / b:.2f}x" if a is not None and b else "-"

    cells = [
        ("reward, start -> end", lambda v: f"{_fmt(v.get('reward_start'))} -> {_fmt(v.get('reward_end'))}"),
        (
            "acceptance length, start -> end",
            lambda v: f"{_fmt(v.get('accept_start'), '.2f')} -> {_fmt(v.get('accept_end'), '.2f')}",
        ),
        ("rollout s/step", lambda v: _fmt(v.get("rollout_s"))),
        ("rollout vs no-spec", lambda v: ratio(v, "rollout_s")),
        ("step s", lambda v: _fmt(v.get("step_s"))),
        ("step vs no-spec", lambda v: ratio(v, "step_s")),
    ]
    lines = [title, "| | " + " | ".join(names) + " |", "| --- |" + " --- |" * len(names)]
    for label, f in cells:
        lines.append(f"| {label} | " + " | ".join(f(variants[n]) for n in names) + " |")
    return "\n".join(lines)


def write_report(dump_folder: str, runs: dict[str, list[dict]] | None = None, plots: bool = True) -> str:
    """Writes summary.md and (``plots``) plots/*.png under ``dump_folder``; returns the summary
    text. ``runs``: whole runs of the variants by name (bench/rl_baselines.py), in addition to
    the run in ``dump_folder`` (whose in-run baselines are used without them)."""
    rows = read_metrics(dump_folder)
    parts = [summary_table(rows)]
    parts.append(
        variants_table(
            inrun_variants(rows), "In-run baselines on the same prompts (no reward / step time: they do not train)"
        )
    )
    if runs:
        parts.append(
            variants_table(
                {n: variant_summary(r) for n, r in runs.items()},
                "Whole runs, same seeds (bench/rl_baselines.py): seconds are medians over steps 2..",
            )
        )
    text = "\n\n".join(parts)
    if plots:
        write_plots(os.path.join(dump_folder, "plots"), rows, runs)
    with open(os.path.join(dump_folder, "summary.md"), "w") as f:
        f.write(text + "\n")
    return text
