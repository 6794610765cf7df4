"""Entry point and trainer: ``python -m titan_spec.train --config FILE [--section.key value ...]``.

``SpecTrainer`` SUBCLASSES torchtitan's ``Trainer`` rather than composing its parts:
the parent already wires the mesh, FSDP2/compile/AC, optimizers, LR schedule, DCP
checkpointer, metrics and the train loop exactly as a torchtitan user expects, and
each capability titan_spec adds hooks in at one of the parent's seams:

- ``__init__``: translate the TOML config (``titan_spec.config``) into torchtitan's
  ``Trainer.Config`` (``to_trainer_config``), build the tapped target from a flavor or
  an HF checkpoint, save the tokenizer with the run;
- ``post_dataloading_process``: attach titan_spec's document-attention metadata;
- ``_forward_backward_body``: the ONE training forward; with ``[draft] enable`` its
  detached taps and logits also give the draft's TTT loss (draft_training.py);
- ``pp_forward_backward_step`` (pipeline parallelism): the same per microbatch on the last
  stage, the taps brought by the TapChannel (parallelisms/pipeline.py, tap_channel.py);
- ``forward_backward_step`` / ``optimizers.step`` (wrapped): the finiteness guard
  (titan_spec/finite.py): a step whose policy or draft loss or gradient norm is not finite
  is skipped for that model and counted; the draft's optimizer steps right after the
  policy's (its own clipping, guard and schedule);
- ``post_dataloading_process`` under context parallelism: the packed batch is zigzag-
  sharded over the cp ranks (parallelisms/cp_batch.py);
- ``state_dict``: the draft, its optimizer and schedule join the DCP checkpoint (and each
  rank's token count goes under its own key);
- ``extra_metrics``: the draft's loss and per-step accuracy join the step's metrics;
- ``checkpoint``: torchtitan's DCP checkpointer with an integrity manifest
  (titan_spec/checkpoint.py); metrics.jsonl rows are strict JSON (``_log_jsonl``).

One LM/SFT step: TaskDataLoader -> train_step (torchtitan) -> forward_backward_step
-> post_dataloading_process -> _forward_backward_body (policy loss + lambda * draft
loss) -> optimizers.step (+ DraftTraining.step in its post-hook).

One RL step is the same path with rollouts as the data source: titan_spec/rl/loop.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import titan_spec  # noqa: F401  (CPU shims before torchtitan)
import torch
from torchtitan.components.loss import IGNORE_INDEX, CrossEntropyLoss
from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.tools.logging import init_logger, logger
from torchtitan.trainer import Trainer

from titan_spec import platform
from titan_spec.config import ConfigError, TitanSpecConfig, load_config, quiet_torchtitan
from titan_spec.data import CharTokenizer, TaskDataLoader
from titan_spec.checkpoint import CheckpointCorrupt, VerifiedCheckpointManager
from titan_spec.draft_training import DraftTraining, under_dump_folder
from titan_spec.finite import NonFiniteStop, StepGuard, fault, global_grad_norm, inject_nan_grad
from titan_spec.models.attention import DocCausalAttention
from titan_spec.models.draft import DraftArch
from titan_spec.models.hf_io import check_hf_weights, load_hf_into, read_hf_arch, save_hf
from titan_spec.models.registry import arch_from_hf_config, arch_to_hf_config, build_target_config, flavor_arch, with_vocab
from titan_spec.models.target import default_tap_layer_ids, validate_tap_layer_ids
from titan_spec.parallelisms.pipeline import check_pipeline_config, pipeline_forward_backward, pipeline_spec
from titan_spec.parallelisms.cp_batch import shard_batch, without_torch_cp

__all__ = ["SpecTrainer", "to_trainer_config", "resolve_arch", "validate_run", "plan_runs", "main", "train_and_close"]


@dataclass(frozen=True)
class Made:
    """A directory that an earlier run of the job.requires chain writes, and what it will
    hold: that run's config fixes it (``plan_runs``), so a later run is validated against it
    before anything trains."""

    run: str
    """The config whose run writes it."""
    hf: Any = None
    """Arch of the policy it exports there (job.export_hf), or None."""
    draft: Any = None
    """DraftArch of the draft it exports there (draft.export_dir), or None."""


def _made(made: dict[str, Made] | None, path: str) -> Made | None:
    return (made or {}).get(os.path.abspath(path)) if path else None


def resolve_arch(cfg: TitanSpecConfig, vocab_size: int, made: dict[str, Made] | None = None):
    """The target's architecture: the HF checkpoint's (its safetensors headers checked
    against it), else the flavor sized to the tokenizer. ``made``: directories an earlier
    run writes (their architecture is that run's; there is nothing to read yet)."""
    if cfg.model.hf_checkpoint:
        path, promise = cfg.model.hf_checkpoint, _made(made, cfg.model.hf_checkpoint)
        if promise is not None and promise.hf is None:
            raise ConfigError(f"model.hf_checkpoint {path!r} is where {promise.run} exports its draft, "
                              "not an HF policy checkpoint", key="model.hf_checkpoint")
        try:
            arch = promise.hf if promise is not None else read_hf_arch(path)
        except ValueError as e:
            raise ConfigError(f"model.hf_checkpoint: {e}", key="model.hf_checkpoint") from None
        if arch.family != cfg.model.name:
            raise ConfigError(
                f"model.name = {cfg.model.name!r} but {path} holds a {arch.family} model", key="model.name"
            )
        if arch.vocab_size < vocab_size:
            raise ConfigError(
                f"{path} has a vocabulary of {arch.vocab_size}, smaller than the "
                f"tokenizer's {vocab_size}", key="model.hf_checkpoint"
            )
        if promise is None:
            try:
                check_hf_weights(path, arch)
            except ValueError as e:
                raise ConfigError(f"model.hf_checkpoint: {e}", key="model.hf_checkpoint") from None
        return arch
    arch = flavor_arch(cfg.model.name, cfg.model.flavor)
    return with_vocab(arch, vocab_size) if cfg.model.vocab_from_tokenizer else arch


def tap_ids_for(cfg: TitanSpecConfig, n_layers: int) -> tuple[int, ...]:
    ids = tuple(cfg.draft.tap_layer_ids) or default_tap_layer_ids(n_layers)
    try:
        validate_tap_layer_ids(ids, n_layers)
    except ValueError as e:
        raise ConfigError(f"draft.tap_layer_ids: {e}") from None
    return ids


def draft_arch_for(cfg: TitanSpecConfig, arch, made: dict[str, Made] | None = None) -> DraftArch:
    """The draft for this target; a ``draft.init_from`` directory supplies the draft vocabulary
    size and tap ids that the config leaves unset (0 / empty), and must fit the result
    (dimensions, vocabularies, tap ids, its safetensors' names and shapes)."""
    from titan_spec.models.draft_io import check_draft_weights, draft_mismatches, read_draft_arch

    vocab, taps = cfg.draft.draft_vocab_size, tuple(cfg.draft.tap_layer_ids)
    path, promise, found = cfg.draft.init_from, _made(made, cfg.draft.init_from), None
    if promise is not None:
        if promise.draft is None:
            raise ConfigError(f"draft.init_from {path!r} is where {promise.run} exports its policy, "
                              "not a draft", key="draft.init_from")
        found = promise.draft
    elif path and os.path.isdir(path):
        try:
            found = read_draft_arch(path)
        except ValueError as e:
            raise ConfigError(f"draft.init_from: {e}", key="draft.init_from") from None
    if found is not None:
        vocab, taps = vocab or found.draft_vocab_size, taps or found.tap_layer_ids
    if taps:
        try:
            validate_tap_layer_ids(taps, arch.n_layers)
        except ValueError as e:
            raise ConfigError(f"draft.tap_layer_ids: {e}", key="draft.tap_layer_ids") from None
    d = DraftArch.from_target(arch, taps or tap_ids_for(cfg, arch.n_layers), vocab)
    try:
        d.validate()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if found is not None:
        bad = draft_mismatches(found, d)
        if bad:
            raise ConfigError(f"draft.init_from {path!r} does not fit the target and the [draft] config: "
                              f"{'; '.join(bad)}", key="draft.init_from")
        if promise is None:
            try:
                check_draft_weights(path, d)
            except ValueError as e:
                raise ConfigError(f"draft.init_from: {e}", key="draft.init_from") from None
    return d


def _parallelize(parallelize_fn):
    def parallelize(model, **kwargs):
        if kwargs["parallel_dims"].cp_enabled:  # titan_spec's ring, not torch's CP
            kwargs["parallel_dims"] = without_torch_cp(kwargs["parallel_dims"])
        model = parallelize_fn(model, **kwargs)
        platform.force_sum_reduction(model)
        return model

    return parallelize


def to_trainer_config(cfg: TitanSpecConfig, made: dict[str, Made] | None = None) -> "SpecTrainer.Config":
    """titan_spec's TOML config -> torchtitan's Trainer.Config (the parent's wiring).
    ``made``: input directories an earlier run of the chain writes (see ``Made``)."""
    tok = CharTokenizer()
    arch = resolve_arch(cfg, tok.get_vocab_size(), made)
    # Taps are read only when the draft trains from them; the LM step returns logits.
    draft_arch = draft_arch_for(cfg, arch, made)  # validates tap ids and draft vocab even when unused
    trains_draft = cfg.draft.enable and (cfg.draft.co_train or not cfg.rl.enable)
    taps = draft_arch.tap_layer_ids if trains_draft else ()
    if cfg.training.seq_len > arch.max_seq_len:
        raise ConfigError(
            f"training.seq_len = {cfg.training.seq_len} exceeds the model's maximum of {arch.max_seq_len}",
            key="training.seq_len",
        )
    model_config = build_target_config(arch, tap_layer_ids=taps)
    if arch.family == "qwen3":
        from torchtitan.models.qwen3 import parallelize_qwen3 as parallelize_fn
        from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter as adapter
    else:
        from torchtitan.models.llama3 import parallelize_llama as parallelize_fn
        from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter as adapter
    if cfg.parallelism.pipeline_parallel_degree > 1:
        check_pipeline_config(cfg, model_config, taps)

    spec = ModelSpec(
        name=arch.family,
        flavor="hf" if cfg.model.hf_checkpoint else cfg.model.flavor,
        model=model_config,
        parallelize_fn=_parallelize(parallelize_fn),
        pipelining_fn=pipeline_spec,
        post_optimizer_build_fn=None,
        state_dict_adapter=adapter,
    )
    o = cfg.optimizer
    kwargs: dict[str, Any] = {"lr": o.lr, "weight_decay": o.weight_decay}
    if o.name in ("AdamW", "Adam"):
        kwargs.update(betas=(o.beta1, o.beta2), eps=o.eps)
    ac = {"none": None, "full": FullAC.Config(), "selective": SelectiveAC.Config()}[cfg.activation_checkpoint.mode]
    training = dataclasses.replace(cfg.training)
    if platform.on_cpu():
        # CUDA graphs capture device work; there is none on CPU.
        training.disable_cuda_graphs = True
    trainer_cls = SpecTrainer
    if cfg.rl.enable:
        from titan_spec.rl.loop import RLTrainer as trainer_cls
    with quiet_torchtitan():
        checkpoint = VerifiedCheckpointManager.from_config(cfg.checkpoint)
    return trainer_cls.Config(
        spec=cfg,
        arch=arch,
        draft_arch=draft_arch if cfg.draft.enable else None,
        model_spec=spec,
        hf_assets_path=cfg.model.hf_checkpoint or cfg.job.dump_folder,
        dump_folder=cfg.job.dump_folder,
        profiler=cfg.profiler,
        metrics=cfg.metrics,
        tokenizer=CharTokenizer.Config(),
        dataloader=TaskDataLoader.Config(
            task=cfg.task, step_rows=cfg.training.local_batch_size, document_multiple=cfg.document_multiple()
        ),
        optimizer=OptimizersContainer.Config(
            param_groups=[ParamGroupConfig(pattern=r".*", optimizer_name=o.name, optimizer_kwargs=kwargs)],
            implementation=o.implementation,
        ),
        lr_scheduler=cfg.lr_scheduler,
        training=training,
        parallelism=cfg.parallelism,
        checkpoint=checkpoint,
        activation_checkpoint=ac,
        compile=cfg.compile,
        comm=cfg.comm,
        debug=cfg.debug,
        loss=CrossEntropyLoss.Config(),
    )


class SpecTrainer(Trainer):
    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        spec: TitanSpecConfig = field(default_factory=TitanSpecConfig)
        """The titan_spec config this trainer config was made from (draft, rl, ... sections)."""

        arch: Any = None
        """The target's resolved architecture (titan_spec.models.registry.Arch)."""

        draft_arch: Any = None
        """The draft's architecture (titan_spec.models.draft.DraftArch), None without a draft."""

        def to_dict(self) -> dict[str, Any]:
            # The parent logs and saves this; the nested titan_spec config is plain data.
            out = Trainer.Config.to_dict(self)
            out["spec"] = dataclasses.asdict(self.spec)
            for name in ("arch", "draft_arch"):
                value = getattr(self, name)
                out[name] = dataclasses.asdict(value) if value is not None else None
            return out

    def __init__(self, config: Config):
        super().__init__(config)
        spec = config.spec
        platform.init_like_unsharded(self.model_parts, self.model_config, config.debug.seed)
        if torch.distributed.get_rank() == 0:
            self.tokenizer.save(config.dump_folder)
        self.metrics_processor.log = self._log_jsonl(self.metrics_processor.log)
        if spec.model.hf_checkpoint:
            # A resumed run restores its own weights over these in train() (checkpointer.load).
            for part in self.model_parts:
                load_hf_into(part, spec.model.hf_checkpoint, config.arch)
            logger.info(f"Loaded HF weights from {spec.model.hf_checkpoint}")
        # Under PP the draft lives on the last stage only; the TapChannel brings it the taps.
        on_draft_stage = not self.parallel_dims.pp_enabled or self.pp_has_last_stage
        self.draft_training = self._build_draft_training() if spec.draft.enable and on_draft_stage else None
        if self.draft_training is not None and self.parallel_dims.pp_enabled:
            self.pp_schedule.titan_spec_loss.attach_draft(self.draft_training, spec.draft.loss_weight)
        # torchtitan's train_step calls optimizers.step() right after its clip: the guarded
        # step applies (or skips) the policy's step, then the draft's (its own clipping,
        # guard and schedule), inside train_step, so the step's metrics include both.
        self.guard = StepGuard("policy", config.training.max_consecutive_skips)
        self._policy_step = self.optimizers.step
        self.optimizers.step = self._guarded_step
        self._fb_calls = 0
        self._step_loss: torch.Tensor | None = None
        self._pre_clip_norm: torch.Tensor | None = None
        self._loss_was_finite = True
        self._cp_sums = torch.zeros(2, dtype=torch.float64)  # CP: this shard's [loss sum, valid tokens]
        self._metrics_trimmed = False

    def _build_draft_training(self) -> DraftTraining:
        spec, pd = self.config.spec, self.parallel_dims
        if spec.draft.offline:
            # Offline draft training: the policy is a frozen teacher.
            for part in self.model_parts:
                part.requires_grad_(False)
        dp_mesh = pd.get_optional_mesh("fsdp") if pd.dp_shard_enabled or pd.cp_enabled else None
        counts = None
        if not spec.draft.init_from:
            counts = self.dataloader.token_counts(spec.draft.vocab_count_batches, self.config.arch.vocab_size)
        return DraftTraining(
            spec.draft,
            self.config.draft_arch,
            device=self.device,
            dp_mesh=dp_mesh,
            lr_scheduler_cfg=self.config.lr_scheduler,
            training_steps=self.config.training.steps,
            token_counts_V=counts,
            seed=self.config.debug.seed or 0,
            max_consecutive_skips=self.config.training.max_consecutive_skips,
        )

    def train_step(self, data_iterator):
        if not self._metrics_trimmed:
            # The first step of this process (after any checkpoint load): rows of later
            # steps come from an interrupted earlier attempt and are written again now.
            self._trim_metrics(self.step - 1)  # train() has already counted this step
            self._metrics_trimmed = True
        if self.draft_training is not None:
            self.draft_training.zero_grad()
        self._fb_calls, self._step_loss, self._pre_clip_norm = 0, None, None
        self._cp_sums.zero_()
        super().train_step(data_iterator)

    # --- the finiteness guard (titan_spec/finite.py) ----------------------------------------

    def forward_backward_step(self, *, input_dict, labels, global_valid_tokens):
        loss = super().forward_backward_step(input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens)
        loss = loss.detach()
        self._step_loss = loss.clone() if self._step_loss is None else self._step_loss + loss
        if self.parallel_dims.cp_enabled:
            self._cp_sums[0] += float(loss.sum()) * float(global_valid_tokens)
        self._fb_calls += 1
        if self._fb_calls == self.gradient_accumulation_steps:
            # The gradients of the step are complete: its global pre-clip norm decides, with
            # the loss, whether the optimizer step is applied (torchtitan's clip comes next).
            params = [p for m in self.model_parts for p in m.parameters()]
            if fault("nan_grad_policy", self.step) and torch.distributed.get_rank() == 0:
                inject_nan_grad(params)
            self._pre_clip_norm = global_grad_norm(params, self.device, self.parallel_dims.get_optional_mesh("pp"))
        # A non-finite loss means the step is skipped; torchtitan's own post-step "Loss is not
        # finite" stop would then end the run although the weights are intact: it sees 0 and
        # the log the true value (_log_jsonl). torch.where: no host sync per microbatch.
        return torch.where(torch.isfinite(loss), loss, torch.zeros_like(loss))

    def _guarded_step(self) -> None:
        """optimizers.step() as torchtitan's train_step calls it, after its clip."""
        ok = self.guard.check(self._step_loss, self._pre_clip_norm, torch.distributed.group.WORLD)
        self._loss_was_finite = not self.guard.last_loss_bad
        if ok:
            self._policy_step()
        else:
            self.guard.log_skip(self.step)
            self.optimizers.zero_grad(set_to_none=True)
        if self.draft_training is not None:
            self.draft_training.step(self.step)
        # Stop on every rank together (under PP the draft lives on the last stage only).
        draft_guard = self.draft_training.guard if self.draft_training is not None else None
        limit = self.guard.max_consecutive
        flags = torch.tensor([
            float(self.guard.consecutive >= limit),
            float(draft_guard is not None and draft_guard.consecutive >= limit),
        ], device=self.device)  # on the device: NCCL has no CPU tensors
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
        flags = flags.cpu()
        if flags.any():
            last_good = self.checkpointer.last_good() if self.checkpointer.enable else "none (checkpoint.enable = false)"
            guard = self.guard if flags[0] else (draft_guard or StepGuard("draft", limit))
            raise NonFiniteStop(guard.stop_message(self.step, last_good))

    def _forward_backward_body(self, inputs, labels, global_valid_tokens, extra_kwargs):
        """ONE forward of the policy; its detached taps and logits also train the draft."""
        if self.draft_training is None:
            return super()._forward_backward_body(inputs, labels, global_valid_tokens, extra_kwargs)
        spec = self.config.spec
        frozen = spec.draft.offline
        with self.train_context():
            with torch.no_grad() if frozen else contextlib.nullcontext():
                logits, taps = self.model_parts[0](inputs, **extra_kwargs)
                policy_loss, _ = self.loss_fn(logits, labels, global_valid_tokens)
            draft = self.draft_training.loss(
                logits, taps, extra_kwargs["positions"], labels, extra_kwargs["attention_masks"]
            )
            total = spec.draft.loss_weight * draft.loss
            if not frozen:
                total = total + policy_loss
            total.backward()
        return policy_loss.detach()

    def pp_forward_backward_step(self, *, input_dict_mbs, label_mbs, global_valid_tokens):
        # Each microbatch's loss on the last stage is policy + lambda * draft (pipeline.py).
        return pipeline_forward_backward(self, input_dict_mbs, label_mbs, global_valid_tokens)

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        # ntokens_seen is this rank's count (summed over ranks when logged), and under context
        # parallelism the ranks' zigzag shards hold different numbers of real tokens. DCP keeps
        # ONE copy of a plain value that every rank saves under the same key, so each rank's
        # count goes under its own key.
        sd[_ntokens_key()] = sd.pop("ntokens_seen")
        sd["guard"] = self.guard.state_dict()
        if self.draft_training is not None:
            sd["draft"] = self.draft_training.state_dict()
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        state_dict["ntokens_seen"] = state_dict.pop(_ntokens_key())
        super().load_state_dict(state_dict)
        self.guard.load_state_dict(state_dict["guard"])
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
        job, spec = self.config.spec.job, self.config.spec
        if job.export_hf:
            path = under_dump_folder(self.config.dump_folder, job.export_hf)
            for part in self.model_parts:
                save_hf(part, path, self.config.arch)
            logger.info(f"Exported the policy (HF format) to {path}")
        if self.draft_training is not None and spec.draft.export_dir:
            path = under_dump_folder(self.config.dump_folder, spec.draft.export_dir)
            self.draft_training.export(path)
            logger.info(f"Exported the draft (SGLang LlamaForCausalLMEagle3 format) to {path}")

    def _metrics_writer(self) -> bool:
        # The first rank of the last pipeline stage sees the loss (torchtitan's loss-visible rank).
        pd = self.parallel_dims
        return torch.distributed.get_rank() == (pd.world_size // pd.pp) * (pd.pp - 1)

    def _trim_metrics(self, last_step: int) -> None:
        """Keep the metrics.jsonl rows of steps <= last_step (the steps this run does not
        redo) and drop a torn last line, so a resumed run writes each step's row once."""
        path = os.path.join(self.config.dump_folder, "metrics.jsonl")
        if not self._metrics_writer() or not os.path.exists(path):
            return
        kept = []
        with open(path) as f:
            for line in f:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut by a kill
                if row.get("step", 0) <= last_step:
                    kept.append(json.dumps(row, allow_nan=False) + "\n")
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(kept)
        os.replace(tmp, path)

    def _log_jsonl(self, log):
        """Wrap MetricsProcessor.log to also append full-precision metrics to metrics.jsonl:
        one strict-JSON row per logged step; a non-finite value is written as null and named
        in the row's ``nonfinite`` list."""
        path = os.path.join(self.config.dump_folder, "metrics.jsonl")

        def logged(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
            extra_metrics = {**(extra_metrics or {}), **self.extra_metrics()}
            if not self._loss_was_finite:  # the guard saw a non-finite loss; torchtitan was shown 0
                global_avg_loss = global_max_loss = float("nan")
            elif self.parallel_dims.cp_enabled:
                global_max_loss = self._cp_max_loss()
            log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra_metrics)
            if self._metrics_writer():
                row = {"step": step, "loss": global_avg_loss, "max_loss": global_max_loss, "grad_norm": grad_norm}
                row.update({k: v for k, v in (extra_metrics or {}).items() if isinstance(v, (int, float))})
                bad = [k for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)]
                row.update({k: None for k in bad})
                if bad:
                    row["nonfinite"] = bad
                with open(path, "a") as f:
                    f.write(json.dumps(row, allow_nan=False) + "\n")

        return logged

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

    def extra_metrics(self) -> dict[str, float]:
        """Metrics of the step besides torchtitan's (collective: every rank calls it)."""
        if self.draft_training is None:
            return {"skipped_steps": self.guard.skipped}
        out = {"skipped_steps": self.guard.skipped, **self.draft_training.metrics()}
        if self.parallel_dims.pp_enabled:  # taps of the last step, counted by microbatch tag
            out["pp/taps_delivered"] = self.pp_schedule.titan_spec_loss.channel.received
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


def validate_run(cfg: TitanSpecConfig, made: dict[str, Made] | None = None) -> "SpecTrainer.Config":
    """Everything checkable before a run starts, for a loaded config: its input files
    (HF safetensors headers, the draft directory, the task file) and its architecture
    (tap ids, draft vocab, seq_len, draft dimensions against the target). ``made``: inputs
    an earlier run of the chain writes, checked against what it will write. Errors name
    where the value at fault came from (the TOML file or the command line)."""
    try:
        cfg.check_paths(made or {})
        return to_trainer_config(cfg, made)
    except ValueError as e:  # ConfigError, and the registry's ValueErrors (an unknown flavor)
        raise cfg.locate(e if isinstance(e, ConfigError) else ConfigError(str(e))) from None


def plan_runs(path: str, overrides: list[str] | None = None) -> list[str]:
    """The configs run_train.sh runs for ``path``, in order: the runs it requires
    (``job.requires``, recursively) that have not finished (no DONE in their dump folder),
    then ``path`` itself with the command-line overrides.

    Every config of the chain is validated COMPLETELY here, before anything runs and
    without writing anything: an input that an earlier run of the chain writes (its
    job.export_hf or draft.export_dir) is checked against the architecture that run's
    config gives it (``Made``); any other input path inside a pending run's dump folder is
    an error (nothing will be there); every other input is read and checked now."""
    order: list[tuple[str, TitanSpecConfig]] = []

    def visit(p: str, ov: list[str] | None, chain: tuple[str, ...]) -> None:
        if p in chain:
            raise ConfigError(f"job.requires forms a cycle: {' -> '.join((*chain, p))}")
        cfg = load_config(p, ov, check_paths=False)
        for req in cfg.job.requires:
            req_path = os.path.normpath(os.path.join(os.path.dirname(p), req))
            if not os.path.isfile(req_path):
                raise ConfigError(f"{p}: job.requires names {req!r}, but {req_path} does not exist")
            req_cfg = load_config(req_path, None, check_paths=False)
            if not os.path.isfile(os.path.join(req_cfg.job.dump_folder, "DONE")):
                visit(req_path, None, (*chain, p))
        if all(p != q for q, _ in order):
            order.append((p, cfg))

    visit(path, overrides, ())
    made: dict[str, Made] = {}
    pending: list[tuple[str, str]] = []  # (dump folder + os.sep, config) of the runs planned so far
    for p, cfg in order:
        for key in ("model.hf_checkpoint", "draft.init_from"):
            d = getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1])
            inside = next((run for dump, run in pending if (os.path.abspath(d) + os.sep).startswith(dump)), None)
            if d and inside and os.path.abspath(d) not in made:
                writes = [k for k, m in made.items() if m.run == inside]
                raise cfg.locate(ConfigError(
                    f"{key} {d!r} is inside the dump folder of {inside}, which runs first but writes no "
                    f"checkpoint there; it writes {writes or 'no export (set its job.export_hf / draft.export_dir)'}",
                    key=key,
                ))
        tc = validate_run(cfg, made)
        dump = os.path.abspath(cfg.job.dump_folder)
        pending.append((dump + os.sep, p))
        if cfg.job.export_hf:
            # What save_hf writes and read_hf_arch reads back: the config.json round trip.
            arch = arch_from_hf_config(arch_to_hf_config(tc.arch))
            made[os.path.abspath(under_dump_folder(dump, cfg.job.export_hf))] = Made(run=p, hf=arch)
        if tc.draft_arch is not None and cfg.draft.export_dir:
            made[os.path.abspath(under_dump_folder(dump, cfg.draft.export_dir))] = Made(run=p, draft=tc.draft_arch)
    return [p for p, _ in order]


