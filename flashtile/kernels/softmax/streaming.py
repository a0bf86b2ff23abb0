"""Rows streamed twice through the online softmax, for rows too long to hold on chip.

* **fused** (enough rows to give every SM its own): persistent programs (1 to
  ``FUSED_PROGRAMS_PER_SM`` per SM) walk rows one after another, each doing both passes of
  the online softmax itself.  Pass 1 streams the row keeping a running ``(m, l)`` per lane
  (Milakov & Gimelshein); pass 2 walks the row *backwards* and writes ``exp(x - m) / l``.
  Walking backwards re-reads first the tiles read last, which are the ones most likely still
  in L2: the bytes read by everyone between a tile's two reads are about (rows in flight) x
  (the part of the row after that tile).  The persistent grid is what bounds the rows in
  flight: as many programs per SM as L2 can hold the rows of (``FUSED_L2_BUDGET_MB``), at
  least one, with the warps per SM kept constant.  Up to ~300 KB per row (64k bf16 / fp32 at
  one or two rows per SM) pass 2 is then served by L2 and HBM sees close to 1 read + 1
  write; longer rows get a partial hit rate, from their tails.  The grid is also capped by
  the kernel's occupancy, since a persistent program that is not resident would only start
  when another has finished all its rows.
* **split** (few, long rows: fewer rows than ``FUSED_MIN_ROWS_PER_SM`` x SMs): each row is
  cut into chunks so that every SM has work.  Kernel 1 writes each chunk's partial
  ``(m, l)``; kernel 2 merges a row's partials (the online-softmax rule) and re-reads its
  chunk to write the output.  Kernel 2 runs its programs, and each chunk's tiles, in the
  reverse order of kernel 1, so the last ~L2-size of kernel 1's reads are re-read first,
  while still cached.  Beyond that the second read comes from HBM: 2 reads + 1 write.

Every streaming loop loads ``UNROLL`` sub-tiles of ``BLOCK_N`` elements back to back before
using any of them, so each warp keeps several 16-byte loads in flight (bytes in flight per
SM, not occupancy, is what sustains HBM bandwidth), and folds them with one in-thread
``max`` / ``sum`` over the ``UNROLL`` axis: the running ``(m, l)`` is rescaled once per
iteration instead of once per element (the exp2 unit is the next bottleneck after memory).
Loads and stores carry L2 eviction hints: the first read of a tile asks L2 to keep it
(``evict_last``), its last read and the output stores mark their lines first to go
(``evict_first``), so the output stream does not push out tiles that are still to be re-read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashtile.kernels.runtime import INTERPRET
from flashtile.kernels.softmax.residency import resident_programs
from flashtile.kernels.softmax.rows import (
    bwd_dx, logits, merge_partials, normalizers, row_offset, safe_shift, softmax_out, sum_partials,
)


@triton.jit
def _tile_cols(start, BLOCK_N: tl.constexpr, UNROLL: tl.constexpr):
    """Columns of one loop iteration: ``UNROLL`` consecutive sub-tiles of ``BLOCK_N``, shaped
    [UNROLL, BLOCK_N] so that the UNROLL axis lies within each thread (the contiguous axis is
    spread over lanes and warps), making the per-iteration fold over it register-only."""
    return start + tl.arange(0, UNROLL)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]


@triton.jit
def _online_update(m, l, x, bias, scale_log2):
    """Fold a [UNROLL, BLOCK_N] tile into the per-lane running (max, sum), log2 units.

    The running sum is rescaled once per iteration (one exp2 per lane), not per element."""
    m_new = tl.maximum(m, tl.max(x * scale_log2 + bias, axis=0))
    shift = safe_shift(m_new)
    e = tl.math.exp2(x * scale_log2 + (bias - shift[None, :]))
    return m_new, l * tl.math.exp2(m - shift) + tl.sum(e, axis=0)


@triton.jit
def _lanes_to_row(m, l):
    """Merge per-lane (m, l) into the row's (shift, l)."""
    shift = safe_shift(tl.max(m, axis=0))
    return shift, tl.sum(l * tl.math.exp2(m - shift), axis=0)


