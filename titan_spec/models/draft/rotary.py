"""The drafts' rotary embedding: rotate-half (NeoX / HF Llama and Qwen3), as SGLang's and vLLM's
draft layers apply it, in float32; shared by every draft kind (EAGLE-3, DFlash).

Shape legend: T = rows, N = heads, H / Hd = head dim, F = head_dim / 2 frequencies, S = positions.
"""

from __future__ import annotations

import torch

__all__ = ["RotaryTable", "apply_rotary", "rotary_cos_sin", "rotate_half"]


def rotary_cos_sin(pos_T: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos_TH, sin_TH of the rotate-half rotary embedding at positions pos_T (float32)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=pos_T.device, dtype=torch.float32) / head_dim))
    ang_TF = pos_T.to(torch.float32)[:, None] * inv_freq[None, :]
    ang_TH = torch.cat([ang_TF, ang_TF], -1)
    return ang_TH.cos(), ang_TH.sin()


def rotate_half(x_TNH: torch.Tensor, cos_T1H: torch.Tensor, sin_T1H: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin with rotate_half(x) = cat(-x2, x1), in float32."""
    hd = x_TNH.shape[-1]
    x = x_TNH.float()
    rot = torch.cat([-x[..., hd // 2 :], x[..., : hd // 2]], dim=-1)
    return (x * cos_T1H + rot * sin_T1H).to(x_TNH.dtype)


def apply_rotary(x_TNH: torch.Tensor, pos_T: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half (NeoX / HF Llama) rotary embedding, as SGLang's Llama attention uses."""
    cos_TH, sin_TH = rotary_cos_sin(pos_T, x_TNH.shape[-1], theta)
    return rotate_half(x_TNH, cos_TH[:, None], sin_TH[:, None])


class RotaryTable:
    """cos/sin of the draft's rotary embedding (rotary_cos_sin) for positions 0..S-1,
    so gathering a row is the on-the-fly result (the table holds exactly the values the
    formula computes) without recomputing it per call. Grows on demand; never shrinks."""

    def __init__(self, head_dim: int, theta: float, device=None):
        self.head_dim, self.theta, self.device = head_dim, float(theta), device
        self.cos_SHd = self.sin_SHd = torch.empty(0, head_dim, device=device)

    def ensure(self, n_positions: int) -> None:
        if self.cos_SHd.shape[0] < n_positions:
            pos_S = torch.arange(n_positions, device=self.device)
            self.cos_SHd, self.sin_SHd = rotary_cos_sin(pos_S, self.head_dim, self.theta)
