"""The DFlash draft kind (models/draft/dflash/): its block loss and gradients against a per-block
fp64 reference written here from the DFlash description, its cached block proposer against
the same reference, lossless speculation with it in the built-in engine (greedy token for
token, sampled by chi-square), its vLLM-layout directory, and its bad inputs.

Models are tiny and random (vocab 32, as tests/test_rollout_engine.py); a "fitted" draft is
trained on the target's own completions by the kind's loss for a few seconds.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import pytest
import torch
from torchtitan.components.loss import IGNORE_INDEX

from titan_spec.config import ConfigError, DFlashConfig, DraftConfig, load_config
from titan_spec.models.attention import doc_metadata_from_positions
from titan_spec.models.draft import draft_kind
from titan_spec.models.draft.dflash.io import MASK_FILE, export_keys
from titan_spec.models.registry import build_target_config, flavor_arch, with_vocab
from titan_spec.rollout import SamplingParams, BuiltinEngineConfig, BuiltinRolloutEngine

from test_rollout_engine import (  # noqa: F401  (_one_thread: the module's autouse fixture, shared)
    _one_thread,
    assert_follows_the_policy,
    check_stats,
    random_prompts,
    sampled_tokens_distribution_check,
)

V = 32
TAPS = (1, 3, 5)
KIND = draft_kind("dflash")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_target(seed: int):
    torch.manual_seed(seed)
    arch = with_vocab(flavor_arch("qwen3", "tiny"), V)
    model = build_target_config(arch, tap_layer_ids=TAPS, max_seq_len=256).build()
    model.init_weights(buffer_device=None)
    with torch.no_grad():  # peaked, varied distributions (as test_rollout_engine.make_target)
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]))
    return model.eval(), arch


def make_draft(arch, seed: int, block_size: int = 4, draft_vocab: int = V, n_layers: int = 1, anchors: int = 0):
    cfg = DraftConfig(
        kind="dflash",
        dflash=DFlashConfig(block_size=block_size, num_layers=n_layers, anchors_per_doc=anchors),
        draft_vocab_size=draft_vocab,
    )
    da = KIND.arch_from_target(arch, TAPS, draft_vocab, cfg)
    counts = torch.rand(V, generator=torch.Generator().manual_seed(seed)) if draft_vocab < V else None
    draft = KIND.initial(da, counts, seed)
    with torch.no_grad():  # norms away from 1, so a test that skips one of them fails
        for n, p in draft.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    return draft, cfg


def packed_batch(seed: int):
    """Two documents in one row: prompt rows outside the loss region, a last row without label."""
    g = torch.Generator().manual_seed(seed)
    pos_1T = torch.cat([torch.arange(11), torch.arange(9)])[None]
    tok_1T = torch.randint(0, V, (1, 20), generator=g)
    labels_1T = torch.roll(tok_1T, -1, 1).clone()
    labels_1T[0, [0, 1, 2, 10, 11, 12, 19]] = IGNORE_INDEX
    return tok_1T, pos_1T, labels_1T


# --- an independent reference: one block at a time, in fp64 --------------------------------


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x_RNH, pos_R, theta):
    hd = x_RNH.shape[-1]
    inv = theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = pos_R.double()[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[:, None], torch.cat([ang.sin(), ang.sin()], -1)[:, None]
    x1, x2 = x_RNH[..., : hd // 2], x_RNH[..., hd // 2 :]
    return x_RNH * cos + torch.cat([-x2, x1], -1) * sin


def reference_block_logits(draft, taps_TD: list, emb_TH, pos_T, anchor: int, start: int):
    """Logits of the J rows of the block anchored at row ``anchor`` of the document starting at
    ``start``: context rows start .. anchor-1, bidirectional inside the block."""
    return reference_block_normed(draft, taps_TD, emb_TH, pos_T, anchor, start) @ draft.lm_head.weight.T


def reference_block_normed(draft, taps_TD: list, emb_TH, pos_T, anchor: int, start: int):
    """The final-norm hidden of the J rows of that block (``reference_block_logits`` before the head)."""
    a, p = draft.arch, dict(draft.named_parameters())
    J, eps, th = a.block_size, a.norm_eps, a.rope_theta
    ctx = _rms(torch.cat([t[start:anchor] for t in taps_TD], -1) @ p["fc.weight"].T, p["hidden_norm.weight"], eps)
    h = torch.cat([emb_TH[anchor][None], p["mask_embedding"][None].expand(J - 1, -1)])
    bpos = pos_T[anchor] + torch.arange(J)
    rep = a.n_heads // a.n_kv_heads
    for i in range(a.n_layers):
        w = {k.removeprefix(f"layers.{i}."): v for k, v in p.items() if k.startswith(f"layers.{i}.")}
        x = _rms(h, w["input_layernorm.weight"], eps)

        def heads(y, name, n):
            return (
                y @ w[f"self_attn.{name}_proj.weight"].T
                if n is None
                else (y @ w[f"self_attn.{name}_proj.weight"].T).view(len(y), n, a.head_dim)
            )

        q = _rope(_rms(heads(x, "q", a.n_heads), w["self_attn.q_norm.weight"], eps), bpos, th)
        k = torch.cat(
            [
                _rope(_rms(heads(ctx, "k", a.n_kv_heads), w["self_attn.k_norm.weight"], eps), pos_T[start:anchor], th),
                _rope(_rms(heads(x, "k", a.n_kv_heads), w["self_attn.k_norm.weight"], eps), bpos, th),
            ]
        )
        v = torch.cat([heads(ctx, "v", a.n_kv_heads), heads(x, "v", a.n_kv_heads)])
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        att = torch.softmax(torch.einsum("qnh,knh->nqk", q, k) / math.sqrt(a.head_dim), -1)
        h = h + torch.einsum("nqk,knh->qnh", att, v).flatten(1) @ w["self_attn.o_proj.weight"].T
        y = _rms(h, w["post_attention_layernorm.weight"], eps)
        h = (
            h
            + (torch.nn.functional.silu(y @ w["mlp.gate_proj.weight"].T) * (y @ w["mlp.up_proj.weight"].T))
            @ w["mlp.down_proj.weight"].T
        )
    return _rms(h, p["norm.weight"], eps)


def reference_loss(draft, logits_TV, taps_TD, emb_TH, pos_T, labels_T, decay):
    J = draft.arch.block_size
    starts = [t for t in range(len(pos_T)) if pos_T[t] == 0] + [len(pos_T)]
    d2t_ids = torch.arange(draft.arch.draft_vocab_size) + draft.d2t
    sums, counts, denoms = [0.0] * (J - 1), [0] * (J - 1), [0] * (J - 1)
    for s, e in zip(starts[:-1], starts[1:]):
        for anchor in range(s + 1, e):
            if labels_T[anchor - 1] == IGNORE_INDEX or labels_T[anchor] == IGNORE_INDEX:
                continue  # a block's known token and its row-1 token are completion tokens
            out = torch.log_softmax(reference_block_logits(draft, taps_TD, emb_TH, pos_T, anchor, s), -1)
            for k in range(1, J):
                src = anchor + k - 1
                if src >= e or labels_T[src] == IGNORE_INDEX:
                    continue
                denoms[k - 1] += 1  # the normalizer: fixed by positions and labels, before the forward
                if not draft.t2d[logits_TV[src].argmax()]:
                    continue
                p = torch.softmax(logits_TV[src][d2t_ids], -1)
                sums[k - 1] = sums[k - 1] - (p * out[k]).sum()
                counts[k - 1] += 1
    # SpecForge's decay-weighted mean over the scored rows
    weights = [decay ** (k - 1) for k in range(1, J)]
    return sum(w * t for w, t in zip(weights, sums)) / sum(w * n for w, n in zip(weights, denoms)), counts


def loss_in_fp64(kind, model, draft, cfg):
    """The kind's loss of ``draft`` in fp64 on ``packed_batch(2)`` and its gradients (zeroed on
    the returned fp64 draft after), with the batch, the target's logits and fp64 taps."""
    tok, pos, labels = packed_batch(2)
    meta = doc_metadata_from_positions(pos)
    with torch.no_grad():
        logits, taps = model(tok, pos, meta)
    draft64 = draft.double()
    taps64 = type(taps)(taps.embeds_BLD.double(), tuple(h.double() for h in taps.hidden))
    got = kind.loss(draft64, logits.double(), taps64, pos, labels, meta, cfg, None, lambda c: c)
    got.loss.backward()
    got_grads = {n: p.grad.clone() for n, p in draft64.named_parameters()}
    draft64.zero_grad()
    return draft64, got, got_grads, (tok, pos, labels, logits, taps64)


