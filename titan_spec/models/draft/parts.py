"""What the draft kinds' modules share: the gated MLP, the vocabulary maps, the width checks.

Module and buffer names are the export names (``mlp.gate_proj``, ``d2t``, ``t2d``), which
SGLang, vLLM and SpecForge read for every kind.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GatedMLP", "VocabMaps", "init_draft_weights", "width_misfits"]


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), no biases: Llama's and Qwen3's MLP."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class VocabMaps:
    """Mixed into a draft module: the buffers d2t (draft id i is target id i + d2t[i]) and t2d
    (target id v is in the draft vocab), the identity until ``set_vocab_mapping``
    (models/draft/vocab.py ``build_vocab_mapping``)."""

    def register_vocab_maps(self, draft_vocab_size: int, vocab_size: int) -> None:
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(vocab_size, dtype=torch.bool)
        t2d[:draft_vocab_size] = True
        self.register_buffer("t2d", t2d)

    def set_vocab_mapping(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def draft_to_target_ids(self) -> torch.Tensor:
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t


def init_draft_weights(module: nn.Module, std: float = 0.02) -> None:
    """Every Linear N(0, std), every RMSNorm ones (SpecForge's init of a fresh draft)."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=std)
        elif isinstance(m, nn.RMSNorm):
            nn.init.ones_(m.weight)


def width_misfits(arch, target_vocab: int, target_dim: int, why_hidden: str) -> list[str]:
    """Why a draft of ``arch`` cannot serve a target of this vocabulary and width ([] = it fits);
    ``why_hidden`` says why the draft's own width must be the target's."""
    bad = []
    if arch.vocab_size != target_vocab:
        bad.append(f"draft vocab_size {arch.vocab_size} != target vocab {target_vocab}")
    if arch.target_hidden != target_dim:
        bad.append(f"draft target_hidden {arch.target_hidden} != target dim {target_dim}")
    if arch.hidden != target_dim:
        bad.append(f"draft hidden {arch.hidden} != target dim {target_dim} ({why_hidden})")
    return bad
