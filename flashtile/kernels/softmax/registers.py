"""Rows held whole in registers: 1 read + 1 write, for rows up to ``IN_REGISTER_MAX`` elements.

A program loads whole rows once, reduces the max and the sum in registers (Triton lowers
``tl.max``/``tl.sum`` to a warp-shuffle reduction, then across warps through shared memory
-- the two-level reduction), and writes the result.  Short rows pack several rows into one
program (``ROWS > 1``) so each program still moves enough bytes; long-but-fitting rows get
one program and more warps.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashtile.kernels.runtime import cdiv
from flashtile.kernels.softmax.rows import bwd_dx, logits, row_offset, safe_shift


@triton.jit
def _softmax_fwd_in_registers(
    X, MASK, Y, n_rows, n_cols, L1, L2,
    sx0, sx1, sx2, sxc, sm0, sm1, sm2, smc,
    scale_log2,
    LOG: tl.constexpr, MASK_KIND: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    ok = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    x_off = row_offset(rows, L1, L2, sx0, sx1, sx2)[:, None]
    m_off = row_offset(rows, L1, L2, sm0, sm1, sm2)[:, None]
    x, bias = logits(X, MASK, x_off, m_off, cols[None, :], ok, sxc, smc, MASK_KIND, "")
    shift = safe_shift(tl.max(x * scale_log2 + bias, axis=1))
    e = tl.math.exp2(x * scale_log2 + (bias - shift[:, None]))
    l = tl.sum(e, axis=1)
    if LOG:
        # An empty row (l = 0) keeps y = -inf instead of -inf + inf = NaN.
        log2_l = tl.where(l == 0.0, 0.0, tl.math.log2(l))
        y = (x * scale_log2 + (bias - shift[:, None] - log2_l[:, None])) * 0.6931471805599453
    else:
        y = e * (1.0 / tl.where(l == 0.0, 1.0, l))[:, None]
    y_off = rows.to(tl.int64)[:, None] * n_cols  # Y is a fresh contiguous (rows, cols) buffer
    tl.store(Y + y_off + cols[None, :], y.to(Y.dtype.element_ty), mask=ok)


@triton.jit
def _softmax_bwd_in_registers(
    Y, G, MASK, DX, n_rows, n_cols, L1, L2, sm0, sm1, sm2, smc, scale,
    LOG: tl.constexpr, MASK_KIND: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)[None, :]
    ok = (rows[:, None] < n_rows) & (cols < n_cols)
    offs = rows.to(tl.int64)[:, None] * n_cols + cols
    m_off = row_offset(rows, L1, L2, sm0, sm1, sm2)[:, None]
    y = tl.load(Y + offs, mask=ok, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=ok, other=0.0).to(tl.float32)
    s = tl.sum(g if LOG else g * y, axis=1)[:, None]
    dx = bwd_dx(MASK, y, g, s, m_off, cols, ok, smc, scale, LOG, MASK_KIND, "")
    tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=ok)


def forward(x, mask, y, n_rows, n_cols, L1, L2, x_strides, m_strides, scale_log2, log, mask_kind, p):
    """y (a fresh contiguous (rows, n_cols) buffer) = softmax of the rows of ``x``, planned by ``p``."""
    _softmax_fwd_in_registers[(cdiv(n_rows, p["ROWS"]),)](
        x, mask, y, n_rows, n_cols, L1, L2, *x_strides, *m_strides, scale_log2,
        LOG=log, MASK_KIND=mask_kind, ROWS=p["ROWS"], BLOCK_N=p["BLOCK_N"], num_warps=p["num_warps"])


def backward(y, g, mask, dx, n_rows, n_cols, L1, L2, m_strides, scale, log, mask_kind, p):
    """dx of contiguous (rows, n_cols) ``y`` and ``g``, planned by ``p``."""
    _softmax_bwd_in_registers[(cdiv(n_rows, p["ROWS"]),)](
        y, g, mask, dx, n_rows, n_cols, L1, L2, *m_strides, scale,
        LOG=log, MASK_KIND=mask_kind, ROWS=p["ROWS"], BLOCK_N=p["BLOCK_N"], num_warps=p["num_warps"])
