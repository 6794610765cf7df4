"""The DFlash block loss under context parallelism: the whole document's context on every rank.

A block anchored at global row a reads the context rows s .. a-1 of its document, which the
zigzag split (parallelisms/context_parallel.ZigzagLayout) spreads over every rank, and the
target's distributions at rows a .. a+J-2, which may sit on the next chunk's rank. So each
rank
  - all-gathers the context features ctx = hidden_norm(fc(taps)) of every rank and puts
    them in global order (``gather_rows``: differentiable, the backward sums each rank's
    gradient into the rows' owner), and the labels (so every rank draws the same anchors as
    one process would, from the same global stream);
  - trains the blocks whose known token is one of its own rows;
  - reads the target's logits at a+1 .. a+J-2 through the halo EAGLE-3's TTT uses too (models/draft/halo.py
    TTTHalo: the first J-2 rows of every chunk), the only V-wide rows that cross.
The context projections of a row then run on every rank (cp times the draft's context
work, a small share of a step; the target's activations stay sharded).

It reads the CPMetadata it is given (layout, rank, group) and imports nothing above the
models floor.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["CPStream"]


class _GatherRows(torch.autograd.Function):
    """x_R of every rank -> x_Tg in global order; backward: all-reduce, keep this rank's rows."""

    @staticmethod
    def forward(ctx, x_R, order_Tg, group, rank):
        parts = [torch.empty_like(x_R) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x_R.contiguous(), group=group)
        ctx.save_for_backward(order_Tg)
        ctx.group, ctx.rank, ctx.rows, ctx.shape = group, rank, x_R.shape[0], tuple(parts[0].shape)
        return torch.cat(parts)[order_Tg]

    @staticmethod
    def backward(ctx, grad_Tg):
        (order_Tg,) = ctx.saved_tensors
        cp = dist.get_world_size(ctx.group)
        full = grad_Tg.new_zeros((cp * ctx.rows, *ctx.shape[1:])).index_add_(0, order_Tg, grad_Tg)
        dist.all_reduce(full, group=ctx.group)
        return full[ctx.rank * ctx.rows : (ctx.rank + 1) * ctx.rows], None, None, None


class CPStream:
    """The global stream of one CP rank's shard: which gathered row is which global row."""

    def __init__(self, meta, device):
        """meta: the rank's parallelisms/context_parallel.CPMetadata."""
        layout, self.group, self.rank = meta.layout, meta.group, meta.rank
        R, cp = layout.local_len, layout.cp
        index = torch.cat([layout.global_index(r) for r in range(cp)])  # [cp*R]: global row or -1 (pad)
        real = index >= 0
        order = torch.empty(layout.global_len, dtype=torch.long)
        order[index[real]] = torch.arange(cp * R)[real]
        self.order_Tg = order.to(device)
        """Row of the all-gathered [cp*R] stream that holds global row g."""
        self.owner_Tg, self.local_Tg = order // R, order % R
        self.positions_Tg = torch.cat([torch.arange(n) for n in layout.doc_lens]) if layout.doc_lens else order
        self.doc_bounds = [0]
        for n in layout.doc_lens:
            self.doc_bounds.append(self.doc_bounds[-1] + n)

    def gather(self, x_R: torch.Tensor) -> torch.Tensor:
        """x_Tg: every rank's rows in global order (differentiable)."""
        return _GatherRows.apply(x_R, self.order_Tg, self.group, self.rank)

    def gather_labels(self, labels_R: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(labels_R) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, labels_R.contiguous(), group=self.group)
        return torch.cat(parts)[self.order_Tg]
