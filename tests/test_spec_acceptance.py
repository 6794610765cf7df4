"""The sampled speculative acceptance rule and the sampling filters, without a model.

Shape legend: N = rows (independent requests), K = draft tokens, L = K + 1 verified
positions, V = target vocab, Vd = draft vocab.

test_acceptance_rule_emits_the_target_distribution_at_every_position calls the engine's
acceptance rule (torch_engine.speculative_accept, what BuiltinRolloutEngine._accept runs) ONCE
on a large batch of rows with fixed target distributions p_1..p_{K+1} and draft
distributions q_1..q_K, and checks it against what speculative sampling must produce
(Leviathan et al. 2023, Thm. 1; Chen et al. 2023), written from p and q directly:

  * the token emitted at position j (0-based; emitted iff a >= j) follows p_{j+1}, also
    conditionally on the token before it (p does not depend on the prefix here, so the
    tokens at different positions are independent); position K is the bonus token, drawn
    only when all K drafts were accepted, and follows p_{K+1};
  * the accepted count: P(draft i accepted | 1..i-1 accepted) = beta_i = sum_x min(p_i, q_i),
    so P(a = j) = beta_1 .. beta_j (1 - beta_{j+1}) and P(a = K) = beta_1 .. beta_K;
  * accepted positions carry the proposed draft tokens unchanged.

The test_filtered_probs_* cases check temperature, top-k and top-p against probabilities
computed by hand. Convention (the engine's, and HF transformers' TopK/TopPLogitsWarper):
temperature first; top-k keeps every token whose logit is >= the k-th largest (ties at the
k-th value all stay); top-p then works on the renormalized top-k distribution and keeps the
smallest prefix of the sorted tokens whose mass is >= top_p: a token is dropped when the mass
strictly before it already reaches top_p (HF: cumulative mass from the bottom <= 1 - top_p).
SGLang 0.5.23's torch-native sampler (layers/sampler.py,
top_k_top_p_min_p_sampling_from_probs_torch) differs on measure-zero boundaries (it keeps
exactly k sorted positions, ties broken by the sort, and drops a token only when the mass
before it is strictly > top_p) and, when top-k and top-p are both set, in substance: it
measures top-p on the probabilities before top-k, not on the renormalized ones (see
test_filtered_probs_top_k_then_top_p_on_the_renormalized_mass for a case where they differ).
"""

import math

import torch

import titan_spec  # noqa: F401
from titan_spec.rollout.base import SamplingParams
from titan_spec.rollout.builtin.sampling import filtered_probs, sample_rows, speculative_accept

from helpers.chi2 import chi2_pvalue

# --- the acceptance rule ------------------------------------------------------------------

# Target vocab 6, draft vocab 4 mapping to target ids 0, 1, 3, 4 (targets 2 and 5 are not
# draftable, so every residual must reach them). p_2 gives draftable token 4 zero mass (a
# proposal there is always rejected). p_4 (the bonus) differs from p_3 everywhere, so a
# bonus drawn from the wrong row is visible.
P_LV = torch.tensor(
    [
        [0.30, 0.10, 0.25, 0.05, 0.20, 0.10],
        [0.05, 0.40, 0.10, 0.25, 0.00, 0.20],
        [0.20, 0.20, 0.05, 0.30, 0.15, 0.10],
        [0.10, 0.05, 0.35, 0.10, 0.10, 0.30],
    ],
    dtype=torch.float64,
)
Q_KVd = torch.tensor(
    [
        [0.40, 0.20, 0.10, 0.30],
        [0.10, 0.50, 0.25, 0.15],
        [0.25, 0.25, 0.35, 0.15],
    ],
    dtype=torch.float64,
)
D2T_Vd = torch.tensor([0, 1, 3, 4])
# beta_i = sum_x min(p_i(x), q_i(x)) by hand (q is 0 on targets 2 and 5):
#   beta_1 = .30 + .10 + .05 + .20 = .65;  beta_2 = .05 + .40 + .25 + 0 = .70
#   beta_3 = .20 + .20 + .30 + .15 = .85
BETA_K = (0.65, 0.70, 0.85)


