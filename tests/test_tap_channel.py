"""TapChannel over real gloo process groups (2 processes): taps arrive by microbatch tag,
local taps are used in place, and every misuse is an error naming it, never a hang."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from titan_spec.parallelisms.tap_channel import TapChannel, TapChannelError, TapLayout

SHAPE = (1, 5, 3)
# Stage 0 (rank 0) computes the embeddings (-1) and layer 1; stage 1 (rank 1, last) layer 4.
LAYOUT = TapLayout({0: (-1, 1), 1: (4,)}, {0: 0, 1: 1}, 1, SHAPE, torch.float32)


def _tap(step, mb, key):
    return torch.full(SHAPE, 1000.0 * step + 10.0 * mb + key)


CASES = ("ok", "twice", "lost", "shape")


def _case(rank, case):
    # Each case has its own channel (its own side groups), so a failed case leaves nothing behind.
    ch = TapChannel(LAYOUT, [0, 1], rank, torch.device("cpu"), timeout_s=3, all_pp_ranks=[[0, 1]])
    n = 4
    for step in (1, 2):
        ch.begin_step(n)
        if rank == 0:
            for mb in range(n):
                if case == "lost" and mb == 2:
                    continue
                ch.put(0, mb, {-1: _tap(step, mb, -1), 1: _tap(step, mb, 1)})
                if case == "twice" and mb == 1:
                    ch.put(0, mb, {-1: _tap(step, mb, -1), 1: _tap(step, mb, 1)})
                if case == "shape":
                    ch.put(0, mb + 1, {-1: torch.zeros(2, 5, 3), 1: _tap(step, mb, 1)})
        else:
            # The last stage asks in another order than the sender sent: tags sort it out.
            for mb in (2, 0, 3, 1):
                ch.put(1, mb, {4: _tap(step, mb, 4)})  # a tap computed on the last stage itself
                got = ch.take(mb)
                assert sorted(got) == [-1, 1, 4]
                for key, t in got.items():
                    assert torch.equal(t, _tap(step, mb, key)), (step, mb, key)
            assert ch.received == 3 * n
        ch.end_step()
    return "ok"


def _worker(rank, port, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    for case in CASES:
        try:
            out = _case(rank, case)
        except TapChannelError as e:
            out = str(e)
        q.put((case, rank, out))
        dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results():
    """Every case in one 2-process spawn (process start-up dominates): {(case, rank): outcome}."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    out = {}
    for _ in range(2 * len(CASES)):
        case, rank, msg = q.get(timeout=120)
        out[case, rank] = msg
    for p in procs:
        p.join(30)
        assert not p.is_alive(), "a rank hung"
    return out


def test_taps_arrive_by_microbatch_tag_over_two_steps(results):
    assert results["ok", 0] == results["ok", 1] == "ok"


@pytest.mark.parametrize(
    "case,rank,needle",
    [
        ("twice", 0, "fired 2 times for microbatch 1"),
        ("lost", 1, "microbatch 2 from pipeline stage 0"),
        ("shape", 0, "is (2, 5, 3) torch.float32, expected (1, 5, 3)"),
    ],
)
def test_misuse_is_a_clear_error_not_a_hang(results, case, rank, needle):
    assert needle in results[case, rank], results
    assert "\n" not in results[case, rank]
    # The other end is never left waiting forever: it fails within the channel's timeout.
    assert results[case, 1 - rank] != "ok", results
