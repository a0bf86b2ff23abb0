"""The NumPy attention references against an independent float64 PyTorch implementation
(forward values and autograd gradients), plus the seed's worked 1-D example.

The PyTorch oracle below spells the mask rule of docs/semantics.md out by hand instead of
calling ``flashtile.masking``, so a wrong band in the shared helper would show up here.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

import flashtile.reference.attention as attention_module
from flashtile.masking import key_range, query_range, visible
from flashtile.reference import (
    attention_1d,
    attention_backward_blocked,
    attention_backward_naive,
    attention_blocked,
    attention_naive,
)

# --- independent oracle ---------------------------------------------------------------------


def torch_attention(q, k, v, scale, causal=False, window=(-1, -1), mask=None):
    """float64 attention with autograd; a row with no visible key gives out 0, lse -inf."""
    b, nq, h, _ = q.shape
    nk, hk = k.shape[1], k.shape[2]
    k = k.repeat_interleave(h // hk, dim=2)  # query head h reads kv head h // group
    v = v.repeat_interleave(h // hk, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale

    i = torch.arange(nq)[:, None]
    j = torch.arange(nk)[None, :]
    left, right = window
    if causal:
        right = 0
    vis = torch.ones(nq, nk, dtype=torch.bool)
    if right >= 0:
        vis &= j <= i + nk - nq + right
    if left >= 0:
        vis &= j >= i + nk - nq - left
    vis = vis.expand(b, h, nq, nk)
    if mask is not None:
        vis = vis & torch.as_tensor(mask)
    seen = vis.any(dim=-1, keepdim=True)

    # Rows that see nothing get dummy zero scores (finite forward and backward) and are
    # then zeroed, so autograd passes exactly 0 through them.
    s = s.masked_fill(~vis, float("-inf")).masked_fill(~seen, 0.0)
    p = torch.softmax(s, dim=-1) * seen
    lse = torch.logsumexp(s, dim=-1).masked_fill(~seen[..., 0], float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", p, v)
    return out, lse, seen[..., 0]


def torch_reference(q, k, v, dout, scale, causal, window, mask):
    """Forward values and gradients from autograd, as NumPy."""
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    out, lse, seen = torch_attention(tq, tk, tv, scale, causal, window, mask)
    out.backward(torch.as_tensor(dout))
    return {
        "out": out.detach().numpy(),
        "lse": lse.detach().numpy(),
        "seen": seen.numpy(),
        "dq": tq.grad.numpy(),
        "dk": tk.grad.numpy(),
        "dv": tv.grad.numpy(),
    }


def assert_close(actual, expected, rtol=1e-10):
    """Elementwise closeness with an absolute floor relative to the array's scale."""
    expected = np.asarray(expected)
    floor = rtol * max(1.0, float(np.abs(expected[np.isfinite(expected)]).max(initial=0.0)))
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=floor)


def assert_lse_equal(actual, expected):
    np.testing.assert_array_equal(np.isneginf(actual), np.isneginf(expected))
    finite = np.isfinite(expected)
    np.testing.assert_allclose(actual[finite], expected[finite], rtol=1e-12, atol=1e-12)


# --- cases ----------------------------------------------------------------------------------


