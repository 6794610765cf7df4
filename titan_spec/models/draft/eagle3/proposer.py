"""EAGLE-3's cached proposer: the draft's trunk and chain steps over a one-layer KV cache,
what the built-in engine drives to propose K tokens a round (``Eagle3Kind.cached_proposer``;
the protocol: models/draft/base.CachedProposer).

The cache's slot rule (slot == position; the chain's step-j key in slot t+j, where the TTT
branch key of training sits) is models/kv_cache.py's. The math is the draft's ``qkv`` and
``finish`` (model.py) with q/k/v and gate/up fused (models/fused.py) and the rotary angles
from a table (models/draft/rotary.py ``RotaryTable``); tests check it against the TTT unroll.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from titan_spec.models.draft.eagle3.model import Eagle3Draft
from titan_spec.models.draft.rotary import RotaryTable, rotate_half
from titan_spec.models.fused import FusedLinearWeight
from titan_spec.models.kv_cache import KVCache, Step, attend, compile_decode, require_plain, rms, step_indices, write_kv

__all__ = ["CachedDraft"]


class CachedDraft:
    """The EAGLE-3 draft's trunk (step 0) and chain steps over a one-layer KV cache.

    extend(): the trunk rows of the newly committed positions, t = start .. start+n-1,
        each fc(taps at t) with the embedding of x[t+1] at position t; returns the output
        of the LAST valid row (hidden, logits), which proposes the first draft token.
    step(): one chain step of that row, at position t+j with the embedding of draft
        token j; its key lands in slot t+j (the branch slot, models/kv_cache.py).
    """

    block_size = 0
    """A chain, not a block (models/draft/base.CachedProposer)."""

    def __init__(self, draft: Eagle3Draft, embed):
        self.draft = draft
        self.embed = embed
        a, ml = draft.arch, draft.midlayer
        require_plain(
            {
                "fc": draft.fc,
                "lm_head": draft.lm_head,
                "q_proj": ml.self_attn.q_proj,
                "k_proj": ml.self_attn.k_proj,
                "v_proj": ml.self_attn.v_proj,
                "o_proj": ml.self_attn.o_proj,
                "gate_proj": ml.mlp.gate_proj,
                "up_proj": ml.mlp.up_proj,
                "down_proj": ml.mlp.down_proj,
            },
            nn.Linear,
        )
        require_plain(
            {
                "input_layernorm": ml.input_layernorm,
                "hidden_norm": ml.hidden_norm,
                "post_attention_layernorm": ml.post_attention_layernorm,
                "norm": draft.norm,
            },
            nn.RMSNorm,
        )
        self.scale = a.head_dim**-0.5
        self.n_heads, self.n_kv_heads, self.head_dim = a.n_heads, a.n_kv_heads, a.head_dim
        self._gqa = bool(a.n_heads != a.n_kv_heads)
        self._qkv = FusedLinearWeight(ml.self_attn.q_proj, ml.self_attn.k_proj, ml.self_attn.v_proj)
        self._gate_up = FusedLinearWeight(ml.mlp.gate_proj, ml.mlp.up_proj)
        self.rotary = RotaryTable(a.head_dim, a.rope_theta, device=draft.fc.weight.device)
        self.cache: KVCache | None = None
        self._extend, self._step = self._extend_core, self._step_core

    def compile(self, backend: str = "inductor") -> None:
        self._extend = compile_decode(self._extend_core, backend)
        self._step = compile_decode(self._step_core, backend)

    def new_cache(self, batch: int, slots: int) -> None:
        a, p = self.draft.arch, self.draft.fc.weight
        self.cache = KVCache(1, batch, a.n_kv_heads, slots, a.head_dim, device=p.device, dtype=p.dtype)
        if self.rotary.device != p.device:
            self.rotary = RotaryTable(a.head_dim, a.rope_theta, device=p.device)
        self.rotary.ensure(slots)

    def weights(self) -> tuple[torch.Tensor, ...]:
        """(wqkv, w_gate_up, cos table, sin table), current; pass to extend/step for a batch."""
        return self._qkv.get(), self._gate_up.get(), self.rotary.cos_SlHd, self.rotary.sin_SlHd

    def extend(
        self,
        taps_BLCD: torch.Tensor,
        tokens_BL: torch.Tensor,
        start_B: torch.Tensor,
        n_B: torch.Tensor,
        n_slots: int | None = None,
        weights: tuple | None = None,
    ):
        """n_slots: a host-side bound >= max(start_B + n_B) (saves a sync); extra slots are masked."""
        pos_BL = start_B[:, None] + torch.arange(tokens_BL.shape[1], device=tokens_BL.device)[None, :]
        # Only the last committed row needs an output; the others only contribute keys.
        last_B = n_B - 1
        pos_B1 = pos_BL.gather(1, last_B[:, None])
        st, st_last = step_indices(pos_BL, mask=False), step_indices(pos_B1, n_slots)
        w = self.weights() if weights is None else weights
        return self._extend(
            taps_BLCD, tokens_BL, st, st_last, last_B, self.cache.k_YBKvSlHd[0], self.cache.v_YBKvSlHd[0], w
        )

    def step(
        self,
        h_BH: torch.Tensor,
        tokens_B: torch.Tensor,
        pos_B: torch.Tensor,
        n_slots: int | None = None,
        weights: tuple | None = None,
    ):
        """n_slots: max(pos_B) + 1 when the caller knows it on the host (saves a sync)."""
        st = step_indices(pos_B[:, None], n_slots)
        w = self.weights() if weights is None else weights
        return self._step(h_BH, tokens_B, st, self.cache.k_YBKvSlHd[0], self.cache.v_YBKvSlHd[0], w)

    def _qkv_rows(self, h_BLH, tokens_BL, pos_BL, w):
        B, L = tokens_BL.shape
        ml, (w_qkv, _, cos_SlHd, sin_SlHd) = self.draft.midlayer, w
        x_BL2H = torch.cat([rms(self.embed(tokens_BL), ml.input_layernorm), rms(h_BLH, ml.hidden_norm)], dim=-1)
        nq, nk = self.n_heads, self.n_kv_heads
        qkv_BLNfHd = F.linear(x_BL2H, w_qkv).view(B, L, nq + 2 * nk, self.head_dim)
        # q and k heads are adjacent: one rotation for both.
        qk_BLNfHd = rotate_half(qkv_BLNfHd[:, :, : nq + nk], cos_SlHd[pos_BL][:, :, None], sin_SlHd[pos_BL][:, :, None])
        return qk_BLNfHd[:, :, :nq], qk_BLNfHd[:, :, nq:], qkv_BLNfHd[:, :, nq + nk :]

    def _finish(self, h_BH, attn_BNHd, w):
        # model.py Eagle3Draft.finish, gate/up fused.
        d, ml = self.draft, self.draft.midlayer
        r_BH = h_BH + F.linear(attn_BNHd.flatten(1), ml.self_attn.o_proj.weight)
        gate_BF, up_BF = F.linear(rms(r_BH, ml.post_attention_layernorm), w[1]).chunk(2, dim=-1)
        out_BH = r_BH + F.linear(F.silu(gate_BF) * up_BF, ml.mlp.down_proj.weight)
        return out_BH, F.linear(rms(out_BH, d.norm), d.lm_head.weight)

    def _extend_core(self, taps_BLCD, tokens_BL, st: Step, st_last: Step, last_B, k_BKvSlHd, v_BKvSlHd, w):
        h_BLH = F.linear(taps_BLCD.flatten(2), self.draft.fc.weight)
        q_BLNHd, k_BLKvHd, v_BLKvHd = self._qkv_rows(h_BLH, tokens_BL, st.pos_BL, w)
        write_kv(k_BKvSlHd, v_BKvSlHd, st, k_BLKvHd, v_BLKvHd)
        rows_B = st.rows_BL[:, 0]
        out_B1NHd = attend(k_BKvSlHd, v_BKvSlHd, st_last, q_BLNHd[rows_B, last_B][:, None], self.scale, self._gqa)
        return self._finish(h_BLH[rows_B, last_B], out_B1NHd[:, 0], w)

    def _step_core(self, h_BH, tokens_B, st: Step, k_BKvSlHd, v_BKvSlHd, w):
        q_B1NHd, k_B1KvHd, v_B1KvHd = self._qkv_rows(h_BH[:, None], tokens_B[:, None], st.pos_BL, w)
        write_kv(k_BKvSlHd, v_BKvSlHd, st, k_B1KvHd, v_B1KvHd)
        out_B1NHd = attend(k_BKvSlHd, v_BKvSlHd, st, q_B1NHd, self.scale, self._gqa)
        return self._finish(h_BH, out_B1NHd[:, 0], w)
