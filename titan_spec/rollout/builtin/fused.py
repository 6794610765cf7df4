"""Small helpers that cut per-op overhead in the rollout engine's decode path.

Shape legend: O = output features, I = input features, S = positions, Hd = head dim.

At decode sizes (a handful of tokens per row) a forward is bound by the number of ops and
Python calls, not by FLOPs, so the engine (a) fuses projections that read the same input
into one matmul, over weights concatenated once and rebuilt only when a source weight
changes, and (b) reads rotary cos/sin from a table instead of recomputing them per call.
Both give the same numbers as the unfused ops: a row of a matmul's output depends only on
its own weight row, and the table holds exactly the values the on-the-fly formula computes.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from titan_spec.models.draft.eagle3.model import rotary_cos_sin

__all__ = ["FusedLinearWeight", "RotaryTable"]


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


class RotaryTable:
    """cos/sin of the draft's rotary embedding (models.draft.rotary_cos_sin) for positions
    0..S-1, so gathering a row is the on-the-fly result. Grows on demand; never shrinks."""

    def __init__(self, head_dim: int, theta: float, device=None):
        self.head_dim, self.theta, self.device = head_dim, float(theta), device
        self.cos_SHd = self.sin_SHd = torch.empty(0, head_dim, device=device)

    def ensure(self, n_positions: int) -> None:
        if self.cos_SHd.shape[0] < n_positions:
            pos_S = torch.arange(n_positions, device=self.device)
            self.cos_SHd, self.sin_SHd = rotary_cos_sin(pos_S, self.head_dim, self.theta)
