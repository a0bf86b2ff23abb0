"""The ``flashtile::attention_forward`` / ``flashtile::attention_backward`` custom ops: PyTorch's
``opcheck`` (schema, fake/meta kernel, autograd registration, AOT dispatch) on CPU inputs, and
``torch.compile(fullgraph=True)`` through ``flashtile.flash_attn_func`` (forward and backward)
matching eager with no graph break.
"""

from __future__ import annotations

import pytest
import torch

import flashtile
import flashtile.ops.attention  # noqa: F401  (registers torch.ops.flashtile.*)
from helpers import random_like, random_qkv, reference_attention_grads

FWD = torch.ops.flashtile.attention_forward.default
BWD = torch.ops.flashtile.attention_backward.default


def _fwd_args(seqlen_q, seqlen_k, window, requires_grad, dtype=torch.float32, nheads=4, nheads_k=2,
              softcap=0.0, alibi_slopes=None):
    q, k, v = random_qkv(2, seqlen_q, seqlen_k, nheads, nheads_k, 16, dtype, requires_grad=requires_grad, seed=3)
    return (q, k, v, 0.3, window[0], window[1], softcap, alibi_slopes, 0.0, 0, 0, False)


FWD_CASES = [
    ((9, 9), (-1, -1)),
    ((9, 13), (-1, 0)),  # causal, bottom-right
    ((13, 6), (-1, 0)),  # causal with fully masked rows (lse = -inf)
    ((11, 11), (3, 2)),  # sliding window
]


@pytest.mark.parametrize("requires_grad", [False, True], ids=["nograd", "grad"])
@pytest.mark.parametrize("seqlens,window", FWD_CASES, ids=lambda x: str(x))
def test_opcheck_attention_forward(seqlens, window, requires_grad):
    args = _fwd_args(*seqlens, window, requires_grad)
    torch.library.opcheck(torch.ops.flashtile.attention_forward, args)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_opcheck_attention_forward_low_precision(dtype):
    args = _fwd_args(9, 13, (-1, 0), True, dtype=dtype)
    torch.library.opcheck(torch.ops.flashtile.attention_forward, args, atol=1e-2, rtol=1e-2)


def _bwd_args(seqlen_q, seqlen_k, window, with_dlse):
    q, k, v, scale, left, right, softcap, slopes, p, seed, offset, det = _fwd_args(seqlen_q, seqlen_k, window, False)
    out, lse = FWD(q, k, v, scale, left, right, softcap, slopes, p, seed, offset, det)
    dout = random_like(out, seed=5)
    dlse = random_like(lse, seed=6) if with_dlse else None
    return (dout, q, k, v, out, lse, dlse, scale, left, right, softcap, slopes, p, seed, offset, det)


@pytest.mark.parametrize("with_dlse", [False, True], ids=["dlse_none", "dlse"])
@pytest.mark.parametrize("seqlens,window", FWD_CASES, ids=lambda x: str(x))
def test_opcheck_attention_backward(seqlens, window, with_dlse):
    # The backward op has no autograd formula of its own (no double backward): its inputs do
    # not require grad, so test_autograd_registration checks it is not silently wrong and
    # test_aot_dispatch_dynamic only runs it forward.
    args = _bwd_args(*seqlens, window, with_dlse)
    torch.library.opcheck(torch.ops.flashtile.attention_backward, args)


def test_backward_op_matches_reference():
    # The op reached through torch.ops gives the oracle's gradients (dlse included).
    dout, q, k, v, out, lse, dlse, scale, left, right, softcap, slopes, p, seed, offset, det = _bwd_args(
        13, 6, (-1, 0), True)
    dq, dk, dv = BWD(dout, q, k, v, out, lse, dlse, scale, left, right, softcap, slopes, p, seed, offset, det)
    ref = reference_attention_grads(q, k, v, dout, dlse, softmax_scale=scale, causal=True)
    for a, b in zip((dq, dk, dv), ref[2:]):
        torch.testing.assert_close(a.double(), b, atol=3e-5, rtol=3e-5)


def test_fake_outputs_match_real():
    q, k, v, scale, left, right, softcap, slopes, p, seed, offset, det = _fwd_args(7, 12, (-1, 0), False,
                                                                                   dtype=torch.bfloat16)
    real = FWD(q, k, v, scale, left, right, softcap, slopes, p, seed, offset, det)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
        fake = FWD(fq, fk, fv, scale, left, right, softcap, slopes, p, seed, offset, det)
    for r, f in zip(real, fake):
        assert r.shape == f.shape and r.dtype == f.dtype and r.stride() == f.stride()
    assert real[1].dtype == torch.float32


