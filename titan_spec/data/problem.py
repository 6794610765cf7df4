"""One verifiable problem: a prompt, its reference answer, what SFT shows of it.

Every task (data/generated.py, data/tasks.py) hands out these; the RL step scores completions
against ``answer`` and the SFT dataloader trains on ``sft_target``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Problem"]


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str
    """The correct completion: what the exact-match reward checks."""
    demonstration: str = ""
    """What an SFT example shows ('' = the answer); differs from it for noisy demonstrations
    and for dataset records (the whole answer field: GSM8K's working, MATH's solution)."""
    messages: tuple = ()
    """The prompt as chat messages ({role, content} dicts) when the record gives it so
    (DAPO-Math); then ``prompt`` is the last message's content."""
    source: str = ""
    """Which record it is (FILE:LINE, FILE#ROW): named by malformed-record and reward errors."""
    record: dict[str, Any] = field(default_factory=dict, compare=False)
    """The raw dataset record ({} for generated problems): a user reward's third argument."""

    @property
    def sft_target(self) -> str:
        return self.demonstration or self.answer
