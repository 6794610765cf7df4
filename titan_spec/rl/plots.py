"""The RL report's plots (rl/report.py writes them): PNGs a person reads at a glance.

``overview.png`` holds every panel; each panel is also its own file:
  reward.png       reward per step (points) and its smoothed line (EMA), per variant
  acceptance.png   acceptance length, co-trained vs frozen draft on the same prompts
  drift.png        completion length (mean, p90, max) and KL(policy || start) over steps
  rollout_time.png rollout seconds per step: co-trained, frozen, no speculation
  rollout_tps.png  rollout tokens/s of the three
  draft_k.png      draft tokens proposed per verify round (adaptive K), when logged
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
    ax.set_ylim(-0.02, 1.02)
    _finish(ax, "Reward (exact match of the final answer)", "mean reward")


def panel_acceptance(ax, rows, runs):
    xs, ys = _series(rows, "rollout/accept_len")
    if xs:
        ax.plot(xs, ema(ys, _span(len(ys))), "-", lw=1, alpha=0.45, color=COLORS["co-trained"],
                label="co-trained, every step (smoothed)")
    base = [r for r in rows if r.get("rollout/accept_len_frozen") is not None]
    for key, name in (("rollout/accept_len", "co-trained"), ("rollout/accept_len_frozen", "frozen")):
        bx, by = _series(base, key)
        if bx:
            ax.plot(bx, by, "o-", ms=4, lw=2, color=COLORS[name], label=f"{name} draft, same prompts")
    if not xs and not base:
        _empty(ax, "acceptance length")
    _finish(ax, "Acceptance length (tokens per target forward)", "tokens")


def panel_drift(ax, rows, runs):
    xs, mean = _series(rows, "rollout/completion_len")
    if not xs:
        _empty(ax, "completion length")
        _finish(ax, "Completion length", "tokens")
        return
    px, p90 = _series(rows, "rollout/completion_len_p90")
    mx, mxv = _series(rows, "rollout/completion_len_max")
    if mx:
        ax.plot(mx, mxv, "-", lw=0.8, color="0.6", label="max")
    if px:
        ax.plot(px, ema(p90, _span(len(p90))), "--", lw=1.5, color="#2ca02c", label="p90 (smoothed)")
    _smoothed(ax, xs, mean, "mean (smoothed)", "#2ca02c")
    _finish(ax, "Completion length and drift from the start", "tokens")
    kx, kl = _series(rows, "drift/kl_k3")
    k1x, k1 = _series(rows, "drift/kl")
    if kx or k1x:
        ax2 = ax.twinx()
        if k1x:
            ax2.plot(k1x, ema(k1, _span(len(k1))), "-", lw=1.5, color="#9467bd", alpha=0.6, label="KL, log-ratio")
        if kx:
            ax2.plot(kx, ema(kl, _span(len(kl))), "-", lw=2, color="#9467bd", label="KL, k3")
        ax2.set_ylabel("KL(policy || start) per token", color="#9467bd")
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = ax2.get_legend_handles_labels()
        ax.legend(h1 + h2, l1 + l2, fontsize=8, frameon=False, loc="upper left")


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
    for key, name in (("rollout/tokens_per_s", "co-trained"), ("rollout/tokens_per_s_frozen", "frozen"),
                      ("rollout/tokens_per_s_nospec", "no-spec")):
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
        ax.set_ylim(bottom=0)
    else:
        _empty(ax, "rollout/draft_k (fixed K)")
    _finish(ax, "Draft tokens per verify round (adaptive K)", "K")


PANELS = (("reward", panel_reward), ("acceptance", panel_acceptance), ("drift", panel_drift),
          ("rollout_time", panel_rollout_time), ("rollout_tps", panel_tps), ("draft_k", panel_draft_k))


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
    cols = 3
    nrows = -(-len(panels) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(6.0 * cols, 3.8 * nrows), squeeze=False)
    for ax, (name, draw) in zip(axes.flat, panels):
        draw(ax, rows, runs)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    paths.append(os.path.join(folder, "overview.png"))
    fig.savefig(paths[-1], dpi=90)
    plt.close(fig)
    return paths
