"""`--plan` on a fresh checkout: every config error of the whole job.requires chain, one line,
exit 2, before anything trains and with nothing written (docs/RELIABILITY.md, Validation).

Setup: a tmp copy of the repository's train_configs whose ./outputs/ paths point into tmp_path
and no outputs at all, i.e. a fresh checkout: the RL run (debug_cpu.toml) requires the offline
draft run, which requires the SFT run; the RL run's model.hf_checkpoint and draft.init_from
are what those runs will export. Most cases go through ``titan_spec.train.entry.main(["--plan",
...])`` in-process (the function the ``--plan`` command calls; stderr captured); a few go
through the real ``python -m titan_spec.train --plan`` and run_train.sh subprocesses.

Guarantees relied on: plan_runs validates a later run against the architecture an earlier
run's config gives its exports (chain-only errors below); load_config rejects non-finite
numbers in one place and names where each value came from; resolve_arch / draft_arch_for read
safetensors headers against the architecture; run_train.sh checks NGPU before any Python.
"""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

import titan_spec  # noqa: F401
from titan_spec.train.entry import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RL, DRAFT, SFT = "debug_cpu.toml", "debug_cpu_draft.toml", "debug_cpu_sft.toml"


def fresh_checkout(tmp_path, edit: dict[str, tuple[str, str]] | None = None) -> str:
    """A copy of train_configs under tmp_path with every ./outputs/ path under tmp_path/outputs
    (which does not exist); ``edit``: file name -> (old text, new text) for a malformed file."""
    confs = tmp_path / "train_configs"
    confs.mkdir()
    for name in os.listdir(os.path.join(ROOT, "train_configs")):
        if name.endswith(".toml"):
            text = (
                open(os.path.join(ROOT, "train_configs", name)).read().replace('"./outputs/', f'"{tmp_path}/outputs/')
            )
            if edit and name in edit:
                old, new = edit[name]
                assert old in text, (name, old)
                text = text.replace(old, new)
            (confs / name).write_text(text)
    return str(confs)


def tree(root) -> set[str]:
    """Every file and folder under root (bytecode caches aside: imports may write those)."""
    out = set()
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if x not in ("__pycache__", ".pytest_cache")]
        out.update(os.path.relpath(os.path.join(d, f), root) for f in [*files, ""])
    return out