def pearson(obs_V: torch.Tensor, p_V: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic and degrees of freedom of counts against probabilities; a count
    in a zero-probability bin is an outright failure (inf). All expected counts here are
    large (>= ~100), so no pooling is needed."""
    n = float(obs_V.sum())
    zero = p_V == 0
    if (obs_V[zero] > 0).any():
        return math.inf, 1
    o, e = obs_V[~zero].double(), p_V[~zero].double() * n
    return float(((o - e) ** 2 / e).sum()), int((~zero).sum()) - 1


def _run_acceptance(N: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    K, Vd = Q_KVd.shape
    # Drafts sampled from q (independently per position: q is fixed, not prefix-dependent).
    d_idx_NK = torch.stack([torch.multinomial(Q_KVd[k].float(), N, replacement=True, generator=g) for k in range(K)], 1)
    d_NK = D2T_Vd[d_idx_NK]
    p_NLV = P_LV.float().expand(N, -1, -1).contiguous()
    q_NKVd = Q_KVd.float().expand(N, -1, -1).contiguous()
    a_N, new_NL = speculative_accept(p_NLV, d_NK, d_idx_NK, q_NKVd, D2T_Vd, g)
    return d_NK, a_N, new_NL


def test_acceptance_rule_emits_the_target_distribution_at_every_position():
    N, K, V = 200_000, Q_KVd.shape[0], P_LV.shape[1]
    d_NK, a_N, new_NL = _run_acceptance(N, seed=0)
    assert a_N.shape == (N,) and new_NL.shape == (N, K + 1)
    assert int(a_N.min()) >= 0 and int(a_N.max()) <= K

    # Accepted positions carry the draft's proposals unchanged.
    for j in range(K):
        kept = a_N > j
        assert torch.equal(new_NL[kept, j], d_NK[kept, j]), j

    # Accepted counts against the closed form.
    b = BETA_K
    p_a = torch.tensor([1 - b[0], b[0] * (1 - b[1]), b[0] * b[1] * (1 - b[2]), b[0] * b[1] * b[2]], dtype=torch.float64)
    stat, df = pearson(torch.bincount(a_N, minlength=K + 1), p_a)
    assert chi2_pvalue(stat, df) > 1e-4, f"accepted counts: chi2 = {stat:.1f} on {df} df"

    # Every emitted position, the bonus (j = K) included: marginally ~ p_{j+1} ...
    for j in range(K + 1):
        emitted = a_N >= j
        n_j = int(emitted.sum())
        assert n_j > 50_000, (j, n_j)  # every position, the bonus too, is tested with power
        obs_V = torch.bincount(new_NL[emitted, j], minlength=V)
        stat, df = pearson(obs_V, P_LV[j])
        assert chi2_pvalue(stat, df) > 1e-4, f"position {j}: chi2 = {stat:.1f} on {df} df, counts {obs_V.tolist()}"
        # ... and conditionally on the token emitted before it.
        if j:
            for prev in new_NL[emitted, j - 1].unique().tolist():
                sel = emitted & (new_NL[:, j - 1] == prev)
                stat, df = pearson(torch.bincount(new_NL[sel, j], minlength=V), P_LV[j])
                assert chi2_pvalue(stat, df) > 1e-4, f"position {j} after token {prev}: chi2 = {stat:.1f} on {df} df"

    # Power: the bonus tokens are told apart from the previous position's distribution (the
    # bug "bonus drawn from p_K") by a wide margin.
    bonus_V = torch.bincount(new_NL[a_N == K, K], minlength=V)
    assert chi2_pvalue(*pearson(bonus_V, P_LV[K - 1])) < 1e-12


def test_acceptance_rule_all_accepted_when_the_draft_is_the_target():
    # q_i == p_i on a draft vocab that covers the target: every proposal is accepted (u * q < p
    # holds for u < 1 whenever q == p > 0), so every row ends with a bonus token ~ p_{K+1}.
    N, K = 40_000, 2
    g = torch.Generator().manual_seed(1)
    p_LV = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.2, 0.2, 0.6]])
    d_NK = torch.stack([torch.multinomial(p_LV[k], N, replacement=True, generator=g) for k in range(K)], 1)
    a_N, new_NL = speculative_accept(p_LV.expand(N, -1, -1), d_NK, d_NK, p_LV[:K].expand(N, -1, -1), torch.arange(3), g)
    assert bool((a_N == K).all())
    assert torch.equal(new_NL[:, :K], d_NK)
    stat, df = pearson(torch.bincount(new_NL[:, K], minlength=3), p_LV[K].double())
    assert chi2_pvalue(stat, df) > 1e-4, f"bonus: chi2 = {stat:.1f} on {df} df"


# --- sample_rows: the engine's one sampler ---------------------------------------------------


def test_sample_rows_follows_each_rows_unnormalized_weights():
    # Every draw of the engine (prefill, plain steps, draft proposals, residuals, bonus tokens)
    # goes through sample_rows. Rows are NOT normalized (a residual max(0, p - q) is not) and
    # have zeros at the ends and inside, where the inverse CDF's boundaries lie (a zero entry
    # spans an empty interval); one row has a single nonzero entry, the last.
    w_RV = torch.tensor(
        [
            [0.0, 2.0, 0.0, 1.0, 1.0, 0.0],
            [3e-1, 1e-3, 0.0, 0.0, 0.2, 0.5],
            [0.0, 0.0, 0.0, 0.0, 0.0, 7.0],
            [0.1, 0.1, 0.1, 0.1, 0.1, 0.1],
        ]
    )
    R, V, n = w_RV.shape[0], w_RV.shape[1], 100_000
    g = torch.Generator().manual_seed(3)
    x_NR = sample_rows(w_RV.repeat(n, 1), g).view(n, R)
    for r in range(R):
        obs_V = torch.bincount(x_NR[:, r], minlength=V)
        assert obs_V.shape == (V,)
        assert int(obs_V[w_RV[r] == 0].sum()) == 0, f"row {r} drew a zero-weight entry: {obs_V.tolist()}"
        stat, df = pearson(obs_V, (w_RV[r] / w_RV[r].sum()).double())
        assert df == 0 or chi2_pvalue(stat, df) > 1e-4, (
            f"row {r}: chi2 = {stat:.1f} on {df} df, counts {obs_V.tolist()}"
        )
    # Power: a sampler that ignored the weights (uniform over the nonzero entries) fails row 0.
    assert (
        chi2_pvalue(*pearson(torch.bincount(x_NR[:, 0], minlength=V), torch.tensor([0, 1, 0, 1, 1, 0]) / 3.0)) < 1e-12
    )
    # Deterministic in the generator's state, one uniform per row.
    a = sample_rows(w_RV, torch.Generator().manual_seed(9))
    b = sample_rows(w_RV, torch.Generator().manual_seed(9))
    assert torch.equal(a, b)


# --- filtered_probs by hand ---------------------------------------------------------------


def _sp(temperature=1.0, top_k=0, top_p=1.0) -> SamplingParams:
    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)


def _close(got, want):
    torch.testing.assert_close(got.double(), torch.tensor(want, dtype=torch.float64), rtol=1e-6, atol=1e-7)


def test_filtered_probs_temperature_and_greedy():
    # logits (0, ln 2, ln 4) at T = 2 -> exp(logits / 2) = (1, sqrt 2, 2).
    logits = torch.tensor([[0.0, math.log(2), math.log(4)]])
    s = 3 + math.sqrt(2)
    _close(filtered_probs(logits, _sp(2.0)), [[1 / s, math.sqrt(2) / s, 2 / s]])
    # T = 0.5 -> (1, 4, 16).
    _close(filtered_probs(logits, _sp(0.5)), [[1 / 21, 4 / 21, 16 / 21]])
    # T = 0 (greedy): one-hot at the argmax.
    _close(filtered_probs(torch.tensor([[0.3, 2.0, -1.0]]), _sp(0.0)), [[0.0, 1.0, 0.0]])


def test_filtered_probs_top_k():
    e = math.e
    # top_k = 1: the argmax alone.
    _close(filtered_probs(torch.tensor([[1.0, 3.0, 2.0, 0.0]]), _sp(top_k=1)), [[0.0, 1.0, 0.0, 0.0]])
    # top_k = 2 without ties: logits (3, 2, 1, 0) keep 3 and 2.
    _close(filtered_probs(torch.tensor([[3.0, 2.0, 1.0, 0.0]]), _sp(top_k=2)), [[e / (e + 1), 1 / (e + 1), 0.0, 0.0]])
    # Ties at the k-th value all stay: logits (3, 1, 1, 0), top_k = 2 -> keep 3, 1, 1.
    s = e**3 + 2 * e
    _close(filtered_probs(torch.tensor([[3.0, 1.0, 1.0, 0.0]]), _sp(top_k=2)), [[e**3 / s, e / s, e / s, 0.0]])
    # top_k = vocab (and above it): nothing is filtered, the plain softmax.
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    s = 1 + e + e * e
    for k in (3, 5):
        _close(filtered_probs(logits, _sp(top_k=k)), [[1 / s, e / s, e * e / s]])
    # Temperature before top-k: T = 2 on (0, 2 ln 2, 4 ln 2), top_k = 2 -> (2, 4) renormalized.
    _close(
        filtered_probs(torch.tensor([[0.0, 2 * math.log(2), 4 * math.log(2)]]), _sp(2.0, top_k=2)),
        [[0.0, 1 / 3, 2 / 3]],
    )


def test_filtered_probs_top_p_boundary():
    # Exactly at the boundary, in exact float arithmetic: four equal logits give 1/4 each, and
    # top_p = 1/2 is reached by two tokens, so exactly two stay (which two depends on the sort
    # of the tie; compare sorted). A "mass before > top_p" rule would keep three, an
    # inclusive-cumsum rule one.
    got = filtered_probs(torch.zeros(1, 4), _sp(top_p=0.5))
    _close(got.sort(-1, descending=True).values, [[0.5, 0.5, 0.0, 0.0]])
    got = filtered_probs(torch.zeros(1, 4), _sp(top_p=0.75))
    _close(got.sort(-1, descending=True).values, [[1 / 3, 1 / 3, 1 / 3, 0.0]])
    # Just below / just over a cumulative mass: probabilities (0.5, 0.3, 0.2) (logits = their logs).
    logits = torch.tensor([[math.log(0.3), math.log(0.5), math.log(0.2)]])
    _close(filtered_probs(logits, _sp(top_p=0.499)), [[0.0, 1.0, 0.0]])
    _close(filtered_probs(logits, _sp(top_p=0.501)), [[0.375, 0.625, 0.0]])
    _close(filtered_probs(logits, _sp(top_p=0.799)), [[0.375, 0.625, 0.0]])
    _close(filtered_probs(logits, _sp(top_p=0.801)), [[0.3, 0.5, 0.2]])
    _close(filtered_probs(logits, _sp(top_p=1.0)), [[0.3, 0.5, 0.2]])
    # A tiny top_p keeps the top token alone.
    _close(filtered_probs(logits, _sp(top_p=1e-6)), [[0.0, 1.0, 0.0]])


def test_filtered_probs_top_k_then_top_p_on_the_renormalized_mass():
    # Probabilities (0.4, 0.3, 0.2, 0.1); top_k = 2 leaves (4/7, 3/7). top_p = 0.5 is then
    # reached by the first token alone (4/7 >= 0.5); on the mass before top-k (0.4 < 0.5, as
    # SGLang's torch sampler measures it) both would stay.
    logits = torch.tensor([[math.log(0.4), math.log(0.3), math.log(0.2), math.log(0.1)]])
    _close(filtered_probs(logits, _sp(top_k=2, top_p=0.5)), [[1.0, 0.0, 0.0, 0.0]])
    _close(filtered_probs(logits, _sp(top_k=2, top_p=0.6)), [[4 / 7, 3 / 7, 0.0, 0.0]])
    # Rows are independent: a batch gives each row its own filter.
    both = filtered_probs(torch.cat([logits, logits.flip(-1)]), _sp(top_k=3, top_p=0.7))
    # top_k = 3 -> (4/9, 3/9, 2/9); mass before the third is 7/9 >= 0.7 -> drop it.
    _close(both, [[4 / 7, 3 / 7, 0.0, 0.0], [0.0, 0.0, 3 / 7, 4 / 7]])
