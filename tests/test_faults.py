"""Fault injection through the real trainer (torchrun, gloo, 2 processes, FSDP): NaN gradients,
kill -9 at a random step and during a checkpoint write, corrupted checkpoint files.

Every run trains policy + draft on ONE repeated problem (a one-line JSONL task: every step's
batch is the same) at a constant learning rate, so a run in which step k is skipped must end
with exactly the weights of a run one step shorter: the independent reference of the
finiteness guard (titan_spec/training/finite.py). The uninterrupted 4-step run is the reference of
every resume. Test hooks: TITAN_SPEC_FAULTS (nan_grad_policy@k, nan_grad_draft@k,
kill_in_checkpoint@k), read in titan_spec/training/finite.py only. Last, a process's end: a gloo
thread that runs Python as a finished rank exits (platform.exit_process).
"""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT

NPROC = 2
TOML = os.path.join(ROOT, "train_configs", "debug_cpu_sft.toml")


def _args(tmp, dump, steps):
    task = os.path.join(tmp, "one.jsonl")
    if not os.path.exists(task):
        with open(task, "w") as f:
            f.write(json.dumps({"question": "12+7?", "answer": "12+7=19 #### 19"}) + "\n")
    return [
        "--metrics.log_freq",
        "1",
        "--metrics.enable_tensorboard",
        "false",
        "--training.seq_len",
        "32",
        "--training.local_batch_size",
        "2",
        "--parallelism.data_parallel_shard_degree",
        str(NPROC),
        "--task.name",
        "jsonl",
        "--task.path",
        task,
        "--lr_scheduler.warmup_steps",
        "0",
        "--lr_scheduler.decay_ratio",
        "0",
        "--draft.enable",
        "true",
        "--draft.draft_vocab_size",
        "24",
        "--draft.eagle3.ttt_steps",
        "3",
        "--draft.vocab_count_batches",
        "1",
        "--checkpoint.interval",
        "1",
        "--training.steps",
        str(steps),
        "--job.dump_folder",
        dump,
    ]


def _cmd(argv):
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={NPROC}",
        "-m",
        "titan_spec.train",
        "--config",
        TOML,
        *argv,
    ]


def _env(**extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    env.pop("TITAN_SPEC_FAULTS", None)
    env.update(extra)
    return env


def _run(argv, **env):
    return subprocess.run(_cmd(argv), capture_output=True, text=True, timeout=600, cwd=ROOT, env=_env(**env))


def _rows(dump):
    # Strict JSON: NaN / Infinity literals are not JSON.
    def bad(token):
        raise AssertionError(f"non-JSON literal {token} in metrics.jsonl")

    with open(os.path.join(dump, "metrics.jsonl")) as f:
        return [json.loads(line, parse_constant=bad) for line in f]


def _tensors(path):
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """ONE torchrun launch of three runs: the reference (4 steps, no checkpoints); a 6-step run
    with NaN injected into both the policy's and the draft's gradients at steps 2 and 4 (on
    rank 0 only: the other rank's gradients are finite, so skipping on both ranks needs the
    global decision); a run whose draft gets NaN at steps 2 and 3 (the stop); a run at lr 1e30
    (the issue's case: finite loss, gradient norm overflowing to inf from step 2)."""
    tmp = str(tmp_path_factory.mktemp("faults"))
    ref, nan, stop, huge = (os.path.join(tmp, n) for n in ("ref", "nan", "stop", "huge"))
    faults = "nan_grad_policy@2,nan_grad_draft@2,nan_grad_policy@4,nan_grad_draft@4"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={NPROC}",
        os.path.join(ROOT, "tests/helpers/train_many.py"),
        json.dumps(
            [
                {"argv": ["--config", TOML, *_args(tmp, ref, 4), "--checkpoint.enable", "false"]},
                # Two skips, never two in a row: a limit of 2 consecutive skips must not stop it.
                {
                    "argv": [
                        "--config",
                        TOML,
                        *_args(tmp, nan, 6),
                        "--training.max_consecutive_skips",
                        "2",
                        "--checkpoint.interval",
                        "2",
                    ],
                    "env": {"TITAN_SPEC_FAULTS": faults},
                },
                {
                    "argv": ["--config", TOML, *_args(tmp, stop, 5), "--training.max_consecutive_skips", "2"],
                    "env": {"TITAN_SPEC_FAULTS": "nan_grad_draft@2,nan_grad_draft@3"},
                },
                {"argv": ["--config", TOML, *_args(tmp, huge, 8), "--optimizer.lr", "1e30"]},
            ]
        ),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=_env())
    log = out.stdout + out.stderr
    assert f"train_many: {ref} exit 0" in log, log[-6000:]  # each test checks its own run's exit
    return {"tmp": tmp, "ref": ref, "nan": nan, "stop": stop, "huge": huge, "log": log}


