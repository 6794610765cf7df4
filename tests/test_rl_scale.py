"""The RL step under data parallelism (and, as they land, context / pipeline / tensor
parallelism) equals the one-process step on the SAME rollouts.

The reference run (one process, tests/helpers/rl_fixed_batch.py --record) generates one step's
rollouts for real, rigs them so every group has distinct rewards and the importance ratios
move off 1 (the PPO clip is active), writes them, and trains on them; every other layout
trains on that file. Both models take one plain SGD step of lr 1, so equal new weights mean
equal (clipped) gradients element by element; the step's policy loss, draft loss and
gradient norms come from its metrics row.

Tolerance: the layouts sum the same fp32 terms in another order (per-rank partial sums,
reduce-scatter, ring merges), so values agree to a few fp32 ulps of the sums involved:
rel 1e-5 on scalars, and on weights abs 2e-6 (|gradients| are O(1e-2); one fp32 ulp of a
weight of O(0.1) is 7e-9), checked element-wise over every tensor.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from numerics import assert_same_draft_accuracy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# llama3/tiny (untied embedding and lm_head): torchtitan has no weight tying under pipeline
# parallelism, and every layout compares against the one reference.
RL = (
    "--config",
    os.path.join(ROOT, "train_configs", "debug_cpu.toml"),
    "--model.name",
    "llama3",
    "--model.hf_checkpoint",
    "",
    "--draft.init_from",
    "",
    "--draft.draft_vocab_size",
    "24",
    "--draft.eagle3.ttt_steps",
    "3",
    "--training.steps",
    "2",
    "--training.seq_len",
    "128",
    "--lr_scheduler.warmup_steps",
    "0",
    "--checkpoint.enable",
    "false",
    "--metrics.log_freq",
    "1",
    "--metrics.enable_tensorboard",
    "false",
    "--rollout.progress",
    "false",
    "--rl.prompts_per_step",
    "4",
    "--rl.group_size",
    "4",
    "--rl.max_new_tokens",
    "12",
    "--rl.baseline_interval",
    "0",
    "--task.seed",
    "5",
)
TP2 = ("--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1")
SCALARS = ("loss", "grad_norm", "draft/loss", "draft/grad_norm", "rl/reward", "rl/clip_fraction")


def fixed_batch_run(
    dump: str,
    nproc: int,
    overrides: tuple[str, ...] = (),
    batch: str | None = None,
    record: bool = False,
    timeout: int = 600,
    generate: bool = False,
) -> dict:
    """One RL step of tests/helpers/rl_fixed_batch.py; returns {"row": metrics row,
    "policy": tensors, "draft": tensors, "draft_ranks": {rank: tensors} of the other ranks,
    "rollouts": {rank: its really generated rollouts} with ``generate``}."""
    batch = batch or os.path.join(dump, "batch.json")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        os.path.join(ROOT, "tests/helpers/rl_fixed_batch.py"),
        "--batch",
        batch,
        "--out",
        dump,
        *(["--record"] if record else []),
        *(["--generate"] if generate else []),
        *RL,
        "--job.dump_folder",
        dump,
        *overrides,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    if out.returncode != 0:
        raise AssertionError(f"rl_fixed_batch failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}")
    with open(os.path.join(dump, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == [1], rows
    ranks = range(1, nproc)
    found = {r: os.path.join(dump, f"draft_rank{r}.safetensors") for r in ranks}
    rollouts = {}
    for r in range(nproc) if generate else ():
        with open(os.path.join(dump, f"rollouts_rank{r}.json")) as f:
            rollouts[r] = json.load(f)
    return {
        "row": rows[0],
        "batch": batch,
        "policy": load_file(os.path.join(dump, "policy.safetensors")),
        "draft": load_file(os.path.join(dump, "draft.safetensors")),
        "draft_ranks": {r: load_file(p) for r, p in found.items() if os.path.exists(p)},
        "rollouts": rollouts,
    }


def assert_same_weights(ref: dict, got: dict, what: str) -> None:
    assert sorted(got) == sorted(ref), what
    for name, want in ref.items():
        # tolerance: ONE plain SGD step of lr 1 (no Adam normalisation, so no sign flip): the weights differ by the gradients' fp32 rounding (module docstring)
        torch.testing.assert_close(got[name], want, rtol=0, atol=2e-6, msg=f"{what} {name}")


def assert_same_step(ref: dict, got: dict, what: str) -> None:
    for key in SCALARS:
        assert got["row"][key] == pytest.approx(ref["row"][key], rel=1e-5, abs=1e-7), (what, key)
    # The drift of the policy from its start (rl/drift.py; the fixed batch's shifted behaviour
    # log-probs make it nonzero): per token of each shard, reduced over dp x cp (absent under
    # PP, where it is off).
    for key in ("drift/kl", "drift/kl_k3"):
        if key in got["row"]:
            assert got["row"][key] == pytest.approx(ref["row"][key], rel=1e-5, abs=1e-6), (what, key)
    for model in ("policy", "draft"):
        assert_same_weights(ref[model], got[model], f"{what}: {model}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The one-process step on freshly generated (then fixed) rollouts."""
    ref = fixed_batch_run(str(tmp_path_factory.mktemp("rl1")), 1, record=True)
    row = ref["row"]
    # The batch exercises what the comparison is about: a moving policy, an active clip.
    assert 0 < row["rl/reward"] < 1 and row["rl/clip_fraction"] > 0, row
    assert row["draft/loss"] > 0 and row["grad_norm"] > 0, row
    return ref


