"""The ONE co-training loss: total = policy loss + lambda * draft loss, from one forward.

Every training forward goes through ``CoTrainingLoss``: SFT (the policy loss is
torchtitan's cross-entropy), offline draft training (the policy is a frozen teacher: its
loss is reported, not trained), RL (the policy loss is PPO-clip, titan_spec/rl/grpo.py),
on the whole model (SpecTrainer._forward_backward_body, RLTrainer's update) or per
microbatch on the last pipeline stage (parallelisms/pipeline.py PipelineLoss, which gets
this object injected and so does not import it).

The policy loss reads the logits; the draft loss (DraftTraining.loss) reads the DETACHED
taps and logits, so each loss's gradient reaches only its own model.

Under tensor parallelism the logits arrive vocab-sharded (a DTensor, ``Shard(-1)`` on the tp
mesh: torchtitan's lm_head plan): the policy loss takes them as they are (loss-parallel
cross-entropy / log-probs, no vocab all-gather), the draft, replicated over the tp group,
gets them gathered and detached (its targets are a softmax over the draft vocabulary and
the target's argmax over the whole one); the taps are already full (models/target.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from titan_spec.training.draft import DraftTraining
from titan_spec.models.target import Taps, full_local

__all__ = ["CoTrainingLoss", "LossTerms", "PolicyLoss"]

PolicyLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, Any]]
"""(logits_BLV, labels_BL, global_valid_tokens) -> (loss, stats): this rank's loss sum over
its valid tokens / the global count (torchtitan's convention), and loss-specific stats (the
PPO ratios' clip fraction, KL, ...; None for cross-entropy)."""


@dataclass
class LossTerms:
    """What one forward's loss is made of."""

    total: torch.Tensor
    """policy (when it trains) + lambda * draft: the one tensor that is backpropagated."""
    policy: torch.Tensor
    """The policy loss (logged also when the policy is a frozen teacher)."""
    policy_stats: Any
    """The policy loss's own stats (see PolicyLoss)."""
    draft: Any = None
    """The draft's loss result (models/draft: loss, per-step sums and counts), None without a draft."""


@dataclass
class CoTrainingLoss:
    """policy + lambda * draft for one (micro)batch."""

    draft: DraftTraining | None
    """The draft's training side (None: the policy loss alone)."""
    weight: float = 1.0
    """lambda (draft.loss_weight)."""
    trains_policy: bool = True
    """False in offline draft training: the policy loss is not part of the total."""

    def __call__(
        self,
        policy_loss: PolicyLoss,
        logits_BLV: torch.Tensor,
        taps: Taps | None,
        labels_BL: torch.Tensor,
        global_valid_tokens: torch.Tensor,
        *,
        positions_BL: torch.Tensor | None = None,
        attention_meta: Any = None,
        draft_count_S: torch.Tensor | None = None,
    ) -> LossTerms:
        """``attention_meta``: the batch's document metadata (CPMetadata under context
        parallelism); ``draft_count_S``: the draft loss's normalizer over the whole step (the
        pipeline passes it for all microbatches; default: this batch's)."""
        policy, stats = policy_loss(logits_BLV, labels_BL, global_valid_tokens)
        total, draft = (policy if self.trains_policy else None), None
        if self.draft is not None:
            with torch.no_grad():
                draft_logits_BLV = full_local(logits_BLV.detach())
            draft = self.draft.loss(draft_logits_BLV, taps, positions_BL, labels_BL, attention_meta, draft_count_S)
            weighted = self.weight * draft.loss
            total = weighted if total is None else total + weighted
        return LossTerms(total=total, policy=policy, policy_stats=stats, draft=draft)
