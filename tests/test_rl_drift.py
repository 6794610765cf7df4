"""The drift estimates (titan_spec/rl/drift.py) against a hand computation: k1 and k3 on the
completion tokens only, sums over minibatches (and repeated PPO epochs) keeping the mean, and
the p90 of the length histogram. The trainer-level check (0 before any update, equal to an
independent fp64 computation after one) is in tests/test_rl_e2e.py."""

import math

import torch

from titan_spec.rl.drift import DriftMeter, percentile_from_counts

IGNORE = -100


def test_k1_and_k3_on_completion_tokens_match_a_hand_computation():
    behaviour = torch.tensor([[-0.5, -1.0, -2.0, 0.0], [-0.1, -3.0, 0.0, 0.0]], dtype=torch.float64)
    start = torch.tensor([[-0.7, -0.4, -2.5, -9.0], [-0.1, -1.0, -9.0, -9.0]], dtype=torch.float64)
    labels = torch.tensor([[IGNORE, 5, 6, IGNORE], [7, 8, IGNORE, IGNORE]])  # 4 completion tokens
    meter = DriftMeter()
    meter.add(behaviour, start, labels)
    pairs = [(-1.0, -0.4), (-2.0, -2.5), (-0.1, -0.1), (-3.0, -1.0)]
    k1 = sum(b - s for b, s in pairs) / 4
    k3 = sum(math.exp(s - b) - (s - b) - 1 for b, s in pairs) / 4
    sums = meter.take()
    assert sums["drift_tokens"] == 4
    assert math.isclose(sums["drift_k1"] / 4, k1, rel_tol=1e-12)
    assert math.isclose(sums["drift_k3"] / 4, k3, rel_tol=1e-12)
    # take() resets; the same minibatch added twice (two PPO epochs) keeps the means.
    assert meter.take() == {"drift_k1": 0.0, "drift_k3": 0.0, "drift_tokens": 0.0}
    meter.add(behaviour, start, labels)
    meter.add(behaviour, start, labels)
    twice = meter.take()
    assert math.isclose(twice["drift_k1"] / twice["drift_tokens"], k1, rel_tol=1e-12)
    # Equal policies: exactly 0.
    meter.add(behaviour, behaviour.clone(), labels)
    same = meter.take()
    assert same["drift_k1"] == 0.0 and same["drift_k3"] == 0.0


def test_percentile_from_counts():
    counts = [0, 2, 0, 5, 3]  # values 1 (x2), 3 (x5), 4 (x3): 10 in all
    assert percentile_from_counts(counts, 0.2) == 1.0
    assert percentile_from_counts(counts, 0.7) == 3.0
    assert percentile_from_counts(counts, 0.9) == 4.0
    assert percentile_from_counts([0, 0], 0.9) == 0.0