@dataclass
class Case:
    name: str
    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_k: int
    headdim: int
    causal: bool = False
    window: tuple = (-1, -1)
    mask: str | None = None  # None, "random" (with fully masked rows) or "keys" (padding)
    block_m: int = 16
    block_n: int = 16
    scale: float | None = None
    headdim_v: int | None = None
    data: dict = field(default_factory=dict, repr=False)

    def arrays(self):
        if not self.data:
            rng = np.random.default_rng(zlib.crc32(self.name.encode()))
            dv = self.headdim_v or self.headdim
            q = rng.normal(size=(self.batch, self.seqlen_q, self.nheads, self.headdim))
            k = rng.normal(size=(self.batch, self.seqlen_k, self.nheads_k, self.headdim))
            v = rng.normal(size=(self.batch, self.seqlen_k, self.nheads_k, dv))
            dout = rng.normal(size=(self.batch, self.seqlen_q, self.nheads, dv))
            mask = None
            if self.mask == "random":
                mask = rng.random((self.batch, self.nheads, self.seqlen_q, self.seqlen_k)) > 0.4
                mask[:, :, min(3, self.seqlen_q - 1)] = False  # a query that sees nothing, every head
                mask[0, -1, 0] = False
            elif self.mask == "keys":  # key padding: (batch, 1, 1, seqlen_k) broadcasts
                mask = np.ones((self.batch, 1, 1, self.seqlen_k), dtype=bool)
                mask[-1, ..., self.seqlen_k // 2 :] = False
            scale = self.scale if self.scale is not None else self.headdim**-0.5
            self.data = dict(q=q, k=k, v=v, dout=dout, mask=mask, scale=scale)
        return self.data

    def kwargs(self):
        d = self.arrays()
        return dict(softmax_scale=d["scale"], causal=self.causal, window_size=self.window, mask=d["mask"])

    def blocks(self):
        return dict(block_m=self.block_m, block_n=self.block_n)


CASES = [
    Case("seqlen1", 1, 1, 1, 1, 1, 8),
    Case("seqlen1_q_many_k_causal", 2, 1, 5, 2, 1, 8, causal=True, block_n=2),
    Case("square17_gqa2", 2, 17, 17, 4, 2, 40),
    Case("square17_causal", 2, 17, 17, 4, 4, 40, causal=True),
    Case("q_lt_k_causal_mqa_hd80", 1, 17, 33, 4, 1, 80, causal=True, block_m=5, block_n=7),
    Case("q_gt_k_causal_empty_rows", 2, 33, 17, 4, 2, 40, causal=True, block_m=8, block_n=5),
    Case("q_gt_k_full", 1, 20, 9, 2, 2, 16, block_m=3, block_n=4),
    Case("window_3_2", 2, 23, 31, 4, 2, 40, window=(3, 2), block_m=4, block_n=6),
    Case("window_0_0_diagonal_only", 1, 19, 19, 2, 1, 16, window=(0, 0), block_m=5, block_n=5),
    Case("window_left_only_q_gt_k", 1, 29, 21, 2, 2, 16, window=(4, -1), block_m=7, block_n=3),
    Case("window_right_only_q_lt_k", 1, 21, 29, 2, 2, 16, window=(-1, 3), block_m=7, block_n=3),
    Case("causal_with_left_window", 1, 30, 30, 4, 1, 24, causal=True, window=(6, 5), block_m=8, block_n=8),
    Case("window_q_gt_k_empty_rows", 1, 25, 10, 2, 1, 16, window=(2, 0), block_m=6, block_n=4),
    Case("user_mask_gqa", 2, 17, 23, 4, 2, 40, mask="random", block_m=6, block_n=5),
    Case("user_mask_causal_mqa", 2, 19, 19, 4, 1, 40, causal=True, mask="random"),
    Case("key_padding_window", 2, 18, 26, 2, 1, 16, window=(5, 5), mask="keys", block_m=4, block_n=9),
    Case("extreme_scale", 1, 17, 21, 2, 1, 40, scale=150.0, block_m=8, block_n=8),
    Case("extreme_scale_causal_mask", 2, 21, 17, 4, 2, 40, causal=True, mask="random", scale=150.0,
         block_m=4),
    Case("negative_scale", 1, 9, 12, 2, 2, 16, scale=-0.7, block_m=4, block_n=5),
    Case("zero_scale_causal", 1, 9, 12, 2, 2, 16, causal=True, scale=0.0, block_m=4, block_n=5),
    Case("headdim_v_differs", 2, 13, 15, 4, 2, 40, causal=True, headdim_v=24, block_m=4, block_n=4),
]
by_case = pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])


@pytest.fixture(scope="module")
def oracle():
    cache = {}

    def get(case):
        if case.name not in cache:
            d = case.arrays()
            cache[case.name] = torch_reference(
                d["q"], d["k"], d["v"], d["dout"], d["scale"], case.causal, case.window, d["mask"]
            )
        return cache[case.name]

    return get


def test_extreme_scale_really_is_extreme():
    d = CASES[[c.name for c in CASES].index("extreme_scale")].arrays()
    s = np.einsum("bqhd,bkhd->bhqk", d["q"], np.repeat(d["k"], 2, axis=2)) * d["scale"]
    assert np.abs(s).max() > 1000.0


# --- forward --------------------------------------------------------------------------------


@by_case
def test_naive_forward_matches_torch(case, oracle):
    d, ref = case.arrays(), oracle(case)
    out, lse = attention_naive(d["q"], d["k"], d["v"], **case.kwargs())
    assert out.dtype == np.float64 and lse.dtype == np.float64
    assert out.shape == ref["out"].shape and lse.shape == ref["lse"].shape
    assert_close(out, ref["out"])
    assert_lse_equal(lse, ref["lse"])


