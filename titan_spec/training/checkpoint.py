"""Checkpoint integrity: torchtitan's DCP checkpointer, each checkpoint sealed by a manifest.

torchtitan 0.3.0 already skips a half-written checkpoint: DCP writes ``.metadata`` last, and
``CheckpointManager._find_load_step`` only considers ``step-N`` folders that hold one. That
check is silent, and it trusts whatever bytes the folder holds (random bytes in a ``.distcp``
load into an optimizer moment; a deleted ``.metadata`` silently resumes an older step).
``VerifiedCheckpointManager`` builds on it in one place, the same two seams:

- ``dcp_save`` (every save, the final one included): once DCP has written every file of
  ``step-N`` (all ranks; ``.metadata`` last), the files' sizes and SHA-256 digests go into
  ``step-N/MANIFEST`` (``titan_spec_manifest.json``), written last and atomically (temporary
  file, fsync, rename, fsync of the folder). A folder without it was never completed (or
  predates manifests).
  Async saves are sealed when torchtitan waits for them (``_wait_for_saving``).
- ``_find_load_step`` (resume): the newest ``step-N`` folder is verified against its
  manifest; one that is incomplete (neither .metadata nor manifest: DCP never finished it),
  unsealed (.metadata but no manifest) or corrupt (a listed file missing, of another size or
  another digest) is reported by name in one line and the previous one is tried. With step
  folders but none verified the run stops (``CheckpointCorrupt``, one line), unless every one
  of them is incomplete (nothing was ever saved: it starts from the beginning, saying so);
  nothing is skipped silently. An explicit ``checkpoint.load_step`` is verified the same way.

Hashing is split over the ranks (file i by rank i mod world) and the results gathered, so
every rank takes the same decision and no rank reads the whole checkpoint.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import signal

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torchtitan.components.checkpointer import AsyncMode, CheckpointManager
from torchtitan.tools.logging import logger

from titan_spec.training.finite import fault

__all__ = [
    "VerifiedCheckpointManager",
    "CheckpointCorrupt",
    "CheckpointWriteFailed",
    "MANIFEST",
    "choose_checkpoint",
    "seal_checkpoint",
    "verify_checkpoint",
]

MANIFEST = "titan_spec_manifest.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_HALF_WRITTEN = "incomplete"


class CheckpointCorrupt(RuntimeError):
    """No checkpoint can be resumed from (the message is one line)."""


class CheckpointWriteFailed(RuntimeError):
    """A checkpoint could not be written: disk full, a read-only or vanished folder (the
    message is one line). The run stops; the folder stays unsealed, so a resume passes over
    it to the last good checkpoint."""


def _os_error(e: BaseException) -> OSError | None:
    """The OSError under a failed save: DCP wraps each rank's writer exception in a
    CheckpointException (a BaseException) with the original as its failures' first item."""
    todo, seen = [e], set()
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError):
            return x
        if isinstance(x, CheckpointException):
            todo += [failure[0] for failure in x.failures.values()]
        todo += [x.__cause__, x.__context__]
    return None


def _files(path: str) -> list[str]:
    out = []
    for root, _, names in os.walk(path):
        for n in names:
            rel = os.path.relpath(os.path.join(root, n), path)
            if rel != MANIFEST and not n.startswith(".tmp"):
                out.append(rel)
    return sorted(out)


def _digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gather(items: list) -> list:
    """Every rank's items, concatenated in rank order (on every rank)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return items
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, items)
    return [x for part in out for x in part]


def _write_atomically(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def seal_checkpoint(path: str) -> None:
    """Write ``path``/MANIFEST over the folder's files (collective; rank 0 writes)."""
    rank, world = _rank_world()
    files = _files(path) if rank == 0 else None
    if dist.is_initialized() and world > 1:
        box = [files]
        dist.broadcast_object_list(box, src=0)
        files = box[0]
    mine = [
        (rel, os.path.getsize(os.path.join(path, rel)), _digest(os.path.join(path, rel))) for rel in files[rank::world]
    ]
    entries = sorted(_gather(mine))
    if rank == 0:
        manifest = {"format": 1, "files": {rel: {"size": size, "sha256": h} for rel, size, h in entries}}
        _write_atomically(os.path.join(path, MANIFEST), json.dumps(manifest, indent=1, sort_keys=True))
    if dist.is_initialized() and world > 1:
        dist.barrier()


def verify_checkpoint(path: str) -> str | None:
    """None when ``path`` matches its manifest, else what is wrong (collective)."""
    rank, world = _rank_world()
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.isfile(manifest_path):
        if os.path.isfile(os.path.join(path, ".metadata")):
            return "unsealed (no manifest: its write stopped before it was sealed, or an older titan_spec wrote it)"
        return _HALF_WRITTEN + " (no .metadata and no manifest: its write was interrupted)"
    try:
        with open(manifest_path) as f:
            listed = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"corrupt (unreadable manifest: {type(e).__name__})"
    problems = []
    for rel in sorted(listed)[rank::world]:
        full = os.path.join(path, rel)
        if not os.path.isfile(full):
            problems.append(f"{rel} is missing")
        elif os.path.getsize(full) != listed[rel]["size"]:
            problems.append(f"{rel} has {os.path.getsize(full)} bytes, not {listed[rel]['size']}")
        elif _digest(full) != listed[rel]["sha256"]:
            problems.append(f"{rel} does not match its checksum")
    problems = sorted(_gather(problems))
    return f"corrupt ({'; '.join(problems)})" if problems else None