@triton.jit
def _chunk_of(pid, splits, chunk, n_cols):
    """Split path: program ``pid`` handles columns [c0, c1) of ``row``."""
    row = pid // splits
    c0 = (pid % splits) * chunk
    return row, c0, tl.minimum(c0 + chunk, n_cols)


@triton.jit
def _softmax_fwd_fused(
    X, MASK, Y, n_rows, n_cols, L1, L2,
    sx0, sx1, sx2, sxc, sm0, sm1, sm2, smc,
    scale_log2,
    LOG: tl.constexpr, MASK_KIND: tl.constexpr, BLOCK_N: tl.constexpr, UNROLL: tl.constexpr,
    STAGES: tl.constexpr, FIRST_READ: tl.constexpr, LAST_READ: tl.constexpr, WRITE: tl.constexpr,
):
    """Persistent: rows pid, pid + grid, ...; per row pass 1 forwards, pass 2 backwards."""
    TILE: tl.constexpr = BLOCK_N * UNROLL
    n_tiles = tl.cdiv(n_cols, TILE)
    for row in tl.range(tl.program_id(0), n_rows, tl.num_programs(0)):
        x_off = row_offset(row, L1, L2, sx0, sx1, sx2)
        m_off = row_offset(row, L1, L2, sm0, sm1, sm2)
        m = tl.full([BLOCK_N], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_N], tl.float32)
        for t in tl.range(0, n_tiles, num_stages=STAGES):
            cols = _tile_cols(t * TILE, BLOCK_N, UNROLL)
            x, bias = logits(X, MASK, x_off, m_off, cols, cols < n_cols, sxc, smc, MASK_KIND, FIRST_READ)
            m, l = _online_update(m, l, x, bias, scale_log2)
        shift, l_row = _lanes_to_row(m, l)
        inv_l, log2_l = normalizers(l_row)
        y_off = tl.cast(row, tl.int64) * n_cols
        for t in tl.range(0, n_tiles, num_stages=STAGES):
            cols = _tile_cols((n_tiles - 1 - t) * TILE, BLOCK_N, UNROLL)
            ok = cols < n_cols
            x, bias = logits(X, MASK, x_off, m_off, cols, ok, sxc, smc, MASK_KIND, LAST_READ)
            y = softmax_out(x, bias, shift, inv_l, log2_l, scale_log2, LOG)
            tl.store(Y + y_off + cols, y.to(Y.dtype.element_ty), mask=ok, eviction_policy=WRITE)


@triton.jit
def _softmax_fwd_partials(
    X, MASK, M_PART, L_PART, n_cols, L1, L2, chunk,
    sx0, sx1, sx2, sxc, sm0, sm1, sm2, smc,
    scale_log2, splits,
    MASK_KIND: tl.constexpr, BLOCK_N: tl.constexpr, UNROLL: tl.constexpr, STAGES: tl.constexpr,
    FIRST_READ: tl.constexpr,
):
    """Split path, kernel 1: the (max, sum) in log2 units of one chunk of one row."""
    TILE: tl.constexpr = BLOCK_N * UNROLL
    row, c0, c1 = _chunk_of(tl.program_id(0), splits, chunk, n_cols)
    x_off = row_offset(row, L1, L2, sx0, sx1, sx2)
    m_off = row_offset(row, L1, L2, sm0, sm1, sm2)
    m = tl.full([BLOCK_N], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_N], tl.float32)
    for start in tl.range(c0, c1, TILE, num_stages=STAGES):
        cols = _tile_cols(start, BLOCK_N, UNROLL)
        x, bias = logits(X, MASK, x_off, m_off, cols, cols < c1, sxc, smc, MASK_KIND, FIRST_READ)
        m, l = _online_update(m, l, x, bias, scale_log2)
    _, l_row = _lanes_to_row(m, l)
    # The true max, -inf for an empty chunk (not the 0 it was shifted by): a stored 0 would
    # become the row's shift when every logit is very negative, and 2^(m_c - 0) underflow.
    tl.store(M_PART + tl.program_id(0), tl.max(m, axis=0))
    tl.store(L_PART + tl.program_id(0), l_row)


