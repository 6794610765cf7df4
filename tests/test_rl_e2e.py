"""RL end to end through torchrun, as the embedded default runs it, at test size:
SFT warm start -> offline draft -> GRPO with the draft co-trained from the same forward.

- reward rises above its SFT start;
- once the policy has moved, the co-trained draft's acceptance length is at least the
  frozen draft's (both measured on the same prompts with the same seed);
- a run stopped at a checkpoint and resumed gives the uninterrupted run's metrics bitwise,
  the baseline step in its window included (the frozen draft is the pre-RL one, not the
  draft restored from the checkpoint);
- the report (summary table, PNG plots) is written;
- several optimizer steps per rollout batch: rl.ppo_epochs = 2 x rl.minibatches = 2 (a real
  RLTrainer driven step by step, tests/helpers/rl_updates.py);
- the DAPO and GSPO losses (rl.loss) run real RL steps the same way.
- the drift metrics (rl.drift_metrics): KL(policy || start) is 0 before any update and equals
  an independent float64 computation on the step's rollouts after one; the completion-length
  metrics equal the rollouts' (tests/helpers/rl_drift.py).
"""

import json
import os
import subprocess
import sys

import pytest

TASK = (
    "--task.name",
    "arithmetic",
    "--task.generated.max_operand",
    "12",
    "--task.generated.num_operands",
    "2",
    "--task.generated.show_work",
    "true",
    "--task.generated.wrong_answer_rate",
    "0.5",
    "--task.seed",
    "5",
)
"""The test-size task: 2-operand arithmetic with short completions (the embedded default's
trace task needs ~100-token completions, too slow here). Half the SFT demonstrations state a
wrong result, so the warm start knows the right one and GRPO has something to sharpen: with
0.3 and 120 SFT steps the policy got ~19% right and RL gained ~0.0005 reward per step, too
little to see in 30 steps (the test passed or failed with the sample stream); with 0.5 and
300 steps, measured 0.32 -> 0.40 over 30 steps."""
SMALL = ("--training.seq_len", "128", "--training.local_batch_size", "8", "--checkpoint.enable", "false")


@pytest.fixture(scope="module")
def warm_start(tmp_path_factory):
    """An SFT policy that gets a third of the answers right (TASK), and an offline draft for it."""
    from conftest import train_many

    root = tmp_path_factory.mktemp("warm")
    sft, draft = str(root / "sft"), str(root / "draft")
    train_many(
        1,
        [  # one launch, the draft run after the SFT run it reads
            (
                sft,
                (*SMALL, *TASK, "--training.steps", "300", "--job.export_hf", "hf", "--lr_scheduler.warmup_steps", "5"),
            ),
            (
                draft,
                (
                    "--config",
                    "debug_cpu_draft.toml",
                    *SMALL,
                    *TASK,
                    "--training.steps",
                    "40",
                    "--model.hf_checkpoint",
                    os.path.join(sft, "hf"),
                    "--lr_scheduler.warmup_steps",
                    "5",
                    "--draft.data",
                    "demonstrations",
                    "--draft.draft_vocab_size",
                    "32",
                ),
            ),
        ],
        config="debug_cpu_sft.toml",
    )
    return os.path.join(sft, "hf"), os.path.join(draft, "draft")


def _rl(warm_start, dump, steps, *extra, nproc: int = 1):
    from conftest import run_train

    hf, draft = warm_start
    return run_train(
        dump,
        nproc,
        (
            "--model.hf_checkpoint",
            hf,
            "--draft.init_from",
            draft,
            *TASK,
            "--training.steps",
            str(steps),
            "--lr_scheduler.warmup_steps",
            "1",
            "--training.seq_len",
            "128",
            "--rl.prompts_per_step",
            "16",
            "--rl.group_size",
            "8",
            "--rl.max_new_tokens",
            "12",
            "--rl.baseline_interval",
            "6",
            "--rollout.progress",
            "false",
            # Fixed depth: adaptive depth picks K from each run's own timed calibration, so a fresh
            # run's sampled trajectory would follow the machine's load (its resume exactness is
            # tested on the worker, test_rl.py / test_rollout_engine.py).
            "--speculative.depth",
            "fixed",
            # The draft's learning rate this test was sized with (the default's is 3e-3): the
            # draft does not change the policy's distribution, but it does change which samples
            # a seed draws, so the 30-step trajectory below is this one's.
            "--draft.lr",
            "1e-3",
            "--checkpoint.interval",
            "3",
            "--metrics.log_freq",
            "1",
            *extra,
        ),
        config="debug_cpu.toml",
        timeout=900,
    )


