"""The built-in rollout engine: lossless speculative decoding (greedy token for token, sampled
by chi-square), behaviour log-probs, spec statistics, weight pushes, bad inputs.

Models are tiny and random (vocab 32 so that sampled distributions can be tested with
few samples); a "good" draft is fitted to the target in a few dozen TTT steps.
"""

import dataclasses
import json
import math

import pytest
import torch

import titan_spec  # noqa: F401
from titan_spec.models.attention import doc_metadata_from_positions
from titan_spec.models.draft.eagle3.model import DraftArch, Eagle3Draft
from titan_spec.models.draft.eagle3.io import EXPORT_KEYS
from titan_spec.models.registry import build_target_config, flavor_arch, with_vocab
from titan_spec.models.draft.eagle3.ttt import ttt_inputs_for_sequences
from titan_spec.rollout import RolloutEngine, SamplingParams, BuiltinEngineConfig, BuiltinRolloutEngine

from helpers.chi2 import chi2_groups, chi2_pvalue

V = 32
TAPS = (1, 3, 4)
MAX_LEN = 256


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # Tiny matmuls: a second thread only adds sync cost, and much more when the machine is busy.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def make_target(seed: int, family: str = "qwen3"):
    torch.manual_seed(seed)
    arch = with_vocab(flavor_arch(family, "tiny"), V)
    model = build_target_config(arch, tap_layer_ids=TAPS, max_seq_len=MAX_LEN).build()
    model.init_weights(buffer_device=None)
    # torchtitan's init makes near-uniform, degenerate outputs; unit-variance projections give
    # peaked, varied distributions, which make both the greedy and the sampled tests sharper.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]))
    return model.eval(), arch


def make_draft(arch, seed: int, draft_vocab: int = V) -> Eagle3Draft:
    torch.manual_seed(seed)
    d = Eagle3Draft(DraftArch.from_target(arch, TAPS, draft_vocab))
    d.reset_parameters()
    return d.eval()


def random_prompts(n: int, seed: int, lo: int = 1, hi: int = 9) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(0, V, (k,), generator=g).tolist() for k in lens]


def fit_draft(model, arch, steps: int = 40, seed: int = 0) -> Eagle3Draft:
    """A draft fitted to the target by TTT on the target's own completions (greedy ones,
    which the greedy tests follow, and a few sampled ones), in a few seconds."""
    plain = BuiltinRolloutEngine(model, None, BuiltinEngineConfig(num_draft_tokens=0))
    prompts = random_prompts(32, seed + 100)
    seqs = [r.prompt_ids + r.output_ids for r in plain.generate(prompts, SamplingParams(0.0, max_new_tokens=40))]
    sampled = plain.generate(prompts[:8], SamplingParams(1.0, max_new_tokens=40, seed=seed))
    seqs += [r.prompt_ids + r.output_ids for r in sampled]
    draft = make_draft(arch, seed)
    draft.train()
    inputs = ttt_inputs_for_sequences(model, draft, seqs, 3)
    opt = torch.optim.AdamW(draft.parameters(), lr=2e-2)
    for _ in range(steps):
        loss = draft(*inputs).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return draft.eval()


@pytest.fixture(scope="module")
def pair():
    model, arch = make_target(0)
    return model, arch, fit_draft(model, arch)


def full_logits(model, seq: list[int]) -> torch.Tensor:
    tok = torch.tensor([seq])
    pos = torch.arange(len(seq))[None]
    with torch.no_grad():
        return model(tok, pos, model.get_attention_masks(pos))[0][0]


def naive_greedy(model, prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(full_logits(model, seq)[-1].argmax()))
    return seq[len(prompt) :]


def check_stats(rollouts, K):
    for r in rollouts:
        assert r.verify_steps >= 1 and 0 <= r.accepted_tokens <= K * r.verify_steps
        assert r.verify_steps + r.accepted_tokens == len(r.output_ids)
        assert r.acceptance_length == pytest.approx(len(r.output_ids) / r.verify_steps)
        assert len(r.logprobs) == len(r.output_ids)


# --- the cached forwards mirror the training forwards ---------------------------------------


