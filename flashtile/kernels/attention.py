"""FlashAttention forward and backward in Triton (Hopper first, any CUDA GPU, and the interpreter).

(One module over 600 lines on purpose: the forward, the three backward passes and their
launchers share one ``Layout``, one set of tile configurations and one argument list; the
pieces every kernel family shares live in ``tile_info``, ``online_softmax``, ``masking`` and
``tma``.)

Forward: one program per (query tile, batch * head).  The query tile stays in registers;
key/value tiles stream through shared memory by TMA (tensor descriptors), scores go
through the tensor cores, and the softmax is kept *online*: a running row max ``m``, a
running row sum ``l`` and an un-normalised fp32 accumulator ``acc``.  Normalisation
happens once at the end and the log-sum-exp is written for the backward.  Nothing of
size seqlen_q x seqlen_k ever reaches HBM.

Backward, by recomputation from the LSE:
  1. ``_bwd_preprocess``: D_i = rowsum(dO_i * O_i) (minus dLSE_i), and the LSE in log2
     units with empty rows turned to +inf so their recomputed P is exactly 0.
  2. ``_bwd_dkdv``: one program per (key tile, batch * kv-head) holds K_j, V_j and loops
     over the query tiles (and over the query heads of its GQA group), recomputing
     P = exp2(Q K^T * scale*log2e - LSE*log2e); dV += P^T dO, dK += dS^T Q.
  3. ``_bwd_dq``: one program per (query tile, batch * head) loops over key tiles:
     dQ += dS K.  No atomics anywhere, so the backward is bitwise deterministic.  (Folding
     dQ into step 2 with atomics measured 25-45 % slower on an H200: docs/tuning.md.)

Tensors keep flash-attn's layout ``(batch, seqlen, nheads, headdim)`` and any strides with
a unit last stride: a 4-D tensor descriptor, built once on the host, addresses tile
``[b, row0:row0+BLOCK, h, :]`` directly, rows past the sequence read as zeros and are never
written.  Head dims that are not a power of two are padded to one *inside* the descriptor
(out-of-range columns read as zeros), so no copy is made.

Packed (varlen) batches ``(total, nheads, headdim)`` use the same host descriptors over the
whole tensor viewed as ``(1, total, nheads, headdim)``, tiles at row ``q_start + m0`` /
``k_start + n0`` (building one per sequence inside the kernel costs a descriptor write and a
fence per program).  Rows past a sequence's end then read the *next* sequence, not zeros, so
masks carry correctness there: keys at or past ``seqlen_k`` are masked out of every softmax
(``key_tiles`` never leaves the boundary tile unmasked), query rows past ``seqlen_q`` get
LSE = +inf in the backward (P exactly 0, given finite inputs), and every store of a packed
tile is a pointer store masked to its sequence's rows (``_store_tile``).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from flashtile.kernels.dropout import dropout_scale
from flashtile.kernels.engine import backward_engine, forward_engine
from flashtile.kernels.launch import constant as launch_constant
from flashtile.kernels.launch import launch
from flashtile.kernels.masking import band_mask, key_tiles, query_tiles
from flashtile.kernels.online_softmax import (
    LOG2E,
    alibi_slope_log2,
    online_max,
    recompute_p,
    score_mod,
    score_mod_args,
    softcap_grad,
)
from flashtile.kernels.runtime import INTERPRET, TileConfig, cdiv, dot_precision
from flashtile.kernels.tile_info import sequence_bounds, tile_and_head
from flashtile.kernels.tma import descriptor, padded_headdim, tma_ready




@triton.jit
def _store_tile(desc, ptr, b, row, h, tile, row_end, VARLEN: tl.constexpr):
    """Store a ``(BLOCK, HEAD_DIM)`` tile at the descriptor's ``[b, row, h, 0]``.

    A packed descriptor spans every sequence, so its bounds would not stop a tile that runs
    past its own sequence from overwriting the next one: packed tiles are stored through
    ``ptr`` (the descriptor's tensor), rows below ``row_end`` only, with the descriptor's strides.
    """
    if VARLEN:
        # TMA already required 16-byte strides and rows; rebuilding them as multiples of
        # 16 bytes (exact divisions) lets the compiler see it and store 16 bytes at a time.
        VEC: tl.constexpr = 128 // desc.dtype.primitive_bitwidth
        row_stride = (desc.strides[1] // VEC) * VEC
        head_stride = (desc.strides[2] // VEC) * VEC
        cols = (desc.shape[3] // VEC) * VEC
        offs_r = tl.arange(0, tile.shape[0])
        offs_d = tl.arange(0, tile.shape[1])
        ptrs = ptr + row.to(tl.int64) * row_stride + h * head_stride + offs_r[:, None] * row_stride + offs_d[None, :]
        tl.store(ptrs, tile.to(desc.dtype), mask=(offs_r < row_end - row)[:, None] & (offs_d < cols)[None, :])
    else:
        desc.store([b, row, h, 0], tile.to(desc.dtype).reshape([1, tile.shape[0], 1, tile.shape[1]]))


# --------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------


@triton.jit
def _kv_tile(desc, paged_kv, which: tl.constexpr, b, row, hk, start_n, bt_row, seqlen_k,
             BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """Key (``which`` = 0) or value (1) tile of keys ``[start_n, start_n + BLOCK_N)``.

    From the TMA descriptor, or -- with ``PAGED`` -- gathered row by row from a paged cache
    ``(num_blocks, PAGE_SIZE, heads_k, d)`` through the sequence's block-table row:
    ``paged_kv = (K_CACHE, V_CACHE, BLOCK_TABLE, num_blocks, max_blocks, headdim, stride_kb,
    stride_kn, stride_kh, stride_vb, stride_vn, stride_vh)``.  Keys at or past ``seqlen_k`` or
    past the block-table row, and pages outside ``[0, num_blocks)``, read as zeros (the host
    checks the values where it can; nothing is read out of bounds where it cannot).
    """
    if PAGED:
        cache = paged_kv[which]
        stride_b = paged_kv[6 + 3 * which]
        stride_n = paged_kv[7 + 3 * which]
        stride_h = paged_kv[8 + 3 * which]
        keys = start_n + tl.arange(0, BLOCK_N)
        col = keys // PAGE_SIZE
        ok = (keys < seqlen_k) & (col < paged_kv[4])
        page = tl.load(paged_kv[2] + bt_row + col, mask=ok, other=0)
        ok = ok & (page >= 0) & (page < paged_kv[3])
        rows = tl.where(ok, page, 0).to(tl.int64) * stride_b + (keys % PAGE_SIZE).to(tl.int64) * stride_n
        cols = tl.arange(0, HEAD_DIM)
        return tl.load(cache + rows[:, None] + hk * stride_h + cols[None, :],
                       mask=ok[:, None] & (cols < paged_kv[5])[None, :], other=0.0)
    return desc.load([b, row, hk, 0]).reshape([BLOCK_N, HEAD_DIM])


@triton.jit
def _fwd_tiles(
    acc, l_i, m_i, q, K_desc, V_desc, paged_kv, bt_row, b, hk, m0, k_start, start, end,
    seqlen_q, seqlen_k, qk_scale, window_left, window_right, softcap_scale, softcap_log2, slope_log2,
    dropout_p, seed, rng_offset, rng_row, rng_cols,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    MASKED: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
):
    offs_m = m0 + tl.arange(0, BLOCK_M)
    for start_n in tl.range(start, end, BLOCK_N):
        k = _kv_tile(K_desc, paged_kv, 0, b, k_start + start_n, hk, start_n, bt_row, seqlen_k,
                     BLOCK_N, HEAD_DIM, PAGED, PAGE_SIZE)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if HAS_SOFTCAP or HAS_ALIBI:
            qk, _ = score_mod(qk, offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_k, qk_scale,
                               softcap_scale, softcap_log2, slope_log2, HAS_SOFTCAP, HAS_ALIBI)
            s_scale = 1.0  # qk is already in log2 units
        else:
            s_scale = qk_scale
        if MASKED:
            visible = band_mask(offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_k, window_left, window_right,
                                MASK_LEFT, MASK_RIGHT)
            qk = tl.where(visible, qk, float("-inf"))
        m_ij, m_sub = online_max(qk, m_i, s_scale, MASKED)
        # exp(s*scale - m) == exp2(s*scale*log2e - m*log2e): with qk_scale = scale*log2e
        # and m kept in log2 units, the scale and the max subtraction are one FMA per score
        # feeding the hardware's native exp2.
        p = tl.math.exp2(qk * s_scale - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)  # the softmax denominator counts dropped entries too
        if HAS_DROPOUT:
            p = p * dropout_scale(seed, rng_offset, rng_row + m0, start_n, rng_cols, dropout_p, BLOCK_M, BLOCK_N,
                                  HAS_DROPOUT)
        v = _kv_tile(V_desc, paged_kv, 1, b, k_start + start_n, hk, start_n, bt_row, seqlen_k,
                     BLOCK_N, HEAD_DIM, PAGED, PAGE_SIZE)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_ij
    return acc, l_i, m_i


@triton.jit
def _attn_fwd(
    Q_desc, K_desc, V_desc, paged_kv, stride_bt, O_desc, O, LSE, ALIBI, stride_ab, CU_Q, CU_K, stride_lb, stride_lh,
    seqlen_q, seqlen_k, max_seqlen_q, nheads, group, qk_scale, window_left, window_right,
    softcap_scale, softcap_log2, dropout_p, seed, rng_offset, rng_cols,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
):
    pid_m, bh = tile_and_head(max_seqlen_q, BLOCK_M, MASK_RIGHT)
    b = bh // nheads
    h = bh % nheads
    hk = h // group
    m0 = pid_m * BLOCK_M
    slope_log2 = alibi_slope_log2(ALIBI, stride_ab, b, h, HAS_ALIBI)
    q_start, seqlen_q, k_start, seqlen_k = sequence_bounds(CU_Q, CU_K, b, seqlen_q, seqlen_k, VARLEN)
    bt_row = b.to(tl.int64) * stride_bt  # this sequence's block-table row (PAGED)
    if VARLEN:
        if m0 >= seqlen_q:  # the grid covers the longest sequence
            return
        b = 0  # from here on b is only the descriptors' first coordinate

    lse_row = (bh // nheads).to(tl.int64) * stride_lb + h * stride_lh + q_start  # also the dropout RNG's row
    # Packed: rows past seqlen_q are the next sequence's queries; computed, never stored.
    q = Q_desc.load([b, q_start + m0, h, 0]).reshape([BLOCK_M, HEAD_DIM])
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    lo, full_lo, full_hi, hi = key_tiles(m0, seqlen_q, seqlen_k, window_left, window_right,
                                         BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT)
    if MASK_LEFT:
        acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, K_desc, V_desc, paged_kv, bt_row, b, hk, m0, k_start, lo, full_lo,
                                   seqlen_q, seqlen_k, qk_scale, window_left, window_right,
                                   softcap_scale, softcap_log2, slope_log2,
                                   dropout_p, seed, rng_offset, lse_row, rng_cols,
                                   BLOCK_M, BLOCK_N, HEAD_DIM, True, MASK_LEFT, MASK_RIGHT,
                                   HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, DOT_PRECISION,
                                   PAGED, PAGE_SIZE)
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, K_desc, V_desc, paged_kv, bt_row, b, hk, m0, k_start, full_lo, full_hi,
                               seqlen_q, seqlen_k, qk_scale, window_left, window_right,
                               softcap_scale, softcap_log2, slope_log2,
                               dropout_p, seed, rng_offset, lse_row, rng_cols,
                               BLOCK_M, BLOCK_N, HEAD_DIM, False, MASK_LEFT, MASK_RIGHT,
                               HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, DOT_PRECISION,
                                   PAGED, PAGE_SIZE)
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, K_desc, V_desc, paged_kv, bt_row, b, hk, m0, k_start, full_hi, hi,
                               seqlen_q, seqlen_k, qk_scale, window_left, window_right,
                               softcap_scale, softcap_log2, slope_log2,
                               dropout_p, seed, rng_offset, lse_row, rng_cols,
                               BLOCK_M, BLOCK_N, HEAD_DIM, True, MASK_LEFT, MASK_RIGHT,
                               HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, DOT_PRECISION,
                                   PAGED, PAGE_SIZE)

    # Deferred normalisation: one reciprocal per row.  A row with no visible key has
    # l = 0: its output is 0 and its LSE -inf, never NaN.
    empty = l_i == 0.0
    inv_l = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, l_i))
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    tl.store(LSE + lse_row + offs_m, lse, mask=offs_m < seqlen_q)
    # Selected, not multiplied: acc may hold 0 * inf = NaN from a masked key's V.
    _store_tile(O_desc, O, b, q_start + m0, h, tl.where(empty[:, None], 0.0, acc * inv_l[:, None]),
                q_start + seqlen_q, VARLEN)


# --------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------


@triton.jit
def _bwd_preprocess(
    O, DO, DLSE, LSE, Delta, LSE2, CU_Q, stride_lb, stride_lh,
    stride_ob, stride_om, stride_oh,
    stride_dob, stride_dom, stride_doh,
    seqlen_q, max_seqlen_q, nheads, headdim,
    HAS_DLSE: tl.constexpr, VARLEN: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    pid_m, bh = tile_and_head(max_seqlen_q, BLOCK_M, False)
    b = bh // nheads
    h = bh % nheads
    q_start, seqlen_q, _, _ = sequence_bounds(CU_Q, CU_Q, b, seqlen_q, seqlen_q, VARLEN)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    mask = (offs_m[:, None] < seqlen_q) & (offs_d[None, :] < headdim)
    rows = (q_start + offs_m).to(tl.int64)[:, None]  # packed: the batch stride is 0
    o = tl.load(O + b.to(tl.int64) * stride_ob + h * stride_oh + rows * stride_om + offs_d[None, :],
                mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + b.to(tl.int64) * stride_dob + h * stride_doh + rows * stride_dom + offs_d[None, :],
                 mask=mask, other=0.0).to(tl.float32)
    row_base = b.to(tl.int64) * stride_lb + h * stride_lh + q_start  # LSE / D / dropout-RNG row
    row = row_base + offs_m
    delta = tl.sum(o * do, axis=1)
    if HAS_DLSE:
        # d lse_i / d s_ij = P_ij: a gradient on the LSE only shifts D_i.
        delta -= tl.load(DLSE + row, mask=offs_m < seqlen_q, other=0.0)
    tl.store(Delta + row, delta, mask=offs_m < seqlen_q)
    lse = tl.load(LSE + row, mask=offs_m < seqlen_q, other=float("-inf"))
    # Rows with no visible key (LSE = -inf) get +inf, so exp2(s - LSE2) is exactly 0 for them.
    tl.store(LSE2 + row, tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634),
             mask=offs_m < seqlen_q)


@triton.jit
def _dkdv_tiles(
    dk, dv, k, v, Q_desc, DO_desc, LSE2, Delta, b, h, q_start, row_base, n0, start, end,
    seqlen_q, seqlen_k, qk_scale, window_left, window_right, softcap_scale, softcap_log2, slope_log2,
    dropout_p, seed, rng_offset, rng_cols,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    MASKED: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Accumulate one query run's contribution to dK, dV of the resident key tile.

    Scores the transposed tile (keys x queries) with K, V as the left (A) operand, so P^T
    and dS^T feed the dV / dK products directly (the other orientation -- K and V as the
    right operand, P and dS transposed -- spilled more in the offline register report).
    """
    offs_n = n0 + tl.arange(0, BLOCK_N)
    for m0 in range(start, end, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        q = Q_desc.load([b, q_start + m0, h, 0]).reshape([BLOCK_M, HEAD_DIM])
        # Rows past seqlen_q (zeros, or the next packed sequence's finite rows) read
        # LSE2 = +inf and D = 0: their P and dS are exactly 0, so they add nothing.
        lse2 = tl.load(LSE2 + row_base + offs_m, mask=offs_m < seqlen_q, other=float("inf"))
        delta = tl.load(Delta + row_base + offs_m, mask=offs_m < seqlen_q, other=0.0)
        do = DO_desc.load([b, q_start + m0, h, 0]).reshape([BLOCK_M, HEAD_DIM])
        qkT = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)
        pT, tanhT = recompute_p(qkT, offs_m[None, :], offs_n[:, None], lse2[None, :], seqlen_q, seqlen_k,
                                 qk_scale, window_left, window_right, softcap_scale, softcap_log2,
                                 slope_log2, MASKED, MASK_LEFT, MASK_RIGHT, HAS_SOFTCAP, HAS_ALIBI)
        dropT = dropout_scale(seed, rng_offset, row_base + m0, n0, rng_cols, dropout_p, BLOCK_M, BLOCK_N,
                              HAS_DROPOUT, KEYS_FIRST=True)
        dv = tl.dot((pT * dropT).to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        dsT = softcap_grad(pT * (dpT * dropT - delta[None, :]), tanhT, HAS_SOFTCAP)
        dk = tl.dot(dsT.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv(
    Q_desc, K_desc, V_desc, DO_desc, DK_desc, DV_desc, DK, DV, LSE2, Delta, ALIBI, stride_ab,
    CU_Q, CU_K, stride_lb, stride_lh,
    seqlen_q, seqlen_k, max_seqlen_k, nheads_k, group, qk_scale, softmax_scale, window_left, window_right,
    softcap_scale, softcap_log2, dropout_p, seed, rng_offset, rng_cols,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid_n, bhk = tile_and_head(max_seqlen_k, BLOCK_N, False)
    b = bhk // nheads_k
    hk = bhk % nheads_k
    n0 = pid_n * BLOCK_N
    batch = b
    q_start, seqlen_q, k_start, seqlen_k = sequence_bounds(CU_Q, CU_K, b, seqlen_q, seqlen_k, VARLEN)
    if VARLEN:
        if n0 >= seqlen_k:
            return
        b = 0  # from here on b is only the descriptors' first coordinate
    k = K_desc.load([b, k_start + n0, hk, 0]).reshape([BLOCK_N, HEAD_DIM])
    v = V_desc.load([b, k_start + n0, hk, 0]).reshape([BLOCK_N, HEAD_DIM])
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    lo, full_lo, full_hi, hi = query_tiles(n0, seqlen_q, seqlen_k, window_left, window_right,
                                           BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT)
    # GQA: the query heads of one group all read this K/V tile; summing their
    # contributions here gives dK/dV without atomics or a K/V copy.
    for g in range(0, group):
        h = hk * group + g
        rows = batch.to(tl.int64) * stride_lb + h * stride_lh + q_start  # this head's LSE / D rows
        slope_log2 = alibi_slope_log2(ALIBI, stride_ab, batch, h, HAS_ALIBI)
        if MASK_RIGHT:
            dk, dv = _dkdv_tiles(dk, dv, k, v, Q_desc, DO_desc, LSE2, Delta, b, h, q_start, rows, n0, lo, full_lo,
                                 seqlen_q, seqlen_k, qk_scale, window_left, window_right,
                                 softcap_scale, softcap_log2, slope_log2, dropout_p, seed, rng_offset, rng_cols,
                                 BLOCK_M, BLOCK_N, HEAD_DIM, True, MASK_LEFT, MASK_RIGHT,
                                 HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, DOT_PRECISION)
        dk, dv = _dkdv_tiles(dk, dv, k, v, Q_desc, DO_desc, LSE2, Delta, b, h, q_start, rows, n0, full_lo, full_hi,
                             seqlen_q, seqlen_k, qk_scale, window_left, window_right,
                             softcap_scale, softcap_log2, slope_log2, dropout_p, seed, rng_offset, rng_cols,
                             BLOCK_M, BLOCK_N, HEAD_DIM, False, MASK_LEFT, MASK_RIGHT,
                             HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, DOT_PRECISION)
        if MASK_LEFT:
            dk, dv = _dkdv_tiles(dk, dv, k, v, Q_desc, DO_desc, LSE2, Delta, b, h, q_start, rows, n0, full_hi, hi,
                                 seqlen_q, seqlen_k, qk_scale, window_left, window_right,
                                 softcap_scale, softcap_log2, slope_log2, dropout_p, seed, rng_offset, rng_cols,
                                 BLOCK_M, BLOCK_N, HEAD_DIM, True, MASK_LEFT, MASK_RIGHT,
                                 HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, DOT_PRECISION)
    _store_tile(DV_desc, DV, b, k_start + n0, hk, dv, k_start + seqlen_k, VARLEN)
    dk = dk * softmax_scale
    _store_tile(DK_desc, DK, b, k_start + n0, hk, dk, k_start + seqlen_k, VARLEN)


@triton.jit
def _dq_tiles(
    dq, q, do, lse2, delta, K_desc, V_desc, b, hk, m0, k_start, start, end,
    seqlen_q, seqlen_k, qk_scale, window_left, window_right, softcap_scale, softcap_log2, slope_log2,
    dropout_p, seed, rng_offset, rng_row, rng_cols,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    MASKED: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    offs_m = m0 + tl.arange(0, BLOCK_M)
    for start_n in range(start, end, BLOCK_N):
        k = K_desc.load([b, k_start + start_n, hk, 0]).reshape([BLOCK_N, HEAD_DIM])
        v = V_desc.load([b, k_start + start_n, hk, 0]).reshape([BLOCK_N, HEAD_DIM])
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        p, tanh = recompute_p(qk, offs_m[:, None], offs_n[None, :], lse2[:, None], seqlen_q, seqlen_k,
                               qk_scale, window_left, window_right, softcap_scale, softcap_log2, slope_log2,
                               MASKED, MASK_LEFT, MASK_RIGHT, HAS_SOFTCAP, HAS_ALIBI)
        drop = dropout_scale(seed, rng_offset, rng_row + m0, start_n, rng_cols, dropout_p, BLOCK_M, BLOCK_N,
                             HAS_DROPOUT)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = softcap_grad(p * (dp * drop - delta[:, None]), tanh, HAS_SOFTCAP)
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def _attn_bwd_dq(
    Q_desc, K_desc, V_desc, DO_desc, DQ_desc, DQ, LSE2, Delta, ALIBI, stride_ab, CU_Q, CU_K, stride_lb, stride_lh,
    seqlen_q, seqlen_k, max_seqlen_q, nheads, group, qk_scale, softmax_scale, window_left, window_right,
    softcap_scale, softcap_log2, dropout_p, seed, rng_offset, rng_cols,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid_m, bh = tile_and_head(max_seqlen_q, BLOCK_M, MASK_RIGHT)
    b = bh // nheads
    h = bh % nheads
    hk = h // group
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    slope_log2 = alibi_slope_log2(ALIBI, stride_ab, b, h, HAS_ALIBI)
    q_start, seqlen_q, k_start, seqlen_k = sequence_bounds(CU_Q, CU_K, b, seqlen_q, seqlen_k, VARLEN)
    row_base = b.to(tl.int64) * stride_lb + h * stride_lh + q_start  # LSE / D / dropout-RNG row
    row = row_base + offs_m
    if VARLEN:
        if m0 >= seqlen_q:
            return
        b = 0  # from here on b is only the descriptors' first coordinate
    q = Q_desc.load([b, q_start + m0, h, 0]).reshape([BLOCK_M, HEAD_DIM])
    do = DO_desc.load([b, q_start + m0, h, 0]).reshape([BLOCK_M, HEAD_DIM])
    lse2 = tl.load(LSE2 + row, mask=offs_m < seqlen_q, other=float("inf"))
    delta = tl.load(Delta + row, mask=offs_m < seqlen_q, other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    lo, full_lo, full_hi, hi = key_tiles(m0, seqlen_q, seqlen_k, window_left, window_right,
                                         BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT)
    if MASK_LEFT:
        dq = _dq_tiles(dq, q, do, lse2, delta, K_desc, V_desc, b, hk, m0, k_start, lo, full_lo,
                       seqlen_q, seqlen_k, qk_scale, window_left, window_right,
                       softcap_scale, softcap_log2, slope_log2, dropout_p, seed, rng_offset, row_base, rng_cols,
                       BLOCK_M, BLOCK_N, HEAD_DIM, True, MASK_LEFT, MASK_RIGHT,
                       HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, DOT_PRECISION)
    dq = _dq_tiles(dq, q, do, lse2, delta, K_desc, V_desc, b, hk, m0, k_start, full_lo, full_hi,
                   seqlen_q, seqlen_k, qk_scale, window_left, window_right,
                   softcap_scale, softcap_log2, slope_log2, dropout_p, seed, rng_offset, row_base, rng_cols,
                   BLOCK_M, BLOCK_N, HEAD_DIM, False, MASK_LEFT, MASK_RIGHT,
                   HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, DOT_PRECISION)
    dq = _dq_tiles(dq, q, do, lse2, delta, K_desc, V_desc, b, hk, m0, k_start, full_hi, hi,
                   seqlen_q, seqlen_k, qk_scale, window_left, window_right,
                   softcap_scale, softcap_log2, slope_log2, dropout_p, seed, rng_offset, row_base, rng_cols,
                   BLOCK_M, BLOCK_N, HEAD_DIM, True, MASK_LEFT, MASK_RIGHT,
                   HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, DOT_PRECISION)
    dq = dq * softmax_scale
    _store_tile(DQ_desc, DQ, b, q_start + m0, h, dq, q_start + seqlen_q, VARLEN)


# --------------------------------------------------------------------------------------
# Launch configuration
# --------------------------------------------------------------------------------------


def fwd_config(head_dim_pad: int, dtype: torch.dtype, causal: bool) -> TileConfig:
    """Tiles measured best on an H200 (bf16, N = 16k; benchmarks/tune_attention.py; the
    alternatives in docs/tuning.md).

    Warp specialisation (``tl.range(..., warp_specialize=True)``) measured no faster than
    plain software pipelining for this kernel on sm_90 with Triton 3.6, and with 4 warps it
    failed to compile, so no config uses it.
    """
    if INTERPRET:
        return TileConfig(16, 32, 4, 1)  # dropout's key tiles are multiples of 32
    if head_dim_pad <= 128:
        return TileConfig(64, 64, 4, 3)
    return TileConfig(64, 32, 4, 3) if causal else TileConfig(128, 64, 8, 3)


def bwd_config(head_dim_pad: int, dtype: torch.dtype, causal: bool) -> tuple[TileConfig, TileConfig]:
    """(dK/dV config, dQ config), measured on an H200 (bf16, N = 16k; alternatives in docs/tuning.md).

    Avoid dK/dV tiles with BLOCK_M == HEAD_DIM and BLOCK_N = 128: Triton 3.6 miscompiled
    the non-causal kernel on sm_90 (dK, dV off by ~80 % relative, measured for (64, 128) at
    d = 64 and (128, 128) at d = 128), while the same configs were correct for causal masks
    and in the interpreter.  (64, 64) at d = 64 measured correct (relative error 2.4e-3,
    as every other tile).
    """
    if INTERPRET:
        return TileConfig(16, 32, 4, 1), TileConfig(16, 32, 4, 1)
    if head_dim_pad <= 32:
        return TileConfig(64, 128, 8, 2), TileConfig(64, 64, 4, 3)
    if head_dim_pad <= 64:
        # 357 / 370 TFLOP/s of backward at N = 16k (non-causal / causal) against 340 / 333
        # with (32, 128) key tiles (benchmarks/tune_attention.py --bwd --headdims 64).
        return TileConfig(64, 64, 4, 3), TileConfig(64, 64, 4, 3)
    if head_dim_pad <= 128:
        # 32 queries per step keeps the dK/dV kernel's spills at tens of bytes instead of
        # hundreds (benchmarks/kernel_report.py): 393 / 401 TFLOP/s of backward at d = 128,
        # N = 16k (non-causal / causal) against 325 / 343 with 64 queries.
        return TileConfig(32, 128, 8, 3), TileConfig(64, 64, 4, 3)
    return TileConfig(64, 64, 8, 2), TileConfig(128, 64, 8, 2)


# --------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------


def _dropout_args(dropout: tuple | None) -> dict:
    """``dropout = (p, seed, offset)`` or None -> kernel arguments (see ``flashtile/kernels/dropout.py``)."""
    p, seed, offset = dropout if dropout is not None else (0.0, 0, 0)
    return dict(HAS_DROPOUT=p > 0, dropout_p=float(p), seed=int(seed), rng_offset=int(offset))


class Layout:
    """Dense ``(batch, seqlen, heads, d)`` or packed ``(total, heads, d)`` inputs, as the kernels see them.

    Both are addressed through host TMA descriptors: a packed tensor is viewed as one batch
    entry ``(1, total, heads, d)`` and the kernels offset rows by cu_seqlens (see the module
    docstring for what keeps sequences apart).
    """

    def __init__(self, q, k, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0,
                 block_table=None):
        self.varlen = cu_seqlens_q is not None
        self.nheads, self.nheads_k = q.shape[-2], k.shape[-2]
        # Paged K/V (packed queries only): k, v are (num_blocks, page_size, heads_k, d) pages
        # that block_table maps each sequence's keys to; cu_seqlens_k gives the lengths.
        self.block_table = block_table
        if self.varlen:
            self.batch = cu_seqlens_q.numel() - 1
            self.seqlen_q, self.seqlen_k = max_seqlen_q, max_seqlen_k  # grid extent; kernels read the rest
            # What the kernels' seqlen arguments carry for a packed batch: the row counts that
            # bound every cu_seqlens value (see sequence_bounds).  Paged keys have no packed
            # rows: their lengths are bounded by each sequence's pages instead (see _kv_tile).
            self.rows_q = q.shape[0]
            self.rows_k = k.shape[0] if block_table is None else 2**31 - 1
            # The kernels read cu_seqlens[b] at offset b: a strided view is copied first.
            self.cu_q, self.cu_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
            self.lse_shape = (self.nheads, q.shape[0])
            self.lse_strides = (0, q.shape[0])  # (batch, head): packed rows are already offset
            self.rng_cols = max_seqlen_k  # dropout counters: row * rng_cols + key
        else:
            self.batch, self.seqlen_q = q.shape[0], q.shape[1]
            self.seqlen_k = k.shape[1]
            self.rows_q, self.rows_k = self.seqlen_q, self.seqlen_k
            self.cu_q = self.cu_k = None
            self.lse_shape = (self.batch, self.nheads, self.seqlen_q)
            self.lse_strides = (self.nheads * self.seqlen_q, self.seqlen_q)
            self.rng_cols = self.seqlen_k

    def prepare(self, t):
        return tma_ready(t)

    def tiles(self, t, rows, hd, make=None):
        """A ``[1, rows, 1, hd]``-box descriptor over ``t`` (``make``: the descriptor factory,
        default ``descriptor``; the Gluon kernels pass theirs)."""
        make = make or descriptor
        if not self.varlen:
            return make(t, rows, hd)
        if t.shape[0] == 0:
            # A descriptor needs a non-empty shape; with no rows no program reads or writes one.
            t = t.new_zeros((1, *t.shape[1:]))
        return make(t.unsqueeze(0), rows, hd)

    def seq_args(self, placeholder):
        cu_q = self.cu_q if self.varlen else placeholder
        cu_k = self.cu_k if self.varlen else placeholder
        return cu_q, cu_k, *self.lse_strides


def _unpad(x, d):
    # Contiguous like the custom ops' fake implementations promise (a copy only for padded head dims).
    return x[..., :d].contiguous() if x.shape[-1] != d else x


@functools.lru_cache(maxsize=None)
def _unpaged_args(device: torch.device) -> tuple:
    """The kernel's ``paged_kv`` tuple without paged keys: placeholders it never reads (not
    ``PAGED``), one constant tuple per device, so the launch layer classifies it once."""
    placeholder = torch.empty(4, dtype=torch.float32, device=device)
    return launch_constant((placeholder, placeholder, placeholder, 0, 0, 0, 0, 0, 0, 0, 0, 0))


def _fast_descriptor(t, rows, hd):
    """``descriptor(t, rows, hd)`` (a ``[1, rows, 1, hd]`` box over ``t``) without
    ``TensorDescriptor``'s per-call checks where they are known to pass: ``t`` is
    ``tma_ready`` (16-byte aligned base and strides, unit last stride; checked again here),
    non-empty, and the box was validated once (``_checked_box``).  Anything else goes
    through the checked constructor, which raises as before."""
    shape, strides = list(t.shape), list(t.stride())
    elt = t.element_size()
    if (0 in shape or strides[-1] != 1 or t.data_ptr() & 15 or len(shape) != 4
            or any((s * elt) & 15 for s in strides[:-1]) or not _checked_box(rows, hd)):
        return descriptor(t, rows, hd)
    desc = object.__new__(TensorDescriptor)
    desc.__dict__.update(base=t, shape=shape, strides=strides, block_shape=[1, rows, 1, hd], padding="zero")
    return desc


@functools.lru_cache(maxsize=None)
def _checked_box(rows: int, hd: int) -> bool:
    from triton._utils import validate_block_shape

    try:
        validate_block_shape([1, rows, 1, hd])
    except (AssertionError, ValueError):
        return False
    return True


# The forward's runtime arguments that change from call to call (dropout's seed and counter
# offset), for the launch layer's key.
_FWD_DYNAMIC = (25, 26)


def _forward(layout, q, k, v, softmax_scale, window_left, window_right, config, softcap, alibi_slopes, dropout):
    if config is None and forward_engine(q, k, dropout, softcap, alibi_slopes,
                                         paged=layout.block_table is not None) == "gluon":
        from flashtile.kernels.hopper import attention_fwd

        return attention_fwd.forward(layout, q, k, v, softmax_scale, window_left, window_right)
    d = q.shape[-1]
    hd = padded_headdim(d)
    cfg = config or fwd_config(hd, q.dtype, window_right >= 0)
    q_ = layout.prepare(q)
    out_ = torch.empty(q_.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(layout.lse_shape, dtype=torch.float32, device=q.device)
    grid = (cdiv(layout.seqlen_q, cfg.block_m) * layout.batch * layout.nheads,)
    mods = score_mod_args(softmax_scale, softcap, alibi_slopes, lse)
    drop = _dropout_args(dropout)
    table = layout.block_table
    if table is None:
        k_desc = layout.tiles(layout.prepare(k), cfg.block_n, hd, _fast_descriptor)
        v_desc = layout.tiles(layout.prepare(v), cfg.block_n, hd, _fast_descriptor)
        paged_kv, stride_bt, page_size = _unpaged_args(q.device), 0, 1
    else:
        # Gathered through the block table, not TMA: the key descriptors are never read.
        k_desc = v_desc = layout.tiles(q_, cfg.block_n, hd, _fast_descriptor)
        table = table if table.stride(1) == 1 else table.contiguous()
        paged_kv = (k, v, table, k.shape[0], table.shape[1], d, *k.stride()[:3], *v.stride()[:3])
        stride_bt, page_size = table.stride(0), k.shape[1]
    launch(_attn_fwd, grid, (
        layout.tiles(q_, cfg.block_m, hd, _fast_descriptor), k_desc, v_desc, paged_kv, stride_bt,
        layout.tiles(out_, cfg.block_m, hd, _fast_descriptor), out_, lse, mods["alibi"], mods["stride_ab"], *layout.seq_args(lse),
        layout.rows_q, layout.rows_k, layout.seqlen_q, layout.nheads, layout.nheads // layout.nheads_k,
        softmax_scale * LOG2E, window_left, window_right,
        mods["softcap_scale"], mods["softcap_log2"], drop["dropout_p"], drop["seed"], drop["rng_offset"],
        layout.rng_cols,
    ), dict(
        HEAD_DIM=hd, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        MASK_LEFT=window_left >= 0, MASK_RIGHT=window_right >= 0,
        HAS_SOFTCAP=mods["HAS_SOFTCAP"], HAS_ALIBI=mods["HAS_ALIBI"], HAS_DROPOUT=drop["HAS_DROPOUT"],
        VARLEN=layout.varlen,
        DOT_PRECISION=dot_precision(q.dtype),
        PAGED=table is not None, PAGE_SIZE=page_size,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    ), dynamic=_FWD_DYNAMIC)
    return _unpad(out_, d), lse


def _backward(layout, dout, q, k, v, out, lse, softmax_scale, window_left, window_right, dlse, configs,
              softcap, alibi_slopes, dropout, deterministic):
    d = q.shape[-1]
    hd = padded_headdim(d)
    cfg_kv, cfg_q = configs or bwd_config(hd, q.dtype, window_right >= 0)
    q_, k_, v_, do_ = (layout.prepare(t) for t in (q, k, v, dout))
    nheads, nheads_k, batch = layout.nheads, layout.nheads_k, layout.batch
    # The kernels address LSE-shaped tensors with the layout's contiguous strides; a view
    # (ring attention passes the back half of each row's LSE) is copied first.
    lse = lse.contiguous()
    dlse = dlse.contiguous() if dlse is not None else None
    seq = layout.seq_args(lse)

    delta = torch.empty_like(lse)
    lse2 = torch.empty_like(lse)
    pre_m = 64 if not INTERPRET else 16
    # Packed tensors have no batch dimension: batch stride 0, rows offset by cu_seqlens.
    o_strides = (0, out.stride(0), out.stride(1)) if layout.varlen else (out.stride(0), out.stride(1), out.stride(2))
    do_strides = (0, dout.stride(0), dout.stride(1)) if layout.varlen else (dout.stride(0), dout.stride(1), dout.stride(2))
    _bwd_preprocess[(cdiv(layout.seqlen_q, pre_m) * batch * nheads,)](
        out, dout, dlse if dlse is not None else lse, lse, delta, lse2, seq[0], seq[2], seq[3],
        *o_strides, *do_strides, layout.rows_q, layout.seqlen_q, nheads, d,
        HAS_DLSE=dlse is not None, VARLEN=layout.varlen, BLOCK_M=pre_m, HEAD_DIM=hd,
    )
    if configs is None and backward_engine(q, k, dropout, softcap, alibi_slopes, deterministic) == "gluon":
        from flashtile.kernels.hopper import attention_bwd

        dq_, dk_, dv_ = attention_bwd.backward(layout, q_, k_, v_, do_, lse2, delta, d, softmax_scale,
                                               window_left, window_right)
        return _unpad(dq_, d), _unpad(dk_, d), _unpad(dv_, d)

    dq_ = torch.empty(q_.shape, dtype=q.dtype, device=q.device)
    dk_ = torch.empty(k_.shape, dtype=k.dtype, device=k.device)
    dv_ = torch.empty(v_.shape, dtype=v.dtype, device=v.device)
    mods = score_mod_args(softmax_scale, softcap, alibi_slopes, lse)
    drop = _dropout_args(dropout)
    common = dict(MASK_LEFT=window_left >= 0, MASK_RIGHT=window_right >= 0,
                  DOT_PRECISION=dot_precision(q.dtype), HEAD_DIM=hd, VARLEN=layout.varlen,
                  HAS_SOFTCAP=mods["HAS_SOFTCAP"], HAS_ALIBI=mods["HAS_ALIBI"], HAS_DROPOUT=drop["HAS_DROPOUT"])
    rng = (drop["dropout_p"], drop["seed"], drop["rng_offset"], layout.rng_cols)
    group = nheads // nheads_k
    tiles = layout.tiles
    _attn_bwd_dkdv[(cdiv(layout.seqlen_k, cfg_kv.block_n) * batch * nheads_k,)](
        tiles(q_, cfg_kv.block_m, hd), tiles(k_, cfg_kv.block_n, hd), tiles(v_, cfg_kv.block_n, hd),
        tiles(do_, cfg_kv.block_m, hd), tiles(dk_, cfg_kv.block_n, hd), tiles(dv_, cfg_kv.block_n, hd), dk_, dv_,
        lse2, delta, mods["alibi"], mods["stride_ab"], *seq,
        layout.rows_q, layout.rows_k, layout.seqlen_k, nheads_k, group,
        softmax_scale * LOG2E, softmax_scale, window_left, window_right,
        mods["softcap_scale"], mods["softcap_log2"], *rng,
        BLOCK_M=cfg_kv.block_m, BLOCK_N=cfg_kv.block_n, **common,
        num_warps=cfg_kv.num_warps, num_stages=cfg_kv.num_stages,
    )
    _attn_bwd_dq[(cdiv(layout.seqlen_q, cfg_q.block_m) * batch * nheads,)](
        tiles(q_, cfg_q.block_m, hd), tiles(k_, cfg_q.block_n, hd), tiles(v_, cfg_q.block_n, hd),
        tiles(do_, cfg_q.block_m, hd), tiles(dq_, cfg_q.block_m, hd), dq_,
        lse2, delta, mods["alibi"], mods["stride_ab"], *seq,
        layout.rows_q, layout.rows_k, layout.seqlen_q, nheads, group,
        softmax_scale * LOG2E, softmax_scale, window_left, window_right,
        mods["softcap_scale"], mods["softcap_log2"], *rng,
        BLOCK_M=cfg_q.block_m, BLOCK_N=cfg_q.block_n, **common,
        num_warps=cfg_q.num_warps, num_stages=cfg_q.num_stages,
    )
    return _unpad(dq_, d), _unpad(dk_, d), _unpad(dv_, d)


def attention_forward(q, k, v, softmax_scale, window_left=-1, window_right=-1, config=None, softcap=0.0,
                      alibi_slopes=None, dropout=None):
    """Forward. q ``(b, nq, h, d)``, k/v ``(b, nk, hk, d)`` -> (out like q, lse ``(b, h, nq)`` fp32).

    ``dropout``: ``(p, seed, offset)`` or None (see ``flashtile.dropout``)."""
    return _forward(Layout(q, k), q, k, v, softmax_scale, window_left, window_right, config, softcap, alibi_slopes,
                    dropout)


def attention_backward(dout, q, k, v, out, lse, softmax_scale, window_left=-1, window_right=-1,
                       deterministic=False, dlse=None, configs=None, softcap=0.0, alibi_slopes=None, dropout=None):
    """Backward: the preprocess, then the Gluon kernel on Hopper (dQ added with atomics) or the
    ``tl.*`` dK/dV and dQ kernels (no atomics: bitwise reproducible), the latter always when
    ``deterministic``."""
    return _backward(Layout(q, k), dout, q, k, v, out, lse, softmax_scale, window_left, window_right, dlse,
                     configs, softcap, alibi_slopes, dropout, deterministic)


def varlen_attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, window_left=-1, window_right=-1,
                             softcap=0.0, alibi_slopes=None, max_seqlen_q=None, max_seqlen_k=None, config=None,
                             dropout=None, block_table=None):
    """Packed forward: q ``(total_q, h, d)``, k/v ``(total_k, hk, d)`` -> (out, lse ``(h, total_q)``).

    One launch for the whole batch; ``max_seqlen_*`` size the grid (computed with a host sync
    when not given).  With ``block_table`` int32 ``(batch, max_blocks)``, k / v are a paged
    cache ``(num_blocks, page_size, hk, d)`` and sequence b's key j sits in page
    ``block_table[b, j // page_size]``, row ``j % page_size``."""
    layout = Layout(q, k, cu_seqlens_q, cu_seqlens_k, *_max_seqlens(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k),
                    block_table=block_table)
    return _forward(layout, q, k, v, softmax_scale, window_left, window_right, config, softcap, alibi_slopes,
                    dropout)


def varlen_attention_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, softmax_scale, window_left=-1,
                              window_right=-1, softcap=0.0, alibi_slopes=None, dlse=None, max_seqlen_q=None,
                              max_seqlen_k=None, configs=None, dropout=None, deterministic=False):
    layout = Layout(q, k, cu_seqlens_q, cu_seqlens_k, *_max_seqlens(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))
    return _backward(layout, dout, q, k, v, out, lse, softmax_scale, window_left, window_right, dlse, configs,
                     softcap, alibi_slopes, dropout, deterministic)


def _max_seqlens(cu_q, cu_k, max_q, max_k):
    if max_q is None:
        max_q = int((cu_q[1:] - cu_q[:-1]).max())
    if max_k is None:
        max_k = int((cu_k[1:] - cu_k[:-1]).max())
    return max_q, max_k
