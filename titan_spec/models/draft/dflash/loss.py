"""The DFlash block loss over a packed batch: blocks anchored in each document, predicted in one forward.

Shape letters (titan_spec/shapes.py): T is this rank's rows, Tg the context stream (T in one
process, the global stream under context parallelism).

Mirrors inference (proposer.py): a block anchored at row a
  - holds the known token x[a] (its target embedding) at position pos[a], then J - 1 masked
    rows (the draft's mask embedding) at positions pos[a] + 1 .. pos[a] + J - 1;
  - attends to the context, the target's tapped features of rows s .. a - 1 of its document
    (row a's features are what the verify forward has not computed yet), and to all J rows
    of its own block;
  - at block row k (1 .. J - 1) is trained against the target's distribution at row a + k - 1
    (its prediction of x[a + k]), restricted to the draft vocab, weighted decay**(k - 1)
    (DFlash's exp(-(k - 1) / gamma)).
Block row k is masked when a + k - 1 leaves the document, when that row is outside the loss
region (labels == IGNORE), or when the target's argmax there is not in the draft vocab.
loss = sum_k decay**(k - 1) * (row k's cross-entropies) / sum_k decay**(k - 1) * (row k's
count): a decay-weighted mean, as SpecForge's DFlash loss.

Anchors: the rows a whose own token and next token are completion tokens (labels[a - 1] and
labels[a] != IGNORE), so the first block sits on the first completion token, where an engine's
first block sits; at most ``per_doc`` of them per document, evenly spaced (deterministic: a
run, its resume and its parallel layouts draw the same blocks). Everything read from the
target is detached.

Attention runs per document (its anchors' J rows against its context rows and their own
blocks) so memory grows with a document's length, not the batch's. Under context
parallelism the context stream is the global one (context.py CPStream) and each rank trains
the blocks anchored on its rows: the sum over ranks is the one-process loss.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torchtitan.components.loss import IGNORE_INDEX

from titan_spec.models.draft.base import DraftLossResult

__all__ = ["BlockPlan", "block_hidden", "block_loss", "block_plan", "block_targets", "block_valid", "doc_bounds_of"]


class BlockPlan(NamedTuple):
    """Where the blocks of one packed stream sit (fixed by positions and labels alone).

    The context stream is what the blocks attend to: the local rows in one process, the
    global stream under context parallelism (context.py), where a rank trains the blocks
    whose known token is one of its rows."""

    rows_A: torch.Tensor
    """Local row of each block's known token (its embedding, the target's logits there)."""
    anchors_A: torch.Tensor
    """The same rows in the context stream, ascending."""
    doc_end_A: torch.Tensor
    """One past the last context-stream row of the anchor's document."""
    groups: list[tuple[int, int, int, int]]
    """Per document with blocks here: (first anchor, one past its last anchor, first row, one
    past the last row of the context stream), host ints; a document's anchors are contiguous."""


def doc_bounds_of(positions_BL: torch.Tensor) -> list[int]:
    """Document boundaries of a [B, L] batch viewed as one stream: a document starts at
    position 0 and at every row start (one host transfer)."""
    B, L = positions_BL.shape
    starts_BL = (positions_BL == 0).cpu()
    starts_BL[:, 0] = True
    return starts_BL.reshape(-1).nonzero().squeeze(1).tolist() + [B * L]


