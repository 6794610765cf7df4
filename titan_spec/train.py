"""Entry point: ``python -m titan_spec.train --config FILE [--section.key value ...]``.

The config (``titan_spec.config``) becomes torchtitan's ``Trainer.Config``
(``to_trainer_config``): the target's architecture from a flavor or an HF checkpoint
(``resolve_arch``), the draft's (``draft_arch_for``), the parallelize and pipeline functions,
optimizer, schedule, checkpointer. Everything checkable before a run starts is checked here
(``validate_run``), for every run of a ``job.requires`` chain (``plan_runs``, ``--plan``),
before torchrun starts any rank. The trainer itself is ``titan_spec.training.trainer.SpecTrainer``
(SFT and offline draft training) or ``titan_spec.rl.trainer.RLTrainer`` (RL).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from typing import Any

import titan_spec  # noqa: F401  (CPU shims before torchtitan)
import torch
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.components.optimizer import ParamGroupConfig, register_moe_load_balancing_hook
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.tools.logging import init_logger

from titan_spec import platform
from titan_spec.training.checkpoint import CheckpointCorrupt, VerifiedCheckpointManager
from titan_spec.config import (
    ConfigError, TitanSpecConfig, check_paths, document_multiple, load_config, locate, quiet_torchtitan,
)
from titan_spec.data.loader import TaskDataLoader
from titan_spec.data.prompts import PromptFormat
from titan_spec.data.rewards import RewardError, check_reward
from titan_spec.data.generated import check_records_fit
from titan_spec.data.tasks import check_task_file
from titan_spec.data.tokenizer import build_tokenizer, tokenizer_config, tokenizer_source
from titan_spec.training.draft import under_dump_folder
from titan_spec.training.finite import NonFiniteStop
from titan_spec.config.draft_kinds import tap_ids_problem
from titan_spec.models.draft import DraftKind, draft_kind
from titan_spec.models.hf_io import check_hf_weights, read_hf_arch
from titan_spec.models.registry import (
    active_parameter_count, arch_from_hf_config, arch_to_hf_config, build_target_config, flavor_arch, parameter_count,
    with_vocab,
)
from titan_spec.parallelisms.cp_batch import without_torch_cp
from titan_spec.parallelisms.pipeline import check_pipeline_config, pipeline_spec
from titan_spec.rl.trainer import RLTrainer
from titan_spec.rollout.sglang.engine import check_config as check_sglang_config
from titan_spec.training.metrics import CoTrainingMetrics
from titan_spec.training.optimizers import CoTrainingLRSchedulers, CoTrainingOptimizers
from titan_spec.training.trainer import SpecTrainer

__all__ = [
    "to_trainer_config", "resolve_arch", "check_inputs", "validate_run", "plan_runs", "main",
    "train_and_close", "weightless_inputs",
]


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
    """Arch of the draft it exports there (draft.export_dir; its draft kind's arch), or None."""
    tokenizer: tuple[str, str] | None = None
    """The tokenizer it saves with its policy export: (kind, source directory), or None."""


def _made(made: dict[str, Made] | None, path: str) -> Made | None:
    return (made or {}).get(os.path.abspath(path)) if path else None


def resolve_tokenizer(cfg: TitanSpecConfig, made: dict[str, Made] | None = None) -> tuple[str, str]:
    """(kind, directory) of the run's tokenizer (data/tokenizer.py ``tokenizer_source``); a
    directory an earlier run of the chain exports to holds that run's tokenizer (``Made``)."""
    t = cfg.tokenizer
    where = t.path or cfg.model.hf_checkpoint
    promise = _made(made, where)
    if promise is not None and t.kind != "char":
        if promise.tokenizer is None:
            key = "tokenizer.path" if t.path else "model.hf_checkpoint"
            raise ConfigError(f"{key} {where!r} is where {promise.run} exports its draft, which carries no "
                              "tokenizer", key=key)
        return promise.tokenizer
    if promise is not None:
        return "char", ""
    return tokenizer_source(t.kind, t.path, cfg.model.hf_checkpoint)


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
            src = cfg.tokenizer.path or path
            raise ConfigError(
                f"the tokenizer of {src} has ids up to {vocab_size - 1}, but {path} has a vocabulary of "
                f"{arch.vocab_size} (ids >= {arch.vocab_size} have no embedding): the tokenizer does not fit the model",
                key="tokenizer.path" if cfg.tokenizer.path else "model.hf_checkpoint"
            )
        if promise is None:
            try:
                check_hf_weights(path, arch)
            except ValueError as e:
                raise ConfigError(f"model.hf_checkpoint: {e}", key="model.hf_checkpoint") from None
        return arch
    arch = flavor_arch(cfg.model.name, cfg.model.flavor)
    arch = with_vocab(arch, vocab_size) if cfg.model.vocab_from_tokenizer else arch
    if arch.vocab_size < vocab_size:
        raise ConfigError(
            f"the tokenizer has ids up to {vocab_size - 1}, but model.flavor {cfg.model.flavor!r} has a vocabulary of "
            f"{arch.vocab_size} with model.vocab_from_tokenizer = false: the tokenizer does not fit the model",
            key="model.vocab_from_tokenizer")
    return arch


def tap_ids_for(cfg: TitanSpecConfig, n_layers: int, kind: DraftKind | None = None) -> tuple[int, ...]:
    """The configured tap ids, else the draft kind's default for an n_layers target, checked."""
    kind = kind or draft_kind(cfg.draft.kind)
    ids = tuple(cfg.draft.tap_layer_ids) or kind.default_tap_layer_ids(n_layers)
    why = tap_ids_problem(ids, n_layers)
    if why:
        raise ConfigError(f"draft.tap_layer_ids: {why}")
    return ids


def draft_arch_for(cfg: TitanSpecConfig, arch, made: dict[str, Made] | None = None):
    """The draft (of kind ``draft.kind``) for this target; a ``draft.init_from`` directory
    supplies the draft vocabulary size and tap ids that the config leaves unset (0 / empty),
    and must fit the result (dimensions, vocabularies, tap ids, its safetensors' names and shapes)."""
    kind = draft_kind(cfg.draft.kind)
    vocab, taps = cfg.draft.draft_vocab_size, tuple(cfg.draft.tap_layer_ids)
    path, promise, found = cfg.draft.init_from, _made(made, cfg.draft.init_from), None
    if promise is not None:
        if promise.draft is None:
            raise ConfigError(f"draft.init_from {path!r} is where {promise.run} exports its policy, "
                              "not a draft", key="draft.init_from")
        found = promise.draft
    elif path and os.path.isdir(path):
        try:
            found = kind.read_arch(path)
        except ValueError as e:
            raise ConfigError(f"draft.init_from: {e}", key="draft.init_from") from None
    if found is not None:
        vocab, taps = vocab or found.draft_vocab_size, taps or found.tap_layer_ids
    why = taps and tap_ids_problem(taps, arch.n_layers)
    if why:
        raise ConfigError(f"draft.tap_layer_ids: {why}", key="draft.tap_layer_ids")
    taps = taps or tap_ids_for(cfg, arch.n_layers, kind)
    try:
        d = kind.arch_from_target(arch, taps, vocab)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if found is not None:
        bad = kind.mismatches(found, d)
        if bad:
            raise ConfigError(f"draft.init_from {path!r} does not fit the target and the [draft] config: "
                              f"{'; '.join(bad)}", key="draft.init_from")
        if promise is None:
            try:
                kind.check_weights(path, d)
            except ValueError as e:
                raise ConfigError(f"draft.init_from: {e}", key="draft.init_from") from None
    return d


def _check_tensor_parallel(arch, tp: int) -> None:
    """torchtitan's TP plan shards the query and key/value heads (attention runs on each
    rank's local heads) and the FFN's hidden dimension over the tp ranks: tp must divide each."""
    if tp <= 1:
        return
    for what, n in (("query heads", arch.n_heads), ("key/value heads", arch.n_kv_heads), ("FFN hidden size", arch.hidden_dim)):
        if n % tp:
            raise ConfigError(
                f"parallelism.tensor_parallel_degree = {tp} does not divide the target's {n} {what}; "
                f"allowed: a divisor of n_heads {arch.n_heads}, n_kv_heads {arch.n_kv_heads} and hidden_dim {arch.hidden_dim}",
                key="parallelism.tensor_parallel_degree",
            )


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
    tok = build_tokenizer(tok_kind, tok_path)
    PromptFormat(cfg.task, tok)  # the chat-template keys fit this tokenizer (ConfigError otherwise)
    arch = resolve_arch(cfg, tok.get_vocab_size(), made)
    # Taps are read only when the draft trains from them; the LM step returns logits.
    draft_arch = draft_arch_for(cfg, arch, made)  # validates tap ids and draft vocab even when unused
    taps = draft_arch.tap_layer_ids if cfg.mode.trains_draft else ()
    if cfg.training.seq_len > arch.max_seq_len:
        raise ConfigError(
            f"training.seq_len = {cfg.training.seq_len} exceeds the model's maximum of {arch.max_seq_len}",
            key="training.seq_len",
        )
    _check_tensor_parallel(arch, cfg.parallelism.tensor_parallel_degree)
    if cfg.parallelism.expert_parallel_degree > 1 and not arch.is_moe:
        raise ConfigError(f"parallelism.expert_parallel_degree = {cfg.parallelism.expert_parallel_degree} needs a "
                          "MoE target (model.flavor tiny_moe, 30B-A3B, ... or a Qwen3-MoE checkpoint); this one is dense",
                          key="parallelism.expert_parallel_degree")
    coeff = cfg.model.moe_load_balance_coeff
    if coeff > 0 and not arch.is_moe:
        raise ConfigError(f"model.moe_load_balance_coeff = {coeff} needs a MoE target; this one is dense",
                          key="model.moe_load_balance_coeff")
    model_config = build_target_config(arch, tap_layer_ids=taps, load_balance_coeff=coeff or None)
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
        spec=cfg,
        arch=arch,
        draft_arch=draft_arch if cfg.mode.has_draft else None,
        model_spec=spec,
        hf_assets_path=cfg.model.hf_checkpoint or cfg.job.dump_folder,
        dump_folder=cfg.job.dump_folder,
        profiler=cfg.profiler,
        metrics=_config_as(CoTrainingMetrics.Config, cfg.metrics),
        tokenizer=tokenizer_config(tok_kind, tok_path),
        dataloader=TaskDataLoader.Config(
            task=cfg.task, step_rows=cfg.training.local_batch_size, document_multiple=document_multiple(cfg)
        ),
        # The co-training components (training/optimizers.py, metrics.py): torchtitan's,
        # stepping and logging the draft with the policy.
        optimizer=CoTrainingOptimizers.Config(
            param_groups=[ParamGroupConfig(pattern=r".*", optimizer_name=o.name, optimizer_kwargs=kwargs)],
            implementation=o.implementation, max_consecutive_skips=cfg.training.max_consecutive_skips,
        ),
        lr_scheduler=_config_as(CoTrainingLRSchedulers.Config, cfg.lr_scheduler),
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


def check_inputs(cfg: TitanSpecConfig, made: dict[str, Made] | None = None) -> None:
    """The inputs a config names, before anything is built: its directories exist
    (config.check_paths), its task file reads (data.tasks.check_task_file), a 'records' task's
    prompts fit training.seq_len (data.generated.check_records_fit), the SGLang
    engine can start from them (rollout.sglang.engine.check_config). ``made``: directories
    an earlier run of the chain writes (not there yet; see ``Made``). Raises ConfigError,
    not yet located (``validate_run`` says where the value came from)."""
    made = made or {}
    check_paths(cfg, made)
    check_task_file(cfg.task)
    check_records_fit(cfg)
    check_reward(cfg.task.reward)
    written = {os.path.abspath(cfg.model.hf_checkpoint), os.path.abspath(cfg.draft.init_from)} & set(made)
    check_sglang_config(cfg, files=not written)
    if cfg.rollout.engine == "sglang" and not written:
        _check_sglang_tokenizer(cfg)


def _check_sglang_tokenizer(cfg: TitanSpecConfig) -> None:
    """SGLang serves model.hf_checkpoint with ITS tokenizer files (token ids in and out, but
    its EOS handling and any text it reports are that directory's): a tokenizer.path
    elsewhere must hold the same tokenizer.json, or the engines disagree on the ids."""
    ours, served = cfg.tokenizer.path, cfg.model.hf_checkpoint
    if not ours or not served or os.path.realpath(ours) == os.path.realpath(served):
        return

    def content(d: str) -> bytes | None:
        f = os.path.join(d, "tokenizer.json")
        if not os.path.isfile(f):
            return None
        with open(f, "rb") as fh:
            return fh.read()

    served_json = content(served)
    if served_json is not None and content(ours) != served_json:
        raise ConfigError(
            f"tokenizer.path {ours!r} is not the tokenizer SGLang serves model.hf_checkpoint {served!r} with "
            "(their tokenizer.json differ): leave tokenizer.path empty, or copy the tokenizer into the checkpoint",
            key="tokenizer.path")


def validate_run(cfg: TitanSpecConfig, made: dict[str, Made] | None = None) -> "SpecTrainer.Config":
    """Everything checkable before a run starts, for a loaded config: its input files
    (HF safetensors headers, the draft directory, the task file) and its architecture
    (tap ids, draft vocab, seq_len, draft dimensions against the target). ``made``: inputs
    an earlier run of the chain writes, checked against what it will write. Errors name
    where the value at fault came from (the TOML file or the command line)."""
    try:
        check_inputs(cfg, made)
        return to_trainer_config(cfg, made)
    except ValueError as e:  # ConfigError, and the registry's ValueErrors (an unknown flavor)
        raise locate(cfg, e if isinstance(e, ConfigError) else ConfigError(str(e))) from None


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
                raise locate(cfg, ConfigError(
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
            made[os.path.abspath(under_dump_folder(dump, cfg.job.export_hf))] = Made(
                run=p, hf=arch, tokenizer=resolve_tokenizer(cfg, made))
        if tc.draft_arch is not None and cfg.draft.export_dir:
            made[os.path.abspath(under_dump_folder(dump, cfg.draft.export_dir))] = Made(run=p, draft=tc.draft_arch)
    return [p for p, _ in order]


def weightless_inputs(cfg: TitanSpecConfig) -> dict[str, Made]:
    """The config's HF and draft directories as promised inputs (``Made``): their config
    files are read and checked as usual, their weight files are not (``--check --no-weights``)."""
    made = {}
    if cfg.model.hf_checkpoint and os.path.isdir(cfg.model.hf_checkpoint):
        try:
            made[os.path.abspath(cfg.model.hf_checkpoint)] = Made(
                run="--no-weights", hf=read_hf_arch(cfg.model.hf_checkpoint), tokenizer=resolve_tokenizer(cfg))
        except ValueError as e:
            raise locate(cfg, ConfigError(f"model.hf_checkpoint: {e}", key="model.hf_checkpoint")) from None
    if cfg.draft.init_from and os.path.isdir(cfg.draft.init_from):
        try:
            made[os.path.abspath(cfg.draft.init_from)] = Made(run="--no-weights", draft=draft_kind(cfg.draft.kind).read_arch(cfg.draft.init_from))
        except ValueError as e:
            raise locate(cfg, ConfigError(f"draft.init_from: {e}", key="draft.init_from")) from None
    return made


def main(argv: list[str] | None = None) -> int:
    """``--check``: validate the config (and the HF/draft directories it names) and exit;
    ``--check --no-weights``: the same without reading weight files (``weightless_inputs``:
    a GPU recipe checked where its checkpoint is not, e.g. against config.json files alone),
    printing the target's parameter counts (built on the meta device);
    ``--plan``: print the configs to run for it, one per line (job.requires first).
    run_train.sh does both in one process before torchrun starts any rank."""
    argv = list(sys.argv[1:] if argv is None else argv)
    check_only, plan_only, no_weights = "--check" in argv, "--plan" in argv, "--no-weights" in argv
    for flag in ("--check", "--plan", "--no-weights"):
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
        if no_weights and not check_only:
            raise ConfigError("--no-weights goes with --check only (a run reads its weights)")
        cfg = load_config(path, argv, check_paths=False)
        trainer_config = validate_run(cfg, weightless_inputs(cfg) if no_weights else None)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"titan_spec: config error: {e}", file=sys.stderr)
        return 2
    if check_only:
        if no_weights:
            arch = trainer_config.arch
            print(f"titan_spec: {path}: checked without its weight files; the target has "
                  f"{parameter_count(arch):,} parameters, {active_parameter_count(arch):,} active per token")
        return 0
    init_logger()
    try:
        return train_and_close(trainer_config)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def train_and_close(trainer_config: "SpecTrainer.Config") -> int:
    """Build, train (export, DONE) and close one run; the exit status. A run stopped by the
    finiteness guard, by a checkpoint it cannot resume from or by a reward that raised prints one line and returns 1
    (no DONE: run_train.sh does not treat it as finished)."""
    trainer = None
    try:
        trainer = trainer_config.build()
        trainer.train()
    except (NonFiniteStop, CheckpointCorrupt, RewardError) as e:
        # One write: the line of each rank stays whole even with unbuffered stderr.
        sys.stderr.write(f"titan_spec: {e}\n")
        sys.stderr.flush()
        return 1
    finally:
        if trainer is not None:
            trainer.close()
    return 0


if __name__ == "__main__":
    platform.exit_process(main())
