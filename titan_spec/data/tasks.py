"""Verifiable tasks: prompts with reference answers, generated locally or read from files.

Generated tasks train with no download: arithmetic ("37+5-12=" -> "30") and the embedded
default's reasoning-trace task (``TraceTask``: a short answer or a long step-by-step
count, both checked on the final answer after '####'). A user's GSM8K-style JSONL file
({"question": ..., "answer": "... #### 42"}) is read with per-line errors (name = 'jsonl');
dataset records of a local JSONL / JSON / Parquet file (name = 'dataset': GSM8K, MATH,
DAPO-Math as distributed) with configurable fields (data/records.py). Malformed records are
named and rejected, or skipped with task.on_malformed = 'skip'.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field
from typing import Any

from torchtitan.tools.logging import logger

from titan_spec.config import ConfigError, TaskConfig
from titan_spec.data.records import field_value, final_answer, read_records
from titan_spec.data.rewards import ANSWER_MARK, exact_match

__all__ = ["Problem", "ArithmeticTask", "TraceTask", "JsonlTask", "DatasetTask", "build_task", "check_task_file",
           "exact_match_reward"]


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


class TraceTask:
    """Reasoning-trace arithmetic: "a+b?" answered at once or counted off step by step.

    Prompt "37+5?". The correct completions (the reward checks the text after '####'):
      short "####42"                               the result at once (7 tokens with <eos>)
      long  "37+5=38/4,39/3,40/2,41/1,42/0####42"  one step per unit of b: the running value
                                                   and the units left, down to 0
    Every token of the long style follows from the few before it (a count, not a sum), so a
    tiny model learns it quickly and gets it right; its length grows with b, drawn from
    min_count..max_count with weights COUNT_DECAY**k: a long tail, like reasoning traces.
    SFT demonstrations use the long style with probability ``trace_fraction`` (always
    right) and the short one otherwise, whose result is off by 1..3 with probability
    ``wrong_answer_rate`` (and which a tiny model does not compute reliably at once): GRPO
    then shifts the policy toward the long style, so its completions lengthen and its
    distribution drifts away from the warm start's. Deterministic in the rng
    (tests/test_tasks.py relies on it).
    """

    COUNT_DECAY = 0.88

    def __init__(self, max_operand: int = 50, min_count: int = 3, max_count: int = 16, trace_fraction: float = 0.5,
                 wrong_answer_rate: float = 0.0, operators: str = "+-"):
        self.counts = list(range(min_count, max(min_count, max_count) + 1))
        self.weights = [self.COUNT_DECAY ** k for k in range(len(self.counts))]
        self.max_operand, self.operators = max_operand, operators
        self.trace_fraction, self.wrong_answer_rate = trace_fraction, wrong_answer_rate

    @staticmethod
    def trace(a: int, op: str, b: int) -> str:
        """The long style without the final answer: "a+b=" then value/units-left per step."""
        d = 1 if op == "+" else -1
        return f"{a}{op}{b}=" + ",".join(f"{a + d * i}/{b - i}" for i in range(1, b + 1))

    def sample(self, rng: random.Random) -> Problem:
        a, op = rng.randint(0, self.max_operand), rng.choice(self.operators)
        b = rng.choices(self.counts, self.weights)[0]
        result = a + b if op == "+" else a - b
        # Drawn for every problem, so the problems themselves do not depend on the rates.
        long_style = rng.random() < self.trace_fraction
        noisy = rng.random() < self.wrong_answer_rate
        shown = result + rng.choice((-3, -2, -1, 1, 2, 3))
        prompt = f"{a}{op}{b}?"
        if long_style:
            return Problem(prompt, str(result), f"{self.trace(a, op, b)}{ANSWER_MARK}{result}")
        return Problem(prompt, str(result), f"{ANSWER_MARK}{shown if noisy else result}")


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


def build_task(task_cfg):
    if task_cfg.name == "trace":
        return TraceTask(task_cfg.max_operand, task_cfg.min_count, task_cfg.max_count, task_cfg.trace_fraction,
                         task_cfg.wrong_answer_rate, task_cfg.operators)
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
    no record has, before any run starts."""
    if task_cfg.name == "arithmetic":
        return
    try:
        build_task(task_cfg)
    except (OSError, ValueError) as e:
        raise ConfigError(f"task.path: {e}", key="task.path") from None


def exact_match_reward(completion: str, answer: str) -> float:
    """The exact-match reward (data/rewards.py ``exact_match``)."""
    return exact_match(completion, answer)
