"""Dataset records from local files, and the final answer of a reference solution.

``read_records`` reads a .jsonl / .json / .parquet file with the HF ``datasets`` library
(local files only: no hub; its Arrow cache goes to a temporary directory that is removed),
and names every record ``FILE:LINE`` (JSONL: its line, blank lines not counted as records)
or ``FILE#ROW`` (Parquet, JSON). A JSONL file ``datasets`` cannot read (a line that is not
JSON, a field whose type changes between lines) is read again line by line so that the bad
lines are named: they are malformed records like any other.

``final_answer`` reads the answer a reward compares against from a reference solution:
GSM8K's value after '####', MATH's last \\boxed{...}, or the whole text.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

from titan_spec.data.rewards import last_boxed

__all__ = ["read_records", "field_value", "final_answer", "FORMATS"]

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def _lines(path: str) -> list[tuple[int, str]]:
    with open(path, encoding="utf-8") as f:
        return [(n, line) for n, line in enumerate(f, 1) if line.strip()]


def read_records(path: str) -> tuple[list[tuple[str, Any]], list[str]]:
    """(records as (name, dict), errors as 'NAME: why') of a local file."""
    if not os.path.isfile(path):
        raise ValueError(f"{path!r} is not a file")
    ext = os.path.splitext(path)[1].lower()
    if ext not in FORMATS:
        raise ValueError(f"{path!r}: not a .jsonl, .json or .parquet file")
    import datasets  # optional heavy dependency, imported where used

    if os.path.getsize(path) == 0:
        raise ValueError(f"{path}: the file is empty (0 bytes); allowed: a .jsonl, .json or .parquet file of records")
    datasets.disable_progress_bars()
    # Its own errors too: a file it cannot read is named once, by the ValueError below
    # (the Parquet reader logs "Failed to read schema ..." before raising).
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        with tempfile.TemporaryDirectory(prefix="titan_spec_ds_") as cache:
            ds = datasets.load_dataset(
                FORMATS[ext], data_files=path, split="train", cache_dir=cache, keep_in_memory=True
            )
            rows = ds.to_list()
    except Exception as e:  # pyarrow / datasets errors: name the lines where we can
        if ext != ".jsonl":
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            what = "not a complete Parquet file (truncated or corrupt)" if ext == ".parquet" else "cannot be read"
            raise ValueError(f"{path}: {what}: {why}") from None
        records, errors = [], []
        for n, line in _lines(path):
            try:
                records.append((f"{path}:{n}", json.loads(line)))
            except json.JSONDecodeError as je:
                errors.append(f"{path}:{n}: not JSON ({je.msg})")
        return records, errors
    if ext == ".jsonl":
        names = [f"{path}:{n}" for n, _ in _lines(path)]
        if len(names) != len(rows):  # not one record per non-blank line: fall back to row numbers
            names = [f"{path}#{i}" for i in range(len(rows))]
    else:
        names = [f"{path}#{i}" for i in range(len(rows))]
    return list(zip(names, rows)), []


def field_value(record: Any, dotted: str) -> Any:
    """``record['a']['b']`` for 'a.b'; KeyError naming the field when it is absent."""
    value = record
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value or value[part] is None:
            raise KeyError(dotted)
        value = value[part]
    return value


def final_answer(text: str, fmt: str) -> str:
    """The final answer of a reference ``text`` by ``fmt`` (task.answer_format); ValueError
    when it has none."""
    if fmt == "auto":
        fmt = "gsm8k" if "####" in text else "boxed" if ("\\boxed" in text or "\\fbox" in text) else "plain"
    if fmt == "gsm8k":
        if "####" not in text:
            raise ValueError("answer has no final value after '####'")
        answer = text.split("####")[-1].strip()
        if not answer:
            raise ValueError("answer has no final value after '####'")
        return answer.replace(",", "") if answer.replace(",", "").lstrip("-").isdigit() else answer
    if fmt == "boxed":
        answer = last_boxed(text)
        if answer is None or not answer.strip():
            raise ValueError("answer has no \\boxed{...} final answer")
        return answer.strip()
    answer = text.strip()
    if not answer:
        raise ValueError("answer is empty")
    return answer
