"""draft.data = "regenerated" (titan_spec/training/regenerate.py): offline draft batches made of the
warm start's own greedy completions of the task's prompts. Checked against an independent
reference: every packed document is a task prompt followed by exactly what the plain
built-in engine decodes greedily for that prompt alone (batch 1), trained on the
completion only; the batches are deterministic in (seed, batch index); the config refuses
the setting where no frozen warm start exists."""

import os
import re
import sys

import pytest

from titan_spec.config import ConfigError, GeneratedTaskConfig, TaskConfig, load_config
from titan_spec.data.loader import TaskDataLoader
from titan_spec.data.tokenizer import CharTokenizer
from titan_spec.training.regenerate import Regenerator
from titan_spec.rollout import SamplingParams, BuiltinEngineConfig, BuiltinRolloutEngine

sys.path.insert(0, os.path.dirname(__file__))
from helpers.hf_assets import write_tiny_qwen3  # noqa: E402

ROW = 64


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    pytest.importorskip("transformers")
    return write_tiny_qwen3(
        tmp_path_factory.mktemp("regen") / "hf", CharTokenizer().get_vocab_size(), seed=3, num_hidden_layers=2
    )


def _loader(tok, regenerate=None):
    task = TaskConfig(
        name="trace",
        generated=GeneratedTaskConfig(max_operand=20, min_count=2, max_count=6, trace_fraction=0.3),
        seed=5,
    )
    loader = TaskDataLoader(
        TaskDataLoader.Config(task=task), dp_world_size=1, dp_rank=0, tokenizer=tok, seq_len=ROW, local_batch_size=4
    )
    loader.use_regenerator(regenerate)
    return loader


def _documents(packed):
    """(tokens, labels) of every document of a packed batch (positions restart at 0)."""
    docs = []
    for row_t, row_p, row_l in zip(packed.input_BL.tolist(), packed.positions_BL.tolist(), packed.labels_BL.tolist()):
        for i, pos in enumerate(row_p):
            if pos == 0:
                docs.append(([], []))
            if docs:
                docs[-1][0].append(row_t[i])
                docs[-1][1].append(row_l[i])
    return docs


def test_regenerated_batches_are_the_policys_greedy_completions(policy):
    tok = CharTokenizer()
    regen = Regenerator(policy, tok.stop_ids, ROW)
    plain = BuiltinRolloutEngine.from_pretrained(policy, None, BuiltinEngineConfig(num_draft_tokens=0), max_seq_len=ROW)
    loader = _loader(tok, regen)
    packed = loader._global_batch(0)
    checked = 0
    for tokens, labels in _documents(packed):
        text = tok.decode(tokens)
        m = re.match(r"\d+[+-]\d+\?", text)
        if m is None or tokens[0] != tok.bos_id:
            continue  # padding, or a document the row cut (pack_documents truncates the last)
        n = len(tok.encode(m.group(0), add_bos=True))
        prompt = tokens[:n]
        want = plain.generate([prompt], SamplingParams(0.0, max_new_tokens=ROW - n, stop_token_ids=tok.stop_ids))[0]
        # The completion: the tokens trained on after the prompt (padding is not).
        got = [t for t, lab in zip(tokens[n:], labels[n - 1 :]) if lab != -100]
        assert got == tokens[n : n + len(got)]
        assert got == want.output_ids[: len(got)] and len(got) >= 1
        assert labels[n - 1 : n - 1 + len(got)] == got  # the completion is what is trained on ...
        assert all(lab == -100 for lab in labels[: n - 1])  # ... never the prompt
        checked += 1
    assert checked >= 4
    # Deterministic: a fresh loader (and a fresh regenerator) packs the same batch; the
    # demonstrations' batch is another one.
    again = _loader(tok, Regenerator(policy, tok.stop_ids, ROW))._global_batch(0)
    assert again.input_BL.equal(packed.input_BL) and again.labels_BL.equal(packed.labels_BL)
    assert not _loader(tok)._global_batch(0).input_BL.equal(packed.input_BL)
    # Memoized by prompt: packing the batch again decodes nothing new.
    size = len(regen.memo)
    loader._global_batch(0)
    assert len(regen.memo) == size


def test_regenerated_needs_a_frozen_warm_start():
    path = os.path.join(os.path.dirname(__file__), "..", "train_configs", "debug_cpu_draft.toml")
    cfg = load_config(path, [], check_paths=False)
    assert cfg.draft.data == "regenerated"  # the embedded default's offline draft
    for overrides, needle in (
        (["--model.hf_checkpoint", ""], "draft.data = 'regenerated' needs model.hf_checkpoint"),
        (["--draft.offline", "false"], "draft.data = 'regenerated' needs offline draft training"),
    ):
        with pytest.raises(ConfigError, match=re.escape(needle)) as info:
            load_config(path, overrides, check_paths=False)
        assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="draft.data"):
        load_config(path, ["--draft.data", "regenerate"], check_paths=False)
