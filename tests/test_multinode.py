"""run_train.sh on more than one node: every node runs the script with NNODES, its NODE_RANK and
node 0's RDZV_ENDPOINT, and the nodes meet in torchrun's c10d rendezvous (node 0 hosts it).

Here two "nodes" on this machine (127.0.0.1), one process each, run an RL job with the draft
co-trained at dp = 2, and one node with two processes runs the same job: the same two ranks
with the same seeds, the same data shards and the same gloo collectives, so every metric but
wall-clock time is the same, step for step. And the checks of the new variables: one line,
exit 2, before anything starts (no Python)."""

import json
import os
import signal
import socket
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A fresh tiny qwen3 policy and draft (no warm start: --job.requires '[]'). A fresh policy
# writes random tokens and the arithmetic task would reward none of them (zero advantages,
# no policy gradient): rl_dynamic:coin (tests/helpers/rl_dynamic.py) rewards about one in five
# by the text's CRC32, so groups have reward spread and the policy's gradients cross the nodes.
RL = (
    "--job.requires",
    "[]",
    "--model.hf_checkpoint",
    "",
    "--draft.init_from",
    "",
    "--draft.export_dir",
    "",
    "--draft.draft_vocab_size",
    "24",
    "--draft.eagle3.ttt_steps",
    "3",
    "--task.reward",
    "rl_dynamic:coin",
    "--task.seed",
    "5",
    "--training.steps",
    "3",
    "--training.seq_len",
    "128",
    "--lr_scheduler.warmup_steps",
    "1",
    "--rl.prompts_per_step",
    "4",
    "--rl.group_size",
    "4",
    "--rl.max_new_tokens",
    "12",
    "--rl.baseline_interval",
    "0",
    "--speculative.depth",
    "fixed",  # adaptive depth calibrates on the machine's timing
    "--rollout.progress",
    "false",
    "--checkpoint.enable",
    "false",
    "--metrics.log_freq",
    "1",
    "--metrics.enable_tensorboard",
    "false",
)


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("NGPU", "NNODES", "NODE_RANK", "RDZV_ENDPOINT", "RDZV_ID")}
    # One thread per process in both layouts: the same kernels, the same sums.
    return dict(
        env, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONPATH=os.path.join(ROOT, "tests", "helpers"), **extra
    )


def _start(dump: str, log: str, **env: str) -> subprocess.Popen:
    """run_train.sh in the background, its output to ``log``.out / .err (files, not pipes: a
    node blocked on a full pipe while the other is read would hold up the rendezvous)."""
    with open(log + ".out", "w") as out, open(log + ".err", "w") as err:
        return subprocess.Popen(
            ["./run_train.sh", "--job.dump_folder", dump, *RL],
            cwd=ROOT,
            env=_env(**env),
            stdout=out,
            stderr=err,
            text=True,
            start_new_session=True,
        )


def _wait(procs: dict[str, subprocess.Popen], timeout: int = 300) -> dict[str, tuple[int, str]]:
    """Each log's exit status and the tail of its output."""
    try:
        for p in procs.values():
            p.wait(timeout=timeout)
    finally:
        for p in procs.values():  # each run_train.sh leads its own session: its torchrun and ranks go with it
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    tails = {}
    for log, p in procs.items():
        with open(log + ".out") as out, open(log + ".err") as err:
            tails[log] = (p.returncode, out.read()[-3000:] + err.read()[-6000:])
    return tails