@pytest.mark.parametrize("block_size,n_layers,draft_vocab", [(4, 1, V), (3, 2, 20)])
def test_block_loss_and_gradients_equal_a_per_block_reference(block_size, n_layers, draft_vocab):
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
        cfg.loss_decay,
    )
    want.backward()
    # The scored rows are the reference's; the normalizer counts them before the draft-vocab mask.
    assert got.count_S.tolist() == counts and min(counts) > 0
    norm_S = KIND.normalizer_counts(pos, labels, doc_metadata_from_positions(pos), cfg)
    assert (norm_S >= got.count_S).all() and (norm_S == got.count_S).all() == (draft_vocab == V)
    # tolerance: the drafts' rotary runs in float32 (as SGLang's and vLLM's cos/sin tables), the
    # reference's in fp64; everything else is fp64 on both sides.
    torch.testing.assert_close(got.loss, want, rtol=1e-7, atol=1e-9)
    for n, p in draft64.named_parameters():
        # tolerance: the same fp32 rotary angles, through the backward (gradients O(1e-2)).
        torch.testing.assert_close(got_grads[n], p.grad, rtol=1e-6, atol=1e-8, msg=n)
    assert got_grads["mask_embedding"].abs().sum() > 0 and got_grads["fc.weight"].abs().sum() > 0


