"""``flashtile.softmax`` / ``flashtile.log_softmax`` and their Triton kernels against a float64 oracle.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (``tests/conftest.py``
sets ``TRITON_INTERPRET=1``); shapes here are kept small so the whole file runs in well under
a minute on two cores.  ``gpu`` tests (large rows, bf16, attention-score-shaped masks) are
skipped without CUDA.

Oracle: ``torch.softmax`` / ``torch.log_softmax`` in float64 of ``x.double() * scale`` with
the mask applied (boolean: False -> -inf; floating: added), except that a row with no finite
entry gives zeros (log-softmax: ``-inf``) and zero gradient -- flashtile's documented
convention, where torch gives NaN.  Gradients are float64 autograd of that oracle.

Tolerances (see ``assert_fwd`` / ``assert_grad``): the kernels compute in float32 and round
the result once to the input dtype, so with ``u`` the unit roundoff of the output dtype
(fp16 2**-11, bf16 2**-8) and ``U32`` the float32 compute error (see ``U32``) the forward
error is at most ``(u + U32) * |y|``; we allow twice that plus a tiny absolute floor
(fp16 ~ 1 ulp relative, bf16 ~ 7.8e-3 at 1; fp32 1e-6 + 8e-6 |y|).  The gradient bound is the
first-order propagation of that error in the stored ``y`` through the backward formula, times
two, plus one rounding of ``dx``.  ``test_tolerances_can_fail`` checks that outputs which are
wrong by a few ulps, along the wrong dim, or missing the scale fail these same assertions.
"""

from __future__ import annotations

import os

import pytest
import torch

import flashtile
from flashtile.kernels import softmax as ks
from flashtile.kernels.runtime import sm_count
from flashtile.kernels.softmax import packing as kpack
from flashtile.kernels.softmax import planning as kplan
from flashtile.kernels.softmax import residency as kres
from flashtile.kernels.softmax import tuning as ktune
from flashtile.ops import softmax as ops_softmax
from flashtile.ops.softmax import _rows, _torch_softmax
from softmax_oracle import (
    F32, F16, BF16, NEG_INF, POS_INF, NAN, U_OUT, U32, oracle, _same_nonfinite, exponent_error, assert_fwd,
    assert_grad, randn, fn_of, run_case, check_fwd_bwd,
)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
needs_kernels = pytest.mark.skipif(not (INTERPRET or CUDA), reason="needs a GPU or TRITON_INTERPRET=1")

# ---------------------------------------------------------------------------------------
# The tolerances can fail
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=str)
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_tolerances_can_fail(dtype, log):
    x = randn(6, 40, dtype=dtype, device="cpu", seed=3)
    ref = oracle(x, -1, 3.0, None, log)
    # The exactly rounded oracle passes ...
    assert_fwd(ref.to(dtype), ref, dtype, log)
    # ... the wrong dim, a missing scale, and a few-ulp relative error do not.
    wrong_dim = (torch.log_softmax if log else torch.softmax)(x.double() * 3.0, 0).to(dtype)
    no_scale = oracle(x, -1, None, None, log).to(dtype)
    if dtype == F32:  # 5e-5 relative + 3e-6 absolute: a few times the float32 allowance
        perturbed = (ref * (1 + 5e-5) + 3e-6).to(dtype)
    else:  # 4 ulps (8 unit roundoffs) relative
        perturbed = (ref * (1 + 8 * U_OUT[dtype])).to(dtype)
    for bad in (wrong_dim, no_scale, perturbed):
        with pytest.raises(AssertionError):
            assert_fwd(bad, ref, dtype, log)
    # NaN where the oracle is finite fails (NaN compares false and must not slip through).
    nan_out = ref.to(dtype).clone()
    nan_out[2, 5] = NAN
    with pytest.raises(AssertionError, match="NaN"):
        assert_fwd(nan_out, ref, dtype, log)
    # Gradients: the exact one passes, one without the scale or along the wrong dim fails.
    x64 = x.double().requires_grad_(True)
    y64 = oracle(x64, -1, 3.0, None, log)
    g = randn(6, 40, dtype=dtype, device="cpu", seed=4).double()
    (dx,) = torch.autograd.grad(y64, x64, g)
    assert_grad(dx.to(dtype), dx, y64.detach(), g, -1, 3.0, log, dtype)
    for bad in (dx / 3.0, _wrong_dim_grad(x, g, log)):
        with pytest.raises(AssertionError):
            assert_grad(bad.to(dtype), dx, y64.detach(), g, -1, 3.0, log, dtype)


def _wrong_dim_grad(x, g, log):
    x64 = x.double().requires_grad_(True)
    y = oracle(x64, 0, 3.0, None, log)
    return torch.autograd.grad(y, x64, g)[0]


# ---------------------------------------------------------------------------------------
# Default plan: in-register rows of every awkward length
# ---------------------------------------------------------------------------------------

ROW_LENGTHS = [1, 31, 32, 33, 100, 1023, 1025]


@needs_kernels
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("dtype", [F32, F16], ids=str)
@pytest.mark.parametrize("n", ROW_LENGTHS)
def test_default_plan_row_lengths(n, dtype, log):
    # 5 rows: not a multiple of the rows packed per program (a partial last program).
    run_case(randn(5, n, dtype=dtype, seed=n), log=log)


@needs_kernels
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("n", [33, 1025])
def test_default_plan_bf16(n, log):
    run_case(randn(3, n, dtype=BF16, seed=n), scale=0.5, log=log)


def test_plan_choices():
    assert ks.plan(4, ktune.IN_REGISTER_MAX)["strategy"] == "registers"
    p = ks.plan(4, 1000, strategy="registers")
    assert p["BLOCK_N"] == 1024 and p["BLOCK_N"] >= 1000
    assert ks.plan(1, 1)["BLOCK_N"] >= 1
    with pytest.raises(ValueError, match="strategy"):
        ks.plan(4, 100, strategy="bogus")
    for n in (1, 17, 200, 1000, 4097):
        for block in (16, 64):
            for unroll in (1, 2, 4):
                for splits in (1, 2, 3, 7, 64):
                    p = ks.plan(3, n, strategy="split", block=block, splits=splits, unroll=unroll)
                    assert p["strategy"] == "split" and p["BLOCK_N"] == block and p["UNROLL"] == unroll
                    assert p["chunk"] % (block * unroll) == 0, p
                    # every column is covered, no program gets an empty chunk, SPLITS holds them all
                    assert p["chunk"] * p["splits"] >= n and (p["splits"] - 1) * p["chunk"] < n, p
                    assert 1 <= p["splits"] <= splits and p["SPLITS"] >= p["splits"], p
    p = ks.plan(5, 1000, strategy="fused", programs=8)
    assert p["strategy"] == "fused" and p["programs"] == 5  # never more programs than rows
    for n in (1, 17, 64, 65, 1000):
        for block in (16, 64, 100):
            for programs in (None, 1, 7, 64):
                p = ks.plan(5, n, strategy="cooperative", block=block, programs=programs)
                chunk = p["BLOCK_N"]
                assert chunk >= block and chunk & (chunk - 1) == 0, p  # a power of two (tl.arange)
                # every column is covered, no chunk program is empty, SPLITS holds them all
                assert chunk * p["splits"] >= n and (p["splits"] - 1) * chunk < n, p
                assert p["SPLITS"] >= p["splits"] and p["SPLITS"] >= 2, p
                # whole rows' chunk programs only, at least one row, never more rows than there are
                assert 1 <= p["slots"] <= 5, p
                assert programs is None or p["slots"] == 1 or p["slots"] * p["splits"] <= programs, p


