"""The SGLang rollout engine without SGLang: server arguments, weight names, the two custom
loaders, the HTTP payloads and push bracket, result parsing, restarts and clear errors.

SGLang 0.5.23 needs CUDA, so its HTTP surface is played here by ``StubSGLang``
(tests/sglang_stub.py): a real HTTP server (http.server, in a thread) that answers SGLang's
endpoints with SGLang's response shapes, records every request, and fails where SGLang
0.5.23 fails (test_sglang_behaviour.py tests the engine against those failures). It says
nothing about SGLang itself, which the GPU test at the end exercises.

No outcome depends on how fast this machine is: every request that gets an answer runs
under a 60 s request timeout; a short timeout is only ever set for a wait that cannot end
otherwise (a stub that hangs until the test ends, a process that never serves).
"""

import importlib
import json
import os
import signal
import subprocess
import sys
import time
import types

import pytest
import torch
from sglang_stub import V, StubSGLang

import titan_spec  # noqa: F401
from titan_spec.platform import on_cpu
from titan_spec.config import ConfigError, load_config
from titan_spec.data.tokenizer import CharTokenizer
from titan_spec.models.draft.eagle3.model import DraftArch, Eagle3Draft
from titan_spec.models.draft.eagle3.io import EXPORT_KEYS, save_draft
from titan_spec.models.hf_io import load_hf_into, read_hf_arch, save_hf
from titan_spec.models.registry import build_target_config, flavor_arch, with_vocab
from titan_spec.rollout import RolloutEngine, SamplingParams
from titan_spec.rollout.sglang.client import (
    EngineDied,
    HttpClient,
    SGLangError,
    SGLangStartError,
    server_cli_args,
)
from titan_spec.rollout.sglang.engine import (
    SEED_MIX,
    SGLangRolloutEngine,
    rollout_from_result,
    sampling_to_sglang,
    sglang_server_args,
)
from titan_spec.rollout.sglang.server.titan_spec_sglang_loaders import (
    DRAFT_LOADER,
    TARGET_LOADER,
    load_draft_weights,
    load_target_weights,
)
from titan_spec.rollout.weight_names import check_draft_fits_policy, draft_to_export_names, policy_to_hf_names
from conftest import load_checked

TAPS = (1, 3, 4)

# DESIGN.md, "Draft (EAGLE-3, SpecForge/SGLang layout)": the export keys, exactly.
DESIGN_DRAFT_KEYS = [
    "fc.weight",
    *(
        f"midlayer.{k}.weight"
        for k in (
            "input_layernorm",
            "hidden_norm",
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "post_attention_layernorm",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        )
    ),
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
]


def _target(family="qwen3", seed=0):
    torch.manual_seed(seed)
    arch = with_vocab(flavor_arch(family, "tiny"), V)
    model = build_target_config(arch, tap_layer_ids=TAPS).build()
    model.init_weights(buffer_device=None)
    return model, arch


def _draft(arch, seed=0, draft_vocab=16):
    torch.manual_seed(seed)
    d = Eagle3Draft(DraftArch.from_target(arch, TAPS, draft_vocab))
    d.reset_parameters()
    d.d2t.copy_(torch.arange(draft_vocab) * 2)  # draft id i -> target id 3i: a non-trivial map
    return d


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """A tiny policy HF directory and its exported draft, written by the real exporters."""
    root = tmp_path_factory.mktemp("sglang")
    model, arch = _target()
    draft = _draft(arch)
    save_hf(model, str(root / "policy"), arch, tokenizer=CharTokenizer())
    save_draft(draft, str(root / "draft"))
    return types.SimpleNamespace(
        policy=str(root / "policy"), draft=str(root / "draft"), model=model, arch=arch, d=draft
    )


def _cfg(**kw):
    over = [
        f"--rollout.sglang.{k}={json.dumps(v) if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else v}"
        for k, v in kw.items()
    ]
    return load_config(None, over).rollout.sglang


# --- server arguments -------------------------------------------------------------------


