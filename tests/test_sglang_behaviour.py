"""The SGLang engine against SGLang 0.5.23's real behaviour (issue 18), without a GPU.

Each test drives the engine into one way SGLang 0.5.23 breaks (a loader exception kills the
server; resume without release raises KeyError in the scheduler; one payload per TP rank;
tap id L-1 is never captured; counts past a stop and after a retraction; seeds ignored
without deterministic inference; SpecForge configs without eagle_config; the 48-request
reset under speculation; the scheduler importing our loader module) and asserts what the
engine guarantees instead. ``StubSGLang`` (tests/sglang_stub.py) fails where SGLang fails.
"""

import json
import logging
import os
import shutil
import subprocess
import sys
import threading

import pytest
import torch
from sglang_stub import StubSGLang
from test_sglang_engine import _cfg, _draft, _target, dirs, stubs  # noqa: F401  (fixtures)

from titan_spec.config import ConfigError, load_config
from conftest import load_checked
from titan_spec.models.draft.eagle3.model import DraftArch, Eagle3Draft
from titan_spec.models.draft.eagle3.io import read_draft_arch, save_draft
from titan_spec.models.target import default_tap_layer_ids
from titan_spec.rollout import SamplingParams
from titan_spec.rollout.sglang.client import EngineDied, HttpClient
from titan_spec.rollout.sglang.engine import SEED_MIX, SEEDS_IGNORED, SGLangRolloutEngine, rollout_from_result
from titan_spec.rollout.weight_names import check_draft_fits_policy, policy_to_hf_names, served_tap_ids

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=4)


def _engine(dirs, stubs, cfg=None, K=4, draft=None, **stub_kw):  # noqa: F811
    """An engine whose every (re)start is a fresh StubSGLang with the real loaders inside."""
    cfg = cfg or _cfg(request_timeout_s=60.0, max_restarts=1, dtype="float32")

    def connect(args):
        kw = {"deterministic": bool(args.get("enable_deterministic_inference")), **stub_kw}
        stubs.append(
            StubSGLang(
                model_path=args["model_path"],
                draft_path=args.get("speculative_draft_model_path"),
                tp_size=args["tp_size"],
                **kw,
            )
        )
        return HttpClient(stubs[-1].url, cfg.request_timeout_s, args["tp_size"])

    return SGLangRolloutEngine(cfg, dirs.policy, draft or dirs.draft, K, connect=connect)


# --- 1. a push SGLang's loaders would refuse is refused here, before sending --------------


def test_pushes_a_loader_would_refuse_never_reach_the_server(dirs, stubs):  # noqa: F811
    engine = _engine(dirs, stubs)
    s = stubs[0]
    policy = dict(dirs.model.state_dict())
    policy["tok_embeddings.weight"] = torch.zeros(dirs.arch.vocab_size + 8, dirs.arch.dim)  # another vocab
    draft = dict(_draft(dirs.arch, seed=3).state_dict())
    moved = {**draft, "d2t": draft["d2t"] + 1}  # another draft vocabulary map
    narrow = {"fc.weight": draft["fc.weight"][:, :-1]}
    as_float = {"d2t": draft["d2t"].float()}
    for push, state, msg in (
        (engine.update_policy_weights, policy, r"model.embed_tokens.weight: shape \[136, 64\] != served \[128, 64\]"),
        (engine.update_draft_weights, moved, "d2t differs from the one SGLang loaded at start"),
        (engine.update_draft_weights, narrow, r"fc.weight: shape \[64, 191\] != served \[64, 192\]"),
        (engine.update_draft_weights, as_float, "d2t: dtype torch.float32 where the server holds torch.int64"),
    ):
        with pytest.raises(ValueError, match=msg) as e:
            push(state, version=9)
        assert "\n" not in str(e.value) and "refused before sending" in str(e.value)
    # Nothing was sent, the first server is alive, nothing moved.
    assert s.calls == [] and s.dead is None and engine.restarts == 0
    assert (engine.policy_version, engine.draft_version) == (0, 0) and engine._policy == {}
    # What the loaders do take still goes through, to the same server, into both stand-ins.
    engine.update_policy_weights(dirs.model.state_dict(), version=1)
    engine.update_draft_weights(draft, version=1)
    assert s.dead is None and len(s.pushed) == 2 and engine.restarts == 0
    assert sorted(s.runners["target"].loaded) == sorted(
        n for n, _ in policy_to_hf_names(dirs.model.state_dict(), dirs.arch)
    )


