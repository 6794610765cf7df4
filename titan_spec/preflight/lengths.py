"""Every document a run packs fits a row of training.seq_len, checked before the start: the
packer (data/packing.py) never truncates, so one document too long stops the run at the
step that first draws it. SFT and offline draft training pack <bos> prompt demonstration
<eos> per record; RL packs the prompt and up to rl.max_new_tokens generated ids. One
ConfigError line naming the record at fault (FILE:LINE, FILE#ROW), the key and what fits."""

from __future__ import annotations

import random

from titan_spec.config import ConfigError, TitanSpecConfig, document_multiple
from titan_spec.data.generated import ANSWER_MAX_LEN, KEYS, MIN_RECORDS, QUESTION_LEN, RECORD_LEN, max_records
from titan_spec.data.loader import sft_document
from titan_spec.data.tasks import build_task

__all__ = ["check_documents_fit", "check_records_fit"]

SAMPLED = 512
"""Problems drawn from a generated task (an unbounded set) for its longest prompt."""


def _padded(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _problems(cfg: TitanSpecConfig) -> tuple[list, bool]:
    """(the task's problems, whether that is all of them): every record of a file task; a
    fixed sample of a generated one ('records' has its own check, ``check_records_fit``)."""
    task = build_task(cfg.task)
    if hasattr(task, "problems"):
        return task.problems, True
    rng = random.Random(cfg.task.seed)
    return [task.sample(rng) for _ in range(SAMPLED)], False


def check_documents_fit(cfg: TitanSpecConfig, tok, prompts) -> None:
    """Raises ConfigError when a document of the run cannot fit training.seq_len. ``tok``:
    the run's tokenizer; ``prompts``: its PromptFormat (the ids the trainer packs)."""
    if cfg.task.name == "records":
        return
    seq_len, multiple = cfg.training.seq_len, document_multiple(cfg)
    rl = cfg.mode.trains == "rl"
    if not rl and (cfg.task.name not in ("jsonl", "dataset") or cfg.draft.data == "regenerated"):
        return  # a generated task's demonstrations are sized by its own keys; regenerated ones by their budget
    problems, every = _problems(cfg)
    if rl:
        _check_rl(cfg, problems, every, prompts, seq_len, multiple)
    else:
        _check_sft(problems, tok, prompts, seq_len, multiple)


def _check_rl(cfg, problems, every: bool, prompts, seq_len: int, multiple: int) -> None:
    m = cfg.rl.max_new_tokens
    longest, n = max(((p, len(prompts.ids(p))) for p in problems), key=lambda x: x[1])
    need = _padded(n + m, multiple)
    if need <= seq_len:
        return
    which = longest.source or repr(longest.prompt)
    if _padded(n + 1, multiple) > seq_len:  # the prompt alone leaves no room for a completion
        raise ConfigError(
            f"task.path: {which}: its prompt is {n} tokens, which leaves no room for a completion in a packed row "
            f"of training.seq_len = {seq_len}; allowed: prompts of at most {seq_len - m} tokens with "
            f"rl.max_new_tokens = {m} (raise training.seq_len, or drop such records)",
            key="task.path",
        )
    of = "the longest prompt" if every else f"the longest of {len(problems)} sampled prompts"
    room = seq_len - n if multiple == 1 else f"{seq_len} - {n}, less padding to multiples of {multiple}"
    raise ConfigError(
        f"rl.max_new_tokens = {m} does not fit a packed row of training.seq_len = {seq_len} with {of} "
        f"({which}, {n} tokens): prompt + completion = {need} tokens; allowed: rl.max_new_tokens <= {room}, "
        f"or raise training.seq_len to {need}",
        key="rl.max_new_tokens",
    )


def _check_sft(problems, tok, prompts, seq_len: int, multiple: int) -> None:
    long = []
    for p in problems:
        n = _padded(len(sft_document(tok, prompts.ids(p), p.sft_target).tokens), multiple)
        if n > seq_len:
            long.append((p, n))
    if not long:
        return
    p, n = max(long, key=lambda x: x[1])
    raise ConfigError(
        f"task.path: {len(long)} of {len(problems)} records are longer than a packed row of training.seq_len = "
        f"{seq_len} tokens (prompt + demonstration + <eos>; never truncated); the longest: {p.source} "
        f"({n} tokens); allowed: records of at most {seq_len} tokens (raise training.seq_len, or drop them)",
        key="task.path",
    )


def check_records_fit(cfg: TitanSpecConfig) -> None:
    """A 'records' task fits the run: its prompts hold MIN_RECORDS..KEYS records, and a whole
    document (<bos>, prompt, completion, <eos>) fits training.seq_len (the completion:
    rl.max_new_tokens in RL, the longest answer otherwise). One ConfigError line, before any
    process starts (preflight/inputs.py check_inputs); the model's maximum length is checked
    against training.seq_len by preflight/trainer_config.py."""
    if cfg.task.name != "records":
        return
    t = cfg.task.generated
    n = max_records(t.prompt_len)
    if n < MIN_RECORDS:
        raise ConfigError(
            f"task.generated.prompt_len = {t.prompt_len} is not allowed; the 'records' task needs at least "
            f"{QUESTION_LEN + RECORD_LEN * MIN_RECORDS} tokens ({MIN_RECORDS} records of {RECORD_LEN} and the question)",
            key="task.generated.prompt_len",
        )
    if n > KEYS:
        raise ConfigError(
            f"task.generated.prompt_len = {t.prompt_len} is not allowed; {n} records cannot fit in {KEYS} distinct "
            f"4-digit keys: it must be at most {QUESTION_LEN + RECORD_LEN * (KEYS + 1) - 1}",
            key="task.generated.prompt_len",
        )
    # An RL document is <bos> + prompt + up to rl.max_new_tokens generated ids (<eos> one of
    # them); an SFT document is <bos> + prompt + answer + <eos>.
    rl = cfg.mode.trains == "rl"
    doc = 1 + t.prompt_len + (cfg.rl.max_new_tokens if rl else ANSWER_MAX_LEN + 1)
    if doc > cfg.training.seq_len:
        what = f"rl.max_new_tokens {cfg.rl.max_new_tokens}" if rl else f"the longest answer {ANSWER_MAX_LEN} + <eos>"
        raise ConfigError(
            f"task.generated.prompt_len = {t.prompt_len} does not fit training.seq_len = {cfg.training.seq_len}: a document "
            f"is <bos> + {t.prompt_len} prompt tokens + {what} = {doc} tokens; raise training.seq_len "
            f"to at least {doc} or lower task.generated.prompt_len",
            key="task.generated.prompt_len",
        )
