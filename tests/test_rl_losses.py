"""The RL loss variants against hand-computed examples (fp64, closed forms written out here):
DAPO (rl/dapo.py: clip-higher, overlong filtering, soft overlong punishment) and GSPO
(rl/gspo.py: the sequence-level ratio), and their wiring in RLTrainer.policy_loss / pack /
reward_shaping. One real RL step of each is tests/test_rl_e2e.py."""

import math
from types import SimpleNamespace

import pytest
import torch

import titan_spec  # noqa: F401
from titan_spec.config import DAPOConfig, RLConfig
from helpers.policy_loss import gspo_loss, ppo_clip_loss
from titan_spec.rl.dapo import DAPOPolicyLoss, overlong_penalty
from titan_spec.rl.grpo import PPOPolicyLoss
from titan_spec.rl.gspo import GSPOPolicyLoss
from titan_spec.rl.step import RLTrainer

F64 = torch.float64


def _logp(behaviour, log_ratio):
    return (behaviour + torch.tensor(log_ratio, dtype=F64)).requires_grad_()


# --- DAPO ------------------------------------------------------------------------------------


def test_dapo_clip_higher_and_overlong_filter_by_hand():
    """Three completions packed as tokens [a a | b b b | c] with a prompt token in front.
    eps_low 0.2, eps_high 0.28: ratio 1.25 with A > 0 is inside [0.8, 1.28] (clip-higher; the
    symmetric 0.2 would clip it at 1.2). Completion c is truncated: with overlong filtering it
    is out of the value, the gradient AND the normalizer (kept tokens 5 here + 3 on another rank)."""
    # token: prompt, a1, a2, b1, b2, b3, c1
    ratio = [5.0, 1.25, 0.7, 1.1, 1.4, 0.9, 1.5]
    adv = [9.0, 1.0, 1.0, -1.0, -1.0, -1.0, 2.0]
    mask = torch.tensor([0, 1, 1, 1, 1, 1, 1])
    keep = torch.tensor([1, 1, 1, 1, 1, 1, 0])  # c is truncated
    behaviour = -torch.linspace(0.3, 1.5, 7, dtype=F64)
    logp = _logp(behaviour, [math.log(r) for r in ratio])
    # -min(r A, clip(r, 0.8, 1.28) A) per kept token, and d/dlogp (= -r A where unclipped wins):
    # a1: r 1.25 A 1  -> -1.25, grad -1.25 (inside)
    # a2: r 0.7  A 1  -> -0.7,  grad -0.7  (below, A > 0: the unclipped 0.7 is the min)
    # b1: r 1.1  A -1 -> 1.1,   grad 1.1   (inside)
    # b2: r 1.4  A -1 -> 1.4,   grad 1.4   (above, A < 0: -1.4 is the min, unclipped)
    # b3: r 0.9  A -1 -> 0.9,   grad 0.9   (inside)
    value = [-1.25, -0.7, 1.1, 1.4, 0.9]
    grad = [0.0, -1.25, -0.7, 1.1, 1.4, 0.9, 0.0]
    N = 5 + 3
    out = ppo_clip_loss(logp, behaviour, torch.tensor(adv, dtype=F64), mask & keep, N, clip_low=0.2, clip_high=0.28)
    assert out.loss.item() == pytest.approx(sum(value) / N, rel=1e-12)
    assert out.out_of_band.item() == pytest.approx(2 / 5)  # a2 and b2 are outside the range ...
    assert out.clip_fraction.item() == 0.0  # ... on the side where the unclipped term is the loss
    out.loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor(grad, dtype=F64) / N, rtol=1e-12, atol=1e-15)

    # The same through DAPOPolicyLoss from logits (one row of 7 tokens): the filtered tokens
    # and the normalizer are its own; the label ids pick the log-probs.
    rl = RLConfig(
        enable=True, loss="dapo", dapo=DAPOConfig(overlong_filter=True), clip_low=0.2, clip_high=0.28, temperature=1.0
    )
    V = 5
    logits = torch.randn(1, 7, V, dtype=F64, generator=torch.Generator().manual_seed(0)).requires_grad_()
    labels = torch.tensor([[-100, 1, 2, 3, 4, 0, 2]])
    lp = torch.log_softmax(logits.detach(), -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    beh = lp - torch.tensor([ratio], dtype=F64).log()
    values = {
        "behaviour_logp": beh,
        "advantages": torch.tensor([adv], dtype=F64),
        "truncated": 1.0 - keep[None].to(F64),
    }
    loss, stats = DAPOPolicyLoss(values, {"tokens": torch.tensor(N), "sequences": 3}, rl)(
        logits, labels, torch.tensor(999)
    )
    assert loss.item() == pytest.approx(sum(value) / N, rel=1e-5)  # token_logprobs runs in fp32
    assert stats.out_of_band.item() == pytest.approx(2 / 5)


def test_dapo_soft_overlong_punishment_by_hand():
    """L_max 12, L_cache 4: no penalty up to 8 tokens, then -(|y| - 8) / 4 * factor, -factor at 12."""
    lengths = torch.tensor([[3, 8, 9], [10, 11, 12]])
    want = [[0.0, 0.0, -0.25], [-0.5, -0.75, -1.0]]
    torch.testing.assert_close(overlong_penalty(lengths, 12, 4, 1.0), torch.tensor(want))
    torch.testing.assert_close(overlong_penalty(lengths, 12, 4, 0.5), torch.tensor(want) * 0.5)
    assert not overlong_penalty(lengths, 12, 0, 1.0).any()  # buffer 0: off


# --- GSPO ------------------------------------------------------------------------------------

# Three completions: per-token log-ratios logp - b, their advantage, the sequence ratio
# s = exp(mean log-ratio) and the loss -min(s A, clip(s, 1 - 0.05, 1 + 0.08) A), by hand.
SEQS = [
    ([0.1, -0.3], 1.0),  # s = exp(-0.1) = 0.904837 < 0.95, A > 0: unclipped is the min, grad flows
    ([0.2, 0.1, 0.0], 2.0),  # s = exp(0.1) = 1.105171 > 1.08, A > 0: clipped to 1.08 * 2, no grad
    ([0.02], -1.0),  # s = exp(0.02) = 1.020201 inside: -(-s) = s, grad flows
]
LO, HI = 0.05, 0.08


def _gspo_inputs():
    """Packed tokens: a prompt token, then the three completions (seq ids 1..3), a pad."""
    behaviour, log_ratio, adv, seq, mask = [-2.0], [4.0], [7.0], [0], [0]
    for i, (lr, a) in enumerate(SEQS):
        for j, x in enumerate(lr):
            behaviour.append(-0.5 - 0.1 * j - i)
            log_ratio.append(x)
            adv.append(a)
            seq.append(i + 1)
            mask.append(1)
    behaviour.append(-1.0), log_ratio.append(-3.0), adv.append(5.0), seq.append(0), mask.append(0)
    b = torch.tensor(behaviour, dtype=F64)
    return (
        b,
        _logp(b, log_ratio),
        torch.tensor(adv, dtype=F64),
        torch.tensor(mask),
        torch.tensor(seq, dtype=torch.float32),
    )


def test_gspo_sequence_ratio_loss_and_gradient_by_hand():
    """loss = sum_i -min(s_i A_i, clip(s_i) A_i) / (global completions: 3 here + 1 elsewhere);
    d loss / d logp_t = -A_i s_i / |y_i| / 4 for the tokens of an unclipped completion, 0 for a
    clipped one. A token-level ratio (PPO) or a product (no 1/|y|) gives other values."""
    b, logp, adv, mask, seq = _gspo_inputs()
    out = gspo_loss(logp, b, adv, mask, seq, 4, clip_low=LO, clip_high=HI)
    s = [math.exp(sum(lr) / len(lr)) for lr, _ in SEQS]
    per = [-min(si * a, min(max(si, 1 - LO), 1 + HI) * a) for si, (_, a) in zip(s, SEQS)]
    assert per == pytest.approx([-s[0], -2.16, s[2]], rel=1e-12)
    assert out.loss.item() == pytest.approx(sum(per) / 4, rel=1e-12)
    out.loss.backward()
    want = [0.0] + [-1.0 * s[0] / 2 / 4] * 2 + [0.0] * 3 + [1.0 * s[2] / 1 / 4] + [0.0]
    torch.testing.assert_close(logp.grad, torch.tensor(want, dtype=F64), rtol=1e-12, atol=1e-15)
    # stats: the clip takes effect on b's 3 of the 6 tokens (a's s is below the range but its
    # unclipped term is the loss); the largest |s - 1| is b's
    assert out.clip_fraction.item() == pytest.approx(3 / 6)
    assert out.ratio_dev.item() == pytest.approx(s[1] - 1, rel=1e-12)
    # Not the token-level loss on the same inputs.
    token = ppo_clip_loss(logp.detach(), b, adv, mask, 6, clip_low=LO, clip_high=HI)
    assert abs(token.loss.item() - out.loss.item()) > 0.05


def test_gspo_equals_verls_per_token_formulation():
    """verl's GSPO-token form: log s_i,t = sg[log s_i] + logp_t - sg[logp_t], the PPO-clip per
    token, aggregated "seq-mean-token-mean" (mean over a sequence's tokens, then over the
    sequences): value and gradient equal gspo_loss's (written here independently, fp64)."""
    b, logp, adv, mask, seq = _gspo_inputs()
    out = gspo_loss(logp, b, adv, mask, seq, 3, clip_low=LO, clip_high=HI)
    out.loss.backward()
    got = logp.grad.clone()
    logp.grad = None
    losses = []
    for i in range(1, 4):
        sel = (seq == i) & (mask > 0)
        lp, bb, a = logp[sel], b[sel], adv[sel]
        log_s = (lp - bb).mean().detach()
        r = torch.exp(log_s + lp - lp.detach())
        per_token = torch.maximum(-a * r, -a * r.clamp(1 - LO, 1 + HI))
        losses.append(per_token.mean())
    ref = torch.stack(losses).mean()
    ref.backward()
    assert out.loss.item() == pytest.approx(ref.item(), rel=1e-12)
    torch.testing.assert_close(got, logp.grad, rtol=1e-12, atol=1e-15)


def test_gspo_kl_and_far_off_policy_cap():
    """The k3 KL enters per sequence (its tokens' mean) times beta; a sequence whose mean
    log-ratio is 50 gets s = exp(10) (verl's cap), finite, not inf."""
    b = torch.zeros(3, dtype=F64)
    logp = torch.tensor([-0.5, -1.0, -2.0], dtype=F64)
    ref = torch.tensor([-1.0, -1.0, -1.0], dtype=F64)
    seq, mask = torch.tensor([1.0, 1.0, 2.0]), torch.ones(3)
    out = gspo_loss(logp, b, torch.zeros(3, dtype=F64), mask, seq, 2, 0.2, 0.2, ref_logp_T=ref, kl_beta=0.5)
    k3 = [math.exp(d) - d - 1 for d in (-0.5, 0.0, 1.0)]
    kl_seq = [(k3[0] + k3[1]) / 2, k3[2]]
    assert out.loss.item() == pytest.approx(0.5 * sum(kl_seq) / 2, rel=1e-12)
    assert out.kl.item() == pytest.approx((kl_seq[0] * 2 + kl_seq[1]) / 3, rel=1e-12)
    far = gspo_loss(
        torch.full((2,), 50.0, dtype=F64),
        torch.zeros(2, dtype=F64),
        torch.ones(2, dtype=F64),
        torch.ones(2),
        torch.ones(2),
        1,
        0.2,
        0.2,
    )
    assert far.ratio_dev.item() == pytest.approx(math.exp(10) - 1, rel=1e-12)


# --- the trainer's wiring --------------------------------------------------------------------


def _rollout(prompt, out, reason):
    return SimpleNamespace(prompt_ids=prompt, output_ids=out, logprobs=[-0.5] * len(out), finish_reason=reason)


def _fake_trainer(rl):
    return SimpleNamespace(
        rl=rl,
        reference=None,
        device=torch.device("cpu"),
        parallel_dims=SimpleNamespace(dp_enabled=False, cp_enabled=False, pp_enabled=False),
        config=SimpleNamespace(training=SimpleNamespace(seq_len=32, local_batch_size=1)),
        tokenizer=SimpleNamespace(pad_id=0),
        dataloader=SimpleNamespace(document_multiple=1),
        _global_sum=lambda n: RLTrainer._global_sum(
            SimpleNamespace(device=torch.device("cpu"), parallel_dims=SimpleNamespace(dp_enabled=False)), n
        ),
    )


def test_pack_policy_loss_and_reward_shaping_wire_each_variant():
    """RLTrainer.pack puts each completion's 1-based index (per minibatch) and its truncation
    on its label tokens; policy_loss builds the variant rl.loss names with the right
    normalizer (DAPO: kept tokens; GSPO: completions); reward_shaping adds DAPO's penalty."""
    rollouts = [
        _rollout([1, 5], [6, 7, 2], "stop"),
        _rollout([1, 5], [8, 9, 9, 9], "length"),
        _rollout([1, 4], [3], "stop"),
        _rollout([1, 4], [3, 3], "stop"),
    ]
    batch = SimpleNamespace(rollouts=rollouts, problems=[None, None])
    rl = RLConfig(enable=True, group_size=2, minibatches=2, max_new_tokens=4)
    fake = _fake_trainer(rl)
    mbs = RLTrainer.pack(fake, batch, torch.tensor([[1.0, -1.0], [0.5, -0.5]]))
    assert len(mbs) == 2
    for mb, outs in zip(mbs, ([[6, 7, 2], [8, 9, 9, 9]], [[3], [3, 3]])):
        targets = mb.labels_BL != -100
        seq = mb.values_BL["seq_index"][targets].tolist()
        assert seq == [1.0] * len(outs[0]) + [2.0] * len(outs[1])
        assert not mb.values_BL["seq_index"][~targets].any()
    assert mbs[0].values_BL["truncated"][mbs[0].labels_BL != -100].tolist() == [0.0] * 3 + [1.0] * 4
    assert mbs[0].values_BL["seq_tokens"][mbs[0].labels_BL != -100].tolist() == [3.0] * 3 + [4.0] * 4

    def policy_loss():
        values, counts = RLTrainer.token_values(fake, mbs[0]), RLTrainer.loss_counts(fake, mbs[0])
        return RLTrainer.policy_loss(fake, values, counts, None)

    assert isinstance(policy_loss(), PPOPolicyLoss)
    fake.rl = RLConfig(enable=True, loss="dapo", dapo=DAPOConfig(overlong_filter=True), group_size=2, max_new_tokens=4)
    dapo = policy_loss()
    assert isinstance(dapo, DAPOPolicyLoss) and int(dapo.totals["tokens"]) == 3  # the truncated 4 are out
    assert int(dapo.totals["sequences"]) == 1
    fake.rl = RLConfig(enable=True, loss="gspo", group_size=2)
    gspo = policy_loss()
    assert isinstance(gspo, GSPOPolicyLoss) and int(gspo.totals["sequences"]) == 2
    fake.rl = RLConfig(
        enable=True,
        loss="dapo",
        group_size=2,
        max_new_tokens=4,
        dapo=DAPOConfig(overlong_buffer=2, overlong_penalty=1.0),
    )
    torch.testing.assert_close(RLTrainer.reward_shaping(fake, batch), torch.tensor([[-0.5, -1.0], [0.0, 0.0]]))
    fake.rl = rl
    assert not RLTrainer.reward_shaping(fake, batch).any()  # grpo: nothing added
