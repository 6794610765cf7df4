"""Verifiable tasks: prompts with reference answers, generated locally or read from files.

The default task is generated arithmetic ("37+5-12=" -> "30"), so the embedded default
trains with no download. A user's GSM8K-style JSONL file ({"question": ..., "answer":
"... #### 42"}) is read with per-line errors (name = 'jsonl'); dataset records of a local
JSONL / JSON / Parquet file (name = 'dataset': GSM8K, MATH, DAPO-Math as distributed) with
configurable fields (data/records.py). Malformed records are named and rejected, or skipped
with task.on_malformed = 'skip'. The 'records' task is the long-context sibling of the
generated one: a lookup over a prompt of 2K-16K+ tokens whose answer needs two records far
apart.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field
from typing import Any

from torchtitan.tools.logging import logger

from titan_spec.config import ConfigError, TaskConfig, TitanSpecConfig
from titan_spec.data.records import field_value, final_answer, read_records
from titan_spec.data.rewards import exact_match

__all__ = ["Problem", "ArithmeticTask", "JsonlTask", "DatasetTask", "LongRecordsTask", "build_task",
           "check_task_file", "check_records_fit", "exact_match_reward"]


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str
    """The correct completion: what the exact-match reward checks."""
    demonstration: str = ""
    """What an SFT example shows ('' = the answer); differs from it for noisy demonstrations
    and for dataset records (the whole answer field: GSM8K's working, MATH's solution)."""
    messages: tuple = ()
    """The prompt as chat messages ({role, content} dicts) when the record gives it so
    (DAPO-Math); then ``prompt`` is the last message's content."""
    source: str = ""
    """Which record it is (FILE:LINE, FILE#ROW): named by malformed-record and reward errors."""
    record: dict[str, Any] = field(default_factory=dict, compare=False)
    """The raw dataset record ({} for generated problems): a user reward's third argument."""

    @property
    def sft_target(self) -> str:
        return self.demonstration or self.answer


class ArithmeticTask:
    """Left-to-right integer arithmetic over ``num_operands`` operands in [0, max_operand].

    With ``show_work`` the completion restates the expression before the result
    ("37+5-12?" -> "37+5-12=30"), like a model writing out its working: most of the
    completion is predictable from the prompt and a few tokens need the computation,
    which is the mix speculative decoding meets in real rollouts.
    """

    def __init__(
        self, max_operand: int = 99, num_operands: int = 2, operators: str = "+-", show_work: bool = False,
        wrong_answer_rate: float = 0.0,
    ):
        self.max_operand = max_operand
        self.num_operands = num_operands
        self.operators = operators
        self.show_work = show_work
        self.wrong_answer_rate = wrong_answer_rate

    def sample(self, rng: random.Random) -> Problem:
        value = rng.randint(0, self.max_operand)
        text = str(value)
        for _ in range(self.num_operands - 1):
            op = rng.choice(self.operators)
            x = rng.randint(0, self.max_operand)
            value = value + x if op == "+" else value - x if op == "-" else value * x
            text += f"{op}{x}"
        # Drawn for every problem, so the problems themselves do not depend on the rate.
        noisy = rng.random() < self.wrong_answer_rate
        shown = value + rng.choice((-2, -1, 1, 2))
        if self.show_work:
            return Problem(f"{text}?", f"{text}={value}", f"{text}={shown}" if noisy else "")
        return Problem(f"{text}=", str(value), str(shown) if noisy else "")


class JsonlTask:
    """GSM8K-style lines: {"question": str, "answer": str with the final answer after '####'}."""

    def __init__(self, path: str, on_malformed: str = "reject"):
        """``on_malformed``: 'reject' raises on any bad line (naming them), 'skip' drops them
        (listed in ``errors`` and logged)."""
        self.problems: list[Problem] = []
        self.errors: list[str] = []
        bad_lines: list[int] = []
        if not os.path.isfile(path):
            raise ValueError(f"{path!r} is not a file")
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    answer = str(row["answer"]).split("####")[-1].strip()
                    if "####" not in str(row["answer"]) or not answer:
                        raise ValueError("answer has no final value after '####'")
                    self.problems.append(Problem(prompt=str(row["question"]).strip() + "\n", answer=answer,
                                                 source=f"{path}:{lineno}", record=row))
                except (ValueError, KeyError, TypeError) as e:
                    why = f"missing field {e}" if isinstance(e, KeyError) else str(e)
                    self.errors.append(f"{path}:{lineno}: {why}")
                    bad_lines.append(lineno)
        if self.errors:
            lines = ", ".join(map(str, bad_lines[:10])) + (", ..." if len(bad_lines) > 10 else "")
            if on_malformed == "reject":
                raise ValueError(
                    f"{path}: {len(self.errors)} malformed line(s) (lines {lines}); first: {self.errors[0]} "
                    "(fix them, or set task.on_malformed = 'skip')"
                )
            logger.warning(f"{path}: skipped {len(self.errors)} malformed line(s): {lines}")
        if not self.problems:
            raise ValueError(f"{path}: no usable problems")

    def sample(self, rng: random.Random) -> Problem:
        return self.problems[rng.randrange(len(self.problems))]


