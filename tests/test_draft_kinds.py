"""The draft seam (models/draft/base.py): the registry, the protocol the trainer drives, the one
tap-id validator and the import direction inside models/draft/.

The protocol test registers a tiny second kind (a linear score over one tap, not EAGLE-3)
and drives DraftTraining through normalizer, loss, step, metrics and export on CPU; its
loss and gradient are closed forms, so the test fails if DraftTraining bypasses the kind
(e.g. builds an Eagle3Draft or computes TTT counts itself).
"""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
import torch.nn as nn
from torchtitan.components.loss import IGNORE_INDEX

from titan_spec.config import ConfigError, DraftConfig, load_config
from titan_spec.config.draft_kinds import DRAFT_KINDS, tap_ids_problem
from titan_spec.config.validate import SECTION_CHECKS
from titan_spec.training.draft import DraftTraining
from titan_spec.models.draft import KINDS, DraftKind, DraftLossResult, draft_kind
from titan_spec.models.draft.eagle3.model import DraftArch
from titan_spec.models.target import Taps, validate_tap_layer_ids
from titan_spec.rollout.weight_names import sglang_tap_misfit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --- registry ------------------------------------------------------------------------------


def test_unknown_draft_kind_is_one_line_listing_the_allowed_kinds():
    with pytest.raises(ValueError) as e:
        draft_kind("mtp")
    msg = str(e.value)
    assert "\n" not in msg and "draft.kind = 'mtp'" in msg and "allowed: 'eagle3'" in msg, msg
    with pytest.raises(ConfigError) as e:
        load_config(None, ["--draft.kind", "mtp"])
    assert "\n" not in str(e.value) and "draft.kind" in str(e.value) and "'eagle3'" in str(e.value), e.value
    assert draft_kind("eagle3").name == "eagle3" == DraftArch.kind


def test_registry_and_config_name_the_same_kinds():
    assert set(KINDS) == set(DRAFT_KINDS)
    assert all(KINDS[name].name == name for name in DRAFT_KINDS)


# --- a second kind, driven by the trainer's DraftTraining ---------------------------------


@dataclass(frozen=True)
class _FakeArch:
    kind: ClassVar[str] = "fake"
    dim: int
    tap_layer_ids: tuple[int, ...] = (2,)
    vocab_size: int = 10
    draft_vocab_size: int = 10


class _FakeDraft(nn.Module):
    """score_t = h_t . w over the single tap."""

    def __init__(self, arch: _FakeArch):
        super().__init__()
        self.arch = arch
        self.w = nn.Parameter(torch.zeros(arch.dim))

    def forward(self, h_TD, valid_T, count_S):
        score_T = h_TD @ self.w
        s = (score_T * valid_T).sum()
        return DraftLossResult(
            loss=s / count_S[0].clamp(min=1),
            loss_sum_S=s.detach()[None],
            count_S=valid_T.sum()[None],
            correct_S=((score_T > 0) & valid_T).sum()[None],
        )


class _FakeKind(DraftKind):
    name = "fake"

    def __init__(self):
        self.seen_meta, self.saved = [], {}

    def default_tap_layer_ids(self, n_layers):
        return (n_layers - 1,)

    def arch_from_target(self, target_arch, tap_layer_ids, draft_vocab_size, cfg):
        return _FakeArch(dim=target_arch.dim, tap_layer_ids=tuple(tap_layer_ids))

    def build(self, arch):
        return _FakeDraft(arch)

    def initial(self, arch, token_counts_V, seed):
        d = _FakeDraft(arch)
        with torch.no_grad():
            d.w.copy_(torch.arange(arch.dim, dtype=torch.float32) - seed)
        return d

    def normalizer_counts(self, positions_BL, labels_BL, meta, cfg):
        self.seen_meta.append(meta)
        return (labels_BL != IGNORE_INDEX).sum().reshape(1)

    def loss(self, model, logits_BLV, taps, positions_BL, labels_BL, meta, cfg, count_S, global_count):
        self.seen_meta.append(meta)
        valid_T = (labels_BL != IGNORE_INDEX).reshape(-1)
        if count_S is None:
            count_S = global_count(valid_T.sum().reshape(1))
        return model(taps.hidden[0].detach().reshape(valid_T.numel(), -1), valid_T, count_S)

    def read_arch(self, path):
        raise NotImplementedError

    def mismatches(self, found, want):
        return []

    def check_weights(self, path, arch):
        pass

    def save(self, model, path):
        self.saved[path] = {k: v.clone() for k, v in model.state_dict().items()}

    def load_into(self, model, path):
        raise NotImplementedError


