"""The draft kinds: ``draft_kind(cfg.draft.kind)`` is the models/draft/base.DraftKind that the
trainer, the parallelisms and the engines go through (docs/draft_kinds.md: adding one).

``KINDS`` holds one instance per kind: for every name in titan_spec.draft_kinds.DRAFT_KINDS
(what config.py allows, with each kind's tap count) the ``KIND`` of its folder's kind.py,
``titan_spec/models/draft/<name>/kind.py``. So a new kind is its folder plus its DRAFT_KINDS
entry, and the registry and the config cannot disagree.
"""

from __future__ import annotations

import importlib

from titan_spec.draft_kinds import DRAFT_KINDS
from titan_spec.models.draft.base import DraftKind, DraftLossResult

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
        raise ValueError(f"draft.kind = {name!r} is not a known draft kind; allowed: "
                         f"{', '.join(repr(k) for k in KINDS)}")
    return kind


def kind_of(arch) -> DraftKind:
    """The kind a draft arch belongs to (its class's ``kind``)."""
    return draft_kind(arch.kind)


for _name in DRAFT_KINDS:  # eagle3: titan_spec.models.draft.eagle3.kind
    register_kind(importlib.import_module(f"{__name__}.{_name}.kind").KIND)