@triton.jit
def _softmax_fwd_write(
    X, MASK, Y, M_PART, L_PART, n_cols, L1, L2, chunk,
    sx0, sx1, sx2, sxc, sm0, sm1, sm2, smc,
    scale_log2, splits,
    LOG: tl.constexpr, MASK_KIND: tl.constexpr, BLOCK_N: tl.constexpr, UNROLL: tl.constexpr,
    SPLITS: tl.constexpr, STAGES: tl.constexpr, LAST_READ: tl.constexpr, WRITE: tl.constexpr,
):
    """Split path, kernel 2: re-read a chunk (last chunks first, last tiles first) and write."""
    TILE: tl.constexpr = BLOCK_N * UNROLL
    # Reverse of kernel 1's order: the chunks read last are re-read first, while still in L2.
    row, c0, c1 = _chunk_of(tl.num_programs(0) - 1 - tl.program_id(0), splits, chunk, n_cols)
    shift, l = merge_partials(M_PART, L_PART, row, splits, SPLITS)
    inv_l, log2_l = normalizers(l)
    x_off = row_offset(row, L1, L2, sx0, sx1, sx2)
    m_off = row_offset(row, L1, L2, sm0, sm1, sm2)
    y_off = tl.cast(row, tl.int64) * n_cols
    n_tiles = tl.cdiv(c1 - c0, TILE)
    for t in tl.range(0, n_tiles, num_stages=STAGES):
        cols = _tile_cols(c0 + (n_tiles - 1 - t) * TILE, BLOCK_N, UNROLL)
        ok = cols < c1
        x, bias = logits(X, MASK, x_off, m_off, cols, ok, sxc, smc, MASK_KIND, LAST_READ)
        y = softmax_out(x, bias, shift, inv_l, log2_l, scale_log2, LOG)
        tl.store(Y + y_off + cols, y.to(Y.dtype.element_ty), mask=ok, eviction_policy=WRITE)


@triton.jit
def _bwd_sum_terms(Y, G, offs, ok, LOG: tl.constexpr, POLICY: tl.constexpr):
    """The summand of the row sum for a tile: g (log-softmax) or g * y (softmax)."""
    g = tl.load(G + offs, mask=ok, other=0.0, eviction_policy=POLICY).to(tl.float32)
    if LOG:
        return g
    return g * tl.load(Y + offs, mask=ok, other=0.0, eviction_policy=POLICY).to(tl.float32)


@triton.jit
def _bwd_tile_dx(Y, G, MASK, offs, m_off, cols, ok, smc, s, scale,
                 LOG: tl.constexpr, MASK_KIND: tl.constexpr, POLICY: tl.constexpr):
    """Load a tile of y and g (their last read: ``POLICY``) and return its dx."""
    y = tl.load(Y + offs, mask=ok, other=0.0, eviction_policy=POLICY).to(tl.float32)
    g = tl.load(G + offs, mask=ok, other=0.0, eviction_policy=POLICY).to(tl.float32)
    return bwd_dx(MASK, y, g, s, m_off, cols, ok, smc, scale, LOG, MASK_KIND, POLICY)