def test_draft_training_drives_a_second_kind_through_the_protocol(monkeypatch):
    kind = _FakeKind()
    monkeypatch.setitem(KINDS, "fake", kind)
    D, seed = 4, 1
    cfg = DraftConfig(kind="fake", lr=0.1, max_norm=100.0)
    dt = DraftTraining(
        cfg,
        _FakeArch(dim=D),
        device=torch.device("cpu"),
        dp_mesh=None,
        lr_scheduler_cfg=load_config(None).lr_scheduler,
        training_steps=10,
        token_counts_V=None,
        seed=seed,
    )
    assert isinstance(dt.draft, _FakeDraft)
    w0 = torch.arange(D, dtype=torch.float64) - seed  # the fake kind's initial()
    assert torch.equal(dt.draft.w.detach().double(), w0)

    g = torch.Generator().manual_seed(0)
    B, L = 2, 3
    h_BLD = torch.randn(B, L, D, generator=g)
    labels_BL = torch.tensor([[5, IGNORE_INDEX, 7], [1, 2, IGNORE_INDEX]])
    positions_BL = torch.arange(L).repeat(B, 1)
    meta = object()  # whatever the trainer hands over (a CPMetadata under CP) reaches the kind as is
    count_S = dt.normalizer([positions_BL], [labels_BL], [meta])
    assert count_S.tolist() == [4]
    result = dt.loss(
        torch.randn(B, L, 10, generator=g), Taps(torch.zeros(B, L, D), (h_BLD,)), positions_BL, labels_BL, meta, count_S
    )
    assert kind.seen_meta == [meta, meta]

    # Closed forms (fp64): loss = sum_valid h_t . w / n, grad = sum_valid h_t / n.
    valid = (labels_BL != IGNORE_INDEX).reshape(-1)
    h_TD = h_BLD.reshape(-1, D).double()
    scores = h_TD @ w0
    assert result.loss.item() == pytest.approx(float(scores[valid].sum() / 4), rel=1e-6)
    result.loss.backward()
    grad = h_TD[valid].sum(0) / 4
    lr = dt.scheduler.schedulers[0].get_last_lr()[0]
    assert lr > 0 and grad.abs().min() > 1e-3
    assert dt.step(0)
    # AdamW's first step (no weight decay, bias-corrected): w -= lr * g / (|g| + eps).
    want = w0 - lr * grad / (grad.abs() + 1e-8)
    assert torch.allclose(dt.draft.w.detach().double(), want, atol=1e-6)

    m = dt.metrics()
    assert m["draft/tokens_0"] == 4
    assert m["draft/loss"] == pytest.approx(float(scores[valid].sum() / 4), rel=1e-6)
    assert m["draft/acc_0"] == pytest.approx(float((scores[valid] > 0).sum() / 4))

    dt.export("/elsewhere/draft", write=False)  # a rank that is not the run's one writer
    assert not kind.saved
    dt.export("/nowhere/draft", write=True)
    assert list(kind.saved) == ["/nowhere/draft"]
    assert torch.equal(kind.saved["/nowhere/draft"]["w"], dt.draft.w.detach())


# --- one tap-id validator -----------------------------------------------------------------


