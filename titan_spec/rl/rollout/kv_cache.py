"""KV-cached forwards of the target (policy) and the EAGLE-3 draft, for the rollout engine.

Shape legend: B = batch rows (requests), L = new tokens per row this call, S = cache slots,
D = target dim, H = draft hidden, N = query heads, K = kv heads, Hd = head dim,
C = tap layers (3), V = target vocab, Vd = draft vocab, Y = layers.

Both caches use "slot == position": the K/V of the token at position t of a request
sits in slot t of its row. A query at position p attends to slots <= p of its row, so
one causal-by-position mask serves every case, without any per-row length bookkeeping:

  - prompts of different lengths: rows are right-padded; a padded query writes garbage
    into slots past its row's valid length, which no valid query can see (they sit at
    lower positions) and the next call overwrites.
  - speculative verify: the K+1 verified tokens are written at slots c..c+K; after
    acceptance only c..c+a are committed and the rest is overwritten by the next call.
  - the draft's chain (EAGLE-3 TTT, models/ttt.py): draft step j of row t sits at
    position t+j and attends to the step-0 ("trunk") keys of positions <= t plus its own
    branch keys k_1..k_j, which are exactly slots t+1..t+j when the branch key of step j
    is written at slot t+j. The next round's trunk rows overwrite those slots.

The target forward calls the model's own submodules (norms, qkv_linear, q/k norms, rope,
wo, feed_forward, lm_head) with the model's weights, in the order of torchtitan's
Qwen3/Llama3 blocks; only the inner attention is replaced by SDPA over the cache.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from titan_spec.models.draft import Eagle3Draft

__all__ = ["KVCache", "CachedTarget", "CachedDraft", "causal_slot_mask"]


class KVCache:
    """Preallocated K/V for Y layers: k_YBKSH, v_YBKSH (heads before slots, as SDPA reads)."""

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, slots: int, head_dim: int, *, device, dtype):
        shape = (n_layers, batch, n_kv_heads, slots, head_dim)
        self.k_YBKSH = torch.zeros(shape, device=device, dtype=dtype)
        self.v_YBKSH = torch.zeros(shape, device=device, dtype=dtype)

    @property
    def slots(self) -> int:
        return self.k_YBKSH.shape[3]

    def keep(self, rows_B: torch.Tensor) -> None:
        """Drop finished requests (one copy, so later steps stop paying for them)."""
        self.k_YBKSH = self.k_YBKSH[:, rows_B]
        self.v_YBKSH = self.v_YBKSH[:, rows_B]


class _Step(NamedTuple):
    """Per-call index tensors, made once in eager code and shared by every layer."""

    rows_BL: torch.Tensor
    pos_BL: torch.Tensor
    mask_B1LS: torch.Tensor
    """Query at position p sees slots 0..p of its own row; S = the slots in use."""


def _step_indices(pos_BL: torch.Tensor) -> _Step:
    # The slot count is a host int (one sync per forward), so attention only reads the
    # slots in use; under torch.compile it arrives as the mask's (dynamic) size.
    n_slots = int(pos_BL.max()) + 1
    rows_BL = torch.arange(pos_BL.shape[0], device=pos_BL.device)[:, None].expand_as(pos_BL)
    return _Step(rows_BL, pos_BL, causal_slot_mask(pos_BL, n_slots))


def causal_slot_mask(pos_BL: torch.Tensor, n_slots: int) -> torch.Tensor:
    """mask_B1LS: query at position p sees slots 0..p of its own row."""
    slots_S = torch.arange(n_slots, device=pos_BL.device)
    return (slots_S[None, None, :] <= pos_BL[:, :, None])[:, None]


def _write_and_attend(k_BKSH, v_BKSH, st: _Step, q_BLNH, k_BLKH, v_BLKH, scale):
    """Write this call's K/V at their positions, then attend over the slots in use."""
    # Advanced indices split by a slice put their dims first: the target is [B, L, K, Hd].
    k_BKSH[st.rows_BL, :, st.pos_BL] = k_BLKH
    v_BKSH[st.rows_BL, :, st.pos_BL] = v_BLKH
    n_slots = st.mask_B1LS.shape[-1]
    out_BNLH = F.scaled_dot_product_attention(
        q_BLNH.transpose(1, 2), k_BKSH[:, :, :n_slots], v_BKSH[:, :, :n_slots], attn_mask=st.mask_B1LS,
        scale=scale, enable_gqa=q_BLNH.shape[2] != k_BLKH.shape[2],
    )
    return out_BNLH.transpose(1, 2)


