"""The rollout engine protocol shared by every engine (built-in torch, SGLang, ...).

An engine turns prompts (token ids) into completions with behaviour log-probs and
per-request speculative statistics, and takes versioned weight pushes from the trainer.
The trainer only ever talks to this protocol, so adding an engine is one adapter.

    generate(prompts, sampling) -> list[Rollout]     one Rollout per prompt, same order
    update_policy_weights(named_tensors, version)     trainer's full policy state dict
    update_draft_weights(named_tensors, version)      draft state dict (export names)
    close()

Acceptance length = completion tokens / verify steps (SGLang's ``spec_accept_length``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

import torch

__all__ = ["SamplingParams", "Rollout", "RolloutEngine", "NamedTensors", "named_tensor_items"]

NamedTensors = dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


def named_tensor_items(named_tensors: NamedTensors) -> list[tuple[str, torch.Tensor]]:
    """A dict or an iterable of (name, tensor) pairs -> a list of pairs (read once)."""
    if isinstance(named_tensors, dict):
        return list(named_tensors.items())
    return list(named_tensors)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one batch of completions. Invalid values raise ValueError at
    construction, so a bad request never reaches an engine."""

    temperature: float = 1.0
    """Softmax temperature; 0 = greedy (argmax), which is exactly reproducible."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of top tokens with mass >= top_p; in (0, 1]."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 (or -1) keeps all."""
    max_new_tokens: int = 128
    """Completion budget per request (>= 1); finish_reason 'length' when it is reached."""
    stop_token_ids: tuple[int, ...] = ()
    """Generation of a request ends at the first of these; the stop token itself is emitted."""
    seed: int | None = None
    """Seed of the engine's sampling RNG for this call; None = fresh randomness."""

    def __post_init__(self):
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)) or self.temperature < 0:
            raise ValueError(f"temperature = {self.temperature!r} must be a finite number >= 0 (0 = greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p = {self.top_p!r} must be in (0, 1]")
        if int(self.top_k) != self.top_k or self.top_k < -1:
            raise ValueError(f"top_k = {self.top_k!r} must be an integer >= 0 (0 or -1 = no limit)")
        if int(self.max_new_tokens) != self.max_new_tokens or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens = {self.max_new_tokens!r} must be an integer >= 1")
        # Accept a list for convenience; keep the dataclass hashable and immutable.
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids {list(self.stop_token_ids)} must be token ids >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class Rollout:
    """One completion and how it was generated."""

    prompt_ids: list[int]
    output_ids: list[int]
    """Completion tokens, ending with a stop token when finish_reason == 'stop'."""
    logprobs: list[float]
    """Behaviour log-prob of each output token under the target: log_softmax(logits / T)
    (T = 1 for greedy), before top-k/top-p truncation."""
    finish_reason: Literal["stop", "length"]
    verify_steps: int = 0
    """Target forwards that emitted tokens for this request (the prefill counts as one)."""
    accepted_tokens: int = 0
    """Emitted tokens that were drafted and accepted (<= num_draft_tokens * verify_steps)."""
    drafted_tokens: int = 0
    """Draft tokens proposed for this request, over its verify rounds after the prefill:
    K per round, so drafted_tokens / (verify_steps - 1) is its mean depth (adaptive depth
    varies K from round to round; fixed depth gives num_draft_tokens)."""
    policy_version: int = 0
    draft_version: int = 0

    @property
    def acceptance_length(self) -> float:
        """Completion tokens per verify step (1.0 without speculation)."""
        return len(self.output_ids) / max(self.verify_steps, 1)


@runtime_checkable
class RolloutEngine(Protocol):
    """What the RL loop needs from a rollout engine (docs/ARCHITECTURE.md, "Rollout engine protocol")."""

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[Rollout]:
        """One Rollout per prompt, in order. Prompts may differ in length."""
        ...

    def update_policy_weights(self, named_tensors: NamedTensors, version: int) -> None:
        """Load policy weights (the trainer's names, full tensors); later rollouts carry version."""
        ...

    def update_draft_weights(self, named_tensors: NamedTensors, version: int) -> None:
        """Load draft weights (export names: fc.weight, midlayer.*, ..., d2t, t2d)."""
        ...

    def close(self) -> None:
        """Release the models and caches; the engine cannot generate afterwards."""
        ...