def test_server_args_from_config_and_cli(dirs):
    cfg = _cfg(mem_fraction_static=0.55, port=31000, enable_memory_saver=True)
    args = sglang_server_args(cfg, dirs.policy, dirs.draft, 4)
    assert args == {
        "model_path": dirs.policy,
        "host": "127.0.0.1",
        "port": 31000,
        "tp_size": 1,
        "dtype": "bfloat16",
        "mem_fraction_static": 0.55,
        "skip_tokenizer_init": True,
        "custom_weight_loader": [TARGET_LOADER, DRAFT_LOADER],
        "enable_memory_saver": True,
        "base_gpu_id": 0,
        "speculative_algorithm": "EAGLE3",
        "speculative_draft_model_path": dirs.draft,
        "speculative_num_steps": 4,
        "speculative_eagle_topk": 1,
        "speculative_num_draft_tokens": 5,
        "enable_draft_weights_cpu_backup": True,
        # On CPU (this machine): SGLang's CPU engine, EAGLE-3 on its CPU attention backend.
        **(
            {
                "device": "cpu",
                "attention_backend": "intel_amx",
                "disable_cuda_graph": True,
                "max_total_tokens": 8192,
                "sleep_on_idle": True,
            }
            if on_cpu()
            else {}
        ),
    }
    # Tree drafting, an explicit verify width, and a pass-through field.
    tree = sglang_server_args(_cfg(eagle_topk=4, num_verify_tokens=16), dirs.policy, dirs.draft, 3)
    assert (tree["speculative_num_steps"], tree["speculative_eagle_topk"], tree["speculative_num_draft_tokens"]) == (
        3,
        4,
        16,
    )
    plain = sglang_server_args(
        load_config(None, ["--rollout.sglang.server_args", "{cuda_graph_max_bs_decode = 8}"]).rollout.sglang,
        dirs.policy,
        None,
        0,
    )
    assert not any(k.startswith("speculative") for k in plain) and plain["cuda_graph_max_bs_decode"] == 8
    assert plain.get("attention_backend", "torch_native") == "torch_native"  # plain decoding: SGLang's own CPU path
    assert 0 < plain["port"] < 65536  # port 0 = a free one
    with pytest.raises(ValueError, match="titan_spec sets itself"):
        sglang_server_args(
            load_config(None, ["--rollout.sglang.server_args", "{mem_fraction_static = 0.9}"]).rollout.sglang,
            dirs.policy,
            None,
            0,
        )

    argv = server_cli_args(args)
    joined = " ".join(argv)
    assert f"--model-path {dirs.policy}" in joined and "--speculative-algorithm EAGLE3" in joined
    assert f"--custom-weight-loader {TARGET_LOADER} {DRAFT_LOADER}" in joined
    assert "--skip-tokenizer-init" in argv and "--enable-draft-weights-cpu-backup" in argv
    assert "--speculative-num-draft-tokens 5" in joined and "--mem-fraction-static 0.55" in joined
    assert "--enable-memory-saver" in argv and "True" not in argv
    # SGLang resolves a load_format with dynamic_import: module path + attribute.
    for path, fn in ((TARGET_LOADER, load_target_weights), (DRAFT_LOADER, load_draft_weights)):
        mod, attr = path.rsplit(".", 1)
        # (the server imports it as a top-level module from server/, which is on its PYTHONPATH)
        assert getattr(importlib.import_module(mod), attr).__code__.co_filename == fn.__code__.co_filename


# --- weight names -----------------------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen3_tied", "llama"])
def test_policy_names_are_the_hf_names_sglang_loads(tmp_path, family):
    transformers = pytest.importorskip("transformers")
    common = dict(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    if family == "llama":
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    else:
        hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=16, tie_word_embeddings=True))
    hf.save_pretrained(tmp_path, safe_serialization=True)
    arch = read_hf_arch(str(tmp_path))
    model = build_target_config(arch).build()
    model.init_weights(buffer_device=None)
    load_hf_into(model, str(tmp_path), arch)

    pairs = policy_to_hf_names(model.state_dict(), arch)
    ref = {k: v for k, v in hf.state_dict().items() if not (arch.tie_embeddings and k == "lm_head.weight")}
    assert sorted(n for n, _ in pairs) == sorted(ref)
    for n, t in pairs:  # Llama's q/k permutation undone exactly
        torch.testing.assert_close(t, ref[n], rtol=0, atol=0)
    with pytest.raises(ValueError, match="no HF name for SGLang.*layers.0.attention.bogus"):
        policy_to_hf_names({"layers.0.attention.bogus": torch.zeros(1)}, arch)


