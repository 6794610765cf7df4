"""Config loading: typed sections, CLI overrides, and one clear line per malformed config."""

import os
import subprocess

import pytest

import titan_spec  # noqa: F401
from titan_spec.config import ConfigError, load_config, parse_overrides
from titan_spec.rollout.builtin.engine import BuiltinEngineConfig

DEFAULT = "train_configs/debug_cpu_sft.toml"  # the default RL run reads its outputs


def test_default_config_loads_and_overrides_apply():
    cfg = load_config(DEFAULT, ["--training.steps", "7", "--compile.enable", "true", "--optimizer.lr=1e-4"])
    assert cfg.training.steps == 7
    assert cfg.compile.enable is True
    assert cfg.optimizer.lr == pytest.approx(1e-4)
    assert cfg.model.name == "qwen3"


def test_engine_config_from_sections():
    cfg = load_config(DEFAULT, ["--speculative.num_draft_tokens", "3", "--rollout.max_batch_size", "8"])
    e = BuiltinEngineConfig.from_sections(cfg.rollout, cfg.speculative)
    assert (e.num_draft_tokens, e.max_batch_size) == (3, 8)
    assert e.depth == "adaptive"  # the default (docs/rollout_engine.md, "Adaptive depth")
    cfg = load_config(DEFAULT, ["--speculative.enabled", "false"])
    assert BuiltinEngineConfig.from_sections(cfg.rollout, cfg.speculative).num_draft_tokens == 0
    # The servers run their fixed chain: the default's effective depth is "fixed" there (an
    # explicit "adaptive" is an error, MALFORMED), while the config keeps what was set.
    for engine in ("sglang", "vllm"):
        spec = load_config(DEFAULT, ["--rollout.engine", engine], check_paths=False).speculative
        assert (spec.depth, spec.effective_depth(engine)) == ("adaptive", "fixed")
    cfg = load_config(DEFAULT, ["--speculative.depth", "fixed"])
    assert BuiltinEngineConfig.from_sections(cfg.rollout, cfg.speculative).depth == "fixed"


def test_validate_changes_nothing():
    """The checks read the config: every value after validate() is the one loaded, also the
    keys a server engine resolves differently (speculative.depth under vLLM / SGLang)."""
    import copy

    from titan_spec.config import validate

    for engine in ("builtin", "sglang", "vllm"):
        cfg = load_config("train_configs/debug_cpu.toml", ["--rollout.engine", engine], check_paths=False)
        before = copy.deepcopy(cfg)
        validate(cfg, world_size=1)
        assert cfg == before, engine
        assert cfg.speculative.depth == "adaptive"
        assert cfg.speculative.effective_depth(engine) == ("adaptive" if engine == "builtin" else "fixed")


def test_every_moved_key_is_refused_in_one_line_naming_its_new_key(tmp_path):
    from titan_spec.config.loader import MOVED

    assert len(MOVED) == 17
    for old, new in MOVED.items():
        section, leaf = old.split(".")
        table = new.rsplit(".", 1)[0]
        # In a file: the file, the old key, the new table and key.
        path = _write(tmp_path, f"[{section}]\n{leaf} = 1\n")
        with pytest.raises(ConfigError) as info:
            load_config(path)
        assert str(info.value) == f"{path}: {old} moved to [{table}] {leaf} ({new})"
        # On the command line: the override as given, and the one to give.
        with pytest.raises(ConfigError) as info:
            load_config(DEFAULT, [f"--{old}", "1"])
        assert str(info.value) == f"command line --{old}: {old} moved to [{table}] {leaf} (--{new})"
        # The new key is accepted where it now lives.
        raw, want = NEW_VALUES.get(leaf, ("2", 2))
        node = load_config(DEFAULT, ["--rl.loss", "dapo", f"--{new}", raw], check_paths=False)
        for part in new.split("."):
            node = getattr(node, part)
        assert node == want, new


