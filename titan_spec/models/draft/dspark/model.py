"""The DSpark draft: DFlash's block backbone (models/draft/dflash/model.py) plus two heads, laid
out as vLLM 0.32's ``Qwen3DSparkForCausalLM`` loads it (vllm/model_executor/models/qwen3_dspark.py,
architecture "Qwen3DSparkModel").

    markov_head.markov_w1:   Embedding(V -> Mr)   the previous token (target id)
    markov_head.markov_w2:   Linear(Mr -> Vd)     its transition bias, added to the block row's logits
    confidence_head.proj:    Linear(H + Mr -> 1)  the row's acceptance logit from the final-norm hidden
                                                  and the previous token's Markov embedding

A block of J rows (the known token y at position c, then J - 1 masked rows) proposes J tokens:
row k predicts position c + k + 1 (vLLM's anchor-as-first layout), so unlike DFlash every row
is a prediction. The Markov bias makes row k depend on the token drafted at row k - 1 (row 0:
on y): the backbone runs once, the heads left to right.

The directory is DFlash's (dflash/io.py) with ``architecture``, ``head_keys`` and
``config_extra`` below. vLLM embeds a masked row by the target's row of mask_token_id and
ignores mask_embedding.pt, which titan_spec trains and reads back (as for DFlash).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

import torch
import torch.nn as nn

from titan_spec.models.draft.dflash.model import DFlashArch, DFlashDraft
from titan_spec.models.draft.dspark.loss import spark_loss

__all__ = ["DSparkArch", "DSparkDraft"]


@dataclass(frozen=True)
class DSparkArch(DFlashArch):
    kind: ClassVar[str] = "dspark"
    architecture: ClassVar[str] = "Qwen3DSparkModel"

    markov_rank: int = 32
    """Mr: the rank of the Markov transition bias."""
    confidence: bool = True
    """The confidence head is built, trained and exported."""

    @staticmethod
    def from_dflash(d: DFlashArch, markov_rank: int, confidence: bool) -> "DSparkArch":
        return DSparkArch(
            **{f.name: getattr(d, f.name) for f in fields(DFlashArch)}, markov_rank=markov_rank, confidence=confidence
        )

    def head_keys(self) -> tuple[str, ...]:
        conf = ("confidence_head.proj.weight", "confidence_head.proj.bias") if self.confidence else ()
        return ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight", *conf)

    def config_extra(self) -> dict:
        # vLLM: block_size rows propose block_size tokens (num_speculative_tokens defaults to it).
        return {
            "markov_rank": self.markov_rank,
            "enable_confidence_head": self.confidence,
            "confidence_head_with_markov": True,
        }

    @staticmethod
    def extra_from_config(cfg_path: str, cfg: dict) -> dict:
        rank = cfg.get("markov_rank")
        if not (isinstance(rank, int) and not isinstance(rank, bool) and rank >= 1):
            raise ValueError(f"{cfg_path}: markov_rank = {rank!r} is not allowed; it must be an integer >= 1")
        confidence = bool(cfg.get("enable_confidence_head", False))
        if confidence and not cfg.get("confidence_head_with_markov", False):
            raise ValueError(
                f"{cfg_path}: confidence_head_with_markov = false is not read here; titan_spec's confidence "
                "head reads the hidden state and the Markov embedding (true)"
            )
        return {"markov_rank": rank, "confidence": confidence}

    def validate(self) -> None:
        super().validate()
        if self.markov_rank < 1:
            raise ValueError(f"draft.dspark.markov_rank = {self.markov_rank} must be >= 1")


class _MarkovHead(nn.Module):
    def __init__(self, a: DSparkArch):
        super().__init__()
        self.markov_w1 = nn.Embedding(a.vocab_size, a.markov_rank)
        self.markov_w2 = nn.Linear(a.markov_rank, a.draft_vocab_size, bias=False)


class _ConfidenceHead(nn.Module):
    def __init__(self, a: DSparkArch):
        super().__init__()
        self.proj = nn.Linear(a.hidden + a.markov_rank, 1, bias=True)


class DSparkDraft(DFlashDraft):
    def __init__(self, arch: DSparkArch):
        super().__init__(arch)
        self.markov_head = _MarkovHead(arch)
        self.confidence_head = _ConfidenceHead(arch) if arch.confidence else None

    def reset_parameters(self, std: float = 0.02) -> None:
        super().reset_parameters(std)
        nn.init.normal_(self.markov_head.markov_w1.weight, std=std)
        if self.confidence_head is not None:
            nn.init.zeros_(self.confidence_head.proj.bias)

    def forward(self, taps, embeds_TH, positions_Tg, plan, targets, weights, count_S=None, gather=None):
        """The DSpark loss (loss.py). Going through forward lets FSDP's hooks gather the parameters."""
        return spark_loss(self, taps, embeds_TH, positions_Tg, plan, targets, weights, count_S, gather)

    # --- the heads, shared by the loss and the cached proposer -----------------------------

    def markov_embed(self, prev_B: torch.Tensor) -> torch.Tensor:
        """m_BMr: the Markov embedding of the previous tokens (target ids)."""
        return self.markov_head.markov_w1(prev_B)

    def spark_logits(self, hn_BH: torch.Tensor, m_BMr: torch.Tensor) -> torch.Tensor:
        """logits_BVd of rows whose final-norm hidden is hn_BH and previous token's embedding m_BMr."""
        return self.lm_head(hn_BH) + self.markov_head.markov_w2(m_BMr.to(hn_BH.dtype))

    def confidence_logit(self, hn_BH: torch.Tensor, m_BMr: torch.Tensor) -> torch.Tensor:
        """The acceptance logit of each row (sigmoid: the head's estimate of P(accepted))."""
        x = torch.cat([hn_BH, m_BMr.to(hn_BH.dtype)], dim=-1)
        return self.confidence_head.proj(x).squeeze(-1)
