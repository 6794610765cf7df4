"""Qwen3-MoE targets: HF import against transformers' Qwen3MoeForCausalLM (logits, taps, the
export round trip), the published parameter counts, FSDP dp=2 and expert parallelism ep=2
against dp=1 through the real entry point, an RL step with the draft co-trained (the built-in
engine's MoE path, torchtitan's routing-bias balancing), and the config errors."""

import json
import os
import subprocess
import sys

import pytest
import torch

import titan_spec  # noqa: F401
from titan_spec.models.hf_io import HFCheckpointError, read_hf_arch, save_hf
from titan_spec.models.moe import ExactGroupedExperts, moe_layers
from titan_spec.models.registry import active_parameter_count, flavor_arch, parameter_count

from helpers.hf_assets import load_target

transformers = pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
V, L, E, K = 97, 6, 8, 2


def _hf_moe(path, **kw):
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=L,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=E,
        num_experts_per_tok=K,
        max_position_embeddings=256,
        norm_topk_prob=True,
        rope_theta=10000.0,
        attn_implementation="eager",
        **kw,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    model.save_pretrained(path, safe_serialization=True)
    return model


def test_logits_and_taps_match_transformers_qwen3_moe(tmp_path):
    """fp32: logits within 1e-4 of transformers', every tap equal to HF hidden_states[k+1] within
    1e-5, the embeddings bitwise; the routing is not degenerate (tokens go to different experts),
    so the parity covers the router, the dispatch and the experts."""
    hf = _hf_moe(tmp_path)
    model, arch = load_target(tmp_path)
    assert (arch.num_experts, arch.moe_top_k, arch.moe_hidden_dim, arch.moe_norm_topk) == (E, K, 32, True)
    assert all(isinstance(m.routed_experts.inner_experts, ExactGroupedExperts) for m in moe_layers(model))
    tok = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(24).repeat(2, 1)
    with torch.no_grad():
        logits, taps = model(tok, pos, model.get_attention_masks(pos))
        ref = hf(tok, output_hidden_states=True)
        chosen = model.layers["0"].moe.router(model.layers["0"].ffn_norm(taps.embeds_BLD))[1]
    assert len({tuple(sorted(c)) for c in chosen.reshape(-1, K).tolist()}) > 4  # many different expert pairs
    # tolerance: one fp32 forward of the same weights as transformers' (other kernels and GEMM blockings)
    torch.testing.assert_close(logits, ref.logits, atol=1e-4, rtol=0)
    torch.testing.assert_close(taps.embeds_BLD, ref.hidden_states[0], atol=0, rtol=0)
    for k, tap in zip((1, 2, 4), taps.hidden):
        # tolerance: the same forward's hidden states, before the lm_head's growth of rounding
        torch.testing.assert_close(tap, ref.hidden_states[k + 1], atol=1e-5, rtol=0)


def test_export_round_trip_is_exact_and_a_moved_routing_bias_is_refused(tmp_path):
    hf = _hf_moe(tmp_path / "in")
    model, arch = load_target(tmp_path / "in")
    save_hf(model, str(tmp_path / "out"), arch)
    assert read_hf_arch(str(tmp_path / "out")) == arch
    back = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path / "out").eval()
    ref = hf.state_dict()
    assert sorted(back.state_dict()) == sorted(ref)
    for name, value in back.state_dict().items():
        assert torch.equal(value, ref[name]), name
    with torch.no_grad():
        model.layers["3"].moe.expert_bias_E[2] = 0.01  # what the balancing hook would do
    with pytest.raises(ValueError, match="routing bias of 1 MoE layer"):
        save_hf(model, str(tmp_path / "out2"), arch)


def test_hf_moe_configs_torchtitan_cannot_build_are_clear_errors(tmp_path):
    _hf_moe(tmp_path / "a", decoder_sparse_step=2)
    with pytest.raises(HFCheckpointError, match="decoder_sparse_step 2"):
        read_hf_arch(str(tmp_path / "a"))
    _hf_moe(tmp_path / "b", mlp_only_layers=[0])
    with pytest.raises(HFCheckpointError, match=r"mlp_only_layers \[0\]"):
        read_hf_arch(str(tmp_path / "b"))


def test_parameter_counts_are_the_published_ones(tmp_path):
    """Qwen3-30B-A3B: 30.5B total, 29.9B without the embedding and the (untied) lm_head, 3.3B
    activated (3.35B: the card truncates); Qwen3-235B-A22B: 235B / 22B (the model cards).
    Built on the meta device (nothing allocated). On a tiny shape the count equals
    transformers' own model's."""
    a30 = flavor_arch("qwen3", "30B-A3B")
    assert parameter_count(a30) == 30_532_122_624 and round(parameter_count(a30) / 1e9, 1) == 30.5
    assert round((parameter_count(a30) - 2 * a30.vocab_size * a30.dim) / 1e9, 1) == 29.9
    assert active_parameter_count(a30) == 3_353_032_704 and int(active_parameter_count(a30) / 1e8) == 33
    a235 = flavor_arch("qwen3", "235B-A22B")
    assert round(parameter_count(a235) / 1e9) == 235 and round(active_parameter_count(a235) / 1e9) == 22
    hf = _hf_moe(tmp_path)
    assert parameter_count(read_hf_arch(str(tmp_path))) == sum(p.numel() for p in hf.parameters())


