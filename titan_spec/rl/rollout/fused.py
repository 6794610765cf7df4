"""Small helpers that cut per-op overhead in the rollout engine's decode path.

Shape legend: O = output features, I = input features, S = positions, Hd (H in
rotate_half_apply's names) = head dim, T = tokens (and any leading dims), N = heads.

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

__all__ = ["FusedLinearWeight", "RotaryTable", "rotate_half_apply"]


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
    """cos/sin of the rotate-half (NeoX) rotary embedding for positions 0..S-1.

    The values are computed with the same float32 ops as ``models.draft.apply_rotary``
    (inv_freq, angle = position * inv_freq, duplicated halves), so gathering a row is
    bitwise the on-the-fly result. Grows on demand; never shrinks.
    """

    def __init__(self, head_dim: int, theta: float, device=None):
        self.head_dim, self.theta, self.device = head_dim, float(theta), device
        self.cos_SHd = self.sin_SHd = torch.empty(0, head_dim, device=device)

    def ensure(self, n_positions: int) -> None:
        if self.cos_SHd.shape[0] >= n_positions:
            return
        hd = self.head_dim
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, hd, 2, device=self.device, dtype=torch.float32) / hd))
        pos_S = torch.arange(n_positions, device=self.device)
        ang_SF = pos_S.to(torch.float32)[:, None] * inv_freq[None, :]
        ang_SHd = torch.cat([ang_SF, ang_SF], -1)
        self.cos_SHd, self.sin_SHd = ang_SHd.cos(), ang_SHd.sin()


def rotate_half_apply(x_TNH: torch.Tensor, cos_T1H: torch.Tensor, sin_T1H: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1) (float32 math)."""
    hd = x_TNH.shape[-1]
    x = x_TNH.float()
    rot = torch.cat([-x[..., hd // 2 :], x[..., : hd // 2]], dim=-1)
    return (x * cos_T1H + rot * sin_T1H).to(x_TNH.dtype)
