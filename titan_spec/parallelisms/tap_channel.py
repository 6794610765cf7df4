"""TapChannel: each microbatch's tapped target features reach the draft on the last pipeline stage.

Under pipeline parallelism the tap layers (and the token embeddings) live on other stages
than the draft, which sits whole on the last stage. Sending them inside the schedule's own
point-to-point traffic would interleave with it (a blocking send inside a stage forward
deadlocks on gloo), so the channel has side process groups of its own: one per pipeline
stage that computes taps and is not on the last stage's rank, joining that stage's rank
and the last stage's rank. A stage forwards its microbatches in order in every schedule,
so each side group carries one ordered stream (what NCCL, which ignores tags, needs).

Per microbatch and tapping stage:

  sender    ``put`` (the stage's tap hook, after its forward): a header and one isend per
            tap, detached, non-blocking; the sends are waited for in ``end_step``.
  receiver  ``begin_step`` posts the irecvs of every microbatch before the schedule runs;
            ``take(mb)`` (right before that microbatch's draft loss) waits for them, checks
            the header and hands the taps over, dropping the channel's references.

Taps that a stage on the last stage's rank computes are used in place (no copy, no send).
The header is (step, microbatch, stage, firing count) and, per tap in slot order, (key,
dtype code, B, L, D) in an int64 tensor whose size the layout fixes, so a hook that fires
twice, a lost, reordered or stale microbatch, and taps whose keys, shape or dtype differ
from the receiver's layout (two ranks that disagree on it) are a ``TapChannelError`` that
names it. Every tap is checked against the static layout before it is sent (gloo aborts
the process on a size mismatch rather than raising: the header check can only see a wrong
shape or dtype of the same byte size), and a peer that never sends or never receives is an
error after ``timeout_s``: never a hang.
"""

from __future__ import annotations

import datetime
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["TapChannel", "TapChannelError", "TapLayout"]

_HEADER = 4  # step, microbatch, stage, firing count
_PER_TAP = 5  # key, dtype code, B, L, D
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
"""dtype codes in the header (index; -1 for any other dtype)."""


def _dtype_code(dtype: torch.dtype) -> int:
    return _DTYPES.index(dtype) if dtype in _DTYPES else -1


def _dtype_name(code: int) -> str:
    return str(_DTYPES[code]) if 0 <= code < len(_DTYPES) else f"dtype code {code}"


class TapChannelError(RuntimeError):
    """Taps lost, duplicated, reordered, mis-shaped or late: one line naming which."""


@dataclass(frozen=True)
class TapLayout:
    """Which pipeline stage computes which taps; the same on every rank."""

    stage_keys: dict[int, tuple[int, ...]]
    """Virtual stage -> the tap keys it computes (layer ids, EMBEDS_TAP for the embeddings);
    only stages that compute taps appear."""

    stage_rank: dict[int, int]
    """Virtual stage -> pipeline rank that runs it (every stage)."""

    last_stage: int
    """The stage that holds the draft."""

    shape_BLD: tuple[int, int, int]
    """Shape of every tap of one microbatch."""

    dtype: torch.dtype
    """dtype of every tap (the activation dtype)."""

    @property
    def last_rank(self) -> int:
        return self.stage_rank[self.last_stage]

    @property
    def keys(self) -> tuple[int, ...]:
        return tuple(sorted(k for keys in self.stage_keys.values() for k in keys))

    def remote_stages(self) -> list[int]:
        """Tapping stages that are not on the last stage's rank (they send)."""
        return sorted(s for s in self.stage_keys if self.stage_rank[s] != self.last_rank)


