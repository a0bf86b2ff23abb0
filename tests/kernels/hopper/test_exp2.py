"""``exp2.exp2_mixed``: exp2 split between the MUFU and a polynomial on the FMA pipe.

On the CPU: the polynomial's arithmetic (``emulated_exp2``, the same steps in NumPy) against
exact ``2^x`` -- relative error, the exact zeros below its floor, NaN kept -- and the shape of
the assembly.  On an sm_90 GPU: the assembly itself, in a small Gluon kernel, against the
emulation and ``torch.exp2``.
"""

import numpy as np
import pytest
import torch

from helpers import is_hopper

exp2 = pytest.importorskip("flashtile.kernels.hopper.exp2")
from triton.experimental import gluon  # noqa: E402  (after the skip: a Triton without Gluon has neither)
from triton.experimental.gluon import language as gl  # noqa: E402


@gluon.jit
def _apply_mixed_exp2(X, Y, EVERY: gl.constexpr):
    # A 64 x 64 fp32 tile through exp2_mixed.
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, 64, layout=gl.SliceLayout(0, layout))
    offs = gl.expand_dims(rows, 1) * 64 + gl.expand_dims(cols, 0)
    gl.store(Y + offs, exp2.exp2_mixed(gl.load(X + offs), EVERY))


def test_polynomial_is_within_its_error_bound_of_exact_exp2():
    x = np.linspace(exp2.FLOOR, 8.0, 1_000_001, dtype=np.float32)
    got = exp2.emulated_exp2(x).astype(np.float64)
    exact = np.exp2(x.astype(np.float64))
    assert np.max(np.abs(got / exact - 1)) < 1e-5


def test_polynomial_gives_exact_zero_below_its_floor_and_keeps_nan():
    x = np.array([-np.inf, -1e30, -126.0, np.nextafter(np.float32(exp2.FLOOR), np.float32(-1e9)), np.nan],
                 dtype=np.float32)
    got = exp2.emulated_exp2(x)
    assert (got[:4] == 0).all() and np.isnan(got[4])


def test_assembly_puts_one_element_of_each_pack_on_the_polynomial():
    for every in (2, 4, 8):
        asm = exp2.mixed_asm(every)
        assert asm.count("ex2.approx.ftz.f32") == every - 1
        assert asm.count("fma.rn.f32") == len(exp2.COEFFS) - 1
        # Outputs $0 .. $(every - 1), inputs $every .. $(2 every - 1); the polynomial's are the last.
        assert f"selp.f32 ${every - 1}," in asm and f"add.rn.f32 %t, ${2 * every - 1}," in asm


@pytest.mark.gpu
@pytest.mark.skipif(not is_hopper(), reason="the Gluon kernels need an sm_90 GPU")
@pytest.mark.parametrize("every", [2, 4, 8])
def test_gpu_mixed_exp2_matches_the_mufu_or_the_polynomial(every):
    gen = torch.Generator().manual_seed(every)
    x = -130 * torch.rand(64 * 64, generator=gen)
    x[:8] = torch.tensor([0.0, -0.0, float("-inf"), float("nan"), -125.0, -125.5, -1e-7, 4.0])
    y = torch.full_like(x, 7.0).cuda()
    _apply_mixed_exp2[(1,)](x.cuda(), y, EVERY=every, num_warps=4)
    y = y.cpu()
    mufu = torch.exp2(x)
    mufu[x < -126] = 0  # the MUFU flushes results below 2^-126 to zero
    poly = torch.from_numpy(exp2.emulated_exp2(x.numpy()))
    nan = torch.isnan(x)
    assert torch.isnan(y[nan]).all()
    close_mufu = torch.isclose(y, mufu, rtol=1e-6, atol=0)
    close_poly = torch.isclose(y, poly, rtol=2 ** -22, atol=0)
    assert (close_mufu | close_poly | nan).all()
    # At x = 0 the MUFU gives exactly 1 and the polynomial does not: one element in `every`.
    zeros = torch.zeros(64 * 64)
    out = torch.empty_like(zeros).cuda()
    _apply_mixed_exp2[(1,)](zeros.cuda(), out, EVERY=every, num_warps=4)
    assert int((out.cpu() != 1.0).sum()) == zeros.numel() // every
