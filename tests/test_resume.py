"""Resume parity across processes: a run stopped at a DCP checkpoint and resumed logs the
uninterrupted run's metrics, step for step, and exports the same draft, at

- dp = 2: the policy, the draft and both optimizers FSDP-sharded over 2 ranks;
- pp = 2: each stage's policy part and optimizer on its rank, the draft (unsharded) and its
  optimizer on the last stage only (train_configs/debug_cpu_pp.toml, llama3);
- cp = 2: FSDP over the context-parallel ranks, zigzag-sharded batches.

A resume replays the same kernels on the same data in the same order, so the expected
equality is bitwise (==, not approx). The LR schedule (2 warmup steps, then cosine decay over
a fixed total_steps) changes the LR every step, and AdamW's moments are well away from zero
after 2 steps, so a resume that restarts the schedule, drops either optimizer's state, or
restarts the data stream changes every later loss.

All runs of the three layouts share ONE 2-process torchrun launch (tests/helpers/train_many.py).
"""

import os

import pytest
import torch
from safetensors.torch import load_file

N, K = 4, 2  # uninterrupted steps; the interrupted run stops at the step-K checkpoint
COMMON = (
    "--model.name",
    "llama3",
    "--training.seq_len",
    "64",
    "--lr_scheduler.total_steps",
    str(N),
    "--lr_scheduler.warmup_steps",
    "2",
    "--draft.enable",
    "true",
    "--draft.draft_vocab_size",
    "24",
    "--draft.eagle3.ttt_steps",
    "3",
    "--checkpoint.interval",
    str(K),
)
LAYOUTS = {
    "dp2": (
        "--parallelism.pipeline_parallel_degree",
        "1",
        "--parallelism.data_parallel_shard_degree",
        "2",
        "--training.local_batch_size",
        "2",
    ),
    "pp2": (
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.data_parallel_shard_degree",
        "1",
        "--parallelism.pipeline_parallel_microbatch_size",
        "2",
    ),
    "cp2": (
        "--parallelism.pipeline_parallel_degree",
        "1",
        "--parallelism.context_parallel_degree",
        "2",
        "--parallelism.data_parallel_shard_degree",
        "1",
    ),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from conftest import train_many

    root = tmp_path_factory.mktemp("resume")
    launch, dumps = [], {}
    for name, layout in LAYOUTS.items():
        full, cut = str(root / f"{name}_full"), str(root / f"{name}_cut")
        dumps[name] = (full, cut)
        launch += [
            (full, (*COMMON, *layout, "--training.steps", str(N), "--checkpoint.enable", "false")),
            (cut, (*COMMON, *layout, "--training.steps", str(K))),  # stops after the step-K checkpoint
            (cut, (*COMMON, *layout, "--training.steps", str(N))),  # resumes from it in the same folder
        ]
    train_many(2, launch)
    return dumps


def _rows(dump):
    import json

    with open(os.path.join(dump, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_resume_is_bitwise(runs, layout):
    full, cut = runs[layout]
    assert os.path.isdir(os.path.join(cut, "checkpoint", f"step-{K}"))
    want, got = _rows(full), _rows(cut)  # the cut run's file holds both of its halves
    assert [r["step"] for r in want] == [r["step"] for r in got] == list(range(1, N + 1)), layout
    # metrics.jsonl holds no wall-clock metric: every row is a function of the training state.
    assert {
        "loss",
        "grad_norm",
        "draft/loss",
        "draft/grad_norm",
        "draft/acc_0",
        "draft/lr",
        "lr/AdamW",
        "n_tokens_seen",
    } <= set(want[0]), want[0]
    for a, b in zip(want, got):
        assert b == a, (layout, a, b)
    # The last step's update is in no logged metric; the exported draft holds it.
    a, b = (load_file(os.path.join(d, "draft", "model.safetensors")) for d in (full, cut))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), (layout, k)
