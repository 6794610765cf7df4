"""The end-of-run RL report (titan_spec/rl/report.py, rl/plots.py) from synthetic
metrics.jsonl rows: the tables carry the numbers of the rows (start/end means, the
variants side by side with their ratios to no speculation), every plot is written, with
and without the adaptive engine's rollout/draft_k, and a missing baseline or metric prints
"-" instead of failing."""

import json
import math
import os

import pytest

from titan_spec.rl.plots import ema
from titan_spec.rl.report import inrun_variants, variant_summary, variants_table, write_report


def synthetic_rows(steps=30, draft_k=False, baselines=True, rollout_s=1.0):
    rows = []
    for s in range(1, steps + 1):
        r = {
            "step": s,
            "rl/reward": 0.2 + 0.5 * s / steps,
            "rollout/accept_len": 3.0,
            "rollout/completion_len": 30.0 + s,
            "rollout/completion_len_p90": 60.0 + s,
            "rollout/completion_len_max": 100.0,
            "drift/kl": 0.01 * (s - 1),
            "drift/kl_k3": 0.008 * (s - 1),
            "time/push_s": 0.1,
            "time/rollout_s": rollout_s,
            "time/train_s": 2.0,
            "time/step_s": 2.1 + rollout_s,
            "rollout/tokens_per_s": 1000.0,
        }
        if draft_k:
            r["rollout/draft_k"] = 4.0 - 3.0 * s / steps
        if baselines and (s == 1 or s % 10 == 0):
            r.update(
                {
                    "rollout/accept_len_frozen": 3.0 - s / steps,
                    "time/rollout_s_frozen": 1.5,
                    "rollout/tokens_per_s_frozen": 700.0,
                    "time/rollout_s_nospec": 2.0,
                    "rollout/tokens_per_s_nospec": 500.0,
                }
            )
        rows.append(r)
    return rows


def _write(folder, rows):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


@pytest.mark.parametrize("draft_k", [False, True])
def test_report_tables_and_plots(tmp_path, draft_k):
    _write(tmp_path, synthetic_rows(draft_k=draft_k))
    text = write_report(str(tmp_path))
    lines = text.splitlines()
    # start = mean of steps 1..10, end = mean of 21..30, computed here by hand.
    reward = next(line for line in lines if line.startswith("| reward |"))
    assert reward == f"| reward | {0.2 + 0.5 * 5.5 / 30:.3f} | {0.2 + 0.5 * 25.5 / 30:.3f} |"
    kl = next(line for line in lines if line.startswith("| KL(policy || start) per token, k3"))
    assert kl.endswith(f"| {0.008 * 4.5:.4f} | {0.008 * 24.5:.4f} |")
    assert any(line.startswith("| draft tokens per round") for line in lines) == draft_k
    # The in-run variants side by side: rollout seconds (medians over baseline steps 10..30) and ratios.
    assert "| rollout s/step | 1.000 | 1.500 | 2.000 |" in lines
    assert "| rollout vs no-spec | 0.50x | 0.75x | 1.00x |" in lines
    assert "| acceptance length, start -> end | 3.00 -> 3.00 | 2.97 -> 2.00 | 1.00 -> 1.00 |" in lines
    names = {"reward", "acceptance", "completion_len", "kl", "rollout_time", "rollout_tps", "overview"} | (
        {"draft_k"} if draft_k else set()
    )
    assert {n[:-4] for n in os.listdir(tmp_path / "plots")} == names
    for n in names:
        assert os.path.getsize(tmp_path / "plots" / f"{n}.png") > 5000


