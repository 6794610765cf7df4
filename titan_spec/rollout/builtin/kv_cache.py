"""KV-cached forwards of the target (policy) and the EAGLE-3 draft, for the rollout engine.

Shape legend: B = batch rows (requests), L = new tokens per row this call, S = cache slots,
D = target dim, H = draft hidden, N = query heads, K = kv heads, Hd = head dim,
C = tap layers (3), V = target vocab, Vd = draft vocab, Y = layers, F = output features
of a fused projection, n = the q + k (+ v) heads of a fused projection.

Both caches use "slot == position": the K/V of the token at position t of a request
sits in slot t of its row. A query at position p attends to slots <= p of its row, so
one causal-by-position mask serves every case, without any per-row length bookkeeping:

  - prompts of different lengths: rows are right-padded; a padded query writes garbage
    into slots past its row's valid length, which no valid query can see (they sit at
    lower positions) and the next call overwrites.
  - speculative verify: the K+1 verified tokens are written at slots c..c+K; after
    acceptance only c..c+a are committed and the rest is overwritten by the next call.
  - the draft's chain (EAGLE-3 TTT, models/draft/eagle3/ttt.py): draft step j of row t sits at
    position t+j and attends to the step-0 ("trunk") keys of positions <= t plus its own
    branch keys k_1..k_j, which are exactly slots t+1..t+j when the branch key of step j
    is written at slot t+j. The next round's trunk rows overwrite those slots.

The target forward applies the ops of torchtitan's Qwen3/Llama3 blocks to the model's own
weights, in the same order (F.rms_norm with each norm's weight and eps, F.linear, the
model's rotary cache and rotary function, silu-gated feed-forward, lm_head); the inner
attention is SDPA over the cache. It calls functions, not the submodules: at decode sizes
a module call (hooks, torchtitan's DTensor bookkeeping in qkv_linear and rope) costs more
than its matmul. Projections that read the same input (wq/wk/wv, w1/w3; the draft's
q/k/v and gate/up) run as one matmul over weights concatenated by fused.py, which gives
the same numbers. The rotary positions are looked up once per forward, not per layer.
The draft does the same with a precomputed cos/sin table.

Host syncs: the only host value a forward needs is the number of cache slots in use;
the engine knows it (it tracks positions on the host from its one transfer per round)
and passes it as ``n_slots``; without it the forward reads max(position) (one sync).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from titan_spec.models.draft.eagle3.model import Eagle3Draft, rotate_half
from titan_spec.rollout.builtin.fused import FusedLinearWeight, RotaryTable

__all__ = ["KVCache", "CachedTarget", "CachedDraft", "PROPOSERS", "causal_slot_mask"]


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
    mask_B1LS: torch.Tensor | None
    """Query at position p sees slots 0..p of its own row; S = the slots in use
    (None for a call that only writes K/V)."""


def _step_indices(pos_BL: torch.Tensor, n_slots: int | None = None, *, mask: bool = True) -> _Step:
    rows_BL = torch.arange(pos_BL.shape[0], device=pos_BL.device)[:, None].expand_as(pos_BL)
    if not mask:
        return _Step(rows_BL, pos_BL, None)
    if n_slots is None:
        # Without the caller's host-side count this is one device->host sync.
        n_slots = int(pos_BL.max()) + 1
    # Under torch.compile the slot count arrives as the mask's (dynamic) size.
    return _Step(rows_BL, pos_BL, causal_slot_mask(pos_BL, n_slots))


def causal_slot_mask(pos_BL: torch.Tensor, n_slots: int) -> torch.Tensor:
    """mask_B1LS: query at position p sees slots 0..p of its own row."""
    slots_S = torch.arange(n_slots, device=pos_BL.device)
    return (slots_S[None, None, :] <= pos_BL[:, :, None])[:, None]


def _write(k_BKSH, v_BKSH, st: _Step, k_BLKH, v_BLKH) -> None:
    # Advanced indices split by a slice put their dims first: the target is [B, L, K, Hd].
    k_BKSH[st.rows_BL, :, st.pos_BL] = k_BLKH
    v_BKSH[st.rows_BL, :, st.pos_BL] = v_BLKH


def _attend(k_BKSH, v_BKSH, st: _Step, q_BLNH, scale, gqa: bool):
    """SDPA of this call's queries over the slots in use of their rows. ``gqa`` is a Python
    bool from the head counts: under torch.compile(dynamic=True) a comparison of tensor
    sizes is symbolic, which SDPA refuses (a graph break that skips the whole forward)."""
    n_slots = st.mask_B1LS.shape[-1]
    out_BNLH = F.scaled_dot_product_attention(
        q_BLNH.transpose(1, 2), k_BKSH[:, :, :n_slots], v_BKSH[:, :, :n_slots], attn_mask=st.mask_B1LS,
        scale=scale, enable_gqa=gqa,
    )
    return out_BNLH.transpose(1, 2)


def _rms(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """nn.RMSNorm(x) with ``norm``'s weight and eps."""
    if x.device.type != "cpu" or x.dtype != torch.float32:
        return F.rms_norm(x, norm.normalized_shape, norm.weight, norm.eps)
    # On CPU, aten's rms_norm is these same float32 ops in this order (so the result is
    # bitwise equal; tests check it), plus dtype round-trips that at decode sizes cost
    # more than the math. Elsewhere F.rms_norm is one fused kernel and stays.
    eps = norm.eps if norm.eps is not None else torch.finfo(x.dtype).eps
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * norm.weight