def test_rl_reward_rises_cotrained_draft_keeps_up_and_resume_is_exact(warm_start, tmp_path):
    dump = str(tmp_path / "rl")
    rows = _rl(warm_start, dump, 30)
    assert [r["step"] for r in rows] == list(range(1, 31))
    rewards = [r["rl/reward"] for r in rows]
    # Noisy per step (16 prompts x 8 samples); compare the first and last thirds.
    assert sum(rewards[-10:]) / 10 > sum(rewards[:10]) / 10 + 0.03, rewards
    # The same prompts through the co-trained and the frozen draft at steps 1, 6, 12, ..., 30.
    base = [r for r in rows if "rollout/accept_len_frozen" in r]
    assert [r["step"] for r in base] == [1, 6, 12, 18, 24, 30]
    assert base[0]["rollout/accept_len"] == pytest.approx(base[0]["rollout/accept_len_frozen"], abs=1e-9)
    assert base[-1]["rollout/accept_len"] >= base[-1]["rollout/accept_len_frozen"], base
    assert all(r["rollout/accept_len"] > 1.0 for r in rows)
    assert all(r["rl/policy_version"] == r["step"] - 1 for r in rows)
    # The end-of-run report.
    for name in ("reward.png", "acceptance.png", "rollout_tps.png"):
        assert os.path.getsize(os.path.join(dump, "plots", name)) > 1000
    with open(os.path.join(dump, "summary.md")) as f:
        assert "| reward |" in f.read()
    assert os.path.isfile(os.path.join(dump, "DONE"))

    # Stop at the step-3 checkpoint, resume to 6: the trajectory equals the uninterrupted run
    # (constant LR after a 1-step warmup, so a 6-step run's steps are the 30-step run's; the LR
    # schedule's restore is tested in test_resume.py). The same weights, prompts and sampling
    # seeds replay the same kernels, so every metric but wall-clock time is equal bitwise, the
    # step-6 baseline included: its frozen engine must hold the pre-RL draft (draft.init_from),
    # not the co-trained draft restored from the step-3 checkpoint.
    assert all(0.0 < r["rollout/draft_k"] <= 4.0 for r in rows), rows  # at most num_draft_tokens a round
    dump2 = str(tmp_path / "resumed")
    first = _rl(warm_start, dump2, 3)
    assert os.path.isdir(os.path.join(dump2, "checkpoint", "step-3"))
    resumed = _rl(warm_start, dump2, 6)[3:]
    assert [r["step"] for r in first + resumed] == list(range(1, 7))
    assert "rollout/accept_len_frozen" in resumed[-1]
    for a, b in zip(rows, first + resumed):
        assert {"loss", "rl/reward", "rollout/accept_len", "rollout/draft_k", "draft/loss", "draft/grad_norm"} <= set(a)
        same = {k: v for k, v in a.items() if not (k.startswith("time/") or "tokens_per_s" in k)}
        assert {k: b.get(k) for k in same} == same, a["step"]


ON_POLICY = 1e-4
"""|ratio - 1| allowed on the first update after a weight push: engine (KV-cached decode, fp32)
and trainer (packed forward, fp32) compute the same log-probs in different orders (~1e-6)."""

MOVED = 1e-3
"""|ratio - 1| every later update must exceed: one AdamW step moves the policy's log-probs by
far more (measured 1e-1 .. 1.7; without the optimizer step they stay ~1e-6 apart)."""


