"""The draft seam: what the trainer, context/pipeline parallelism and the engines need of a draft.

A draft kind (``draft.kind``, registered in models/draft/__init__.py; adding one:
docs/draft_kinds.md) is one ``DraftKind``.
Who uses what (read from the callers):

    preflight draft_arch_for    default_tap_layer_ids, read_arch, arch_from_target (its checks),
                                mismatches, check_weights
    draft_training.py           initial (build + init), normalizer_counts, loss, build + save (export),
                                load_into (draft.init_from)
    pipeline.py PipelineLoss    DraftTraining.loss only (taps from the TapChannel, the microbatch's
                                positions / labels / attention metadata, the step's normalizer)
    context parallelism         nothing: the loss takes a CPMetadata as its attention metadata and
                                gathers whatever rows it reads across shards itself
    rollout/builtin/engine.py   read_arch + build + load_into (from_pretrained), arch.tap_layer_ids,
                                arch.misfits, cached_proposer (its decode path),
                                model.draft_to_target_ids / d2t (speculative acceptance)
    rl/worker.py              arch.tap_layer_ids (which taps the engine's target computes)
    tap ids, everywhere         titan_spec.config.draft_kinds.tap_ids_problem with the kind's tap count

The arch a kind returns is a frozen dataclass with at least ``tap_layer_ids`` (the target
layers the draft reads, in the order it reads them), ``vocab_size`` and ``draft_vocab_size``,
and ``misfits(target_vocab, target_dim)``; its class names its kind in ``kind``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
import torch.nn as nn

from titan_spec.config import DraftConfig
from titan_spec.torch_compat import fsdp_output

__all__ = ["BlockProposer", "CachedProposer", "DraftKind", "DraftLossResult"]


@fsdp_output  # the draft's forward returns it through FSDP
@dataclass
class DraftLossResult:
    """One (micro)batch's draft loss and what the metrics sum over the step (per loss step j)."""

    loss: torch.Tensor
    """The differentiable loss, already normalized (by the count passed in, else the local one)."""
    loss_sum_S: torch.Tensor
    """Per-step sum of the per-row loss over valid rows (detached)."""
    count_S: torch.Tensor
    """Per-step number of valid rows."""
    correct_S: torch.Tensor
    """Per-step rows where the draft's argmax equals the target's."""


class CachedProposer(Protocol):
    """What the built-in engine (rollout/builtin/engine.py ``_propose``) drives to draft K tokens
    per round; built by the kind, ``DraftKind.cached_proposer(draft, embed)``, over the KV-cache
    pieces of models/kv_cache.py. EAGLE-3's is models/draft/eagle3/proposer.CachedDraft."""

    block_size: int
    """0: a chain (``extend`` proposes the first token, each ``step`` the next one)."""

    cache: Any
    """The batch's KV cache (``keep(rows_B)`` drops finished rows; None between batches)."""

    def new_cache(self, batch: int, slots: int) -> None: ...

    def weights(self) -> tuple[torch.Tensor, ...]:
        """The draft's current (fused) weights for one batch."""

    def extend(self, taps_BLCD, tokens_BL, start_B, n_B, n_slots=None, weights=None):
        """The newly committed positions -> (hidden_BH, logits_BVd) of each row's last one."""

    def step(self, h_BH, tokens_B, pos_B, n_slots=None, weights=None):
        """One chain step -> (hidden_BH, logits_BVd)."""

    def compile(self, backend: str = "inductor") -> None: ...


class BlockProposer(Protocol):
    """A proposer that drafts a whole block in one forward (DFlash: models/draft/dflash/proposer.py
    ``CachedBlockDraft``, DSpark: dspark/proposer.py); the built-in engine's ``_propose`` takes
    its second path for it."""

    block_size: int
    """J > 0: rows of the block one ``propose`` runs (slots c .. c+J-1)."""

    proposals: int
    """Proposals one block gives (DFlash J - 1, DSpark J); a round verifies the first K <= proposals."""

    has_confidence: bool
    """``row`` can estimate each proposal's acceptance (DSpark's confidence head)."""

    cache: Any

    def new_cache(self, batch: int, slots: int) -> None: ...

    def weights(self) -> tuple[torch.Tensor, ...]: ...

    def extend(self, taps_BLCD, tokens_BL, start_B, n_B, n_slots=None, weights=None) -> None:
        """Take in the newly committed positions (their taps); nothing is proposed yet."""

    def propose(self, y_B, c_B, n_slots: int, weights=None) -> torch.Tensor:
        """The block after the pending token y at position c -> what ``row`` reads."""

    def row(self, out_BJ, j: int, prev_B, confidence: bool = False):
        """Proposal j (position c+1+j) given the token drafted before it (target ids) ->
        (logits_BVd, conf_B: the estimate that it is accepted given the ones before it, or None
        unless ``confidence``, which needs has_confidence)."""

    def compile(self, backend: str = "inductor") -> None: ...


