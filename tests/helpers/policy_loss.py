"""The policy objective (titan_spec/rl/objective.py) called the way the hand-computed tests
read it: one function per loss kind over flat tokens, with the global counts given."""

from __future__ import annotations

from dataclasses import replace

import torch

from titan_spec.config import RLConfig
from titan_spec.rl.grpo import PPOPolicyLoss
from titan_spec.rl.objective import policy_objective


def settings(**kw) -> RLConfig:
    return RLConfig(enable=True, **kw)


def ppo_clip_loss(
    logp_T, behaviour_T, adv_T, mask_T, global_tokens, clip_low=0.2, clip_high=0.2, ref_logp_T=None, kl_beta=0.0, **rl
):
    """GRPO's token-level PPO-clip, "token-mean" over ``global_tokens``."""
    cfg = settings(clip_low=clip_low, clip_high=clip_high, kl_beta=kl_beta, **rl)
    return policy_objective(
        logp_T,
        {"behaviour_logp": behaviour_T, "advantages": adv_T},
        mask_T > 0,
        {"tokens": global_tokens, "sequences": 1},
        cfg,
        ref_logp_T=ref_logp_T,
    )


def gspo_loss(
    logp_T,
    behaviour_T,
    adv_T,
    mask_T,
    seq_T,
    global_sequences,
    clip_low=3e-4,
    clip_high=4e-4,
    ref_logp_T=None,
    kl_beta=0.0,
    **rl,
):
    """GSPO's sequence ratio, "seq-mean-token-mean" over ``global_sequences``."""
    mask = mask_T > 0
    seq = seq_T.round().long() * mask.long()
    n_S = torch.bincount(seq, minlength=int(seq.max()) + 1).to(logp_T.dtype)
    cfg = settings(loss="gspo", clip_low=clip_low, clip_high=clip_high, kl_beta=kl_beta, **rl)
    values = {"behaviour_logp": behaviour_T, "advantages": adv_T, "seq_index": seq_T, "seq_tokens": n_S[seq]}
    return policy_objective(
        logp_T,
        values,
        mask,
        {"tokens": int(mask.sum()), "sequences": global_sequences},
        cfg,
        sequence_ratio=True,
        ref_logp_T=ref_logp_T,
    )


def ppo_policy_loss(behaviour_BL, advantages_BL, rl, tokens) -> PPOPolicyLoss:
    """GRPO's PolicyLoss over a packed batch whose completion tokens number ``tokens``."""
    values = {"behaviour_logp": behaviour_BL, "advantages": advantages_BL}
    return PPOPolicyLoss(values, {"tokens": tokens, "sequences": 1}, replace(rl, loss_agg="token-mean"))
