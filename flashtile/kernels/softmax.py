"""Row softmax / log-softmax kernels, forward and backward, chosen by row length and row count.

Softmax is memory-bound: the floor is one read and one write per element (the backward:
two reads and one write).  How close a kernel gets depends on whether a row fits on chip,
and, when it does not, on whether its second read can be served by the L2 cache:

* **registers** (rows up to ``IN_REGISTER_MAX`` elements): a program loads whole rows
  once, reduces the max and the sum in registers (Triton lowers ``tl.max``/``tl.sum`` to a
  warp-shuffle reduction, then across warps through shared memory -- the two-level
  reduction), and writes the result: 1 read + 1 write.  Short rows pack several rows into
  one program (``ROWS > 1``) so each program still moves enough bytes; long-but-fitting
  rows get one program and more warps.
* **cooperative** (longer rows, up to ``COOPERATIVE_MAX`` / ``COOP_BWD_MAX`` elements, at
  most 4M forward / 2M backward on an H200; by default the backward up to 256k): a row
  too long for one SM is cut into chunks (``COOP_BLOCK``), one per program, and
  every chunk stays in registers from its read to its write, so HBM sees 1 read + 1 write
  however long the row.  Each program publishes its chunk's ``(m, l)`` and waits until the
  row's other chunk programs have published theirs (a per-row arrival counter), then
  merges them with the online-softmax rule and writes.  Waiting on another program is only
  safe when that program is running, so the grid is launched *cooperatively* (the driver
  refuses a grid whose programs cannot all be resident at once) and holds as many rows'
  chunk programs as fit, each group of chunk programs taking its rows in the same order.
  Only the programs of one row wait for each other, so groups drift apart and one group's
  wait overlaps another's streaming.  Rows whose chunks cannot all be resident at once
  fall back to the two paths below.
* **fused** (longer rows, and enough of them to give every SM its own rows): persistent
  programs (1 to ``FUSED_PROGRAMS_PER_SM`` per SM) walk rows one after another, each doing
  both passes of the online softmax itself.  Pass 1 streams the row keeping a running
  ``(m, l)`` per lane (Milakov & Gimelshein); pass 2 walks the row *backwards* and writes
  ``exp(x - m) / l``.  Walking backwards re-reads first the tiles read last, which are the
  ones most likely still in L2: the bytes read by everyone between a tile's two reads are
  about (rows in flight) x (the part of the row after that tile).  The persistent grid is
  what bounds the rows in flight: as many programs per SM as L2 can hold the rows of
  (``FUSED_L2_BUDGET_MB``), at least one, with the warps per SM kept constant.  Up to
  ~300 KB per row (64k bf16 / fp32 at one or two rows per SM) pass 2 is then served by L2
  and HBM sees close to 1 read + 1 write; longer rows get a partial hit rate, from their
  tails.  The grid is also capped by the kernel's occupancy, since a persistent program
  that is not resident would only start when another has finished all its rows.
* **split** (few, long rows: fewer rows than ``FUSED_MIN_ROWS_PER_SM`` x SMs): each row is
  cut into chunks so that every SM has work.  Kernel 1 writes each chunk's partial
  ``(m, l)``; kernel 2 merges a row's partials (the online-softmax rule) and re-reads its
  chunk to write the output.  Kernel 2 runs its programs, and each chunk's tiles, in the
  reverse order of kernel 1, so the last ~L2-size of kernel 1's reads are re-read first,
  while still cached.  Beyond that the second read comes from HBM: 2 reads + 1 write.

Outside the cooperative path programs of one launch never wait on each other.  The
interpreter runs programs one after another, so there the cooperative kernel runs as two
launches of the same code: publish every chunk's ``(m, l)``, then re-read and write.

Every streaming loop loads ``UNROLL`` sub-tiles of ``BLOCK_N`` elements back to back before
using any of them, so each warp keeps several 16-byte loads in flight (bytes in flight per
SM, not occupancy, is what sustains HBM bandwidth), and folds them with one in-thread
``max`` / ``sum`` over the ``UNROLL`` axis: the running ``(m, l)`` is rescaled once per
iteration instead of once per element (the exp2 unit is the next bottleneck after memory).
Loads and stores carry L2 eviction hints: the first read of a tile asks L2 to keep it
(``evict_last``), its last read and the output stores mark their lines first to go
(``evict_first``), so the output stream does not push out tiles that are still to be re-read.

Rows are addressed through up to three leading indices with arbitrary strides plus a column
stride, so transposed / sliced / broadcast (stride-0) inputs and masks are read in place.
The scale and the mask are applied on the fly: the masked scores never exist in memory.
Everything is computed in float32 and in log2 units (one FMA and an ``exp2`` per element).
A row with no finite entry (all ``-inf`` / all masked) gives zeros (log-softmax: ``-inf``),
never NaN; NaN and ``+inf`` inputs propagate as in ``torch.softmax``.

Tuning: every knob below is a module-level constant that ``plan()`` reads at call time, and
the environment variable ``FLASHTILE_SOFTMAX_TUNING="name=value,..."`` (names as in
``KNOBS``, e.g. ``unroll=2,programs_per_sm=1``) overrides them without editing code;
``benchmarks/tune_softmax.py`` sweeps them on a GPU.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

from flashtile.kernels.runtime import INTERPRET, cdiv, next_power_of_2, parse_tuning, sm_count

LOG2E = 1.4426950408889634

# --- Strategy thresholds and launch knobs (defaults for an H200: 132 SMs, 50 MB L2) ------
# Rows up to this length are held whole in registers.  At 16k elements and 16 warps that is
# 32 values per thread (61-91 registers, forward / backward, no spills); at 32k the
# backward spills (at 16 or 32 warps) and only one program fits per SM, which leaves its
# load-reduce-store phases unoverlapped, so longer rows stream (fused path) instead.
IN_REGISTER_MAX = 16384
# num_warps of the in-register kernel for rows of 8k+ elements; 0 = by row length.
REGISTER_WARPS = 0
# Streaming kernels (fused and split): each iteration loads UNROLL sub-tiles back to back;
# a sub-tile is one 16-byte vector per thread unless STREAM_BLOCK (elements) says otherwise.
# Bytes in flight per SM, not occupancy, is what sustains HBM bandwidth: 4.2 TB/s x ~0.8 us
# of loaded latency / 132 SMs ~ 25 KB; 16 warps x 32 threads x 4 x 16 B = 32 KB.
STREAM_BLOCK = 0
STREAM_UNROLL = 4
# Fused path: warps per SM, shared by the resident programs (num_warps = this / programs
# per SM, so the bytes in flight per SM stay the same however many rows are in flight).
FUSED_WARPS_PER_SM = 16
# At most this many persistent programs per SM (also capped by occupancy at launch).  More
# than one lets a program's end-of-row reduction -- a barrier that drains its loads --
# overlap the others' streaming ...
FUSED_PROGRAMS_PER_SM = 4
# ... but every program holds a row in flight, and pass 2 hits L2 only while (rows in flight)
# x (bytes re-read per row) fits in L2 (50 MB on an H200, shared with the output stream,
# whose stores are marked evict_first): fewer programs per SM for longer rows, down to
# FUSED_MIN_PROGRAMS_PER_SM.  Below 1 (e.g. 0.5: one 32-warp program per two SMs) trades
# SMs for L2 hits on the longest rows -- only worth it if half the SMs can still pull the
# full bandwidth (loop stages help: their bytes in flight sit in shared memory).
FUSED_L2_BUDGET_MB = 40
FUSED_MIN_PROGRAMS_PER_SM = 1.0
# Fused when n_rows >= this x SMs (every SM gets a whole row); fewer rows take the split
# path so that all SMs still stream.
FUSED_MIN_ROWS_PER_SM = 1.0
# Split path: num_warps per chunk program, and chunk programs per SM to aim for (several
# waves: a small tail).
SPLIT_WARPS = 8
SPLIT_PROGRAMS_PER_SM = 8
MAX_SPLITS = 256
# Cooperative path: rows longer than IN_REGISTER_MAX and up to COOPERATIVE_MAX (forward) /
# COOP_BWD_MAX (backward) elements are cut into chunks, one chunk per program of COOP_WARPS
# warps, held in registers from its read to its write.  Forward chunks are COOP_BLOCK
# elements, 0 = 32 KB of input (16k bf16 / 8k fp32 elements: 32 words per thread at 8
# warps, bf16 / fp16 held as pairs in int32 words); backward chunks COOP_BWD_BLOCK elements
# (y and dy both held: 8192 measured above 4096 for bf16 64k, 0.86 of the copy rate against
# 0.81, and equal elsewhere).  0 turns a path off.
# Why the backward goes cooperative up to 256k (H200, M x N = 2^28, fraction of the copy
# rate): bf16 64k / 256k / 1M 0.78 / 0.69 / 0.49 against the fused path's 0.74 / 0.56 /
# 0.55; fp32 0.87 / 0.78 / 0.65 against 0.67 / 0.60 / 0.59.  The forward needs its input
# held packed (COOP_PACK) to gain: holding fp32 values (63-106 registers, 2-4 programs per
# SM) it measured bf16 0.67 / 0.64 / 0.48 against 0.76 / 0.63 / 0.60, because a chunk's
# wait for its row's slowest chunk is hidden only by the other rows' resident chunks, so
# the bytes held per SM are what counts.  All alternatives: docs/tuning.md, "Row softmax".
COOPERATIVE_MAX = 4194304
COOP_BWD_MAX = 262144
# The forward takes the cooperative path only for rows of at least this many bytes: below,
# the fused path's second read still hits L2 (bf16 64k, 128 KB rows: fused 0.72-0.76 of the
# copy rate, cooperative 0.69-0.70; fp32 64k, 256 KB: fused 0.78-0.82, cooperative 0.84).
COOP_FWD_MIN_BYTES = 262144
COOP_BLOCK = 0
COOP_BWD_BLOCK = 8192
COOP_WARPS = 8
# 1: hold unmasked contiguous 16-bit rows as pairs in int32 words; 0: one element a word.
COOP_PACK = 1
# Register cap (ptxas .maxnreg) for the cooperative kernels: 0 = none, except when a row's
# chunks would not all be resident without it -- then 64 (4 programs of 8 warps per SM: a
# 4M-element row fits on an H200's 132 SMs; masked variants spill ~100 B at this cap).
# The forward's own cap, COOP_FWD_MAXNREG, overrides it for the forward: ptxas front-loads
# the exp2 arguments (~125 registers for 32 packed words a thread), and 4 programs per SM
# at 64 registers measured fastest despite ~100 B of spills (bf16 256k: 0.68 of the copy
# rate against 0.60 uncapped; fp32, which does not spill at 64, 0.78 against 0.72).
COOP_MAXNREG = 0
COOP_FWD_MAXNREG = 64
# L2 eviction hints on the streaming kernels (1) or none (0).
EVICTION_HINTS = 1
# num_stages of the streaming loops (tl.range); 0 = the compiler's default (no pipelining
# of these loads).  2-3 turns them into cp.async copies through shared memory: more bytes
# in flight per thread, without the eviction hints.
LOOP_STAGES = 0

TUNING_ENV = "FLASHTILE_SOFTMAX_TUNING"
KNOBS = {
    "in_register_max": "IN_REGISTER_MAX",
    "register_warps": "REGISTER_WARPS",
    "block": "STREAM_BLOCK",
    "unroll": "STREAM_UNROLL",
    "warps_per_sm": "FUSED_WARPS_PER_SM",
    "programs_per_sm": "FUSED_PROGRAMS_PER_SM",
    "l2_budget_mb": "FUSED_L2_BUDGET_MB",
    "min_programs_per_sm": "FUSED_MIN_PROGRAMS_PER_SM",
    "fused_min_rows_per_sm": "FUSED_MIN_ROWS_PER_SM",
    "split_warps": "SPLIT_WARPS",
    "split_programs_per_sm": "SPLIT_PROGRAMS_PER_SM",
    "cooperative_max": "COOPERATIVE_MAX",
    "coop_bwd_max": "COOP_BWD_MAX",
    "coop_fwd_min_bytes": "COOP_FWD_MIN_BYTES",
    "coop_pack": "COOP_PACK",
    "coop_block": "COOP_BLOCK",
    "coop_bwd_block": "COOP_BWD_BLOCK",
    "coop_warps": "COOP_WARPS",
    "coop_maxnreg": "COOP_MAXNREG",
    "coop_fwd_maxnreg": "COOP_FWD_MAXNREG",
    "evict": "EVICTION_HINTS",
    "stages": "LOOP_STAGES",
}
_FLOAT_KNOBS = ("fused_min_rows_per_sm", "l2_budget_mb", "min_programs_per_sm", "programs_per_sm")


def knobs() -> dict:
    """The knobs in force: the module constants, overridden by ``FLASHTILE_SOFTMAX_TUNING``."""
    current = {name: globals()[const] for name, const in KNOBS.items()}
    current.update(parse_tuning(TUNING_ENV, os.environ.get(TUNING_ENV, ""), tuple(KNOBS), tuple(_FLOAT_KNOBS)))
    return current


# --------------------------------------------------------------------------------------
# Shared pieces
# --------------------------------------------------------------------------------------


@triton.jit
def _row_offset(row, L1, L2, s0, s1, s2):
    """Offset of row ``row`` for a tensor whose leading dims (L0, L1, L2) have strides s0, s1, s2."""
    i2 = row % L2
    t = row // L2
    return (t // L1).to(tl.int64) * s0 + (t % L1).to(tl.int64) * s1 + i2.to(tl.int64) * s2


@triton.jit
def _logits(X, MASK, x_off, m_off, cols, ok, sxc, smc, MASK_KIND: tl.constexpr, POLICY: tl.constexpr):
    """A block of logits as ``x`` (fp32) and a ``bias`` in log2 units.

    The logit is ``x * scale * log2(e) + bias``; keeping the two apart lets each use fold the
    scale, the bias and the max subtraction into one FMA, ``x * s + (bias - max)``, rounded
    once -- rounding ``x * s`` first would cost absolute accuracy when scores are large.
    Padding and masked-out entries get ``bias = -inf`` and ``x = 0`` (so a NaN hidden by the
    mask stays hidden, and a negative scale cannot turn the padding into +inf).
    """
    x = tl.load(X + x_off + cols * sxc, mask=ok, other=0.0, eviction_policy=POLICY).to(tl.float32)
    return _apply_mask(x, tl.where(ok, 0.0, float("-inf")), MASK, m_off, cols, ok, smc, MASK_KIND, POLICY)


@triton.jit
def _apply_mask(x, bias, MASK, m_off, cols, ok, smc, MASK_KIND: tl.constexpr, POLICY: tl.constexpr):
    """Fold the mask of ``cols`` into ``(x, bias)``: the one mask rule of every forward kernel."""
    if MASK_KIND == 1:  # boolean, True = keep
        keep = tl.load(MASK + m_off + cols * smc, mask=ok, other=0, eviction_policy=POLICY) != 0
        bias = tl.where(keep, bias, float("-inf"))
        x = tl.where(keep, x, 0.0)
    elif MASK_KIND == 2:  # additive, in natural-log units like x * scale
        add = tl.load(MASK + m_off + cols * smc, mask=ok, other=0.0, eviction_policy=POLICY)
        bias = bias + add.to(tl.float32) * 1.4426950408889634
    return x, bias


@triton.jit
def _safe_shift(m):
    # (-inf) - (-inf) is NaN: a row with no finite entry is shifted by 0, so it stays 0.
    return tl.where(m == float("-inf"), 0.0, m)


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
    shift = _safe_shift(m_new)
    e = tl.math.exp2(x * scale_log2 + (bias - shift[None, :]))
    return m_new, l * tl.math.exp2(m - shift) + tl.sum(e, axis=0)


@triton.jit
def _lanes_to_row(m, l):
    """Merge per-lane (m, l) into the row's (shift, l)."""
    shift = _safe_shift(tl.max(m, axis=0))
    return shift, tl.sum(l * tl.math.exp2(m - shift), axis=0)