@pytest.mark.needs_torch_2_14("expert parallelism (ep = 2)")
def test_fsdp_dp2_and_expert_parallel_ep2_match_dp1(tmp_path, train, many):
    """SFT of the tiny_moe flavor with the draft co-trained through the real entry point:
    dp=2 (FSDP) and dp=2 x ep=2 (torchtitan's expert parallelism: each rank holds 4 of the 8
    experts, tokens travel by all-to-all over gloo) give the single-process run's policy and
    draft losses and gradient norms on the same global batch."""
    common = [
        "--model.flavor",
        "tiny_moe",
        "--checkpoint.enable",
        "false",
        "--job.export_hf",
        "",
        "--training.steps",
        "2",
        "--lr_scheduler.total_steps",
        "2",
        "--draft.enable",
        "true",
        "--draft.draft_vocab_size",
        "24",
        "--draft.eagle3.ttt_steps",
        "2",
    ]
    one = train(str(tmp_path / "dp1"), 1, (*common, "--training.local_batch_size", "4"))
    two = ("--training.local_batch_size", "2", "--parallelism.data_parallel_shard_degree", "2")
    dp2, ep2 = many(
        2,
        [
            (str(tmp_path / "dp2"), (*common, *two)),
            (str(tmp_path / "ep2"), (*common, *two, "--parallelism.expert_parallel_degree", "2")),
        ],
        config="debug_cpu_sft.toml",
    )
    assert [r["step"] for r in one] == [r["step"] for r in dp2] == [r["step"] for r in ep2] == [1, 2]
    assert one[-1]["loss"] < one[0]["loss"]
    for key in ("loss", "grad_norm", "draft/loss", "draft/grad_norm"):  # the numbers, for the record (-s)
        print(
            key,
            [r[key] for r in one],
            "max |dp2 - dp1|",
            max(abs(a[key] - b[key]) for a, b in zip(one, dp2)),
            "max |ep2 - dp1|",
            max(abs(a[key] - c[key]) for a, c in zip(one, ep2)),
        )
    for a, b, c in zip(one, dp2, ep2):
        for key in ("loss", "grad_norm", "draft/loss", "draft/grad_norm"):
            # tolerance: fp32 sums in another order; step 2 after an AdamW step whose sign flips
            # move only ~0-gradient weights, so the loss moves by a second-order term only.
            assert b[key] == pytest.approx(a[key], abs=1e-5, rel=1e-5), (key, a, b)
            assert c[key] == pytest.approx(a[key], abs=1e-5, rel=1e-5), (key, a, c)


def test_rl_step_on_a_moe_policy_with_the_draft_co_trained_and_bias_balancing(tmp_path):
    """Two RL steps (2 PPO epochs each) of the tiny_moe policy with a fresh EAGLE-3 draft
    co-trained, the built-in engine generating with its MoE blocks, torchtitan's routing-bias
    balancing on (model.moe_load_balance_coeff 0.05): the engine and the trainer compute the
    same log-probs on the first update after each push (so the engine's MoE forward and the
    bias it was pushed are the trainer's), the bias moves and changes the routing within a step
    (the second update's ratio moves although a fresh policy's rewards are all equal, so its
    policy gradient is zero), both optimizers step."""
    args = [
        "--config",
        os.path.join(ROOT, "train_configs", "debug_cpu.toml"),
        "--job.dump_folder",
        str(tmp_path),
        "--model.hf_checkpoint",
        "",
        "--model.flavor",
        "tiny_moe",
        "--draft.init_from",
        "",
        "--draft.export_dir",
        "",
        "--model.moe_load_balance_coeff",
        "0.05",
        "--training.seq_len",
        "128",
        "--training.steps",
        "2",
        "--rl.ppo_epochs",
        "2",
        "--rl.prompts_per_step",
        "2",
        "--rl.group_size",
        "4",
        "--rl.max_new_tokens",
        "8",
        "--rl.baseline_interval",
        "0",
        "--rollout.progress",
        "false",
        "--checkpoint.enable",
        "false",
        "--metrics.enable_tensorboard",
        "false",
        "--lr_scheduler.warmup_steps",
        "0",
    ]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=1",
        os.path.join(ROOT, "tests/helpers/rl_updates.py"),
        *args,
    ]
    out = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT),
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    line = next(x for x in out.stdout.splitlines() if "rl_updates: " in x)
    steps = json.loads(line.split("rl_updates: ", 1)[1])
    for step, adam in zip(steps, (2.0, 4.0)):
        assert step["ratio_dev"][0] < 1e-4, step
        assert step["engine_bias_pushed"] is True, step
        assert step["policy_adam_steps"] == step["draft_adam_steps"] == [adam], step
    assert steps[0]["max_expert_bias"] > 0 and steps[1]["max_expert_bias"] > 0
    assert steps[1]["ratio_dev"][1] > 1e-4, steps  # the moved bias re-routes some tokens


