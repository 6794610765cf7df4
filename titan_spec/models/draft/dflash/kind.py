"""DFlash as a draft kind (``draft.kind = "dflash"``): models/draft/base.DraftKind over model.py
(the block draft), loss.py (its block loss), io.py (vLLM's directory) and proposer.py (the
built-in engine's block proposer).

Shape legend: B = batch rows, L = row length, T = B*L packed tokens, V = target vocab,
S = block_size - 1 loss positions.
"""

from __future__ import annotations

import torch

from titan_spec.config import DraftConfig
from titan_spec.models.attention import DocMetadata
from titan_spec.models.draft.base import DraftKind, DraftLossResult
from titan_spec.models.draft.dflash.io import (
    check_dflash_weights, dflash_mismatches, load_dflash_into, read_dflash_arch, save_dflash,
)
from titan_spec.models.draft.dflash.loss import block_plan, block_targets, block_valid
from titan_spec.models.draft.dflash.model import DFlashArch, DFlashDraft, default_dflash_tap_ids
from titan_spec.models.draft.dflash.proposer import CachedBlockDraft
from titan_spec.models.draft.vocab import build_vocab_mapping

__all__ = ["KIND", "DFlashKind"]


def _no_cp(meta) -> None:
    # A block's context is every earlier row of its document, which under context parallelism
    # lives on every rank; the preflight refuses the combination first (this is the backstop).
    if meta is not None and not isinstance(meta, DocMetadata):
        raise ValueError("draft.kind = 'dflash' does not train under context parallelism yet "
                         "(parallelism.context_parallel_degree must be 1)")


class DFlashKind(DraftKind):
    name = DFlashArch.kind

    def default_tap_layer_ids(self, n_layers: int) -> tuple[int, ...]:
        return default_dflash_tap_ids(n_layers)

    def arch_from_target(self, target_arch, tap_layer_ids, draft_vocab_size: int, cfg: DraftConfig) -> DFlashArch:
        d = DFlashArch.from_target(target_arch, tap_layer_ids, draft_vocab_size, cfg.block_size, cfg.num_layers,
                                   cfg.mask_token_id)
        d.validate()
        return d

    def build(self, arch: DFlashArch) -> DFlashDraft:
        return DFlashDraft(arch)

    def initial(self, arch: DFlashArch, token_counts_V: torch.Tensor | None, seed: int) -> DFlashDraft:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + 1)  # the same on every rank, apart from the policy's stream
            draft = DFlashDraft(arch)
            draft.reset_parameters()
        if token_counts_V is not None and arch.draft_vocab_size < arch.vocab_size:
            draft.set_vocab_mapping(*build_vocab_mapping(token_counts_V, arch.draft_vocab_size))
        return draft

    # --- training ----------------------------------------------------------------------

    def normalizer_counts(self, positions_BL, labels_BL, meta, cfg: DraftConfig) -> torch.Tensor:
        _no_cp(meta)
        plan = block_plan(positions_BL, labels_BL, cfg.anchors_per_doc)
        valid = block_valid(plan, labels_BL.reshape(-1), cfg.block_size)
        return torch.stack([v.sum() for _, v in valid])

    def loss(self, model, logits_BLV, taps, positions_BL, labels_BL, meta, cfg: DraftConfig,
             count_S, global_count) -> DraftLossResult:
        _no_cp(meta)
        T = positions_BL.numel()
        positions_T, labels_T = positions_BL.reshape(T), labels_BL.reshape(T)
        plan = block_plan(positions_BL, labels_BL, cfg.anchors_per_doc)
        targets = block_targets(model, plan, labels_T, logits_BLV.detach().reshape(T, -1), cfg.block_size)
        if count_S is None:
            count_S = global_count(torch.stack([v.sum() for _, v in block_valid(plan, labels_T, cfg.block_size)]))
        hidden = tuple(h.detach().reshape(T, -1) for h in taps.hidden)
        # Through forward: FSDP's hooks gather the parameters.
        return model(hidden, taps.embeds_BLD.detach().reshape(T, -1), positions_T, plan, targets, cfg.loss_decay, count_S)

    # --- export / import ---------------------------------------------------------------

    def read_arch(self, path: str) -> DFlashArch:
        return read_dflash_arch(path)

    def mismatches(self, found: DFlashArch, want: DFlashArch) -> list[str]:
        return dflash_mismatches(found, want)

    def check_weights(self, path: str, arch: DFlashArch) -> None:
        check_dflash_weights(path, arch)

    def save(self, model: DFlashDraft, path: str) -> None:
        save_dflash(model, path)

    def load_into(self, model: DFlashDraft, path: str) -> None:
        load_dflash_into(model, path)

    # --- serving -----------------------------------------------------------------------

    def cached_proposer(self, model: DFlashDraft, embed) -> CachedBlockDraft:
        return CachedBlockDraft(model, embed)


KIND = DFlashKind()
"""What models/draft/__init__.py registers under "dflash"."""
