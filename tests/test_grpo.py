"""GRPO advantages and the PPO-clip loss against hand-computed values; the RL loop's grouping of
completions into advantages and its KL-regularized co-training step, run in-process."""

import dataclasses
import math
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch

import titan_spec  # noqa: F401
from helpers.rl_loop_stub import rollout_step
from titan_spec.config import DraftConfig, Eagle3Config, RLConfig, load_config
from titan_spec.training.draft import DraftTraining
from titan_spec.models.draft.eagle3.model import DraftArch
from titan_spec.models.registry import build_target_config, flavor_arch, with_vocab
from helpers.policy_loss import ppo_clip_loss
from titan_spec.rl.grpo import group_advantages
from titan_spec.training.co_training import CoTrainingLoss
from titan_spec.rl.step import RLTrainer
from titan_spec.training.trainer import SpecTrainer
from titan_spec.data.packing import Document, pack_documents


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
    assert out.clip_fraction.item() == pytest.approx(2 / 4)  # the clip takes effect: tokens 0 and 2 (verl's)
    assert out.out_of_band.item() == pytest.approx(3 / 4)  # |ratio - 1| > eps: tokens 0, 1, 2
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


# --- asymmetric clip, the KL gradient, masking ---------------------------------------------
# Float64 throughout so ratios are exact enough for 1e-12 comparisons. Per token the loss is
# -min(r*A, clip(r, 1 - lo, 1 + hi)*A) / N, so d/dlogp = -r*A/N where the unclipped term is
# the min (or the two are equal), and 0 where the clipped, constant term is the min.

LO, HI = 0.1, 0.3  # the ratio's trust region is [0.9, 1.3]
# (ratio, advantage, contribution -min(...), d contribution / d logp, outside [0.9, 1.3]?)
ASYMMETRIC = [
    (1.2, 1.0, -1.2, -1.2, False),  # inside; with lo/hi swapped ([0.7, 1.1]) it would clip to -1.1, grad 0
    (1.4, 1.0, -1.3, 0.0, True),  # A > 0 above 1 + hi: clipped, no gradient
    (0.8, 1.0, -0.8, -0.8, True),  # A > 0 below 1 - lo: the unclipped term is the min, gradient flows
    (0.95, -1.0, 0.95, 0.95, False),  # inside, A < 0
    (0.85, -1.0, 0.9, 0.0, True),  # A < 0 below 1 - lo: clipped to 0.9, no gradient
    (0.75, -2.0, 1.8, 0.0, True),  # A < 0 below 1 - lo; swapped bounds would keep 0.75 (1.5, grad 1.5)
    (1.5, -1.0, 1.5, 1.5, True),  # A < 0 above 1 + hi: the unclipped term is the min, gradient flows
    (1.25, -1.0, 1.25, 1.25, False),  # inside for the right bounds, clipped at 1.1 for swapped ones
]


def _logp(ratio, behaviour):
    return (behaviour + torch.tensor(ratio, dtype=torch.float64).log()).requires_grad_()


def test_asymmetric_clip_values_and_gradients_per_token_by_hand():
    """clip_low bounds the ratio from below and clip_high from above, in both advantage signs;
    a swap of the two (or of their signs) changes tokens 0, 5 and 7."""
    ratio, adv, value, grad, outside = map(list, zip(*ASYMMETRIC))
    n, N = len(ratio), 10  # global token count includes other ranks' tokens
    behaviour = -torch.linspace(0.5, 2.0, n + 1, dtype=torch.float64)
    logp = _logp(ratio + [2.0], behaviour)
    adv_T = torch.tensor(adv + [7.0], dtype=torch.float64)
    mask = torch.tensor([1] * n + [0])  # the last token is a prompt token with a huge ratio * advantage
    out = ppo_clip_loss(logp, behaviour, adv_T, mask, global_tokens=N, clip_low=LO, clip_high=HI)
    assert out.loss.item() == pytest.approx(sum(value) / N, rel=1e-12)
    assert out.out_of_band.item() == pytest.approx(sum(outside) / n)
    # verl's and TRL's clip fraction: where the clipped term wins, i.e. no gradient flows
    assert out.clip_fraction.item() == pytest.approx(sum(g == 0.0 for g in grad) / n)
    out.loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor(grad + [0.0], dtype=torch.float64) / N, rtol=1e-12, atol=1e-15)


