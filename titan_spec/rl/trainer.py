"""The RL step of DESIGN.md: GRPO on the policy and the draft co-trained from ONE forward.

``RLTrainer`` is ``SpecTrainer`` with its data source swapped for rollouts; the rest is
torchtitan's own step, so clipping, the optimizer, the LR schedule, DCP checkpoints and
metrics behave as in any torchtitan run. One step:

  _rollout_batches          1 gather the trainer's weights, push them to this rank's engine
   (torchtitan pulls a         (version = optimizer steps taken)
    batch from it)          2 this rank's prompts of the step (deterministic in seed and step)
                            3 G completions per prompt, speculative, with behaviour log-probs
                            4 rewards -> group advantages -> one packed batch of prompt+completion
                              documents (labels, behaviour log-probs, advantages on completions)
  _forward_backward_body    5 ONE forward: PPO-clip loss from the logits; the draft's TTT loss
                              from the same forward's detached taps and logits; backward of
                              policy + lambda * draft
  torchtitan train_step     6 clip, optimizer step (the draft steps in its post-hook), LR step
  extra_metrics             7 reward, PPO stats, acceptance length, tokens/s, time split and,
                              at intervals, the frozen-draft and no-speculation baselines

Shape legend: B = packed rows, L = row length, V = vocab, P = prompts, G = group size.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.tools.logging import logger

from titan_spec.draft_training import DraftTraining, initial_draft
from titan_spec.models.registry import build_target_config
from titan_spec.models.draft import DraftLossResult
from titan_spec.rl.grpo import PolicyLossOutput, group_advantages, ppo_clip_loss
from titan_spec.data.packing import Document, pack_documents
from titan_spec.rollout.base import SamplingParams
from titan_spec.rl.rollouts import RolloutStats, RolloutWorker, full_policy_state
from titan_spec.data.tasks import exact_match_reward
from titan_spec.trainer import SpecTrainer

__all__ = ["RLTrainer", "CoTrainingLoss", "co_training_loss", "token_logprobs"]

_VALUES = ("behaviour_logp", "advantages")
DEGENERATE_WARN_STEPS = 5
"""Steps in a row in which every group's rewards are identical (all advantages 0, so the
policy gradient is 0: nothing is learned) before a warning, repeated every as many steps."""


def token_logprobs(logits_BLV: torch.Tensor, labels_BL: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / T) at each label (0 where the label is ignored)."""
    logits_BLV = logits_BLV.float() / temperature
    picked_BL = logits_BLV.gather(-1, labels_BL.clamp(min=0)[..., None])[..., 0]
    return (picked_BL - logits_BLV.logsumexp(-1)).masked_fill(labels_BL == IGNORE_INDEX, 0.0)


@dataclass
class CoTrainingLoss:
    total: torch.Tensor
    """policy loss + lambda * draft loss: the one tensor that is backpropagated."""
    policy: PolicyLossOutput
    draft: DraftLossResult | None


