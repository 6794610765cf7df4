"""titan_spec's TOML config -> torchtitan's ``Trainer.Config``: the resolved target and
draft (preflight/resolve.py), the parallelize and pipeline functions, torchtitan's
optimizers and LR schedules for the policy, the metrics (training/metrics.py), the
checkpointer; the trainer class by mode (SpecTrainer for SFT and offline draft training,
RLTrainer for RL)."""

from __future__ import annotations

import dataclasses
from typing import Any

import titan_spec  # noqa: F401  (CPU shims before torchtitan)
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig, register_moe_load_balancing_hook
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
from torchtitan.protocols.model_spec import ModelSpec

from titan_spec import platform
from titan_spec.config import ConfigError, TitanSpecConfig, document_multiple, quiet_torchtitan
from titan_spec.data.loader import TaskDataLoader
from titan_spec.data.prompts import PromptFormat
from titan_spec.data.tokenizer import tokenizer_config
from titan_spec.models.hf_io import read_hf_arch
from titan_spec.models.registry import build_target_config
from titan_spec.parallelisms.cp_batch import without_torch_cp
from titan_spec.parallelisms.pipeline import TapPipeline
from titan_spec.preflight.inputs import check_chat_template
from titan_spec.preflight.lengths import check_documents_fit
from titan_spec.preflight.parallelism import check_pipeline_config, check_tensor_parallel
from titan_spec.preflight.resolve import Made, _made, draft_arch_for, resolve_arch, resolve_tokenizer
from titan_spec.rl.step import RLTrainer
from titan_spec.training.checkpoint import VerifiedCheckpointManager
from titan_spec.training.metrics import CoTrainingMetrics
from titan_spec.training.trainer import SpecTrainer

__all__ = ["to_trainer_config"]


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
    if cfg.model.hf_checkpoint and _made(made, cfg.model.hf_checkpoint) is None:
        try:  # the checkpoint's own config.json first: it says more than its tokenizer files
            read_hf_arch(cfg.model.hf_checkpoint)
        except ValueError as e:
            raise ConfigError(f"model.hf_checkpoint: {e}", key="model.hf_checkpoint") from None
    tok_kind, tok_path = resolve_tokenizer(cfg, made)
    # A promised directory's tokenizer is its source's (the same files, copied there later).
    try:
        tok = tokenizer_config(tok_kind, tok_path).build()
    except ValueError as e:
        raise ConfigError(str(e), key="tokenizer.path") from None
    check_chat_template(cfg.task, tok)
    prompts = PromptFormat(cfg.task, tok)
    check_documents_fit(cfg, tok, prompts)  # every record's document fits training.seq_len
    arch = resolve_arch(cfg, tok.get_vocab_size(), made)
    # Taps are read only when the draft trains from them; the LM step returns logits.
    draft_arch = draft_arch_for(cfg, arch, made)  # validates tap ids and draft vocab even when unused
    taps = draft_arch.tap_layer_ids if cfg.mode.trains_draft else ()
    if cfg.training.seq_len > arch.max_seq_len:
        raise ConfigError(
            f"training.seq_len = {cfg.training.seq_len} exceeds the model's maximum of {arch.max_seq_len}",
            key="training.seq_len",
        )
    check_tensor_parallel(arch, cfg.parallelism.tensor_parallel_degree)
    if cfg.parallelism.expert_parallel_degree > 1 and not arch.is_moe:
        raise ConfigError(
            f"parallelism.expert_parallel_degree = {cfg.parallelism.expert_parallel_degree} needs a "
            "MoE target (model.flavor tiny_moe, 30B-A3B, ... or a Qwen3-MoE checkpoint); this one is dense",
            key="parallelism.expert_parallel_degree",
        )
    coeff = cfg.model.moe_load_balance_coeff
    if coeff > 0 and not arch.is_moe:
        raise ConfigError(
            f"model.moe_load_balance_coeff = {coeff} needs a MoE target; this one is dense",
            key="model.moe_load_balance_coeff",
        )
    model_config = build_target_config(arch, tap_layer_ids=taps, load_balance_coeff=coeff or None)
    if arch.family == "qwen3":
        from torchtitan.models.qwen3 import parallelize_qwen3 as parallelize_fn
        from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter as adapter
    else:
        from torchtitan.models.llama3 import parallelize_llama as parallelize_fn
        from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter as adapter
    if cfg.parallelism.pipeline_parallel_degree > 1:
        check_pipeline_config(cfg, model_config, taps)

    model_spec = ModelSpec(
        name=arch.family,
        flavor="hf" if cfg.model.hf_checkpoint else cfg.model.flavor,
        model=model_config,
        parallelize_fn=_parallelize(parallelize_fn),
        pipelining_fn=TapPipeline(),
        # torchtitan's aux-loss-free balancing: moves each MoE layer's routing bias before
        # every optimizer step (models/moe.py); off, the bias stays 0 (HF's routing).
        post_optimizer_build_fn=register_moe_load_balancing_hook if coeff > 0 else None,
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
    trainer_cls = RLTrainer if cfg.mode.trains == "rl" else SpecTrainer
    with quiet_torchtitan():
        checkpoint = VerifiedCheckpointManager.from_config(cfg.checkpoint)
    return trainer_cls.Config(
        job=cfg.job,
        model=cfg.model,
        task=cfg.task,
        draft=cfg.draft,
        speculative=cfg.speculative,
        rollout=cfg.rollout,
        rl=cfg.rl,
        arch=arch,
        draft_arch=draft_arch if cfg.mode.has_draft else None,
        model_spec=model_spec,
        hf_assets_path=cfg.model.hf_checkpoint or cfg.job.dump_folder,
        dump_folder=cfg.job.dump_folder,
        profiler=cfg.profiler,
        metrics=_config_as(CoTrainingMetrics.Config, cfg.metrics),
        tokenizer=tokenizer_config(tok_kind, tok_path),
        dataloader=TaskDataLoader.Config(
            task=cfg.task, step_rows=cfg.training.local_batch_size, document_multiple=document_multiple(cfg)
        ),
        # The policy's optimizers and LR schedules: torchtitan's (the trainer's joint step,
        # training/joint_step.py, steps them with the draft's).
        optimizer=OptimizersContainer.Config(
            param_groups=[ParamGroupConfig(pattern=r".*", optimizer_name=o.name, optimizer_kwargs=kwargs)],
            implementation=o.implementation,
        ),
        lr_scheduler=dataclasses.replace(cfg.lr_scheduler),
        training=training,
        parallelism=cfg.parallelism,
        checkpoint=checkpoint,
        activation_checkpoint=ac,
        compile=cfg.compile,
        comm=cfg.comm,
        debug=cfg.debug,
        loss=CrossEntropyLoss.Config(),
    )


def _config_as(cls, config):
    """``config`` (a torchtitan component's Config, as the TOML filled it) as the Config of
    titan_spec's subclass of that component (the same fields)."""
    return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init})
