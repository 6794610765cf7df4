"""The policy losses by name (``rl.loss``): one protocol, one registry.

A policy loss kind is a class with

    counts(values_BL, targets_BL, rl) -> {name: count}
        what its normalizer counts on the WHOLE (unsharded) minibatch beyond the token count
        (the trainer sums each over the data-parallel ranks, as it does global_valid_tokens,
        so CP shards and PP microbatches add up to the whole minibatch's loss);
    from_values(values, counts, rl, ref_logp_BL) -> loss
        the loss of one (shard or microbatch of a) minibatch from its per-token values
        (behaviour_logp, advantages, seq_index, truncated) and those global counts: a
        ``training.co_training.PolicyLoss`` (logits, labels, global tokens) -> (loss, stats).

rl/grpo.py (PPO-clip, token-level), rl/dapo.py (PPO-clip with overlong filtering), rl/gspo.py
(the sequence-level ratio) each define one. A new loss is a class here and a name in
``RLConfig.loss``.
"""

from __future__ import annotations

from titan_spec.rl.dapo import DAPOPolicyLoss
from titan_spec.rl.grpo import PPOPolicyLoss
from titan_spec.rl.gspo import GSPOPolicyLoss

__all__ = ["POLICY_LOSSES"]

POLICY_LOSSES = {"grpo": PPOPolicyLoss, "dapo": DAPOPolicyLoss, "gspo": GSPOPolicyLoss}
