"""How the ranks that hold the same data-parallel rank share one step's rollout generation.

The ranks of one data-parallel group (the same batch-mesh coordinate: the product of the
non-batch mesh dims: its CP and TP ranks and pipeline stages) get the same problems from the
dataloader and must pack the same documents: under context parallelism every CP rank
zigzag-shards the same packed minibatch. Generating them all on every rank would repeat the
work n times; generating on one rank would idle the others through a whole generation. So:

  share     rank k of the n ranks generates a contiguous k-th share of the group's
            completions (its own engine call, its own seed: the caller's ``work(items, k)``);
  exchange  the shares are all-gathered (``all_gather_object``) and concatenated in rank
            order, so every rank of the group ends with the same list, in the order a lone
            rank would have generated it.

``share_work`` is generic over what a share yields (the RL step: its rollouts, stats and
baselines) and over which dims make the group (``same_data_group`` builds it from the batch
mesh alone). With a group of one it calls ``work(items, 0)`` and does nothing else.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import torch.distributed as dist

__all__ = ["same_data_group", "share_bounds", "share_work"]

T = TypeVar("T")
R = TypeVar("R")


def same_data_group(batch_rank: int, world_size: int) -> dist.ProcessGroup | None:
    """The process group of the ranks whose batch-mesh rank (the dataloader's dp_rank) is
    ``batch_rank``, None when this rank is its group's only member (no non-batch dims).
    Collective over the world (every rank calls it, once): the groups are read from the
    ranks' own batch coordinates, so they do not depend on how torchtitan orders the mesh."""
    if world_size == 1:
        return None
    coords: list[int] = [0] * world_size
    dist.all_gather_object(coords, int(batch_rank))
    groups = [[r for r in range(world_size) if coords[r] == b] for b in sorted(set(coords))]
    if len(groups[0]) == 1:
        return None  # batch mesh = world: data parallel only
    # gloo, whatever the training backend: the exchange is of pickled Python objects (an NCCL
    # group would copy them to the GPU and back), and with rl.async_steps it runs in the
    # generation thread, beside the training step's own collectives on the mesh's groups.
    mine, _ = dist.new_subgroups_by_enumeration(groups, backend="gloo")
    return mine


def share_bounds(count: int, rank: int, size: int) -> tuple[int, int]:
    """[lo, hi) of share ``rank`` of ``count`` items split into ``size`` contiguous shares
    whose sizes differ by at most one item."""
    return rank * count // size, (rank + 1) * count // size


def share_work(items: list[T], work: Callable[[list[T], int], R], group: dist.ProcessGroup | None) -> list[R]:
    """Every group rank's ``work(its share of items, its rank in group)``, in rank order
    (collective over ``group``: an ``all_gather_object``); ``[work(items, 0)]`` without one."""
    if group is None:
        return [work(items, 0)]
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    lo, hi = share_bounds(len(items), rank, size)
    mine = work(items[lo:hi], rank)
    out: list = [None] * size
    dist.all_gather_object(out, mine, group=group)
    return out
