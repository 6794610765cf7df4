"""The generated trace task (titan_spec/data/generated.py TraceTask), the embedded default's:
deterministic in the seed, both styles verified by the reward and re-derived from the
prompt, lengths long with a tail, and the demonstration mix
at the configured rates."""

import random
import re
import statistics

import pytest

from titan_spec.config import ConfigError, GeneratedTaskConfig, TaskConfig, load_config
from titan_spec.data.generated import TraceTask
from titan_spec.data.tasks import build_task, exact_match_reward
from titan_spec.data.tokenizer import CharTokenizer


def _sample(task, seed, n):
    rng = random.Random(seed)
    return [task.sample(rng) for _ in range(n)]


def test_deterministic_in_the_seed_and_the_problems_independent_of_the_style_rates():
    a = TraceTask(50, 4, 16, 0.7, 0.5)
    assert _sample(a, 3, 200) == _sample(TraceTask(50, 4, 16, 0.7, 0.5), 3, 200)
    assert _sample(a, 3, 200) != _sample(a, 4, 200)
    # The rates change the demonstrations, never which problems come up.
    b = TraceTask(50, 4, 16, 0.1, 0.0)
    assert [(p.prompt, p.answer) for p in _sample(a, 3, 200)] == [(p.prompt, p.answer) for p in _sample(b, 3, 200)]


def test_both_styles_are_right_by_the_reward_and_the_trace_counts_correctly():
    tok = CharTokenizer()
    probs = _sample(TraceTask(50, 4, 16, 0.5, 0.5), 0, 2000)
    traces = [p for p in probs if "/" in p.sft_target]
    guesses = [p for p in probs if "/" not in p.sft_target]
    assert 0.45 < len(traces) / len(probs) < 0.55
    wrong = [p for p in guesses if exact_match_reward(p.sft_target, p.answer) == 0]
    assert 0.45 < len(wrong) / len(guesses) < 0.55  # wrong_answer_rate, off by 1..3
    for p in guesses:
        a, op, b = re.fullmatch(r"(\d+)([+-])(\d+)\?", p.prompt).groups()
        said = p.sft_target.rsplit("####", 1)[1]
        phrase = f"{a} {'plus' if op == '+' else 'minus'} {b}"
        assert p.sft_target == f"{a}{op}{b} means {phrase}; {phrase} is about {said}, so ####{said}"
        assert 0 <= abs(int(said) - int(p.answer)) <= 3
    for p in wrong:
        assert 1 <= abs(int(p.sft_target.rsplit("####", 1)[1]) - int(p.answer)) <= 3
    for p in traces:
        assert exact_match_reward(p.sft_target, p.answer) == 1.0
        # Re-derive the trace from the prompt: "a+b=" then (a +- i)/(b - i) for i = 1..b.
        a, op, b = re.fullmatch(r"(\d+)([+-])(\d+)\?", p.prompt).groups()
        a, b, d = int(a), int(b), 1 if op == "+" else -1
        assert p.answer == str(a + d * b)
        steps = ",".join(f"{a + d * i}/{b - i}" for i in range(1, b + 1))
        assert p.sft_target == f"{a}{op}{b}={steps}####{a + d * b}"
    for p in probs:
        tok.encode(p.prompt + p.sft_target)  # printable ASCII: the character tokenizer takes it
    # Both styles are long: a draft has room for K = 4 in either.
    assert statistics.mean(len(p.sft_target) for p in guesses) >= 45
    assert statistics.mean(len(p.sft_target) for p in traces) >= 40
    # The reward checks only what follows the last '####', and a completion without one whole.
    assert exact_match_reward("junk####12", "12") == 1.0 and exact_match_reward("12", "12") == 1.0
    assert exact_match_reward("12####13", "12") == 0.0 and exact_match_reward("3+9=12", "12") == 0.0


def test_lengths_are_reasoning_trace_like():
    probs = _sample(TraceTask(50, 4, 16, 1.0, 0.0), 1, 4000)
    lengths = sorted(len(p.sft_target) + 1 for p in probs)  # + <eos>
    mean, p50, p90 = statistics.mean(lengths), lengths[2000], lengths[3600]
    assert mean >= 40 and p90 > 1.5 * p50 and lengths[-1] > 2 * p50, (mean, p50, p90, lengths[-1])
    # b = 4 + k with weight 0.88**k: the smallest count is the likeliest.
    counts = [int(re.fullmatch(r"\d+[+-](\d+)\?", p.prompt).group(1)) for p in probs]
    assert min(counts) == 4 and max(counts) == 16 and statistics.mode(counts) == 4


def test_config_builds_it_and_rejects_bad_values(tmp_path):
    cfg = TaskConfig(
        name="trace", generated=GeneratedTaskConfig(max_operand=20, min_count=2, max_count=5, trace_fraction=1.0)
    )
    task = build_task(cfg)
    assert isinstance(task, TraceTask) and task.counts == [2, 3, 4, 5]
    path = tmp_path / "x.toml"
    path.write_text('[task]\nname = "trace"\n[task.generated]\nmin_count = 2\n')
    for bad, msg in (
        (
            ["--task.generated.max_count", "1"],
            "task.generated.max_count = 1 is not allowed; it must be >= task.generated.min_count (2)",
        ),
        (["--task.generated.trace_fraction", "1.5"], "task.generated.trace_fraction = 1.5"),
        (["--task.generated.operators", "*"], "task.generated.operators = '*'"),
    ):
        with pytest.raises(ConfigError, match=re.escape(msg)) as info:
            load_config(str(path), bad, check_paths=False)
        assert "\n" not in str(info.value)
