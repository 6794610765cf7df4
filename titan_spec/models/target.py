"""The policy / target model: torchtitan's Qwen3 or Llama3 decoder with feature taps.

One forward yields the logits AND the hidden states of the tap layers, so the draft's
training signal costs no second pass. Tap id k is the OUTPUT of decoder layer k
(0-based) = HF ``hidden_states[k+1]`` = SGLang ``layers_to_capture = k+1``.

Taps are read in the eager loop between decoder blocks. torchtitan compiles and
activation-checkpoints per block, so the taps sit outside every compiled or
checkpointed region: no graph break, nothing replayed on recompute.

Like torchtitan's ``_skip_lm_head``, tapping is a module attribute and not a forward
argument: pipeline stages call ``.requires_grad`` on every forward input.

Under tensor parallelism (torchtitan's own plan, ``Module.parallelize``) the decoder's
activations are DTensors on the tp mesh: between blocks they are sequence-sharded
(``Shard(1)``, sequence parallel) or replicated, and the logits are vocab-sharded
(``Shard(-1)``, for torchtitan's loss-parallel cross-entropy). The draft is a plain module
replicated over the tp group: every tap leaves the forward as the FULL local hidden state
(``full_local``: an all-gather of the sequence shards), so every tp rank feeds the draft
the same tensors and its gradients agree across the group by construction.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch.distributed.tensor import DTensor
from torchtitan.models.common.attention import AttentionMasksType, FlexAttention, VarlenAttention
from torchtitan.models.common.nn_modules import RMSNorm
from torchtitan.models.llama3 import Llama3Model
from torchtitan.models.qwen3 import Qwen3Model

from titan_spec.config.draft_kinds import tap_ids_problem
from titan_spec.models.attention import DocCausalAttention, doc_metadata_from_positions

__all__ = [
    "EMBEDS_TAP",
    "Taps",
    "TappedQwen3Model",
    "TappedLlama3Model",
    "default_tap_layer_ids",
    "full_local",
    "validate_tap_layer_ids",
    "to_tapped_config",
    "use_doc_attention",
]


def default_tap_layer_ids(n_layers: int) -> tuple[int, int, int]:
    """SpecForge / SGLang / NeMo-RL default: low, middle and late layer outputs."""
    return (1, n_layers // 2 - 1, n_layers - 4)


def validate_tap_layer_ids(ids: tuple[int, ...], n_layers: int) -> None:
    """ValueError unless the ids are distinct layers of an n_layers target
    (titan_spec.config.draft_kinds.tap_ids_problem, the one tap-id validator)."""
    why = tap_ids_problem(ids, n_layers)
    if why:
        raise ValueError(why)


def full_local(x: torch.Tensor) -> torch.Tensor:
    """A plain tensor holding all of ``x``: a DTensor (a tensor-parallel activation,
    sequence- or vocab-sharded) is gathered (``full_tensor``: differentiable, a collective
    on every rank of its mesh); anything else is returned as is."""
    return x.full_tensor() if isinstance(x, DTensor) else x


class Taps(NamedTuple):
    """What the draft reads from the target's training forward (detach before use)."""

    embeds_BLD: torch.Tensor
    """Token embeddings of the input (the draft shares the target's embedding)."""
    hidden: tuple[torch.Tensor, ...]
    """h_BLD of each tap layer, in tap_layer_ids order."""


EMBEDS_TAP = -1
"""Key of the token embeddings among a pipeline stage's stashed taps."""


class _TapMixin:
    """forward() and get_attention_masks() shared by the tapped Qwen3 and Llama3."""

    stash_taps: bool = False
    """Pipeline stages set this: forward then returns only its output (what the schedule
    sends on) and leaves the taps it holds in ``stashed_taps``, {layer id: h_BLD} plus
    {EMBEDS_TAP: embeds_BLD} on the stage with the embedding, for the TapChannel."""

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        attention_masks: AttentionMasksType | None = None,
    ):
        """Returns logits_BLV, or (logits_BLV, Taps) when the model has tap ids."""
        tap_ids = self.config.tap_layer_ids
        taps: dict[int, torch.Tensor] = {}
        h_BLD = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        embeds_BLD = h_BLD
        # Under tensor parallelism taps are gathered from their sequence shards (full_local).
        # Under PP a stage holds a slice of the layers; keys keep the global layer ids.
        for key, layer in self.layers.items():
            h_BLD = layer(h_BLD, attention_masks, positions)
            if int(key) in tap_ids:
                taps[int(key)] = full_local(h_BLD)
        h_BLD = self.norm(h_BLD) if self.norm is not None else h_BLD
        out = h_BLD
        if not self._skip_lm_head and self.lm_head is not None:
            out = self.lm_head(h_BLD)
        if not tap_ids:
            return out
        embeds_BLD = full_local(embeds_BLD)
        if self.stash_taps:
            if self.tok_embeddings is not None:
                taps[EMBEDS_TAP] = embeds_BLD
            self.stashed_taps = taps
            return out
        return out, Taps(embeds_BLD, tuple(taps[i] for i in tap_ids if i in taps))

    def get_attention_masks(self, positions: torch.Tensor) -> AttentionMasksType | None:
        attn = self.config.first_attention
        if attn is not None and isinstance(attn.inner_attention, DocCausalAttention.Config):
            return doc_metadata_from_positions(positions)
        return super().get_attention_masks(positions)


class TappedQwen3Model(_TapMixin, Qwen3Model):
    @dataclass(kw_only=True, slots=True)
    class Config(Qwen3Model.Config):
        tap_layer_ids: tuple[int, ...] = ()
        """Decoder layers whose outputs the forward also returns (empty: logits only)."""


class TappedLlama3Model(_TapMixin, Llama3Model):
    @dataclass(kw_only=True, slots=True)
    class Config(Llama3Model.Config):
        tap_layer_ids: tuple[int, ...] = ()
        """Decoder layers whose outputs the forward also returns (empty: logits only)."""


_TAPPED = {Qwen3Model.Config: TappedQwen3Model.Config, Llama3Model.Config: TappedLlama3Model.Config}


def to_tapped_config(config, tap_layer_ids: tuple[int, ...] = ()):
    """torchtitan's Qwen3/Llama3 config -> the tapped subclass (same fields + tap ids)."""
    tapped_cls = _TAPPED.get(type(config))
    if tapped_cls is None:
        raise TypeError(f"no tapped target for {type(config).__name__}; use Qwen3 or Llama3")
    validate_tap_layer_ids(tuple(tap_layer_ids), len(config.layers))
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    return tapped_cls(**values, tap_layer_ids=tuple(tap_layer_ids))


def use_doc_attention(config) -> None:
    """Swap every inner attention for titan_spec's document-causal attention (in place).

    torchtitan's flex backend has no backward on CPU and its varlen backend is
    CUDA/bf16 only; ours runs on both and returns the LSE that CP and TTT merge on.
    """
    for _, _, parent, attr in config.traverse((FlexAttention.Config, VarlenAttention.Config)):
        setattr(parent, attr, DocCausalAttention.Config())


def set_norm_eps(config, eps: float) -> None:
    for _, norm, _, _ in config.traverse(RMSNorm.Config):
        norm.eps = eps