@pytest.mark.parametrize(
    "config,world,args,needle",
    [
        (
            "debug_cpu_sft.toml",
            2,
            ["--parallelism.expert_parallel_degree", "2"],
            "parallelism.expert_parallel_degree = 2 needs a MoE target",
        ),
        (
            "debug_cpu_sft.toml",
            1,
            ["--model.flavor", "tiny_moe", "--parallelism.expert_parallel_degree", "2"],
            "parallelism.expert_parallel_degree = 2 must divide the 1 FSDP ranks",
        ),
        (
            "debug_cpu.toml",
            2,
            ["--model.flavor", "tiny_moe", "--parallelism.expert_parallel_degree", "2"],
            "parallelism.expert_parallel_degree = 2 with rl.enable is not supported",
        ),
        (
            "debug_cpu_sft.toml",
            1,
            ["--model.moe_load_balance_coeff", "0.001"],
            "model.moe_load_balance_coeff = 0.001 needs a MoE target; this one is dense",
        ),
        (
            "debug_cpu_sft.toml",
            1,
            ["--model.flavor", "tiny_moe", "--model.moe_load_balance_coeff", "0.001", "--job.export_hf", "hf"],
            "so job.export_hf = 'hf' would route tokens differently",
        ),
    ],
)
def test_moe_config_errors_are_one_line(tmp_path, capsys, monkeypatch, config, world, args, needle):
    from titan_spec.train.entry import main

    monkeypatch.setenv("WORLD_SIZE", str(world))
    cfg = os.path.join(ROOT, "train_configs", config)
    assert main(["--check", "--config", cfg, "--job.dump_folder", str(tmp_path), "--job.export_hf", "", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and needle in err, err


# The published Qwen3-30B-A3B config.json (Hugging Face Qwen/Qwen3-30B-A3B), as distributed.
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


@pytest.mark.needs_torch_2_14("the spmd_types backend over 8 processes (the recipe's dp = 8)")
def test_qwen3_30b_a3b_recipe_checks_against_the_real_config_without_weights(tmp_path, capsys, monkeypatch):
    """train_configs/qwen3_30b_a3b_sglang.toml on 8 ranks against a directory holding the
    published config.json and no weights (and an EAGLE-3 draft directory of the shape the
    recipe asks for, config only): `--check --no-weights` passes and reports the target's
    parameter counts, built on the meta device (30.5B / 3.3B, the model card's); plain
    `--check` names the absent weights, one line."""
    from helpers.hf_assets import write_qwen_sized_tokenizer
    from titan_spec.models.draft.eagle3.io import draft_config_json
    from titan_spec.models.draft.eagle3.model import DraftArch
    from titan_spec.models.registry import arch_from_hf_config
    from titan_spec.train.entry import main

    policy, draft = tmp_path / "Qwen3-30B-A3B", tmp_path / "Qwen3-30B-A3B-eagle3"
    policy.mkdir()
    draft.mkdir()
    (policy / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    write_qwen_sized_tokenizer(policy)  # the recipe applies its chat template
    arch = arch_from_hf_config(QWEN3_30B_A3B)
    assert arch == flavor_arch("qwen3", "30B-A3B")  # the flavor is the published shape
    (draft / "config.json").write_text(json.dumps(draft_config_json(DraftArch.from_target(arch, (1, 23, 44), 32000))))
    gsm = tmp_path / "gsm.jsonl"
    gsm.write_text('{"question": "What is 2+2?", "answer": "It is 4. #### 4"}\n')
    recipe = os.path.join(ROOT, "train_configs", "qwen3_30b_a3b_sglang.toml")
    args = [
        "--config",
        recipe,
        "--model.hf_checkpoint",
        str(policy),
        "--draft.init_from",
        str(draft),
        "--task.path",
        str(gsm),
        "--job.dump_folder",
        str(tmp_path / "out"),
    ]
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert main(["--check", "--no-weights", *args]) == 0
    out = capsys.readouterr().out
    assert "30,532,122,624 parameters, 3,353,032,704 active per token" in out, out
    assert main(["--check", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no model.safetensors" in err, err


def test_policy_names_for_sglang_are_the_hf_checkpoint_names(tmp_path):
    """What an SGLang engine is pushed for a MoE policy: exactly the HF checkpoint's names and
    tensors (experts split per expert), the routing bias dropped while it is 0 and refused once
    it moved (SGLang's Qwen3-MoE routes without one)."""
    from safetensors.torch import load_file

    from titan_spec.rollout.weight_names import policy_to_hf_names

    _hf_moe(tmp_path)
    model, arch = load_target(tmp_path, taps=())
    hf_sd = load_file(tmp_path / "model.safetensors")
    pushed = dict(policy_to_hf_names(model.state_dict(), arch))
    assert sorted(pushed) == sorted(hf_sd)
    for name, value in pushed.items():
        assert torch.equal(value, hf_sd[name]), name
    with torch.no_grad():
        model.layers["0"].moe.expert_bias_E[0] = -0.02
    with pytest.raises(ValueError, match="the policy weights for SGLang: the routing bias"):
        policy_to_hf_names(model.state_dict(), arch)
