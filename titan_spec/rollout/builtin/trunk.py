"""The draft's pending trunk rows: committed positions the draft's cache has not seen yet.

Shape letters (titan_spec/shapes.py): a segment's L is the positions it holds per request.

A drafting round's proposer first ``extend``s its cache with the positions the last rounds
committed (each row: the target's taps at t and the token x[t+1]). After a K = 0 round
(adaptive depth: a plain decode step) nothing is drafted, so those positions wait here as
one more segment, and the next drafting round extends all of them in one call.
"""

from __future__ import annotations

import torch

__all__ = ["PendingTrunk", "join_segments"]

LONG_STREAK = 32
"""Segments kept before a K = 0 streak joins them into one: keeps the list short."""


def join_segments(segments: list[tuple]) -> tuple:
    """Pending draft trunk rows of several rounds as one (taps, tokens, start, n). Each
    segment's rows are contiguous positions that start where the previous segment's valid
    rows end; a stable sort moves every row's valid entries to the front, in order."""
    if len(segments) == 1:
        return segments[0]
    taps_BLCD = torch.cat([s[0] for s in segments], dim=1)
    tok_BL = torch.cat([s[1] for s in segments], dim=1)
    dev = tok_BL.device
    valid_BL = torch.cat([torch.arange(s[1].shape[1], device=dev)[None, :] < s[3][:, None] for s in segments], dim=1)
    order_BL = torch.sort((~valid_BL).long(), dim=1, stable=True).indices
    taps_BLCD = taps_BLCD.gather(1, order_BL[:, :, None, None].expand_as(taps_BLCD))
    return taps_BLCD, tok_BL.gather(1, order_BL), segments[0][2], sum(s[3] for s in segments)


class PendingTrunk:
    """Segments (taps_BLCD, tokens_BL, start_B, n_B), one per round since the last drafting
    round, and ``slots``: a host-side bound on their last position + 1 (no sync)."""

    def __init__(self, taps_BLpCD, tokens_BLp, P_B, y_B, P: int):
        """The prompt's rows t = 0..P-1, which read x[t+1]: the prompt shifted by one, then
        y_B (the first completion token) after each row's last prompt token."""
        tok_BLp = torch.roll(tokens_BLp, -1, dims=1)
        tok_BLp[torch.arange(tok_BLp.shape[0], device=tok_BLp.device), P_B - 1] = y_B
        self.segments = [(taps_BLpCD, tok_BLp, torch.zeros_like(P_B), P_B)]
        self.slots = P

    def joined(self) -> tuple:
        """All pending rows as one segment, what the proposer's ``extend`` takes."""
        return join_segments(self.segments)

    def keep(self, rows_B: torch.Tensor) -> None:
        """Drop finished requests."""
        self.segments = [tuple(x[rows_B] for x in self.joined())]

    def add(self, segment: tuple, K: int, c_max: int) -> None:
        """The rows a round at depth K committed. K > 0: the round's proposer extended
        every earlier row, so the new segment is all that waits; its verify window reached
        c_max + K. K = 0: one more segment (a long streak is joined first)."""
        if K:
            self.segments, self.slots = [segment], c_max + K + 1
            return
        if len(self.segments) > LONG_STREAK:
            self.segments = [self.joined()]
        self.segments.append(segment)
        self.slots = max(self.slots, c_max + 1)