def test_two_ppo_epochs_of_two_minibatches_take_four_optimizer_steps_on_one_rollout_batch(warm_start, tmp_path):
    """Two RL steps of 2 epochs x 2 minibatches on the warm start. The importance ratio
    pi / pi_behaviour is 1 until an update with a gradient has moved the policy (the policy
    then still being the one that sampled the rollouts) and clearly not 1 on every update
    after it: the first update after a push is on-policy, and so is one that follows a
    minibatch whose groups all had equal rewards (zero advantages, zero gradient: AdamW does
    not move); the policy's and the draft's AdamW take four steps per rollout batch; the
    second step's rollouts come from the weights after those four (version 4, pushed to the
    engine)."""
    first, second = rl_updates(warm_start, tmp_path, "--rl.ppo_epochs", "2", "--rl.minibatches", "2")
    for step, adam_steps in ((first, 4.0), (second, 8.0)):
        dev, norms = step["ratio_dev"], step["grad_norm"]
        assert len(dev) == len(norms) == 4, step  # 2 epochs x 2 minibatches
        assert norms[0] > 0 or norms[1] > 0, step  # some minibatch has a gradient: the policy moves
        moved = False
        for d, g in zip(dev, norms):
            assert (d > MOVED) if moved else (d < ON_POLICY), step
            moved = moved or g > 0
        assert step["policy_adam_steps"] == [adam_steps], step
        assert step["draft_adam_steps"] == [adam_steps], step
    assert (first["policy_version"], first["engine_version"]) == (0, 0)
    assert (second["policy_version"], second["engine_version"]) == (4, 4)


def rl_updates(warm_start, tmp_path, *extra, helper: str = "rl_updates") -> list[dict]:
    """RL steps of a real RLTrainer on the warm start (tests/helpers/rl_updates.py, or
    ``helper``): what each step did."""
    hf, draft = warm_start
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    args = [
        "--config",
        os.path.join(root, "train_configs", "debug_cpu.toml"),
        "--job.dump_folder",
        str(tmp_path),
        "--model.hf_checkpoint",
        hf,
        "--draft.init_from",
        draft,
        "--draft.export_dir",
        "",
        *TASK,
        "--training.seq_len",
        "128",
        "--training.steps",
        "2",
        "--rl.prompts_per_step",
        "4",
        "--rl.group_size",
        "4",
        "--rl.max_new_tokens",
        "12",
        "--rl.baseline_interval",
        "0",
        "--rollout.progress",
        "false",
        "--checkpoint.enable",
        "false",
        "--metrics.enable_tensorboard",
        "false",
        "--lr_scheduler.warmup_steps",
        "0",
        "--speculative.depth",
        "fixed",
        *extra,  # sampled rollouts independent of the machine's timing
    ]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=1",
        os.path.join(root, f"tests/helpers/{helper}.py"),
        *args,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=root)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=root, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    line = next(x for x in out.stdout.splitlines() if f"{helper}: " in x)
    return json.loads(line.split(f"{helper}: ", 1)[1])


@pytest.mark.parametrize(
    "loss",
    [
        (
            "--rl.loss",
            "dapo",
            "--rl.clip_high",
            "0.28",
            "--rl.dapo.overlong_filter",
            "true",
            "--rl.dapo.overlong_buffer",
            "4",
        ),
        ("--rl.loss", "gspo", "--rl.clip_low", "3e-4", "--rl.clip_high", "4e-4"),
    ],
    ids=["dapo", "gspo"],
)
def test_dapo_and_gspo_run_real_rl_steps(warm_start, tmp_path, loss):
    """rl.loss = dapo (clip-higher, overlong filtering and shaping) and gspo (sequence ratios
    with the paper's clip ranges) through RLTrainer.policy_loss: two RL steps of 2 PPO epochs
    each. The first update after a push is on-policy (GSPO: every sequence ratio 1), the second
    sees the moved policy, both models' AdamW step twice per RL step. DAPO's soft overlong
    punishment is logged (rl/overlong_penalty, per completion; rl/reward stays the task's):
    equal to the paper's eq. (13) computed here from the completions' lengths."""
    steps = rl_updates(warm_start, tmp_path, "--rl.ppo_epochs", "2", *loss)
    for step, adam_steps in zip(steps, (2.0, 4.0)):
        dev = step["ratio_dev"]
        assert len(dev) == 2 and dev[0] < ON_POLICY and dev[1] > MOVED, step
        assert step["policy_adam_steps"] == step["draft_adam_steps"] == [adam_steps], step
    with open(tmp_path / "metrics.jsonl") as f:
        logged = [json.loads(line) for line in f]
    assert [r["step"] for r in logged] == [1, 2]
    for step, row in zip(steps, logged):
        if loss[1] == "dapo":  # L_max = 12, L_cache = 4, penalty 1: min(0, (8 - |y|) / 4)
            want = [min(0.0, (8 - n) / 4) for n in step["lengths"]]
            assert row["rl/overlong_penalty"] == pytest.approx(sum(want) / len(want), abs=1e-6), (row, step)
            assert row["rl/overlong_fraction"] == sum(w < 0 for w in want) / len(want)
        else:
            assert "rl/overlong_penalty" not in row