@by_case
def test_blocked_forward_matches_torch_and_naive(case, oracle):
    d, ref = case.arrays(), oracle(case)
    out, lse = attention_blocked(d["q"], d["k"], d["v"], **case.kwargs(), **case.blocks())
    assert_close(out, ref["out"])
    assert_lse_equal(lse, ref["lse"])
    out_n, lse_n = attention_naive(d["q"], d["k"], d["v"], **case.kwargs())
    assert_close(out, out_n, rtol=1e-12)
    assert_lse_equal(lse, lse_n)


@pytest.mark.parametrize("block_m,block_n", [(1, 1), (2, 3), (17, 17), (64, 64)])
def test_blocked_forward_any_tiling(block_m, block_n):
    case = CASES[[c.name for c in CASES].index("user_mask_gqa")]
    d = case.arrays()
    out, lse = attention_blocked(d["q"], d["k"], d["v"], **case.kwargs(), block_m=block_m, block_n=block_n)
    out_n, lse_n = attention_naive(d["q"], d["k"], d["v"], **case.kwargs())
    assert_close(out, out_n, rtol=1e-12)
    assert_lse_equal(lse, lse_n)


# --- backward -------------------------------------------------------------------------------


@by_case
@pytest.mark.parametrize("which", ["naive", "blocked"])
def test_backward_matches_torch_autograd(case, which, oracle):
    d, ref = case.arrays(), oracle(case)
    out, lse = attention_blocked(d["q"], d["k"], d["v"], **case.kwargs(), **case.blocks())
    if which == "naive":
        grads = attention_backward_naive(d["dout"], d["q"], d["k"], d["v"], out, lse, **case.kwargs())
    else:
        grads = attention_backward_blocked(
            d["dout"], d["q"], d["k"], d["v"], out, lse, **case.kwargs(), **case.blocks()
        )
    for name, g in zip(("dq", "dk", "dv"), grads):
        assert g.shape == d[name[1]].shape, name
        assert np.isfinite(g).all(), name
        assert_close(g, ref[name], rtol=1e-9)


@by_case
def test_rows_without_keys_are_zero_and_silent(case, oracle):
    """No visible key: out 0, lse -inf, dq 0 -- and dout on such a row changes nothing."""
    d, ref = case.arrays(), oracle(case)
    empty = ~ref["seen"]  # (batch, nheads, seqlen_q)
    out, lse = attention_blocked(d["q"], d["k"], d["v"], **case.kwargs(), **case.blocks())
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    np.testing.assert_array_equal(lse[empty], -np.inf)
    empty_rows = empty.transpose(0, 2, 1)  # -> (batch, seqlen_q, nheads) like out
    np.testing.assert_array_equal(out[empty_rows], 0.0)
    if not empty.any():
        return

    noisy = d["dout"].copy()
    noisy[empty_rows] += 1e3
    for backward in (attention_backward_blocked, attention_backward_naive):
        extra = case.blocks() if backward is attention_backward_blocked else {}
        dq, dk, dv = backward(d["dout"], d["q"], d["k"], d["v"], out, lse, **case.kwargs(), **extra)
        np.testing.assert_array_equal(dq[empty_rows], 0.0)
        dq2, dk2, dv2 = backward(noisy, d["q"], d["k"], d["v"], out, lse, **case.kwargs(), **extra)
        np.testing.assert_array_equal(dk2, dk)
        np.testing.assert_array_equal(dv2, dv)
        np.testing.assert_array_equal(dq2[empty_rows], 0.0)


def test_fully_masked_everything():
    rng = np.random.default_rng(11)
    q, k, v = rng.normal(size=(1, 5, 2, 8)), rng.normal(size=(1, 7, 2, 8)), rng.normal(size=(1, 7, 2, 8))
    mask = np.zeros((5, 7), dtype=bool)
    for fwd in (attention_naive, attention_blocked):
        out, lse = fwd(q, k, v, mask=mask)
        np.testing.assert_array_equal(out, 0.0)
        np.testing.assert_array_equal(lse, -np.inf)
    dout = rng.normal(size=out.shape)
    for bwd in (attention_backward_naive, attention_backward_blocked):
        for g in bwd(dout, q, k, v, out, lse, mask=mask):
            np.testing.assert_array_equal(g, 0.0)


