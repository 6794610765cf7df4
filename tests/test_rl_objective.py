"""The settings verl and TRL users expect (titan_spec/rl/objective.py, rl/mismatch.py): dual-clip,
the loss aggregations, the KL estimators, truncated importance sampling and the clip fraction,
each against a reference written here from the formulas (fp64, loops over completions), with
hand-computed cases at the boundaries; and the config errors of their bad values."""

import math

import pytest
import torch

import titan_spec  # noqa: F401
from helpers.policy_loss import ppo_clip_loss, settings
from titan_spec.rl.mismatch import MismatchSums, tis_weights
from titan_spec.rl.objective import kl_estimate, policy_objective

F64 = torch.float64


def _logp(behaviour, ratio):
    return (behaviour + torch.tensor(ratio, dtype=F64).log()).requires_grad_()


# --- dual-clip -------------------------------------------------------------------------------


def test_dual_clip_caps_a_negative_advantages_loss_at_c_times_its_magnitude():
    """c = 3, band [0.8, 1.2]. Per token (ratio, A) -> loss, d loss / d logp, dual cap acts:
    the cap -A c binds only for A < 0 once -A r exceeds it (just above r = 3 it does, just
    below it does not); A > 0 and the ordinary clip are untouched."""
    eps = 1e-6
    cases = [
        (5.0, -1.0, 3.0, 0.0, True),  # -A r = 5 > 3: capped, no gradient
        (3.0 + eps, -1.0, 3.0, 0.0, True),
        (3.0 - eps, -1.0, 3.0 - eps, 3.0 - eps, False),  # below the cap: PPO's unclipped term, d = -A r
        (5.0, 1.0, -1.2, 0.0, False),  # A > 0: the ordinary clip at 1.2
        (0.5, -2.0, 1.6, 0.0, False),  # A < 0 below the band: clipped to 0.8 * 2 = 1.6 < cap 6
        (1.1, -0.5, 0.55, 0.55, False),  # inside the band
    ]
    ratio, adv, value, grad, dual = map(list, zip(*cases))
    b = -torch.linspace(0.2, 1.2, len(ratio), dtype=F64)
    logp = _logp(b, ratio)
    out = ppo_clip_loss(logp, b, torch.tensor(adv, dtype=F64), torch.ones(len(ratio)), len(ratio), dual_clip=3.0)
    assert out.loss.item() == pytest.approx(sum(value) / len(ratio), rel=1e-12)
    out.loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor(grad, dtype=F64) / len(ratio), rtol=1e-12, atol=1e-15)
    assert out.dual_clip_fraction.item() == pytest.approx(sum(dual) / len(ratio))
    off = ppo_clip_loss(logp.detach(), b, torch.tensor(adv, dtype=F64), torch.ones(len(ratio)), len(ratio))
    assert off.loss.item() == pytest.approx((5.0 + 3.0 + eps + 3.0 - eps - 1.2 + 1.6 + 0.55) / 6, rel=1e-12)
    assert off.dual_clip_fraction.item() == 0.0


# --- the clip fraction -----------------------------------------------------------------------


def test_clip_fraction_counts_where_the_clip_takes_effect_as_verl_and_trl_do():
    """verl's pg_clipfrac (the clipped term is the larger loss) and TRL's clip ratio (ratio
    below 1 - eps with A < 0, above 1 + eps with A > 0): tokens with A = 0 or with the ratio
    outside the band on the side the advantage does not push are not clipped."""
    ratio = [1.5, 1.5, 0.5, 0.5, 1.5, 0.5, 1.0]
    adv = [1.0, -1.0, 1.0, -1.0, 0.0, 0.0, 1.0]
    b = torch.zeros(len(ratio), dtype=F64)
    out = ppo_clip_loss(_logp(b, ratio).detach(), b, torch.tensor(adv, dtype=F64), torch.ones(7), 7)
    r, a = torch.tensor(ratio, dtype=F64), torch.tensor(adv, dtype=F64)
    trl = ((r < 0.8) & (a < 0)) | ((r > 1.2) & (a > 0))
    assert out.clip_fraction.item() == pytest.approx(float(trl.double().mean())) == pytest.approx(2 / 7)
    assert out.out_of_band.item() == pytest.approx(6 / 7)  # the old count: every ratio outside the band


