"""The Triton attention kernels against the float64 oracle.

Without a GPU these run in Triton's interpreter on CPU tensors (``tests/conftest.py`` sets
``TRITON_INTERPRET=1``), in float32 and float16 -- the interpreter's bf16 ``tl.dot`` is
broken, so bf16 is covered by the ``gpu`` tests on real hardware.  Tolerance is flash-attn's
rule: the kernel's error against float64 is at most twice PyTorch's own error computing the
same thing in the input dtype, plus a small floor.
"""

import os

import pytest
import torch

from helpers import assert_close_to_reference, random_like, random_qkv, reference_attention_grads

from flashtile.kernels import attention as ka

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernels = pytest.mark.skipif(
    not (INTERPRET or torch.cuda.is_available()), reason="needs a GPU or TRITON_INTERPRET=1"
)

FLOOR = {torch.float32: 1e-5, torch.float16: 1e-4, torch.bfloat16: 1e-3}


def _run_and_check(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, causal, window, dtype, device=DEVICE, seed=0):
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype=dtype, device=device, seed=seed)
    scale = headdim ** -0.5
    left, right = window
    if causal:
        right = 0
    out, lse = ka.attention_forward(q, k, v, scale, left, right)
    dout = random_like(out, seed=seed + 1)
    dq, dk, dv = ka.attention_backward(dout, q, k, v, out, lse, scale, left, right)

    kw = dict(softmax_scale=scale, causal=causal, window_size=window)
    ref = reference_attention_grads(q, k, v, dout, upcast=True, **kw)
    low = reference_attention_grads(q, k, v, dout, upcast=False, **kw)
    floor = FLOOR[dtype]
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (batch, nheads, seqlen_q) and lse.dtype == torch.float32
    assert_close_to_reference(out, ref[0], low[0], "out", atol_floor=floor)
    # LSE: -inf exactly where the oracle's is, close elsewhere.
    empty = ref[1] == float("-inf")
    assert torch.equal(lse == float("-inf"), empty), "rows with no visible key must have LSE -inf"
    finite = ~empty
    assert_close_to_reference(lse[finite], ref[1][finite], low[1][finite].to(torch.float64), "lse", atol_floor=floor)
    for name, got, r64, rlow in zip(("dq", "dk", "dv"), (dq, dk, dv), ref[2:], low[2:]):
        assert got.shape == r64.shape and got.dtype == dtype
        assert_close_to_reference(got, r64, rlow, name, atol_floor=floor * 10)


# Interpreter-sized matrix: each case is a few seconds in the interpreter.
CASES = [
    # batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, causal, window
    (1, 1, 1, 1, 1, 64, False, (-1, -1)),
    (1, 17, 17, 2, 2, 40, False, (-1, -1)),
    (1, 17, 17, 2, 1, 96, True, (-1, -1)),
    (2, 128, 128, 2, 2, 64, True, (-1, -1)),
    (1, 128, 200, 2, 1, 64, False, (-1, -1)),
    (1, 200, 128, 4, 2, 40, True, (-1, -1)),  # seqlen_q > seqlen_k: the first 72 rows see nothing
    (1, 17, 200, 2, 2, 128, True, (-1, -1)),
    (1, 200, 17, 2, 2, 64, False, (-1, -1)),
    (1, 100, 100, 2, 2, 64, False, (8, 0)),  # sliding window
    (1, 70, 90, 2, 1, 40, False, (5, 7)),
]


@needs_kernels
@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}-q{}-k{}-h{}/{}-d{}-{}-w{}".format(*c[:6], "causal" if c[6] else "full", c[7]))
def test_fwd_bwd_matches_reference_fp32(case):
    _run_and_check(*case, dtype=torch.float32)


@needs_kernels
@pytest.mark.parametrize("case", CASES[1:7:2], ids=lambda c: "q{}-k{}-d{}".format(c[1], c[2], c[5]))
def test_fwd_bwd_matches_reference_fp16(case):
    _run_and_check(*case, dtype=torch.float16)


@needs_kernels
def test_non_contiguous_inputs_and_odd_headdim():
    """q sliced out of a packed qkv tensor; a head dim that is not a multiple of 8."""
    torch.manual_seed(0)
    qkv = torch.randn(1, 33, 3, 2, 40, device=DEVICE)
    q, k, v = qkv.unbind(2)
    out, lse = ka.attention_forward(q, k, v, 40 ** -0.5, -1, 0)
    ref_out, ref_lse = ka.attention_forward(q.contiguous(), k.contiguous(), v.contiguous(), 40 ** -0.5, -1, 0)
    torch.testing.assert_close(out, ref_out, atol=0, rtol=0)
    q, k, v = random_qkv(1, 20, 20, 1, 1, 20, device=DEVICE)  # 20 * 4 bytes: rows not 16-byte aligned
    out, _ = ka.attention_forward(q, k, v, 0.3, -1, -1)
    dout = random_like(out)
    grads = ka.attention_backward(dout, q, k, v, out, _, 0.3, -1, -1)
    ref = reference_attention_grads(q, k, v, dout, softmax_scale=0.3)
    for got, r in zip((out,) + tuple(grads), (ref[0],) + ref[2:]):
        torch.testing.assert_close(got.double(), r, atol=2e-5, rtol=1e-4)