def main(argv: list[str] | None = None) -> int:
    """``--check``: validate the config (and the HF/draft directories it names) and exit;
    ``--plan``: print the configs to run for it, one per line (job.requires first).
    run_train.sh does both in one process before torchrun starts any rank."""
    argv = list(sys.argv[1:] if argv is None else argv)
    check_only, plan_only = "--check" in argv, "--plan" in argv
    for flag in ("--check", "--plan"):
        if flag in argv:
            argv.remove(flag)
    path = None
    if "--config" in argv:
        i = argv.index("--config")
        path = argv[i + 1] if i + 1 < len(argv) else None
        del argv[i : i + 2]
    try:
        if plan_only:
            print("\n".join(plan_runs(path or "", argv)))
            return 0
        trainer_config = validate_run(load_config(path, argv, check_paths=False))
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"titan_spec: config error: {e}", file=sys.stderr)
        return 2
    if check_only:
        return 0
    init_logger()
    try:
        return train_and_close(trainer_config)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def train_and_close(trainer_config: "SpecTrainer.Config") -> int:
    """Build, train (export, DONE) and close one run; the exit status. A run stopped by the
    finiteness guard or by a checkpoint it cannot resume from prints one line and returns 1
    (no DONE: run_train.sh does not treat it as finished)."""
    trainer = None
    try:
        trainer = trainer_config.build()
        trainer.train()
    except (NonFiniteStop, CheckpointCorrupt) as e:
        # One write: the line of each rank stays whole even with unbuffered stderr.
        sys.stderr.write(f"titan_spec: {e}\n")
        sys.stderr.flush()
        return 1
    finally:
        if trainer is not None:
            trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
