"""The tapped target against transformers: logits, taps, packed documents, HF round trip."""

import json
import os

import pytest
import torch

import titan_spec  # noqa: F401
from titan_spec.models.hf_io import HFCheckpointError, load_hf_into, read_hf_arch, save_hf
from titan_spec.models.registry import build_target_config
from titan_spec.models.target import default_tap_layer_ids

from helpers.hf_assets import load_target

transformers = pytest.importorskip("transformers")

V, L = 97, 6


def _hf_qwen3(path, tie=False):
    cfg = transformers.Qwen3Config(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=L,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
        rope_theta=10000.0,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    model.save_pretrained(path, safe_serialization=True)
    return model


def _hf_llama(path):
    cfg = transformers.LlamaConfig(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=L,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=10000.0,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.mark.parametrize("family", ["qwen3", "qwen3_tied", "llama"])
def test_logits_and_taps_match_transformers(tmp_path, family):
    hf = {"qwen3": lambda p: _hf_qwen3(p), "qwen3_tied": lambda p: _hf_qwen3(p, tie=True), "llama": _hf_llama}[family](
        tmp_path
    )
    model, _ = load_target(tmp_path)
    tok = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(24).repeat(2, 1)
    with torch.no_grad():
        logits, taps = model(tok, pos, model.get_attention_masks(pos))
        ref = hf(tok, output_hidden_states=True)
    # tolerance: one fp32 forward of the same weights as transformers' (other kernels and GEMM blockings)
    torch.testing.assert_close(logits, ref.logits, atol=1e-4, rtol=0)
    assert len(taps.hidden) == 3
    torch.testing.assert_close(taps.embeds_BLD, ref.hidden_states[0], atol=0, rtol=0)
    for k, tap in zip((1, 2, 4), taps.hidden):
        # tolerance: the same forward's hidden states (fp32, other kernels)
        torch.testing.assert_close(tap, ref.hidden_states[k + 1], atol=1e-4, rtol=0)


def test_packed_documents_equal_separate_forwards(tmp_path):
    hf = _hf_qwen3(tmp_path)
    model, _ = load_target(tmp_path, taps=())
    g = torch.Generator().manual_seed(2)
    docs = [torch.randint(0, V, (n,), generator=g) for n in (9, 1, 14)]
    packed = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(len(d)) for d in docs])[None]
    with torch.no_grad():
        out = model(packed, pos, model.get_attention_masks(pos))[0]
        start = 0
        for d in docs:
            # tolerance: one fp32 forward of the same weights, packed vs one document (other shapes, other blockings)
            torch.testing.assert_close(out[start : start + len(d)], hf(d[None]).logits[0], atol=1e-4, rtol=0)
            start += len(d)


def test_default_tap_ids():
    assert default_tap_layer_ids(36) == (1, 17, 32)
    assert default_tap_layer_ids(8) == (1, 3, 4)


def test_export_round_trip_exact(tmp_path):
    hf = _hf_qwen3(tmp_path / "in")
    model, arch = load_target(tmp_path / "in")
    save_hf(model, str(tmp_path / "out"), arch)
    assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "model.safetensors"]
    assert read_hf_arch(str(tmp_path / "out")) == arch
    back = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path / "out").eval()
    for (name, a), (_, b) in zip(sorted(hf.state_dict().items()), sorted(back.state_dict().items())):
        assert torch.equal(a, b), name


def test_sharded_index_is_read(tmp_path):
    from safetensors.torch import load_file, save_file

    _hf_qwen3(tmp_path / "one")
    ref_model, arch = load_target(tmp_path / "one")
    sd = load_file(tmp_path / "one" / "model.safetensors")
    keys = sorted(sd)
    shard = tmp_path / "two"
    shard.mkdir()
    (shard / "config.json").write_text((tmp_path / "one" / "config.json").read_text())
    halves = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for fname, ks in halves.items():
        save_file({k: sd[k] for k in ks}, shard / fname)
    weight_map = {k: f for f, ks in halves.items() for k in ks}
    (shard / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    model, _ = load_target(shard)
    for (n, a), (_, b) in zip(sorted(model.state_dict().items()), sorted(ref_model.state_dict().items())):
        assert torch.equal(a, b), n


def test_bad_checkpoints_give_clear_errors(tmp_path):
    with pytest.raises(HFCheckpointError, match="is not a directory"):
        read_hf_arch(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(HFCheckpointError, match="has no config.json"):
        read_hf_arch(str(tmp_path / "empty"))
    _hf_qwen3(tmp_path / "ok")
    arch = read_hf_arch(str(tmp_path / "ok"))
    # weights missing
    os.remove(tmp_path / "ok" / "model.safetensors")
    model = build_target_config(arch).build()
    with pytest.raises(HFCheckpointError, match="no model.safetensors"):
        load_hf_into(model, str(tmp_path / "ok"), arch)
    # config that does not match the target
    _hf_qwen3(tmp_path / "ok2")
    cfg = json.loads((tmp_path / "ok2" / "config.json").read_text())
    cfg["hidden_size"] = 128
    (tmp_path / "ok2" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HFCheckpointError, match="does not match the target: dim: checkpoint 128 vs model 64"):
        load_hf_into(model, str(tmp_path / "ok2"), arch)
    # unsupported model type
    cfg["model_type"] = "gpt2"
    (tmp_path / "ok2" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HFCheckpointError, match="model_type 'gpt2' is not supported"):
        read_hf_arch(str(tmp_path / "ok2"))
    # index naming a missing shard
    (tmp_path / "ok" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "x.safetensors"}}))
    with pytest.raises(HFCheckpointError, match="missing shard"):
        load_hf_into(model, str(tmp_path / "ok"), arch)
