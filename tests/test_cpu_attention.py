"""``flashtile.flash_attn_func`` on CPU tensors (the tiled PyTorch path) against a float64 oracle.

Forward, LSE and gradients are compared with :func:`helpers.reference_attention`:
* float32 inputs with float32-level tolerances;
* float16 / bfloat16 inputs with flash-attn's rule (error at most twice that of the same naive
  computation done in the low precision by PyTorch, plus a small floor).
Also: bottom-right causal / sliding-window masks with ``seqlen_q != seqlen_k`` (fully masked
rows), GQA/MQA, head dims, the LSE and gradients through it, extreme logits, non-contiguous
inputs, inf/NaN propagation, tile sizes that do not divide the sequence, and a check that no
``seqlen_q x seqlen_k`` tensor is ever allocated.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import flashtile
from flashtile import cpu
from flashtile.cpu.numerics import exp2_flushed
from flashtile.masking import mask_array, normalize_window
from helpers import (
    assert_close_to_reference,
    random_like,
    random_qkv,
    reference_attention,
    reference_attention_grads,
)

LOWP = (torch.float16, torch.bfloat16)
# float32 against the float64 oracle: observed errors are ~1e-6 (out) / ~4e-6 (grads, N=1000).
FP32_OUT_TOL = dict(atol=1e-5, rtol=1e-5)
FP32_GRAD_TOL = dict(atol=3e-5, rtol=3e-5)
# flash-attn rule floors (out, dq, dk, dv).
FP32_FLOORS = (1e-5, 3e-5, 3e-5, 3e-5)
LOWP_FLOORS = (1e-5, 1e-5, 1e-5, 1e-5)
# The LSE is computed in float32 whatever the input dtype; against float64 on the same inputs.
EPS32 = torch.finfo(torch.float32).eps
LSE_TOL = dict(atol=1e-5, rtol=1e-5)


def _max_abs_score(q, k, softmax_scale):
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    group = q.shape[2] // k.shape[2]
    kk = k.detach().double().repeat_interleave(group, dim=2)
    return torch.einsum("bqhd,bkhd->bhqk", q.detach().double(), kk).abs().max().item() * scale if q.numel() and k.numel() else 0.0


def _empty_rows(seqlen_q, seqlen_k, causal, window):
    left, right = normalize_window(causal, window)
    return ~_mask(seqlen_q, seqlen_k, left, right).any(dim=-1)


def _mask(seqlen_q, seqlen_k, left, right):
    # (mask_array gives a (1, seqlen_k) row when both sides are unbounded)
    return mask_array(seqlen_q, seqlen_k, left, right, xp=torch).expand(seqlen_q, seqlen_k)


def check_against_reference(
    dtype,
    batch,
    seqlen_q,
    seqlen_k,
    nheads,
    nheads_k,
    headdim,
    causal=False,
    window=(-1, -1),
    softmax_scale=None,
    use_lse_grad=False,
    seed=0,
    softcap=0.0,
    alibi_slopes=None,
):
    """Run flash_attn_func fwd + bwd and compare out, lse, dq, dk, dv with the oracle."""
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype, requires_grad=True, seed=seed)
    out, lse = flashtile.flash_attn_func(
        q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window, return_lse=True,
        softcap=softcap, alibi_slopes=alibi_slopes,
    )
    assert out.shape == q.shape and out.dtype == dtype and out.device == q.device
    assert lse.shape == (batch, nheads, seqlen_q) and lse.dtype == torch.float32

    dout = random_like(out, seed=seed + 1)
    outputs, grad_outputs = [out], [dout]
    dlse = None
    if use_lse_grad:
        dlse = random_like(lse, seed=seed + 2)
        outputs.append(lse)
        grad_outputs.append(dlse)
    dq, dk, dv = torch.autograd.grad(outputs, (q, k, v), grad_outputs)
    for name, g, x in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        assert g.shape == x.shape and g.dtype == x.dtype, name
        assert torch.isfinite(g).all(), f"{name} has non-finite entries"

    kw = dict(softmax_scale=softmax_scale, causal=causal, window_size=window, softcap=softcap, alibi_slopes=alibi_slopes)
    ref = reference_attention_grads(q, k, v, dout, dlse, upcast=True, **kw)
    smax = _max_abs_score(q, k, softmax_scale)
    # A float32 score of size |s| carries a rounding error of about eps32 * |s|, and so does the
    # LSE; -inf rows must match exactly.
    torch.testing.assert_close(lse, ref[1].float(), atol=LSE_TOL["atol"] + 4 * EPS32 * smax, rtol=LSE_TOL["rtol"])
    names = ("out", "dq", "dk", "dv")
    mine = (out, dq, dk, dv)
    ref64 = (ref[0], ref[2], ref[3], ref[4])
    # flash-attn's rule for every dtype: at most twice the error of the naive computation in
    # the same precision, plus a floor.  float32: a float32-level absolute floor, widened by
    # eps32 * max|s| * max|ref| -- the conditioning of softmax with large scores |s| (the
    # backward's D_i = rowsum(dO * O) turns O's O(eps |s|) error into dq / dk error).
    low = reference_attention_grads(q, k, v, dout, dlse, upcast=False, **kw)
    reflow = (low[0], low[2], low[3], low[4])
    floors = FP32_FLOORS if dtype == torch.float32 else LOWP_FLOORS
    for name, a, b, c, floor in zip(names, mine, ref64, reflow, floors):
        if dtype == torch.float32:
            floor = floor + 4 * EPS32 * smax * b.abs().max().item()
        assert_close_to_reference(a, b, c, name=f"{name} ({dtype})", atol_floor=floor)

    # Query rows that see no key: output exactly 0, LSE -inf, no gradient.
    empty = _empty_rows(seqlen_q, seqlen_k, causal, window)
    if empty.any():
        assert (out[:, empty] == 0).all()
        assert (lse[:, :, empty] == float("-inf")).all()
        assert (dq[:, empty] == 0).all()
    return out, lse


# ---------------------------------------------------------------------------------------
# Accuracy against the oracle
# ---------------------------------------------------------------------------------------

SEQLENS = [(1, 1), (17, 17), (200, 200), (1, 17), (17, 1), (17, 200), (200, 17)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", SEQLENS)
def test_float32_matches_reference(seqlen_q, seqlen_k, causal):
    check_against_reference(torch.float32, 2, seqlen_q, seqlen_k, 4, 2, 64, causal=causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (17, 17), (200, 200), (17, 200), (200, 17)])
@pytest.mark.parametrize("dtype", LOWP, ids=str)
def test_low_precision_matches_reference(dtype, seqlen_q, seqlen_k, causal):
    check_against_reference(dtype, 2, seqlen_q, seqlen_k, 4, 2, 64, causal=causal)


def test_long_sequence_causal_gqa():
    # Several (256 x 512) tiles in both directions with the default tile sizes.
    check_against_reference(torch.float32, 1, 1000, 1000, 2, 1, 64, causal=True)


def test_causal_more_queries_than_keys_has_empty_rows():
    # Bottom-right alignment: with seqlen_q=20 > seqlen_k=7 the first 13 queries see nothing.
    out, lse = check_against_reference(torch.float32, 1, 20, 7, 2, 1, 32, causal=True)
    assert (lse[:, :, :13] == float("-inf")).all() and torch.isfinite(lse[:, :, 13:]).all()
    assert (out[:, :13] == 0).all()
    # query 13 sees exactly key 0: its output is v[:, 0]
    _, _, v = random_qkv(1, 20, 7, 2, 1, 32, torch.float32)
    torch.testing.assert_close(out[:, 13], v[:, 0].expand(1, 2, 32), atol=0, rtol=0)


WINDOWS = [(3, 0), (0, 5), (10, 10), (-1, 3), (7, -1), (0, 0)]


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(50, 50), (20, 70), (70, 20)])
@pytest.mark.parametrize("window", WINDOWS, ids=str)
def test_sliding_window_float32(window, seqlen_q, seqlen_k):
    check_against_reference(torch.float32, 2, seqlen_q, seqlen_k, 4, 2, 32, window=window)


@pytest.mark.parametrize("window,causal", [((3, 0), False), ((10, 10), True), ((0, 5), False)])
def test_sliding_window_bfloat16(window, causal):
    check_against_reference(torch.bfloat16, 2, 60, 90, 4, 2, 64, causal=causal, window=window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("nheads_k", [4, 2, 1])
def test_gqa_mqa(nheads_k, dtype):
    check_against_reference(dtype, 2, 33, 45, 4, nheads_k, 64, causal=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("headdim", [40, 64, 80, 96, 256])
def test_head_dims(headdim, dtype):
    seqlen = 16 if headdim == 256 else 37
    check_against_reference(dtype, 1, seqlen, seqlen + 5, 2, 1, headdim, causal=True)


@pytest.mark.parametrize("softmax_scale", [0.01, 0.3, 1.0, 2.5])
def test_custom_softmax_scale(softmax_scale):
    check_against_reference(torch.float32, 2, 31, 40, 2, 2, 64, causal=True, softmax_scale=softmax_scale)


def test_default_softmax_scale_is_inverse_sqrt_headdim():
    q, k, v = random_qkv(1, 9, 11, 2, 2, 48, torch.float32)
    a = flashtile.flash_attn_func(q, k, v)
    b = flashtile.flash_attn_func(q, k, v, softmax_scale=48 ** -0.5)
    torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_return_lse(dtype):
    q, k, v = random_qkv(2, 13, 21, 4, 2, 32, dtype)
    out_only = flashtile.flash_attn_func(q, k, v, causal=True)
    res = flashtile.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert isinstance(out_only, torch.Tensor)
    assert isinstance(res, tuple) and len(res) == 2
    out, lse = res
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (2, 4, 13) and lse.dtype == torch.float32 and lse.device == q.device
    torch.testing.assert_close(out, out_only, atol=0, rtol=0)
    ref_out, ref_lse = reference_attention(q, k, v, causal=True)
    torch.testing.assert_close(lse, ref_lse.float(), **LSE_TOL)


@pytest.mark.parametrize(
    "dtype,seqlen_q,seqlen_k,causal",
    [
        (torch.float32, 40, 40, False),
        (torch.float32, 40, 15, True),  # empty rows: dlse there must be ignored
        (torch.float32, 15, 40, True),
        (torch.bfloat16, 40, 25, True),
    ],
)
def test_gradient_through_lse(dtype, seqlen_q, seqlen_k, causal):
    check_against_reference(dtype, 2, seqlen_q, seqlen_k, 4, 2, 32, causal=causal, use_lse_grad=True)


def test_lse_only_loss():
    # A loss of the LSE alone (out unused): the backward gets dout = 0 (or None) and dlse.
    q, k, v = random_qkv(1, 12, 30, 2, 1, 16, torch.float32, requires_grad=True)
    _, lse = flashtile.flash_attn_func(q, k, v, causal=True, return_lse=True)
    g = torch.autograd.grad(lse.sum(), (q, k, v), allow_unused=True)
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    _, ref_lse = reference_attention(qr, kr, vr, causal=True)
    ref = torch.autograd.grad(ref_lse.sum(), (qr, kr, vr), allow_unused=True)
    for name, a, b in zip(("dq", "dk", "dv"), g, ref):
        if b is None or not b.any():
            assert a is None or (a == 0).all(), name
        else:
            torch.testing.assert_close(a.double(), b, **FP32_GRAD_TOL)


# ---------------------------------------------------------------------------------------
# Numerics: extreme logits, inf / NaN
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_extreme_logits(dtype, causal):
    q, k, v = random_qkv(2, 40, 40, 2, 2, 32, dtype)
    raw = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()).abs().max().item()
    scale = 1000.0 / raw  # scores span about [-1000, 1000]: exp without max-subtraction overflows
    check_against_reference(dtype, 2, 40, 40, 2, 2, 32, causal=causal, softmax_scale=scale)


@pytest.mark.parametrize("engine", ["tiled", "fused"])
def test_backward_recomputes_the_forward_probabilities(engine):
    # dv = P^T dO depends on P alone, so its error exposes any mismatch between the P the
    # forward normalised (through the LSE) and the P the backward rebuilds.  The tiled engine
    # rounds its scores identically in both (q scaled once): within 4x the naive float32
    # error.  PyTorch's fused kernel rounds them differently in its forward and backward, an
    # O(eps32 * max|s|) relative error in P -- what the conditioning bound of
    # check_against_reference allows, ~25x the naive error at these |s| ~ 1000.
    q, k, v = random_qkv(2, 40, 40, 2, 2, 32, torch.float32)
    raw = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()).abs().max().item()
    scale = 1000.0 / raw
    dout = random_like(q, seed=1)
    out, lse = cpu.attention_forward(q, k, v, scale, engine=engine)
    _, _, dv = cpu.attention_backward(dout, q, k, v, out, lse, scale, engine=engine)
    ref = reference_attention_grads(q, k, v, dout, softmax_scale=scale)
    low = reference_attention_grads(q, k, v, dout, softmax_scale=scale, upcast=False)
    floor = 1e-5 if engine == "tiled" else 1e-5 + 4 * EPS32 * 1000.0 * ref[4].abs().max().item()
    assert_close_to_reference(dv, ref[4], low[4], name="dv", factor=4.0, atol_floor=floor)


@pytest.mark.parametrize("causal, alibi, with_dlse", [(False, False, False), (True, True, True)])
def test_reference_grads_split_by_heads_equal_the_whole(monkeypatch, causal, alibi, with_dlse):
    # Large GPU cases run the oracle a few KV heads at a time (helpers.REFERENCE_CHUNK_BYTES):
    # one KV head (and its query heads) per chunk here must give the very same numbers.
    import helpers

    q, k, v = random_qkv(2, 33, 40, 6, 3, 16, torch.float32)
    dout = random_like(q, seed=1)
    dlse = torch.randn(2, 6, 33, dtype=torch.float64) if with_dlse else None
    kw = dict(causal=causal, alibi_slopes=torch.rand(2, 6) if alibi else None)
    whole = reference_attention_grads(q, k, v, dout, dlse, **kw)
    monkeypatch.setattr(helpers, "REFERENCE_CHUNK_BYTES", 1)
    split = reference_attention_grads(q, k, v, dout, dlse, **kw)
    for a, b in zip(whole, split):
        assert torch.equal(a, b)


def test_all_scores_very_negative():
    # Every score is about -1000 (exp underflows to 0 without the max shift): the output is
    # still the exact softmax average, not 0 or NaN.
    gen = torch.Generator().manual_seed(3)
    q = torch.ones(1, 8, 1, 16)
    k = -1.0 - 0.01 * torch.rand(1, 24, 1, 16, generator=gen)
    v = torch.randn(1, 24, 1, 16, generator=gen)
    scale = 1000.0 / 16
    out, lse = flashtile.flash_attn_func(q, k, v, softmax_scale=scale, return_lse=True)
    ref_out, ref_lse = reference_attention(q, k, v, softmax_scale=scale)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert (lse < -900).all()
    torch.testing.assert_close(out.double(), ref_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse.double(), ref_lse, atol=0, rtol=1e-6)


def _poisoned(which, value, causal):
    """q, k, v (float32, batch 2) with ``value`` planted in batch 0, head (kv) 0, position 5."""
    q, k, v = random_qkv(2, 24, 24, 2, 1, 16, torch.float32)
    t = {"q": q, "k": k, "v": v}[which]
    t[0, 5, 0, 3] = value
    return q, k, v


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("which,value", [("k", float("nan")), ("q", float("nan")), ("k", float("inf")), ("q", float("-inf"))])
def test_nonfinite_inputs_propagate_like_torch(which, value, causal):
    q, k, v = _poisoned(which, value, causal)
    out, lse = flashtile.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    ref_out, ref_lse = reference_attention(q, k, v, causal=causal)
    # Same NaN pattern as the naive computation, same values elsewhere; batch 1 untouched.
    torch.testing.assert_close(out.double(), ref_out, equal_nan=True, **FP32_OUT_TOL)
    assert torch.isnan(out).any(), "a non-finite input must not be silently absorbed"
    assert torch.isfinite(out[1]).all() and torch.isfinite(lse[1]).all()
    if which == "k" and value != value:  # NaN key 5: exactly the queries that see it are NaN
        sees = _mask(24, 24, -1, 0 if causal else -1)[:, 5]
        assert torch.isnan(out[0, sees]).all()
        assert torch.isfinite(out[0, ~sees]).all()
        assert torch.isnan(lse[0, :, sees]).all()


@pytest.mark.parametrize("causal", [False, True])
def test_nan_in_v_propagates(causal):
    q, k, v = _poisoned("v", float("nan"), causal)
    out = flashtile.flash_attn_func(q, k, v, causal=causal)
    sees = _mask(24, 24, -1, 0 if causal else -1)[:, 5]
    # Every query that attends to key 5 gets NaN in feature 3 (p > 0 times NaN) ...
    assert torch.isnan(out[0, sees, :, 3]).all()
    # ... other features and the other batch stay finite and exact.  (Queries that cannot see
    # key 5 may legitimately be NaN too: the naive p @ v computes 0 * NaN = NaN.)
    ref_out, _ = reference_attention(q, k, torch.nan_to_num(v, nan=0.0), causal=causal)
    keep = torch.ones(16, dtype=torch.bool)
    keep[3] = False
    torch.testing.assert_close(out[0, sees][..., keep].double(), ref_out[0, sees][..., keep], **FP32_OUT_TOL)
    torch.testing.assert_close(out[1].double(), ref_out[1], **FP32_OUT_TOL)


def test_nan_gradients_stay_in_affected_batch():
    q, k, v = _poisoned("k", float("nan"), True)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = flashtile.flash_attn_func(q, k, v, causal=True)
    dout = random_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    assert torch.isnan(dq[0]).any() and torch.isnan(dk[0]).any()
    ref = reference_attention_grads(q[1:], k[1:], v[1:], dout[1:], causal=True)
    for name, a, b in zip(("dq", "dk", "dv"), (dq[1], dk[1], dv[1]), ref[2:]):
        torch.testing.assert_close(a.double(), b[0], **FP32_GRAD_TOL, msg=lambda m, name=name: f"{name}: {m}")


# ---------------------------------------------------------------------------------------
# Layouts and tiles
# ---------------------------------------------------------------------------------------


def _fwd_bwd(q, k, v, dout, **kw):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out, lse = flashtile.flash_attn_func(q, k, v, return_lse=True, **kw)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    return out, lse, dq, dk, dv


@pytest.mark.parametrize("layout", ["packed_qkv", "heads_first_view"])
def test_noncontiguous_inputs(layout):
    b, n, h, d = 2, 37, 4, 32
    gen = torch.Generator().manual_seed(7)
    if layout == "packed_qkv":
        qkv = torch.randn(b, n, 3, h, d, generator=gen)
        q, k, v = qkv.unbind(dim=2)
    else:
        q, k, v = (torch.randn(b, h, n, d, generator=gen).transpose(1, 2) for _ in range(3))
    assert not q.is_contiguous() and q.stride(-1) == 1
    dout = torch.randn(b, h, n, d, generator=gen).transpose(1, 2)  # non-contiguous upstream grad
    got = _fwd_bwd(q, k, v, dout, causal=True)
    want = _fwd_bwd(q.contiguous(), k.contiguous(), v.contiguous(), dout.contiguous(), causal=True)
    for name, a, c in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, c, atol=1e-6, rtol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    ref = reference_attention_grads(q, k, v, dout, causal=True)
    torch.testing.assert_close(got[0].double(), ref[0], **FP32_OUT_TOL)
    torch.testing.assert_close(got[2].double(), ref[2], **FP32_GRAD_TOL)


BLOCKS = [(1, 3), (5, 7), (16, 16), (37, 53), (64, 128), (256, 512)]


@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (6, 2)], ids=str)
def test_block_sizes_do_not_change_the_result(window):
    seqlen_q, seqlen_k = 37, 53  # no block size above divides both
    q, k, v = random_qkv(2, seqlen_q, seqlen_k, 4, 2, 16, torch.float32, seed=11)
    dout = random_like(q, seed=12)
    scale = 0.25
    ref = reference_attention_grads(q, k, v, dout, softmax_scale=scale, window_size=window)
    results = []
    for bm, bn in BLOCKS:
        out, lse = cpu.attention_forward(q, k, v, scale, *window, block_m=bm, block_n=bn)
        dq, dk, dv = cpu.attention_backward(dout, q, k, v, out, lse, scale, *window, block_m=bm, block_n=bn)
        results.append((out, lse, dq, dk, dv))
        torch.testing.assert_close(out.double(), ref[0], **FP32_OUT_TOL)
        torch.testing.assert_close(lse.double(), ref[1], **LSE_TOL)
        for a, b in zip((dq, dk, dv), ref[2:]):
            torch.testing.assert_close(a.double(), b, **FP32_GRAD_TOL)
    for res in results[1:]:
        for a, b in zip(res, results[0]):
            torch.testing.assert_close(a, b, atol=2e-6, rtol=2e-6)


# ---------------------------------------------------------------------------------------
# Memory: no seqlen_q x seqlen_k tensor, forward or backward
# ---------------------------------------------------------------------------------------


class _LargestOutput(TorchDispatchMode):
    """Records the largest tensor (by numel) produced by any ATen op while active."""

    def __init__(self):
        super().__init__()
        self.numel = 0
        self.op = None
        self.nops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        self.nops += 1
        for t in tree_flatten(result)[0]:
            if isinstance(t, torch.Tensor) and t.numel() > self.numel:
                self.numel, self.op = t.numel(), str(func)
        return result


def test_memory_recorder_detects_quadratic_tensors():
    # The detector itself: naive attention materialises N x N scores and is caught.
    n = 256
    q, k, v = random_qkv(1, n, n, 1, 1, 32, torch.float32)
    with _LargestOutput() as rec:
        reference_attention(q, k, v, upcast=False)
    assert rec.numel >= n * n


@pytest.mark.parametrize("causal", [False, True])
def test_no_quadratic_memory(causal):
    n, d = 4096, 32
    q, k, v = random_qkv(1, n, n, 1, 1, d, torch.float32, seed=5)
    dout = random_like(q)
    window = (-1, 0) if causal else (-1, -1)
    limit = n * n // 4
    with _LargestOutput() as rec:
        out, lse = cpu.attention_forward(q, k, v, d ** -0.5, *window, block_m=256, block_n=512)
    assert rec.nops > 0
    assert rec.numel < limit, f"forward allocated a tensor of {rec.numel} elements ({rec.op})"
    with _LargestOutput() as rec:
        cpu.attention_backward(dout, q, k, v, out, lse, d ** -0.5, *window, block_m=256, block_n=512)
    assert rec.nops > 0
    assert rec.numel < limit, f"backward allocated a tensor of {rec.numel} elements ({rec.op})"
    # The biggest allocation is one (block_m x block_n) score tile or an O(N d) buffer.
    assert rec.numel <= max(256 * 512, n * d)
    assert torch.isfinite(out).all()


def test_autograd_saves_nothing_quadratic():
    # Between forward and backward only q, k, v, out and the LSE are kept: O(N d), not O(N^2).
    n, d = 1024, 16
    q, k, v = random_qkv(1, n, n, 2, 1, d, torch.float32, requires_grad=True, seed=6)
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = flashtile.flash_attn_func(q, k, v, causal=True)
    assert saved, "nothing saved for the backward?"
    assert max(saved) <= 2 * n * d, f"saved tensors of sizes {saved}"
    out.sum().backward()
    assert torch.isfinite(q.grad).all()


def test_backward_is_deterministic():
    q, k, v = random_qkv(2, 70, 90, 4, 1, 32, torch.bfloat16, requires_grad=True, seed=4)
    dout = random_like(q, seed=5)
    runs = []
    for _ in range(2):
        out = flashtile.flash_attn_func(q, k, v, causal=True, deterministic=True)
        runs.append((out,) + torch.autograd.grad(out, (q, k, v), dout))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------
# Softcap and ALiBi (docs/semantics.md order: scale, softcap, ALiBi, masks)
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "softcap,alibi_shape,causal,seqlens",
    [(5.0, None, False, (17, 40)), (2.0, None, True, (40, 17)), (0.0, "heads", True, (33, 50)),
     (0.0, "batch-heads", False, (50, 33)), (3.0, "heads", True, (64, 64))],
    ids=["softcap", "softcap-causal", "alibi-causal", "alibi-per-batch", "both"],
)
def test_softcap_and_alibi(dtype, softcap, alibi_shape, causal, seqlens):
    slopes = None
    if alibi_shape == "heads":
        slopes = torch.rand(4, generator=torch.Generator().manual_seed(7)) * 0.5
    elif alibi_shape == "batch-heads":
        slopes = torch.rand(2, 4, generator=torch.Generator().manual_seed(7)) * 0.5
    check_against_reference(dtype, 2, *seqlens, 4, 2, 32, causal=causal, softcap=softcap, alibi_slopes=slopes,
                            softmax_scale=0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_exp2_flushed_gives_normal_numbers_or_zero(dtype):
    floor = -1022.0 if dtype == torch.float64 else -126.0
    tiny = torch.finfo(dtype).tiny
    x = torch.tensor([0.0, -1.0, -30.5, floor + 0.5, floor, floor - 0.5, floor - 30.0, -1e30, float("-inf")],
                     dtype=dtype)
    got = exp2_flushed(x.clone())
    want = torch.where(x > floor, torch.exp2(x), 0.0)
    assert torch.equal(got, want)
    assert not ((got > 0) & (got < tiny)).any()  # no subnormal number


@pytest.mark.parametrize("causal", [False, True])
def test_alibi_keys_far_below_the_row_maximum(causal):
    # Slopes of 1 and 2 over 300 keys put most scores hundreds below their row's maximum,
    # where 2^(s - m) is subnormal or 0 in float32 (the tiled path flushes those terms to 0).
    slopes = torch.tensor([1.0, 2.0, 0.5, 0.01])
    check_against_reference(torch.float32, 1, 300, 300, 4, 2, 32, causal=causal, alibi_slopes=slopes)
