"""The trainer end to end through torchrun: loss falls, FSDP parity, exact resume."""

import os

import pytest


def _losses(rows):
    return {r["step"]: r["loss"] for r in rows}


def test_fsdp_dp2_matches_dp1_and_resume_is_exact(tmp_path, train):
    # A fixed LR schedule length, so a run stopped at step 3 has the same LRs as a 6-step run.
    steps = ["--training.steps", "6", "--checkpoint.interval", "3", "--lr_scheduler.total_steps", "6"]
    one = _losses(train(str(tmp_path / "dp1"), 1, (*steps, "--training.local_batch_size", "4")))
    # dp=2 with 2 rows each sees the same 4-row global batch as dp=1 with 4 rows.
    two = _losses(train(str(tmp_path / "dp2"), 2, (*steps, "--training.local_batch_size", "2",
                                                   "--parallelism.data_parallel_shard_degree", "2")))
    assert sorted(one) == list(range(1, 7))
    assert one[6] < one[1], "loss did not fall"
    for step in one:
        assert two[step] == pytest.approx(one[step], abs=1e-5, rel=1e-5), (step, one, two)

    # Interrupt after step 3 (a checkpoint), then resume to step 6 in the same folder.
    dump = str(tmp_path / "resume")
    first = _losses(train(dump, 1, ("--training.steps", "3", "--checkpoint.interval", "3", "--lr_scheduler.total_steps", "6")))
    assert os.path.isdir(os.path.join(dump, "checkpoint", "step-3"))
    resumed = _losses(train(dump, 1, steps))
    assert sorted(first) == [1, 2, 3]
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6]  # metrics.jsonl appended by both runs
    for step in (4, 5, 6):
        assert resumed[step] == pytest.approx(one[step], abs=1e-6, rel=1e-6), (step, one, resumed)
