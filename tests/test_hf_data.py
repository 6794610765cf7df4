"""Real tokenizers, datasets and rewards (issue 15), unit by unit, against independent references:

- the HF tokenizer (torchtitan's HuggingFaceTokenizer under titan_spec's HFTokenizer) encodes,
  decodes and renders the chat template exactly as transformers does from the SAME files
  (a Qwen-style tokenizer trained here with ``tokenizers``); a saved tokenizer reloads as the same;
- the dataset task reads GSM8K JSONL, MATH-style and DAPO-style Parquet records as distributed
  (final answers, demonstrations, chat prompts), names malformed records, skips them on request;
- each reward against hand-checked cases (math-verify: \\boxed{1/2} vs 0.5, \\frac{3}{4}, wrong answers);
- bad input is one config line, exit 2, before anything trains.
"""

import json
import os
import sys

import pytest

from titan_spec.config import ConfigError, TaskConfig
from titan_spec.data import rewards
from titan_spec.data.prompts import PromptFormat
from titan_spec.data.problem import Problem
from titan_spec.data.tasks import DatasetTask
from titan_spec.data.tokenizer import CharTokenizer, HFTokenizer
from titan_spec.preflight.inputs import check_reward
from titan_spec.preflight.resolve import tokenizer_source

sys.path.insert(0, os.path.dirname(__file__))
from helpers.hf_assets import gsm8k_records, write_jsonl, write_tiny_qwen3, write_tokenizer  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXTS = [
    "What is 3 plus 4?",
    "  spaces\tand\nnewlines  ",
    "unicode: café ÷ π",
    "<|im_start|>user\nhi<|im_end|>",
    "<think>\nstep</think>\n\n#### 7",
    "The answer is \\boxed{\\frac{3}{4}}.",
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return write_tokenizer(tmp_path_factory.mktemp("tok") / "tok")


@pytest.fixture(scope="module")
def reference(tok_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(tok_dir)


def test_hf_tokenizer_matches_transformers(tok_dir, reference):
    tok = HFTokenizer(tokenizer_path=tok_dir)
    assert (tok.eos_id, tok.pad_id, tok.bos_id) == (reference.eos_token_id, reference.pad_token_id, None)
    assert tok.stop_ids == (
        reference.convert_tokens_to_ids("<|im_end|>"),
        reference.convert_tokens_to_ids("<|endoftext|>"),
    )
    assert tok.get_vocab_size() == len(reference)  # the largest id + 1 (added tokens after the BPE)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == reference(text, add_special_tokens=False)["input_ids"], text
        assert tok.decode(ids) == reference.decode(ids, skip_special_tokens=True), text
        assert tok.encode(text, add_eos=True) == ids + [reference.eos_token_id]


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}])
@pytest.mark.parametrize("system", ["", "You are a careful solver."])
def test_chat_template_renders_as_transformers(tok_dir, reference, kwargs, system):
    tok = HFTokenizer(tokenizer_path=tok_dir)
    fmt = PromptFormat(TaskConfig(system_prompt=system, chat_template_kwargs=kwargs), tok)
    p = Problem("What is 3 plus 4?", "7")
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": p.prompt}]
    want = reference.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **kwargs)
    assert fmt.text(p) == want
    assert ("<think>\n\n</think>" in want) == (kwargs == {"enable_thinking": False})
    # The ids: transformers' own tokenized chat (no BOS added on top of the template).
    ref_ids = reference.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, **kwargs)
    ref_ids = ref_ids["input_ids"] if isinstance(ref_ids, dict) or hasattr(ref_ids, "keys") else ref_ids
    assert fmt.ids(p) == list(ref_ids)