@triton.jit
def _softmax_out(x, bias, shift, inv_l, log2_l, scale_log2, LOG: tl.constexpr):
    if LOG:
        return (x * scale_log2 + (bias - shift - log2_l)) * 0.6931471805599453
    return tl.math.exp2(x * scale_log2 + (bias - shift)) * inv_l


@triton.jit
def _normalizers(l):
    # An empty row (l = 0) keeps y = 0 (softmax) / -inf (log-softmax) instead of NaN.
    return 1.0 / tl.where(l == 0.0, 1.0, l), tl.where(l == 0.0, 0.0, tl.math.log2(l))


@triton.jit
def _arrive_and_wait(ARRIVED, row, splits):
    """Cooperative path: count this program's partial of ``row`` as published, then wait until
    the row's other ``splits - 1`` chunk programs have published theirs.

    Safe only because the grid is launched cooperatively (every program resident at once:
    nobody waits for a program that cannot start) and every program walks its rows in the
    same order as the other programs of its row.  (Polling the partials themselves, as
    nonzero 64-bit words, instead of one counter measured slower: 0.51 of the copy rate
    against 0.67 for bf16 N = 64k.)"""
    tl.debug_barrier()  # all threads' partial stores happen before the release below
    tl.atomic_add(ARRIVED + row, 1, sem="release", scope="gpu")
    arrived = tl.atomic_add(ARRIVED + row, 0, sem="acquire", scope="gpu")
    while arrived < splits:
        arrived = tl.atomic_add(ARRIVED + row, 0, sem="acquire", scope="gpu")