def test_inrun_rollout_ratio_is_the_median_of_per_step_ratios():
    # Baseline steps 10, 20, 30 (step 1 is left out as warm-up): co-trained / no-spec seconds
    # (1, 4), (2, 2), (6, 3): per-step ratios 0.25, 1, 2 -> median 1.00x; the ratio of the
    # medians (2 / 3 = 0.67x) would mix steps whose load differed.
    rows = synthetic_rows()
    for step, (co, ns) in {10: (1.0, 4.0), 20: (2.0, 2.0), 30: (6.0, 3.0)}.items():
        rows[step - 1]["time/rollout_s"], rows[step - 1]["time/rollout_s_nospec"] = co, ns
        rows[step - 1]["time/rollout_s_frozen"] = 2 * ns
    text = variants_table(inrun_variants(rows), "t")
    assert "| rollout s/step | 2.000 | 6.000 | 3.000 |" in text
    assert "| rollout vs no-spec | 1.00x | 2.00x | 1.00x |" in text


def test_report_without_baselines_or_drift(tmp_path):
    rows = synthetic_rows(baselines=False)
    for r in rows:
        del r["drift/kl"], r["drift/kl_k3"]
    _write(tmp_path, rows)
    text = write_report(str(tmp_path))
    assert "| KL(policy || start) per token, k3 | - | - |" in text
    assert "| acceptance length, frozen draft (same prompts) | - | - |" in text
    assert "| rollout vs no-spec | - |" in text  # no no-spec column to divide by
    assert os.path.getsize(tmp_path / "plots" / "acceptance.png") > 5000


def test_whole_runs_side_by_side_with_a_missing_variant(tmp_path):
    co, nospec = synthetic_rows(rollout_s=1.0), synthetic_rows(rollout_s=4.0)
    _write(tmp_path, co)
    text = write_report(str(tmp_path), runs={"co-trained": co, "no-spec": nospec}, plots=False)
    whole = text.split("Whole runs")[1].splitlines()
    assert "| | co-trained | no-spec |" in whole
    r0, r1 = f"{0.2 + 0.5 * 5.5 / 30:.3f}", f"{0.2 + 0.5 * 25.5 / 30:.3f}"  # means of steps 1-10, 21-30
    assert f"| reward, start -> end | {r0} -> {r1} | {r0} -> {r1} |" in whole
    assert "| rollout vs no-spec | 0.25x | 1.00x |" in whole
    assert f"| step vs no-spec | {3.1 / 6.1:.2f}x | 1.00x |" in whole
    assert variants_table({"frozen": variant_summary(co)}, "t").splitlines()[-1] == "| step vs no-spec | - |"
    assert set(inrun_variants(synthetic_rows(baselines=False))) == {"co-trained"}


def test_ema_matches_a_hand_computation():
    # alpha = 2 / (3 + 1) = 0.5; debiased: m_t / (1 - 0.5^t).
    got = ema([1.0, 3.0, 2.0], span=3)
    want = [1.0, (0.25 * 1 + 0.5 * 3) / 0.75, (0.125 * 1 + 0.25 * 3 + 0.5 * 2) / 0.875]
    assert all(math.isclose(a, b) for a, b in zip(got, want))


def test_the_headline_compares_the_drafts_at_fixed_depth_and_shows_the_adaptive_ratio_beside_it(tmp_path):
    """issue 30: with the fixed-K baselines in the rows, the summary carries both drafts'
    acceptance at fixed K (start = first baseline step, end = last) and a headline ratio
    from the last baseline step, the adaptive one beside it; without them, neither."""
    rows = synthetic_rows()
    for r in rows:
        if "rollout/accept_len_frozen" in r:
            r.update(
                {
                    "rollout/accept_len_fixed": 3.0 + r["step"] / 30,
                    "rollout/accept_len_frozen_fixed": 2.5,
                    "rollout/fixed_k": 4,
                }
            )
    _write(tmp_path, rows)
    lines = write_report(str(tmp_path), plots=False).splitlines()
    assert "| acceptance at fixed K = 4, co-trained draft (same prompts) | 3.033 | 4.000 |" in lines
    assert "| acceptance at fixed K = 4, frozen draft (same prompts) | 2.500 | 2.500 |" in lines
    # Last baseline step (30): fixed 4.0 / 2.5 = 1.60x; adaptive 3.0 / (3.0 - 1.0) = 1.50x.
    head = next(line for line in lines if line.startswith("At the last baseline step"))
    assert "accepts 1.60x the frozen draft's tokens per verify at fixed K = 4" in head and "choice 1.50x" in head
    _write(tmp_path / "old", synthetic_rows())
    text = write_report(str(tmp_path / "old"), plots=False)
    assert "at fixed K" not in text and "At the last baseline step" not in text


