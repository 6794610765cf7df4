"""The packed task dataloader for language-model / SFT steps.

It plugs into torchtitan's Trainer through its Configurable contract
(``dataloader.build(dp_rank=..., ...)``).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torchtitan.components.dataloader import BaseDataLoader

from titan_spec.config import TaskConfig
from titan_spec.data.packing import Document, pack_documents
from titan_spec.data.prompts import PromptFormat
from titan_spec.data.tasks import build_task

__all__ = ["TaskDataLoader", "sft_document"]

REGENERATE_CHUNK = 64
"""Prompts decoded together when the batches are regenerated (the last chunk's unused
prompts are dropped: the batches stay a function of (seed, batch index))."""


def sft_document(tok, prompt: str | list[int], answer: str) -> Document:
    """<bos> prompt answer <eos> (a prompt given as ids is used as is: the chat template's),
    trained on the answer and <eos> only."""
    p = tok.encode(prompt, add_bos=True) if isinstance(prompt, str) else list(prompt)
    return Document(tokens=p + tok.encode(answer, add_eos=True), loss_from=len(p))


class TaskDataLoader(BaseDataLoader):
    """Infinite packed SFT batches of the task, deterministic in (seed, batch index).

    Its checkpoint state is the batch index, so a resumed run sees exactly the batches
    the uninterrupted run would have seen.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        task: TaskConfig = field(default_factory=TaskConfig)
        """The task section of the titan_spec config."""

        step_rows: int = 0
        """Rows of one step per data-parallel rank (training.local_batch_size); the loader
        hands them out ``local_batch_size`` rows at a time (pipeline parallelism asks for
        microbatches). 0 = the loader's local_batch_size."""

        document_multiple: int = 1
        """Every packed document is padded to a multiple of this many tokens (the resolved
        task.document_multiple; see data/packing.py)."""

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int,
        dp_rank: int,
        tokenizer,
        seq_len: int,
        local_batch_size: int,
        **_: object,
    ):
        self.task_cfg = config.task
        self.task = build_task(config.task)
        self.tokenizer = tokenizer
        self.prompts = PromptFormat(config.task, tokenizer)
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.rows, self.row_len = local_batch_size, seq_len
        self.step_rows = config.step_rows or local_batch_size
        self.document_multiple = config.document_multiple
        if self.step_rows % self.rows:
            raise ValueError(f"a step's {self.step_rows} rows do not split into batches of {self.rows}")
        self.batch_index = 0
        self._packed = (-1, None)  # the last global batch: its microbatches are consecutive
        self._regenerate = None  # use_regenerator

    def use_regenerator(self, regenerate) -> None:
        """draft.data = "regenerated": ``regenerate(prompt ids) -> the policy's completion ids``,
        which the batches then train on instead of the demonstrations
        (titan_spec/training/regenerate.py)."""
        self._regenerate = regenerate

    def _global_batch(self, index: int):
        # Every rank packs the GLOBAL batch and keeps its own rows: the data of a step does
        # not depend on how it is split, so dp=2 x 4 rows trains on exactly dp=1 x 8 rows.
        rng = random.Random(self.task_cfg.seed * 1_000_003 + index)
        rows = self.step_rows * self.dp_world_size
        docs: list[Document] = []
        budget, total = rows * self.row_len, 0
        while total < budget:
            if self._regenerate is None:
                prob = self.task.sample(rng)
                docs.append(sft_document(self.tokenizer, self.prompt_ids(prob), prob.sft_target))
                total += len(docs[-1].tokens)
                continue
            # Regenerated: a chunk of prompts decoded together, packed until the budget.
            prompts = [self.prompt_ids(self.task.sample(rng)) for _ in range(REGENERATE_CHUNK)]
            for p, completion in zip(prompts, self._regenerate(prompts)):
                if total < budget:
                    docs.append(Document(tokens=list(p) + completion, loss_from=len(p)))
                    total += len(docs[-1].tokens)
        packed, _ = pack_documents(docs, rows, self.row_len, self.tokenizer.pad_id, self.document_multiple)
        return packed

    def _batch(self, index: int):
        # Microbatch k of step g: so pp microbatches of 1 row see the rows of pp = 1.
        g, k = divmod(index, self.step_rows // self.rows)
        if self._packed[0] != g:
            self._packed = (g, self._global_batch(g))
        packed = self._packed[1]
        start = self.dp_rank * self.step_rows + k * self.rows
        mine = slice(start, start + self.rows)
        return {"input": packed.input_BL[mine], "positions": packed.positions_BL[mine]}, packed.labels_BL[mine]

    def prompt_ids(self, problem) -> list[int]:
        """The ids of ``problem``'s prompt as the policy sees it (data/prompts.py): the SFT
        documents' prompts and the RL rollouts' are the same ids."""
        return self.prompts.ids(problem)

    def next_problems(self, count: int) -> list:
        """RL: this rank's share of the ``count`` prompts of the next step, deterministic in
        (task seed, step index) like the packed batches, whatever the number of ranks."""
        self.batch_index += 1
        return self.problems_at(self.batch_index - 1, count)

    def problems_at(self, index: int, count: int) -> list:
        """``next_problems`` at batch index ``index``, without moving the dataloader."""
        rng = random.Random(self.task_cfg.seed * 1_000_003 + index)
        problems = [self.task.sample(rng) for _ in range(count)]
        share = count // self.dp_world_size
        return problems[self.dp_rank * share : (self.dp_rank + 1) * share]

    def token_counts(self, num_batches: int, vocab_size: int) -> torch.Tensor:
        """How often each token is a training target in the first batches (all ranks' rows)."""
        counts = torch.zeros(vocab_size, dtype=torch.long)
        for index in range(num_batches):
            labels = self._global_batch(index).labels_BL
            counts += torch.bincount(labels[labels >= 0], minlength=vocab_size)[:vocab_size]
        return counts

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            batch = self._batch(self.batch_index)
            self.batch_index += 1
            yield batch

    def state_dict(self) -> dict:
        return {f"dp_rank_{self.dp_rank}": self.batch_index, "world_size": self.dp_world_size}

    def load_state_dict(self, state_dict: dict) -> None:
        key = f"dp_rank_{self.dp_rank}"
        if key in state_dict:
            self.batch_index = int(state_dict[key])
