"""Edge inputs of the public API: rows with no visible key when V holds inf, zero-length
softmax rows under autograd, float-mask gradients, scalar argument types and signs."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import flashtile
from flashtile import cpu
from flashtile.ops import softmax as ops_softmax

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_kernels = pytest.mark.skipif(not (INTERPRET or torch.cuda.is_available()), reason="needs a GPU or the interpreter")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inf_case(device="cpu", seed=0):
    """causal, seqlen_q 5 > seqlen_k 3: rows 0-1 see no key; v[0, 0, 0, 0] = inf."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, n, 2, 16, generator=g) for n in (5, 3, 3))
    v[0, 0, 0, 0] = float("inf")
    return q.to(device), k.to(device), v.to(device)


def _assert_empty_rows_zero(out, lse):
    assert torch.equal(out[0, :2], torch.zeros_like(out[0, :2])), out[0, :2]
    assert (lse[0, :, :2] == float("-inf")).all()
    assert torch.isinf(out[0, 2:, 0, 0]).all()  # the rows that see key 0 get its inf


def test_cpu_empty_row_is_zero_when_v_holds_inf():
    q, k, v = _inf_case()
    out, lse = cpu.attention_forward(q, k, v, 0.25, -1, 0)
    _assert_empty_rows_zero(out, lse)
    out, lse = flashtile.flash_attn_func(q, k, v, causal=True, return_lse=True)
    _assert_empty_rows_zero(out, lse)


@needs_kernels
def test_triton_forward_empty_row_is_zero_when_v_holds_inf():
    from flashtile.kernels import attention as ka

    q, k, v = _inf_case(DEVICE)
    out, lse = ka.attention_forward(q, k, v, 0.25, -1, 0)
    _assert_empty_rows_zero(out, lse)


@needs_kernels
def test_decode_kernel_empty_row_is_zero_when_v_holds_inf():
    from flashtile import kvcache

    q, k, v = _inf_case(DEVICE)
    for splits in (1, 2):
        out, lse = kvcache._attend_triton(q, k, v, 3, None, None, 0.25, -1, 0, 0.0, None, splits)
        _assert_empty_rows_zero(out, lse)


@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("shape,dim", [((3, 0), 1), ((0, 5), 0)])
def test_cpu_softmax_zero_length_keeps_autograd(log, shape, dim):
    x = torch.zeros(shape, requires_grad=True)
    y = ops_softmax._torch_softmax(x, dim, 1.0, None, log)
    assert y.requires_grad
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == shape


def _float_mask_grad(monkeypatch, triton_path, log):
    monkeypatch.setattr(ops_softmax, "_use_triton", lambda x: triton_path)
    device = DEVICE if triton_path else "cpu"
    x = torch.randn(3, 7, device=device, requires_grad=True)
    mask = torch.randn(3, 7, device=device, requires_grad=True)
    y = (flashtile.log_softmax if log else flashtile.softmax)(x, -1, mask=mask)
    (y * torch.randn(3, 7, device=device)).sum().backward()
    return x.grad, mask.grad


@pytest.mark.parametrize("log", [False, True])
def test_float_mask_gets_no_gradient_on_either_path(monkeypatch, log):
    """The README: the mask receives no gradient; the CPU path gave it one, Triton None."""
    dx_cpu, dmask_cpu = _float_mask_grad(monkeypatch, False, log)
    assert dmask_cpu is None
    if INTERPRET or torch.cuda.is_available():
        dx_tri, dmask_tri = _float_mask_grad(monkeypatch, True, log)
        assert dmask_tri is None


def test_negative_max_seqlen_is_value_error():
    q = torch.randn(9, 2, 16)
    cu = torch.tensor([0, 5, 9], dtype=torch.int32)
    with pytest.raises(ValueError, match="max_seqlen_q must be >= 0, got -1"):
        flashtile.flash_attn_varlen_func(q, q, q, cu, cu, -1, 5)
    with pytest.raises(ValueError, match="max_seqlen_k"):
        flashtile.flash_attn_varlen_func(q, q, q, cu, cu, 5, -3)
    with pytest.raises(TypeError, match="max_seqlen_q must be an int"):
        flashtile.flash_attn_varlen_func(q, q, q, cu, cu, "5", 5)


def test_numpy_bool_causal_accepted():
    q, k, v = (torch.randn(1, 4, 2, 8) for _ in range(3))
    expected = flashtile.flash_attn_func(q, k, v, causal=True)
    assert torch.equal(flashtile.flash_attn_func(q, k, v, causal=np.bool_(True)), expected)
    assert torch.equal(flashtile.flash_attn_func(q, k, v, causal=np.bool_(False)), flashtile.flash_attn_func(q, k, v))


def test_scalar_type_errors_name_the_type():
    q, k, v = (torch.randn(1, 4, 2, 8) for _ in range(3))
    with pytest.raises(TypeError, match=r"causal must be a bool, got numpy\.(int64|intc|int_)"):
        flashtile.flash_attn_func(q, k, v, causal=np.int64(1))
    with pytest.raises(TypeError, match=r"softmax_scale must be a finite float > 0 or None, got numpy\.str_"):
        flashtile.flash_attn_func(q, k, v, softmax_scale=np.str_("0.5"))


@pytest.mark.parametrize("scale", [-1.0, 0.0])
def test_softmax_scale_of_any_sign_is_supported(scale):
    """flashtile.softmax documents x * scale for any finite scale (a negative one is
    softmax(-x)); unlike attention's softmax_scale it is not restricted to > 0."""
    x = torch.randn(3, 6)
    y = ops_softmax._torch_softmax(x, 1, scale, None, False)
    torch.testing.assert_close(y, torch.softmax(x * scale, 1))