def test_draft_names_are_the_design_list(dirs):
    assert list(EXPORT_KEYS) == DESIGN_DRAFT_KEYS
    sd = dirs.d.state_dict()
    pairs = draft_to_export_names({**sd, "embed_tokens.weight": torch.zeros(V, 64)})  # embedding: the target's
    assert [n for n, _ in pairs] == [k for k in sd if k in EXPORT_KEYS] and sorted(n for n, _ in pairs) == sorted(
        DESIGN_DRAFT_KEYS
    )
    assert all(t is sd[n] for n, t in pairs)
    with pytest.raises(ValueError, match="unknown name.*model.fc.weight"):
        draft_to_export_names({"model.fc.weight": torch.zeros(1)})


# --- the two custom loaders -------------------------------------------------------------


class _Recorder(torch.nn.Module):
    def __init__(self, architectures, **config):
        super().__init__()
        self.config = types.SimpleNamespace(architectures=architectures, **config)
        self.loaded = []

    def load_weights(self, weights):
        self.loaded += [n for n, _ in weights]


# The class names and config attributes of SGLang's models (sglang/srt/models/qwen3.py,
# llama.py, llama_eagle3.py): the draft keeps hot_token_id = d2t + arange after loading.
class Qwen3ForCausalLM(_Recorder):
    pass


class LlamaForCausalLM(_Recorder):
    pass


class LlamaForCausalLMEagle3(_Recorder):
    pass


def test_loaders_keep_policy_and_draft_apart(dirs):
    hf_pairs = policy_to_hf_names(dirs.model.state_dict(), dirs.arch)
    draft_pairs = draft_to_export_names(dirs.d.state_dict())
    hf_names = [n for n, _ in hf_pairs]
    targets = [Qwen3ForCausalLM(["Qwen3ForCausalLM"], tie_word_embeddings=True), LlamaForCausalLM(["LlamaForCausalLM"])]
    d2t = dirs.d.d2t
    draft = LlamaForCausalLMEagle3(
        ["LlamaForCausalLMEagle3"], draft_vocab_size=16, eagle_config={"eagle_aux_hidden_state_layer_ids": list(TAPS)}
    )
    draft.hot_token_id = d2t + torch.arange(d2t.numel())
    # A draft known only by its config (SGLang may wrap the class), and one by class only.
    by_config = _Recorder(["LlamaForCausalLMEagle3"])
    by_class = LlamaForCausalLMEagle3(None)

    for t in targets:
        load_target_weights(t, hf_pairs)
        load_draft_weights(t, draft_pairs)  # the draft push reaches the target runner too: no-op
        assert t.loaded == hf_names
        # Draft tensors in a policy push: refused, since both models have an lm_head.weight.
        with pytest.raises(ValueError, match="policy push carries draft names.*fc.weight"):
            load_target_weights(t, hf_pairs + draft_pairs)
        assert t.loaded == hf_names
    for d in (draft, by_config, by_class):
        load_target_weights(d, hf_pairs)
        assert d.loaded == []
        load_draft_weights(d, draft_pairs)
        assert d.loaded == [n for n in EXPORT_KEYS if n not in ("d2t", "t2d")]

    moved = [(n, t + 1 if n == "d2t" else t) for n, t in draft_pairs]
    with pytest.raises(ValueError, match="d2t differs from the one SGLang loaded"):
        load_draft_weights(draft, moved)
    with pytest.raises(ValueError, match="not EAGLE-3 draft export names"):
        load_draft_weights(draft, [("model.layers.0.self_attn.q_proj.weight", torch.zeros(1))])


# --- a recording HTTP server with SGLang's endpoint shapes (tests/sglang_stub.py) ---------


@pytest.fixture
def stubs():
    made = []
    yield made
    for s in made:
        s.stop()


