"""The parallelisms' fit, decided by the config and the target alone: tensor parallelism
divides the heads and the FFN, the pipeline's split, schedule and the features it cannot
carry (one ConfigError line each)."""

from __future__ import annotations

from titan_spec.config import ConfigError
from titan_spec.parallelisms.pipeline import check_pipeline_split, check_schedule, stage_module_names

__all__ = ["check_pipeline_config", "check_tensor_parallel"]


def check_tensor_parallel(arch, tp: int) -> None:
    """torchtitan's TP plan shards the query and key/value heads (attention runs on each
    rank's local heads) and the FFN's hidden dimension over the tp ranks: tp must divide each."""
    if tp <= 1:
        return
    for what, n in (
        ("query heads", arch.n_heads),
        ("key/value heads", arch.n_kv_heads),
        ("FFN hidden size", arch.hidden_dim),
    ):
        if n % tp:
            raise ConfigError(
                f"parallelism.tensor_parallel_degree = {tp} does not divide the target's {n} {what}; "
                f"allowed: a divisor of n_heads {arch.n_heads}, n_kv_heads {arch.n_kv_heads} and hidden_dim {arch.hidden_dim}",
                key="parallelism.tensor_parallel_degree",
            )


def check_pipeline_config(cfg, model_config, tap_ids: tuple[int, ...]) -> None:
    """Everything about PP that the config alone decides, as one-line ConfigErrors raised
    before any process starts (``python -m titan_spec.train --check`` runs this)."""
    p = cfg.parallelism
    n_layers = len(model_config.layers)
    if p.pipeline_parallel_degree > n_layers:
        raise ConfigError(
            f"pipeline parallelism: parallelism.pipeline_parallel_degree = {p.pipeline_parallel_degree} is larger than "
            f"the {n_layers} decoder layers of model {cfg.model.name}/{cfg.model.flavor}; every stage needs at least "
            f"one layer, so pp must be at most {n_layers}"
        )
    try:
        check_schedule(p, cfg.training.local_batch_size)
        names = stage_module_names(p, n_layers, model_config)
        check_pipeline_split(names, tap_ids, draft=cfg.mode.has_draft)
    except ValueError as e:
        raise ConfigError(f"pipeline parallelism: {e}") from None
    if getattr(model_config, "enable_weight_tying", False):
        raise ConfigError(
            f"pipeline parallelism: model {cfg.model.name}/{cfg.model.flavor} ties its embedding and lm_head, "
            "which sit on different stages; torchtitan does not support weight tying under PP (use an untied "
            "model, e.g. model.name = 'llama3')"
        )
    if cfg.mode.trains == "draft":
        raise ConfigError(
            "pipeline parallelism: draft.offline (a frozen target) is not supported; the pipeline "
            "backward needs a trainable target (run offline draft training with pp = 1)"
        )
    if cfg.mode.trains == "rl" and cfg.rl.kl_beta > 0:
        raise ConfigError(
            f"pipeline parallelism: rl.kl_beta = {cfg.rl.kl_beta:g} is not supported (the KL term needs a frozen "
            "whole reference model next to the logits on the last stage); RL under PP runs with rl.kl_beta = 0, "
            "or use pp = 1 for the KL term"
        )
    if cfg.mode.trains == "rl" and cfg.rl.drift_metrics:
        raise ConfigError(
            "pipeline parallelism: rl.drift_metrics = true is not supported (the drift measure needs the frozen "
            "starting policy's logits on the last stage, as the KL term does); set rl.drift_metrics = false under PP"
        )
    if cfg.mode.trains == "rl" and cfg.rollout.engine != "builtin":
        raise ConfigError(
            f"pipeline parallelism: rollout.engine = {cfg.rollout.engine!r} is not supported with rl.enable "
            "(every stage's rank pushes the gathered weights into its own built-in engine); use "
            "rollout.engine = 'builtin' under PP"
        )
    if cfg.job.export_hf:
        raise ConfigError(
            "pipeline parallelism: job.export_hf is not supported (each stage holds part of the "
            "policy); export from a checkpoint with pp = 1"
        )