def test_regret_of_adaptive_depth_and_start_end_windows_that_do_not_overlap(tmp_path):
    """issue 30 item 3: the regret of adaptive depth against the best fixed K of each baseline
    call is a row (first / last baseline step) and a line over the baseline steps after the
    first (whose adaptive call pays the cost calibration). Issue 31: start and end windows
    never overlap on a short run, and the seconds rows leave out step 1's warm-up."""
    rows = synthetic_rows()
    for step, (regret, best) in {1: (0.5, 4), 10: (0.02, 4), 20: (-0.01, 3), 30: (0.04, 3)}.items():
        rows[step - 1].update(
            {"rollout/depth_regret": regret, "rollout/best_fixed_k": best, "rollout/depth_regret_wall": 2 * regret}
        )
    rows[0]["time/rollout_s"] = 50.0  # step 1: warm-up
    _write(tmp_path, rows)
    lines = write_report(str(tmp_path), plots=False).splitlines()
    assert "| adaptive depth's regret vs the best fixed K (same prompts) | +0.500 | +0.040 |" in lines
    line = next(ln for ln in lines if ln.startswith("Adaptive depth vs the best fixed K"))
    assert (
        "3 baseline steps after the first, rounds priced by the engine's round-cost table: regret median "
        "+0.020, worst +0.040"
        in line
        and "[4, 3, 3]" in line
        and "by wall seconds" in line
    )
    assert line.endswith("median +0.040.")
    assert "| rollout s/step | 1.000 | 1.000 |" in lines  # steps 2..11 and 21..30: not the 50 s of step 1
    short = synthetic_rows(steps=6, baselines=False)
    _write(tmp_path / "short", short)
    lines = write_report(str(tmp_path / "short"), plots=False).splitlines()
    assert lines[0].startswith("RL steps 1..6 (start = first 3, end = last 3;")
    reward = next(line for line in lines if line.startswith("| reward |"))
    assert reward == f"| reward | {0.2 + 0.5 * 2 / 6:.3f} | {0.2 + 0.5 * 5 / 6:.3f} |"  # steps 1-3 and 4-6
    assert not any("regret" in ln for ln in lines)


def test_async_rows_show_the_wait_and_the_lag_and_only_for_an_async_run(tmp_path):
    rows = synthetic_rows(baselines=False)
    _write(tmp_path / "sync", rows)
    assert "async" not in write_report(str(tmp_path / "sync"), plots=False)
    for r in rows:  # rl.async_steps = 1: the first step waits for its own batch, later ones ~not
        r["time/rollout_wait_s"] = 1.1 if r["step"] == 1 else 0.2 + 0.01 * r["step"]
        r["rl/policy_lag"] = 0.0 if r["step"] == 1 else 1.0
    _write(tmp_path / "async", rows)
    text = write_report(str(tmp_path / "async"), plots=False)
    start = sum(0.2 + 0.01 * s for s in range(2, 12)) / 10  # steps 2..11: step 1 pays warm-up
    end = sum(0.2 + 0.01 * s for s in range(21, 31)) / 10
    assert f"| wait for the batch s/step (async; push and rollout overlapped) | {start:.3f} | {end:.3f} |" in text
    assert "| policy lag, steps (async) | 0.9 | 1.0 |" in text  # steps 1-10: one at lag 0
