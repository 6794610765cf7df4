"""The DSpark draft kind (models/draft/dspark/): its loss and gradients against a per-block fp64
reference written here from SpecForge's DSpark objective (every block row a prediction, the
Markov bias of the teacher-forced previous token, 0.1 CE + 0.9 L1 + 1.0 confidence BCE,
decay-weighted mean), its cached proposer against the same reference, lossless speculation with
it in the built-in engine (greedy token for token, sampled by chi-square), its vLLM-layout
directory and its config errors. Models and batches are test_dflash.py's.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torchtitan.components.loss import IGNORE_INDEX

from titan_spec.config import ConfigError, DFlashConfig, DraftConfig, DSparkConfig, load_config
from titan_spec.models.attention import doc_metadata_from_positions
from titan_spec.models.draft import draft_kind
from titan_spec.models.draft.dflash.io import export_keys
from titan_spec.rollout import BuiltinEngineConfig, BuiltinRolloutEngine, SamplingParams
from titan_spec.rollout.builtin.depth import confidence_depth

from test_dflash import TAPS, V, loss_in_fp64, make_target, reference_block_normed
from test_rollout_engine import (  # noqa: F401  (_one_thread: the module's autouse fixture, shared)
    _one_thread,
    assert_follows_the_policy,
    check_stats,
    random_prompts,
    sampled_tokens_distribution_check,
)

KIND = draft_kind("dspark")


def make_draft(
    arch, seed: int, block_size: int = 4, draft_vocab: int = V, n_layers: int = 1, rank: int = 8, confidence=True
):
    cfg = DraftConfig(
        kind="dspark",
        dflash=DFlashConfig(block_size=block_size, num_layers=n_layers, anchors_per_doc=0),
        dspark=DSparkConfig(markov_rank=rank, confidence_head=confidence),
        draft_vocab_size=draft_vocab,
    )
    da = KIND.arch_from_target(arch, TAPS, draft_vocab, cfg)
    counts = torch.rand(V, generator=torch.Generator().manual_seed(seed)) if draft_vocab < V else None
    draft = KIND.initial(da, counts, seed)
    with torch.no_grad():  # norms away from 1 and heads away from their init, so a skipped term fails
        for n, p in draft.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
            elif "markov" in n or "confidence" in n:
                p.normal_(0.0, 0.5)
    return draft, cfg


# --- an independent reference: one block at a time, in fp64 --------------------------------


def reference_loss(draft, logits_TV, taps_TD, emb_TH, pos_T, labels_T, tok_T, cfg):
    J, k_ = draft.arch.block_size, cfg.dspark
    starts = [t for t in range(len(pos_T)) if pos_T[t] == 0] + [len(pos_T)]
    d2t_ids = (torch.arange(draft.arch.draft_vocab_size) + draft.d2t).tolist()
    p = dict(draft.named_parameters())
    total, denom, counts = 0.0, 0.0, [0] * J
    for s, e in zip(starts[:-1], starts[1:]):
        for a in range(s + 1, e):
            if labels_T[a] == IGNORE_INDEX or labels_T[a - 1] == IGNORE_INDEX:
                continue  # blocks start at the first completion token
            hn = reference_block_normed(draft, taps_TD, emb_TH, pos_T, a, s)
            for k in range(J):
                if any(a + i >= e or labels_T[a + i] == IGNORE_INDEX for i in range(k + 1)):
                    break
                w = cfg.loss_decay**k
                denom += w
                label = int(tok_T[a + k + 1])
                if label not in d2t_ids:
                    continue
                m = p["markov_head.markov_w1.weight"][int(tok_T[a + k])]
                logp = torch.log_softmax(hn[k] @ p["lm_head.weight"].T + m @ p["markov_head.markov_w2.weight"].T, -1)
                ce = -logp[d2t_ids.index(label)]
                l1 = (logp.exp() - torch.softmax(logits_TV[a + k][d2t_ids], -1)).abs().sum()
                conf = torch.cat([hn[k], m]) @ p["confidence_head.proj.weight"][0] + p["confidence_head.proj.bias"][0]
                bce = F.binary_cross_entropy_with_logits(conf, (1 - l1.detach() / 2).clamp(0, 1))
                total = total + w * (k_.ce_weight * ce + k_.l1_weight * l1 + k_.confidence_weight * bce)
                counts[k] += 1
    return total / denom, counts


@pytest.mark.parametrize("block_size,n_layers,draft_vocab", [(4, 1, V), (3, 2, 20)])
def test_loss_and_gradients_equal_a_per_block_reference(block_size, n_layers, draft_vocab):
    model, arch = make_target(0)
    draft, cfg = make_draft(arch, 1, block_size, draft_vocab, n_layers)
    draft64, got, got_grads, (tok, pos, labels, logits, taps64) = loss_in_fp64(KIND, model, draft, cfg)
    want, counts = reference_loss(
        draft64,
        logits[0].double(),
        [h[0] for h in taps64.hidden],
        taps64.embeds_BLD[0],
        pos[0],
        labels[0],
        tok[0],
        cfg,
    )
    want.backward()
    assert got.count_S.tolist() == counts and min(counts) > 0
    # tolerance: the drafts' rotary runs in float32, the reference's in fp64 (as test_dflash.py).
    torch.testing.assert_close(got.loss, want, rtol=1e-7, atol=1e-9)
    for n, q in draft64.named_parameters():
        # tolerance: the same fp32 rotary angles through the backward (gradients O(1-10)).
        torch.testing.assert_close(got_grads[n], q.grad, rtol=1e-6, atol=3e-7, msg=n)
    for n in ("markov_head.markov_w2.weight", "confidence_head.proj.weight", "mask_embedding"):
        assert got_grads[n].abs().sum() > 0, n


def test_blocks_start_at_the_first_completion_token():
    from titan_spec.models.draft.dflash.loss import block_plan, doc_bounds_of

    pos = torch.cat([torch.arange(30), torch.arange(10)])[None]
    labels = torch.ones(40, dtype=torch.long)
    labels[:5] = IGNORE_INDEX  # doc 1: labels from row 5 (its last prompt row), doc 2: every row
    plan = block_plan(doc_bounds_of(pos), labels, 0)
    assert plan.anchors_A.tolist() == list(range(6, 30)) + list(range(31, 40))


# --- the cached proposer ------------------------------------------------------------------


def test_cached_proposer_equals_the_reference_block_and_heads():
    from titan_spec.rollout.builtin.cached_target import CachedTarget

    model, arch = make_target(0)
    draft, _ = make_draft(arch, 3, block_size=5, n_layers=2)
    seq = [int(t) for t in torch.randint(0, V, (9,), generator=torch.Generator().manual_seed(9))]
    prop = KIND.cached_proposer(draft.eval(), CachedTarget(model, TAPS).embed)
    assert prop.proposals == 5
    prop.new_cache(1, 32)
    with torch.no_grad():
        pos = torch.arange(9)[None]
        _, taps = model(torch.tensor([seq]), pos, doc_metadata_from_positions(pos))
        taps_1LCD = torch.stack([h[0] for h in taps.hidden], 1)[None]
        prop.extend(
            taps_1LCD[:, :6], torch.zeros(1, 6, dtype=torch.long), torch.zeros(1, dtype=torch.long), torch.tensor([6])
        )
        out = prop.propose(torch.tensor([seq[6]]), torch.tensor([6]), n_slots=11)
        hn = reference_block_normed(
            draft.double(),
            [h.double() for h in taps_1LCD[0].unbind(1)],
            model.tok_embeddings(torch.tensor(seq)).double(),
            torch.arange(9),
            6,
            0,
        )
        draft.float()
        p = dict(draft.double().named_parameters())
        for j, prev in enumerate([seq[6], 11, 4, 30, 2]):
            want = (
                hn[j] @ p["lm_head.weight"].T
                + p["markov_head.markov_w1.weight"][prev] @ p["markov_head.markov_w2.weight"].T
            )
            draft.float()
            got = prop.row(out, j, torch.tensor([prev]))[0][0]
            # tolerance: the cached proposer in fp32 against the fp64 reference (logits O(1)).
            torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
            draft.double()
        draft.float()


# --- speculation in the built-in engine -----------------------------------------------------


@pytest.fixture(scope="module")
def fitted():
    from test_dflash import train_dflash

    model, arch = make_target(0)
    plain = BuiltinRolloutEngine(model, None, BuiltinEngineConfig(num_draft_tokens=0))
    prompts = random_prompts(24, 100)
    seqs = [r.prompt_ids + r.output_ids for r in plain.generate(prompts, SamplingParams(0.0, max_new_tokens=40))]
    draft, cfg = make_draft(arch, 0, block_size=6)
    with torch.no_grad():
        draft.markov_head.markov_w1.weight.normal_(0.0, 0.02)
        draft.markov_head.markov_w2.weight.normal_(0.0, 0.02)
    return model, arch, train_dflash(model, draft, cfg, seqs, 60, kind=KIND)


@pytest.mark.parametrize("which,K", [("fitted", 6), ("random", 2)])
def test_greedy_speculation_with_a_dspark_draft_equals_plain(fitted, which, K):
    model, arch, good = fitted
    draft = good if which == "fitted" else make_draft(arch, 7, block_size=3, draft_vocab=20)[0].eval()
    plain = BuiltinRolloutEngine(model, None, BuiltinEngineConfig(num_draft_tokens=0))
    spec = BuiltinRolloutEngine(model, draft, BuiltinEngineConfig(num_draft_tokens=K))
    tokens = steps = 0
    for seed in (3, 4):
        prompts = random_prompts(6, seed)
        sp = SamplingParams(temperature=0.0, max_new_tokens=30)
        want, got = plain.generate(prompts, sp), spec.generate(prompts, sp)
        check_stats(got, K)
        for g, w in zip(got, want):
            assert g.output_ids == w.output_ids and g.finish_reason == w.finish_reason
            tokens, steps = tokens + len(g.output_ids), steps + g.verify_steps
    if which == "fitted":
        assert tokens / steps > 1.5, tokens / steps  # it really speculates: the equality is not vacuous


def test_sampled_tokens_with_a_dspark_draft_follow_the_policy(fitted):
    model, _, draft = fitted
    res, accepted_per_row = sampled_tokens_distribution_check(
        model, draft, 4, SamplingParams(1.0, max_new_tokens=3, seed=0)
    )
    assert_follows_the_policy(res)
    assert accepted_per_row > 0.3  # drafts are accepted and rejected: both paths run


# --- depth = "confidence": the confidence head picks each round's K --------------------------


def test_confidence_depth_is_the_deepest_rows_surviving_prefix():
    conf_BK = torch.tensor([[0.9, 0.9, 0.2, 0.9], [0.6, 0.6, 0.6, 0.6], [0.1, 1.0, 1.0, 1.0]])
    for threshold in (0.05, 0.1, 0.2, 0.4, 0.5, 0.7, 0.85):
        # Brute force: j > 1 is verified when some row's product of confidences 1..j reaches it.
        want = 1 + sum(any(float(r[:j].prod()) >= threshold for r in conf_BK) for j in range(2, 5))
        assert confidence_depth(conf_BK, threshold) == want, threshold
    assert confidence_depth(torch.full((2, 4), 0.01), 0.5) == 1  # the block was paid for: K >= 1


@pytest.mark.parametrize("threshold", [0.3, 0.5])
def test_greedy_speculation_at_confidence_depth_equals_plain(fitted, threshold):
    model, _, draft = fitted
    plain = BuiltinRolloutEngine(model, None, BuiltinEngineConfig(num_draft_tokens=0))
    cfg = BuiltinEngineConfig(num_draft_tokens=6, depth="confidence", confidence_threshold=threshold)
    spec = BuiltinRolloutEngine(model, draft, cfg)
    depths = []
    for seed in (3, 4):
        prompts = random_prompts(6, seed)
        sp = SamplingParams(temperature=0.0, max_new_tokens=30)
        want, got = plain.generate(prompts, sp), spec.generate(prompts, sp)
        check_stats(got, 6)
        for g, w in zip(got, want):
            assert g.output_ids == w.output_ids and g.finish_reason == w.finish_reason
        depths += spec.last_depths
    assert 1 <= min(depths) < max(depths) <= 6, sorted(set(depths))  # the head really chooses


def test_sampled_tokens_at_confidence_depth_follow_the_policy(fitted):
    model, _, draft = fitted
    res, accepted_per_row, depths = sampled_tokens_distribution_check(
        model, draft, 4, SamplingParams(1.0, max_new_tokens=3, seed=0), depth="confidence"
    )
    assert_follows_the_policy(res)
    # One round per row: the first proposals verified, the rest cut (what the rule must not bias).
    assert accepted_per_row > 0.3 and min(depths) < 4, (accepted_per_row, sorted(set(depths)))


def test_confidence_depth_without_a_confidence_head_is_one_line(fitted):
    from test_dflash import make_draft as make_dflash

    model, arch, _ = fitted
    drafts = [make_dflash(arch, 1, block_size=4)[0], make_draft(arch, 2, confidence=False)[0]]
    for draft in drafts:
        with pytest.raises(ValueError) as e:
            BuiltinRolloutEngine(model, draft, BuiltinEngineConfig(num_draft_tokens=2, depth="confidence"))
        assert "\n" not in str(e.value) and "confidence head" in str(e.value), e.value


def test_more_draft_tokens_than_the_block_is_one_line(fitted):
    model, _, draft = fitted
    with pytest.raises(ValueError) as e:
        BuiltinRolloutEngine(model, draft, BuiltinEngineConfig(num_draft_tokens=7))
    assert "\n" not in str(e.value) and "<= 6 (block_size 6)" in str(e.value)


# --- the directory: vLLM's layout, round trip ------------------------------------------------


def test_export_is_vllms_layout_and_round_trips(tmp_path):
    from safetensors.torch import load_file

    model, arch = make_target(0)
    draft, cfg = make_draft(arch, 5, block_size=4, draft_vocab=20)
    KIND.save(draft, str(tmp_path / "d"))
    conf = json.load(open(tmp_path / "d" / "config.json"))
    assert conf["architectures"] == ["Qwen3DSparkModel"] and conf["block_size"] == 4
    assert conf["markov_rank"] == 8 and conf["enable_confidence_head"] and conf["confidence_head_with_markov"]
    sd = load_file(str(tmp_path / "d" / "model.safetensors"))
    assert set(sd) == set(export_keys(draft.arch))
    assert sd["markov_head.markov_w1.weight"].shape == (V, 8) and sd["markov_head.markov_w2.weight"].shape == (20, 8)
    assert sd["confidence_head.proj.weight"].shape == (1, arch.dim + 8) and sd["confidence_head.proj.bias"].shape == (
        1,
    )
    assert KIND.read_arch(str(tmp_path / "d")) == draft.arch
    KIND.check_weights(str(tmp_path / "d"), draft.arch)
    back = KIND.build(draft.arch)
    KIND.load_into(back, str(tmp_path / "d"))
    for (n, a), b in zip(draft.state_dict().items(), back.state_dict().values()):
        assert torch.equal(a, b), n
    # A DFlash reader refuses it in one line naming its kind.
    with pytest.raises(ValueError) as e:
        draft_kind("dflash").read_arch(str(tmp_path / "d"))
    assert "\n" not in str(e.value) and "DSpark" in str(e.value)


@pytest.mark.parametrize(
    "args,key",
    [
        (["--speculative.num_draft_tokens", "9", "--draft.dflash.block_size", "8"], "speculative.num_draft_tokens"),
        (["--rollout.engine", "vllm"], "rollout.engine"),
        (["--rollout.engine", "sglang"], "rollout.engine"),
        (["--draft.dspark.markov_rank", "0"], "draft.dspark.markov_rank"),
        (["--speculative.depth", "confidence", "--draft.dspark.confidence_head", "false"], "speculative.depth"),
        (["--speculative.depth", "confidence", "--draft.kind", "eagle3"], "speculative.depth"),
        (["--speculative.depth", "confidence", "--speculative.confidence_threshold", "0"], "confidence_threshold"),
    ],
)
def test_config_errors_of_the_kind_are_one_line(args, key):
    with pytest.raises(ConfigError) as e:
        load_config(None, ["--rl.enable", "true", "--draft.kind", "dspark", *args])
    assert "\n" not in str(e.value) and key in str(e.value), e.value
