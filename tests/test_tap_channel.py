"""TapChannel over real gloo process groups (2 processes): taps arrive by microbatch tag,
local taps are used in place, and every misuse is a one-line error naming it on one end
while the other end fails with its own error, never a hang.

Shape legend: B = microbatch rows, L = row length, D = model dim (SHAPE_BLD).

Timing guarantees the test relies on (none of them a wall-clock race):
- the processes meet through a FileStore in tmp_path (no port is picked and released);
  gloo's own sockets are bound by the OS;
- every wait whose data is sent runs under T_LONG (60 s), which no loaded machine reaches;
- only a wait whose data is never sent runs under T_SHORT: that it times out is certain,
  T_SHORT only chooses how soon. The surviving end learns that its peer failed through the
  world group (an all-gather) before it lowers ``timeout_s`` for that wait.
"""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from titan_spec.parallelisms.tap_channel import TapChannel, TapChannelError, TapLayout
from titan_spec.platform import exit_process

SHAPE_BLD = (1, 5, 3)
# Stage 0 (rank 0) computes the embeddings (-1) and layer 1; stage 1 (rank 1, last) layer 4.
LAYOUT = TapLayout({0: (-1, 1), 1: (4,)}, {0: 0, 1: 1}, 1, SHAPE_BLD, torch.float32)
T_LONG, T_SHORT = 60.0, 0.5
N = 2  # microbatches per step in the misuse cases


def _tap(step, mb, key):
    return torch.full(SHAPE_BLD, 1000.0 * step + 10.0 * mb + key)


def _taps(step, mb):
    return {-1: _tap(step, mb, -1), 1: _tap(step, mb, 1)}


def _wire(step, mb):
    """The sender's taps of (step, mb) in slot order, as the channel's low-level send takes them."""
    return [(-1, _tap(step, mb, -1)), (1, _tap(step, mb, 1))]


def _outcome(fn):
    """'ok', or the error's text; an error that is not a TapChannelError keeps its type."""
    try:
        fn()
        return "ok"
    except TapChannelError as e:
        return str(e)
    except Exception as e:  # a mutated channel may fail otherwise: visible, not a pass
        return f"{type(e).__name__}: {e}"


# --- the good path: both ends concurrently, two steps, taps asked in another order -----------


def _ok(rank):
    ch = TapChannel(LAYOUT, [0, 1], rank, torch.device("cpu"), timeout_s=T_LONG, all_pp_ranks=[[0, 1]])
    n = 4
    for step in (1, 2):
        ch.begin_step(n)
        if rank == 0:
            for mb in range(n):
                ch.put(0, mb, _taps(step, mb))
        else:
            for mb in (2, 0, 3, 1):  # tags sort it out
                ch.put(1, mb, {4: _tap(step, mb, 4)})  # a tap computed on the last stage itself
                got = ch.take(mb)
                assert sorted(got) == [-1, 1, 4]
                for key, t in got.items():
                    assert torch.equal(t, _tap(step, mb, key)), (step, mb, key)
            assert ch.received == 3 * n
        ch.end_step()


# --- misuse cases: what the sender (rank 0) and the receiver (rank 1) do in one step ---------
# A good sender sends every microbatch; a good receiver takes every one. Each case breaks one
# end. A sender that fails never sends microbatch 1: the receiver then asks for it first, so
# its wait is certain to time out (and no wait under T_SHORT is one for data that is sent).


def _send_all(ch, step):
    for mb in range(N):
        ch.put(0, mb, _taps(step, mb))


def _take(ch, step, order=range(N)):
    for mb in order:
        ch.put(1, mb, {4: _tap(step, mb, 4)})
        got = ch.take(mb)
        for key, t in got.items():
            assert torch.equal(t, _tap(step, mb, key)), (step, mb, key)


def _send_twice(ch, step):
    ch.put(0, 0, _taps(step, 0))
    ch.put(0, 0, _taps(step, 0))


def _send_lost(ch, step):
    ch.put(0, 0, _taps(step, 0))  # microbatch 1's tap hook never runs


def _send_misshaped(ch, step):
    ch.put(0, 0, {-1: torch.zeros(2, 5, 3), 1: _tap(step, 0, 1)})


def _send_out_of_range(ch, step):
    ch.put(0, N, _taps(step, N))


