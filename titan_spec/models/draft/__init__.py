"""The draft kinds: ``draft_kind(cfg.draft.kind)`` is the models/draft/base.DraftKind that the
trainer, the parallelisms and the engines go through (docs/draft_kinds.md: adding one).

``KINDS`` holds one instance per kind, the ``KIND`` of its folder's kind.py
(``titan_spec/models/draft/<name>/kind.py``), imported below by name, one line per kind.
titan_spec.config.draft_kinds.DRAFT_KINDS is what the config allows (with each kind's tap
count); importing this package checks that the two name the same kinds.
"""

from __future__ import annotations

from titan_spec.config.draft_kinds import DRAFT_KINDS
from titan_spec.models.draft.base import DraftKind, DraftLossResult
from titan_spec.models.draft.dflash.kind import KIND as DFLASH
from titan_spec.models.draft.dspark.kind import KIND as DSPARK
from titan_spec.models.draft.eagle3.kind import KIND as EAGLE3

__all__ = ["KINDS", "DraftKind", "DraftLossResult", "draft_kind", "kind_of", "register_kind"]

KINDS: dict[str, DraftKind] = {}


def register_kind(kind: DraftKind) -> DraftKind:
    """Add a kind under ``kind.name`` (a second registration of a name is an error)."""
    if kind.name in KINDS:
        raise ValueError(f"draft kind {kind.name!r} is already registered")
    KINDS[kind.name] = kind
    return kind


def draft_kind(name: str) -> DraftKind:
    """The kind ``draft.kind = name`` selects; ValueError (one line) naming the allowed kinds."""
    kind = KINDS.get(name)
    if kind is None:
        raise ValueError(
            f"draft.kind = {name!r} is not a known draft kind; allowed: {', '.join(repr(k) for k in KINDS)}"
        )
    return kind


def kind_of(arch) -> DraftKind:
    """The kind a draft arch belongs to (its class's ``kind``)."""
    return draft_kind(arch.kind)


for _kind in (EAGLE3, DFLASH, DSPARK):  # a new kind: its import above and its name here
    register_kind(_kind)
if set(KINDS) != set(DRAFT_KINDS):
    raise ImportError(f"draft kinds registered {sorted(KINDS)} but config/draft_kinds.py allows {sorted(DRAFT_KINDS)}")
