"""The attention backward in ``tl.*``, by recomputation from the LSE: kernels, tiles, launchers.

  1. ``_bwd_preprocess``: D_i = rowsum(dO_i * O_i) (minus dLSE_i), and the LSE in log2
     units with empty rows turned to +inf so their recomputed P is exactly 0.
  2. ``_attn_bwd_dkdv``: one program per (key tile, batch * kv-head) holds K_j, V_j and loops
     over the query tiles (and over the query heads of its GQA group), recomputing
     P = exp2(Q K^T * scale*log2e - LSE*log2e); dV += P^T dO, dK += dS^T Q.
  3. ``_attn_bwd_dq``: one program per (query tile, batch * head) loops over key tiles:
     dQ += dS K.  No atomics anywhere, so the backward is bitwise deterministic.  (Folding
     dQ into step 2 with atomics measured 25-45 % slower on an H200: docs/tuning.md.)

Like the forward, each pass walks its tiles in up to three runs (``query_tiles`` /
``key_tiles``) so that only the edge tiles pay for the mask.  On Hopper, where
``engine.backward_engine`` picks it (at head dims up to 64 not for masked calls below 2048
rows), steps 2 and 3 run as the Gluon kernel of ``flashtile/kernels/hopper/attention_bwd.py``
instead (dQ added into an fp32 workspace), or -- where ``engine.separate_dq`` says so:
deterministic calls, short masked ones, head dims 129-256 -- step 2 alone as that kernel
(``attention_bwd_wide.py`` above 128) and step 3 as here for deterministic calls up to head
dim 64, else as the Gluon ``attention_bwd_dq.py`` (``engine.separate_dq_engine``).
"""

from __future__ import annotations

import functools
import sys

import torch
import triton
import triton.language as tl

from flashtile.kernels.attention.layout import Layout, dropout_args, max_seqlens, store_tile, unpad
from flashtile.kernels.dropout import dropout_scale
from flashtile.kernels.engine import (backward_engine, engine_setting, separate_dq, separate_dq_engine,
                                      short_masked_backward)
