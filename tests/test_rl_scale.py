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
    "--config", os.path.join(ROOT, "train_configs", "debug_cpu.toml"),
    "--model.name", "llama3", "--model.hf_checkpoint", "", "--draft.init_from", "", "--draft.draft_vocab_size", "24",
    "--draft.ttt_steps", "3", "--training.steps", "2",
    "--training.seq_len", "128", "--lr_scheduler.warmup_steps", "0", "--checkpoint.enable", "false",
    "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false", "--rollout.progress", "false",
    "--rl.prompts_per_step", "4", "--rl.group_size", "4", "--rl.max_new_tokens", "12",
    "--rl.baseline_interval", "0", "--task.seed", "5",
)
SCALARS = ("loss", "grad_norm", "draft/loss", "draft/grad_norm", "rl/reward", "rl/clip_fraction")


def fixed_batch_run(dump: str, nproc: int, overrides: tuple[str, ...] = (), batch: str | None = None,
                    record: bool = False, timeout: int = 600) -> dict:
    """One RL step of tests/helpers/rl_fixed_batch.py; returns {"row": metrics row,
    "policy": tensors, "draft": tensors}."""
    batch = batch or os.path.join(dump, "batch.json")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
        os.path.join(ROOT, "tests/helpers/rl_fixed_batch.py"), "--batch", batch, "--out", dump,
        *(["--record"] if record else []), *RL, "--job.dump_folder", dump, *overrides,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    if out.returncode != 0:
        raise AssertionError(f"rl_fixed_batch failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}")
    with open(os.path.join(dump, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == [1], rows
    return {"row": rows[0], "batch": batch, "policy": load_file(os.path.join(dump, "policy.safetensors")),
            "draft": load_file(os.path.join(dump, "draft.safetensors"))}


def assert_same_step(ref: dict, got: dict, what: str) -> None:
    for key in SCALARS:
        assert got["row"][key] == pytest.approx(ref["row"][key], rel=1e-5, abs=1e-7), (what, key)
    for model in ("policy", "draft"):
        assert sorted(got[model]) == sorted(ref[model]), (what, model)
        for name, want in ref[model].items():
            torch.testing.assert_close(got[model][name], want, rtol=0, atol=2e-6, msg=f"{what}: {model} {name}")


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


# Pipeline parallelism (llama3/tiny, 8 layers, taps (1, 3, 4)): stage 0 = embeddings + layers 0-3
# (it sends the embeddings and taps 1 and 3 over the TapChannel), stage 1 = layers 4-7 + norm +
# lm_head + the draft (tap 4 used in place). A minibatch fills training.local_batch_size rows,
# cut into microbatches of pipeline_parallel_microbatch_size rows (the reference's packed rows
# followed by empty ones).
PP2 = ("--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B",
       "--parallelism.data_parallel_shard_degree", "1", "--training.local_batch_size", "4",
       "--parallelism.pipeline_parallel_microbatch_size", "2")


def test_pp2_step_equals_one_process(reference, tmp_path):
    """Each microbatch's PPO loss on the last stage from its own rows' behaviour log-probs and
    advantages, normalized by the minibatch's token count; the draft on the last stage fed by
    the TapChannel; the push's full policy and draft on global rank 0 (the first stage, which
    holds neither the last layers nor the draft)."""
    got = fixed_batch_run(str(tmp_path / "pp2"), 2, PP2, batch=reference["batch"])
    assert_same_step(reference, got, "pp=2")
    assert got["row"]["pp/taps_delivered"] == 2 * 4  # 2 microbatches x (embeddings + 3 taps)


# The run through the real entry point: the first steps' metrics of RL at pp = 2 equal the
# one-process run's. From a random init (no warm start: it would cost an SFT and a draft run),
# so the policy earns no reward yet (its advantages and PPO loss are 0; the fixed-batch tests
# above carry the policy gradient); what the runs show is the rest of the step: step 1's
# rollouts from the weights pushed out of both stages (every rank generates its pipeline's
# batch, the ranks checked to agree), the draft trained on the last stage, and step 2's
# rollouts from the draft broadcast from there into both ranks' engines.
RUN = ("--model.name", "llama3", "--model.hf_checkpoint", "", "--draft.init_from", "",
       "--draft.draft_vocab_size", "24", "--draft.ttt_steps", "3", "--training.steps", "2",
       "--checkpoint.enable", "false", "--rollout.progress", "false", "--rl.prompts_per_step", "4",
       "--rl.group_size", "4", "--rl.max_new_tokens", "12", "--rl.baseline_interval", "0", "--task.seed", "5")
EXACT = ("rollout/tokens", "rollout/accept_len", "rl/reward", "rl/stop_fraction", "rl/policy_version",
         "draft/tokens_0", "draft/tokens_1", "draft/tokens_2")
CLOSE = ("loss", "grad_norm", "draft/loss", "draft/grad_norm")


def test_pp2_run_first_steps_equal_one_process(tmp_path, train):
    """Through `python -m titan_spec.train` (torchrun, gloo): rollout counts and acceptance
    (the sampled tokens) equal exactly; losses and gradient norms at the fixed-batch test's
    rel 1e-5; the draft's accuracies to one argmax flip (tests/numerics.py)."""
    one = train(str(tmp_path / "pp1"), 1, RUN, config="debug_cpu.toml")
    pp = train(str(tmp_path / "pp2"), 2, (*RUN, *PP2), config="debug_cpu.toml")
    assert [r["step"] for r in one] == [r["step"] for r in pp] == [1, 2]
    for a, b in zip(one, pp):
        assert a["rollout/tokens"] > 0 and a["draft/loss"] > 0, a
        for key in EXACT:
            assert b[key] == a[key], (a["step"], key, a[key], b[key])
        for key in CLOSE:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (a["step"], key, a[key], b[key])
        assert_same_draft_accuracy(a, b, 3, f"step {a['step']}")