NEW_VALUES = {
    "operators": ("'+'", "+"),
    "overlong_filter": ("true", True),
    "show_work": ("true", True),
    "trace_fraction": ("0.25", 0.25),
    "wrong_answer_rate": ("0.25", 0.25),
    "max_count": ("20", 20),
}
"""A value each moved key's own checks take (the rest: 2), for the config the tests load."""


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--draft.blok_size", "4"], "unknown key 'draft.blok_size' (did you mean 'draft.dflash.block_size'?)"),
        (["--draft.dflash.blok_size", "4"], "unknown key 'draft.dflash.blok_size' (did you mean 'block_size'?)"),
        (["--task.max_operandd", "4"], "(did you mean 'task.generated.max_operand'?)"),
        (["--rl.dapo.overlong_bufer", "4"], "(did you mean 'overlong_buffer'?)"),
    ],
)
def test_unknown_keys_still_get_did_you_mean(args, needle):
    with pytest.raises(ConfigError) as info:
        load_config(DEFAULT, args)
    assert needle in str(info.value) and "\n" not in str(info.value), info.value


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
@pytest.mark.parametrize(
    "key,value,allowed",
    [
        ("port", 70000, "0 (free port) or a port number"),
        ("start_timeout_s", 0.0, "> 0"),
        ("request_timeout_s", -1.0, "> 0"),
        ("max_restarts", -1, ">= 0"),
    ],
)
def test_server_engines_share_their_base_and_its_checks(engine, key, value, allowed):
    """[rollout.sglang] and [rollout.vllm] take the shared keys of ServerEngineConfig, each
    checked once and named under the engine's own table."""
    from titan_spec.config import SGLangConfig, ServerEngineConfig, VLLMConfig

    cls = {"sglang": SGLangConfig, "vllm": VLLMConfig}[engine]
    assert issubclass(cls, ServerEngineConfig)
    # The engines' own defaults where they differ.
    assert (SGLangConfig().start_timeout_s, VLLMConfig().start_timeout_s) == (900.0, 600.0)
    with pytest.raises(ConfigError) as info:
        load_config(DEFAULT, [f"--rollout.{engine}.{key}", str(value)])
    assert str(info.value) == (
        f"command line --rollout.{engine}.{key}: rollout.{engine}.{key} = {value!r} "
        f"is not allowed; it must be {allowed}"
    )


def test_parse_overrides_types():
    out = parse_overrides(["--draft.tap_layer_ids", "[1,2,3]", "--job.dump_folder", "./x", "--a.b", "false"])
    assert out == {"draft": {"tap_layer_ids": [1, 2, 3]}, "job": {"dump_folder": "./x"}, "a": {"b": False}}


def _write(tmp_path, text):
    p = tmp_path / "c.toml"
    p.write_text(text)
    return str(p)


