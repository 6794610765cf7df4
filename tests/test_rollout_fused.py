"""The rollout engine's decode-path shortcuts give the numbers of the ops they replace:
the rotary table, the CPU float32 RMSNorm, and fused projection weights that follow
in-place weight changes.

Each test says which guarantee it relies on: bitwise where the same kernels run on the same
values (copies, one op sequence on one tensor), a tolerance derived from the arithmetic where
the work is split differently (tests/numerics.py)."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from titan_spec.models.draft.rotary import RotaryTable, apply_rotary, rotate_half
from titan_spec.models.fused import FusedLinearWeight
from titan_spec.models.kv_cache import rms as _rms

from numerics import EPS32, assert_gemm_regroup_close


def test_rotary_table_is_the_on_the_fly_rotary():
    """The table and the on-the-fly path compute the same angles (one float32 multiply each,
    exactly rounded, so bitwise), but cos/sin over a [300, 16] and a [6, 16] tensor: ATen runs
    an elementwise op vectorized over the body and scalar over the tail, and the two libm paths
    may differ by an ulp. So the angles' cos/sin agree to 2 ulps and the rotated values to
    4 ulps of |x|; a wrong row (position) or a stale table differs by O(|x|)."""
    g = torch.Generator().manual_seed(0)
    table = RotaryTable(head_dim=16, theta=1e6)
    table.ensure(40)
    table.ensure(300)  # grown: recomputed, not appended
    pos_T = torch.tensor([0, 1, 7, 39, 40, 299])
    x_TNH = torch.randn(6, 6, 16, generator=g)
    got = rotate_half(x_TNH, table.cos_SlHd[pos_T][:, None], table.sin_SlHd[pos_T][:, None])
    want = apply_rotary(x_TNH, pos_T, 1e6)
    torch.testing.assert_close(got, want, rtol=0, atol=4 * EPS32 * x_TNH.abs().max().item())
    # Not vacuous: the neighbouring row of the table is a different rotation.
    near_T = (pos_T + 1) % 300
    off = rotate_half(x_TNH, table.cos_SlHd[near_T][:, None], table.sin_SlHd[near_T][:, None])
    assert (off - want).abs().max() > 1e-2


def test_cpu_rms_norm_is_bitwise_f_rms_norm():
    """Bitwise by construction: on CPU in float32, aten's rms_norm is the same ops in the same
    order on the same tensor (pow, mean, add eps, rsqrt, two muls) that _rms runs without its
    dtype round-trips; a change in either shows here."""
    g = torch.Generator().manual_seed(1)
    for eps in (1e-6, None):
        norm = nn.RMSNorm(64, eps=eps)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(64, generator=g))
        for shape in ((1, 5, 64), (32, 5, 64), (3, 64)):
            x = torch.randn(*shape, generator=g) * 3
            assert torch.equal(_rms(x, norm), F.rms_norm(x, (64,), norm.weight, eps))


def test_fused_weight_follows_in_place_changes_and_replaced_parameters():
    """The fused weight is a copy (bitwise). One GEMM over the [6, 8] weight and two over
    [4, 8] and [2, 8] are different BLAS calls that may block the length-8 dot products
    differently (1 ulp apart on an AVX-512/MKL machine), so their outputs are compared at the
    float32 dot-product error bound, 2 * K * eps * |x| @ |W|^T."""
    g = torch.Generator().manual_seed(0)
    a, b = nn.Linear(8, 4, bias=False), nn.Linear(8, 2, bias=False)
    fused = FusedLinearWeight(a, b)
    assert torch.equal(fused.get(), torch.cat([a.weight, b.weight]))
    for rows in (3, 8, 64):
        x = torch.randn(rows, 8, generator=g)
        w = torch.cat([a.weight, b.weight]).detach()
        with torch.no_grad():
            assert_gemm_regroup_close(F.linear(x, fused.get()), torch.cat([a(x), b(x)], -1), x, w)
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