def test_kl_k3_gradient_is_its_closed_form_and_masked_tokens_are_excluded():
    """k3(d) = exp(d) - d - 1 with d = ref - logp, so d k3 / d logp = 1 - exp(ref - logp):
    the KL pulls logp toward ref. The loss adds beta * k3 / N per completion token on top of
    the PPO term; a masked token with a large KL adds to neither the value, the gradient
    nor the logged mean KL."""
    beta, N = 0.25, 6
    behaviour = torch.tensor([-1.0, -2.0, -0.5, -1.5, -3.0], dtype=torch.float64)
    ratio = [1.1, 0.95, 1.0, 1.2, 1.0]  # all inside [0.9, 1.3]: the PPO gradient is -r*A/N
    adv = torch.tensor([1.0, -2.0, 0.0, 0.5, 3.0], dtype=torch.float64)
    logp = _logp(ratio, behaviour)
    ref = torch.tensor([-1.5, -1.0, -0.2, -1.7, -3.0 + 5.0], dtype=torch.float64)  # token 4: ref - logp = 5
    mask = torch.tensor([1, 1, 1, 1, 0])
    out = ppo_clip_loss(logp, behaviour, adv, mask, N, clip_low=LO, clip_high=HI, ref_logp_T=ref, kl_beta=beta)
    r, a, lp, rf = (torch.tensor(ratio, dtype=torch.float64), adv, logp.detach(), ref)
    d = rf - lp
    k3 = torch.exp(d) - d - 1
    m = mask.double()
    assert k3[4] > 100  # large enough that leaking it through the mask would show
    assert out.kl.item() == pytest.approx(float((k3 * m).sum() / 4), rel=1e-12)
    assert out.loss.item() == pytest.approx(float(((-r * a + beta * k3) * m).sum() / N), rel=1e-12)
    out.loss.backward()
    expected = (-r * a + beta * (1 - torch.exp(d))) * m / N
    torch.testing.assert_close(logp.grad, expected, rtol=1e-12, atol=1e-15)
    # The KL part alone (A = 0): a token below its reference is pushed up, one above pushed down.
    logp0 = _logp(ratio, behaviour)
    ppo_clip_loss(
        logp0, behaviour, torch.zeros(5, dtype=torch.float64), mask, N, ref_logp_T=ref, kl_beta=beta
    ).loss.backward()
    assert logp0.grad[1] < 0 < logp0.grad[0] and logp0.grad[4] == 0
    torch.testing.assert_close(logp0.grad, beta * (1 - torch.exp(d)) * m / N, rtol=1e-12, atol=1e-15)


# --- group advantages ----------------------------------------------------------------------


def test_group_advantages_with_more_groups_than_members_and_distinct_rewards():
    """[P, G] with P != G: each ROW is a prompt's group (a transposed reading averages over
    the wrong axis and changes every value below)."""
    r_PG = torch.tensor([[0.0, 1.0], [4.0, 4.0], [3.0, -1.0]])  # P = 3, G = 2
    # group means 0.5, 4, 1; centred +-0.5, 0, +-2; unbiased stds sqrt(0.5), 0, sqrt(8)
    c = [[-0.5, 0.5], [0.0, 0.0], [2.0, -2.0]]
    assert group_advantages(r_PG, scale_by_std=False).tolist() == c
    s = [[-0.5 / math.sqrt(0.5), 0.5 / math.sqrt(0.5)], [0.0, 0.0], [2 / math.sqrt(8), -2 / math.sqrt(8)]]
    torch.testing.assert_close(group_advantages(r_PG), torch.tensor(s), rtol=1e-5, atol=0)
    r_PG = torch.tensor([[0.0, 1.0, 5.0], [2.0, 2.0, 2.0]])  # P = 2, G = 3: mean 2, var (4 + 1 + 9) / 2
    torch.testing.assert_close(
        group_advantages(r_PG),
        torch.tensor([[-2.0, -1.0, 3.0], [0.0, 0.0, 0.0]]) / torch.tensor([[7**0.5], [1.0]]),
        rtol=1e-5,
        atol=0,
    )


# The RL loop's own grouping (RLTrainer.generate/score/pack, run in-process over scripted
# completions): P = 3 prompts, G = 4 completions each, exact-match rewards.
PROBLEMS = [
    ("qa", "5", ["5", "6", "55", "5"]),  # rewards 1 0 0 1
    ("qb", "7", ["1", "2", "7", "3"]),  # rewards 0 0 1 0
    ("qc", "9", ["0", "1", "2", "3"]),  # rewards 0 0 0 0: all equal, no signal
]
ADVANTAGES = {  # (prompt, completion) -> advantage, by hand
    True: {  # centred / unbiased std (qa: std sqrt(1/3), qb: std 1/2)
        ("qa", "5"): 0.5 * math.sqrt(3),
        ("qa", "6"): -0.5 * math.sqrt(3),
        ("qa", "55"): -0.5 * math.sqrt(3),
        ("qb", "7"): 1.5,
        ("qb", "1"): -0.5,
        ("qb", "2"): -0.5,
        ("qb", "3"): -0.5,
    },
    False: {  # centred only
        ("qa", "5"): 0.5,
        ("qa", "6"): -0.5,
        ("qa", "55"): -0.5,
        ("qb", "7"): 0.75,
        ("qb", "1"): -0.25,
        ("qb", "2"): -0.25,
        ("qb", "3"): -0.25,
    },
}


