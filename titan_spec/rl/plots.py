"""The RL report's plots (rl/report.py writes them): PNGs a person reads at a glance.

``overview.png`` holds every panel; each panel is also its own file:
  reward.png       reward per step (points) and its smoothed line (EMA), per variant
  acceptance.png   acceptance length, co-trained vs frozen draft on the same prompts
  completion_len.png  completion length over steps (mean, p90, max)
  kl.png           KL(policy || starting policy) per token over steps (rl/drift.py)
  rollout_time.png rollout seconds per step: co-trained, frozen, no speculation
  draft_k.png      draft tokens proposed per verify round (adaptive K), when logged
  rollout_tps.png  rollout tokens/s of the three (not in the overview when draft_k is)
A panel whose metrics are absent says so instead of failing. Shape-free: rows are the
metrics.jsonl dicts.
"""

from __future__ import annotations

import os

__all__ = ["ema", "write_plots"]

COLORS = {"co-trained": "#1f77b4", "frozen": "#d62728", "no-spec": "#7f7f7f"}


def ema(values: list[float], span: int) -> list[float]:
    """Exponential moving average with alpha = 2 / (span + 1), debiased at the start (as
    TensorBoard's smoothing), so the line starts at the first point, not at 0."""
    alpha, out, m, w = 2.0 / (span + 1), [], 0.0, 0.0
    for v in values:
        m, w = (1 - alpha) * m + alpha * v, (1 - alpha) * w + alpha
        out.append(m / w)
    return out


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def _span(n: int) -> int:
    return max(3, n // 8)


def _empty(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} logged", ha="center", va="center", transform=ax.transAxes, color="0.4")


def _finish(ax, title: str, ylabel: str) -> None:
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("RL step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, frameon=False)


def _smoothed(ax, xs, ys, label, color, raw=True):
    if raw:
        ax.plot(xs, ys, "o", ms=2.5, alpha=0.3, color=color)
    ax.plot(xs, ema(ys, _span(len(ys))), "-", lw=2, color=color, label=label)


def panel_reward(ax, rows, runs):
    drawn = False
    for name, rs in (runs or {"co-trained": rows}).items():
        xs, ys = _series(rs, "rl/reward")
        if xs:
            _smoothed(ax, xs, ys, f"{name} (smoothed)", COLORS.get(name, None))
            drawn = True
    if not drawn:
        _empty(ax, "reward")
    top = max((v for rs in (runs or {"": rows}).values() for v in _series(rs, "rl/reward")[1]), default=1.0)
    ax.set_ylim(0, min(1.02, 1.2 * top + 0.05))
    _finish(ax, "Reward (exact match of the final answer)", "mean reward")


def panel_acceptance(ax, rows, runs):
    xs, ys = _series(rows, "rollout/accept_len")
    if xs:
        ax.plot(
            xs,
            ema(ys, _span(len(ys))),
            "-",
            lw=1,
            alpha=0.45,
            color=COLORS["co-trained"],
            label="co-trained, every step (smoothed)",
        )
    base = [r for r in rows if r.get("rollout/accept_len_frozen") is not None]
    for key, name in (("rollout/accept_len", "co-trained"), ("rollout/accept_len_frozen", "frozen")):
        bx, by = _series(base, key)
        if bx:
            ax.plot(bx, by, "o-", ms=4, lw=2, color=COLORS[name], label=f"{name} draft, same prompts (adaptive K)")
    # The drafts at equal depth (fixed K): their quality, apart from the depth policy's choice.
    for key, name in (("rollout/accept_len_fixed", "co-trained"), ("rollout/accept_len_frozen_fixed", "frozen")):
        bx, by = _series(base, key)
        if bx:
            ax.plot(bx, by, "s--", ms=4, lw=1.5, color=COLORS[name], label=f"{name} draft, same prompts, fixed K")
    if not xs and not base:
        _empty(ax, "acceptance length")
    _finish(ax, "Acceptance length (tokens per target forward)", "tokens")


def panel_length(ax, rows, runs):
    xs, mean = _series(rows, "rollout/completion_len")
    if xs:
        mx, mxv = _series(rows, "rollout/completion_len_max")
        px, p90 = _series(rows, "rollout/completion_len_p90")
        if mx:
            ax.plot(mx, mxv, "-", lw=0.8, color="0.65", label="max")
        if px:
            ax.plot(px, ema(p90, _span(len(p90))), "--", lw=1.5, color="#2ca02c", label="p90 (smoothed)")
        _smoothed(ax, xs, mean, "mean (smoothed)", "#2ca02c")
        ax.set_ylim(bottom=0)
    else:
        _empty(ax, "completion length")
    _finish(ax, "Completion length (tokens)", "tokens")


def panel_kl(ax, rows, runs):
    k1x, k1 = _series(rows, "drift/kl")
    kx, k3 = _series(rows, "drift/kl_k3")
    if k1x:
        _smoothed(ax, k1x, k1, "sampled log-ratio (smoothed)", "#c5b0d5")
    if kx:
        _smoothed(ax, kx, k3, "k3 (smoothed)", "#9467bd")
    if not (kx or k1x):
        _empty(ax, "drift (rl.drift_metrics off)")
    _finish(ax, "Drift: KL(policy || starting policy) per token", "nats / token")


def panel_rollout_time(ax, rows, runs):
    if runs:
        for name, rs in runs.items():
            xs, ys = _series(rs[1:], "time/rollout_s")
            if xs:
                _smoothed(ax, xs, ys, f"{name} run", COLORS.get(name))
    else:
        xs, ys = _series(rows[1:], "time/rollout_s")
        if xs:
            _smoothed(ax, xs, ys, "co-trained (every step)", COLORS["co-trained"])
        for key, name in (("time/rollout_s_frozen", "frozen"), ("time/rollout_s_nospec", "no-spec")):
            bx, by = _series(rows[1:], key)
            if bx:
                ax.plot(bx, by, "o-", ms=4, color=COLORS[name], label=f"{name} (same prompts)")
    if not ax.get_lines():
        _empty(ax, "rollout time")
    ax.set_ylim(bottom=0)
    _finish(ax, "Rollout seconds per step", "seconds")


def panel_tps(ax, rows, runs):
    base = [r for r in rows if "rollout/tokens_per_s_nospec" in r or "rollout/tokens_per_s_frozen" in r]
    for key, name in (
        ("rollout/tokens_per_s", "co-trained"),
        ("rollout/tokens_per_s_frozen", "frozen"),
        ("rollout/tokens_per_s_nospec", "no-spec"),
    ):
        xs, ys = _series(base, key)
        if xs:
            ax.plot(xs, ys, "o-", ms=4, color=COLORS[name], label=name)
    if not ax.get_lines():
        _empty(ax, "rollout throughput")
    ax.set_ylim(bottom=0)
    _finish(ax, "Rollout throughput (same prompts)", "tokens/s")


def panel_draft_k(ax, rows, runs):
    xs, ys = _series(rows, "rollout/draft_k")
    if xs:
        _smoothed(ax, xs, ys, "co-trained", COLORS["co-trained"])
        # The fastest fixed K on the same call (baseline steps; rl/step.py rollout/depth_regret).
        bx, by = _series(rows, "rollout/best_fixed_k")
        if bx:
            ax.plot(bx, by, "D", ms=5, color="0.3", label="best fixed K on the same prompts")
        ax.set_ylim(bottom=0)
    else:
        _empty(ax, "rollout/draft_k (fixed K)")
    _finish(ax, "Draft tokens per verify round (adaptive K)", "K")


PANELS = (
    ("reward", panel_reward),
    ("acceptance", panel_acceptance),
    ("completion_len", panel_length),
    ("kl", panel_kl),
    ("rollout_time", panel_rollout_time),
    ("draft_k", panel_draft_k),
    ("rollout_tps", panel_tps),
)
OVERVIEW = 6
"""Panels in overview.png: the first six present (rollout_tps only when draft_k is absent)."""


def write_plots(folder: str, rows: list[dict], runs: dict[str, list[dict]] | None = None) -> list[str]:
    """Writes the PNGs into ``folder``; returns their paths. ``runs``: whole runs by variant
    name (bench/rl_baselines.py), for the reward and rollout-time panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(folder, exist_ok=True)
    has_k = any(r.get("rollout/draft_k") is not None for r in rows)
    panels = [p for p in PANELS if p[0] != "draft_k" or has_k]
    paths = []
    for name, draw in panels:
        fig, ax = plt.subplots(figsize=(6.4, 3.8))
        draw(ax, rows, runs)
        fig.tight_layout()
        paths.append(os.path.join(folder, f"{name}.png"))
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    panels = panels[:OVERVIEW]
    cols = 3
    nrows = -(-len(panels) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(6.0 * cols, 3.8 * nrows), squeeze=False)
    for ax, (name, draw) in zip(axes.flat, panels):
        draw(ax, rows, runs)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.tight_layout()
    paths.append(os.path.join(folder, "overview.png"))
    fig.savefig(paths[-1], dpi=90)
    plt.close(fig)
    return paths