# --- masking conventions ----------------------------------------------------------------------


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(7, 7), (5, 9), (9, 5)])
def test_causal_is_bottom_right_tril(seqlen_q, seqlen_k):
    rng = np.random.default_rng(12)
    q = rng.normal(size=(2, seqlen_q, 2, 8))
    k, v = rng.normal(size=(2, 2, seqlen_k, 2, 8))
    tril = np.tril(np.ones((seqlen_q, seqlen_k), dtype=bool), k=seqlen_k - seqlen_q)
    for fwd in (attention_naive, attention_blocked):
        out_c, lse_c = fwd(q, k, v, causal=True)
        out_m, lse_m = fwd(q, k, v, mask=tril)
        np.testing.assert_array_equal(out_c, out_m)
        np.testing.assert_array_equal(lse_c, lse_m)
    # the last query always sees the last key; with seqlen_q > seqlen_k the first ones see nothing
    assert np.isfinite(lse_c[..., -1]).all()
    n_empty = max(seqlen_q - seqlen_k, 0)
    assert np.isneginf(lse_c[..., :n_empty]).all() and np.isfinite(lse_c[..., n_empty:]).all()


@pytest.mark.parametrize("seqlen_q,seqlen_k,left,right", [(9, 9, -1, 0), (5, 12, 3, 0), (12, 5, -1, 0),
                                                         (10, 10, 2, 1), (7, 7, -1, -1), (6, 30, 4, 2)])
def test_key_and_query_ranges_are_the_bands_bounds(seqlen_q, seqlen_k, left, right):
    # key_range: the keys a run of queries may see; query_range: the queries a run of keys may
    # be seen by -- each exactly the span of the visible pairs, empty where there are none.
    seen = visible(np.arange(seqlen_q)[:, None], np.arange(seqlen_k)[None, :], seqlen_q, seqlen_k, left, right)

    def span(flags):
        idx = np.flatnonzero(flags)
        return (int(idx[0]), int(idx[-1]) + 1) if idx.size else None

    for a in range(seqlen_q):
        for b in range(a + 1, seqlen_q + 1):
            lo, hi = key_range(a, b, seqlen_q, seqlen_k, left, right)
            assert (lo, hi) == span(seen[a:b].any(0)) if lo < hi else span(seen[a:b].any(0)) is None
    for a in range(seqlen_k):
        for b in range(a + 1, seqlen_k + 4):  # a run may reach past the last key
            lo, hi = query_range(a, b, seqlen_q, seqlen_k, left, right)
            assert (lo, hi) == span(seen[:, a:b].any(1)) if lo < hi else span(seen[:, a:b].any(1)) is None


def _count_tiles(monkeypatch):
    calls = []
    real = attention_module.visible

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(attention_module, "visible", counting)
    return calls


@pytest.mark.parametrize(
    "seqlen_q,seqlen_k,causal,window,block_m,block_n,tiles",
    [
        (64, 64, True, (-1, -1), 16, 16, 1 + 2 + 3 + 4),  # lower triangle of a 4x4 tile grid
        (64, 64, False, (-1, -1), 16, 16, 16),
        (40, 8, True, (-1, -1), 16, 8, 1),  # query tiles 0 and 1 see no key at all
        (64, 64, False, (8, 8), 16, 16, 2 + 3 + 3 + 2),  # band: diagonal tiles and their neighbours
    ],
)
def test_tiles_outside_the_band_are_skipped(
    monkeypatch, seqlen_q, seqlen_k, causal, window, block_m, block_n, tiles
):
    rng = np.random.default_rng(13)
    q = rng.normal(size=(1, seqlen_q, 1, 4))
    k, v = rng.normal(size=(2, 1, seqlen_k, 1, 4))
    kw = dict(causal=causal, window_size=window)
    tiling = dict(block_m=block_m, block_n=block_n)
    out, lse = attention_naive(q, k, v, **kw)
    calls = _count_tiles(monkeypatch)
    out_b, lse_b = attention_blocked(q, k, v, **kw, **tiling)
    assert len(calls) == tiles
    assert_close(out_b, out, rtol=1e-12)
    calls.clear()
    grads = attention_backward_blocked(np.ones_like(out), q, k, v, out, lse, **kw, **tiling)
    assert len(calls) == tiles
    ref = attention_backward_naive(np.ones_like(out), q, k, v, out, lse, **kw)
    for g, r in zip(grads, ref):
        assert_close(g, r, rtol=1e-12)


# --- 2-D convention, 1-D seed example, errors --------------------------------------------------