def test_template_bos_is_not_added_twice(tok_dir, tmp_path):
    """A template that writes its own BOS (Llama-3 style): the prompt ids are transformers'
    tokenized chat, BOS once; without a template the prompt text gets one BOS."""
    import shutil

    transformers = pytest.importorskip("transformers")
    d = tmp_path / "bos"
    shutil.copytree(tok_dir, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["bos_token"] = "<|endoftext|>"
    cfg["chat_template"] = "{{ bos_token }}" + cfg["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok, ref = HFTokenizer(tokenizer_path=str(d)), transformers.AutoTokenizer.from_pretrained(str(d))
    p = Problem("What is 3 plus 4?", "7")
    ids = PromptFormat(TaskConfig(), tok).ids(p)
    want = ref.apply_chat_template([{"role": "user", "content": p.prompt}], tokenize=True, add_generation_prompt=True)
    want = list(want["input_ids"] if hasattr(want, "keys") else want)
    assert ids == want and ids.count(tok.bos_id) == 1
    raw = PromptFormat(TaskConfig(chat_template="off"), tok).ids(p)
    assert raw == [tok.bos_id] + ref(p.prompt, add_special_tokens=False)["input_ids"]


def test_sft_and_rl_prompts_are_the_same_ids(tok_dir, reference, tmp_path):
    """The loader's prompt ids (what RLTrainer.generate sends to the engine) are the chat
    template's, and every SFT document starts with them; the embedded task keeps its ids."""
    import random

    from titan_spec.data.loader import TaskDataLoader

    recs = gsm8k_records(6)
    task = _task(write_jsonl(tmp_path / "g.jsonl", recs), chat_template_kwargs={"enable_thinking": False})
    tok = HFTokenizer(tokenizer_path=tok_dir)
    loader = TaskDataLoader(
        TaskDataLoader.Config(task=task), dp_world_size=1, dp_rank=0, tokenizer=tok, seq_len=512, local_batch_size=1
    )
    p = loader.task.problems[0]
    want = reference.apply_chat_template(
        [{"role": "user", "content": p.prompt}], tokenize=True, add_generation_prompt=True, enable_thinking=False
    )
    assert loader.prompt_ids(p) == list(want["input_ids"] if hasattr(want, "keys") else want)
    first = loader.task.sample(random.Random(task.seed * 1_000_003 + 0))
    row = loader._global_batch(0).input_BL[0].tolist()
    ids = loader.prompt_ids(first)
    assert row[: len(ids)] == ids
    assert row[len(ids) : len(ids) + len(tok.encode(first.sft_target)) + 1] == tok.encode(
        first.sft_target, add_eos=True
    )
    char = CharTokenizer()
    plain = TaskDataLoader(
        TaskDataLoader.Config(), dp_world_size=1, dp_rank=0, tokenizer=char, seq_len=64, local_batch_size=1
    )
    q = plain.task.sample(random.Random(0))
    assert plain.prompt_ids(q) == char.encode(q.prompt, add_bos=True)


def test_saved_tokenizers_reload_as_the_same(tok_dir, tmp_path):
    tok = HFTokenizer(tokenizer_path=tok_dir)
    tok.save(str(tmp_path / "saved"))
    again = HFTokenizer(tokenizer_path=str(tmp_path / "saved"))
    msgs = [{"role": "user", "content": "hi"}]
    assert [again.encode(t) for t in TEXTS] == [tok.encode(t) for t in TEXTS]
    assert (again.eos_id, again.pad_id, again.stop_ids, again.get_vocab_size()) == (
        tok.eos_id,
        tok.pad_id,
        tok.stop_ids,
        tok.get_vocab_size(),
    )
    assert again.apply_chat_template(msgs, add_generation_prompt=True) == tok.apply_chat_template(
        msgs, add_generation_prompt=True
    )
    assert tokenizer_source("auto", "", str(tmp_path / "saved")) == ("hf", str(tmp_path / "saved"))
    char = CharTokenizer()
    char.save(str(tmp_path / "char"))
    assert tokenizer_source("auto", "", str(tmp_path / "char")) == ("char", str(tmp_path / "char"))
    assert CharTokenizer(tokenizer_path=str(tmp_path / "char")).vocab == char.vocab
    assert tokenizer_source("auto", "", "") == ("char", "")  # the embedded task
    with pytest.raises(ConfigError, match="has no tokenizer files"):
        tokenizer_source("auto", "", str(tmp_path))


def test_chat_template_jinja_file_wins(tok_dir, tmp_path):
    """chat_template.jinja (GPT-OSS style) takes priority over tokenizer_config.json's, as in transformers."""
    import shutil

    d = tmp_path / "t"
    shutil.copytree(tok_dir, d)
    (d / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")
    tok = HFTokenizer(tokenizer_path=str(d))
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "[user] x\n"
    tok.save(str(tmp_path / "copy"))
    assert (tmp_path / "copy" / "chat_template.jinja").is_file()


# --- rewards ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "completion,answer,want",
    [
        ("so the answer is \\boxed{1/2}", "0.5", 1.0),
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("The answer is $\\boxed{\\frac{3}{4}}$", "\\frac{3}{4}", 1.0),
        ("\\boxed{\\frac34}", "0.75", 1.0),
        ("3+4=7\n#### 7", "7", 1.0),
        ("\\boxed{\\sqrt 2}", "\\sqrt{2}", 1.0),  # a bare LaTeX reference answer is read as math ($...$)
        ("\\boxed{2}", "2\\pi", 0.0),
        ("\\boxed{3}", "3\\sqrt{13}", 0.0),
        ("\\boxed{\\frac{3}{5}}", "\\frac{3}{4}", 0.0),
        ("\\boxed{41}", "42", 0.0),
        ("I do not know", "42", 0.0),
        ("", "1/2", 0.0),
    ],
)
def test_math_reward(completion, answer, want):
    assert rewards.math_reward(completion, answer, {}) == want


def test_exact_match_and_format_rewards():
    assert rewards.exact_match(" 30 ", "30", {}) == 1.0 and rewards.exact_match("30.0", "30", {}) == 0.0
    assert rewards.format_reward("work... \\boxed{x^2}", "", {}) == 1.0
    assert rewards.format_reward("work...\n#### 12", "", {}) == 1.0
    assert rewards.format_reward("work... 12", "", {}) == 0.0 and rewards.format_reward("#### ", "", {}) == 0.0
    assert rewards.last_boxed("a \\boxed{\\frac{1}{2}} then \\boxed{x_{1}}") == "x_{1}"


def _user_module(tmp_path, monkeypatch, body):
    (tmp_path / "my_rewards.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_rewards", None)


def test_user_reward_by_dotted_path(tmp_path, monkeypatch):
    _user_module(
        tmp_path,
        monkeypatch,
        "def length(completion, answer, record):\n    return len(completion) + record['bonus']\n"
        "def boom(completion, answer, record):\n    raise KeyError('tests')\n"
        "def nan(completion, answer, record):\n    return float('nan')\n",
    )
    fn = rewards.reward_fn("my_rewards:length")
    probs = [Problem("p", "a", source="f.jsonl:3", record={"bonus": 10})]
    assert rewards.score(fn, "my_rewards:length", ["abc"], probs) == [13.0]
    with pytest.raises(
        rewards.RewardError, match=r"reward 'my_rewards:boom' raised on record f.jsonl:3: KeyError: 'tests'"
    ):
        rewards.score(rewards.reward_fn("my_rewards:boom"), "my_rewards:boom", ["abc"], probs)
    with pytest.raises(rewards.RewardError, match="returned nan on record f.jsonl:3"):
        rewards.score(rewards.reward_fn("my_rewards:nan"), "my_rewards:nan", ["abc"], probs)


def test_a_raising_reward_stops_the_run_with_one_line_naming_the_record(capsys):
    """RLTrainer.score through the registry: a reward that raises is a RewardError naming the
    record; train_and_close prints it as one line and returns 1 (no DONE), not a traceback."""
    from types import SimpleNamespace

    from titan_spec.rl.step import RLTrainer
    from titan_spec.train.entry import train_and_close

    def boom(completion, answer, record):
        raise ZeroDivisionError("division by zero")

    tok = CharTokenizer()
    fake = SimpleNamespace(
        rl=SimpleNamespace(group_size=2),
        tokenizer=tok,
        reward=boom,
        _warn_if_degenerate=print,
        config=SimpleNamespace(task=SimpleNamespace(reward="mine:boom")),
    )
    batch = SimpleNamespace(
        problems=[Problem("1+1=", "2", source="train.jsonl:7")],
        rollouts=[SimpleNamespace(output_ids=tok.encode("2", add_eos=True))] * 2,
    )
    with pytest.raises(rewards.RewardError) as e:
        RLTrainer.score(fake, batch)
    assert str(e.value) == (
        "reward 'mine:boom' raised on record train.jsonl:7: ZeroDivisionError: division by zero (completion '2')"
    )

    class Trainer:
        closed = False

        def train(self):
            raise e.value

        def close(self):
            Trainer.closed = True

    capsys.readouterr()
    assert train_and_close(SimpleNamespace(build=Trainer)) == 1 and Trainer.closed
    assert capsys.readouterr().err.splitlines() == [f"titan_spec: {e.value}"]


def test_reward_names_are_checked():
    with pytest.raises(ConfigError, match=r"task.reward = 'mathh' is not a reward \(did you mean 'math'\?\)"):
        check_reward("mathh")
    with pytest.raises(ConfigError, match=r"module 'no_such_module_x' does not import \(ModuleNotFoundError"):
        check_reward("no_such_module_x:fn")
    with pytest.raises(ConfigError, match="module 'json' has no function 'nope'"):
        check_reward("json:nope")


# --- dataset records --------------------------------------------------------------------------


def _task(path, **kw):
    return TaskConfig(name="dataset", path=str(path), **kw)


def test_gsm8k_jsonl_as_distributed(tmp_path):
    recs = gsm8k_records(5)
    task = DatasetTask(_task(write_jsonl(tmp_path / "train.jsonl", recs)))
    p = task.problems[2]
    assert (p.prompt, p.answer, p.sft_target) == (
        recs[2]["question"],
        recs[2]["answer"].split("#### ")[1],
        recs[2]["answer"],
    )
    assert p.source == f"{tmp_path / 'train.jsonl'}:3" and p.record == recs[2]


def test_math_and_dapo_parquet_as_distributed(tmp_path):
    datasets = pytest.importorskip("datasets")
    math_rows = [{"problem": "Simplify 6/8.", "solution": "Divide by 2: $\\boxed{\\frac{3}{4}}$.", "level": "Level 1"}]
    datasets.Dataset.from_list(math_rows).to_parquet(str(tmp_path / "math.parquet"))
    task = DatasetTask(
        _task(
            tmp_path / "math.parquet",
            prompt_field="problem",
            answer_field="solution",
            prompt_template="{prompt} Put the final answer in \\boxed{}.",
        )
    )
    (p,) = task.problems
    assert (p.prompt, p.answer, p.sft_target) == (
        "Simplify 6/8. Put the final answer in \\boxed{}.",
        "\\frac{3}{4}",
        math_rows[0]["solution"],
    )
    dapo_rows = [
        {
            "data_source": "math_dapo",
            "prompt": [{"role": "user", "content": "Find x if 2x = 10."}],
            "ability": "MATH",
            "reward_model": {"ground_truth": "5", "style": "rule-lighteval/MATH_v2"},
        }
    ]
    datasets.Dataset.from_list(dapo_rows).to_parquet(str(tmp_path / "dapo.parquet"))
    task = DatasetTask(
        _task(tmp_path / "dapo.parquet", prompt_field="prompt", answer_field="reward_model.ground_truth")
    )
    (p,) = task.problems
    assert (p.messages, p.answer, p.sft_target) == (({"role": "user", "content": "Find x if 2x = 10."},), "5", "5")


def test_malformed_records_are_named_or_skipped(tmp_path):
    good = gsm8k_records(3)
    path = tmp_path / "bad.jsonl"
    lines = [
        json.dumps(good[0]),
        "{not json",
        json.dumps({"question": "q"}),
        "",
        json.dumps({"question": "q", "answer": "no mark"}),
        json.dumps(good[1]),
    ]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"3 malformed record\(s\); first: .*bad.jsonl:2: not JSON"):
        DatasetTask(_task(path, answer_format="gsm8k"))
    task = DatasetTask(_task(path, answer_format="gsm8k", on_malformed="skip"))
    assert [p.source.rsplit(":", 1)[1] for p in task.problems] == ["1", "6"]
    assert [e.split(": ", 1)[0].rsplit(":", 1)[1] for e in task.errors] == ["2", "3", "5"]
    assert "missing field 'answer'" in task.errors[1] and "no final value after '####'" in task.errors[2]


# --- bad input: one line, exit 2, before anything trains ---------------------------------------


def _check(capsys, *args):
    from titan_spec.train.entry import main

    capsys.readouterr()
    rc = main(["--check", "--config", os.path.join(ROOT, "train_configs", "debug_cpu_sft.toml"), *args])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    return rc, err


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory, tok_dir):
    """A tiny Qwen3 checkpoint written by transformers, without tokenizer files, and a GSM8K JSONL."""
    root = tmp_path_factory.mktemp("bad")
    tok = HFTokenizer(tokenizer_path=tok_dir)
    write_tiny_qwen3(root / "ckpt", tok.get_vocab_size())
    write_tiny_qwen3(root / "small_vocab", 200, num_hidden_layers=2)
    return root, write_jsonl(root / "gsm8k.jsonl", gsm8k_records(8))


