"""Packing documents into fixed token budgets: a flat stream with document boundaries.

Shape legend: B = rows, L = row length (the token budget).

Every row is a concatenation of whole documents; positions restart at 0 where a
document starts (that is how attention finds the boundaries), labels are the next
token inside the same document, and the tail of a row is a padding document whose
labels are ignored. No per-sample padding, no attention across documents.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchtitan.components.loss import IGNORE_INDEX

__all__ = ["Document", "PackedBatch", "pack_documents"]


@dataclass
class Document:
    tokens: list[int]
    """Token ids, BOS first."""

    loss_from: int = 1
    """Index of the first token that is a training target (e.g. the first completion token)."""


@dataclass
class PackedBatch:
    input_BL: torch.Tensor
    positions_BL: torch.Tensor
    labels_BL: torch.Tensor
    """Next-token targets; IGNORE_INDEX outside the loss region and across boundaries."""


def pack_documents(docs: list[Document], rows: int, row_len: int, pad_id: int) -> tuple[PackedBatch, int]:
    """Greedy first-fit packing of docs in order. Returns the batch and how many docs fit.

    A document longer than row_len is an error (the caller sizes budgets), never truncated
    silently.
    """
    input_BL = torch.full((rows, row_len), pad_id, dtype=torch.long)
    positions_BL = torch.zeros((rows, row_len), dtype=torch.long)
    labels_BL = torch.full((rows, row_len), IGNORE_INDEX, dtype=torch.long)
    fill = [0] * rows
    row, used = 0, 0
    for doc in docs:
        n = len(doc.tokens)
        if n > row_len:
            raise ValueError(f"a document of {n} tokens does not fit a row of {row_len} tokens")
        if fill[row] + n > row_len:
            row += 1
            if row == rows:
                break
        col = fill[row]
        toks = torch.tensor(doc.tokens, dtype=torch.long)
        input_BL[row, col : col + n] = toks
        positions_BL[row, col : col + n] = torch.arange(n)
        # the label of token i is token i+1, kept only when token i+1 is in the loss region
        tgt = toks[1:].clone()
        tgt[: max(doc.loss_from - 1, 0)] = IGNORE_INDEX
        labels_BL[row, col : col + n - 1] = tgt
        fill[row] += n
        used += 1
    # The padding tail of each row is one more document: its positions restart at 0.
    for r in range(rows):
        positions_BL[r, fill[r] :] = torch.arange(row_len - fill[r])
    return PackedBatch(input_BL, positions_BL, labels_BL), used