@needs_kernels
def test_extreme_logits_are_exact():
    """Scores of size ~1000: the running max keeps exp2 in range."""
    q, k, v = random_qkv(1, 40, 40, 1, 1, 32, device=DEVICE)
    out, lse = ka.attention_forward(q * 30, k * 30, v, 1.0, -1, 0)
    ref = reference_attention_grads(q * 30, k * 30, v, torch.ones_like(out), softmax_scale=1.0, causal=True)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    torch.testing.assert_close(out.double(), ref[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse.double(), ref[1], atol=1e-3, rtol=1e-5)


@needs_kernels
def test_lse_gradient():
    """A loss that uses the LSE: its gradient enters through D_i."""
    q, k, v = random_qkv(1, 30, 45, 2, 1, 32, device=DEVICE)
    out, lse = ka.attention_forward(q, k, v, 0.2, -1, 0)
    dout, dlse = random_like(out, seed=3), random_like(lse, seed=4)
    grads = ka.attention_backward(dout, q, k, v, out, lse, 0.2, -1, 0, dlse=dlse)
    ref = reference_attention_grads(q, k, v, dout, dlse=dlse, softmax_scale=0.2, causal=True)
    for got, r in zip(grads, ref[2:]):
        torch.testing.assert_close(got.double(), r, atol=2e-5, rtol=1e-4)


@needs_kernels
def test_backward_takes_views_of_a_longer_sequence():
    """Ring attention's zigzag steps pass the back half of a shard: q, out, dout, LSE and its
    gradient as narrowed views (the LSE view is not contiguous).  The gradients must equal
    those from contiguous copies."""
    q, k, v = random_qkv(1, 64, 64, 2, 1, 32, device=DEVICE)
    out, lse = ka.attention_forward(q, k, v, 0.2, -1, -1)
    dout, dlse = random_like(out, seed=5), random_like(lse, seed=6)
    half = lambda x, dim: x.narrow(dim, 32, 32)  # noqa: E731
    views = (half(dout, 1), half(q, 1), k, v, half(out, 1), half(lse, 2), half(dlse, 2))
    assert not views[5].is_contiguous()
    got = ka.attention_backward(*views[:6], 0.2, -1, -1, dlse=views[6])
    copies = [t.contiguous() for t in views]
    want = ka.attention_backward(*copies[:6], 0.2, -1, -1, dlse=copies[6])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=0, rtol=0)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape, headdim", [((2, 17, 3, 64), 40), ((1, 5, 2, 128), 128), ((3, 1, 1, 32), 32)])
def test_dq_from_workspace_scales_and_rounds_the_first_headdim_columns(shape, headdim, dtype):
    # The Gluon backward's fp32 dQ workspace (the padded head dim last) into dQ: a row count
    # that is no multiple of the kernel's block, columns past the true head dim dropped.
    from flashtile.kernels.attention.backward import dq_from_workspace

    acc = torch.randn(shape, dtype=torch.float32, device=DEVICE)
    dq = dq_from_workspace(acc, headdim, 0.3, dtype)
    assert dq.shape == (*shape[:-1], headdim) and dq.dtype == dtype and dq.is_contiguous()
    expected = (acc[..., :headdim] * 0.3).to(dtype)
    if INTERPRET and dtype == torch.bfloat16:  # the interpreter rounds to bf16 its own way: one ulp
        torch.testing.assert_close(dq.float(), expected.float(), rtol=2 ** -7, atol=0)
    else:
        assert torch.equal(dq, expected)


@needs_kernels
def test_strided_alibi_slopes_and_cu_seqlens():
    """ALiBi slopes and cu_seqlens as every-other-entry views: as contiguous copies."""
    q, k, v = random_qkv(2, 24, 24, 2, 1, 32, device=DEVICE)
    slopes = torch.tensor([0.5, -1.0, 0.25, -1.0], device=DEVICE)[::2]
    got = ka.attention_forward(q, k, v, 0.2, -1, 0, alibi_slopes=slopes)
    want = ka.attention_forward(q, k, v, 0.2, -1, 0, alibi_slopes=slopes.contiguous())
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    packed = [t.reshape(-1, *t.shape[2:]) for t in (q, k, v)]
    cu = torch.tensor([0, 99, 10, 99, 48, 99], dtype=torch.int32, device=DEVICE)[::2]
    got = ka.varlen_attention_forward(*packed, cu, cu, 0.2, -1, 0)
    want = ka.varlen_attention_forward(*packed, cu.contiguous(), cu.contiguous(), 0.2, -1, 0)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# ----------------------------------------------------------------------------------------