def block_plan(bounds: list[int], labels_Tg: torch.Tensor, per_doc: int, owner_Tg=None, local_Tg=None) -> BlockPlan:
    """The blocks of a stream cut at ``bounds``: at most ``per_doc`` anchors of each document
    (rows a with labels[a - 1] and labels[a] in the loss region), evenly spaced. ``owner_Tg``
    (a bool per row: this rank's) and ``local_Tg`` (its local row) keep a CP rank's blocks;
    None: every block, rows_A = anchors_A."""
    ok_Tg = labels_Tg.cpu() != IGNORE_INDEX
    ok_Tg[1:] &= ok_Tg[:-1].clone()
    ok_Tg[torch.tensor(bounds[:-1], dtype=torch.long)] = False
    cand = ok_Tg.nonzero().squeeze(1)
    mine = owner_Tg.cpu() if owner_Tg is not None else None
    anchors, ends, groups = [], [], []
    for s, e in zip(bounds[:-1], bounds[1:]):
        lo, hi = torch.searchsorted(cand, torch.tensor([s, e])).tolist()
        n = hi - lo
        if not n:
            continue
        m = min(n, per_doc) if per_doc else n
        picked = cand[lo + (torch.arange(m) * n) // m]
        if mine is not None:
            picked = picked[mine[picked]]
        if not picked.numel():
            continue
        groups.append((len(anchors), len(anchors) + picked.numel(), s, e))
        anchors += picked.tolist()
        ends += [e] * picked.numel()
    dev = labels_Tg.device
    anchors_A = torch.tensor(anchors, dtype=torch.long, device=dev)
    rows_A = anchors_A if local_Tg is None else local_Tg.to(dev)[anchors_A]
    return BlockPlan(rows_A, anchors_A, torch.tensor(ends, dtype=torch.long, device=dev), groups)


def block_valid(plan: BlockPlan, labels_Tg: torch.Tensor, block_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per block row k = 1 .. J-1: (src_A = a + k - 1 in the context stream, clamped inside the
    document; valid_A: inside the document and in the loss region). Pure index math."""
    out = []
    for k in range(1, block_size):
        idx = plan.anchors_A + k - 1
        inside = idx < plan.doc_end_A
        src = torch.where(inside, idx, plan.anchors_A)
        out.append((src, inside & (labels_Tg[src] != IGNORE_INDEX)))
    return out


def _at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    # Softmax in float32 for bf16/fp32 models; fp64 stays fp64 (the reference tests run there).
    return x.to(torch.promote_types(x.dtype, torch.float32))


@torch.no_grad()
def block_targets(draft: nn.Module, rows: list[tuple[torch.Tensor, torch.Tensor]]):
    """Per block row k, from (valid_A, the target's logits_AV at a + k - 1): (valid_A and 'the
    target's argmax is in the draft vocab', the target's distribution restricted to the draft
    vocab)."""
    d2t_ids = draft.draft_to_target_ids()
    out = []
    for valid, logits_AV in rows:
        tgt_AV = _at_least_fp32(logits_AV)
        out.append((valid & draft.t2d[tgt_AV.argmax(-1)], torch.softmax(tgt_AV[:, d2t_ids], dim=-1)))
    return out


def _attend(draft: nn.Module, plan: BlockPlan, q_QNHd, k_QKvHd, v_QKvHd, kc_TgKvHd, vc_TgKvHd):
    """Each document's block rows over its context rows < anchor and their own block."""
    a, J = draft.arch, draft.arch.block_size
    scale = a.head_dim**-0.5
    outs = []
    for a0, a1, s, e in plan.groups:
        q0, q1 = a0 * J, a1 * J
        anchor_Q = plan.anchors_A[a0:a1].repeat_interleave(J)
        block_Q = torch.arange(a1 - a0, device=q_QNHd.device).repeat_interleave(J)
        ctx_mask = torch.arange(s, e, device=q_QNHd.device)[None, :] < anchor_Q[:, None]
        own_mask = block_Q[:, None] == block_Q[None, :]
        keys = torch.cat([kc_TgKvHd[s:e], k_QKvHd[q0:q1]]).transpose(0, 1)
        vals = torch.cat([vc_TgKvHd[s:e], v_QKvHd[q0:q1]]).transpose(0, 1)
        o_NQHd = F.scaled_dot_product_attention(
            q_QNHd[q0:q1].transpose(0, 1),
            keys,
            vals,
            attn_mask=torch.cat([ctx_mask, own_mask], dim=1),
            scale=scale,
            enable_gqa=a.n_heads != a.n_kv_heads,
        )
        outs.append(o_NQHd.transpose(0, 1))
    return torch.cat(outs) if outs else q_QNHd * 0


def block_hidden(draft: nn.Module, taps, embeds_TH, positions_Tg, plan: BlockPlan, gather=None):
    """h_QH: the last layer's output (before the final norm) of every block row, the A blocks'
    J rows flattened (arguments as ``block_loss``)."""
    J, A, H = draft.arch.block_size, plan.rows_A.numel(), embeds_TH.shape[-1]
    ctx_TgH = draft.context(tuple(t.detach() for t in taps))
    if gather is not None:
        ctx_TgH = gather(ctx_TgH)
    pos_Q = (positions_Tg[plan.anchors_A][:, None] + torch.arange(J, device=positions_Tg.device)).reshape(-1)
    known_A1H = embeds_TH.detach()[plan.rows_A][:, None]
    h_QH = torch.cat([known_A1H, draft.mask_embedding.to(known_A1H.dtype).expand(A, J - 1, H)], dim=1).reshape(A * J, H)
    for i in range(draft.arch.n_layers):
        kc_TgKvHd, vc_TgKvHd = draft.context_kv(i, ctx_TgH, positions_Tg)
        q_QNHd, k_QKvHd, v_QKvHd = draft.block_qkv(i, h_QH, pos_Q)
        h_QH = draft.block_finish(i, h_QH, _attend(draft, plan, q_QNHd, k_QKvHd, v_QKvHd, kc_TgKvHd, vc_TgKvHd))
    return h_QH


def block_loss(
    draft: nn.Module,
    taps,
    embeds_TH,
    positions_Tg,
    plan: BlockPlan,
    targets,
    decay: float = 0.8,
    count_S: torch.Tensor | None = None,
    gather=None,
) -> DraftLossResult:
    """The draft's block loss, for ``targets = block_targets(...)``. ``taps``: the C local tap
    tensors [T, D] and ``embeds_TH`` the local embeddings (detached here); ``positions_Tg``: of
    the context stream, which ``gather`` makes from the local context rows (None: they are
    it). ``count_S`` (valid rows per block row, summed over the data-parallel ranks)
    normalizes the loss when given, else the local counts do."""
    J, A = draft.arch.block_size, plan.rows_A.numel()
    h_QH = block_hidden(draft, taps, embeds_TH, positions_Tg, plan, gather=gather)
    logits_AJVd = draft.logits(h_QH).view(A, J, -1)

    loss_sum, counts, correct = [], [], []
    for k, (valid, tgt_p_AVd) in enumerate(targets, start=1):
        logits_AVd = logits_AJVd[:, k]
        ce_A = -(tgt_p_AVd * F.log_softmax(_at_least_fp32(logits_AVd), dim=-1)).sum(-1)
        loss_sum.append((ce_A * valid).sum())
        counts.append(valid.sum())
        correct.append(((logits_AVd.argmax(-1) == tgt_p_AVd.argmax(-1)) & valid).sum())
    sum_S = torch.stack(loss_sum)
    decay_S = decay ** torch.arange(J - 1, device=sum_S.device, dtype=sum_S.dtype)
    denom = (decay_S * (torch.stack(counts) if count_S is None else count_S).to(sum_S.dtype)).sum()
    return DraftLossResult(
        loss=(decay_S * sum_S).sum() / denom.clamp(min=1e-6),
        loss_sum_S=sum_S.detach(),
        count_S=torch.stack(counts),
        correct_S=torch.stack(correct),
    )
