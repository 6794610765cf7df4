"""The drafts' rotary embedding: rotate-half (NeoX / HF Llama and Qwen3), as SGLang's and vLLM's
draft layers apply it, in float32; shared by every draft kind (EAGLE-3, DFlash).
"""

from __future__ import annotations

import torch

__all__ = ["RotaryTable", "apply_rotary", "rotary_cos_sin", "rotate_half"]


def rotary_cos_sin(pos_T: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos_THd, sin_THd of the rotate-half rotary embedding at positions pos_T (float32)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=pos_T.device, dtype=torch.float32) / head_dim))
    ang_TFq = pos_T.to(torch.float32)[:, None] * inv_freq[None, :]
    ang_THd = torch.cat([ang_TFq, ang_TFq], -1)
    return ang_THd.cos(), ang_THd.sin()


def rotate_half(x_TNHd: torch.Tensor, cos_T1Hd: torch.Tensor, sin_T1Hd: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin with rotate_half(x) = cat(-x2, x1), in float32."""
    hd = x_TNHd.shape[-1]
    x = x_TNHd.float()
    rot = torch.cat([-x[..., hd // 2 :], x[..., : hd // 2]], dim=-1)
    return (x * cos_T1Hd + rot * sin_T1Hd).to(x_TNHd.dtype)


def apply_rotary(x_TNHd: torch.Tensor, pos_T: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half (NeoX / HF Llama) rotary embedding, as SGLang's Llama attention uses."""
    cos_THd, sin_THd = rotary_cos_sin(pos_T, x_TNHd.shape[-1], theta)
    return rotate_half(x_TNHd, cos_THd[:, None], sin_THd[:, None])


class RotaryTable:
    """cos/sin of the draft's rotary embedding (rotary_cos_sin) for positions 0..S-1,
    so gathering a row is the on-the-fly result (the table holds exactly the values the
    formula computes) without recomputing it per call. Grows on demand; never shrinks."""

    def __init__(self, head_dim: int, theta: float, device=None):
        self.head_dim, self.theta, self.device = head_dim, float(theta), device
        self.cos_SlHd = self.sin_SlHd = torch.empty(0, head_dim, device=device)

    def ensure(self, n_positions: int) -> None:
        if self.cos_SlHd.shape[0] < n_positions:
            pos_Sl = torch.arange(n_positions, device=self.device)
            self.cos_SlHd, self.sin_SlHd = rotary_cos_sin(pos_Sl, self.head_dim, self.theta)
