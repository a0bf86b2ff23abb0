"""``torch.autograd.gradcheck`` in float64 on the CPU path: the analytic backward (both
engines: the fused kernel where it applies, the tiled path for the rest) against finite
differences of the forward, for every option the backward handles itself."""

from __future__ import annotations

import pytest
import torch

import flashtile


def _inputs(batch, seqlen_q, seqlen_k, nheads, nheads_k, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seqlen_q, nheads, d, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(batch, seqlen_k, nheads_k, d, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(batch, seqlen_k, nheads_k, d, generator=g, dtype=torch.float64, requires_grad=True)
    return q, k, v


CASES = {
    "plain": dict(),
    "causal": dict(causal=True),
    "causal-more-queries": dict(causal=True, seqlens=(7, 4)),  # empty rows, fused with row offset
    "causal-more-keys": dict(causal=True, seqlens=(4, 7)),  # bottom-right: tiled
    "window": dict(window_size=(2, 1)),
    "gqa": dict(heads=(4, 2), causal=True),
    "mqa": dict(heads=(4, 1)),
    "softcap": dict(softcap=2.0),
    "alibi": dict(alibi=True, causal=True),
    "alibi-per-batch-softcap": dict(alibi="batch", softcap=3.0),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
@pytest.mark.parametrize("return_lse", [False, True], ids=["out", "out+lse"])
def test_flash_attn_func_gradcheck(case, return_lse):
    case = dict(case)
    seqlen_q, seqlen_k = case.pop("seqlens", (5, 6))
    nheads, nheads_k = case.pop("heads", (2, 2))
    alibi = case.pop("alibi", None)
    q, k, v = _inputs(2, seqlen_q, seqlen_k, nheads, nheads_k, 4)
    if alibi:
        shape = (2, nheads) if alibi == "batch" else (nheads,)
        case["alibi_slopes"] = torch.rand(shape, generator=torch.Generator().manual_seed(1)) * 0.5

    def f(q, k, v):
        res = flashtile.flash_attn_func(q, k, v, return_lse=return_lse, **case)
        if not return_lse:
            return res
        out, lse = res
        return out, torch.where(torch.isinf(lse), 0.0, lse)  # -inf rows: no gradient, finite output

    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_gradcheck(causal):
    cu_q = torch.tensor([0, 3, 3, 8], dtype=torch.int32)  # one empty sequence
    cu_k = torch.tensor([0, 4, 6, 11], dtype=torch.int32)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(8, 2, 4, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(11, 1, 4, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(11, 1, 4, generator=g, dtype=torch.float64, requires_grad=True)

    def f(q, k, v):
        return flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 5, causal=causal)

    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_packed_gradcheck():
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(1, 5, 3, 2, 4, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: flashtile.flash_attn_qkvpacked_func(t, causal=True), (qkv,),
                                    eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("mask", [None, "bool", "float"])
def test_softmax_gradcheck(log, mask):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 7, generator=g, dtype=torch.float64, requires_grad=True)
    m = None
    if mask == "bool":
        m = torch.rand(3, 7, generator=g) > 0.3
        m[:, 0] = True  # no empty row: log_softmax of an empty row is -inf
    elif mask == "float":
        m = torch.randn(7, generator=g, dtype=torch.float64)
    fn = flashtile.log_softmax if log else flashtile.softmax

    def f(t):
        y = fn(t, dim=-1, scale=0.7, mask=m)
        return torch.where(torch.isinf(y), 0.0, y)  # masked entries of log_softmax are -inf

    assert torch.autograd.gradcheck(f, (x,), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_float64_results_are_float64_exact():
    # float64 in, float64 out, LSE float64, at float64 accuracy against the materialising formula.
    q, k, v = _inputs(1, 9, 11, 2, 1, 8)
    out, lse = flashtile.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert out.dtype == torch.float64 and lse.dtype == torch.float64
    kk, vv = k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) * 8 ** -0.5
    s = s.masked_fill(torch.ones(9, 11, dtype=torch.bool).tril(2).logical_not(), float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(s, -1), atol=1e-13, rtol=1e-13)
    torch.testing.assert_close(out, torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), vv), atol=1e-13, rtol=1e-13)
    x = torch.randn(4, 6, dtype=torch.float64)
    assert flashtile.softmax(x).dtype == torch.float64
    torch.testing.assert_close(flashtile.softmax(x), x.softmax(-1), atol=1e-15, rtol=1e-14)
