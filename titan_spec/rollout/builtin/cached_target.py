"""The target (policy) over a KV cache, step by step, for the built-in rollout engine.

The cache, its "slot == position" rule (right-padded prompts, rejected verify tails, the
draft chain's branch slots) and the write/attend ops are models/kv_cache.py's, shared with
the draft kinds' cached proposers (models/draft/<kind>/proposer.py).

The forward applies the ops of torchtitan's Qwen3/Llama3 blocks to the model's own
weights, in the same order (F.rms_norm with each norm's weight and eps, F.linear, the
model's rotary cache and rotary function, silu-gated feed-forward, lm_head); the inner
attention is SDPA over the cache. It calls functions, not the submodules: at decode sizes
a module call (hooks, torchtitan's DTensor bookkeeping in qkv_linear and rope) costs more
than its matmul. Projections that read the same input (wq/wk/wv, w1/w3) run as one matmul
over weights concatenated by models/fused.py, which gives the same numbers. The rotary
positions are looked up once per forward, not per layer.

Host syncs: the only host value a forward needs is the number of cache slots in use;
the engine knows it (it tracks positions on the host from its one transfer per round)
and passes it as ``n_slots``; without it the forward reads max(position) (one sync).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from titan_spec.models.fused import FusedLinearWeight
from titan_spec.models.kv_cache import KVCache, Step, attend, compile_decode, require_plain, rms, step_indices, write_kv

__all__ = ["CachedTarget"]


class CachedTarget:
    """The tapped torchtitan target (Qwen3/Llama3, dense or Qwen3-MoE) run step by step over a KV cache.

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
        # MoE blocks run torchtitan's own MoE module on the step's rows (router, dispatch,
        # experts: the training forward's math); dense blocks the fused w1/w3 below.
        self._moe = [bool(getattr(b, "moe_enabled", False)) for b in self.blocks]
        linears, norms = {"lm_head": model.lm_head}, {"norm": model.norm}
        for y, b in enumerate(self.blocks):
            a = b.attention
            ffn = (
                ()
                if self._moe[y]
                else (("w1", b.feed_forward.w1), ("w2", b.feed_forward.w2), ("w3", b.feed_forward.w3))
            )
            linears |= {
                f"layers.{y}.{n}": m
                for n, m in (
                    ("wq", a.qkv_linear.wq),
                    ("wk", a.qkv_linear.wk),
                    ("wv", a.qkv_linear.wv),
                    ("wo", a.wo),
                    *ffn,
                )
            }
            norms |= {f"layers.{y}.attention_norm": b.attention_norm, f"layers.{y}.ffn_norm": b.ffn_norm}
            if a.q_norm is not None:
                norms |= {f"layers.{y}.q_norm": a.q_norm, f"layers.{y}.k_norm": a.k_norm}
        require_plain(linears, nn.Linear)
        require_plain(norms, nn.RMSNorm)
        attn = self.blocks[0].attention
        self.n_kv_heads, self.head_dim = attn.n_kv_heads, attn.head_dim
        self._gqa = bool(attn.n_heads != attn.n_kv_heads)
        self.max_seq_len = int(model.config.max_seq_len)
        self.vocab_size = int(model.config.vocab_size)
        self.dim = int(model.config.dim)
        self._qkv = [
            FusedLinearWeight(b.attention.qkv_linear.wq, b.attention.qkv_linear.wk, b.attention.qkv_linear.wv)
            for b in self.blocks
        ]
        self._w13 = [
            None if moe else FusedLinearWeight(b.feed_forward.w1, b.feed_forward.w3)
            for b, moe in zip(self.blocks, self._moe)
        ]
        self._no_w13 = torch.empty(0)
        self._qkv_heads = [n // self.head_dim for n in self._qkv[0].sizes]
        # Every layer's rotary module has the same config (and so the same cache): look the
        # positions up once per forward instead of once per layer.
        rope0 = attn.rope
        self._shared_rope = all(b.attention.rope.config == rope0.config for b in self.blocks)
        self.cache: KVCache | None = None
        self._core = self._forward_core

    def compile(self, backend: str = "inductor") -> None:
        self._core = compile_decode(self._forward_core, backend)

    def new_cache(self, batch: int, slots: int) -> None:
        p = self.model.tok_embeddings.weight
        self.cache = KVCache(
            len(self.blocks), batch, self.n_kv_heads, slots, self.head_dim, device=p.device, dtype=p.dtype
        )

    def fused_weights(self) -> list[torch.Tensor]:
        """[wqkv, w13] per layer, current (rebuilt when the model's weights changed)."""
        return [
            w
            for y in range(len(self.blocks))
            for w in (self._qkv[y].get(), self._no_w13 if self._w13[y] is None else self._w13[y].get())
        ]

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.tok_embeddings(tokens)

    def forward(
        self,
        tokens_BL: torch.Tensor,
        start_B: torch.Tensor,
        logits_at_B: torch.Tensor | None = None,
        n_slots: int | None = None,
        fused: list[torch.Tensor] | None = None,
    ):
        """Returns (logits, taps_BLCD). logits is [B, L, V], or [B, V] at index logits_at_B
        of each row when given (the prefill needs only the last prompt position).
        taps_BLCD is None when there are no tap ids (no draft to feed).
        n_slots: max(start_B) + L when the caller knows it on the host (saves a sync);
        fused: ``fused_weights()`` when the caller holds them for a whole batch."""
        pos_BL = start_B[:, None] + torch.arange(tokens_BL.shape[1], device=tokens_BL.device)[None, :]
        st = step_indices(pos_BL, n_slots)
        # Slots past the model's length only hold tokens whose outputs are never used
        # (they would be past max_new_tokens); clamp their rotary position to stay in the table.
        rope_pos_BL = pos_BL.clamp(max=self.max_seq_len - 1)
        fused = self.fused_weights() if fused is None else fused
        return self._core(tokens_BL, st, rope_pos_BL, self.cache.k_YBKvSlHd, self.cache.v_YBKvSlHd, logits_at_B, fused)

    def _forward_core(self, tokens_BL, st: Step, rope_pos_BL, k_YBKvSlHd, v_YBKvSlHd, logits_at_B, fused):
        # Qwen3/Llama3 block: x + attn(attention_norm(x)), then + feed_forward(ffn_norm(x)).
        B, L = tokens_BL.shape
        h_BLD = self.model.tok_embeddings(tokens_BL)
        taps: list[torch.Tensor] = [h_BLD] * len(self.tap_ids)
        rope_cache = None
        for y, block in enumerate(self.blocks):
            attn = block.attention
            qkv_BLO = F.linear(rms(h_BLD, block.attention_norm), fused[2 * y])
            xq_BLNHd, xk_BLKvHd, xv_BLKvHd = qkv_BLO.view(B, L, -1, self.head_dim).split(self._qkv_heads, dim=2)
            if attn.q_norm is not None:
                xq_BLNHd, xk_BLKvHd = rms(xq_BLNHd, attn.q_norm), rms(xk_BLKvHd, attn.k_norm)
            if rope_cache is None or not self._shared_rope:
                # The model's own lookup (any rotary flavor), once per forward when shared.
                rope_cache = attn.rope._reshape_cache(xq_BLNHd, rope_pos_BL)
            xq_BLNHd, xk_BLKvHd = attn.rope.apply_rotary_emb(xq_BLNHd, xk_BLKvHd, rope_cache)
            scale = attn.scaling if attn.scaling is not None else attn.head_dim**-0.5
            write_kv(k_YBKvSlHd[y], v_YBKvSlHd[y], st, xk_BLKvHd, xv_BLKvHd)
            out_BLNHd = attend(k_YBKvSlHd[y], v_YBKvSlHd[y], st, xq_BLNHd, scale, self._gqa)
            h_BLD = h_BLD + F.linear(out_BLNHd.flatten(2), attn.wo.weight)
            if self._moe[y]:
                h_BLD = h_BLD + block.moe(rms(h_BLD, block.ffn_norm))
            else:
                gate_BLF, up_BLF = F.linear(rms(h_BLD, block.ffn_norm), fused[2 * y + 1]).chunk(2, dim=-1)
                h_BLD = h_BLD + F.linear(F.silu(gate_BLF) * up_BLF, block.feed_forward.w2.weight)
            if y in self._tap_slot:
                taps[self._tap_slot[y]] = h_BLD
        taps_BLCD = torch.stack(taps, dim=2) if taps else None
        if logits_at_B is not None:
            h_BLD = h_BLD[torch.arange(h_BLD.shape[0], device=h_BLD.device), logits_at_B]
        return F.linear(rms(h_BLD, self.model.norm), self.model.lm_head.weight), taps_BLCD
