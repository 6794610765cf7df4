"""The DFlash block draft, laid out as vLLM 0.32's ``DFlashQwen3ForCausalLM`` loads it
(vllm/model_executor/models/qwen3_dflash.py, architecture "DFlashDraftModel").

    fc:            Linear(C*D -> H, no bias)    the tapped target features of a context position
    hidden_norm:   RMSNorm(H)                   ctx = hidden_norm(fc(taps)), shared by every layer
    layers[i]:     Qwen3 decoder layers (q_norm / k_norm per head, rotate-half rotary).
                   The queries are the block: the embedding of its known token, then
                   ``mask_embedding`` at each masked position. The keys and values are the context
                   rows (k_proj / v_proj of ctx, no input norm) and the block's own rows; inside
                   the block nothing is masked (vLLM's non-causal DFlash attention).
    norm, lm_head: H -> Vd;  d2t / t2d as EAGLE-3's (draft id i is target id i + d2t[i])
    mask_embedding: H   a masked position's input (trained here; vLLM reads it from mask_embedding.pt)

Module names are the export names. The draft step is split around attention (``block_qkv``,
``block_finish``), as EAGLE-3's is: training attends over a packed batch (loss.py), the
built-in engine over a KV cache (proposer.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn as nn

from titan_spec.config.draft_kinds import DRAFT_KINDS, tap_ids_problem
from titan_spec.models.draft.dflash.loss import block_loss
from titan_spec.models.draft.parts import GatedMLP, VocabMaps, init_draft_weights, width_misfits
from titan_spec.models.draft.rotary import apply_rotary

__all__ = ["DFlashArch", "DFlashDraft", "default_dflash_tap_ids"]


def default_dflash_tap_ids(n_layers: int, count: int = 3) -> tuple[int, ...]:
    """``count`` taps spread evenly over layers 1 .. n_layers - 3 (z-lab's DFlash rule), fewer
    on a target too shallow for that many distinct ones."""
    lo, hi = min(1, n_layers - 1), max(min(1, n_layers - 1), n_layers - 3)
    if count == 1:
        return (n_layers // 2,)
    return tuple(sorted({round(lo + i * (hi - lo) / (count - 1)) for i in range(count)}))


@dataclass(frozen=True)
class DFlashArch:
    kind: ClassVar[str] = "dflash"
    """The draft kind (models/draft/__init__.py's registry) this arch belongs to."""
    architecture: ClassVar[str] = "DFlashDraftModel"
    """config.json's ``architectures`` entry of its directory (io.py)."""

    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate: int
    n_layers: int
    """Decoder layers of the draft."""
    target_hidden: int
    vocab_size: int
    """Target vocabulary size."""
    draft_vocab_size: int
    rope_theta: float
    norm_eps: float
    max_seq_len: int
    tap_layer_ids: tuple[int, ...]
    block_size: int
    """Block rows: the known token, then block_size - 1 predicted (masked) positions."""
    mask_token_id: int
    """The target id a masked position stands for in the exported config (vLLM)."""

    @staticmethod
    def from_target(
        arch, tap_layer_ids, draft_vocab_size: int, block_size: int, n_layers: int, mask_token_id: int = -1
    ) -> "DFlashArch":
        """Decoder layers of the target's width and heads (as z-lab's and SpecForge's DFlash drafts)."""
        return DFlashArch(
            hidden=arch.dim,
            n_heads=arch.n_heads,
            n_kv_heads=arch.n_kv_heads,
            head_dim=arch.head_dim,
            intermediate=arch.hidden_dim,
            n_layers=n_layers,
            target_hidden=arch.dim,
            vocab_size=arch.vocab_size,
            draft_vocab_size=draft_vocab_size or arch.vocab_size,
            rope_theta=arch.rope_theta,
            norm_eps=arch.norm_eps,
            max_seq_len=arch.max_seq_len,
            tap_layer_ids=tuple(tap_layer_ids),
            block_size=block_size,
            mask_token_id=mask_token_id if mask_token_id >= 0 else arch.vocab_size - 1,
        )

    def validate(self) -> None:
        why = tap_ids_problem(self.tap_layer_ids, count=DRAFT_KINDS[self.kind])
        if why:
            raise ValueError(why)
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"draft.draft_vocab_size = {self.draft_vocab_size} must be in 1..{self.vocab_size} "
                "(the target vocabulary)"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"draft heads {self.n_heads} must be a multiple of kv heads {self.n_kv_heads}")
        if self.block_size < 2:
            raise ValueError(f"draft.dflash.block_size = {self.block_size} must be >= 2")
        if self.n_layers < 1:
            raise ValueError(f"draft.dflash.num_layers = {self.n_layers} must be >= 1")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"draft.dflash.mask_token_id = {self.mask_token_id} must be a target id in 0..{self.vocab_size - 1}"
            )

    def head_keys(self) -> tuple[str, ...]:
        """Tensors beyond the backbone's in the exported directory (a subclass's heads)."""
        return ()

    def config_extra(self) -> dict:
        """config.json fields beyond the backbone's."""
        return {}

    @staticmethod
    def extra_from_config(cfg_path: str, cfg: dict) -> dict:
        """This arch's own fields read back from config.json (``config_extra``'s inverse)."""
        return {}

    def misfits(self, target_vocab: int, target_dim: int) -> list[str]:
        """Why this draft cannot serve a target of this vocabulary and width ([] = it fits)."""
        return width_misfits(self, target_vocab, target_dim, "the block's known token is embedded by the target")


