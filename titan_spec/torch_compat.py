"""What torchtitan 0.3.0 and titan_spec need of torch that torch < 2.14 lacks.

The project pins torch 2.14.1; the GPU image it is checked on has torch 2.11 and no package
registry, so 2.14.1 cannot be installed there. Each backfill below
gives 2.11 the one 2.14 symbol or behaviour a path titan_spec runs needs, with its reason, and
does nothing on torch >= 2.14. What cannot be backfilled faithfully is refused by the preflight
on torch < 2.14 instead (preflight/torch_support.py: pipeline and expert parallelism).

Applied from platform.py, before anything imports torchtitan. scripts/compat_check.sh runs the
GPU check's test files under torch 2.11 on CPU.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import torch

__all__ = ["TORCH_VERSION", "BACKFILLS_NEEDED", "apply_backfills", "fsdp_output"]

TORCH_VERSION: tuple[int, int] = tuple(int(p) for p in torch.__version__.split(".")[:2])
"""(major, minor) of the torch this process runs."""

BACKFILLS_NEEDED = TORCH_VERSION < (2, 14)

_APPLIED = False


@dataclasses.dataclass
class _DataParallelMeshDims:
    """torch 2.14's torch.distributed.fsdp.DataParallelMeshDims (the data-parallel axes of a
    full SPMD mesh, for fully_shard's dp_mesh_dims): torchtitan imports it at module level."""

    shard: str | tuple[str, ...] | None = None
    replicate: str | tuple[str, ...] | None = None

    def __post_init__(self):
        if self.shard is None and self.replicate is None:
            raise ValueError("At least one of shard or replicate must be set in DataParallelMeshDims")

    @property
    def shard_names(self) -> tuple[str, ...]:
        return () if self.shard is None else (self.shard,) if isinstance(self.shard, str) else tuple(self.shard)

    @property
    def replicate_names(self) -> tuple[str, ...]:
        if self.replicate is None:
            return ()
        return (self.replicate,) if isinstance(self.replicate, str) else tuple(self.replicate)


def _set_timeout(timeout: timedelta, group=None) -> None:
    """torch 2.14's torch.distributed.set_timeout: torchtitan's set_pg_timeouts calls it for
    every mesh group and the default one (None); 2.11's ProcessGroup has the method it calls."""
    from torch.distributed.distributed_c10d import _get_default_group, _rank_not_in_group

    group = _get_default_group() if group is None else group
    if _rank_not_in_group(group):
        raise ValueError("Invalid process group specified")
    group.set_timeout(timeout)


def apply_backfills() -> None:
    """Give torch < 2.14 what torchtitan 0.3.0 imports or calls. Idempotent; a no-op on >= 2.14."""
    global _APPLIED
    if _APPLIED or not BACKFILLS_NEEDED:
        return
    _APPLIED = True
    import torch.distributed as dist
    import torch.distributed.fsdp as fsdp

    # (1) `from torch.distributed.fsdp import DataParallelMeshDims` in torchtitan's
    #     distributed/full_dtensor.py, which torchtitan.train imports: without it nothing trains.
    #     It reaches fully_shard only under the spmd backends on a mesh larger than 1, which the
    #     preflight refuses on torch < 2.14 (2.11's fully_shard has no dp_mesh_dims).
    if not hasattr(fsdp, "DataParallelMeshDims"):
        _DataParallelMeshDims.__name__ = _DataParallelMeshDims.__qualname__ = "DataParallelMeshDims"
        _DataParallelMeshDims.__module__ = "torch.distributed.fsdp"
        fsdp.DataParallelMeshDims = _DataParallelMeshDims
    # (2) torchtitan's set_pg_timeouts (after the first step) calls dist.set_timeout.
    if dist.is_available() and not hasattr(dist, "set_timeout"):
        dist.set_timeout = _set_timeout


def fsdp_output(cls):
    """Class decorator for a dataclass an FSDP module's forward returns: on torch < 2.14 it is
    registered as a pytree node so FSDP sees the tensors inside it.

    2.11's FSDP2 finds the outputs to hook for the pre-backward (the unshard, and the post-
    backward reduce-scatter that follows) with tree_flatten, which takes an unregistered
    dataclass for one leaf: no hook is registered and at dp > 1 the module's gradients are
    never reduced, silently (each rank steps on its own). 2.14 collects the tensors inside
    dataclasses itself; there the class is left as it is.
    """
    if BACKFILLS_NEEDED:
        torch.utils._pytree.register_dataclass(cls)
    return cls
