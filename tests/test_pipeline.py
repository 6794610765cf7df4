"""Pipeline parallelism with the TapChannel, end to end through the trainer (gloo, CPU):
pp = 2 trains the policy and the draft exactly like pp = 1, for every schedule and
composed with FSDP; config errors come before any process starts."""

import os

import pytest
from safetensors.torch import load_file

from titan_spec.config import ConfigError, load_config
from titan_spec.preflight import to_trainer_config

from numerics import assert_same_draft_accuracy, assert_same_draft_export

# train_configs/debug_cpu_pp.toml: llama3/tiny, as torchtitan has no weight tying under PP (qwen3/tiny ties). 8 layers, taps (1, 3, 4).
# 1F1B/GPipe: stage 0 = embeddings + layers 0-3 (embeddings, taps 1 and 3 are sent), stage 1 = layers
# 4-7 (tap 4 used in place). Interleaved1F1B, 4 virtual stages: stage 0 (rank 0) sends the embeddings
# and tap 1; stage 1 (layers 2-4) is on the last stage's rank, its taps 3 and 4 are used in place.
COMMON = (
    "--model.name",
    "llama3",
    "--training.seq_len",
    "64",
    "--training.steps",
    "3",
    "--draft.enable",
    "true",
    "--draft.draft_vocab_size",
    "24",
    "--draft.eagle3.ttt_steps",
    "3",
    "--checkpoint.enable",
    "false",
    "--lr_scheduler.total_steps",
    "3",
)
PP1 = ("--parallelism.pipeline_parallel_degree", "1")
KEYS = ["loss", "grad_norm", "draft/loss", "draft/grad_norm"]
DRAFT_LR, STEPS = 3e-3, 3  # [draft] lr default; training.steps in COMMON


def _pp(schedule, dp=1, mb=1):
    return (
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_schedule",
        schedule,
        "--parallelism.pipeline_parallel_microbatch_size",
        str(mb),
        "--parallelism.data_parallel_shard_degree",
        str(dp),
    )


def _assert_same_training(ref, rows, ref_dump, dump, label):
    """Pipelined and flat steps reduce in other orders (microbatch gradient accumulation, FSDP
    reduce-scatter), so they agree to rounding, not bitwise: losses and gradient norms (what the
    optimizers consume) at rel 2e-5; accuracies to one argmax flip; the draft's weights after
    3 AdamW steps to Adam's sign-flip bound (tests/numerics.py says why each)."""
    assert [r["step"] for r in rows] == [r["step"] for r in ref] == [1, 2, 3], label
    for a, b in zip(ref, rows):
        for key in KEYS:  # losses, and the gradients through their norms and the next steps' losses
            assert b[key] == pytest.approx(a[key], rel=2e-5, abs=1e-6), (label, key, a, b)
        assert_same_draft_accuracy(a, b, 3, label)
    # The draft trained on the last stage ends where the pp = 1 draft ends.
    want, got = (
        load_file(os.path.join(ref_dump, "draft/model.safetensors")),
        load_file(os.path.join(dump, "draft/model.safetensors")),
    )
    assert_same_draft_export(got, want, DRAFT_LR, STEPS, f"{label}: draft")


@pytest.mark.needs_torch_2_14("pipeline parallelism (pp = 2)")
def test_pp2_matches_pp1_for_each_schedule(tmp_path, many):
    """One 2-process launch: pp = 1 (FSDP over the 2 ranks, 2 rows each; test_train shows this
    equals one process) and pp = 2 with 4 microbatches of 1 row for each schedule, on the same
    4-row global batches."""
    schedules = ("1F1B", "GPipe", "Interleaved1F1B")
    runs = [
        (
            str(tmp_path / "pp1"),
            (*COMMON, "--training.local_batch_size", "2", *PP1, "--parallelism.data_parallel_shard_degree", "2"),
        )
    ]
    # GPipe also runs with full activation checkpointing: the blocks recompute in the backward,
    # the taps (read between blocks) must still be sent exactly once per microbatch.
    ac = {"GPipe": ("--activation_checkpoint.mode", "full")}
    runs += [(str(tmp_path / s), (*COMMON, *_pp(s), *ac.get(s, ()))) for s in schedules]
    ref, *pps = many(2, runs)
    assert ref[-1]["loss"] < ref[0]["loss"]
    for s, rows in zip(schedules, pps):
        _assert_same_training(ref, rows, runs[0][0], str(tmp_path / s), s)
        # Every microbatch's 4 taps (embeddings + 3 layers) reached the draft, checked by tag.
        assert [r["pp/taps_delivered"] for r in rows] == [4 * 4] * 3, s


