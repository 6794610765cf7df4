"""DFlash as a draft kind (``draft.kind = "dflash"``): models/draft/base.DraftKind over model.py
(the block draft), loss.py (its block loss), context.py (the loss under context parallelism),
io.py (vLLM's directory) and proposer.py (the built-in engine's block proposer).
"""

from __future__ import annotations

import torch

from titan_spec.config import DraftConfig
from titan_spec.models.attention import DocMetadata
from titan_spec.models.draft.base import DraftKind, DraftLossResult
from titan_spec.models.draft.dflash.context import CPStream
from titan_spec.models.draft.dflash.io import (
    check_dflash_weights,
    dflash_mismatches,
    load_dflash_into,
    read_dflash_arch,
    save_dflash,
)
from titan_spec.models.draft.dflash.loss import block_plan, block_targets, block_valid, doc_bounds_of
from titan_spec.models.draft.dflash.model import DFlashArch, DFlashDraft, default_dflash_tap_ids
from titan_spec.models.draft.dflash.proposer import CachedBlockDraft
from titan_spec.models.draft.halo import TTTHalo
from titan_spec.models.draft.vocab import build_vocab_mapping

__all__ = ["KIND", "Blocks", "DFlashKind"]


def _is_cp_shard(meta) -> bool:
    # As eagle3/kind.py: attention metadata that is not a DocMetadata is a context-parallel
    # shard (parallelisms/context_parallel.CPMetadata, not imported: a higher floor).
    return meta is not None and not isinstance(meta, DocMetadata)


class Blocks:
    """A (micro)batch's blocks and the stream they attend to: the local rows in one process;
    under context parallelism the global stream (context.py), this rank's blocks only.
    ``valid``: per scored block row, (src, valid) (DFlash's ``block_valid``, set by the kind)."""

    def __init__(self, positions_BL, labels_BL, meta, per_doc: int):
        labels_T = labels_BL.reshape(-1)
        self.stream = CPStream(meta, labels_T.device) if _is_cp_shard(meta) else None
        if self.stream is None:
            self.labels_Tg, self.positions_Tg = labels_T, positions_BL.reshape(-1)
            bounds, owner, local = doc_bounds_of(positions_BL), None, None
        else:
            st = self.stream
            self.labels_Tg, self.positions_Tg = st.gather_labels(labels_T), st.positions_Tg.to(labels_T.device)
            bounds, owner, local = st.doc_bounds, st.owner_Tg == st.rank, st.local_Tg
        self.plan = block_plan(bounds, self.labels_Tg, per_doc, owner, local)
        self.valid: list[tuple[torch.Tensor, torch.Tensor]] = []

    def counts(self) -> torch.Tensor:
        return torch.stack([v.sum() for _, v in self.valid])

    def target_logits(self, logits_TV, meta, block_size: int) -> list[torch.Tensor]:
        """The target's logits at a + k - 1 for every block row k. Under context parallelism
        rows a+1 .. a+J-2 may live on the next chunk's rank: EAGLE-3's halo brings the first
        J-2 rows of every chunk (the only V-wide rows that cross)."""
        if self.stream is None:
            return [logits_TV[src] for src, _ in self.valid]
        rows_A = self.plan.rows_A
        if block_size <= 2:
            return [logits_TV[rows_A]]
        halo = TTTHalo(meta, block_size - 2, logits_TV.device)
        logits_Rh = halo.extend(logits_TV)
        return [logits_TV[rows_A]] + [logits_Rh[src_R[rows_A]] for src_R in halo.sources()]


