# The trainer's side of context parallelism: shard a packed batch for the ring.
# (The rows the draft's TTT unroll reads across shard boundaries are the draft's
# business: models/draft/halo.py.)

from __future__ import annotations

from typing import Any

import torch
from torchtitan.components.loss import IGNORE_INDEX

from titan_spec.models.attention import doc_metadata_from_positions
from titan_spec.parallelisms.context_parallel import CPMetadata, ZigzagLayout, zigzag_shard, zigzag_unshard

__all__ = ["shard_batch", "shard_values", "unshard_values", "without_torch_cp"]


def shard_batch(
    input_dict: dict[str, torch.Tensor], labels_BL: torch.Tensor, cp_mesh
) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """(inputs_1R, labels_1R, {positions, attention_masks}) of this CP rank.

    The B rows of the batch become one packed stream (a row never continues the
    previous row's document), split per document into the zigzag layout. Pad
    rows get label IGNORE_INDEX, so losses and token counts skip them.
    """
    tokens_BL, positions_BL = input_dict["input"], input_dict["positions"]
    rank, group = cp_mesh.get_local_rank(), cp_mesh.get_group()
    layout = _layout(positions_BL, cp_mesh)
    tokens_R = zigzag_shard(tokens_BL.reshape(-1), layout, rank, pad_value=0)
    labels_R = zigzag_shard(labels_BL.reshape(-1), layout, rank, pad_value=IGNORE_INDEX)
    positions_R = layout.local_positions(rank).to(positions_BL.device)
    extra = {
        "positions": positions_R.unsqueeze(0),
        "attention_masks": CPMetadata.build(layout, group, tokens_BL.device),
    }
    return tokens_R.unsqueeze(0), labels_R.unsqueeze(0), extra


def shard_values(values_BL: dict[str, torch.Tensor], positions_BL: torch.Tensor, cp_mesh) -> dict[str, torch.Tensor]:
    """Per-token values of a packed batch (RL: behaviour log-probs, advantages), each [B, L],
    on this CP rank's rows, [1, R]: sharded exactly as ``shard_batch`` shards the labels of
    the batch with these positions, so every value stays with its token; pad rows get 0."""
    layout, rank = _layout(positions_BL, cp_mesh), cp_mesh.get_local_rank()
    return {k: zigzag_shard(v.reshape(-1), layout, rank, pad_value=0).unsqueeze(0) for k, v in values_BL.items()}


def unshard_values(value_1R: torch.Tensor, positions_BL: torch.Tensor, cp_mesh) -> torch.Tensor:
    """The inverse of ``shard_values`` for one value: every CP rank's rows of it gathered
    back into the whole batch's [B, L] (collective over the cp group)."""
    layout = _layout(positions_BL, cp_mesh)
    return zigzag_unshard(value_1R.reshape(-1), layout, cp_mesh.get_group()).view(positions_BL.shape)


def _layout(positions_BL: torch.Tensor, cp_mesh) -> ZigzagLayout:
    """The zigzag split of the batch's documents (found from its positions) over cp_mesh."""
    meta = doc_metadata_from_positions(positions_BL)
    return ZigzagLayout.from_cu_seqlens(meta.cu_seqlens_cpu.tolist(), cp_mesh.size())


class without_torch_cp:
    """ParallelDims as torchtitan's parallelize_fn should see it under titan_spec's CP:
    with cp_enabled False, so it does not wrap the attention in torch's context_parallel
    path (no CPU support, no per-document causality, and titan_spec's ring replaces it).
    Everything else, the fsdp mesh over dp_shard x cp included, is the real one."""

    cp_enabled = False

    def __init__(self, parallel_dims):
        self._parallel_dims = parallel_dims

    def __getattr__(self, name):
        return getattr(self._parallel_dims, name)