@triton.jit
def _softmax_bwd_fused(
    Y, G, MASK, DX, n_rows, n_cols, L1, L2, sm0, sm1, sm2, smc, scale,
    LOG: tl.constexpr, MASK_KIND: tl.constexpr, BLOCK_N: tl.constexpr, UNROLL: tl.constexpr,
    STAGES: tl.constexpr, FIRST_READ: tl.constexpr, LAST_READ: tl.constexpr, WRITE: tl.constexpr,
):
    """Persistent: per row, pass 1 forwards sums, pass 2 backwards writes dx."""
    TILE: tl.constexpr = BLOCK_N * UNROLL
    n_tiles = tl.cdiv(n_cols, TILE)
    for row in tl.range(tl.program_id(0), n_rows, tl.num_programs(0)):
        row_off = tl.cast(row, tl.int64) * n_cols
        m_off = row_offset(row, L1, L2, sm0, sm1, sm2)
        acc = tl.zeros([BLOCK_N], tl.float32)
        for t in tl.range(0, n_tiles, num_stages=STAGES):
            cols = _tile_cols(t * TILE, BLOCK_N, UNROLL)
            acc += tl.sum(_bwd_sum_terms(Y, G, row_off + cols, cols < n_cols, LOG, FIRST_READ), axis=0)
        s = tl.sum(acc, axis=0)
        for t in tl.range(0, n_tiles, num_stages=STAGES):
            cols = _tile_cols((n_tiles - 1 - t) * TILE, BLOCK_N, UNROLL)
            ok = cols < n_cols
            dx = _bwd_tile_dx(Y, G, MASK, row_off + cols, m_off, cols, ok, smc, s, scale, LOG, MASK_KIND, LAST_READ)
            tl.store(DX + row_off + cols, dx.to(DX.dtype.element_ty), mask=ok, eviction_policy=WRITE)


@triton.jit
def _softmax_bwd_partials(
    Y, G, S_PART, n_cols, chunk, splits,
    LOG: tl.constexpr, BLOCK_N: tl.constexpr, UNROLL: tl.constexpr, STAGES: tl.constexpr,
    FIRST_READ: tl.constexpr,
):
    TILE: tl.constexpr = BLOCK_N * UNROLL
    row, c0, c1 = _chunk_of(tl.program_id(0), splits, chunk, n_cols)
    row_off = tl.cast(row, tl.int64) * n_cols
    acc = tl.zeros([BLOCK_N], tl.float32)
    for start in tl.range(c0, c1, TILE, num_stages=STAGES):
        cols = _tile_cols(start, BLOCK_N, UNROLL)
        acc += tl.sum(_bwd_sum_terms(Y, G, row_off + cols, cols < c1, LOG, FIRST_READ), axis=0)
    tl.store(S_PART + tl.program_id(0), tl.sum(acc, axis=0))


@triton.jit
def _softmax_bwd_write(
    Y, G, MASK, DX, S_PART, n_cols, L1, L2, chunk, sm0, sm1, sm2, smc, scale, splits,
    LOG: tl.constexpr, MASK_KIND: tl.constexpr, BLOCK_N: tl.constexpr, UNROLL: tl.constexpr,
    SPLITS: tl.constexpr, STAGES: tl.constexpr, LAST_READ: tl.constexpr, WRITE: tl.constexpr,
):
    TILE: tl.constexpr = BLOCK_N * UNROLL
    # Reverse of kernel 1's order: the chunks read last are re-read first, while still in L2.
    row, c0, c1 = _chunk_of(tl.num_programs(0) - 1 - tl.program_id(0), splits, chunk, n_cols)
    s = sum_partials(S_PART, row, splits, SPLITS)
    row_off = tl.cast(row, tl.int64) * n_cols
    m_off = row_offset(row, L1, L2, sm0, sm1, sm2)
    n_tiles = tl.cdiv(c1 - c0, TILE)
    for t in tl.range(0, n_tiles, num_stages=STAGES):
        cols = _tile_cols(c0 + (n_tiles - 1 - t) * TILE, BLOCK_N, UNROLL)
        ok = cols < c1
        dx = _bwd_tile_dx(Y, G, MASK, row_off + cols, m_off, cols, ok, smc, s, scale, LOG, MASK_KIND, LAST_READ)
        tl.store(DX + row_off + cols, dx.to(DX.dtype.element_ty), mask=ok, eviction_policy=WRITE)


