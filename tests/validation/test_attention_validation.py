"""Argument checking of ``flashtile.flash_attn_func``: every wrong input raises the exception
type docs/semantics.md prescribes, with a message naming the argument, before any kernel runs.

Wrong type -> TypeError; wrong value, shape, dtype, device or layout -> ValueError; a supported
combination not implemented yet -> NotImplementedError.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import flashtile
from flashtile.validation import MAX_HEADDIM, check_attention_inputs

B, NQ, NK, H, HK, D = 2, 5, 7, 4, 2, 16


def _t(*shape, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, dtype=torch.float32).to(dtype=dtype, device=device)


def _qkv(dtype=torch.float32):
    return _t(B, NQ, H, D, dtype=dtype), _t(B, NK, HK, D, dtype=dtype), _t(B, NK, HK, D, dtype=dtype)


_DEFAULT = object()


def call(q=_DEFAULT, k=_DEFAULT, v=_DEFAULT, **kwargs):
    """flash_attn_func on valid small inputs, with the given ones replaced."""
    dq, dk, dv = _qkv()
    pick = lambda given, default: default if given is _DEFAULT else given  # noqa: E731
    return flashtile.flash_attn_func(pick(q, dq), pick(k, dk), pick(v, dv), **kwargs)


# ---------------------------------------------------------------------------------------
# Sanity: valid inputs pass
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_valid_inputs_accepted(dtype):
    q, k, v = _qkv(dtype)
    out = flashtile.flash_attn_func(q, k, v, causal=True, window_size=(3, 0), softmax_scale=0.5)
    assert out.shape == q.shape and out.dtype == dtype


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(softmax_scale=1),  # an int scale is a number
        dict(window_size=[3, 0]),  # a list pair, like flash-attn accepts
        dict(window_size=(-1, -1), causal=False, dropout_p=0, softcap=0),
        dict(deterministic=True, return_lse=True),
        dict(alibi_slopes=None),
    ],
    ids=lambda kw: ",".join(kw),
)
def test_valid_scalar_arguments_accepted(kwargs):
    call(**kwargs)


@pytest.mark.parametrize("headdim", [1, MAX_HEADDIM])
def test_head_dim_bounds_accepted(headdim):
    q, k, v = _t(1, 3, 2, headdim), _t(1, 4, 1, headdim), _t(1, 4, 1, headdim)
    assert flashtile.flash_attn_func(q, k, v).shape == q.shape


# ---------------------------------------------------------------------------------------
# Tensors
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["q", "k", "v"])
@pytest.mark.parametrize(
    "bad", [None, [[1.0]], np.zeros((B, NK, HK, D), dtype=np.float32), 3.0], ids=["None", "list", "ndarray", "float"]
)
def test_non_tensor_is_type_error(name, bad):
    with pytest.raises(TypeError, match=rf"\b{name}\b"):
        call(**{name: bad})


@pytest.mark.parametrize(
    "name,shape",
    [("q", (NQ, H, D)), ("q", (1, B, NQ, H, D)), ("k", (NK, HK, D)), ("v", (B, NK, HK)), ("v", (1, B, NK, HK, D))],
)
def test_wrong_rank(name, shape):
    with pytest.raises(ValueError, match=rf"\b{name}\b.*4 dimensions"):
        call(**{name: _t(*shape)})


@pytest.mark.parametrize("name", ["q", "k", "v"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool, torch.complex64], ids=str)
def test_unsupported_dtype(name, dtype):
    shape = (B, NQ, H, D) if name == "q" else (B, NK, HK, D)
    bad = torch.zeros(shape, dtype=dtype)
    with pytest.raises(ValueError, match=rf"\b{name}\b.*dtype"):
        call(**{name: bad})


def test_float64_accepted_on_cpu():
    q, k, v = (t.double() for t in _qkv())
    out, lse = flashtile.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert out.dtype == torch.float64 and lse.dtype == torch.float64


@pytest.mark.parametrize("name", ["q", "k", "v", "x"])
def test_float64_rejected_for_the_gpu_kernels(name):
    # The check itself, for a CUDA device (no GPU needed): a ValueError naming the argument
    # and saying where float64 runs.
    from flashtile.validation import check_dtype

    with pytest.raises(ValueError, match=rf"^{name} has dtype torch.float64.*GPU kernels.*CPU"):
        check_dtype(name, torch.float64, "cuda")
    check_dtype(name, torch.float64, "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_float64_cuda_tensors_rejected():
    q, k, v = (t.double().cuda() for t in _qkv())
    with pytest.raises(ValueError, match=r"^q has dtype torch.float64"):
        flashtile.flash_attn_func(q, k, v)
    with pytest.raises(ValueError, match=r"^x has dtype torch.float64"):
        flashtile.softmax(q)
    with pytest.raises(ValueError, match=r"^qkv has dtype torch.float64"):
        flashtile.flash_attn_qkvpacked_func(torch.stack([q, q, q], dim=2))


@pytest.mark.parametrize("name", ["k", "v"])
def test_mismatched_dtypes(name):
    q, k, v = _qkv(torch.float16)
    bad = {"k": k, "v": v}[name].to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"dtype"):
        flashtile.flash_attn_func(q, **{"k": k, "v": v, name: bad})


@pytest.mark.parametrize("name", ["k", "v"])
def test_mismatched_devices(name):
    q, k, v = _qkv()
    bad = torch.empty(B, NK, HK, D, device="meta")
    with pytest.raises(ValueError, match=r"device"):
        flashtile.flash_attn_func(q, **{"k": k, "v": v, name: bad})


def test_unsupported_device():
    q, k, v = (t.to("meta") for t in _qkv())
    with pytest.raises(ValueError, match=r"\bq\b.*device"):
        flashtile.flash_attn_func(q, k, v)


@pytest.mark.parametrize("name", ["k", "v"])
def test_batch_mismatch(name):
    q, k, v = _qkv()
    bad = _t(B + 1, NK, HK, D)
    with pytest.raises(ValueError, match=r"batch"):
        flashtile.flash_attn_func(q, **{"k": k, "v": v, name: bad})


@pytest.mark.parametrize("vshape", [(B, NK + 1, HK, D), (B, NK, HK * 2, D)], ids=["seqlen", "nheads"])
def test_k_v_shape_mismatch(vshape):
    q, k, _ = _qkv()
    with pytest.raises(ValueError, match=r"\bk\b.*\bv\b"):
        flashtile.flash_attn_func(q, k, _t(*vshape))


def test_head_dim_mismatch_q_k():
    q = _t(B, NQ, H, D)
    k, v = _t(B, NK, HK, D + 8), _t(B, NK, HK, D + 8)
    with pytest.raises(ValueError, match=r"head dim"):
        flashtile.flash_attn_func(q, k, v)


def test_head_dim_mismatch_v():
    q, k, _ = _qkv()
    with pytest.raises(ValueError, match=r"\bv\b.*head dim"):
        flashtile.flash_attn_func(q, k, _t(B, NK, HK, D * 2))


@pytest.mark.parametrize("headdim", [0, MAX_HEADDIM + 1, 300])
def test_head_dim_out_of_range(headdim):
    q, k, v = _t(B, NQ, H, headdim), _t(B, NK, HK, headdim), _t(B, NK, HK, headdim)
    with pytest.raises(ValueError, match=r"head dim"):
        flashtile.flash_attn_func(q, k, v)


@pytest.mark.parametrize("nheads,nheads_k", [(3, 2), (4, 3), (2, 4), (4, 0)])
def test_nheads_not_divisible(nheads, nheads_k):
    q, k, v = _t(B, NQ, nheads, D), _t(B, NK, nheads_k, D), _t(B, NK, nheads_k, D)
    with pytest.raises(ValueError, match=r"nheads"):
        flashtile.flash_attn_func(q, k, v)


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_non_unit_last_stride(name):
    # Right shape, but the head dimension is strided (a transposed view).
    shape = (B, NQ, H, D) if name == "q" else (B, NK, HK, D)
    base = torch.randn(*shape[:2], shape[3], shape[2])
    bad = base.transpose(-1, -2)
    assert bad.shape == shape and bad.stride(-1) != 1
    with pytest.raises(ValueError, match=rf"\b{name}\b.*contiguous"):
        call(**{name: bad})


def test_non_unit_last_stride_error_suggests_a_fix():
    q = torch.randn(B, NQ, D, H).transpose(-1, -2)
    with pytest.raises(ValueError, match=r"\.contiguous\(\)"):
        call(q=q)


# ---------------------------------------------------------------------------------------
# Scalars
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value,exc",
    [
        (-0.1, ValueError),
        (1.0, ValueError),
        (1.5, ValueError),
        (float("nan"), ValueError),
        (float("inf"), ValueError),
        ("0.1", TypeError),
        (None, TypeError),
        (True, TypeError),
        (torch.tensor(0.1), TypeError),
    ],
    ids=repr,
)
def test_dropout_p_invalid(value, exc):
    with pytest.raises(exc, match=r"dropout_p"):
        call(dropout_p=value)


@pytest.mark.parametrize("value", [0.1, 0.5])
def test_dropout_accepted(value):
    out = call(dropout_p=value)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize(
    "value,exc",
    [
        (0.0, ValueError),
        (-0.5, ValueError),
        (0, ValueError),
        (float("nan"), ValueError),
        (float("inf"), ValueError),
        (-math.inf, ValueError),
        ("0.5", TypeError),
        (True, TypeError),
        ([0.5], TypeError),
    ],
    ids=repr,
)
def test_softmax_scale_invalid(value, exc):
    with pytest.raises(exc, match=r"softmax_scale"):
        call(softmax_scale=value)


@pytest.mark.parametrize("value", [1, 0, "yes", None, 1.0, torch.tensor(True)], ids=repr)
def test_causal_not_bool(value):
    with pytest.raises(TypeError, match=r"causal"):
        call(causal=value)


@pytest.mark.parametrize(
    "value,exc",
    [
        ((-2, 0), ValueError),
        ((0, -5), ValueError),
        ((1.0, 2), TypeError),
        ((1, 2.5), TypeError),
        ((True, 0), TypeError),
        (("3", 0), TypeError),
        (5, TypeError),
        (None, TypeError),
        ("ab", TypeError),
    ],
    ids=repr,
)
def test_window_size_invalid(value, exc):
    with pytest.raises(exc, match=r"window_size"):
        call(window_size=value)


@pytest.mark.parametrize("value", [(1, 2, 3), (4,), ()], ids=repr)
def test_window_size_wrong_length_is_value_error(value):
    with pytest.raises(ValueError, match=r"window_size"):
        call(window_size=value)


@pytest.mark.parametrize("value", [(1, 2, 3), (4,), ()], ids=repr)
def test_window_size_wrong_length_is_rejected(value):
    # Whatever the exception type, a wrong-length window is never silently accepted.
    with pytest.raises((TypeError, ValueError), match=r"window_size"):
        call(window_size=value)


@pytest.mark.parametrize(
    "value,exc", [(-1.0, ValueError), (-0.1, ValueError), (float("nan"), ValueError), ("1", TypeError), (None, TypeError)],
    ids=repr,
)
def test_softcap_invalid(value, exc):
    with pytest.raises(exc, match=r"softcap"):
        call(softcap=value)


def test_softcap_accepted():
    out = call(softcap=30.0)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("value", [[0.5] * H, 0.5, np.ones(H, dtype=np.float32)], ids=["list", "float", "ndarray"])
def test_alibi_slopes_not_tensor(value):
    with pytest.raises(TypeError, match=r"alibi_slopes"):
        call(alibi_slopes=value)


@pytest.mark.parametrize("shape", [(H,), (B, H)])
def test_alibi_slopes_accepted(shape):
    out = call(alibi_slopes=torch.rand(shape, dtype=torch.float32))
    assert torch.isfinite(out).all()


@pytest.mark.parametrize(
    "slopes",
    [torch.rand(H, dtype=torch.float64), torch.rand(H, dtype=torch.float16), torch.rand(H + 1), torch.rand(B, H, 1),
     torch.rand(B + 1, H), torch.rand(H, device="meta")],
    ids=["float64", "float16", "wrong-nheads", "rank3", "wrong-batch", "meta-device"],
)
def test_alibi_slopes_invalid(slopes):
    with pytest.raises(ValueError, match=r"alibi_slopes"):
        call(alibi_slopes=slopes)


@pytest.mark.parametrize("value", [1, 0, "true", None], ids=repr)
def test_deterministic_not_bool(value):
    with pytest.raises(TypeError, match=r"deterministic"):
        call(deterministic=value)


@pytest.mark.parametrize("value", [1, 0, "true", None, torch.tensor(True)], ids=repr)
def test_return_lse_not_bool(value):
    with pytest.raises(TypeError, match=r"return_lse"):
        call(return_lse=value)


def test_error_messages_say_what_is_accepted():
    with pytest.raises(ValueError, match=r"float16.*bfloat16.*float32"):
        call(q=torch.zeros(B, NQ, H, D, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        call(dropout_p=2.0)
    with pytest.raises(ValueError, match=r"-1"):
        call(window_size=(-3, 0))


def test_validation_runs_before_any_kernel(monkeypatch):
    # A bad argument is reported by the checker, never by the backend.
    from flashtile import cpu

    def boom(*args, **kwargs):
        raise AssertionError("backend called with invalid arguments")

    monkeypatch.setattr(cpu, "fwd", boom)  # what a call on CPU tensors reaches, with or without the op
    with pytest.raises(ValueError, match=r"softmax_scale"):
        call(softmax_scale=-1.0)
    with pytest.raises(TypeError, match=r"return_lse"):
        call(return_lse="no")


def test_check_attention_inputs_normalises():
    q, k, v = _qkv()
    p = check_attention_inputs(q, k, v, causal=True, window_size=(4, 9))
    assert (p.window_left, p.window_right) == (4, 0)  # causal caps right at 0
    assert p.softmax_scale == pytest.approx(D ** -0.5)
    assert isinstance(p.softmax_scale, float)
    p = check_attention_inputs(q, k, v, softmax_scale=2)
    assert p.softmax_scale == 2.0 and isinstance(p.softmax_scale, float)