KL_TOL = 2e-5
"""|logged - independent| allowed for the per-token KL estimates: the logged ones use the
engine's fp32 behaviour log-probs and the trainer's fp32 packed forward of the reference,
the independent ones fp64 unpacked forwards (~1e-6 per token apart, see ON_POLICY); a wrong
mask, a wrong sign or the wrong policy moves them by far more (the step-2 KL is ~1e-2)."""


def test_drift_metrics_are_zero_at_the_start_and_match_an_independent_computation(warm_start, tmp_path):
    hf, draft = warm_start
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    args = [
        "--config",
        os.path.join(root, "train_configs", "debug_cpu.toml"),
        "--job.dump_folder",
        str(tmp_path),
        "--model.hf_checkpoint",
        hf,
        "--draft.init_from",
        draft,
        "--draft.export_dir",
        "",
        *TASK,
        "--training.seq_len",
        "128",
        "--training.steps",
        "2",
        "--rl.drift_metrics",
        "true",
        "--rl.minibatches",
        "2",
        "--rl.prompts_per_step",
        "4",
        "--rl.group_size",
        "4",
        "--rl.max_new_tokens",
        "12",
        "--optimizer.lr",
        "3e-4",
        "--rl.baseline_interval",
        "0",
        "--rollout.progress",
        "false",
        "--checkpoint.enable",
        "false",
        "--metrics.enable_tensorboard",
        "false",
        "--lr_scheduler.warmup_steps",
        "0",
        "--speculative.depth",
        "fixed",
    ]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=1",
        os.path.join(root, "tests/helpers/rl_drift.py"),
        *args,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=root)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=root, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    line = next(x for x in out.stdout.splitlines() if "rl_drift: " in x)
    first, second = json.loads(line.split("rl_drift: ", 1)[1])
    for step in (first, second):
        got, ref = step["logged"], step["independent"]
        assert got["drift/kl"] == pytest.approx(ref["kl"], abs=KL_TOL), step
        assert got["drift/kl_k3"] == pytest.approx(ref["kl_k3"], abs=KL_TOL), step
        assert got["rollout/completion_len"] == pytest.approx(ref["len_mean"], rel=1e-12)
        assert got["rollout/completion_len_max"] == ref["len_max"]
        lengths = ref["lengths"]  # sorted; p90 = the smallest length with >= 90% at or below it
        assert got["rollout/completion_len_p90"] == next(
            v for v in lengths if sum(x <= v for x in lengths) >= 0.9 * len(lengths)
        )
    # Before any update the policy is the starting one: both estimates vanish.
    assert abs(first["logged"]["drift/kl"]) < KL_TOL and first["logged"]["drift/kl_k3"] < KL_TOL, first
    # Two AdamW steps at lr 1e-3 later the policy has moved: k3 > 0 clearly, on the same scale as k1.
    assert second["independent"]["kl_k3"] > 50 * KL_TOL, second