def test_cached_target_and_draft_mirror_the_training_forward_and_ttt():
    """KV-cached target (prefill + a decode step) against the training forward, and the
    cached draft chain (teacher-forced) against the TTT unroll of models/draft/eagle3/ttt.py, row by row."""
    from titan_spec.models.draft.eagle3.proposer import CachedDraft
    from titan_spec.rollout.builtin.cached_target import CachedTarget

    model, arch = make_target(3)
    draft = make_draft(arch, 4)
    with torch.no_grad():
        for p in draft.parameters():  # larger draft weights: sharper, more discriminating logits
            if p.dim() == 2:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]))
    n = 24
    x = torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(n)
    meta = doc_metadata_from_positions(pos[None])
    with torch.inference_mode():
        logits, taps = model(x[None], pos[None], meta)
        ct = CachedTarget(model, TAPS)
        ct.new_cache(1, n + 4)
        lg_a, tp_a = ct.forward(x[None, :15], torch.tensor([0]))
        lg_b, tp_b = ct.forward(x[None, 15:], torch.tensor([15]))  # a 9-token "verify" over the cache
    torch.testing.assert_close(torch.cat([lg_a, lg_b], 1), logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.cat([tp_a, tp_b], 1), torch.stack(taps.hidden, 2), atol=1e-5, rtol=0)

    steps, rows = 4, (9, 17)
    hidden = tuple(h[0] for h in taps.hidden)
    emb = model.tok_embeddings(x)
    for t0 in rows:
        c = 5  # score draft-vocab id c at every step
        tgt_p = torch.zeros(n, V)
        tgt_p[:, c] = 1.0
        targets = []
        for j in range(steps):
            src = (torch.arange(n) + 1 + j).clamp(max=n - 1)
            targets.append((src, torch.arange(n) == t0, tgt_p))
        with torch.no_grad():
            ttt = draft(hidden, emb.detach(), pos, meta, targets)
        cd = CachedDraft(draft, model.tok_embeddings)
        cd.new_cache(1, n + steps)
        with torch.inference_mode():
            # Trunk rows 0..t0 (taps at t, embedding of x[t+1]), then the chain on x[t0+2], ...
            h, lg = cd.extend(
                torch.stack(taps.hidden, 2)[:, : t0 + 1], x[None, 1 : t0 + 2], torch.tensor([0]), torch.tensor([t0 + 1])
            )
            got = [torch.log_softmax(lg[0], -1)[c]]
            for j in range(1, steps):
                h, lg = cd.step(h, x[t0 + 1 + j][None], torch.tensor([t0 + j]))
                got.append(torch.log_softmax(lg[0], -1)[c])
        torch.testing.assert_close(torch.stack(got), -ttt.loss_sum_S, atol=1e-5, rtol=0)


# --- greedy: token for token ------------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_plain_greedy_equals_naive_full_forwards(family):
    model, _ = make_target(1, family)
    engine = BuiltinRolloutEngine(model, None, BuiltinEngineConfig(num_draft_tokens=0))
    prompts = random_prompts(4, seed=2)
    out = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=24))
    for p, r in zip(prompts, out):
        assert r.output_ids == naive_greedy(model, p, 24)
        assert r.finish_reason == "length" and r.verify_steps == 24 and r.accepted_tokens == 0


def _with_stops(plain_out):
    # Stop tokens that occur mid-way in some rows, so rows end at different steps.
    stops = {plain_out[0].output_ids[5], plain_out[2].output_ids[11]}
    return tuple(sorted(stops))


@pytest.mark.parametrize("K", [1, 4])
@pytest.mark.parametrize("which", ["random", "fitted"])
def test_greedy_speculative_equals_plain(pair, which, K):
    model, arch, fitted = pair
    draft = fitted if which == "fitted" else make_draft(arch, 7, draft_vocab=20)
    plain = BuiltinRolloutEngine(model, None, BuiltinEngineConfig(num_draft_tokens=0))
    spec = BuiltinRolloutEngine(model, draft, BuiltinEngineConfig(num_draft_tokens=K))
    total_tokens = total_steps = 0
    for seed in (3, 4, 5):
        prompts = random_prompts(6, seed)
        sp = SamplingParams(temperature=0.0, max_new_tokens=30)
        ref = plain.generate(prompts, sp)
        stops = _with_stops(ref)
        sp_stop = SamplingParams(temperature=0.0, max_new_tokens=30, stop_token_ids=stops)
        ref_stop = plain.generate(prompts, sp_stop)
        for full, cut in zip(ref, ref_stop):
            first = next((i for i, t in enumerate(full.output_ids) if t in stops), None)
            want = full.output_ids if first is None else full.output_ids[: first + 1]
            assert cut.output_ids == want
            assert cut.finish_reason == ("length" if first is None else "stop")
        assert any(r.finish_reason == "stop" for r in ref_stop)
        for sp_, want_out in ((sp, ref), (sp_stop, ref_stop)):
            got = spec.generate(prompts, sp_)
            check_stats(got, K)
            for g, w in zip(got, want_out):
                assert g.output_ids == w.output_ids
                assert g.finish_reason == w.finish_reason
                torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-5, rtol=0)
                total_tokens += len(g.output_ids)
                total_steps += g.verify_steps
    if which == "fitted" and K == 4:
        # The trained pair really speculates (so the equality above is not vacuous).
        assert total_tokens / total_steps > 1.6


def test_batching_and_chunking_do_not_change_greedy_output(pair):
    model, _, draft = pair
    prompts = random_prompts(5, seed=9)
    sp = SamplingParams(temperature=0.0, max_new_tokens=20)
    whole = BuiltinRolloutEngine(model, draft, BuiltinEngineConfig(num_draft_tokens=3)).generate(prompts, sp)
    chunked = BuiltinRolloutEngine(model, draft, BuiltinEngineConfig(num_draft_tokens=3, max_batch_size=2)).generate(
        prompts, sp
    )
    single = [
        BuiltinRolloutEngine(model, draft, BuiltinEngineConfig(num_draft_tokens=3)).generate([p], sp)[0]
        for p in prompts
    ]
    for a, b, c in zip(whole, chunked, single):
        assert a.output_ids == b.output_ids == c.output_ids


# --- sampled: the policy's distribution, whatever the draft -------------------------------


