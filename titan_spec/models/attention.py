# Document-causal attention over a packed token stream, returning the LSE.
#
# A packed batch is one flat stream of T tokens cut into documents by
# cu_seqlens ([documents + 1], int32, 0 .. T). A query attends causally to the keys of
# its own document only: the block kernel (attention_blocks.py) over the
# causal block of every document on itself, the same kernel the context-parallel
# ring runs per source rank. The forward returns the per-row log-sum-exp (lse)
# so that callers (EAGLE-3 TTT branch attention) can merge partial softmaxes
# exactly (attention_blocks.merge_partials), and the backward takes (out, lse)
# as inputs instead of recomputing them, so it can be fed the *merged* ones.

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from torchtitan.protocols.module import Module

from titan_spec.models.attention_blocks import blocks_bwd, blocks_fwd, document_blocks

__all__ = [
    "DocCausalAttention",
    "DocMetadata",
    "doc_attention",
    "doc_metadata_from_positions",
]


class DocMetadata(NamedTuple):
    """Document boundaries of a packed token stream.

    cu_seqlens: int32 [D+1] on the compute device, 0 .. T.
    cu_seqlens_cpu: the same offsets in a CPU tensor, so per-document loops and
        kernel launch parameters need no device sync. A tensor, not a tuple of
        ints: torch.compile would guard on every int and recompile for each new
        packing layout, while tensors flow into the (opaque) custom ops as data.
    """

    cu_seqlens: torch.Tensor
    cu_seqlens_cpu: torch.Tensor


def doc_metadata_from_positions(positions_BL: torch.Tensor) -> DocMetadata:
    """Document metadata for a [B, L] batch viewed as one stream of B*L tokens.

    A document starts wherever position == 0 and at the start of every row
    (a row never continues the previous row's document). Syncs to host once.
    """
    B, L = positions_BL.shape
    starts_BL = positions_BL == 0
    starts_BL[:, 0] = True
    starts_T = starts_BL.reshape(-1).nonzero().squeeze(1)
    end = torch.tensor([B * L], device=positions_BL.device, dtype=starts_T.dtype)
    cu_seqlens = torch.cat([starts_T, end]).to(torch.int32)
    # A distinct tensor even on CPU: autograd.Function under dynamo rejects one tensor passed twice.
    return DocMetadata(cu_seqlens, cu_seqlens.to("cpu", copy=True))


# ---------------------------------------------------------------------------
# Custom ops: opaque to torch.compile, so the per-document Python loops and
# the host offsets never get traced.
# ---------------------------------------------------------------------------


@torch.library.custom_op("titan_spec::doc_attn_fwd", mutates_args=())
def doc_attn_fwd(
    q_TNHd: torch.Tensor,
    k_TKvHd: torch.Tensor,
    v_TKvHd: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_cpu: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Document-causal attention. Returns (out_TNHd, lse_NT fp32).

    Rows with no key (impossible for causal self-attention, but possible for
    empty documents in cu_seqlens) get out = 0 and lse = -inf.
    """
    blocks = document_blocks(cu_seqlens_cpu.tolist())
    return blocks_fwd(q_TNHd, k_TKvHd, v_TKvHd, blocks, scale, cu_seqlens)


@doc_attn_fwd.register_fake
def _doc_attn_fwd_fake(q_TNHd, k_TKvHd, v_TKvHd, cu_seqlens, cu_seqlens_cpu, scale):
    T, N, _ = q_TNHd.shape
    out_TNHd = q_TNHd.new_empty(T, N, v_TKvHd.shape[-1])
    lse_NT = q_TNHd.new_empty(N, T, dtype=torch.float32)
    return out_TNHd, lse_NT


@torch.library.custom_op("titan_spec::doc_attn_bwd", mutates_args=())
def doc_attn_bwd(
    dout_TNHd: torch.Tensor,
    q_TNHd: torch.Tensor,
    k_TKvHd: torch.Tensor,
    v_TKvHd: torch.Tensor,
    out_TNHd: torch.Tensor,
    lse_NT: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_cpu: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of document-causal attention.

    Uses the given out and lse as-is: dS = P * (dP - rowsum(dout * out)) with
    P = exp(S * scale - lse). Passing the merged (out, lse) of several parts
    yields this part's exact contribution to the merged softmax's gradient.
    """
    blocks = document_blocks(cu_seqlens_cpu.tolist())
    return blocks_bwd(dout_TNHd, q_TNHd, k_TKvHd, v_TKvHd, out_TNHd, lse_NT, blocks, scale, cu_seqlens)


@doc_attn_bwd.register_fake
def _doc_attn_bwd_fake(dout_TNHd, q_TNHd, k_TKvHd, v_TKvHd, out_TNHd, lse_NT, cu_seqlens, cu_seqlens_cpu, scale):
    return torch.empty_like(q_TNHd), torch.empty_like(k_TKvHd), torch.empty_like(v_TKvHd)


def _fwd_setup_context(ctx, inputs, output) -> None:
    q_TNHd, k_TKvHd, v_TKvHd, cu_seqlens, cu_seqlens_cpu, scale = inputs
    out_TNHd, lse_NT = output
    # lse is an output for merging, not a differentiable one: a dlse term
    # cannot be fed to the fused flash backward. Callers that merge partials
    # must use an explicit backward with the merged lse (see
    # branch_attention.py) instead of autograd through merge_partials.
    ctx.mark_non_differentiable(lse_NT)
    ctx.save_for_backward(q_TNHd, k_TKvHd, v_TKvHd, out_TNHd, lse_NT, cu_seqlens, cu_seqlens_cpu)
    ctx.scale = scale


def _fwd_backward(ctx, dout_TNHd, _dlse_NT):
    q_TNHd, k_TKvHd, v_TKvHd, out_TNHd, lse_NT, cu_seqlens, cu_seqlens_cpu = ctx.saved_tensors
    dq, dk, dv = torch.ops.titan_spec.doc_attn_bwd(
        dout_TNHd,
        q_TNHd,
        k_TKvHd,
        v_TKvHd,
        out_TNHd,
        lse_NT,
        cu_seqlens,
        cu_seqlens_cpu,
        ctx.scale,
    )
    return dq, dk, dv, None, None, None


doc_attn_fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)