def test_nan_gradients_skip_the_step_and_reach_no_weights_or_checkpoint(runs):
    """A NaN in either model's gradient skips that step for it on every rank: after 6 steps with
    steps 2 and 4 skipped, the exported policy and draft equal the 4-step run's bit for bit;
    the skipped rows say so (null + nonfinite flag), and no checkpoint holds a non-finite value."""
    assert f"train_many: {runs['nan']} exit 0" in runs["log"]
    ref, nan = _rows(runs["ref"]), _rows(runs["nan"])
    assert [r["step"] for r in nan] == list(range(1, 7))
    for name in ("hf", "draft"):
        a, b = _tensors(os.path.join(runs["ref"], name)), _tensors(os.path.join(runs["nan"], name))
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), (name, k)
    for r in nan:
        skipped = r["step"] in (2, 4)
        assert (r["grad_norm"] is None) == skipped and (r["draft/grad_norm"] is None) == skipped, r
        assert (set(r.get("nonfinite", [])) == {"grad_norm", "draft/grad_norm"}) == skipped, r
    assert nan[-1]["skipped_steps"] == 2 and nan[-1]["draft/skipped_steps"] == 2
    # Step 3 of the NaN run starts from the weights after step 1 (step 2 skipped), like step 2 of
    # the reference: the same batch, so the same loss.
    assert nan[2]["loss"] == ref[1]["loss"] and nan[2]["draft/loss"] == ref[1]["draft/loss"]
    assert "step 2: the policy gradient norm is not finite" in runs["log"]
    assert "step 4: the draft gradient norm is not finite" in runs["log"]

    folder = os.path.join(runs["nan"], "checkpoint")
    assert sorted(os.listdir(folder)) == ["step-2", "step-4", "step-6"]  # right after each skip
    _assert_checkpoints_finite(folder, runs["tmp"])


