"""TOML -> typed config, with validation that names where a value came from (the file or
``command line --key``), the key and what is allowed.

One TOML file is one ``TitanSpecConfig``: each top-level table is a section and each
section is a dataclass. Where torchtitan's own config dataclass fits a section as is
(training, parallelism, checkpoint, compile, metrics, lr_scheduler, comm, debug,
profiler) it is used directly; titan_spec's own sections (job, model, optimizer,
activation_checkpoint, task, draft, speculative, rollout, rl) are defined here and are
translated to torchtitan's Trainer.Config by ``titan_spec.train``.

CLI overrides ``--section.key value`` go through the same parser and checks as the
file, so a typo on the command line fails exactly like a typo in the file. Every number,
from either, must be finite (one check, in ``_assign``).
``python -m titan_spec.train --check --config FILE [overrides]`` checks without training.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import logging
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

try:
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python < 3.11
    import tomli as tomllib

from torchtitan.components.checkpointer import CheckpointManager
from torchtitan.components.optimizer import LRSchedulersContainer
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.config import CommConfig, CompileConfig, DebugConfig, ParallelismConfig
from torchtitan.config import TrainingConfig as _TorchtitanTrainingConfig
from torchtitan.tools.logging import logger as tt_logger
from torchtitan.tools.profiler import Profiler

from titan_spec.draft_kinds import DRAFT_KINDS, tap_ids_problem

__all__ = ["ConfigError", "TitanSpecConfig", "load_config", "parse_overrides"]


class ConfigError(ValueError):
    """A config problem, already phrased for the user (one line).

    ``key`` (dotted, e.g. 'optimizer.lr') is the key at fault where there is one:
    ``load_config`` uses it to name where the value came from (the file or the command line)."""

    def __init__(self, message: str, key: str = ""):
        super().__init__(message)
        self.key = key


# ---------------------------------------------------------------------------
# titan_spec's own sections
# ---------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class TrainingConfig(_TorchtitanTrainingConfig):
    """torchtitan's [training] section plus titan_spec's own keys."""

    max_consecutive_skips: int = 3
    """A step whose policy or draft loss or gradient norm is not finite is skipped (no
    optimizer step, counted as skipped_steps / draft/skipped_steps); after this many skips
    in a row the run stops, naming the step, the loss and the last good checkpoint."""


@dataclass(kw_only=True)
class JobConfig:
    dump_folder: str = "./outputs"
    """Where logs, TensorBoard files, checkpoints, the tokenizer and plots go."""

    export_hf: str = ""
    """Write the trained policy as an HF checkpoint here at the end, relative to dump_folder ('' = no export)."""

    description: str = ""
    """Free text, logged at start."""

    requires: list[str] = field(default_factory=list)
    """Configs (TOML paths, relative to this file) whose runs must finish before this one, in
    order: run_train.sh runs each once (a run is finished when its dump folder holds DONE).
    The embedded default uses it for SFT -> offline draft -> RL."""

    def validate(self) -> None:
        # '' would put tb/, checkpoints and DONE into the current directory (the repository).
        _check(bool(self.dump_folder.strip()), "job.dump_folder", self.dump_folder, "a non-empty path")


@dataclass(kw_only=True)
class ModelConfig:
    name: Literal["qwen3", "llama3"] = "qwen3"
    """Model family of the policy/target."""

    flavor: str = "tiny"
    """Named size (qwen3: tiny, small, tiny16, 0.6B, 1.7B, 4B, 8B; llama3: tiny, 1B, 8B). Ignored when
    hf_checkpoint is set (the checkpoint's config.json defines the architecture)."""

    hf_checkpoint: str = ""
    """Directory of an HF checkpoint (config.json + *.safetensors [+ index]) to start from."""

    vocab_from_tokenizer: bool = True
    """Size the embedding to the task tokenizer (flavors only; an HF checkpoint keeps its vocab)."""


@dataclass(kw_only=True)
class OptimizerConfig:
    name: Literal["AdamW", "Adam", "SGD"] = "AdamW"
    """Optimizer of the policy."""

    lr: float = 3e-3
    """Peak learning rate."""

    weight_decay: float = 0.0
    """Decoupled weight decay."""

    beta1: float = 0.9
    """Adam beta1."""

    beta2: float = 0.95
    """Adam beta2."""

    eps: float = 1e-8
    """Adam epsilon."""

    implementation: Literal["for-loop", "foreach", "fused"] = "foreach"
    """torch.optim implementation ('fused' needs a GPU)."""

    def validate(self) -> None:
        _check(self.lr > 0, "optimizer.lr", self.lr, "a positive number")
        _check(self.weight_decay >= 0, "optimizer.weight_decay", self.weight_decay, ">= 0")
        _check(0 <= self.beta1 < 1, "optimizer.beta1", self.beta1, "in [0, 1)")
        _check(0 <= self.beta2 < 1, "optimizer.beta2", self.beta2, "in [0, 1)")
        _check(self.eps > 0, "optimizer.eps", self.eps, "a positive number")


@dataclass(kw_only=True)
class ActivationCheckpointConfig:
    mode: Literal["none", "full", "selective"] = "none"
    """Per-block activation checkpointing (torchtitan's FullAC / SelectiveAC)."""


@dataclass(kw_only=True)
class TaskConfig:
    name: Literal["arithmetic", "jsonl"] = "arithmetic"
    """'arithmetic': problems generated locally; 'jsonl': a GSM8K-style file (question, answer after '####')."""

    path: str = ""
    """The JSONL file when name = 'jsonl'."""

    on_malformed: Literal["reject", "skip"] = "reject"
    """A JSONL line that is not a question with a '####' answer: 'reject' stops before the run
    starts (naming the lines), 'skip' drops those lines with a warning naming them."""

    max_operand: int = 99
    """Largest operand of the generated problems (difficulty)."""

    num_operands: int = 2
    """Operands per generated problem."""

    operators: str = "+-"
    """Operators the generated problems use (subset of '+-*')."""

    show_work: bool = False
    """Arithmetic completions restate the expression before the result ("3+4?" -> "3+4=7")."""

    seed: int = 1234
    """Seed of the problem generator."""

    wrong_answer_rate: float = 0.0
    """Fraction of SFT demonstrations of the arithmetic task whose result is off by 1 or 2
    (noisy demonstrations, as real SFT data has; the RL reward always checks the true
    result, so RL has something to fix)."""

    document_multiple: int = 0
    """Pad every packed SFT document to a multiple of this many tokens (pad tokens continue
    its positions and are never targets, so the losses of its real tokens are unchanged).
    0 = automatic: 2 x parallelism.context_parallel_degree under pipeline x context
    parallelism (each CP rank's share of a microbatch then has the static length
    microbatch rows x seq_len / cp the pipeline stages are built with), else 1."""

    def validate(self) -> None:
        _check(self.document_multiple >= 0, "task.document_multiple", self.document_multiple, ">= 0")
        _check(self.max_operand >= 1, "task.max_operand", self.max_operand, ">= 1")
        _check(self.num_operands >= 2, "task.num_operands", self.num_operands, ">= 2")
        _check(
            bool(self.operators) and set(self.operators) <= set("+-*"),
            "task.operators", self.operators, "a non-empty subset of '+-*'",
        )
        _check(0 <= self.wrong_answer_rate < 1, "task.wrong_answer_rate", self.wrong_answer_rate, "in [0, 1)")
        if self.name == "jsonl" and not self.path.strip():
            raise ConfigError("task.path is empty but task.name = 'jsonl' needs a JSONL file", key="task.path")


@dataclass(kw_only=True)
class DraftConfig:
    enable: bool = False
    """Build the EAGLE-3 draft and train it from the policy's training forward."""

    kind: str = "eagle3"
    """The draft's kind (titan_spec/models/draft/, docs/draft_kinds.md): its model, loss, taps
    and directory format. "eagle3": SpecForge/SGLang's EAGLE-3 draft (one decoder layer over
    three target taps, trained with training-time test)."""

    offline: bool = False
    """Offline draft training: the target is frozen and only the draft trains on its taps and
    logits (the usual warm start of a draft before RL)."""

    tap_layer_ids: list[int] = field(default_factory=list)
    """Target layers whose outputs feed the draft (three distinct ids); empty = (1, L//2-1, L-4)."""

    draft_vocab_size: int = 0
    """Draft vocabulary: the most frequent target tokens of the training data; 0 = the whole target vocab."""

    vocab_count_batches: int = 16
    """Batches of training data counted to pick the draft vocabulary."""

    ttt_steps: int = 7
    """Training-time-test unroll length T."""

    loss_decay: float = 0.8
    """Weight of TTT step j is loss_decay**j."""

    loss_weight: float = 1.0
    """lambda in total = policy loss + lambda * draft loss."""

    lr: float = 3e-3
    """Learning rate of the draft's own AdamW (warmup and decay follow [lr_scheduler])."""

    max_norm: float = 1.0
    """Gradient clipping of the draft, separate from the policy's."""

    init_from: str = ""
    """A SpecForge/SGLang draft directory to start from (checked against the target)."""

    export_dir: str = "draft"
    """Where the SGLang-loadable draft is written at the end, relative to job.dump_folder ('' = no export)."""

    co_train: bool = True
    """In RL: train the draft from every step's policy forward and push it to the rollout
    engine (off = the frozen-draft baseline: the draft serves rollouts unchanged)."""

    def validate(self) -> None:
        _check(self.ttt_steps >= 1, "draft.ttt_steps", self.ttt_steps, ">= 1")
        _check(0 < self.loss_decay <= 1, "draft.loss_decay", self.loss_decay, "in (0, 1]")
        _check(self.loss_weight > 0, "draft.loss_weight", self.loss_weight, "> 0")
        _check(self.lr > 0, "draft.lr", self.lr, "a positive number")
        _check(self.max_norm > 0, "draft.max_norm", self.max_norm, "> 0")
        _check(self.draft_vocab_size >= 0, "draft.draft_vocab_size", self.draft_vocab_size, ">= 0 (0 = target vocab)")
        _check(self.vocab_count_batches >= 1, "draft.vocab_count_batches", self.vocab_count_batches, ">= 1")
        _check(self.kind in DRAFT_KINDS, "draft.kind", self.kind, f"one of {', '.join(map(repr, DRAFT_KINDS))}")
        why = self.tap_layer_ids and tap_ids_problem(self.tap_layer_ids, count=DRAFT_KINDS[self.kind])
        if why:
            raise ConfigError(why)


@dataclass(kw_only=True)
class SpeculativeConfig:
    enabled: bool = True
    """Speculative decoding in rollouts (off = plain decoding, the no-spec baseline)."""

    num_draft_tokens: int = 4
    """K: draft tokens proposed (chain) and verified in one target forward per round."""

    def validate(self) -> None:
        _check(self.num_draft_tokens >= 1, "speculative.num_draft_tokens", self.num_draft_tokens,
               ">= 1 (turn speculation off with speculative.enabled = false)")


@dataclass(kw_only=True)
class SGLangConfig:
    """[rollout.sglang]: the SGLang engine (GPU; sglang 0.5.23, extra [sglang]). The policy
    comes from model.hf_checkpoint, the EAGLE-3 draft from draft.init_from, K from
    [speculative]; see titan_spec/rollout/sglang/engine.py."""

    mode: Literal["server", "engine"] = "server"
    """'server': launch `python -m sglang.launch_server` and talk HTTP (restarted if it dies);
    'engine': sglang.Engine in the trainer's process (a crash there kills the trainer)."""

    host: str = "127.0.0.1"
    """Server host."""

    port: int = 0
    """Server port; 0 = a free port."""

    tp_size: int = 1
    """Tensor parallel GPUs of the server. One server runs per trainer rank, on that rank's
    GPU (docs/rollout_engine.md), so > 1 only in a single-process run."""

    dtype: Literal["bfloat16", "float16", "float32", "auto"] = "bfloat16"
    """Serving dtype; pushed weights are cast to it."""

    mem_fraction_static: float = 0.7
    """Fraction of GPU memory for weights and KV cache."""

    eagle_topk: int = 1
    """Draft branches per step (1 = a chain of speculative.num_draft_tokens tokens)."""

    num_verify_tokens: int = 0
    """Tokens verified per step (SGLang's speculative_num_draft_tokens); 0 = num_draft_tokens + 1."""

    enable_draft_weights_cpu_backup: bool = True
    """SGLang keeps a CPU copy of the draft across memory release/resume."""

    enable_memory_saver: bool = False
    """Allow release/resume of the server's GPU memory (colocated training)."""

    start_timeout_s: float = 900.0
    """Seconds the server may take to load and answer /health_generate."""

    request_timeout_s: float = 1800.0
    """A request unanswered this long counts as a hung server (restarted)."""

    max_restarts: int = 2
    """Restarts in a row before a rollout call fails."""

    max_running_requests: int = 0
    """Requests SGLang runs at once; 0 = one RL step's requests (rl.prompts_per_step x
    rl.group_size). Always sent: unset, SGLang resets it to 48 under speculation."""

    deterministic: bool = False
    """Start SGLang with enable_deterministic_inference, so that SamplingParams.seed makes
    rollouts reproducible (without it SGLang ignores sampling_seed and a warning says so).
    SGLang 0.5.23 then forces batch-invariant ops and the pytorch sampler (slower decoding),
    allows attention backend ascend, fa3, fa4, flashinfer, intel_xpu or triton only, and with
    flashinfer the radix cache is disabled. Unseeded calls get a fresh random seed each."""

    log_dir: str = ""
    """Where the server's log goes ('' = the system temp dir)."""

    server_args: dict[str, Any] = field(default_factory=dict)
    """Further sglang ServerArgs fields, passed as is (e.g. {cuda_graph_max_bs_decode = 64}; SGLang's
    field names, not its CLI aliases: --cuda-graph-max-bs is only a CLI alias of that field)."""

    def validate(self) -> None:
        _check(0 <= self.port < 65536, "rollout.sglang.port", self.port, "0 (free port) or a port number")
        _check(self.tp_size >= 1, "rollout.sglang.tp_size", self.tp_size, ">= 1")
        _check(0 < self.mem_fraction_static < 1, "rollout.sglang.mem_fraction_static", self.mem_fraction_static, "in (0, 1)")
        _check(self.eagle_topk >= 1, "rollout.sglang.eagle_topk", self.eagle_topk, ">= 1")
        _check(self.num_verify_tokens >= 0, "rollout.sglang.num_verify_tokens", self.num_verify_tokens, ">= 0 (0 = num_draft_tokens + 1)")
        _check(self.start_timeout_s > 0, "rollout.sglang.start_timeout_s", self.start_timeout_s, "> 0")
        _check(self.request_timeout_s > 0, "rollout.sglang.request_timeout_s", self.request_timeout_s, "> 0")
        _check(self.max_restarts >= 0, "rollout.sglang.max_restarts", self.max_restarts, ">= 0")
        _check(self.max_running_requests >= 0, "rollout.sglang.max_running_requests", self.max_running_requests,
               ">= 0 (0 = rl.prompts_per_step x rl.group_size)")


@dataclass(kw_only=True)
class RolloutConfig:
    engine: Literal["torch", "sglang"] = "torch"
    """Rollout engine."""

    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    """The SGLang engine's settings (used when engine = 'sglang')."""

    max_batch_size: int = 0
    """Requests the built-in engine decodes together (larger calls are split); 0 = all at once."""

    compile: bool = False
    """torch.compile the built-in engine's target and draft steps (minutes of compile on CPU)."""

    progress: bool = True
    """A progress bar with tokens/s and the running acceptance length during generation."""

    def validate(self) -> None:
        _check(self.max_batch_size >= 0, "rollout.max_batch_size", self.max_batch_size, ">= 0 (0 = no limit)")
        self.sglang.validate()

    def torch_engine_config(self, speculative: SpeculativeConfig):
        """The built-in engine's settings from the [rollout] and [speculative] sections."""
        from titan_spec.rollout.builtin.engine import TorchEngineConfig

        return TorchEngineConfig(
            num_draft_tokens=speculative.num_draft_tokens if speculative.enabled else 0,
            max_batch_size=self.max_batch_size,
            compile=self.compile,
            progress=self.progress,
        )


@dataclass(kw_only=True)
class RLConfig:
    enable: bool = False
    """GRPO post-training: every step generates rollouts with the engine, scores them and
    trains the policy (and, with the draft, the draft) on them (titan_spec/rl/trainer.py)."""

    prompts_per_step: int = 16
    """Prompts per step across all data-parallel ranks (split evenly over them)."""

    group_size: int = 8
    """Completions sampled per prompt; advantages are relative to the prompt's group."""

    max_new_tokens: int = 32
    """Completion budget per rollout."""

    temperature: float = 1.0
    """Sampling temperature of rollouts; the policy loss uses log-probs at this temperature."""

    clip_low: float = 0.2
    """PPO ratio clip below: ratio >= 1 - clip_low."""

    clip_high: float = 0.2
    """PPO ratio clip above: ratio <= 1 + clip_high."""

    scale_advantages: bool = True
    """Divide group-centred rewards by the group's std (GRPO); off = centring only (Dr. GRPO)."""

    kl_beta: float = 0.0
    """Weight of the k3 KL to the initial policy (a frozen copy is kept when > 0)."""

    baseline_interval: int = 10
    """Every this many steps (and at the first), generate the step's prompts again with the
    frozen initial draft and without speculation, for the co-trained/frozen/no-spec comparison;
    0 = never."""

    rollout_retries: int = 1
    """A rollout that raises is retried this many times on a rebuilt engine, then the run stops."""

    def validate(self) -> None:
        _check(self.prompts_per_step >= 1, "rl.prompts_per_step", self.prompts_per_step, ">= 1")
        _check(self.group_size >= 2, "rl.group_size", self.group_size, ">= 2 (advantages compare a group)")
        _check(self.max_new_tokens >= 1, "rl.max_new_tokens", self.max_new_tokens, ">= 1")
        _check(self.temperature > 0, "rl.temperature", self.temperature, "> 0 (RL samples its rollouts)")
        _check(0 <= self.clip_low < 1, "rl.clip_low", self.clip_low, "in [0, 1)")
        _check(self.clip_high >= 0, "rl.clip_high", self.clip_high, ">= 0")
        _check(self.kl_beta >= 0, "rl.kl_beta", self.kl_beta, ">= 0")
        _check(self.baseline_interval >= 0, "rl.baseline_interval", self.baseline_interval, ">= 0 (0 = never)")
        _check(self.rollout_retries >= 0, "rl.rollout_retries", self.rollout_retries, ">= 0")


@dataclass(kw_only=True)
class TitanSpecConfig:
    job: JobConfig = field(default_factory=JobConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_scheduler: LRSchedulersContainer.Config = field(default_factory=LRSchedulersContainer.Config)
    checkpoint: CheckpointManager.Config = field(default_factory=CheckpointManager.Config)
    activation_checkpoint: ActivationCheckpointConfig = field(default_factory=ActivationCheckpointConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    metrics: MetricsProcessor.Config = field(default_factory=MetricsProcessor.Config)
    comm: CommConfig = field(default_factory=CommConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    profiler: Profiler.Config = field(default_factory=Profiler.Config)
    draft: DraftConfig = field(default_factory=DraftConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    rl: RLConfig = field(default_factory=RLConfig)

    source: str = field(default="<defaults>", metadata={"internal": True})
    origins: dict[str, str] = field(default_factory=dict, metadata={"internal": True})
    """Where each set key's value came from: dotted key -> the TOML path or 'command line'."""

    def locate(self, e: ConfigError) -> ConfigError:
        """``e`` prefixed with where its value came from: 'command line --KEY' when the key at
        fault (``e.key``, else the first key the message names) was set on the command line,
        else the TOML file."""
        key = e.key or next((k for k in _DOTTED.findall(str(e)) if k in self.origins), "")
        if self.origins.get(key) == _CLI:
            msg = str(e).removeprefix(f"{key}: ")  # the prefix names the key already
            return ConfigError(f"{_CLI} --{key}: {msg}", key=key)
        return ConfigError(f"{self.source}: {e}", key=key)

    def validate(self, world_size: int | None = None) -> None:
        """Checks that span sections. world_size None: read WORLD_SIZE (default 1)."""
        for f in _fields(self):
            sub = getattr(self, f.name)
            if hasattr(sub, "validate"):
                sub.validate()
        t, p = self.training, self.parallelism
        _check(t.steps >= 1, "training.steps", t.steps, ">= 1")
        _check(t.seq_len >= 8, "training.seq_len", t.seq_len, ">= 8")
        _check(t.local_batch_size >= 1, "training.local_batch_size", t.local_batch_size, ">= 1")
        _check(t.max_norm > 0, "training.max_norm", t.max_norm, "> 0")
        _check(t.max_consecutive_skips >= 1, "training.max_consecutive_skips", t.max_consecutive_skips, ">= 1")
        _check(self.metrics.log_freq >= 1, "metrics.log_freq", self.metrics.log_freq, ">= 1")
        _check(self.checkpoint.interval >= 1, "checkpoint.interval", self.checkpoint.interval, ">= 1")
        if self.checkpoint.enable:
            _check(bool(self.checkpoint.folder.strip()), "checkpoint.folder", self.checkpoint.folder,
                   "a non-empty path (relative to job.dump_folder)")
        for name in (
            "data_parallel_replicate_degree", "tensor_parallel_degree", "pipeline_parallel_degree",
            "context_parallel_degree", "expert_parallel_degree",
        ):
            _check(getattr(p, name) >= 1, f"parallelism.{name}", getattr(p, name), ">= 1")
        shard = p.data_parallel_shard_degree
        _check(shard == -1 or shard >= 1, "parallelism.data_parallel_shard_degree", shard, "-1 (fill) or >= 1")
        if world_size is None:
            world_size = int(os.environ.get("WORLD_SIZE", "1"))
        others = (
            p.data_parallel_replicate_degree * p.tensor_parallel_degree
            * p.pipeline_parallel_degree * p.context_parallel_degree
        )
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
        cp = p.context_parallel_degree
        if cp > 1:
            # Every document is padded to a multiple of 2*cp; a budget that is one keeps
            # padded positions inside the row (and the rotary table).
            _check(t.seq_len % (2 * cp) == 0, "training.seq_len", t.seq_len,
                   f"a multiple of 2 * parallelism.context_parallel_degree = {2 * cp} (zigzag split)")
            if p.pipeline_parallel_degree > 1 and self.document_multiple() % (2 * cp):
                raise ConfigError(
                    f"task.document_multiple = {self.task.document_multiple} under pipeline x context parallelism "
                    f"must be a multiple of 2 * context_parallel_degree = {2 * cp} (or 0 = automatic), so every "
                    "CP shard of a microbatch has the pipeline's static length"
                )
            if self.rl.enable:
                raise ConfigError("parallelism.context_parallel_degree > 1 with rl.enable = true is not "
                                  "supported yet (the RL loop does not shard its batches); use cp = 1")
        m = self.document_multiple()
        _check(t.seq_len % m == 0, "training.seq_len", t.seq_len, f"a multiple of the document multiple {m}")
        for name in ("tensor_parallel_degree", "expert_parallel_degree"):
            if getattr(p, name) > 1:
                raise ConfigError(
                    f"parallelism.{name} = {getattr(p, name)} is not supported yet; titan_spec runs data "
                    "parallel (FSDP), pipeline parallel and context parallel now"
                )
        if self.rl.enable:
            self._validate_rl(world_size)

    def document_multiple(self) -> int:
        """task.document_multiple resolved (0 = automatic, see its docstring)."""
        if self.task.document_multiple:
            return self.task.document_multiple
        p = self.parallelism
        both = p.pipeline_parallel_degree > 1 and p.context_parallel_degree > 1
        return 2 * p.context_parallel_degree if both else 1

    def check_paths(self, made: typing.Container[str] = ()) -> None:
        """Inputs named by the config exist. ``made``: absolute paths of directories that an
        earlier run of the job.requires chain writes (``titan_spec.train.plan_runs`` checks
        what they will hold against this run instead)."""
        for key in ("model.hf_checkpoint", "draft.init_from"):
            d = getattr(getattr(self, key.split(".")[0]), key.split(".")[1])
            if d and os.path.abspath(d) not in made and not os.path.isdir(d):
                raise ConfigError(f"{key} {d!r} is not a directory", key=key)
        if self.task.name == "jsonl":
            from titan_spec.data.tasks import build_task

            try:
                build_task(self.task)
            except (OSError, ValueError) as e:
                raise ConfigError(f"task.path: {e}", key="task.path") from None
        if self.rollout.engine == "sglang":
            files = not {os.path.abspath(self.model.hf_checkpoint), os.path.abspath(self.draft.init_from)} & set(made)
            self._validate_sglang(files)

    def _validate_rl(self, world_size: int) -> None:
        rl, d, sp = self.rl, self.draft, self.speculative
        if d.enable and d.co_train and not sp.enabled:
            raise ConfigError(
                "draft.co_train = true needs speculative.enabled = true (a co-trained draft serves the "
                "rollouts); for the no-speculation baseline set draft.enable = false or draft.co_train = false"
            )
        if sp.enabled and not d.enable:
            raise ConfigError("speculative.enabled = true in RL needs a draft: set draft.enable = true "
                              "(with draft.init_from), or speculative.enabled = false")
        if d.offline:
            raise ConfigError("draft.offline = true freezes the policy, which RL trains; use it in a warm-start run")
        if self.rollout.engine == "sglang" and world_size > 1 and self.rollout.sglang.tp_size > 1:
            raise ConfigError(
                f"rollout.sglang.tp_size = {self.rollout.sglang.tp_size} with {world_size} trainer processes: "
                "one SGLang server runs per rank on that rank's GPU, so tp_size must be 1 (docs/rollout_engine.md)"
            )
        dp = world_size // max(self.parallelism.context_parallel_degree * self.parallelism.pipeline_parallel_degree, 1)
        if rl.prompts_per_step % max(dp, 1):
            raise ConfigError(
                f"rl.prompts_per_step = {rl.prompts_per_step} must be a multiple of the {dp} data-parallel ranks"
            )

    def _validate_sglang(self, files: bool = True) -> None:
        if not self.model.hf_checkpoint:
            raise ConfigError("rollout.engine = 'sglang' needs model.hf_checkpoint: SGLang loads the policy from a local HF directory")
        if not self.speculative.enabled:
            return
        if not self.draft.init_from:
            raise ConfigError(
                "rollout.engine = 'sglang' with speculative.enabled needs draft.init_from: the exported EAGLE-3 "
                "draft directory SGLang starts from (train one with --draft.offline true)"
            )
        from titan_spec.models.hf_io import read_hf_arch
        from titan_spec.rollout.sglang.engine import MANAGED_SERVER_ARGS
        from titan_spec.rollout.weight_names import check_draft_fits_policy, sglang_tap_misfit

        clash = sorted(set(self.rollout.sglang.server_args) & set(MANAGED_SERVER_ARGS))
        if clash:
            raise ConfigError(f"rollout.sglang.server_args sets {clash}, which titan_spec sets itself; use the [rollout.sglang] keys")
        if not files:  # an earlier run writes them; train.draft_arch_for checks the promised draft
            return
        try:
            check_draft_fits_policy(self.model.hf_checkpoint, self.draft.init_from)
            why = self.draft.tap_layer_ids and sglang_tap_misfit(
                self.draft.tap_layer_ids, read_hf_arch(self.model.hf_checkpoint).n_layers)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if why:
            raise ConfigError(f"draft.tap_layer_ids: {why} (rollout.engine = 'sglang')")


def _check(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{key} = {value!r} is not allowed; it must be {allowed}", key=key)


_CLI = "command line"
_DOTTED = re.compile(r"\b[a-z_]+(?:\.[a-z_]+)+\b")


def _non_finite(value: Any) -> bool:
    """A float inf/nan anywhere in value (TOML and the command line both spell them inf, nan)."""
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, (list, tuple)):
        return any(_non_finite(v) for v in value)
    if isinstance(value, dict):
        return any(_non_finite(v) for v in value.values())
    return False


def _fields(obj_or_cls) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(obj_or_cls) if not f.name.startswith("_") and not f.metadata.get("internal")]


# ---------------------------------------------------------------------------
# Typed assignment
# ---------------------------------------------------------------------------

_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp) if a is not type(None))
    if origin in (list, tuple):
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        return f"a list of {_type_name(args[0]) if args else 'values'}"
    if origin is dict:
        return "a table"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


_NO = object()


def _coerce(value: Any, tp: Any) -> Any:
    """value (from TOML) as type tp, or _NO."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin is Literal:
        return value if value in typing.get_args(tp) else _NO
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            if arg is type(None):
                continue
            out = _coerce(value, arg)
            if out is not _NO:
                return out
        return _NO
    if origin in (list, tuple):
        if not isinstance(value, list):
            return _NO
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        items = [_coerce(v, args[0]) if args else v for v in value]
        if any(i is _NO for i in items):
            return _NO
        return items if origin is list else tuple(items)
    if origin is dict:
        return value if isinstance(value, dict) else _NO
    if tp is bool:
        return value if isinstance(value, bool) else _NO
    if tp is int:
        return value if isinstance(value, int) and not isinstance(value, bool) else _NO
    if tp is float:
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else _NO
    if tp is str:
        return value if isinstance(value, str) else _NO
    return _NO


def _assign(obj: Any, table: dict, where: str, path: str, origins: dict[str, str]) -> None:
    cls = type(obj)
    fields = {f.name: f for f in _fields(cls)}
    hints = _hints(cls)
    for key, value in table.items():
        dotted = f"{path}.{key}" if path else key
        here = f"{where} --{dotted}" if where == _CLI else where
        if key not in fields:
            valid = sorted(fields)
            near = difflib.get_close_matches(key, valid, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            kind = "key" if path else "section"
            raise ConfigError(
                f"{where}: unknown {kind} {dotted!r}{hint}; valid {kind}s"
                f"{' of [' + path + ']' if path else ''}: {', '.join(valid)}"
            )
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current) and not isinstance(current, type):
            if not isinstance(value, dict):
                raise ConfigError(f"{here}: {dotted} must be a table [{dotted}], got {value!r}")
            _assign(current, value, where, dotted, origins)
            continue
        tp = hints[key]
        out = _coerce(value, tp)
        if out is _NO:
            raise ConfigError(f"{here}: {dotted} = {value!r} has the wrong type; it must be {_type_name(tp)}")
        # The ONE finiteness check of every numeric key: an inf/nan learning rate, temperature or
        # norm would be accepted by each section's range checks (inf > 0) and poison training.
        if _non_finite(out):
            raise ConfigError(f"{here}: {dotted} = {value!r} is not allowed; it must be finite (not inf or nan)",
                              key=dotted)
        setattr(obj, key, out)
        origins[dotted] = where


# ---------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """['--training.steps', '5', '--compile.enable', 'true'] -> nested dict of TOML values."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg[2:]:
            raise ConfigError(f"command line: {arg!r} is not an override; use --section.key value")
        key = arg[2:]
        if "=" in key:
            key, raw = key.split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"command line: --{key} has no value; use --{key} VALUE")
            raw = args[i + 1]
            i += 2
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw  # bare words are strings: --job.dump_folder ./out
        if isinstance(value, str) and raw.lower() in ("true", "false"):
            value = raw.lower() == "true"
        node = out
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return out


@contextlib.contextmanager
def quiet_torchtitan():
    """torchtitan config dataclasses built without the warnings they log about their own defaults."""
    # torchtitan's default CheckpointManager.Config warns about its own default
    # (initial_load_model_only without initial_load_path) each time one is built.
    level = tt_logger.level
    tt_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        tt_logger.setLevel(level)


def load_config(
    path: str | None, overrides: list[str] | None = None, world_size: int | None = None, check_paths: bool = True
) -> TitanSpecConfig:
    """Read, type-check and validate a config. Raises ConfigError with a one-line message."""
    with quiet_torchtitan():
        cfg = TitanSpecConfig()
    if path:
        if not os.path.isfile(path):
            raise ConfigError(f"config file {path!r} does not exist")
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML: {e}") from None
        for key, value in data.items():
            if not isinstance(value, dict):
                valid = ", ".join(f.name for f in _fields(cfg))
                raise ConfigError(f"{path}: top-level key {key!r} must be inside a [section]; sections: {valid}")
        _assign(cfg, data, path, "", cfg.origins)
        cfg.source = path
    if overrides:
        _assign(cfg, parse_overrides(overrides), _CLI, "", cfg.origins)
    try:
        cfg.validate(world_size)
        if check_paths:
            cfg.check_paths()
    except ConfigError as e:
        raise cfg.locate(e) from None
    return cfg