# --- 2. a push that kills the server leaves the last good weights and version --------------


def test_server_death_during_a_push_rolls_back_to_the_last_good_weights(dirs, stubs):  # noqa: F811
    engine = _engine(dirs, stubs, crash_versions={"policy-9.draft-0"})
    good, _ = _target(seed=3)
    engine.update_policy_weights(good.state_dict(), version=2)
    good_hf = {n: t.clone() for n, t in policy_to_hf_names(good.state_dict(), dirs.arch)}
    bad, _ = _target(seed=4)
    with pytest.raises(EngineDied, match="gave up after 1 restart"):
        engine.update_policy_weights(bad.state_dict(), version=9)  # every server dies loading it
    assert engine.policy_version == 2
    assert sorted(engine._policy) == sorted(good_hf) and all(
        torch.equal(engine._policy[n], t) for n, t in good_hf.items()
    )
    # Not poisoned: the next call starts a server with the last good weights and serves.
    out = engine.generate([[1, 2]], GREEDY)
    fresh = stubs[-1]
    assert fresh.dead is None and out[0].policy_version == 2
    assert fresh.pushed[0].keys() == good_hf.keys() and all(
        torch.equal(fresh.pushed[0][n], t) for n, t in good_hf.items()
    )
    assert [c[1]["weight_version"] for c in fresh.calls if c[0] == "update_weights_from_tensor"] == [
        "policy-2.draft-0"
    ] * 2


def test_giving_up_leaves_the_engine_ready_to_restart(dirs, stubs):  # noqa: F811
    # max_restarts = 0: the call that finds the server dead fails, the next one restarts it.
    engine = _engine(dirs, stubs, cfg=_cfg(request_timeout_s=60.0, max_restarts=0, dtype="float32"))
    stubs[0].stop()
    with pytest.raises(EngineDied, match="gave up after 0 restart"):
        engine.generate([[1]], GREEDY)
    assert engine.generate([[1]], GREEDY)[0].output_ids == [2, 3, 4, 5]
    assert engine.restarts == 1 and len(stubs) == 2


# --- 3. released/resumed state: no resume of what is not released; no release mid-request --


def test_resume_only_what_is_released_even_across_a_restart(dirs, stubs):  # noqa: F811
    engine = _engine(dirs, stubs)
    engine.resume_memory()  # never released: SGLang's scheduler would raise KeyError
    assert stubs[0].calls == [] and stubs[0].dead is None
    engine.release_memory(["kv_cache"])
    engine.release_memory(["kv_cache"])  # already released: not sent twice
    with pytest.raises(RuntimeError, match=r"memory \['kv_cache'\] is released: call resume_memory"):
        engine.generate([[1]], GREEDY)
    stubs[0].stop()  # the server dies while its KV cache is released
    engine.resume_memory(["kv_cache"])  # a fresh server holds all its memory: nothing to resume
    assert engine.restarts == 1 and stubs[1].dead is None and stubs[1].offload_tags == set()
    assert "resume_memory_occupation" not in stubs[1].names()
    assert engine.generate([[1]], GREEDY)[0].output_ids == [2, 3, 4, 5]
    with pytest.raises(ValueError, match="memory tags .'weight'. are not SGLang's"):
        engine.release_memory(["weight"])


