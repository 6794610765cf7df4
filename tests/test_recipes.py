"""The GPU recipes (train_configs/qwen3_{0.6b,1.7b,8b}_sglang.toml, qwen3_{0.6b,8b}_vllm.toml)
pass ``--check`` against directories with the real models' structure and absent weights, and
the target they build has the published size.

Each fixture directory holds the config.json Qwen publishes for the model, Qwen3's tokenizer
layout (a byte-level BPE of 151643 entries, the added tokens at 151643..151668, Qwen's
tokenizer_config.json special tokens and a Qwen-style chat template) and safetensors whose
headers name the tensors transformers' Qwen3ForCausalLM has (built on the meta device: the
independent reference), sharded as the published checkpoints are, with the data left out
(sparse files). The draft directory is an EAGLE-3 draft of the target's width.

Published sizes (the Qwen3 model cards on Hugging Face, "Number of Parameters" and
"(Non-Embedding)"): 0.6B / 0.44B, 1.7B / 1.4B, 8.2B / 6.95B.
"""

import json
import os
import shlex
import sys
import tomllib

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from helpers.hf_assets import gsm8k_records, write_jsonl, write_qwen_sized_tokenizer, write_sparse_safetensors  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_COMMON = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_position_embeddings": 40960,
    "model_type": "qwen3",
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
# name -> (config.json fields, safetensors shards of the published checkpoint, published total
# and non-embedding parameters as the model card rounds them: (value in B, decimals)).
MODELS = {
    "0.6b": (
        {
            "hidden_size": 1024,
            "intermediate_size": 3072,
            "num_attention_heads": 16,
            "num_hidden_layers": 28,
            "max_window_layers": 28,
            "tie_word_embeddings": True,
        },
        1,
        (0.6, 1),
        (0.44, 2),
    ),
    "1.7b": (
        {
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "num_attention_heads": 16,
            "num_hidden_layers": 28,
            "max_window_layers": 28,
            "tie_word_embeddings": True,
        },
        2,
        (1.7, 1),
        (1.4, 1),
    ),
    "8b": (
        {
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "num_attention_heads": 32,
            "num_hidden_layers": 36,
            "max_window_layers": 36,
            "tie_word_embeddings": False,
        },
        5,
        (8.2, 1),
        (6.95, 2),
    ),
}


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory):
    return write_qwen_sized_tokenizer(tmp_path_factory.mktemp("qwen_tok"))


def _hf_shapes(cfg: dict) -> tuple[dict, int]:
    """transformers' Qwen3ForCausalLM on the meta device: its checkpoint names and shapes, its parameter count."""
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**cfg))
    sd = model.state_dict()
    if cfg["tie_word_embeddings"]:
        sd.pop("lm_head.weight")  # tied: the published checkpoints do not store it
    return {k: tuple(v.shape) for k, v in sd.items()}, sum(p.numel() for p in model.parameters())


def header_commands(path: str) -> list[tuple[dict[str, str], list[str]]]:
    """The ``./run_train.sh`` commands a TOML's header comment shows: (environment
    assignments, arguments), a command continued on the comment lines indented below it,
    cut at "..." or ";" (the header's own elisions)."""
    lines = []
    with open(path) as f:
        for line in f:
            if not line.startswith("#"):
                break
            lines.append(line[1:].rstrip("\n"))
    commands, i = [], 0
    while i < len(lines):
        text = lines[i]
        i += 1
        if "./run_train.sh" not in text:
            continue
        while i < len(lines) and lines[i].startswith("     ") and lines[i].strip().startswith("--"):
            text += " " + lines[i]
            i += 1
        head, tail = text.split("./run_train.sh", 1)
        words = shlex.split(head + " ./run_train.sh " + tail.split(";")[0].split("...")[0].split("(")[0])
        at = words.index("./run_train.sh")
        start = at
        while start > 0 and "=" in words[start - 1] and words[start - 1].split("=")[0].isupper():
            start -= 1
        args = words[at + 1 :]
        if args and not args[0].startswith("--"):
            continue  # prose about run_train.sh, not a command
        commands.append((dict(w.split("=", 1) for w in words[start:at]), args))
    return commands


@pytest.mark.parametrize(
    "name", sorted(f for f in os.listdir(os.path.join(ROOT, "train_configs")) if f.endswith(".toml"))
)
def test_every_header_command_is_one_run_train_accepts(name, monkeypatch, tmp_path, capsys):
    """run_train.sh takes its config from CONFIG_FILE and its arguments as overrides
    (``--config`` is refused): every command a header shows runs in ``--plan`` form (what
    run_train.sh runs first) with its NGPU as the world size. A command on a user's model
    (/models/..., /data/...) is planned on the real structure by the test below."""
    from titan_spec.train.entry import main

    for env, args in header_commands(os.path.join(ROOT, "train_configs", name)):
        assert "--config" not in args, (name, args)
        cfg = env.get("CONFIG_FILE", "train_configs/debug_cpu.toml")
        with open(os.path.join(ROOT, cfg)) as f:
            on_user_model = "/models/" in f.read()
        if on_user_model or any(a.startswith(("/models/", "/data/")) for a in args):
            continue
        monkeypatch.setenv("WORLD_SIZE", env.get("NGPU", "1"))
        monkeypatch.chdir(ROOT)  # the chains' paths are relative to the repository, as run_train.sh runs them
        capsys.readouterr()
        rc = main(["--plan", "--config", cfg, *args])
        assert rc == 0, (name, env, args, capsys.readouterr().err)