def policy_probs(model, contexts: list[list[int]], sp: SamplingParams) -> torch.Tensor:
    from titan_spec.rollout.builtin.sampling import filtered_probs

    return torch.stack([filtered_probs(full_logits(model, c)[-1], sp) for c in contexts])


def sampled_tokens_distribution_check(model, draft, K, sp, n=6000, prompt=(3, 17, 5), depth="fixed", costs=None):
    """Tokens 1..3 of n completions of one prompt against the policy's distributions.
    ``sp.max_new_tokens`` may exceed 3 (adaptive depth then has a budget to choose K for)."""
    engine = BuiltinRolloutEngine(model, draft, BuiltinEngineConfig(num_draft_tokens=K, depth=depth), costs=costs)
    out = engine.generate([list(prompt)] * n, sp)
    toks = torch.tensor([r.output_ids[:3] for r in out])  # [n, 3]
    prompt = list(prompt)
    results = {}
    # token 1 (from the prefill), token 2 | token 1, token 3 | tokens 1-2 (the speculative ones)
    p1 = policy_probs(model, [prompt], sp)[0]
    results[1] = chi2_groups([(torch.bincount(toks[:, 0], minlength=V), p1)])
    firsts = toks[:, 0].unique().tolist()
    p2 = policy_probs(model, [prompt + [f] for f in firsts], sp)
    results[2] = chi2_groups(
        [(torch.bincount(toks[toks[:, 0] == f, 1], minlength=V), p2[i]) for i, f in enumerate(firsts)]
    )
    pairs, counts = toks[:, :2].unique(dim=0, return_counts=True)
    common = [pr.tolist() for pr, c in zip(pairs, counts) if c >= 50]
    p3 = policy_probs(model, [prompt + pr for pr in common], sp)
    sel = [((toks[:, 0] == a) & (toks[:, 1] == b)) for a, b in common]
    results[3] = chi2_groups([(torch.bincount(toks[m, 2], minlength=V), p3[i]) for i, m in enumerate(sel)])
    # Power: the same samples against a somewhat different temperature must be rejected.
    hot = SamplingParams(sp.temperature * 1.5, top_k=sp.top_k, top_p=sp.top_p, max_new_tokens=3)
    p2_hot = policy_probs(model, [prompt + [f] for f in firsts], hot)
    results["power"] = chi2_groups(
        [(torch.bincount(toks[toks[:, 0] == f, 1], minlength=V), p2_hot[i]) for i, f in enumerate(firsts)]
    )
    accepted = sum(r.accepted_tokens for r in out)
    if depth != "fixed":
        return results, accepted / n, engine.last_depths
    return results, accepted / n


def assert_follows_the_policy(res) -> None:
    """sampled_tokens_distribution_check's chi-squares: tokens 1-3 follow the policy (p > 1e-3 on
    >= 5 degrees of freedom each) and the test has the power to tell T from 1.5 T."""
    for k in (1, 2, 3):
        stat, df = res[k]
        assert df >= 5, (k, df)
        assert chi2_pvalue(stat, df) > 1e-3, f"token {k}: chi2 = {stat:.1f} on {df} df"
    stat, df = res["power"]
    assert chi2_pvalue(stat, df) < 1e-6, "the test cannot tell T from 1.5 T: no power"


def _bad_draft(model, arch):
    """A draft that always proposes one token the policy rarely picks (draft vocab of one)."""
    d = make_draft(arch, 11, draft_vocab=1)
    with torch.no_grad():
        least = int(full_logits(model, [3, 17, 5])[-1].argmin())
        d.d2t.fill_(least)
        d.t2d.zero_()
        d.t2d[least] = True
    return d


@pytest.mark.parametrize(
    "which,K,sp",
    [
        ("fitted", 3, SamplingParams(1.0, max_new_tokens=3, seed=0)),
        ("bad", 2, SamplingParams(1.0, max_new_tokens=3, seed=1)),
        ("random", 2, SamplingParams(0.8, top_k=10, top_p=0.9, max_new_tokens=3, seed=2)),
    ],
)
def test_sampled_tokens_follow_the_policy(pair, which, K, sp):
    model, arch, fitted = pair
    draft = {"fitted": fitted, "bad": _bad_draft(model, arch), "random": make_draft(arch, 5, draft_vocab=24)}[which]
    res, accepted_per_row = sampled_tokens_distribution_check(model, draft, K, sp)
    assert_follows_the_policy(res)
    if which == "fitted":
        assert accepted_per_row > 0.5  # both acceptance and rejection paths are exercised
    if which == "bad":
        assert accepted_per_row < 0.3


# --- log-probs and statistics ------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_behaviour_logprobs_equal_a_full_forward(pair, temperature):
    model, _, draft = pair
    engine = BuiltinRolloutEngine(model, draft, BuiltinEngineConfig(num_draft_tokens=3))
    prompts = random_prompts(4, seed=21)
    out = engine.generate(prompts, SamplingParams(temperature, top_k=12, max_new_tokens=25, seed=3))
    check_stats(out, 3)
    t = temperature or 1.0  # greedy reports T = 1 log-probs
    for r in out:
        logits = full_logits(model, r.prompt_ids + r.output_ids)
        want = torch.log_softmax(logits / t, -1)[len(r.prompt_ids) - 1 : -1].gather(
            -1, torch.tensor(r.output_ids)[:, None]
        )[:, 0]
        torch.testing.assert_close(torch.tensor(r.logprobs), want, atol=1e-5, rtol=0)