def _documents(inputs, labels_BL, tok):
    """(prompt text, completion text, advantages on its label positions) of every packed doc."""
    ids, pos, lab = inputs["input"].reshape(-1), inputs["positions"].reshape(-1), labels_BL.reshape(-1)
    adv = inputs["advantages"].reshape(-1)
    starts = [i for i in range(ids.numel()) if pos[i] == 0 and ids[i] == tok.bos_id]
    out = []
    for s in starts:
        e = s + 1
        while e < ids.numel() and pos[e] != 0:
            e += 1
        text = tok.decode(ids[s:e].tolist())
        prompt, completion = text[:2], text[2:]  # every prompt is two characters
        targets = lab[s:e] != -100
        assert int(targets.sum()) == len(completion)
        out.append((prompt, completion, adv[s:e][targets].tolist()))
    return out


@pytest.mark.parametrize("scale", [True, False])
def test_rl_loop_groups_each_prompts_completions_and_puts_their_advantage_on_them(scale):
    docs = _documents(*rollout_step(PROBLEMS, scale_advantages=scale))
    assert sorted((p, c) for p, c, _ in docs) == sorted((p, c) for p, _, cs in PROBLEMS for c in cs)
    for prompt, completion, adv in docs:
        want = ADVANTAGES[scale].get((prompt, completion), 0.0)
        assert adv == pytest.approx([want] * len(completion), rel=1e-5, abs=1e-6), (prompt, completion)


# --- one co-training step with the KL term and the reference model ------------------------


def test_co_training_step_with_kl_uses_a_frozen_reference_copy_and_adds_the_kl_gradient():
    """RLTrainer._build_reference and policy_loss and SpecTrainer.co_train_forward_backward
    (what RLTrainer.update runs), in-process with kl_beta > 0
    over a tiny policy that has moved away from its reference (as after some RL steps), and
    compared with an independent computation: the reference is a separate copy of the policy
    as it was (later policy changes do not reach it, it takes no gradient), and the policy's
    gradient is that of PPO-clip + beta * mean k3 KL written out here in fp64 from the two
    models' logits. The draft's gradient does not depend on beta."""
    IGNORE, T, beta, taps = -100, 0.7, 0.5, (1, 3, 4)
    torch.manual_seed(0)
    arch = dataclasses.replace(with_vocab(flavor_arch("qwen3", "tiny"), 40), n_layers=5, max_seq_len=64)
    model = build_target_config(arch, tap_layer_ids=taps).build()
    model.init_weights(buffer_device=None)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    fake = SimpleNamespace(
        config=SimpleNamespace(arch=arch, draft=SimpleNamespace(loss_weight=0.5)),
        device=torch.device("cpu"),
        model_parts=[model],
        train_context=nullcontext,
    )
    reference = RLTrainer._build_reference(fake)
    assert not any(p.requires_grad for p in reference.parameters())
    with torch.no_grad():  # the policy moves on; its reference must not
        for p in model.parameters():
            p.add_(0.3 * p.abs().mean() * torch.randn_like(p))

    g = torch.Generator().manual_seed(1)
    docs = []
    for i in range(4):
        c = torch.randint(3, 40, (3 + i,), generator=g).tolist()
        docs.append(
            Document(
                [1] + torch.randint(3, 40, (4,), generator=g).tolist() + c,
                loss_from=5,
                values={
                    "behaviour_logp": (-torch.rand(len(c), generator=g) * 3).tolist(),
                    "advantages": [i - 1.5] * len(c),
                },
            )
        )
    b, _ = pack_documents(docs, None, 32, pad_id=0)
    mask = b.labels_BL != IGNORE
    N = mask.sum()
    extra = {"positions": b.positions_BL, "attention_masks": model.get_attention_masks(b.positions_BL)}
    dcfg = DraftConfig(enable=True, eagle3=Eagle3Config(ttt_steps=2))
    dt = DraftTraining(
        dcfg,
        DraftArch.from_target(arch, taps, arch.vocab_size),
        device=torch.device("cpu"),
        dp_mesh=None,
        lr_scheduler_cfg=load_config(None).lr_scheduler,
        training_steps=10,
        token_counts_V=None,
        seed=0,
    )

    def step(kl_beta):
        model.zero_grad(set_to_none=True)
        dt.zero_grad()
        fake.rl = RLConfig(enable=True, temperature=T, kl_beta=kl_beta)
        fake.reference, fake.co_loss = reference if kl_beta else None, CoTrainingLoss(dt, weight=0.5)
        ref_logp = RLTrainer.reference_logprobs(fake, b.input_BL, b.labels_BL, extra)
        policy_loss = RLTrainer.policy_loss(fake, b.values_BL, {"tokens": N, "sequences": 1}, ref_logp)
        terms = SpecTrainer.co_train_forward_backward(fake, b.input_BL, b.labels_BL, N, extra, policy_loss)
        draft_grads = [p.grad.clone() for p in dt.draft.parameters() if p.grad is not None]
        return [p.grad.clone() for p in model.parameters()], draft_grads, terms.policy_stats

    with_kl, draft_kl, stats = step(beta)
    without, draft_0, _ = step(0.0)

    # Independent: a fresh model holding the initial weights is the reference.
    ref2 = build_target_config(arch).build()
    ref2.load_state_dict(initial)
    for k, v in reference.state_dict().items():
        assert torch.equal(v, initial[k]), f"the reference's {k} is not the initial policy's"
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        ref_lp = torch.log_softmax(ref2(b.input_BL, **extra).double() / T, -1)
    logits, _ = model(b.input_BL, **extra)
    lp = torch.log_softmax(logits.double() / T, -1)
    lab = b.labels_BL.clamp(min=0)[..., None]
    lp_BL, ref_BL = lp.gather(-1, lab)[..., 0], ref_lp.gather(-1, lab)[..., 0]
    ratio = torch.exp(lp_BL - b.values_BL["behaviour_logp"].double())
    adv = b.values_BL["advantages"].double()
    ppo = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    d = ref_BL - lp_BL
    k3 = torch.exp(d) - d - 1
    ((ppo + beta * k3)[mask].sum() / N).backward()
    expected = [p.grad for p in model.parameters()]

    assert float(stats.kl) == pytest.approx(float(k3[mask].mean().detach()), rel=1e-4)
    assert float(k3[mask].mean().detach()) > 1e-2  # the policy really moved away from its reference
    kl_part = sum(float((a - c).norm()) for a, c in zip(with_kl, without))
    assert kl_part > 0.1 * sum(float(a.norm()) for a in with_kl), "the KL term adds (almost) no gradient"
    for got, want in zip(with_kl, expected):
        torch.testing.assert_close(got, want.float(), rtol=2e-4, atol=2e-6)
    assert len(draft_kl) == len(draft_0) > 0
    for a, c in zip(draft_kl, draft_0):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-7)


