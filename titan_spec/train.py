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
- ``train_step``: the draft's optimizer steps right after the policy's;
- ``state_dict``: the draft, its optimizer and schedule join the DCP checkpoint.

One LM/SFT step: TaskDataLoader -> train_step (torchtitan) -> forward_backward_step
-> post_dataloading_process -> _forward_backward_body (policy loss + lambda * draft
loss) -> optimizers.step -> DraftTraining.step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import titan_spec  # noqa: F401  (CPU shims before torchtitan)
import torch
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.tools.logging import init_logger, logger
from torchtitan.trainer import Trainer

from titan_spec import platform
from titan_spec.config import ConfigError, TitanSpecConfig, load_config
from titan_spec.data import CharTokenizer, TaskDataLoader
from titan_spec.draft_training import DraftTraining, under_dump_folder
from titan_spec.models.attention import DocCausalAttention
from titan_spec.models.draft import DraftArch
from titan_spec.models.hf_io import load_hf_into, read_hf_arch, save_hf
from titan_spec.models.registry import build_target_config, flavor_arch, with_vocab
from titan_spec.models.target import default_tap_layer_ids, validate_tap_layer_ids
from titan_spec.parallelisms.cp_batch import shard_batch, without_torch_cp

__all__ = ["SpecTrainer", "to_trainer_config", "resolve_arch", "main"]


def resolve_arch(cfg: TitanSpecConfig, vocab_size: int):
    """The target's architecture: the HF checkpoint's, else the flavor sized to the tokenizer."""
    if cfg.model.hf_checkpoint:
        arch = read_hf_arch(cfg.model.hf_checkpoint)
        if arch.family != cfg.model.name:
            raise ConfigError(
                f"model.name = {cfg.model.name!r} but {cfg.model.hf_checkpoint} holds a {arch.family} model"
            )
        if arch.vocab_size < vocab_size:
            raise ConfigError(
                f"{cfg.model.hf_checkpoint} has a vocabulary of {arch.vocab_size}, smaller than the "
                f"tokenizer's {vocab_size}"
            )
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


def draft_arch_for(cfg: TitanSpecConfig, arch) -> DraftArch:
    d = DraftArch.from_target(arch, tap_ids_for(cfg, arch.n_layers), cfg.draft.draft_vocab_size)
    try:
        d.validate()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return d


def _parallelize(parallelize_fn):
    def parallelize(model, **kwargs):
        if kwargs["parallel_dims"].cp_enabled:  # titan_spec's ring, not torch's CP
            kwargs["parallel_dims"] = without_torch_cp(kwargs["parallel_dims"])
        model = parallelize_fn(model, **kwargs)
        platform.force_sum_reduction(model)
        return model

    return parallelize