def _engine(dirs, stubs, cfg=None, **stub_kw):
    cfg = cfg or _cfg(request_timeout_s=60.0, max_restarts=2)

    def connect(args):
        stubs.append(
            StubSGLang(
                model_path=args["model_path"],
                draft_path=args.get("speculative_draft_model_path"),
                tp_size=args["tp_size"],
                **stub_kw,
            )
        )
        stubs[-1].client = HttpClient(stubs[-1].url, cfg.request_timeout_s, args["tp_size"])
        return stubs[-1].client

    return SGLangRolloutEngine(cfg, dirs.policy, dirs.draft, 4, connect=connect)


BRACKET = [
    "pause_generation",
    "begin_weight_update",
    "update_weights_from_tensor",
    "end_weight_update",
    "flush_cache",
    "continue_generation",
]


def test_pushes_are_bracketed_selected_versioned_and_exact(dirs, stubs):
    engine = _engine(dirs, stubs)
    s = stubs[0]
    other, _ = _target(seed=7)
    engine.update_policy_weights(other.state_dict(), version=3)
    sd = _draft(dirs.arch, seed=9).state_dict()
    engine.update_draft_weights(sd, version=5)
    assert s.names() == BRACKET * 2
    calls = dict(s.calls[:6])
    assert calls["pause_generation"] == {"mode": "retract"}
    assert calls["begin_weight_update"] == {"selector": "target"}
    upd = calls["update_weights_from_tensor"]
    assert (upd["load_format"], upd["selector"], upd["flush_cache"], upd["weight_version"]) == (
        TARGET_LOADER,
        "target",
        False,
        "policy-3.draft-0",
    )
    assert isinstance(upd["serialized_named_tensors"], list) and len(upd["serialized_named_tensors"]) == 1
    upd2 = dict(s.calls[6:])["update_weights_from_tensor"]
    assert (upd2["load_format"], upd2["selector"], upd2["weight_version"]) == (
        DRAFT_LOADER,
        "draft",
        "policy-3.draft-5",
    )
    assert dict(s.calls[6:])["begin_weight_update"] == {"selector": "draft"}

    ref = dict(policy_to_hf_names(other.state_dict(), dirs.arch))
    assert sorted(s.pushed[0]) == sorted(ref)
    for n, t in s.pushed[0].items():  # cast to the serving dtype
        assert t.dtype == torch.bfloat16 and torch.equal(t, ref[n].to(torch.bfloat16))
    assert sorted(s.pushed[1]) == sorted(EXPORT_KEYS)
    assert torch.equal(s.pushed[1]["d2t"], sd["d2t"]) and torch.equal(
        s.pushed[1]["fc.weight"], sd["fc.weight"].bfloat16()
    )

    # Rollouts carry the versions the server reports for them.
    out = engine.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_new_tokens=8))
    assert (out[0].policy_version, out[0].draft_version) == (3, 5)


def test_from_config(dirs, stubs):
    cfg = load_config(
        None,
        [
            "--rollout.engine",
            "sglang",
            "--model.hf_checkpoint",
            dirs.policy,
            "--draft.init_from",
            dirs.draft,
            "--speculative.num_draft_tokens",
            "2",
            "--rollout.sglang.port",
            "31234",
        ],
    )
    seen = []

    def connect(args):
        seen.append(args)
        stubs.append(StubSGLang())
        return HttpClient(stubs[-1].url, 60.0)

    engine = SGLangRolloutEngine.from_config(cfg, connect=connect)
    assert (
        seen[0]["model_path"],
        seen[0]["speculative_draft_model_path"],
        seen[0]["speculative_num_steps"],
        seen[0]["speculative_num_draft_tokens"],
        seen[0]["port"],
    ) == (dirs.policy, dirs.draft, 2, 3, 31234)
    assert engine.generate([[3]], SamplingParams(max_new_tokens=2))[0].output_ids == [4, 5]
    cfg.speculative.enabled = False
    plain = SGLangRolloutEngine.from_config(cfg, connect=connect)
    assert plain.K == 0 and "speculative_algorithm" not in seen[1]
    assert plain.generate([[3]], SamplingParams(max_new_tokens=3))[0].verify_steps == 3  # one forward per token
    # Relative directories (as the shipped TOMLs give them) reach the server absolute: it runs
    # in its log folder, where SGLang would read a relative one as a model hub id.
    rel = os.path.relpath(dirs.policy)
    SGLangRolloutEngine(_cfg(), rel, None, 0, connect=connect)
    assert seen[2]["model_path"] == os.path.abspath(rel) == dirs.policy


