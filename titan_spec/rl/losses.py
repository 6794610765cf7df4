"""The policy losses by name (``rl.loss``): one protocol, one registry.

A policy loss kind is a class (an rl/objective.py ``ClippedPolicyLoss``) with

    counts(values_BL, targets_BL, rl) -> {"tokens": n, "sequences": s}
        what its normalizers count on the WHOLE (unsharded) minibatch: the kept completion
        tokens and completions (the trainer sums each over the data-parallel ranks, as it
        does global_valid_tokens, so CP shards and PP microbatches add up to the whole
        minibatch's loss);
    from_values(values, counts, rl, ref_logp_BL) -> loss
        the loss of one (shard or microbatch of a) minibatch from its per-token values
        (RLTrainer.token_values) and those global counts: a ``training.co_training.PolicyLoss``
        (logits, labels, global tokens) -> (loss, stats).

rl/grpo.py (PPO-clip per token), rl/dapo.py (the same with overlong filtering) and
rl/gspo.py (the sequence-level ratio) each define one; the objective they share (ratio,
clip, dual-clip, TIS, KL estimator, aggregation) is rl/objective.py. A new loss is a class
here and a name in ``RLConfig.loss``.
"""

from __future__ import annotations

from titan_spec.rl.dapo import DAPOPolicyLoss
from titan_spec.rl.grpo import PPOPolicyLoss
from titan_spec.rl.gspo import GSPOPolicyLoss

__all__ = ["POLICY_LOSSES"]

POLICY_LOSSES = {"grpo": PPOPolicyLoss, "dapo": DAPOPolicyLoss, "gspo": GSPOPolicyLoss}