def test_dp2_step_equals_one_process(reference, tmp_path):
    """FSDP over 2 ranks, each training on its half of the problems."""
    got = fixed_batch_run(str(tmp_path / "dp2"), 2, batch=reference["batch"])
    assert_same_step(reference, got, "dp=2")


CP2 = ("--parallelism.context_parallel_degree", "2")


def test_cp2_step_equals_one_process(reference, tmp_path):
    """Context parallelism: both CP ranks hold the whole batch (one data-parallel rank) and
    train on their zigzag shards of it: the behaviour log-probs and advantages travel with
    their tokens (cp_batch.shard_values), the PPO loss sums each shard over the global token
    count, the draft's TTT loss reads its cross-shard rows through the halo."""
    got = fixed_batch_run(
        str(tmp_path / "cp2"), 2, (*CP2, "--parallelism.data_parallel_shard_degree", "1"), batch=reference["batch"]
    )
    assert_same_step(reference, got, "cp=2")


def test_dp2_cp2_step_equals_one_process_and_the_reference_forward_runs_on_the_shards(reference, tmp_path):
    """FSDP over dp 2 x cp 2 (4 processes): 2 data-parallel ranks with their halves of the
    problems, each zigzag-sharded over its 2 CP ranks; rl.kl_beta > 0 adds the frozen
    reference's forward on the same shards. At the first step the reference is the policy,
    so a reference forward that sees the shards as the policy does gives KL 0 (and a KL
    gradient of 0: the step equals the kl_beta = 0 reference run); one that reads them
    another way (without the ring, unsharded) gives KL > 0."""
    got = fixed_batch_run(
        str(tmp_path / "dp2cp2"),
        4,
        (*CP2, "--parallelism.data_parallel_shard_degree", "2", "--rl.kl_beta", "0.5"),
        batch=reference["batch"],
    )
    assert got["row"]["rl/kl"] == pytest.approx(0.0, abs=1e-6), got["row"]
    assert_same_step(reference, got, "dp=2 x cp=2")


EASY = (
    "--task.name",
    "arithmetic",
    "--task.generated.max_operand",
    "3",
    "--task.generated.operators",
    "+",
    "--task.generated.show_work",
    "false",
    "--task.seed",
    "5",
    "--checkpoint.enable",
    "false",
)
"""A task a 40-step SFT gets partly right (one-digit answers), so rewards differ within groups."""