def _rows(dump: str) -> list[dict]:
    with open(os.path.join(dump, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_train_as_one_node_of_two_processes(tmp_path):
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    log = str(tmp_path / "one_node")
    ((rc, tail),) = _wait({log: _start(one, log, NGPU="2")}).values()
    assert rc == 0, tail

    # Both nodes write to one dump folder, as on a filesystem every node sees. Node 1 starts
    # first: it waits for node 0, the host of the rendezvous.
    nodes = dict(NNODES="2", NGPU="1", RDZV_ENDPOINT=f"127.0.0.1:{_free_port()}", RDZV_ID="test_multinode")
    logs = {str(tmp_path / f"node{r}"): r for r in (1, 0)}
    done = _wait({log: _start(two, log, NODE_RANK=str(r), **nodes) for log, r in logs.items()})
    for log, (rc, tail) in done.items():
        assert rc == 0, (log, tail)
        assert "node_rank is only used" not in tail, tail

    # Two nodes that had each trained alone (dp = 1) would log other token counts and losses:
    # equal rows mean one job of two ranks.
    want, got = _rows(one), _rows(two)
    assert [r["step"] for r in want] == [r["step"] for r in got] == [1, 2, 3]
    assert any(r["grad_norm"] > 0 for r in want) and all(r["draft/grad_norm"] > 0 for r in want), want
    for a, b in zip(want, got):
        same = {k: v for k, v in a.items() if not (k.startswith("time/") or "tokens_per_s" in k)}
        assert sorted(same) == sorted(k for k in b if not (k.startswith("time/") or "tokens_per_s" in k)), a["step"]
        # tolerance: none needed in practice (the same ranks run the same kernels and collectives);
        # a few float32 ulps of slack should a launch ever reorder a sum
        assert {k: b[k] for k in same} == pytest.approx(same, rel=1e-6, abs=1e-9), a["step"]


@pytest.mark.parametrize(
    "env,line",
    [
        (
            dict(NNODES="0"),
            "run_train.sh: NNODES = '0' is not allowed; it must be a positive integer (nodes in the job)",
        ),
        (
            dict(NNODES="two"),
            "run_train.sh: NNODES = 'two' is not allowed; it must be a positive integer (nodes in the job)",
        ),
        (
            dict(NNODES="2", NODE_RANK="2", RDZV_ENDPOINT="127.0.0.1:29500"),
            "run_train.sh: NODE_RANK = '2' is not allowed; it must be an integer from 0 to NNODES-1 = 1 (this node's index)",
        ),
        (
            dict(NODE_RANK="-1"),
            "run_train.sh: NODE_RANK = '-1' is not allowed; it must be an integer from 0 to NNODES-1 = 0 (this node's index)",
        ),
        (
            dict(NNODES="2"),
            "run_train.sh: RDZV_ENDPOINT = '' is not allowed; with NNODES = 2 it must be host:port, "
            "node 0's address and a port free there (e.g. 10.0.0.1:29500), the same on every node",
        ),
        (
            dict(NNODES="2", NODE_RANK="1", RDZV_ENDPOINT="127.0.0.1:99999"),
            "run_train.sh: RDZV_ENDPOINT = '127.0.0.1:99999' is not allowed; with NNODES = 2 it must be host:port, "
            "node 0's address and a port free there (e.g. 10.0.0.1:29500), the same on every node",
        ),
        (
            dict(NNODES="2", RDZV_ENDPOINT="127.0.0.1:29500", RDZV_ID="my job"),
            "run_train.sh: RDZV_ID = 'my job' is not allowed; it must be letters, digits, '.', '_' or '-', the same on every node",
        ),
    ],
    ids=[
        "nnodes_zero",
        "nnodes_word",
        "node_rank_past_nnodes",
        "node_rank_negative",
        "no_endpoint",
        "bad_port",
        "rdzv_id_space",
    ],
)
def test_run_train_rejects_bad_node_settings_before_python(env, line, tmp_path):
    """Like NGPU (tests/test_plan_validation.py): the variable named with what is allowed, exit 2,
    before the environment set-up and the plan."""
    out = subprocess.run(
        ["bash", "run_train.sh", "--job.dump_folder", str(tmp_path / "never")],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
        env=_env(**env),
    )
    assert out.returncode == 2, out.stderr
    assert out.stdout == ""
    assert out.stderr.splitlines() == [line]
    assert not (tmp_path / "never").exists()
