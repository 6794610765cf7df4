"""Mixture-of-experts pieces of the target: torchtitan's Qwen3-MoE layers, made exact in fp32.

torchtitan's ``GroupedExperts`` casts tokens and expert weights to bfloat16 before its
grouped matmuls (the CUDA grouped GEMM kernels want bf16). On CPU that loses fp32 parity
with HF (bf16 has 8 mantissa bits: logits differ by ~1e-2) and ``torch._grouped_mm`` on
CPU even rejects bf16 operands of small widths ("strides should be multiple of 16
bytes"). ``ExactGroupedExperts`` runs the same three grouped matmuls in the input's
dtype on CPU, and exactly torchtitan's bf16 path on CUDA, so GPU numerics are
torchtitan's and CPU numerics are fp32 (the tests' HF parity at 1e-4 relies on it).

Everything else is torchtitan's MoE: the softmax top-k router with Qwen3's renormalized
top-k weights (``route_norm``), the local token dispatcher (argsort by expert, weighted
scatter-add), and the auxiliary-loss-free load balancing of
https://arxiv.org/abs/2408.15664: every MoE layer holds ``expert_bias_E`` (added to the
router scores for the CHOICE of experts only, never to the gate weights) and counts its
tokens per expert in ``tokens_per_expert_E``; torchtitan's optimizer pre-step hook
(``register_moe_load_balancing_hook``) moves the bias by
``coeff * sign(mean load - load)`` before every optimizer step and zeroes the counts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torchtitan.models.common.moe import MoE, GroupedExperts

__all__ = ["ExactGroupedExperts", "use_exact_experts", "moe_layers", "expert_biases"]


class ExactGroupedExperts(GroupedExperts):
    """torchtitan's GroupedExperts with its bf16 cast kept on CUDA only (see the module
    docstring); same parameters, names and init."""

    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        pass

    def forward(self, x_TrD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        if x_TrD.is_cuda:
            return super().forward(x_TrD, num_tokens_per_expert_E)
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
        offsets_E = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
        dt = x_TrD.dtype
        h_TrF = F.silu(self._grouped_mm(A=x_TrD, B_t=w1.to(dt).transpose(-2, -1), offs=offsets_E))
        h_TrF = h_TrF * self._grouped_mm(A=x_TrD, B_t=w3.to(dt).transpose(-2, -1), offs=offsets_E)
        return self._grouped_mm(A=h_TrF, B_t=w2.to(dt).transpose(-2, -1), offs=offsets_E)


def use_exact_experts(config) -> None:
    """Swap every GroupedExperts config for ExactGroupedExperts' (in place)."""
    for _, experts, parent, attr in config.traverse(GroupedExperts.Config):
        if type(experts) is GroupedExperts.Config:
            values = {f.name: getattr(experts, f.name) for f in dataclasses.fields(experts) if f.init}
            setattr(parent, attr, ExactGroupedExperts.Config(**values))


def moe_layers(model: nn.Module) -> list[MoE]:
    """The MoE modules of a (possibly wrapped) target, in layer order."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def expert_biases(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The routing-bias buffers among a torchtitan state dict's entries."""
    return {k: v for k, v in state.items() if k.endswith("moe.expert_bias_E")}