def test_cp2_and_pp2_rl_runs_through_the_entry_point_equal_the_same_run_without_them(tmp_path):
    """Two RL steps through the real entry point (conftest.train_many: one 2-process torchrun
    launch, after a short SFT warm start) at cp = 2, at pp = 2 and without either.

    Which run is compared: the one-process run's rollouts cannot be the cp = 2 run's. The
    built-in engine samples a call's completions from ONE seeded RNG stream consumed across
    the batch's rows (and rows leave the batch as they stop), so the same prompts in two
    calls of half the batch give other samples whatever the seeds. The cp = 2 run generates
    its completions in two such calls (rl/sharing.py), seeded as the two data-parallel
    ranks of a dp = 2 run seed theirs: the same command without CP, at the same 2 processes,
    generates exactly the cp = 2 run's rollouts (same prompts, seeds and batch shapes per
    call), and the dp = 2 run's RL step equals the one-process step on the same rollouts
    (test_dp2_step_equals_one_process). So every metric the rollouts and the updates make
    is compared: the rollouts' (reward, stop fraction, tokens, acceptance lengths with the
    co-trained and the frozen draft) exactly, the updates' (policy and draft loss, gradient
    norms, clip fraction) at the fp32 tolerance of the fixed-batch tests, the draft's
    accuracies to one argmax flip. Step 2 trains on rollouts generated by the weights of a
    CP update pushed into the engines: equal only if that update is.

    pp = 2 the same way: its two ranks (one data-parallel rank, two stages) generate a share
    each, seeded as the dp = 2 run's ranks, and exchange them (rl/sharing.py); step 1 is
    generated by the weights pushed out of both stages, step 2 also by the draft broadcast
    from the last stage after its update there.

    Not compared: n_tokens_seen (dp = 2 packs each rank's half into its own rows, cp = 2 the
    whole batch into one set: the padding differs), max_loss (the largest data-parallel
    rank's mean: two halves vs one whole), seconds and tokens/s."""
    from conftest import train_many

    sft, dp2, cp2, pp2 = (str(tmp_path / name) for name in ("sft", "dp2", "cp2", "pp2"))
    llama = ("--model.name", "llama3")  # untied: pipeline parallelism needs it
    rl = (
        *llama,
        "--model.hf_checkpoint",
        os.path.join(sft, "hf"),
        "--draft.init_from",
        "",
        "--draft.eagle3.ttt_steps",
        "3",
        "--draft.draft_vocab_size",
        "24",
        *EASY,
        "--training.steps",
        "2",
        "--lr_scheduler.warmup_steps",
        "0",
        "--rl.prompts_per_step",
        "4",
        "--rl.group_size",
        "4",
        "--rl.max_new_tokens",
        "8",
        "--rl.baseline_interval",
        "2",
        "--rollout.progress",
        "false",
        "--speculative.depth",
        "fixed",
    )  # adaptive depth times each rank's own rounds: other K, other samples
    # local_batch_size: the draft's vocabulary comes from the first batches' token counts,
    # the data-parallel ranks' rows together: 2 x 2 rows = 1 x 4.
    a, *others = train_many(
        2,
        [
            (
                sft,
                (
                    "--config",
                    "debug_cpu_sft.toml",
                    *llama,
                    *EASY,
                    "--training.steps",
                    "40",
                    "--job.export_hf",
                    "hf",
                    "--task.generated.wrong_answer_rate",
                    "0",
                ),
            ),
            (dp2, (*rl, "--training.local_batch_size", "2")),
            (cp2, (*rl, *CP2, "--parallelism.data_parallel_shard_degree", "1")),
            (pp2, (*rl, *PP2)),
        ],
        config="debug_cpu.toml",
    )[1:]
    assert 0 < a[0]["rl/reward"] < 1 and a[0]["grad_norm"] > 0, a[0]  # the policy moves
    for b, layout in zip(others, ("cp=2", "pp=2")):
        _assert_same_run(a, b, layout)


def _assert_same_run(a: list[dict], b: list[dict], layout: str) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2], layout
    for ra, rb in zip(a, b):
        # Exact although step 2's rollouts come from weights after an AdamW step (equal only to
        # Adam's sign-flip bound, tests/numerics.py): a sampled token changes only if the
        # inverse-CDF draw falls within the logits' difference (~1e-6) of a boundary, about
        # 1e-6 per token, ~1e-4 for the run's ~100 sampled tokens; a real layout bug moves many.
        for key in (
            "rl/reward",
            "rl/stop_fraction",
            "rollout/tokens",
            "rollout/accept_len",
            "rollout/accept_len_frozen",
            "rl/policy_version",
        ):
            assert rb[key] == ra[key], (layout, ra["step"], key, ra, rb)
        for key in ("loss", "grad_norm", "draft/loss", "draft/grad_norm", "rl/clip_fraction"):
            assert rb[key] == pytest.approx(ra[key], rel=1e-5, abs=1e-7), (layout, ra["step"], key, ra, rb)
        assert_same_draft_accuracy(ra, rb, 3, f"{layout} step {ra['step']}")


# Pipeline parallelism (llama3/tiny, 8 layers, taps (1, 3, 4)): stage 0 = embeddings + layers 0-3
# (it sends the embeddings and taps 1 and 3 over the TapChannel), stage 1 = layers 4-7 + norm +
# lm_head + the draft (tap 4 used in place). A minibatch fills training.local_batch_size rows,
# cut into microbatches of pipeline_parallel_microbatch_size rows (the reference's packed rows
# followed by empty ones).
PP2 = (
    "--rl.drift_metrics",
    "false",  # its reference forward does not run under PP (a config error)
    "--parallelism.pipeline_parallel_degree",
    "2",
    "--parallelism.pipeline_parallel_schedule",
    "1F1B",
    "--parallelism.data_parallel_shard_degree",
    "1",
    "--training.local_batch_size",
    "4",
    "--parallelism.pipeline_parallel_microbatch_size",
    "2",
)


def test_pp2_step_equals_one_process(reference, tmp_path):
    """Each microbatch's PPO loss on the last stage from its own rows' behaviour log-probs and
    advantages, normalized by the minibatch's token count; the draft on the last stage fed by
    the TapChannel; the push's full policy and draft on global rank 0 (the first stage, which
    holds neither the last layers nor the draft)."""
    got = fixed_batch_run(str(tmp_path / "pp2"), 2, PP2, batch=reference["batch"])
    assert_same_step(reference, got, "pp=2")
    assert got["row"]["pp/taps_delivered"] == 2 * 4  # 2 microbatches x (embeddings + 3 taps)


