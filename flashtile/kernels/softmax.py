"""Row softmax / log-softmax kernels, forward and backward, chosen by row length.

Softmax is memory-bound: the floor is one read and one write per element.  How close a
kernel gets depends on whether a row fits on chip:

* **In registers** (rows up to ``IN_REGISTER_MAX`` elements): a program loads whole rows
  once, reduces the max and the sum in registers (Triton lowers ``tl.max``/``tl.sum`` to a
  warp-shuffle reduction, then across warps through shared memory -- the two-level
  reduction), and writes the result: 1 read + 1 write.  Short rows pack several rows into
  one program (``ROWS > 1``) so each program still moves enough bytes; long-but-fitting
  rows get one program and more warps.
* **Online, two passes** (longer rows): pass 1 streams the row once keeping a running
  ``(m, l)`` per lane and rescaling ``l`` whenever the max grows (Milakov & Gimelshein);
  pass 2 streams it again and writes ``exp(x - m) / l``: 2 reads + 1 write.  When there are
  few rows, each row is split into ``splits`` chunks handled by separate programs, so all
  SMs stay busy; the chunks' partial ``(m, l)`` are merged with the online-softmax rule.

Rows are addressed through up to three leading indices with arbitrary strides plus a column
stride, so transposed / sliced / broadcast (stride-0) inputs and masks are read in place.
The scale and the mask are applied on the fly: the masked scores never exist in memory.
Everything is computed in float32 and in log2 units (one FMA and an ``exp2`` per element).
A row with no finite entry (all ``-inf`` / all masked) gives zeros (log-softmax: ``-inf``),
never NaN; NaN and ``+inf`` inputs propagate as in ``torch.softmax``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashtile.kernels.runtime import INTERPRET, sm_count

LOG2E = 1.4426950408889634
IN_REGISTER_MAX = 32768
MAX_SPLITS = 64


@triton.jit
def _row_offset(row, L1, L2, s0, s1, s2):
    """Offset of row ``row`` for a tensor whose leading dims (L0, L1, L2) have strides s0, s1, s2."""
    i2 = row % L2
    t = row // L2
    return (t // L1).to(tl.int64) * s0 + (t % L1).to(tl.int64) * s1 + i2.to(tl.int64) * s2


@triton.jit
def _logits(X, MASK, x_off, m_off, cols, ok, sxc, smc, MASK_KIND: tl.constexpr):
    """A block of logits as ``x`` (fp32) and a ``bias`` in log2 units.

    The logit is ``x * scale * log2(e) + bias``; keeping the two apart lets each use fold the
    scale, the bias and the max subtraction into one FMA, ``x * s + (bias - max)``, rounded
    once -- rounding ``x * s`` first would cost absolute accuracy when scores are large.
    Padding and masked-out entries get ``bias = -inf`` and ``x = 0`` (so a NaN hidden by the
    mask stays hidden, and a negative scale cannot turn the padding into +inf).
    """
    x = tl.load(X + x_off + cols * sxc, mask=ok, other=0.0).to(tl.float32)
    bias = tl.where(ok, 0.0, float("-inf"))
    if MASK_KIND == 1:  # boolean, True = keep
        keep = tl.load(MASK + m_off + cols * smc, mask=ok, other=0) != 0
        bias = tl.where(keep, bias, float("-inf"))
        x = tl.where(keep, x, 0.0)
    elif MASK_KIND == 2:  # additive, in natural-log units like x * scale
        bias = bias + tl.load(MASK + m_off + cols * smc, mask=ok, other=0.0).to(tl.float32) * 1.4426950408889634
    return x, bias


@triton.jit
def _safe_shift(m):
    # (-inf) - (-inf) is NaN: a row with no finite entry is shifted by 0, so it stays 0.
    return tl.where(m == float("-inf"), 0.0, m)


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
    x_off = _row_offset(rows, L1, L2, sx0, sx1, sx2)[:, None]
    m_off = _row_offset(rows, L1, L2, sm0, sm1, sm2)[:, None]
    x, bias = _logits(X, MASK, x_off, m_off, cols[None, :], ok, sxc, smc, MASK_KIND)
    shift = _safe_shift(tl.max(x * scale_log2 + bias, axis=1))
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
def _softmax_fwd_partials(
    X, MASK, M_PART, L_PART, n_cols, L1, L2, chunk,
    sx0, sx1, sx2, sxc, sm0, sm1, sm2, smc,
    scale_log2, splits,
    MASK_KIND: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Pass 1 of the online softmax over one chunk of one row: its (max, sum) in log2 units."""
    pid = tl.program_id(0)
    row = pid // splits
    c0 = (pid % splits) * chunk
    x_off = _row_offset(row, L1, L2, sx0, sx1, sx2)
    m_off = _row_offset(row, L1, L2, sm0, sm1, sm2)
    # One running (m, l) per lane; merged across lanes once at the end.
    m = tl.full([BLOCK_N], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_N], tl.float32)
    for start in range(c0, tl.minimum(c0 + chunk, n_cols), BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        ok = (cols < n_cols) & (cols < c0 + chunk)
        x, bias = _logits(X, MASK, x_off, m_off, cols, ok, sxc, smc, MASK_KIND)
        m_new = tl.maximum(m, x * scale_log2 + bias)
        shift = _safe_shift(m_new)
        l = l * tl.math.exp2(m - shift) + tl.math.exp2(x * scale_log2 + (bias - shift))
        m = m_new
    m_row = tl.max(m, axis=0)
    l_row = tl.sum(l * tl.math.exp2(m - _safe_shift(m_row)), axis=0)
    tl.store(M_PART + pid, m_row)
    tl.store(L_PART + pid, l_row)


@triton.jit
def _merge_partials(M_PART, L_PART, row, splits, SPLITS: tl.constexpr):
    """Merge a row's chunk states: m = max m_c, l = sum l_c * 2^(m_c - m)."""
    idx = tl.arange(0, SPLITS)
    ok = idx < splits
    m_c = tl.load(M_PART + row * splits + idx, mask=ok, other=float("-inf"))
    l_c = tl.load(L_PART + row * splits + idx, mask=ok, other=0.0)
    m = tl.max(m_c, axis=0)
    shift = _safe_shift(m)
    return shift, tl.sum(l_c * tl.math.exp2(m_c - shift), axis=0)


@triton.jit
def _softmax_fwd_write(
    X, MASK, Y, M_PART, L_PART, n_cols, L1, L2, chunk,
    sx0, sx1, sx2, sxc, sm0, sm1, sm2, smc,
    scale_log2, splits,
    LOG: tl.constexpr, MASK_KIND: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
):
    """Pass 2: re-read the chunk and write exp2(logit - m) / l (or its log)."""
    pid = tl.program_id(0)
    row = pid // splits
    c0 = (pid % splits) * chunk
    shift, l = _merge_partials(M_PART, L_PART, row, splits, SPLITS)
    inv_l = 1.0 / tl.where(l == 0.0, 1.0, l)
    log2_l = tl.where(l == 0.0, 0.0, tl.math.log2(l))  # empty row: y stays -inf, not NaN
    x_off = _row_offset(row, L1, L2, sx0, sx1, sx2)
    m_off = _row_offset(row, L1, L2, sm0, sm1, sm2)
    y_off = row.to(tl.int64) * n_cols
    for start in range(c0, tl.minimum(c0 + chunk, n_cols), BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        ok = (cols < n_cols) & (cols < c0 + chunk)
        x, bias = _logits(X, MASK, x_off, m_off, cols, ok, sxc, smc, MASK_KIND)
        if LOG:
            y = (x * scale_log2 + (bias - shift - log2_l)) * 0.6931471805599453
        else:
            y = tl.math.exp2(x * scale_log2 + (bias - shift)) * inv_l
        tl.store(Y + y_off + cols, y.to(Y.dtype.element_ty), mask=ok)


# Backward.  With y the output (contiguous) and g = dL/dy:
#   softmax:     dx = scale * y * (g - sum(g * y))
#   log_softmax: dx = scale * (g - exp(y) * sum(g))
# Entries removed by a boolean mask get dx = 0 (they did not influence y).


@triton.jit
def _bwd_terms(Y, G, MASK, y_off, m_off, cols, ok, smc, LOG: tl.constexpr, MASK_KIND: tl.constexpr):
    y = tl.load(Y + y_off + cols, mask=ok, other=0.0).to(tl.float32)
    g = tl.load(G + y_off + cols, mask=ok, other=0.0).to(tl.float32)
    if LOG:
        p = tl.math.exp(y)  # exp(-inf) = 0 for masked entries
        term = g
    else:
        p = y
        term = g * y
    keep = ok
    if MASK_KIND == 1:
        keep = keep & (tl.load(MASK + m_off + cols * smc, mask=ok, other=0) != 0)
    return p, g, term, keep


@triton.jit
def _bwd_dx(p, g, s, keep, scale, LOG: tl.constexpr):
    if LOG:
        dx = g - p * s
    else:
        dx = p * (g - s)
    return tl.where(keep, dx * scale, 0.0)


@triton.jit
def _softmax_bwd_in_registers(
    Y, G, MASK, DX, n_rows, n_cols, L1, L2, sm0, sm1, sm2, smc, scale,
    LOG: tl.constexpr, MASK_KIND: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)[None, :]
    ok = (rows[:, None] < n_rows) & (cols < n_cols)
    y_off = rows.to(tl.int64)[:, None] * n_cols
    m_off = _row_offset(rows, L1, L2, sm0, sm1, sm2)[:, None]
    p, g, term, keep = _bwd_terms(Y, G, MASK, y_off, m_off, cols, ok, smc, LOG, MASK_KIND)
    dx = _bwd_dx(p, g, tl.sum(term, axis=1)[:, None], keep, scale, LOG)
    tl.store(DX + y_off + cols, dx.to(DX.dtype.element_ty), mask=ok)


@triton.jit
def _softmax_bwd_partials(
    Y, G, MASK, S_PART, n_cols, L1, L2, chunk, sm0, sm1, sm2, smc, splits,
    LOG: tl.constexpr, MASK_KIND: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    row = pid // splits
    c0 = (pid % splits) * chunk
    y_off = row.to(tl.int64) * n_cols
    m_off = _row_offset(row, L1, L2, sm0, sm1, sm2)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for start in range(c0, tl.minimum(c0 + chunk, n_cols), BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        ok = (cols < n_cols) & (cols < c0 + chunk)
        p, g, term, keep = _bwd_terms(Y, G, MASK, y_off, m_off, cols, ok, smc, LOG, MASK_KIND)
        acc += term
    tl.store(S_PART + pid, tl.sum(acc, axis=0))


@triton.jit
def _softmax_bwd_write(
    Y, G, MASK, DX, S_PART, n_cols, L1, L2, chunk, sm0, sm1, sm2, smc, scale, splits,
    LOG: tl.constexpr, MASK_KIND: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
):
    pid = tl.program_id(0)
    row = pid // splits
    c0 = (pid % splits) * chunk
    idx = tl.arange(0, SPLITS)
    s = tl.sum(tl.load(S_PART + row * splits + idx, mask=idx < splits, other=0.0), axis=0)
    y_off = row.to(tl.int64) * n_cols
    m_off = _row_offset(row, L1, L2, sm0, sm1, sm2)
    for start in range(c0, tl.minimum(c0 + chunk, n_cols), BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        ok = (cols < n_cols) & (cols < c0 + chunk)
        p, g, term, keep = _bwd_terms(Y, G, MASK, y_off, m_off, cols, ok, smc, LOG, MASK_KIND)
        dx = _bwd_dx(p, g, s, keep, scale, LOG)
        tl.store(DX + y_off + cols, dx.to(DX.dtype.element_ty), mask=ok)


# --------------------------------------------------------------------------------------
# Launch planning
# --------------------------------------------------------------------------------------


def collapse_rows(shape, *stride_sets):
    """Merge adjacent leading dims that every tensor can merge; None if more than 3 remain.

    ``shape`` is the shape with the softmax dim last; each stride set gives that tensor's
    strides in the same order.  Returns ``(lead_shape, [lead_strides per tensor])`` with the
    leading part padded to exactly three dims.
    """
    lead = list(shape[:-1])
    strides = [list(s[:-1]) for s in stride_sets]
    i = len(lead) - 1
    while i > 0:
        if all(st[i - 1] == st[i] * lead[i] for st in strides) or lead[i] == 1 or lead[i - 1] == 1:
            if lead[i] == 1:
                merged = [st[i - 1] for st in strides]
            elif lead[i - 1] == 1:
                merged = [st[i] for st in strides]
            else:
                merged = [st[i] for st in strides]
            lead[i - 1] = lead[i - 1] * lead[i]
            for st, mst in zip(strides, merged):
                st[i - 1] = mst
                del st[i]
            del lead[i]
        i -= 1
    if len(lead) > 3:
        return None
    while len(lead) < 3:
        lead.insert(0, 1)
        for st in strides:
            st.insert(0, 0)
    return tuple(lead), [tuple(st) for st in strides]


def plan(n_rows: int, n_cols: int, strategy: str | None = None, block: int | None = None,
         splits: int | None = None):
    """Pick the strategy and its launch shape for (n_rows, n_cols)."""
    if strategy is None:
        strategy = "registers" if n_cols <= IN_REGISTER_MAX else "online"
    if strategy == "registers":
        block_n = max(16, triton.next_power_of_2(n_cols))
        if INTERPRET:
            rows = 4 if block_n <= 64 else 1
            return dict(strategy=strategy, BLOCK_N=block_n, ROWS=rows, num_warps=1)
        rows = max(1, min(64, 4096 // block_n))
        num_warps = 4 if block_n <= 4096 else (8 if block_n <= 8192 else 16)
        return dict(strategy=strategy, BLOCK_N=block_n, ROWS=rows, num_warps=num_warps)
    if strategy != "online":
        raise ValueError(f"strategy must be 'registers', 'online' or None, got {strategy!r}")
    block_n = block or (64 if INTERPRET else 4096)
    if splits is None:
        sms = sm_count(torch.cuda.current_device()) if not INTERPRET else 1
        splits = max(1, min(MAX_SPLITS, -(-4 * sms // n_rows), triton.cdiv(n_cols, block_n)))
    chunk = triton.cdiv(triton.cdiv(n_cols, splits), block_n) * block_n
    splits = triton.cdiv(n_cols, chunk)
    return dict(strategy=strategy, BLOCK_N=block_n, splits=splits, chunk=chunk,
                SPLITS=max(2, triton.next_power_of_2(splits)), num_warps=1 if INTERPRET else 8)


def _mask_kind(mask):
    if mask is None:
        return 0
    return 1 if mask.dtype == torch.bool else 2


def softmax_forward(x, mask, lead_shape, x_strides, m_strides, n_cols, scale, log,
                    out_dtype, strategy=None, block=None, splits=None):
    """Launch the forward over rows described by (lead_shape, strides). Returns y (rows, n_cols)."""
    n_rows = lead_shape[0] * lead_shape[1] * lead_shape[2]
    y = torch.empty((n_rows, n_cols), dtype=out_dtype, device=x.device)
    if n_rows == 0 or n_cols == 0:
        return y
    kind = _mask_kind(mask)
    mask_arg = mask if mask is not None else x
    L1, L2 = lead_shape[1], lead_shape[2]
    sx, sm = x_strides, m_strides
    p = plan(n_rows, n_cols, strategy, block, splits)
    scale_log2 = scale * LOG2E
    if p["strategy"] == "registers":
        grid = (triton.cdiv(n_rows, p["ROWS"]),)
        _softmax_fwd_in_registers[grid](
            x, mask_arg, y, n_rows, n_cols, L1, L2, *sx, *sm, scale_log2,
            LOG=log, MASK_KIND=kind, ROWS=p["ROWS"], BLOCK_N=p["BLOCK_N"], num_warps=p["num_warps"])
        return y
    parts = torch.empty((2, n_rows * p["splits"]), dtype=torch.float32, device=x.device)
    grid = (n_rows * p["splits"],)
    _softmax_fwd_partials[grid](
        x, mask_arg, parts[0], parts[1], n_cols, L1, L2, p["chunk"], *sx, *sm, scale_log2, p["splits"],
        MASK_KIND=kind, BLOCK_N=p["BLOCK_N"], num_warps=p["num_warps"])
    _softmax_fwd_write[grid](
        x, mask_arg, y, parts[0], parts[1], n_cols, L1, L2, p["chunk"], *sx, *sm, scale_log2, p["splits"],
        LOG=log, MASK_KIND=kind, BLOCK_N=p["BLOCK_N"], SPLITS=p["SPLITS"], num_warps=p["num_warps"])
    return y


def softmax_backward(y, g, mask, lead_shape, m_strides, scale, log, out_dtype,
                     strategy=None, block=None, splits=None):
    """dx for contiguous (rows, n_cols) ``y`` and ``g``; dx has the same (rows, n_cols) layout."""
    n_rows, n_cols = y.shape
    dx = torch.empty((n_rows, n_cols), dtype=out_dtype, device=y.device)
    if n_rows == 0 or n_cols == 0:
        return dx
    kind = _mask_kind(mask)
    mask_arg = mask if mask is not None else y
    L1, L2 = lead_shape[1], lead_shape[2]
    p = plan(n_rows, n_cols, strategy, block, splits)
    if p["strategy"] == "registers":
        _softmax_bwd_in_registers[(triton.cdiv(n_rows, p["ROWS"]),)](
            y, g, mask_arg, dx, n_rows, n_cols, L1, L2, *m_strides, scale,
            LOG=log, MASK_KIND=kind, ROWS=p["ROWS"], BLOCK_N=p["BLOCK_N"], num_warps=p["num_warps"])
        return dx
    part = torch.empty((n_rows * p["splits"],), dtype=torch.float32, device=y.device)
    grid = (n_rows * p["splits"],)
    _softmax_bwd_partials[grid](
        y, g, mask_arg, part, n_cols, L1, L2, p["chunk"], *m_strides, p["splits"],
        LOG=log, MASK_KIND=kind, BLOCK_N=p["BLOCK_N"], num_warps=p["num_warps"])
    _softmax_bwd_write[grid](
        y, g, mask_arg, dx, part, n_cols, L1, L2, p["chunk"], *m_strides, scale, p["splits"],
        LOG=log, MASK_KIND=kind, BLOCK_N=p["BLOCK_N"], SPLITS=p["SPLITS"], num_warps=p["num_warps"])
    return dx