def _messages(value: Any) -> tuple:
    """A chat prompt: a non-empty list of {role, content} with string contents."""
    if not value or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                            and isinstance(m.get("content"), str) for m in value):
        raise ValueError("prompt is a list but not of {role, content} messages")
    return tuple({"role": m["role"], "content": m["content"]} for m in value)


class DatasetTask:
    """Records of a local dataset file (data/records.py): the prompt from ``task.prompt_field``
    (a string, or chat messages), the final answer from ``task.answer_field`` by
    ``task.answer_format``, the SFT demonstration the whole answer field."""

    def __init__(self, cfg: TaskConfig):
        path = cfg.path
        self.problems: list[Problem] = []
        rows, self.errors = read_records(path)
        fields = (cfg.prompt_field, cfg.answer_field)
        if rows and not self.errors:
            for f in fields:
                if not any(_has(r, f) for _, r in rows):
                    key = "task.prompt_field" if f == cfg.prompt_field else "task.answer_field"
                    found = sorted(rows[0][1]) if isinstance(rows[0][1], dict) else type(rows[0][1]).__name__
                    raise ValueError(f"{path}: no record has the field {f!r} ({key}); its records have: {found}")
        for name, row in rows:
            try:
                raw = field_value(row, cfg.prompt_field)
                messages = _messages(raw) if isinstance(raw, list) else ()
                if not messages and not isinstance(raw, str):
                    raise ValueError(f"prompt {cfg.prompt_field!r} is a {type(raw).__name__}, not text or chat messages")
                prompt = messages[-1]["content"] if messages else cfg.prompt_template.replace("{prompt}", raw.strip())
                if not prompt.strip():
                    raise ValueError("prompt is empty")
                text = field_value(row, cfg.answer_field)
                if not isinstance(text, (str, int, float)) or isinstance(text, bool):
                    raise ValueError(f"answer {cfg.answer_field!r} is a {type(text).__name__}, not text or a number")
                text = str(text)
                answer = final_answer(text, cfg.answer_format)
                self.problems.append(Problem(prompt, answer, text.strip() if text.strip() != answer else "",
                                             messages, name, row))
            except KeyError as e:
                self.errors.append(f"{name}: missing field {e.args[0]!r}")
            except ValueError as e:
                self.errors.append(f"{name}: {e}")
        if self.errors:
            n = len(self.errors)
            if cfg.on_malformed == "reject":
                raise ValueError(f"{path}: {n} malformed record(s); first: {self.errors[0]} "
                                 "(fix them, or set task.on_malformed = 'skip')")
            logger.warning(f"{path}: skipped {n} malformed record(s): {'; '.join(self.errors[:10])}"
                           f"{'; ...' if n > 10 else ''}")
        if not self.problems:
            raise ValueError(f"{path}: no usable problems")

    def sample(self, rng: random.Random) -> Problem:
        return self.problems[rng.randrange(len(self.problems))]


def _has(row: Any, dotted: str) -> bool:
    try:
        field_value(row, dotted)
        return True
    except KeyError:
        return False


# ---------------------------------------------------------------------------
# The long-context lookup task ('records')
# ---------------------------------------------------------------------------
#
# A prompt of exactly prompt_len characters (= tokens of the character tokenizer):
#
#     ###0417=3;9051=5;2210=7;...;0638=1;?0417+2210=
#
# filler '#' (the remainder no whole record fills), then n records 'KKKK=V;' (distinct
# 4-digit keys, values 0-9), then the question '?A+B='. The completion restates both
# records and adds their values: '0417=3,2210=7,10'. The keys are in the question, so a
# draft can predict them from nearby tokens; the values are only in the records, which is
# where the whole context matters:
# - record A is in the first quarter of the list, record B in the third quarter: at least a
#   quarter of the prompt apart (2K tokens of an 8K prompt), the question far from both;
# - under context parallelism's zigzag layout (rank r holds chunks r and 2cp-1-r of 2cp) at
#   cp = 2, A is on rank 0, B on rank 1 and the question on rank 0 again: the answer needs
#   keys that travel the ring.

RECORD_LEN = 7
"""Characters of one record, 'KKKK=V;'."""
QUESTION_LEN = 11
"""Characters of the question, '?KKKK+KKKK='."""
ANSWER_MAX_LEN = 16
"""Characters of the longest completion, 'KKKK=V,KKKK=V,18'."""
MIN_RECORDS = 8
"""At least two records per quarter of the list, so A and B have a quarter each to come from."""
KEYS = 10_000
"""Distinct 4-digit keys: the most records a prompt can hold."""


def max_records(prompt_len: int) -> int:
    """Records a prompt of ``prompt_len`` characters holds (before the KEYS cap)."""
    return (prompt_len - QUESTION_LEN) // RECORD_LEN