def test_engine_stats_edges_and_protocol(pair):
    model, _, draft = pair
    engine = BuiltinRolloutEngine(model, None, BuiltinEngineConfig(num_draft_tokens=0))
    assert isinstance(engine, RolloutEngine)
    out = engine.generate(random_prompts(3, seed=1), SamplingParams(1.0, max_new_tokens=7, seed=0))
    for r in out:
        assert r.verify_steps == 7 and r.accepted_tokens == 0 and r.acceptance_length == 1.0
    assert engine.generate([], SamplingParams()) == []
    # One new token (the prefill's), and a bar that reports progress.
    spec = BuiltinRolloutEngine(model, draft, BuiltinEngineConfig(num_draft_tokens=3, progress=True))
    for n in (1, 2):
        out = spec.generate(random_prompts(3, seed=2), SamplingParams(0.0, max_new_tokens=n))
        assert [len(r.output_ids) for r in out] == [n] * 3
        check_stats(out, 3)
    # Same seed, same samples.
    a = spec.generate(random_prompts(3, seed=2), SamplingParams(1.0, max_new_tokens=9, seed=5))
    b = spec.generate(random_prompts(3, seed=2), SamplingParams(1.0, max_new_tokens=9, seed=5))
    assert [r.output_ids for r in a] == [r.output_ids for r in b]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_compiled_engine_matches_eager(pair, temperature):
    """The engine compiles its cached forwards with fullgraph=True, so this also fails on a
    graph break (which would otherwise run the forward eager, silently)."""
    model, _, draft = pair
    prompts = random_prompts(3, seed=6)
    sp = SamplingParams(temperature, max_new_tokens=12, seed=0)
    ref = BuiltinRolloutEngine(model, draft, BuiltinEngineConfig(num_draft_tokens=2)).generate(prompts, sp)
    cfg = BuiltinEngineConfig(num_draft_tokens=2, compile=True, compile_backend="aot_eager")
    got = BuiltinRolloutEngine(model, draft, cfg).generate(prompts, sp)
    assert [r.output_ids for r in got] == [r.output_ids for r in ref]


# --- weight pushes ------------------------------------------------------------------------