class CachedTarget:
    """The tapped torchtitan target (Qwen3/Llama3, dense) run step by step over a KV cache.

    ``forward(tokens_BL, start_B)`` appends L tokens per row at positions start_B + 0..L-1
    and returns the logits and the tap features (the tap layers' outputs in tap_ids order,
    as the draft's fc reads them).
    """

    def __init__(self, model: nn.Module, tap_ids: tuple[int, ...]):
        self.model = model
        self.blocks = list(model.layers.values())
        self.tap_ids = tuple(tap_ids)
        layer_index = {int(k): y for y, k in enumerate(model.layers.keys())}
        missing = [t for t in self.tap_ids if t not in layer_index]
        if missing:
            raise ValueError(f"tap layer ids {missing} are not layers of the target (0..{len(self.blocks) - 1})")
        # block index -> slot in the tap features (tap_ids order)
        self._tap_slot = {layer_index[t]: c for c, t in enumerate(self.tap_ids)}
        for block in self.blocks:
            if getattr(block, "moe_enabled", False):
                raise ValueError("the torch rollout engine supports dense targets only (this one has MoE layers)")
        attn = self.blocks[0].attention
        self.n_kv_heads, self.head_dim = attn.n_kv_heads, attn.head_dim
        self.max_seq_len = int(model.config.max_seq_len)
        self.vocab_size = int(model.config.vocab_size)
        self.dim = int(model.config.dim)
        self.cache: KVCache | None = None
        self._core = self._forward_core

    def compile(self, backend: str = "inductor") -> None:
        self._core = torch.compile(self._forward_core, dynamic=True, backend=backend)

    def new_cache(self, batch: int, slots: int) -> None:
        p = self.model.tok_embeddings.weight
        self.cache = KVCache(
            len(self.blocks), batch, self.n_kv_heads, slots, self.head_dim, device=p.device, dtype=p.dtype
        )

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.tok_embeddings(tokens)

    def forward(self, tokens_BL: torch.Tensor, start_B: torch.Tensor, logits_at_B: torch.Tensor | None = None):
        """Returns (logits, taps_BLCD). logits is [B, L, V], or [B, V] at index logits_at_B
        of each row when given (the prefill needs only the last prompt position).
        taps_BLCD is None when there are no tap ids (no draft to feed)."""
        pos_BL = start_B[:, None] + torch.arange(tokens_BL.shape[1], device=tokens_BL.device)[None, :]
        st = _step_indices(pos_BL)
        # Slots past the model's length only hold tokens whose outputs are never used
        # (they would be past max_new_tokens); clamp their rotary position to stay in the table.
        rope_pos_BL = pos_BL.clamp(max=self.max_seq_len - 1)
        return self._core(tokens_BL, st, rope_pos_BL, self.cache.k_YBKSH, self.cache.v_YBKSH, logits_at_B)

    def _forward_core(self, tokens_BL, st: _Step, rope_pos_BL, k_YBKSH, v_YBKSH, logits_at_B):
        # Qwen3/Llama3 block: x + attn(attention_norm(x)), then + feed_forward(ffn_norm(x)).
        h_BLD = self.model.tok_embeddings(tokens_BL)
        taps: list[torch.Tensor] = [h_BLD] * len(self.tap_ids)
        for y, block in enumerate(self.blocks):
            attn = block.attention
            xq_BLNH, xk_BLKH, xv_BLKH = attn.qkv_linear(block.attention_norm(h_BLD))
            if attn.q_norm is not None:
                xq_BLNH, xk_BLKH = attn.q_norm(xq_BLNH), attn.k_norm(xk_BLKH)
            xq_BLNH, xk_BLKH = attn.rope(xq_BLNH, xk_BLKH, rope_pos_BL)
            scale = attn.scaling if attn.scaling is not None else attn.head_dim**-0.5
            out_BLNH = _write_and_attend(k_YBKSH[y], v_YBKSH[y], st, xq_BLNH, xk_BLKH, xv_BLKH, scale)
            h_BLD = h_BLD + attn.wo(out_BLNH.flatten(2))
            h_BLD = h_BLD + block.feed_forward(block.ffn_norm(h_BLD))
            if y in self._tap_slot:
                taps[self._tap_slot[y]] = h_BLD
        taps_BLCD = torch.stack(taps, dim=2) if taps else None
        if logits_at_B is not None:
            h_BLD = h_BLD[torch.arange(h_BLD.shape[0], device=h_BLD.device), logits_at_B]
        return self.model.lm_head(self.model.norm(h_BLD)), taps_BLCD