def test_plan_on_h200_shapes(monkeypatch):
    """The default plan at the benchmark's shapes (M x N = 2**28) on a 132-SM GPU."""
    monkeypatch.setattr(kplan, "_sms", lambda: 132)
    monkeypatch.setattr(kplan, "INTERPRET", False)
    monkeypatch.delenv(ks.TUNING_ENV, raising=False)

    def at(n, elem, **kw):
        return ks.plan(2**28 // n, n, elem_bytes=elem, reread_bytes=n * elem, **kw)

    assert at(16384, 2)["num_warps"] == 16 and at(16384, 2, backward=True)["num_warps"] == 32
    assert at(8192, 2, backward=True)["num_warps"] == 8
    for elem in (2, 4):
        assert at(ktune.IN_REGISTER_MAX, elem)["strategy"] == "registers"
        # The backward holds rows of up to COOP_BWD_MAX in chunk programs (the cooperative
        # path); the forward, and longer backward rows, take the two-pass paths below.
        for n in (ktune.IN_REGISTER_MAX + 1, 65536, ktune.COOP_BWD_MAX):
            p = at(n, elem, backward=True)
            assert p["strategy"] == "cooperative", (n, elem, p)
            assert p["BLOCK_N"] == ktune.COOP_BWD_BLOCK
            assert p["splits"] == -(-n // p["BLOCK_N"]) and p["slots"] == 2**28 // n
        assert at(2 * ktune.COOP_BWD_MAX, elem, backward=True)["strategy"] == "fused"
    monkeypatch.setenv(ks.TUNING_ENV, "cooperative_max=4194304")
    for elem, chunk in ((2, 16384), (4, 8192)):  # 32 KB of input per forward chunk program
        p = at(4194304, elem)
        assert p["strategy"] == "cooperative" and p["BLOCK_N"] == chunk and p["splits"] == 4194304 // chunk
    monkeypatch.setenv(ks.TUNING_ENV, "cooperative_max=0")
    for elem in (2, 4):
        for n in (2 * ktune.IN_REGISTER_MAX, 65536, 262144, 1048576):
            p = at(n, elem)
            assert p["strategy"] == "fused", (n, elem, p)
            # rows in flight x bytes per row within the L2 budget, or one row per SM
            per_sm = p["programs"] // 132
            assert per_sm >= 1 and (per_sm == 1 or per_sm * 132 * n * elem <= ktune.FUSED_L2_BUDGET_MB * 2**20)
            # the same warps per SM however many programs share an SM; 16-byte sub-tiles
            assert p["num_warps"] * per_sm == ktune.FUSED_WARPS_PER_SM
            assert p["BLOCK_N"] * elem == p["num_warps"] * 32 * 16
        p = at(4194304, elem)  # 64 rows: fewer than SMs
        assert p["strategy"] == "split" and p["splits"] * 64 >= ktune.SPLIT_PROGRAMS_PER_SM * 132
    assert at(65536, 2)["programs"] == 2 * 132  # 128 KB rows: two rows per SM fit in L2
    assert at(262144, 2)["programs"] == 132
    assert ks.plan(131, 10**6)["strategy"] == "split" and ks.plan(132, 10**6)["strategy"] == "fused"
    assert ks.streaming_strategy(131) == "split" and ks.streaming_strategy(132) == "fused"
    # Allowed below one program per SM, the longest rows get fewer, larger programs.
    monkeypatch.setenv(ks.TUNING_ENV, "cooperative_max=0,min_programs_per_sm=0.5")
    p = at(262144, 2)
    assert p["programs"] == 66 and p["num_warps"] == 32
    assert at(65536, 2)["programs"] == 2 * 132  # unchanged where L2 holds a row per SM


def test_resident_programs_per_sm(monkeypatch):
    """The fused path's grid cap: programs one SM holds, by threads, registers, shared memory."""
    import types

    monkeypatch.setattr(kres, "_device_limits", lambda device_index: (2048, 65536, 233472))

    def compiled(regs, shared):
        return types.SimpleNamespace(n_regs=regs, metadata=types.SimpleNamespace(shared=shared),
                                     _init_handles=lambda: None)

    assert ks.resident_programs_per_sm(compiled(80, 64), 16, 0) == 1  # 80 x 512 registers: one
    assert ks.resident_programs_per_sm(compiled(64, 64), 16, 0) == 2  # exactly two
    assert ks.resident_programs_per_sm(compiled(64, 32), 8, 0) == 4
    assert ks.resident_programs_per_sm(compiled(32, 32), 4, 0) == 16  # thread-bound
    assert ks.resident_programs_per_sm(compiled(40, 100_000), 8, 0) == 2  # shared-memory-bound
    assert ks.resident_programs_per_sm(compiled(255, 0), 32, 0) == 1  # never 0


def test_tuning_knobs_from_environment(monkeypatch):
    monkeypatch.setenv(ks.TUNING_ENV, "unroll=2, programs_per_sm=1,fused_min_rows_per_sm=1e9")
    k = ks.knobs()
    assert k["unroll"] == 2 and k["programs_per_sm"] == 1 and k["fused_min_rows_per_sm"] == 1e9
    assert k["in_register_max"] == ktune.IN_REGISTER_MAX  # untouched knobs keep the module's value
    assert ks.plan(4, 2 * ktune.COOPERATIVE_MAX)["strategy"] == "split"
    assert ks.plan(4, ktune.COOP_BWD_MAX, backward=True)["strategy"] == "cooperative"
    # The forward's cooperative path starts at COOP_FWD_MIN_BYTES per row.
    n = ktune.COOP_FWD_MIN_BYTES // 4
    assert ks.plan(4, n, elem_bytes=4)["strategy"] == "cooperative"
    assert ks.plan(4, n, elem_bytes=2)["strategy"] == "split"
    assert ks.plan(4, n, elem_bytes=4, masked=True)["strategy"] == "split"  # masked rows stream
    assert ks.plan(4, n, elem_bytes=4, masked=True, strategy="cooperative")["strategy"] == "cooperative"
    # fused_min_rows_per_sm=0: the fused path for any row count, whatever the device's SM count.
    monkeypatch.setenv(ks.TUNING_ENV,
                       "in_register_max=8,cooperative_max=100,coop_fwd_min_bytes=0,fused_min_rows_per_sm=0")
    assert ks.plan(4, 9)["strategy"] == "cooperative" and ks.plan(4, 8)["strategy"] == "registers"
    assert ks.plan(4, 101)["strategy"] == "fused"
    monkeypatch.setenv(ks.TUNING_ENV, "in_register_max=8,coop_bwd_max=0,coop_block=128,fused_min_rows_per_sm=0")
    assert ks.plan(4, 9, backward=True)["strategy"] == "fused" and ks.knobs()["coop_block"] == 128
    for bad in ("bogus=1", "unroll", "unroll=two"):
        monkeypatch.setenv(ks.TUNING_ENV, bad)
        with pytest.raises(ValueError):
            ks.knobs()


def test_collapse_rows():
    # contiguous 4-D with the softmax dim last: all leading dims merge into one
    x = torch.empty(2, 3, 4, 5)
    assert ks.collapse_rows(tuple(x.shape), tuple(x.stride())) == ((1, 1, 24), [(0, 0, 5)])
    # a broadcast mask stops the merge where its stride pattern breaks
    m = torch.empty(2, 1, 4, 5).expand(2, 3, 4, 5)
    lead, (sx, sm) = ks.collapse_rows(tuple(x.shape), tuple(x.stride()), tuple(m.stride()))
    assert lead == (2, 3, 4) and sm == (20, 0, 5) and sx == (60, 20, 5)
    # four unmergeable leading dims: None (the caller copies)
    y = torch.empty(3, 2, 3, 2, 5).permute(3, 2, 1, 0, 4)
    assert ks.collapse_rows(tuple(y.shape), tuple(y.stride())) is None


# ---------------------------------------------------------------------------------------
# Streaming strategies, forced on small rows: "fused" (both passes in one persistent
# program, pass 2 backwards) and "split" (row chunks in separate programs, merged partials)
# ---------------------------------------------------------------------------------------


def _online_input(n, mode, seed):
    """4 rows that stress the running (max, sum) and the chunk merge: random; a ramp whose max
    grows in every tile; leading tiles all -inf; and a fourth row that is fully masked (bool),
    partially masked (additive) or very large (no mask)."""
    x = randn(4, n, seed=seed)
    x[1] = torch.linspace(-20.0, 20.0, n, device=x.device) + 0.1 * x[1]
    x[2, : (3 * n) // 5] = NEG_INF
    if n == 1:
        x[2, 0] = 0.5  # a 1-column row cannot be both -inf and non-empty
    mask = None
    if mode == "bool":
        mask = torch.rand(4, n, generator=torch.Generator().manual_seed(seed + 1)) > 0.3
        mask[:, -1] = True  # rows 0-2 keep at least one entry
        mask[3] = False  # row 3: nothing kept
    elif mode == "add":
        mask = randn(4, n, seed=seed + 2)
        mask[3, ::2] = NEG_INF
        if n == 1:
            mask[3, 0] = 1.0
    else:
        x[3] = randn(n, seed=seed + 3, std=1000.0)
    return x.to(DEVICE), None if mask is None else mask.to(DEVICE)


def _launch(x, mask, scale, log, dtype, g, **override):
    """The launchers as the op calls them; returns (y, dx) as (rows, n) tensors."""
    xm, mm, lead, sx, sm = _rows(x, x.dim() - 1, mask)
    y = ks.softmax_forward(xm, mm, lead, sx, sm, xm.shape[-1], scale, log, dtype, **override)
    bmask = mm if (mm is not None and mm.dtype == torch.bool) else None
    dx = ks.softmax_backward(y, g, bmask, lead, sm, scale, log, dtype, **override)
    return y, dx


def _stream_kw(strategy, block, unroll, count):
    """Launch overrides: ``count`` is the splits per row (split) or the persistent grid (fused,
    cooperative); on the cooperative path ``block`` is the chunk per program (``unroll`` unused)."""
    kw = dict(strategy=strategy, block=block, unroll=unroll)
    kw["splits" if strategy == "split" else "programs"] = count
    return kw


STREAM_CASES = [
    # strategy, n, block, unroll, splits (split) / programs (fused), mask mode, log
    ("split", 1, 16, 2, 7, "bool", True),
    ("split", 17, 16, 1, 2, "add", True),
    ("split", 17, 16, 2, 3, "none", False),
    ("split", 17, 16, 1, 7, "bool", True),
    ("split", 200, 16, 1, 7, "bool", True),
    ("split", 200, 64, 1, 2, "bool", False),
    ("split", 200, 16, 4, 3, "add", False),
    ("split", 200, 32, 2, 3, "add", True),
    ("split", 1000, 64, 2, 1, "bool", False),
    ("split", 1000, 64, 4, 3, "none", True),
    ("split", 1000, 64, 2, 5, "bool", True),
    ("fused", 1, 16, 1, 1, "bool", True),
    ("fused", 17, 16, 2, 3, "bool", True),
    ("fused", 17, 16, 1, 4, "add", False),
    ("fused", 200, 16, 2, 1, "bool", False),
    ("fused", 200, 16, 4, 3, "none", True),
    ("fused", 200, 32, 1, 2, "add", True),
    ("fused", 1000, 64, 2, 3, "bool", True),
    ("fused", 1000, 64, 4, 1, "add", False),
    ("fused", 1000, 32, 4, 2, "none", True),
    # cooperative: chunk per program, rows' chunk programs in the grid (programs)
    ("cooperative", 1, 16, 1, 1, "bool", True),
    ("cooperative", 17, 16, 1, 2, "bool", True),
    ("cooperative", 17, 16, 1, 100, "add", False),
    ("cooperative", 200, 16, 1, 13, "bool", False),
    ("cooperative", 200, 32, 1, 7, "none", True),
    ("cooperative", 200, 64, 1, 64, "add", True),
    ("cooperative", 1000, 64, 1, 16, "bool", True),
    ("cooperative", 1000, 128, 1, 3, "add", False),
    ("cooperative", 1000, 256, 1, 64, "none", True),
]


@needs_kernels
@pytest.mark.parametrize("case", STREAM_CASES,
                         ids=lambda c: "{}-n{}-b{}x{}-{}-{}-{}".format(*c[:6], "log" if c[6] else "sm"))
def test_streaming_matches_registers_and_oracle(case):
    strategy, n, block, unroll, count, mode, log = case
    x, mask = _online_input(n, mode, seed=n + count)
    scale = 0.7
    g = randn(4, n, seed=99)
    y_reg, dx_reg = _launch(x, mask, scale, log, F32, g, strategy="registers")
    y_str, dx_str = _launch(x, mask, scale, log, F32, g, **_stream_kw(strategy, block, unroll, count))
    # Against the oracle, forward and backward.
    x64 = x.double().requires_grad_(True)
    y64 = oracle(x64, -1, scale, mask, log)
    (dx64,) = torch.autograd.grad(y64, x64, g.double())
    eexp = exponent_error(x, -1, scale, mask)
    for name, y, dx in (("registers", y_reg, dx_reg), (strategy, y_str, dx_str)):
        assert_fwd(y, y64, F32, log, name=f"y[{name}]", eexp=eexp)
        assert_grad(dx, dx64, y64.detach(), g.double(), -1, scale, log, F32, name=f"dx[{name}]", eexp=eexp)
    # The running / merged (max, sum) give the same numbers as one pass over the whole row
    # in registers (float32, different summation order only).
    _, _, finite = _same_nonfinite(y_str, y_reg, f"{strategy} vs registers")
    assert torch.allclose(y_str[finite], y_reg[finite], rtol=4e-6, atol=1e-7)
    assert torch.allclose(dx_str, dx_reg, rtol=1e-5, atol=1e-7)
    if mode == "bool":
        assert torch.equal(y_str[3], torch.full_like(y_str[3], NEG_INF if log else 0.0))
        assert torch.equal(dx_str[3], torch.zeros_like(dx_str[3]))  # nothing kept: gradient exactly 0
        assert torch.equal(dx_str[~mask], torch.zeros_like(dx_str[~mask]))


@needs_kernels
@pytest.mark.parametrize("strategy", ["split", "fused", "cooperative"])
@pytest.mark.parametrize("dtype", [F16, BF16], ids=str)
def test_streaming_low_precision(dtype, strategy):
    x = randn(3, 200, dtype=dtype, seed=8)
    g = randn(3, 200, dtype=dtype, seed=9)
    for log in (False, True):
        y, dx = _launch(x, None, 1.0, log, dtype, g, **_stream_kw(strategy, 32, 2, 2))
        x64 = x.double().requires_grad_(True)
        y64 = oracle(x64, log=log)
        (dx64,) = torch.autograd.grad(y64, x64, g.double())
        assert_fwd(y, y64, dtype, log)
        assert_grad(dx, dx64, y64.detach(), g.double(), -1, None, log, dtype)


@needs_kernels
@pytest.mark.parametrize("strategy", ["split", "fused", "cooperative"])
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_streaming_extreme_values(strategy, log):
    """+-1000 logits (and a constant 1000 row) are exact through the running max; a row whose
    max sits in its last tile exercises the rescaling of everything summed before it."""
    n = 150
    x = randn(5, n, seed=24, std=1000.0)
    x[1] = torch.tensor([1000.0, -1000.0] * (n // 2), device=DEVICE)
    x[2] = 1000.0
    x[3, :] = -1000.0
    x[3, -1] = -999.0
    x[4] = torch.linspace(-3000.0, 3000.0, n, device=DEVICE)
    g = randn(5, n, seed=25)
    y, dx = _launch(x, None, 1.0, log, F32, g, **_stream_kw(strategy, 16, 2, 3))
    assert torch.isfinite(y).all() and torch.isfinite(dx).all()
    x64 = x.double().requires_grad_(True)
    y64 = oracle(x64, log=log)
    (dx64,) = torch.autograd.grad(y64, x64, g.double())
    eexp = exponent_error(x)
    assert_fwd(y, y64, F32, log, eexp=eexp)
    assert_grad(dx, dx64, y64.detach(), g.double(), -1, None, log, F32, eexp=eexp)
    if not log:
        # A constant row: every probability the same value, 1 / n up to the rounding of the
        # kernel's reciprocal of the sum (the GPU's division is not IEEE-exact).
        assert torch.equal(y[2], y[2, :1].expand(n))
        torch.testing.assert_close(y[2], torch.full_like(y[2], 1.0 / n), rtol=2.0**-22, atol=0)


def _packed_rows(n, dtype, seed):
    """Rows for the cooperative forward's packed 16-bit pairs: random; +-1000 alternating
    (even / odd columns are the two halves of a word); a constant row; all -inf; one +inf;
    one NaN; the max alone in the last column (the ragged last chunk); large and spread."""
    x = randn(8, n, seed=seed, std=2.0)
    x[1, ::2], x[1, 1::2] = 1000.0, -1000.0
    x[2] = 7.0
    x[3] = NEG_INF
    x[4, n // 3] = POS_INF
    x[5, min(n - 1, n // 2 + 1)] = NAN
    x[6, -1] = 40.0
    x[7] = randn(n, seed=seed + 1, std=3000.0)
    return x.to(dtype).to(DEVICE)


def _forward(x, scale, log, **override):
    xm, mm, lead, sx, sm = _rows(x, x.dim() - 1, None)
    return ks.softmax_forward(xm, mm, lead, sx, sm, xm.shape[-1], scale, log, x.dtype, **override)


def _assert_packed(x, scale, log, **override):
    """Forward and backward on the cooperative path, x (and y, g) held as 16-bit pairs."""
    xm, _, _, sx, _ = _rows(x, x.dim() - 1, None)
    assert kpack.word_kind(xm, None, sx, xm.shape[-1], x.dtype) != ks.KIND_PLAIN.value
    g = randn(*x.shape, dtype=x.dtype, seed=x.shape[-1] + 5).to(x.device)
    y, dx = _launch(x, None, scale, log, x.dtype, g, strategy="cooperative", **override)
    x64 = x.double().requires_grad_(True)
    y64 = oracle(x64, -1, scale, None, log)
    (dx64,) = torch.autograd.grad(y64, x64, g.double())
    eexp = exponent_error(x, -1, scale)
    assert_fwd(y, y64, x.dtype, log, eexp=eexp)
    # (log-softmax's gradient of the all -inf row 3 is not the oracle's 0: see above)
    rows = [r for r in range(x.shape[0]) if not (log and r == 3)]
    assert_grad(dx[rows], dx64[rows], y64.detach()[rows], g.double()[rows], -1, scale, log, x.dtype,
                eexp=eexp[rows])


@needs_kernels
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("dtype", [BF16, F16], ids=str)
def test_cooperative_packed_pairs(dtype, log):
    """Unmasked contiguous 16-bit rows are held as pairs in int32 words, forward and backward:
    both halves, every chunk, the padding of the last one, non-finite entries and any sign
    of the scale."""
    for n in (2, 34, 200):
        x = _packed_rows(n, dtype, seed=n)
        for scale in (0.7, -1.3, 0.0):
            _assert_packed(x, scale, log, block=32)


@needs_kernels
def test_cooperative_forward_packing_choice():
    """Pairs only where every row is contiguous, even and word-aligned, unmasked, and y has
    x's dtype; everything else is held one element a word (and still correct)."""
    x = randn(3, 200, dtype=BF16, seed=3)

    def kind(t, mask=None, out=None):
        tm, mm, _, st, _ = _rows(t, t.dim() - 1, mask)
        return kpack.word_kind(tm, mm, st, tm.shape[-1], out or t.dtype)

    assert kind(x) == ks.KIND_BF16X2.value and kind(x.half()) == ks.KIND_F16X2.value
    base = randn(3, 203, dtype=BF16, seed=4)
    plain = {
        "fp32": x.float(),
        "odd length": x[:, :199],
        "odd row stride": base[:, :200],
        "odd start": base[:, 1:201],
        "strided columns": randn(3, 400, dtype=BF16, seed=5)[:, ::2],
        "column-major": randn(200, 3, dtype=BF16, seed=6).t(),
    }
    for name, t in plain.items():
        assert kind(t) == ks.KIND_PLAIN.value, name
        y = _forward(t, 0.9, False, strategy="cooperative", block=32)
        assert_fwd(y, oracle(t, -1, 0.9), t.dtype, name=name)
    assert kind(x, mask=torch.ones(3, 200, dtype=torch.bool, device=DEVICE)) == ks.KIND_PLAIN.value
    assert kind(x, out=F32) == ks.KIND_PLAIN.value
    # The backward: a gradient that starts off a word (a contiguous view at an odd offset).
    y = _forward(x, 0.9, False, strategy="cooperative", block=32)
    g = randn(3 * 200 + 1, dtype=BF16, seed=7)[1:].view(3, 200)
    dx = ks.softmax_backward(y, g, None, (1, 1, 3), (0, 0, 0, 0), 0.9, False, BF16, strategy="cooperative", block=32)
    x64 = x.double().requires_grad_(True)
    y64 = oracle(x64, -1, 0.9)
    (dx64,) = torch.autograd.grad(y64, x64, g.double())
    assert_grad(dx, dx64, y64.detach(), g.double(), -1, 0.9, False, BF16)


@needs_kernels
@pytest.mark.parametrize("path", ["cooperative", "fused", "split"])
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_public_api_through_streaming_paths(monkeypatch, log, path):
    """With ``in_register_max`` lowered the op's default plan holds rows in chunk programs
    (cooperative) or, with that path off, streams (fused, or split when ``fused_min_rows_per_sm``
    asks for more rows than there are): the autograd wiring, dims, strides (a transposed
    view, a sliced one) and masks go through it too."""
    monkeypatch.setenv(ks.TUNING_ENV, "in_register_max=64," + {
        "cooperative": "cooperative_max=1000,coop_fwd_min_bytes=0",
        "fused": "coop_bwd_max=0,fused_min_rows_per_sm=0",
        "split": "coop_bwd_max=0,fused_min_rows_per_sm=1000000",
    }[path])
    p = ks.plan(2, 130)
    assert p["strategy"] == path and (path == "fused" or p["splits"] > 1 or not INTERPRET)
    base = randn(130, 2, seed=11)
    mask = torch.rand(130, 1, generator=torch.Generator().manual_seed(1)) > 0.2
    mask[-1] = True
    run_case(base, dim=0, scale=0.5, mask=mask.to(DEVICE), log=log)
    run_case(randn(2, 130, seed=12), view=lambda t: t.t(), dim=0, log=log)
    run_case(randn(6, 400, seed=13), view=lambda t: t[::2, 1::3], log=log)


# ---------------------------------------------------------------------------------------
# dim != -1, strided views, the copy path
# ---------------------------------------------------------------------------------------

DIM_CASES = [
    # shape, dim
    ((7,), 0),
    ((9, 5), 0),
    ((4, 33), 1),
    ((3, 17, 5), 1),
    ((3, 17, 5), -2),
    ((2, 3, 9, 4), 1),
    ((2, 3, 9, 4), 2),
    ((2, 3, 9, 4), 0),
    # size-1 dims among the leading ones (merged by collapse_rows whatever their stride)
    ((1, 5, 7), -1),
    ((2, 1, 3, 8), -1),
    ((3, 1, 6, 1), 2),
]


@needs_kernels
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("case", DIM_CASES, ids=lambda c: f"{'x'.join(map(str, c[0]))}-dim{c[1]}")
def test_dims(case, log):
    shape, dim = case
    run_case(randn(*shape, seed=len(shape) + dim), dim=dim, scale=1.5, log=log)


VIEW_CASES = {
    "transposed": ((40, 6), lambda t: t.t(), -1),
    "transposed_dim0": ((40, 6), lambda t: t.t(), 0),
    "sliced_step": ((8, 99), lambda t: t[::2, 1::3], -1),
    "sliced_step_dim0": ((8, 99), lambda t: t[1::2, ::3], 0),
    "expand_rows": ((1, 37), lambda t: t.expand(5, 37), -1),  # stride 0 across rows
    "expand_cols": ((6, 1), lambda t: t.expand(6, 20), -1),  # stride 0 along the row
    "broadcast_3d": ((3, 1, 19), lambda t: t.expand(3, 4, 19), 1),
    "permuted_4d": ((2, 5, 3, 4), lambda t: t.permute(0, 2, 3, 1), -1),
}


@needs_kernels
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("name", list(VIEW_CASES))
def test_non_contiguous_views(name, log):
    shape, view, dim = VIEW_CASES[name]
    run_case(randn(*shape, seed=3), dim=dim, view=view, log=log)


def _five_d(t):
    return t.permute(3, 2, 1, 0, 4)  # four leading dims, none mergeable with a neighbour


@needs_kernels
@pytest.mark.parametrize("with_mask", [False, True], ids=["nomask", "mask"])
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_five_d_copy_path(log, with_mask):
    base = randn(3, 2, 3, 2, 5, seed=21)
    x = _five_d(base)
    assert ks.collapse_rows(tuple(x.shape), tuple(x.stride())) is None  # really the copy path
    mask = None
    if with_mask:
        mask = (torch.rand(2, 3, 1, 3, 5, generator=torch.Generator().manual_seed(2)) > 0.3).to(DEVICE)
        mask[0, 0, 0, 0] = False  # a fully masked row
    run_case(base, dim=-1, view=_five_d, mask=mask, log=log)
    # and along a leading dim of the same 5-D view
    run_case(base, dim=1, view=_five_d, log=log, grad=False)


# ---------------------------------------------------------------------------------------
# Masks
# ---------------------------------------------------------------------------------------


def _bool_mask(*shape, seed=0, p=0.3):
    return (torch.rand(*shape, generator=torch.Generator().manual_seed(seed)) > p).to(DEVICE)


MASK_CASES = {
    "bool_full": ((3, 20), lambda: _bool_mask(3, 20), F32, -1),
    "bool_heads_broadcast": ((2, 3, 9, 9), lambda: _bool_mask(2, 1, 9, 9, seed=1), F32, -1),
    "bool_cols_broadcast": ((6, 33), lambda: _bool_mask(33, seed=2), F32, -1),
    "bool_cols_broadcast_dim0": ((6, 33), lambda: _bool_mask(33, seed=2, p=0.1), F32, 0),
    "bool_dim1_4d": ((2, 7, 3, 4), lambda: _bool_mask(1, 7, 3, 1, seed=3), F32, 1),
    "add_fp32": ((4, 31), lambda: randn(4, 31, seed=4), F32, -1),
    "add_fp32_neg_inf": ((4, 31), lambda: randn(4, 31, seed=5).masked_fill(~_bool_mask(4, 31, seed=5), NEG_INF), F32, -1),
    "add_fp16_on_fp32": ((4, 31), lambda: randn(4, 31, dtype=F16, seed=6), F32, -1),
    "add_fp32_on_fp16": ((4, 31), lambda: randn(4, 31, seed=9, std=2.0), F16, -1),
    "add_fp16_on_fp16": (
        (2, 3, 9, 9),
        lambda: randn(2, 1, 9, 9, dtype=F16, seed=7).masked_fill(~_bool_mask(2, 1, 9, 9, seed=7), NEG_INF),
        F16,
        -1,
    ),
    "add_fp64_broadcast": ((6, 33), lambda: randn(33, dtype=torch.float64, seed=8), F32, -1),
}


@needs_kernels
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("name", list(MASK_CASES))
def test_masks(name, log):
    shape, make_mask, dtype, dim = MASK_CASES[name]
    mask = make_mask()
    _, dx = run_case(randn(*shape, dtype=dtype, seed=10), dim=dim, scale=0.8, mask=mask, log=log)
    if mask.dtype == torch.bool:
        # masked entries had no influence on y: their gradient is exactly 0
        dropped = ~mask.expand(shape)
        assert torch.equal(dx[dropped], torch.zeros_like(dx[dropped]))


@needs_kernels
@pytest.mark.parametrize("kind", ["bool", "additive"])
@pytest.mark.parametrize("n", [5, 33])
def test_fully_masked_row_softmax(kind, n):
    x = randn(3, n, seed=12)
    keep = _bool_mask(3, n, seed=12, p=0.2)
    keep[:, 0] = True
    keep[1] = False
    mask = keep if kind == "bool" else torch.zeros(3, n, device=DEVICE).masked_fill(~keep, NEG_INF)
    y, dx = run_case(x, mask=mask)
    assert torch.equal(y[1], torch.zeros_like(y[1]))
    assert torch.equal(dx[1], torch.zeros_like(dx[1]))
    assert torch.isfinite(dx).all()


@needs_kernels
def test_fully_masked_row_log_softmax():
    x = randn(3, 33, seed=13)
    keep = _bool_mask(3, 33, seed=13)
    keep[:, 0] = True
    keep[2] = False
    y, dx = run_case(x, mask=keep, log=True)
    assert torch.equal(y[2], torch.full_like(y[2], NEG_INF))
    assert torch.equal(dx[2], torch.zeros_like(dx[2]))
    assert not torch.isnan(y).any()


# ---------------------------------------------------------------------------------------
# Scale
# ---------------------------------------------------------------------------------------

def _scale_param(scale, n, strategy, masked=False):
    # Zero and negative scales on padded rows (length not a power of two, or the online
    # path) once turned the padding lanes into +inf / NaN: keep them covered.
    name = f"scale{scale}-n{n}-{strategy}" + ("-boolmask" if masked else "")
    return pytest.param(scale, n, strategy, masked, id=name)


SCALE_CASES = [
    _scale_param(s, n, strat)
    for s in (0.125, 3.0, -1.0)
    for n, strat in ((31, "registers"), (32, "registers"), (200, "split"), (200, "fused"), (200, "cooperative"))
] + [
    _scale_param(0.0, 31, "registers"),
    _scale_param(0.0, 32, "registers"),
    _scale_param(-1.0, 31, "registers", masked=True),
    _scale_param(-1.0, 200, "split", masked=True),
    _scale_param(-1.0, 200, "fused", masked=True),
    _scale_param(-1.0, 200, "cooperative", masked=True),
    _scale_param(0.0, 200, "fused"),
    _scale_param(0.0, 200, "cooperative"),
]


@needs_kernels
@pytest.mark.parametrize("scale,n,strategy,masked", SCALE_CASES)
def test_scale(scale, n, strategy, masked):
    x = randn(3, n, seed=14)
    mask = _bool_mask(3, n, seed=14, p=0.1) if masked else None
    if mask is not None:
        mask[:, 0] = True
    g = randn(3, n, seed=15)
    kw = dict(strategy="registers") if strategy == "registers" else _stream_kw(strategy, 64, 1, 2)
    for log in (False, True):
        y, dx = _launch(x, mask, scale, log, F32, g, **kw)
        x64 = x.double().requires_grad_(True)
        y64 = oracle(x64, -1, scale, mask, log)
        (dx64,) = torch.autograd.grad(y64, x64, g.double())
        assert_fwd(y, y64, F32, log)
        assert_grad(dx, dx64, y64.detach(), g.double(), -1, scale, log, F32)


@needs_kernels
def test_negative_scale_public_api():
    """``flashtile.softmax(x, scale=-1.0)`` equals ``torch.softmax(-x)``."""
    x = randn(4, 10, seed=16)
    y = flashtile.softmax(x, scale=-1.0)
    assert_fwd(y, oracle(x, -1, -1.0), F32)


@needs_kernels
def test_int_scale_and_default_scale():
    x = randn(3, 12, seed=17)
    assert_fwd(flashtile.softmax(x, scale=2), oracle(x, -1, 2.0), F32)
    assert torch.equal(flashtile.softmax(x), flashtile.softmax(x, scale=None))
    assert torch.equal(flashtile.softmax(x), flashtile.softmax(x, scale=1.0))


# ---------------------------------------------------------------------------------------
# Extreme values
# ---------------------------------------------------------------------------------------


@needs_kernels
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_large_magnitudes_fp32(log):
    x = randn(4, 50, seed=18, std=1000.0)
    x[1] = torch.tensor([1000.0, -1000.0] * 25, device=DEVICE)
    x[2] = 1000.0  # a constant row: uniform, no overflow
    x[3, :] = -1000.0
    x[3, 7] = -999.0
    y, _ = run_case(x, log=log)
    assert torch.isfinite(y).all()


@needs_kernels
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_large_magnitudes_fp16(log):
    x = randn(3, 40, seed=19, std=3e4).clamp(-3e4, 3e4).to(F16)  # x - max >= -6e4: representable
    x[1] = torch.tensor([3e4, -3e4] * 20, dtype=F16, device=DEVICE)
    x[2] = 6.0e4
    y, dx = run_case(x, log=log)
    assert torch.isfinite(y).all() and torch.isfinite(dx).all()


@needs_kernels
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_large_common_offset_fp32(log):
    """Rows of 1000 + N(0, 1): finite, and within the bound whose ``exponent_error`` term
    (~|x| 2**-24, here ~2e-4 relative) covers the kernels' scale-before-subtract rounding."""
    x = 1000.0 + randn(3, 100, seed=20)
    assert float(exponent_error(x).max()) < 2e-4
    run_case(x, log=log)


@needs_kernels
@pytest.mark.parametrize("strategy", ["registers", "split", "fused", "cooperative"])
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_non_finite_inputs(log, strategy):
    n = 40
    x = randn(6, n, seed=21)
    x[1] = NEG_INF  # all -inf: zeros / -inf, not NaN
    x[2, 13] = NAN  # NaN: that row all NaN, the others untouched
    x[3, 30] = POS_INF  # +inf: NaN row, as torch
    x[4, ::3] = NEG_INF  # some -inf entries: ordinary
    x[5, 39] = POS_INF
    x[5, 0] = NAN
    kw = dict(strategy="registers") if strategy == "registers" else _stream_kw(strategy, 16, 1, 3)
    g = randn(6, n, seed=22)
    y, dx = _launch(x, None, 1.0, log, F32, g, **kw)
    ref = oracle(x, log=log)
    assert torch.isnan(y[2]).all() and torch.isnan(y[3]).all() and torch.isnan(y[5]).all()
    assert torch.equal(y[1], torch.full_like(y[1], NEG_INF if log else 0.0))
    assert_fwd(y, ref, F32, log)  # includes: NaN exactly where torch's float64 softmax has NaN
    torch_ref = (torch.log_softmax if log else torch.softmax)(x.double(), -1)
    assert torch.equal(torch.isnan(y[2:]), torch.isnan(torch_ref[2:]))
    # gradients of the finite rows (0 and 4) match the oracle; softmax of the all -inf row: 0
    x64 = x.double().requires_grad_(True)
    y64 = oracle(x64, log=log)
    (dx64,) = torch.autograd.grad(y64, x64, g.double())
    rows = [0, 4] if log else [0, 1, 4]
    assert_grad(dx[rows], dx64[rows], y64.detach()[rows], g.double()[rows], -1, None, log, F32)
    if not log:
        assert torch.equal(dx[1], torch.zeros_like(dx[1]))


@needs_kernels
def test_all_neg_inf_public_api():
    x = torch.full((2, 3, 17), NEG_INF, device=DEVICE)
    x[0, 1, 4] = 0.0
    y = flashtile.softmax(x, dim=-1)
    ly = flashtile.log_softmax(x, dim=-1)
    assert not torch.isnan(y).any() and not torch.isnan(ly).any()
    assert_fwd(y, oracle(x), F32)
    assert_fwd(ly, oracle(x, log=True), F32, log=True)
    assert y[0, 1, 4] == 1.0 and ly[0, 1, 4] == 0.0


# ---------------------------------------------------------------------------------------
# dtypes, empty tensors
# ---------------------------------------------------------------------------------------


@needs_kernels
@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=str)
def test_output_and_grad_dtype(dtype):
    x = randn(2, 9, dtype=dtype, seed=23).requires_grad_(True)
    for fn in (flashtile.softmax, flashtile.log_softmax):
        y = fn(x, 0)
        assert y.dtype == dtype and y.shape == x.shape
        (dx,) = torch.autograd.grad(y, x, torch.ones_like(y))
        assert dx.dtype == dtype


@needs_kernels
@pytest.mark.parametrize("shape,dim", [((3, 0), -1), ((0, 5), -1), ((0, 5), 0), ((2, 0, 4), 1)])
def test_empty_tensors(shape, dim):
    x = torch.zeros(shape, device=DEVICE, requires_grad=True)
    for fn in (flashtile.softmax, flashtile.log_softmax):
        y = fn(x, dim)
        assert y.shape == x.shape
        (dx,) = torch.autograd.grad(y, x, torch.ones_like(y))
        assert dx.shape == x.shape


# ---------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------


def _x():
    return torch.randn(3, 4, device=DEVICE)


@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda f: f([[1.0, 2.0]]), TypeError, "x must be a torch.Tensor"),
        (lambda f: f(torch.ones(3, 4, dtype=torch.int32)), ValueError, "dtype"),
        (lambda f: f(torch.ones(3, 4, dtype=torch.complex64)), ValueError, "dtype"),
        (lambda f: f(torch.tensor(1.0)), ValueError, "0-d"),
        (lambda f: f(_x(), 2), ValueError, "dim"),
        (lambda f: f(_x(), -3), ValueError, "dim"),
        (lambda f: f(_x(), True), TypeError, "dim"),
        (lambda f: f(_x(), 1.0), TypeError, "dim"),
        (lambda f: f(_x(), mask=torch.ones(5, dtype=torch.bool, device=DEVICE)), ValueError, "broadcast"),
        (lambda f: f(_x(), mask=torch.ones(2, 3, 4, dtype=torch.bool, device=DEVICE)), ValueError, "enlarge"),
        (lambda f: f(_x(), mask=torch.ones(3, 4, dtype=torch.int64, device=DEVICE)), ValueError, "mask"),
        (lambda f: f(_x(), mask=[[True] * 4] * 3), TypeError, "mask"),
        (lambda f: f(_x(), scale="0.5"), TypeError, "scale"),
        (lambda f: f(_x(), scale=True), TypeError, "scale"),
        (lambda f: f(_x(), scale=float("nan")), ValueError, "scale"),
        (lambda f: f(_x(), scale=float("inf")), ValueError, "scale"),
    ],
    ids=[
        "non_tensor", "int_dtype", "complex64", "zero_dim", "dim_too_big", "dim_too_small", "dim_bool",
        "dim_float", "mask_not_broadcastable", "mask_enlarges", "mask_int", "mask_list", "scale_str",
        "scale_bool", "scale_nan", "scale_inf",
    ],
)
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_validation(call, exc, match, log):
    with pytest.raises(exc, match=match):
        call(fn_of(log))


# ---------------------------------------------------------------------------------------
# The CPU (non-Triton) path
# ---------------------------------------------------------------------------------------

CPU_CASES = {
    "plain": ((5, 33), -1, None, None, F32),
    "dim0": ((9, 5), 0, 2.0, None, F32),
    "dim_middle": ((2, 7, 3), 1, 0.5, None, F32),
    "neg_scale": ((4, 31), -1, -1.0, None, F32),
    "zero_scale": ((4, 31), -1, 0.0, None, F32),
    "bool_mask_bcast": ((2, 3, 6, 6), -1, 0.8, lambda: _bool_mask(2, 1, 6, 6, seed=3), F32),
    "bool_mask_cols": ((6, 10), -1, None, lambda: _bool_mask(10, seed=4), F32),
    "add_mask_fp16": ((4, 20), -1, None, lambda: randn(4, 20, dtype=F16, seed=5, device="cpu"), F16),
    "add_mask_neg_inf": ((4, 20), -1, None, lambda: torch.zeros(4, 20).masked_fill(~_bool_mask(4, 20, seed=6).cpu(), NEG_INF), F32),
    "bf16": ((3, 50), -1, 0.125, None, BF16),
    "fp16": ((3, 50), 0, 3.0, None, F16),
}


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("name", list(CPU_CASES))
def test_cpu_path(name, log):
    shape, dim, scale, make_mask, dtype = CPU_CASES[name]
    x = randn(*shape, dtype=dtype, device="cpu", seed=30)
    mask = make_mask().cpu() if make_mask else None
    y = _torch_softmax(x, dim, 1.0 if scale is None else scale, mask, log)
    assert_fwd(y, oracle(x, dim, scale, mask, log), dtype, log)


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_cpu_path_empty_and_non_finite_rows(log):
    x = randn(6, 12, device="cpu", seed=31)
    x[0] = NEG_INF
    x[1, 3] = NAN
    x[2, 4] = POS_INF
    keep = torch.ones(6, 12, dtype=torch.bool)
    keep[3] = False  # fully masked
    keep[4, ::2] = False
    y = _torch_softmax(x, 1, 1.0, keep, log)
    ref = oracle(x, 1, None, keep, log)
    assert_fwd(y, ref, F32, log)
    empty = torch.full((12,), NEG_INF if log else 0.0)
    assert torch.equal(y[0], empty) and torch.equal(y[3], empty)
    assert torch.isnan(y[1]).all() and torch.isnan(y[2]).all()
    # The same through the additive form of the mask.
    add = torch.zeros(6, 12).masked_fill(~keep, NEG_INF)
    assert_fwd(_torch_softmax(x, 1, 1.0, add, log), ref, F32, log)


def test_cpu_path_no_rows():
    x = torch.zeros(0, 5)
    for log in (False, True):
        y = _torch_softmax(x, 1, 1.0, None, log)
        assert y.shape == x.shape


@pytest.mark.parametrize("shape,dim", [((3, 0), 1), ((0, 5), 0)])
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_cpu_path_zero_length_rows(log, shape, dim):
    x = torch.zeros(shape)
    y = _torch_softmax(x, dim, 1.0, None, log)
    assert y.shape == shape
    assert torch.equal(y, (torch.log_softmax if log else torch.softmax)(x, dim))


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_public_api_takes_cpu_path_without_interpreter(monkeypatch, log):
    """With TRITON_INTERPRET unset a CPU tensor runs plain PyTorch; autograd goes through torch."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not ops_softmax._use_triton(torch.zeros(1))
    keep = _bool_mask(2, 1, 7, seed=8).cpu()  # broadcast over dim 1
    keep[0, 0, 0] = True
    keep[1, 0, :] = False  # the rows x[1, :, :] are fully masked
    base = randn(2, 4, 7, device="cpu", seed=32)
    run_case(base, dim=2, scale=0.5, mask=keep, log=log)


# ---------------------------------------------------------------------------------------
# GPU (skipped without CUDA): large rows, bf16, attention-score-shaped masks
# ---------------------------------------------------------------------------------------

GPU_ROW_LENGTHS = [1, 31, 32, 33, 1023, 1024, 1025, 16384, 16385, 32768, 32769, 65537, 262144, 262145]




@pytest.mark.gpu
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("dtype", [BF16, F16, F32], ids=str)
@pytest.mark.parametrize("n", GPU_ROW_LENGTHS)
def test_gpu_row_lengths(n, dtype, log):
    rows = max(3, min(777, 2**22 // n))  # 777 short rows: a partial last multi-row program
    x = randn(rows, n, dtype=dtype, device="cuda", seed=n, std=2.0)
    check_fwd_bwd(x, scale=0.9, log=log)


@pytest.mark.gpu
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("dtype", [BF16, F32], ids=str)
def test_gpu_huge_rows_split(dtype, log, monkeypatch):
    # (staged_bwd_min_bytes=0: the backward too on the split path, not the shared-memory one)
    monkeypatch.setenv(ks.TUNING_ENV, "cooperative_max=0,staged_bwd_min_bytes=0")
    x = randn(2, 4_194_304, dtype=dtype, device="cuda", seed=40)
    p = ks.plan(2, x.shape[1], elem_bytes=x.element_size())
    assert p["strategy"] == "split" and p["splits"] > 1
    check_fwd_bwd(x, log=log)


@pytest.mark.gpu
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("dtype", [BF16, F32], ids=str)
def test_gpu_huge_rows_cooperative(dtype, log, monkeypatch):
    """4M-element rows, cooperative both ways: the forward holds all 256 (bf16) / 512 (fp32)
    chunks of a row at once (at its 64-register cap); the backward's 512 chunk programs run
    cooperatively if they can all be resident (at the 64-register fallback), else on the
    split path."""
    monkeypatch.setenv(ks.TUNING_ENV, "cooperative_max=4194304,coop_bwd_max=4194304,staged_bwd_min_bytes=0")
    x = randn(2, 4_194_304, dtype=dtype, device="cuda", seed=40)
    p = ks.plan(2, x.shape[1], elem_bytes=x.element_size())
    assert p["strategy"] == "cooperative" and p["splits"] == 4_194_304 * x.element_size() // 32768
    check_fwd_bwd(x, log=log)


@pytest.mark.gpu
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("dtype", [BF16, F16], ids=str)
@pytest.mark.parametrize("config", ["", "coop_fwd_maxnreg=80", "coop_fwd_maxnreg=0,coop_bwd_block=4096"])
def test_gpu_cooperative_packed(config, dtype, log, monkeypatch):
    """The packed kernels on the GPU (the forward's max taken on the packed words): even rows
    with a ragged last chunk (65538: one word in the forward's fifth chunk, the rest NaN
    padding), non-finite entries, every sign of the scale, under the register caps the
    tuning sweep tries."""
    monkeypatch.setenv(ks.TUNING_ENV, "cooperative_max=262144,coop_fwd_min_bytes=0," + config)
    for n in (65536, 65538):
        x = _packed_rows(n, dtype, seed=n)
        for scale in (0.7, -1.3, 0.0):
            _assert_packed(x, scale, log)
    x = randn(64, 65536, dtype=dtype, device="cuda", seed=48, std=2.0)  # many rows in flight
    check_fwd_bwd(x, scale=0.9, log=log)


def _gpu_rows_for_fused():
    """Enough rows for the default plan to take the fused path on this GPU."""
    return int(ktune.FUSED_MIN_ROWS_PER_SM * sm_count(torch.cuda.current_device())) + 8


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["cooperative", "fused", "split"])
@pytest.mark.parametrize("dtype", [BF16, F32], ids=str)
@pytest.mark.parametrize("n,log", [(16385, False), (65537, True), (262145, False)], ids=str)
def test_gpu_streaming_paths(n, log, dtype, path, monkeypatch):
    """Rows just past the in-register limit and past powers of two (ragged last tile, rows
    not 16-byte aligned), through each path both ways: cooperative, fused (enough rows) and
    forced split."""
    monkeypatch.setenv(ks.TUNING_ENV, {"cooperative": "cooperative_max=1000000,coop_bwd_max=1000000,coop_fwd_min_bytes=0",
                                       "fused": "cooperative_max=0,coop_bwd_max=0",
                                       "split": "cooperative_max=0,coop_bwd_max=0,fused_min_rows_per_sm=1000000"}[path])
    rows = _gpu_rows_for_fused()
    x = randn(rows, n, dtype=dtype, device="cuda", seed=n + 1, std=3.0)
    assert ks.plan(rows, n, elem_bytes=x.element_size())["strategy"] == path
    check_fwd_bwd(x, scale=0.7, log=log)


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["cooperative", "fused"])
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_gpu_masked_and_extreme_long_rows(log, path, monkeypatch):
    monkeypatch.setenv(ks.TUNING_ENV, "cooperative_max=65536,coop_fwd_min_bytes=0" if path == "cooperative"
                       else "cooperative_max=0,coop_bwd_max=0")
    rows, n = _gpu_rows_for_fused(), 65536
    # A masked forward streams either way (see plan()); the backward takes `path`.
    assert ks.plan(rows, n, elem_bytes=2, masked=True)["strategy"] == "fused"
    assert ks.plan(rows, n, elem_bytes=2, backward=True)["strategy"] == path
    x = randn(rows, n, dtype=BF16, device="cuda", seed=45, std=2.0)
    x[0] = 1000.0
    x[1, ::2], x[1, 1::2] = 1000.0, -1000.0
    if not log:  # (log-softmax's gradient of an all -inf row is not the oracle's 0: see above)
        x[2] = NEG_INF  # all -inf: zeros
    keep = _bool_mask(rows, n, seed=46, p=0.3)
    keep[3] = False  # fully masked
    keep[:3] = True
    y, dx = check_fwd_bwd(x, mask=keep, log=log)
    if not log:
        assert torch.equal(y[2], torch.zeros_like(y[2]))
    assert torch.equal(y[3], torch.full_like(y[3], NEG_INF if log else 0.0))
    assert torch.equal(dx[3], torch.zeros_like(dx[3]))


@pytest.mark.gpu
def test_gpu_tuning_knobs_keep_results(monkeypatch):
    """Every knob setting the tuning script sweeps computes the same function."""
    rows = _gpu_rows_for_fused()
    x = randn(rows, 65537, dtype=BF16, device="cuda", seed=47)
    for config in ("coop_bwd_max=0,programs_per_sm=1", "coop_bwd_max=0,warps_per_sm=32,unroll=1",
                   "coop_bwd_max=0,evict=0,block=1024", "coop_bwd_max=0,stages=2",
                   "coop_fwd_min_bytes=0,coop_maxnreg=64", "coop_fwd_min_bytes=0,coop_block=16384,coop_bwd_block=2048",
                   "coop_fwd_min_bytes=0,coop_warps=4", "coop_fwd_min_bytes=0,coop_pack=0,coop_fwd_maxnreg=0"):
        monkeypatch.setenv(ks.TUNING_ENV, config)
        check_fwd_bwd(x, log=False)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F16, BF16], ids=str)
def test_gpu_attention_scores_bool_mask(dtype):
    b, h, n = 4, 16, 1024
    x = randn(b, h, n, n, dtype=dtype, device="cuda", seed=41, std=4.0)
    keep = torch.ones(n, n, dtype=torch.bool, device="cuda").tril()  # causal
    keep = keep[None, None].repeat(b, 1, 1, 1)
    keep[1] &= _bool_mask(1, n, n, seed=42, p=0.5).cuda()  # random padding-like holes
    keep[2, 0, 5] = False  # a fully masked query row
    for log in (False, True):
        _, dx = check_fwd_bwd(x, scale=0.125, mask=keep, log=log)
        assert torch.equal(dx[2, :, 5], torch.zeros_like(dx[2, :, 5]))


@pytest.mark.gpu
def test_gpu_attention_scores_additive_mask():
    b, h, n = 2, 8, 1024
    x = randn(b, h, n, n, dtype=F16, device="cuda", seed=43, std=4.0)
    add = torch.zeros(b, 1, n, n, dtype=F16, device="cuda").masked_fill(
        ~torch.ones(n, n, dtype=torch.bool, device="cuda").tril(), NEG_INF
    ) + randn(b, 1, n, n, dtype=F16, device="cuda", seed=44, std=0.5)
    check_fwd_bwd(x, scale=0.125, mask=add, log=False)


@pytest.mark.gpu
def test_gpu_layouts_and_negative_scale():
    """A sample of the interpreter cases on real hardware (strides, dims, copy path, masks)."""
    run_case(randn(40, 6, device="cuda"), view=lambda t: t.t())
    run_case(randn(8, 99, device="cuda"), view=lambda t: t[::2, 1::3], log=True)
    run_case(randn(1, 37, device="cuda"), view=lambda t: t.expand(5, 37))
    run_case(randn(3, 17, 5, device="cuda"), dim=1)
    run_case(randn(3, 2, 3, 2, 5, device="cuda"), view=_five_d)
    run_case(randn(2, 3, 9, 9, device="cuda", dtype=F16), mask=_bool_mask(2, 1, 9, 9).cuda(), log=True)
    run_case(randn(4, 32, device="cuda"), scale=-1.0)  # power-of-two rows: no padding lanes