class TapChannel:
    def __init__(
        self,
        layout: TapLayout,
        pp_ranks: list[int],
        pp_rank: int,
        device,
        timeout_s: float,
        all_pp_ranks: list[list[int]],
    ):
        """Collective over the whole world (every rank, the same arguments but its own
        ``pp_ranks``/``pp_rank``): creates the side groups. ``pp_ranks`` are the global
        ranks of this rank's pipeline, by pipeline rank; ``all_pp_ranks`` are those of
        every pipeline (pp x dp / pp x cp), in one order on every rank."""
        self.layout, self.pp_rank, self.device = layout, pp_rank, device
        self.timeout_s = timeout_s
        """How long each wait of the channel lasts before it raises (the side groups' timeout;
        a test lowers it only for a wait whose data is never sent)."""
        self.is_receiver = pp_rank == layout.last_rank
        timeout = datetime.timedelta(seconds=timeout_s)
        self.groups: dict[int, dist.ProcessGroup] = {}
        self.peer: dict[int, int] = {}  # stage -> global rank of the other end
        for ranks in all_pp_ranks:  # every rank creates every group, in the same order
            for s in layout.remote_stages():
                pair = [ranks[layout.stage_rank[s]], ranks[layout.last_rank]]
                group = dist.new_group(pair, timeout=timeout)
                if ranks == pp_ranks and pp_rank in (layout.stage_rank[s], layout.last_rank):
                    self.groups[s] = group
                    self.peer[s] = pair[1] if pp_rank == layout.stage_rank[s] else pair[0]
        self.step = 0
        self.n_microbatches = 0
        self._fired: Counter = Counter()  # (stage, mb) -> tap hook firings this step
        self._sends: list = []  # (stage, mb, work, tensor): alive until end_step
        self._recvs: dict[int, dict[int, tuple]] = {}  # mb -> stage -> (header work, header, [(key, work, buf)])
        self._local: dict[int, dict[int, torch.Tensor]] = {}  # mb -> taps computed on this rank
        self.received = 0  # taps delivered to the draft in the last step

    # --- tags: unique per (microbatch, slot) within a side group ---------------------------

    def _tag(self, stage: int, mb: int, slot: int) -> int:
        return mb * (len(self.layout.stage_keys[stage]) + 1) + slot

    # --- per step -----------------------------------------------------------------------

    def begin_step(self, n_microbatches: int) -> None:
        """Before the schedule runs: the last stage posts every microbatch's irecvs."""
        self.step += 1
        self.n_microbatches = n_microbatches
        self._fired.clear()
        self.received = 0
        if not self.is_receiver:
            return
        L = self.layout
        for mb in range(n_microbatches):
            per_stage = {}
            for s in L.remote_stages():
                group, peer = self.groups[s], self.peer[s]
                header = torch.empty(self._header_size(s), dtype=torch.int64, device=self.device)
                hwork = dist.irecv(header, peer, group=group, tag=self._tag(s, mb, 0))
                bufs = []
                for slot, key in enumerate(L.stage_keys[s], start=1):
                    buf = torch.empty(L.shape_BLD, dtype=L.dtype, device=self.device)
                    bufs.append((key, dist.irecv(buf, peer, group=group, tag=self._tag(s, mb, slot)), buf))
                per_stage[s] = (hwork, header, bufs)
            self._recvs[mb] = per_stage

    def put(self, stage: int, mb: int, taps: dict[int, torch.Tensor]) -> None:
        """The tap hook of ``stage`` after its forward of microbatch ``mb``."""
        L = self.layout
        self._fired[stage, mb] += 1
        if self._fired[stage, mb] > 1:
            raise TapChannelError(
                f"TapChannel: the tap hook of pipeline stage {stage} fired {self._fired[stage, mb]} times "
                f"for microbatch {mb} in step {self.step}; it must fire exactly once per microbatch"
            )
        if not 0 <= mb < self.n_microbatches:
            raise TapChannelError(f"TapChannel: microbatch {mb} is outside 0..{self.n_microbatches - 1} of this step")
        want = L.stage_keys.get(stage, ())
        if tuple(sorted(taps)) != want:
            raise TapChannelError(
                f"TapChannel: pipeline stage {stage} computed taps {sorted(taps)} for microbatch {mb}, "
                f"but the layout expects {list(want)}"
            )
        for key, t in taps.items():
            if tuple(t.shape) != L.shape_BLD or t.dtype != L.dtype:
                raise TapChannelError(
                    f"TapChannel: tap {key} of microbatch {mb} on stage {stage} is {tuple(t.shape)} {t.dtype}, "
                    f"expected {L.shape_BLD} {L.dtype} (the static stage metadata)"
                )
        if self.pp_rank == L.last_rank:
            self._local.setdefault(mb, {}).update({k: t.detach() for k, t in taps.items()})
            return
        tensors = [(key, taps[key]) for key in L.stage_keys[stage]]
        self._send(stage, mb, self._header(self.step, mb, stage, self._fired[stage, mb], tensors), tensors)

    # --- the wire: no checks (``put`` checks first; a test crafts bad messages with these) ---

    def _header_size(self, stage: int) -> int:
        return _HEADER + _PER_TAP * len(self.layout.stage_keys[stage])

    def _header(self, step: int, mb: int, stage: int, fired: int, tensors) -> torch.Tensor:
        """The header of one microbatch's ``tensors`` [(key, tap)] (3-d taps, slot order)."""
        fields = [step, mb, stage, fired]
        for key, t in tensors:
            fields += [key, _dtype_code(t.dtype), *t.shape]
        return torch.tensor(fields, dtype=torch.int64, device=self.device)

    def _send(self, stage: int, mb: int, header: torch.Tensor, tensors) -> None:
        """isend ``header`` and ``tensors`` [(key, tap)] on microbatch ``mb``'s tags, by slot."""
        group, peer = self.groups[stage], self.peer[stage]
        self._sends.append((stage, mb, dist.isend(header, peer, group=group, tag=self._tag(stage, mb, 0)), header))
        for slot, (_, t) in enumerate(tensors, start=1):
            t = t.detach().contiguous()
            self._sends.append((stage, mb, dist.isend(t, peer, group=group, tag=self._tag(stage, mb, slot)), t))

    def take(self, mb: int) -> dict[int, torch.Tensor]:
        """All taps of microbatch ``mb`` on the last stage (before its draft loss)."""
        if not 0 <= mb < self.n_microbatches:
            raise TapChannelError(
                f"TapChannel: take(microbatch {mb}) is outside 0..{self.n_microbatches - 1} of step {self.step}"
            )
        out = self._local.pop(mb, {})
        for s, (hwork, header, bufs) in sorted(self._recvs.pop(mb, {}).items()):
            self._wait(hwork, f"the header of microbatch {mb} from pipeline stage {s}", s)
            self._check_header(mb, s, [int(x) for x in header.tolist()])
            for key, work, buf in bufs:
                self._wait(work, f"tap {key} of microbatch {mb} from pipeline stage {s}", s)
                out[key] = buf
        missing = sorted(set(self.layout.keys) - set(out))
        if missing:
            raise TapChannelError(
                f"TapChannel: taps {missing} of microbatch {mb} never reached the last stage in step {self.step} "
                "(asked twice, or a stage skipped its tap hook)"
            )
        self.received += len(out)
        return out

    def _check_header(self, mb: int, s: int, got: list[int]) -> None:
        """The header that arrived on microbatch ``mb``'s tag from stage ``s`` is the one this
        step expects, for the taps this rank's layout expects."""
        L = self.layout
        if tuple(got[:_HEADER]) != (self.step, mb, s, 1):
            raise TapChannelError(
                f"TapChannel: expected step {self.step} microbatch {mb} from stage {s} (fired once), got "
                f"step {got[0]} microbatch {got[1]} from stage {got[2]} (fired {got[3]}): taps lost, stale or reordered"
            )
        taps = [got[i : i + _PER_TAP] for i in range(_HEADER, len(got), _PER_TAP)]
        keys = [t[0] for t in taps]
        if keys != list(L.stage_keys[s]):
            raise TapChannelError(
                f"TapChannel: pipeline stage {s} sent taps {keys} for microbatch {mb}, "
                f"but the last stage's layout expects {list(L.stage_keys[s])}"
            )
        want = (_dtype_code(L.dtype), *L.shape_BLD)
        for key, *dtype_shape in taps:
            if tuple(dtype_shape) != want:
                raise TapChannelError(
                    f"TapChannel: tap {key} of microbatch {mb} from stage {s} arrived as {tuple(dtype_shape[1:])} "
                    f"{_dtype_name(dtype_shape[0])}, expected {L.shape_BLD} {L.dtype} (the last stage's layout)"
                )

    def end_step(self) -> None:
        """After the schedule: every send completed, every microbatch taken exactly once."""
        sends, self._sends = self._sends, []
        for stage, mb, work, _ in sends:
            self._wait(work, f"sending microbatch {mb} of pipeline stage {stage}", stage)
        my_stages = [s for s in self.layout.stage_keys if self.layout.stage_rank[s] == self.pp_rank]
        for s in my_stages:
            fired = [self._fired[s, mb] for mb in range(self.n_microbatches)]
            if fired != [1] * self.n_microbatches:
                raise TapChannelError(
                    f"TapChannel: the tap hook of pipeline stage {s} fired {fired} times for microbatches "
                    f"0..{self.n_microbatches - 1} in step {self.step}; it must fire once for each"
                )
        left = sorted(set(self._recvs) | set(self._local))
        self._recvs.clear()
        self._local.clear()
        if left:
            raise TapChannelError(f"TapChannel: the taps of microbatches {left} were never used by the draft loss")

    def _wait(self, work, what: str, stage: int) -> None:
        try:
            work.wait(datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as e:
            raise TapChannelError(
                f"TapChannel: {what} (peer rank {self.peer.get(stage)}) failed or did not complete within "
                f"{self.timeout_s:g}s: {str(e).splitlines()[0][:200]}"
            ) from e