def _policies(p):
    """Eviction hints: keep on the first read, drop on the last read and on the output."""
    if p["evict"]:
        return dict(FIRST_READ="evict_last", LAST_READ="evict_first", WRITE="evict_first")
    return dict(FIRST_READ="", LAST_READ="", WRITE="")


def _persistent_grid(kernel, args, kwargs, p, device):
    """The fused path's grid: the planned programs, capped by how many can be resident, since
    a persistent program that has to wait for a free slot only starts when another is done."""
    if INTERPRET:
        return p["programs"]
    return max(1, min(p["programs"], resident_programs(kernel, args, kwargs, device)))


def forward(x, mask, y, n_rows, n_cols, L1, L2, x_strides, m_strides, scale_log2, log, mask_kind, p):
    """y (a fresh contiguous (rows, n_cols) buffer) = softmax of the rows of ``x``, by the
    fused or the split path as ``p`` says."""
    pol = _policies(p)
    tiles = dict(BLOCK_N=p["BLOCK_N"], UNROLL=p["UNROLL"], STAGES=p["STAGES"], num_warps=p["num_warps"])
    if p["strategy"] == "fused":
        args = (x, mask, y, n_rows, n_cols, L1, L2, *x_strides, *m_strides, scale_log2)
        kw = dict(LOG=log, MASK_KIND=mask_kind, **tiles, **pol)
        grid = _persistent_grid(_softmax_fwd_fused, args, kw, p, x.device)
        _softmax_fwd_fused[(grid,)](*args, **kw)
        return
    parts = torch.empty((2, n_rows * p["splits"]), dtype=torch.float32, device=x.device)
    grid = (n_rows * p["splits"],)
    _softmax_fwd_partials[grid](
        x, mask, parts[0], parts[1], n_cols, L1, L2, p["chunk"], *x_strides, *m_strides, scale_log2, p["splits"],
        MASK_KIND=mask_kind, FIRST_READ=pol["FIRST_READ"], **tiles)
    _softmax_fwd_write[grid](
        x, mask, y, parts[0], parts[1], n_cols, L1, L2, p["chunk"], *x_strides, *m_strides, scale_log2, p["splits"],
        LOG=log, MASK_KIND=mask_kind, SPLITS=p["SPLITS"], LAST_READ=pol["LAST_READ"], WRITE=pol["WRITE"], **tiles)


def backward(y, g, mask, dx, n_rows, n_cols, L1, L2, m_strides, scale, log, mask_kind, p):
    """dx of contiguous (rows, n_cols) ``y`` and ``g``, by the fused or the split path as ``p`` says."""
    pol = _policies(p)
    tiles = dict(BLOCK_N=p["BLOCK_N"], UNROLL=p["UNROLL"], STAGES=p["STAGES"], num_warps=p["num_warps"])
    if p["strategy"] == "fused":
        args = (y, g, mask, dx, n_rows, n_cols, L1, L2, *m_strides, scale)
        kw = dict(LOG=log, MASK_KIND=mask_kind, **tiles, **pol)
        grid = _persistent_grid(_softmax_bwd_fused, args, kw, p, y.device)
        _softmax_bwd_fused[(grid,)](*args, **kw)
        return
    part = torch.empty((n_rows * p["splits"],), dtype=torch.float32, device=y.device)
    grid = (n_rows * p["splits"],)
    _softmax_bwd_partials[grid](y, g, part, n_cols, p["chunk"], p["splits"], LOG=log,
                                FIRST_READ=pol["FIRST_READ"], **tiles)
    _softmax_bwd_write[grid](
        y, g, mask, dx, part, n_cols, L1, L2, p["chunk"], *m_strides, scale, p["splits"],
        LOG=log, MASK_KIND=mask_kind, SPLITS=p["SPLITS"], LAST_READ=pol["LAST_READ"], WRITE=pol["WRITE"], **tiles)
