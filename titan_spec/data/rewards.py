"""The reward registry: what an RL completion scores against its record's answer.

Every reward has ONE signature, the built-in ones and a user's alike::

    def reward(completion: str, answer: str, record: Mapping[str, Any]) -> float

``completion`` is the decoded completion (special tokens dropped), ``answer`` the record's
final answer (``Problem.answer``: GSM8K's value after '####', MATH's last \\boxed{...}, a
DAPO-Math ground truth), ``record`` the raw dataset record ({} for generated problems). It
returns a finite number (bool and int count as 0/1 and their value).

    exact_match   1 when the completion, stripped, equals the answer (the embedded task's)
    math          1 when math-verify finds the completion's final answer equal to the answer
                  (boxed answers, fractions, decimals, LaTeX): math_verify.verify(gold, pred)
    format        1 when the completion ends its work with a final answer mark: a \\boxed{...}
                  or a '#### x' line
    module:func   a user function of the signature above, imported by ``task.reward``

``reward_fn`` resolves ``task.reward``; its ValueError (an unknown name with a "did you mean",
a path that does not import, an attribute that is not callable) is a config error before any
run starts (preflight/inputs.py ``check_reward``). A reward
that raises or returns a non-finite value during a step is a ``RewardError`` naming the
record: ``titan_spec.train`` prints it as one line and the run stops (no DONE).
"""

from __future__ import annotations

import difflib
import functools
import importlib
import math
import numbers
import re
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["REWARDS", "RewardError", "reward_fn", "score", "exact_match", "math_reward", "format_reward", "last_boxed"]

RewardFn = Callable[[str, str, Mapping[str, Any]], float]


class RewardError(RuntimeError):
    """A reward that raised or returned a non-finite value, phrased for the user (one line)."""


ANSWER_MARK = "####"
"""GSM8K's final-answer marker: a completion that writes it is judged on what follows it."""


def exact_match(completion: str, answer: str, record: Mapping[str, Any] | None = None) -> float:
    """1.0 when the completion's final answer equals ``answer``: the text after its last
    '####' when it writes one (GSM8K's convention; the trace task's both styles), else the
    whole completion (the arithmetic task, whose completions never contain '#')."""
    if ANSWER_MARK in completion:
        completion = completion.rsplit(ANSWER_MARK, 1)[-1]
    return 1.0 if completion.strip() == answer.strip() else 0.0


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (or \\fbox{...}) of ``text``, braces matched; None if there is none."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, j = 1, i
    while j < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        j += 1
    return text[i : j - 1] if depth == 0 else None


@functools.lru_cache(maxsize=65536)
def _gold(answer: str):
    from math_verify import parse  # optional heavy dependency (sympy), imported where used

    # A bare reference answer ("3/4", "\frac{3}{4}", "0.5") parses as LaTeX math.
    return parse(answer if ("$" in answer or "\\boxed" in answer) else f"${answer}$")


def math_reward(completion: str, answer: str, record: Mapping[str, Any] | None = None) -> float:
    from math_verify import parse, verify

    gold, pred = _gold(answer), parse(completion)
    return 1.0 if gold and pred and verify(gold, pred) else 0.0


_FINAL_MARK = re.compile(r"####\s*\S")


def format_reward(completion: str, answer: str = "", record: Mapping[str, Any] | None = None) -> float:
    return 1.0 if last_boxed(completion) is not None or _FINAL_MARK.search(completion) else 0.0


REWARDS: dict[str, RewardFn] = {"exact_match": exact_match, "math": math_reward, "format": format_reward}
"""The built-in rewards by ``task.reward`` name."""


def _import(path: str) -> RewardFn:
    module, _, name = path.partition(":")
    if not module or not name:
        raise ValueError(f"task.reward = {path!r}: a user reward is 'module:function'")
    try:
        mod = importlib.import_module(module)
    except Exception as e:  # ImportError, or whatever the module raises while importing
        raise ValueError(
            f"task.reward = {path!r}: module {module!r} does not import "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        ) from None
    fn = getattr(mod, name, None)
    if not callable(fn):
        raise ValueError(f"task.reward = {path!r}: module {module!r} has no function {name!r}")
    return fn


def reward_fn(name: str) -> RewardFn:
    """``task.reward`` -> the function; ValueError (one line) for an unknown name or a bad path."""
    if name in REWARDS:
        return REWARDS[name]
    if ":" in name:
        return _import(name)
    near = difflib.get_close_matches(name, list(REWARDS), n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    raise ValueError(
        f"task.reward = {name!r} is not a reward{hint}; allowed: {', '.join(REWARDS)} "
        "or a user function 'module:function'"
    )


def score(fn: RewardFn, name: str, completions: list[str], problems: list) -> list[float]:
    """``fn`` over (completion, problem) pairs; a reward that raises or returns a non-finite
    value is a RewardError naming the reward and the record (``Problem.source``)."""
    out = []
    for completion, p in zip(completions, problems):
        where = getattr(p, "source", "") or repr(p.prompt[:60])
        try:
            value = fn(completion, p.answer, getattr(p, "record", None) or {})
        except Exception as e:
            raise RewardError(
                f"reward {name!r} raised on record {where}: {type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''} (completion {completion[:80]!r})"
            ) from e
        if not isinstance(value, numbers.Real):
            raise RewardError(
                f"reward {name!r} returned {type(value).__name__} {value!r} on record {where}, not a number"
            )
        value = float(value)
        if not math.isfinite(value):
            raise RewardError(f"reward {name!r} returned {value} on record {where} (completion {completion[:80]!r})")
        out.append(value)
    return out