# --------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------


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
    x, bias = _logits(X, MASK, x_off, m_off, cols[None, :], ok, sxc, smc, MASK_KIND, "")
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
        x_off = _row_offset(row, L1, L2, sx0, sx1, sx2)
        m_off = _row_offset(row, L1, L2, sm0, sm1, sm2)
        m = tl.full([BLOCK_N], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_N], tl.float32)
        for t in tl.range(0, n_tiles, num_stages=STAGES):
            cols = _tile_cols(t * TILE, BLOCK_N, UNROLL)
            x, bias = _logits(X, MASK, x_off, m_off, cols, cols < n_cols, sxc, smc, MASK_KIND, FIRST_READ)
            m, l = _online_update(m, l, x, bias, scale_log2)
        shift, l_row = _lanes_to_row(m, l)
        inv_l, log2_l = _normalizers(l_row)
        y_off = tl.cast(row, tl.int64) * n_cols
        for t in tl.range(0, n_tiles, num_stages=STAGES):
            cols = _tile_cols((n_tiles - 1 - t) * TILE, BLOCK_N, UNROLL)
            ok = cols < n_cols
            x, bias = _logits(X, MASK, x_off, m_off, cols, ok, sxc, smc, MASK_KIND, LAST_READ)
            y = _softmax_out(x, bias, shift, inv_l, log2_l, scale_log2, LOG)
            tl.store(Y + y_off + cols, y.to(Y.dtype.element_ty), mask=ok, eviction_policy=WRITE)


@triton.jit
def _chunk_of(pid, splits, chunk, n_cols):
    """Split path: program ``pid`` handles columns [c0, c1) of ``row``."""
    row = pid // splits
    c0 = (pid % splits) * chunk
    return row, c0, tl.minimum(c0 + chunk, n_cols)


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
    x_off = _row_offset(row, L1, L2, sx0, sx1, sx2)
    m_off = _row_offset(row, L1, L2, sm0, sm1, sm2)
    m = tl.full([BLOCK_N], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_N], tl.float32)
    for start in tl.range(c0, c1, TILE, num_stages=STAGES):
        cols = _tile_cols(start, BLOCK_N, UNROLL)
        x, bias = _logits(X, MASK, x_off, m_off, cols, cols < c1, sxc, smc, MASK_KIND, FIRST_READ)
        m, l = _online_update(m, l, x, bias, scale_log2)
    _, l_row = _lanes_to_row(m, l)
    # The true max, -inf for an empty chunk (not the 0 it was shifted by): a stored 0 would
    # become the row's shift when every logit is very negative, and 2^(m_c - 0) underflow.
    tl.store(M_PART + tl.program_id(0), tl.max(m, axis=0))
    tl.store(L_PART + tl.program_id(0), l_row)


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
def _sum_partials(S_PART, row, splits, SPLITS: tl.constexpr):
    """The backward's row sum: the sum of the row's chunk sums."""
    idx = tl.arange(0, SPLITS)
    return tl.sum(tl.load(S_PART + row * splits + idx, mask=idx < splits, other=0.0), axis=0)


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
    shift, l = _merge_partials(M_PART, L_PART, row, splits, SPLITS)
    inv_l, log2_l = _normalizers(l)
    x_off = _row_offset(row, L1, L2, sx0, sx1, sx2)
    m_off = _row_offset(row, L1, L2, sm0, sm1, sm2)
    y_off = tl.cast(row, tl.int64) * n_cols
    n_tiles = tl.cdiv(c1 - c0, TILE)
    for t in tl.range(0, n_tiles, num_stages=STAGES):
        cols = _tile_cols(c0 + (n_tiles - 1 - t) * TILE, BLOCK_N, UNROLL)
        ok = cols < c1
        x, bias = _logits(X, MASK, x_off, m_off, cols, ok, sxc, smc, MASK_KIND, LAST_READ)
        y = _softmax_out(x, bias, shift, inv_l, log2_l, scale_log2, LOG)
        tl.store(Y + y_off + cols, y.to(Y.dtype.element_ty), mask=ok, eviction_policy=WRITE)


