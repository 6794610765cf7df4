"""The draft kinds a config may name (``draft.kind``) and the ONE validator of tap layer ids.

A leaf of the ground floor: it imports nothing, so every floor calls it (config/validate.py
checks ``draft.kind`` and the tap-id count before any target is known;
models/target.py, models/draft/*, preflight/resolve.py and rollout/weight_names.py check the ids
against the target's depth or SGLang's capture rule through the same function).

The kinds' implementations are registered in titan_spec/models/draft/__init__.py; a test
checks that the registry and this table name the same kinds.
"""

from __future__ import annotations

__all__ = ["DRAFT_KINDS", "tap_ids_problem"]

DRAFT_KINDS: dict[str, int] = {"eagle3": 3, "dflash": 0, "dspark": 0}
"""draft.kind -> how many distinct target layers the draft reads (its taps); 0 = any number
from one up (DFlash's and DSpark's fc reads the concatenation of however many it is given)."""

_WORDS = {1: "one", 2: "two", 3: "three", 4: "four", 5: "five", 6: "six"}


def tap_ids_problem(ids, n_layers: int | None = None, count: int | None = None) -> str | None:
    """Why these tap layer ids cannot be used, as the one-line message users see; None = fine.

    n_layers: the target's depth (ids must be in 0..n_layers-1; None = not known yet).
    count: how many distinct ids the draft kind reads (DRAFT_KINDS; 0 = at least one);
    None = any number, but no layer twice. The range is checked first, then the count (or the repeats),
    the order the preflight checks have always run in (tests pin the messages)."""
    ids = list(ids)
    if n_layers is not None:
        bad = [i for i in ids if not 0 <= i < n_layers]
        if bad:
            return (
                f"tap layer ids {bad} are out of range: the target has {n_layers} layers, "
                f"so ids must be in 0..{n_layers - 1}"
            )
    if count == 0 and not ids:
        return "draft.tap_layer_ids = [] names no layer; the draft needs at least one tap"
    if count and (len(ids) != count or len(set(ids)) != count):
        return f"draft.tap_layer_ids = {ids} must be {_WORDS.get(count, count)} distinct layer ids"
    if len(set(ids)) != len(ids):
        return f"tap layer ids {ids} repeat a layer; they must be distinct"
    return None
