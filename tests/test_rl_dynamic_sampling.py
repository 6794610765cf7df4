"""DAPO's dynamic sampling (rl.dynamic_sampling, titan_spec/rl/dynamic_sampling.py).

- the selection rule on hand-made rewards: the first groups with reward spread, in
  generation order; None while another round may follow; at the last round the earliest
  flat groups top the batch up to its size; the counts it reports; deterministic;
- ``dynamic_sample`` runs rounds only while needed, at most 1 + rl.dynamic_sampling_rounds,
  and assembles the kept groups' problems and rollouts (the first round's baselines, every
  round's generation cost);
- a real RLTrainer (tests/helpers/rl_dynamic.py, a fresh tiny policy with a reward that
  leaves about 40% of its groups flat): every step's batch equals the rule applied by hand
  to every round the trainer scored, each round with seeds never used before, and the
  rl/dynamic_* metrics and rl/reward (the kept batch's) are logged.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from titan_spec.rl.dynamic_sampling import dynamic_sample, has_spread, select_groups
from titan_spec.rl.step_records import RolloutBatch
from titan_spec.rl.worker import RolloutStats

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

S, F = [0.0, 1.0, 1.0], [1.0, 1.0, 1.0]  # a group with spread, a flat one (G = 3)


def test_has_spread_is_true_exactly_where_a_group_has_two_different_rewards():
    rewards_NG = torch.tensor([[0.0, 0.0], [0.0, 1.0], [0.5, 0.5], [-1.0, 2.0]])
    assert has_spread(rewards_NG).tolist() == [False, True, False, True]


def test_keeps_the_first_groups_with_spread_in_generation_order():
    rewards_NG = torch.tensor([F, S, F, S, S, F, S])  # 4 with spread: 1, 3, 4, 6
    sel = select_groups(rewards_NG, share=3, final=False)
    assert sel.groups == [1, 3, 4]  # not 6: the batch is full
    assert (sel.dropped, sel.topped_up) == (3, 0)  # every flat group left out is counted
    # The cap makes no difference once the batch is full.
    assert select_groups(rewards_NG, share=3, final=True) == sel


def test_wants_another_round_while_short_and_another_may_follow():
    assert select_groups(torch.tensor([S, F, F]), share=3, final=False) is None


def test_at_the_cap_the_earliest_flat_groups_top_the_batch_up():
    rewards_NG = torch.tensor([F, S, F, F, S, F])  # 2 with spread for a batch of 4
    sel = select_groups(rewards_NG, share=4, final=True)
    assert sel.groups == [0, 1, 2, 4]  # spread 1, 4 + flat 0, 2, in generation order
    assert (sel.dropped, sel.topped_up) == (2, 2)
    # Nothing with spread at all: the first round's groups, all topped up.
    sel = select_groups(torch.tensor([F, F, F, F]), share=2, final=True)
    assert (sel.groups, sel.dropped, sel.topped_up) == ([0, 1], 2, 2)


def test_the_rule_is_a_function_of_the_rewards_alone():
    g = torch.Generator().manual_seed(3)
    rewards_NG = torch.randint(0, 2, (12, 4), generator=g).float()
    first = select_groups(rewards_NG, share=5, final=True)
    assert all(select_groups(rewards_NG.clone(), share=5, final=True) == first for _ in range(3))
    kept = rewards_NG[first.groups]
    n_spread = int(has_spread(rewards_NG).sum())
    assert int(has_spread(kept).sum()) == min(5, n_spread)


def test_fewer_groups_than_the_batch_is_an_error():
    with pytest.raises(ValueError, match="fewer than the batch's 3"):
        select_groups(torch.tensor([S, S]), share=3, final=True)


def _batch(tag: str, rewards_PG: list[list[float]], seconds: float = 1.0) -> RolloutBatch:
    """A RolloutBatch whose problems are f"{tag}{i}" and rollouts (f"{tag}{i}", j)."""
    G = len(rewards_PG[0])
    rollouts = [(f"{tag}{i}", j) for i in range(len(rewards_PG)) for j in range(G)]
    stats = RolloutStats(tokens=10, verify_steps=4, seconds=seconds, drafted_tokens=6, rounds=2)
    return RolloutBatch(
        [f"{tag}{i}" for i in range(len(rewards_PG))],
        rollouts,
        stats,
        {"nospec": RolloutStats(1, 1, 0.5)} if tag == "a" else {},
        7,
        0.25,
    )


def _run(rounds: list[list[list[float]]], extra: int):
    """dynamic_sample over scripted rounds a, b, c, ...; returns (batch, rewards, rounds generated)."""
    tags = iter("bcdefg")
    made = []
    scripted = dict(zip("abcdefg", rounds))

    def generate():
        made.append(next(tags))
        return _batch(made[-1], scripted[made[-1]])

    first = _batch("a", rounds[0])
    batch, rewards_PG = dynamic_sample(
        first, torch.tensor(rounds[0]), generate, lambda b: torch.tensor(scripted[b.problems[0][0]]), extra
    )
    return batch, rewards_PG, made


def test_dynamic_sample_stops_as_soon_as_the_batch_is_full():
    batch, rewards_PG, made = _run([[F, S], [S, F], [S, S]], extra=3)
    assert made == ["b"]  # round c was never generated
    assert batch.problems == ["a1", "b0"]
    assert batch.rollouts == [("a1", 0), ("a1", 1), ("a1", 2), ("b0", 0), ("b0", 1), ("b0", 2)]
    assert rewards_PG.tolist() == [S, S]
    d = batch.dynamic
    assert (d.rounds, d.dropped, d.topped_up, d.generated) == (2, 2, 0, 4)
    # The step's generation cost is both rounds', the baselines and version the first's.
    assert (batch.stats.tokens, batch.stats.seconds, batch.stats.drafted_tokens, batch.stats.rounds) == (20, 2.0, 12, 4)
    assert list(batch.baselines) == ["nospec"] and (batch.policy_version, batch.push_s) == (7, 0.25)


def test_dynamic_sample_uses_at_most_the_extra_rounds_then_tops_up():
    batch, rewards_PG, made = _run([[F, F], [F, S], [F, F], [S, S]], extra=2)
    assert made == ["b", "c"]  # 1 + 2 rounds; d (which would fill it) is never generated
    assert batch.problems == ["a0", "b1"]  # spread b1 + the earliest flat a0, in generation order
    assert rewards_PG.tolist() == [F, S]
    d = batch.dynamic
    assert (d.rounds, d.dropped, d.topped_up, d.generated) == (3, 4, 1, 6)


def test_a_first_round_with_spread_everywhere_is_the_batch_unchanged():
    batch, rewards_PG, made = _run([[S, S, S]], extra=3)
    assert made == [] and batch.problems == ["a0", "a1", "a2"] and rewards_PG.tolist() == [S, S, S]
    assert (batch.dynamic.rounds, batch.dynamic.dropped, batch.dynamic.topped_up) == (1, 0, 0)


def _expected(rounds: list, share: int, extra: int) -> tuple[int, list[int]]:
    """The rule written out again, independently: (rounds used, kept group indices)."""
    groups = [g for r in rounds for g in r]
    for used in range(1, 2 + extra):
        spread = [i for i, g in enumerate(groups[: used * share]) if max(g) != min(g)]
        if len(spread) >= share:
            return used, spread[:share]
    flat = [i for i, g in enumerate(groups) if max(g) == min(g)]
    return 1 + extra, sorted(spread + flat[: share - len(spread)])


def test_real_rl_steps_keep_the_groups_with_spread_and_log_what_they_did(tmp_path):
    steps, share, extra = 3, 4, 1
    args = [
        "--config",
        os.path.join(ROOT, "train_configs", "debug_cpu.toml"),
        "--job.dump_folder",
        str(tmp_path),
        "--model.hf_checkpoint",
        "",
        "--draft.init_from",
        "",
        "--draft.export_dir",
        "",
        "--task.reward",
        "rl_dynamic:coin",
        "--task.seed",
        "5",
        "--rl.dynamic_sampling",
        "true",
        "--rl.dynamic_sampling_rounds",
        str(extra),
        "--rl.prompts_per_step",
        str(share),
        "--rl.group_size",
        "4",
        "--rl.max_new_tokens",
        "8",
        "--rl.baseline_interval",
        "0",
        "--training.seq_len",
        "128",
        "--rollout.progress",
        "false",
        "--checkpoint.enable",
        "false",
        "--metrics.enable_tensorboard",
        "false",
        "--metrics.log_freq",
        "1",
        "--lr_scheduler.warmup_steps",
        "0",
    ]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=1",
        os.path.join(ROOT, "tests/helpers/rl_dynamic.py"),
        str(steps),
        *args,
    ]
    out = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT),
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    line = next(x for x in out.stdout.splitlines() if "rl_dynamic: " in x)
    got = json.loads(line.split("rl_dynamic: ", 1)[1])
    with open(os.path.join(tmp_path, "metrics.jsonl")) as f:
        rows = [json.loads(x) for x in f]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    used_total = 0
    for step, row in zip(got, rows):
        rounds = step["rounds"]
        used, kept = _expected(rounds, share, extra)
        groups = [g for r in rounds for g in r]
        assert len(rounds) == used, step  # rounds ran only while needed, never past the cap
        assert step["kept"] == [groups[i] for i in kept], step
        n_spread = sum(max(g) != min(g) for g in groups)
        kept_spread = sum(max(g) != min(g) for g in step["kept"])
        assert kept_spread == min(share, n_spread), step  # every kept group has spread where the cap allowed
        assert step["completions"] == share * 4  # the batch shape is unchanged
        flat = len(groups) - n_spread
        topped = share - kept_spread
        assert step["dynamic"] == [used, flat - topped, topped, len(groups)], step
        # The logged metrics: rl/reward is the kept batch's, the rl/dynamic_* what was done.
        assert row["rl/reward"] == pytest.approx(sum(map(sum, step["kept"])) / (share * 4)), row
        assert (
            row["rl/dynamic_rounds"],
            row["rl/dynamic_groups_dropped"],
            row["rl/dynamic_topped_up"],
            row["rl/dynamic_groups_generated"],
        ) == (used, flat - topped, topped, len(groups)), row
        used_total += used
        assert step["batch_index"] == used_total  # one dataloader batch of problems per round
    assert used_total > steps, got  # some step needed another round (else this tested nothing)
    seeds = got[-1]["seeds"]
    assert len(seeds) == used_total and len(set(seeds)) == len(seeds), seeds  # each round its own seed