def test_weight_updates_change_outputs_and_bump_versions(pair):
    model, arch, fitted = pair
    other, _ = make_target(42)
    prompts = random_prompts(4, seed=31)
    sp = SamplingParams(temperature=0.0, max_new_tokens=20)
    own_target, _ = make_target(0)
    engine = BuiltinRolloutEngine(own_target, make_draft(arch, 3), BuiltinEngineConfig(num_draft_tokens=3))
    before = engine.generate(prompts, sp)
    assert {(r.policy_version, r.draft_version) for r in before} == {(0, 0)}

    engine.update_policy_weights(other.state_dict(), version=3)
    after = engine.generate(prompts, sp)
    fresh = BuiltinRolloutEngine(other, None, BuiltinEngineConfig(num_draft_tokens=0)).generate(prompts, sp)
    assert [r.output_ids for r in after] == [r.output_ids for r in fresh]
    assert [r.output_ids for r in after] != [r.output_ids for r in before]
    assert {r.policy_version for r in after} == {3}

    # Back to the first policy, streamed as (name, tensor) pairs; then the fitted draft.
    engine.update_policy_weights(iter(model.state_dict().items()), version=4)
    low = engine.generate(prompts, sp)
    sd = fitted.state_dict()
    engine.update_draft_weights({k: sd[k] for k in EXPORT_KEYS}, version=5)
    high = engine.generate(prompts, sp)
    assert [r.output_ids for r in low] == [r.output_ids for r in high] == [r.output_ids for r in before]
    assert sum(r.accepted_tokens for r in high) > sum(r.accepted_tokens for r in low)
    assert {(r.policy_version, r.draft_version) for r in high} == {(4, 5)}

    # A bad push changes nothing: not the weights, not the version.
    bad = dict(model.state_dict())
    bad["layers.0.attention.wo.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="shape"):
        engine.update_policy_weights(bad, version=6)
    with pytest.raises(ValueError, match="unknown name"):
        engine.update_draft_weights({"nope.weight": torch.zeros(1)}, version=7)
    with pytest.raises(ValueError, match="d2t"):  # checked before any tensor is copied
        engine.update_draft_weights({"fc.weight": torch.zeros_like(sd["fc.weight"]), "d2t": sd["d2t"] + V}, version=8)
    again = engine.generate(prompts, sp)
    assert [r.output_ids for r in again] == [r.output_ids for r in high]
    assert {(r.policy_version, r.draft_version) for r in again} == {(4, 5)}


# --- bad inputs ---------------------------------------------------------------------------


def test_bad_inputs_give_clear_errors_and_the_engine_keeps_working(pair):
    model, arch, draft = pair
    engine = BuiltinRolloutEngine(model, draft, BuiltinEngineConfig(num_draft_tokens=2))
    prompts = random_prompts(3, seed=41)
    sp = SamplingParams(temperature=0.0, max_new_tokens=12)
    ref = engine.generate(prompts, sp)

    def one_line(exc_info):
        assert "\n" not in str(exc_info.value)

    cases = [
        (lambda: engine.generate([[1, 2], []], sp), "prompt 1 is empty"),
        (lambda: engine.generate([[1] * 250], SamplingParams(0.0, max_new_tokens=10)), "max length 256"),
        (lambda: engine.generate([[1, V + 3]], sp), "outside the vocabulary"),
        (lambda: SamplingParams(temperature=-0.5), "temperature"),
        (lambda: SamplingParams(top_p=0.0), "top_p"),
        (lambda: SamplingParams(top_k=-3), "top_k"),
        (lambda: SamplingParams(max_new_tokens=0), "max_new_tokens"),
        (lambda: BuiltinRolloutEngine(model, draft, BuiltinEngineConfig(num_draft_tokens=-1)), "num_draft_tokens"),
        (lambda: BuiltinRolloutEngine(model, None, BuiltinEngineConfig(num_draft_tokens=2)), "needs a draft"),
    ]
    wrong_vocab = Eagle3Draft(DraftArch.from_target(with_vocab(arch, V + 8), TAPS, 16))
    wrong_hidden = Eagle3Draft(dataclasses.replace(DraftArch.from_target(arch, TAPS, 16), hidden=48, target_hidden=48))
    bad_d2t = make_draft(arch, 1, draft_vocab=8)
    bad_d2t.d2t.fill_(V - 4)  # draft ids 4..7 land past the target vocabulary
    cases += [
        (
            lambda: BuiltinRolloutEngine(model, bad_d2t, BuiltinEngineConfig(num_draft_tokens=2)),
            "d2t maps draft ids outside",
        ),
        (
            lambda: BuiltinRolloutEngine(model, wrong_vocab, BuiltinEngineConfig(num_draft_tokens=2)),
            "draft vocab_size 40 != target vocab 32",
        ),
        (
            lambda: BuiltinRolloutEngine(model, wrong_hidden, BuiltinEngineConfig(num_draft_tokens=2)),
            "target_hidden 48 != target dim 64",
        ),
    ]
    for fn, msg in cases:
        with pytest.raises(ValueError, match=msg) as e:
            fn()
        one_line(e)
        assert [r.output_ids for r in engine.generate(prompts, sp)] == [r.output_ids for r in ref]
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.generate(prompts, sp)


# --- adaptive depth (rollout/builtin/depth.py) ----------------------------------------------


def pinned_costs(ratios=(1.0, 1.15, 1.3, 1.45, 1.6), modes=("greedy", "sample", "sample_topk_topp")):
    """A fixed cost table (no measurement: deterministic tests): a round at K costs
    ratios[K] plain steps at every batch size."""
    from titan_spec.rollout.builtin.depth import RoundCosts

    return RoundCosts({m: {"1": [r * 1e-3 for r in ratios]} for m in modes}, pinned=True)


def _adaptive(model, draft, costs, K=4, **kw):
    return BuiltinRolloutEngine(
        model, draft, BuiltinEngineConfig(num_draft_tokens=K, depth="adaptive", **kw), costs=costs
    )


@pytest.mark.parametrize("which", ["random", "fitted"])
def test_adaptive_depth_greedy_equals_plain_and_follows_the_draft(pair, which):
    """Greedy output equals plain decoding token for token whatever the depth choices, also
    across batches of one call (max_batch_size) and with stop tokens; and the choices follow
    the draft: a random draft falls to K = 0 after the first call's first rounds and the
    later calls start there (the acceptance estimate is carried from call to call), a
    fitted one drafts deep (the acceptance it would get at K = 4 is the
    test_greedy_speculative_equals_plain pair's > 1.6)."""
    model, arch, fitted = pair
    draft = fitted if which == "fitted" else make_draft(arch, 7, draft_vocab=20)
    plain = BuiltinRolloutEngine(model, None, BuiltinEngineConfig(num_draft_tokens=0))
    spec = _adaptive(model, draft, pinned_costs(), max_batch_size=4)
    depths = []
    for seed in (3, 4):
        prompts = random_prompts(6, seed)
        sp = SamplingParams(temperature=0.0, max_new_tokens=30)
        ref = plain.generate(prompts, sp)
        sp_stop = SamplingParams(temperature=0.0, max_new_tokens=30, stop_token_ids=_with_stops(ref))
        for sp_ in (sp, sp_stop):
            want = plain.generate(prompts, sp_)
            got = spec.generate(prompts, sp_)
            check_stats(got, 4)
            for g, w in zip(got, want):
                assert g.output_ids == w.output_ids and g.finish_reason == w.finish_reason
                torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-5, rtol=0)
            assert all(r.drafted_tokens <= 4 * (r.verify_steps - 1) for r in got)
            depths.append(
                (list(spec.last_depths), sum(r.drafted_tokens for r in got), sum(r.verify_steps - 1 for r in got))
            )
    if which == "random":
        # The optimistic prior drafts in the first rounds; a few rejections take it to 0,
        # where it stays (but for a probe every depth.PROBE_EVERY = 64 rounds), and
        # the next calls start from the low estimate.
        first = depths[0][0]
        assert any(k > 0 for k in first[:3]), first
        later = first[6:] + [k for d, _, _ in depths[1:] for k in d]
        assert sum(k == 0 for k in later) >= 0.9 * len(later), depths
        assert sum(d for _, d, _ in depths) / sum(r for _, _, r in depths) < 0.5
    else:
        # Drafts on (the pair's per-depth acceptance makes K = 2 the best here at these
        # costs; a request's last rounds shorten K to its budget).
        draft_k = sum(d for _, d, _ in depths) / sum(r for _, _, r in depths)
        assert draft_k >= 1.5, (draft_k, depths)


