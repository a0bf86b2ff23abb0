"""The CPU path's two engines (``flashtile.cpu``): PyTorch's fused CPU flash kernel and the
tiled path.  Which one a call gets, and each one forced, against the float64 oracle on
awkward shapes (seqlen 1, 17, seqlen_q != seqlen_k, rows that see no key), GQA, dtypes."""

from __future__ import annotations

import pytest
import torch

import flashtile
from flashtile import cpu
from flashtile.cpu import fused
from helpers import random_like, random_qkv, reference_attention_grads

# float32 vs the float64 oracle at these sizes: errors ~1e-6.
TOL32 = dict(atol=2e-5, rtol=2e-5)
TOL64 = dict(atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize(
    "seqlens,window,expected",
    [
        ((17, 17), (-1, -1), (0, False)),
        ((17, 17), (-1, 0), (0, True)),
        ((1, 17), (-1, 0), (0, False)),  # one query, bottom-right causal: sees every key
        ((17, 5), (-1, 0), (12, True)),  # the first 12 rows see nothing, the rest is square causal
        ((20, 5), (-1, 15), (0, True)),  # top-left causal written as a bottom-right window
        ((17, 17), (16, 0), (0, True)),  # a left window that hides nothing
        ((5, 17), (-1, 0), None),  # bottom-right causal, more keys: not the kernel's mask
        ((17, 17), (3, 0), None),
        ((17, 17), (-1, 2), None),
        ((0, 17), (-1, -1), None),  # empty inputs never reach the kernel
        ((17, 0), (-1, -1), None),
        ((5, 17), (-1, 0), None),
    ],
)
def test_fused_plan(seqlens, window, expected):
    q_shape, k_shape = (1, seqlens[0], 2, 8), (1, seqlens[1], 2, 8)
    assert cpu.fused_plan(q_shape, k_shape, *window) == expected


@pytest.mark.parametrize("option", [dict(softcap=1.0), dict(alibi_slopes=torch.ones(2)), dict(dropout=(0.1, 0, 0))])
def test_options_the_kernel_lacks_go_tiled(option):
    assert cpu.fused_plan((1, 8, 2, 8), (1, 8, 2, 8), **option) is None
    assert cpu.engine_for((1, 8, 2, 8), (1, 8, 2, 8), **option) == "tiled"
    assert cpu.engine_for((1, 8, 2, 8), (1, 8, 2, 8)) == "fused"
    assert cpu.engine_for((1, 8, 2, 8), (1, 8, 2, 8), dlse=torch.ones(1)) == "tiled"


def test_forcing_fused_where_it_does_not_apply_is_an_error():
    q, k, v = random_qkv(1, 5, 17, 2, 2, 8, torch.float32)
    with pytest.raises(ValueError, match="engine='fused'"):
        cpu.attention_forward(q, k, v, 0.3, -1, 0, engine="fused")
    with pytest.raises(ValueError, match="engine must be one of"):
        cpu.attention_forward(q, k, v, 0.3, engine="fast")


SHAPES = [(1, 1), (17, 17), (1, 17), (17, 1), (17, 5), (5, 17), (200, 130), (130, 200)]
MASKS = {"full": (-1, -1), "causal": (-1, 0), "window": (4, 2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("mask", MASKS.keys())
@pytest.mark.parametrize("seqlen_q,seqlen_k", SHAPES)
@pytest.mark.parametrize("engine", ["auto", "fused", "tiled"])
def test_engine_matches_reference(engine, seqlen_q, seqlen_k, mask, dtype):
    window = MASKS[mask]
    plan = cpu.fused_plan((2, seqlen_q, 4, 16), (2, seqlen_k, 2, 16), *window)
    if engine == "fused" and plan is None:
        pytest.skip("the fused kernel does not compute this call")
    q, k, v = random_qkv(2, seqlen_q, seqlen_k, 4, 2, 16, dtype, seed=seqlen_q + seqlen_k)
    dout = random_like(q, seed=1)
    scale = 0.4
    out, lse = cpu.attention_forward(q, k, v, scale, *window, engine=engine)
    dq, dk, dv = cpu.attention_backward(dout, q, k, v, out, lse, scale, *window, engine=engine)
    ref = reference_attention_grads(q, k, v, dout, softmax_scale=scale, window_size=window)
    tol = TOL64 if dtype == torch.float64 else TOL32
    assert out.dtype == dtype and lse.dtype == dtype and out.is_contiguous() and lse.is_contiguous()
    torch.testing.assert_close(lse.double(), ref[1], **tol)  # equal -inf rows included
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), (ref[0],) + tuple(ref[2:])):
        assert got.shape == want.shape and got.is_contiguous(), name
        torch.testing.assert_close(got.double(), want, **tol, msg=lambda m, name=name: f"{name}: {m}")
    empty = torch.isinf(ref[1][0, 0])
    if empty.any():  # rows that see no key: output 0, LSE -inf, no gradient
        assert (out[:, empty] == 0).all() and (lse[..., empty] == float("-inf")).all() and (dq[:, empty] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_low_precision_fused_computes_in_float32(dtype, causal):
    # fp16 / bf16 go through the kernel in float32: the LSE is float32-accurate on the
    # rounded inputs, and the output is the float32 result rounded once.
    q, k, v = random_qkv(2, 70, 70, 4, 2, 32, dtype, seed=3)
    window = (-1, 0) if causal else (-1, -1)
    out, lse = cpu.attention_forward(q, k, v, 0.2, *window, engine="fused")
    out32, lse32 = cpu.attention_forward(q.float(), k.float(), v.float(), 0.2, *window, engine="tiled")
    assert out.dtype == dtype and lse.dtype == torch.float32
    torch.testing.assert_close(lse, lse32, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.float(), out32, atol=2 * torch.finfo(dtype).eps, rtol=0)


def test_fused_backward_is_deterministic_and_takes_a_tiled_lse():
    q, k, v = random_qkv(2, 300, 300, 4, 1, 32, torch.float32, seed=5)
    dout = random_like(q, seed=6)
    out, lse = cpu.attention_forward(q, k, v, 0.2, -1, 0, engine="tiled")
    runs = [cpu.attention_backward(dout, q, k, v, out, lse, 0.2, -1, 0, engine="fused") for _ in range(2)]
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    tiled = cpu.attention_backward(dout, q, k, v, out, lse, 0.2, -1, 0, engine="tiled")
    for a, b in zip(runs[0], tiled):
        torch.testing.assert_close(a, b, **TOL32)


def test_lse_gradient_goes_to_the_tiled_backward(monkeypatch):
    # The kernel's backward has no LSE-gradient input; a zero LSE gradient (what autograd passes
    # for an unused LSE) still takes the fused one.
    used = []
    real = fused.backward
    monkeypatch.setattr(fused, "backward", lambda *a: used.append(True) or real(*a))
    q, k, v = random_qkv(1, 40, 40, 2, 2, 16, torch.float64, requires_grad=True, seed=7)
    out, lse = flashtile.flash_attn_func(q, k, v, causal=True, return_lse=True)
    out.sum().backward()
    assert used == [True]
    out, lse = flashtile.flash_attn_func(q, k, v, causal=True, return_lse=True)
    (out.sum() + lse.sum()).backward()
    assert used == [True]


@pytest.mark.parametrize("rows", [1, 2, 16, 256])
def test_default_blocks(rows):
    bm, bn = cpu.default_blocks(rows, 4096, 4096, 4)
    assert 64 <= bm <= 512 and 128 <= bn <= 512
    assert bm & (bm - 1) == 0 and bn & (bn - 1) == 0
    assert cpu.default_blocks(rows, 17, 5, 4) == (min(bm, 17), min(bn, 5))