def test_anchors_per_document_are_capped_evenly_and_deterministically():
    from titan_spec.models.draft.dflash.loss import block_plan, doc_bounds_of

    pos = torch.cat([torch.arange(30), torch.arange(10)])[None]
    labels = torch.ones(40, dtype=torch.long)
    labels[:5] = IGNORE_INDEX  # doc 1: rows 6..29 are anchors (24), doc 2: rows 31..39 (9)
    bounds = doc_bounds_of(pos)
    assert bounds == [0, 30, 40]
    plan = block_plan(bounds, labels, 4)
    assert plan.anchors_A.tolist() == plan.rows_A.tolist() == [6, 12, 18, 24, 31, 33, 35, 37]
    assert plan.groups == [(0, 4, 0, 30), (4, 8, 30, 40)]
    assert block_plan(bounds, labels, 0).anchors_A.tolist() == list(range(6, 30)) + list(range(31, 40))
    # A CP rank keeps the blocks anchored on its rows, at their local rows.
    mine = torch.zeros(40, dtype=torch.bool)
    mine[[12, 24, 33]] = True
    kept = block_plan(bounds, labels, 4, mine, torch.arange(40) + 100)
    assert kept.anchors_A.tolist() == [12, 24, 33] and kept.rows_A.tolist() == [112, 124, 133]
    assert kept.groups == [(0, 2, 0, 30), (2, 3, 30, 40)]


# --- the cached proposer ------------------------------------------------------------------


def test_cached_block_proposer_equals_the_reference_block():
    from titan_spec.rollout.builtin.cached_target import CachedTarget

    model, arch = make_target(0)
    draft, _ = make_draft(arch, 3, block_size=5, n_layers=2)
    seqs = [[int(t) for t in torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(n))] for n in (9, 6)]
    target = CachedTarget(model, TAPS)
    prop = KIND.cached_proposer(draft.eval(), target.embed)
    prop.new_cache(2, 32)
    with torch.no_grad():
        taps_BLCD = []
        for s in seqs:
            pos = torch.arange(len(s))[None]
            _, taps = model(torch.tensor([s]), pos, doc_metadata_from_positions(pos))
            taps_BLCD.append(torch.stack([h[0] for h in taps.hidden], 1))
        L = max(len(s) for s in seqs)
        padded = torch.zeros(2, L, len(TAPS), arch.dim)
        for b, t in enumerate(taps_BLCD):
            padded[b, : len(t)] = t
        start = torch.zeros(2, dtype=torch.long)
        # Round 1: positions 0..4 / 0..3 committed in one call; round 2: two / one more (the
        # first block's slots become context), then propose again.
        for n in (torch.tensor([5, 4]), torch.tensor([2, 1])):
            new = torch.zeros(2, int(n.max()), len(TAPS), arch.dim)
            for b in range(2):
                new[b, : n[b]] = padded[b, start[b] : start[b] + n[b]]
            prop.extend(new, torch.zeros(2, new.shape[1], dtype=torch.long), start, n)
            start = start + n
            got_BJV = prop.propose(
                torch.tensor([s[c] for s, c in zip(seqs, start.tolist())]), start, n_slots=int(start.max()) + 5
            )
            for b, s in enumerate(seqs):
                emb = model.tok_embeddings(torch.tensor(s))
                want = reference_block_logits(
                    draft.double(),
                    [h.double() for h in taps_BLCD[b].unbind(1)],
                    emb.double(),
                    torch.arange(len(s)),
                    int(start[b]),
                    0,
                )
                draft.float()
                # tolerance: the cached proposer in fp32 against the fp64 reference (logits O(1)).
                torch.testing.assert_close(got_BJV[b].double(), want[1:], rtol=1e-4, atol=1e-4)


