"""The SGLang rollout engine against a REAL SGLang 0.5.23 server on this CPU (its own
environment, built by scripts/ensure_sglang_env.sh once per machine), serving EAGLE-3.

One server for the whole module, started from a tiny transformers-written Qwen3 (head_dim 32,
float32) and a full-vocabulary EAGLE-3 draft exported by titan_spec's own exporter; on CPU the
server runs with titan_spec's stand-ins for the sgl_kernel ops the CPU wheel lacks
(rollout/sglang/server/titan_spec_sglang_cpu.py). The tests run in file order and each leaves
the server serving policy A and the random draft (the start weights, pushed back), except the
last, which kills it.

Skipped, with the reason, only where the SGLang environment cannot be built.
"""

import os
import signal
import subprocess
import time
import types

import pytest
import torch

import titan_spec  # noqa: F401
from titan_spec.config.schema import SGLangConfig
from titan_spec.models.draft.eagle3.io import save_draft
from titan_spec.models.draft.eagle3.model import DraftArch, Eagle3Draft
from titan_spec.rollout import SamplingParams
from titan_spec.config.engine_env import env_script
from titan_spec.rollout.sglang.engine import SGLangRolloutEngine

from helpers.hf_assets import load_target, write_tiny_qwen3
from test_vllm_engine import (
    NEW,
    QWEN,
    TAPS,
    V,
    K,
    _acceptance,
    _builtin,
    _fit_draft,
    _hf_greedy,
    _prompts,
    assert_sampled_speculation_follows_the_policy,
)

ENV_SCRIPT = env_script("sglang")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    t0 = time.perf_counter()
    built = subprocess.run(["bash", ENV_SCRIPT], capture_output=True, text=True)
    if built.returncode != 0:
        err = [ln for ln in built.stderr.splitlines() if ln.strip() and "is ignored" not in ln]
        pytest.skip(
            f"the SGLang environment cannot be built here ({ENV_SCRIPT}: {err[-1] if err else built.returncode})"
        )
    env_s = time.perf_counter() - t0
    root = tmp_path_factory.mktemp("sglang")
    pol_a = write_tiny_qwen3(str(root / "policy_a"), vocab_size=V, seed=0, **QWEN)
    pol_b = write_tiny_qwen3(str(root / "policy_b"), vocab_size=V, seed=1, initializer_range=0.3, **QWEN)
    _, arch = load_target(pol_a, taps=TAPS)
    torch.manual_seed(3)
    rand = Eagle3Draft(DraftArch.from_target(arch, TAPS, V))
    rand.reset_parameters()
    save_draft(rand, str(root / "draft"))
    fitted = Eagle3Draft(rand.arch)
    fitted.load_state_dict(rand.state_dict())
    fitted = _fit_draft(pol_a, fitted)
    cfg = SGLangConfig(
        log_dir=str(root / "logs"), dtype="float32", start_timeout_s=600, request_timeout_s=300, max_restarts=1
    )
    t1 = time.perf_counter()
    engine = SGLangRolloutEngine(cfg, pol_a, str(root / "draft"), K, max_running_requests=16)
    start_s = time.perf_counter() - t1
    print(f"\nSGLang env ready in {env_s:.1f}s; server started in {start_s:.1f}s")
    yield types.SimpleNamespace(engine=engine, a=pol_a, b=pol_b, rand=rand, fitted=fitted, arch=arch, root=root)
    pgid = engine._client.pid
    engine.close()
    _assert_group_gone(pgid)


def _assert_group_gone(pgid: int) -> None:
    """No process of the server's group (its scheduler and detokenizer included) is left."""
    for _ in range(100):
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    raise AssertionError(f"processes of the SGLang server's group {pgid} are still running")


def test_cpu_stand_ins_are_loaded(served):
    """The server says what titan_spec loaded into it (/server_info): the sgl_kernel CPU ops
    and the attention backend lift, on CPU only."""
    info = served.engine.server_info()
    loaded = info.get("titan_spec_cpu") or []
    assert "op:verify_tree_greedy_cpu" in loaded and any(x.startswith("patch:") for x in loaded), loaded


def test_greedy_speculative_equals_builtin_and_transformers(served):
    prompts = _prompts(4, seed=1)
    out = served.engine.generate(prompts, SamplingParams(0.0, max_new_tokens=NEW))
    builtin = _builtin(served.a).generate(prompts, SamplingParams(0.0, max_new_tokens=NEW))
    assert [r.output_ids for r in out] == [r.output_ids for r in builtin] == _hf_greedy(served.a, prompts, NEW)
    for r in out:
        assert r.finish_reason == "length" and len(r.output_ids) == NEW == len(r.logprobs)
        assert r.verify_steps + r.accepted_tokens == NEW and 0 <= r.accepted_tokens <= K * r.verify_steps
    # Greedy log-probs are the T = 1 ones of the chosen tokens, as the built-in engine's
    # (fp32 on both sides, other kernels: SGLang's torch_native/intel_amx paths vs ours).
    for r, b in zip(out, builtin):
        torch.testing.assert_close(torch.tensor(r.logprobs), torch.tensor(b.logprobs), atol=2e-4, rtol=0)
    stop = out[0].output_ids[5]
    sp = SamplingParams(0.0, max_new_tokens=NEW, stop_token_ids=(stop,))
    got, want = served.engine.generate(prompts[:1], sp)[0], _builtin(served.a).generate(prompts[:1], sp)[0]
    assert got.output_ids == want.output_ids and got.output_ids[-1] == stop and got.finish_reason == "stop"


