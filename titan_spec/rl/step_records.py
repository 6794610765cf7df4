"""What passes between the phases of one RL step, as typed records (the phases:
titan_spec/rl/step.py): generate gives a ``RolloutBatch``, pack its ``Minibatch`` list,
each update an ``UpdateStats``, and the step's ``StepRecord`` holds them all for the
metrics. The records are plain data: nothing here computes or communicates.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from titan_spec.data.problem import Problem
from titan_spec.rl.worker import RolloutStats
from titan_spec.rollout.base import Rollout

__all__ = ["DynamicSampling", "Generation", "RolloutBatch", "Minibatch", "UpdateStats", "StepRecord"]


@dataclass(frozen=True)
class DynamicSampling:
    """What dynamic sampling did on this rank in one step (rl/dynamic_* metrics)."""

    rounds: int
    """Generation rounds used, the step's usual one included (1 .. 1 + rl.dynamic_sampling_rounds)."""
    dropped: int
    """Groups without reward spread left out of the batch."""
    topped_up: int
    """Groups without reward spread put back to fill the batch (the rounds ran out)."""
    generated: int
    """Groups generated over all rounds."""


@dataclass(frozen=True)
class Generation:
    """What one step generates, drawn in the trainer's thread (rl/generation.py plan_generation)."""

    step: int
    """The RL step the batch is for (its baseline schedule and baseline order)."""
    problem_index: int
    """The dataloader's batch index the problems were drawn at."""
    problems: list[Problem]
    prompts: list[list[int]]
    """len P * G: each problem's prompt ids G times."""
    seed_base: int
    """Seeds of the step's calls: seed_base + the generation rank (rl/generation.py run_generation)."""
    baselines: bool
    """Whether the baselines run too (rl.baseline_interval)."""


@dataclass
class RolloutBatch:
    """One step's rollouts on this rank: P problems x G completions, prompt-major."""

    problems: list[Problem]
    rollouts: list[Rollout]
    """len P * G; rollout i answers problems[i // G]."""
    stats: RolloutStats
    """What the main engine's generate call cost and yielded."""
    baselines: dict[str, RolloutStats]
    """The same prompts through the frozen draft ("frozen") and without speculation
    ("nospec"), at rl.baseline_interval steps; empty otherwise."""
    policy_version: int
    """Optimizer steps the generating weights had seen (the version pushed)."""
    push_s: float
    """Seconds the weight push took."""
    dynamic: DynamicSampling | None = None
    """rl.dynamic_sampling: what it did this step (DynamicSampling above:
    rounds, groups dropped and topped up); None without it."""
    problem_index: int = 0
    """The dataloader's batch index its problems were drawn at (``problems_at``)."""


@dataclass
class Minibatch:
    """One optimizer step's share of the packed rollouts (rl.minibatches per step)."""

    inputs: dict[str, torch.Tensor]
    """Model inputs: "input" token ids and "positions" (document-relative), [B, L]."""
    labels_BL: torch.Tensor
    """Next-token labels on completion tokens, IGNORE_INDEX elsewhere."""
    values_BL: dict[str, torch.Tensor]
    """Per-token values the losses read (rl/objective.py), each [B, L], 0 off the completions:
    "behaviour_logp" (the label token's log-prob under the behaviour policy: the engine's, or
    the trainer's at the step's starting weights, rl/recompute.py), "advantages" (its
    completion's group advantage), "seq_index" (its completion, 1-based within this rank's
    minibatch), "truncated" (1 on a completion cut at rl.max_new_tokens), "seq_tokens" (its
    completion's length) and, with rl.tis, "tis_weight" (rl/mismatch.py)."""


@dataclass
class UpdateStats:
    """One forward/backward + optimizer step of the policy (and the draft)."""

    loss: torch.Tensor
    """The policy loss this rank contributed (sum / global tokens), finite or replaced by 0."""
    local_valid_tokens: torch.Tensor
    global_valid_tokens: torch.Tensor
    grad_norm: torch.Tensor
    """The policy's pre-clip global gradient norm (torchtitan's clip_grad_norm_)."""
    policy_tokens: float
    """This rank's completion tokens in the minibatch."""
    # The policy loss's statistics over this rank's tokens (rl/objective.py PolicyLossOutput).
    clip_fraction: float
    dual_clip_fraction: float
    kl: float
    ratio_dev: float
    logp_diff_mean: float
    logp_diff_max: float
    out_of_band: float

    POLICY_STATS: ClassVar[tuple[str, ...]] = (
        "clip_fraction",
        "dual_clip_fraction",
        "kl",
        "ratio_dev",
        "logp_diff_mean",
        "logp_diff_max",
        "out_of_band",
    )
    """The fields taken from the policy loss's PolicyLossOutput."""
    MAXIMA: ClassVar[tuple[str, ...]] = ("ratio_dev", "logp_diff_max")
    """Those of them that are maxima (the others are per-token means)."""


@dataclass
class StepRecord:
    """One RL step on this rank: the rollouts, every update, the time split."""

    batch: RolloutBatch
    rewards_PG: torch.Tensor
    shaping_PG: torch.Tensor | None = None
    """What was added to the rewards before the advantages (DAPO's soft overlong
    punishment, rl/dapo.py; <= 0), or None when nothing was."""
    updates: list[UpdateStats] = field(default_factory=list)
    rollout_done: float = 0.0
    """perf_counter() when the batch was packed (the training phase starts)."""
    train_s: float = 0.0
    """Seconds of all updates of the step."""
    mismatch: dict[str, float] | None = None
    """rl.behaviour_logprobs = "recompute": this rank's engine/trainer mismatch sums from the
    recompute forward (rl/mismatch.py MismatchSums); None: taken from the first update."""
    drift: dict[str, float] = field(default_factory=dict)
    """Sums of the drift estimates over the step's updates (rl/drift.py; empty without a
    reference policy)."""
    wait_s: float | None = None
    """rl.async_steps: seconds the step spent before its batch was in hand (the weights
    gathered and copied for the next job, then the wait for this step's batch); the batch's
    push and generation overlapped earlier steps. None: the synchronous step."""
    policy_version: int = 0
    """Optimizer steps the trainer's weights had seen when the step began (the batch's
    own ``policy_version`` is the generating weights'; their difference is the staleness)."""
