# Context parallelism for packed, document-causal attention with EAGLE-3
# branch keys: per-document zigzag sharding and a ring attention custom op.
#
# Layout (docs/ARCHITECTURE.md, as TransformerEngine THD): every document is padded to a
# multiple of 2*cp and cut into 2*cp chunks of c_d rows; rank r holds chunks r
# and 2*cp-1-r of every document, document-major. Every rank therefore holds
# the same number of rows per document (2*c_d), so all ranks share one local
# cu_seqlens and every ring message has the same shape.
#
# Ring: the trunk K/V (step-0 keys) travels the CP group. With source rank s
# and local rank r, per document (local rows [a, a+2c)):
#   s == r: the two local chunks in order, causal (plain document-causal)
#   s <  r: every local query vs the source's first chunk (k rows [a, a+c)),
#           no mask: both local chunks come after chunk s
#   s >  r: the local second chunk (q rows [a+c, a+2c)) vs both source chunks,
#           no mask; the local first chunk precedes both and is skipped
# so every step costs every rank the same 2*c*c query-key pairs per document:
# the zigzag is what balances causal work. The branch part (keys k_1..k_Sb at
# the query's own row) is position-aligned and needs no communication. All
# partials merge by log-sum-exp; the backward feeds every part the MERGED
# (out, lse) and sends dK/dV of the trunk around the ring back to its owner.
#
# Pad rows sit at the end of their document, so a real query never sees a pad
# key: in a no-mask block all keys precede the query chunk, and the causal
# block masks later rows. Pad rows get finite but meaningless outputs;
# callers mask them (labels = IGNORE_INDEX).

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.distributed as dist

from titan_spec.models.attention import DocMetadata
from titan_spec.models.attention_blocks import Block, blocks_bwd, blocks_fwd, document_blocks, merge_partials
from titan_spec.models.branch_attention import branch_backward, branch_part

__all__ = [
    "CPMetadata",
    "ZigzagLayout",
    "ring_attention",
    "ring_blocks",
    "zigzag_shard",
    "zigzag_unshard",
]