class DraftKind(ABC):
    """One kind of draft model. Stateless: every method takes the arch or the model."""

    name: ClassVar[str]
    """The ``draft.kind`` value (a key of titan_spec.config.draft_kinds.DRAFT_KINDS)."""

    # --- architecture ------------------------------------------------------------------

    @abstractmethod
    def default_tap_layer_ids(self, n_layers: int) -> tuple[int, ...]:
        """The taps an n_layers target feeds this kind when draft.tap_layer_ids is empty."""

    @abstractmethod
    def arch_from_target(
        self, target_arch, tap_layer_ids: tuple[int, ...], draft_vocab_size: int, cfg: DraftConfig
    ) -> Any:
        """The draft's arch for this target (``tap_layer_ids`` and ``draft_vocab_size`` already
        resolved against the target and draft.init_from; the kind's own sizes from ``cfg``),
        checked: ValueError (one line) if it cannot be built."""

    @abstractmethod
    def build(self, arch) -> nn.Module:
        """An uninitialized model (works under ``torch.device('meta')``)."""

    @abstractmethod
    def initial(self, arch, token_counts_V: torch.Tensor | None, seed: int) -> nn.Module:
        """The seeded, deterministic initial model (the same on every rank; ``token_counts_V``:
        target-token frequencies of the training data, or None)."""

    # --- training ----------------------------------------------------------------------

    @abstractmethod
    def normalizer_counts(self, positions_BL, labels_BL, meta, cfg: DraftConfig) -> torch.Tensor:
        """count_S: rows each loss step can train on in this (micro)batch, from positions and
        labels only (fixed before the forward). ``meta``: a DocMetadata or a CPMetadata shard."""

    @abstractmethod
    def loss(
        self,
        model: nn.Module,
        logits_BLV: torch.Tensor,
        taps,
        positions_BL,
        labels_BL,
        meta,
        cfg: DraftConfig,
        count_S: torch.Tensor | None,
        global_count: Callable[[torch.Tensor], torch.Tensor],
    ) -> DraftLossResult:
        """The draft loss of one (micro)batch from the target's taps (models/target.Taps) and
        logits, normalized by ``count_S`` (None: this batch's own counts, summed by
        ``global_count`` over the data-parallel ranks). Everything read from the target is
        detached. Under context parallelism ``meta`` is the rank's CPMetadata and the loss
        fetches the rows it needs from the other shards."""

    # --- export / import ---------------------------------------------------------------

    @abstractmethod
    def read_arch(self, path: str) -> Any:
        """The arch a draft directory holds (its config); ValueError naming what is wrong."""

    @abstractmethod
    def mismatches(self, found, want) -> list[str]:
        """Why a directory of arch ``found`` cannot initialize the draft ``want`` ([] = it fits)."""

    @abstractmethod
    def check_weights(self, path: str, arch) -> None:
        """The directory's weights are the ones ``arch`` needs (names, shapes; header only)."""

    @abstractmethod
    def save(self, model: nn.Module, path: str) -> None:
        """Write the draft directory (atomic)."""

    @abstractmethod
    def load_into(self, model: nn.Module, path: str, target_dir: str | None = None) -> None:
        """Initialize ``model`` from a draft directory after checking that it fits;
        ``target_dir``: the policy's HF checkpoint, for what a directory shares with it."""

    # --- serving -----------------------------------------------------------------------

    def cached_proposer(
        self, model: nn.Module, embed: Callable[[torch.Tensor], torch.Tensor]
    ) -> CachedProposer | BlockProposer | None:
        """The built-in engine's proposer over a KV cache for ``model``; ``embed`` maps token
        ids to the target's embeddings (shared, not the draft's). None: this kind does not
        speculate in the built-in engine (it still trains; the engine refuses it with one line)."""
        return None
