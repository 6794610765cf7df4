"""DSpark as a draft kind (``draft.kind = "dspark"``): DFlash's kind (models/draft/dflash/kind.py)
with model.py (the backbone and its two heads), loss.py (SpecForge's DSpark objective), io.py
(vLLM's Qwen3DSparkModel directory) and proposer.py (the block, then the heads left to right).
Under context parallelism the blocks and the target's rows they read travel as DFlash's do.
"""

from __future__ import annotations

import torch

from titan_spec.config import DraftConfig
from titan_spec.models.draft.base import DraftLossResult
from titan_spec.models.draft.dflash.kind import Blocks, DFlashKind
from titan_spec.models.draft.dspark.io import (
    check_dspark_weights,
    dspark_mismatches,
    load_dspark_into,
    read_dspark_arch,
    save_dspark,
)
from titan_spec.models.draft.dspark.loss import SparkWeights, spark_targets, spark_valid
from titan_spec.models.draft.dspark.model import DSparkArch, DSparkDraft
from titan_spec.models.draft.dspark.proposer import CachedSparkDraft
from titan_spec.models.draft.vocab import build_vocab_mapping

__all__ = ["KIND", "DSparkKind"]


class DSparkKind(DFlashKind):
    name = DSparkArch.kind

    def arch_from_target(self, target_arch, tap_layer_ids, draft_vocab_size: int, cfg: DraftConfig) -> DSparkArch:
        d = DSparkArch.from_dflash(
            super().arch_from_target(target_arch, tap_layer_ids, draft_vocab_size, cfg),
            cfg.dspark.markov_rank,
            cfg.dspark.confidence_head,
        )
        d.validate()
        return d

    def build(self, arch: DSparkArch) -> DSparkDraft:
        return DSparkDraft(arch)

    def initial(self, arch: DSparkArch, token_counts_V: torch.Tensor | None, seed: int) -> DSparkDraft:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + 1)  # the same on every rank, apart from the policy's stream
            draft = DSparkDraft(arch)
            draft.reset_parameters()
        if token_counts_V is not None and arch.draft_vocab_size < arch.vocab_size:
            draft.set_vocab_mapping(*build_vocab_mapping(token_counts_V, arch.draft_vocab_size))
        return draft

    # --- training ----------------------------------------------------------------------

    def _blocks(self, positions_BL, labels_BL, meta, cfg: DraftConfig) -> Blocks:
        blocks = Blocks(positions_BL, labels_BL, meta, cfg.dflash.anchors_per_doc, completion_only=True)
        blocks.valid = spark_valid(blocks.plan, blocks.labels_Tg, cfg.dflash.block_size)
        return blocks

    def loss(
        self, model, logits_BLV, taps, positions_BL, labels_BL, meta, cfg: DraftConfig, count_S, global_count
    ) -> DraftLossResult:
        T = positions_BL.numel()
        blocks = self._blocks(positions_BL, labels_BL, meta, cfg)
        # Row k reads the target at a + k: DFlash's rows of a block one longer.
        logits = blocks.target_logits(logits_BLV.detach().reshape(T, -1), meta, cfg.dflash.block_size + 1)
        targets = spark_targets(model, blocks.plan, blocks.labels_Tg, blocks.valid, logits)
        if count_S is None:
            count_S = global_count(blocks.counts())
        k = cfg.dspark
        weights = SparkWeights(k.ce_weight, k.l1_weight, k.confidence_weight, cfg.loss_decay)
        hidden = tuple(h.detach().reshape(T, -1) for h in taps.hidden)
        gather = blocks.stream.gather if blocks.stream is not None else None
        # Through forward: FSDP's hooks gather the parameters.
        return model(
            hidden,
            taps.embeds_BLD.detach().reshape(T, -1),
            blocks.positions_Tg,
            blocks.plan,
            targets,
            weights,
            count_S,
            gather,
        )

    # --- export / import ---------------------------------------------------------------

    def read_arch(self, path: str) -> DSparkArch:
        return read_dspark_arch(path)

    def mismatches(self, found: DSparkArch, want: DSparkArch) -> list[str]:
        return dspark_mismatches(found, want)

    def check_weights(self, path: str, arch: DSparkArch) -> None:
        check_dspark_weights(path, arch)

    def save(self, model: DSparkDraft, path: str) -> None:
        save_dspark(model, path)

    def load_into(self, model: DSparkDraft, path: str, target_dir: str | None = None) -> None:
        load_dspark_into(model, path, target_dir)

    # --- serving -----------------------------------------------------------------------

    def cached_proposer(self, model: DSparkDraft, embed) -> CachedSparkDraft:
        return CachedSparkDraft(model, embed)


KIND = DSparkKind()
"""What models/draft/__init__.py registers under "dspark"."""