def _send_wrong_keys(ch, step):
    ch.put(0, 0, {-1: _tap(step, 0, -1), 2: _tap(step, 0, 1)})


def _raw(ch, step, mb, header_step=None, header_mb=None, tensors=None):
    """Microbatch ``mb``'s tags, with a header and tensors that bypass ``put``'s checks."""
    tensors = _wire(step, mb) if tensors is None else tensors
    header = ch._header(
        step if header_step is None else header_step, mb if header_mb is None else header_mb, 0, 1, tensors
    )
    ch._send(0, mb, header, tensors)


def _raw_step(ch, step, **kw):
    """A raw send of microbatch 0 (bent by ``kw``), the others as ``put`` sends them."""
    _raw(ch, step, 0, **kw)
    for mb in range(1, N):
        ch.put(0, mb, _taps(step, mb))
    ch._fired[0, 0] = 1  # microbatch 0 went out raw: end_step's firing count is not what is tested


def _send_stale(ch, step):
    _raw_step(ch, step, header_step=step - 1)  # the previous step's header


def _send_reordered(ch, step):
    _raw(ch, step, 0, header_mb=1, tensors=_wire(step, 1))  # microbatch 1's taps where 0 is expected
    _raw(ch, step, 1, header_mb=0, tensors=_wire(step, 0))
    ch._fired[0, 0] = ch._fired[0, 1] = 1


def _send_raw_misshaped(ch, step):
    # Same byte size as (1, 5, 3): gloo would abort the process on any other size.
    _raw_step(ch, step, tensors=[(-1, _tap(step, 0, -1).view(5, 1, 3)), (1, _tap(step, 0, 1))])


def _send_raw_dtype(ch, step):
    _raw_step(ch, step, tensors=[(-1, _tap(step, 0, -1)), (1, torch.zeros(2, 5, 3, dtype=torch.bfloat16))])


def _send_raw_keys(ch, step):
    _raw_step(ch, step, tensors=[(-1, _tap(step, 0, -1)), (2, _tap(step, 0, 1))])


def _take_untaken(ch, step):
    ch.put(1, 1, {4: _tap(step, 1, 4)})  # microbatch 1 runs through the last stage ...
    _take(ch, step, order=[0])  # ... but its draft loss never asks for its taps


def _take_out_of_range(ch, step):
    _take(ch, step)
    ch.take(N)


# case -> (sender, receiver, warm-up steps, rank whose error names the misuse, needle)
CASES = {
    "twice": (_send_twice, _take, 0, 0, "fired 2 times for microbatch 0 in step 1"),
    # The receiver's error for a lost microbatch is OTHER[0]: a timeout that names it.
    "lost": (_send_lost, _take, 0, 0, f"fired [1, 0] times for microbatches 0..{N - 1} in step 1"),
    "shape_at_sender": (
        _send_misshaped,
        _take,
        0,
        0,
        "tap -1 of microbatch 0 on stage 0 is (2, 5, 3) torch.float32, expected (1, 5, 3) torch.float32",
    ),
    "range_at_sender": (_send_out_of_range, _take, 0, 0, f"microbatch {N} is outside 0..{N - 1} of this step"),
    "keys_at_sender": (
        _send_wrong_keys,
        _take,
        0,
        0,
        "pipeline stage 0 computed taps [-1, 2] for microbatch 0, but the layout expects [-1, 1]",
    ),
    "stale": (
        _send_stale,
        _take,
        1,
        1,
        "expected step 2 microbatch 0 from stage 0 (fired once), got step 1 microbatch 0 from stage 0 (fired 1)",
    ),
    "reordered": (
        _send_reordered,
        _take,
        0,
        1,
        "expected step 1 microbatch 0 from stage 0 (fired once), got step 1 microbatch 1 from stage 0 (fired 1)",
    ),
    "shape_at_receiver": (
        _send_raw_misshaped,
        _take,
        0,
        1,
        "tap -1 of microbatch 0 from stage 0 arrived as (5, 1, 3) torch.float32, expected (1, 5, 3) torch.float32",
    ),
    "dtype_at_receiver": (
        _send_raw_dtype,
        _take,
        0,
        1,
        "tap 1 of microbatch 0 from stage 0 arrived as (2, 5, 3) torch.bfloat16, expected (1, 5, 3) torch.float32",
    ),
    "keys_at_receiver": (
        _send_raw_keys,
        _take,
        0,
        1,
        "pipeline stage 0 sent taps [-1, 2] for microbatch 0, but the last stage's layout expects [-1, 1]",
    ),
    "untaken": (_send_all, _take_untaken, 0, 1, "the taps of microbatches [1] were never used by the draft loss"),
    "range_at_receiver": (_send_all, _take_out_of_range, 0, 1, f"take(microbatch {N}) is outside 0..{N - 1} of step 1"),
}
# The other end's error: the receiver waits for a microbatch the sender never sent (it takes
# microbatch 1 first: no send of the failing step reaches it); the sender's next step is never
# received.
OTHER = {
    0: f"the header of microbatch 1 from pipeline stage 0 (peer rank 0) failed or did not complete within "
    f"{T_SHORT:g}s: ",
    1: f"sending microbatch 0 of pipeline stage 0 (peer rank 1) failed or did not complete within {T_SHORT:g}s: ",
}