def _eagle3_arch(taps):
    return DraftArch(
        hidden=8,
        n_heads=2,
        n_kv_heads=1,
        head_dim=4,
        intermediate=16,
        target_hidden=8,
        vocab_size=20,
        draft_vocab_size=20,
        rope_theta=1e4,
        norm_eps=1e-6,
        max_seq_len=32,
        tap_layer_ids=taps,
    )


@pytest.mark.parametrize("ids", [[1, 2], [1, 1, 2], [0, 1, 2, 3]])
def test_every_tap_id_check_says_what_the_one_validator_says(ids):
    want = tap_ids_problem(ids, count=DRAFT_KINDS["eagle3"])
    assert want
    with pytest.raises(ConfigError) as e:
        SECTION_CHECKS[DraftConfig](DraftConfig(tap_layer_ids=ids))
    assert str(e.value) == want
    with pytest.raises(ValueError) as e:
        _eagle3_arch(tuple(ids)).validate()
    assert str(e.value) == want
    assert sglang_tap_misfit(ids, 8) == want


def test_range_checks_say_what_the_one_validator_says():
    want = tap_ids_problem((1, 99, 2), 8)
    assert want == "tap layer ids [99] are out of range: the target has 8 layers, so ids must be in 0..7"
    with pytest.raises(ValueError) as e:
        validate_tap_layer_ids((1, 99, 2), 8)
    assert str(e.value) == want
    assert validate_tap_layer_ids((1, 3, 4), 8) is None


# --- imports inside models/draft/ ----------------------------------------------------------


def _module_imports(path: str) -> tuple[set[str], list[str]]:
    """(titan_spec modules imported at module level, titan_spec imports inside functions)."""
    tree = ast.parse(open(path).read())
    top, local = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("titan_spec"):
            names = {node.module} | {f"{node.module}.{a.name}" for a in node.names}
            (top.update(names) if node in tree.body else local.append(node.module))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("titan_spec"):
                    (top.add(a.name) if node in tree.body else local.append(a.name))
    return top, local


def test_models_draft_imports_form_no_cycle_and_none_is_function_local():
    base = os.path.join(ROOT, "titan_spec", "models", "draft")
    mods = {}
    for d, _, files in os.walk(base):
        for f in files:
            if f.endswith(".py") and f != "__init__.py":
                rel = os.path.relpath(os.path.join(d, f), ROOT)[:-3].replace(os.sep, ".")
                mods[rel] = os.path.join(d, f)
    graph = {}
    for name, path in mods.items():
        top, local = _module_imports(path)
        assert not local, f"{name} imports {local} inside a function"
        graph[name] = {m for m in top if m in mods and m != name}
    seen, stack = set(), []

    def visit(n):
        assert n not in stack, f"import cycle: {' -> '.join(stack[stack.index(n) :] + [n])}"
        if n in seen:
            return
        stack.append(n)
        for m in graph[n]:
            visit(m)
        stack.pop()
        seen.add(n)

    for n in graph:
        visit(n)
    assert "titan_spec.models.draft.eagle3.ttt" in graph["titan_spec.models.draft.eagle3.model"]


def test_builtin_engine_names_a_draft_kind_it_cannot_serve():
    from titan_spec.models.registry import build_target_config, flavor_arch, with_vocab
    from titan_spec.rollout.builtin.engine import BuiltinRolloutEngine

    arch = with_vocab(flavor_arch("qwen3", "tiny"), 40)
    target = build_target_config(arch, max_seq_len=64).build()
    target.init_weights(buffer_device=None)

    class Arch(_FakeArch):
        def misfits(self, target_vocab, target_dim):
            return []

    draft = _FakeDraft(Arch(dim=arch.dim, vocab_size=40, draft_vocab_size=40))
    draft.register_buffer("d2t", torch.zeros(40, dtype=torch.long))
    with pytest.raises(ValueError, match=r"no cached proposer for draft kind 'fake' \(it has 'eagle3'") as e:
        BuiltinRolloutEngine(target, draft)
    assert "\n" not in str(e.value)
