"""The generated tasks: problems made locally from the task seed, no download.

- ``ArithmeticTask``: left-to-right integer arithmetic ("37+5-12=" -> "30");
- ``TraceTask`` (the embedded default): a guessed answer in words or a step-by-step count,
  both checked on the final answer after '####';
- ``LongRecordsTask`` ('records'): the long-context lookup over a prompt of 2K-16K+ tokens
  whose answer needs two records far apart (preflight/lengths.py checks it fits the run).
"""

from __future__ import annotations

import random

from titan_spec.data.problem import Problem
from titan_spec.data.rewards import ANSWER_MARK

__all__ = ["ArithmeticTask", "TraceTask", "LongRecordsTask", "max_records"]


class ArithmeticTask:
    """Left-to-right integer arithmetic over ``num_operands`` operands in [0, max_operand].

    With ``show_work`` the completion restates the expression before the result
    ("37+5-12?" -> "37+5-12=30"), like a model writing out its working: most of the
    completion is predictable from the prompt and a few tokens need the computation,
    which is the mix speculative decoding meets in real rollouts.
    """

    def __init__(
        self,
        max_operand: int = 99,
        num_operands: int = 2,
        operators: str = "+-",
        show_work: bool = False,
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
    """Reasoning-trace arithmetic: "a+b?" answered by a guess or counted off step by step.

    Prompt "37+5?". The two styles of completion (the reward checks the text after '####'):
      guess "37+5 means 37 plus 5; 37 plus 5 is about 42, so ####42"
                   restates the problem in words, then states a result it did not work out
      trace "37+5=38/4,39/3,40/2,41/1,42/0####42"
                   one step per unit of b: the running value and the units left, down to 0
    Both are long (about 55 and 50 characters, = tokens of the character tokenizer) and
    almost every token follows from the few before it, so a draft predicts both well once
    it has seen them. The trace's length grows with b, drawn from min_count..max_count with
    weights COUNT_DECAY**k: a long tail, like reasoning traces. SFT demonstrations use the
    trace with probability ``trace_fraction`` (always right) and the guess otherwise, whose
    result is off by 1..3 with probability ``wrong_answer_rate`` (and which a tiny model
    does not compute reliably at once). With trace_fraction < 0.5 the warm start's most
    likely completion is a guess: a draft trained on its greedy completions (draft.data =
    "regenerated") has never seen a trace. GRPO then moves the policy to the trace, which
    is always right: its distribution drifts away from the warm start's into text the
    offline draft does not predict. Deterministic in the rng (tests/test_tasks.py relies
    on it).
    """

    COUNT_DECAY = 0.88

    def __init__(
        self,
        max_operand: int = 50,
        min_count: int = 3,
        max_count: int = 16,
        trace_fraction: float = 0.5,
        wrong_answer_rate: float = 0.0,
        operators: str = "+-",
    ):
        self.counts = list(range(min_count, max(min_count, max_count) + 1))
        self.weights = [self.COUNT_DECAY**k for k in range(len(self.counts))]
        self.max_operand, self.operators = max_operand, operators
        self.trace_fraction, self.wrong_answer_rate = trace_fraction, wrong_answer_rate

    @staticmethod
    def trace(a: int, op: str, b: int) -> str:
        """The trace style without the final answer: "a+b=" then value/units-left per step."""
        d = 1 if op == "+" else -1
        return f"{a}{op}{b}=" + ",".join(f"{a + d * i}/{b - i}" for i in range(1, b + 1))

    @staticmethod
    def guess(a: int, op: str, b: int, result: int) -> str:
        """The guess style without the final answer: the problem in words, then ``result``."""
        phrase = f"{a} {'plus' if op == '+' else 'minus'} {b}"
        return f"{a}{op}{b} means {phrase}; {phrase} is about {result}, so "

    def sample(self, rng: random.Random) -> Problem:
        a, op = rng.randint(0, self.max_operand), rng.choice(self.operators)
        b = rng.choices(self.counts, self.weights)[0]
        result = a + b if op == "+" else a - b
        # Drawn for every problem, so the problems themselves do not depend on the rates.
        trace_style = rng.random() < self.trace_fraction
        noisy = rng.random() < self.wrong_answer_rate
        shown = result + rng.choice((-3, -2, -1, 1, 2, 3))
        prompt = f"{a}{op}{b}?"
        if trace_style:
            return Problem(prompt, str(result), f"{self.trace(a, op, b)}{ANSWER_MARK}{result}")
        said = shown if noisy else result
        return Problem(prompt, str(result), f"{self.guess(a, op, b, said)}{ANSWER_MARK}{said}")


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