# --- speculation in the built-in engine -----------------------------------------------------


def train_dflash(model, draft, cfg: DraftConfig, seqs: list[list[int]], steps: int, lr: float = 1e-2, kind=KIND):
    """``steps`` AdamW steps of the kind's loss on token sequences packed as one row's documents."""
    tok = torch.tensor([t for s in seqs for t in s])[None]
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    labels = torch.roll(tok, -1, 1).clone()
    labels[0, torch.roll(pos, -1, 1)[0] == 0] = IGNORE_INDEX  # a document's last row has no next token
    meta = doc_metadata_from_positions(pos)
    with torch.no_grad():
        logits, taps = model(tok, pos, meta)
    opt = torch.optim.AdamW(draft.parameters(), lr=lr)
    draft.train()
    for _ in range(steps):
        loss = kind.loss(draft, logits, taps, pos, labels, meta, cfg, None, lambda c: c).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return draft.eval()


def fit_draft(model, arch, block_size: int, steps: int = 60, seed: int = 0):
    """A DFlash draft fitted by its own loss on the target's greedy completions (and a few sampled)."""
    plain = BuiltinRolloutEngine(model, None, BuiltinEngineConfig(num_draft_tokens=0))
    prompts = random_prompts(24, seed + 100)
    seqs = [r.prompt_ids + r.output_ids for r in plain.generate(prompts, SamplingParams(0.0, max_new_tokens=40))]
    seqs += [
        r.prompt_ids + r.output_ids
        for r in plain.generate(prompts[:6], SamplingParams(1.0, max_new_tokens=40, seed=seed))
    ]
    draft, cfg = make_draft(arch, seed, block_size, anchors=0)
    return train_dflash(model, draft, cfg, seqs, steps)


@pytest.fixture(scope="module")
def fitted():
    model, arch = make_target(0)
    return model, arch, fit_draft(model, arch, block_size=8)


@pytest.mark.parametrize("which,K", [("fitted", 7), ("fitted", 3), ("random", 2)])
def test_greedy_speculation_with_a_block_draft_equals_plain(fitted, which, K):
    model, arch, good = fitted
    draft = good if which == "fitted" else make_draft(arch, 7, block_size=3, draft_vocab=20)[0].eval()
    plain = BuiltinRolloutEngine(model, None, BuiltinEngineConfig(num_draft_tokens=0))
    spec = BuiltinRolloutEngine(model, draft, BuiltinEngineConfig(num_draft_tokens=K))
    tokens = steps = 0
    for seed in (3, 4):
        prompts = random_prompts(6, seed)
        sp = SamplingParams(temperature=0.0, max_new_tokens=30, stop_token_ids=[int(random_prompts(1, seed)[0][0])])
        want = plain.generate(prompts, sp)
        got = spec.generate(prompts, sp)
        check_stats(got, K)
        for g, w in zip(got, want):
            assert g.output_ids == w.output_ids and g.finish_reason == w.finish_reason
            # tolerance: the same target, its verify window wider than plain decoding's one token
            # (fp32 attention over other key counts), as tests/test_rollout_engine.py.
            torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-5, rtol=0)
            tokens, steps = tokens + len(g.output_ids), steps + g.verify_steps
    if which == "fitted" and K == 7:
        assert tokens / steps > 1.2, tokens / steps  # it accepts drafted tokens: the equality is not vacuous


def test_adaptive_depth_with_a_block_draft_equals_plain(fitted):
    model, _, draft = fitted
    prompts = random_prompts(5, 11)
    sp = SamplingParams(temperature=0.0, max_new_tokens=24)
    want = BuiltinRolloutEngine(model, None, BuiltinEngineConfig(num_draft_tokens=0)).generate(prompts, sp)
    engine = BuiltinRolloutEngine(model, draft, BuiltinEngineConfig(num_draft_tokens=7, depth="adaptive"))
    got = engine.generate(prompts, sp)
    assert [g.output_ids for g in got] == [w.output_ids for w in want]
    assert set(engine.last_depths) <= set(range(8)) and engine.last_depths


