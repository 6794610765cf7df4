"""DAPO's dynamic sampling (``rl.dynamic_sampling``; verl's ``algorithm.filter_groups``).

A group whose G rewards are all equal has advantage 0 on every completion: no policy
gradient, yet it dilutes the token-mean loss. Round 0 is the step's usual generation; while
fewer than P groups have spread rewards and rounds remain (rl.dynamic_sampling_rounds), the
dataloader's next problems are generated and scored the same way; after the last round the
earliest dropped groups top the batch up, so it is always P groups (logged).

Invariants: the rule reads the task's rewards, not the overlong shaping; each data-parallel
rank decides alone (no collective per round over the batch mesh), and the ranks of ONE
data-parallel rank decide the same rounds because they hold the same exchanged rollouts and
score them with the same function of text and problem.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from titan_spec.rl.step_records import DynamicSampling, RolloutBatch
from titan_spec.rl.worker import RolloutStats

__all__ = ["GroupSelection", "dynamic_sample", "has_spread", "select_groups"]


def has_spread(rewards_PaG: torch.Tensor) -> torch.Tensor:
    """[Pa] bool: True where a group's rewards are not all equal (its advantages are not all 0)."""
    return rewards_PaG.amax(dim=1) != rewards_PaG.amin(dim=1)


@dataclass(frozen=True)
class GroupSelection:
    """Which of the N groups generated so far make the step's batch."""

    groups: list[int]
    """The chosen groups' indices into the N, ascending (generation order), P of them."""
    dropped: int
    """Groups whose rewards were all equal and that are not in the batch."""
    topped_up: int
    """Groups whose rewards were all equal that ARE in the batch (the top-up): dropped +
    topped_up is every group without spread generated."""


def select_groups(rewards_PaG: torch.Tensor, share: int, final: bool) -> GroupSelection | None:
    """The rule: the first ``share`` groups of ``rewards_PaG`` (in generation order) whose
    rewards are not all equal. When fewer have spread: None if another round may still
    follow, else (``final``) all of them topped up with the earliest groups without spread.
    Deterministic: a function of the rewards alone."""
    if rewards_PaG.shape[0] < share:
        raise ValueError(f"{rewards_PaG.shape[0]} groups generated, fewer than the batch's {share}")
    spread_Pa = has_spread(rewards_PaG)
    spread = torch.nonzero(spread_Pa).flatten().tolist()
    flat = torch.nonzero(~spread_Pa).flatten().tolist()
    if len(spread) >= share:
        # The last round's surplus groups with spread are left out too (not counted).
        return GroupSelection(spread[:share], len(flat), 0)
    if not final:
        return None
    fill = flat[: share - len(spread)]
    return GroupSelection(sorted(spread + fill), len(flat) - len(fill), len(fill))


def _sequential(stats: list[RolloutStats]) -> RolloutStats:
    """Engine calls run one after another: everything adds up, seconds included."""
    return RolloutStats(
        sum(s.tokens for s in stats),
        sum(s.verify_steps for s in stats),
        sum(s.seconds for s in stats),
        sum(s.drafted_tokens for s in stats),
        sum(s.rounds for s in stats),
    )


def dynamic_sample(
    first: RolloutBatch,
    rewards_PG: torch.Tensor,
    generate: Callable[[], RolloutBatch],
    score: Callable[[RolloutBatch], torch.Tensor],
    extra_rounds: int,
) -> tuple[RolloutBatch, torch.Tensor]:
    """The step's batch and its task rewards [P, G] after dynamic sampling: ``first`` (the
    step's usual round, scored ``rewards_PG``) and, while ``select_groups`` wants more, up to
    ``extra_rounds`` batches of ``generate()`` (the next problems) scored by ``score``.

    The returned batch holds the kept groups' problems and rollouts in generation order;
    its ``stats`` are every round's engine calls added up (the step's real generation cost:
    rollout/tokens, time/rollout_s), its baselines the first round's (they measure speed on
    the step's usual prompts), ``dynamic`` what was done."""
    share, G = rewards_PG.shape
    batches, rewards = [first], [rewards_PG]
    selection = select_groups(rewards_PG, share, final=extra_rounds == 0)
    while selection is None:
        batches.append(generate())
        rewards.append(score(batches[-1]))
        selection = select_groups(torch.cat(rewards), share, final=len(batches) == 1 + extra_rounds)
    problems = [p for b in batches for p in b.problems]
    rollouts = [r for b in batches for r in b.rollouts]
    kept = RolloutBatch(
        [problems[i] for i in selection.groups],
        [rollouts[i * G + j] for i in selection.groups for j in range(G)],
        _sequential([b.stats for b in batches]),
        first.baselines,
        first.policy_version,
        first.push_s,
        dynamic=DynamicSampling(len(batches), selection.dropped, selection.topped_up, len(problems)),
    )
    return kept, torch.cat(rewards)[selection.groups]
