"""The pieces of a forward over a KV cache: the cache, its slot rule, write, attend, RMSNorm, compile.

The cache uses "slot == position": the K/V of the token at position t of a request sits in
slot t of its row. A query at position p attends to slots <= p of its row, so one
causal-by-position mask serves every case, without any per-row length bookkeeping:

  - prompts of different lengths: rows are right-padded; a padded query writes garbage
    into slots past its row's valid length, which no valid query can see (they sit at
    lower positions) and the next call overwrites.
  - speculative verify: the K+1 verified tokens are written at slots c..c+K; after
    acceptance only c..c+a are committed and the rest is overwritten by the next call.
  - a draft's chain (EAGLE-3 TTT, models/draft/eagle3/ttt.py): draft step j of row t sits
    at position t+j and attends to the step-0 ("trunk") keys of positions <= t plus its own
    branch keys k_1..k_j, which are exactly slots t+1..t+j when the branch key of step j is
    written at slot t+j. The next round's trunk rows overwrite those slots.

Here, not in rollout/: the cached target (rollout/builtin/cached_target.py) and each draft
kind's cached proposer (models/draft/<kind>/proposer.py) both run on these, and a kind may
not import from the rollout floor above it.

Host syncs: the only host value a forward needs is the number of cache slots in use; the
engine knows it (it tracks positions on the host) and passes it as ``n_slots``; without it
``step_indices`` reads max(position) (one sync).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["KVCache", "Step", "attend", "causal_slot_mask", "require_plain", "rms", "step_indices", "write_kv"]


class KVCache:
    """Preallocated K/V for Y layers: k_YBKvSlHd, v_YBKvSlHd (heads before slots, as SDPA reads)."""

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, slots: int, head_dim: int, *, device, dtype):
        shape = (n_layers, batch, n_kv_heads, slots, head_dim)
        self.k_YBKvSlHd = torch.zeros(shape, device=device, dtype=dtype)
        self.v_YBKvSlHd = torch.zeros(shape, device=device, dtype=dtype)

    @property
    def slots(self) -> int:
        return self.k_YBKvSlHd.shape[3]

    def keep(self, rows_B: torch.Tensor) -> None:
        """Drop finished requests (one copy, so later steps stop paying for them)."""
        self.k_YBKvSlHd = self.k_YBKvSlHd[:, rows_B]
        self.v_YBKvSlHd = self.v_YBKvSlHd[:, rows_B]


class Step(NamedTuple):
    """Per-call index tensors, made once in eager code and shared by every layer."""

    rows_BL: torch.Tensor
    pos_BL: torch.Tensor
    mask_B1LSl: torch.Tensor | None
    """Query at position p sees slots 0..p of its own row; S = the slots in use
    (None for a call that only writes K/V)."""


def step_indices(pos_BL: torch.Tensor, n_slots: int | None = None, *, mask: bool = True) -> Step:
    rows_BL = torch.arange(pos_BL.shape[0], device=pos_BL.device)[:, None].expand_as(pos_BL)
    if not mask:
        return Step(rows_BL, pos_BL, None)
    if n_slots is None:
        # Without the caller's host-side count this is one device->host sync.
        n_slots = int(pos_BL.max()) + 1
    # Under torch.compile the slot count arrives as the mask's (dynamic) size.
    return Step(rows_BL, pos_BL, causal_slot_mask(pos_BL, n_slots))


def causal_slot_mask(pos_BL: torch.Tensor, n_slots: int) -> torch.Tensor:
    """mask_B1LSl: query at position p sees slots 0..p of its own row."""
    slots_Sl = torch.arange(n_slots, device=pos_BL.device)
    return (slots_Sl[None, None, :] <= pos_BL[:, :, None])[:, None]


def write_kv(k_BKvSlHd, v_BKvSlHd, st: Step, k_BLKvHd, v_BLKvHd) -> None:
    # Advanced indices split by a slice put their dims first: the target is [B, L, Kv, Hd].
    k_BKvSlHd[st.rows_BL, :, st.pos_BL] = k_BLKvHd
    v_BKvSlHd[st.rows_BL, :, st.pos_BL] = v_BLKvHd


def attend(k_BKvSlHd, v_BKvSlHd, st: Step, q_BLNHd, scale, gqa: bool):
    """SDPA of this call's queries over the slots in use of their rows. ``gqa`` is a Python
    bool from the head counts: under torch.compile(dynamic=True) a comparison of tensor
    sizes is symbolic, which SDPA refuses (a graph break that skips the whole forward)."""
    n_slots = st.mask_B1LSl.shape[-1]
    out_BNLHd = F.scaled_dot_product_attention(
        q_BLNHd.transpose(1, 2),
        k_BKvSlHd[:, :, :n_slots],
        v_BKvSlHd[:, :, :n_slots],
        attn_mask=st.mask_B1LSl,
        scale=scale,
        enable_gqa=gqa,
    )
    return out_BNLHd.transpose(1, 2)


def rms(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """nn.RMSNorm(x) with ``norm``'s weight and eps."""
    if x.device.type != "cpu" or x.dtype != torch.float32:
        return F.rms_norm(x, norm.normalized_shape, norm.weight, norm.eps)
    # On CPU, aten's rms_norm is these same float32 ops in this order (so the result is
    # bitwise equal; tests check it), plus dtype round-trips that at decode sizes cost
    # more than the math. Elsewhere F.rms_norm is one fused kernel and stays.
    eps = norm.eps if norm.eps is not None else torch.finfo(x.dtype).eps
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * norm.weight


def require_plain(modules: dict[str, nn.Module], kind: type) -> None:
    """A cached forward re-implements these modules' forwards; a subclass that changes
    forward (float8, LoRA, ...) would be silently skipped, so refuse it."""
    bad = [f"{k} ({type(m).__name__})" for k, m in modules.items() if type(m).forward is not kind.forward]
    if bad:
        raise ValueError(
            f"the torch rollout engine needs plain {kind.__name__} modules; these are not: {', '.join(bad)}"
        )


def compile_decode(fn: Callable, backend: str = "inductor") -> Callable:
    """torch.compile a cached forward: dynamic shapes; fullgraph, because a graph break would
    make dynamo run the whole forward eager, silently, and a clear error is better. Called with
    the modules' float attributes (eps, norm_type) as constants: traced as symbols they make
    dynamo restart its analysis, so every new graph would be traced twice."""
    compiled = torch.compile(fn, dynamic=True, backend=backend, fullgraph=True)

    @functools.wraps(fn)
    def call(*args):
        with torch._dynamo.config.patch(specialize_float=True):
            return compiled(*args)

    return call
