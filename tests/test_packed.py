"""The packed attention functions: same results as the unpacked call on the same tensors, the
gradient lands in the packed tensor, and both agree with the float64 oracle.

CPU tensors run the PyTorch path; the ``kernel`` tests point the attention op's dispatch at
the Triton kernels (interpreter, float16) to check that the kernels read the strided views
of a packed tensor correctly.
"""

import os

import pytest
import torch

from helpers import assert_close_to_reference, reference_attention_grads

import flashtile
import flashtile.ops.attention as attention_ops
from flashtile import cpu
from flashtile import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernels = pytest.mark.skipif(not (INTERPRET or torch.cuda.is_available()),
                                   reason="needs a GPU or TRITON_INTERPRET=1")


def _leaf(*shape, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float32).to(dtype=dtype, device=device).requires_grad_()


def _unpacked_leaves(packed):
    """Independent leaves holding the same values as each slice of the packing axis."""
    return [t.detach().clone().requires_grad_() for t in packed.unbind(dim=-3)]


def _check_same(got, want, exact):
    if exact:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)


def _compare_qkvpacked(device, dtype, causal, window, varlen, exact):
    b, n, h, d = 2, 9, 2, 16
    if varlen:
        cu = torch.tensor([0, 4, 4, 13], dtype=torch.int32, device=device)
        qkv = _leaf(13, 3, h, d, dtype=dtype, device=device)
    else:
        qkv = _leaf(b, n, 3, h, d, dtype=dtype, device=device)
    kw = dict(causal=causal, window_size=window, return_lse=True)
    if varlen:
        out, lse = flash_attn_varlen_qkvpacked_func(qkv, cu, 9, **kw)
    else:
        out, lse = flash_attn_qkvpacked_func(qkv, **kw)
    dout = torch.randn_like(out)
    out.backward(dout)
    assert qkv.grad is not None and qkv.grad.shape == qkv.shape

    q, k, v = _unpacked_leaves(qkv)
    if varlen:
        out2, lse2 = flash_attn_varlen_func(q, k, v, cu, cu, 9, 9, **kw)
    else:
        out2, lse2 = flash_attn_func(q, k, v, **kw)
    out2.backward(dout)
    _check_same(out, out2, exact)
    _check_same(lse, lse2, exact)
    for i, grad in enumerate((q.grad, k.grad, v.grad)):
        _check_same(qkv.grad.select(-3, i), grad, exact)
    return qkv, out, dout


def _compare_kvpacked(device, dtype, causal, varlen, exact):
    h, hk, d = 4, 2, 16
    if varlen:
        cu_q = torch.tensor([0, 3, 5], dtype=torch.int32, device=device)
        cu_k = torch.tensor([0, 7, 15], dtype=torch.int32, device=device)
        q, kv = _leaf(5, h, d, dtype=dtype, device=device), _leaf(15, 2, hk, d, dtype=dtype, device=device, seed=1)
    else:
        q, kv = _leaf(2, 3, h, d, dtype=dtype, device=device), _leaf(2, 8, 2, hk, d, dtype=dtype, device=device, seed=1)
    kw = dict(causal=causal, return_lse=True)
    if varlen:
        out, lse = flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, 3, 8, **kw)
    else:
        out, lse = flash_attn_kvpacked_func(q, kv, **kw)
    dout = torch.randn_like(out)
    out.backward(dout)
    assert kv.grad is not None and kv.grad.shape == kv.shape

    q2 = q.detach().clone().requires_grad_()
    k, v = _unpacked_leaves(kv)
    if varlen:
        out2, lse2 = flash_attn_varlen_func(q2, k, v, cu_q, cu_k, 3, 8, **kw)
    else:
        out2, lse2 = flash_attn_func(q2, k, v, **kw)
    out2.backward(dout)
    _check_same(out, out2, exact)
    _check_same(lse, lse2, exact)
    _check_same(q.grad, q2.grad, exact)
    _check_same(kv.grad.select(-3, 0), k.grad, exact)
    _check_same(kv.grad.select(-3, 1), v.grad, exact)


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (3, 1))])
@pytest.mark.parametrize("varlen", [False, True])
def test_qkvpacked_equals_unpacked_call_cpu(causal, window, varlen):
    _compare_qkvpacked("cpu", torch.float32, causal, window, varlen, exact=False)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("varlen", [False, True])
def test_kvpacked_equals_unpacked_call_cpu(causal, varlen):
    _compare_kvpacked("cpu", torch.float32, causal, varlen, exact=False)