# ---------------------------------------------------------------------------
# Layout: shard / unshard
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ZigzagLayout:
    """Per-document zigzag split of one packed stream over a CP group.

    doc_lens: the global (unpadded) document lengths, in stream order; empty
        documents are allowed and hold no rows.
    cp: the context-parallel degree.
    """

    doc_lens: tuple[int, ...]
    cp: int

    @classmethod
    def from_cu_seqlens(cls, cu_host, cp: int) -> "ZigzagLayout":
        cu = [int(x) for x in cu_host]
        return cls(tuple(e - s for s, e in zip(cu[:-1], cu[1:])), cp)

    @cached_property
    def chunk_lens(self) -> tuple[int, ...]:
        """c_d: rows per chunk of each document (its padded length / 2cp)."""
        n = 2 * self.cp
        return tuple(-(-length // n) for length in self.doc_lens)

    @property
    def global_len(self) -> int:
        return sum(self.doc_lens)

    @property
    def local_len(self) -> int:
        """Rows on every rank (the same on all of them)."""
        return 2 * sum(self.chunk_lens)

    @cached_property
    def local_cu_seqlens(self) -> tuple[int, ...]:
        """Local document offsets (2*c_d rows each), identical on every rank."""
        cu = [0]
        for c in self.chunk_lens:
            cu.append(cu[-1] + 2 * c)
        return tuple(cu)

    def local_positions(self, rank: int) -> torch.Tensor:
        """[R] int64: position within its document of every local row (pads included)."""
        out = []
        for c in self.chunk_lens:
            for chunk in (rank, 2 * self.cp - 1 - rank):
                out.append(torch.arange(chunk * c, (chunk + 1) * c))
        return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)

    def global_index(self, rank: int) -> torch.Tensor:
        """[R] int64: index into the global stream of every local row, -1 for a pad row."""
        pos_R = self.local_positions(rank)
        start_R, len_R = [], []
        s = 0
        for length, c in zip(self.doc_lens, self.chunk_lens):
            start_R.append(torch.full((2 * c,), s))
            len_R.append(torch.full((2 * c,), length))
            s += length
        if not start_R:
            return pos_R
        start_R, len_R = torch.cat(start_R), torch.cat(len_R)
        return torch.where(pos_R < len_R, start_R + pos_R, -1)

    def local_metadata(self, device) -> DocMetadata:
        cu = torch.tensor(self.local_cu_seqlens, dtype=torch.int32)
        return DocMetadata(cu.to(device), cu.clone())


def zigzag_shard(x_Tg: torch.Tensor, layout: ZigzagLayout, rank: int, pad_value=0) -> torch.Tensor:
    """This rank's rows of a global stream x_Tg[T, ...] (dim 0), pads set to pad_value."""
    if x_Tg.shape[0] != layout.global_len:
        raise ValueError(f"zigzag_shard: {x_Tg.shape[0]} rows for a layout of {layout.global_len} tokens")
    idx_R = layout.global_index(rank).to(x_Tg.device)
    x_R = x_Tg[idx_R.clamp(min=0)]
    pad_R = (idx_R < 0).view(-1, *([1] * (x_Tg.dim() - 1)))
    return torch.where(pad_R, torch.as_tensor(pad_value, dtype=x_Tg.dtype, device=x_Tg.device), x_R)


def zigzag_unshard(x_R: torch.Tensor, layout: ZigzagLayout, group: dist.ProcessGroup) -> torch.Tensor:
    """Inverse of zigzag_shard: all-gather the CP group's rows, drop pads -> x_Tg[T, ...]."""
    cp = dist.get_world_size(group)
    parts = [torch.empty_like(x_R) for _ in range(cp)]
    dist.all_gather(parts, x_R.contiguous(), group=group)
    x_Tg = x_R.new_empty(layout.global_len, *x_R.shape[1:])
    for rank, part in enumerate(parts):
        idx_R = layout.global_index(rank).to(x_R.device)
        keep_R = idx_R >= 0
        x_Tg[idx_R[keep_R]] = part[keep_R]
    return x_Tg


# ---------------------------------------------------------------------------
# Ring blocks: which (query rows, key rows, causal) each ring step computes
# ---------------------------------------------------------------------------


def ring_blocks(local_cu, rank: int, src: int) -> list[Block]:
    """(q_start, q_end, k_start, k_end, causal) blocks of local queries against
    the kv shard of rank ``src`` (rows in the shared local layout), the blocks
    models/attention_blocks.py's kernel computes for that ring step."""
    if src == rank:
        # The rank's own shard: its two chunks of every document are in order,
        # so this is plain local document attention.
        return document_blocks(local_cu)
    blocks = []
    for a, e in zip(local_cu[:-1], local_cu[1:]):
        c = (e - a) // 2
        if c == 0:
            continue
        if src < rank:
            blocks.append((a, e, a, a + c, False))
        else:
            blocks.append((a + c, e, a, e, False))
    return blocks


# ---------------------------------------------------------------------------
# Ring communication
# ---------------------------------------------------------------------------

_KV_TAG, _DKV_TAG = 11, 12


class _Ring:
    """Non-blocking send to rank+1 / receive from rank-1 within the CP group."""

    def __init__(self, group_name: str):
        self.group = dist.distributed_c10d._resolve_process_group(group_name)
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)

    def shift(self, x: torch.Tensor, tag: int):
        """Start passing x one rank forward; returns (received buffer, handles)."""
        recv, sent = torch.empty_like(x), x.contiguous()
        nxt, prv = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        works = [
            dist.isend(sent, group=self.group, group_dst=nxt, tag=tag),
            dist.irecv(recv, group=self.group, group_src=prv, tag=tag),
        ]
        # The sent buffer rides along so that it outlives the send.
        return recv, (works, sent)


def _wait(pending) -> None:
    if pending:
        for w in pending[0]:
            w.wait()


def _pack(k_RKvHd: torch.Tensor, v_RKvHd: torch.Tensor) -> torch.Tensor:
    return torch.cat([k_RKvHd.reshape(-1), v_RKvHd.reshape(-1)])


def _unpack(kv: torch.Tensor, k_shape: torch.Size, v_shape: torch.Size):
    n = k_shape.numel()
    return kv[:n].view(k_shape), kv[n:].view(v_shape)


# ---------------------------------------------------------------------------
# The custom ops
# ---------------------------------------------------------------------------