def choose_checkpoint(folder: str) -> tuple[int, str | None]:
    """The newest verified ``step-N`` under ``folder``: (N, its path), or (-1, None) when the
    folder holds none at all. Each newer one that fails verification is reported (one line,
    by name); with step folders but none verified, CheckpointCorrupt (collective)."""
    if not os.path.isdir(folder):
        return -1, None
    steps = sorted((int(m.group(1)) for n in os.listdir(folder) if (m := _STEP_DIR.match(n))), reverse=True)
    rejected, stop = [], False
    for step in steps:
        path = os.path.join(folder, f"step-{step}")
        problem = verify_checkpoint(path)
        if problem is None:
            return step, path
        rejected.append(f"step-{step} {problem}")
        # Only a folder DCP never finished (no .metadata, no manifest) holds nothing to lose.
        stop = stop or not problem.startswith(_HALF_WRITTEN)
        logger.warning(f"checkpoint {path} is {problem}; not resuming from it, trying the previous one")
    if rejected and not stop:
        logger.warning(f"no checkpoint in {folder} was ever completed: starting from the beginning")
    elif rejected:
        raise CheckpointCorrupt(
            f"no verified checkpoint to resume from in {folder}: {', '.join(rejected)}; move the folder "
            "away to start from scratch"
        )
    return -1, None


class VerifiedCheckpointManager(CheckpointManager):
    """torchtitan's CheckpointManager; every checkpoint sealed by a manifest and verified on resume."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        pass  # the same keys ([checkpoint]); build() makes a VerifiedCheckpointManager

    @classmethod
    def from_config(cls, cfg: CheckpointManager.Config) -> "VerifiedCheckpointManager.Config":
        """The same [checkpoint] keys as this class's Config (torchtitan's own Config warns
        about its defaults when built: the caller builds it under config.quiet_torchtitan)."""
        return cls.Config(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.init})

    def __init__(self, config, **kwargs):
        self._last_good: str | None = None
        self._pending_seal: str | None = None
        super().__init__(config, **kwargs)

    @property
    def last_verified(self) -> str | None:
        """The newest checkpoint this run loaded (verified) or sealed; None if none."""
        return getattr(self, "_last_good", None)

    def last_good(self) -> str:
        """last_verified, for messages."""
        return self.last_verified or "none yet (no verified checkpoint written or loaded)"

    # --- save ---------------------------------------------------------------------------

    def dcp_save(self, state_dict, checkpoint_id, async_mode, enable_garbage_collection=False, to_hf=False):
        # A folder saved again (a resumed run redoing a step) is unsealed until it is complete.
        if _rank_world()[0] == 0 and os.path.isfile(os.path.join(checkpoint_id, MANIFEST)):
            os.remove(os.path.join(checkpoint_id, MANIFEST))
        try:
            ret = super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
        except (Exception, CheckpointException) as e:
            err = _os_error(e)
            if err is None:
                raise
            what = os.strerror(err.errno) if err.errno else str(err)
            raise CheckpointWriteFailed(
                f"writing checkpoint {checkpoint_id} failed: {what.lower()}; it stays "
                f"unsealed and a resume passes over it; last good checkpoint: {self.last_good()}; free space (or "
                "fix the folder) and rerun the same command to resume"
            ) from None
        if async_mode == AsyncMode.DISABLED:
            self._seal(checkpoint_id)
        else:
            self._pending_seal = checkpoint_id
        return ret

    def _wait_for_saving(self) -> None:
        super()._wait_for_saving()
        if self._pending_seal is not None:
            path, self._pending_seal = self._pending_seal, None
            self._seal(path)

    def _seal(self, checkpoint_id: str) -> None:
        m = _STEP_DIR.match(os.path.basename(os.path.normpath(checkpoint_id)))
        if m and fault("kill_in_checkpoint", int(m.group(1))):
            os.kill(os.getpid(), signal.SIGKILL)  # test hook: DCP's files written, no manifest
        seal_checkpoint(checkpoint_id)
        self._last_good = checkpoint_id

    # --- load ---------------------------------------------------------------------------

    def _find_load_step(self, folder: str = "") -> int:
        step, path = choose_checkpoint(folder or self.folder)
        if path is not None:
            self._last_good = path
        return step

    def _load(self, step: int = -1) -> bool:
        if step != -1:
            path = self._create_checkpoint_id(step)
            problem = verify_checkpoint(path) if os.path.isdir(path) else None
            if problem is not None:
                raise CheckpointCorrupt(f"checkpoint.load_step = {step}: {path} is {problem}")
            if os.path.isdir(path):
                self._last_good = path
        return super()._load(step)