def test_policy_push_serves_the_pushed_policy(served):
    e, prompts = served.engine, _prompts(3, seed=2)
    sp = SamplingParams(0.0, max_new_tokens=NEW)
    before = e.generate(prompts, sp)
    b_model, _ = load_target(served.b, taps=())
    e.update_policy_weights(b_model.state_dict(), version=1)  # torchtitan names, as the trainer pushes
    after = e.generate(prompts, sp)
    assert [r.output_ids for r in after] == _hf_greedy(served.b, prompts, NEW) != [r.output_ids for r in before]
    # The versions come back from SGLang's own weight_version (set by the push bracket).
    assert {(r.policy_version, r.draft_version) for r in after} == {(1, 0)}
    a_model, _ = load_target(served.a, taps=())
    e.update_policy_weights(a_model.state_dict(), version=2)
    assert [r.output_ids for r in e.generate(prompts, sp)] == [r.output_ids for r in before]


def test_draft_push_reaches_only_the_drafter(served):
    """Acceptance with the random draft ~1 token per verify; the fitted draft pushed, clearly
    higher; the random one pushed back, the same counts as before: each push reached the
    drafter. Greedy output never changes (the target was not touched by a draft push)."""
    e, prompts = served.engine, _prompts(8, seed=11)  # prompts the draft was fitted on
    sp = SamplingParams(0.0, max_new_tokens=NEW)
    rand = e.generate(prompts, sp)
    e.update_draft_weights(served.fitted.state_dict(), version=3)
    fit = e.generate(prompts, sp)
    e.update_draft_weights(served.rand.state_dict(), version=4)
    back = e.generate(prompts, sp)
    a_rand, a_fit, a_back = _acceptance(rand), _acceptance(fit), _acceptance(back)
    print(f"\nSGLang acceptance length (K={K}): random {a_rand:.2f}, fitted {a_fit:.2f}, random again {a_back:.2f}")
    assert a_rand < 1.3 and a_fit > a_rand + 0.5, (a_rand, a_fit)
    assert [r.verify_steps for r in back] == [r.verify_steps for r in rand]
    assert [r.output_ids for r in rand] == [r.output_ids for r in fit] == [r.output_ids for r in back]
    assert [r.output_ids for r in fit] == _hf_greedy(served.a, prompts, NEW)
    assert {r.draft_version for r in fit} == {3} and {r.draft_version for r in back} == {4}


def test_bad_push_refused_trainer_side_and_server_keeps_serving(served):
    e, prompts = served.engine, _prompts(2, seed=3)
    sp = SamplingParams(0.0, max_new_tokens=8)
    before = e.generate(prompts, sp)
    versions = (e.policy_version, e.draft_version)
    a_model, _ = load_target(served.a, taps=())
    sd = a_model.state_dict()
    bad = dict(sd, **{"layers.0.attention.qkv_linear.wq.weight": torch.zeros(7, 64)})
    with pytest.raises(ValueError, match="refused before sending.*shape \\[7, 64\\]"):
        e.update_policy_weights(bad, version=9)
    with pytest.raises(ValueError, match="refused before sending.*dtype torch.int64"):
        e.update_policy_weights({"norm.weight": torch.ones(64, dtype=torch.long)}, version=9)
    assert (e.policy_version, e.draft_version) == versions
    assert [r.output_ids for r in e.generate(prompts, sp)] == [r.output_ids for r in before]


def test_sampled_speculation_follows_the_policy_distribution(served):
    """Lossless speculative sampling through SGLang on CPU: the chi-square check of
    test_vllm_engine (tokens 2 and 3 of 2,400 T = 1 completions against policy B's exact
    distributions, with power against T = 1.5). SGLang 0.5.23 alone verifies every CPU request
    greedily (measured: p = 0); the stand-ins make its sampling verify run on CPU."""
    assert_sampled_speculation_follows_the_policy(served, "SGLang")


def test_kill9_server_restarts_and_repushes_last_good_weights(served):
    e, prompts = served.engine, _prompts(3, seed=5)
    b_model, _ = load_target(served.b, taps=())
    e.update_policy_weights(b_model.state_dict(), version=7)  # the last good policy is B, not the start files'
    want = e.generate(prompts, SamplingParams(0.0, max_new_tokens=NEW))
    pid = e._client.pid
    os.kill(pid, signal.SIGKILL)
    got = e.generate(prompts, SamplingParams(0.0, max_new_tokens=NEW))
    assert e.restarts == 1 and e._client.pid != pid
    _assert_group_gone(pid)  # the killed launcher's scheduler and detokenizer were ended too
    assert [r.output_ids for r in got] == [r.output_ids for r in want] == _hf_greedy(served.b, prompts, NEW)
    assert {r.policy_version for r in got} == {7}
