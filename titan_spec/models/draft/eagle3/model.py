"""The EAGLE-3 draft, laid out exactly as SGLang's ``LlamaForCausalLMEagle3`` / SpecForge.

    fc:        Linear(3*D -> H)             the three tapped target features -> draft hidden
    midlayer:  one decoder layer whose q/k/v read cat(input_layernorm(embed(tok)), hidden_norm(h))
    norm, lm_head: H -> Vd
    d2t[i]:    target id of draft id i is i + d2t[i];   t2d[v]: target id v is in the draft vocab

Module names are the export names, so the exported safetensors are this state dict.
The embedding is the target's (shared, never trained by the draft) and is passed in.

A draft step is split in two halves around attention, ``qkv`` and ``finish``, because
the attention differs by caller: training-time test uses branch attention over a
packed batch (models/draft/eagle3/ttt.py), the rollout engine a KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn as nn

from titan_spec.config.draft_kinds import DRAFT_KINDS, tap_ids_problem
from titan_spec.models.draft.eagle3.ttt import ttt_unroll
from titan_spec.models.draft.parts import GatedMLP, VocabMaps, init_draft_weights, width_misfits
from titan_spec.models.draft.rotary import apply_rotary

__all__ = ["DraftArch", "Eagle3Draft"]


@dataclass(frozen=True)
class DraftArch:
    kind: ClassVar[str] = "eagle3"
    """The draft kind (models/draft/__init__.py's registry) this arch belongs to."""

    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate: int
    target_hidden: int
    vocab_size: int
    """Target vocabulary size (the embedding's rows)."""
    draft_vocab_size: int
    rope_theta: float
    norm_eps: float
    max_seq_len: int
    tap_layer_ids: tuple[int, int, int]

    @staticmethod
    def from_target(arch, tap_layer_ids, draft_vocab_size: int) -> "DraftArch":
        """SpecForge's default: the draft layer has the target's width and heads."""
        return DraftArch(
            hidden=arch.dim,
            n_heads=arch.n_heads,
            n_kv_heads=arch.n_kv_heads,
            head_dim=arch.head_dim,
            intermediate=arch.hidden_dim,
            target_hidden=arch.dim,
            vocab_size=arch.vocab_size,
            draft_vocab_size=draft_vocab_size or arch.vocab_size,
            rope_theta=arch.rope_theta,
            norm_eps=arch.norm_eps,
            max_seq_len=arch.max_seq_len,
            tap_layer_ids=tuple(tap_layer_ids),
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

    def misfits(self, target_vocab: int, target_dim: int) -> list[str]:
        """Why this draft cannot serve a target of this vocabulary and width ([] = it fits).
        The draft reads the target's embeddings, so its own width is the target's too."""
        return width_misfits(self, target_vocab, target_dim, "the draft reads the target's embeddings")


class _Attention(nn.Module):
    def __init__(self, a: DraftArch):
        super().__init__()
        self.q_proj = nn.Linear(2 * a.hidden, a.n_heads * a.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * a.hidden, a.n_kv_heads * a.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * a.hidden, a.n_kv_heads * a.head_dim, bias=False)
        self.o_proj = nn.Linear(a.n_heads * a.head_dim, a.hidden, bias=False)


class _MidLayer(nn.Module):
    def __init__(self, a: DraftArch):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(a.hidden, eps=a.norm_eps)
        self.hidden_norm = nn.RMSNorm(a.hidden, eps=a.norm_eps)
        self.self_attn = _Attention(a)
        self.post_attention_layernorm = nn.RMSNorm(a.hidden, eps=a.norm_eps)
        self.mlp = GatedMLP(a.hidden, a.intermediate)


class Eagle3Draft(VocabMaps, nn.Module):
    def __init__(self, arch: DraftArch):
        super().__init__()
        arch.validate()
        self.arch = arch
        self.fc = nn.Linear(3 * arch.target_hidden, arch.hidden, bias=False)
        self.midlayer = _MidLayer(arch)
        self.norm = nn.RMSNorm(arch.hidden, eps=arch.norm_eps)
        self.lm_head = nn.Linear(arch.hidden, arch.draft_vocab_size, bias=False)
        self.register_vocab_maps(arch.draft_vocab_size, arch.vocab_size)

    def reset_parameters(self, std: float = 0.02) -> None:
        init_draft_weights(self, std)

    def forward(self, taps_T3D, embeds_TH, positions_T, meta, targets, decay: float = 0.8, count_S=None):
        """The training-time-test loss (models/draft/eagle3/ttt.py). Going through forward (not a helper
        function) lets FSDP's hooks gather the sharded parameters."""
        return ttt_unroll(self, taps_T3D, embeds_TH, positions_T, meta, targets, decay, count_S)

    # --- one draft step, split around attention -------------------------------------

    def qkv(self, h_TH: torch.Tensor, emb_TH: torch.Tensor, pos_T: torch.Tensor):
        """Returns (q_TNHd, k_TKvHd, v_TKvHd) with rotary applied at positions pos_T."""
        a, layer = self.arch, self.midlayer
        x = torch.cat([layer.input_layernorm(emb_TH), layer.hidden_norm(h_TH)], dim=-1)
        T = x.shape[0]
        q = layer.self_attn.q_proj(x).view(T, a.n_heads, a.head_dim)
        k = layer.self_attn.k_proj(x).view(T, a.n_kv_heads, a.head_dim)
        v = layer.self_attn.v_proj(x).view(T, a.n_kv_heads, a.head_dim)
        return apply_rotary(q, pos_T, a.rope_theta), apply_rotary(k, pos_T, a.rope_theta), v

    def finish(self, h_TH: torch.Tensor, attn_TNHd: torch.Tensor):
        """Returns (hidden_TH fed to the next step, logits_TVd)."""
        layer = self.midlayer
        r = h_TH + layer.self_attn.o_proj(attn_TNHd.flatten(1))
        out = r + layer.mlp(layer.post_attention_layernorm(r))
        return out, self.lm_head(self.norm(out))
