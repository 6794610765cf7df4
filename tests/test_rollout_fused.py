"""The rollout engine's decode-path shortcuts give the numbers of the ops they replace:
the rotary table, the CPU float32 RMSNorm, and fused projection weights that follow
in-place weight changes."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from titan_spec.models.draft import apply_rotary, rotate_half
from titan_spec.rl.rollout.fused import FusedLinearWeight, RotaryTable
from titan_spec.rl.rollout.kv_cache import _rms


def test_rotary_table_is_bitwise_the_on_the_fly_rotary():
    g = torch.Generator().manual_seed(0)
    table = RotaryTable(head_dim=16, theta=1e6)
    table.ensure(40)
    table.ensure(300)  # grown: recomputed, not appended
    pos_T = torch.tensor([0, 1, 7, 39, 40, 299])
    x_TNH = torch.randn(6, 6, 16, generator=g)
    got = rotate_half(x_TNH, table.cos_SHd[pos_T][:, None], table.sin_SHd[pos_T][:, None])
    assert torch.equal(got, apply_rotary(x_TNH, pos_T, 1e6))


def test_cpu_rms_norm_is_bitwise_f_rms_norm():
    g = torch.Generator().manual_seed(1)
    for eps in (1e-6, None):
        norm = nn.RMSNorm(64, eps=eps)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(64, generator=g))
        for shape in ((1, 5, 64), (32, 5, 64), (3, 64)):
            x = torch.randn(*shape, generator=g) * 3
            assert torch.equal(_rms(x, norm), F.rms_norm(x, (64,), norm.weight, eps))


def test_fused_weight_follows_in_place_changes_and_replaced_parameters():
    a, b = nn.Linear(8, 4, bias=False), nn.Linear(8, 2, bias=False)
    fused = FusedLinearWeight(a, b)
    x = torch.randn(3, 8)
    assert torch.equal(F.linear(x, fused.get()), torch.cat([a(x), b(x)], -1))
    assert fused.get() is fused.get()  # cached while nothing changed
    with torch.no_grad():
        b.weight.mul_(2.0)  # a weight push / optimizer step: in place
    assert torch.equal(fused.get()[4:], b.weight)
    a.weight = nn.Parameter(torch.zeros(4, 8))  # a replaced parameter
    assert torch.equal(fused.get()[:4], torch.zeros(4, 8))


def test_fused_weight_of_inference_tensors_is_rebuilt_every_call():
    with torch.inference_mode():  # such weights have no version counter to watch
        a, b = nn.Linear(8, 4, bias=False), nn.Linear(8, 2, bias=False)
    fused = FusedLinearWeight(a, b)
    assert torch.equal(fused.get(), torch.cat([a.weight, b.weight]))
    with torch.inference_mode():
        b.weight.zero_()
    assert torch.equal(fused.get()[4:], torch.zeros(2, 8))