def test_pp2_x_cp2_step_equals_one_process(reference, tmp_path):
    """pp = 2 x cp = 2 (4 processes, one data-parallel rank): each microbatch zigzag-split over
    the 2 CP ranks of each stage (documents padded to multiples of 2 * cp = 4, so every shard
    has the pipeline's static length), its behaviour log-probs and advantages sharded with
    its tokens (cp_batch.shard_values), ring attention inside the stages, CP-sharded taps over
    the TapChannel, the draft's TTT halo on the last stage."""
    got = fixed_batch_run(str(tmp_path / "pp2cp2"), 4, (*PP2, *CP2), batch=reference["batch"])
    assert_same_step(reference, got, "pp=2 x cp=2")
    assert got["row"]["pp/taps_delivered"] == 2 * 4


def test_tp2_step_equals_one_process(reference, tmp_path):
    """Tensor parallelism over 2 ranks of ONE data-parallel group (torchtitan's Qwen3 plan,
    sequence parallel): the attention runs on each rank's heads, the taps reach the draft
    gathered from their sequence shards, the PPO log-probs come from the vocab-sharded logits
    (loss parallel), the push gathers the TP shards. The draft is replicated over the tp group
    and must end equal on both ranks (identical inputs, so identical gradients: no reduction).
    The tp ranks of the data-parallel rank share its generation (rl/sharing.py: each generates
    half from the same pushed, gathered weights, then they exchange): both hold the same 16
    rollouts, generated for real here."""
    got = fixed_batch_run(str(tmp_path / "tp2"), 2, TP2, batch=reference["batch"], generate=True)
    assert_same_step(reference, got, "tp=2")
    assert sorted(got["draft_ranks"]) == [1], "every rank holds the replicated draft"
    for rank, draft in got["draft_ranks"].items():
        assert_same_weights(reference["draft"], draft, f"tp=2: the draft on rank {rank}")
    assert len(got["rollouts"][0]) == 16 and got["rollouts"][1] == got["rollouts"][0]


# --- the settings verl users expect (docs/RL.md) ---------------------------------------------
# The behaviour log-probs recomputed by the trainer (one no-grad forward per minibatch, as the
# update runs it), sequence-level TIS against the file's engine log-probs (shifted, so the
# weights are far from 1 and the cap binds on some completions), dual-clip and per-sequence
# aggregation: one process, then dp 2 x cp 2, pp 2 and tp 2 on the same file.
VERL = (
    "--rl.behaviour_logprobs",
    "recompute",
    "--rl.tis",
    "sequence",
    "--rl.dual_clip",
    "3",
    "--rl.loss_agg",
    "seq-mean-token-mean",
)
MISMATCH = ("rl/logp_mismatch_mean", "rl/logp_mismatch_max", "rl/logp_mismatch_out_of_band")


@pytest.fixture(scope="module")
def verl_reference(reference, tmp_path_factory):
    ref = fixed_batch_run(str(tmp_path_factory.mktemp("rl1_verl")), 1, VERL, batch=reference["batch"])
    row = ref["row"]
    # The recompute is the denominator: at the first update every ratio is 1, nothing clips;
    # the engine's shifted log-probs show as the mismatch, and the loss is not the engine run's.
    assert row["rl/clip_fraction"] == 0.0 and row["rl/logp_mismatch_mean"] > 0.1, row
    assert row["loss"] != pytest.approx(reference["row"]["loss"], rel=1e-3)
    return ref


@pytest.mark.parametrize("layout", ["dp2cp2", "pp2", "tp2"])
def test_recompute_tis_dual_clip_and_seq_mean_under_each_parallelism_equal_one_process(
    verl_reference, reference, tmp_path, layout
):
    """Under CP the recompute runs on each rank's zigzag shard and the log-probs are gathered
    back for the sequence weights; under PP through the schedule's forward alone
    (schedule.eval), recorded on the last stage; under TP from vocab-sharded logits."""
    nproc, extra = {
        "dp2cp2": (4, (*CP2, "--parallelism.data_parallel_shard_degree", "2")),
        "pp2": (2, PP2),
        "tp2": (2, TP2),
    }[layout]
    got = fixed_batch_run(str(tmp_path / layout), nproc, (*VERL, *extra), batch=reference["batch"])
    assert_same_step(verl_reference, got, layout)
    for key in MISMATCH:
        assert got["row"][key] == pytest.approx(verl_reference["row"][key], rel=1e-5, abs=1e-7), (layout, key)