# --- real input files: a tiny qwen3 policy (the SFT flavor sized to the tokenizer) and its draft


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """Valid checkpoints written by the real writers (save_hf, save_draft) and malformed copies."""
    import torch

    from titan_spec.data.tokenizer import CharTokenizer
    from titan_spec.models.draft.eagle3.model import DraftArch, Eagle3Draft
    from titan_spec.models.draft.eagle3.io import save_draft
    from titan_spec.models.hf_io import save_hf, write_safetensors_dir
    from titan_spec.models.registry import build_target_config, flavor_arch, with_vocab
    from safetensors.torch import load_file

    base = tmp_path_factory.mktemp("inputs")
    torch.manual_seed(0)
    arch = with_vocab(flavor_arch("qwen3", "tiny"), CharTokenizer().get_vocab_size())
    save_hf(build_target_config(arch).build(), str(base / "hf"), arch, tokenizer=CharTokenizer())
    d = DraftArch.from_target(arch, (1, 3, 4), 32)
    save_draft(Eagle3Draft(d), str(base / "draft"))
    # Another target width (qwen3/small: 128): its draft does not fit a 64-wide target.
    wide = with_vocab(flavor_arch("qwen3", "small"), arch.vocab_size)
    save_draft(Eagle3Draft(DraftArch.from_target(wide, (1, 3, 4), 32)), str(base / "draft_wide"))

    def variant(src, name, fn):
        shutil.copytree(base / src, base / name)
        fn(base / name)
        return str(base / name)

    def truncate(p):
        f = p / "model.safetensors"
        f.write_bytes(f.read_bytes()[: os.path.getsize(f) // 2])

    def corrupt_header(p):
        f = p / "model.safetensors"
        raw = bytearray(f.read_bytes())
        raw[8:40] = os.urandom(32)  # inside the JSON header
        f.write_bytes(bytes(raw))

    def bad_length(p):  # the 8-byte header length overwritten
        f = p / "model.safetensors"
        f.write_bytes(os.urandom(8) + f.read_bytes()[8:])

    def trailing_bytes(p):
        with open(p / "model.safetensors", "ab") as f:
            f.write(b"\0" * 100)

    def drop_tensor(p):
        sd = load_file(str(p / "model.safetensors"))
        del sd["model.layers.3.mlp.up_proj.weight"]
        write_safetensors_dir(str(p), sd, json.loads((p / "config.json").read_text()), extra=CharTokenizer().save)

    def wider_mlp(p):  # config.json says intermediate_size 256; the tensors are 192
        cfg = json.loads((p / "config.json").read_text())
        cfg["intermediate_size"] = 256
        (p / "config.json").write_text(json.dumps(cfg))

    def draft_config(**fields):  # the draft's config.json with fields replaced (None: JSON null)
        def edit(p):
            cfg = json.loads((p / "config.json").read_text())
            cfg.update(fields)
            if "eagle_aux_hidden_state_layer_ids" in fields:
                cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = fields["eagle_aux_hidden_state_layer_ids"]
            (p / "config.json").write_text(json.dumps(cfg))

        return edit

    def draft_d2t(fn):  # the draft's d2t rewritten by fn (the other tensors and config.json kept)
        def edit(p):
            sd = load_file(str(p / "model.safetensors"))
            sd["d2t"] = fn(sd["d2t"].clone())
            write_safetensors_dir(str(p), sd, json.loads((p / "config.json").read_text()))

        return edit

    def d2t_outside(d2t):  # draft id 31 -> target id 31 + 80 = 111, past the 100-id vocabulary
        d2t[31] = 80
        return d2t

    def d2t_repeated(d2t):  # draft ids 4 and 5 -> target id 4
        d2t[5] = -1
        return d2t

    # Dataset files: a record whose question alone is 150+ tokens; MATH-style \\boxed{} solutions.
    (base / "long_question.jsonl").write_text(
        json.dumps({"question": "long words " * 15, "answer": "#### 2"})
        + "\n"
        + json.dumps({"question": "2+2?", "answer": "#### 4"})
        + "\n"
    )
    (base / "math.jsonl").write_text(
        json.dumps({"problem": "1+1?", "solution": "so \\boxed{2}"})
        + "\n"
        + json.dumps({"problem": "2+2?", "solution": "\\boxed{4}"})
        + "\n"
    )

    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"question": ["1+1?"] * 50, "answer": ["#### 2"] * 50}), base / "ok.parquet")
    raw = (base / "ok.parquet").read_bytes()
    (base / "truncated.parquet").write_bytes(raw[: len(raw) // 2])
    (base / "empty.parquet").write_bytes(b"")

    return {
        "parquet_truncated": str(base / "truncated.parquet"),
        "parquet_empty": str(base / "empty.parquet"),
        "long_question": str(base / "long_question.jsonl"),
        "math_jsonl": str(base / "math.jsonl"),
        "draft_null_heads": variant("draft", "draft_null_heads", draft_config(num_attention_heads=None)),
        "draft_hidden_words": variant("draft", "draft_hidden_words", draft_config(hidden_size="sixty-four")),
        "draft_vocab_500": variant("draft", "draft_vocab_500", draft_config(draft_vocab_size=500)),
        "draft_tap_99": variant("draft", "draft_tap_99", draft_config(eagle_aux_hidden_state_layer_ids=[1, 3, 99])),
        "draft_d2t_outside": variant("draft", "draft_d2t_outside", draft_d2t(d2t_outside)),
        "draft_d2t_repeated": variant("draft", "draft_d2t_repeated", draft_d2t(d2t_repeated)),
        "hf": str(base / "hf"),
        "draft": str(base / "draft"),
        "draft_wide": str(base / "draft_wide"),
        "hf_no_weights": variant("hf", "hf_no_weights", lambda p: (p / "model.safetensors").unlink()),
        "hf_truncated": variant("hf", "hf_truncated", truncate),
        "hf_corrupt": variant("hf", "hf_corrupt", corrupt_header),
        "hf_missing_tensor": variant("hf", "hf_missing_tensor", drop_tensor),
        "hf_bad_length": variant("hf", "hf_bad_length", bad_length),
        "hf_trailing_bytes": variant("hf", "hf_trailing_bytes", trailing_bytes),
        "hf_wrong_shapes": variant("hf", "hf_wrong_shapes", wider_mlp),
        "draft_truncated": variant("draft", "draft_truncated", truncate),
    }


# (config, overrides ({tmp}: tmp_path, {in:NAME}: an input above), file edits, substrings of the
# one line: the origin, the key and what is allowed)
CASES = {
    # Only detectable through the chain: the RL run's policy and draft are what the SFT and draft
    # runs will export (qwen3/tiny sized to the tokenizer: 8 layers, vocab 100, 2048 positions).
    "chain_tap_ids_out_of_range": (
        RL,
        ["--draft.tap_layer_ids", "[0,1,99]"],
        None,
        ["command line --draft.tap_layer_ids", "[99] are out of range", "0..7"],
    ),
    "chain_draft_vocab": (
        RL,
        ["--draft.draft_vocab_size", "100000"],
        None,
        ["command line --draft.draft_vocab_size", "must be in 1..100"],
    ),
    "chain_seq_len": (
        RL,
        ["--training.seq_len", "100000"],
        None,
        ["command line --training.seq_len", "exceeds the model's maximum of 2048"],
    ),
    "chain_task_path_missing": (
        RL,
        ["--task.name", "jsonl", "--task.path", "{tmp}/missing.jsonl"],
        None,
        ["command line --task.path", "missing.jsonl", "is not a file"],
    ),
    "chain_init_from_taps_mismatch": (
        RL,
        ["--draft.tap_layer_ids", "[1,2,3]"],
        None,
        ["debug_cpu.toml: draft.init_from", "tap ids: directory [1, 3, 4] vs config [1, 2, 3]"],
    ),
    "chain_hf_checkpoint_not_exported": (
        RL,
        ["--model.hf_checkpoint", "{tmp}/outputs/debug_cpu/sft/hff"],
        None,
        ["command line --model.hf_checkpoint", "inside the dump folder of", "outputs/debug_cpu/sft/hf']"],
    ),
    "chain_init_from_is_the_policy": (
        RL,
        ["--draft.init_from", "{tmp}/outputs/debug_cpu/sft/hf"],
        None,
        ["command line --draft.init_from", "exports its policy, not a draft"],
    ),
    "chain_model_family": (RL, ["--model.name", "llama3"], None, ["command line --model.name", "holds a qwen3 model"]),
    "chain_error_in_required_file": (
        RL,
        [],
        {DRAFT: ("lr = 3e-3", "lr = 3e-3\ndraft_vocab_size = 100000")},
        ["debug_cpu_draft.toml: draft.draft_vocab_size = 100000", "1..100"],
    ),
    # The SFT run exports qwen3/small (128 wide), so the draft run's draft is 128 wide; the RL
    # run's own policy is a 64-wide checkpoint: the promised draft does not fit it.
    "chain_draft_dims_vs_target": (
        RL,
        ["--model.hf_checkpoint", "{in:hf}"],
        {SFT: ('flavor = "tiny"', 'flavor = "small"')},
        ["debug_cpu.toml: draft.init_from", "hidden: directory 128 vs target/config 64"],
    ),
    "chain_error_in_required_taps": (
        RL,
        [],
        {DRAFT: ('export_dir = "draft"', 'export_dir = "draft"\ntap_layer_ids = [0, 1, 99]')},
        ["debug_cpu_draft.toml: draft.tap_layer_ids", "[99] are out of range", "0..7"],
    ),
    # Non-finite numbers: one check in the loader, for titan_spec's and torchtitan's sections.
    "lr_inf": (RL, ["--optimizer.lr", "inf"], None, ["command line --optimizer.lr", "optimizer.lr = inf", "finite"]),
    "lr_nan": (SFT, ["--optimizer.lr", "nan"], None, ["command line --optimizer.lr", "optimizer.lr = nan", "finite"]),
    "draft_lr_inf": (RL, ["--draft.lr", "inf"], None, ["command line --draft.lr", "draft.lr = inf", "finite"]),
    "temperature_inf": (RL, ["--rl.temperature", "inf"], None, ["command line --rl.temperature", "finite"]),
    "max_norm_inf": (RL, ["--training.max_norm", "inf"], None, ["command line --training.max_norm", "finite"]),
    "min_lr_factor_nan": (
        SFT,
        ["--lr_scheduler.min_lr_factor", "-nan"],
        None,
        ["command line --lr_scheduler.min_lr_factor", "finite"],
    ),
    "toml_lr_inf": (RL, [], {RL: ("lr = 1e-4", "lr = inf")}, ["debug_cpu.toml: optimizer.lr = inf", "finite"]),
    # Empty paths.
    "dump_folder_empty": (
        RL,
        ["--job.dump_folder", ""],
        None,
        ["command line --job.dump_folder", "job.dump_folder = ''", "a non-empty path"],
    ),
    "checkpoint_folder_empty": (
        SFT,
        ["--checkpoint.folder", ""],
        None,
        ["command line --checkpoint.folder", "a non-empty path"],
    ),
    # Input files, checked against the architecture before the trainer starts.
    "hf_no_safetensors": (
        SFT,
        ["--model.hf_checkpoint", "{in:hf_no_weights}"],
        None,
        ["command line --model.hf_checkpoint", "no model.safetensors", "only safetensors"],
    ),
    "hf_truncated": (
        SFT,
        ["--model.hf_checkpoint", "{in:hf_truncated}"],
        None,
        [
            "command line --model.hf_checkpoint",
            "model.safetensors: not a complete safetensors file: incomplete metadata",
        ],
    ),
    "hf_corrupt_header": (
        SFT,
        ["--model.hf_checkpoint", "{in:hf_corrupt}"],
        None,
        ["command line --model.hf_checkpoint", "model.safetensors: not a complete safetensors file: "],
    ),
    "hf_missing_tensor": (
        SFT,
        ["--model.hf_checkpoint", "{in:hf_missing_tensor}"],
        None,
        ["command line --model.hf_checkpoint", "missing ['model.layers.3.mlp.up_proj.weight']"],
    ),
    "hf_wrong_shapes": (
        SFT,
        ["--model.hf_checkpoint", "{in:hf_wrong_shapes}"],
        None,
        [
            "command line --model.hf_checkpoint",
            "tensor shapes do not match its config.json",
            "[192, 64] (config.json needs [256, 64])",
        ],
    ),
    "draft_other_hidden_size": (
        RL,
        ["--draft.init_from", "{in:draft_wide}"],
        None,
        ["command line --draft.init_from", "hidden: directory 128 vs target/config 64"],
    ),
    "hf_bad_header_length": (
        SFT,
        ["--model.hf_checkpoint", "{in:hf_bad_length}"],
        None,
        ["command line --model.hf_checkpoint", "model.safetensors: not a complete safetensors file: header too large"],
    ),
    "hf_trailing_bytes": (
        SFT,
        ["--model.hf_checkpoint", "{in:hf_trailing_bytes}"],
        None,
        [
            "command line --model.hf_checkpoint",
            "model.safetensors: not a complete safetensors file: incomplete metadata",
        ],
    ),
    "init_from_is_a_policy_checkpoint": (
        RL,
        ["--draft.init_from", "{in:hf}"],
        None,
        ["command line --draft.init_from", "is not LlamaForCausalLMEagle3"],
    ),
    "flavor_unknown": (
        SFT,
        ["--model.flavor", "huge"],
        None,
        ["command line --model.flavor", "'huge' is not a qwen3 flavor; allowed: tiny, small"],
    ),
    "draft_truncated": (
        RL,
        ["--draft.init_from", "{in:draft_truncated}"],
        None,
        ["command line --draft.init_from", "model.safetensors: not a complete safetensors file: incomplete metadata"],
    ),
    # The draft directory's config.json is the origin of its own values (issue 31): the file and
    # the field are named, through draft.init_from (the key the user set), never a [draft] key.
    "draft_config_null_field": (
        RL,
        ["--draft.init_from", "{in:draft_null_heads}"],
        None,
        [
            "command line --draft.init_from: ",
            "draft_null_heads/config.json: field 'num_attention_heads' is null; it must be a positive integer",
        ],
    ),
    "draft_config_field_not_a_number": (
        RL,
        ["--draft.init_from", "{in:draft_hidden_words}"],
        None,
        [
            "command line --draft.init_from: ",
            'draft_hidden_words/config.json: hidden_size = "sixty-four" is not allowed; it must be a positive integer',
        ],
    ),
    "draft_config_vocab_out_of_range": (
        RL,
        ["--draft.init_from", "{in:draft_vocab_500}"],
        None,
        [
            "command line --draft.init_from: ",
            "draft_vocab_500/config.json: draft_vocab_size = 500 must be in 1..100 (the target vocabulary",
        ],
    ),
    "draft_config_tap_out_of_range": (
        RL,
        ["--draft.init_from", "{in:draft_tap_99}"],
        None,
        [
            "command line --draft.init_from: ",
            "draft_tap_99/config.json: "
            "eagle_aux_hidden_state_layer_ids [1, 3, 99]: tap layer ids [99] are out of range",
            "0..7",
        ],
    ),
    "draft_d2t_outside_vocab": (
        RL,
        ["--draft.init_from", "{in:draft_d2t_outside}"],
        None,
        [
            "command line --draft.init_from: ",
            "draft_d2t_outside/model.safetensors: d2t maps 1 draft id(s) "
            "outside the target vocabulary 0..99 (first: draft id 31 -> 111)",
        ],
    ),
    "draft_d2t_repeated_ids": (
        RL,
        ["--draft.init_from", "{in:draft_d2t_repeated}"],
        None,
        [
            "command line --draft.init_from: ",
            "draft_d2t_repeated/model.safetensors: d2t maps several "
            "draft ids onto the same target id (1 repeated, first: 4)",
        ],
    ),
    # A rollout is packed whole into one row of training.seq_len (256 here), with its prompt.
    "rl_max_new_tokens_over_a_row": (
        RL,
        ["--rl.max_new_tokens", "300"],
        None,
        [
            "command line --rl.max_new_tokens: rl.max_new_tokens = 300 does not fit a packed "
            "row of training.seq_len = 256",
            "at most 254",
        ],
    ),
    "rl_max_new_tokens_with_the_longest_prompt": (
        RL,
        ["--task.name", "jsonl", "--task.path", "{in:long_question}", "--rl.max_new_tokens", "200"],
        None,
        [
            "command line --rl.max_new_tokens: rl.max_new_tokens = 200 does not fit",
            "with the longest prompt (",
            "long_question.jsonl:1, ",
            "allowed: rl.max_new_tokens <= ",
            "raise training.seq_len to ",
        ],
    ),
    "rl_max_new_tokens_generated_prompts": (
        RL,
        ["--rl.max_new_tokens", "252"],
        None,
        [
            "command line --rl.max_new_tokens: rl.max_new_tokens = 252 does not fit",
            "the longest of 512 sampled prompts",
            "allowed: rl.max_new_tokens <= ",
        ],
    ),
    # Dataset records: the file and the record are named.
    "sft_record_longer_than_a_row": (
        SFT,
        ["--task.name", "jsonl", "--task.path", "{in:long_question}", "--training.seq_len", "64"],
        None,
        [
            "command line --task.path: 1 of 2 records are longer than a packed row of training.seq_len = 64",
            "the longest: ",
            "long_question.jsonl:1 (",
        ],
    ),
    # task.answer_format: the key is the origin, not task.path.
    "answer_format_reads_no_record": (
        SFT,
        [
            "--task.name",
            "dataset",
            "--task.path",
            "{in:math_jsonl}",
            "--task.prompt_field",
            "problem",
            "--task.answer_field",
            "solution",
            "--task.answer_format",
            "gsm8k",
        ],
        None,
        [
            "command line --task.answer_format: task.answer_format = 'gsm8k' finds no final "
            "answer in any of the 2 records",
            "math.jsonl:1",
            "allowed: 'auto'",
            "did you mean 'boxed'? it reads every record",
        ],
    ),
    "parquet_truncated": (
        SFT,
        ["--task.name", "dataset", "--task.path", "{in:parquet_truncated}"],
        None,
        [
            "command line --task.path: ",
            "truncated.parquet: not a complete Parquet file (truncated or "
            "corrupt): Parquet magic bytes not found in footer",
        ],
    ),
    "parquet_empty": (
        SFT,
        ["--task.name", "dataset", "--task.path", "{in:parquet_empty}"],
        None,
        [
            "command line --task.path: ",
            "empty.parquet: the file is empty (0 bytes); allowed: a .jsonl, .json or .parquet file of records",
        ],
    ),
    "answer_format_unknown": (
        SFT,
        ["--task.answer_format", "boxd"],
        None,
        [
            "command line --task.answer_format: task.answer_format = 'boxd' is not allowed; it must "
            "be one of 'auto', 'gsm8k', 'boxed', 'plain' (did you mean 'boxed'?)"
        ],
    ),
}


def _args(overrides, tmp_path, inputs):
    out = []
    for a in overrides:
        a = a.replace("{tmp}", str(tmp_path))
        if a.startswith("{in:"):
            a = inputs[a[4:-1]]
        out.append(a)
    return out


def plan_in_process(capsys, confs, config, args):
    """main(['--plan', ...]) as `python -m titan_spec.train --plan` runs it: (rc, stdout, stderr)."""
    capsys.readouterr()
    try:
        rc = main(["--plan", "--config", os.path.join(confs, config), *args])
    except SystemExit as e:  # argparse-style exits count as the exit code too
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("name", sorted(CASES))
def test_plan_rejects_malformed_input_in_one_line(name, tmp_path, capsys, inputs):
    config, overrides, edit, needles = CASES[name]
    confs = fresh_checkout(tmp_path, edit)
    before = tree(tmp_path), tree(ROOT)
    start = time.perf_counter()
    rc, out, err = plan_in_process(capsys, confs, config, _args(overrides, tmp_path, inputs))
    with capsys.disabled():  # a benchmark, not a timed assertion: the refusal's wall time, in-process
        print(f"\n--plan refusal {name}: {time.perf_counter() - start:.3f} s in-process")
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2, (out, err)
    assert len(lines) == 1 and lines[0].startswith("titan_spec: config error: "), err
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert out == ""  # no run is planned
    assert (tree(tmp_path), tree(ROOT)) == before  # nothing written: no dump folder, no tb/
    assert not (tmp_path / "outputs").exists()


def test_valid_inputs_pass_the_same_checks(tmp_path, capsys, inputs):
    """The negative control: the untouched chain, and the real writers' checkpoints, plan fine
    (so the checks above reject what is malformed, not everything)."""
    confs = fresh_checkout(tmp_path)
    before = tree(tmp_path)
    rc, out, err = plan_in_process(capsys, confs, RL, [])
    assert rc == 0, err
    assert [os.path.basename(p) for p in out.split()] == [SFT, DRAFT, RL]
    rc, out, err = plan_in_process(capsys, confs, SFT, ["--model.hf_checkpoint", inputs["hf"]])
    assert rc == 0, err
    rc, out, err = plan_in_process(capsys, confs, RL, ["--draft.init_from", inputs["draft"]])
    assert rc == 0, err
    assert tree(tmp_path) == before


def test_sglang_checks_wait_for_inputs_the_chain_writes(tmp_path, capsys, inputs):
    """The SGLang engine's input check (rollout/sglang/engine.py check_config) reads the
    policy and draft directories only where they exist now: in the chain they are what the
    SFT and draft runs will export (checked against their promise instead), so the RL run
    plans fine; with existing directories the same check reads them and refuses a misfit."""
    confs = fresh_checkout(tmp_path)
    rc, out, err = plan_in_process(capsys, confs, RL, ["--rollout.engine", "sglang"])
    assert rc == 0, err
    assert [os.path.basename(p) for p in out.split()] == [SFT, DRAFT, RL]
    rc, out, err = plan_in_process(
        capsys,
        confs,
        RL,
        [
            "--rollout.engine",
            "sglang",
            "--model.hf_checkpoint",
            inputs["hf"],
            "--draft.init_from",
            inputs["draft_wide"],
        ],
    )
    assert rc == 2 and err.count("\n") == 1 and "does not fit the policy" in err, err


def _env():
    return dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")


@pytest.mark.parametrize(
    "args,needle",
    [
        (
            ["--draft.tap_layer_ids", "[0,1,99]"],
            "command line --draft.tap_layer_ids: tap layer ids [99] are out of range",
        ),
        # The datasets library logs its own line before raising: only ours is printed.
        (
            ["--task.name", "dataset", "--task.path", "{in:parquet_truncated}"],
            "truncated.parquet: not a complete Parquet file (truncated or corrupt)",
        ),
    ],
)
def test_plan_command_fresh_checkout(args, needle, tmp_path, inputs, capsys):
    """The real `python -m titan_spec.train --plan` (what run_train.sh calls) on the chain."""
    confs = fresh_checkout(tmp_path)
    before = tree(tmp_path), tree(ROOT)
    start = time.perf_counter()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "titan_spec.train",
            "--plan",
            "--config",
            os.path.join(confs, RL),
            *_args(args, tmp_path, inputs),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=_env(),
    )
    # What a user waits for (Python, torch and torchtitan start-up included): printed, not asserted.
    with capsys.disabled():
        print(f"\n--plan refusal (the real command): {time.perf_counter() - start:.2f} s wall")
    lines = [
        line
        for line in out.stderr.splitlines()
        if line.strip() and "Warning" not in line and "register_constant" not in line
    ]
    assert out.returncode == 2, out.stderr
    assert len(lines) == 1 and needle in lines[0], out.stderr
    assert out.stdout == ""
    assert (tree(tmp_path), tree(ROOT)) == before


@pytest.mark.parametrize("ngpu", ["0", "abc", "-1", "1.5"])
def test_run_train_rejects_bad_ngpu_before_python(ngpu, tmp_path):
    """run_train.sh names NGPU and what is allowed, exit 2, and starts nothing (the check
    comes before the environment set-up and the plan)."""
    env = dict(_env(), NGPU=ngpu)
    out = subprocess.run(
        ["bash", "run_train.sh", "--job.dump_folder", str(tmp_path / "never")],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
        env=env,
    )
    assert out.returncode == 2, out.stderr
    assert out.stdout == ""
    assert out.stderr.splitlines() == [
        f"run_train.sh: NGPU = '{ngpu}' is not allowed; it must be a positive integer (processes per node)"
    ]
    assert not (tmp_path / "never").exists()


@pytest.mark.parametrize("family", ["qwen3", "qwen3_tied", "llama_sharded"])
def test_transformers_checkpoints_pass_the_header_check(family, tmp_path):
    """The expected names and shapes are those of checkpoints transformers itself writes
    (the independent reference), tied and sharded ones included; one wrong shape fails."""
    transformers = pytest.importorskip("transformers")
    from titan_spec.models.hf_io import HFCheckpointError, check_hf_weights, read_hf_arch

    common = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    if family.startswith("qwen3"):
        model = transformers.Qwen3ForCausalLM(
            transformers.Qwen3Config(**common, head_dim=16, tie_word_embeddings=family == "qwen3_tied")
        )
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    # max_shard_size splits the llama checkpoint into several files + model.safetensors.index.json
    model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="100KB" if "sharded" in family else "5GB")
    assert os.path.isfile(tmp_path / "model.safetensors.index.json") == ("sharded" in family)
    check_hf_weights(str(tmp_path), read_hf_arch(str(tmp_path)))
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] = 128
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HFCheckpointError, match=r"gate_proj.weight \[96, 64\] \(config.json needs \[128, 64\]\)"):
        check_hf_weights(str(tmp_path), read_hf_arch(str(tmp_path)))


