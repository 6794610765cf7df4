"""Co-training under context and tensor parallelism through the real entry point (torchrun,
gloo): two steps of policy + draft with cp = 2 (and dp x cp), dp x tp and cp x tp, and offline
draft training under dp x tp, give the losses and gradients of one process."""

import json
import os

import pytest
from safetensors.torch import load_file

from conftest import train_many
from numerics import assert_same_draft_accuracy, assert_same_draft_export

DRAFT_LR, STEPS = 3e-3, 2  # [draft] lr default; training.steps in COMMON
COMMON = (
    "--training.steps",
    "2",
    "--lr_scheduler.total_steps",
    "2",
    "--checkpoint.enable",
    "false",
    "--draft.enable",
    "true",
    "--draft.draft_vocab_size",
    "24",
    "--draft.eagle3.ttt_steps",
    "3",
)


def _assert_same_run(a_rows, b_rows, what, same_dp=True):
    assert [r["step"] for r in a_rows] == [r["step"] for r in b_rows] == [1, 2], what
    for a, b in zip(a_rows, b_rows):
        # Step k's losses depend on the updates of steps < k, so equal later losses also mean
        # equal gradients; grad norms check the gradients of the step itself.
        # tolerance: fp32 rounding of sums in another order. Step 2 follows an AdamW step, whose
        # sign flips (tests/numerics.py) move only weights with a ~0 gradient: the loss moves by
        # their second-order term only, far inside rel 1e-4 (the weights: _assert_same_export).
        for key in ("loss", "draft/loss", "grad_norm", "draft/grad_norm"):
            assert b[key] == pytest.approx(a[key], abs=1e-5, rel=1e-4), (what, key, a, b)
        assert b["n_tokens_seen"] == a["n_tokens_seen"], (what, a, b)  # document padding is not counted
        # max_loss: the largest mean loss of one data-parallel rank's batch, its CP shards pooled
        # (torchtitan alone divides each shard's loss sum by the whole batch's token count).
        if same_dp:
            assert b["max_loss"] == pytest.approx(a["max_loss"], abs=1e-5, rel=1e-4), (what, a, b)
        else:
            assert b["max_loss"] >= b["loss"] - 1e-6, (what, b)
        assert_same_draft_accuracy(a, b, 3, what)  # the ring reduces in another order: one argmax flip


def _assert_same_export(a_dir, b_dir, what):
    """The draft directory a run exported (one writer: under TP every tp rank holds a replica)
    holds the reference run's export: the same files and config exactly, the same tensors to
    Adam's sign-flip bound after the COMMON run's 2 AdamW steps (tests/numerics.py)."""
    for d in (a_dir, b_dir):
        assert sorted(os.listdir(os.path.join(d, "draft"))) == ["config.json", "model.safetensors"], (what, d)
    a_cfg, b_cfg = (json.load(open(os.path.join(d, "draft", "config.json"))) for d in (a_dir, b_dir))
    assert b_cfg == a_cfg, what
    a, b = (load_file(os.path.join(d, "draft", "model.safetensors")) for d in (a_dir, b_dir))
    assert_same_draft_export(b, a, DRAFT_LR, STEPS, what)


OFFLINE = ("--draft.offline", "true")
TP = ("--parallelism.tensor_parallel_degree", "2")


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    """The one-process runs (co-training, offline draft training), in one launch."""
    d = tmp_path_factory.mktemp("one")
    cotrain, offline = train_many(
        1, [(str(d / "cp1"), COMMON), (str(d / "off1"), (*COMMON, *OFFLINE))], config="debug_cpu_sft.toml"
    )
    return {"cotrain": cotrain, "offline": offline, "cotrain_dir": str(d / "cp1"), "offline_dir": str(d / "off1")}


def test_cp_co_training_matches_cp1(tmp_path, train, one):
    """cp = 2 alone, and FSDP over the dp x cp mesh (2 data-parallel groups of 2 context-parallel
    ranks, 2 rows each), see the 4-row global batch of the single-process run."""
    one = one["cotrain"]
    two = train(
        str(tmp_path / "cp2"),
        2,
        (*COMMON, "--parallelism.context_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"),
    )
    _assert_same_run(one, two, "cp=2")
    four = train(
        str(tmp_path / "dp2cp2"),
        4,
        (
            *COMMON,
            "--parallelism.context_parallel_degree",
            "2",
            "--parallelism.data_parallel_shard_degree",
            "2",
            "--training.local_batch_size",
            "2",
        ),
    )
    _assert_same_run(one, four, "dp=2 x cp=2", same_dp=False)


def test_tp_co_training_matches_one_process(tmp_path, one):
    """torchtitan's TP plan (sequence parallel) on 2 ranks under FSDP over 2 data-parallel groups
    (2 rows each), and under cp = 2 (the ring over each tp rank's local heads), in one 4-process
    launch; and offline draft training (a frozen teacher) under dp x tp. The draft, replicated
    over the tp group, trains on the taps gathered from their sequence shards and the gathered
    logits; its data-parallel mesh and normalizer exclude tp (draft/tokens_j below equal)."""
    dp2tp2, cp2tp2, offline = train_many(
        4,
        [
            (
                str(tmp_path / "dp2tp2"),
                (*COMMON, *TP, "--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "2"),
            ),
            (
                str(tmp_path / "cp2tp2"),
                (
                    *COMMON,
                    *TP,
                    "--parallelism.context_parallel_degree",
                    "2",
                    "--parallelism.data_parallel_shard_degree",
                    "1",
                ),
            ),
            (
                str(tmp_path / "offdp2tp2"),
                (
                    *COMMON,
                    *OFFLINE,
                    *TP,
                    "--parallelism.data_parallel_shard_degree",
                    "2",
                    "--training.local_batch_size",
                    "2",
                ),
            ),
        ],
        config="debug_cpu_sft.toml",
    )
    _assert_same_run(one["cotrain"], dp2tp2, "dp=2 x tp=2", same_dp=False)
    _assert_same_run(one["cotrain"], cp2tp2, "cp=2 x tp=2")
    _assert_same_run(one["offline"], offline, "offline draft, dp=2 x tp=2", same_dp=False)
    for name, ref in (("dp2tp2", "cotrain_dir"), ("cp2tp2", "cotrain_dir"), ("offdp2tp2", "offline_dir")):
        _assert_same_export(one[ref], str(tmp_path / name), name)
