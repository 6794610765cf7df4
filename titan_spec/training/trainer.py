"""The SFT / offline-draft trainer: torchtitan's ``Trainer`` with titan_spec's seams.

``SpecTrainer`` subclasses torchtitan's ``Trainer`` rather than composing its parts: the
parent wires the mesh, FSDP2/compile/AC, optimizers, LR schedules, DCP checkpointer, metrics
and the loop as a torchtitan user expects, and each capability titan_spec adds enters at one
of the parent's hooks (``post_dataloading_process``, ``forward_backward_step``,
``_forward_backward_body``, ``pp_forward_backward_step``, ``state_dict``). Its config,
``SpecTrainer.Config``, is torchtitan's ``Trainer.Config`` with titan_spec's sections
(built by preflight/trainer_config.py).

Invariant: every training forward goes through ``co_train_forward_backward`` (ONE forward;
training/co_training.py: policy loss + lambda * draft loss) and every update through
``joint_step`` (training/joint_step.py: the guarded policy step, the draft's, both
schedules), which torchtitan's SFT ``train_step`` reaches under the names ``optimizers`` and
``lr_schedulers``. The SFT step's files and calls: docs/ARCHITECTURE.md; the RL step
(titan_spec/rl/step.py) has its own ``train_step`` over the same pieces.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

import titan_spec  # noqa: F401  (CPU shims before torchtitan)
import torch
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from titan_spec import platform
from titan_spec.training.co_training import CoTrainingLoss, LossTerms
from titan_spec.config import RunMode, mode_of
from titan_spec.config.schema import (
    DraftConfig,
    JobConfig,
    ModelConfig,
    RLConfig,
    RolloutConfig,
    SpeculativeConfig,
    TaskConfig,
)
from titan_spec.training.draft import DraftTraining, initial_draft, under_dump_folder
from titan_spec.training.finite import fault, global_grad_norm, inject_nan_grad
from titan_spec.training.joint_step import JointStep, TorchtitanCalls
from titan_spec.models.attention import DocCausalAttention
from titan_spec.models.hf_io import load_hf_into, save_hf
from titan_spec.parallelisms.cp_batch import shard_batch
from titan_spec.parallelisms.pipeline import PipelineRun, pipeline_forward_backward
from titan_spec.training.regenerate import Regenerator

__all__ = ["SpecTrainer"]


class SpecTrainer(Trainer):
    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        job: JobConfig = field(default_factory=JobConfig)
        """[job]: what the run exports and which runs come first (config/schema.py)."""

        model: ModelConfig = field(default_factory=ModelConfig)
        """[model]: the policy/target (its flavor or HF checkpoint)."""

        task: TaskConfig = field(default_factory=TaskConfig)
        """[task]: the problems and their reward."""

        draft: DraftConfig = field(default_factory=DraftConfig)
        """[draft]: the draft (EAGLE-3 or DFlash) and its training."""

        speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
        """[speculative]: speculative decoding in rollouts."""

        rollout: RolloutConfig = field(default_factory=RolloutConfig)
        """[rollout]: the rollout engine."""

        rl: RLConfig = field(default_factory=RLConfig)
        """[rl]: GRPO post-training."""

        arch: Any = None
        """The target's resolved architecture (titan_spec.models.registry.Arch)."""

        draft_arch: Any = None
        """The draft's architecture (its draft kind's arch, titan_spec.models.draft), None without a draft."""

        @property
        def mode(self) -> RunMode:
            """What the run trains and serves (config/mode.py)."""
            return mode_of(self)

        def to_dict(self) -> dict[str, Any]:
            # The parent logs and saves this.
            out = Trainer.Config.to_dict(self)
            out["metrics"].pop("step_metrics", None)  # the trainer's method, not configuration
            for name in ("arch", "draft_arch"):
                value = getattr(self, name)
                out[name] = dataclasses.asdict(value) if value is not None else None
            return out

    def __init__(self, config: Config):
        # torchtitan builds the metrics processor; this trainer's step metrics join its every log.
        config = dataclasses.replace(
            config, metrics=dataclasses.replace(config.metrics, step_metrics=self.step_metrics)
        )
        super().__init__(config)
        platform.init_like_unsharded(self.model_parts, self.model_config, config.debug.seed)
        if torch.distributed.get_rank() == 0:
            self.tokenizer.save(config.dump_folder)
        if config.model.hf_checkpoint:
            # A resumed run restores its own weights over these in train() (checkpointer.load).
            for part in self.model_parts:
                load_hf_into(part, config.model.hf_checkpoint, config.arch, stage=self.parallel_dims.pp_enabled)
            logger.info(f"Loaded HF weights from {config.model.hf_checkpoint}")
        if config.draft.data == "regenerated":
            self.dataloader.use_regenerator(
                Regenerator(config.model.hf_checkpoint, self.tokenizer.stop_ids, config.training.seq_len, self.device)
            )
        # Under PP the draft lives on the last stage only; the TapChannel brings it the taps.
        # The schedule's loss (parallelisms/pipeline.py PipelineLoss), kept by the pipelining_fn.
        self.pp_loss = config.model_spec.pipelining_fn.loss if self.parallel_dims.pp_enabled else None
        self.mode = config.mode
        """What the run trains and serves (config/mode.py), read once."""
        on_draft_stage = not self.parallel_dims.pp_enabled or self.pp_has_last_stage
        trains_draft_here = self.mode.trains_draft and on_draft_stage
        keep = self.keeps_starting_draft and self.mode.has_draft
        start = self._starting_draft() if keep or trains_draft_here else None
        self.starting_draft: torch.nn.Module | None = start if keep else None
        """The draft before training (unsharded), kept where ``keeps_starting_draft``."""
        self.draft_training = (
            self._build_draft_training(copy.deepcopy(start) if keep else start) if trains_draft_here else None
        )
        self.co_loss = CoTrainingLoss(
            self.draft_training, config.draft.loss_weight, trains_policy=self.mode.trains != "draft"
        )
        # The joint update (training/joint_step.py) over torchtitan's containers of the policy.
        self.joint_step = JointStep(
            self.optimizers,
            self.lr_schedulers,
            self.draft_training,
            max_consecutive_skips=config.training.max_consecutive_skips,
            last_good=self._last_good,
        )
        # torchtitan's train_step (SFT) clips, then calls self.optimizers.step() and
        # self.lr_schedulers.step() without arguments: under those names, the joint step's two
        # functions (the checkpointer keeps torchtitan's containers, so their state keys).
        calls = TorchtitanCalls(self.joint_step, lambda: (self.step, self._step_loss, self._pre_clip_norm))
        self.optimizers, self.lr_schedulers = calls.optimizers, calls.schedules
        self._fb_calls = 0
        self._step_loss: torch.Tensor | None = None
        self._pre_clip_norm: torch.Tensor | None = None  # SFT: the guard's norm (torchtitan's clip keeps its own)
        self._cp_sums = torch.zeros(2, dtype=torch.float64)  # CP: this shard's [loss sum, valid tokens]
        self._metrics_trimmed = False

    keeps_starting_draft = False
    """Whether the trainer keeps the draft before training (RL: its rollout engines start from it)."""

    def _starting_draft(self) -> torch.nn.Module:
        """The draft before training, built once (training/draft.py initial_draft)."""
        cfg = self.config
        counts = None
        if not cfg.draft.init_from and self.config.draft_arch.draft_vocab_size < self.config.arch.vocab_size:
            # The draft vocabulary: the most frequent targets of the first batches.
            counts = self.dataloader.token_counts(cfg.draft.vocab_count_batches, self.config.arch.vocab_size)
        return initial_draft(
            cfg.draft, self.config.draft_arch, counts, self.config.debug.seed or 0, cfg.model.hf_checkpoint or None
        )

    def _build_draft_training(self, start: torch.nn.Module) -> DraftTraining:
        pd = self.parallel_dims
        if self.mode.trains == "draft":
            # Offline draft training: the policy is a frozen teacher.
            for part in self.model_parts:
                part.requires_grad_(False)
        dp_mesh = pd.get_optional_mesh("fsdp") if pd.dp_shard_enabled or pd.cp_enabled else None
        return DraftTraining(
            self.config.draft,
            self.config.draft_arch,
            device=self.device,
            dp_mesh=dp_mesh,
            lr_scheduler_cfg=self.config.lr_scheduler,
            training_steps=self.config.training.steps,
            start=start,
            max_consecutive_skips=self.config.training.max_consecutive_skips,
        )

    def train_step(self, data_iterator):
        self.begin_step()
        self.begin_update()  # torchtitan's step is one optimizer step
        super().train_step(data_iterator)

    def begin_step(self) -> None:
        """What every step does first (SFT here, RL in its own train_step)."""
        if not self._metrics_trimmed:
            # The first step of this process (after any checkpoint load): rows of later
            # steps come from an interrupted earlier attempt and are written again now.
            self.metrics_processor.trim(self.step - 1)  # train() has already counted this step
            self._metrics_trimmed = True
        self._cp_sums.zero_()

    def begin_update(self) -> None:
        """Before the gradients of one optimizer step accumulate."""
        if self.draft_training is not None:
            self.draft_training.zero_grad()
        self._fb_calls, self._step_loss = 0, None

    # --- the finiteness guard (titan_spec/training/finite.py) ----------------------------------------

    def forward_backward_step(self, *, input_dict, labels, global_valid_tokens):
        loss = super().forward_backward_step(
            input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens
        )
        last = self._fb_calls + 1 == self.gradient_accumulation_steps
        loss = self.account_loss(loss, global_valid_tokens, last=last)
        if last:
            # torchtitan's train_step clips next and keeps the norm it returns, so the guard
            # gets its own reduction of the global pre-clip norm (RL's update passes clip's).
            params = [p for m in self.model_parts for p in m.parameters()]
            self._pre_clip_norm = global_grad_norm(params, self.device, self.parallel_dims.get_optional_mesh("pp"))
        return loss

    def account_loss(self, loss: torch.Tensor, global_valid_tokens, *, last: bool) -> torch.Tensor:
        """The guard's bookkeeping after one forward/backward: the step's loss so far
        (``_step_loss``). Returns the loss to log (0 in place of a non-finite one)."""
        loss = loss.detach()
        self._step_loss = loss.clone() if self._step_loss is None else self._step_loss + loss
        if self.parallel_dims.cp_enabled:
            self._cp_sums[0] += float(loss.sum()) * float(global_valid_tokens)
        self._fb_calls += 1
        if last and fault("nan_grad_policy", self.step) and torch.distributed.get_rank() == 0:
            inject_nan_grad([p for m in self.model_parts for p in m.parameters()])  # the test hook (finite.py)
        # A non-finite loss means the step is skipped; torchtitan's own post-step "Loss is not
        # finite" stop would then end the run although the weights are intact: it sees 0 and
        # the log the true value (step_metrics). torch.where: no host sync per microbatch.
        return torch.where(torch.isfinite(loss), loss, torch.zeros_like(loss))

    def _last_good(self) -> str:
        """The last good checkpoint, for the message a stopped run ends with."""
        return self.checkpointer.last_good() if self.checkpointer.enable else "none (checkpoint.enable = false)"

    def _forward_backward_body(self, inputs, labels, global_valid_tokens, extra_kwargs):
        if self.draft_training is None:  # the policy alone: torchtitan's own step
            return super()._forward_backward_body(inputs, labels, global_valid_tokens, extra_kwargs)
        return self.co_train_forward_backward(
            inputs, labels, global_valid_tokens, extra_kwargs, self.loss_fn
        ).policy.detach()

    def co_train_forward_backward(self, inputs, labels, global_valid_tokens, extra_kwargs, policy_loss) -> LossTerms:
        """ONE forward of the policy; ``policy_loss`` (co_training.PolicyLoss) from its
        logits and, with a draft, the draft's loss from its detached taps and logits;
        policy + lambda * draft is backpropagated. Without a trainable policy (offline draft
        training) the forward runs without autograd."""
        with self.train_context():
            with contextlib.nullcontext() if self.co_loss.trains_policy else torch.no_grad():
                out = self.model_parts[0](inputs, **extra_kwargs)
            logits, taps = out if isinstance(out, tuple) else (out, None)
            terms = self.co_loss(
                policy_loss,
                logits,
                taps,
                labels,
                global_valid_tokens,
                positions_BL=extra_kwargs.get("positions"),
                attention_meta=extra_kwargs.get("attention_masks"),
            )
            terms.total.backward()
        return terms

    def pp_forward_backward_step(self, *, input_dict_mbs, label_mbs, global_valid_tokens):
        # Each microbatch's loss on the last stage is policy + lambda * draft (pipeline.py).
        return pipeline_forward_backward(
            self.pipeline_run(), self.prepare_microbatches(input_dict_mbs, label_mbs), global_valid_tokens
        )

    def pipeline_run(self) -> PipelineRun:
        """What one pipelined forward/backward needs of this trainer (parallelisms/pipeline.py)."""
        return PipelineRun(
            self.pp_schedule,
            self.pp_loss,
            self.pp_has_first_stage,
            self.pp_has_last_stage,
            self.device,
            self.train_context,
            self.co_loss if self.draft_training is not None else None,
        )

    def prepare_microbatches(self, input_dict_mbs, label_mbs) -> list[tuple]:
        """Each microbatch's (inputs, labels, extra kwargs) after post_dataloading_process."""
        return [self.post_dataloading_process(d, labels) for d, labels in zip(input_dict_mbs, label_mbs, strict=True)]

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        # ntokens_seen is this rank's count (summed over ranks when logged), and under context
        # parallelism the ranks' zigzag shards hold different numbers of real tokens. DCP keeps
        # ONE copy of a plain value that every rank saves under the same key, so each rank's
        # count goes under its own key.
        sd[_ntokens_key()] = sd.pop("ntokens_seen")
        sd["guard"] = self.joint_step.guard.state_dict()
        if self.draft_training is not None:
            sd["draft"] = self.draft_training.state_dict()
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        state_dict["ntokens_seen"] = state_dict.pop(_ntokens_key())
        super().load_state_dict(state_dict)
        self.joint_step.guard.load_state_dict(state_dict["guard"])
        if self.draft_training is not None and "draft" in state_dict:
            self.draft_training.load_state_dict(state_dict["draft"])

    def train(self):
        super().train()
        self.export()
        if torch.distributed.get_rank() == 0:
            # run_train.sh skips a finished run that a later config requires (job.requires).
            with open(os.path.join(self.config.dump_folder, "DONE"), "w") as f:
                f.write(f"{self.step}\n")

    def export(self) -> None:
        """End-of-run exports: the policy as an HF checkpoint, the draft for SGLang."""
        job, draft = self.config.job, self.config.draft
        if job.export_hf:
            path = under_dump_folder(self.config.dump_folder, job.export_hf)
            for part in self.model_parts:
                save_hf(part, path, self.config.arch, tokenizer=self.tokenizer)
            logger.info(f"Exported the policy (HF format) to {path}")
        if self.draft_training is not None and draft.export_dir:
            path = under_dump_folder(self.config.dump_folder, draft.export_dir)
            # One writer: the first rank of the last stage (all its other mesh coordinates 0).
            self.draft_training.export(path, write=self.metrics_processor.is_writer())
            logger.info(f"Exported the draft ({draft.kind}) to {path}")

    def _cp_max_loss(self) -> float:
        """max_loss under context parallelism: the largest mean loss of one data-parallel
        rank's batch, its CP shards pooled (torchtitan divides each shard's loss by the
        token count of the whole unsharded batch, which understates it)."""
        sums = self._cp_sums.to(self.device)
        dist = torch.distributed
        dist.all_reduce(sums, group=self.parallel_dims.get_mesh("cp").get_group())
        mean = (sums[0] / sums[1].clamp(min=1)).reshape(1)
        if self.parallel_dims.dp_enabled:
            dist.all_reduce(mean, op=dist.ReduceOp.MAX, group=self.parallel_dims.get_mesh("batch").get_group())
        return float(mean)

    def step_metrics(self) -> dict[str, float]:
        """The logged step's metrics besides torchtitan's (metrics.py; collective: every rank
        calls it): ``loss`` / ``max_loss`` where torchtitan's reductions are not the step's
        (a skipped non-finite step: torchtitan was shown 0; CP's max loss), the guard's
        skips, the draft's loss and accuracies."""
        out = {}
        if not self.joint_step.loss_was_finite:
            out["loss"] = out["max_loss"] = float("nan")
        elif self.parallel_dims.cp_enabled:
            out["max_loss"] = self._cp_max_loss()
        out["skipped_steps"] = self.joint_step.guard.skipped
        if self.draft_training is None:
            return out
        out.update(self.draft_training.metrics())
        if self.parallel_dims.pp_enabled:  # taps of the last step, counted by microbatch tag
            out["pp/taps_delivered"] = self.pp_loss.channel.received
        return out

    def post_dataloading_process(self, input_dict, labels):
        if self.parallel_dims.cp_enabled:
            # Zigzag-shard for the ring (parallelisms/cp_batch.py), not torch's CP input split.
            inputs, labels, extra = shard_batch(input_dict, labels, self.parallel_dims.get_mesh("cp"))
            self.ntokens_seen += extra["attention_masks"].num_real_rows()
            self._cp_sums[1] += float((labels != IGNORE_INDEX).sum())  # this shard's targets (max_loss)
            return inputs, labels, extra
        inputs, labels, extra = super().post_dataloading_process(input_dict, labels)
        attn = self.model_config.first_attention
        if isinstance(attn.inner_attention, DocCausalAttention.Config) and "positions" in extra:
            extra["attention_masks"] = self.model_parts[0].get_attention_masks(extra["positions"])
        return inputs, labels, extra


def _ntokens_key() -> str:
    return f"ntokens_seen_rank_{torch.distributed.get_rank()}"
