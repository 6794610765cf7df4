"""A draft loss under context parallelism: the rows t+1 .. t+S it reads across shard boundaries.

EAGLE-3's TTT at step j reads, for local row t, the row t+1+j of the global stream (next
token's embedding, the target's distribution there, its label); DFlash's block anchored at t
reads the target's distributions at t+1 .. t+J-2. Under the zigzag split
(parallelisms/context_parallel.ZigzagLayout) such a row can sit on another rank, but only as
one of the first S rows of some chunk: t+1+j either stays in t's chunk or enters a later
chunk at offset <= j < S. So every rank all-gathers the first min(S, c_d) rows of each of
its chunks (the "halo", the same count on every rank) and indexes into [local rows; halo
of every rank].

It reads the CPMetadata it is given (layout, rank, group) and imports nothing above the
models floor: the CP halo is the draft kinds' business (models/draft/eagle3/kind.py and
dflash/kind.py call it), the trainer only hands the loss its CPMetadata.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torchtitan.components.loss import IGNORE_INDEX

__all__ = ["TTTHalo"]


class TTTHalo:
    """Cross-shard row lookup of rows t+1 .. t+S on one CP rank."""

    def __init__(self, meta, steps: int, device):
        """meta: the rank's parallelisms/context_parallel.CPMetadata."""
        layout, rank, cp = meta.layout, meta.rank, meta.layout.cp
        self.group, self.steps = meta.group, steps
        halo_rows, per_row = [], []
        halo_off = 0
        for a, c, length in zip(layout.local_cu_seqlens[:-1], layout.chunk_lens, layout.doc_lens):
            if c == 0:
                continue
            h = min(steps, c)
            for slot in (0, 1):
                halo_rows.append(torch.arange(a + slot * c, a + slot * c + h))
            per_row.append(torch.tensor([[a, c, length, halo_off, h]]).expand(2 * c, 5))
            halo_off += 2 * h
        self.halo_rows = torch.cat(halo_rows).to(device)
        self.halo_len, R = halo_off, layout.local_len
        a_R, c_R, len_R, off_R, h_R = torch.cat(per_row).unbind(1)
        pos_R = layout.local_positions(rank)
        row_R = torch.arange(R)
        self._src, self._in_doc = [], []
        for j in range(steps):
            p_R = pos_R + 1 + j
            in_doc_R = p_R < len_R
            chunk_R = p_R // c_R
            o_R = p_R - chunk_R * c_R
            second = chunk_R >= cp  # the chunk is its owner's second (slot 1)
            owner_R = torch.where(second, 2 * cp - 1 - chunk_R, chunk_R)
            local_R = a_R + second * c_R + o_R
            halo_R = R + owner_R * self.halo_len + off_R + second * h_R + o_R
            src_R = torch.where(owner_R == rank, local_R, halo_R)
            self._src.append(torch.where(in_doc_R, src_R, row_R).to(device))
            self._in_doc.append(in_doc_R.to(device))

    def extend(self, x_R: torch.Tensor) -> torch.Tensor:
        """x_Rh: the local rows, then the halo rows of every rank, rank-major."""
        halo = x_R[self.halo_rows].contiguous()
        parts = [torch.empty_like(halo) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, halo, group=self.group)
        return torch.cat([x_R, *parts])

    def sources(self) -> list[torch.Tensor]:
        """Per step j: src_R, row t+1+j's index into the extended rows (row t itself where
        t+1+j leaves the document). Index math only: nothing is gathered."""
        return list(self._src)

    def shifts(self, labels_Rh: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per step j: (src_R into the extended rows, valid_R), as ttt.ttt_shifts."""
        return [
            (src_R, in_doc_R & (labels_Rh[src_R] != IGNORE_INDEX)) for src_R, in_doc_R in zip(self._src, self._in_doc)
        ]
