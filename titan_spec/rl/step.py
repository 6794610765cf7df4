"""One RL step: GRPO on the policy and the draft co-trained from ONE forward.

``RLTrainer.train_step`` is the step, top to bottom (docs/ARCHITECTURE.md lists the files
and calls; this is the one telling of what each phase does):

  1 push       the trainer's full weights to this rank's engine, versioned by the
               optimizer steps they have seen (rl/worker.py; under PP gathered over
               the stages, the draft from the last one)
  2 generate   this rank's prompts of the step (deterministic in seed, step and rank),
               G completions each, speculative, with behaviour log-probs; at
               rl.baseline_interval steps the same prompts through the baselines
               (rl/baselines.py); the ranks of one data-parallel rank (its CP ranks, its
               pipeline stages) each generate a share and exchange them (rl/generation.py,
               rl/sharing.py; with rl.async_steps queued ahead, rl/rollout_queue.py)
  3 score      rewards (task.reward from the registry, data/rewards.py); with
               rl.dynamic_sampling, new prompts until every group has spread
  4 advantages group-relative (rl/grpo.py) of the rewards + reward_shaping (DAPO's
               overlong punishment, rl/dapo.py)
  5 pack       prompt+completion documents into rl.minibatches packed minibatches carrying
               labels, behaviour log-probs and advantages (data/packing.py); with
               rl.behaviour_logprobs = "recompute" the trainer's log-probs replace the
               engine's (rl/recompute.py)
  6 update     for each of rl.ppo_epochs x rl.minibatches (under CP: this rank's zigzag
               shard, the per-token values sharded with their tokens; under PP: the
               schedule's microbatches, each with its own policy loss on the last stage,
               _pipelined_forward_backward): ONE forward; the policy loss of kind rl.loss
               (rl/losses.py) + lambda * the draft's loss from the same forward's detached
               taps and logits (training/co_training.py); backward; clip; JointStep.step
               with the clip's norm: the guarded policy step, then the draft's
               (training/joint_step.py)
  7 schedule   JointStep.step_schedules: the LR schedules of both, once per RL step
  8 metrics    reward, PPO stats, acceptance length, tokens/s, time split, from the
               step's StepRecord (rl/step_metrics.py)

torchtitan's ``Trainer.train`` runs the loop and calls this ``train_step`` once per step; the
data iterator it passes is not used: an RL step makes its own batch. What passes between
the phases is typed (rl/step_records.py); shape letters: titan_spec/shapes.py.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.distributed import utils as dist_utils
from torchtitan.tools.logging import logger

from titan_spec.data.packing import Document, pack_documents
from titan_spec.data.rewards import reward_fn, score
from titan_spec.models.registry import build_target_config
from titan_spec.parallelisms.cp_batch import shard_values
from titan_spec.parallelisms.pipeline import broadcast_from_last_stage, gather_over_stages, pipeline_forward_backward
from titan_spec.rl.dapo import overlong_penalty
from titan_spec.rl.drift import DriftMeter
from titan_spec.rl.dynamic_sampling import dynamic_sample
from titan_spec.rl.generation import RolloutGeneration
from titan_spec.rl.grpo import group_advantages
from titan_spec.rl.logprobs import token_logprobs
from titan_spec.rl.losses import POLICY_LOSSES
from titan_spec.rl.recompute import recompute_behaviour
from titan_spec.rl.step_metrics import rl_step_metrics
from titan_spec.rl.step_records import Minibatch, RolloutBatch, StepRecord, UpdateStats
from titan_spec.rl.report import write_report
from titan_spec.rl.sharing import same_data_group
from titan_spec.rl.worker import RolloutWorker, full_policy_state
from titan_spec.training.trainer import SpecTrainer

__all__ = ["RLTrainer"]

DEGENERATE_WARN_STEPS = 5
"""Steps in a row in which every group's rewards are identical (all advantages 0, so the
policy gradient is 0: nothing is learned) before a warning, repeated every as many steps."""


class RLTrainer(SpecTrainer):
    """GRPO with online draft co-training (``[rl] enable = true``)."""

    @dataclass(kw_only=True, slots=True)
    class Config(SpecTrainer.Config):
        pass  # the same fields; its build() makes an RLTrainer

    keeps_starting_draft = True  # its rollout engines start from the draft before RL

    def __init__(self, config):
        super().__init__(config)
        self.rl = config.rl
        # The draft as it was before RL (SpecTrainer's starting draft): the rollout engines
        # start from it and the frozen-draft baseline keeps it (rebuilt identically on resume).
        self.worker = RolloutWorker(
            config,
            config.arch,
            self.device,
            self.starting_draft,
            costs_dir=config.dump_folder,
            resume_hint=self._resume_hint,
        )
        # The ranks of this rank's data-parallel rank (its CP ranks) share each step's
        # generation (rl/sharing.py); collective over the world.
        group = same_data_group(self.dataloader.dp_rank, dist.get_world_size())
        self.generation = RolloutGeneration(
            self.rl, config.task.seed, self.tokenizer, self.dataloader, self.worker, group
        )
        """Phase 2, synchronous or queued (rl/generation.py)."""
        self._degenerate_steps = 0
        self.reward = reward_fn(config.task.reward)
        # The starting policy, for the KL penalty and the drift metrics (rl/drift.py).
        self.reference = self._build_reference() if self.rl.kl_beta > 0 or self.rl.drift_metrics else None
        self.drift = DriftMeter()
        self.last_step: StepRecord | None = None
        """The latest step's record (its metrics are logged from it)."""

    def state_dict(self) -> dict:
        sd = super().state_dict()
        rank = dist.get_rank()
        queued = self.generation.queue_state()  # first: it waits for the jobs in flight
        if queued is not None:
            sd[f"rollout_queue_rank_{rank}"] = queued
        # Each rank's engines carry their own acceptance estimates (their own prompts): one
        # key per rank, as for ntokens_seen (DCP keeps one copy of a plain value per key).
        sd[f"rollout_depth_rank_{rank}"] = json.dumps(self.worker.state_dict())
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        rank = dist.get_rank()
        depth = state_dict.pop(f"rollout_depth_rank_{rank}", None)
        queued = state_dict.pop(f"rollout_queue_rank_{rank}", None)
        super().load_state_dict(state_dict)
        if depth is not None:
            self.worker.load_state_dict(json.loads(depth))
        if queued is not None:
            self.generation.restore_queue(queued)

    def _build_reference(self) -> torch.nn.Module:
        """A frozen full copy of the initial policy for the KL term and the drift metrics
        (built before any resume)."""
        with torch.device(self.device):
            ref = build_target_config(self.config.arch).build()
        ref.load_state_dict(full_policy_state(self.model_parts))
        return ref.eval().requires_grad_(False)

    def _resume_hint(self) -> str:
        last = self.checkpointer.last_verified
        if last is None:
            return "no verified checkpoint exists yet: a rerun starts from the beginning"
        return f"its last verified checkpoint is {last}: rerun the same command to resume from it"

    # --- the step ------------------------------------------------------------------------

    def train_step(self, data_iterator) -> None:
        """ONE RL step (torchtitan's train() calls it once per step; ``data_iterator`` is not
        used: the step makes its own batch)."""
        del data_iterator
        rl = self.rl
        self.begin_step()
        lr_metrics = self.lr_schedulers.get_metrics()  # the LRs this step trains with
        gen, version = self.generation, self._policy_version()
        t0 = time.perf_counter()
        wait_s = None
        if rl.async_steps:  # generated while earlier steps trained (rl/rollout_queue.py)
            batch, wait_s = gen.queued_generate(self.step, version, self.full_weights)
        else:
            batch = gen.generate(self.step, version, self.push_weights())
        rewards_PG = self.score(batch)
        if rl.dynamic_sampling:  # DAPO: rounds of new prompts until every group has spread
            batch, rewards_PG = dynamic_sample(
                batch,
                rewards_PG,
                lambda: gen.generate(self.step, version, 0.0, first=False),
                self.score,
                rl.dynamic_sampling_rounds,
            )
        self._warn_if_degenerate(rewards_PG)  # once a step, on the batch trained on
        shaping_PG = self.reward_shaping(batch)
        advantages_PG = group_advantages(rewards_PG + shaping_PG, rl.scale_advantages)
        minibatches = self.pack(batch, advantages_PG)
        mismatch = recompute_behaviour(self, minibatches) if rl.behaviour_logprobs == "recompute" else None
        record = StepRecord(
            batch,
            rewards_PG,
            shaping_PG if rl.dapo.overlong_buffer > 0 else None,
            rollout_done=time.perf_counter(),
            mismatch=mismatch,
            wait_s=wait_s,
            policy_version=version,
        )
        # torchtitan's throughput account: the rollouts are this step's data loading.
        self.metrics_processor.count_data(record.rollout_done - t0, sum(mb.labels_BL.numel() for mb in minibatches))
        for _ in range(rl.ppo_epochs):
            for mb in minibatches:
                record.updates.append(self.update(mb))
        self.joint_step.step_schedules()  # the policy's and the draft's schedules, once per RL step
        record.train_s = time.perf_counter() - record.rollout_done
        record.drift = self.drift.take()
        self.last_step = record
        if self.metrics_processor.should_log(self.step):
            self.log_step(record, lr_metrics)

    def push_weights(self) -> float:
        """1: the trainer's full weights into this rank's engine (collective under FSDP),
        versioned; returns the seconds it took."""
        t0 = time.perf_counter()
        policy_state, draft_state = self.full_weights()
        self.worker.push(policy_state, draft_state, self._policy_version())
        del policy_state, draft_state
        return time.perf_counter() - t0

    def full_weights(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
        """The policy's and the draft's full tensors by plain name, on every rank (collective:
        every rank calls it); the draft's is None without a trained draft."""
        policy_state = full_policy_state(self.model_parts)
        draft_state = self.draft_training.full_state_dict() if self.draft_training is not None else None
        pd = self.parallel_dims
        if pd.pp_enabled:
            # Each rank holds its stage's part (gathered over its FSDP group just above) and
            # only the last stage's ranks hold the draft: exchange both over the pp group.
            pp_mesh = pd.get_mesh("pp")
            policy_state = gather_over_stages(policy_state, pp_mesh, self.device)
            if self.mode.trains_draft:
                draft_state = broadcast_from_last_stage(draft_state, pp_mesh, self.device)
        return policy_state, draft_state

    def _policy_version(self) -> int:
        """Optimizer steps the weights have seen before this step: (step - 1) RL steps of
        rl.ppo_epochs x rl.minibatches updates each."""
        return (self.step - 1) * self.rl.ppo_epochs * self.rl.minibatches

    def score(self, batch: RolloutBatch) -> torch.Tensor:
        """3: rewards_PG of the batch's completions (no collective: rl.dynamic_sampling scores
        each round, and the data-parallel ranks may run different numbers of rounds)."""
        G, tok = self.rl.group_size, self.tokenizer
        rewards = score(
            self.reward,
            self.config.task.reward,
            [tok.decode(r.output_ids) for r in batch.rollouts],
            [batch.problems[i // G] for i in range(len(batch.rollouts))],
        )
        return torch.tensor(rewards, dtype=torch.float32).view(len(batch.problems), G)

    def pack(self, batch: RolloutBatch, advantages_PG: torch.Tensor) -> list[Minibatch]:
        """5: prompt+completion documents, in rollout order, split into rl.minibatches equal
        shares, each packed into rows of training.seq_len."""
        adv = advantages_PG.reshape(-1).tolist()
        n = len(batch.rollouts) // self.rl.minibatches  # config validation: it divides
        docs = [
            Document(
                r.prompt_ids + r.output_ids,
                loss_from=len(r.prompt_ids),
                values={
                    "behaviour_logp": r.logprobs,
                    "advantages": [a] * len(r.output_ids),
                    # what the loss variants read: the completion (1-based in its minibatch), its truncation
                    "seq_index": [float(i % n + 1)] * len(r.output_ids),
                    "truncated": [float(r.finish_reason == "length")] * len(r.output_ids),
                    "seq_tokens": [float(len(r.output_ids))] * len(r.output_ids),
                },
            )
            for i, (r, a) in enumerate(zip(batch.rollouts, adv))
        ]
        # Under PP the schedule's microbatches have static shapes: a minibatch fills exactly
        # training.local_batch_size rows (empty rows carry no labels).
        rows = self.config.training.local_batch_size if self.parallel_dims.pp_enabled else None
        out = []
        for i in range(self.rl.minibatches):
            share = docs[i * n : (i + 1) * n]
            try:
                packed, used = pack_documents(
                    share, rows, self.config.training.seq_len, self.tokenizer.pad_id, self.dataloader.document_multiple
                )
            except ValueError as e:
                raise ValueError(f"{e}: raise training.seq_len or lower rl.max_new_tokens") from None
            if used < len(share):
                raise ValueError(
                    f"under pipeline parallelism a minibatch is packed into training.local_batch_size = {rows} rows "
                    f"of {self.config.training.seq_len} tokens (the schedule's microbatches), but only {used} of its "
                    f"{len(share)} completions fit: raise training.local_batch_size (a multiple of "
                    "parallelism.pipeline_parallel_microbatch_size), training.seq_len or rl.minibatches"
                )
            out.append(
                Minibatch(
                    {"input": packed.input_BL, "positions": packed.positions_BL}, packed.labels_BL, packed.values_BL
                )
            )
        return out

    def update(self, mb: Minibatch) -> UpdateStats:
        """6: one forward/backward of a minibatch and the optimizer steps of both models.

        Under context parallelism every CP rank holds the whole minibatch of its data-parallel
        rank (generate's exchange) and trains on its zigzag shard of it: the tokens, labels
        and positions through post_dataloading_process, the per-token values with them
        (cp_batch.shard_values); the loss sums the shard's tokens over the global count, so
        the shards' losses and gradients add up to the whole batch's. Under pipeline
        parallelism the minibatch runs through the schedule (``_pipelined_forward_backward``).
        """
        self.optimizers.zero_grad(set_to_none=self.config.training.disable_cuda_graphs)
        self.begin_update()
        pd = self.parallel_dims
        local_valid_tokens = (mb.labels_BL != IGNORE_INDEX).sum()
        # The count of the unsharded minibatch, summed over the data-parallel ranks: the
        # global count (every CP rank / stage of a data-parallel rank holds the same minibatch).
        global_valid_tokens = local_valid_tokens.to(self.device)
        if pd.dp_enabled:
            global_valid_tokens = dist_utils.dist_sum_tensor(global_valid_tokens, pd.get_mesh("batch"))
        fb = self._pipelined_forward_backward if pd.pp_enabled else self._forward_backward
        loss, policy_tokens, stats = fb(mb, global_valid_tokens)
        loss = self.account_loss(loss, global_valid_tokens, last=True)
        # torchtitan's clip returns the global pre-clip norm, also when it is not finite: the guard's input.
        grad_norm = dist_utils.clip_grad_norm_(
            [p for m in self.model_parts for p in m.parameters()],
            self.config.training.max_norm,
            foreach=True,
            pp_mesh=pd.get_optional_mesh("pp"),
            ep_enabled=pd.ep_enabled,
        )
        self.checkpointer.maybe_wait_for_staging()
        # The policy's step (or the guard's skip), then the draft's (training/joint_step.py).
        self.joint_step.step(self.step, self._step_loss, grad_norm)
        return UpdateStats(
            loss=loss,
            local_valid_tokens=local_valid_tokens,
            global_valid_tokens=global_valid_tokens,
            grad_norm=grad_norm,
            policy_tokens=policy_tokens,
            **stats,
        )

    def _forward_backward(self, mb: Minibatch, global_valid_tokens) -> tuple[torch.Tensor, float, dict]:
        """ONE forward of this rank's (shard of the) minibatch, the policy loss + lambda *
        the draft's, backward: (policy loss, this rank's completion tokens, PPO stats)."""
        inputs, labels, extra = self.on_device(mb)
        ref_logp_BL = self.reference_logprobs(inputs, labels, extra)
        values = self.token_values(mb)
        if ref_logp_BL is not None:  # the same forward measures the drift (rl/drift.py)
            self.drift.add(values["behaviour_logp"], ref_logp_BL, labels)
        policy_loss = self.policy_loss(values, self.loss_counts(mb), ref_logp_BL)
        terms = self.co_train_forward_backward(inputs, labels, global_valid_tokens, extra, policy_loss)
        st = terms.policy_stats
        stats = {name: float(getattr(st, name)) for name in UpdateStats.POLICY_STATS}
        return terms.policy, float((labels != IGNORE_INDEX).sum()), stats

    def _pipelined_forward_backward(self, mb: Minibatch, global_valid_tokens) -> tuple[torch.Tensor, float, dict]:
        """Under pipeline parallelism: the minibatch's rows in the schedule's microbatches,
        each with its own policy loss built from ITS rows' values, computed on the last stage
        (parallelisms/pipeline.py PipelineLoss, with the draft's loss on the taps the
        TapChannel brings) and normalized by the whole minibatch's counts, as
        ``_forward_backward`` is; the PPO stats token-weighted over the microbatches (on the
        last stage; empty elsewhere)."""
        counts = self.loss_counts(mb)  # of the whole minibatch: every microbatch's loss uses them
        parts = self.microbatch_rows(mb)
        loss_mbs = [self.policy_loss(self.token_values(mb, p), counts, None) for p in parts]
        run = self.pipeline_run()
        loss = pipeline_forward_backward(run, [self.on_device(mb, p) for p in parts], global_valid_tokens, loss_mbs)
        got = list(run.loss.policy_stats.values())
        n = float(sum(count for _, count in got))
        weighted = lambda name: sum(float(getattr(st, name)) * c for st, c in got) / max(n, 1.0)
        # Fractions and means weighted by the microbatches' tokens, maxima maxed.
        stats = {
            name: (
                max((float(getattr(st, name)) for st, _ in got), default=0.0)
                if name in UpdateStats.MAXIMA
                else weighted(name)
            )
            for name in UpdateStats.POLICY_STATS
        }
        return loss, n, stats

    def on_device(self, mb: Minibatch, rows: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """The minibatch's ``rows`` on the device through post_dataloading_process: (inputs,
        labels, extra kwargs); under context parallelism this rank's zigzag shard of them."""
        return self.post_dataloading_process(
            {k: v[rows].to(self.device) for k, v in mb.inputs.items()}, mb.labels_BL[rows].to(self.device)
        )

    def microbatch_rows(self, mb: Minibatch) -> list[slice]:
        """Under pipeline parallelism: the minibatch's rows of each of the schedule's
        microbatches (parallelism.pipeline_parallel_microbatch_size rows each)."""
        rows = self.config.parallelism.pipeline_parallel_microbatch_size
        return [slice(lo, lo + rows) for lo in range(0, mb.labels_BL.shape[0], rows)]

    def token_values(self, mb: Minibatch, rows: slice = slice(None)) -> dict[str, torch.Tensor]:
        """The per-token values the policy loss reads, of the minibatch's ``rows``, on the
        device; under context parallelism this rank's zigzag shard of them, exactly as
        post_dataloading_process shards the tokens and labels (cp_batch.shard_values)."""
        values = {k: v[rows] for k, v in mb.values_BL.items()}
        if self.parallel_dims.cp_enabled:
            values = shard_values(values, mb.inputs["positions"][rows], self.parallel_dims.get_mesh("cp"))
        return {k: v.to(self.device) for k, v in values.items()}

    def loss_counts(self, mb: Minibatch) -> dict[str, torch.Tensor]:
        """What a loss variant divides by, counted on the WHOLE (unsharded) minibatch and
        summed over the data-parallel ranks, like global_valid_tokens: DAPO's kept completion
        tokens (overlong filtering), GSPO's completions. Shards and microbatches then add up."""
        local = POLICY_LOSSES[self.rl.loss].counts(mb.values_BL, mb.labels_BL != IGNORE_INDEX, self.rl)
        return {name: self._global_sum(n) for name, n in local.items()}

    def reference_logprobs(self, inputs, labels_BL, extra_kwargs) -> torch.Tensor | None:
        """With a reference (rl.kl_beta > 0 or rl.drift_metrics): the frozen starting policy's
        log-probs of the label tokens (one no-grad forward of the same, possibly CP-sharded,
        inputs); else None."""
        if self.reference is None:
            return None
        with self.train_context(), torch.no_grad():
            return token_logprobs(self.reference(inputs, **extra_kwargs), labels_BL, self.rl.temperature)

    def policy_loss(self, values: dict[str, torch.Tensor], counts: dict[str, torch.Tensor], ref_logp_BL):
        """The policy loss of kind rl.loss (rl/losses.py) over ``values`` (token_values);
        ``ref_logp_BL`` adds the KL term."""
        return POLICY_LOSSES[self.rl.loss].from_values(values, counts, self.rl, ref_logp_BL)

    def _global_sum(self, n) -> torch.Tensor:
        """A count summed over the data-parallel ranks (collective under data parallelism)."""
        t = torch.as_tensor(n, dtype=torch.int64, device=self.device)
        if self.parallel_dims.dp_enabled:
            t = dist_utils.dist_sum_tensor(t, self.parallel_dims.get_mesh("batch"))
        return t

    def reward_shaping(self, batch: RolloutBatch) -> torch.Tensor:
        """What is added to the rewards before the advantages (not to the logged reward):
        DAPO's soft overlong punishment with rl.dapo.overlong_buffer > 0 (rl/dapo.py), else 0."""
        rl = self.rl
        lengths_PG = torch.tensor([len(r.output_ids) for r in batch.rollouts]).view(len(batch.problems), rl.group_size)
        return overlong_penalty(lengths_PG, rl.max_new_tokens, rl.dapo.overlong_buffer, rl.dapo.overlong_penalty)

    def _warn_if_degenerate(self, rewards_PG: torch.Tensor) -> None:
        """A logged warning when no group on any rank has two different rewards for
        DEGENERATE_WARN_STEPS steps in a row (collective over the data-parallel ranks)."""
        flat = torch.tensor([float(bool((rewards_PG.amax(1) == rewards_PG.amin(1)).all()))])
        if self.parallel_dims.dp_enabled:
            flat = flat.to(self.device)  # NCCL has no CPU tensors
            dist.all_reduce(flat, op=dist.ReduceOp.MIN, group=self.parallel_dims.get_mesh("batch").get_group())
        self._degenerate_steps = self._degenerate_steps + 1 if bool(flat) else 0
        if self._degenerate_steps and self._degenerate_steps % DEGENERATE_WARN_STEPS == 0:
            logger.warning(
                f"step {self.step}: every group's rewards were identical for {self._degenerate_steps} steps in a row "
                f"(reward {float(rewards_PG.mean()):g}): all advantages are 0 and the policy gradient is zero; "
                "the task may be too hard or too easy for the policy, or the policy has collapsed"
            )

    # --- 8: metrics ------------------------------------------------------------------------

    def log_step(self, record: StepRecord, lr_metrics: dict) -> None:
        """torchtitan's step log (loss, max loss, grad norm, tokens seen, LRs), averaged over
        the step's updates; step_metrics adds the RL metrics of ``record``."""
        # torchtitan's loss reduction is inline in Trainer.train_step (no function to call): the same, per update.
        pd = self.parallel_dims
        losses, max_losses = [], []
        for u in record.updates:
            if pd.dp_cp_enabled:
                mesh = pd.get_optional_mesh("loss")
                # Each rank's loss is its sum / the global token count: the global mean is
                # the sum over ranks; the largest rank mean rescales by its own count.
                losses.append(dist_utils.dist_sum(u.loss, mesh))
                max_losses.append(
                    dist_utils.dist_max(u.loss * u.global_valid_tokens / u.local_valid_tokens.to(u.loss.device), mesh)
                )
            else:
                losses.append(float(u.loss.item()))
                max_losses.append(losses[-1])
        ntokens = self.ntokens_seen
        if pd.dp_cp_enabled:
            ntokens = dist_utils.dist_sum(
                torch.tensor(ntokens, dtype=torch.int64, device=self.device), pd.get_optional_mesh("loss")
            )
        grad_norm = sum(float(u.grad_norm.item()) for u in record.updates) / len(record.updates)
        self.metrics_processor.log(
            self.step,
            sum(losses) / len(losses),
            max(max_losses),
            grad_norm,
            extra_metrics={"n_tokens_seen": ntokens, **lr_metrics},
        )

    def step_metrics(self) -> dict[str, float]:
        """torchtitan's step metrics, the draft's, and the RL step's (rl/step_metrics.py)."""
        out = super().step_metrics()
        if self.last_step is not None:
            out.update(rl_step_metrics(self.last_step, self.config, self.mode, self.parallel_dims))
        return out

    def train(self):
        super().train()
        self.generation.close()  # the batches of steps after the last are not trained on
        self.worker.close()
        if dist.get_rank() == 0:
            summary = write_report(self.config.dump_folder)
            logger.info(f"RL summary\n{summary}")
