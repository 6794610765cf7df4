"""The draft vocabulary every kind may use: the most frequent target tokens of the training data.

A draft with draft_vocab_size < the target's predicts over those ids only; its buffers map
them back: d2t[i] (draft id i is target id i + d2t[i]) and t2d[v] (target id v is in the
draft vocab), the names SpecForge, SGLang and vLLM read.
"""

from __future__ import annotations

import torch

__all__ = ["build_vocab_mapping"]


def build_vocab_mapping(token_counts_V: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``draft_vocab_size`` target ids by frequency (ties: lower id) -> (d2t, t2d)."""
    V = token_counts_V.numel()
    if not 1 <= draft_vocab_size <= V:
        raise ValueError(f"draft vocab size {draft_vocab_size} must be in 1..{V} (the target vocabulary)")
    # Stable sort on -count keeps lower ids first among equal counts.
    order = torch.sort(-token_counts_V.to(torch.float64), stable=True).indices[:draft_vocab_size]
    ids = torch.sort(order).values
    d2t = ids - torch.arange(draft_vocab_size)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    return d2t.to(torch.long), t2d
