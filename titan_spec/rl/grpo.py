"""GRPO: group-relative advantages and the PPO-clip policy loss over packed tokens.

Shape legend: G = completions per prompt, P = prompts, T = packed tokens, B = packed rows,
L = row length, V = vocab.

Advantages: each prompt's G rewards are centred on their group mean (and divided by the
group std, optionally), so a completion is judged against its siblings only.

Loss (per completion token i with advantage A and behaviour log-prob b):
    ratio_i = exp(logp_i - b_i)
    loss_i  = -min(ratio_i * A, clip(ratio_i, 1 - eps_low, 1 + eps_high) * A)
            + beta * KL_i(policy || reference)          (k3 estimator, optional)
summed over the completion tokens of the whole global batch and divided by their
global count, as torchtitan normalizes its LM loss (token-level, not per-sequence).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Shard
from torchtitan.components.loss import IGNORE_INDEX, _LossParallelCrossEntropy

__all__ = ["group_advantages", "PolicyLossOutput", "PPOPolicyLoss", "ppo_clip_loss", "token_logprobs"]


def group_advantages(rewards_PG: torch.Tensor, scale_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """(reward - group mean) [/ (group std + eps)] for rewards of shape [P, G]."""
    if rewards_PG.dim() != 2:
        raise ValueError(f"rewards must be [prompts, group], got shape {tuple(rewards_PG.shape)}")
    centred = rewards_PG - rewards_PG.mean(dim=1, keepdim=True)
    if not scale_by_std:
        return centred
    # Unbiased std as in GRPO; a group of 1 has no spread (its advantage is 0 anyway).
    std = rewards_PG.std(dim=1, keepdim=True, unbiased=rewards_PG.shape[1] > 1)
    return centred / (std + eps)


@dataclass
class PolicyLossOutput:
    loss: torch.Tensor
    """Sum over this rank's completion tokens / global_tokens (sums to the global mean)."""
    clip_fraction: torch.Tensor
    """Fraction of this rank's tokens whose ratio was clipped (detached)."""
    kl: torch.Tensor
    """Mean k3 KL to the reference over this rank's tokens (detached; 0 without one)."""
    ratio_dev: torch.Tensor
    """max |ratio - 1| over this rank's tokens (detached): 0 up to rounding when the policy
    still is the behaviour policy (the first update after a weight push)."""


def ppo_clip_loss(
    logp_T: torch.Tensor,
    behaviour_logp_T: torch.Tensor,
    advantages_T: torch.Tensor,
    mask_T: torch.Tensor,
    global_tokens: torch.Tensor | int,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    ref_logp_T: torch.Tensor | None = None,
    kl_beta: float = 0.0,
) -> PolicyLossOutput:
    """PPO-clip with GRPO's token-level normalization. ``mask_T`` selects completion tokens."""
    mask = mask_T.to(logp_T.dtype)
    ratio = torch.exp(logp_T - behaviour_logp_T)
    unclipped = ratio * advantages_T
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages_T
    per_token = -torch.minimum(unclipped, clipped)
    kl = torch.zeros((), dtype=logp_T.dtype, device=logp_T.device)
    if ref_logp_T is not None and kl_beta > 0:
        # k3: exp(ref - logp) - (ref - logp) - 1 >= 0, unbiased for KL(pi || ref).
        d = ref_logp_T - logp_T
        kl_T = torch.exp(d) - d - 1.0
        per_token = per_token + kl_beta * kl_T
        kl = (kl_T * mask).sum().detach() / mask.sum().clamp(min=1)
    loss = (per_token * mask).sum() / torch.as_tensor(global_tokens, dtype=logp_T.dtype).clamp(min=1)
    with torch.no_grad():
        was_clipped = ((ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high)).to(mask.dtype)
        clip_fraction = (was_clipped * mask).sum() / mask.sum().clamp(min=1)
        ratio_dev = ((ratio - 1.0).abs() * mask).max() if mask.numel() else torch.zeros(())
    return PolicyLossOutput(loss=loss, clip_fraction=clip_fraction, kl=kl, ratio_dev=ratio_dev)


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
        local_TV, labels_BL.flatten(), mesh.get_group(), logits_BLV.shape[-1], "none",
    )
    return (-nll_T).view(labels_BL.shape)


@dataclass
class PPOPolicyLoss:
    """The RL policy loss of one minibatch (a ``co_training.PolicyLoss``): PPO-clip of the
    policy's log-probs at the rollout temperature against the behaviour log-probs the engine
    sampled with, the tokens' group advantages, and the optional KL to the reference."""

    behaviour_logp_BL: torch.Tensor
    advantages_BL: torch.Tensor
    rl: object
    """The [rl] section (temperature, clip_low, clip_high, kl_beta)."""
    ref_logp_BL: torch.Tensor | None = None

    @staticmethod
    def counts(values_BL: dict[str, torch.Tensor], targets_BL: torch.Tensor, rl) -> dict[str, int]:
        """What the loss divides by besides the global token count (rl/losses.py): nothing."""
        return {}

    @classmethod
    def from_values(cls, values: dict[str, torch.Tensor], counts: dict, rl, ref_logp_BL=None) -> "PPOPolicyLoss":
        return cls(values["behaviour_logp"], values["advantages"], rl, ref_logp_BL)

    def __call__(self, logits_BLV, labels_BL, global_valid_tokens) -> tuple[torch.Tensor, PolicyLossOutput]:
        rl = self.rl
        out = ppo_clip_loss(
            token_logprobs(logits_BLV, labels_BL, rl.temperature).reshape(-1),
            self.behaviour_logp_BL.reshape(-1), self.advantages_BL.reshape(-1),
            (labels_BL != IGNORE_INDEX).reshape(-1), global_valid_tokens,
            clip_low=rl.clip_low, clip_high=rl.clip_high,
            ref_logp_T=None if self.ref_logp_BL is None else self.ref_logp_BL.reshape(-1), kl_beta=rl.kl_beta,
        )
        return out.loss, out