def test_qkvpacked_gradient_matches_float64_oracle():
    qkv, out, dout = _compare_qkvpacked("cpu", torch.float32, True, (-1, -1), False, exact=False)
    q, k, v = qkv.detach().unbind(dim=2)
    ref = reference_attention_grads(q, k, v, dout, upcast=True, causal=True)
    low = reference_attention_grads(q, k, v, dout, upcast=False, causal=True)
    assert_close_to_reference(out, ref[0], low[0], "out")
    for i, name in enumerate(("dq", "dk", "dv")):
        assert_close_to_reference(qkv.grad[:, :, i], ref[2 + i], low[2 + i], name, atol_floor=1e-4)


def test_packed_inputs_are_not_copied(monkeypatch):
    """The attention backend receives views whose storage is the packed tensor's."""
    seen = []
    real = cpu.fwd

    def spy(q, k, v, *args, **kwargs):
        seen.append((q.untyped_storage().data_ptr(), k.untyped_storage().data_ptr(), v.untyped_storage().data_ptr()))
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(cpu, "fwd", spy)
    qkv = _leaf(1, 4, 3, 2, 8)
    flash_attn_qkvpacked_func(qkv)
    assert seen == [(qkv.untyped_storage().data_ptr(),) * 3]


def _through_kernels(monkeypatch):
    """CUDA tensors take the Triton kernels anyway; in the interpreter, send CPU tensors there."""
    if KERNEL_DEVICE == "cpu":
        from flashtile.kernels import attention as triton_attention

        monkeypatch.setattr(attention_ops, "_backend", lambda t: triton_attention)


@needs_kernels
@pytest.mark.parametrize("varlen", [False, True])
def test_qkvpacked_through_kernels(monkeypatch, varlen):
    _through_kernels(monkeypatch)
    qkv, out, dout = _compare_qkvpacked(KERNEL_DEVICE, torch.float16, True, (-1, -1), varlen, exact=False)
    if not varlen:
        q, k, v = qkv.detach().unbind(dim=2)
        ref = reference_attention_grads(q, k, v, dout, upcast=True, causal=True)
        low = reference_attention_grads(q, k, v, dout, upcast=False, causal=True)
        for i, name in enumerate(("dq", "dk", "dv")):
            assert_close_to_reference(qkv.grad[:, :, i], ref[2 + i], low[2 + i], name, atol_floor=1e-3)


@needs_kernels
@pytest.mark.parametrize("varlen", [False, True])
def test_kvpacked_through_kernels(monkeypatch, varlen):
    _through_kernels(monkeypatch)
    _compare_kvpacked(KERNEL_DEVICE, torch.float16, True, varlen, exact=False)


@pytest.mark.parametrize("call,message", [
    (lambda: flash_attn_qkvpacked_func(torch.randn(2, 4, 2, 2, 8)), "qkv must have shape \\(batch, seqlen, 3"),
    (lambda: flash_attn_qkvpacked_func(torch.randn(4, 3, 2, 8)), "qkv must have 5 dimensions"),
    (lambda: flash_attn_qkvpacked_func(torch.randn(2, 4, 3, 2, 8).long()), "qkv must have dtype"),
    (lambda: flash_attn_kvpacked_func(torch.randn(2, 4, 2, 8), torch.randn(2, 4, 3, 2, 8)), "kv must have shape"),
    (lambda: flash_attn_varlen_qkvpacked_func(torch.randn(2, 4, 3, 2, 8), torch.tensor([0, 4], dtype=torch.int32), 4),
     "qkv must have 4 dimensions"),
    (lambda: flash_attn_varlen_kvpacked_func(torch.randn(4, 2, 8), torch.randn(4, 3, 2, 8),
                                             torch.tensor([0, 4], dtype=torch.int32),
                                             torch.tensor([0, 4], dtype=torch.int32), 4, 4), "kv must have shape"),
])
def test_bad_packed_shapes_name_the_argument(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_qkvpacked_not_a_tensor():
    with pytest.raises(TypeError, match="qkv must be a torch.Tensor"):
        flash_attn_qkvpacked_func([[1.0]])


def test_exported():
    for name in ("flash_attn_qkvpacked_func", "flash_attn_kvpacked_func", "flash_attn_varlen_qkvpacked_func",
                 "flash_attn_varlen_kvpacked_func"):
        assert name in flashtile.__all__ and callable(getattr(flashtile, name))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("varlen", [False, True])
def test_gpu_packed_gradients_equal_unpacked_call(dtype, varlen):
    _compare_qkvpacked("cuda", dtype, True, (-1, -1), varlen, exact=True)
    _compare_kvpacked("cuda", dtype, True, varlen, exact=True)