def test_generate_payload_and_results(dirs, stubs):
    engine = _engine(dirs, stubs, cfg=_cfg(request_timeout_s=60.0, deterministic=True))  # seeds are sent
    sp = SamplingParams(temperature=0.7, top_p=0.9, top_k=0, max_new_tokens=16, stop_token_ids=(2,), seed=11)
    out = engine.generate([[5, 6], [7], [5, 6]], sp)
    body = dict(stubs[0].calls)["generate"]
    assert body["input_ids"] == [[5, 6], [7], [5, 6]] and body["return_logprob"] is True
    assert body["sampling_params"] == [
        {"max_new_tokens": 16, "temperature": 0.7, "top_p": 0.9, "top_k": -1, "stop_token_ids": [2], "sampling_seed": s}
        for s in (11 * SEED_MIX, 11 * SEED_MIX + 1, 11 * SEED_MIX + 2)
    ]
    r = out[1]
    assert (
        r.prompt_ids == [7] and r.output_ids == [8, 9, 10, 11, 12] and r.logprobs == [-0.25, -0.5, -0.75, -1.0, -1.25]
    )
    assert (r.finish_reason, r.verify_steps, r.accepted_tokens) == ("length", 3, 2)  # prefill + 2 verifies
    assert r.acceptance_length == 5 / 3
    assert sampling_to_sglang(SamplingParams(temperature=0.0, max_new_tokens=4), 1, seeded=False) == [
        {"max_new_tokens": 4, "temperature": 0.0, "top_p": 1.0, "top_k": -1, "ignore_eos": True}
    ]
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[1], []], sp)
    with pytest.raises(ValueError, match="outside the vocabulary 0..127"):
        engine.generate([[V]], sp)


def test_result_parsing_across_meta_info_versions():
    lp = [[-1.0, 4, None], [-2.0, 9, None], [-0.5, 2, None]]
    base = {"output_token_logprobs": lp, "finish_reason": {"type": "stop", "matched": 2}, "completion_tokens": 3}
    new = rollout_from_result(
        [1], {"meta_info": {**base, "spec_verify_ct": 1, "spec_num_correct_drafts": 1}}, True, (4, 6)
    )
    assert (new.output_ids, new.finish_reason, new.verify_steps, new.accepted_tokens) == ([4, 9, 2], "stop", 2, 1)
    assert (new.policy_version, new.draft_version) == (4, 6)  # no weight_version reported: the engine's own
    old = rollout_from_result(
        [1], {"meta_info": {**base, "spec_verify_ct": 1, "spec_accept_token_num": 1}}, True, (0, 0)
    )
    only_len = rollout_from_result([1], {"meta_info": {**base, "spec_accept_length": 3.0}}, True, (0, 0))
    no_key = rollout_from_result([1], {"meta_info": {**base, "spec_verify_ct": 1}}, True, (0, 0))
    assert (old.verify_steps, old.accepted_tokens) == (only_len.verify_steps, only_len.accepted_tokens) == (2, 1)
    assert (no_key.verify_steps, no_key.accepted_tokens) == (2, 1)  # completion - 1 - verifies
    one = rollout_from_result(
        [1], {"meta_info": {**base, "output_token_logprobs": lp[:1], "completion_tokens": 1}}, True, (0, 0)
    )
    assert (one.verify_steps, one.accepted_tokens, one.acceptance_length) == (1, 0, 1.0)  # prefill only: no spec keys
    plain = rollout_from_result([1], {"meta_info": base}, False, (0, 0))
    assert (plain.verify_steps, plain.accepted_tokens) == (3, 0)
    tagged = rollout_from_result([1], {"meta_info": {**base, "weight_version": "policy-7.draft-2"}}, True, (0, 0))
    assert (tagged.policy_version, tagged.draft_version) == (7, 2)
    with pytest.raises(SGLangError, match="finish_reason 'abort'"):
        rollout_from_result(
            [1], {"meta_info": {**base, "finish_reason": {"type": "abort", "message": "x"}}}, True, (0, 0)
        )
    with pytest.raises(SGLangError, match="output_token_logprobs"):
        rollout_from_result([1], {"meta_info": {"completion_tokens": 1}}, True, (0, 0))