def test_release_waits_for_a_generate_in_flight(dirs, stubs):  # noqa: F811
    hold = threading.Event()
    engine = _engine(dirs, stubs, hold_generate=hold)
    s = stubs[0]
    out = []
    gen = threading.Thread(target=lambda: out.append(engine.generate([[1]], GREEDY)))
    gen.start()
    assert s.generate_entered.wait(30)
    rel = threading.Thread(target=engine.release_memory)
    rel.start()
    # Give a release that does not wait for the generate the time to reach the server
    # (it would in milliseconds); the engine's lock keeps it out until the answer is back.
    rel.join(0.5)
    hold.set()
    gen.join(30)
    rel.join(30)
    assert s.dead is None, s.dead
    assert s.names() == ["generate", "release_memory_occupation"] and len(out) == 1
    assert s.offload_tags == {"kv_cache", "weights", "cuda_graph"}


# --- 4. one payload per TP rank ------------------------------------------------------------


def test_every_tp_rank_gets_its_own_payload(dirs, stubs):  # noqa: F811
    engine = _engine(dirs, stubs, cfg=_cfg(request_timeout_s=60.0, max_restarts=0, dtype="float32", tp_size=2))
    other, _ = _target(seed=5)
    engine.update_policy_weights(other.state_dict(), version=1)
    s = stubs[0]
    assert s.dead is None
    payloads = dict(s.calls)["update_weights_from_tensor"]["serialized_named_tensors"]
    assert len(payloads) == 2 and payloads[0] != payloads[1]
    ref = dict(policy_to_hf_names(other.state_dict(), dirs.arch))
    for rank in s.per_rank:  # each rank opened its own payload and got every tensor
        assert rank.keys() == ref.keys() and all(torch.equal(rank[n], ref[n]) for n in ref)


# --- 5. tap ids SGLang cannot capture ------------------------------------------------------


def test_last_layer_tap_is_a_config_error_with_sglang(dirs, tmp_path):  # noqa: F811
    L = dirs.arch.n_layers
    d = Eagle3Draft(DraftArch.from_target(dirs.arch, (1, 3, L - 1), 16))
    save_draft(d, str(tmp_path / "last"))
    with pytest.raises(ValueError, match=rf"tap ids \[1, 3, {L - 1}\] cannot be served by SGLang.*0..{L - 2}"):
        check_draft_fits_policy(dirs.policy, str(tmp_path / "last"))
    base = ["--rollout.engine", "sglang", "--model.hf_checkpoint", dirs.policy]
    for extra in (
        ["--draft.init_from", str(tmp_path / "last")],
        ["--draft.init_from", dirs.draft, "--draft.tap_layer_ids", f"[1, 3, {L - 1}]"],
    ):
        with pytest.raises(ConfigError, match="cannot be served by SGLang") as e:
            load_checked(None, base + extra)
        assert "\n" not in str(e.value)
    load_checked(None, base + ["--draft.init_from", dirs.draft, "--draft.tap_layer_ids", f"[1, 3, {L - 2}]"])
    load_checked(
        None, ["--model.hf_checkpoint", dirs.policy, "--draft.tap_layer_ids", f"[1, 3, {L - 1}]"]
    )  # built-in engine


# --- 6. counts as SGLang reports them -------------------------------------------------------


def _meta(n, **kw):
    return {
        "meta_info": {
            "output_token_logprobs": [[-1.0, 7, None]] * n,
            "completion_tokens": n,
            "finish_reason": {"type": "stop", "matched": 7},
            **kw,
        }
    }


def test_counts_include_retractions_and_not_drafts_past_the_stop():
    # Hand count, 6 tokens: prefill emits 1; a verify emits 1 + 2 accepted; the request is
    # retracted and its re-prefill emits 1; the last verify accepts 3 drafts of which the
    # first is the stop token, so it emits 1 and SGLang still counts 3 correct drafts.
    # Forwards = 4 (prefill, verify, re-prefill, verify); accepted emitted = 2.
    r = rollout_from_result([1], _meta(6, spec_verify_ct=2, spec_num_correct_drafts=5, num_retractions=1), True, (0, 0))
    assert (r.verify_steps, r.accepted_tokens) == (4, 2)
    # No retraction, the budget cut inside the last verify's drafts: 1 + (1 + 3) + (1 of 4).
    r = rollout_from_result([1], _meta(6, spec_verify_ct=2, spec_num_correct_drafts=7, num_retractions=0), True, (0, 0))
    assert (r.verify_steps, r.accepted_tokens) == (3, 3)
    assert r.verify_steps + r.accepted_tokens == len(r.output_ids) and r.acceptance_length == 2.0


