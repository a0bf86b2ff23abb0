"""Attention dropout: the counter-based mask, its reproducibility, and exactness against a reference
that applies the very same mask explicitly."""

import os

import pytest
import torch

import flashtile
from flashtile import dropout as fd
from helpers import random_like, random_qkv

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_kernels = pytest.mark.skipif(not (INTERPRET or torch.cuda.is_available()), reason="needs a GPU or the interpreter")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _masked_reference(q, k, v, dout, mask, p, causal):
    """float64 attention with an explicit dropout mask: out = (P * M / (1 - p)) V, and its grads."""
    qd, kd, vd = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    group = q.shape[2] // k.shape[2]
    s = torch.einsum("bqhd,bkhd->bhqk", qd, kd.repeat_interleave(group, 2)) * q.shape[-1] ** -0.5
    if causal:
        nq, nk = q.shape[1], k.shape[1]
        visible = torch.arange(nk, device=q.device)[None, :] <= torch.arange(nq, device=q.device)[:, None] + nk - nq
        s = s.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(s, dim=-1).nan_to_num(0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", probs * mask.double() / (1 - p), vd.repeat_interleave(group, 2))
    grads = torch.autograd.grad(out, (qd, kd, vd), dout.double())
    return out, grads


@needs_kernels
def test_philox_matches_triton_rand():
    import triton
    import triton.language as tl

    @triton.jit
    def draw(out, seed, offset, N: tl.constexpr):
        counters = tl.arange(0, N).to(tl.int64) * 104729 + offset
        tl.store(out + tl.arange(0, N), tl.rand(seed, counters))

    for seed, offset in [(0, 0), (987654321987, 12), (2**61 + 3, 2**34 + 5)]:
        got = torch.empty(128, device=DEVICE)
        draw[(1,)](got, seed, offset, 128)
        want = fd.philox_uniform(seed, torch.arange(128, dtype=torch.int64, device=DEVICE) * 104729 + offset)
        assert torch.equal(got, want)


@needs_kernels
def test_philox4x32_matches_triton_randint4x():
    """All four words, bit for bit: the kernels' keep decisions use every one of them."""
    import triton
    import triton.language as tl

    @triton.jit
    def draw(out, seed, offset, N: tl.constexpr):
        idx = tl.arange(0, N)
        r0, r1, r2, r3 = tl.randint4x(seed, idx.to(tl.int64) * 7919 + offset)
        # uint32 -> int64 zero-extends: the stored values are the words' unsigned values.
        tl.store(out + idx, r0.to(tl.int64))
        tl.store(out + N + idx, r1.to(tl.int64))
        tl.store(out + 2 * N + idx, r2.to(tl.int64))
        tl.store(out + 3 * N + idx, r3.to(tl.int64))

    for seed, offset in [(0, 0), (2**61 + 3, 2**34 + 5)]:
        got = torch.empty(4 * 64, dtype=torch.int64, device=DEVICE)
        draw[(1,)](got, seed, offset, 64)
        want = fd.philox4x32(seed, torch.arange(64, dtype=torch.int64, device=DEVICE) * 7919 + offset)
        assert torch.equal(got.view(4, 64), torch.stack(want))


def test_keep_rate_and_independence():
    mask = fd.dropout_mask(1234, 0, 2, 4, 64, 128, 0.3)
    rate = mask.float().mean().item()
    assert abs(rate - 0.7) < 0.01, rate
    other = fd.dropout_mask(1235, 0, 2, 4, 64, 128, 0.3)
    assert (mask != other).float().mean().item() > 0.3  # a different seed gives a different mask


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_dropout_matches_masked_reference(causal, dtype):
    q, k, v = random_qkv(2, 33, 47, 4, 2, 32, dtype=dtype, requires_grad=True, seed=3)
    p = 0.25
    with fd.capture() as calls:
        out = flashtile.flash_attn_func(q, k, v, dropout_p=p, causal=causal)
    (seed, offset), = calls
    mask = fd.dropout_mask(seed, offset, 2, 4, 33, 47, p)
    dout = random_like(out, seed=4)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref, ref_grads = _masked_reference(q, k, v, dout, mask, p, causal)
    tol = dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(out.double(), ref, **tol)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.double(), r, **tol)