# --- faults -----------------------------------------------------------------------------


def test_dead_or_hung_server_is_restarted_with_both_weight_sets(dirs, stubs):
    engine = _engine(dirs, stubs, cfg=_cfg(request_timeout_s=60.0, max_restarts=1, dtype="float32"))
    assert isinstance(engine, RolloutEngine)
    other, _ = _target(seed=3)
    pushed = {n: t.clone() for n, t in policy_to_hf_names(other.state_dict(), dirs.arch)}
    engine.update_policy_weights(other.state_dict(), version=2)
    with torch.no_grad():  # the trainer steps on: the server must get back what version 2 was
        for p in other.parameters():
            p.add_(1.0)
    sd = _draft(dirs.arch, seed=4).state_dict()
    engine.update_draft_weights(sd, version=2)
    prompts, sp = [[1, 2]], SamplingParams(temperature=0.0, max_new_tokens=4)

    stubs[0].stop()  # the server dies
    out = engine.generate(prompts, sp)
    assert engine.restarts == 1 and len(stubs) == 2
    fresh = stubs[1]
    assert fresh.names() == BRACKET * 2 + ["generate"]  # policy, then draft, then the retried call
    assert sorted(fresh.pushed[0]) == sorted(pushed)
    assert all(torch.equal(t, pushed[n]) for n, t in fresh.pushed[0].items())
    assert torch.equal(fresh.pushed[1]["fc.weight"], sd["fc.weight"])
    assert (out[0].policy_version, out[0].draft_version) == (2, 2)

    # The server hangs: it never answers, so the request timeout must end the wait. Only this
    # client (that only this request uses) gets a short one; the restarted server's is 60 s.
    fresh.hang.set()
    fresh.client.timeout = 0.5
    engine.generate(prompts, sp)
    assert engine.restarts == 2 and stubs[2].names()[-1] == "generate"
    stubs[2].unhealthy = True  # it answers, but 503: unhealthy
    engine.generate(prompts, sp)
    assert engine.restarts == 3 and stubs[3].names() == BRACKET * 2 + ["generate"]

    for s in stubs[2:]:
        s.stop()
    # Every restart comes up dead: give up after max_restarts, clearly.
    engine._connect = lambda args: HttpClient("http://127.0.0.1:9", 1.0)
    with pytest.raises(EngineDied, match="gave up after 1 restart"):
        engine.generate(prompts, sp)


def test_refused_push_keeps_old_version_and_closes_the_bracket(dirs, stubs):
    engine = _engine(dirs, stubs, fail_update=True)
    with pytest.raises(SGLangError, match="Online weight updates are not supported") as e:
        engine.update_policy_weights(dirs.model.state_dict(), version=9)
    assert "\n" not in str(e.value)
    assert stubs[0].names() == [
        "pause_generation",
        "begin_weight_update",
        "update_weights_from_tensor",
        "end_weight_update",
        "continue_generation",
    ]
    assert engine.policy_version == 0 and engine._policy == {}
    with pytest.raises(ValueError, match="no draft"):
        SGLangRolloutEngine(_cfg(), dirs.policy, None, 0, connect=lambda a: None).update_draft_weights({}, 1)