@pytest.mark.parametrize(
    "K,sp",
    [
        (4, SamplingParams(1.0, max_new_tokens=3, seed=0)),
        (2, SamplingParams(0.8, top_k=10, top_p=0.9, max_new_tokens=3, seed=2)),
    ],
)
def test_sampled_tokens_with_a_block_draft_follow_the_policy(fitted, K, sp):
    model, _, draft = fitted
    res, accepted_per_row = sampled_tokens_distribution_check(model, draft, K, sp)
    assert_follows_the_policy(res)
    assert accepted_per_row > 0.3  # drafts are accepted and rejected: both paths run


def test_more_draft_tokens_than_the_block_is_one_line(fitted):
    model, _, draft = fitted
    with pytest.raises(ValueError) as e:
        BuiltinRolloutEngine(model, draft, BuiltinEngineConfig(num_draft_tokens=8))
    assert "\n" not in str(e.value) and "<= 7 (block_size 8 - 1)" in str(e.value)


# --- the directory: vLLM's layout, round trip, refusals -------------------------------------


def test_export_is_vllms_layout_and_round_trips(tmp_path):
    model, arch = make_target(0)
    draft, cfg = make_draft(arch, 5, block_size=6, draft_vocab=20, n_layers=2)
    path = str(tmp_path / "dflash")
    KIND.save(draft, path)
    conf = json.loads(open(os.path.join(path, "config.json")).read())
    assert conf["architectures"] == ["DFlashDraftModel"] and conf["model_type"] == "qwen3"
    assert conf["num_hidden_layers"] == 2 and conf["block_size"] == 6 and conf["draft_vocab_size"] == 20
    assert conf["dflash_config"] == {"mask_token_id": V - 1, "target_layer_ids": list(TAPS)}
    from safetensors import safe_open

    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert names == set(export_keys(draft.arch))
    assert {"fc.weight", "hidden_norm.weight", "layers.1.self_attn.k_norm.weight", "lm_head.weight", "d2t"} <= names
    assert not any("mask" in n or "embed" in n for n in names)
    mask = torch.load(os.path.join(path, MASK_FILE), weights_only=True)
    assert mask["mask_token_id"] == V - 1 and torch.equal(mask["embedding"], draft.mask_embedding.detach())
    found = KIND.read_arch(path)
    assert found == draft.arch and KIND.mismatches(found, draft.arch) == []
    KIND.check_weights(path, draft.arch)
    copy = KIND.build(found)
    KIND.load_into(copy, path)
    for (n, a), (_, b) in zip(draft.state_dict().items(), copy.state_dict().items()):
        assert torch.equal(a, b), n
    # A full-vocabulary draft carries no maps (vLLM has no draft_id_to_target_id then).
    full, _ = make_draft(arch, 6, block_size=4)
    KIND.save(full, str(tmp_path / "full"))
    with safe_open(str(tmp_path / "full" / "model.safetensors"), "pt") as f:
        assert "d2t" not in f.keys() and "t2d" not in f.keys()
    # The engine loads it from the directories alone, as the rollout worker does.
    engine = BuiltinRolloutEngine(model, copy, BuiltinEngineConfig(num_draft_tokens=5))
    assert engine.generate([[1, 2, 3]], SamplingParams(0.0, max_new_tokens=4))[0].output_ids


def test_a_directory_of_the_other_kind_is_one_line_naming_the_kind(tmp_path):
    model, arch = make_target(0)
    draft, _ = make_draft(arch, 5)
    KIND.save(draft, str(tmp_path / "dflash"))
    eagle = draft_kind("eagle3")
    from titan_spec.models.draft.eagle3.model import DraftArch, Eagle3Draft

    e3 = Eagle3Draft(DraftArch.from_target(arch, TAPS, 0))
    e3.reset_parameters()
    eagle.save(e3, str(tmp_path / "eagle3"))
    with pytest.raises(ValueError) as e:
        eagle.read_arch(str(tmp_path / "dflash"))
    assert "\n" not in str(e.value) and "set draft.kind = 'dflash'" in str(e.value), e.value
    with pytest.raises(ValueError) as e:
        KIND.read_arch(str(tmp_path / "eagle3"))
    assert "\n" not in str(e.value) and "set draft.kind = 'eagle3'" in str(e.value), e.value
    # Without its mask embedding the directory shares the target's row (SpecForge's layout):
    # it checks, and loading it without the policy's checkpoint is one line.
    os.remove(tmp_path / "dflash" / MASK_FILE)
    KIND.check_weights(str(tmp_path / "dflash"), draft.arch)
    with pytest.raises(ValueError) as e:
        KIND.load_into(KIND.build(draft.arch), str(tmp_path / "dflash"))
    assert "\n" not in str(e.value) and "no mask_embedding.pt (SpecForge's layout)" in str(e.value), e.value