def test_engine_rollouts_keep_tokens_equal_to_verifies_plus_accepted(dirs, stubs):  # noqa: F811
    engine = _engine(dirs, stubs, meta={"spec_verify_ct": 1, "spec_num_correct_drafts": 4, "num_retractions": 1})
    (r,) = engine.generate([[1]], SamplingParams(temperature=0.0, max_new_tokens=5))
    assert (len(r.output_ids), r.verify_steps, r.accepted_tokens) == (5, 3, 2)


# --- 7. seeds are honoured only with deterministic inference --------------------------------


def test_seeds_need_deterministic_inference(dirs, stubs, caplog):  # noqa: F811
    sp = SamplingParams(temperature=1.0, max_new_tokens=2, seed=5)
    engine = _engine(dirs, stubs)
    assert "enable_deterministic_inference" not in engine.server_args
    with caplog.at_level(logging.WARNING, logger="titan_spec.rollout.sglang.engine"):
        engine.generate([[1], [2]], sp)
        engine.generate([[1]], sp)
    warned = [r.getMessage() for r in caplog.records if "sampling_seed" in r.getMessage()]
    assert warned == [SEEDS_IGNORED] and "rollout.sglang.deterministic = true" in SEEDS_IGNORED
    assert all("sampling_seed" not in p for p in dict(stubs[0].calls)["generate"]["sampling_params"])

    caplog.clear()
    det = _engine(dirs, stubs, cfg=_cfg(request_timeout_s=60.0, deterministic=True))
    assert det.server_args["enable_deterministic_inference"] is True
    with caplog.at_level(logging.WARNING, logger="titan_spec.rollout.sglang.engine"):
        det.generate([[1], [2]], sp)
    assert not [r for r in caplog.records if "sampling_seed" in r.getMessage()]
    assert [p["sampling_seed"] for p in dict(stubs[-1].calls)["generate"]["sampling_params"]] == [
        5 * SEED_MIX,
        5 * SEED_MIX + 1,
    ]
    # The warning names what SGLang 0.5.23's deterministic mode costs (server_args/args.py
    # and its attention-backend check), and the key's reference (docs/CONFIG.md) says the same.
    text = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "CONFIG.md")).read()
    doc = text[text.index("`deterministic`", text.index("## `[rollout.sglang]`")) :][:600]
    for where in (SEEDS_IGNORED, doc):
        for needle in (
            "ascend",
            "fa3",
            "fa4",
            "flashinfer",
            "intel_xpu",
            "triton",
            "batch-invariant",
            "pytorch sampler",
            "radix cache",
        ):
            assert needle in where, (needle, where)


def test_unseeded_copies_of_a_prompt_differ_under_deterministic_inference(dirs, stubs):  # noqa: F811
    # With deterministic inference SGLang samples an unseeded request with seed 42, and its
    # sampler hashes only (seed, position): G unseeded copies of a prompt would all be equal
    # (the stub plays this), collapsing a GRPO group. Each call draws a fresh base instead.
    det = _engine(dirs, stubs, cfg=_cfg(request_timeout_s=60.0, deterministic=True))
    sp = SamplingParams(temperature=1.0, max_new_tokens=5)  # seed None
    first = [tuple(r.output_ids) for r in det.generate([[3]] * 4, sp)]
    second = [tuple(r.output_ids) for r in det.generate([[3]] * 4, sp)]
    assert len(set(first)) == 4 and len(set(second)) == 4 and set(first) != set(second)
    sent = [[p["sampling_seed"] for p in c[1]["sampling_params"]] for c in stubs[-1].calls if c[0] == "generate"]
    assert all(isinstance(x, int) and 0 <= x < 2**62 for call in sent for x in call)
    assert len({x for call in sent for x in call}) == 8
    # A seeded call stays reproducible: same seed, same samples (the stub's seeded sampler).
    seeded = SamplingParams(temperature=1.0, max_new_tokens=5, seed=9)
    assert [r.output_ids for r in det.generate([[3]] * 4, seeded)] == [
        r.output_ids for r in det.generate([[3]] * 4, seeded)
    ]


