"""One RL step: GRPO on the policy and the draft co-trained from ONE forward.

``RLTrainer.train_step`` is the step, top to bottom:

  1 push       the trainer's full weights to this rank's engine, versioned by the
               optimizer steps they have seen (rl/rollouts.py)
  2 generate   this rank's prompts of the step (deterministic in seed, step and rank),
               G completions each, speculative, with behaviour log-probs; at intervals
               the same prompts through the frozen draft and without speculation
  3 score      rewards (exact match)
  4 advantages group-relative (rl/grpo.py)
  5 pack       prompt+completion documents into rl.minibatches packed minibatches carrying
               labels, behaviour log-probs and advantages (data/packing.py)
  6 update     for each of rl.ppo_epochs x rl.minibatches: ONE forward; PPO-clip loss
               (importance ratio against the behaviour log-probs) + lambda * the draft's
               loss from the same forward's detached taps and logits (co_training.py);
               backward; clip; the guarded optimizer steps of the policy and the draft
  7 schedule   the LR schedules of both, once per RL step
  8 metrics    reward, PPO stats, acceptance length, tokens/s, time split (StepRecord)

How it uses torchtitan: ``Trainer.train`` runs the loop (steps, checkpoints through
titan_spec/checkpoint.py, profiler, GC) and calls this ``train_step`` once per step; the
mesh, FSDP2, compile, activation checkpointing, the optimizers and LR schedulers, the
gradient clipping (``dist_utils.clip_grad_norm_``), the loss reductions and the
MetricsProcessor are torchtitan's. The data iterator it passes is not used: an RL step
makes its own batch. What passes between the phases is typed (rl/records.py).

Shape legend: B = packed rows, L = row length, P = prompts, G = group size.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.distributed import utils as dist_utils
from torchtitan.tools.logging import logger

from titan_spec.data.packing import Document, pack_documents
from titan_spec.data.tasks import exact_match_reward
from titan_spec.draft_training import initial_draft
from titan_spec.models.registry import build_target_config
from titan_spec.rl.grpo import PPOPolicyLoss, group_advantages, token_logprobs
from titan_spec.rl.records import Minibatch, RolloutBatch, StepRecord, UpdateStats
from titan_spec.rl.report import write_report
from titan_spec.rl.rollouts import RolloutWorker, full_policy_state
from titan_spec.rollout.base import SamplingParams
from titan_spec.trainer import SpecTrainer

__all__ = ["RLTrainer"]

DEGENERATE_WARN_STEPS = 5
"""Steps in a row in which every group's rewards are identical (all advantages 0, so the
policy gradient is 0: nothing is learned) before a warning, repeated every as many steps."""


class RLTrainer(SpecTrainer):
    """GRPO with online draft co-training (``[rl] enable = true``)."""

    @dataclass(kw_only=True, slots=True)
    class Config(SpecTrainer.Config):
        pass  # the same fields; its build() makes an RLTrainer

    def __init__(self, config):
        super().__init__(config)
        spec = config.spec
        self.rl = spec.rl
        draft = None
        if spec.mode.has_draft:
            # The draft as it was before RL: the rollout engines start from it and the
            # frozen-draft baseline keeps it (rebuilt identically on resume).
            counts = None
            if not spec.draft.init_from:
                counts = self.dataloader.token_counts(spec.draft.vocab_count_batches, config.arch.vocab_size)
            draft = initial_draft(spec.draft, config.draft_arch, counts, config.debug.seed or 0)
        self.worker = RolloutWorker(spec, config.arch, self.device, draft)
        self.worker.resume_hint = self._resume_hint
        self._degenerate_steps = 0
        self.reference = self._build_reference() if self.rl.kl_beta > 0 else None
        self.last_step: StepRecord | None = None
        """The latest step's record (its metrics are logged from it)."""

    def _build_reference(self) -> torch.nn.Module:
        """A frozen full copy of the initial policy for the KL term (built before any resume)."""
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
        t0 = time.perf_counter()
        batch = self.generate(self.push_weights())
        rewards_PG = self.score(batch)
        advantages_PG = group_advantages(rewards_PG, rl.scale_advantages)
        minibatches = self.pack(batch, advantages_PG)
        record = StepRecord(batch, rewards_PG, rollout_done=time.perf_counter())
        # torchtitan's throughput account (its batch generator keeps it for a data
        # iterator): the rollouts are this step's data loading.
        self.metrics_processor.data_loading_times.append(record.rollout_done - t0)
        self.metrics_processor.ntokens_since_last_log += sum(mb.labels_BL.numel() for mb in minibatches)
        for _ in range(rl.ppo_epochs):
            for mb in minibatches:
                record.updates.append(self.update(mb))
        self.lr_schedulers.step()  # the policy's and the draft's schedules, once per RL step
        record.train_s = time.perf_counter() - record.rollout_done
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
        return policy_state, draft_state

    def _policy_version(self) -> int:
        """Optimizer steps the weights have seen before this step: (step - 1) RL steps of
        rl.ppo_epochs x rl.minibatches updates each."""
        return (self.step - 1) * self.rl.ppo_epochs * self.rl.minibatches

    def generate(self, push_s: float) -> RolloutBatch:
        """2: this rank's prompts of the step, G completions each (and the baselines)."""
        tok, rl = self.tokenizer, self.rl
        step_index = self.dataloader.batch_index
        problems = self.dataloader.next_problems(rl.prompts_per_step)
        prompts = [tok.encode(p.prompt, add_bos=True) for p in problems for _ in range(rl.group_size)]
        sampling = SamplingParams(
            temperature=rl.temperature, max_new_tokens=rl.max_new_tokens, stop_token_ids=(tok.eos_id,),
            seed=(self.config.spec.task.seed * 1_000_003 + step_index) * 4096 + self.dataloader.dp_rank,
        )
        rollouts, stats = self.worker.generate(prompts, sampling)
        baselines = {}
        if rl.baseline_interval and (self.step == 1 or self.step % rl.baseline_interval == 0):
            baselines = self.worker.baselines(prompts, sampling)
        return RolloutBatch(problems, rollouts, stats, baselines, self._policy_version(), push_s)

    def score(self, batch: RolloutBatch) -> torch.Tensor:
        """3: rewards_PG of the batch's completions."""
        G, tok = self.rl.group_size, self.tokenizer
        rewards = [exact_match_reward(tok.decode(r.output_ids), batch.problems[i // G].answer)
                   for i, r in enumerate(batch.rollouts)]
        rewards_PG = torch.tensor(rewards, dtype=torch.float32).view(len(batch.problems), G)
        self._warn_if_degenerate(rewards_PG)
        return rewards_PG

    def pack(self, batch: RolloutBatch, advantages_PG: torch.Tensor) -> list[Minibatch]:
        """5: prompt+completion documents, in rollout order, split into rl.minibatches equal
        shares, each packed into rows of training.seq_len."""
        adv = advantages_PG.reshape(-1).tolist()
        docs = [
            Document(r.prompt_ids + r.output_ids, loss_from=len(r.prompt_ids),
                     values={"behaviour_logp": r.logprobs, "advantages": [a] * len(r.output_ids)})
            for r, a in zip(batch.rollouts, adv)
        ]
        n = len(docs) // self.rl.minibatches  # config validation: it divides
        out = []
        for i in range(self.rl.minibatches):
            try:
                packed, _ = pack_documents(docs[i * n:(i + 1) * n], None, self.config.training.seq_len, self.tokenizer.pad_id)
            except ValueError as e:
                raise ValueError(f"{e}: raise training.seq_len or lower rl.max_new_tokens") from None
            out.append(Minibatch(
                {"input": packed.input_BL, "positions": packed.positions_BL}, packed.labels_BL,
                packed.values_BL["behaviour_logp"], packed.values_BL["advantages"],
            ))
        return out

    def update(self, mb: Minibatch) -> UpdateStats:
        """6: one forward/backward of a minibatch and the optimizer steps of both models."""
        self.optimizers.zero_grad(set_to_none=self.config.training.disable_cuda_graphs)
        self.begin_update()
        dev = self.device
        local_valid_tokens = (mb.labels_BL != IGNORE_INDEX).sum()
        global_valid_tokens = local_valid_tokens.to(dev)
        if self.parallel_dims.dp_enabled:
            global_valid_tokens = dist_utils.dist_sum_tensor(global_valid_tokens, self.parallel_dims.get_mesh("batch"))
        inputs, labels, extra = self.post_dataloading_process(
            {k: v.to(dev) for k, v in mb.inputs.items()}, mb.labels_BL.to(dev)
        )
        policy_loss = self.policy_loss(mb, inputs, labels, extra)
        terms = self.co_train_forward_backward(inputs, labels, global_valid_tokens, extra, policy_loss)
        loss = self.account_loss(terms.policy, global_valid_tokens, last=True)
        grad_norm = dist_utils.clip_grad_norm_(
            [p for m in self.model_parts for p in m.parameters()], self.config.training.max_norm, foreach=True,
            pp_mesh=self.parallel_dims.get_optional_mesh("pp"), ep_enabled=self.parallel_dims.ep_enabled,
        )
        self.checkpointer.maybe_wait_for_staging()
        self.optimizers.step()  # guarded: the policy's step (or skip), then the draft's
        n = float((labels != IGNORE_INDEX).sum())
        stats = terms.policy_stats
        return UpdateStats(
            loss=loss, local_valid_tokens=local_valid_tokens, global_valid_tokens=global_valid_tokens,
            grad_norm=grad_norm, policy_tokens=n, clip_fraction=float(stats.clip_fraction), kl=float(stats.kl),
            ratio_dev=float(stats.ratio_dev),
        )

    def policy_loss(self, mb: Minibatch, inputs, labels_BL, extra_kwargs) -> PPOPolicyLoss:
        """The minibatch's PPO-clip loss; with rl.kl_beta > 0 it carries the frozen
        reference's log-probs of the same tokens (one no-grad forward)."""
        ref_logp_BL = None
        if self.reference is not None:
            with self.train_context(), torch.no_grad():
                ref_logp_BL = token_logprobs(self.reference(inputs, **extra_kwargs), labels_BL, self.rl.temperature)
        dev = labels_BL.device
        return PPOPolicyLoss(mb.behaviour_logp_BL.to(dev), mb.advantages_BL.to(dev), self.rl, ref_logp_BL)

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
        the step's updates; extra_metrics adds the RL metrics of ``record``."""
        pd = self.parallel_dims
        losses, max_losses = [], []
        for u in record.updates:
            if pd.dp_cp_enabled:
                mesh = pd.get_optional_mesh("loss")
                # Each rank's loss is its sum / the global token count: the global mean is
                # the sum over ranks; the largest rank mean rescales by its own count.
                losses.append(dist_utils.dist_sum(u.loss, mesh))
                max_losses.append(dist_utils.dist_max(u.loss * u.global_valid_tokens / u.local_valid_tokens.to(u.loss.device), mesh))
            else:
                losses.append(float(u.loss.item()))
                max_losses.append(losses[-1])
        ntokens = self.ntokens_seen
        if pd.dp_cp_enabled:
            ntokens = dist_utils.dist_sum(torch.tensor(ntokens, dtype=torch.int64, device=self.device),
                                          pd.get_optional_mesh("loss"))
        grad_norm = sum(float(u.grad_norm.item()) for u in record.updates) / len(record.updates)
        self.metrics_processor.log(
            self.step, sum(losses) / len(losses), max(max_losses), grad_norm,
            extra_metrics={"n_tokens_seen": ntokens, **lr_metrics},
        )

    def extra_metrics(self) -> dict[str, float]:
        out = super().extra_metrics()
        record = self.last_step
        if record is None:
            return out
        b, names = record.batch, ("frozen", "nospec")
        stats = b.stats
        # Summed over the data-parallel ranks (token-weighted PPO stats: means over all
        # ranks' completion tokens) ...
        sums = {
            "reward": float(record.rewards_PG.sum()), "completions": len(b.rollouts),
            "stopped": sum(r.finish_reason == "stop" for r in b.rollouts),
            "tokens": stats.tokens, "verify": stats.verify_steps,
            "policy_tokens": sum(u.policy_tokens for u in record.updates),
            "clip": sum(u.policy_tokens * u.clip_fraction for u in record.updates),
            "kl": sum(u.policy_tokens * u.kl for u in record.updates),
        }
        for n in names:
            base = b.baselines.get(n)
            sums[f"{n}_tokens"], sums[f"{n}_verify"] = (base.tokens, base.verify_steps) if base is not None else (0, 0)
        # ... and the slowest rank's seconds.
        maxes = {"rollout": stats.seconds, "push": b.push_s, "train": record.train_s,
                 **{n: b.baselines[n].seconds if n in b.baselines else 0.0 for n in names}}
        sums, maxes = self._reduce(sums, dist.ReduceOp.SUM), self._reduce(maxes, dist.ReduceOp.MAX)
        tokens, ppo_tokens = sums["tokens"], max(sums["policy_tokens"], 1.0)
        out.update({
            "rl/reward": sums["reward"] / sums["completions"],
            "rl/stop_fraction": sums["stopped"] / sums["completions"],
            "rl/clip_fraction": sums["clip"] / ppo_tokens,
            "rl/kl": sums["kl"] / ppo_tokens,
            "rl/policy_version": b.policy_version,
            "rollout/tokens": tokens,
            "rollout/accept_len": tokens / max(sums["verify"], 1),
            "rollout/tokens_per_s": tokens / max(maxes["rollout"], 1e-9),
            "time/push_s": maxes["push"],
            "time/rollout_s": maxes["rollout"],
            "time/train_s": maxes["train"],
            "time/step_s": maxes["push"] + maxes["rollout"] + maxes["train"],
        })
        if len(record.updates) > 1:
            out["rl/updates"] = len(record.updates)
        if "frozen" in b.baselines:
            out["rollout/accept_len_frozen"] = sums["frozen_tokens"] / max(sums["frozen_verify"], 1)
            out["rollout/tokens_per_s_frozen"] = sums["frozen_tokens"] / max(maxes["frozen"], 1e-9)
        if "nospec" in b.baselines:
            out["rollout/tokens_per_s_nospec"] = sums["nospec_tokens"] / max(maxes["nospec"], 1e-9)
            out["time/rollout_s_nospec"] = maxes["nospec"]
        return out

    def _reduce(self, values: dict[str, float], op) -> dict[str, float]:
        """``values`` reduced over the data-parallel ranks (float64, one collective)."""
        t = torch.tensor(list(values.values()), dtype=torch.float64)
        if self.parallel_dims.dp_enabled:
            dist.all_reduce(t, op=op, group=self.parallel_dims.get_mesh("batch").get_group())
        return dict(zip(values, t.tolist()))

    def train(self):
        super().train()
        self.worker.close()
        if dist.get_rank() == 0:
            summary = write_report(self.config.dump_folder)
            logger.info(f"RL summary\n{summary}")
