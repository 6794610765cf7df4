"""Packing documents into fixed token budgets: a flat stream with document boundaries.

Every row is a concatenation of whole documents; positions restart at 0 where a
document starts (that is how attention finds the boundaries), labels are the next
token inside the same document, and the tail of a row is a padding document whose
labels are ignored. No per-sample padding, no attention across documents.

With ``multiple`` > 1 every document is padded to a multiple of that many tokens
(pad tokens continue the document's positions and have ignored labels): a causal
model computes exactly the same losses for the real tokens, and a context-parallel
zigzag split of the rows then needs no padding of its own, so each rank's share has
a length fixed by the row budget alone (the static shapes pipeline stages need).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torchtitan.components.loss import IGNORE_INDEX

__all__ = ["Document", "PackedBatch", "pack_documents"]


@dataclass
class Document:
    tokens: list[int]
    """Token ids, BOS first."""

    loss_from: int = 1
    """Index of the first token that is a training target (e.g. the first completion token)."""

    values: dict[str, list[float]] = field(default_factory=dict)
    """Per-target values (RL: behaviour log-probs, advantages), one per target token
    tokens[loss_from:], placed where those tokens are labels; 0 elsewhere."""


@dataclass
class PackedBatch:
    input_BL: torch.Tensor
    positions_BL: torch.Tensor
    labels_BL: torch.Tensor
    """Next-token targets; IGNORE_INDEX outside the loss region and across boundaries."""
    values_BL: dict[str, torch.Tensor] = field(default_factory=dict)
    """Documents' ``values`` at their label positions (float32), 0 elsewhere."""


def pack_documents(
    docs: list[Document], rows: int | None, row_len: int, pad_id: int, multiple: int = 1
) -> tuple[PackedBatch, int]:
    """Greedy packing of docs in order (a new row when the next one does not fit). Returns
    the batch and how many docs fit; ``rows=None`` uses as many rows as all docs need.
    ``multiple``: each document takes a multiple of that many tokens of its row.

    A document longer than row_len is an error (the caller sizes budgets), never truncated
    silently.
    """
    if row_len % multiple:
        raise ValueError(f"rows of {row_len} tokens do not hold documents padded to multiples of {multiple}")
    if rows is None:
        rows = max(_rows_needed(docs, row_len, multiple), 1)
    input_BL = torch.full((rows, row_len), pad_id, dtype=torch.long)
    positions_BL = torch.zeros((rows, row_len), dtype=torch.long)
    labels_BL = torch.full((rows, row_len), IGNORE_INDEX, dtype=torch.long)
    names = sorted({k for d in docs for k in d.values})
    values_BL = {k: torch.zeros((rows, row_len), dtype=torch.float32) for k in names}
    fill = [0] * rows
    row, used = 0, 0
    for doc in docs:
        n = len(doc.tokens)
        m = _padded(n, multiple)
        if m > row_len:
            raise ValueError(f"a document of {n} tokens does not fit a row of {row_len} tokens")
        if fill[row] + m > row_len:
            row += 1
            if row == rows:
                break
        col = fill[row]
        toks = torch.tensor(doc.tokens, dtype=torch.long)
        input_BL[row, col : col + n] = toks
        positions_BL[row, col : col + m] = torch.arange(m)
        # the label of token i is token i+1, kept only when token i+1 is in the loss region
        tgt = toks[1:].clone()
        tgt[: max(doc.loss_from - 1, 0)] = IGNORE_INDEX
        labels_BL[row, col : col + n - 1] = tgt
        for k, vals in doc.values.items():
            if len(vals) != n - doc.loss_from:
                raise ValueError(f"document values {k!r}: {len(vals)} values for {n - doc.loss_from} targets")
            # target token i (i >= loss_from) is the label of position i - 1
            values_BL[k][row, col + doc.loss_from - 1 : col + n - 1] = torch.tensor(vals, dtype=torch.float32)
        fill[row] += m
        used += 1
    # The padding tail of each row is one more document: its positions restart at 0.
    for r in range(rows):
        positions_BL[r, fill[r] :] = torch.arange(row_len - fill[r])
    return PackedBatch(input_BL, positions_BL, labels_BL, values_BL), used


def _padded(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _rows_needed(docs: list[Document], row_len: int, multiple: int) -> int:
    rows, fill = 0, row_len
    for doc in docs:
        m = _padded(len(doc.tokens), multiple)
        if fill + m > row_len:
            rows, fill = rows + 1, 0
        fill += m
    return rows
