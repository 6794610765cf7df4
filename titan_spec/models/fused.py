"""Fused projection weights for the cached (decode-path) forwards.

At decode sizes (a handful of tokens per row) a forward is bound by the number of ops and
Python calls, not by FLOPs, so the cached forwards (rollout/builtin/cached_target.py, a
kind's models/draft/<kind>/proposer.py) fuse projections that read the same input into one
matmul, over weights concatenated once and rebuilt only when a source weight changes. That
gives the same numbers as the unfused ops: a row of a matmul's output depends only on its
own weight row.
"""

from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["FusedLinearWeight"]


class FusedLinearWeight:
    """cat([m.weight for m in modules], dim 0): one F.linear instead of several.

    The weights are read from the modules on every ``get()`` (so a replaced parameter is
    seen) and the concatenation is rebuilt when any weight's storage or in-place version
    counter changes: a weight push (``copy_``), an optimizer step and ``load_state_dict``
    all bump the version, so the fused copy never serves stale weights. Weights that are
    inference tensors (made under inference_mode) have no version counter and are
    concatenated on every call.
    """

    def __init__(self, *modules: nn.Module):
        if any(getattr(m, "bias", None) is not None for m in modules):
            raise ValueError("FusedLinearWeight fuses bias-free linears only")
        self.modules = modules
        self.sizes = [int(m.weight.shape[0]) for m in modules]
        self._key: tuple | None = None
        self._weight_OI: torch.Tensor | None = None

    def get(self) -> torch.Tensor:
        ws = [m.weight for m in self.modules]
        if any(w.is_inference() for w in ws):
            # Weights made under inference_mode have no version counter: rebuild every time.
            with torch.no_grad():
                return torch.cat([w.detach() for w in ws], dim=0)
        key = tuple((w.data_ptr(), w._version, w.dtype, w.device) for w in ws)
        if key != self._key:
            with torch.no_grad():
                self._weight_OI = torch.cat([w.detach() for w in ws], dim=0)
            self._key = key
        return self._weight_OI