# --- loss aggregation ------------------------------------------------------------------------

# Three completions of 1, 3 and 6 tokens (and a prompt token, a pad) on this rank; the
# minibatch holds S = 5 completions and N = 14 tokens over all data-parallel ranks.
LENGTHS, S_GLOBAL, N_GLOBAL, NORM = (1, 3, 6), 5, 14, 8


def _packed(seed=0):
    g = torch.Generator().manual_seed(seed)
    seq = [0] + [i + 1 for i, n in enumerate(LENGTHS) for _ in range(n)] + [0]
    T = len(seq)
    seq_T = torch.tensor(seq, dtype=F64)
    mask_T = seq_T > 0
    n_T = torch.tensor([0] + [n for n in LENGTHS for _ in range(n)] + [0], dtype=F64)
    adv_S = torch.tensor([0.0, 1.5, -0.7, 0.4], dtype=F64)
    b_T = -torch.rand(T, generator=g, dtype=F64) - 0.1
    logp_T = (b_T + 0.3 * torch.randn(T, generator=g, dtype=F64)).requires_grad_()
    values = {"behaviour_logp": b_T, "advantages": adv_S[seq_T.long()], "seq_index": seq_T, "seq_tokens": n_T}
    return logp_T, values, mask_T


def _reference(logp_T, values, mask_T, agg, sequence_ratio=False):
    """The aggregations as verl's agg_loss documents them, over completions one at a time."""
    seq = values["seq_index"].long()
    per_seq, all_tokens = [], []
    for i in range(1, len(LENGTHS) + 1):
        sel = (seq == i) & mask_T
        lp, b, a = logp_T[sel], values["behaviour_logp"][sel], values["advantages"][sel]
        if sequence_ratio:
            r = torch.exp((lp - b).mean().detach() + lp - lp.detach())
        else:
            r = torch.exp(lp - b)
        pg = torch.maximum(-a * r, -a * r.clamp(0.8, 1.2))
        per_seq.append(pg)
        all_tokens.append(pg)
    if agg == "token-mean":
        return torch.cat(all_tokens).sum() / N_GLOBAL
    if agg == "seq-mean-token-mean":
        return sum(pg.mean() for pg in per_seq) / S_GLOBAL
    if agg == "seq-mean-token-sum":
        return sum(pg.sum() for pg in per_seq) / S_GLOBAL
    return sum(pg.sum() for pg in per_seq) / (S_GLOBAL * NORM)


AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


@pytest.mark.parametrize("sequence_ratio", [False, True], ids=["token-ratio", "gspo"])
@pytest.mark.parametrize("agg", AGGS)
def test_each_aggregation_equals_its_formula_and_the_shards_add_up(agg, sequence_ratio):
    """Value and gradient of every rl.loss_agg on completions of different lengths against the
    reference; then the same tokens split into two shards (as CP ranks or PP microbatches see
    them, each with the whole minibatch's counts): the shards' losses and gradients sum to
    the whole. The modes really differ here (each pair of values is apart)."""
    rl = settings(
        loss="gspo" if sequence_ratio else "grpo",
        loss_agg=agg,
        loss_agg_norm=NORM if agg == "seq-mean-token-sum-norm" else 0,
    )
    counts = {"tokens": N_GLOBAL, "sequences": S_GLOBAL}
    logp, values, mask = _packed()
    out = policy_objective(logp, values, mask, counts, rl, sequence_ratio=sequence_ratio)
    out.loss.backward()
    got = logp.grad.clone()
    logp.grad = None
    ref = _reference(logp, values, mask, agg, sequence_ratio)
    ref.backward()
    assert out.loss.item() == pytest.approx(ref.item(), rel=1e-12)
    torch.testing.assert_close(got, logp.grad, rtol=1e-12, atol=1e-15)
    if not sequence_ratio:  # GSPO needs a completion whole on one rank (config validation)
        cut = 6  # inside the third completion
        parts = []
        for sl in (slice(0, cut), slice(cut, None)):
            lp = logp.detach()[sl].clone().requires_grad_()
            o = policy_objective(lp, {k: v[sl] for k, v in values.items()}, mask[sl], counts, rl)
            o.loss.backward()
            parts.append((o.loss.item(), lp.grad))
        assert parts[0][0] + parts[1][0] == pytest.approx(out.loss.item(), rel=1e-12)
        torch.testing.assert_close(torch.cat([parts[0][1], parts[1][1]]), got, rtol=1e-12, atol=1e-15)
    others = {a: _reference(logp.detach(), values, mask, a, sequence_ratio).item() for a in AGGS}
    assert len({round(v, 9) for v in others.values()}) == 4, others


