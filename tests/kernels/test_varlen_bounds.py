"""Packed-batch kernels clamp cu_seqlens into the packed tensors.

The public functions check cu_seqlens on the host, but not under CUDA-graph capture or
torch.compile tracing; there the kernels themselves must keep every read and write inside
the tensors.  Called below the validation layer with a cu_seqlens that claims more rows than
exist, the kernels must behave as if each sequence were cut at the tensor's end.
"""

import os

import pytest
import torch

from helpers import random_like

from flashtile.kernels import attention as ka

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not (INTERPRET or torch.cuda.is_available()),
                                reason="needs a GPU or TRITON_INTERPRET=1")


def _packed(total, heads, d, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(total, heads, d, generator=gen).to(DEVICE)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("end", [50, 2**31 - 1])  # claims 50 rows of 10, or int32's largest
def test_cu_seqlens_past_the_tensor_are_cut_at_its_end(causal, end):
    total, heads, d = 10, 2, 32
    q, k, v = (_packed(total, heads, d, seed) for seed in range(3))
    scale = d ** -0.5
    right = 0 if causal else -1
    bad = torch.tensor([0, 3, end], dtype=torch.int32, device=DEVICE)
    cut = torch.tensor([0, 3, 10], dtype=torch.int32, device=DEVICE)
    out, lse = ka.varlen_attention_forward(q, k, v, bad, bad, scale, -1, right, max_seqlen_q=47, max_seqlen_k=47)
    want, want_lse = ka.varlen_attention_forward(q, k, v, cut, cut, scale, -1, right, max_seqlen_q=7, max_seqlen_k=7)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)

    dout = random_like(out, seed=5)
    grads = ka.varlen_attention_backward(dout, q, k, v, out, lse, bad, bad, scale, -1, right,
                                         max_seqlen_q=47, max_seqlen_k=47)
    want_grads = ka.varlen_attention_backward(dout, q, k, v, want, want_lse, cut, cut, scale, -1, right,
                                              max_seqlen_q=7, max_seqlen_k=7)
    for got, ref in zip(grads, want_grads):
        torch.testing.assert_close(got, ref, rtol=0, atol=0)


@pytest.mark.parametrize("bad, fixed, written", [
    ([-5, 4, 8], [0, 4, 8], 8),  # a negative start reads from row 0
    ([0, 6, 3], [0, 6, 6], 6),  # an end before its start is an empty sequence
    ([-2**31, 4, 8], [0, 4, 8], 8),  # int32's extremes: no overflow in end - start
    ([0, -2**31, 8], [0, 0, 8], 8),
])
def test_negative_and_decreasing_cu_seqlens_stay_inside(bad, fixed, written):
    total, heads, d = 8, 1, 32
    q, k, v = (_packed(total, heads, d, seed) for seed in range(3))
    bad = torch.tensor(bad, dtype=torch.int32, device=DEVICE)
    fixed = torch.tensor(fixed, dtype=torch.int32, device=DEVICE)
    out, lse = ka.varlen_attention_forward(q, k, v, bad, bad, d ** -0.5, max_seqlen_q=9, max_seqlen_k=9)
    want, want_lse = ka.varlen_attention_forward(q, k, v, fixed, fixed, d ** -0.5, max_seqlen_q=6, max_seqlen_k=6)
    torch.testing.assert_close(out[:written], want[:written], rtol=0, atol=0)
    torch.testing.assert_close(lse[:, :written], want_lse[:, :written], rtol=0, atol=0)
