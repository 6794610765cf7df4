"""The DSpark loss over a packed batch: DFlash's blocks (models/draft/dflash/loss.py), every row a
prediction, with SpecForge's DSpark objective.

A block anchored at row a (its known token x[a] at pos[a], then J - 1 masked rows) attends as a
DFlash block does. Block row k (0 .. J - 1) predicts x[a + k + 1], the token the target's row
a + k predicted; its previous token is x[a + k] (teacher forcing: row 0's is the known token).
Anchors start at the first completion token (DFlash's ``block_plan``), so every row's
previous token is a label of the stream.

Per row, with logits = lm_head(norm(h)) + markov bias of the previous token, over the draft vocab:
  - ce:   cross-entropy against the sampled token x[a + k + 1];
  - l1:   sum |softmax(logits) - p_target| (p_target: the target's distribution at a + k,
          restricted to the draft vocab);
  - conf: BCE of the confidence logit against 1 - l1 / 2 (detached), the chance that
          speculative sampling accepts a token drawn from the draft.
loss = sum over rows of decay**k * (w_ce ce + w_l1 l1 + w_conf conf) / sum of decay**k over the
scored rows (a decay-weighted mean, SpecForge's; the sums' counts are global over the data-
parallel ranks when given). A row is scored when it and every row before it in the block is
inside the document and the loss region and its token is in the draft vocab.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from titan_spec.models.draft.base import DraftLossResult
from titan_spec.models.draft.dflash.loss import BlockPlan, block_hidden, block_valid

__all__ = ["SparkTargets", "SparkWeights", "spark_loss", "spark_targets", "spark_valid"]


class SparkWeights(NamedTuple):
    ce: float
    l1: float
    confidence: float
    decay: float


class SparkTargets(NamedTuple):
    """Per block row k, stacked on S = J (everything read from the stream, detached)."""

    valid_SA: torch.Tensor
    """The row is scored."""
    prev_SA: torch.Tensor
    """Its previous token (target id; a safe id where not valid)."""
    label_SA: torch.Tensor
    """The token it predicts, as a draft id (0 where not valid)."""
    p_SAVd: torch.Tensor
    """The target's distribution there, restricted to the draft vocab."""


def spark_valid(plan: BlockPlan, labels_Tg: torch.Tensor, block_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per block row k = 0 .. J-1: (src_A = a + k, the row the target predicted its token from;
    valid_A: it and every row before it inside the document and the loss region). Index math on
    positions and labels only: what the normalizer counts."""
    out, ok_A = [], None
    for src_A, v_A in block_valid(plan, labels_Tg, block_size + 1):
        ok_A = v_A if ok_A is None else ok_A & v_A
        out.append((src_A, ok_A))
    return out


@torch.no_grad()
def spark_targets(draft: nn.Module, plan: BlockPlan, labels_Tg, valid, target_logits) -> SparkTargets:
    """From ``spark_valid``'s rows and the target's logits at them; a row whose token is not in
    the draft vocab is not scored (it is still counted by the normalizer)."""
    d2t_ids = draft.draft_to_target_ids()
    to_draft_V = torch.zeros_like(draft.t2d, dtype=torch.long)
    to_draft_V[d2t_ids] = torch.arange(d2t_ids.numel(), device=d2t_ids.device)
    vs, prevs, labs, ps = [], [], [], []
    for k, ((src_A, v_A), logits_AV) in enumerate(zip(valid, target_logits)):
        lab_A = labels_Tg[src_A].clamp(min=0)
        ok_A = v_A & draft.t2d[lab_A]
        prev_A = labels_Tg[(plan.anchors_A - 1 if k == 0 else src_A - 1).clamp(min=0)].clamp(min=0)
        vs.append(ok_A)
        prevs.append(torch.where(ok_A, prev_A, 0))
        labs.append(torch.where(ok_A, to_draft_V[lab_A], 0))
        x_AV = logits_AV.to(torch.promote_types(logits_AV.dtype, torch.float32))
        ps.append(torch.softmax(x_AV[:, d2t_ids], dim=-1))
    return SparkTargets(torch.stack(vs), torch.stack(prevs), torch.stack(labs), torch.stack(ps))


def spark_loss(
    draft: nn.Module,
    taps,
    embeds_TH,
    positions_Tg,
    plan: BlockPlan,
    t: SparkTargets,
    w: SparkWeights,
    count_S: torch.Tensor | None = None,
    gather=None,
) -> DraftLossResult:
    """The DSpark loss (module docstring). ``count_S``: the rows ``spark_valid`` counts per block
    row, summed over the data-parallel ranks (None: this batch's scored rows)."""
    J, A = draft.arch.block_size, plan.rows_A.numel()
    h_QH = block_hidden(draft, taps, embeds_TH, positions_Tg, plan, gather=gather)
    hn_SAH = draft.norm(h_QH).view(A, J, -1).transpose(0, 1)
    m_SAMr = draft.markov_embed(t.prev_SA)
    logits_SAVd = draft.spark_logits(hn_SAH, m_SAMr)
    logp_SAVd = F.log_softmax(logits_SAVd.to(t.p_SAVd.dtype), dim=-1)
    ce_SA = -logp_SAVd.gather(-1, t.label_SA[..., None]).squeeze(-1)
    l1_SA = (logp_SAVd.exp() - t.p_SAVd).abs().sum(-1)
    per_SA = w.ce * ce_SA + w.l1 * l1_SA
    if draft.confidence_head is not None and w.confidence:
        conf_SA = draft.confidence_logit(hn_SAH, m_SAMr).to(per_SA.dtype)
        accept_SA = (1.0 - 0.5 * l1_SA.detach()).clamp(0.0, 1.0)
        per_SA = per_SA + w.confidence * F.binary_cross_entropy_with_logits(conf_SA, accept_SA, reduction="none")
    valid_SA = t.valid_SA
    decay_S = w.decay ** torch.arange(J, device=per_SA.device, dtype=per_SA.dtype)
    scored_S = valid_SA.sum(-1)
    denom = (decay_S * (scored_S if count_S is None else count_S).to(decay_S.dtype)).sum()
    loss = (decay_S[:, None] * per_SA * valid_SA).sum() / denom.clamp(min=1e-6)
    return DraftLossResult(
        loss=loss,
        loss_sum_S=(ce_SA * valid_SA).sum(-1).detach(),
        count_S=scored_S,
        correct_S=((logits_SAVd.argmax(-1) == t.label_SA) & valid_SA).sum(-1),
    )