def co_training_loss(
    logits_BLV: torch.Tensor,
    taps,
    labels_BL: torch.Tensor,
    behaviour_logp_BL: torch.Tensor,
    advantages_BL: torch.Tensor,
    global_tokens: torch.Tensor,
    rl_cfg,
    *,
    draft_training: DraftTraining | None = None,
    draft_weight: float = 1.0,
    positions_BL: torch.Tensor | None = None,
    attention_masks=None,
    ref_logp_BL: torch.Tensor | None = None,
) -> CoTrainingLoss:
    """The RL objective of one forward. The policy loss reads the logits; the draft loss reads
    the detached taps and detached logits (DraftTraining.loss), so each loss's gradient
    reaches only its own model."""
    mask_T = (labels_BL != IGNORE_INDEX).reshape(-1)
    policy = ppo_clip_loss(
        token_logprobs(logits_BLV, labels_BL, rl_cfg.temperature).reshape(-1),
        behaviour_logp_BL.reshape(-1), advantages_BL.reshape(-1), mask_T, global_tokens,
        clip_low=rl_cfg.clip_low, clip_high=rl_cfg.clip_high,
        ref_logp_T=None if ref_logp_BL is None else ref_logp_BL.reshape(-1), kl_beta=rl_cfg.kl_beta,
    )
    total, draft = policy.loss, None
    if draft_training is not None:
        draft = draft_training.loss(logits_BLV, taps, positions_BL, labels_BL, attention_masks)
        total = total + draft_weight * draft.loss
    return CoTrainingLoss(total, policy, draft)


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
        if spec.draft.enable:
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
        self._rl: dict[str, Any] = {}
        self._values: dict[str, torch.Tensor] = {}

    def _resume_hint(self) -> str:
        last = self.checkpointer.last_verified
        if last is None:
            return "no verified checkpoint exists yet: a rerun starts from the beginning"
        return f"its last verified checkpoint is {last}: rerun the same command to resume from it"

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

    def _build_draft_training(self):
        # A frozen-draft run (draft.co_train = false) serves rollouts with the draft but never trains it.
        return super()._build_draft_training() if self.config.spec.draft.co_train else None

    def _build_reference(self) -> torch.nn.Module:
        """A frozen full copy of the initial policy for the KL term (built before any resume)."""
        with torch.device(self.device):
            ref = build_target_config(self.config.arch).build()
        ref.load_state_dict(full_policy_state(self.model_parts))
        return ref.eval().requires_grad_(False)

    # --- 1-4: rollouts as the data source ---------------------------------------------------

    def batch_generator(self, data_iterable):
        # torchtitan's generator does the token and data-time accounting around ours.
        return super().batch_generator(self._rollout_batches())

    def _rollout_batches(self):
        tok, rl = self.tokenizer, self.rl
        while True:
            t0 = time.perf_counter()
            version = self.step - 1  # optimizer steps taken before this step
            policy_state = full_policy_state(self.model_parts)
            draft_state = self.draft_training.full_state_dict() if self.draft_training is not None else None
            self.worker.push(policy_state, draft_state, version)
            del policy_state, draft_state
            t_push = time.perf_counter()

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

            rewards = [exact_match_reward(tok.decode(r.output_ids), problems[i // rl.group_size].answer)
                       for i, r in enumerate(rollouts)]
            rewards_PG = torch.tensor(rewards, dtype=torch.float32).view(len(problems), rl.group_size)
            self._warn_if_degenerate(rewards_PG)
            adv = group_advantages(rewards_PG, rl.scale_advantages).reshape(-1).tolist()
            docs = [
                Document(r.prompt_ids + r.output_ids, loss_from=len(r.prompt_ids),
                         values={"behaviour_logp": r.logprobs, "advantages": [a] * len(r.output_ids)})
                for r, a in zip(rollouts, adv)
            ]
            try:
                packed, _ = pack_documents(docs, None, self.config.training.seq_len, tok.pad_id)
            except ValueError as e:
                raise ValueError(f"{e}: raise training.seq_len or lower rl.max_new_tokens") from None
            self._rl = {
                "reward_sum": float(rewards_PG.sum()), "completions": len(rollouts), "rollout": stats,
                "baselines": baselines, "push_s": t_push - t0,
                "batch_ready": time.perf_counter(), "policy_version": version,
                "stopped": sum(r.finish_reason == "stop" for r in rollouts),
            }
            yield {
                "input": packed.input_BL, "positions": packed.positions_BL,
                **{k: packed.values_BL[k] for k in _VALUES},
            }, packed.labels_BL

    def post_dataloading_process(self, input_dict, labels):
        # Behaviour log-probs and advantages are loss inputs, not model kwargs.
        self._values = {k: input_dict.pop(k) for k in _VALUES}
        return super().post_dataloading_process(input_dict, labels)

    # --- 5: one forward, two losses ---------------------------------------------------------

    def _forward_backward_body(self, inputs, labels, global_valid_tokens, extra_kwargs):
        spec = self.config.spec
        with self.train_context():
            out = self.model_parts[0](inputs, **extra_kwargs)
            logits, taps = out if isinstance(out, tuple) else (out, None)
            ref_logp = None
            if self.reference is not None:
                with torch.no_grad():
                    ref_logp = token_logprobs(self.reference(inputs, **extra_kwargs), labels, self.rl.temperature)
            loss = co_training_loss(
                logits, taps, labels, self._values["behaviour_logp"], self._values["advantages"],
                global_valid_tokens, self.rl, draft_training=self.draft_training,
                draft_weight=spec.draft.loss_weight, positions_BL=extra_kwargs.get("positions"),
                attention_masks=extra_kwargs.get("attention_masks"), ref_logp_BL=ref_logp,
            )
            loss.total.backward()
        # Token-weighted, so the logged means are over all ranks' completion tokens.
        n = float((labels != IGNORE_INDEX).sum())
        self._rl.update(policy_tokens=n, clip_sum=n * float(loss.policy.clip_fraction), kl_sum=n * float(loss.policy.kl))
        return loss.policy.loss.detach()

    # --- 7: metrics -------------------------------------------------------------------------

    def extra_metrics(self) -> dict[str, float]:
        out = super().extra_metrics()
        s = self._rl
        if not s:
            return out
        train_s = time.perf_counter() - s["batch_ready"]
        stats: RolloutStats = s["rollout"]
        names = ("frozen", "nospec")
        sums = [s["reward_sum"], s["completions"], s["stopped"], stats.tokens, stats.verify_steps,
                s.get("policy_tokens", 0.0), s.get("clip_sum", 0.0), s.get("kl_sum", 0.0)]
        for n in names:
            b = s["baselines"].get(n)
            sums += [b.tokens, b.verify_steps] if b is not None else [0, 0]
        maxes = [stats.seconds, s["push_s"], train_s] + [
            s["baselines"][n].seconds if n in s["baselines"] else 0.0 for n in names
        ]
        sums_t, maxes_t = torch.tensor(sums, dtype=torch.float64), torch.tensor(maxes, dtype=torch.float64)
        if self.parallel_dims.dp_enabled:
            group = self.parallel_dims.get_mesh("batch").get_group()
            dist.all_reduce(sums_t, group=group)
            dist.all_reduce(maxes_t, op=dist.ReduceOp.MAX, group=group)
        (reward, n, stopped, tokens, verify, policy_tokens, clip_sum, kl_sum, f_tok, f_ver, n_tok, n_ver) = sums_t.tolist()
        rollout_s, push_s, train_s, f_s, n_s = maxes_t.tolist()
        out.update({
            "rl/reward": reward / n,
            "rl/stop_fraction": stopped / n,
            "rl/clip_fraction": clip_sum / max(policy_tokens, 1.0),
            "rl/kl": kl_sum / max(policy_tokens, 1.0),
            "rl/policy_version": s["policy_version"],
            "rollout/tokens": tokens,
            "rollout/accept_len": tokens / max(verify, 1),
            "rollout/tokens_per_s": tokens / max(rollout_s, 1e-9),
            "time/push_s": push_s,
            "time/rollout_s": rollout_s,
            "time/train_s": train_s,
            "time/step_s": push_s + rollout_s + train_s,
        })
        if s["baselines"]:
            if "frozen" in s["baselines"]:
                out["rollout/accept_len_frozen"] = f_tok / max(f_ver, 1)
                out["rollout/tokens_per_s_frozen"] = f_tok / max(f_s, 1e-9)
            if "nospec" in s["baselines"]:
                out["rollout/tokens_per_s_nospec"] = n_tok / max(n_s, 1e-9)
                out["time/rollout_s_nospec"] = n_s
        self._rl = {}
        return out

    def train(self):
        super().train()
        self.worker.close()
        if dist.get_rank() == 0:
            from titan_spec.rl.report import write_report

            summary = write_report(self.config.dump_folder)
            logger.info(f"RL summary\n{summary}")