@torch.library.custom_op("titan_spec::ring_attn_fwd", mutates_args=())
def ring_attn_fwd(
    q_RNHd: torch.Tensor,
    k0_RKvHd: torch.Tensor,
    v0_RKvHd: torch.Tensor,
    kb_SbRKvHd: torch.Tensor,
    vb_SbRKvHd: torch.Tensor,
    cu_seqlens_cpu: torch.Tensor,
    group_name: str,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zigzag ring trunk attention + local branch attention, one softmax.

    Returns (out_RNHd in q's dtype, lse_NR fp32) for the local queries.
    cu_seqlens_cpu is the shared local layout (ZigzagLayout.local_cu_seqlens).
    """
    ring = _Ring(group_name)
    cu = cu_seqlens_cpu.tolist()
    kv = _pack(k0_RKvHd, v0_RKvHd)
    outs, lses = [], []
    for i in range(ring.size):
        if i + 1 < ring.size:
            kv_next, works = ring.shift(kv, _KV_TAG)
        k_RKvHd, v_RKvHd = _unpack(kv, k0_RKvHd.shape, v0_RKvHd.shape)
        src = (ring.rank - i) % ring.size
        out_RNHd, lse_NR = blocks_fwd(q_RNHd, k_RKvHd, v_RKvHd, ring_blocks(cu, ring.rank, src), scale)
        # Merge as we go: memory stays at one partial, whatever cp is.
        if outs:
            out_RNHd, lse_NR = merge_partials([outs[0], out_RNHd], [lses[0], lse_NR])
        outs, lses = [out_RNHd], [lse_NR]
        if i + 1 < ring.size:
            _wait(works)
            kv = kv_next
    out_b, lse_b = branch_part(q_RNHd, kb_SbRKvHd, vb_SbRKvHd, scale)
    out_RNHd, lse_NR = merge_partials([outs[0], out_b], [lses[0], lse_b])
    # Contiguous, as the fake promises: the merge's broadcasts may permute strides.
    return out_RNHd.to(q_RNHd.dtype).contiguous(), lse_NR.contiguous()


@ring_attn_fwd.register_fake
def _ring_attn_fwd_fake(q_RNHd, k0_RKvHd, v0_RKvHd, kb_SbRKvHd, vb_SbRKvHd, cu_seqlens_cpu, group_name, scale):
    R, N, _ = q_RNHd.shape
    return q_RNHd.new_empty(R, N, v0_RKvHd.shape[-1]), q_RNHd.new_empty(N, R, dtype=torch.float32)


@torch.library.custom_op("titan_spec::ring_attn_bwd", mutates_args=())
def ring_attn_bwd(
    dout_RNHd: torch.Tensor,
    q_RNHd: torch.Tensor,
    k0_RKvHd: torch.Tensor,
    v0_RKvHd: torch.Tensor,
    kb_SbRKvHd: torch.Tensor,
    vb_SbRKvHd: torch.Tensor,
    out_RNHd: torch.Tensor,
    lse_NR: torch.Tensor,
    cu_seqlens_cpu: torch.Tensor,
    group_name: str,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk0, dv0, dkb, dvb) of ring_attn_fwd, every part fed the merged (out, lse).

    The trunk K/V travel the ring again; the dK/dV accumulated for a shard travel
    with it and, after cp hops, arrive back at the rank that owns the shard.
    """
    ring = _Ring(group_name)
    cu = cu_seqlens_cpu.tolist()
    dq_RNHd = torch.zeros(q_RNHd.shape, dtype=torch.float32, device=q_RNHd.device)
    kv = _pack(k0_RKvHd, v0_RKvHd)
    dkv = None  # the accumulated grads of the shard held this step (none before step 0)
    dkv_works = None
    for i in range(ring.size):
        if i + 1 < ring.size:
            kv_next, kv_works = ring.shift(kv, _KV_TAG)
        k_RKvHd, v_RKvHd = _unpack(kv, k0_RKvHd.shape, v0_RKvHd.shape)
        src = (ring.rank - i) % ring.size
        dq, dk, dv = blocks_bwd(
            dout_RNHd, q_RNHd, k_RKvHd, v_RKvHd, out_RNHd, lse_NR, ring_blocks(cu, ring.rank, src), scale
        )
        dq_RNHd += dq.float()
        # Accumulate in fp32: a shard's grad is summed over cp hops.
        local = _pack(dk.float(), dv.float())
        _wait(dkv_works)
        dkv = local if dkv is None else dkv + local
        dkv, dkv_works = ring.shift(dkv, _DKV_TAG)
        if i + 1 < ring.size:
            _wait(kv_works)
            kv = kv_next
    _wait(dkv_works)  # the last hop brings this rank's own shard home
    dk0_RKvHd, dv0_RKvHd = _unpack(dkv, k0_RKvHd.shape, v0_RKvHd.shape)
    # The branch part last: its Sb-deep grads would otherwise sit through the
    # ring loop's buffers and raise the peak.
    dq_b_RNHd, dkb_SbRKvHd, dvb_SbRKvHd = branch_backward(
        dout_RNHd, q_RNHd, kb_SbRKvHd, vb_SbRKvHd, out_RNHd, lse_NR, scale
    )
    dq_RNHd += dq_b_RNHd.float()
    # Fresh contiguous tensors, as the fake promises (dk0 and dv0 are views of one
    # buffer, and a custom op's outputs may not alias each other).
    grads = (
        dq_RNHd.to(q_RNHd.dtype),
        dk0_RKvHd.to(k0_RKvHd.dtype),
        dv0_RKvHd.to(v0_RKvHd.dtype),
        dkb_SbRKvHd,
        dvb_SbRKvHd,
    )
    return tuple(g.clone(memory_format=torch.contiguous_format) for g in grads)


@ring_attn_bwd.register_fake
def _ring_attn_bwd_fake(
    dout_RNHd, q_RNHd, k0_RKvHd, v0_RKvHd, kb_SbRKvHd, vb_SbRKvHd, out_RNHd, lse_NR, cu_seqlens_cpu, group_name, scale
):
    return tuple(x.new_empty(x.shape) for x in (q_RNHd, k0_RKvHd, v0_RKvHd, kb_SbRKvHd, vb_SbRKvHd))


def _setup_context(ctx, inputs, output) -> None:
    q_RNHd, k0_RKvHd, v0_RKvHd, kb_SbRKvHd, vb_SbRKvHd, cu_seqlens_cpu, group_name, scale = inputs
    out_RNHd, lse_NR = output
    ctx.mark_non_differentiable(lse_NR)
    ctx.save_for_backward(q_RNHd, k0_RKvHd, v0_RKvHd, kb_SbRKvHd, vb_SbRKvHd, out_RNHd, lse_NR, cu_seqlens_cpu)
    ctx.group_name, ctx.scale = group_name, scale


def _backward(ctx, dout_RNHd, _dlse_NR):
    q, k0, v0, kb, vb, out, lse, cu_cpu = ctx.saved_tensors
    grads = torch.ops.titan_spec.ring_attn_bwd(
        dout_RNHd, q, k0, v0, kb, vb, out, lse, cu_cpu, ctx.group_name, ctx.scale
    )
    return (*grads, None, None, None)


ring_attn_fwd.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------
# What models see
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class CPMetadata:
    """attention_masks for a zigzag-sharded packed stream. DocCausalAttention and the
    draft's ttt_attention call its methods (ring attention) instead of local attention
    when they are handed this instead of a DocMetadata."""

    layout: ZigzagLayout
    """The split of the global stream; its local offsets are every rank's."""
    local: DocMetadata
    """Local document offsets (layout.local_cu_seqlens) as tensors."""
    group: dist.ProcessGroup
    """The context-parallel process group (the ring)."""
    group_name: str
    """Its registered name: what the custom op takes (and all that compiled code reads)."""

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    def num_real_rows(self) -> int:
        """Local rows that are tokens of the batch (not document padding)."""
        return int((self.layout.global_index(self.rank) >= 0).sum())

    def attention(self, q_RNHd, k_RKvHd, v_RKvHd, scale: float) -> torch.Tensor:
        """The target's document-causal attention over this rank's rows."""
        return ring_attention(q_RNHd, k_RKvHd, v_RKvHd, self, scale)[0]

    def ttt_attention(self, q_RNHd, k0_RKvHd, v0_RKvHd, kb_SbRKvHd, vb_SbRKvHd, scale: float) -> torch.Tensor:
        """The draft's TTT attention (trunk over the ring + local branch)."""
        return ring_attention(q_RNHd, k0_RKvHd, v0_RKvHd, self, scale, kb_SbRKvHd, vb_SbRKvHd)[0]

    @classmethod
    def build(cls, layout: ZigzagLayout, group: dist.ProcessGroup, device) -> "CPMetadata":
        return cls(layout, layout.local_metadata(device), group, group.group_name)


def ring_attention(
    q_RNHd: torch.Tensor,
    k0_RKvHd: torch.Tensor,
    v0_RKvHd: torch.Tensor,
    meta: CPMetadata,
    scale: float,
    kb_SbRKvHd: torch.Tensor | None = None,
    vb_SbRKvHd: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable ring (+ branch) attention over this rank's rows: (out_RNHd, lse_NR).

    Without kb/vb it is the target's document-causal attention; with them, the
    draft's TTT attention at step Sb = kb.shape[0].
    """
    if kb_SbRKvHd is None:
        kb_SbRKvHd = vb_SbRKvHd = k0_RKvHd.new_zeros((0, *k0_RKvHd.shape))
    return torch.ops.titan_spec.ring_attn_fwd(
        q_RNHd, k0_RKvHd, v0_RKvHd, kb_SbRKvHd, vb_SbRKvHd, meta.local.cu_seqlens_cpu, meta.group_name, scale
    )
