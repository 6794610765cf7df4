"""DSpark as a draft kind (``draft.kind = "dspark"``): DFlash's kind (models/draft/dflash/kind.py)
over model.py (the backbone and its two heads), loss.py (SpecForge's DSpark objective) and
proposer.py (the block, then the heads left to right); its directory is DFlash's io.py with the
arch's architecture, head tensors and config fields (vLLM's Qwen3DSparkModel: model.py). Under
context parallelism the blocks and the target's rows they read travel as DFlash's do.
"""

from __future__ import annotations

from titan_spec.config import DraftConfig
from titan_spec.models.draft.dflash.kind import Blocks, DFlashKind
from titan_spec.models.draft.dspark.loss import SparkWeights, spark_targets, spark_valid
from titan_spec.models.draft.dspark.model import DSparkArch, DSparkDraft
from titan_spec.models.draft.dspark.proposer import CachedSparkDraft

__all__ = ["KIND", "DSparkKind"]


class DSparkKind(DFlashKind):
    name = DSparkArch.kind
    arch_cls = DSparkArch
    draft_cls = DSparkDraft
    proposer_cls = CachedSparkDraft

    def arch_from_target(self, target_arch, tap_layer_ids, draft_vocab_size: int, cfg: DraftConfig) -> DSparkArch:
        d = DSparkArch.from_dflash(
            super().arch_from_target(target_arch, tap_layer_ids, draft_vocab_size, cfg),
            cfg.dspark.markov_rank,
            cfg.dspark.confidence_head,
        )
        d.validate()
        return d

    def _blocks(self, positions_BL, labels_BL, meta, cfg: DraftConfig) -> Blocks:
        blocks = Blocks(positions_BL, labels_BL, meta, cfg.dflash.anchors_per_doc)
        blocks.valid = spark_valid(blocks.plan, blocks.labels_Tg, cfg.dflash.block_size)
        return blocks

    def _targets(self, model, blocks: Blocks, logits_TV, meta, cfg: DraftConfig):
        # Row k reads the target at a + k: DFlash's rows of a block one longer.
        logits = blocks.target_logits(logits_TV, meta, cfg.dflash.block_size + 1)
        k = cfg.dspark
        return (
            spark_targets(model, blocks.plan, blocks.labels_Tg, blocks.valid, logits),
            SparkWeights(k.ce_weight, k.l1_weight, k.confidence_weight, cfg.loss_decay),
        )


KIND = DSparkKind()
"""What models/draft/__init__.py registers under "dspark"."""