def test_default_aggregation_is_token_mean_for_ppo_and_per_sequence_for_gspo():
    logp, values, mask = _packed(1)
    counts = {"tokens": N_GLOBAL, "sequences": S_GLOBAL}
    grpo = policy_objective(logp.detach(), values, mask, counts, settings())
    gspo = policy_objective(logp.detach(), values, mask, counts, settings(loss="gspo"), sequence_ratio=True)
    assert grpo.loss.item() == pytest.approx(_reference(logp.detach(), values, mask, "token-mean").item(), rel=1e-12)
    assert gspo.loss.item() == pytest.approx(
        _reference(logp.detach(), values, mask, "seq-mean-token-mean", True).item(), rel=1e-12
    )


def test_dr_grpos_constant_defaults_to_the_completion_budget():
    """seq-mean-token-sum-norm with rl.loss_agg_norm = 0 divides by rl.max_new_tokens (TRL's
    dr_grpo: num sequences x max_completion_length)."""
    logp, values, mask = _packed(2)
    counts = {"tokens": N_GLOBAL, "sequences": S_GLOBAL}
    out = policy_objective(
        logp.detach(), values, mask, counts, settings(loss_agg="seq-mean-token-sum-norm", max_new_tokens=NORM)
    )
    assert out.loss.item() == pytest.approx(
        _reference(logp.detach(), values, mask, "seq-mean-token-sum-norm").item(), rel=1e-12
    )


# --- KL estimators ---------------------------------------------------------------------------


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimators_value_and_gradient_by_closed_form(estimator):
    """d = logp - ref: k1 = d (d/dlogp 1), k2 = d^2 / 2 (d), k3 = exp(-d) + d - 1 (1 - exp(-d));
    the KL term is aggregated like the loss (token-mean over N here)."""
    logp = torch.tensor([-1.0, -2.0, -0.3], dtype=F64, requires_grad=True)
    ref = torch.tensor([-1.5, -1.0, -0.3], dtype=F64)
    d = (logp - ref).detach()
    value, grad = {
        "k1": (d, torch.ones(3, dtype=F64)),
        "k2": (d * d / 2, d),
        "k3": (torch.exp(-d) + d - 1, 1 - torch.exp(-d)),
    }[estimator]
    zero = torch.zeros(3, dtype=F64)
    out = policy_objective(
        logp,
        {"behaviour_logp": logp.detach(), "advantages": zero},
        torch.ones(3, dtype=torch.bool),
        {"tokens": 4, "sequences": 1},
        settings(kl_beta=0.5, kl_estimator=estimator),
        ref_logp_T=ref,
    )
    assert out.kl.item() == pytest.approx(float(value.mean()), rel=1e-12)
    assert out.loss.item() == pytest.approx(0.5 * float(value.sum()) / 4, rel=1e-12)
    out.loss.backward()
    torch.testing.assert_close(logp.grad, 0.5 * grad / 4, rtol=1e-12, atol=1e-15)