# (toml text or None, CLI overrides, world size, substrings the one-line message must contain)
MALFORMED = [
    ("[trainig]\nsteps = 3\n", [], 1, ["unknown section 'trainig'", "did you mean 'training'", "valid sections"]),
    ("[training]\nstepz = 3\n", [], 1, ["unknown key 'training.stepz'", "did you mean 'steps'"]),
    ("[training]\nsteps = 'three'\n", [], 1, ["training.steps", "wrong type", "an integer"]),
    ("[training]\nsteps = 0\n", [], 1, ["training.steps = 0", ">= 1"]),
    ("[compile]\nenable = 1\n", [], 1, ["compile.enable", "true or false"]),
    ("[model]\nname = 'gpt2'\n", [], 1, ["model.name", "'qwen3', 'llama3'"]),
    ("[optimizer]\nlr = -0.1\n", [], 1, ["optimizer.lr", "positive"]),
    ("[optimizer]\nbeta2 = 1.5\n", [], 1, ["optimizer.beta2", "[0, 1)"]),
    ("[parallelism]\ndata_parallel_shard_degree = 2\n", [], 1, ["do not multiply to the world size", "1 processes"]),
    ("[parallelism]\ndata_parallel_shard_degree = 2\n", [], 4, ["= 2, but 4 processes"]),
    ("[task.generated]\noperators = '+/'\n", [], 1, ["task.generated.operators", "subset of '+-*'"]),
    ("[task]\nname = 'jsonl'\n", [], 1, ["task.path is empty"]),
    ("steps = 3\n", [], 1, ["top-level key 'steps' must be inside a [section]"]),
    ("[training\nsteps = 3\n", [], 1, ["not valid TOML"]),
    ("[model]\nhf_checkpoint = '/nonexistent/dir'\n", [], 1, ["model.hf_checkpoint", "is not a directory"]),
    ("", ["--training.steps"], 1, ["--training.steps has no value"]),
    ("", ["training.steps", "3"], 1, ["is not an override"]),
    ("", ["--draft.tap_layer_ids", "[1, 'a']"], 1, ["draft.tap_layer_ids", "a list of an integer"]),
    ("", ["--draft.tap_layer_ids", "[1, 2]"], 1, ["draft.tap_layer_ids = [1, 2] must be three distinct"]),
    ("", ["--draft.loss_decay", "0"], 1, ["draft.loss_decay", "(0, 1]"]),
    ("[metrics]\nlog_freq = 0\n", [], 1, ["metrics.log_freq"]),
    ("[speculative]\nnum_draft_tokens = 0\n", [], 1, ["speculative.num_draft_tokens", "speculative.enabled = false"]),
    ("[rollout]\nengine = 'vlm'\n", [], 1, ["rollout.engine", "'builtin', 'sglang', 'vllm'"]),
    (
        "[rollout]\nengine = 'torch'\n",
        [],
        1,
        ["rollout.engine = 'torch' was renamed: use rollout.engine = 'builtin'", "'builtin', 'sglang', 'vllm'"],
    ),
    ("", ["--rollout.engine", "torch"], 1, ["--rollout.engine", "was renamed: use rollout.engine = 'builtin'"]),
    ("[speculative]\ndepth = 'auto'\n", [], 1, ["speculative.depth", "'fixed', 'adaptive'"]),
    (
        "[speculative]\ndepth = 'adaptive'\n[rollout]\nengine = 'sglang'\n",
        [],
        1,
        ["speculative.depth = 'adaptive' is not allowed with rollout.engine = 'sglang'", "must be 'fixed'"],
    ),
    ("[training]\nlocal_batch_size = 2.5\n", [], 1, ["training.local_batch_size", "an integer"]),
    (
        "[parallelism]\ntensor_parallel_degree = 2\ndata_parallel_shard_degree = 1\n",
        [],
        2,
        ["tensor_parallel_degree = 2 needs parallelism.spmd_backend = 'partial_dtensor'", "not 'spmd_types'"],
    ),
    (
        "[parallelism]\ntensor_parallel_degree = 2\ndata_parallel_shard_degree = 1\nspmd_backend = 'partial_dtensor'\n[training]\nseq_len = 129\n",
        [],
        2,
        ["training.seq_len = 129", "a multiple of 2 = parallelism.tensor_parallel_degree 2 under sequence parallelism"],
    ),
    (
        "[parallelism]\ntensor_parallel_degree = 2\ndata_parallel_shard_degree = 1\nspmd_backend = 'partial_dtensor'\ncontext_parallel_degree = 2\n[training]\nseq_len = 132\n",
        [],
        4,
        [
            "training.seq_len = 132",
            "a multiple of 8 = parallelism.tensor_parallel_degree 2 x 2 * context_parallel_degree 2",
        ],
    ),
    (
        "[parallelism]\ntensor_parallel_degree = 2\ndata_parallel_shard_degree = 1\nspmd_backend = 'partial_dtensor'\npipeline_parallel_degree = 2\n",
        [],
        4,
        [
            "tensor_parallel_degree = 2 with pipeline_parallel_degree = 2 is not supported",
            "composes with FSDP and context parallelism",
        ],
    ),
    (
        "[parallelism]\ntensor_parallel_degree = 2\ndata_parallel_shard_degree = 2\nspmd_backend = 'partial_dtensor'\n[rl]\nenable = true\nprompts_per_step = 3\n[speculative]\nenabled = false\n",
        [],
        4,
        ["rl.prompts_per_step = 3", "multiple of the 2 data-parallel ranks"],
    ),
    ("[parallelism]\ncontext_parallel_degree = 2\n", [], 3, ["cp = 2 does not divide the 3 processes"]),
    (
        "[parallelism]\ncontext_parallel_degree = 2\n[training]\nseq_len = 130\n",
        [],
        2,
        ["training.seq_len = 130", "a multiple of 2 * parallelism.context_parallel_degree = 4"],
    ),
    (
        "[parallelism]\ncontext_parallel_degree = 2\npipeline_parallel_degree = 2\n[task]\ndocument_multiple = 2\n",
        [],
        4,
        [
            "task.document_multiple = 2 under pipeline x context parallelism",
            "a multiple of 2 * context_parallel_degree = 4",
        ],
    ),
    ("[task]\ndocument_multiple = -1\n", [], 1, ["task.document_multiple = -1", ">= 0"]),
    ("[rl]\nloss = 'ppo'\n", [], 1, ["rl.loss", "'grpo', 'dapo', 'gspo'"]),
    ("[rl]\ntis_cap = 0.0\n", [], 1, ["rl.tis_cap = 0.0 is not allowed", "> 0"]),
    ("[rl]\ndual_clip = 1.0\n", [], 1, ["rl.dual_clip = 1.0 is not allowed", "0 (off) or > 1"]),
    ("[rl]\nloss_agg = 'seq-mean'\n", [], 1, ["rl.loss_agg", "'token-mean', 'seq-mean-token-mean'"]),
    ("[rl]\ntis = 'token'\n", [], 1, ["rl.tis = 'token'", "rl.behaviour_logprobs = 'recompute'"]),
    ("[rl]\nkl_estimator = 'k4'\n", [], 1, ["rl.kl_estimator", "'k1', 'k2', 'k3'"]),
    ("[rl]\ndynamic_sampling = true\ngroup_size = 1\n", [], 1, ["rl.group_size = 1", ">= 2"]),
    ("[rl]\ndynamic_sampling_rounds = 0\n", [], 1, ["rl.dynamic_sampling_rounds = 0", ">= 1"]),
    (
        "[rl.dapo]\noverlong_filter = true\n",
        [],
        1,
        ["rl.dapo.overlong_filter = True is DAPO's: it needs rl.loss = 'dapo'"],
    ),
    (
        "[rl]\nloss = 'dapo'\nmax_new_tokens = 8\n[rl.dapo]\noverlong_buffer = 8\n",
        [],
        1,
        ["rl.dapo.overlong_buffer = 8", "< rl.max_new_tokens = 8"],
    ),
    (
        "[parallelism]\nexpert_parallel_degree = 2\n[rl]\nenable = true\n",
        [],
        2,
        ["expert_parallel_degree = 2 with rl.enable is not supported"],
    ),
    ("[model]\nmoe_load_balance_coeff = -1.0\n", [], 1, ["model.moe_load_balance_coeff = -1.0", ">= 0"]),
    (
        "[task]\ndocument_multiple = 3\n[training]\nseq_len = 128\n",
        [],
        1,
        ["training.seq_len = 128", "document multiple 3"],
    ),
]


