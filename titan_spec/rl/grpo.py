"""GRPO: group-relative advantages and the PPO-clip policy loss per token (``rl.loss = "grpo"``).

Advantages: each prompt's G rewards are centred on their group mean (and divided by the
group std, optionally), so a completion is judged against its siblings only.

Loss: rl/objective.py's clipped objective with the per-token ratio exp(logp - b),
aggregated "token-mean" by default (the sum over the completion tokens of the whole global
batch divided by their global count, as torchtitan normalizes its LM loss); the GRPO
paper's per-sequence mean is rl.loss_agg = "seq-mean-token-mean".
"""

from __future__ import annotations

import torch

from titan_spec.rl.objective import ClippedPolicyLoss

__all__ = ["group_advantages", "PPOPolicyLoss"]


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


class PPOPolicyLoss(ClippedPolicyLoss):
    """GRPO's policy loss: PPO-clip per token over every completion token."""
