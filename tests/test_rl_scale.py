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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RL = (
    "--config", os.path.join(ROOT, "train_configs", "debug_cpu.toml"),
    "--model.hf_checkpoint", "", "--draft.init_from", "", "--draft.draft_vocab_size", "24",
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
