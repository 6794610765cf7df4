"""The warm start's own completions, for offline draft training (``draft.data = "regenerated"``).

A draft is trained to predict its target, so EAGLE-3 and SpecForge train it on responses the
target itself generated for the training prompts rather than on the dataset's answers: the
draft learns what the policy says. ``Regenerator`` does that inside the run: the task
dataloader (data/loader.py) hands it the prompts of a batch and packs what it returns. The
policy is the run's warm start (model.hf_checkpoint), decoded greedily by the built-in
engine without a draft (its most likely completion of each prompt; deterministic, so a
resumed run packs the same batches), to <eos> or the row length. Completions are memoized
by prompt: a task that repeats prompts decodes each once.

The engine holds its own plain copy of the warm start, read from model.hf_checkpoint, not the
trainer's model: that one may be FSDP/TP-sharded DTensors inside the training graph, and a
tiny one-process copy costs less than gathering it. Every rank decodes the global batch's
prompts, as every rank packs the global batch. For a
real model, regenerate offline with a serving engine and train from the result
(task.name = "dataset").
"""

from __future__ import annotations

import torch

from titan_spec.rollout import SamplingParams, BuiltinEngineConfig, BuiltinRolloutEngine

__all__ = ["Regenerator"]


class Regenerator:
    """prompt ids -> the policy's greedy completion ids (ending with the stop token when it
    stopped; the tokenizer's ``stop_ids``)."""

    def __init__(self, hf_dir: str, stop_ids: tuple[int, ...], row_len: int, device: torch.device | str = "cpu"):
        self.engine = BuiltinRolloutEngine.from_pretrained(
            hf_dir, None, BuiltinEngineConfig(num_draft_tokens=0), max_seq_len=row_len, device=device
        )
        self.stop_ids, self.row_len = tuple(stop_ids), row_len
        self.memo: dict[tuple[int, ...], list[int]] = {}

    def __call__(self, prompts: list[list[int]]) -> list[list[int]]:
        todo = sorted({tuple(p) for p in prompts if tuple(p) not in self.memo})
        # One generate call per completion budget (a batch shares max_new_tokens).
        by_budget: dict[int, list[tuple[int, ...]]] = {}
        for p in todo:
            by_budget.setdefault(self.row_len - len(p), []).append(p)
        for budget, group in by_budget.items():
            if budget < 1:
                raise ValueError(
                    f"a prompt of {self.row_len - budget} tokens leaves no room for a completion "
                    f"in rows of training.seq_len = {self.row_len}"
                )
            sp = SamplingParams(temperature=0.0, max_new_tokens=budget, stop_token_ids=self.stop_ids)
            for p, r in zip(group, self.engine.generate([list(p) for p in group], sp)):
                self.memo[p] = list(r.output_ids)
        return [self.memo[tuple(p)] for p in prompts]