# Every GPU recipe qwen3_<size>_<engine>.toml of a size in MODELS, for each rollout engine it exists for.
RECIPES = sorted(
    f
    for f in os.listdir(os.path.join(ROOT, "train_configs"))
    if f.startswith("qwen3_") and f.endswith(".toml") and f.split("_")[1] in MODELS
)


def test_the_recipes_cover_both_server_engines():
    assert {
        "qwen3_0.6b_sglang.toml",
        "qwen3_1.7b_sglang.toml",
        "qwen3_8b_sglang.toml",
        "qwen3_0.6b_vllm.toml",
        "qwen3_8b_vllm.toml",
    } <= set(RECIPES), RECIPES


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_checks_against_the_real_structure(recipe, tmp_path, tokenizer_files, capsys, monkeypatch):
    import titan_spec.preflight.plan as plan
    from titan_spec.models.draft.eagle3.io import EXPORT_KEYS, draft_config_json

    # The GPU recipes' first checkpoint needs their machine's disk (8B: ~100 GB), not this
    # one's; the disk check has its own test (test_plan_validation.py).
    monkeypatch.setattr(plan, "check_free_space", lambda *a: None)
    from titan_spec.models.draft.eagle3.model import DraftArch, Eagle3Draft
    from titan_spec.models.hf_io import read_hf_arch
    from titan_spec.models.registry import parameter_count
    from titan_spec.train.entry import main

    size, engine = recipe[len("qwen3_") : -len(".toml")].split("_")
    fields, shards, total, non_embedding = MODELS[size]
    cfg = {**_COMMON, **fields}
    model_dir = tmp_path / f"Qwen3-{size}"
    shapes, hf_count = _hf_shapes(cfg)
    write_sparse_safetensors(model_dir, shapes, shards=shards)
    (model_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        os.symlink(os.path.join(tokenizer_files, name), model_dir / name)
    arch = read_hf_arch(str(model_dir))
    L = arch.n_layers
    draft = DraftArch.from_target(arch, (1, L // 2 - 1, L - 4), 32000)
    draft_dir = tmp_path / "eagle3"
    with torch.device("meta"):
        dsd = Eagle3Draft(draft).state_dict()
    write_sparse_safetensors(
        draft_dir, {k: tuple(dsd[k].shape) for k in EXPORT_KEYS}, dtypes={"d2t": "int64", "t2d": "bool"}
    )
    (draft_dir / "config.json").write_text(json.dumps(draft_config_json(draft, torch.bfloat16)))
    data = write_jsonl(tmp_path / "train.jsonl", gsm8k_records(4))

    capsys.readouterr()
    path = os.path.join(ROOT, "train_configs", recipe)
    with open(path, "rb") as f:
        assert tomllib.load(f)["rollout"]["engine"] == engine  # the file's name says its rollout engine
    rc = main(
        [
            "--check",
            "--config",
            path,
            "--model.hf_checkpoint",
            str(model_dir),
            "--draft.init_from",
            str(draft_dir),
            "--task.path",
            data,
        ]
    )
    assert rc == 0, capsys.readouterr().err
    # The header's command for the draft this recipe needs, as written, in --plan form: on
    # this model directory and data file (the header's /models and /data paths).
    ((env, args),) = [c for c in header_commands(path) if c[0].get("CONFIG_FILE") != f"train_configs/{recipe}"]
    args = [str(model_dir) if a.startswith("/models/") else data if a.startswith("/data/") else a for a in args]
    rc = main(
        [
            "--plan",
            "--config",
            os.path.join(ROOT, env["CONFIG_FILE"]),
            *args,
            "--job.dump_folder",
            str(tmp_path / "draft_run"),
        ]
    )
    assert rc == 0, capsys.readouterr().err

    n = parameter_count(arch)
    assert n == hf_count  # titan_spec's target = transformers' model, parameter for parameter
    emb = arch.vocab_size * arch.dim * (1 if arch.tie_embeddings else 2)
    assert round(n / 1e9, total[1]) == total[0], n
    assert round((n - emb) / 1e9, non_embedding[1]) == non_embedding[0], n - emb
    print(f"Qwen3-{size}: {n:,} parameters ({n - emb:,} non-embedding)")