def test_adaptive_depth_sampling_is_exact(pair):
    """The chi-square check of test_sampled_tokens_follow_the_policy with adaptive depth: a
    budget of 8 tokens lets the choice vary between rounds (K drafted, then smaller as the
    budget runs out), and the tokens still follow the policy's distribution."""
    model, arch, fitted = pair
    sp = SamplingParams(1.0, max_new_tokens=8, seed=4)
    res, accepted_per_row, depths = sampled_tokens_distribution_check(
        model, fitted, 3, sp, depth="adaptive", costs=pinned_costs((1.0, 1.1, 1.25, 1.45))
    )
    for k in (1, 2, 3):
        stat, df = res[k]
        assert df >= 5, (k, df)
        assert chi2_pvalue(stat, df) > 1e-3, f"token {k}: chi2 = {stat:.1f} on {df} df"
    assert chi2_pvalue(*res["power"]) < 1e-6, "the test cannot tell T from 1.5 T: no power"
    assert len(set(depths)) >= 2 and max(depths) >= 2, depths  # the depth really varied
    assert accepted_per_row > 0.5


def test_adaptive_depth_choices_are_a_function_of_the_cost_table(pair):
    """The reproducibility guarantee (depth.py): a call's choices and samples are a function
    of (the cost table, the acceptance state it starts from): an engine that measures its
    table during a call samples exactly what it samples on a later call that starts from the
    same acceptance state with the table in place (the measurement uses its own RNG and
    scratch caches); a second engine given copies of both makes the same choices and the
    same samples; the table is frozen once measured; the acceptance state carries from call
    to call (so a call started from another state may choose otherwise)."""
    model, arch, fitted = pair
    from titan_spec.rollout.builtin.depth import RoundCosts

    prompts = random_prompts(3, seed=8)
    sp = SamplingParams(1.0, top_k=12, top_p=0.9, max_new_tokens=16, seed=5)
    e1 = _adaptive(model, fitted, RoundCosts(), K=3)
    start = e1.acceptance.state_dict()
    first = e1.generate(prompts, sp)
    table = e1.costs.state_dict()
    assert set(table) == {"sample_topk_topp"} and sorted(table["sample_topk_topp"]) == ["1", "2", "4"]
    for row in table["sample_topk_topp"].values():
        assert len(row) == 4 and all(a <= b for a, b in zip(row, row[1:])) and row[0] > 0
    d1, after = list(e1.last_depths), e1.acceptance.state_dict()
    assert set(after) == {"sample_topk_topp@T=1"} and after != start  # carried: the call's rounds are in it
    e1.acceptance.load_state_dict(start)
    again = e1.generate(prompts, sp)
    assert e1.costs.state_dict() == table  # frozen: no second measurement
    assert [r.output_ids for r in again] == [r.output_ids for r in first] and e1.last_depths == d1
    assert e1.acceptance.state_dict() == after
    e2 = _adaptive(model, fitted, RoundCosts(table), K=3)
    other = e2.generate(prompts, sp)
    assert [r.output_ids for r in other] == [r.output_ids for r in first] and e2.last_depths == d1
    # And the choices do depend on the table: speculation made expensive gives K = 0.
    e3 = _adaptive(model, fitted, pinned_costs((1.0, 3.0, 5.0, 7.0)), K=3)
    e3.generate(prompts, sp)
    assert set(e3.last_depths) == {0}, e3.last_depths


