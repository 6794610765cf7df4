"""EAGLE-3 as a draft kind (``draft.kind = "eagle3"``): models/draft/base.DraftKind over
model.py (the draft), ttt.py (its training-time-test loss), halo.py (TTT under context
parallelism), io.py (the SGLang / SpecForge directory) and proposer.py (the built-in
engine's KV-cached decode path).

The loss and the normalizer are DraftTraining's former bodies, op for op (the metrics of
the default chain stay identical).
"""

from __future__ import annotations

import torch

from titan_spec.config import DraftConfig
from titan_spec.models.attention import DocMetadata
from titan_spec.models.draft.base import DraftKind, DraftLossResult
from titan_spec.models.draft.eagle3.io import (
    check_draft_weights,
    draft_mismatches,
    load_draft_into,
    read_draft_arch,
    save_draft,
)
from titan_spec.models.draft.eagle3.model import DraftArch, Eagle3Draft
from titan_spec.models.draft.eagle3.proposer import CachedDraft
from titan_spec.models.draft.halo import TTTHalo
from titan_spec.models.draft.vocab import build_vocab_mapping
from titan_spec.models.draft.eagle3.ttt import ttt_shifts, ttt_targets
from titan_spec.models.target import default_tap_layer_ids

__all__ = ["KIND", "Eagle3Kind"]


def _is_cp_shard(meta) -> bool:
    # Like branch_attention.ttt_attention: attention metadata that is not a DocMetadata is a
    # context-parallel shard (parallelisms/context_parallel.CPMetadata, not imported: a higher floor).
    return meta is not None and not isinstance(meta, DocMetadata)


def _count_S(shifts) -> torch.Tensor:
    return torch.stack([valid.sum() for _, valid in shifts])


class Eagle3Kind(DraftKind):
    name = DraftArch.kind

    def default_tap_layer_ids(self, n_layers: int) -> tuple[int, ...]:
        return default_tap_layer_ids(n_layers)

    def arch_from_target(self, target_arch, tap_layer_ids, draft_vocab_size: int, cfg: DraftConfig) -> DraftArch:
        d = DraftArch.from_target(target_arch, tap_layer_ids, draft_vocab_size)
        d.validate()
        return d

    def build(self, arch: DraftArch) -> Eagle3Draft:
        return Eagle3Draft(arch)

    def initial(self, arch: DraftArch, token_counts_V: torch.Tensor | None, seed: int) -> Eagle3Draft:
        with torch.random.fork_rng(devices=[]):
            # Same init on every rank, independent of the policy's RNG stream.
            torch.manual_seed(seed + 1)
            draft = Eagle3Draft(arch)
            draft.reset_parameters()
        if token_counts_V is not None and arch.draft_vocab_size < arch.vocab_size:
            draft.set_vocab_mapping(*build_vocab_mapping(token_counts_V, arch.draft_vocab_size))
        return draft

    # --- training ----------------------------------------------------------------------

    def normalizer_counts(self, positions_BL, labels_BL, meta, cfg: DraftConfig) -> torch.Tensor:
        """Under context parallelism the rank's shard is counted with its cross-shard rows (TTTHalo)."""
        if _is_cp_shard(meta):
            halo = TTTHalo(meta, cfg.eagle3.ttt_steps, labels_BL.device)
            return _count_S(halo.shifts(halo.extend(labels_BL.reshape(-1))))
        return _count_S(ttt_shifts(positions_BL.reshape(-1), labels_BL.reshape(-1), cfg.eagle3.ttt_steps))

    def loss(
        self, model, logits_BLV, taps, positions_BL, labels_BL, meta, cfg: DraftConfig, count_S, global_count
    ) -> DraftLossResult:
        T = positions_BL.numel()
        logits_TV = logits_BLV.detach().reshape(T, -1)
        positions_T, labels_T = positions_BL.reshape(T), labels_BL.reshape(T)
        embeds_TH = taps.embeds_BLD.detach().reshape(T, -1)
        shifts = None
        if _is_cp_shard(meta):
            # Rows t+1+j may live on another CP rank: index [local; halo] rows instead.
            halo = TTTHalo(meta, cfg.eagle3.ttt_steps, logits_TV.device)
            logits_TV, labels_T, embeds_TH = (halo.extend(x) for x in (logits_TV, labels_T, embeds_TH))
            shifts = halo.shifts(labels_T)
        targets = ttt_targets(model, positions_T, labels_T, logits_TV, cfg.eagle3.ttt_steps, shifts)
        if count_S is None:  # this batch alone (the shifts of the CP halo are already built)
            count_S = global_count(
                _count_S(shifts if shifts is not None else ttt_shifts(positions_T, labels_T, cfg.eagle3.ttt_steps))
            )
        hidden = tuple(h.detach().reshape(T, -1) for h in taps.hidden)
        # Through forward (not ttt_unroll directly): FSDP's hooks gather the parameters.
        return model(hidden, embeds_TH, positions_T, meta, targets, cfg.loss_decay, count_S)

    # --- export / import ---------------------------------------------------------------

    def read_arch(self, path: str) -> DraftArch:
        return read_draft_arch(path)

    def mismatches(self, found: DraftArch, want: DraftArch) -> list[str]:
        return draft_mismatches(found, want)

    def check_weights(self, path: str, arch: DraftArch) -> None:
        check_draft_weights(path, arch)

    def save(self, model: Eagle3Draft, path: str) -> None:
        save_draft(model, path)

    def load_into(self, model: Eagle3Draft, path: str, target_dir: str | None = None) -> None:
        load_draft_into(model, path)  # an EAGLE-3 directory holds its whole draft

    # --- serving -----------------------------------------------------------------------

    def cached_proposer(self, model: Eagle3Draft, embed) -> CachedDraft:
        return CachedDraft(model, embed)


KIND = Eagle3Kind()
"""What models/draft/__init__.py registers under "eagle3"."""
