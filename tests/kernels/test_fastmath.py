"""exp2 on the FMA pipe (flashtile/kernels/fastmath.py): accuracy, exact zeros, and the forward with it."""

import pytest
import torch

from helpers import assert_close_to_reference, random_qkv, reference_attention

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from flashtile.kernels import fastmath  # noqa: E402
from flashtile.kernels.runtime import INTERPRET  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernels = pytest.mark.skipif(DEVICE == "cpu" and not INTERPRET, reason="needs a GPU or TRITON_INTERPRET=1")


@triton.jit
def _exp2_kernel(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n, other=0.0)
    tl.store(Y + offs, fastmath.exp2_fma(x), mask=offs < n)


@needs_kernels
def test_exp2_fma_relative_error_and_exact_zeros():
    grid = torch.linspace(-130.0, 8.0, 20001, dtype=torch.float64)
    special = torch.tensor([float("-inf"), -1e30, -126.0, -125.0, -124.9, -0.5, 0.0, 0.5, 1.0, 7.999], dtype=torch.float64)
    x = torch.cat([grid, special]).to(torch.float32)
    y = torch.empty_like(x)
    _exp2_kernel[(triton.cdiv(x.numel(), 1024),)](x.to(DEVICE), y_dev := y.to(DEVICE), x.numel(), BLOCK=1024)
    y = y_dev.cpu().double()
    want = torch.exp2(x.double())
    normal = x >= -125.0
    rel = ((y[normal] - want[normal]) / want[normal]).abs().max().item()
    assert rel < 8e-5, rel
    assert (y[~normal] == 0).all(), "below 2^-125 (and -inf) must give exactly 0"


@needs_kernels
@pytest.mark.parametrize("causal", [False, True])
def test_forward_with_half_the_exp2_on_the_fma_pipe(causal, monkeypatch):
    from flashtile.kernels import attention as ka

    monkeypatch.setattr(fastmath, "EXP2_SPLIT", True)
    # Causal with seqlen_q > seqlen_k (bottom-right aligned): the first 30 rows see no key.
    lq, lk = (70, 40) if causal else (40, 70)
    q, k, v = random_qkv(2, lq, lk, 2, 1, 32, dtype=torch.float16, device=DEVICE, seed=3)
    right = 0 if causal else -1
    out, lse = ka.attention_forward(q, k, v, 32 ** -0.5, -1, right)
    ref64, lse64 = reference_attention(q, k, v, causal=causal, upcast=True)
    ref16, _ = reference_attention(q, k, v, causal=causal, upcast=False)
    assert_close_to_reference(out, ref64, ref16, "out", atol_floor=1e-4)
    torch.testing.assert_close(lse.double(), lse64, atol=2e-4, rtol=1e-4)
    if causal:
        assert (out[:, :30] == 0).all() and torch.isinf(lse[:, :, :30]).all()