# GPU only
# ----------------------------------------------------------------------------------------

GPU_CASES = CASES + [
    (2, 1000, 1000, 4, 4, 64, False, (-1, -1)),
    (2, 1000, 1000, 4, 4, 128, False, (-1, -1)),
    (2, 1000, 1000, 4, 4, 256, False, (-1, -1)),
    (2, 1000, 1000, 4, 2, 64, True, (-1, -1)),
    (2, 1000, 1000, 4, 1, 128, True, (-1, -1)),
    (1, 513, 700, 2, 2, 256, True, (-1, -1)),
    (1, 700, 513, 2, 2, 80, True, (-1, -1)),
    (1, 777, 777, 2, 2, 96, False, (64, 0)),
    (1, 4096, 4096, 8, 2, 128, True, (-1, -1)),
    (1, 16384, 16384, 4, 4, 64, True, (-1, -1)),
    (1, 16384, 16384, 2, 2, 128, False, (-1, -1)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "b{}-q{}-k{}-h{}/{}-d{}-{}-w{}".format(*c[:6], "causal" if c[6] else "full", c[7]))
def test_gpu_fwd_bwd_matches_reference(case, dtype):
    _run_and_check(*case, dtype=dtype, device="cuda")


@pytest.mark.gpu
def test_gpu_public_api_autograd_and_compile():
    import flashtile

    q, k, v = random_qkv(2, 300, 300, 4, 2, 128, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    out = flashtile.flash_attn_func(q, k, v, causal=True)
    out.backward(random_like(out))
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    compiled = torch.compile(lambda a, b, c: flashtile.flash_attn_func(a, b, c, causal=True), fullgraph=True)
    out_c = compiled(q, k, v)
    out_c.backward(random_like(out_c))
    torch.testing.assert_close(out_c, out, atol=0, rtol=0)
    for t, g in zip((q, k, v), grads):
        torch.testing.assert_close(t.grad, g, atol=0, rtol=0)


@pytest.mark.gpu
def test_gpu_backward_is_deterministic():
    q, k, v = random_qkv(2, 1024, 1024, 8, 2, 128, dtype=torch.bfloat16, device="cuda")
    out, lse = ka.attention_forward(q, k, v, 128 ** -0.5, -1, 0)
    dout = random_like(out)
    first = ka.attention_backward(dout, q, k, v, out, lse, 128 ** -0.5, -1, 0, deterministic=True)
    for _ in range(100):
        again = ka.attention_backward(dout, q, k, v, out, lse, 128 ** -0.5, -1, 0, deterministic=True)
        for a, b in zip(first, again):
            assert torch.equal(a, b)


@pytest.mark.gpu
def test_gpu_more_than_2_31_elements():
    """64-bit offsets: q, k, v each hold 2^31 + elements (4 GiB in bf16)."""
    batch, n, h, d = 65537, 128, 2, 128  # 65537 * 128 * 2 * 128 > 2**31
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(batch, n, h, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    assert q.numel() > 2**31
    out, lse = ka.attention_forward(q, k, v, d ** -0.5, -1, 0)
    dout = torch.randn(out.shape, device="cuda", dtype=out.dtype, generator=gen)
    dq, dk, dv = ka.attention_backward(dout, q, k, v, out, lse, d ** -0.5, -1, 0)
    for b in (0, batch - 1):
        sl = slice(b, b + 1)
        ref = reference_attention_grads(q[sl], k[sl], v[sl], dout[sl], causal=True)
        low = reference_attention_grads(q[sl], k[sl], v[sl], dout[sl], causal=True, upcast=False)
        assert_close_to_reference(out[sl], ref[0], low[0], f"out[{b}]", atol_floor=1e-3)
        for name, got, r, lo in zip(("dq", "dk", "dv"), (dq[sl], dk[sl], dv[sl]), ref[2:], low[2:]):
            assert_close_to_reference(got, r, lo, f"{name}[{b}]", atol_floor=1e-2)


@needs_kernels
@pytest.mark.parametrize(
    "softcap,alibi_shape,causal",
    [(4.0, None, False), (2.0, None, True), (0.0, "heads", True), (0.0, "batch-heads", False), (3.0, "heads", True)],
    ids=["softcap", "softcap-causal", "alibi-causal", "alibi-per-batch", "both-causal"],
)
def test_softcap_and_alibi_match_reference(softcap, alibi_shape, causal):
    q, k, v = random_qkv(2, 37, 45, 2, 1, 32, device=DEVICE, seed=9)
    q = q * 2  # scores big enough for the softcap to bend them
    gen = torch.Generator().manual_seed(3)
    slopes = None
    if alibi_shape == "heads":
        slopes = (torch.rand(2, generator=gen) * 0.5).to(DEVICE)
    elif alibi_shape == "batch-heads":
        slopes = (torch.rand(2, 2, generator=gen) * 0.5).to(DEVICE)
    right = 0 if causal else -1
    kw = dict(softcap=softcap, alibi_slopes=slopes)
    out, lse = ka.attention_forward(q, k, v, 0.3, -1, right, **kw)
    dout = random_like(out, seed=4)
    ref = reference_attention_grads(q, k, v, dout, softmax_scale=0.3, causal=causal, **kw)
    torch.testing.assert_close(out.double(), ref[0], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(lse.double(), ref[1], atol=2e-5, rtol=1e-5)
    grads = ka.attention_backward(dout, q, k, v, out, lse, 0.3, -1, right, **kw)
    for name, got, r in zip(("dq", "dk", "dv"), grads, ref[2:]):
        torch.testing.assert_close(got.double(), r, atol=5e-5, rtol=1e-4, msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("softcap,use_alibi,causal", [(30.0, False, True), (0.0, True, True), (20.0, True, False)])
def test_gpu_softcap_and_alibi(dtype, softcap, use_alibi, causal):
    import flashtile

    q, k, v = random_qkv(2, 1000, 1100, 8, 2, 128, dtype=dtype, device="cuda", requires_grad=True, seed=11)
    slopes = torch.rand(8, device="cuda", dtype=torch.float32) * 0.1 if use_alibi else None
    kw = dict(softcap=softcap, alibi_slopes=slopes, causal=causal)
    out = flashtile.flash_attn_func(q, k, v, **kw)
    dout = random_like(out, seed=12)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref = reference_attention_grads(q, k, v, dout, **kw)
    low = reference_attention_grads(q, k, v, dout, upcast=False, **kw)
    assert_close_to_reference(out, ref[0], low[0], "out", atol_floor=1e-3)
    for name, got, r, lo in zip(("dq", "dk", "dv"), grads, ref[2:], low[2:]):
        assert_close_to_reference(got, r, lo, name, atol_floor=1e-2)


@needs_kernels
@pytest.mark.parametrize("causal,window,softcap,alibi", [(False, (-1, -1), 0.0, False), (True, (-1, -1), 0.0, False),
                                                        (False, (3, 2), 2.0, True)])
def test_varlen_kernels_match_cpu_path(causal, window, softcap, alibi):
    """One launch over a packed batch (empty and length-1 sequences included) equals the per-sequence CPU path."""
    from flashtile import cpu

    cu_q = torch.tensor([0, 20, 27, 27, 28, 60], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 20, 27, 32, 35, 50], dtype=torch.int32, device=DEVICE)
    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(n, h, 40, generator=gen).to(DEVICE) for n, h in ((60, 4), (50, 2), (50, 2)))
    slopes = (torch.rand(5, 4, generator=gen) * 0.3).to(DEVICE) if alibi else None
    left, right = window[0], 0 if causal else window[1]
    kw = dict(softcap=softcap, alibi_slopes=slopes)
    out, lse = ka.varlen_attention_forward(q, k, v, cu_q, cu_k, 0.3, left, right, **kw)
    # The CPU path's oracle on CPU copies (its fused branch is a CPU-only op).
    host = lambda t: None if t is None else t.double().cpu()  # noqa: E731
    ref_kw = dict(softcap=softcap, alibi_slopes=None if slopes is None else slopes.cpu())
    ref_out, ref_lse = cpu.varlen_attention_forward(host(q), host(k), host(v), cu_q.cpu(), cu_k.cpu(), 0.3,
                                                    left, right, **ref_kw)
    torch.testing.assert_close(host(out), ref_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(host(lse), ref_lse, atol=2e-5, rtol=1e-5)  # -inf rows must match
    dout, dlse = random_like(out, seed=9), random_like(lse, seed=10)
    grads = ka.varlen_attention_backward(dout, q, k, v, out, lse, cu_q, cu_k, 0.3, left, right, dlse=dlse, **kw)
    ref = cpu.varlen_attention_backward(host(dout), host(q), host(k), host(v), ref_out, ref_lse,
                                        cu_q.cpu(), cu_k.cpu(), 0.3, left, right, dlse=host(dlse), **ref_kw)
    for name, got, r in zip(("dq", "dk", "dv"), grads, ref):
        torch.testing.assert_close(host(got), r, atol=5e-5, rtol=1e-4, msg=name)