class LongRecordsTask:
    """Prompts of exactly ``prompt_len`` characters holding ``max_records(prompt_len)`` records;
    the format is in the comment above. ``wrong_answer_rate``: as ArithmeticTask's (the SFT
    demonstration's sum off by 1 or 2)."""

    def __init__(self, prompt_len: int, wrong_answer_rate: float = 0.0):
        n = max_records(prompt_len)
        if not MIN_RECORDS <= n <= KEYS:
            raise ValueError(f"prompt_len {prompt_len} holds {n} records; allowed {MIN_RECORDS}..{KEYS}")
        self.prompt_len, self.records = prompt_len, n
        self.wrong_answer_rate = wrong_answer_rate

    def positions(self, rng: random.Random) -> tuple[int, int]:
        """The record indices asked about: A in [0, n/4), B in [n/2, 3n/4)."""
        n = self.records
        return rng.randrange(0, n // 4), rng.randrange(n // 2, 3 * n // 4)

    def sample(self, rng: random.Random):
        n = self.records
        keys = rng.sample(range(KEYS), n)
        values = [rng.randrange(10) for _ in range(n)]
        a, b = self.positions(rng)
        filler = "#" * (self.prompt_len - QUESTION_LEN - RECORD_LEN * n)
        records = "".join(f"{k:04d}={v};" for k, v in zip(keys, values))
        prompt = f"{filler}{records}?{keys[a]:04d}+{keys[b]:04d}="
        total = values[a] + values[b]
        # Drawn for every problem, so the problems themselves do not depend on the rate.
        noisy = rng.random() < self.wrong_answer_rate
        shown = max(total + rng.choice((-2, -1, 1, 2)), 0)
        work = f"{keys[a]:04d}={values[a]},{keys[b]:04d}={values[b]},"
        return Problem(prompt, f"{work}{total}", f"{work}{shown}" if noisy else "")


def check_records_fit(cfg: TitanSpecConfig) -> None:
    """A 'records' task fits the run: its prompts hold MIN_RECORDS..KEYS records, and a whole
    document (<bos>, prompt, completion, <eos>) fits training.seq_len (the completion:
    rl.max_new_tokens in RL, the longest answer otherwise). One ConfigError line, before any
    process starts (train.check_inputs); the model's maximum length is checked against
    training.seq_len by train.to_trainer_config."""
    t = cfg.task
    if t.name != "records":
        return
    n = max_records(t.prompt_len)
    if n < MIN_RECORDS:
        raise ConfigError(
            f"task.prompt_len = {t.prompt_len} is not allowed; the 'records' task needs at least "
            f"{QUESTION_LEN + RECORD_LEN * MIN_RECORDS} tokens ({MIN_RECORDS} records of {RECORD_LEN} and the question)",
            key="task.prompt_len",
        )
    if n > KEYS:
        raise ConfigError(
            f"task.prompt_len = {t.prompt_len} is not allowed; {n} records cannot fit in {KEYS} distinct "
            f"4-digit keys: it must be at most {QUESTION_LEN + RECORD_LEN * (KEYS + 1) - 1}",
            key="task.prompt_len",
        )
    # An RL document is <bos> + prompt + up to rl.max_new_tokens generated ids (<eos> one of
    # them); an SFT document is <bos> + prompt + answer + <eos>.
    rl = cfg.mode.trains == "rl"
    doc = 1 + t.prompt_len + (cfg.rl.max_new_tokens if rl else ANSWER_MAX_LEN + 1)
    if doc > cfg.training.seq_len:
        what = f"rl.max_new_tokens {cfg.rl.max_new_tokens}" if rl else f"the longest answer {ANSWER_MAX_LEN} + <eos>"
        raise ConfigError(
            f"task.prompt_len = {t.prompt_len} does not fit training.seq_len = {cfg.training.seq_len}: a document "
            f"is <bos> + {t.prompt_len} prompt tokens + {what} = {doc} tokens; raise training.seq_len "
            f"to at least {doc} or lower task.prompt_len",
            key="task.prompt_len",
        )


def build_task(task_cfg):
    if task_cfg.name == "records":
        return LongRecordsTask(task_cfg.prompt_len, task_cfg.wrong_answer_rate)
    if task_cfg.name == "arithmetic":
        return ArithmeticTask(
            task_cfg.max_operand, task_cfg.num_operands, task_cfg.operators, task_cfg.show_work,
            task_cfg.wrong_answer_rate,
        )
    if task_cfg.name == "dataset":
        return DatasetTask(task_cfg)
    return JsonlTask(task_cfg.path, task_cfg.on_malformed)


def check_task_file(task_cfg: TaskConfig) -> None:
    """A [task] that reads a file (name = 'jsonl' or 'dataset') can read it: one ConfigError
    line (key task.path) naming the file and its malformed records, or the configured field
    no record has, before any run starts. Generated tasks read no file ('records' has its own
    check, check_records_fit)."""
    if task_cfg.name in ("arithmetic", "records"):
        return
    try:
        build_task(task_cfg)
    except (OSError, ValueError) as e:
        raise ConfigError(f"task.path: {e}", key="task.path") from None


def exact_match_reward(completion: str, answer: str) -> float:
    """The exact-match reward (data/rewards.py ``exact_match``)."""
    return exact_match(completion, answer)