def test_async_steps_train_on_the_batch_of_the_weights_one_step_older_exactly(warm_start, tmp_path):
    """rl.async_steps = 1 on a fixed schedule (tests/helpers/rl_async.py, 3 steps): the batches of
    steps 1 and 2 were generated by the starting weights W_0 (both queued at step 1) and step
    3's by W_1 (queued at step 2 while it trained): every completion token's behaviour
    log-prob is that copy's log-prob, recomputed by a fresh model, to rounding, and not the
    trainer's weights at the step (W_{t-1}, which moved). The draft was pushed with the policy
    (same versions). The updates' ratios are against those behaviour log-probs: on-policy at
    step 1's first update, off by one step's move at steps 2 and 3."""
    steps = rl_updates(warm_start, tmp_path, "--rl.async_steps", "1", "--training.steps", "3", helper="rl_async")
    assert [(s["trainer_version"], s["batch_version"], s["draft_versions"]) for s in steps] == [
        (0, 0, [0]),
        (1, 0, [0]),
        (2, 1, [1]),
    ], steps
    for s, made_by in zip(steps, (0, 0, 1)):
        gaps = s["logp_gap_by_copy"]
        assert gaps[made_by] < ON_POLICY, steps
        assert all(g > MOVED for j, g in enumerate(gaps) if j != made_by), steps
    assert steps[0]["ratio_dev"][0] < ON_POLICY, steps
    assert steps[1]["ratio_dev"][0] > MOVED and steps[2]["ratio_dev"][0] > MOVED, steps


def test_async_run_resumes_exactly_with_the_batches_in_flight(warm_start, tmp_path):
    """rl.async_steps = 1 through torchrun: staleness 0 at step 1 and 1 after it (rl/policy_lag,
    rl/draft_lag); a run stopped at its step-2 checkpoint (which saved the batch of step 3,
    generated while step 2 trained) and resumed gives the uninterrupted run's metrics, every
    one but wall-clock time, step for step."""
    every2 = ("--rl.async_steps", "1", "--checkpoint.interval", "2")
    rows = _rl(warm_start, str(tmp_path / "rl"), 4, *every2)
    assert [r["step"] for r in rows] == list(range(1, 5))
    assert [r["rl/policy_lag"] for r in rows] == [0, 1, 1, 1]
    assert [r["rl/draft_lag"] for r in rows] == [0, 1, 1, 1]
    assert [r["rl/policy_version"] for r in rows] == [0, 0, 1, 2]
    assert all(r["time/rollout_wait_s"] >= 0 for r in rows)
    dump = str(tmp_path / "resumed")
    first = _rl(warm_start, dump, 2, *every2)
    resumed = _rl(warm_start, dump, 4, *every2)[2:]
    assert [r["step"] for r in first + resumed] == list(range(1, 5))
    for a, b in zip(rows, first + resumed):
        same = {k: v for k, v in a.items() if not (k.startswith("time/") or "tokens_per_s" in k)}
        assert {k: b.get(k) for k in same} == same, a["step"]


def test_async_steps_under_data_and_context_parallelism(warm_start, tmp_path):
    """rl.async_steps = 1 on 2 processes, dp = 2 and then cp = 2 (FSDP, gloo): the generation
    threads feed their engines (under CP each rank a share of its data-parallel rank's
    completions, exchanged over the generation group from the threads) while the trainer's
    threads run the step's collectives (the weight gather, the gradient reductions, the ring
    attention, the metrics). The lags are those of one process, and the two runs trained on
    the same rollouts at both steps (a dp = 1 x cp = 2 run's generation calls are a dp = 2
    run's: the same prompts, seeds and shapes; both batches come from the starting weights)."""
    common = ("--rl.async_steps", "1", "--rl.baseline_interval", "0", "--checkpoint.enable", "false")
    runs = {
        "dp": _rl(warm_start, str(tmp_path / "dp"), 2, *common, nproc=2),
        "cp": _rl(
            warm_start,
            str(tmp_path / "cp"),
            2,
            *common,
            "--parallelism.context_parallel_degree",
            "2",
            "--parallelism.data_parallel_shard_degree",
            "1",
            nproc=2,
        ),
    }
    for rows in runs.values():
        assert [(r["step"], r["rl/policy_version"], r["rl/policy_lag"], r["rl/draft_lag"]) for r in rows] == [
            (1, 0, 0, 0),
            (2, 0, 1, 1),
        ]
    for a, b in zip(runs["dp"], runs["cp"]):
        assert (a["rl/reward"], a["rollout/tokens"], a["rollout/accept_len"]) == (
            b["rl/reward"],
            b["rollout/tokens"],
            b["rollout/accept_len"],
        )