def test_k3_is_clamped_as_verls_low_var_kl():
    """A token 30 nats below the reference: k3 would be exp(30); verl clamps it to 10."""
    got = kl_estimate(torch.tensor([-31.0, -1.0], dtype=F64), torch.tensor([-1.0, -1.0], dtype=F64), "k3")
    assert got.tolist() == [10.0, 0.0]


# --- truncated importance sampling -----------------------------------------------------------


def test_tis_weights_per_token_and_per_sequence_by_hand_at_the_cap():
    """Two completions [a a | b b b] (and a prompt token): token weights min(pi / pi_engine, C)
    with C = 2, sequence weights min(prod, C) on every token of the completion."""
    log_r = [0.0, math.log(1.5), math.log(2.5), math.log(0.5), math.log(1.9), math.log(1.05)]
    engine = torch.tensor([-1.0, -0.5, -0.7, -1.2, -0.9, -0.3], dtype=F64)
    trainer = engine + torch.tensor(log_r, dtype=F64)
    seq = torch.tensor([0.0, 1, 1, 2, 2, 2])
    targets = seq > 0
    tok = tis_weights(trainer, engine, seq, targets, "token", 2.0)
    torch.testing.assert_close(tok, torch.tensor([0.0, 1.5, 2.0, 0.5, 1.9, 1.05], dtype=F64), rtol=1e-12, atol=0)
    sq = tis_weights(trainer, engine, seq, targets, "sequence", 2.0)
    b = 0.5 * 1.9 * 1.05  # 0.9975, under the cap; a's 1.5 * 2.5 = 3.75 is capped
    torch.testing.assert_close(sq, torch.tensor([0.0, 2.0, 2.0, b, b, b], dtype=F64), rtol=1e-12, atol=0)
    far = tis_weights(engine + 500.0, engine, seq, targets, "sequence", 2.0)
    assert torch.isfinite(far).all() and far[1:].tolist() == pytest.approx([2.0] * 5)


def test_tis_weights_the_policy_gradient_term_and_not_the_kl():
    """loss_t = w_t * pg_t + beta * kl_t: the weight scales the PPO term's value and gradient."""
    b = torch.tensor([-1.0, -0.5], dtype=F64)
    logp = _logp(b, [1.1, 0.9])
    ref = torch.tensor([-1.2, -0.1], dtype=F64)
    adv = torch.tensor([1.0, -1.0], dtype=F64)
    w = torch.tensor([0.5, 2.0], dtype=F64)
    rl = settings(kl_beta=0.3)
    base = {"behaviour_logp": b, "advantages": adv}
    mask, counts = torch.ones(2, dtype=torch.bool), {"tokens": 2, "sequences": 1}
    got = policy_objective(logp, {**base, "tis_weight": w}, mask, counts, rl, ref_logp_T=ref)
    r = torch.tensor([1.1, 0.9], dtype=F64)
    d = logp.detach() - ref
    k3 = torch.exp(-d) + d - 1
    assert got.loss.item() == pytest.approx(float((w * (-adv * r) + 0.3 * k3).sum() / 2), rel=1e-12)
    got.loss.backward()
    torch.testing.assert_close(logp.grad, (w * (-adv * r) + 0.3 * (1 - torch.exp(-d))) / 2, rtol=1e-12, atol=1e-15)


def test_mismatch_sums_by_hand():
    """|logp_trainer - logp_engine| summed, maxed, and the tokens whose ratio leaves the clip
    band [0.8, 1.2] (log 0.8 = -0.223, log 1.2 = 0.182); masked tokens count nowhere."""
    engine = torch.tensor([-1.0, -1.0, -1.0, -1.0, -1.0], dtype=F64)
    trainer = engine + torch.tensor([0.01, -0.3, 0.19, -0.2, 5.0], dtype=F64)
    got = MismatchSums.of(trainer, engine, torch.tensor([1, 1, 1, 1, 0]), settings())
    assert got.tokens == 4 and got.out_of_band == 2
    assert got.diff_sum == pytest.approx(0.7, rel=1e-12) and got.diff_max == pytest.approx(0.3, rel=1e-12)