@pytest.mark.parametrize(
    "args,key",
    [
        (["--draft.dflash.block_size", "40", "--rl.max_new_tokens", "32"], "draft.dflash.block_size"),
        (["--draft.dflash.block_size", "4", "--speculative.num_draft_tokens", "4"], "speculative.num_draft_tokens"),
        (["--draft.tap_layer_ids", "[]", "--draft.dflash.block_size", "1"], "draft.dflash.block_size"),
    ],
)
def test_config_errors_of_the_kind_are_one_line(args, key):
    with pytest.raises(ConfigError) as e:
        load_config(None, ["--rl.enable", "true", "--draft.kind", "dflash", *args])
    assert "\n" not in str(e.value) and key in str(e.value), e.value


# --- co-training under parallelism: pp = 2 (and FSDP dp = 2) equal pp = 1 ----------------------


@pytest.mark.needs_torch_2_14("pipeline parallelism (pp = 2)")
@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_dflash_under_fsdp_dp2_pp2_and_cp2_equals_one_process(tmp_path, many, kind):
    """The DFlash kind under each parallelism, against one process on the same 4-row batches:
    FSDP dp = 2 (2 rows a rank, the draft sharded, its normalizer summed over the ranks),
    pp = 2 (1F1B, 4 microbatches of a row, the block loss on the last stage from the taps the
    TapChannel delivers) and cp = 2 (zigzag shards: every rank gathers the documents' context
    rows, trains the blocks anchored on its rows, and reads the target's logits across the
    boundary through the halo). Equal losses, gradient norms and per-position accuracies at
    every step, and the exported draft (mask embedding included) within Adam's sign-flip bound.
    DSpark (the same backbone and blocks, its heads and objective) the same way."""
    from safetensors.torch import load_file

    from numerics import assert_adam_weights_close, assert_same_draft_accuracy, assert_same_draft_export

    common = (
        "--model.name",
        "llama3",
        "--training.seq_len",
        "64",
        "--training.steps",
        "3",
        "--draft.enable",
        "true",
        "--draft.kind",
        kind,
        "--draft.dflash.block_size",
        "4",
        "--draft.dflash.anchors_per_doc",
        "6",
        "--draft.draft_vocab_size",
        "24",
        "--draft.dflash.num_layers",
        "2",
        "--checkpoint.enable",
        "false",
        "--lr_scheduler.total_steps",
        "3",
        "--speculative.num_draft_tokens",
        "3",
    )
    pp1 = (
        *common,
        "--training.local_batch_size",
        "2",
        "--parallelism.pipeline_parallel_degree",
        "1",
        "--parallelism.data_parallel_shard_degree",
        "2",
    )
    pp2 = (
        *common,
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_schedule",
        "1F1B",
        "--parallelism.pipeline_parallel_microbatch_size",
        "1",
        "--parallelism.data_parallel_shard_degree",
        "1",
    )
    one = (*common, "--training.local_batch_size", "4", "--parallelism.pipeline_parallel_degree", "1")
    cp2 = (
        *common,
        "--training.local_batch_size",
        "4",
        "--parallelism.pipeline_parallel_degree",
        "1",
        "--parallelism.context_parallel_degree",
        "2",
        "--parallelism.data_parallel_shard_degree",
        "1",
    )
    dumps = [str(tmp_path / "one"), str(tmp_path / "pp1"), str(tmp_path / "pp2"), str(tmp_path / "cp2")]
    (ref,) = many(1, [(dumps[0], one)])
    runs = many(2, [(dumps[1], pp1), (dumps[2], pp2), (dumps[3], cp2)])
    # DSpark's draft/loss is its CE term, 0.1 of what it trains (mostly L1): not pinned to fall in 3 steps.
    assert ref[-1]["draft/loss"] < ref[0]["draft/loss"] or kind == "dspark"
    want = load_file(os.path.join(dumps[0], "draft/model.safetensors"))
    mask = torch.load(os.path.join(dumps[0], "draft", MASK_FILE), weights_only=True)["embedding"]
    for label, dump, rows in zip(("fsdp dp2", "pp2", "cp2"), dumps[1:], runs):
        assert [r["step"] for r in rows] == [r["step"] for r in ref] == [1, 2, 3]
        for a, b in zip(ref, rows):
            for key in ("loss", "grad_norm", "draft/loss", "draft/grad_norm"):
                assert b[key] == pytest.approx(a[key], rel=2e-5, abs=1e-6), (label, key, a, b)
            assert_same_draft_accuracy(a, b, 4 if kind == "dspark" else 3, label)
        assert_same_draft_export(load_file(os.path.join(dump, "draft/model.safetensors")), want, 3e-3, 3, label)
        got_mask = torch.load(os.path.join(dump, "draft", MASK_FILE), weights_only=True)["embedding"]
        assert_adam_weights_close(got_mask, mask, 3e-3, 3, msg=f"{label}: mask embedding")