def _agree(failed: bool) -> list[bool]:
    """Each rank's ``failed``, over the world group (long timeout): the order between the ends."""
    every = [None, None]
    dist.all_gather_object(every, failed)
    return every


def _misuse(rank, case):
    """One step in a fixed order: the sender's whole step (sends posted and waited), then the
    receiver's; then, if the receiver failed, the sender's next step (that nobody receives)."""
    send, take, warm, _, _ = CASES[case]
    ch = TapChannel(LAYOUT, [0, 1], rank, torch.device("cpu"), timeout_s=T_LONG, all_pp_ranks=[[0, 1]])
    for step in range(1, warm + 1):  # good steps first (the stale case needs a previous step)
        ch.begin_step(N)
        if rank == 0:
            _send_all(ch, step)
        else:
            _take(ch, step)
        ch.end_step()
    step = warm + 1
    ch.begin_step(N)  # the receiver's irecvs are posted here, so the sender's sends complete

    def sender_step():
        send(ch, step)
        ch.end_step()

    def receiver_step():
        if sender_failed:
            # A failed sender never sent microbatch 1 (see CASES): this wait cannot succeed.
            ch.timeout_s = T_SHORT
            _take(ch, step, order=[1, 0])
        else:
            take(ch, step)
        ch.end_step()

    def next_sender_step():
        ch.timeout_s = T_SHORT  # the receiver is gone: no irecv will match these sends
        ch.begin_step(N)
        _send_all(ch, step + 1)
        ch.end_step()

    out = _outcome(sender_step) if rank == 0 else "ok"
    sender_failed = _agree(out != "ok")[0]
    if rank == 1:
        out = _outcome(receiver_step)
    receiver_failed = _agree(out != "ok")[1]
    if rank == 0 and out == "ok" and receiver_failed:
        out = _outcome(next_sender_step)
    return out


def _worker(rank, store_path, q):
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    q.put(("ok", rank, _outcome(lambda: _ok(rank))))
    dist.barrier()
    for case in CASES:
        q.put((case, rank, _misuse(rank, case)))
        dist.barrier()
    exit_process(0)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every case in one 2-process spawn (process start-up dominates): {(case, rank): outcome}."""
    store = str(tmp_path_factory.mktemp("tap_channel") / "store")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, store, q)) for r in range(2)]
    for p in procs:
        p.start()
    out = {}
    for _ in range(2 * (len(CASES) + 1)):
        case, rank, msg = q.get(timeout=300)
        out[case, rank] = msg
    for p in procs:
        p.join(60)
        assert not p.is_alive(), "a rank hung"
        assert p.exitcode == 0
    return out


def test_taps_arrive_by_microbatch_tag_over_two_steps(results):
    assert results["ok", 0] == results["ok", 1] == "ok", results


@pytest.mark.parametrize("case", list(CASES))
def test_misuse_is_a_clear_error_on_both_ends(results, case):
    _, _, _, rank, needle = CASES[case]
    named, other = results[case, rank], results[case, 1 - rank]
    assert named.startswith("TapChannel: ") and needle in named, (case, named)
    assert "\n" not in named
    # The other end is never left waiting: its own one-line error, after T_SHORT.
    assert other.startswith("TapChannel: " + OTHER[rank]), (case, other)
    assert "\n" not in other