def test_adjacent_rank_seeds_never_share_a_request_seed(dirs, stubs):  # noqa: F811
    # The RL loop seeds rank r's step with base * 4096 + r (rl/step.py). Request i of seed s
    # must not get the seed of request i' of seed s + 1 (seed + i would: s + 1 + 0 == s + 1).
    det = _engine(dirs, stubs, cfg=_cfg(request_timeout_s=60.0, deterministic=True))
    s = 7 * 4096 + 2
    for rank_seed in (s, s + 1):
        det.generate([[3]] * 8, SamplingParams(temperature=1.0, max_new_tokens=2, seed=rank_seed))
    sent = [[p["sampling_seed"] for p in c[1]["sampling_params"]] for c in stubs[-1].calls if c[0] == "generate"]
    assert len(set(sent[0])) == len(set(sent[1])) == 8 and not set(sent[0]) & set(sent[1])
    assert sent == [[(r * SEED_MIX + i) % 2**62 for i in range(8)] for r in (s, s + 1)]  # hand formula


# --- 8. SpecForge drafts without eagle_config ----------------------------------------------


def test_specforge_draft_without_eagle_config_serves_with_default_taps(dirs, stubs, tmp_path):  # noqa: F811
    # SpecForge's configs (e.g. configs/qwen3-8b-eagle3.json) carry no eagle_config: SGLang
    # then captures [2, L//2, L-3], i.e. tap ids (1, L//2-1, L-4) - the fixture's TAPS here.
    d = tmp_path / "specforge"
    shutil.copytree(dirs.draft, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("eagle_config", None)
    cfg.pop("eagle_aux_hidden_state_layer_ids", None)
    (d / "config.json").write_text(json.dumps(cfg))
    assert default_tap_layer_ids(dirs.arch.n_layers) == tuple(dirs.d.arch.tap_layer_ids)
    check_draft_fits_policy(dirs.policy, str(d))
    ok = load_checked(
        None, ["--rollout.engine", "sglang", "--model.hf_checkpoint", dirs.policy, "--draft.init_from", str(d)]
    )
    assert ok.draft.init_from == str(d)
    assert served_tap_ids(json.loads((d / "config.json").read_text()), dirs.arch.n_layers) == default_tap_layer_ids(
        dirs.arch.n_layers
    )
    engine = _engine(dirs, stubs, draft=str(d))
    assert stubs[-1].calls == [] and engine.server_args["speculative_draft_model_path"] == str(d)
    engine.update_draft_weights(dirs.d.state_dict(), version=1)
    assert stubs[-1].dead is None and engine.draft_version == 1


def test_sglang_serves_only_eagle_config_tap_ids(dirs, tmp_path):  # noqa: F811
    # SGLang 0.5.23 captures the layers of eagle_config["eagle_aux_hidden_state_layer_ids"]
    # only (model_runner_components/spec_aux_hidden_state.py), else its default; a top-level
    # list sizes fc but is never captured, and use_aux_hidden_state = false captures nothing.
    L = dirs.arch.n_layers
    base = ["--rollout.engine", "sglang", "--model.hf_checkpoint", dirs.policy, "--draft.init_from"]

    def variant(name, edit):
        d = tmp_path / name
        shutil.copytree(dirs.draft, d)
        cfg = json.loads((d / "config.json").read_text())
        edit(cfg)
        (d / "config.json").write_text(json.dumps(cfg))
        return str(d), cfg

    # The exporter's own directory (both keys, equal): served as written.
    own = json.loads(open(os.path.join(dirs.draft, "config.json")).read())
    assert served_tap_ids(own, L) == tuple(dirs.d.arch.tap_layer_ids)
    # eagle_config's ids are served even when they are not the default.
    d, cfg = variant(
        "eagle_only",
        lambda c: (
            c.pop("eagle_aux_hidden_state_layer_ids"),
            c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[0, 2, 5]),
        ),
    )
    assert served_tap_ids(cfg, L) == (0, 2, 5) != default_tap_layer_ids(L)
    # Top-level ids only: SGLang serves its default; they differ, so the directory is refused.
    d, cfg = variant(
        "top_only", lambda c: (c.pop("eagle_config"), c.update(eagle_aux_hidden_state_layer_ids=[0, 2, 5]))
    )
    assert served_tap_ids(cfg, L) == default_tap_layer_ids(L) == (1, 3, 4)
    refusals = [(d, r"top-level eagle_aux_hidden_state_layer_ids \[0, 2, 5\] .* SGLang serves \[1, 3, 4\]")]
    # Both keys, different: eagle_config's are served, the top-level list is refused.
    d, _ = variant("both", lambda c: c.update(eagle_aux_hidden_state_layer_ids=[0, 2, 5]))
    refusals.append((d, r"top-level eagle_aux_hidden_state_layer_ids \[0, 2, 5\] .* SGLang serves \[1, 3, 4\]"))
    d, _ = variant("no_aux", lambda c: c["eagle_config"].update(use_aux_hidden_state=False))
    refusals.append((d, "use_aux_hidden_state = false"))
    for d, msg in refusals:
        with pytest.raises(ValueError, match=msg) as e:
            check_draft_fits_policy(dirs.policy, d)
        assert "\n" not in str(e.value)
        with pytest.raises(ConfigError, match=msg):
            load_checked(None, base + [d])
    # The built-in engine's reading of the same directory is unchanged (eagle_config first).
    assert read_draft_arch(refusals[1][0]).tap_layer_ids == tuple(dirs.d.arch.tap_layer_ids)