class DFlashKind(DraftKind):
    """DFlash's kind; DSpark's (dspark/kind.py) is this one with its own model, targets and proposer."""

    name = DFlashArch.kind
    arch_cls: type[DFlashArch] = DFlashArch
    draft_cls: type[DFlashDraft] = DFlashDraft
    proposer_cls: type[CachedBlockDraft] = CachedBlockDraft

    def default_tap_layer_ids(self, n_layers: int) -> tuple[int, ...]:
        return default_dflash_tap_ids(n_layers)

    def arch_from_target(self, target_arch, tap_layer_ids, draft_vocab_size: int, cfg: DraftConfig) -> DFlashArch:
        d = DFlashArch.from_target(
            target_arch,
            tap_layer_ids,
            draft_vocab_size,
            cfg.dflash.block_size,
            cfg.dflash.num_layers,
            cfg.dflash.mask_token_id,
        )
        d.validate()
        return d

    def build(self, arch: DFlashArch) -> DFlashDraft:
        return self.draft_cls(arch)

    def initial(self, arch: DFlashArch, token_counts_V: torch.Tensor | None, seed: int) -> DFlashDraft:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + 1)  # the same on every rank, apart from the policy's stream
            draft = self.draft_cls(arch)
            draft.reset_parameters()
        if token_counts_V is not None and arch.draft_vocab_size < arch.vocab_size:
            draft.set_vocab_mapping(*build_vocab_mapping(token_counts_V, arch.draft_vocab_size))
        return draft

    # --- training ----------------------------------------------------------------------

    def _blocks(self, positions_BL, labels_BL, meta, cfg: DraftConfig) -> Blocks:
        blocks = Blocks(positions_BL, labels_BL, meta, cfg.dflash.anchors_per_doc)
        blocks.valid = block_valid(blocks.plan, blocks.labels_Tg, cfg.dflash.block_size)
        return blocks

    def normalizer_counts(self, positions_BL, labels_BL, meta, cfg: DraftConfig) -> torch.Tensor:
        """Under context parallelism a rank counts the blocks anchored on its rows (their sum
        over the ranks is the one-process count)."""
        return self._blocks(positions_BL, labels_BL, meta, cfg).counts()

    def _targets(self, model, blocks: Blocks, logits_TV, meta, cfg: DraftConfig):
        """What the model's forward is trained against, and its objective's settings."""
        logits = blocks.target_logits(logits_TV, meta, cfg.dflash.block_size)
        return block_targets(model, [(v, x) for (_, v), x in zip(blocks.valid, logits)]), cfg.loss_decay

    def loss(
        self, model, logits_BLV, taps, positions_BL, labels_BL, meta, cfg: DraftConfig, count_S, global_count
    ) -> DraftLossResult:
        T = positions_BL.numel()
        blocks = self._blocks(positions_BL, labels_BL, meta, cfg)
        targets, objective = self._targets(model, blocks, logits_BLV.detach().reshape(T, -1), meta, cfg)
        if count_S is None:
            count_S = global_count(blocks.counts())
        hidden = tuple(h.detach().reshape(T, -1) for h in taps.hidden)
        gather = blocks.stream.gather if blocks.stream is not None else None
        # Through forward: FSDP's hooks gather the parameters.
        return model(
            hidden,
            taps.embeds_BLD.detach().reshape(T, -1),
            blocks.positions_Tg,
            blocks.plan,
            targets,
            objective,
            count_S,
            gather,
        )

    # --- export / import ---------------------------------------------------------------

    def read_arch(self, path: str) -> DFlashArch:
        return read_dflash_arch(path, self.arch_cls)

    def mismatches(self, found: DFlashArch, want: DFlashArch) -> list[str]:
        return dflash_mismatches(found, want)

    def check_weights(self, path: str, arch: DFlashArch) -> None:
        check_dflash_weights(path, arch, self.draft_cls)

    def save(self, model: DFlashDraft, path: str) -> None:
        save_dflash(model, path)

    def load_into(self, model: DFlashDraft, path: str, target_dir: str | None = None) -> None:
        load_dflash_into(model, path, target_dir)

    # --- serving -----------------------------------------------------------------------

    def cached_proposer(self, model: DFlashDraft, embed) -> CachedBlockDraft:
        return self.proposer_cls(model, embed)


KIND = DFlashKind()
"""What models/draft/__init__.py registers under "dflash"."""