def test_memory_release_then_resume_pushes_the_draft_again(dirs, stubs):
    engine = _engine(dirs, stubs)
    s = stubs[0]
    engine.release_memory()
    engine.resume_memory()
    # The draft from its directory is pushed at once; the policy was never pushed: say so.
    assert s.names() == ["release_memory_occupation", "resume_memory_occupation"] + BRACKET
    assert sorted(s.pushed[0]) == sorted(EXPORT_KEYS)
    with pytest.raises(RuntimeError, match="released and none was pushed"):
        engine.generate([[1]], SamplingParams(max_new_tokens=2))
    engine.update_policy_weights(dirs.model.state_dict(), version=1)
    engine.release_memory(["kv_cache"])
    engine.resume_memory(["kv_cache"])  # KV only: nothing to push
    engine.release_memory()
    engine.resume_memory()
    n = len(s.calls)
    engine.generate([[1]], SamplingParams(max_new_tokens=2))  # the stored policy goes back first
    assert s.names()[n:] == BRACKET + ["generate"]
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.generate([[1]], SamplingParams(max_new_tokens=2))

    # SGLang keeps the policy on the CPU itself: nothing to push before generating.
    backed = _engine(
        dirs,
        stubs,
        cfg=load_config(None, ["--rollout.sglang.server_args", "{enable_weights_cpu_backup = true}"]).rollout.sglang,
    )
    backed.release_memory()
    backed.resume_memory()
    backed.generate([[1]], SamplingParams(max_new_tokens=2))
    assert stubs[-1].names() == ["release_memory_occupation", "resume_memory_occupation"] + BRACKET + ["generate"]


# --- bad input --------------------------------------------------------------------------