def test_manual_seed_reproduces_and_calls_differ():
    q, k, v = random_qkv(1, 20, 20, 2, 2, 16, seed=5)
    torch.manual_seed(7)
    a = flashtile.flash_attn_func(q, k, v, dropout_p=0.5)
    b = flashtile.flash_attn_func(q, k, v, dropout_p=0.5)
    torch.manual_seed(7)
    a2 = flashtile.flash_attn_func(q, k, v, dropout_p=0.5)
    assert torch.equal(a, a2)
    assert not torch.equal(a, b)


def test_dropout_mean_is_unbiased():
    """E[dropout(P)] = P: averaging many draws approaches the dropout-free output."""
    q, k, v = random_qkv(1, 8, 64, 1, 1, 16, seed=6)
    torch.manual_seed(0)  # the 400 masks; the bound holds with a wide margin for any seed
    plain = flashtile.flash_attn_func(q, k, v)
    mean = torch.stack([flashtile.flash_attn_func(q, k, v, dropout_p=0.2) for _ in range(400)]).mean(0)
    assert (mean - plain).abs().max().item() < 0.06


@needs_kernels
@pytest.mark.parametrize("causal", [False, True])
def test_kernels_apply_the_same_mask_as_the_cpu_path(causal):
    """Triton kernels (GPU or interpreter) and the CPU path, fed the same (seed, offset), agree."""
    from flashtile import cpu
    from flashtile.kernels import attention as ka

    q, k, v = random_qkv(2, 37, 45, 4, 2, 32, device=DEVICE, seed=8)
    drop = (0.3, 123456789, 8)
    right = 0 if causal else -1
    out, lse = ka.attention_forward(q, k, v, 0.3, -1, right, dropout=drop)
    ref_out, ref_lse = cpu.attention_forward(q.double(), k.double(), v.double(), 0.3, -1, right, dropout=drop)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=1e-4)
    dout = random_like(out, seed=9)
    grads = ka.attention_backward(dout, q, k, v, out, lse, 0.3, -1, right, dropout=drop)
    ref = cpu.attention_backward(dout.double(), q.double(), k.double(), v.double(), ref_out, ref_lse, 0.3, -1, right,
                                 dropout=drop)
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g.double(), r, atol=5e-5, rtol=1e-4)


@needs_kernels
def test_varlen_kernels_dropout_match_cpu_path():
    from flashtile import cpu
    from flashtile.kernels import attention as ka

    cu_q = torch.tensor([0, 20, 20, 33], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 25, 30, 41], dtype=torch.int32, device=DEVICE)
    gen = torch.Generator().manual_seed(10)
    q, k, v = (torch.randn(n, h, 32, generator=gen).to(DEVICE) for n, h in ((33, 4), (41, 2), (41, 2)))
    drop = (0.2, 42, 0)
    # A max_seqlen_k above the longest sequence changes the RNG's row length: both paths follow it.
    out, lse = ka.varlen_attention_forward(q, k, v, cu_q, cu_k, 0.25, -1, 0, dropout=drop, max_seqlen_q=20,
                                           max_seqlen_k=30)
    ref_out, ref_lse = cpu.varlen_attention_forward(q.double(), k.double(), v.double(), cu_q.cpu(), cu_k.cpu(), 0.25,
                                                    -1, 0, dropout=drop, max_seqlen_k=30)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=1e-4)
    dout = random_like(out, seed=11)
    grads = ka.varlen_attention_backward(dout, q, k, v, out, lse, cu_q, cu_k, 0.25, -1, 0, dropout=drop,
                                         max_seqlen_q=20, max_seqlen_k=30)
    ref = cpu.varlen_attention_backward(dout.double(), q.double(), k.double(), v.double(), ref_out, ref_lse,
                                        cu_q.cpu(), cu_k.cpu(), 0.25, -1, 0, dropout=drop, max_seqlen_k=30)
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g.double(), r, atol=5e-5, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_dropout_matches_masked_reference(causal):
    q, k, v = random_qkv(2, 500, 600, 8, 2, 128, dtype=torch.bfloat16, device="cuda", requires_grad=True, seed=12)
    p = 0.15
    with fd.capture() as calls:
        out = flashtile.flash_attn_func(q, k, v, dropout_p=p, causal=causal)
    (seed, offset), = calls
    mask = fd.dropout_mask(seed, offset, 2, 8, 500, 600, p, device="cuda")
    dout = random_like(out, seed=13)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref, ref_grads = _masked_reference(q, k, v, dout, mask, p, causal)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.double(), r, atol=5e-2, rtol=5e-2)