def _assert_checkpoints_finite(folder, tmp):
    """Every floating tensor of every checkpoint under folder (weights, both optimizers' moments,
    the draft) is finite, read back through DCP."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    for step in sorted(os.listdir(folder)):
        out = os.path.join(tmp, f"{os.path.basename(os.path.dirname(folder))}-{step}.pt")
        dcp_to_torch_save(os.path.join(folder, step), out)
        flat = []

        def walk(x):
            if isinstance(x, torch.Tensor) and x.is_floating_point():
                flat.append(x)
            elif isinstance(x, dict):
                for v in x.values():
                    walk(v)
            elif isinstance(x, (list, tuple)):
                for v in x:
                    walk(v)

        walk(torch.load(out, weights_only=False))
        assert len(flat) > 50 and all(bool(torch.isfinite(t).all()) for t in flat), step


def test_exports_are_world_readable(runs):
    """hf/ and draft/ get the modes of any folder the run makes (0755 / 0644 under umask 022)."""
    umask = os.umask(0)
    os.umask(umask)
    for name in ("hf", "draft"):
        path = os.path.join(runs["ref"], name)
        assert os.stat(path).st_mode & 0o777 == 0o777 & ~umask, name
        for f in os.listdir(path):
            assert os.stat(os.path.join(path, f)).st_mode & 0o777 == 0o666 & ~umask, (name, f)


def test_consecutive_non_finite_steps_stop_the_run_in_one_line(runs):
    """Two draft NaNs in a row with max_consecutive_skips = 2: the run stops at step 3 with one
    line naming the step, the draft and the last good checkpoint; exit 1, no DONE, no export
    (train_and_close, the body of python -m titan_spec.train)."""
    dump = runs["stop"]
    assert f"train_many: {dump} exit 1" in runs["log"]
    lines = {ln for ln in runs["log"].splitlines() if ln.startswith("titan_spec: stopped") and dump in ln}
    assert len(lines) == 1, lines  # the same line on both ranks
    line = lines.pop()
    assert "step 3" in line and "draft" in line and "policy" not in line, line
    assert line.endswith(os.path.join(dump, "checkpoint", "step-2")), line
    assert not os.path.exists(os.path.join(dump, "DONE")) and not os.path.exists(os.path.join(dump, "hf"))
    assert [r["step"] for r in _rows(dump)] == [1, 2]  # step 3 stopped before its row


def test_huge_learning_rate_stops_before_any_non_finite_weight(runs):
    """lr 1e30: step 1 leaves huge but finite weights, from step 2 the loss stays finite but the
    gradient norm overflows (clipping alone would scale the gradients to 0 and step on); the
    guard skips steps 2-4 and stops (default limit 3) naming the policy's gradient norm, with
    every checkpoint finite and no DONE."""
    dump = runs["huge"]
    assert f"train_many: {dump} exit 1" in runs["log"]
    lines = {ln for ln in runs["log"].splitlines() if ln.startswith("titan_spec: stopped") and dump in ln}
    assert lines == {
        f"titan_spec: stopped at step 4: the policy gradient norm was not finite for 3 consecutive "
        f"steps (training.max_consecutive_skips = 3); last good checkpoint: "
        f"{os.path.join(dump, 'checkpoint', 'step-3')}"
    }, lines
    rows = _rows(dump)
    assert [r["grad_norm"] is None for r in rows] == [False, True, True]
    assert all(r["loss"] is not None for r in rows)
    assert not os.path.exists(os.path.join(dump, "DONE"))
    _assert_checkpoints_finite(os.path.join(dump, "checkpoint"), runs["tmp"])


def _same_rows(rows, ref):
    assert [r["step"] for r in rows] == [r["step"] for r in ref], rows  # each step once
    for a, b in zip(rows, ref):
        assert a == b, (a, b)


def test_kill_at_a_random_step_and_during_a_checkpoint_write_then_resume(runs, tmp_path):
    """Three attempts of the same 4-step command in one folder, then the metrics equal the
    uninterrupted run's, each step once (rows of redone steps replaced, a torn line dropped):
    1. kill -9 of every process once step k's row is written (k random, printed);
    2. rerun: it resumes and is killed (test hook) while writing the last checkpoint, step-4
       (DCP's files complete, no manifest); then random bytes go into step-3's rank-1 shard;
    3. rerun: it reports step-4 unsealed and step-3 corrupt, by name, and resumes from step-2."""
    k = random.Random().randint(2, 3)
    print(f"kill after step {k}")
    dump = str(tmp_path / "killed")
    argv = _args(runs["tmp"], dump, 4)
    proc = subprocess.Popen(_cmd(argv), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT, env=_env())
    path = os.path.join(dump, "metrics.jsonl")
    try:
        while proc.poll() is None:
            if os.path.exists(path):
                with open(path) as f:
                    if sum(1 for _ in f) >= k:
                        break
            time.sleep(0.05)
    finally:
        _kill9(proc)
    assert not os.path.exists(os.path.join(dump, "DONE"))

    out = _run(argv, TITAN_SPEC_FAULTS="kill_in_checkpoint@4")
    assert out.returncode != 0 and not os.path.exists(os.path.join(dump, "DONE"))
    ckpt = os.path.join(dump, "checkpoint")
    assert os.path.isfile(os.path.join(ckpt, "step-4", ".metadata"))
    _scribble(os.path.join(ckpt, "step-3", "__1_0.distcp"), random.Random(3))

    out = _run(argv)
    assert out.returncode == 0, out.stderr[-4000:]
    log = out.stdout + out.stderr
    assert f"checkpoint {os.path.join(ckpt, 'step-4')} is unsealed" in log
    assert f"checkpoint {os.path.join(ckpt, 'step-3')} is corrupt (__1_0.distcp does not match its checksum)" in log
    assert f"Loading the checkpoint from {os.path.join(ckpt, 'step-2')}" in log
    _same_rows(_rows(dump), _rows(runs["ref"]))
    assert os.path.isfile(os.path.join(dump, "DONE"))


def _kill9(proc):
    """SIGKILL torchrun and its workers (each in its own session, so not by process group),
    workers first so none outlives the kill."""

    def children(pid):
        try:
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                kids = [int(c) for c in f.read().split()]
        except OSError:
            return []
        return [d for c in kids for d in (c, *children(c))]

    for pid in reversed([proc.pid, *children(proc.pid)]):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def _scribble(path, rng, n=64):
    """Overwrite n bytes at a random offset with random bytes (same size)."""
    size = os.path.getsize(path)
    off = rng.randrange(0, max(size - n, 1))
    with open(path, "r+b") as f:
        f.seek(off)
        f.write(bytes(rng.randrange(256) for _ in range(min(n, size))))


def test_every_corrupted_file_is_detected_and_the_previous_checkpoint_chosen(runs, tmp_path, caplog):
    """Random bytes in each file of the newest checkpoint (.metadata and each rank's .distcp), a
    truncated or deleted file, an unsealed folder: each is reported by name and the previous
    verified checkpoint is chosen; with none verified the run stops (CheckpointCorrupt)."""
    from titan_spec.training.checkpoint import MANIFEST, CheckpointCorrupt, choose_checkpoint

    src = os.path.join(runs["nan"], "checkpoint")
    names = sorted(os.listdir(os.path.join(src, "step-6")))
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp", MANIFEST]
    rng = random.Random(0)

    def fresh(tag):
        folder = str(tmp_path / tag)
        for s in ("step-4", "step-6"):
            shutil.copytree(os.path.join(src, s), os.path.join(folder, s))
        return folder

    assert choose_checkpoint(fresh("clean")) == (6, os.path.join(str(tmp_path / "clean"), "step-6"))
    cases = {f"bytes {n}": (n, "does not match its checksum") for n in names if n != MANIFEST}
    cases.update(
        {
            "deleted .metadata": (".metadata", "is missing"),
            "truncated": ("__0_0.distcp", "bytes, not"),
            "unsealed": (MANIFEST, "unsealed"),
        }
    )
    for i, (tag, (name, why)) in enumerate(cases.items()):
        folder = fresh(f"case{i}")
        target = os.path.join(folder, "step-6", name)
        if tag.startswith("bytes"):
            _scribble(target, rng)
        elif tag == "truncated":
            os.truncate(target, os.path.getsize(target) - 1)
        else:
            os.remove(target)
        caplog.clear()
        assert choose_checkpoint(folder) == (4, os.path.join(folder, "step-4")), tag
        reports = [r.getMessage() for r in caplog.records if "not resuming from it" in r.getMessage()]
        assert len(reports) == 1 and os.path.join(folder, "step-6") in reports[0] and why in reports[0], (tag, reports)
        if tag != "unsealed" and name != MANIFEST:
            assert name in reports[0], (tag, reports)
    # Nothing verified: the run stops and says why, naming each folder.
    folder = fresh("none")
    for s in ("step-4", "step-6"):
        _scribble(os.path.join(folder, s, "__0_0.distcp"), rng)
    with pytest.raises(CheckpointCorrupt, match=r"no verified checkpoint.*step-6 corrupt.*step-4 corrupt"):
        choose_checkpoint(folder)
    # Only folders DCP never finished (a kill during the first save): a fresh start, reported.
    folder = fresh("half")
    for s in ("step-4", "step-6"):
        for n in (".metadata", MANIFEST):
            os.remove(os.path.join(folder, s, n))
    caplog.clear()
    assert choose_checkpoint(folder) == (-1, None)
    assert any("was ever completed: starting from the beginning" in r.getMessage() for r in caplog.records)


def test_rl_resume_hint_and_degenerate_reward_warning(caplog):
    """The RL stop message claims a resume only when a verified checkpoint exists; every group's
    rewards identical (all advantages 0) for DEGENERATE_WARN_STEPS steps in a row is a warning,
    and a step with signal resets the count."""
    from types import SimpleNamespace

    from titan_spec.rl.step import DEGENERATE_WARN_STEPS, RLTrainer

    none = SimpleNamespace(checkpointer=SimpleNamespace(last_verified=None))
    assert "no verified checkpoint" in RLTrainer._resume_hint(none)
    some = SimpleNamespace(checkpointer=SimpleNamespace(last_verified="/x/checkpoint/step-4"))
    assert RLTrainer._resume_hint(some).endswith("/x/checkpoint/step-4: rerun the same command to resume from it")

    t = SimpleNamespace(parallel_dims=SimpleNamespace(dp_enabled=False), _degenerate_steps=0, step=0)
    flat = torch.tensor([[1.0, 1.0], [0.0, 0.0]])  # each group identical (rewards differ across groups)
    signal_ = torch.tensor([[1.0, 0.0], [0.0, 0.0]])

    def warnings():
        return [r for r in caplog.records if "rewards were identical" in r.getMessage()]

    for i in range(DEGENERATE_WARN_STEPS - 1):
        t.step += 1
        RLTrainer._warn_if_degenerate(t, flat)
    RLTrainer._warn_if_degenerate(t, signal_)  # one step with signal: the count starts over
    for i in range(DEGENERATE_WARN_STEPS - 1):
        t.step += 1
        RLTrainer._warn_if_degenerate(t, flat)
    assert warnings() == []
    t.step += 1
    RLTrainer._warn_if_degenerate(t, flat)
    assert len(warnings()) == 1 and f"for {DEGENERATE_WARN_STEPS} steps in a row" in warnings()[0].getMessage()


def test_rl_report_skips_null_values(tmp_path):
    """A metrics row with a non-finite value (null + nonfinite) does not break the RL report."""
    from titan_spec.rl.plots import _series
    from titan_spec.rl.report import _mean, read_metrics

    rows = [
        {"step": 1, "rl/reward": 0.5},
        {"step": 2, "rl/reward": None, "nonfinite": ["rl/reward"]},
        {"step": 3, "rl/reward": 1.0},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rows = read_metrics(str(tmp_path))
    assert _mean(rows, "rl/reward") == 0.75 and _series(rows, "rl/reward") == ([1, 3], [0.5, 1.0])


def test_a_finished_process_exits_0_while_a_gloo_thread_runs_python(tmp_path):
    """platform.exit_process ends a process that ran process groups with its status, even
    when a gloo worker thread runs Python after the process's work is done (a collective's
    callback completing as it ends: tests/helpers/exit_after_collective.py). Python's own
    exit aborts that process (CI saw a finished dp = 2 run end so): the control."""

    def launch(mode):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            os.path.join(ROOT, "tests", "helpers", "exit_after_collective.py"),
            str(tmp_path / mode),
            mode,
        ]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=_env())

    control = launch("sys_exit")
    assert control.returncode != 0 and "terminate called without an active exception" in control.stderr, (
        f"Python's own exit no longer aborts here (rc {control.returncode}; a torch that fixed it?):\n"
        f"{control.stderr[-2000:]}"
    )
    out = launch("exit_process")
    assert out.returncode == 0, out.stderr[-3000:]


@pytest.fixture
def full_disk(tmp_path):
    """A dump folder whose checkpoint/ is a 256 KiB tmpfs (a checkpoint of this run is ~MBs):
    the disk is full at the first checkpoint. Needs root's right to mount (CI runs as root)."""
    dump = tmp_path / "full"
    ckpt = dump / "checkpoint"
    ckpt.mkdir(parents=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(ckpt)], capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs is not allowed here (needs root)")
    try:
        yield str(dump)
    finally:
        subprocess.run(["umount", str(ckpt)], capture_output=True)


def test_disk_full_at_a_checkpoint_is_one_line_that_says_so(full_disk, tmp_path):
    """ENOSPC while DCP writes the step-1 checkpoint: every rank stops with the same one line
    (no space left on device, the checkpoint, the last good one), exit 1, no DONE; the
    half-written folder has no manifest, so a resume passes over it."""
    out = _run(_args(str(tmp_path), full_disk, 2))
    assert out.returncode != 0
    lines = {ln for ln in (out.stdout + out.stderr).splitlines() if ln.startswith("titan_spec: writing checkpoint")}
    assert len(lines) == 1, (lines, out.stderr[-3000:])  # the same line on both ranks
    line = lines.pop()
    assert "step-1 failed: no space left on device" in line and "last good checkpoint: none yet" in line, line
    assert not os.path.exists(os.path.join(full_disk, "DONE"))
    step1 = os.path.join(full_disk, "checkpoint", "step-1")
    assert not os.path.exists(os.path.join(step1, "titan_spec_manifest.json"))
    assert [r["step"] for r in _rows(full_disk)] == [1]  # step 1 trained and logged, its checkpoint refused