def test_bad_draft_directories_and_config(dirs, tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        check_draft_fits_policy(dirs.policy, str(tmp_path / "nope"))
    _, big = _target()
    wrong = Eagle3Draft(DraftArch.from_target(with_vocab(big, V + 8), (1, 3, 9), 16))
    save_draft(wrong, str(tmp_path / "wrong"))
    with pytest.raises(ValueError, match=r"vocab_size 136 != target vocab 128.*tap ids \[1, 3, 9\]") as e:
        check_draft_fits_policy(dirs.policy, str(tmp_path / "wrong"))
    assert "\n" not in str(e.value)
    os.makedirs(tmp_path / "half")
    with open(tmp_path / "half" / "config.json", "w") as f:
        json.dump(json.load(open(os.path.join(dirs.draft, "config.json"))), f)
    with pytest.raises(ValueError, match="no model.safetensors"):
        check_draft_fits_policy(dirs.policy, str(tmp_path / "half"))

    base = ["--rollout.engine", "sglang"]
    cases = [
        ([], "needs model.hf_checkpoint"),
        (["--model.hf_checkpoint", dirs.policy], "needs draft.init_from"),
        (
            ["--model.hf_checkpoint", dirs.policy, "--draft.init_from", str(tmp_path / "wrong")],
            "does not fit the policy",
        ),
        (
            [
                "--model.hf_checkpoint",
                dirs.policy,
                "--draft.init_from",
                dirs.draft,
                "--rollout.sglang.server_args",
                "{speculative_num_steps = 2}",
            ],
            "titan_spec sets itself",
        ),
        (["--rollout.sglang.mode", "ray"], "rollout.sglang.mode"),
        (["--rollout.sglang.eagle_topk", "0"], "rollout.sglang.eagle_topk"),
        # The trainer's own python has no sglang: refused before any process starts.
        (["--rollout.sglang.python", sys.executable], f"rollout.sglang.python = '{sys.executable}' has no sglang"),
    ]
    if on_cpu():  # the CPU stand-ins build chains only
        fit = ["--model.hf_checkpoint", dirs.policy, "--draft.init_from", dirs.draft]
        tree = fit + ["--rollout.sglang.eagle_topk", "2", "--rollout.sglang.num_verify_tokens", "6"]
        cases.append((tree, "rollout.sglang.eagle_topk = 2 is not served on CPU"))
    for over, msg in cases:
        with pytest.raises(ConfigError, match=msg) as e:
            load_checked(None, base + over)
        assert "\n" not in str(e.value)
    ok = load_checked(None, base + ["--model.hf_checkpoint", dirs.policy, "--draft.init_from", dirs.draft])
    assert ok.rollout.engine == "sglang"
    assert load_checked(None, base + ["--model.hf_checkpoint", dirs.policy, "--speculative.enabled", "false"])


def test_missing_sglang_and_start_failures_are_one_line(dirs, tmp_path):
    # An interpreter without sglang: the server exits at once, and the error is one line
    # with the log's last lines (the trainer's own python has no sglang).
    cfg = _cfg(python=sys.executable, log_dir=str(tmp_path), start_timeout_s=120)
    with pytest.raises(SGLangStartError, match="exited with code 1 while starting.*No module named 'sglang'") as e:
        SGLangRolloutEngine(cfg, dirs.policy, dirs.draft, 4)
    assert "\n" not in str(e.value)
    log = tmp_path / "server.log"
    # A process that never serves: killed at the timeout (short: it cannot serve before it).
    # One that exits: its log tail, seen as soon as it has exited (long timeout: however slow
    # its start-up, the exit comes first).
    for code, msg, timeout_s in (
        ("import time; time.sleep(60)", "was not ready within 1.5s", 1.5),
        (
            "print('CUDA out of memory'); raise SystemExit(3)",
            "exited with code 3 while starting.*CUDA out of memory",
            60.0,
        ),
    ):
        with open(log, "wb") as f:
            p = subprocess.Popen(
                [sys.executable, "-c", code], stdout=f, stderr=subprocess.STDOUT, start_new_session=True
            )
        c = HttpClient("http://127.0.0.1:9", 1.0, process=p, log_path=str(log))
        with pytest.raises(SGLangStartError, match=msg) as e:
            c.wait_ready(timeout_s)
        assert "\n" not in str(e.value) and p.poll() is not None


def test_gpu_recipe_checks(dirs, capsys, monkeypatch, tmp_path):
    from titan_spec.train.entry import main

    gsm = tmp_path / "gsm.jsonl"
    gsm.write_text('{"question": "What is 2+2?", "answer": "It is 4. #### 4"}\n')
    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "train_configs", "qwen3_8b_sglang.toml")
    monkeypatch.setenv("WORLD_SIZE", "8")
    # The recipe with this machine's tiny policy and draft in place of Qwen3-8B's (its tokenizer
    # is the character one, without a chat template; tests/test_recipes.py checks the recipe
    # against Qwen3-8B's structure).
    tiny = [
        "--model.hf_checkpoint",
        dirs.policy,
        "--draft.init_from",
        dirs.draft,
        "--draft.draft_vocab_size",
        "16",
        "--training.seq_len",
        "1024",
        "--task.path",
        str(gsm),
        "--task.chat_template",
        "off",
        "--rl.max_new_tokens",
        "256",
    ]  # a prompt and its completion fit the tiny policy's 1024-token rows
    assert main(["--check", "--config", path, *tiny]) == 0
    capsys.readouterr()
    assert main(["--check", "--config", path]) == 2  # its /models paths are not on this machine
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is not a directory" in err


def test_server_group_ends_when_the_trainer_is_gone():
    """The server entry's parent watch (server/titan_spec_sglang_server.py): when the process
    named in TITAN_SPEC_PARENT_PID dies (here kill -9), the server's whole process group goes,
    its children included (SGLang's scheduler and detokenizer)."""
    from titan_spec.rollout.sglang.serving import SERVER_DIR, server_env

    assert server_env(sys.executable)["TITAN_SPEC_PARENT_PID"] == str(os.getpid())
    trainer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    code = (
        "import subprocess, sys, titan_spec_sglang_server as s; "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
        f"s._watch_parent({trainer.pid}, poll_s=0.1)"
    )
    server = subprocess.Popen(
        [sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": SERVER_DIR}, start_new_session=True
    )
    try:
        time.sleep(1.0)
        assert server.poll() is None  # the trainer is alive: the server keeps serving
        os.killpg(server.pid, 0)
        trainer.kill()
        trainer.wait()
        assert server.wait(timeout=30) == -signal.SIGKILL
        for _ in range(100):  # the child in its group goes too
            try:
                os.killpg(server.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            raise AssertionError("a process of the server's group outlived the trainer")
    finally:
        trainer.kill()
        try:
            os.killpg(server.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