@pytest.fixture
def read_only_folder(tmp_path):
    """A folder no run can write in: mode 0555 for a user; as root (whom the mode does not bind)
    a read-only tmpfs mounted there, skipped where mounting is not allowed."""
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() != 0:
        ro.chmod(0o555)
        yield ro
        ro.chmod(0o755)
        return
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(ro)], capture_output=True).returncode:
        pytest.skip("running as root without the right to mount a read-only tmpfs")
    try:
        yield ro
    finally:
        subprocess.run(["umount", str(ro)], check=True)


@pytest.mark.parametrize("inside", [False, True], ids=["is_read_only", "inside_read_only"])
def test_read_only_dump_folder_is_one_line(inside, read_only_folder, tmp_path, capsys):
    """A dump folder that cannot be written (or made) is refused before the start, named with
    the OS's reason, instead of the first write's traceback (torchtitan's comm_traces)."""
    confs = fresh_checkout(tmp_path)
    dump = read_only_folder / "run" if inside else read_only_folder
    before = tree(tmp_path), tree(ROOT)
    start = time.perf_counter()
    rc, out, err = plan_in_process(capsys, confs, SFT, ["--job.dump_folder", str(dump)])
    with capsys.disabled():
        print(f"\n--plan refusal read_only_dump_folder: {time.perf_counter() - start:.3f} s in-process")
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and out == "", err
    assert lines == [
        f"titan_spec: config error: command line --job.dump_folder: job.dump_folder '{dump}' is not "
        f"writable: {read_only_folder}: {'Read-only file system' if os.geteuid() == 0 else 'Permission denied'}; "
        "allowed: a folder this user can create files in (the run writes its checkpoints, metrics and "
        "exports there)"
    ], err
    assert (tree(tmp_path), tree(ROOT)) == before


