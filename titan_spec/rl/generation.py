"""Phase 2 of the RL step: this rank's rollouts of each step, synchronous or queued.

``RolloutGeneration`` (one per trainer) draws a step's problems, prompts and seeds from the
dataloader (``plan_generation``, always in the trainer's thread: the dataloader's state is
the trainer's), runs them through this rank's engine (``run_generation``: the ranks of one
data-parallel rank each generate a share and exchange them, rl/sharing.py) and, with
rl.async_steps = N, keeps the batches of the next N steps in a RolloutQueue
(rl/rollout_queue.py), each job pushing the weights it was queued with.

Invariant: the synchronous and the queued path make the same engine calls with the same
prompts, seeds and batch shapes; only when the weights are pushed differs. The queue's
finished batches are a checkpoint's ``rollout_queue_rank_<rank>`` value (``queue_state``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from titan_spec.rl.baselines import is_baseline_step
from titan_spec.rl.rollout_queue import RolloutQueue, batch_from_state, batch_to_state
from titan_spec.rl.sharing import share_work
from titan_spec.rl.step_records import Generation, RolloutBatch
from titan_spec.rl.worker import RolloutStats, RolloutWorker
from titan_spec.rollout.base import SamplingParams

__all__ = ["RolloutGeneration"]

Weights = tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]
"""The policy's and the draft's full tensors by plain name (the draft's None without one)."""


class RolloutGeneration:
    """This rank's generation of every step's batch (and the baselines), through ``worker``."""

    def __init__(
        self,
        rl,
        task_seed: int,
        tokenizer,
        dataloader,
        worker: RolloutWorker,
        generation_group: dist.ProcessGroup | None,
    ):
        self.rl, self.task_seed, self.tokenizer = rl, task_seed, tokenizer
        self.dataloader, self.worker = dataloader, worker
        self.generation_group = generation_group
        """The ranks that hold this rank's data-parallel rank (its CP ranks), which share each
        step's generation (rl/sharing.py ``same_data_group``); None when it is alone."""
        self.queue = RolloutQueue(rl.async_steps) if rl.async_steps else None
        """rl.async_steps: the batches generated ahead (rl/rollout_queue.py); None: synchronous."""

    def generate(self, step: int, version: int, push_s: float, first: bool = True) -> RolloutBatch:
        """This rank's data-parallel share of step ``step``'s prompts, G completions each (and
        the baselines), from the weights just pushed (``version``, in ``push_s`` seconds).
        ``first`` = False: a further round of rl.dynamic_sampling (the dataloader's next
        problems, whose index gives its own seeds; never the baselines, which measure the
        step's first round)."""
        return self.run_generation(self.plan_generation(step, first), push_s, version)

    def plan_generation(self, step: int, first: bool = True) -> Generation:
        """What step ``step`` generates: the dataloader's next problems (its state moves
        here, in the trainer's thread), their prompts, seeds and whether it is a baseline step."""
        rl = self.rl
        index = self.dataloader.batch_index
        problems = self.dataloader.next_problems(rl.prompts_per_step)
        prompts = [self.dataloader.prompt_ids(p) for p in problems for _ in range(rl.group_size)]
        baselines = first and is_baseline_step(step, rl.baseline_interval)
        return Generation(step, index, problems, prompts, (self.task_seed * 1_000_003 + index) * 4096, baselines)

    def run_generation(self, plan: Generation, push_s: float, version: int) -> RolloutBatch:
        """``plan`` through this rank's engine, which holds weights ``version``. The ranks that
        hold the same data-parallel rank (its CP ranks) each generate a share of those
        completions and exchange them (rl/sharing.py), so each ends with all of them: one
        call of ``rollout_share`` per rank."""
        n = 1 if self.generation_group is None else dist.get_world_size(self.generation_group)

        def work(share: list[list[int]], k: int):
            # Share k of data-parallel rank d is generation rank d * n + k: a dp = D x cp = C
            # run's calls are a dp = D * C run's (the same prompts, seed and batch shape).
            return self.rollout_share(
                share, plan.seed_base + self.dataloader.dp_rank * n + k, plan.baselines, plan.step
            )

        shares = share_work(plan.prompts, work, self.generation_group)
        rollouts = [r for share in shares for r in share[0]]
        stats = RolloutStats.combined([share[1] for share in shares])
        base = {name: RolloutStats.combined([share[2][name] for share in shares]) for name in shares[0][2]}
        return RolloutBatch(plan.problems, rollouts, stats, base, version, push_s, problem_index=plan.problem_index)

    def queued_generate(
        self, step: int, version: int, full_weights: Callable[[], Weights]
    ) -> tuple[RolloutBatch, float]:
        """Asynchronous (rl.async_steps = N; rl/rollout_queue.py): the trainer's weights now
        (after step t-1, ``version``) are gathered (``full_weights``, collective) and copied,
        and the generation of step t+N is queued on them (at step 1 or after a resume without
        saved batches, those of steps t .. t+N); then this step's batch, generated by the
        weights after step t-1-N, is taken from the queue. Returns it and the seconds all
        this took."""
        t0 = time.perf_counter()
        policy_state, draft_state = full_weights()
        # Copies: the job pushes them later, while the optimizer updates the tensors in place.
        policy_state = {n: t.detach().clone() for n, t in policy_state.items()}
        draft_state = None if draft_state is None else {n: t.detach().clone() for n, t in draft_state.items()}
        for offset in range(len(self.queue), self.rl.async_steps + 1):
            plan = self.plan_generation(step + offset)
            self.queue.submit(lambda plan=plan: self._pushed_generation(plan, policy_state, draft_state, version))
        batch = self.queue.next()
        return batch, time.perf_counter() - t0

    def _pushed_generation(self, plan: Generation, policy_state, draft_state, version: int) -> RolloutBatch:
        """A queued job (the generation thread): push the weights, generate."""
        t0 = time.perf_counter()
        self.worker.push(policy_state, draft_state, version)
        return self.run_generation(plan, time.perf_counter() - t0, version)

    def rollout_share(self, prompts: list[list[int]], seed: int, baselines: bool, step: int):
        """One rank's share of step ``step``'s generation: (rollouts, stats, baseline stats)."""
        rl, tok = self.rl, self.tokenizer
        sampling = SamplingParams(
            temperature=rl.temperature, max_new_tokens=rl.max_new_tokens, stop_token_ids=tuple(tok.stop_ids), seed=seed
        )
        if baselines:  # the step's call with the baselines around it (rl/baselines.py)
            return self.worker.baselines.run(step, prompts, sampling, self.worker.generate)
        return (*self.worker.generate(prompts, sampling), {})

    # --- the queue's checkpoint state ------------------------------------------------------

    def queue_state(self) -> str | None:
        """The queued batches, finished (waits for the jobs in flight, which move the engines'
        estimates), as JSON; None when synchronous."""
        if self.queue is None:
            return None
        return json.dumps([batch_to_state(b) for b in self.queue.state()])

    def restore_queue(self, saved: str) -> None:
        """The batches ``queue_state`` saved back in the queue, their problems drawn again
        from the dataloader; nothing when synchronous."""
        if self.queue is None:
            return
        n = self.rl.prompts_per_step
        self.queue.restore(
            [batch_from_state(b, self.dataloader.problems_at(b["problem_index"], n)) for b in json.loads(saved)]
        )

    def close(self) -> None:
        """Drops the batches of steps after the last (they are not trained on)."""
        if self.queue is not None:
            self.queue.close()
