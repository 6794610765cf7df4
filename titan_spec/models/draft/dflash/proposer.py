"""DFlash's cached proposer: the context K/V of every committed position in a per-layer KV cache,
and one forward over a block that proposes block_size - 1 tokens (``DFlashKind.cached_proposer``;
the protocol: models/draft/base.BlockProposer).

As in vLLM's DFlash proposer (vllm/v1/spec_decode/dflash.py): ``extend`` writes the committed
positions' context K/V (the draft's ``context_kv`` of hidden_norm(fc(taps))) into slots ==
positions, as ``precompute_and_store_context_kv`` does; ``propose`` runs the block [y, mask,
..., mask] at positions c .. c+J-1 (y: the pending token at c), writes its K/V into slots
c .. c+J-1 and lets every block row see all slots <= c+J-1: the context < c and the whole
block. The next round's ``extend`` overwrites the block's slots with context. The math is the
draft's ``block_qkv`` / ``block_finish`` / ``logits`` (model.py); tests check it against the
training loss's forward.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from titan_spec.models.draft.dflash.model import DFlashDraft
from titan_spec.models.kv_cache import (
    KVCache,
    Step,
    attend,
    causal_slot_mask,
    compile_decode,
    require_plain,
    step_indices,
    write_kv,
)

__all__ = ["CachedBlockDraft"]


class CachedBlockDraft:
    """The DFlash draft over a KV cache of draft.arch.n_layers layers."""

    def __init__(self, draft: DFlashDraft, embed):
        self.draft, self.embed = draft, embed
        a = draft.arch
        require_plain({n: m for n, m in draft.named_modules() if isinstance(m, nn.Linear)}, nn.Linear)
        require_plain({n: m for n, m in draft.named_modules() if isinstance(m, nn.RMSNorm)}, nn.RMSNorm)
        self.block_size = a.block_size
        self.proposals = a.block_size - 1
        self.has_confidence = False
        self.scale = a.head_dim**-0.5
        self._gqa = bool(a.n_heads != a.n_kv_heads)
        self.cache: KVCache | None = None
        self._extend, self._propose = self._extend_core, self._propose_core

    def compile(self, backend: str = "inductor") -> None:
        self._extend = compile_decode(self._extend_core, backend)
        self._propose = compile_decode(self._propose_core, backend)

    def new_cache(self, batch: int, slots: int) -> None:
        a, p = self.draft.arch, self.draft.fc.weight
        self.cache = KVCache(a.n_layers, batch, a.n_kv_heads, slots, a.head_dim, device=p.device, dtype=p.dtype)

    def weights(self) -> tuple[torch.Tensor, ...]:
        """Nothing to fuse: the cores read the draft's modules."""
        return ()

    def extend(
        self,
        taps_BLCD: torch.Tensor,
        tokens_BL: torch.Tensor,
        start_B: torch.Tensor,
        n_B: torch.Tensor,
        n_slots: int | None = None,
        weights: tuple | None = None,
    ) -> None:
        """Write the context K/V of positions start .. start+L-1 (rows past n_B write slots that
        no query sees before the next call overwrites them: models/kv_cache.py)."""
        pos_BL = start_B[:, None] + torch.arange(tokens_BL.shape[1], device=tokens_BL.device)[None, :]
        self._extend(taps_BLCD, step_indices(pos_BL, mask=False), self.cache.k_YBKvSlHd, self.cache.v_YBKvSlHd)

    def propose(self, y_B: torch.Tensor, c_B: torch.Tensor, n_slots: int, weights: tuple | None = None) -> torch.Tensor:
        """The block at positions c .. c+J-1 -> logits_BJVd of block rows 1 .. J-1 (the proposals
        for positions c+1 .. c+J-1). n_slots: a host-side bound >= max(c_B) + J."""
        J = self.block_size
        pos_BJ = c_B[:, None] + torch.arange(J, device=c_B.device)[None, :]
        # Every block row sees the context and the whole block: all slots <= c+J-1.
        mask = causal_slot_mask((c_B + J - 1)[:, None].expand(-1, J), n_slots)
        rows_BJ = torch.arange(c_B.shape[0], device=c_B.device)[:, None].expand_as(pos_BJ)
        return self._propose(y_B, Step(rows_BJ, pos_BJ, mask), self.cache.k_YBKvSlHd, self.cache.v_YBKvSlHd)

    def row(self, out_BJ: torch.Tensor, j: int, prev_B: torch.Tensor, confidence: bool = False):
        """(logits_BVd of proposal j from ``propose``'s output, None): DFlash's rows do not read
        the previous token, and it has no confidence head."""
        return out_BJ[:, j], None

    def _block_rows(self, h_BJH: torch.Tensor) -> torch.Tensor:
        """What ``propose`` returns of the last layer's block rows: rows 1 .. J-1's logits."""
        return self.draft.logits(h_BJH[:, 1:])

    def _extend_core(self, taps_BLCD, st: Step, k_YBKvSlHd, v_YBKvSlHd):
        d = self.draft
        B, L = st.pos_BL.shape
        ctx_TH = d.context(taps_BLCD.flatten(2)).reshape(B * L, -1)
        for i in range(d.arch.n_layers):
            k_TKvHd, v_TKvHd = d.context_kv(i, ctx_TH, st.pos_BL.reshape(-1))
            write_kv(
                k_YBKvSlHd[i],
                v_YBKvSlHd[i],
                st,
                k_TKvHd.view(B, L, *k_TKvHd.shape[1:]),
                v_TKvHd.view(B, L, *v_TKvHd.shape[1:]),
            )

    def _propose_core(self, y_B, st: Step, k_YBKvSlHd, v_YBKvSlHd):
        d = self.draft
        B, J = st.pos_BL.shape
        known_B1H = self.embed(y_B)[:, None]
        h_BJH = torch.cat([known_B1H, d.mask_embedding.to(known_B1H.dtype).expand(B, J - 1, -1)], dim=1)
        pos_Q = st.pos_BL.reshape(-1)
        for i in range(d.arch.n_layers):
            q_QNHd, k_QKvHd, v_QKvHd = d.block_qkv(i, h_BJH.reshape(B * J, -1), pos_Q)
            write_kv(
                k_YBKvSlHd[i],
                v_YBKvSlHd[i],
                st,
                k_QKvHd.view(B, J, *k_QKvHd.shape[1:]),
                v_QKvHd.view(B, J, *v_QKvHd.shape[1:]),
            )
            out_BJNHd = attend(
                k_YBKvSlHd[i], v_YBKvSlHd[i], st, q_QNHd.view(B, J, *q_QNHd.shape[1:]), self.scale, self._gqa
            )
            h_BJH = d.block_finish(i, h_BJH.reshape(B * J, -1), out_BJNHd.reshape(B * J, *out_BJNHd.shape[2:])).view(
                B, J, -1
            )
        return self._block_rows(h_BJH)