# --- 9. smaller ones -------------------------------------------------------------------------


def test_max_running_requests_base_gpu_and_one_server_per_rank(dirs, stubs, monkeypatch):  # noqa: F811
    seen = []

    def connect(args):
        seen.append(args)
        stubs.append(StubSGLang())
        return HttpClient(stubs[-1].url, 5.0)

    base = ["--rollout.engine", "sglang", "--model.hf_checkpoint", dirs.policy, "--draft.init_from", dirs.draft]
    monkeypatch.setenv("LOCAL_RANK", "3")
    SGLangRolloutEngine.from_config(
        load_config(None, base + ["--rl.prompts_per_step", "4", "--rl.group_size", "6"]), connect=connect
    )
    SGLangRolloutEngine.from_config(
        load_config(None, base + ["--rollout.sglang.max_running_requests", "64"]), connect=connect
    )
    assert [a["max_running_requests"] for a in seen] == [24, 64]  # never SGLang's 48 under speculation
    assert [a["base_gpu_id"] for a in seen] == [3, 3]  # this rank's GPU
    with pytest.raises(ConfigError, match="one SGLang server runs per rank") as e:
        load_config(
            None,
            base + ["--rl.enable", "true", "--draft.enable", "true", "--rollout.sglang.tp_size", "2"],
            world_size=2,
        )
    assert "\n" not in str(e.value)
    # The server_args example names SGLang's field, not the CLI alias.
    from titan_spec.config import SGLangConfig
    from titan_spec.config.schema import __file__ as config_file

    text = open(config_file).read()
    doc = text[text.index("server_args: dict[str, Any]", text.index("class SGLangConfig")) :][:400]
    assert "{cuda_graph_max_bs_decode = 64}" in doc and "{cuda_graph_max_bs =" not in doc
    assert SGLangConfig().max_running_requests == 0


def test_the_server_modules_import_torch_only():
    # What SGLang's processes do with server/ on their PYTHONPATH: the loaders (dynamic_import
    # of load_format) and the CPU stand-ins import no titan_spec and no torchtitan (the SGLang
    # environment has neither).
    from titan_spec.rollout.sglang.serving import SERVER_DIR

    code = (
        "import sys, titan_spec_sglang_loaders, titan_spec_sglang_cpu; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('titan_spec', 'torchtitan', 'sglang')))"
    )
    env = {**os.environ, "PYTHONPATH": SERVER_DIR}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"