def test_bad_inputs_are_one_line_each(capsys, tiny_ckpt, tok_dir, tmp_path):
    root, data = tiny_ckpt
    ckpt = str(root / "ckpt")
    (tmp_path / "math.jsonl").write_text(json.dumps({"problem": "1+1?", "solution": "\\boxed{2}"}) + "\n")
    dataset = ["--task.name", "dataset", "--task.path", data]
    cases = [
        (["--model.hf_checkpoint", ckpt], f"command line --model.hf_checkpoint: {ckpt!r} has no tokenizer files"),
        (
            ["--model.hf_checkpoint", str(root / "small_vocab"), "--tokenizer.path", tok_dir],
            f"command line --tokenizer.path: the tokenizer of {tok_dir} has ids up to 326, but "
            f"{root / 'small_vocab'} has a vocabulary of 200 (ids >= 200 have no embedding)",
        ),
        (
            ["--task.name", "dataset", "--task.path", str(tmp_path / "math.jsonl")],
            "no record has the field 'question' (task.prompt_field); its records have: ['problem', 'solution']",
        ),
        (
            [*dataset, "--task.reward", "mathh"],
            "command line --task.reward: task.reward = 'mathh' is not a reward (did you mean 'math'?)",
        ),
        ([*dataset, "--task.reward", "no_such_module_x:score"], "module 'no_such_module_x' does not import"),
    ]
    for args, needle in cases:
        rc, err = _check(capsys, *args)
        assert rc == 2 and len(err) == 1 and needle in err[0], (args, err)
    # The same checkpoint with its tokenizer named passes, and so does 'char' (the built-in ids).
    assert _check(
        capsys, "--model.hf_checkpoint", ckpt, "--tokenizer.path", tok_dir, *dataset, "--task.reward", "math"
    ) == (0, [])


def test_sglang_serves_the_trainers_tokenizer(tok_dir, tmp_path):
    """With the SGLang engine, a tokenizer.path other than the served checkpoint's must hold
    the same tokenizer.json (SGLang serves the checkpoint directory with its own files)."""
    import shutil

    from titan_spec.config import load_config
    from titan_spec.preflight.inputs import _check_sglang_tokenizer

    served, same = tmp_path / "served", tmp_path / "same"
    CharTokenizer().save(str(served))
    shutil.copytree(served, same)

    def check(path):
        _check_sglang_tokenizer(
            load_config(
                None,
                ["--rollout.engine", "sglang", "--model.hf_checkpoint", str(served), "--tokenizer.path", path],
                check_paths=False,
            )
        )

    check(str(same))
    with pytest.raises(ConfigError, match="is not the tokenizer SGLang serves model.hf_checkpoint"):
        check(tok_dir)
