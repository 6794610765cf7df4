"""Target architectures: named flavors and HF ``config.json`` -> torchtitan model configs.

An ``Arch`` is the handful of numbers that define a Qwen3 / Llama3 decoder, dense or
(Qwen3) mixture-of-experts. Named flavors (ours for CPU, torchtitan's up to 8B dense and
30B-A3B / 235B-A22B MoE) and HF checkpoints (``Qwen3ForCausalLM``, ``Qwen3MoeForCausalLM``,
``LlamaForCausalLM``) both become an ``Arch``, and one builder turns an ``Arch`` into
torchtitan's model config, so a checkpoint and a flavor of the same shape build the same
module tree.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear
from torchtitan.models.common.moe import MoE, TokenChoiceTopKRouter
from torchtitan.models.common.nn_modules import RMSNorm

from titan_spec.models.moe import use_exact_experts
from titan_spec.models.target import set_norm_eps, to_tapped_config, use_doc_attention

__all__ = [
    "Arch",
    "FAMILIES",
    "flavor_arch",
    "arch_from_hf_config",
    "arch_to_hf_config",
    "build_target_config",
    "parameter_count",
    "active_parameter_count",
]

FAMILIES = ("qwen3", "llama3")


@dataclass(frozen=True)
class Arch:
    family: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_dim: int
    rope_theta: float
    max_seq_len: int
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    rope_scaling: tuple[tuple[str, float], ...] = ()
    """Llama-3 style rope scaling (factor, low/high_freq_factor, original_max_position_embeddings)."""
    num_experts: int = 0
    """Routed experts of every decoder layer's MoE feed-forward (Qwen3-MoE); 0 = dense.
    With experts, ``hidden_dim`` is only carried (HF ``intermediate_size``), not built."""
    moe_top_k: int = 0
    """Experts each token is routed to (HF ``num_experts_per_tok``)."""
    moe_hidden_dim: int = 0
    """Hidden width of each expert (HF ``moe_intermediate_size``)."""
    moe_norm_topk: bool = True
    """Renormalize the top-k routing weights to sum to 1 (HF ``norm_topk_prob``; Qwen3-MoE: true)."""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


# CPU flavors. 8 layers so the default tap ids (1, L//2-1, L-4) = (1, 3, 4) are distinct.
_FLAVORS: dict[str, dict[str, Arch]] = {
    "qwen3": {
        "tiny": Arch("qwen3", 256, 64, 8, 4, 2, 16, 192, 1e6, 2048, tie_embeddings=True),
        "small": Arch("qwen3", 256, 128, 8, 4, 2, 32, 384, 1e6, 4096, tie_embeddings=True),
        # tiny's width and depth with 2 heads of 32 (tiny has 4 of 16): vLLM's CPU attention
        # has no head_dim 16 kernel, so the vLLM chain (train_configs/debug_cpu_vllm*.toml)
        # trains this one.
        "tiny_hd32": Arch("qwen3", 256, 64, 8, 2, 1, 32, 192, 1e6, 2048, tie_embeddings=True),
        # tiny's width at twice the depth: the rollout benchmark's target, so that one draft
        # layer is a smaller share of a target step (real EAGLE-3 pairs: 1 layer vs 32+).
        "tiny16": Arch("qwen3", 256, 64, 16, 4, 2, 16, 192, 1e6, 2048, tie_embeddings=True),
        # tiny's shape with a 64K rotary table: the long-context task (train_configs/long_context_cpu*.toml)
        # and bench/rl_scale.py run sequences of 8K-32K tokens.
        "tiny_long": Arch("qwen3", 256, 64, 8, 4, 2, 16, 192, 1e6, 65536, tie_embeddings=True),
        "0.6B": Arch("qwen3", 151936, 1024, 28, 16, 8, 128, 3072, 1e6, 40960, tie_embeddings=True),
        "1.7B": Arch("qwen3", 151936, 2048, 28, 16, 8, 128, 6144, 1e6, 40960, tie_embeddings=True),
        "4B": Arch("qwen3", 151936, 2560, 36, 32, 8, 128, 9728, 1e6, 40960, tie_embeddings=True),
        "8B": Arch("qwen3", 151936, 4096, 36, 32, 8, 128, 12288, 1e6, 40960),
        # Qwen3-MoE. tiny_moe: tiny's attention with 8 experts of width 32, top-2 (CPU tests);
        # debugmodel_moe, 30B-A3B, 235B-A22B: torchtitan's shapes (qwen3_configs), the last
        # two those of the published Qwen3-30B-A3B / Qwen3-235B-A22B config.json files.
        "tiny_moe": Arch("qwen3", 256, 64, 8, 4, 2, 16, 192, 1e6, 2048, num_experts=8, moe_top_k=2, moe_hidden_dim=32),
        "debugmodel_moe": Arch(
            "qwen3", 2048, 256, 8, 16, 8, 128, 3072, 1e6, 4096, num_experts=64, moe_top_k=8, moe_hidden_dim=768
        ),
        "30B-A3B": Arch(
            "qwen3", 151936, 2048, 48, 32, 4, 128, 6144, 1e6, 40960, num_experts=128, moe_top_k=8, moe_hidden_dim=768
        ),
        "235B-A22B": Arch(
            "qwen3", 151936, 4096, 94, 64, 4, 128, 12288, 1e6, 40960, num_experts=128, moe_top_k=8, moe_hidden_dim=1536
        ),
    },
    "llama3": {
        "tiny": Arch("llama3", 256, 64, 8, 4, 2, 16, 192, 5e5, 2048, norm_eps=1e-5),
        "1B": Arch(
            "llama3",
            128256,
            2048,
            16,
            32,
            8,
            64,
            8192,
            5e5,
            131072,
            1e-5,
            True,
            (
                ("factor", 32.0),
                ("low_freq_factor", 1.0),
                ("high_freq_factor", 4.0),
                ("original_max_position_embeddings", 8192),
            ),
        ),
        "8B": Arch(
            "llama3",
            128256,
            4096,
            32,
            32,
            8,
            128,
            14336,
            5e5,
            131072,
            1e-5,
            False,
            (
                ("factor", 8.0),
                ("low_freq_factor", 1.0),
                ("high_freq_factor", 4.0),
                ("original_max_position_embeddings", 8192),
            ),
        ),
    },
}


def flavor_arch(family: str, flavor: str) -> Arch:
    if family not in _FLAVORS:
        raise ValueError(f"model.name {family!r} is not known; allowed: {', '.join(FAMILIES)}")
    if flavor not in _FLAVORS[family]:
        raise ValueError(f"model.flavor {flavor!r} is not a {family} flavor; allowed: {', '.join(_FLAVORS[family])}")
    return _FLAVORS[family][flavor]


def _rope_theta(cfg: dict) -> float:
    # transformers >= 5 writes the theta inside rope_parameters; the Hub's files at the top level.
    return float(cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)))


def arch_from_hf_config(cfg: dict, where: str = "config.json") -> Arch:
    """HF ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM`` / ``LlamaForCausalLM`` config -> Arch."""
    model_type = cfg.get("model_type")
    family = {"qwen3": "qwen3", "qwen3_moe": "qwen3", "llama": "llama3"}.get(model_type)
    if family is None:
        raise ValueError(f"{where}: model_type {model_type!r} is not supported; allowed: 'qwen3', 'qwen3_moe', 'llama'")
    try:
        n_heads = int(cfg["num_attention_heads"])
        dim = int(cfg["hidden_size"])
        scaling = cfg.get("rope_scaling") or {}
        if scaling and scaling.get("rope_type", scaling.get("type")) not in ("llama3",):
            raise ValueError(f"{where}: rope_scaling {scaling} is not supported (only llama3)")
        moe = {}
        if model_type == "qwen3_moe":
            # torchtitan builds every layer sparse: HF's dense-layer options must be off.
            if int(cfg.get("decoder_sparse_step", 1)) != 1 or cfg.get("mlp_only_layers"):
                raise ValueError(
                    f"{where}: decoder_sparse_step {cfg.get('decoder_sparse_step')} / mlp_only_layers "
                    f"{cfg.get('mlp_only_layers')} are not supported (every layer must be MoE: 1 / [])"
                )
            experts = cfg.get("num_experts", cfg.get("num_local_experts"))
            if experts is None:
                raise KeyError("num_experts")
            moe = dict(
                num_experts=int(experts),
                moe_top_k=int(cfg["num_experts_per_tok"]),
                moe_hidden_dim=int(cfg["moe_intermediate_size"]),
                moe_norm_topk=bool(cfg.get("norm_topk_prob", False)),
            )
        return Arch(
            family=family,
            vocab_size=int(cfg["vocab_size"]),
            dim=dim,
            n_layers=int(cfg["num_hidden_layers"]),
            n_heads=n_heads,
            n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
            head_dim=int(cfg.get("head_dim") or dim // n_heads),
            hidden_dim=int(cfg["intermediate_size"]),
            rope_theta=_rope_theta(cfg),
            max_seq_len=int(cfg.get("max_position_embeddings", 4096)),
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            rope_scaling=tuple(
                (k, float(scaling[k]))
                for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
                if k in scaling
            ),
            **moe,
        )
    except KeyError as e:
        raise ValueError(f"{where}: missing field {e.args[0]!r}") from None


def arch_to_hf_config(arch: Arch) -> dict:
    cfg = {
        "architectures": ["Qwen3ForCausalLM" if arch.family == "qwen3" else "LlamaForCausalLM"],
        "model_type": "qwen3" if arch.family == "qwen3" else "llama",
        "vocab_size": arch.vocab_size,
        "hidden_size": arch.dim,
        "num_hidden_layers": arch.n_layers,
        "num_attention_heads": arch.n_heads,
        "num_key_value_heads": arch.n_kv_heads,
        "head_dim": arch.head_dim,
        "intermediate_size": arch.hidden_dim,
        "rope_theta": arch.rope_theta,
        "max_position_embeddings": arch.max_seq_len,
        "rms_norm_eps": arch.norm_eps,
        "tie_word_embeddings": arch.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "torch_dtype": "float32",
    }
    if arch.rope_scaling:
        cfg["rope_scaling"] = {"rope_type": "llama3", **dict(arch.rope_scaling)}
    if arch.is_moe:
        cfg.update(
            {
                "architectures": ["Qwen3MoeForCausalLM"],
                "model_type": "qwen3_moe",
                "num_experts": arch.num_experts,
                "num_experts_per_tok": arch.moe_top_k,
                "moe_intermediate_size": arch.moe_hidden_dim,
                "norm_topk_prob": arch.moe_norm_topk,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [],
            }
        )
    return cfg


def _rope(arch: Arch, max_seq_len: int):
    if arch.family == "qwen3":
        return CosSinRoPE.Config(dim=arch.head_dim, max_seq_len=max_seq_len, theta=arch.rope_theta)
    scaling = dict(arch.rope_scaling)
    if not scaling:
        return ComplexRoPE.Config(dim=arch.head_dim, max_seq_len=max_seq_len, theta=arch.rope_theta)
    return ComplexRoPE.Config(
        dim=arch.head_dim,
        max_seq_len=max_seq_len,
        theta=arch.rope_theta,
        scaling="llama",
        scaling_factor=scaling.get("factor", 8.0),
        low_freq_factor=scaling.get("low_freq_factor", 1.0),
        high_freq_factor=scaling.get("high_freq_factor", 4.0),
        original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 8192)),
    )


MOE_BALANCE_BUFFER_COEFF = 1e-3
"""torchtitan's default load_balance_coeff, which every MoE layer is built with so that it
holds its ``expert_bias_E`` buffer (zeros: the routing of the HF model) in every copy of the
target (trainer, engines, reference); the bias moves only where the trainer registers
torchtitan's balancing hook (model.moe_load_balance_coeff > 0), at that config's rate."""


def build_target_config(
    arch: Arch,
    tap_layer_ids: tuple[int, ...] = (),
    max_seq_len: int | None = None,
    load_balance_coeff: float | None = None,
):
    """Arch -> torchtitan (tapped) model config with titan_spec's document attention.
    MoE: torchtitan's Qwen3-MoE layers, experts exact in fp32 (models/moe.py), every layer
    with a routing-bias buffer; ``load_balance_coeff`` (> 0) is the rate torchtitan's
    balancing hook moves it at (MOE_BALANCE_BUFFER_COEFF when None)."""
    # torchtitan's layer builders are the single source of the block structure and inits.
    # Separate wq/wk/wv (fuse_qkv=False): the fused layout renames keys in state-dict
    # hooks, which breaks loading full HF tensors into FSDP-sharded (DTensor) params.
    seq = max_seq_len or arch.max_seq_len
    if arch.family == "qwen3":
        from torchtitan.models import qwen3 as fam
        from torchtitan.models.qwen3.model import Qwen3Model as ModelCls

        common = dict(
            n_layers=arch.n_layers,
            dim=arch.dim,
            n_heads=arch.n_heads,
            n_kv_heads=arch.n_kv_heads,
            head_dim=arch.head_dim,
            attn_backend="flex",
            rope=_rope(arch, seq),
            fuse_qkv=False,
        )
        if arch.is_moe:
            # "standard" dispatch: torchtitan's all-to-all under expert parallelism, its local
            # argsort/scatter-add dispatcher without (ep_mesh None).
            layers = fam._build_qwen3_moe_layers(
                **common,
                moe_hidden_dim=arch.moe_hidden_dim,
                num_experts=arch.num_experts,
                top_k=arch.moe_top_k,
                moe_comm_backend="standard",
            )
        else:
            layers = fam._build_qwen3_layers(**common, hidden_dim=arch.hidden_dim)
        lin_init, emb_init = fam._LINEAR_INIT, fam._EMBEDDING_SKIP_INIT if arch.tie_embeddings else fam._EMBEDDING_INIT
        norm_init = fam._NORM_INIT
    elif arch.family == "llama3":
        from torchtitan.models import llama3 as fam
        from torchtitan.models.llama3.model import Llama3Model as ModelCls

        if arch.head_dim * arch.n_heads != arch.dim:
            raise ValueError("llama3 needs head_dim * n_heads == dim")
        layers = fam._build_llama3_layers(
            n_layers=arch.n_layers,
            dim=arch.dim,
            n_heads=arch.n_heads,
            n_kv_heads=arch.n_kv_heads,
            hidden_dim=arch.hidden_dim,
            attn_backend="flex",
            rope=_rope(arch, seq),
            fuse_qkv=False,
        )
        lin_init, emb_init = fam._LINEAR_INIT, fam._EMBEDDING_SKIP_INIT if arch.tie_embeddings else fam._EMBEDDING_INIT
        norm_init = fam._NORM_INIT
    else:
        raise ValueError(f"model family {arch.family!r} is not known; allowed: {', '.join(FAMILIES)}")
    config = ModelCls.Config(
        vocab_size=arch.vocab_size,
        dim=arch.dim,
        norm=RMSNorm.Config(normalized_shape=arch.dim, eps=arch.norm_eps, param_init=norm_init),
        enable_weight_tying=arch.tie_embeddings,
        tok_embeddings=Embedding.Config(num_embeddings=arch.vocab_size, embedding_dim=arch.dim, param_init=emb_init),
        lm_head=Linear.Config(in_features=arch.dim, out_features=arch.vocab_size, param_init=lin_init),
        layers=layers,
    )
    set_norm_eps(config, arch.norm_eps)
    if arch.is_moe:
        _configure_moe(config, arch, load_balance_coeff or MOE_BALANCE_BUFFER_COEFF)
    # Qwen3's q/k norms are over head_dim with the same eps (HF uses rms_norm_eps for both).
    use_doc_attention(config)
    return to_tapped_config(config, tap_layer_ids)


def _configure_moe(config, arch: Arch, coeff: float) -> None:
    for _, router, _, _ in config.traverse(TokenChoiceTopKRouter.Config):
        router.route_norm = arch.moe_norm_topk  # HF norm_topk_prob
    for _, moe, _, _ in config.traverse(MoE.Config):
        moe.load_balance_coeff = coeff
    use_exact_experts(config)


def parameter_count(arch: Arch) -> int:
    """Parameters of the target built for ``arch`` (on the meta device: nothing allocated);
    a tied lm_head counts once."""
    with torch.device("meta"):
        model = build_target_config(arch).build()
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def active_parameter_count(arch: Arch) -> int:
    """Parameters one token uses: all but the (num_experts - top_k) experts of every MoE layer
    it is not routed to (= parameter_count for a dense target)."""
    if not arch.is_moe:
        return parameter_count(arch)
    per_expert = 3 * arch.dim * arch.moe_hidden_dim  # w1, w3: F x D; w2: D x F
    return parameter_count(arch) - arch.n_layers * (arch.num_experts - arch.moe_top_k) * per_expert


def with_vocab(arch: Arch, vocab_size: int) -> Arch:
    return dataclasses.replace(arch, vocab_size=vocab_size)
