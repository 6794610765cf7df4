"""The long-context lookup task ('records', data/tasks.py LongRecordsTask) and its config
checks: deterministic prompts of exactly task.generated.prompt_len tokens, answers checked by an
independent parser, the two records asked about far apart (and on different CP ranks at
cp = 2), bad lengths one config line before anything starts."""

import os
import random
import re
import subprocess
import sys

import pytest

import titan_spec  # noqa: F401
from titan_spec.config import ConfigError, load_config
from titan_spec.config.schema import GeneratedTaskConfig, TaskConfig
from titan_spec.data.loader import sft_document
from titan_spec.data.generated import LongRecordsTask
from titan_spec.data.tasks import build_task, exact_match_reward
from titan_spec.data.tokenizer import CharTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LONG = os.path.join(ROOT, "train_configs", "long_context_cpu.toml")
LONG_SFT = os.path.join(ROOT, "train_configs", "long_context_cpu_sft.toml")


def _solve(prompt: str) -> tuple[str, int, int]:
    """An independent reading of a prompt: parse every record and the question with regular
    expressions; returns (answer, char offset of record A, char offset of record B)."""
    m = re.fullmatch(r"(#*)((?:\d{4}=\d;)+)\?(\d{4})\+(\d{4})=", prompt)
    assert m, prompt[:80]
    records = {
        k: (int(v), m.start(2) + i.start())
        for i, (k, v) in ((i, i.groups()) for i in re.finditer(r"(\d{4})=(\d);", m.group(2)))
    }
    assert len(records) == len(re.findall(r"\d{4}=\d;", m.group(2))), "keys repeat"
    (va, pa), (vb, pb) = records[m.group(3)], records[m.group(4)]
    return f"{m.group(3)}={va},{m.group(4)}={vb},{va + vb}", pa, pb


@pytest.mark.parametrize("prompt_len", [2048, 8192, 16384, 2053])
def test_records_prompts_have_the_length_asked_and_the_right_answer(prompt_len):
    task = LongRecordsTask(prompt_len)
    tok = CharTokenizer()
    rng = random.Random(7)
    for _ in range(20):
        p = task.sample(rng)
        assert len(p.prompt) == prompt_len
        assert len(tok.encode(p.prompt)) == prompt_len  # 1 token per character
        answer, pa, pb = _solve(p.prompt)
        assert p.answer == answer and p.sft_target == answer
        assert exact_match_reward(answer, p.answer) == 1.0
        # Far apart: at least a quarter of the prompt between the two records, and the
        # question (the last 11 characters) at least a quarter away from the later one.
        assert pb - pa >= prompt_len // 4 - 7, (pa, pb)
        assert prompt_len - pb >= prompt_len // 4 - 7
        # Under cp = 2 (zigzag: 4 chunks of the padded document <bos> prompt answer <eos>,
        # rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2), the two records and the
        # question sit on rank 0, rank 1, rank 0: the answer needs the ring.
        doc = len(sft_document(tok, p.prompt, p.answer).tokens)
        chunk = -(-doc // 4)
        rank = lambda pos: (0, 1, 1, 0)[(pos + 1) // chunk]  # +1: <bos> comes first
        assert [rank(pa), rank(pa + 6), rank(pb), rank(pb + 6), rank(prompt_len - 1)] == [0, 0, 1, 1, 0]


def test_records_task_is_deterministic_in_the_seed_and_uses_the_whole_range():
    task = build_task(TaskConfig(name="records", generated=GeneratedTaskConfig(prompt_len=4096)))
    a = [task.sample(random.Random(3)) for _ in range(2)]
    assert a[0] == a[1]
    b = task.sample(random.Random(4))
    assert b.prompt != a[0].prompt
    # Values 0-9 on both sides: sums 0..18 appear over many problems (not a constant answer).
    rng = random.Random(0)
    sums = {int(task.sample(rng).answer.rsplit(",", 1)[1]) for _ in range(300)}
    assert min(sums) <= 2 and max(sums) >= 16


def test_records_noisy_demonstrations_keep_the_true_answer():
    task = LongRecordsTask(1024, wrong_answer_rate=0.5)
    rng = random.Random(1)
    problems = [task.sample(rng) for _ in range(40)]
    noisy = [p for p in problems if p.demonstration]
    assert 5 < len(noisy) < 35
    for p in problems:
        assert p.answer == _solve(p.prompt)[0]
    for p in noisy:
        assert p.demonstration.rsplit(",", 1)[0] == p.answer.rsplit(",", 1)[0]
        assert p.demonstration != p.answer


@pytest.mark.parametrize(
    "overrides,needles",
    [
        (
            ["--task.generated.prompt_len", "40"],
            ["task.generated.prompt_len = 40 is not allowed", "at least 67 tokens"],
        ),
        (
            ["--task.generated.prompt_len", "80000", "--training.seq_len", "80020"],
            ["task.generated.prompt_len = 80000 is not allowed", "cannot fit", "at most 70017"],
        ),
        # SFT: <bos> + 8190 + the longest answer (16) + <eos> = 8208 > 8192
        (
            ["--task.generated.prompt_len", "8190", "--training.seq_len", "8192"],
            ["task.generated.prompt_len = 8190 does not fit training.seq_len = 8192", "= 8208 tokens", "at least 8208"],
        ),
        (["--training.seq_len", "70000"], ["training.seq_len = 70000 exceeds the model's maximum of 65536"]),
    ],
)
def test_records_bad_lengths_are_one_config_line(overrides, needles):
    from titan_spec.preflight import validate_run

    cfg = load_config(LONG_SFT, overrides, world_size=2, check_paths=False)
    with pytest.raises(ConfigError) as info:
        validate_run(cfg)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("command line --"), msg
    for needle in needles:
        assert needle in msg, msg


def test_records_rl_prompt_that_does_not_fit_stops_the_chain_before_it_starts(tmp_path):
    """`--plan` of the long-context chain (what run_train.sh runs first): an RL prompt whose
    document (<bos> + 8200 + rl.max_new_tokens 24 = 8225) does not fit training.seq_len 8224 is
    one line, exit 2, with no run started (the SFT run it requires included)."""
    cmd = [
        sys.executable,
        "-m",
        "titan_spec.train",
        "--plan",
        "--config",
        LONG,
        "--task.generated.prompt_len",
        "8200",
        "--job.dump_folder",
        str(tmp_path / "never"),
    ]
    env = dict(os.environ, WORLD_SIZE="2", PYTHONPATH=ROOT, HF_HUB_OFFLINE="1")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert out.returncode == 2, out.stderr
    lines = [
        line
        for line in out.stderr.splitlines()
        if line.strip() and "Warning" not in line and "register_constant" not in line
    ]
    assert len(lines) == 1, out.stderr
    for needle in [
        "command line --task.generated.prompt_len",
        "task.generated.prompt_len = 8200 does not fit training.seq_len = 8224",
        "rl.max_new_tokens 24",
        "= 8225 tokens",
    ]:
        assert needle in lines[0], lines[0]
    assert not (tmp_path / "never").exists() and out.stdout == ""