def test_depth_choice_and_estimate_by_hand():
    from titan_spec.rollout.builtin.depth import AcceptanceEstimate, RoundCosts, batch_buckets, choose_depth

    # E[tokens | K] = 1 + a1 + a1 a2 + ...; rate = E / cost.
    #   alphas (.9, .9), costs (1, 1.2, 1.4): rates 1, 1.9/1.2 = 1.58, 2.71/1.4 = 1.94 -> K = 2
    assert choose_depth([0.9, 0.9], [10], [1.0, 1.2, 1.4]) == 2
    #   costs (1, 2, 3): rates 1, .95, .90 -> K = 0
    assert choose_depth([0.9, 0.9], [10], [1.0, 2.0, 3.0]) == 0
    #   alphas (.5, .5), costs (1, 1.2, 1.6): rates 1, 1.25, 1.75/1.6 = 1.09 -> K = 1
    assert choose_depth([0.5, 0.5], [10, 10], [1.0, 1.2, 1.6]) == 1
    # One token of budget left: drafting gains nothing (ties go to the smaller K).
    assert choose_depth([0.99, 0.99], [1, 1], [1.0, 1.01, 1.02]) == 0
    # Budgets 2 and 10: K = 2 adds .81 for one row only: (2 + 2*.9 + .81) / 1.4 = 3.29
    # against K = 1: 3.8 / 1.2 = 3.17.
    assert choose_depth([0.9, 0.9], [2, 10], [1.0, 1.2, 1.4]) == 2
    assert choose_depth([0.9, 0.9], [2, 2], [1.0, 1.2, 1.4]) == 1

    est = AcceptanceEstimate(3, prior=0.5, prior_weight=2.0, decay=0.5, idle_decay=0.25)
    assert est.alphas() == [0.5, 0.5, 0.5]
    # A round weighs 1 whatever its rows: each of its 3 rows counts 1/3.
    est.observe(3, [0, 3, 1])  # reached: d1 by 3 rows, d2 by 2, d3 by 1; accepted: 2, 1, 1
    assert est.alphas() == pytest.approx([(2 / 3 + 1) / (1 + 2), (1 / 3 + 1) / (2 / 3 + 2), (1 / 3 + 1) / (1 / 3 + 2)])
    est.observe(2, [2])  # decay by 0.5, then: reached d1, d2; accepted both (depth 3 not drafted)
    r, a = [0.5 + 1, 1 / 3 + 1, 1 / 6], [1 / 3 + 1, 1 / 6 + 1, 1 / 6]
    assert est.alphas() == pytest.approx([(a[j] + 1) / (r[j] + 2) for j in range(3)])
    est.observe(0, [0, 0])  # K = 0: no observation, the counts decay by idle_decay
    r, a = [x / 4 for x in r], [x / 4 for x in a]
    assert est.alphas() == pytest.approx([(a[j] + 1) / (r[j] + 2) for j in range(3)])
    # Batch 64 of identical rows is one round of evidence, as one row at batch 1 is.
    wide, narrow = AcceptanceEstimate(3), AcceptanceEstimate(3)
    wide.observe(3, [1] * 64)
    narrow.observe(3, [1])
    assert wide.alphas() == pytest.approx(narrow.alphas())

    # The measured cost row is made non-decreasing in K by pooling inversions, not by
    # trusting the lowest measurement (which sent every round to the deepest of a tie).
    from titan_spec.rollout.builtin.calibrate import _non_decreasing

    assert _non_decreasing([2.0, 5.6, 7.0, 6.0, 8.0]) == pytest.approx([2.0, 5.6, 6.5, 6.5, 8.0])
    assert _non_decreasing([3.0, 2.0, 1.0]) == pytest.approx([2.0, 2.0, 2.0])
    assert _non_decreasing([1.0, 2.0]) == [1.0, 2.0]

    # The engine's state: one estimate per sampling setting, JSON-ready, loads back.
    from titan_spec.rollout.builtin.depth import AcceptanceState

    state = AcceptanceState(3)
    state.of(SamplingParams(0.0)).observe(3, [3])
    state.of(SamplingParams(1.0)).observe(3, [0])
    state.of(SamplingParams(0.7)).observe(3, [1])
    assert sorted(state.state_dict()) == ["greedy", "sample@T=0.7", "sample@T=1"]
    assert state.of(SamplingParams(0.0)).alphas()[0] > state.of(SamplingParams(1.0)).alphas()[0]
    loaded = AcceptanceState(3)
    loaded.load_state_dict(json.loads(json.dumps(state.state_dict())))
    assert loaded.state_dict() == state.state_dict()
    with pytest.raises(ValueError, match="K up to 3"):
        AcceptanceState(2).load_state_dict(state.state_dict())

    assert batch_buckets(1) == [1] and batch_buckets(6) == [1, 2, 4, 8] and batch_buckets(8) == [1, 2, 4, 8]
    c = RoundCosts({"greedy": {"1": [1.0, 2.0], "4": [4.0, 8.0]}})
    assert c.costs("greedy", 2, 1) == pytest.approx([2.0, 4.0])  # a third of the way from 1 to 4
    assert c.costs("greedy", 16, 1) == [4.0, 8.0] and c.costs("greedy", 1, 0) == [1.0]
    with pytest.raises(ValueError, match="frozen"):
        c.set("greedy", 4, [1.0, 1.0])
    assert c.missing("greedy", [1, 2, 4], 1) == [2] and c.missing("greedy", [1], 2) == [1]
    assert RoundCosts(c.state_dict(), pinned=True).missing("greedy", [1, 2, 4], 1) == []
    # A call's rounds (K, rows) priced by the table: 1 plain round at 4 rows, 2 at K = 1 with 2 rows.
    assert c.price("greedy", [(0, 4), (1, 2), (1, 2)], 1) == pytest.approx(4.0 + 4.0 + 4.0)
    assert c.price("sample", [(0, 4)], 1) == 0.0 and c.price("greedy", [], 1) == 0.0


