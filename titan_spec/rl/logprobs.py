"""The policy's log-probs of the label tokens at the rollout temperature, from its logits."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Shard
from torchtitan.components.loss import IGNORE_INDEX, _LossParallelCrossEntropy

__all__ = ["token_logprobs"]


def token_logprobs(logits_BLV: torch.Tensor, labels_BL: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / T) at each label (0 where the label is ignored). Vocab-sharded
    logits (a DTensor, tensor parallelism) stay sharded: torchtitan's loss-parallel
    cross-entropy (per-token, reduction "none") over the tp group, so no rank gathers the
    vocabulary; every tp rank gets the same plain log-probs."""
    if isinstance(logits_BLV, DTensor):
        return _vocab_parallel_logprobs(logits_BLV, labels_BL, temperature)
    logits_BLV = logits_BLV.float() / temperature
    picked_BL = logits_BLV.gather(-1, labels_BL.clamp(min=0)[..., None])[..., 0]
    return (picked_BL - logits_BLV.logsumexp(-1)).masked_fill(labels_BL == IGNORE_INDEX, 0.0)


def _vocab_parallel_logprobs(logits_BLV: DTensor, labels_BL: torch.Tensor, temperature: float) -> torch.Tensor:
    mesh = logits_BLV.device_mesh
    if mesh.ndim != 1 or tuple(logits_BLV.placements) != (Shard(logits_BLV.ndim - 1),):
        # Not torchtitan's lm_head layout: gather and take the plain path.
        return token_logprobs(logits_BLV.full_tensor(), labels_BL, temperature)
    local_TV = logits_BLV.to_local().flatten(0, 1).float() / temperature
    nll_T = _LossParallelCrossEntropy.apply(
        local_TV,
        labels_BL.flatten(),
        mesh.get_group(),
        logits_BLV.shape[-1],
        "none",
    )
    return (-nll_T).view(labels_BL.shape)