# ---------------------------------------------------------------------------------------
# torch.compile
# ---------------------------------------------------------------------------------------


def _attention(q, k, v):
    # Bottom-right causal + window, 20 queries on 12 keys: the first 8 rows see no key.
    return flashtile.flash_attn_func(q, k, v, causal=True, window_size=(6, -1), return_lse=True)


def test_torch_compile_fullgraph_forward_and_backward():
    # Only the op inside the compiled region (the upstream gradients are fed to autograd.grad
    # directly): that keeps inductor from generating and building C++ kernels, which is what
    # costs time on a small CPU machine; the custom op's fake kernel, autograd formula and
    # backward op are traced all the same.
    torch._dynamo.reset()
    q, k, v = random_qkv(2, 20, 12, 4, 2, 16, torch.float32, requires_grad=True, seed=8)
    dout = random_like(q, seed=9)
    dlse = random_like(torch.empty(2, 4, 20), seed=10)

    compiled = torch.compile(_attention, fullgraph=True)  # a graph break would raise
    out_c, lse_c = compiled(q, k, v)
    grads_c = torch.autograd.grad((out_c, lse_c), (q, k, v), (dout, dlse))

    out_e, lse_e = _attention(q, k, v)
    grads_e = torch.autograd.grad((out_e, lse_e), (q, k, v), (dout, dlse))

    torch.testing.assert_close(out_c, out_e, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse_c, lse_e, atol=1e-6, rtol=1e-6)  # -inf rows included
    assert (lse_c[:, :, :8] == float("-inf")).all() and (out_c[:, :8] == 0).all()
    for name, a, b in zip(("dq", "dk", "dv"), grads_c, grads_e):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    ref = reference_attention_grads(q, k, v, dout, dlse, causal=True, window_size=(6, -1))
    torch.testing.assert_close(grads_c[0].double(), ref[2], atol=3e-5, rtol=3e-5)


def test_torch_compile_no_graph_break_explain():
    # Dynamo's own account: one graph, no break, the custom op inside it.
    torch._dynamo.reset()
    q, k, v = random_qkv(1, 8, 8, 2, 1, 16, torch.bfloat16, seed=11)

    def f(q, k, v):
        return flashtile.flash_attn_func(q, k, v, causal=True) * 2

    explanation = torch._dynamo.explain(f)(q, k, v)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
    code = "\n".join(g.code for g in explanation.graphs)
    assert "flashtile.attention_forward" in code


def test_opcheck_attention_forward_softcap_alibi():
    args = _fwd_args(9, 13, (-1, 0), True, softcap=2.0, alibi_slopes=torch.tensor([0.1, 0.2, 0.3, 0.4]))
    torch.library.opcheck(torch.ops.flashtile.attention_forward, args)


def test_opcheck_attention_forward_dropout():
    q, k, v, scale, left, right, softcap, slopes, _, _, _, det = _fwd_args(9, 13, (-1, 0), True)
    torch.library.opcheck(torch.ops.flashtile.attention_forward, (q, k, v, scale, left, right, softcap, slopes,
                                                                 0.2, 1234, 16, det))


def test_opcheck_attention_forward_float64():
    args = _fwd_args(5, 6, (-1, 0), False, dtype=torch.float64)
    torch.library.opcheck(torch.ops.flashtile.attention_forward, args)


def test_eager_cpu_calls_skip_the_ops_only_when_nothing_needs_them(monkeypatch):
    from flashtile.ops import attention as ops

    q, k, v = random_qkv(1, 40, 40, 2, 2, 16, torch.float32, requires_grad=True, seed=3)
    want_out = flashtile.flash_attn_func(q, k, v, causal=True)
    want = torch.autograd.grad(want_out.sum(), (q, k, v))
    calls = []
    real_forward, real_backward = ops.attention_forward, ops.attention_backward
    monkeypatch.setattr(ops, "attention_forward", lambda *a: calls.append("forward op") or real_forward(*a))
    monkeypatch.setattr(ops, "attention_backward", lambda *a: calls.append("backward op") or real_backward(*a))
    out = flashtile.flash_attn_func(q, k, v, causal=True)
    assert type(out.grad_fn).__name__ == "EagerAttentionBackward"
    got = torch.autograd.grad(out.sum(), (q, k, v))
    with torch.no_grad():
        flashtile.flash_attn_func(q, k, v, causal=True)
    assert not calls
    assert torch.equal(out, want_out) and all(torch.equal(a, b) for a, b in zip(got, want))

    class PassThrough(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with PassThrough():
        flashtile.flash_attn_func(q, k, v, causal=True).sum().backward()
    assert calls == ["forward op", "backward op"]
