"""EAGLE-3 draft: TTT shifts and masks by hand, the loss against a direct computation,
gradient isolation, vocab mapping, export/import in the SGLang format, bad inputs."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from torchtitan.components.loss import IGNORE_INDEX

import titan_spec  # noqa: F401
from titan_spec.models.attention import doc_metadata_from_positions
from titan_spec.models.draft.eagle3.model import DraftArch, Eagle3Draft
from titan_spec.models.draft.vocab import build_vocab_mapping
from titan_spec.models.draft.eagle3.io import EXPORT_KEYS, load_draft_into, read_draft_arch, save_draft
from titan_spec.models.draft.eagle3.ttt import ttt_shifts, ttt_targets

ARCH = DraftArch(
    hidden=32,
    n_heads=4,
    n_kv_heads=2,
    head_dim=8,
    intermediate=48,
    target_hidden=24,
    vocab_size=50,
    draft_vocab_size=20,
    rope_theta=1e4,
    norm_eps=1e-6,
    max_seq_len=128,
    tap_layer_ids=(1, 3, 4),
)


def _draft(seed=0, arch=ARCH):
    torch.manual_seed(seed)
    d = Eagle3Draft(arch)
    d.reset_parameters()
    counts = torch.arange(arch.vocab_size, 0, -1).float()  # token 0 most frequent
    d.set_vocab_mapping(*build_vocab_mapping(counts, arch.draft_vocab_size))
    return d


def test_ttt_shifts_by_hand():
    # Two documents: [a b c d] and [e f g]; labels ignore the prompt token b->c (index 1)
    # and every document's last token.
    positions = torch.tensor([0, 1, 2, 3, 0, 1, 2])
    labels = torch.tensor([11, IGNORE_INDEX, 13, IGNORE_INDEX, 15, 16, IGNORE_INDEX])
    (src0, v0), (src1, v1), (src2, v2) = ttt_shifts(positions, labels, 3)
    # step 0: row t reads token t+1 and is trained on the target at t+1
    assert src0.tolist() == [1, 2, 3, 4, 5, 6, 6]
    assert v0.tolist() == [False, True, False, False, True, False, False]
    # step 1: token t+2; row 0 -> target 2 (label 13, valid); row 4 -> 6 (ignored)
    assert src1.tolist() == [2, 3, 4, 5, 6, 6, 6]
    assert v1.tolist() == [True, False, False, False, False, False, False]
    # step 2: row 0 -> 3 is the end of doc 1; row 4 -> 6 past the end of doc 2
    assert v2.tolist() == [False] * 7


def test_vocab_mapping_top_n_and_ties():
    counts = torch.tensor([5, 0, 9, 5, 1, 9])
    d2t, t2d = build_vocab_mapping(counts, 3)
    ids = (torch.arange(3) + d2t).tolist()
    assert ids == [0, 2, 5]  # 9, 9, then the lower id of the two 5s
    assert t2d.tolist() == [True, False, True, False, False, True]
    with pytest.raises(ValueError, match="must be in 1..6"):
        build_vocab_mapping(counts, 7)


def _batch(T_docs=(7, 1, 9), V=50, Ht=24, H=32, seed=1):
    g = torch.Generator().manual_seed(seed)
    pos = torch.cat([torch.arange(n) for n in T_docs])
    T = pos.numel()
    labels = torch.randint(0, V, (T,), generator=g)
    ends = torch.cumsum(torch.tensor(T_docs), 0) - 1
    labels[ends] = IGNORE_INDEX
    taps = tuple(torch.randn(T, Ht, generator=g) for _ in range(3))
    return pos, labels, taps, torch.randn(T, H, generator=g), torch.randn(T, V, generator=g)


def test_ttt_loss_equals_direct_dense_computation():
    """The unroll (branch attention, masks, soft labels, decay) against a direct per-row
    recomputation with an explicit key list per query."""
    d = _draft()
    pos, labels, taps, embeds, logits = _batch()
    meta = doc_metadata_from_positions(pos[None])
    steps = 4
    tg = ttt_targets(d, pos, labels, logits, steps)
    out = d(taps, embeds, pos, meta, tg, decay=0.8)

    # Direct: keep every step's k, v; attend with an explicit set of keys per row.
    T = pos.numel()
    doc = torch.cumsum((pos == 0).long(), 0)
    h = d.fc(torch.cat(taps, -1))
    ks, vs, expected = [], [], 0.0
    for j, (src, valid, tgt_p) in enumerate(tg):
        q, k, v = d.qkv(h, embeds[src], pos + j)
        ks.append(k)
        vs.append(v)
        rows = []
        for t in range(T):
            keys = [ks[0][s] for s in range(T) if doc[s] == doc[t] and s <= t] + [ks[i][t] for i in range(1, j + 1)]
            vals = [vs[0][s] for s in range(T) if doc[s] == doc[t] and s <= t] + [vs[i][t] for i in range(1, j + 1)]
            K, Vv = torch.stack(keys), torch.stack(vals)  # [n, K, Hd]
            Kq = K.repeat_interleave(2, dim=1)
            Vq = Vv.repeat_interleave(2, dim=1)
            att = torch.softmax(torch.einsum("nh,mnh->nm", q[t], Kq) * ARCH.head_dim**-0.5, dim=-1)
            rows.append(torch.einsum("nm,mnh->nh", att, Vq))
        h, lg = d.finish(h, torch.stack(rows))
        ce = -(tgt_p * torch.log_softmax(lg, -1)).sum(-1)
        expected = expected + 0.8**j * (ce * valid).sum() / valid.sum().clamp(min=1)
        assert int(out.count_S[j]) == int(valid.sum())
    # tolerance: one fp32 forward of the same weights, summed in another order (no optimizer step)
    torch.testing.assert_close(out.loss, expected, atol=1e-5, rtol=1e-5)


def test_targets_mask_argmax_outside_draft_vocab():
    d = _draft()
    pos, labels, _, _, logits = _batch()
    outside = int((~d.t2d).nonzero()[0])
    logits[:, outside] = 100.0  # the target's argmax is outside the draft vocab everywhere
    for _, valid, tgt_p in ttt_targets(d, pos, labels, logits, 3):
        assert not valid.any()
        # tolerance: a softmax row sums to 1 to fp32 rounding (torch's fp32 default)
        torch.testing.assert_close(tgt_p.sum(-1), torch.ones(len(pos)))


def test_draft_loss_reaches_only_the_draft():
    """Taps, embeddings and soft labels are detached: no gradient flows back into them."""
    d = _draft()
    pos, labels, taps, embeds, logits = _batch()
    taps = tuple(t.requires_grad_() for t in taps)
    embeds.requires_grad_()
    logits.requires_grad_()
    tg = ttt_targets(d, pos, labels, logits, 3)
    out = d(taps, embeds, pos, doc_metadata_from_positions(pos[None]), tg)
    out.loss.backward()
    assert all(t.grad is None for t in (*taps, embeds, logits))
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in d.parameters())


def test_export_import_round_trip_and_exact_format(tmp_path):
    d = _draft(seed=3)
    save_draft(d, str(tmp_path / "draft"))
    assert sorted(os.listdir(tmp_path / "draft")) == ["config.json", "model.safetensors"]
    tensors = load_file(tmp_path / "draft" / "model.safetensors")
    assert sorted(tensors) == sorted(EXPORT_KEYS)
    # Every tensor's shape in SGLang's layout: tests/test_draft_sglang_forward.py.
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert tensors["fc.weight"].dtype == torch.float32
    cfg = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["draft_vocab_size"] == 20 and cfg["vocab_size"] == 50 and cfg["target_hidden_size"] == 24
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert cfg["num_hidden_layers"] == 1
    assert read_draft_arch(str(tmp_path / "draft")) == ARCH

    back = Eagle3Draft(ARCH)
    load_draft_into(back, str(tmp_path / "draft"))
    for (k, x), (_, y) in zip(sorted(d.state_dict().items()), sorted(back.state_dict().items())):
        assert torch.equal(x, y), k


def test_import_rejects_a_draft_for_another_target(tmp_path):
    save_draft(_draft(), str(tmp_path / "draft"))
    import dataclasses

    other = Eagle3Draft(dataclasses.replace(ARCH, target_hidden=48))
    with pytest.raises(ValueError, match="does not match the target: target_hidden: directory 24 vs target/config 48"):
        load_draft_into(other, str(tmp_path / "draft"))
    other = Eagle3Draft(dataclasses.replace(ARCH, vocab_size=64))
    with pytest.raises(ValueError, match="vocab_size: directory 50 vs target/config 64"):
        load_draft_into(other, str(tmp_path / "draft"))
    with pytest.raises(ValueError, match="has no config.json"):
        load_draft_into(other, str(tmp_path))


def test_bad_draft_arch():
    import dataclasses

    with pytest.raises(ValueError, match="three distinct"):
        Eagle3Draft(dataclasses.replace(ARCH, tap_layer_ids=(1, 1, 2)))
    with pytest.raises(ValueError, match="draft_vocab_size = 60 must be in 1..50"):
        Eagle3Draft(dataclasses.replace(ARCH, draft_vocab_size=60))


def test_interrupted_export_leaves_the_old_directory(tmp_path, monkeypatch):
    import titan_spec.models.hf_io as hf_io

    save_draft(_draft(seed=1), str(tmp_path / "draft"))
    before = (tmp_path / "draft" / "model.safetensors").read_bytes()

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(hf_io, "save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        save_draft(_draft(seed=2), str(tmp_path / "draft"))
    assert (tmp_path / "draft" / "model.safetensors").read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["draft"]  # no temporary directory left behind