from flashtile.kernels.launch import bind, launch
from flashtile.kernels.masking import key_tiles, query_tiles
from flashtile.kernels.online_softmax import LOG2E, alibi_slope_log2, recompute_p, score_mod_args, softcap_grad
from flashtile.kernels.plans import NO_PLAN, PENDING, PlanCache, stand_ins
from flashtile.kernels.runtime import INTERPRET, TileConfig, cdiv, dot_precision
from flashtile.kernels.tile_info import sequence_bounds, tile_and_head
from flashtile.kernels.tma import DescriptorTemplate, padded_headdim, tma_strides
from flashtile.semantics.params import AttentionParams


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
    row_base = b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh + q_start  # LSE / D / dropout-RNG row
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
def _dq_from_workspace(ACC, DQ, rows, headdim, scale, HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    """``DQ = scale * ACC[:, :headdim]`` rounded to DQ's dtype: the Gluon backward's fp32 dQ
    workspace (rows of ``HEAD_DIM``, the padded head dim) into dQ (rows of ``headdim``)."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    c = tl.arange(0, HEAD_DIM)
    mask = (r < rows)[:, None] & (c < headdim)[None, :]
    acc = tl.load(ACC + r[:, None] * HEAD_DIM + c[None, :], mask=mask)
    tl.store(DQ + r[:, None] * headdim + c[None, :], (acc * scale).to(DQ.dtype.element_ty), mask=mask)


@triton.jit
def _dkdv_tiles(
    dk, dv, k, v, Q_desc, DO_desc, LSE2, Delta, b, h, q_start, row_base, n0, start, end, seq, mods, rng,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    MASKED: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Accumulate one query run's contribution to dK, dV of the resident key tile.

    Scores the transposed tile (keys x queries) with K, V as the left (A) operand, so P^T
    and dS^T feed the dV / dK products directly (the other orientation -- K and V as the
    right operand, P and dS transposed -- spilled more in the offline register report).
    ``seq``, ``mods`` and ``rng`` are the bundles of ``online_softmax`` and ``dropout``, built once
    per kernel.  The constexprs stay separate arguments: Triton turns a constexpr into a tensor
    when a tuple holding it is assigned or unpacked.
    """
    seqlen_q = seq[0]
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
        pT, tanhT = recompute_p(qkT, offs_m[None, :], offs_n[:, None], lse2[None, :], seq, mods,
                                MASKED, MASK_LEFT, MASK_RIGHT, HAS_SOFTCAP, HAS_ALIBI)
        dropT = dropout_scale(rng, row_base + m0, n0, BLOCK_M, BLOCK_N, HAS_DROPOUT, KEYS_FIRST=True)
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
    seq = (seqlen_q, seqlen_k, window_left, window_right)
    rng = (dropout_p, seed, rng_offset, rng_cols)
    # GQA: the query heads of one group all read this K/V tile; summing their
    # contributions here gives dK/dV without atomics or a K/V copy.
    for g in range(0, group):
        h = hk * group + g
        rows = batch.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh + q_start  # this head's LSE / D rows
        slope_log2 = alibi_slope_log2(ALIBI, stride_ab, batch, h, HAS_ALIBI)
        mods = (qk_scale, softcap_scale, softcap_log2, slope_log2)  # per head: its ALiBi slope
        if MASK_RIGHT:
            dk, dv = _dkdv_tiles(dk, dv, k, v, Q_desc, DO_desc, LSE2, Delta, b, h, q_start, rows, n0, lo, full_lo,
                                 seq, mods, rng, BLOCK_M, BLOCK_N, HEAD_DIM, True, MASK_LEFT, MASK_RIGHT,
                                 HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, DOT_PRECISION)
        dk, dv = _dkdv_tiles(dk, dv, k, v, Q_desc, DO_desc, LSE2, Delta, b, h, q_start, rows, n0, full_lo, full_hi,
                             seq, mods, rng, BLOCK_M, BLOCK_N, HEAD_DIM, False, MASK_LEFT, MASK_RIGHT,
                             HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, DOT_PRECISION)
        if MASK_LEFT:
            dk, dv = _dkdv_tiles(dk, dv, k, v, Q_desc, DO_desc, LSE2, Delta, b, h, q_start, rows, n0, full_hi, hi,
                                 seq, mods, rng, BLOCK_M, BLOCK_N, HEAD_DIM, True, MASK_LEFT, MASK_RIGHT,
                                 HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, DOT_PRECISION)
    store_tile(DV_desc, DV, b, k_start + n0, hk, dv, k_start + seqlen_k, VARLEN)
    dk = dk * softmax_scale
    store_tile(DK_desc, DK, b, k_start + n0, hk, dk, k_start + seqlen_k, VARLEN)


@triton.jit
def _dq_tiles(
    dq, q, do, lse2, delta, K_desc, V_desc, b, hk, m0, k_start, start, end, seq, mods, rng, rng_row,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    MASKED: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Accumulate one key run's contribution to dQ of the resident query tile.

    ``seq``, ``mods`` and ``rng`` are the bundles of ``online_softmax`` and ``dropout``, built once
    per kernel.  The constexprs stay separate arguments: Triton turns a constexpr into a tensor
    when a tuple holding it is assigned or unpacked.  ``rng_row``: the head's first dropout row.
    """
    offs_m = m0 + tl.arange(0, BLOCK_M)
    for start_n in range(start, end, BLOCK_N):
        k = K_desc.load([b, k_start + start_n, hk, 0]).reshape([BLOCK_N, HEAD_DIM])
        v = V_desc.load([b, k_start + start_n, hk, 0]).reshape([BLOCK_N, HEAD_DIM])
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        p, tanh = recompute_p(qk, offs_m[:, None], offs_n[None, :], lse2[:, None], seq, mods,
                              MASKED, MASK_LEFT, MASK_RIGHT, HAS_SOFTCAP, HAS_ALIBI)
        drop = dropout_scale(rng, rng_row + m0, start_n, BLOCK_M, BLOCK_N, HAS_DROPOUT)
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
    row_base = b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh + q_start  # LSE / D / dropout-RNG row
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
    seq = (seqlen_q, seqlen_k, window_left, window_right)
    mods = (qk_scale, softcap_scale, softcap_log2, slope_log2)
    rng = (dropout_p, seed, rng_offset, rng_cols)
    if MASK_LEFT:
        dq = _dq_tiles(dq, q, do, lse2, delta, K_desc, V_desc, b, hk, m0, k_start, lo, full_lo,
                       seq, mods, rng, row_base, BLOCK_M, BLOCK_N, HEAD_DIM, True, MASK_LEFT, MASK_RIGHT,
                       HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, DOT_PRECISION)
    dq = _dq_tiles(dq, q, do, lse2, delta, K_desc, V_desc, b, hk, m0, k_start, full_lo, full_hi,
                   seq, mods, rng, row_base, BLOCK_M, BLOCK_N, HEAD_DIM, False, MASK_LEFT, MASK_RIGHT,
                   HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, DOT_PRECISION)
    dq = _dq_tiles(dq, q, do, lse2, delta, K_desc, V_desc, b, hk, m0, k_start, full_hi, hi,
                   seq, mods, rng, row_base, BLOCK_M, BLOCK_N, HEAD_DIM, True, MASK_LEFT, MASK_RIGHT,
                   HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, DOT_PRECISION)
    dq = dq * softmax_scale
    store_tile(DQ_desc, DQ, b, q_start + m0, h, dq, q_start + seqlen_q, VARLEN)


# --------------------------------------------------------------------------------------
# Tiles and launchers
# --------------------------------------------------------------------------------------


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


def _preprocess_launch(layout, out, dout, lse, dlse, delta, lse2, d):
    """``(kernel, grid, args, options)`` of the preprocess (delta and the LSE in log2 units)."""
    hd = padded_headdim(d)
    pre_m = 64 if not INTERPRET else 16
    cu_q, _, stride_lb, stride_lh = layout.seq_args(lse)
    # Packed tensors have no batch dimension: batch stride 0, rows offset by cu_seqlens.
    o_strides = (0, out.stride(0), out.stride(1)) if layout.varlen else (out.stride(0), out.stride(1), out.stride(2))
    do_strides = (0, dout.stride(0), dout.stride(1)) if layout.varlen else (dout.stride(0), dout.stride(1), dout.stride(2))
    args = (out, dout, dlse if dlse is not None else lse, lse, delta, lse2, cu_q, stride_lb, stride_lh,
            *o_strides, *do_strides, layout.rows_q, layout.seqlen_q, layout.nheads, d)
    options = dict(HAS_DLSE=dlse is not None, VARLEN=layout.varlen, BLOCK_M=pre_m, HEAD_DIM=hd)
    return _bwd_preprocess, (cdiv(layout.seqlen_q, pre_m) * layout.batch * layout.nheads,), args, options


def dq_from_workspace(dq_acc, headdim, softmax_scale, dtype):
    """dQ from the Gluon backward's fp32 workspace (contiguous, the padded head dim last):
    scaled and rounded to ``dtype`` in one pass (a ``tl.*`` kernel at the copy rate; ``torch.mul``
    into a 16-bit output took 68 against 53 us on an H200, docs/tuning.md), with no fp32
    temporary beside the workspace.  The workspace, dQ, dK and dV are all alive here, so the
    caller lets go of everything else first."""
    dq = torch.empty((*dq_acc.shape[:-1], headdim), dtype=dtype, device=dq_acc.device)
    hd = dq_acc.shape[-1]
    rows = dq_acc.numel() // hd
    if rows:
        block_rows = 32 if not INTERPRET else 16
        launch(_dq_from_workspace, (cdiv(rows, block_rows),), (dq_acc, dq, rows, headdim, softmax_scale),
               dict(HEAD_DIM=hd, BLOCK_ROWS=block_rows, num_warps=4))
    return dq


def _gradient_args(layout, q_, lse, params: AttentionParams):
    """What the ``tl.*`` dK/dV and dQ kernels share: ``(ALiBi tensor and stride, the cu_seqlens
    and LSE strides, the scalars, the constexprs)``."""
    hd = padded_headdim(q_.shape[-1])
    mods = score_mod_args(params.softmax_scale, params.softcap, params.alibi_slopes, lse)
    drop = dropout_args(params.dropout)
    window_left, window_right = params.window_left, params.window_right
    common = dict(MASK_LEFT=window_left >= 0, MASK_RIGHT=window_right >= 0,
                  DOT_PRECISION=dot_precision(q_.dtype), HEAD_DIM=hd, VARLEN=layout.varlen,
                  HAS_SOFTCAP=mods["HAS_SOFTCAP"], HAS_ALIBI=mods["HAS_ALIBI"], HAS_DROPOUT=drop["HAS_DROPOUT"])
    scalars = (params.softmax_scale * LOG2E, params.softmax_scale, window_left, window_right,
               mods["softcap_scale"], mods["softcap_log2"], drop["dropout_p"], drop["seed"], drop["rng_offset"],
               layout.rng_cols)
    return (mods["alibi"], mods["stride_ab"]), layout.seq_args(lse), scalars, common


def _dkdv_launch(layout, q_, k_, v_, do_, dk_, dv_, lse2, delta, lse, params: AttentionParams, cfg):
    """``(kernel, grid, args, options)`` of the ``tl.*`` dK/dV kernel."""
    hd = padded_headdim(q_.shape[-1])
    alibi, seq, scalars, common = _gradient_args(layout, q_, lse, params)
    tiles = layout.tiles
    return _attn_bwd_dkdv, (cdiv(layout.seqlen_k, cfg.block_n) * layout.batch * layout.nheads_k,), (
        tiles(q_, cfg.block_m, hd), tiles(k_, cfg.block_n, hd), tiles(v_, cfg.block_n, hd),
        tiles(do_, cfg.block_m, hd), tiles(dk_, cfg.block_n, hd), tiles(dv_, cfg.block_n, hd), dk_, dv_,
        lse2, delta, *alibi, *seq,
        layout.rows_q, layout.rows_k, layout.seqlen_k, layout.nheads_k, layout.nheads // layout.nheads_k, *scalars,
    ), dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, **common, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _dq_launch(layout, q_, k_, v_, do_, dq_, lse2, delta, lse, params: AttentionParams, cfg):
    """``(kernel, grid, args, options)`` of the ``tl.*`` dQ kernel."""
    hd = padded_headdim(q_.shape[-1])
    alibi, seq, scalars, common = _gradient_args(layout, q_, lse, params)
    tiles = layout.tiles
    return _attn_bwd_dq, (cdiv(layout.seqlen_q, cfg.block_m) * layout.batch * layout.nheads,), (
        tiles(q_, cfg.block_m, hd), tiles(k_, cfg.block_n, hd), tiles(v_, cfg.block_n, hd),
        tiles(do_, cfg.block_m, hd), tiles(dq_, cfg.block_m, hd), dq_,
        lse2, delta, *alibi, *seq,
        layout.rows_q, layout.rows_k, layout.seqlen_q, layout.nheads, layout.nheads // layout.nheads_k, *scalars,
    ), dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, **common, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _backward(layout, dout, q, k, v, out, lse, params: AttentionParams, dlse, configs):
    d = q.shape[-1]
    hd = padded_headdim(d)
    q_, k_, v_, do_ = (layout.prepare(t) for t in (q, k, v, dout))
    # The kernels address LSE-shaped tensors with the layout's contiguous strides; a view
    # (ring attention passes the back half of each row's LSE) is copied first.
    lse = lse.contiguous()
    dlse = dlse.contiguous() if dlse is not None else None
    delta = torch.empty_like(lse)
    lse2 = torch.empty_like(lse)
    # Every launch through the launch layer: after the first call of a class, directly.
    launch(*_preprocess_launch(layout, out, dout, lse, dlse, delta, lse2, d))
    if configs is None and backward_engine(q, k, params.dropout, params.softcap, params.alibi_slopes,
                                           short_masked_backward(layout.seqlen_q, params.window_left,
                                                                 params.window_right)) == "gluon":
        from flashtile.kernels.hopper import attention_bwd

        split = separate_dq(hd, params.deterministic, layout.seqlen_q, params.window_left, params.window_right)
        dq_acc, dk_, dv_ = attention_bwd.backward(layout, q_, k_, v_, do_, lse2, delta, d, params.softmax_scale,
                                                  params.window_left, params.window_right, separate_dq=split)
        if dq_acc is None:  # engine.separate_dq: dK and dV alone; dQ in a pass whose programs own rows
            if separate_dq_engine(hd, params.deterministic) == "gluon":
                from flashtile.kernels.hopper import attention_bwd_dq

                dq_ = attention_bwd_dq.backward_dq(layout, q_, k_, v_, do_, lse2, delta, d, params.softmax_scale,
                                                   params.window_left, params.window_right)
            else:
                dq_ = torch.empty(q_.shape, dtype=q.dtype, device=q.device)
                cfg_q = bwd_config(hd, q.dtype, params.window_right >= 0)[1]
                launch(*_dq_launch(layout, q_, k_, v_, do_, dq_, lse2, delta, lse, params, cfg_q))
            return unpad(dq_, d), unpad(dk_, d), unpad(dv_, d)
        del lse2, delta  # read: dQ's conversion is the peak of memory
        return dq_from_workspace(dq_acc, d, params.softmax_scale, q.dtype), unpad(dk_, d), unpad(dv_, d)

    dq_ = torch.empty(q_.shape, dtype=q.dtype, device=q.device)
    dk_ = torch.empty(k_.shape, dtype=k.dtype, device=k.device)
    dv_ = torch.empty(v_.shape, dtype=v.dtype, device=v.device)
    cfg_kv, cfg_q = configs or bwd_config(hd, q.dtype, params.window_right >= 0)
    launch(*_dkdv_launch(layout, q_, k_, v_, do_, dk_, dv_, lse2, delta, lse, params, cfg_kv))
    launch(*_dq_launch(layout, q_, k_, v_, do_, dq_, lse2, delta, lse, params, cfg_q))
    return unpad(dq_, d), unpad(dk_, d), unpad(dv_, d)


# --- Launch plans of the dense backward --------------------------------------------------
# As the forward's (forward.py, where the reasons are spelled out): a training step runs the
# backward with a handful of shapes, each many times, and everything of its launches but the
# tensors -- the engine, tiles, grids, constexprs, the int and float arguments, the
# descriptors' shapes, strides and boxes -- is a function of the shapes, strides, dtypes and
# devices of dout, q, k, v, out and lse, the call's scalars, the engine setting and the tile
# configuration functions, so it is worked out once per such key.  A plan takes the calls the
# general path would run with no copy (TMA-ready strides, a head dim of a power of two, a
# contiguous LSE), no dropout, ALiBi or LSE gradient; the rest goes the general way.  When a
# plan is built: ``flashtile.kernels.plans``.
cache = PlanCache()
_Tensor = torch.Tensor


def clear_plans() -> None:
    """Forget the backward's launch plans and the keys seen once."""
    cache.clear()


_gluon_modules = None  # (engine, attention_bwd_wide, attention_bwd_dq), once the Gluon backward is loaded


def _config_functions() -> tuple:
    """The functions that pick the tiles, the head dim from which a separate dQ pass is the
    Gluon one, the rows below which a masked call takes that pass and those below which it
    stays on ``tl.*`` at small head dims (tests and A/B benchmarks replace them): part of the key."""
    global _gluon_modules
    hopper = sys.modules.get("flashtile.kernels.hopper.attention_bwd")
    if hopper is None:
        return (bwd_config,)
    if _gluon_modules is None:
        from flashtile.kernels import engine
        from flashtile.kernels.hopper import attention_bwd_dq, attention_bwd_wide

        _gluon_modules = engine, attention_bwd_wide, attention_bwd_dq
    engine, wide, dq = _gluon_modules
    return (bwd_config, hopper.config_for, hopper.separate_dq_config, wide.config_for, dq.config_for,
            engine.GLUON_DQ_MIN_HEADDIM, engine.SEPARATE_DQ_MAX_ROWS, engine.SHORT_MASKED_BACKWARD_ROWS)



def _plan_for(dout, q, k, v, out, lse, params: AttentionParams):
    """The plan of this call (see above), or None: the general path."""
    tensors = (dout, q, k, v, out, lse)
    if any(t.__class__ is not _Tensor for t in tensors) or torch.compiler.is_compiling():
        return None
    if params.alibi_slopes is not None or params.dropout_p > 0:
        return None
    scale, left, right, softcap = params.softmax_scale, params.window_left, params.window_right, params.softcap
    key = (dout.shape, dout.stride(), dout.dtype, dout.device, q.shape, q.stride(), q.dtype, q.device, k.shape,
           k.stride(), k.dtype, k.device, v.shape, v.stride(), v.dtype, v.device, out.shape, out.stride(), out.dtype,
           out.device, lse.shape, lse.stride(), lse.dtype, lse.device,
           scale, left, right, softcap, params.deterministic, scale.__class__, left.__class__, right.__class__,
           softcap.__class__, engine_setting(), _config_functions())
    plan = cache.plans.get(key)
    if plan is None:
        # The plan's descriptors are built over this call's tensors: a misaligned one waits.
        plan = cache.decide(key, lambda: _dense_plan(dout, q, k, v, out, lse, params),
                            ready=not (q.data_ptr() | k.data_ptr() | v.data_ptr() | dout.data_ptr()) & 15)
    return None if plan is NO_PLAN or plan is PENDING else plan


def _dense_plan(dout, q, k, v, out, lse, params: AttentionParams):
    """The launch plan of ``bwd(dout, q, k, v, out, lse, params)``: a function ``(dout, q, k, v,
    out, lse) -> (dq, dk, dv)``, or None (a call whose bases are not all 16-byte aligned), for
    tensors with these shapes, strides, dtypes and devices; None when they need the general path."""
    d = q.shape[-1]
    if (0 in q.shape or 0 in k.shape or padded_headdim(d) != d or not lse.is_contiguous()
            or lse.dtype != torch.float32 or not all(map(tma_strides, (q, k, v, dout)))):
        return None
    layout = Layout(q, k)
    device = q.device
    lse_shape = tuple(lse.shape)
    shapes = tuple(q.shape), tuple(k.shape), tuple(v.shape)
    dtype = q.dtype
    # Stand-ins for the call's outputs (``stand_ins``: overlapping, never read or written).
    sample_delta, sample_lse2, *samples = stand_ins(
        device, (lse_shape, torch.float32), (lse_shape, torch.float32), *((shape, dtype) for shape in shapes))
    kernel, grid, args, options = _preprocess_launch(layout, out, dout, lse, None, sample_delta, sample_lse2, d)
    # A call passes out, dO, the LSE (also the stand-in of the absent LSE gradient and of the
    # cu_seqlens), delta and the log2 LSE; the strides and sizes are the plan's.
    preprocess = bind(kernel, grid, options, args, tail_from=7)
    cfg_kv, cfg_q = bwd_config(d, dtype, params.window_right >= 0)
    # Each kernel's descriptors become templates over the call's tensors; a call passes those,
    # the gradients, the log2 LSE, delta, the LSE (the ALiBi and cu_seqlens stand-ins) and,
    # between them, the plan's own ALiBi stride.
    dq_kernel, dq_grid, dq_args, dq_options = _dq_launch(layout, q, k, v, dout, samples[0], sample_lse2, sample_delta,
                                                         lse, params, cfg_q)
    dq = bind(dq_kernel, dq_grid, dq_options, _templates(dq_args, 5), tail_from=12)
    stride_ab = dq_args[9]
    short = short_masked_backward(q.shape[1], params.window_left, params.window_right)
    gluon = backward_engine(q, k, None, params.softcap, None, short) == "gluon"
    finish = None  # dQ from what ``gradients`` returns for it, where that is a workspace
    if gluon:
        from flashtile.kernels.hopper import attention_bwd

        split = separate_dq(d, params.deterministic, q.shape[1], params.window_left, params.window_right)
        gluon_gradients = attention_bwd.dense_plan(layout, q, k, v, dout, sample_lse2, sample_delta,
                                                   params.softmax_scale, params.window_left, params.window_right,
                                                   split)

        gluon_dq = None  # engine.separate_dq: dQ in a separate pass, as the general path's
        if not attention_bwd.returns_dq_workspace(d, split) and separate_dq_engine(d, params.deterministic) == "gluon":
            from flashtile.kernels.hopper import attention_bwd_dq

            gluon_dq = attention_bwd_dq.dense_plan(layout, q, k, v, dout, sample_lse2, sample_delta,
                                                   params.softmax_scale, params.window_left, params.window_right)

        def gradients(q, k, v, dout, lse2, delta, lse):
            dq_acc, dk_, dv_ = gluon_gradients(q, k, v, dout, lse2, delta)
            if dq_acc is not None:
                return dq_acc, dk_, dv_
            if gluon_dq is not None:
                return gluon_dq(q, k, v, dout, lse2, delta), dk_, dv_
            dq_ = torch.empty(*shapes[0], dtype=dtype, device=device)
            dq((q, k, v, dout, dq_, dq_, lse2, delta, lse, stride_ab, lse, lse))
            return dq_, dk_, dv_

        if attention_bwd.returns_dq_workspace(d, split):
            finish = functools.partial(dq_from_workspace, headdim=d,
                                       softmax_scale=params.softmax_scale, dtype=dtype)
    else:
        dkdv_kernel, dkdv_grid, dkdv_args, dkdv_options = _dkdv_launch(layout, q, k, v, dout, *samples[1:], sample_lse2,
                                                                       sample_delta, lse, params, cfg_kv)
        dkdv = bind(dkdv_kernel, dkdv_grid, dkdv_options, _templates(dkdv_args, 6), tail_from=14)
        dkdv_stride_ab = dkdv_args[11]

        def gradients(q, k, v, dout, lse2, delta, lse):
            dq_, dk_, dv_ = (torch.empty(*shape, dtype=dtype, device=device) for shape in shapes)
            dkdv((q, k, v, dout, dk_, dv_, dk_, dv_, lse2, delta, lse, dkdv_stride_ab, lse, lse))
            dq((q, k, v, dout, dq_, dq_, lse2, delta, lse, stride_ab, lse, lse))
            return dq_, dk_, dv_

    def run(dout, q, k, v, out, lse):
        # The key fixed everything but the bases; TMA needs them 16-byte aligned.
        if (q.data_ptr() | k.data_ptr() | v.data_ptr() | dout.data_ptr()) & 15:
            return None
        delta = torch.empty(*lse_shape, dtype=torch.float32, device=device)
        lse2 = torch.empty(*lse_shape, dtype=torch.float32, device=device)
        preprocess((out, dout, lse, lse, delta, lse2, lse))
        dq_, dk_, dv_ = gradients(q, k, v, dout, lse2, delta, lse)
        if finish is None:
            return dq_, dk_, dv_
        del lse2, delta  # read: dQ's conversion (``finish``) is the peak of memory
        return finish(dq_), dk_, dv_

    return run


def _templates(args: tuple, n: int) -> tuple:
    """``args`` with its first ``n`` (descriptors) turned into templates (``DescriptorTemplate``)."""
    return tuple(DescriptorTemplate(a) if i < n else a for i, a in enumerate(args))


def bwd(dout, q, k, v, out, lse, params: AttentionParams, dlse=None, configs=None):
    """Backward: the preprocess, then the Gluon kernel on Hopper (dQ added in no fixed order; where
    ``engine.separate_dq`` says so, dK and dV alone and dQ from a separate pass) or the ``tl.*``
    dK/dV and dQ kernels (no atomics: bitwise reproducible), the latter always with ``configs``
    (``(dK/dV config, dQ config)``, replacing :func:`bwd_config`'s).
    Without ``dlse`` or ``configs``, the launches come from the plan of the call's key where there is one."""
    if dlse is None and configs is None:
        plan = _plan_for(dout, q, k, v, out, lse, params)
        if plan is not None:
            result = plan(dout, q, k, v, out, lse)
            if result is not None:
                return result
    return _backward(Layout(q, k), dout, q, k, v, out, lse, params, dlse, configs)


def varlen_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, params: AttentionParams, dlse=None,
               max_seqlen_q=None, max_seqlen_k=None, configs=None):
    """Packed backward, one launch per pass for the whole batch (``max_seqlen_*`` as in ``varlen_fwd``)."""
    layout = Layout(q, k, cu_seqlens_q, cu_seqlens_k, *max_seqlens(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))
    return _backward(layout, dout, q, k, v, out, lse, params, dlse, configs)


def attention_backward(dout, q, k, v, out, lse, softmax_scale, window_left=-1, window_right=-1,
                       deterministic=False, dlse=None, configs=None, softcap=0.0, alibi_slopes=None, dropout=None):
    """:func:`bwd` with the params as arguments; ``dropout``: ``(p, seed, offset)`` or None."""
    params = AttentionParams.from_launcher(softmax_scale, window_left, window_right, softcap, alibi_slopes, dropout,
                                           deterministic)
    return bwd(dout, q, k, v, out, lse, params, dlse, configs)


def varlen_attention_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, softmax_scale, window_left=-1,
                              window_right=-1, softcap=0.0, alibi_slopes=None, dlse=None, max_seqlen_q=None,
                              max_seqlen_k=None, configs=None, dropout=None, deterministic=False):
    """:func:`varlen_bwd` with the params as arguments; ``dropout``: ``(p, seed, offset)`` or None."""
    params = AttentionParams.from_launcher(softmax_scale, window_left, window_right, softcap, alibi_slopes, dropout,
                                           deterministic)
    return varlen_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, params, dlse, max_seqlen_q, max_seqlen_k,
                      configs)