def to_trainer_config(cfg: TitanSpecConfig) -> "SpecTrainer.Config":
    """titan_spec's TOML config -> torchtitan's Trainer.Config (the parent's wiring)."""
    tok = CharTokenizer()
    arch = resolve_arch(cfg, tok.get_vocab_size())
    # Taps are read only when the draft trains from them; the LM step returns logits.
    draft_arch = draft_arch_for(cfg, arch)  # validates tap ids and draft vocab even when unused
    taps = draft_arch.tap_layer_ids if cfg.draft.enable else ()
    if cfg.training.seq_len > arch.max_seq_len:
        raise ConfigError(
            f"training.seq_len = {cfg.training.seq_len} exceeds the model's maximum of {arch.max_seq_len}"
        )
    model_config = build_target_config(arch, tap_layer_ids=taps)
    if arch.family == "qwen3":
        from torchtitan.models.qwen3 import parallelize_qwen3 as parallelize_fn
        from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter as adapter
    else:
        from torchtitan.models.llama3 import parallelize_llama as parallelize_fn
        from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter as adapter
    from torchtitan.distributed.pipeline_parallel import pipeline_llm

    spec = ModelSpec(
        name=arch.family,
        flavor="hf" if cfg.model.hf_checkpoint else cfg.model.flavor,
        model=model_config,
        parallelize_fn=_parallelize(parallelize_fn),
        pipelining_fn=pipeline_llm,
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
    return SpecTrainer.Config(
        spec=cfg,
        arch=arch,
        draft_arch=draft_arch if cfg.draft.enable else None,
        model_spec=spec,
        hf_assets_path=cfg.model.hf_checkpoint or cfg.job.dump_folder,
        dump_folder=cfg.job.dump_folder,
        profiler=cfg.profiler,
        metrics=cfg.metrics,
        tokenizer=CharTokenizer.Config(),
        dataloader=TaskDataLoader.Config(task=cfg.task),
        optimizer=OptimizersContainer.Config(
            param_groups=[ParamGroupConfig(pattern=r".*", optimizer_name=o.name, optimizer_kwargs=kwargs)],
            implementation=o.implementation,
        ),
        lr_scheduler=cfg.lr_scheduler,
        training=training,
        parallelism=cfg.parallelism,
        checkpoint=cfg.checkpoint,
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
        self.draft_training = self._build_draft_training() if spec.draft.enable else None

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
        )

    def train_step(self, data_iterator):
        # The draft's optimizer steps right after the policy's, with its own clipping.
        if self.draft_training is not None:
            self.draft_training.zero_grad()
        super().train_step(data_iterator)
        if self.draft_training is not None:
            self.draft_training.step()

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

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        if self.draft_training is not None:
            sd["draft"] = self.draft_training.state_dict()
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        if self.draft_training is not None and "draft" in state_dict:
            self.draft_training.load_state_dict(state_dict["draft"])

    def train(self):
        super().train()
        self.export()

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

    def _log_jsonl(self, log):
        """Wrap MetricsProcessor.log to also append full-precision metrics to metrics.jsonl."""
        path = os.path.join(self.config.dump_folder, "metrics.jsonl")

        def logged(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
            if self.draft_training is not None:
                extra_metrics = {**(extra_metrics or {}), **self.draft_training.metrics()}
            log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra_metrics)
            if torch.distributed.get_rank() == 0:
                row = {"step": step, "loss": global_avg_loss, "max_loss": global_max_loss, "grad_norm": grad_norm}
                row.update({k: v for k, v in (extra_metrics or {}).items() if isinstance(v, (int, float))})
                with open(path, "a") as f:
                    f.write(json.dumps(row) + "\n")

        return logged

    def post_dataloading_process(self, input_dict, labels):
        if self.parallel_dims.cp_enabled:
            # Zigzag-shard for the ring (parallelisms/cp_batch.py), not torch's CP input split.
            inputs, labels, extra = shard_batch(input_dict, labels, self.parallel_dims.get_mesh("cp"))
            self.ntokens_seen += extra["attention_masks"].num_real_rows()
            return inputs, labels, extra
        inputs, labels, extra = super().post_dataloading_process(input_dict, labels)
        attn = self.model_config.first_attention
        if isinstance(attn.inner_attention, DocCausalAttention.Config) and "positions" in extra:
            extra["attention_masks"] = self.model_parts[0].get_attention_masks(extra["positions"])
        return inputs, labels, extra


def main(argv: list[str] | None = None) -> int:
    """``--check``: validate the config (and the HF/draft directories it names) and exit;
    run_train.sh does this in one process before torchrun starts any rank."""
    argv = list(sys.argv[1:] if argv is None else argv)
    check_only = "--check" in argv
    if check_only:
        argv.remove("--check")
    path = None
    if "--config" in argv:
        i = argv.index("--config")
        path = argv[i + 1] if i + 1 < len(argv) else None
        del argv[i : i + 2]
    try:
        cfg = load_config(path, argv)
        trainer_config = to_trainer_config(cfg)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"titan_spec: config error: {e}", file=sys.stderr)
        return 2
    if check_only:
        return 0
    init_logger()
    trainer = None
    try:
        trainer = trainer_config.build()
        trainer.train()
    finally:
        if trainer is not None:
            trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