def test_compiled_block_proposer_matches_eager(fitted):
    """The block proposer's cores compile with fullgraph=True (a graph break fails here, not
    silently eager)."""
    model, _, draft = fitted
    prompts = random_prompts(3, seed=6)
    sp = SamplingParams(1.0, max_new_tokens=12, seed=0)
    ref = BuiltinRolloutEngine(model, draft, BuiltinEngineConfig(num_draft_tokens=4)).generate(prompts, sp)
    cfg = BuiltinEngineConfig(num_draft_tokens=4, compile=True, compile_backend="aot_eager")
    got = BuiltinRolloutEngine(model, draft, cfg).generate(prompts, sp)
    assert [r.output_ids for r in got] == [r.output_ids for r in ref]
    assert [r.accepted_tokens for r in got] == [r.accepted_tokens for r in ref]


def test_dflash_taps_outside_the_target_are_one_line_before_the_start(capsys, monkeypatch):
    """The DFlash chain's plan (--plan, what run_train.sh runs first) with a tap past the
    8-layer target: exit 2 and one line naming the key and the allowed range."""
    from titan_spec.train.entry import main

    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("WORLD_SIZE", "1")
    capsys.readouterr()
    rc = main(["--plan", "--config", "train_configs/debug_cpu_dflash.toml", "--draft.tap_layer_ids", "[1, 9]"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert "draft.tap_layer_ids" in err[0] and "must be in 0..7" in err[0], err


def _specforge_dir(draft, path: str) -> None:
    """``draft`` as SpecForge writes a DFlash draft (specforge/modeling/draft/dflash.py and its
    export): config.json with block_size and num_target_layers at the top level and
    dflash_config's two keys, no draft_vocab_size / target_hidden_size; model.safetensors with
    the draft's own tensors only (no lm_head: SpecForge trains with the target's frozen one),
    and no mask_embedding.pt (it embeds a masked position by the target's row)."""
    from safetensors.torch import save_file

    a = draft.arch
    os.makedirs(path)
    conf = {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "hidden_size": a.hidden,
        "intermediate_size": a.intermediate,
        "num_attention_heads": a.n_heads,
        "num_key_value_heads": a.n_kv_heads,
        "head_dim": a.head_dim,
        "num_hidden_layers": a.n_layers,
        "vocab_size": a.vocab_size,
        "rms_norm_eps": a.norm_eps,
        "rope_theta": a.rope_theta,
        "max_position_embeddings": a.max_seq_len,
        "tie_word_embeddings": False,
        "block_size": a.block_size,
        "num_target_layers": 8,
        "dflash_config": {"mask_token_id": a.mask_token_id, "target_layer_ids": list(a.tap_layer_ids)},
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(conf, f)
    sd = draft.state_dict()
    own = [k for k in export_keys(a) if k not in ("lm_head.weight", "d2t", "t2d")]
    save_file({k: sd[k].contiguous() for k in own}, os.path.join(path, "model.safetensors"))


@pytest.mark.parametrize("tied", [True, False])
def test_a_specforge_directory_loads_with_the_targets_head_trains_and_exports(tmp_path, tied):
    """draft.init_from takes a directory SpecForge wrote: its lm_head and mask embedding are the
    target's (from the policy's HF checkpoint, as SpecForge trains and vLLM serves it), every
    other tensor is the directory's; the draft then trains one step and exports titan_spec's
    own layout, which loads back exactly."""
    from titan_spec.models.draft.dflash.io import shares_target_head
    from titan_spec.models.hf_io import save_hf

    from safetensors.torch import load_file

    model, arch = make_target(0)
    if not tied:  # the same weights with an lm_head of its own (the HF file then holds lm_head.weight)
        arch = dataclasses.replace(arch, tie_embeddings=False)
        untied = build_target_config(arch, tap_layer_ids=TAPS, max_seq_len=256).build()
        untied.init_weights(buffer_device=None)
        untied.load_state_dict(model.state_dict(), strict=False)
        with torch.no_grad():
            untied.lm_head.weight.normal_(0.0, 0.1)  # a head that is not the embedding
        model = untied.eval()
    hf = str(tmp_path / "policy")
    save_hf(model, hf, arch)
    hf_sd = load_file(os.path.join(hf, "model.safetensors"))
    assert ("lm_head.weight" in hf_sd) == (not tied)
    src, cfg = make_draft(arch, 7, block_size=4, n_layers=2)
    sf = str(tmp_path / "specforge")
    _specforge_dir(src, sf)
    assert shares_target_head(sf)
    found = KIND.read_arch(sf)
    assert KIND.mismatches(found, src.arch) == []
    KIND.check_weights(sf, src.arch)
    draft = KIND.initial(src.arch, None, 99)
    with pytest.raises(ValueError, match="needs the policy's HF directory") as e:
        KIND.load_into(draft, sf)
    assert "\n" not in str(e.value)
    KIND.load_into(draft, sf, hf)
    got, want = draft.state_dict(), src.state_dict()
    embed_VD = model.tok_embeddings.weight.detach()
    head_VD = embed_VD if tied else hf_sd["lm_head.weight"]
    assert tied or not torch.equal(head_VD, embed_VD)
    assert torch.equal(got["lm_head.weight"], head_VD)
    assert torch.equal(got["mask_embedding"], embed_VD[src.arch.mask_token_id])
    for k in export_keys(src.arch):
        if k != "lm_head.weight":
            assert torch.equal(got[k], want[k]), k
    # One training step of the loaded draft, then titan_spec's export and a round trip.
    tok, pos, labels = packed_batch(2)
    meta = doc_metadata_from_positions(pos)
    with torch.no_grad():
        logits, taps = model(tok, pos, meta)
    opt = torch.optim.AdamW(draft.parameters(), lr=1e-2)
    loss = KIND.loss(draft, logits, taps, pos, labels, meta, cfg, None, lambda c: c).loss
    assert torch.isfinite(loss)
    loss.backward()
    opt.step()
    assert not torch.equal(draft.lm_head.weight.detach(), head_VD)
    out = str(tmp_path / "exported")
    KIND.save(draft, out)
    assert not shares_target_head(out)
    # vLLM would serve the SpecForge directory with the target's head, which a draft push would
    # overwrite: refused in one line; the exported directory is served.
    from titan_spec.rollout.vllm.serving import dflash_misfit

    assert "SpecForge's layout" in dflash_misfit(hf, sf) and dflash_misfit(hf, out) is None
    back = KIND.build(KIND.read_arch(out))
    KIND.load_into(back, out)
    for (n, a), (_, b) in zip(draft.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), n


def test_a_specforge_directory_without_the_policys_checkpoint_is_one_line_before_the_start(tmp_path):
    """A SpecForge directory shares the target's head: a config that names one as draft.init_from
    with no model.hf_checkpoint (a random-init policy) is refused by the preflight."""
    from titan_spec.preflight.plan import validate_run

    base = ["--draft.enable", "true", "--draft.kind", "dflash", "--draft.offline", "true"]
    base += ["--job.dump_folder", str(tmp_path / "run")]
    d = validate_run(load_config(None, base, check_paths=False), disk=False).draft_arch
    sf = str(tmp_path / "specforge")
    _specforge_dir(KIND.initial(d, None, 1), sf)
    with pytest.raises(ConfigError, match="SpecForge's layout.*needs model.hf_checkpoint") as e:
        validate_run(load_config(None, base + ["--draft.init_from", sf], check_paths=False), disk=False)
    assert "\n" not in str(e.value)