@pytest.mark.parametrize("text,overrides,world,needles", MALFORMED)
def test_malformed_config_gives_one_clear_line(tmp_path, text, overrides, world, needles):
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides, world_size=world)
    msg = str(info.value)
    assert "\n" not in msg
    for needle in needles:
        assert needle in msg, msg


def test_missing_config_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("/nonexistent/x.toml")


@pytest.mark.parametrize(
    "config,args,needle",
    [
        # The default (RL, which requires the SFT and draft runs): caught before the SFT run starts.
        ("", ["--training.stepz", "3"], "unknown key 'training.stepz'"),
        ("", ["--model.hf_checkpoint", "/tmp"], "has no config.json"),
        ("", ["--rl.group_size", "1"], "rl.group_size = 1"),
        (DEFAULT, ["--draft.enable", "true", "--draft.tap_layer_ids", "[1, 2, 9]"], "out of range"),
    ],
)
def test_run_train_config_error_is_one_line_and_starts_nothing(tmp_path, config, args, needle):
    """Through ./run_train.sh: one line, exit 2, no torchrun, no output folder.

    run_train.sh works in its own folder and the chain's runs write to ./outputs/ there, so
    it runs from a view of the repository in tmp_path (links to its files): any folder that
    a started run makes shows up in the view, whatever the repository's outputs/ holds."""
    dump = tmp_path / "never"
    env = dict(os.environ, CONFIG_FILE=config) if config else None
    view = _repo_view(tmp_path)
    before = sorted(os.listdir(view))
    out = subprocess.run(
        ["./run_train.sh", "--job.dump_folder", str(dump), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=view,
        env=env,
    )
    assert out.returncode == 2, out.stderr
    lines = [
        line
        for line in out.stderr.splitlines()
        if line.strip() and "Warning" not in line and "register_constant" not in line
    ]
    assert len(lines) == 1 and needle in lines[0], out.stderr
    assert not dump.exists()
    # No required run started either: run_train.sh announces none, and nothing was written
    # where they write (no ./outputs/ in the view).
    assert "titan_spec: run" not in out.stdout, out.stdout
    assert sorted(os.listdir(view)) == before


_VIEW = ("run_train.sh", "scripts", "titan_spec", "train_configs", "pyproject.toml", ".venv")


def _repo_view(tmp_path) -> str:
    """A folder of links to what run_train.sh needs from the repository (scripts/ensure_env.sh
    finds .venv and pyproject.toml next to its scripts/ folder, i.e. in the view)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    view = tmp_path / "repo"
    view.mkdir()
    for name in _VIEW:
        (view / name).symlink_to(os.path.join(root, name))
    return str(view)


def test_tap_ids_out_of_range_is_a_config_error():
    from titan_spec.preflight import to_trainer_config

    cfg = load_config(DEFAULT, ["--draft.tap_layer_ids", "[1, 3, 8]"])
    with pytest.raises(ConfigError, match=r"out of range: the target has 8 layers"):
        to_trainer_config(cfg)


@pytest.mark.parametrize(
    "tp,why", [(3, "does not divide the target's 4 query heads"), (4, "does not divide the target's 2 key/value heads")]
)
def test_tp_not_dividing_the_heads_is_one_line_before_any_process(tp, why, monkeypatch, capsys):
    """torchtitan's TP plan shards q and k/v heads: `--check` (run_train.sh's pre-flight, no process
    group) refuses a degree that does not divide them, naming the allowed sizes."""
    from titan_spec.train.entry import main

    monkeypatch.setenv("WORLD_SIZE", str(tp))
    argv = [
        "--check",
        "--config",
        os.path.join(os.path.dirname(DEFAULT), "debug_cpu_sft.toml"),
        "--parallelism.tensor_parallel_degree",
        str(tp),
        "--parallelism.data_parallel_shard_degree",
        "1",
        "--training.seq_len",
        str(48 * tp),
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and why in err and "allowed: a divisor of n_heads 4, n_kv_heads 2" in err, err


def test_draft_vocab_larger_than_target_is_an_error():
    from titan_spec.preflight import to_trainer_config

    cfg = load_config(DEFAULT, ["--draft.enable", "true", "--draft.draft_vocab_size", "100000"])
    with pytest.raises(ConfigError, match=r"draft.draft_vocab_size = 100000 must be in 1\.\.100"):
        to_trainer_config(cfg)


@pytest.mark.parametrize(
    "name",
    sorted(
        f for f in os.listdir(os.path.join(os.path.dirname(__file__), "..", "train_configs")) if f.endswith(".toml")
    ),
)
def test_every_shipped_config_is_valid(name):
    """Each train_configs/*.toml loads and validates (inputs made by earlier runs of a chain are
    not checked: check_paths=False), at the world size its parallel degrees need."""
    import tomllib

    path = os.path.join(os.path.dirname(__file__), "..", "train_configs", name)
    with open(path, "rb") as f:
        p = tomllib.load(f).get("parallelism", {})
    world = p.get("pipeline_parallel_degree", 1) * p.get("context_parallel_degree", 1)
    cfg = load_config(path, world_size=world, check_paths=False)
    assert cfg.training.steps >= 1