def _require(modules: dict[str, nn.Module], kind: type) -> None:
    """The fast path re-implements these modules' forwards; a subclass that changes forward
    (float8, LoRA, ...) would be silently skipped, so refuse it."""
    bad = [f"{k} ({type(m).__name__})" for k, m in modules.items() if type(m).forward is not kind.forward]
    if bad:
        raise ValueError(f"the torch rollout engine needs plain {kind.__name__} modules; these are not: {', '.join(bad)}")


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
            ffn = () if self._moe[y] else (("w1", b.feed_forward.w1), ("w2", b.feed_forward.w2), ("w3", b.feed_forward.w3))
            linears |= {f"layers.{y}.{n}": m for n, m in (("wq", a.qkv_linear.wq), ("wk", a.qkv_linear.wk),
                        ("wv", a.qkv_linear.wv), ("wo", a.wo), *ffn)}
            norms |= {f"layers.{y}.attention_norm": b.attention_norm, f"layers.{y}.ffn_norm": b.ffn_norm}
            if a.q_norm is not None:
                norms |= {f"layers.{y}.q_norm": a.q_norm, f"layers.{y}.k_norm": a.k_norm}
        _require(linears, nn.Linear)
        _require(norms, nn.RMSNorm)
        attn = self.blocks[0].attention
        self.n_kv_heads, self.head_dim = attn.n_kv_heads, attn.head_dim
        self._gqa = bool(attn.n_heads != attn.n_kv_heads)
        self.max_seq_len = int(model.config.max_seq_len)
        self.vocab_size = int(model.config.vocab_size)
        self.dim = int(model.config.dim)
        self._qkv = [FusedLinearWeight(b.attention.qkv_linear.wq, b.attention.qkv_linear.wk, b.attention.qkv_linear.wv)
                     for b in self.blocks]
        self._w13 = [None if moe else FusedLinearWeight(b.feed_forward.w1, b.feed_forward.w3)
                     for b, moe in zip(self.blocks, self._moe)]
        self._no_w13 = torch.empty(0)
        self._qkv_heads = [n // self.head_dim for n in self._qkv[0].sizes]
        # Every layer's rotary module has the same config (and so the same cache): look the
        # positions up once per forward instead of once per layer.
        rope0 = attn.rope
        self._shared_rope = all(b.attention.rope.config == rope0.config for b in self.blocks)
        self.cache: KVCache | None = None
        self._core = self._forward_core

    def compile(self, backend: str = "inductor") -> None:
        # fullgraph: a graph break would make dynamo run the whole forward eager (correct but
        # 4x slower, silently); a clear error is better.
        self._core = torch.compile(self._forward_core, dynamic=True, backend=backend, fullgraph=True)

    def new_cache(self, batch: int, slots: int) -> None:
        p = self.model.tok_embeddings.weight
        self.cache = KVCache(
            len(self.blocks), batch, self.n_kv_heads, slots, self.head_dim, device=p.device, dtype=p.dtype
        )

    def fused_weights(self) -> list[torch.Tensor]:
        """[wqkv, w13] per layer, current (rebuilt when the model's weights changed)."""
        return [w for y in range(len(self.blocks))
                for w in (self._qkv[y].get(), self._no_w13 if self._w13[y] is None else self._w13[y].get())]

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.tok_embeddings(tokens)

    def forward(self, tokens_BL: torch.Tensor, start_B: torch.Tensor, logits_at_B: torch.Tensor | None = None,
                n_slots: int | None = None, fused: list[torch.Tensor] | None = None):
        """Returns (logits, taps_BLCD). logits is [B, L, V], or [B, V] at index logits_at_B
        of each row when given (the prefill needs only the last prompt position).
        taps_BLCD is None when there are no tap ids (no draft to feed).
        n_slots: max(start_B) + L when the caller knows it on the host (saves a sync);
        fused: ``fused_weights()`` when the caller holds them for a whole batch."""
        pos_BL = start_B[:, None] + torch.arange(tokens_BL.shape[1], device=tokens_BL.device)[None, :]
        st = _step_indices(pos_BL, n_slots)
        # Slots past the model's length only hold tokens whose outputs are never used
        # (they would be past max_new_tokens); clamp their rotary position to stay in the table.
        rope_pos_BL = pos_BL.clamp(max=self.max_seq_len - 1)
        fused = self.fused_weights() if fused is None else fused
        return self._core(tokens_BL, st, rope_pos_BL, self.cache.k_YBKSH, self.cache.v_YBKSH, logits_at_B, fused)

    def _forward_core(self, tokens_BL, st: _Step, rope_pos_BL, k_YBKSH, v_YBKSH, logits_at_B, fused):
        # Qwen3/Llama3 block: x + attn(attention_norm(x)), then + feed_forward(ffn_norm(x)).
        B, L = tokens_BL.shape
        h_BLD = self.model.tok_embeddings(tokens_BL)
        taps: list[torch.Tensor] = [h_BLD] * len(self.tap_ids)
        rope_cache = None
        for y, block in enumerate(self.blocks):
            attn = block.attention
            qkv_BLF = F.linear(_rms(h_BLD, block.attention_norm), fused[2 * y])
            xq_BLNH, xk_BLKH, xv_BLKH = qkv_BLF.view(B, L, -1, self.head_dim).split(self._qkv_heads, dim=2)
            if attn.q_norm is not None:
                xq_BLNH, xk_BLKH = _rms(xq_BLNH, attn.q_norm), _rms(xk_BLKH, attn.k_norm)
            if rope_cache is None or not self._shared_rope:
                # The model's own lookup (any rotary flavor), once per forward when shared.
                rope_cache = attn.rope._reshape_cache(xq_BLNH, rope_pos_BL)
            xq_BLNH, xk_BLKH = attn.rope.apply_rotary_emb(xq_BLNH, xk_BLKH, rope_cache)
            scale = attn.scaling if attn.scaling is not None else attn.head_dim**-0.5
            _write(k_YBKSH[y], v_YBKSH[y], st, xk_BLKH, xv_BLKH)
            out_BLNH = _attend(k_YBKSH[y], v_YBKSH[y], st, xq_BLNH, scale, self._gqa)
            h_BLD = h_BLD + F.linear(out_BLNH.flatten(2), attn.wo.weight)
            if self._moe[y]:
                h_BLD = h_BLD + block.moe(_rms(h_BLD, block.ffn_norm))
            else:
                gate_BLF, up_BLF = F.linear(_rms(h_BLD, block.ffn_norm), fused[2 * y + 1]).chunk(2, dim=-1)
                h_BLD = h_BLD + F.linear(F.silu(gate_BLF) * up_BLF, block.feed_forward.w2.weight)
            if y in self._tap_slot:
                taps[self._tap_slot[y]] = h_BLD
        taps_BLCD = torch.stack(taps, dim=2) if taps else None
        if logits_at_B is not None:
            h_BLD = h_BLD[torch.arange(h_BLD.shape[0], device=h_BLD.device), logits_at_B]
        return F.linear(_rms(h_BLD, self.model.norm), self.model.lm_head.weight), taps_BLCD


class CachedDraft:
    """The EAGLE-3 draft's trunk (step 0) and chain steps over a one-layer KV cache.

    extend(): the trunk rows of the newly committed positions, t = start .. start+n-1,
        each fc(taps at t) with the embedding of x[t+1] at position t; returns the output
        of the LAST valid row (hidden, logits), which proposes the first draft token.
    step(): one chain step of that row, at position t+j with the embedding of draft
        token j; its key lands in slot t+j (the branch slot, see the module docstring).

    The math is the draft's ``qkv`` and ``finish`` (models/draft/eagle3/model.py) with q/k/v and
    gate/up fused and the rotary angles from a table; tests check it against the TTT unroll.
    """

    def __init__(self, draft: Eagle3Draft, embed):
        self.draft = draft
        self.embed = embed
        a, ml = draft.arch, draft.midlayer
        _require({"fc": draft.fc, "lm_head": draft.lm_head, "q_proj": ml.self_attn.q_proj,
                  "k_proj": ml.self_attn.k_proj, "v_proj": ml.self_attn.v_proj, "o_proj": ml.self_attn.o_proj,
                  "gate_proj": ml.mlp.gate_proj, "up_proj": ml.mlp.up_proj, "down_proj": ml.mlp.down_proj}, nn.Linear)
        _require({"input_layernorm": ml.input_layernorm, "hidden_norm": ml.hidden_norm,
                  "post_attention_layernorm": ml.post_attention_layernorm, "norm": draft.norm}, nn.RMSNorm)
        self.scale = a.head_dim**-0.5
        self.n_heads, self.n_kv_heads, self.head_dim = a.n_heads, a.n_kv_heads, a.head_dim
        self._gqa = bool(a.n_heads != a.n_kv_heads)
        self._qkv = FusedLinearWeight(ml.self_attn.q_proj, ml.self_attn.k_proj, ml.self_attn.v_proj)
        self._gate_up = FusedLinearWeight(ml.mlp.gate_proj, ml.mlp.up_proj)
        self.rotary = RotaryTable(a.head_dim, a.rope_theta, device=draft.fc.weight.device)
        self.cache: KVCache | None = None
        self._extend, self._step = self._extend_core, self._step_core

    def compile(self, backend: str = "inductor") -> None:
        self._extend = torch.compile(self._extend_core, dynamic=True, backend=backend, fullgraph=True)
        self._step = torch.compile(self._step_core, dynamic=True, backend=backend, fullgraph=True)

    def new_cache(self, batch: int, slots: int) -> None:
        a, p = self.draft.arch, self.draft.fc.weight
        self.cache = KVCache(1, batch, a.n_kv_heads, slots, a.head_dim, device=p.device, dtype=p.dtype)
        if self.rotary.device != p.device:
            self.rotary = RotaryTable(a.head_dim, a.rope_theta, device=p.device)
        self.rotary.ensure(slots)

    def weights(self) -> tuple[torch.Tensor, ...]:
        """(wqkv, w_gate_up, cos table, sin table), current; pass to extend/step for a batch."""
        return self._qkv.get(), self._gate_up.get(), self.rotary.cos_SHd, self.rotary.sin_SHd

    def extend(self, taps_BLCD: torch.Tensor, tokens_BL: torch.Tensor, start_B: torch.Tensor, n_B: torch.Tensor,
               n_slots: int | None = None, weights: tuple | None = None):
        """n_slots: a host-side bound >= max(start_B + n_B) (saves a sync); extra slots are masked."""
        pos_BL = start_B[:, None] + torch.arange(tokens_BL.shape[1], device=tokens_BL.device)[None, :]
        # Only the last committed row needs an output; the others only contribute keys.
        last_B = n_B - 1
        pos_B1 = pos_BL.gather(1, last_B[:, None])
        st, st_last = _step_indices(pos_BL, mask=False), _step_indices(pos_B1, n_slots)
        w = self.weights() if weights is None else weights
        return self._extend(taps_BLCD, tokens_BL, st, st_last, last_B, self.cache.k_YBKSH[0], self.cache.v_YBKSH[0], w)

    def step(self, h_BH: torch.Tensor, tokens_B: torch.Tensor, pos_B: torch.Tensor,
             n_slots: int | None = None, weights: tuple | None = None):
        """n_slots: max(pos_B) + 1 when the caller knows it on the host (saves a sync)."""
        st = _step_indices(pos_B[:, None], n_slots)
        w = self.weights() if weights is None else weights
        return self._step(h_BH, tokens_B, st, self.cache.k_YBKSH[0], self.cache.v_YBKSH[0], w)

    def _qkv_rows(self, h_BLH, tokens_BL, pos_BL, w):
        B, L = tokens_BL.shape
        ml, (w_qkv, _, cos_SHd, sin_SHd) = self.draft.midlayer, w
        x_BL2H = torch.cat([_rms(self.embed(tokens_BL), ml.input_layernorm), _rms(h_BLH, ml.hidden_norm)], dim=-1)
        nq, nk = self.n_heads, self.n_kv_heads
        qkv_BLnH = F.linear(x_BL2H, w_qkv).view(B, L, nq + 2 * nk, self.head_dim)
        # q and k heads are adjacent: one rotation for both.
        qk_BLnH = rotate_half(qkv_BLnH[:, :, : nq + nk], cos_SHd[pos_BL][:, :, None], sin_SHd[pos_BL][:, :, None])
        return qk_BLnH[:, :, :nq], qk_BLnH[:, :, nq:], qkv_BLnH[:, :, nq + nk :]

    def _finish(self, h_BH, attn_BNH, w):
        # models/draft/eagle3/model.py Eagle3Draft.finish, gate/up fused.
        d, ml = self.draft, self.draft.midlayer
        r_BH = h_BH + F.linear(attn_BNH.flatten(1), ml.self_attn.o_proj.weight)
        gate_BF, up_BF = F.linear(_rms(r_BH, ml.post_attention_layernorm), w[1]).chunk(2, dim=-1)
        out_BH = r_BH + F.linear(F.silu(gate_BF) * up_BF, ml.mlp.down_proj.weight)
        return out_BH, F.linear(_rms(out_BH, d.norm), d.lm_head.weight)

    def _extend_core(self, taps_BLCD, tokens_BL, st: _Step, st_last: _Step, last_B, k_BKSH, v_BKSH, w):
        h_BLH = F.linear(taps_BLCD.flatten(2), self.draft.fc.weight)
        q_BLNH, k_BLKH, v_BLKH = self._qkv_rows(h_BLH, tokens_BL, st.pos_BL, w)
        _write(k_BKSH, v_BKSH, st, k_BLKH, v_BLKH)
        rows_B = st.rows_BL[:, 0]
        out_B1NH = _attend(k_BKSH, v_BKSH, st_last, q_BLNH[rows_B, last_B][:, None], self.scale, self._gqa)
        return self._finish(h_BLH[rows_B, last_B], out_B1NH[:, 0], w)

    def _step_core(self, h_BH, tokens_B, st: _Step, k_BKSH, v_BKSH, w):
        q_B1NH, k_B1KH, v_B1KH = self._qkv_rows(h_BH[:, None], tokens_B[:, None], st.pos_BL, w)
        _write(k_BKSH, v_BKSH, st, k_B1KH, v_B1KH)
        out_B1NH = _attend(k_BKSH, v_BKSH, st, q_B1NH, self.scale, self._gqa)
        return self._finish(h_BH, out_B1NH[:, 0], w)


PROPOSERS: dict[str, type] = {"eagle3": CachedDraft}
"""Draft kind (the arch's ``kind``, models/draft/) -> the cached proposer the engine drives,
``Proposer(draft, embed)``: a models/draft/base.CachedProposer. The KV cache is the rollout
floor's, so the table lives here, not in models/."""
