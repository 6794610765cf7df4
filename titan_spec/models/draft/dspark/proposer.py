"""DSpark's cached proposer: DFlash's (models/draft/dflash/proposer.py) over the same KV cache,
where every block row is a proposal and the heads run left to right.

``propose`` runs the block [y, mask, ..., mask] at positions c .. c+J-1 once and returns the
final-norm hidden of its J rows; ``row(out, j, prev)`` adds the Markov bias of the token
drafted at j - 1 (j = 0: y) to row j's logits, so the engine draws proposal j after proposal
j - 1 (rollout/builtin/engine.py ``_propose``). Each proposal's q is then the distribution it
was drawn from given the ones before it, which keeps the acceptance rule exact.
With ``confidence`` it also gives the confidence head's estimate that proposal j is accepted
(the engine's depth = "confidence", rollout/builtin/depth.py ``confidence_depth``).
"""

from __future__ import annotations

import torch

from titan_spec.models.draft.dflash.proposer import CachedBlockDraft
from titan_spec.models.draft.dspark.model import DSparkDraft

__all__ = ["CachedSparkDraft"]


class CachedSparkDraft(CachedBlockDraft):
    def __init__(self, draft: DSparkDraft, embed):
        super().__init__(draft, embed)
        self.proposals = draft.arch.block_size
        self.has_confidence = draft.confidence_head is not None

    def row(self, out_BJ: torch.Tensor, j: int, prev_B: torch.Tensor, confidence: bool = False):
        d, hn_BH = self.draft, out_BJ[:, j]
        m_BMr = d.markov_embed(prev_B)
        conf_B = torch.sigmoid(d.confidence_logit(hn_BH, m_BMr)) if confidence else None
        return d.spark_logits(hn_BH, m_BMr), conf_B

    def _block_rows(self, h_BJH: torch.Tensor) -> torch.Tensor:
        return self.draft.norm(h_BJH)