class _Attention(nn.Module):
    def __init__(self, a: DFlashArch):
        super().__init__()
        self.q_proj = nn.Linear(a.hidden, a.n_heads * a.head_dim, bias=False)
        self.k_proj = nn.Linear(a.hidden, a.n_kv_heads * a.head_dim, bias=False)
        self.v_proj = nn.Linear(a.hidden, a.n_kv_heads * a.head_dim, bias=False)
        self.o_proj = nn.Linear(a.n_heads * a.head_dim, a.hidden, bias=False)
        self.q_norm = nn.RMSNorm(a.head_dim, eps=a.norm_eps)
        self.k_norm = nn.RMSNorm(a.head_dim, eps=a.norm_eps)


class _Layer(nn.Module):
    def __init__(self, a: DFlashArch):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(a.hidden, eps=a.norm_eps)
        self.self_attn = _Attention(a)
        self.post_attention_layernorm = nn.RMSNorm(a.hidden, eps=a.norm_eps)
        self.mlp = GatedMLP(a.hidden, a.intermediate)


class DFlashDraft(VocabMaps, nn.Module):
    def __init__(self, arch: DFlashArch):
        super().__init__()
        arch.validate()
        self.arch = arch
        self.fc = nn.Linear(len(arch.tap_layer_ids) * arch.target_hidden, arch.hidden, bias=False)
        self.hidden_norm = nn.RMSNorm(arch.hidden, eps=arch.norm_eps)
        self.layers = nn.ModuleList(_Layer(arch) for _ in range(arch.n_layers))
        self.norm = nn.RMSNorm(arch.hidden, eps=arch.norm_eps)
        self.lm_head = nn.Linear(arch.hidden, arch.draft_vocab_size, bias=False)
        self.mask_embedding = nn.Parameter(torch.empty(arch.hidden))
        self.register_vocab_maps(arch.draft_vocab_size, arch.vocab_size)

    def reset_parameters(self, std: float = 0.02) -> None:
        init_draft_weights(self, std)
        nn.init.normal_(self.mask_embedding, std=std)

    def forward(self, taps, embeds_TH, positions_Tg, plan, targets, decay: float = 0.8, count_S=None, gather=None):
        """The block loss (loss.py). Going through forward lets FSDP's hooks gather the parameters."""
        return block_loss(self, taps, embeds_TH, positions_Tg, plan, targets, decay, count_S, gather)

    # --- the pieces, shared by the loss and the cached proposer ----------------------------

    def context(self, taps: tuple[torch.Tensor, ...] | torch.Tensor) -> torch.Tensor:
        """ctx_TH = hidden_norm(fc(cat(taps))); ``taps``: one [..., C*D] tensor or C [..., D] ones."""
        x = taps if isinstance(taps, torch.Tensor) else torch.cat(list(taps), dim=-1)
        return self.hidden_norm(self.fc(x))

    def context_kv(self, i: int, ctx_TH: torch.Tensor, pos_T: torch.Tensor):
        """Layer i's keys (k_norm, rotary at pos_T) and values of context rows -> (k_TKvHd, v_TKvHd)."""
        a, attn = self.arch, self.layers[i].self_attn
        T = ctx_TH.shape[0]
        k = attn.k_norm(attn.k_proj(ctx_TH).view(T, a.n_kv_heads, a.head_dim))
        return apply_rotary(k, pos_T, a.rope_theta), attn.v_proj(ctx_TH).view(T, a.n_kv_heads, a.head_dim)

    def block_qkv(self, i: int, h_QH: torch.Tensor, pos_Q: torch.Tensor):
        """Layer i's (q_QNHd, k_QKvHd, v_QKvHd) of block rows: input norm, projections, q/k norms, rotary."""
        a, layer = self.arch, self.layers[i]
        attn, Q = layer.self_attn, h_QH.shape[0]
        x = layer.input_layernorm(h_QH)
        q = attn.q_norm(attn.q_proj(x).view(Q, a.n_heads, a.head_dim))
        k = attn.k_norm(attn.k_proj(x).view(Q, a.n_kv_heads, a.head_dim))
        v = attn.v_proj(x).view(Q, a.n_kv_heads, a.head_dim)
        return apply_rotary(q, pos_Q, a.rope_theta), apply_rotary(k, pos_Q, a.rope_theta), v

    def block_finish(self, i: int, h_QH: torch.Tensor, attn_QNHd: torch.Tensor) -> torch.Tensor:
        """Layer i's output: the attention's residual, then the MLP's."""
        layer = self.layers[i]
        r = h_QH + layer.self_attn.o_proj(attn_QNHd.flatten(1))
        return r + layer.mlp(layer.post_attention_layernorm(r))

    def logits(self, h_QH: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h_QH))
