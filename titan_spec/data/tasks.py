"""Verifiable tasks: prompts with reference answers, generated locally (data/generated.py)
or read from files (here), and ``build_task`` choosing one from [task].

Generated tasks train with no download: arithmetic ("37+5-12=" -> "30") and the embedded
default's reasoning-trace task (``TraceTask``: a guessed answer in words or a step-by-step
count, both checked on the final answer after '####'). A user's GSM8K-style JSONL file
({"question": ..., "answer": "... #### 42"}) is read with per-line errors (name = 'jsonl');
dataset records of a local JSONL / JSON / Parquet file (name = 'dataset': GSM8K, MATH,
DAPO-Math as distributed) with configurable fields (data/records.py). Malformed records are
named and rejected, or skipped with task.on_malformed = 'skip'.
The 'records' task is the long-context sibling of the generated ones: a lookup over a
prompt of 2K-16K+ tokens whose answer needs two records far apart.
"""

from __future__ import annotations

import json
import os
import random
from typing import Any

from torchtitan.tools.logging import logger

from titan_spec.config import TaskConfig
from titan_spec.data.generated import ArithmeticTask, LongRecordsTask, TraceTask
from titan_spec.data.problem import Problem
from titan_spec.data.records import field_value, final_answer, read_records
from titan_spec.data.rewards import exact_match

__all__ = ["AnswerFormatError", "JsonlTask", "DatasetTask", "build_task", "exact_match_reward"]


class AnswerFormatError(ValueError):
    """No record of a file has a final answer in task.answer_format: the format is at fault,
    not the file (the preflight names task.answer_format, not task.path)."""


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
                    self.problems.append(
                        Problem(
                            prompt=str(row["question"]).strip() + "\n",
                            answer=answer,
                            source=f"{path}:{lineno}",
                            record=row,
                        )
                    )
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
    if not value or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
    ):
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
        format_misses: list[tuple[str, str, str]] = []  # (record, answer text, why) final_answer refused
        for name, row in rows:
            try:
                raw = field_value(row, cfg.prompt_field)
                messages = _messages(raw) if isinstance(raw, list) else ()
                if not messages and not isinstance(raw, str):
                    raise ValueError(
                        f"prompt {cfg.prompt_field!r} is a {type(raw).__name__}, not text or chat messages"
                    )
                prompt = messages[-1]["content"] if messages else cfg.prompt_template.replace("{prompt}", raw.strip())
                if not prompt.strip():
                    raise ValueError("prompt is empty")
                text = field_value(row, cfg.answer_field)
                if not isinstance(text, (str, int, float)) or isinstance(text, bool):
                    raise ValueError(f"answer {cfg.answer_field!r} is a {type(text).__name__}, not text or a number")
                text = str(text)
                try:
                    answer = final_answer(text, cfg.answer_format)
                except ValueError as e:
                    format_misses.append((name, text, str(e)))
                    raise
                self.problems.append(
                    Problem(prompt, answer, text.strip() if text.strip() != answer else "", messages, name, row)
                )
            except KeyError as e:
                self.errors.append(f"{name}: missing field {e.args[0]!r}")
            except ValueError as e:
                self.errors.append(f"{name}: {e}")
        if rows and len(format_misses) == len(rows) and cfg.answer_format != "auto":
            _answer_format_misfit(cfg, format_misses)
        if self.errors:
            n = len(self.errors)
            if cfg.on_malformed == "reject":
                raise ValueError(
                    f"{path}: {n} malformed record(s); first: {self.errors[0]} "
                    "(fix them, or set task.on_malformed = 'skip')"
                )
            logger.warning(
                f"{path}: skipped {n} malformed record(s): {'; '.join(self.errors[:10])}{'; ...' if n > 10 else ''}"
            )
        if not self.problems:
            raise ValueError(f"{path}: no usable problems")

    def sample(self, rng: random.Random) -> Problem:
        return self.problems[rng.randrange(len(self.problems))]


def _answer_format_misfit(cfg: TaskConfig, misses: list[tuple[str, str, str]]) -> None:
    """No record has a final answer in task.answer_format: the format is at fault, not the
    file (a record or two without one is the file's: malformed records, task.path)."""
    # 'plain' reads any text, so it is suggested by no one: the specific formats first.
    fits = [f for f in ("gsm8k", "boxed", "auto") if f != cfg.answer_format and all(_reads(t, f) for _, t, _ in misses)]
    hint = f"; did you mean {fits[0]!r}? it reads every record" if fits else ""
    name, _, why = misses[0]
    raise AnswerFormatError(
        f"task.answer_format = {cfg.answer_format!r} finds no final answer in any of the {len(misses)} records of "
        f"{cfg.path} (first: {name}: {why}); allowed: 'auto' (each record's own), 'gsm8k' (after '####'), "
        f"'boxed' (the last \\boxed{{}}), 'plain' (the whole field){hint}"
    )


def _reads(text: str, fmt: str) -> bool:
    try:
        final_answer(text, fmt)
        return True
    except ValueError:
        return False


def _has(row: Any, dotted: str) -> bool:
    try:
        field_value(row, dotted)
        return True
    except KeyError:
        return False


def build_task(task_cfg):
    g = task_cfg.generated
    if task_cfg.name == "trace":
        return TraceTask(g.max_operand, g.min_count, g.max_count, g.trace_fraction, g.wrong_answer_rate, g.operators)
    if task_cfg.name == "records":
        return LongRecordsTask(g.prompt_len, g.wrong_answer_rate)
    if task_cfg.name == "arithmetic":
        return ArithmeticTask(g.max_operand, g.num_operands, g.operators, g.show_work, g.wrong_answer_rate)
    if task_cfg.name == "dataset":
        return DatasetTask(task_cfg)
    return JsonlTask(task_cfg.path, task_cfg.on_malformed)


def exact_match_reward(completion: str, answer: str) -> float:
    """The exact-match reward (data/rewards.py ``exact_match``)."""
    return exact_match(completion, answer)