@pytest.mark.needs_torch_2_14("pipeline parallelism (pp = 2)")
def test_pp2_x_dp2_and_pp2_x_cp2_match_pp1(tmp_path, many):
    """4 processes, one launch, 8-row global batches of documents padded to multiples of 4
    tokens (what pp x cp = 2 packs automatically): pp = 2 x FSDP dp = 2 (draft FSDP'd over the
    last stage's 2 ranks) and pp = 2 x cp = 2 (each microbatch zigzag-split over 2 ranks per
    stage, ring attention inside the stages, CP-sharded taps over the channel, the draft's
    TTT halo on the last stage) against pp = 1 x dp = 4."""
    aligned = ("--task.document_multiple", "4")
    runs = [
        (
            str(tmp_path / "dp4"),
            (
                *COMMON,
                *aligned,
                "--training.local_batch_size",
                "2",
                *PP1,
                "--parallelism.data_parallel_shard_degree",
                "4",
            ),
        ),
        (str(tmp_path / "pp2dp2"), (*COMMON, *aligned, *_pp("1F1B", dp=2, mb=2))),
        (
            str(tmp_path / "pp2cp2"),
            (
                *COMMON,
                "--training.local_batch_size",
                "8",
                *_pp("1F1B", dp=1, mb=2),
                "--parallelism.context_parallel_degree",
                "2",
            ),
        ),
    ]
    ref, dp_rows, cp_rows = many(4, runs)
    _assert_same_training(ref, dp_rows, runs[0][0], runs[1][0], "pp2 x dp2")
    assert [r["pp/taps_delivered"] for r in dp_rows] == [2 * 4] * 3
    _assert_same_training(ref, cp_rows, runs[0][0], runs[2][0], "pp2 x cp2")
    assert [r["pp/taps_delivered"] for r in cp_rows] == [4 * 4] * 3


BAD = [
    (
        [
            "--draft.tap_layer_ids",
            "[1, 3, 6]",
            "--parallelism.module_fqns_per_model_part",
            "[['tok_embeddings', 'layers.0', 'layers.1', 'layers.2', 'layers.3'], ['layers.4', 'layers.5', 'layers.7', 'norm', 'lm_head']]",
        ],
        "tap layer ids [6] name no layer on any pipeline stage",
    ),
    (
        [
            "--parallelism.module_fqns_per_model_part",
            "[['tok_embeddings', 'layers.0', 'layers.1', 'layers.2', 'norm', 'lm_head'], ['layers.3', 'layers.4', 'layers.5', 'layers.6', 'layers.7']]",
        ],
        "the draft trains on the last pipeline stage",
    ),
    (["--parallelism.pipeline_parallel_microbatch_size", "4"], "1F1B needs at least as many microbatches as stages: 1"),
    (["--parallelism.pipeline_parallel_microbatch_size", "3"], "must be >= 1 and divide training.local_batch_size = 4"),
    (
        [
            "--parallelism.pipeline_parallel_schedule",
            "Interleaved1F1B",
            "--training.local_batch_size",
            "5",
            "--parallelism.pipeline_parallel_microbatch_size",
            "1",
        ],
        "Interleaved1F1B needs the microbatch count to be a multiple",
    ),
    (["--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"], "must be one of 1F1B, GPipe, Interleaved1F1B"),
    (["--model.name", "qwen3"], "ties its embedding and lm_head"),
    (["--draft.offline", "true"], "draft.offline (a frozen target) is not supported"),
    # A module on two stages: its tap would be computed (and sent) twice.
    (
        [
            "--parallelism.module_fqns_per_model_part",
            "[['tok_embeddings', 'layers.0', 'layers.1', 'layers.2', 'layers.3'], ['layers.3', 'layers.4', 'layers.5', 'layers.6', 'layers.7', 'norm', 'lm_head']]",
        ],
        "layers.3 is on pipeline stages 0 and 1; every module must be on exactly one stage",
    ),
    # RL runs under PP; what it does not support there says what it does.
    (["--rl.enable", "true", "--rl.kl_beta", "0.1"], "rl.kl_beta = 0.1 is not supported"),
    (["--rl.enable", "true", "--rollout.engine", "sglang"], "use rollout.engine = 'builtin' under PP"),
]


@pytest.mark.parametrize("args,needle", BAD)
def test_bad_pipeline_config_is_one_line_before_any_step(args, needle):
    base = [
        "--model.name",
        "llama3",
        "--draft.enable",
        "true",
        "--training.local_batch_size",
        "4",
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.data_parallel_shard_degree",
        "1",
    ]
    cfg = load_config(
        os.path.join(os.path.dirname(__file__), "..", "train_configs/debug_cpu_pp.toml"), base + args, world_size=2
    )
    with pytest.raises(ConfigError) as info:
        to_trainer_config(cfg)
    assert needle in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_pp_larger_than_the_layers_is_one_line_before_any_step():
    """pp = 9 on llama3/tiny's 8 layers (9 processes: the degrees fit the world)."""
    cfg = load_config(
        os.path.join(os.path.dirname(__file__), "..", "train_configs/debug_cpu_pp.toml"),
        [
            "--model.name",
            "llama3",
            "--parallelism.pipeline_parallel_degree",
            "9",
            "--parallelism.data_parallel_shard_degree",
            "1",
            "--training.local_batch_size",
            "9",
            "--parallelism.pipeline_parallel_microbatch_size",
            "1",
        ],
        world_size=9,
    )
    with pytest.raises(ConfigError) as info:
        to_trainer_config(cfg)
    msg = str(info.value)
    assert "pipeline_parallel_degree = 9 is larger than the 8 decoder layers" in msg and "\n" not in msg, msg
