"""SIGTERM to run_train.sh's process alone (what a scheduler or some shells' Ctrl-C send) stops
the whole run: the script forwards it to torchrun, torchrun to every rank, and the script
returns only when all of them have exited; a rerun of the same command resumes from the last
verified checkpoint and logs each step once (docs/RELIABILITY.md, Signals).

The run is the SFT config on 2 CPU processes (gloo), a checkpoint every 2 steps. Before the
fix, bash died at once with 143 and torchrun trained on, orphaned: the process check fails.
"""

import json
import os
import re
import signal
import subprocess
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 30


def _children() -> dict[int, int]:
    """pid -> parent pid of every process now."""
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            out[int(d)] = int(stat[stat.rindex(")") + 2 :].split()[1])
    return out


def _descendants(pid: int) -> set[int]:
    parents, found, todo = _children(), set(), [pid]
    while todo:
        p = todo.pop()
        for c, pp in parents.items():
            if pp == p and c not in found:
                found.add(c)
                todo.append(c)
    return found


def _remember(seen: dict[int, str], pid: int) -> None:
    for c in _descendants(pid):  # the latest command line: a forked child execs its command
        seen[c] = _cmdline(c) or seen.get(c, "")


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie (a zombie has exited; its parent has not reaped it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _kill_left(seen: dict[int, str]) -> None:
    """A failed test leaves no process of its run behind: each by its pid, and only while that
    pid still runs the command it ran (a pid can be reused by someone else's process)."""
    for p, cmd in seen.items():
        if _alive(p) and _cmdline(p) == cmd:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _steps(dump) -> list[int]:
    path = os.path.join(dump, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line)["step"] for line in f if line.endswith("\n")]


def _launch(dump, log):
    env = dict(
        os.environ, CONFIG_FILE="train_configs/debug_cpu_sft.toml", NGPU="2", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1"
    )
    args = [
        "--job.dump_folder",
        str(dump),
        "--training.steps",
        str(STEPS),
        "--training.seq_len",
        "128",
        "--training.local_batch_size",
        "4",
        "--lr_scheduler.warmup_steps",
        "2",
        "--metrics.log_freq",
        "1",
        "--metrics.enable_tensorboard",
        "false",
        "--checkpoint.interval",
        "2",
    ]
    return subprocess.Popen(
        ["bash", os.path.join(ROOT, "run_train.sh"), *args],
        cwd=ROOT,
        env=env,
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=_as_from_a_terminal,
    )


def _as_from_a_terminal() -> None:
    """SIGINT and SIGTERM at their defaults, as a script started from a terminal has them: a
    suite started in the background (`./run_tests.sh &` without job control) ignores SIGINT,
    that is inherited, and bash cannot trap a signal ignored when it started."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def test_sigterm_to_run_train_stops_every_rank_and_a_rerun_resumes(tmp_path):
    dump, log = tmp_path / "run", tmp_path / "first.log"
    script = _launch(dump, log)
    seen: dict[int, str] = {}  # pid -> command line of every process the script started
    try:
        deadline = time.monotonic() + 300
        # Signalled mid-training: after a few steps (and a sealed checkpoint), long before the last.
        while len(_steps(dump)) < 5:
            assert script.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            _remember(seen, script.pid)
            time.sleep(0.2)
        _remember(seen, script.pid)
        ranks = [
            p
            for p in seen
            if _alive(p)
            and "-m titan_spec.train --config" in _cmdline(p)
            and "titan_spec.train.launch" not in _cmdline(p)
        ]
        assert len(ranks) == 2, [(p, _cmdline(p)) for p in seen]  # the signal meets a running run
        os.kill(script.pid, signal.SIGTERM)  # the script's process only, not its group
        rc = script.wait(timeout=120)
        time.sleep(0.5)  # a process the script left behind would still be running now
        left = [(p, _cmdline(p)) for p in seen if _alive(p)]
    finally:
        if script.poll() is None:  # the test failed: do not leave the run behind
            os.killpg(script.pid, signal.SIGKILL)
        _kill_left(seen)
    out = log.read_text()
    assert left == [], left  # torchrun and both ranks exited before the script returned
    assert rc == 143, out[-3000:]
    assert out.rstrip().splitlines()[-1] == (
        "run_train.sh: stopped by SIGTERM; every process of the run has exited; "
        "rerun the same command to resume from the last verified checkpoint"
    )
    stopped_at = _steps(dump)
    assert stopped_at and max(stopped_at) < STEPS and not (dump / "DONE").exists()

    # The same command again: it resumes from the newest sealed checkpoint (a save the signal
    # cut short has no manifest; training/checkpoint.py passes over it) and finishes.
    sealed = sorted(
        int(d.name.removeprefix("step-"))
        for d in (dump / "checkpoint").iterdir()
        if (d / "titan_spec_manifest.json").is_file()
    )
    assert sealed, list((dump / "checkpoint").iterdir())
    rerun_log = tmp_path / "rerun.log"
    rerun = _launch(dump, rerun_log)
    try:
        assert rerun.wait(timeout=600) == 0, rerun_log.read_text()[-3000:]
    finally:
        if rerun.poll() is None:
            os.killpg(rerun.pid, signal.SIGKILL)
    text = rerun_log.read_text()
    loaded = re.findall(r"Loading the checkpoint from \S+/step-(\d+)", text)
    assert loaded == [str(sealed[-1])], text[-3000:]
    assert _steps(dump) == list(range(1, STEPS + 1))  # each step's row once, none lost
    assert (dump / "DONE").exists()


def test_sigint_during_the_plan_stops_it_and_starts_nothing(tmp_path):
    """Ctrl-C (SIGINT) while `--plan` runs: the plan process is stopped too (a background
    command of a script ignores SIGINT, so run_train.sh passes SIGTERM on), exit 130, and no
    run of the chain starts."""
    dump, log = tmp_path / "run", tmp_path / "plan.log"
    script = _launch(dump, log)
    seen: dict[int, str] = {}  # pid -> command line of every process the script started
    try:
        deadline = time.monotonic() + 60
        while not any("--plan" in _cmdline(p) for p in seen):
            assert script.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            _remember(seen, script.pid)
            time.sleep(0.05)
        os.kill(script.pid, signal.SIGINT)
        rc = script.wait(timeout=60)
        left = [(p, _cmdline(p)) for p in seen if _alive(p)]
    finally:
        if script.poll() is None:
            os.killpg(script.pid, signal.SIGKILL)
        _kill_left(seen)
    out = log.read_text()
    assert left == [] and rc == 130, (left, out[-3000:])
    assert (
        out.rstrip().splitlines()[-1].startswith("run_train.sh: stopped by SIGINT; every process of the run has exited")
    )
    assert "titan_spec: run" not in out and not dump.exists()
