"""titan_spec.train.launch, the torchrun run_train.sh starts: a rank that stopped with its one line
(titan_spec.train.launch.report_stop) has that line printed once by the launcher, whichever rank
stopped first, and nothing more (torchrun's own ChildFailedError report is ~50 lines, a
traceback of a stop that was handled); a rank that crashed adds one line naming the rank, its
exit code and its error; a rank killed by a signal the same, with 128 + the signal as exit status."""

import os
import signal
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _launch(tmp_path, body: str, nproc: int = 2) -> subprocess.CompletedProcess:
    script = tmp_path / "rank.py"
    script.write_text(
        "from torch.distributed.elastic.multiprocessing.errors import record\n"
        "import os, signal, sys\n@record\ndef main():\n" + body + "\nmain()\n"
    )
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "titan_spec.train.launch",
            "--standalone",
            f"--nproc_per_node={nproc}",
            "--local-ranks-filter",
            "0",
            "--role",
            "rank",
            "--tee",
            "3",
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )


def _ours(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("titan_spec:")]


def test_a_crashed_rank_is_one_line_naming_it(tmp_path):
    out = _launch(tmp_path, "    if os.environ['RANK'] == '1':\n        raise KeyError('boom')")
    assert out.returncode == 1
    assert _ours(out.stderr) == ["titan_spec: rank 1 exited with code 1: KeyError: 'boom' (its output: LOG_RANK=1)"], (
        out.stderr
    )
    assert "ChildFailedError" not in out.stderr and "Root Cause" not in out.stderr


def test_a_rank_killed_by_a_signal_is_one_line_and_128_plus_it(tmp_path):
    out = _launch(tmp_path, "    os.kill(os.getpid(), signal.SIGKILL)", nproc=1)
    assert out.returncode == 128 + signal.SIGKILL
    lines = _ours(out.stderr)
    assert len(lines) == 1 and lines[0].startswith("titan_spec: rank 0 exited with code -9: Signal 9 (SIGKILL)"), (
        out.stderr
    )


def test_the_line_of_a_rank_that_stopped_first_is_printed_once(tmp_path):
    """Rank 1 stops at once; rank 0, slower, is stopped by torchrun before it could print its own
    line (what a loaded machine did to a config error): the launcher prints rank 1's."""
    out = _launch(
        tmp_path,
        "    from titan_spec.train.launch import report_stop\n"
        "    import time\n"
        "    if os.environ['RANK'] == '0':\n        time.sleep(60)\n"
        "    report_stop('titan_spec: stopped on purpose')\n    sys.exit(3)",
    )
    assert out.returncode == 3, out.stderr
    assert _ours(out.stderr) == ["titan_spec: stopped on purpose"], out.stderr
    assert "ChildFailedError" not in out.stderr and "Root Cause" not in out.stderr


def test_a_stop_the_rank_handled_adds_nothing(tmp_path):
    """The finiteness guard's stop, through run_train.sh on the SFT config: its one line is all."""
    env = dict(
        os.environ,
        CONFIG_FILE="train_configs/debug_cpu_sft.toml",
        TITAN_SPEC_FAULTS=",".join(f"nan_grad_policy@{s}" for s in (2, 3, 4)),
    )
    out = subprocess.run(
        ["./run_train.sh", "--job.dump_folder", str(tmp_path / "run"), "--training.steps", "6"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=env,
    )
    assert out.returncode == 1, out.stderr[-3000:]
    noise = [ln for ln in out.stderr.splitlines() if "Warning" not in ln and "_rng_tracker" not in ln and ln.strip()]
    assert len(noise) == 1 and noise[0].startswith("titan_spec: stopped at step 4:"), out.stderr[-3000:]


def test_a_config_error_found_by_the_ranks_is_their_one_line(tmp_path):
    """run_train.sh runs a chain's later runs without a separate `--check` process: each rank
    checks its config first (titan_spec.train main: load_config, validate_run) and a config
    error is one line, exit 2, before anything is written."""
    dump = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")  # as run_train.sh sets it (else torchrun's banner)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "titan_spec.train.launch",
            "--standalone",
            "--nproc_per_node=2",
            "--local-ranks-filter",
            "0",
            "--role",
            "rank",
            "--tee",
            "3",
            "-m",
            "titan_spec.train",
            "--config",
            "train_configs/debug_cpu_sft.toml",
            "--job.dump_folder",
            str(dump),
            "--training.steps",
            "x",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=env,
    )
    assert out.returncode == 2, out.stderr[-3000:]
    lines = [ln for ln in out.stderr.splitlines() if ln.strip() and "Warning" not in ln and "warn" not in ln]
    assert lines == [
        "titan_spec: config error: command line --training.steps: training.steps = 'x' "
        "has the wrong type; it must be an integer"
    ], out.stderr[-3000:]
    assert not dump.exists()
