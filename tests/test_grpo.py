"""GRPO advantages and the PPO-clip loss against hand-computed values."""

import math

import pytest
import torch

from titan_spec.rl.grpo import group_advantages, ppo_clip_loss


def test_group_advantages_by_hand():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    a = group_advantages(r)
    std = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]
    assert a[0].tolist() == pytest.approx([0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std], rel=1e-5)
    assert a[1].tolist() == [0.0, 0.0, 0.0, 0.0]  # no spread, no signal
    assert group_advantages(r, scale_by_std=False)[0].tolist() == [0.5, -0.5, -0.5, 0.5]
    with pytest.raises(ValueError, match="prompts, group"):
        group_advantages(torch.ones(4))


def test_ppo_clip_loss_by_hand():
    # token: ratio, advantage -> contribution -min(r*A, clip(r)*A)
    # 0: 1.5, +1 -> -min(1.5, 1.2) = -1.2 (clipped)
    # 1: 0.5, +1 -> -min(0.5, 0.8) = -0.5
    # 2: 0.5, -1 -> -min(-0.5, -0.8) = 0.8 (clipped)
    # 3: 1.1, -2 -> -min(-2.2, -2.2) = 2.2
    # 4: masked out (prompt token)
    ratio = torch.tensor([1.5, 0.5, 0.5, 1.1, 3.0])
    behaviour = torch.tensor([-1.0, -2.0, -0.3, -0.7, -1.0])
    logp = (behaviour + ratio.log()).requires_grad_()
    adv = torch.tensor([1.0, 1.0, -1.0, -2.0, 5.0])
    mask = torch.tensor([1, 1, 1, 1, 0])
    out = ppo_clip_loss(logp, behaviour, adv, mask, global_tokens=8)
    assert out.loss.item() == pytest.approx((-1.2 - 0.5 + 0.8 + 2.2) / 8, rel=1e-6)
    assert out.clip_fraction.item() == pytest.approx(3 / 4)  # |ratio - 1| > eps: tokens 0, 1, 2
    out.loss.backward()
    # Gradient flows only through unclipped tokens: d/dlogp of -r*A = -r*A.
    expected = torch.tensor([0.0, -0.5, 0.0, 2.2, 0.0]) / 8
    torch.testing.assert_close(logp.grad, expected, atol=1e-6, rtol=1e-6)


def test_kl_k3_by_hand():
    logp = torch.tensor([-1.0, -2.0])
    ref = torch.tensor([-1.5, -1.0])
    out = ppo_clip_loss(logp, logp.clone(), torch.zeros(2), torch.ones(2), 2, ref_logp_T=ref, kl_beta=0.1)
    k3 = [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]
    assert out.kl.item() == pytest.approx(sum(k3) / 2, rel=1e-6)
    assert out.loss.item() == pytest.approx(0.1 * sum(k3) / 2, rel=1e-6)