def test_two_dimensional_single_head_convention():
    rng = np.random.default_rng(14)
    q, dout = rng.normal(size=(6, 8)), rng.normal(size=(6, 5))
    k, v = rng.normal(size=(9, 8)), rng.normal(size=(9, 5))
    kw = dict(causal=True, mask=rng.random((6, 9)) > 0.3)
    lift = lambda x: x[None, :, None, :]  # noqa: E731
    for fwd in (attention_naive, attention_blocked):
        out, lse = fwd(q, k, v, **kw)
        out4, lse4 = fwd(lift(q), lift(k), lift(v), **kw)
        assert out.shape == (6, 5) and lse.shape == (6,)
        np.testing.assert_array_equal(out, out4[0, :, 0])
        np.testing.assert_array_equal(lse, lse4[0, 0])
    for bwd in (attention_backward_naive, attention_backward_blocked):
        grads = bwd(dout, q, k, v, out, lse, **kw)
        grads4 = bwd(lift(dout), lift(q), lift(k), lift(v), out4, lse4, **kw)
        for g, g4, x in zip(grads, grads4, (q, k, v)):
            assert g.shape == x.shape
            np.testing.assert_array_equal(g, g4[0, :, 0])


def test_attention_1d_seed_example():
    q = [0.5, -1.0, 2.0]
    K = [[1.0, 0.0, -0.5], [0.0, 2.0, 1.0], [-1.0, 1.0, 0.0], [2.0, -1.0, 1.5]]
    V = [[1.0, 2.0], [0.5, -1.0], [3.0, 0.0], [-2.0, 1.0]]
    o = attention_1d(q, K, V)
    assert isinstance(o, list) and len(o) == 2
    np.testing.assert_allclose(o, [-1.96382361, 0.98924009], rtol=0, atol=1e-8)
    # and it is ordinary attention with scale 1
    out, _ = attention_naive(np.array([q]), np.array(K), np.array(V), softmax_scale=1.0)
    np.testing.assert_allclose(o, out[0], rtol=1e-14)


@pytest.mark.parametrize("n,d,dv,big", [(1, 3, 2, 0.0), (7, 4, 3, 0.0), (50, 5, 2, 0.0), (20, 3, 4, 1000.0)])
def test_attention_1d_matches_torch(n, d, dv, big):
    rng = np.random.default_rng(n)
    q = rng.normal(size=d)
    K = rng.normal(size=(n, d)) + big / np.sqrt(d) * np.sign(q) * rng.random((n, 1))  # logits ~ big
    V = rng.normal(size=(n, dv))
    ref = torch.softmax(torch.as_tensor(K @ q), 0).numpy() @ V
    np.testing.assert_allclose(attention_1d(q.tolist(), K.tolist(), V.tolist()), ref, rtol=1e-12, atol=1e-14)


def test_attention_1d_no_keys():
    assert attention_1d([1.0, 2.0], [], []) == []


@pytest.mark.parametrize(
    "shapes,extra,match",
    [
        (((1, 4, 2, 8), (1, 5, 2, 8), (1, 5, 2, 8)), dict(mask=np.ones((4, 5))), "boolean"),
        (((1, 4, 2, 8), (1, 5, 2, 8), (1, 5, 2, 8)), dict(mask=np.ones((3, 5), dtype=bool)), "broadcast"),
        (((1, 4, 3, 8), (1, 5, 2, 8), (1, 5, 2, 8)), {}, "multiple"),
        (((1, 4, 2, 8), (1, 5, 2, 6), (1, 5, 2, 8)), {}, "head dimension"),
        (((1, 4, 2, 8), (1, 5, 2, 8), (1, 6, 2, 8)), {}, "k and v"),
        (((2, 4, 2, 8), (1, 5, 2, 8), (1, 5, 2, 8)), {}, "batch"),
        (((4, 2, 8), (5, 2, 8), (5, 2, 8)), {}, "4-D"),
        (((1, 4, 2, 8), (1, 5, 2, 8), (1, 5, 2, 8)), dict(block_m=0), "block_m"),
        (((1, 4, 2, 8), (1, 5, 2, 8), (1, 5, 2, 8)), dict(window_size=(-2, 0)), "window_size"),
        (((1, 4, 2, 8), (1, 5, 2, 8), (1, 5, 2, 8)), dict(softmax_scale=float("nan")), "softmax_scale"),
    ],
)
def test_bad_arguments_raise_value_error(shapes, extra, match):
    q, k, v = (np.zeros(s) for s in shapes)
    with pytest.raises(ValueError, match=match):
        attention_blocked(q, k, v, **extra)


def test_backward_checks_shapes():
    q, k, v = np.zeros((1, 4, 2, 8)), np.zeros((1, 5, 2, 8)), np.zeros((1, 5, 2, 8))
    out, lse = attention_naive(q, k, v)
    with pytest.raises(ValueError, match="dout"):
        attention_backward_blocked(out[:, :3], q, k, v, out, lse)
    with pytest.raises(ValueError, match="lse"):
        attention_backward_naive(out, q, k, v, out, lse[:, 0])
