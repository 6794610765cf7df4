"""EAGLE-3 training-time test (TTT): the draft's T-step unroll over a packed batch.

Mirrors inference (docs/ARCHITECTURE.md "Training-time test"): at step j, row t
  - reads the hidden h_j[t]: fc(taps at t) at j = 0, else the draft's own output of
    row t at step j-1;
  - reads the embedding of token x[t+1+j];
  - sits at rotary position pos[t] + j and attends to the step-0 keys of rows <= t of its
    document plus the branch keys k_1[t] .. k_j[t] (models/branch_attention.py);
  - is trained against the target's distribution at position t+1+j (its prediction of
    x[t+2+j]) restricted to the draft vocab, weighted decay**j.
A row is masked at step j when t+1+j leaves its document, when that position is outside
the loss region (labels == IGNORE), or when the target's argmax there is not in the
draft vocab. Everything the target provides (taps, embeddings, logits) is detached:
the draft loss never reaches the policy.

``draft`` below is an Eagle3Draft (model.py); this module does not import it (model.py's
forward runs ``ttt_unroll``, so the import goes one way: model.py -> ttt.py).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torchtitan.components.loss import IGNORE_INDEX

from titan_spec.models.attention import DocMetadata, doc_metadata_from_positions
from titan_spec.models.branch_attention import ttt_attention
from titan_spec.models.draft.base import DraftLossResult

__all__ = ["TTTResult", "ttt_inputs_for_sequences", "ttt_shifts", "ttt_targets", "ttt_unroll"]


TTTResult = DraftLossResult
"""The TTT loss's result (models/draft/base.DraftLossResult): loss = sum_j decay**j *
loss_sum[j] / count[j] (count: local, or the global one passed in); per step j the soft
cross-entropy sum over valid rows, the valid rows, and the rows where the draft's argmax
equals the target's (restricted) argmax."""


def ttt_shifts(positions_T: torch.Tensor, labels_T: torch.Tensor, steps: int):
    """For each step j: (src_T index of t+1+j clamped, valid_T: same document and in the loss
    region). Pure index math, shared by the unroll and its tests."""
    T = positions_T.numel()
    doc_T = torch.cumsum((positions_T == 0).to(torch.long), 0)
    t = torch.arange(T, device=positions_T.device)
    out = []
    for j in range(steps):
        idx = t + 1 + j
        src = idx.clamp(max=T - 1)
        valid = (idx < T) & (doc_T[src] == doc_T) & (labels_T[src] != IGNORE_INDEX)
        out.append((src, valid))
    return out


@torch.no_grad()
def ttt_targets(draft: nn.Module, positions_T, labels_T, target_logits_TV, steps: int, shifts=None):
    """Per step j: (src_T, valid_T, target_p_TVd). valid adds the mask 'target argmax is in
    the draft vocab' to ttt_shifts; target_p is the target's distribution at t+1+j
    restricted to the draft vocab (renormalized). ``shifts`` replaces ttt_shifts where rows
    t+1+j live elsewhere (context parallel: halo.TTTHalo)."""
    d2t_ids = draft.draft_to_target_ids()
    out = []
    for src, valid in shifts or ttt_shifts(positions_T, labels_T, steps):
        tgt_TV = target_logits_TV[src].float()
        valid = valid & draft.t2d[tgt_TV.argmax(-1)]
        out.append((src, valid, torch.softmax(tgt_TV[:, d2t_ids], dim=-1)))
    return out


def ttt_inputs_for_sequences(target, draft: nn.Module, seqs: list[list[int]], steps: int) -> tuple:
    """Offline distillation inputs: token sequences packed as documents, the target's
    (no-grad) taps, embeddings and logits over them, and the TTT targets of every position.
    ``draft(*inputs).loss`` is then the draft's TTT loss on them."""
    tok_T = torch.tensor([t for s in seqs for t in s])
    pos_T = torch.cat([torch.arange(len(s)) for s in seqs])
    meta = doc_metadata_from_positions(pos_T[None])
    with torch.no_grad():
        logits_1TV, taps = target(tok_T[None], pos_T[None], meta)
    targets = ttt_targets(draft, pos_T, tok_T, logits_1TV[0], steps)
    return tuple(h[0] for h in taps.hidden), taps.embeds_BLD[0], pos_T, meta, targets


def ttt_unroll(
    draft: nn.Module,
    taps_T3D: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    embeds_TH: torch.Tensor,
    positions_T: torch.Tensor,
    meta: DocMetadata,
    targets: list,
    decay: float = 0.8,
    count_S: torch.Tensor | None = None,
) -> TTTResult:
    """The draft's TTT loss over one packed stream, for ``targets = ttt_targets(...)``.
    ``count_S`` (valid rows per step summed over data-parallel ranks) normalizes the
    loss when given, else the local counts do."""
    taps = [t.detach() for t in taps_T3D]
    embeds_TH = embeds_TH.detach()
    scale = draft.arch.head_dim**-0.5

    h_TH = draft.fc(torch.cat(taps, dim=-1))
    k0 = v0 = None
    kb: list[torch.Tensor] = []
    vb: list[torch.Tensor] = []
    loss_sum, counts, correct, terms = [], [], [], []
    for j, (src, valid, tgt_p_TVd) in enumerate(targets):
        q, k, v = draft.qkv(h_TH, embeds_TH[src], positions_T + j)
        if j == 0:
            k0, v0 = k, v
        else:
            kb.append(k)
            vb.append(v)
        empty = k.new_zeros((0, *k.shape))
        attn = ttt_attention(q, k0, v0, torch.stack(kb) if kb else empty, torch.stack(vb) if vb else empty, meta, scale)
        h_TH, logits_TVd = draft.finish(h_TH, attn)

        logp_TVd = F.log_softmax(logits_TVd.float(), dim=-1)
        ce_T = -(tgt_p_TVd * logp_TVd).sum(-1)
        step_sum = (ce_T * valid).sum()
        n = valid.sum()
        denom = (count_S[j] if count_S is not None else n).clamp(min=1)
        terms.append((decay**j) * step_sum / denom)
        loss_sum.append(step_sum.detach())
        counts.append(n)
        correct.append(((logits_TVd.argmax(-1) == tgt_p_TVd.argmax(-1)) & valid).sum())
    return TTTResult(
        loss=torch.stack(terms).sum(),
        loss_sum_S=torch.stack(loss_sum),
        count_S=torch.stack(counts),
        correct_S=torch.stack(correct),
    )