# The cooperative forward holds its chunk as loaded -- unmasked bf16 / fp16 rows as their
# own 16-bit pairs in int32 words (PAIRS = 2), anything else one element a word -- and
# recomputes the logits from it for the write: an fp32 copy of the chunk would take twice
# the registers of a 16-bit one, and registers are what bounds the rows in flight per SM.
KIND_PLAIN = tl.constexpr(0)  # one element per word, any float dtype
KIND_BF16X2 = tl.constexpr(1)
KIND_F16X2 = tl.constexpr(2)


@triton.jit
def _unpack(w, h: tl.constexpr, KIND: tl.constexpr):
    """Element ``h`` (0 = low half, 1 = high half) of each word, as fp32."""
    if KIND == KIND_BF16X2:  # a bf16 is the top half of the fp32 with the same value
        bits = (w << 16) if h == 0 else (w & -65536)
        return bits.to(tl.float32, bitcast=True)
    elif KIND == KIND_F16X2:
        half = w if h == 0 else (w >> 16)
        return half.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        return w.to(tl.float32)


@triton.jit
def _pack(y_lo, y_hi, KIND: tl.constexpr):
    """Two fp32 halves -> one word of two 16-bit floats (the inverse of ``_unpack``)."""
    if KIND == KIND_BF16X2:
        lo = y_lo.to(tl.bfloat16).to(tl.int16, bitcast=True)
        hi = y_hi.to(tl.bfloat16).to(tl.int16, bitcast=True)
    else:
        lo = y_lo.to(tl.float16).to(tl.int16, bitcast=True)
        hi = y_hi.to(tl.float16).to(tl.int16, bitcast=True)
    return (lo.to(tl.int32) & 65535) | (hi.to(tl.int32) << 16)