@pytest.mark.parametrize(
    "body,needle",
    [
        (
            "def reward(completion, answer, record):\n    raise KeyError('score')\n",
            "raised on record",
        ),
        ("def reward(completion, answer, record):\n    return 'yes'\n", "returned str 'yes'"),
        ("def reward(completion, answer, record):\n    return float('nan')\n", "returned nan"),
    ],
)
def test_a_reward_that_cannot_score_is_one_line_before_the_start(body, needle, tmp_path, capsys, monkeypatch):
    """A user's reward (task.reward = 'module:function') that raises or returns a non-number on
    the task's first problems is refused by --plan (preflight/inputs.py check_reward_scores),
    not at step 1 after the start-up; a reward that scores them plans fine."""
    (tmp_path / "user_reward_probe.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("user_reward_probe", None)
    confs = fresh_checkout(tmp_path)
    before = tree(tmp_path / "train_configs")
    rc, out, err = plan_in_process(capsys, confs, RL, ["--task.reward", "user_reward_probe:reward"])
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and out == "" and len(lines) == 1, err
    assert lines[0].startswith(
        "titan_spec: config error: command line --task.reward: task.reward = "
        "'user_reward_probe:reward' does not score the task before the start: "
    ), lines[0]
    assert needle in lines[0] and "allowed: a function (completion, answer, record) -> a finite number" in lines[0]
    assert tree(tmp_path / "train_configs") == before and not (tmp_path / "outputs").exists()
    (tmp_path / "user_reward_probe.py").write_text(
        "def reward(completion, answer, record):\n    return len(completion)\n"
    )
    sys.modules.pop("user_reward_probe", None)
    rc, out, err = plan_in_process(capsys, confs, RL, ["--task.reward", "user_reward_probe:reward"])
    assert rc == 0, err


def test_a_disk_without_room_for_the_first_checkpoint_is_one_line(tmp_path, capsys):
    """issue 31: a dump folder on a disk too small for one checkpoint of the run (12 bytes per
    trained parameter, preflight/inputs.py check_free_space) and its exports is refused before
    the start, with what is free and what is needed (a 1 MiB tmpfs; the tiny SFT run needs
    ~6 MiB), not at the first checkpoint."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)], capture_output=True).returncode:
        pytest.skip("running as root without the right to mount a tmpfs")
    try:
        confs = fresh_checkout(tmp_path)
        before = tree(tmp_path), tree(ROOT)
        rc, out, err = plan_in_process(capsys, confs, SFT, ["--job.dump_folder", str(small / "run")])
        lines = [line for line in err.splitlines() if line.strip()]
        assert rc == 2 and out == "" and len(lines) == 1, err
        assert lines[0].startswith(
            f"titan_spec: config error: command line --job.dump_folder: job.dump_folder "
            f"'{small / 'run'}' has no space left for the run: {small} has "
        ), err
        assert "MiB free, one checkpoint and the exports of 400,960 parameters need 6.1 MiB; allowed:" in lines[0], err
        # With checkpoints off the exports alone (1.5 MiB) still do not fit.
        rc, _, err = plan_in_process(
            capsys, confs, SFT, ["--job.dump_folder", str(small / "run"), "--checkpoint.enable", "false"]
        )
        assert rc == 2 and "need 1.5 MiB" in err, err
        assert (tree(tmp_path), tree(ROOT)) == before
    finally:
        subprocess.run(["umount", str(small)], check=True)