class CachedDraft:
    """The EAGLE-3 draft's trunk (step 0) and chain steps over a one-layer KV cache.

    extend(): the trunk rows of the newly committed positions, t = start .. start+n-1,
        each fc(taps at t) with the embedding of x[t+1] at position t; returns the output
        of the LAST valid row (hidden, logits), which proposes the first draft token.
    step(): one chain step of that row, at position t+j with the embedding of draft
        token j; its key lands in slot t+j (the branch slot, see the module docstring).
    """

    def __init__(self, draft: Eagle3Draft, embed):
        self.draft = draft
        self.embed = embed
        self.scale = draft.arch.head_dim**-0.5
        self.cache: KVCache | None = None
        self._extend, self._step = self._extend_core, self._step_core

    def compile(self, backend: str = "inductor") -> None:
        self._extend = torch.compile(self._extend_core, dynamic=True, backend=backend)
        self._step = torch.compile(self._step_core, dynamic=True, backend=backend)

    def new_cache(self, batch: int, slots: int) -> None:
        a, p = self.draft.arch, self.draft.fc.weight
        self.cache = KVCache(1, batch, a.n_kv_heads, slots, a.head_dim, device=p.device, dtype=p.dtype)

    def extend(self, taps_BLCD: torch.Tensor, tokens_BL: torch.Tensor, start_B: torch.Tensor, n_B: torch.Tensor):
        pos_BL = start_B[:, None] + torch.arange(tokens_BL.shape[1], device=tokens_BL.device)[None, :]
        # Only the last committed row needs an output; the others only contribute keys.
        last_B = n_B - 1
        pos_B1 = pos_BL.gather(1, last_B[:, None])
        st, st_last = _step_indices(pos_BL), _step_indices(pos_B1)
        return self._extend(taps_BLCD, tokens_BL, st, st_last, last_B, self.cache.k_YBKSH[0], self.cache.v_YBKSH[0])

    def step(self, h_BH: torch.Tensor, tokens_B: torch.Tensor, pos_B: torch.Tensor):
        st = _step_indices(pos_B[:, None])
        return self._step(h_BH, tokens_B, st, self.cache.k_YBKSH[0], self.cache.v_YBKSH[0])

    def _qkv(self, h_BLH, tokens_BL, pos_BL):
        B, L = tokens_BL.shape
        q_TNH, k_TKH, v_TKH = self.draft.qkv(
            h_BLH.reshape(B * L, -1), self.embed(tokens_BL).reshape(B * L, -1), pos_BL.reshape(-1)
        )
        return tuple(x.view(B, L, *x.shape[1:]) for x in (q_TNH, k_TKH, v_TKH))

    def _extend_core(self, taps_BLCD, tokens_BL, st: _Step, st_last: _Step, last_B, k_BKSH, v_BKSH):
        h_BLH = self.draft.fc(taps_BLCD.flatten(2))
        q_BLNH, k_BLKH, v_BLKH = self._qkv(h_BLH, tokens_BL, st.pos_BL)
        k_BKSH[st.rows_BL, :, st.pos_BL] = k_BLKH
        v_BKSH[st.rows_BL, :, st.pos_BL] = v_BLKH
        rows_B = st.rows_BL[:, 0]
        q_B1NH = q_BLNH[rows_B, last_B][:, None]
        # Re-writing the last row's own K/V is a no-op that lets one helper do the attention.
        k_B1KH, v_B1KH = k_BLKH[rows_B, last_B][:, None], v_BLKH[rows_B, last_B][:, None]
        out_B1NH = _write_and_attend(k_BKSH, v_BKSH, st_last, q_B1NH, k_B1KH, v_B1KH, self.scale)
        return self.draft.finish(h_BLH[rows_B, last_B], out_B1NH[:, 0])

    def _step_core(self, h_BH, tokens_B, st: _Step, k_BKSH, v_BKSH):
        q_B1NH, k_B1KH, v_B1KH = self._qkv(h_BH[:, None], tokens_B[:, None], st.pos_BL)
        out_B1NH = _write_and_attend(k_BKSH, v_BKSH, st, q_B1NH, k_B1KH, v_B1KH, self.scale)
        return self.draft.finish(h_BH, out_B1NH[:, 0])