def test_adaptive_depth_drafts_from_every_position_after_plain_rounds(pair, monkeypatch):
    """After K = 0 rounds the draft has not seen the committed positions; the next drafting
    round must extend all of them (the pending segments). Reference: the same prompt with
    those tokens appended, whose prefill gives the draft every position at once. The draft's
    distribution for the first proposal (what its first extend returns) then agrees."""
    import titan_spec.rollout.builtin.engine as engine_mod

    model, arch, fitted = pair
    plan = iter([0] * 5 + [3] * 100)
    monkeypatch.setattr(engine_mod, "choose_depth", lambda *a: next(plan))

    def first_extend(engine):
        seen = []
        real = engine._draft.extend

        def record(*a, **k):
            out = real(*a, **k)
            seen.append(out[1].clone())  # logits_BVd of each row's last pending position
            return out

        engine._draft.extend = record
        return seen

    spec = _adaptive(model, fitted, pinned_costs(), K=3)
    seen = first_extend(spec)
    prompts = random_prompts(3, seed=12)
    sp = SamplingParams(0.0, max_new_tokens=12)
    got = spec.generate(prompts, sp)
    assert spec.last_depths[:6] == [0, 0, 0, 0, 0, 3]
    # The prefill and 5 plain rounds committed 6 tokens: the reference prompt holds 5 of them
    # (the 6th is the pending token its prefill emits).
    ref = BuiltinRolloutEngine(model, fitted, BuiltinEngineConfig(num_draft_tokens=3))
    ref_seen = first_extend(ref)
    ref.generate([p + r.output_ids[:5] for p, r in zip(prompts, got)], sp)
    torch.testing.assert_close(seen[0], ref_seen[0], atol=1e-4, rtol=0)


def test_adaptive_depth_probes_a_written_off_draft_and_recovers_after_a_push(pair, monkeypatch):
    """A K = 0 round observes nothing, so an estimate a bad draft drove to K = 0 could not
    see a good draft pushed later; every PROBE_EVERY-th K = 0 round in a row drafts
    PROBE_DEPTH tokens instead (depth.py). A random draft: K = 0 but for the probes,
    exactly every PROBE_EVERY rounds across calls; then the fitted draft is pushed: the
    first drafting round comes within PROBE_EVERY rounds (54 here) and the engine keeps
    drafting (K > 0 in >= 80% of the next 2 PROBE_EVERY rounds). Without probes the same state stays at K = 0 for
    over 2 PROBE_EVERY rounds (the idle decay alone: 189 rounds here). Greedy output
    equals plain decoding throughout."""
    import titan_spec.rollout.builtin.depth as depth_mod

    model, arch, fitted = pair
    P = depth_mod.PROBE_EVERY
    est = depth_mod.AcceptanceEstimate(4)
    for _ in range(P - 1):
        assert est.depth(0) == 0
        est.observe(0, [0])
    assert est.depth(0) == depth_mod.PROBE_DEPTH and est.depth(2) == 2  # a probe replaces K = 0 only
    assert est.state_dict()["idle"] == P - 1  # part of the state (a retried call repeats its probes)
    est.observe(depth_mod.PROBE_DEPTH, [0])
    assert est.idle == 0 and est.depth(0) == 0
    est.load_state_dict({"reached": [0.0] * 5, "accepted": [0.0] * 5})  # a state saved before probes
    assert est.idle == 0
    # K = 4 at 1.9 plain steps: the fitted draft's 2.6 tokens a round pay (1.35x), the
    # random draft's 1.04 do not; the prior alone needs alpha_1 > 0.28 to draft again.
    costs = pinned_costs((1.0, 1.3, 1.5, 1.7, 1.9), modes=("greedy",))
    engine = _adaptive(model, make_draft(arch, 7), costs)
    plain = BuiltinRolloutEngine(model, None, BuiltinEngineConfig(num_draft_tokens=0))
    sp = SamplingParams(0.0, max_new_tokens=30)
    prompts = random_prompts(32, 100)[:6]  # fit_draft's prompts: the fitted draft knows them
    want = [r.output_ids for r in plain.generate(prompts, sp)]

    def rounds(n: int) -> list[int]:
        """The K of at least n rounds, calls of the same prompts (greedy: same output)."""
        depths = []
        while len(depths) < n:
            assert [r.output_ids for r in engine.generate(prompts, sp)] == want
            depths += engine.last_depths
        return depths

    bad = rounds(3 * P)
    drafting = [i for i, k in enumerate(bad) if k]
    start = next(i for i, k in enumerate(bad) if not k)  # the prior's first rounds draft
    assert start < 6 and [i for i in drafting if i > start] == list(range(start + P - 1, len(bad), P)), drafting
    assert all(bad[i] == depth_mod.PROBE_DEPTH for i in drafting if i > start)

    sd = fitted.state_dict()
    engine.update_draft_weights({k: sd[k] for k in EXPORT_KEYS}, version=1)
    written_off = engine.acceptance.state_dict()
    good = rounds(3 * P)
    first = next(i for i, k in enumerate(good) if k)
    assert first < P, good
    assert sum(k > 0 for k in good[first : first + 2 * P]) >= 0.8 * 2 * P, good

    engine.acceptance.load_state_dict(written_off)  # the same state, no probes
    monkeypatch.setattr(depth_mod, "PROBE_EVERY", 10**9)
    assert set(rounds(2 * P)[: 2 * P]) == {0}