def _vocab_parallel_worker(rank: int, world: int, init_file: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from titan_spec.platform import exit_process
    from titan_spec.rl.logprobs import token_logprobs

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        gen = torch.Generator().manual_seed(0)
        logits_BLV = torch.randn(2, 5, 10, generator=gen) * 3
        labels_BL = torch.randint(0, 10, (2, 5), generator=gen)
        labels_BL[0, 0] = labels_BL[1, 3] = -100  # ignored: log-prob 0, no gradient
        T = 0.7
        # Reference: fp64 log_softmax on the whole vocabulary, in one process.
        ref = logits_BLV.double().requires_grad_()
        want = torch.log_softmax(ref / T, -1).gather(-1, labels_BL.clamp(min=0)[..., None])[..., 0]
        want = want.masked_fill(labels_BL == -100, 0.0)
        w_BL = torch.arange(10.0).view(2, 5)
        (want_grad,) = torch.autograd.grad((want * w_BL).sum(), ref)
        # torchtitan's lm_head layout: the vocabulary sharded over the tp mesh (5 columns each).
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        sharded = distribute_tensor(logits_BLV.clone(), mesh, [Shard(2)]).requires_grad_()
        got = token_logprobs(sharded, labels_BL, T)
        assert not isinstance(got, type(sharded)) and got.shape == labels_BL.shape
        torch.testing.assert_close(got.double(), want.detach(), rtol=0, atol=1e-5)
        (got * w_BL).sum().backward()
        torch.testing.assert_close(sharded.grad.full_tensor().double(), want_grad, rtol=0, atol=1e-5)
    finally:
        dist.destroy_process_group()
    exit_process(0)


def test_token_logprobs_of_vocab_sharded_logits_match_the_whole_vocabulary(tmp_path):
    """Under tensor parallelism the PPO log-probs come from the vocab-sharded logits through
    torchtitan's loss-parallel cross-entropy (no vocab all-gather): values and gradients equal
    an fp64 log-softmax over the whole vocabulary, at a temperature != 1, ignored labels 0."""
    import torch.multiprocessing as mp

    mp.spawn(_vocab_parallel_worker, args=(2, str(tmp_path / "init")), nprocs=2)