def doc_attention(
    q_TNHd: torch.Tensor,
    k_TKvHd: torch.Tensor,
    v_TKvHd: torch.Tensor,
    meta: DocMetadata,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable document-causal attention: (out_TNHd, lse_NT fp32).

    Gradients flow to q, k, v through out only; lse is returned marked
    non-differentiable (requires_grad=False) and exists for exact merging.
    """
    return torch.ops.titan_spec.doc_attn_fwd(q_TNHd, k_TKvHd, v_TKvHd, meta.cu_seqlens, meta.cu_seqlens_cpu, scale)


class DocCausalAttention(Module):
    """Inner attention: causal within each document of a packed batch.

    Drop-in for torchtitan's VarlenAttention: takes [B, L, N, Hd] q/k/v and a
    DocMetadata as attention_masks, and works on CPU (tests) and GPU.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        pass

    def __init__(self, config: Config) -> None:
        super().__init__()

    # q_BLNH / k_BLNH / v_BLNH are torchtitan's names, not titan_spec/shapes.py's (H: head dim):
    # its sharding configs key the inner attention's inputs by them.
    def forward(
        self,
        q_BLNH: torch.Tensor,
        k_BLNH: torch.Tensor,
        v_BLNH: torch.Tensor,
        *,
        attention_masks: DocMetadata,
        scale: float | None = None,
        enable_gqa: bool = False,
        **kwargs,
    ) -> torch.Tensor:
        B, L, N, H = q_BLNH.shape
        K, Hv = k_BLNH.shape[2], v_BLNH.shape[-1]
        assert enable_gqa or N == K, f"{N} query heads vs {K} kv heads needs enable_gqa"
        assert N % K == 0, f"{N} query heads is not a multiple of {K} kv heads"
        scale = 1.0 / math.sqrt(H) if scale is None else scale
        if not isinstance(attention_masks, DocMetadata):
            # A context-parallel shard (parallelisms/context_parallel.CPMetadata)
            # brings its ring attention.
            out_TNHd = attention_masks.attention(
                q_BLNH.reshape(B * L, N, H),
                k_BLNH.reshape(B * L, K, H),
                v_BLNH.reshape(B * L, K, Hv),
                scale,
            )
            return out_TNHd.view(B, L, N, Hv)
        out_TNHd, _ = doc_attention(
            q_BLNH.reshape(B * L, N, H),
            k_BLNH.reshape(B * L, K, H),
            v_BLNH.reshape(B * L, K, Hv),
            attention_masks,
            scale,
        )
        return out_TNHd.view(B, L, N, Hv)