@triton.jit
def _max_pairs(a, b, KIND: tl.constexpr, MIN: tl.constexpr):
    """Elementwise max (``MIN``: min) of both halves of two words at once, NaN-ignoring like
    ``tl.max``: reduces a packed chunk without unpacking it to fp32 registers."""
    op: tl.constexpr = ("min" if MIN else "max") + (".bf16x2" if KIND == KIND_BF16X2 else ".f16x2")
    return tl.inline_asm_elementwise(op + " $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _max_bf16x2(a, b):
    return _max_pairs(a, b, KIND_BF16X2, False)


@triton.jit
def _min_bf16x2(a, b):
    return _max_pairs(a, b, KIND_BF16X2, True)


@triton.jit
def _max_f16x2(a, b):
    return _max_pairs(a, b, KIND_F16X2, False)


@triton.jit
def _min_f16x2(a, b):
    return _max_pairs(a, b, KIND_F16X2, True)


@triton.jit
def _opaque(w):
    """``w``, through an instruction the compiler cannot see through: the write recomputes
    the logits from the held words instead of keeping the first pass's fp32 copies."""
    return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [w], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _chunk_logits(w, h: tl.constexpr, MASK, m_off, idx, ok, smc,
                  KIND: tl.constexpr, PAIRS: tl.constexpr, MASK_KIND: tl.constexpr, POLICY: tl.constexpr,
                  NAN_PADDED: tl.constexpr):
    """Half ``h`` of a held chunk as ``(x, bias)`` (see ``_logits``): column ``idx * PAIRS + h``.
    ``NAN_PADDED``: the padding was loaded as NaN and the caller drops it (bias 0 here)."""
    x = _unpack(w, h, KIND)
    if NAN_PADDED:
        bias = 0.0  # pairs are never masked
    else:
        x, bias = _apply_mask(x, tl.where(ok, 0.0, float("-inf")), MASK, m_off, idx, ok, smc, MASK_KIND, POLICY)
    return x, bias


@triton.jit
def _chunk_max(w, MASK, m_off, idx, ok, smc, scale_log2,
               KIND: tl.constexpr, PAIRS: tl.constexpr, MASK_KIND: tl.constexpr, PACKED_MAX: tl.constexpr):
    """The chunk's largest logit, log2 units (-inf for an empty chunk)."""
    if PACKED_MAX:
        # max(x * s) = s * (max x if s >= 0 else min x), reduced on the packed words; the
        # padding words are NaN, which max / min ignore (every chunk has a real column).
        if scale_log2 >= 0:
            best = tl.reduce(w, 0, _max_bf16x2 if KIND == KIND_BF16X2 else _max_f16x2)
            x = tl.maximum(_unpack(best, 0, KIND), _unpack(best, 1, KIND))
        else:
            best = tl.reduce(w, 0, _min_bf16x2 if KIND == KIND_BF16X2 else _min_f16x2)
            x = tl.minimum(_unpack(best, 0, KIND), _unpack(best, 1, KIND))
        return x * scale_log2
    m = tl.full([], float("-inf"), tl.float32)
    for h in tl.static_range(PAIRS):
        x, bias = _chunk_logits(w, h, MASK, m_off, idx, ok, smc, KIND, PAIRS, MASK_KIND, "", False)
        m = tl.maximum(m, tl.max(x * scale_log2 + bias, axis=0))
    return m


@triton.jit
def _softmax_fwd_cooperative(
    X, MASK, Y, M_PART, L_PART, ARRIVED, n_rows, n_words, L1, L2,
    sx0, sx1, sx2, sxc, sm0, sm1, sm2, smc,
    scale_log2, splits,
    LOG: tl.constexpr, MASK_KIND: tl.constexpr, KIND: tl.constexpr, WORDS: tl.constexpr,
    SPLITS: tl.constexpr, PHASE: tl.constexpr, ASM: tl.constexpr,
):
    """Cooperative path: program (slot, c) keeps chunk c of rows slot, slot + slots, ... in
    registers between its one read and its one write, and learns the row's (max, sum) from
    the row's other chunk programs through ``M_PART`` / ``L_PART`` and a zeroed arrival
    counter per row, ``ARRIVED``.

    The chunk is ``WORDS`` words: with ``KIND`` a packed kind, ``X`` and ``Y`` are read as
    int32 words of contiguous 16-bit rows, two elements each (``n_words`` = half the
    columns, ``sx*`` in words); otherwise a word is one element, ``sxc`` apart.

    PHASE 0 is the GPU kernel (publish, wait, write).  The interpreter runs programs one after
    another, so a program could never see a later one's partial: it runs PHASE 1 (publish)
    and then PHASE 2 (re-read and write) as two launches of this same code."""
    PAIRS: tl.constexpr = 1 if KIND == KIND_PLAIN else 2
    tl.static_assert(PAIRS == 1 or MASK_KIND == 0, "masked rows are held one element a word")
    # 16-bit pairs: the max is taken on the packed words, the padding loaded as NaN.
    PACKED_MAX: tl.constexpr = ASM and PAIRS == 2
    PAD: tl.constexpr = (0x7FC07FC0 if KIND == KIND_BF16X2 else 0x7E007E00) if PACKED_MAX else 0
    if PAIRS == 2:
        XW = X.to(tl.pointer_type(tl.int32), bitcast=True)
        YW = Y.to(tl.pointer_type(tl.int32), bitcast=True)
    else:
        XW = X
        YW = Y
    pid = tl.program_id(0)
    c = pid % splits
    idx = c * WORDS + tl.arange(0, WORDS)
    ok = idx < n_words
    for row in tl.range(pid // splits, n_rows, tl.num_programs(0) // splits):
        x_off = _row_offset(row, L1, L2, sx0, sx1, sx2)
        m_off = _row_offset(row, L1, L2, sm0, sm1, sm2)
        w = tl.load(XW + x_off + idx * sxc, mask=ok, other=PAD, eviction_policy="evict_first")
        if PHASE != 2:
            m_c = _chunk_max(w, MASK, m_off, idx, ok, smc, scale_log2, KIND, PAIRS, MASK_KIND, PACKED_MAX)
            shift_c = _safe_shift(m_c)
            x, bias = _chunk_logits(w, 0, MASK, m_off, idx, ok, smc, KIND, PAIRS, MASK_KIND, "", PACKED_MAX)
            e = tl.math.exp2(x * scale_log2 + (bias - shift_c))
            if PAIRS == 2:
                x, bias = _chunk_logits(w, 1, MASK, m_off, idx, ok, smc, KIND, PAIRS, MASK_KIND, "", PACKED_MAX)
                e += tl.math.exp2(x * scale_log2 + (bias - shift_c))
            if PACKED_MAX:
                e = tl.where(ok, e, 0.0)
            # The true max, -inf for an empty chunk (see _softmax_fwd_partials).
            tl.store(M_PART + row * splits + c, m_c)
            tl.store(L_PART + row * splits + c, tl.sum(e, axis=0))
            if PHASE == 0:
                _arrive_and_wait(ARRIVED, row, splits)
        if PHASE != 1:
            shift, l = _merge_partials(M_PART, L_PART, row, splits, SPLITS)
            inv_l, log2_l = _normalizers(l)
            if PACKED_MAX:
                w = _opaque(w)
            x, bias = _chunk_logits(w, 0, MASK, m_off, idx, ok, smc, KIND, PAIRS, MASK_KIND, "evict_first", PACKED_MAX)
            y = _softmax_out(x, bias, shift, inv_l, log2_l, scale_log2, LOG)
            if PAIRS == 2:
                x, bias = _chunk_logits(w, 1, MASK, m_off, idx, ok, smc, KIND, PAIRS, MASK_KIND, "evict_first",
                                        PACKED_MAX)
                y = _pack(y, _softmax_out(x, bias, shift, inv_l, log2_l, scale_log2, LOG), KIND)
            y_off = tl.cast(row, tl.int64) * n_words  # YW is a fresh contiguous (rows, words) buffer
            tl.store(YW + y_off + idx, y.to(YW.dtype.element_ty), mask=ok, eviction_policy="evict_first")


# Backward.  With y the output (contiguous) and g = dL/dy:
#   softmax:     dx = scale * y * (g - sum(g * y))
#   log_softmax: dx = scale * (g - exp(y) * sum(g))
# Entries removed by a boolean mask get dx = 0 (they did not influence y).  The row sum
# needs g * y (softmax) or g alone (log-softmax: y is not read in that pass).


@triton.jit
def _bwd_sum_terms(Y, G, offs, ok, LOG: tl.constexpr, POLICY: tl.constexpr):
    """The summand of the row sum for a tile: g (log-softmax) or g * y (softmax)."""
    g = tl.load(G + offs, mask=ok, other=0.0, eviction_policy=POLICY).to(tl.float32)
    if LOG:
        return g
    return g * tl.load(Y + offs, mask=ok, other=0.0, eviction_policy=POLICY).to(tl.float32)


@triton.jit
def _bwd_dx(MASK, y, g, s, m_off, cols, ok, smc, scale,
            LOG: tl.constexpr, MASK_KIND: tl.constexpr, POLICY: tl.constexpr):
    if LOG:
        dx = g - tl.math.exp(y) * s  # exp(-inf) = 0 for masked entries
    else:
        dx = y * (g - s)
    keep = ok
    if MASK_KIND == 1:
        keep = keep & (tl.load(MASK + m_off + cols * smc, mask=ok, other=0, eviction_policy=POLICY) != 0)
    return tl.where(keep, dx * scale, 0.0)


@triton.jit
def _bwd_tile_dx(Y, G, MASK, offs, m_off, cols, ok, smc, s, scale,
                 LOG: tl.constexpr, MASK_KIND: tl.constexpr, POLICY: tl.constexpr):
    """Load a tile of y and g (their last read: ``POLICY``) and return its dx."""
    y = tl.load(Y + offs, mask=ok, other=0.0, eviction_policy=POLICY).to(tl.float32)
    g = tl.load(G + offs, mask=ok, other=0.0, eviction_policy=POLICY).to(tl.float32)
    return _bwd_dx(MASK, y, g, s, m_off, cols, ok, smc, scale, LOG, MASK_KIND, POLICY)


@triton.jit
def _softmax_bwd_in_registers(
    Y, G, MASK, DX, n_rows, n_cols, L1, L2, sm0, sm1, sm2, smc, scale,
    LOG: tl.constexpr, MASK_KIND: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)[None, :]
    ok = (rows[:, None] < n_rows) & (cols < n_cols)
    offs = rows.to(tl.int64)[:, None] * n_cols + cols
    m_off = _row_offset(rows, L1, L2, sm0, sm1, sm2)[:, None]
    y = tl.load(Y + offs, mask=ok, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=ok, other=0.0).to(tl.float32)
    s = tl.sum(g if LOG else g * y, axis=1)[:, None]
    dx = _bwd_dx(MASK, y, g, s, m_off, cols, ok, smc, scale, LOG, MASK_KIND, "")
    tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=ok)


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
        m_off = _row_offset(row, L1, L2, sm0, sm1, sm2)
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
    s = _sum_partials(S_PART, row, splits, SPLITS)
    row_off = tl.cast(row, tl.int64) * n_cols
    m_off = _row_offset(row, L1, L2, sm0, sm1, sm2)
    n_tiles = tl.cdiv(c1 - c0, TILE)
    for t in tl.range(0, n_tiles, num_stages=STAGES):
        cols = _tile_cols(c0 + (n_tiles - 1 - t) * TILE, BLOCK_N, UNROLL)
        ok = cols < c1
        dx = _bwd_tile_dx(Y, G, MASK, row_off + cols, m_off, cols, ok, smc, s, scale, LOG, MASK_KIND, LAST_READ)
        tl.store(DX + row_off + cols, dx.to(DX.dtype.element_ty), mask=ok, eviction_policy=WRITE)


@triton.jit
def _softmax_bwd_cooperative(
    Y, G, MASK, DX, S_PART, ARRIVED, n_rows, n_words, L1, L2, sm0, sm1, sm2, smc, scale, splits,
    LOG: tl.constexpr, MASK_KIND: tl.constexpr, KIND: tl.constexpr, WORDS: tl.constexpr,
    SPLITS: tl.constexpr, PHASE: tl.constexpr, ASM: tl.constexpr,
):
    """Cooperative path (see the forward): a chunk of y and g stays in registers, as loaded
    (16-bit pairs in int32 words when ``KIND`` says so, as in the forward), while the row's
    chunk programs exchange their partial sums through ``S_PART``."""
    PAIRS: tl.constexpr = 1 if KIND == KIND_PLAIN else 2
    tl.static_assert(PAIRS == 1 or MASK_KIND == 0, "masked rows are held one element a word")
    if PAIRS == 2:
        YW = Y.to(tl.pointer_type(tl.int32), bitcast=True)
        GW = G.to(tl.pointer_type(tl.int32), bitcast=True)
        DXW = DX.to(tl.pointer_type(tl.int32), bitcast=True)
    else:
        YW = Y
        GW = G
        DXW = DX
    pid = tl.program_id(0)
    c = pid % splits
    idx = c * WORDS + tl.arange(0, WORDS)
    ok = idx < n_words
    for row in tl.range(pid // splits, n_rows, tl.num_programs(0) // splits):
        offs = tl.cast(row, tl.int64) * n_words + idx
        yw = tl.load(YW + offs, mask=ok, other=0, eviction_policy="evict_first")
        gw = tl.load(GW + offs, mask=ok, other=0, eviction_policy="evict_first")
        if PHASE != 2:
            g = _unpack(gw, 0, KIND)
            part = g if LOG else g * _unpack(yw, 0, KIND)
            if PAIRS == 2:
                g = _unpack(gw, 1, KIND)
                part += g if LOG else g * _unpack(yw, 1, KIND)
            tl.store(S_PART + row * splits + c, tl.sum(part, axis=0))
            if PHASE == 0:
                _arrive_and_wait(ARRIVED, row, splits)
        if PHASE != 1:
            s = _sum_partials(S_PART, row, splits, SPLITS)
            m_off = _row_offset(row, L1, L2, sm0, sm1, sm2)
            if ASM and PAIRS == 2:  # recompute from the held words (see the forward's _opaque)
                yw = _opaque(yw)
                gw = _opaque(gw)
            dx = _bwd_dx(MASK, _unpack(yw, 0, KIND), _unpack(gw, 0, KIND), s, m_off, idx, ok, smc, scale,
                         LOG, MASK_KIND, "evict_first")
            if PAIRS == 2:
                dx = _pack(dx, _bwd_dx(MASK, _unpack(yw, 1, KIND), _unpack(gw, 1, KIND), s, m_off, idx, ok,
                                       smc, scale, LOG, MASK_KIND, "evict_first"), KIND)
            tl.store(DXW + offs, dx.to(DXW.dtype.element_ty), mask=ok, eviction_policy="evict_first")


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


STRATEGIES = ("registers", "cooperative", "fused", "split")
_ALIASES = {"online": "split"}  # the split path's former name


def _floor_pow2(v: float) -> float:
    return 2.0 ** math.floor(math.log2(v))


def _sms() -> int:
    return 1 if INTERPRET else sm_count(torch.cuda.current_device())


def streaming_strategy(n_rows: int) -> str:
    """The two-pass path for rows that are not held on chip: fused when every SM gets rows."""
    return "fused" if n_rows >= knobs()["fused_min_rows_per_sm"] * _sms() else "split"


def plan(n_rows: int, n_cols: int, strategy: str | None = None, block: int | None = None,
         splits: int | None = None, unroll: int | None = None, programs: int | None = None,
         elem_bytes: int = 4, reread_bytes: int | None = None, backward: bool = False,
         masked: bool = False):
    """Pick the strategy and its launch shape for (n_rows, n_cols).

    ``elem_bytes`` is the size of the streamed tensors' elements (sub-tiles are one 16-byte
    vector per thread); ``reread_bytes`` the bytes per row that pass 2 reads again (default
    ``n_cols * elem_bytes``), which sets how many rows the fused path keeps in flight;
    ``backward`` picks the backward's chunk size on the cooperative path; ``masked`` (the
    forward has a mask) keeps the forward off the cooperative path by default: its masked
    variants spill 0.3-1.6 KB a thread at the 64-register cap (offline ptxas), so their
    speed there is not established (docs/tuning.md).
    ``strategy``, ``block`` (sub-tile elements; cooperative: chunk elements), ``unroll``
    (sub-tiles per iteration), ``splits`` (chunks per row, split path) and ``programs``
    (persistent grid, fused and cooperative paths; still capped by occupancy at launch)
    override the knobs, for tests and tuning.
    """
    k = knobs()
    strategy = _ALIASES.get(strategy, strategy)
    sms = _sms()
    if backward:
        cooperative = n_cols <= k["coop_bwd_max"]
    else:
        cooperative = (not masked and k["coop_fwd_min_bytes"] <= n_cols * elem_bytes
                       and n_cols <= k["cooperative_max"])
    if strategy is None:
        if n_cols <= k["in_register_max"]:
            strategy = "registers"
        elif cooperative:
            strategy = "cooperative"
        else:
            strategy = streaming_strategy(n_rows)
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES} or None, got {strategy!r}")
    if strategy == "cooperative":
        if INTERPRET:
            chunk, num_warps = block or 64, 1
        else:
            fwd_chunk = k["coop_block"] or 32768 // elem_bytes
            chunk, num_warps = block or (k["coop_bwd_block"] if backward else fwd_chunk), k["coop_warps"]
        chunk = next_power_of_2(chunk)
        n_splits = cdiv(n_cols, chunk)
        slots = n_rows if programs is None else max(1, programs // n_splits)
        maxnreg = k["coop_maxnreg"] if backward else (k["coop_fwd_maxnreg"] or k["coop_maxnreg"])
        return dict(strategy=strategy, BLOCK_N=chunk, num_warps=num_warps, splits=n_splits,
                    SPLITS=max(2, next_power_of_2(n_splits)), slots=min(n_rows, slots),
                    maxnreg=0 if INTERPRET else maxnreg, pack=bool(k["coop_pack"]))
    if strategy == "registers":
        block_n = max(16, next_power_of_2(n_cols))
        if INTERPRET:
            rows = 4 if block_n <= 64 else 1
            return dict(strategy=strategy, BLOCK_N=block_n, ROWS=rows, num_warps=1)
        rows = max(1, min(64, 4096 // block_n))
        # 8k+ rows: 32 values per thread (16k: 16 warps; 32k: 32 warps, which does not spill).
        # The backward of 16k rows takes 32 warps (16 values of y and of dy per thread):
        # bf16 0.96 of the copy rate against 0.76 with 16 (fp32 1.03 either way; H200,
        # docs/tuning.md).
        num_warps = 4 if block_n <= 4096 else min(32, block_n // (512 if backward and block_n >= 16384 else 1024))
        if block_n >= 8192 and k["register_warps"]:
            num_warps = k["register_warps"]
        return dict(strategy=strategy, BLOCK_N=block_n, ROWS=rows, num_warps=num_warps)

    if strategy == "fused":
        # Rows in flight: as many as L2 can hold the re-read part of, within [min, max]
        # programs per SM, rounded down to a power of two so that num_warps is one too.
        reread = reread_bytes or n_cols * elem_bytes
        rows_fit = k["l2_budget_mb"] * 2**20 / max(1, reread)
        per_sm = _floor_pow2(min(k["programs_per_sm"], max(k["min_programs_per_sm"], rows_fit / sms)))
        num_warps = int(min(32, max(4, _floor_pow2(k["warps_per_sm"] / per_sm))))
    else:
        num_warps = k["split_warps"]
    if INTERPRET:
        num_warps, default_block, unroll = 1, 64, unroll or 2
    else:
        default_block = k["block"] or num_warps * 32 * max(1, 16 // elem_bytes)
    block_n = block or default_block
    unroll = unroll or k["unroll"]
    tile = block_n * unroll
    common = dict(strategy=strategy, BLOCK_N=block_n, UNROLL=unroll, num_warps=num_warps,
                  STAGES=k["stages"] or None, evict=bool(k["evict"]) and not INTERPRET)
    if strategy == "fused":
        return dict(common, programs=max(1, min(n_rows, programs or int(per_sm * sms))))
    if splits is None:
        target = k["split_programs_per_sm"] * sms
        splits = max(1, min(MAX_SPLITS, -(-target // n_rows), cdiv(n_cols, tile)))
    chunk = cdiv(cdiv(n_cols, splits), tile) * tile
    splits = cdiv(n_cols, chunk)
    return dict(common, splits=splits, chunk=chunk, SPLITS=max(2, next_power_of_2(splits)))


def _policies(p):
    """Eviction hints: keep on the first read, drop on the last read and on the output."""
    if p["evict"]:
        return dict(FIRST_READ="evict_last", LAST_READ="evict_first", WRITE="evict_first")
    return dict(FIRST_READ="", LAST_READ="", WRITE="")


@functools.cache
def _device_limits(device_index: int):
    props = torch.cuda.get_device_properties(device_index)
    return (getattr(props, "max_threads_per_multi_processor", 2048),
            getattr(props, "regs_per_multiprocessor", 65536),
            getattr(props, "shared_memory_per_multiprocessor", 233472))


_RESIDENT: dict = {}


def resident_programs_per_sm(compiled, num_warps: int, device_index: int) -> int:
    """How many programs of ``compiled`` one SM holds at once (threads, registers, shared memory)."""
    compiled._init_handles()
    threads, regs, smem = _device_limits(device_index)
    regs_per_warp = -(-max(1, compiled.n_regs) * 32 // 256) * 256  # allocated per warp, 256 at a time
    fits = [threads // (32 * num_warps), regs // regs_per_warp // num_warps, 32]
    if compiled.metadata.shared:
        fits.append(smem // (compiled.metadata.shared + 1024))  # 1 KB reserved per block
    return max(1, min(fits))


def _resident_programs(kernel, args, kwargs, device) -> int:
    """How many programs of ``kernel`` (compiled for these arguments) the whole GPU holds at once."""
    key = (kernel.fn.__name__ if hasattr(kernel, "fn") else id(kernel), device.index,
           tuple(str(a.dtype) for a in args if isinstance(a, torch.Tensor)), tuple(sorted(kwargs.items())))
    per_sm = _RESIDENT.get(key)
    if per_sm is None:
        compiled = kernel.warmup(*args, grid=(1,), **kwargs)
        per_sm = _RESIDENT[key] = resident_programs_per_sm(compiled, kwargs["num_warps"], device.index)
    return per_sm * sm_count(device.index)


def _persistent_grid(kernel, args, kwargs, p, device):
    """The fused path's grid: the planned programs, capped by how many can be resident, since
    a persistent program that has to wait for a free slot only starts when another is done."""
    if INTERPRET:
        return p["programs"]
    return max(1, min(p["programs"], _resident_programs(kernel, args, kwargs, device)))


def _launch_cooperative(kernel, args, kwargs, p, device) -> bool:
    """Run a cooperative kernel over ``p["slots"]`` rows at a time (fewer if fewer rows' chunk
    programs can be resident at once); False, launching nothing, when not even one row's can."""
    if INTERPRET:  # programs run one after another: publish everything, then write
        grid = (p["slots"] * p["splits"],)
        kernel[grid](*args, PHASE=1, **kwargs)
        kernel[grid](*args, PHASE=2, **kwargs)
        return True
    # Cooperative: the driver refuses the launch unless every program can be resident at
    # once, so a program waiting for its row's other chunks can never wait forever.
    kwargs = dict(kwargs, PHASE=0, launch_cooperative_grid=True)
    maxnreg = p["maxnreg"]
    if maxnreg:
        kwargs["maxnreg"] = maxnreg
    slots = min(p["slots"], _resident_programs(kernel, args, kwargs, device) // p["splits"])
    if slots < 1 and not maxnreg:  # more programs per SM at fewer registers each
        kwargs["maxnreg"] = 64
        slots = min(p["slots"], _resident_programs(kernel, args, kwargs, device) // p["splits"])
    while slots >= 1:
        try:
            kernel[(slots * p["splits"],)](*args, **kwargs)
            return True
        except RuntimeError as e:  # our residency estimate above the driver's: fewer rows at once
            if "cooperative" not in str(e).lower():
                raise
            slots //= 2
    return False


def _mask_kind(mask):
    if mask is None:
        return 0
    return 1 if mask.dtype == torch.bool else 2


def _packing(x, mask, x_strides, n_cols, out_dtype):
    """How the cooperative forward holds its chunk: unmasked 16-bit rows that are contiguous
    and start on a word (y in x's dtype) as pairs in int32 words, anything else one element
    a word."""
    if mask is not None or x.dtype != out_dtype or x.dtype not in (torch.bfloat16, torch.float16):
        return KIND_PLAIN.value
    if n_cols % 2 or x_strides[3] != 1 or any(st % 2 for st in x_strides[:3]) or x.data_ptr() % 4:
        return KIND_PLAIN.value
    return (KIND_BF16X2 if x.dtype == torch.bfloat16 else KIND_F16X2).value


def softmax_forward(x, mask, lead_shape, x_strides, m_strides, n_cols, scale, log,
                    out_dtype, strategy=None, block=None, splits=None, unroll=None, programs=None):
    """Launch the forward over rows described by (lead_shape, strides). Returns y (rows, n_cols)."""
    n_rows = lead_shape[0] * lead_shape[1] * lead_shape[2]
    y = torch.empty((n_rows, n_cols), dtype=out_dtype, device=x.device)
    if n_rows == 0 or n_cols == 0:
        return y
    kind = _mask_kind(mask)
    mask_arg = mask if mask is not None else x
    L1, L2 = lead_shape[1], lead_shape[2]
    sx, sm = x_strides, m_strides
    reread = n_cols * (x.element_size() + (mask.element_size() if mask is not None else 0))
    p = plan(n_rows, n_cols, strategy, block, splits, unroll, programs, x.element_size(), reread,
             masked=mask is not None)
    scale_log2 = scale * LOG2E
    if p["strategy"] == "registers":
        grid = (cdiv(n_rows, p["ROWS"]),)
        _softmax_fwd_in_registers[grid](
            x, mask_arg, y, n_rows, n_cols, L1, L2, *sx, *sm, scale_log2,
            LOG=log, MASK_KIND=kind, ROWS=p["ROWS"], BLOCK_N=p["BLOCK_N"], num_warps=p["num_warps"])
        return y
    if p["strategy"] == "cooperative":
        parts = torch.empty((2, n_rows * p["splits"]), dtype=torch.float32, device=x.device)
        arrived = torch.zeros((n_rows,), dtype=torch.int32, device=x.device)
        packing = _packing(x, mask, sx, n_cols, out_dtype) if p["pack"] else KIND_PLAIN.value
        pairs = 1 if packing == KIND_PLAIN.value else 2
        sxw = tuple(st // pairs for st in sx[:3]) + (sx[3],)
        args = (x, mask_arg, y, parts[0], parts[1], arrived, n_rows, n_cols // pairs, L1, L2, *sxw, *sm,
                scale_log2, p["splits"])
        kw = dict(LOG=log, MASK_KIND=kind, KIND=packing, WORDS=p["BLOCK_N"] // pairs, SPLITS=p["SPLITS"],
                  ASM=not INTERPRET, num_warps=p["num_warps"])
        if _launch_cooperative(_softmax_fwd_cooperative, args, kw, p, x.device):
            return y
        p = plan(n_rows, n_cols, streaming_strategy(n_rows), elem_bytes=x.element_size(), reread_bytes=reread)
    pol = _policies(p)
    tiles = dict(BLOCK_N=p["BLOCK_N"], UNROLL=p["UNROLL"], STAGES=p["STAGES"], num_warps=p["num_warps"])
    if p["strategy"] == "fused":
        args = (x, mask_arg, y, n_rows, n_cols, L1, L2, *sx, *sm, scale_log2)
        kw = dict(LOG=log, MASK_KIND=kind, **tiles, **pol)
        grid = _persistent_grid(_softmax_fwd_fused, args, kw, p, x.device)
        _softmax_fwd_fused[(grid,)](*args, **kw)
        return y
    parts = torch.empty((2, n_rows * p["splits"]), dtype=torch.float32, device=x.device)
    grid = (n_rows * p["splits"],)
    _softmax_fwd_partials[grid](
        x, mask_arg, parts[0], parts[1], n_cols, L1, L2, p["chunk"], *sx, *sm, scale_log2, p["splits"],
        MASK_KIND=kind, FIRST_READ=pol["FIRST_READ"], **tiles)
    _softmax_fwd_write[grid](
        x, mask_arg, y, parts[0], parts[1], n_cols, L1, L2, p["chunk"], *sx, *sm, scale_log2, p["splits"],
        LOG=log, MASK_KIND=kind, SPLITS=p["SPLITS"], LAST_READ=pol["LAST_READ"], WRITE=pol["WRITE"], **tiles)
    return y


def softmax_backward(y, g, mask, lead_shape, m_strides, scale, log, out_dtype,
                     strategy=None, block=None, splits=None, unroll=None, programs=None):
    """dx for contiguous (rows, n_cols) ``y`` and ``g``; dx has the same (rows, n_cols) layout."""
    n_rows, n_cols = y.shape
    dx = torch.empty((n_rows, n_cols), dtype=out_dtype, device=y.device)
    if n_rows == 0 or n_cols == 0:
        return dx
    kind = _mask_kind(mask)
    mask_arg = mask if mask is not None else y
    L1, L2 = lead_shape[1], lead_shape[2]
    reread = n_cols * (y.element_size() + g.element_size() + (mask.element_size() if mask is not None else 0))
    p = plan(n_rows, n_cols, strategy, block, splits, unroll, programs, y.element_size(), reread, backward=True)
    if p["strategy"] == "registers":
        _softmax_bwd_in_registers[(cdiv(n_rows, p["ROWS"]),)](
            y, g, mask_arg, dx, n_rows, n_cols, L1, L2, *m_strides, scale,
            LOG=log, MASK_KIND=kind, ROWS=p["ROWS"], BLOCK_N=p["BLOCK_N"], num_warps=p["num_warps"])
        return dx
    if p["strategy"] == "cooperative":
        part = torch.empty((n_rows * p["splits"],), dtype=torch.float32, device=y.device)
        arrived = torch.zeros((n_rows,), dtype=torch.int32, device=y.device)
        # y, g and dx are contiguous (rows, n_cols): pairs when 16-bit, even and unmasked.
        packing = KIND_PLAIN.value
        if p["pack"] and g.dtype == y.dtype and g.data_ptr() % 4 == 0:
            packing = _packing(y, mask, (0, 0, n_cols, 1), n_cols, out_dtype)
        pairs = 1 if packing == KIND_PLAIN.value else 2
        args = (y, g, mask_arg, dx, part, arrived, n_rows, n_cols // pairs, L1, L2, *m_strides, scale, p["splits"])
        kw = dict(LOG=log, MASK_KIND=kind, KIND=packing, WORDS=p["BLOCK_N"] // pairs, SPLITS=p["SPLITS"],
                  ASM=not INTERPRET, num_warps=p["num_warps"])
        if _launch_cooperative(_softmax_bwd_cooperative, args, kw, p, y.device):
            return dx
        p = plan(n_rows, n_cols, streaming_strategy(n_rows), elem_bytes=y.element_size(), reread_bytes=reread)
    pol = _policies(p)
    tiles = dict(BLOCK_N=p["BLOCK_N"], UNROLL=p["UNROLL"], STAGES=p["STAGES"], num_warps=p["num_warps"])
    if p["strategy"] == "fused":
        args = (y, g, mask_arg, dx, n_rows, n_cols, L1, L2, *m_strides, scale)
        kw = dict(LOG=log, MASK_KIND=kind, **tiles, **pol)
        grid = _persistent_grid(_softmax_bwd_fused, args, kw, p, y.device)
        _softmax_bwd_fused[(grid,)](*args, **kw)
        return dx
    part = torch.empty((n_rows * p["splits"],), dtype=torch.float32, device=y.device)
    grid = (n_rows * p["splits"],)
    _softmax_bwd_partials[grid](y, g, part, n_cols, p["chunk"], p["splits"], LOG=log,
                                FIRST_READ=pol["FIRST_READ"], **tiles)
    _softmax_bwd_write[grid](
        y, g, mask_arg, dx, part, n_cols, L1, L2, p["chunk"], *m_strides, scale, p["splits"],
        LOG=log, MASK_KIND=kind, SPLITS=p["SPLITS"], LAST_READ=pol["LAST_READ"], WRITE=pol["WRITE"], **tiles)
    return dx
