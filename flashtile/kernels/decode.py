"""Split-KV decoding: a few query rows against a long KV cache (flash-decoding).

(One module over 600 lines on purpose: the three kernels of a decode step -- split, combine,
append -- and their launch plans share one argument layout, the plans' dynamic positions
indexing the kernels' parameter lists, so they are read and changed together.)

Decoding reads the whole cache for a handful of query rows, so it is memory-bound, and one
program per (batch, head) would leave most SMs idle at small batch.  The cache is therefore
cut into ``num_splits`` chunks of whole key tiles; each program handles one chunk for one
(batch, kv head) and *all* query rows of that head's GQA group (``group * seqlen_q`` rows in
one tile, so each K/V tile is read once for the group), and writes a partial output and
LSE (with a single split, the final output directly: one launch in all).  The partials are
merged with the online-softmax rule (the same rule as ``flashtile.merging``) by one of two
kernels, never by the dozen elementwise torch ops the merge would take, which matter when
the whole decode step lasts a few microseconds: in an eager step of few splits, by the split
kernel's last program of each query tile to finish (one launch a step); otherwise by a
second, small kernel, on Hopper a programmatic dependent launch: launched while the split
kernel still runs, it waits (``griddepcontrol.wait``) just before it reads the partials.
The partials live in the stream's scratch (``flashtile.kernels.workspace``).

The cache is contiguous ``(batch_cache, seqlen_cache, nheads_k, d)`` (rows of sequence b at
``cache_batch_idx[b]``) or paged ``(num_blocks, page_size, nheads_k, d)`` with
``block_table[b, j // page_size]`` holding key ``j`` -- any page size: each key row's
address is computed on its own.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from flashtile.kernels import workspace
from flashtile.kernels.launch import bind, launch
from flashtile.kernels.masking import band_mask
from flashtile.kernels.online_softmax import (
    LOG2E,
    merge_state_weights,
    merged_state_lse,
    online_max,
    score_mod,
    score_mod_args,
)
from flashtile.kernels.runtime import (
    INTERPRET,
    cdiv,
    dot_precision,
    has_programmatic_launch,
    next_power_of_2,
    register_family,
    sm_count,
)
from flashtile.kernels.tma import padded_headdim

# --- Launch knobs (H200, CUDA graph; every measured alternative: docs/tuning.md) ----------
# Key tiles: 128 for a contiguous cache (batch 1, 32k: 3.0 TB/s against 2.9 with 64), but 64
# when 128-key tiles would leave the split count capped by MIN_TILES_PER_SPLIT at under half
# of what fills the GPU (NARROW_SHORT_CACHES; batch 1, 8k: 1.39 TB/s against 1.17).  A paged
# cache computes an address per key row and takes 64, or 128 when there are fewer than
# PAGED_WIDE_BELOW_SPLITS splits (batch 8, 8k, 16-token pages: 3.2 TB/s against 2.9; batch 1,
# 32k: 2.5 against 2.1); head dims above 128 take 32.
BLOCK_N = 128
NARROW_SHORT_CACHES = 1
BLOCK_N_PAGED = 64
PAGED_WIDE_BELOW_SPLITS = 16
# 4 warps: 3-20 % above 8 in every measured case (batch 1 / 8, cache 8k / 32k, contiguous and
# paged; e.g. batch 8, 8k, paged: 3.0 TB/s against 2.7).
WARPS = 4
STAGES = 3
# Splits: at most PROGRAMS_PER_SM programs per SM in one wave, each split keeping at least
# MIN_TILES_PER_SPLIT key tiles (see choose_num_splits).  A contiguous cache's 128-key tiles
# pipeline three stages of K and V (~136 KB of shared memory), so one program fits per SM:
# PROGRAMS_PER_SM_WIDE = 1 there (batch 8, 8k: 3.59 TB/s against 3.28 with 2).  Two tiles a
# split fill the GPU at short caches, where more per split left SMs idle (batch 1, 1k / 8k,
# contiguous: 379 / 2090 GB/s against 190 / 1350 with 8; paged16 255 / 1507 against 104 / 837;
# batch 8, 1k: 1912 against 1434); longer caches reach the wave's limit first either way.
PROGRAMS_PER_SM = 2
PROGRAMS_PER_SM_WIDE = 1
MIN_TILES_PER_SPLIT = 2
# Programmatic dependent launch of the combine kernel on Hopper (0: an ordinary launch).
PDL = 1
# Eager steps of up to this many splits merge them in the split kernel (its last program of
# each query tile to finish): one launch a step instead of two, which a host-bound eager
# decoding loop feels (H200 host: 23-27 us a step with one launch).  On the GPU that merge is
# serial where the combine kernel's programs merge in parallel under a programmatic launch
# (CUDA graph, batch 1, cache 1k, 8 splits: 271 GB/s against 370; 32 splits at 4k: 604
# against 1265), so steps captured in a graph, or traced by torch.compile, and steps of more
# splits keep the combine kernel.
MERGE_LAST_MAX_SPLITS = 16
# The knobs in force: these constants, overridden by ``FLASHTILE_DECODE_TUNING``
# (``"block_n=64,warps=4"``; benchmarks/tune_decode.py sweeps them on a GPU).
TUNING = register_family("decode", "FLASHTILE_DECODE_TUNING", {
    "block_n": (BLOCK_N, "key tile of a contiguous cache (head dims above 128: 32)"),
    "narrow_short_caches": (NARROW_SHORT_CACHES, "1: 64-key tiles where 128-key ones would leave under half the "
                            "splits that fill the GPU"),
    "block_n_paged": (BLOCK_N_PAGED, "key tile of a paged cache"),
    "paged_wide_below_splits": (PAGED_WIDE_BELOW_SPLITS, "a paged cache takes 128-key tiles below this many splits"),
    "warps": (WARPS, "num_warps of the split kernel"),
    "stages": (STAGES, "num_stages of the split kernel (fewer where shared memory runs out)"),
    "programs_per_sm": (PROGRAMS_PER_SM, "split programs per SM in one wave"),
    "programs_per_sm_wide": (PROGRAMS_PER_SM_WIDE, "the same with 128-key tiles of a contiguous cache"),
    "min_tiles_per_split": (MIN_TILES_PER_SPLIT, "key tiles each split keeps at least"),
    "pdl": (PDL, "1: the combine kernel is a programmatic dependent launch on Hopper"),
    "merge_last_max_splits": (MERGE_LAST_MAX_SPLITS, "up to this many splits the split kernel merges them itself "
                              "(0: always the combine kernel)"),
})
TUNING_ENV = TUNING.env_var
knobs = TUNING.current


@triton.jit
def _cache_slots(keys, key_ok, cache_b, b, BLOCK_TABLE, stride_bt, num_blocks, PAGED: tl.constexpr,
                 PAGE_SIZE: tl.constexpr):
    """``(cache index, row in it, ok)`` of ``keys`` (int64).  A paged cache's block table is read
    only for keys in range, and a page id outside ``[0, num_blocks)`` is not followed: its
    keys are dropped (``ok`` False) -- the launcher checks the values on the host where it
    can, and this keeps the loads in bounds where it cannot (CUDA-graph capture)."""
    if PAGED:
        page = tl.load(BLOCK_TABLE + b.to(tl.int64) * stride_bt + keys // PAGE_SIZE, mask=key_ok, other=0)
        page_ok = (page >= 0) & (page < num_blocks)
        idx = tl.where(page_ok, page, 0).to(tl.int64)
        slot = (keys % PAGE_SIZE).to(tl.int64)
        ok = key_ok & page_ok
    else:
        idx = cache_b.to(tl.int64) + tl.zeros_like(keys).to(tl.int64)
        slot = keys.to(tl.int64)
        ok = key_ok
    return idx, slot, ok


@triton.jit
def _rotary_tables(COS, SIN, rot_pos, pos_ok, offs_d, stride_cos_p, stride_cos_k, stride_sin_p, stride_sin_k,
                   seqlen_ro, half_rotary, INTERLEAVED: tl.constexpr):
    """``(partner, cos, sin, angle_ok)`` of the rows at rotary positions ``rot_pos`` (the rule of
    :mod:`flashtile.kernels.rotary`: the first ``2 * half_rotary`` features in pairs; a row
    whose position is outside the ``seqlen_ro`` rows of the tables is left unrotated).  Each
    feature is combined with its pair partner, so a tile stays one ``(rows, HEAD_DIM)``
    block: ``out = x * cos + partner * sin`` with the sign of the pair rule folded into
    ``sin`` (:func:`_rotate_rows`).

    Interleaved pairs are neighbours: the tables are loaded as contiguous ``(rows, HEAD_DIM /
    2)`` tiles and each value doubled in registers, and the partner is found in registers
    too (``partner`` is unused).  Gather loads of a ``(rows, HEAD_DIM)`` tile -- an address
    per element and thread -- took the fused append + rotary split kernel to 234-255
    registers (sm_90, benchmarks/decode_register_report.py).  Otherwise the partner is
    ``offs_d +- half_rotary`` (``half_rotary`` a runtime value), loaded a second time."""
    rotated = offs_d < 2 * half_rotary
    row_ok = pos_ok & (rot_pos >= 0) & (rot_pos < seqlen_ro)
    angle_ok = row_ok[:, None] & rotated[None, :]
    if INTERLEAVED:
        # Pair k is features (2k, 2k + 1): out_2k = x_2k cos - x_2k+1 sin, out_2k+1 = x_2k+1 cos + x_2k sin.
        ROWS: tl.constexpr = rot_pos.shape[0]
        HALF: tl.constexpr = offs_d.shape[0] // 2
        offs_k = tl.arange(0, HALF)
        table_ok = row_ok[:, None] & (offs_k < half_rotary)[None, :]
        cos_k = tl.load(COS + rot_pos[:, None] * stride_cos_p + offs_k[None, :] * stride_cos_k, mask=table_ok,
                        other=1.0).to(tl.float32)
        sin_k = tl.load(SIN + rot_pos[:, None] * stride_sin_p + offs_k[None, :] * stride_sin_k, mask=table_ok,
                        other=0.0).to(tl.float32)
        cos = tl.reshape(tl.join(cos_k, cos_k), (ROWS, 2 * HALF))
        sin = tl.reshape(tl.join(-sin_k, sin_k), (ROWS, 2 * HALF))
        partner = offs_d  # unused: the partner is found in registers
    else:
        # Pair k is features (k, k + half_rotary).
        first = offs_d < half_rotary
        pair = tl.where(first, offs_d, offs_d - half_rotary)
        partner = tl.where(first, offs_d + half_rotary, offs_d - half_rotary)
        sign = tl.where(first, -1.0, 1.0)
        partner = tl.where(rotated, partner, offs_d)
        cos = tl.load(COS + rot_pos[:, None] * stride_cos_p + pair[None, :] * stride_cos_k, mask=angle_ok,
                      other=1.0).to(tl.float32)
        sin = tl.load(SIN + rot_pos[:, None] * stride_sin_p + pair[None, :] * stride_sin_k, mask=angle_ok,
                      other=0.0).to(tl.float32) * sign[None, :]
    return partner, cos, sin, angle_ok


@triton.jit
def _rotate_rows(x, rows, partner, cos, sin, angle_ok, mask, INTERLEAVED: tl.constexpr):
    """``x`` (loaded from ``rows + offs_d`` under ``mask``, 0 elsewhere) rotated by
    :func:`_rotary_tables`' angles, in float32, rounded once to ``x``'s dtype: what
    :func:`flashtile.apply_rotary_emb` returns.  Unrotated features keep their value as it
    is (``x * 1 + partner * 0`` would turn an inf partner into NaN)."""
    if INTERLEAVED:
        # Interleaved: feature 2k's partner is 2k + 1 and back, swapped in registers.
        ROWS: tl.constexpr = x.shape[0]
        HALF: tl.constexpr = x.shape[1] // 2
        even, odd = tl.split(tl.reshape(x, (ROWS, HALF, 2)))
        xp = tl.reshape(tl.join(odd, even), (ROWS, 2 * HALF))
    else:
        xp = tl.load(rows + partner[None, :], mask=mask, other=0.0)
    return tl.where(angle_ok, x.to(tl.float32) * cos + xp.to(tl.float32) * sin, x.to(tl.float32)).to(x.dtype)


@triton.jit
def _append_valid(SEQLENS, CACHE_BATCH_IDX, BLOCK_TABLE, stride_bt, stride_btc, batch, seqlen_new, capacity,
                  cache_rows, seqlen_all, BLOCK_B: tl.constexpr, BLOCK_P: tl.constexpr, PAGED: tl.constexpr,
                  PAGE_SIZE: tl.constexpr, HAS_BATCH_IDX: tl.constexpr, HAS_SEQLENS: tl.constexpr):
    """Whether every index value of the *whole* batch lets the append write: lengths in
    ``[0, capacity - seqlen_new]``, cache rows and the pages that receive keys in
    ``[0, cache_rows)``.  An append writes nothing unless they all do, so a launch with a bad
    value (possible only where the host could not read them, in CUDA-graph capture) changes
    nothing and touches nothing out of bounds."""
    offs_b = tl.arange(0, BLOCK_B)
    b_ok = offs_b < batch
    if HAS_SEQLENS:
        lens = tl.load(SEQLENS + offs_b, mask=b_ok, other=0).to(tl.int64)
    else:
        lens = tl.zeros([BLOCK_B], tl.int64) + seqlen_all
    ok = (lens >= 0) & (lens <= capacity - seqlen_new)
    if HAS_BATCH_IDX:
        cbi = tl.load(CACHE_BATCH_IDX + offs_b, mask=b_ok, other=0)
        ok = ok & (cbi >= 0) & (cbi < cache_rows)
    if PAGED:
        # The block-table columns holding positions lens[b] ... lens[b] + seqlen_new - 1.
        col = (tl.where(ok, lens, 0) // PAGE_SIZE)[:, None] + tl.arange(0, BLOCK_P)[None, :]
        col_ok = b_ok[:, None] & ok[:, None] & (col <= ((lens + seqlen_new - 1) // PAGE_SIZE)[:, None])
        pages = tl.load(BLOCK_TABLE + offs_b[:, None].to(tl.int64) * stride_bt + col * stride_btc, mask=col_ok,
                        other=0)
        page_bad = col_ok & ((pages < 0) | (pages >= cache_rows))
        ok = ok & (tl.max(page_bad.to(tl.int32), 1) == 0)
    return tl.min(tl.where(b_ok, ok, True).to(tl.int32), 0) == 1


@triton.jit
def _append_slots(pos, t_ok, b, cache_b, BLOCK_TABLE, stride_bt, stride_btc, PAGED: tl.constexpr,
                  PAGE_SIZE: tl.constexpr):
    """``(cache index, row)`` (int64) where the appended keys at positions ``pos`` of sequence
    ``b`` land (``t_ok``: the rows to write; the others get index 0)."""
    if PAGED:
        page = tl.load(BLOCK_TABLE + b.to(tl.int64) * stride_bt + (pos // PAGE_SIZE) * stride_btc, mask=t_ok, other=0)
        idx, row = page.to(tl.int64), pos % PAGE_SIZE
    else:
        idx, row = cache_b.to(tl.int64) + tl.zeros_like(pos), pos
    return tl.where(t_ok, idx, 0), row


@triton.jit
def _decode_split(
    Q, K, V, O_PART, SEQLENS_K, CACHE_BATCH_IDX, BLOCK_TABLE, LEFTPAD, ALIBI, OUT, LSE, K_NEW, V_NEW, COS, SIN,
    ARRIVALS, seqlen_k_all, capacity, chunk, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
    stride_ab, stride_ob, stride_on, stride_oh, stride_qb, stride_qn, stride_qh, stride_bt,
    stride_knb, stride_knn, stride_knh, stride_vnb, stride_vnn, stride_vnh,
    stride_cos_p, stride_cos_k, stride_sin_p, stride_sin_k, seqlen_ro, half_rotary,
    seqlen_q, nheads_k, group, num_splits, seqlen_new, cache_rows,
    qk_scale, window_left, window_right, softcap_scale, softcap_log2,
    HAS_SEQLENS: tl.constexpr, headdim: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, HAS_BATCH_IDX: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr, DIRECT: tl.constexpr, MERGE_LAST: tl.constexpr, BLOCK_S: tl.constexpr,
    HAS_LEFTPAD: tl.constexpr, APPEND: tl.constexpr, ROTARY: tl.constexpr, INTERLEAVED: tl.constexpr,
    ROTARY_LOCAL: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_NEW: tl.constexpr,
):
    """One (sequence, KV head, split): the split's keys against every query row of the head's
    GQA group.  With ``DIRECT`` (one split) the program writes ``OUT`` / ``LSE`` itself;
    otherwise it leaves a partial output and LSE in ``O_PART`` (the outputs, then the LSEs)
    for :func:`_combine_splits`, or with ``MERGE_LAST`` for the last of the tile's splits to
    finish, which merges them (:func:`_merge_if_last`; ``ARRIVALS``: one zeroed int32 counter
    per (sequence, KV head, query tile), left zeroed).

    With ``HAS_LEFTPAD`` sequence b's keys start at cache position ``LEFTPAD[b]``: the kernel
    works on key indices counted from there (masks and ALiBi aligned to them) and reads
    position ``LEFTPAD[b] + j`` for key ``j``.

    With ``APPEND`` the call's ``seqlen_new`` new keys / values (``K_NEW``, ``V_NEW``) are part
    of the step: split 0 of each (sequence, KV head) writes them into the cache at positions
    ``SEQLENS_K[b] ...`` (``seqlen_k_all ...``) -- nothing in the whole launch unless every
    index of the batch is valid, :func:`_append_valid` -- and the split whose keys they are
    attends to them straight from ``K_NEW`` / ``V_NEW`` (rounded to the cache's dtype, as
    stored), never from the rows being written: the cache is read only below the old length,
    so no program reads what another writes.  With ``ROTARY`` the new keys are rotated at
    rotary positions ``SEQLENS_K[b] - LEFTPAD[b] + t``, and the query rows at
    ``SEQLENS_K[b] - LEFTPAD[b]`` (``+ i`` for row ``i`` with ``ROTARY_LOCAL``), as
    :func:`flashtile.apply_rotary_emb` would before the call."""
    if PDL:
        # The combine kernel may be launched now; it waits for this grid's results itself.
        gdc_launch_dependents()
    # Under torch.compile Inductor passes Python floats as fp64 (Triton's launcher: fp32); the
    # scores, the softmax state and the accumulator stay fp32 either way.
    qk_scale = tl.cast(qk_scale, tl.float32)
    softcap_scale = tl.cast(softcap_scale, tl.float32)
    softcap_log2 = tl.cast(softcap_log2, tl.float32)
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // nheads_k
    hk = pid % nheads_k
    # The keys of sequence b: its valid length before this call's append (``SEQLENS_K[b]``, or
    # ``seqlen_k_all`` for every sequence) plus the ``seqlen_new`` keys appended by the call.
    if HAS_SEQLENS:
        old_len = tl.load(SEQLENS_K + b)
    else:
        old_len = seqlen_k_all
    seqlen_k = old_len + seqlen_new
    # Index values are clamped into the cache (a length in [0, capacity], a row or page id
    # that exists): the host checks them where it can read them, not inside CUDA-graph
    # capture, and no value may make this kernel read out of bounds.
    seqlen_k = tl.minimum(tl.maximum(seqlen_k, 0), capacity)
    if HAS_BATCH_IDX:
        cache_b = tl.load(CACHE_BATCH_IDX + b)
        row_exists = (cache_b >= 0) & (cache_b < cache_rows)
        seqlen_k = tl.where(row_exists, seqlen_k, 0)
        cache_b = tl.where(row_exists, cache_b, 0)
    else:
        cache_b = b
    key_base = 0
    pad = 0
    if HAS_LEFTPAD:
        pad = tl.load(LEFTPAD + b)
        key_base = tl.minimum(tl.maximum(pad, 0), seqlen_k)
        seqlen_k = seqlen_k - key_base
    offs_d = tl.arange(0, HEAD_DIM)
    # A constexpr head dim: when it is a power of two the loads carry no column mask, so they
    # vectorise and the compiler can pipeline them (cp.async); a column mask against a runtime
    # head dim left every K/V load scalar and unpipelined.
    if headdim == HEAD_DIM:
        d_ok = offs_d < HEAD_DIM  # folded away
    else:
        d_ok = offs_d < headdim
    rot_base = tl.full([], 0, tl.int64) + old_len - pad  # the rotary position of the first new key (int64)
    start = split * chunk
    end = tl.minimum(start + chunk, seqlen_k)

    if APPEND:
        if (split == 0) & (tl.program_id(2) == 0):
            all_ok = _append_valid(SEQLENS_K, CACHE_BATCH_IDX, BLOCK_TABLE, stride_bt, 1, tl.num_programs(0) // nheads_k,
                                   seqlen_new, capacity, cache_rows, seqlen_k_all, BLOCK_B, BLOCK_P, PAGED, PAGE_SIZE,
                                   HAS_BATCH_IDX, HAS_SEQLENS)
            for t0 in tl.range(0, seqlen_new, BLOCK_T, num_stages=1):
                t = t0 + tl.arange(0, BLOCK_T)
                t_ok = (t < seqlen_new) & all_ok
                pos = tl.where(t_ok, t.to(tl.int64) + old_len, 0)
                idx, row = _append_slots(pos, t_ok, b, cache_b, BLOCK_TABLE, stride_bt, 1, PAGED, PAGE_SIZE)
                mask = t_ok[:, None] & d_ok[None, :]
                k_rows = K_NEW + b.to(tl.int64) * stride_knb + t[:, None].to(tl.int64) * stride_knn + hk * stride_knh
                kn = tl.load(k_rows + offs_d[None, :], mask=mask, other=0.0)
                if ROTARY:
                    w_partner, w_cos, w_sin, w_turn = _rotary_tables(COS, SIN, rot_base + t, t_ok, offs_d,
                                                                     stride_cos_p, stride_cos_k, stride_sin_p,
                                                                     stride_sin_k, seqlen_ro, half_rotary, INTERLEAVED)
                    kn = _rotate_rows(kn, k_rows, w_partner, w_cos, w_sin, w_turn, mask, INTERLEAVED)
                vn = tl.load(V_NEW + b.to(tl.int64) * stride_vnb + t[:, None].to(tl.int64) * stride_vnn + hk * stride_vnh
                             + offs_d[None, :], mask=mask, other=0.0)
                tl.store(K + (idx * stride_kb + row * stride_kn)[:, None] + hk * stride_kh + offs_d[None, :],
                         kn.to(K.dtype.element_ty), mask=mask)
                tl.store(V + (idx * stride_vb + row * stride_vn)[:, None] + hk * stride_vh + offs_d[None, :],
                         vn.to(V.dtype.element_ty), mask=mask)
        # Key index of the first new key: the cache is read below it, the new keys from there on.
        new_lo = old_len - key_base
        cache_end = tl.minimum(seqlen_k, new_lo)
        cache_stop = tl.minimum(end, cache_end)
    else:
        cache_end = seqlen_k
        cache_stop = end

    # Rows of the tile: query positions of the heads of the group, BLOCK_M at a time.
    rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    i = rows % seqlen_q  # query position
    h = hk * group + rows // seqlen_q  # query head
    row_ok = rows < group * seqlen_q
    q_rows = Q + b.to(tl.int64) * stride_qb + i[:, None] * stride_qn + h[:, None] * stride_qh
    q_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_rows + offs_d[None, :], mask=q_mask, other=0.0)
    if ROTARY:
        if ROTARY_LOCAL:
            q_pos = rot_base + i
        else:
            q_pos = rot_base + tl.zeros_like(i).to(tl.int64)
        q_partner, q_cos, q_sin, q_turn = _rotary_tables(COS, SIN, q_pos, row_ok, offs_d, stride_cos_p, stride_cos_k,
                                                         stride_sin_p, stride_sin_k, seqlen_ro, half_rotary, INTERLEAVED)
        q = _rotate_rows(q, q_rows, q_partner, q_cos, q_sin, q_turn, q_mask, INTERLEAVED)
    if HAS_ALIBI:
        slope_log2 = tl.load(ALIBI + b * stride_ab + h, mask=row_ok, other=0.0)[:, None] * 1.4426950408889634
    else:
        slope_log2 = 0.0

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for n0 in range(start, cache_stop, BLOCK_N):
        keys = n0 + tl.arange(0, BLOCK_N)
        idx, slot, key_ok = _cache_slots(keys + key_base, keys < cache_end, cache_b, b, BLOCK_TABLE, stride_bt,
                                         cache_rows, PAGED, PAGE_SIZE)
        k_rows = idx * stride_kb + slot * stride_kn
        v_rows = idx * stride_vb + slot * stride_vn
        kv_mask = key_ok[:, None] & d_ok[None, :]
        k = tl.load(K + k_rows[:, None] + hk * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if HAS_SOFTCAP or HAS_ALIBI:
            s, _ = score_mod(qk, i[:, None], keys[None, :], seqlen_q, seqlen_k, qk_scale, softcap_scale,
                              softcap_log2, slope_log2, HAS_SOFTCAP, HAS_ALIBI)
        else:
            s = qk * qk_scale
        visible = band_mask(i[:, None], keys[None, :], seqlen_q, seqlen_k, window_left, window_right,
                            MASK_LEFT, MASK_RIGHT)
        if PAGED or APPEND:
            # Keys behind an invalid page id; with APPEND, the new keys (attended below).
            visible = visible & key_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new, m_sub = online_max(s, m_i, 1.0, True)  # every tile may hold masked keys
        p = tl.math.exp2(s - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + v_rows[:, None] + hk * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    if APPEND:
        # This split's new keys, from K_NEW / V_NEW: the same tile step on keys that would be
        # loaded from the rows being written.
        # Tiles of BLOCK_NEW keys (the new keys are few), not software-pipelined: this loop
        # runs once or twice per program and must not add pipeline buffers to the main loop's.
        for n0 in tl.range(tl.maximum(start, new_lo), end, BLOCK_NEW, num_stages=1):
            keys = n0 + tl.arange(0, BLOCK_NEW)
            t = keys - new_lo
            t_ok = (keys < end) & (t >= 0) & (t < seqlen_new)
            kv_mask = t_ok[:, None] & d_ok[None, :]
            k_rows = K_NEW + b.to(tl.int64) * stride_knb + t[:, None].to(tl.int64) * stride_knn + hk * stride_knh
            k = tl.load(k_rows + offs_d[None, :], mask=kv_mask, other=0.0)
            if ROTARY:
                n_partner, n_cos, n_sin, n_turn = _rotary_tables(COS, SIN, rot_base + t, t_ok, offs_d, stride_cos_p,
                                                                 stride_cos_k, stride_sin_p, stride_sin_k, seqlen_ro,
                                                                 half_rotary, INTERLEAVED)
                k = _rotate_rows(k, k_rows, n_partner, n_cos, n_sin, n_turn, kv_mask, INTERLEAVED)
            k = k.to(K.dtype.element_ty)  # what the cache holds
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
            if HAS_SOFTCAP or HAS_ALIBI:
                s, _ = score_mod(qk, i[:, None], keys[None, :], seqlen_q, seqlen_k, qk_scale, softcap_scale,
                                  softcap_log2, slope_log2, HAS_SOFTCAP, HAS_ALIBI)
            else:
                s = qk * qk_scale
            visible = band_mask(i[:, None], keys[None, :], seqlen_q, seqlen_k, window_left, window_right,
                                MASK_LEFT, MASK_RIGHT) & t_ok[None, :]
            s = tl.where(visible, s, float("-inf"))
            m_new, m_sub = online_max(s, m_i, 1.0, True)
            p = tl.math.exp2(s - m_sub[:, None])
            alpha = tl.math.exp2(m_i - m_sub)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V_NEW + b.to(tl.int64) * stride_vnb + t[:, None].to(tl.int64) * stride_vnn + hk * stride_vnh
                        + offs_d[None, :], mask=kv_mask, other=0.0).to(V.dtype.element_ty)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
            m_i = m_new

    # A row with no visible key gives 0 by selection: its acc may hold 0 * inf = NaN from a
    # masked key's V, which no multiplication by 0 would clear.
    empty = l_i == 0.0
    out = tl.where(empty[:, None], 0.0, acc * (1.0 / tl.where(empty, 1.0, l_i))[:, None])
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    nheads = nheads_k * group
    batch = tl.num_programs(0) // nheads_k
    out_off = b.to(tl.int64) * stride_ob + i[:, None] * stride_on + h[:, None] * stride_oh + offs_d[None, :]
    lse_off = (b.to(tl.int64) * nheads + h) * seqlen_q + i
    if DIRECT:
        # One split: this program's result is final.
        tl.store(OUT + out_off, out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        tl.store(LSE + lse_off, lse, mask=row_ok)
    else:
        # Partials in O_PART: (splits, batch, seqlen_q, nheads, HEAD_DIM) outputs, then
        # (splits, batch, nheads, seqlen_q) LSEs.
        part = split * batch + b  # (split, batch) flattened
        o_off = ((part.to(tl.int64) * seqlen_q + i[:, None]) * nheads + h[:, None]) * HEAD_DIM + offs_d[None, :]
        tl.store(O_PART + o_off, out, mask=row_ok[:, None])
        lse_part = O_PART + (num_splits * batch * seqlen_q * nheads).to(tl.int64) * HEAD_DIM
        tl.store(lse_part + (part.to(tl.int64) * nheads + h) * seqlen_q + i, lse, mask=row_ok)
        if MERGE_LAST:
            _merge_if_last(O_PART, lse_part, OUT, LSE, ARRIVALS + pid * tl.num_programs(2) + tl.program_id(2),
                           num_splits, batch, seqlen_q, nheads, b, i, h, row_ok, offs_d, d_ok, out_off, lse_off,
                           BLOCK_M, HEAD_DIM, BLOCK_S)


@triton.jit
def _merge_if_last(O_PART, LSE_PART, OUT, LSE, ARRIVAL, num_splits, batch, seqlen_q, nheads, b, i, h, row_ok, offs_d,
                   d_ok, out_off, lse_off, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr):
    """The split-KV merge inside the split kernel: each program of a query tile counts itself
    in at ``ARRIVAL`` once its partial is stored, and the one that arrives last (whichever
    split it is) merges the tile's ``num_splits <= BLOCK_S`` partials in split order -- the
    result does not depend on which program it is -- writes ``OUT`` / ``LSE`` and zeroes the
    counter for the next launch.  What :func:`_combine_splits` computes with ``IN_ORDER``, bit
    for bit (the same steps per element), without its launch."""
    # Every thread's partial stores come before the count (a barrier), and the count is an
    # acquire-release at GPU scope: the last program's loads see every other program's stores.
    # Those loads go to L2 (``.cg``): this SM's L1 may hold the scratch's lines from an earlier launch.
    tl.debug_barrier()
    arrived = tl.atomic_add(ARRIVAL, 1, sem="acq_rel", scope="gpu")
    if arrived == num_splits - 1:
        tl.store(ARRIVAL, 0)
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        # Unrolled with masks, so the loads of every split are independent and issue together.
        for s in tl.static_range(BLOCK_S):
            part = (s * batch + b).to(tl.int64)
            s_ok = row_ok & (s < num_splits)
            lse_s = tl.load(LSE_PART + (part * nheads + h) * seqlen_q + i, mask=s_ok, other=float("-inf"),
                            cache_modifier=".cg")
            o_s = tl.load(O_PART + ((part * seqlen_q + i[:, None]) * nheads + h[:, None]) * HEAD_DIM + offs_d[None, :],
                          mask=s_ok[:, None], other=0.0, cache_modifier=".cg")
            m, alpha, w = merge_state_weights(m, lse_s)
            total = total * alpha + w
            acc = acc * alpha[:, None] + o_s * w[:, None]
        empty, lse = merged_state_lse(m, total)
        out = tl.where(empty[:, None], 0.0, acc / tl.where(empty, 1.0, total)[:, None])
        tl.store(OUT + out_off, out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        tl.store(LSE + lse_off, lse, mask=row_ok)


@triton.jit
def _combine_splits(
    O_PART, OUT, LSE, num_splits, batch, seqlen_q, nheads, headdim,
    stride_ob, stride_on, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, IN_ORDER: tl.constexpr, PDL: tl.constexpr,
):
    """One program per (batch, query row, head): the ``num_splits <= BLOCK_S`` partials
    (``O_PART``: the split kernel's partial outputs, then their LSEs) merged into one row.

    ``IN_ORDER``: merged split after split with the steps of the split kernel's own merge
    (:func:`_merge_if_last`), so that a step merged either way gives the same bits; used
    where eager steps merge in the split kernel.  Otherwise as reductions over the split axis
    (max, then weights, then a weighted sum), whose latency is shorter at many splits (CUDA
    graph, batch 1, 32k, 32 splits: 3052 / 3027 GB/s against 2904 / 2920 in order).

    With ``PDL`` the launch overlaps the split kernel's tail, and the program waits for that
    kernel's partials before reading them."""
    if PDL:
        gdc_wait()
    pid = tl.program_id(0)
    h = pid % nheads
    i = (pid // nheads) % seqlen_q
    b = pid // (nheads * seqlen_q)
    LSE_PART = O_PART + (num_splits * batch * seqlen_q * nheads).to(tl.int64) * HEAD_DIM
    offs_d = tl.arange(0, HEAD_DIM)
    if IN_ORDER:
        m = tl.full([], float("-inf"), tl.float32)
        total = tl.zeros([], tl.float32)
        acc = tl.zeros([HEAD_DIM], tl.float32)
        # Unrolled with masks, so the loads of every split are independent and issue together.
        for s in tl.static_range(BLOCK_S):
            part = (s * batch + b).to(tl.int64)
            s_ok = s < num_splits
            lse_s = tl.load(LSE_PART + (part * nheads + h) * seqlen_q + i, mask=s_ok, other=float("-inf"))
            o_s = tl.load(O_PART + ((part * seqlen_q + i) * nheads + h) * HEAD_DIM + offs_d, mask=s_ok, other=0.0)
            m, alpha, w = merge_state_weights(m, lse_s)
            total = total * alpha + w
            acc = acc * alpha + o_s * w
        empty, lse = merged_state_lse(m, total)
        out = tl.where(empty, 0.0, acc / tl.where(empty, 1.0, total))
    else:
        s = tl.arange(0, BLOCK_S).to(tl.int64)
        s_ok = s < num_splits
        lse_s = tl.load(LSE_PART + ((s * batch + b) * nheads + h) * seqlen_q + i, mask=s_ok, other=float("-inf"))
        m = tl.max(lse_s, 0)
        # Every split empty (no visible key): keep exp() finite and give zeros with LSE -inf.
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        w = tl.exp(lse_s - m_safe)
        total = tl.sum(w, 0)
        empty = total == 0.0
        w = w / tl.where(empty, 1.0, total)
        o = tl.load(O_PART + (((s[:, None] * batch + b) * seqlen_q + i) * nheads + h) * HEAD_DIM + offs_d[None, :],
                    mask=s_ok[:, None], other=0.0)
        out = tl.where(empty, 0.0, tl.sum(o * w[:, None], 0))
        lse = tl.where(empty, float("-inf"), m_safe + tl.log(tl.where(empty, 1.0, total)))
    out_off = b.to(tl.int64) * stride_ob + i.to(tl.int64) * stride_on + h.to(tl.int64) * stride_oh
    tl.store(OUT + out_off + offs_d, out.to(OUT.dtype.element_ty), mask=offs_d < headdim)
    tl.store(LSE + (b.to(tl.int64) * nheads + h) * seqlen_q + i, lse)


def choose_num_splits(batch: int, nheads_k: int, capacity: int, device: torch.device, block_n: int,
                      programs_per_sm: int = PROGRAMS_PER_SM, min_tiles: int = MIN_TILES_PER_SPLIT) -> int:
    """At most ``programs_per_sm`` programs per SM in one wave, each split keeping at least
    ``min_tiles`` key tiles.

    Measured on an H200 (cache 32k, GQA 32:4, d = 128, CUDA graph): a partial second wave
    costs more than it gains (batch 8: 9 splits 3.5-3.8 TB/s, 8 splits 4.1-4.2), and 64 splits
    of 4 tiles lost to 32 of 8 (batch 1: 2.5 TB/s against 2.9), a case that one program per
    SM for 128-key tiles (``PROGRAMS_PER_SM_WIDE``) keeps at 33 splits whatever the minimum.
    """
    sms = 1 if device.type != "cuda" else sm_count(device.index or 0)
    fill = programs_per_sm * sms // max(1, batch * nheads_k)
    return max(1, min(fill, 64, capacity // (min_tiles * block_n)))


def launch_shape(batch: int, nheads_k: int, capacity: int, device: torch.device, paged: bool, hd: int,
                 knob=None):
    """``(block_n, num_splits)``: the key tile and the automatic split count (the rules and
    their measurements are with the knobs at the top of this module)."""
    knob = knob or knobs()
    if INTERPRET:
        return 16, choose_num_splits(batch, nheads_k, capacity, device, 16)

    def splits(block_n, wide):
        per_sm = knob["programs_per_sm_wide"] if wide else knob["programs_per_sm"]
        return choose_num_splits(batch, nheads_k, capacity, device, block_n, per_sm, knob["min_tiles_per_split"])

    if hd > 128:
        return 32, splits(32, False)
    if paged:
        block_n = knob["block_n_paged"]
        num_splits = splits(block_n, False)
        if block_n == 64 and num_splits < knob["paged_wide_below_splits"]:
            # Few, long splits: wider tiles amortise the block-table reads over more rows.
            block_n, num_splits = 128, splits(128, False)
        return block_n, num_splits
    block_n = knob["block_n"]
    num_splits = splits(block_n, block_n >= 128)
    if block_n >= 128 and knob["narrow_short_caches"]:
        sms = sm_count(device.index or 0) if device.type == "cuda" else 1
        fill = knob["programs_per_sm_wide"] * sms // max(1, batch * nheads_k)
        if 2 * num_splits < fill:
            # A short cache: narrower tiles allow twice the splits at the same tiles per split.
            block_n, num_splits = 64, splits(64, False)
    return block_n, num_splits


# Query rows per program: the whole GQA group (seqlen_q * group rows) in one tile while it is
# small, so each K/V tile is read once for the group; long groups (seqlen_q up to 128 with
# MQA is a legal shape) are cut into tiles of at most MAX_TILE_ELEMENTS / head dim rows (the
# fp32 accumulator stays at 128 registers per thread with 4 warps) on a third grid axis.
MAX_TILE_ELEMENTS = 128 * 128
# Shared memory of an H100 / H200 SM available to one program, for devices that do not report
# theirs (the interpreter), so that the configs chosen there are those of the GPU.
DEFAULT_SMEM_BYTES = 232448


@functools.lru_cache(maxsize=None)
@torch.compiler.assume_constant_result  # a device query Dynamo cannot trace: a constant of the trace
def smem_budget(device_index: int | None) -> int:
    """Bytes of shared memory one program may use on that CUDA device (``None``: the default)."""
    if device_index is None or INTERPRET:
        return DEFAULT_SMEM_BYTES
    return int(triton.runtime.driver.active.utils.get_device_properties(device_index)["max_shared_mem"])


def smem_bytes(block_m: int, block_n: int, hd: int, stages: int, elt: int) -> int:
    """An upper bound of ``_decode_split``'s shared memory: the Q tile, ``stages`` buffers of a
    K and a V tile, and the P tile of the second product (checked against the compiler's
    figure on an H200: tests/test_kvcache.py::test_gpu_decode_smem_estimate_bounds_the_compiler)."""
    return elt * (block_m * hd + 2 * stages * block_n * hd + block_m * block_n)


@dataclasses.dataclass
class DecodeConfig:
    """The tiles of a decode launch (a dataclass: ``torch.compile`` traces its construction)."""

    block_m: int
    block_n: int
    stages: int
    num_splits: int


def launch_config(batch: int, nheads_k: int, capacity: int, device: torch.device, paged: bool, hd: int,
                  rows: int, elt: int, knob=None) -> DecodeConfig:
    """The tiles of a launch: :func:`launch_shape`'s key tile and splits, query tiles of up to
    ``MAX_TILE_ELEMENTS / hd`` rows, then -- while the shared memory this needs exceeds the
    device's -- fewer pipeline stages (down to 2), narrower key tiles (down to 16), shorter
    query tiles (down to 16), one stage.  ``rows``: seqlen_q * group; ``elt``: bytes per element."""
    knob = knob or knobs()
    block_n, num_splits = launch_shape(batch, nheads_k, capacity, device, paged, hd, knob)
    block_m = max(16, min(next_power_of_2(rows), max(16, MAX_TILE_ELEMENTS // hd)))
    stages = 1 if INTERPRET else knob["stages"]
    budget = smem_budget((device.index or 0) if device.type == "cuda" else None)
    while smem_bytes(block_m, block_n, hd, stages, elt) > budget:
        if stages > 2:
            stages -= 1
        elif block_n > 16:
            block_n //= 2
            num_splits = choose_num_splits(batch, nheads_k, capacity, device, block_n, knob["programs_per_sm"],
                                           knob["min_tiles_per_split"])
        elif block_m > 16:
            block_m //= 2
        elif stages > 1:
            stages -= 1
        else:
            break  # 16 x 16 tiles, one stage: a few KB whatever the head dim
    return DecodeConfig(block_m=block_m, block_n=block_n, stages=stages, num_splits=num_splits)


@functools.lru_cache(maxsize=256)
def cached_launch_config(batch: int, nheads_k: int, capacity: int, device: torch.device, paged: bool, hd: int,
                         rows: int, elt: int, tuning_text: str) -> DecodeConfig:
    """:func:`launch_config` once per shape: a decoding loop repeats one shape for thousands of
    steps, and the rule (split count, shared-memory fit) costs microseconds of Python.  Keyed
    on the ``FLASHTILE_DECODE_TUNING`` text, which selects the knobs."""
    return launch_config(batch, nheads_k, capacity, device, paged, hd, rows, elt, TUNING.parse(tuning_text))


# Positions of the int length shared by every sequence (``seqlen_k_all`` / ``seqlen_all``),
# which grows every decoding step, among the kernels' runtime arguments: a hint for the
# launch layer's key (classified each call instead of memoised by value).
_SPLIT_DYNAMIC = (_decode_split.arg_names.index("seqlen_k_all"),)
# With them, for a plan serving every key length (:func:`few_rows_plan`), the arguments that
# follow the length: the capacity, the split's chunk and the K and V strides.
_SPLIT_SIZED = tuple(range(_SPLIT_DYNAMIC[0], _decode_split.arg_names.index("stride_vh") + 1))

# --- Launch plans ------------------------------------------------------------------------
# A decoding loop calls with one shape for thousands of steps.  Everything of a launch but
# the tensors and the shared int length -- grids, constexprs and options, split count, the
# int and float arguments -- is a function of the shapes, strides, dtypes, device, flags and
# scalars of the call (and of the tuning text), so it is worked out once per such key (a
# plan) and a call only fills in its tensors and its length.  A plan also holds its kernels'
# bound launchers (:func:`flashtile.kernels.launch.bind`, built at its first launch): the
# plan's own int and float objects are passed at every call, so the launch layer keys a call
# on its tensors' dtypes and alignment and the length's class alone.  A launcher is rebuilt
# when the module's kernel is not the one it holds (tests wrap the kernels).  Bounded like
# the launch layer's memos: a workload cycling through more keys than this builds plans
# again, nothing else.
_MAX_PLANS = 256
_split_plans: dict = {}
_append_plans: dict = {}


plan_generation = object()  # replaced by clear_plans(): plans kept elsewhere (kvcache's memo) are stale


def clear_plans() -> None:
    """Forget the cached launch plans (after a test changes what a plan was built from: the
    tile constants, the device queries)."""
    global plan_generation
    _split_plans.clear()
    _append_plans.clear()
    plan_generation = object()


try:  # CPython's mapping behind os.environ: one dict look-up instead of encoding the name
    _ENVIRON = os.environ._data
    _TUNING_KEY = os.environ.encodekey(TUNING_ENV)
except AttributeError:  # another Python: read through os.environ
    _ENVIRON, _TUNING_KEY = None, None


def tuning_raw():
    """The ``FLASHTILE_DECODE_TUNING`` value as stored in the environment (``None`` when unset):
    a plan key's part that invalidates plans when the variable changes, read at the cost of
    one dict look-up per call (the text itself: :func:`tuning_text`)."""
    if _ENVIRON is not None:
        return _ENVIRON.get(_TUNING_KEY)
    return os.environ.get(TUNING_ENV)


def tuning_text(raw) -> str:
    """The variable's text from :func:`tuning_raw`'s value."""
    if raw is None:
        return ""
    return raw if raw.__class__ is str else os.environ.decodevalue(raw)


def _contiguous_strides(shape) -> tuple:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


class _Merge:
    """How a plan's launches merge the splits -- in the split kernel (``merge_last``) or by the
    combine kernel -- with the options and bound launchers of that way."""

    __slots__ = ("merge_last", "n_counters", "options", "combine_options", "split_launch", "sized_launch",
                 "combine_launch")

    def __init__(self, merge_last: bool, n_counters: int, options: dict, combine_options: dict):
        self.merge_last, self.n_counters = merge_last, n_counters
        self.options, self.combine_options = options, combine_options
        self.split_launch = self.sized_launch = self.combine_launch = None


class _SplitPlan:
    """What one decoding step launches for one key: see its construction in :func:`_split_plan`
    and :meth:`run`.  ``eager`` / ``graph``: how the splits merge in an eager launch and in one
    captured into a CUDA graph or traced by torch.compile (the same object when they agree)."""

    __slots__ = ("grid", "tail", "direct", "eager", "graph", "scratch", "out_shape", "lse_shape", "part_numel",
                 "lse_numel", "dtype", "device", "has_seqlens", "combine_grid", "combine_tail", "num_splits", "block_n",
                 "fixed_classes")

    def run(self, q, k_cache, v_cache, seqlens_k, cache_batch_idx, block_table, leftpad, alibi_slopes, k_new=None,
            v_new=None, cos=None, sin=None, bound=True, sized=None, need_lse=True):
        """``(out, lse)`` of the step; index tensors as the kernel reads them (contiguous, a
        block table's columns at stride 1).  ``bound``: through the bound launchers (not
        while torch.compile traces).  ``sized``: the call's own capacity, chunk and K and V
        strides (``_SPLIT_SIZED`` after the length), instead of the plan's.  ``need_lse``
        False: ``lse`` is None (the kernel writes it to scratch)."""
        out = torch.empty(self.out_shape, dtype=self.dtype, device=self.device)
        capturing = bound and self.scratch and workspace.capturing()
        way = self.graph if capturing or not bound else self.eager
        # The partials -- (splits, batch, seqlen_q, nheads, HEAD_DIM) outputs then (splits,
        # batch, nheads, seqlen_q) LSEs in one float32 buffer, the kernels finding the LSEs
        # after the outputs -- the merge's counters and an unwanted LSE go to the stream's
        # scratch on a GPU (``flashtile.kernels.workspace``): dead once the step is done.
        held = None
        if bound and self.scratch and not (self.direct and need_lse):
            held = workspace.scratch(self.device, self.part_numel, way.n_counters, 0 if need_lse else self.lse_numel,
                                     capturing)
        if need_lse or held is None:
            lse = torch.empty(self.lse_shape, dtype=torch.float32, device=self.device)
        else:
            lse = held.sink
        if self.direct:  # one split: the program writes out and lse itself
            part = counters = None
        elif held is not None:
            part, counters = held.floats, (held.counters if way.merge_last else None)
        else:
            part = torch.empty(self.part_numel, dtype=torch.float32, device=self.device)
            counters = torch.zeros(way.n_counters, dtype=torch.int32, device=self.device) if way.merge_last else None
        # Pointer arguments the kernel does not read (behind a constexpr flag): ``None``, which
        # Triton makes a constexpr and the launch layer keys by identity (fewer tensors to
        # classify per call); a tensor while torch.compile traces.
        ph = lse if not bound else None
        if not bound:
            part = lse if part is None else part
            counters = lse if counters is None else counters
        args = (q, k_cache, v_cache, part, seqlens_k if self.has_seqlens else ph,
                ph if cache_batch_idx is None else cache_batch_idx, ph if block_table is None else block_table,
                ph if leftpad is None else leftpad, ph if alibi_slopes is None else alibi_slopes, out, lse,
                ph if k_new is None else k_new, ph if v_new is None else v_new, ph if cos is None else cos,
                ph if sin is None else sin, counters, 0 if self.has_seqlens else seqlens_k)
        combine = not (self.direct or way.merge_last)
        if not bound:
            tail = self.tail if sized is None else sized + self.tail[len(sized):]
            launch(_decode_split, self.grid, args + tail, way.options, dynamic=_SPLIT_DYNAMIC)
            if combine:
                launch(_combine_splits, self.combine_grid, (part, out, lse) + self.combine_tail, way.combine_options)
            return out, (lse if need_lse else None)
        if sized is None:
            split = way.split_launch
            if split is None or split.kernel is not _decode_split:
                split = way.split_launch = bind(_decode_split, self.grid, way.options, args + self.tail,
                                                _SPLIT_DYNAMIC, tail_from=len(args), fixed=self.fixed_classes)
        else:
            args += sized
            split = way.sized_launch
            if split is None or split.kernel is not _decode_split:
                split = way.sized_launch = bind(_decode_split, self.grid, way.options,
                                                args + self.tail[len(sized):], _SPLIT_SIZED, tail_from=len(args))
        split(args)
        if combine:
            merge = way.combine_launch
            if merge is None or merge.kernel is not _combine_splits:
                merge = way.combine_launch = bind(_combine_splits, self.combine_grid, way.combine_options,
                                                  (part, out, lse) + self.combine_tail, tail_from=3,
                                                  fixed=self.fixed_classes)
            merge((part, out, lse))
        return out, (lse if need_lse else None)


def _split_plan(q, k_cache, v_cache, block_table, has_seqlens, has_batch_idx, has_leftpad, alibi_slopes,
                softmax_scale, window_left, window_right, softcap, num_splits, seqlen_new, tuning_text,
                new=None, rotary=None, fixed_classes=False):
    """The launch plan of :func:`decode` for these arguments (the index tensors already made
    contiguous as the kernel reads them).  ``new``: ``(k, v)`` of a fused append (then
    ``seqlen_new`` is theirs); ``rotary``: ``(cos, sin, interleaved, local)``;
    ``fixed_classes``: the plan serves one caller's key, which holds the types, dtypes and
    device of every tensor the calls pass (its bound launches skip classifying them:
    ``launch.bind``'s ``fixed``)."""
    batch, seqlen_q, nheads, d = q.shape
    nheads_k = k_cache.shape[2]
    paged = block_table is not None
    page_size = k_cache.shape[1] if paged else 1
    capacity = block_table.shape[1] * page_size if paged else k_cache.shape[1]
    hd = padded_headdim(d)
    knob = TUNING.parse(tuning_text)
    group = nheads // nheads_k
    cfg = cached_launch_config(batch, nheads_k, capacity, q.device, paged, hd, group * seqlen_q, q.element_size(),
                               tuning_text)
    block_n = cfg.block_n
    num_splits = num_splits if num_splits > 0 else cfg.num_splits
    direct = num_splits == 1
    pdl = not direct and bool(knob["pdl"]) and q.is_cuda and has_programmatic_launch(q.device.index or 0)
    chunk = cdiv(cdiv(capacity, num_splits), block_n) * block_n
    plan = _SplitPlan()
    plan.fixed_classes = fixed_classes
    plan.out_shape = (batch, seqlen_q, nheads, d)
    plan.lse_shape = (batch, nheads, seqlen_q)
    plan.dtype, plan.device, plan.has_seqlens = q.dtype, q.device, has_seqlens
    plan.num_splits, plan.block_n = num_splits, block_n
    # The output is allocated contiguous at every call: its strides are those of a fresh tensor
    # (torch's rule: each the product of the later sizes, a size 0 counted as 1).
    out_strides = _contiguous_strides(plan.out_shape)
    plan.part_numel = 0 if direct else num_splits * batch * seqlen_q * nheads * (hd + 1)
    plan.lse_numel = batch * nheads * seqlen_q
    plan.direct, plan.scratch = direct, q.is_cuda
    mods = score_mod_args(softmax_scale, softcap, alibi_slopes, q)
    plan.grid = (batch * nheads_k, num_splits, cdiv(group * seqlen_q, cfg.block_m))
    k_new, v_new = new if new is not None else (None, None)
    cos, sin, interleaved, local = rotary if rotary is not None else (None, None, False, False)
    # Every argument after the tensors and the shared length: the bound launcher's own tail
    # (its first eight, ``_SPLIT_SIZED``'s, are a call's own in a plan for every key length).
    plan.tail = (
        capacity, chunk, *k_cache.stride()[:3], *v_cache.stride()[:3],
        mods["stride_ab"], *out_strides[:3], *q.stride()[:3], block_table.stride(0) if paged else 0,
        *(k_new.stride()[:3] if k_new is not None else (0, 0, 0)), *(v_new.stride()[:3] if v_new is not None else (0, 0, 0)),
        *(cos.stride() if cos is not None else (0, 0)), *(sin.stride() if sin is not None else (0, 0)),
        cos.shape[0] if cos is not None else 0, cos.shape[1] if cos is not None else 0,
        seqlen_q, nheads_k, group, num_splits, seqlen_new, k_cache.shape[0], softmax_scale * LOG2E, window_left,
        window_right, mods["softcap_scale"], mods["softcap_log2"])
    block_t = min(64, max(1, next_power_of_2(seqlen_new)))
    options = dict(
        HAS_SEQLENS=has_seqlens, headdim=d, HEAD_DIM=hd, BLOCK_M=cfg.block_m,
        BLOCK_N=block_n, MASK_LEFT=window_left >= 0, MASK_RIGHT=window_right >= 0,
        HAS_SOFTCAP=mods["HAS_SOFTCAP"], HAS_ALIBI=mods["HAS_ALIBI"],
        PAGED=paged, PAGE_SIZE=page_size, HAS_BATCH_IDX=has_batch_idx,
        DOT_PRECISION=dot_precision(q.dtype), PDL=pdl, DIRECT=direct, MERGE_LAST=False, BLOCK_S=1,
        HAS_LEFTPAD=has_leftpad, APPEND=new is not None, ROTARY=cos is not None, INTERLEAVED=interleaved,
        ROTARY_LOCAL=local,
        BLOCK_B=max(2, next_power_of_2(batch)) if new is not None else 1,
        BLOCK_P=max(2, next_power_of_2(cdiv(seqlen_new - 1, page_size) + 1)) if new is not None else 1,
        BLOCK_T=block_t if new is not None else 1,
        BLOCK_NEW=min(block_n, max(16, block_t)) if new is not None else 16,
        num_warps=4 if INTERPRET else knob["warps"], num_stages=cfg.stages,
    )
    plan.combine_grid = (batch * seqlen_q * nheads,)
    plan.combine_tail = (num_splits, batch, seqlen_q, nheads, d, *out_strides[:3])
    merge_last = not direct and num_splits <= knob["merge_last_max_splits"]
    block_s = max(2, next_power_of_2(num_splits))
    combine_options = dict(HEAD_DIM=hd, BLOCK_S=block_s, IN_ORDER=merge_last, PDL=pdl, launch_pdl=pdl,
                           num_warps=1 if INTERPRET else 4)
    plan.graph = plan.eager = _Merge(False, 0, options, combine_options)
    if merge_last:
        # Eager launches of few splits merge in the split kernel (see MERGE_LAST_MAX_SPLITS),
        # with the same bits as the combine kernel's merge in order.
        merged = dict(options, PDL=False, MERGE_LAST=True, BLOCK_S=block_s)
        plan.eager = _Merge(True, batch * nheads_k * plan.grid[2], merged, combine_options)
    return plan


def step_plan(q, k_cache, v_cache, k, v, block_table, has_seqlens, has_batch_idx, has_leftpad, alibi_slopes,
              softmax_scale, window_left, window_right, softcap, num_splits, rotary, tuning_text):
    """The plan of one whole decoding step in one launch (two with the combine): the append of
    ``k``, ``v`` (``None``: none) fused into the split kernel, ``rotary`` ``(cos, sin,
    interleaved, local)`` or ``None``, on arguments checked by the caller
    (:func:`flashtile.flash_attn_with_kvcache`, which memoises the plan with its checks).
    Index tensors must reach :meth:`_SplitPlan.run` as the kernel reads them (contiguous, a
    block table's columns at stride 1)."""
    # A plan of the caller's memo key alone, which holds every tensor's type, dtype and device.
    return _split_plan(q, k_cache, v_cache, block_table, has_seqlens, has_batch_idx, has_leftpad, alibi_slopes,
                       softmax_scale, window_left, window_right, softcap, num_splits,
                       0 if k is None else k.shape[1], tuning_text, None if k is None else (k, v), rotary,
                       fixed_classes=True)


def length_class_unit(knob) -> tuple[int, int]:
    """``(unit, top)``: cache lengths with one ``min(capacity // unit, top)`` get one launch
    configuration from :func:`launch_config` (the tiles, stages and split count), all else equal.

    Why: the configuration reads the capacity only through :func:`choose_num_splits`'
    ``capacity // (min_tiles * block_n)``, where ``min_tiles`` is the knob's or the default and
    every key tile ``block_n`` is a power of two no narrower than the narrowest knob (or 16, the
    narrowest the shared-memory fit goes), so ``unit`` divides each ``min_tiles * block_n`` and
    the floor of the floor is the floor.  From ``top`` on every split count is at its cap of 64."""
    tiles = (MIN_TILES_PER_SPLIT, knob["min_tiles_per_split"])
    widths = (16, knob["block_n"], knob["block_n_paged"])
    unit = max(1, math.gcd(*tiles) * min(widths))
    return unit, 64 * max(tiles) * max(256, *widths) // unit


class _FewRowsPlan:
    """The split-kernel plan of a dense forward of a few query rows (``engine.split_kv_forward``)
    for every key length: a model extending its KV cache by a token a step calls with a new
    length each time, and one length's plan, launcher and compiled variant serve the next.
    Per length class (:func:`length_class_unit`) one :class:`_SplitPlan`; a call passes its own
    length, chunk and K and V strides (``_SPLIT_SIZED``)."""

    __slots__ = ("make", "unit", "top", "by_class")

    def run(self, q, k, v, alibi_slopes, bound=True, need_lse=True):
        """``(out, lse)`` of the forward; ``k``, ``v`` of any length and strides (unit last);
        ``bound`` and ``need_lse`` as in :meth:`_SplitPlan.run`."""
        n = k.shape[1]
        length_class = n // self.unit
        if length_class > self.top:
            length_class = self.top
        plan = self.by_class.get(length_class)
        if plan is None:
            if len(self.by_class) >= _MAX_PLANS:
                self.by_class.clear()
            plan = self.by_class[length_class] = self.make(q, k, v)
        block_n = plan.block_n
        chunk = cdiv(cdiv(n, plan.num_splits), block_n) * block_n
        ks, vs = k.stride(), v.stride()
        return plan.run(q, k, v, n, None, None, None, alibi_slopes, bound=bound,
                        sized=(n, chunk, ks[0], ks[1], ks[2], vs[0], vs[1], vs[2]), need_lse=need_lse)


def few_rows_plan(q, k, v, alibi_slopes, softmax_scale, window_left, window_right, softcap,
                  tuning_text: str) -> _FewRowsPlan:
    """The plan of a dense forward of ``q``'s few rows against ``k``, ``v`` as a full cache (no
    append, no index tensors) for every key length; the arguments checked by the caller, the
    scalars and ``alibi_slopes``' shape fixed for the plan."""
    plan = _FewRowsPlan()
    plan.unit, plan.top = length_class_unit(TUNING.parse(tuning_text))
    plan.by_class = {}

    def make(q, k, v):
        # The forward's plan key holds q's, k's, v's and the slopes' types, dtypes and device.
        return _split_plan(q, k, v, None, False, False, False, alibi_slopes, softmax_scale, window_left, window_right,
                           softcap, 0, 0, tuning_text, fixed_classes=True)

    plan.make = make
    return plan


def decode(q, k_cache, v_cache, seqlens_k, cache_batch_idx, block_table, softmax_scale, window_left, window_right,
           softcap, alibi_slopes, num_splits, cache_leftpad=None, seqlen_new=0):
    """Decode attention without an append: ``(out (b, nq, h, d) in q's dtype, lse fp32 (b, h,
    nq))``.  ``flash_attn_with_kvcache`` launches through :func:`step_plan` (the same split
    kernel, with the append fused); this entry point attends to a cache as it is.

    ``seqlens_k``: int32 / int64 ``(batch,)`` cache lengths, or one int for every sequence (no
    tensor to fill: a decoding step is short enough that one launch fewer shows); the kernel
    adds ``seqlen_new`` (keys an earlier :func:`append_kv` appended) to them, so the caller
    needs no tensor op for the updated lengths.  ``cache_batch_idx``, ``block_table``,
    ``cache_leftpad``: int32 or int64, read as they are.  One split is one launch; more
    merge in the split kernel (eager, up to ``merge_last_max_splits``) or add the combine
    kernel, launched programmatically dependent on Hopper.  Launches go through the launch
    layer (:mod:`flashtile.kernels.launch`: compiled once per specialisation class, then
    launched directly), with the launch plan of this call's key (see ``_MAX_PLANS``)."""
    # The kernel reads entry b of these at offset b (block-table rows with their own stride,
    # columns at stride 1): strided views are copied first (a no-op for contiguous ones).
    has_seqlens = isinstance(seqlens_k, torch.Tensor)
    if has_seqlens:
        seqlens_k = seqlens_k.contiguous()
    if cache_batch_idx is not None:
        cache_batch_idx = cache_batch_idx.contiguous()
    if cache_leftpad is not None:
        cache_leftpad = cache_leftpad.contiguous()
    paged = block_table is not None
    if paged and block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    if alibi_slopes is not None:
        alibi_slopes = alibi_slopes.contiguous()  # the kernel steps over heads with stride 1
    raw = tuning_raw()
    plan_args = (q, k_cache, v_cache, block_table, has_seqlens, cache_batch_idx is not None,
                 cache_leftpad is not None, alibi_slopes, softmax_scale, window_left, window_right, softcap,
                 num_splits, seqlen_new, tuning_text(raw))
    compiling = torch.compiler.is_compiling()
    if compiling:
        plan = _split_plan(*plan_args)  # traced as it stands, no memo (shapes may be symbolic)
    else:
        # Everything the plan reads of the arguments: the (validated) scalars by value and type.
        key = (q.shape, q.stride(), q.dtype, q.device, k_cache.shape, k_cache.stride(), v_cache.stride(),
               None if block_table is None else (block_table.shape[1], block_table.stride(0)),
               None if alibi_slopes is None else alibi_slopes.shape, has_seqlens, cache_batch_idx is not None,
               cache_leftpad is not None, softmax_scale, window_left, window_right, softcap, num_splits, seqlen_new,
               softmax_scale.__class__, softcap.__class__, raw)
        plan = _split_plans.get(key)
        if plan is None:
            if len(_split_plans) >= _MAX_PLANS:
                _split_plans.clear()
            plan = _split_plans[key] = _split_plan(*plan_args)
    return plan.run(q, k_cache, v_cache, seqlens_k, cache_batch_idx, block_table, cache_leftpad, alibi_slopes,
                    bound=not compiling)


@triton.jit
def _append_kv(
    K_NEW, V_NEW, K_CACHE, V_CACHE, SEQLENS, CACHE_BATCH_IDX, BLOCK_TABLE, COS, SIN, LEFTPAD,
    stride_cos_p, stride_cos_k, stride_sin_p, stride_sin_k, seqlen_ro, half_rotary,
    stride_knb, stride_knn, stride_knh, stride_vnb, stride_vnn, stride_vnh,
    stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh, stride_bt, stride_btc,
    batch, seqlen_new, nheads_k, headdim, capacity, cache_rows, seqlen_all,
    HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_P: tl.constexpr,
    PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, HAS_BATCH_IDX: tl.constexpr, HAS_SEQLENS: tl.constexpr,
    ROTARY: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_LEFTPAD: tl.constexpr,
):
    """New keys / values ``BLOCK_T`` positions of one sequence (grid: batch, position tiles) at
    ``SEQLENS[b] ...`` (or ``seqlen_all ...`` for every sequence without ``HAS_SEQLENS``).  Every program first checks the index values of the *whole* batch --
    lengths in ``[0, capacity - seqlen_new]``, cache rows and the pages that receive keys in
    ``[0, cache_rows)`` -- and writes nothing unless all are valid: a launch with a bad value
    (possible only where the host could not read them, in CUDA-graph capture) changes nothing
    and touches nothing out of bounds.

    With ``ROTARY`` the new keys are rotated on their way into the cache (:func:`_rotary_tables`,
    at rotary position ``SEQLENS[b] + t``, less ``LEFTPAD[b]`` with ``HAS_LEFTPAD``), rounded
    to k's dtype, then to the cache's: what apply_rotary_emb + the append store.  The split
    kernel appends the same way (its ``APPEND``), and ``flash_attn_with_kvcache`` uses that
    fused form; this standalone append (:func:`append_kv`) is the independent implementation
    the tests hold the fused one to."""
    b = tl.program_id(0)
    all_ok = _append_valid(SEQLENS, CACHE_BATCH_IDX, BLOCK_TABLE, stride_bt, stride_btc, batch, seqlen_new, capacity,
                           cache_rows, seqlen_all, BLOCK_B, BLOCK_P, PAGED, PAGE_SIZE, HAS_BATCH_IDX, HAS_SEQLENS)
    if HAS_SEQLENS:
        own_len = tl.load(SEQLENS + b).to(tl.int64)
    else:
        own_len = seqlen_all
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = (t < seqlen_new) & all_ok
    pos = t.to(tl.int64) + own_len
    pos = tl.where(t_ok, pos, 0)
    if HAS_BATCH_IDX:
        cache_b = tl.load(CACHE_BATCH_IDX + b)
    else:
        cache_b = b
    idx, row = _append_slots(pos, t_ok, b, cache_b, BLOCK_TABLE, stride_bt, stride_btc, PAGED, PAGE_SIZE)
    offs_d = tl.arange(0, HEAD_DIM)
    mask = t_ok[:, None] & (offs_d < headdim)[None, :]
    if ROTARY:
        rot_pos = pos
        if HAS_LEFTPAD:
            rot_pos = pos - tl.load(LEFTPAD + b).to(tl.int64)
        partner, cos, sin, angle_ok = _rotary_tables(COS, SIN, rot_pos, t_ok, offs_d, stride_cos_p, stride_cos_k,
                                                     stride_sin_p, stride_sin_k, seqlen_ro, half_rotary, INTERLEAVED)
    for h in range(nheads_k):
        k_row = K_NEW + b.to(tl.int64) * stride_knb + t[:, None].to(tl.int64) * stride_knn + h * stride_knh
        kn = tl.load(k_row + offs_d[None, :], mask=mask, other=0.0)
        if ROTARY:
            kn = _rotate_rows(kn, k_row, partner, cos, sin, angle_ok, mask, INTERLEAVED)
        vn = tl.load(V_NEW + b.to(tl.int64) * stride_vnb + t[:, None].to(tl.int64) * stride_vnn + h * stride_vnh
                     + offs_d[None, :], mask=mask, other=0.0)
        tl.store(K_CACHE + (idx * stride_kb + row * stride_kn)[:, None] + h * stride_kh + offs_d[None, :],
                 kn.to(K_CACHE.dtype.element_ty), mask=mask)
        tl.store(V_CACHE + (idx * stride_vb + row * stride_vn)[:, None] + h * stride_vh + offs_d[None, :],
                 vn.to(V_CACHE.dtype.element_ty), mask=mask)


_APPEND_DYNAMIC = (_append_kv.arg_names.index("seqlen_all"),)


class _AppendPlan:
    """What :func:`append_kv` launches for one key: see :func:`_append_plan`."""

    __slots__ = ("grid", "ints", "options")


def _append_plan(k_cache, v_cache, k, v, has_seqlens, has_batch_idx, block_table, cos, sin, interleaved, has_leftpad):
    batch, seqlen_new, nheads_k, d = k.shape
    paged = block_table is not None
    page_size = k_cache.shape[1] if paged else 1
    capacity = block_table.shape[1] * page_size if paged else k_cache.shape[1]
    block_t = min(64, max(1, next_power_of_2(seqlen_new)))
    plan = _AppendPlan()
    plan.grid = (batch, cdiv(seqlen_new, block_t))
    plan.ints = (
        cos.stride(0) if cos is not None else 0, cos.stride(1) if cos is not None else 0,
        sin.stride(0) if sin is not None else 0, sin.stride(1) if sin is not None else 0,
        cos.shape[0] if cos is not None else 0, cos.shape[1] if cos is not None else 0,
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), block_table.stride(0) if paged else 0, block_table.stride(1) if paged else 0,
        batch, seqlen_new, nheads_k, d, capacity, k_cache.shape[0],
    )
    plan.options = dict(
        HEAD_DIM=next_power_of_2(d), BLOCK_T=block_t, BLOCK_B=max(2, next_power_of_2(batch)),
        BLOCK_P=max(2, next_power_of_2(cdiv(seqlen_new - 1, page_size) + 1)), PAGED=paged, PAGE_SIZE=page_size,
        HAS_BATCH_IDX=has_batch_idx, HAS_SEQLENS=has_seqlens, ROTARY=cos is not None,
        INTERLEAVED=interleaved, HAS_LEFTPAD=has_leftpad, num_warps=4,
    )
    return plan


def append_kv(k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, rotary=None):
    """Write ``k``, ``v`` ``(batch, seqlen_new, nheads_k, d)`` into the cache at positions
    ``cache_seqlens[b] ...`` (an int32 / int64 ``(batch,)`` tensor, or one int for every
    sequence) in place: one launch (the torch equivalent is two scatters and the index
    arithmetic before them), nothing written unless every index is valid.  The launch's
    grid, constexprs and int arguments come from a plan per key (see ``_MAX_PLANS``).

    ``rotary``: ``None`` or ``(cos, sin, interleaved, cache_leftpad)`` (checked by the caller:
    :func:`flashtile.rotary.check_rotary_arguments`): ``k`` is written rotated at rotary
    positions ``cache_seqlens[b] - cache_leftpad[b] + t`` (``cache_leftpad`` may be ``None``)."""
    has_seqlens = isinstance(cache_seqlens, torch.Tensor)
    if has_seqlens:
        cache_seqlens = cache_seqlens.contiguous()
    if cache_batch_idx is not None:
        cache_batch_idx = cache_batch_idx.contiguous()
    cos = sin = leftpad = None
    interleaved = False
    if rotary is not None:
        cos, sin, interleaved, leftpad = rotary
        if leftpad is not None:
            leftpad = leftpad.contiguous()
    plan_args = (k_cache, v_cache, k, v, has_seqlens, cache_batch_idx is not None, block_table, cos, sin,
                 interleaved, leftpad is not None)
    if torch.compiler.is_compiling():
        plan = _append_plan(*plan_args)  # traced as it stands, no memo (shapes may be symbolic)
    else:
        # Everything the plan reads of the arguments (``interleaved`` is a checked bool).
        key = (k.shape, k.stride(), v.stride(), k_cache.shape, k_cache.stride(), v_cache.stride(),
               None if block_table is None else (block_table.shape[1], block_table.stride()),
               None if cos is None else (cos.shape, cos.stride(), sin.stride(), interleaved),
               has_seqlens, cache_batch_idx is not None, leftpad is not None)
        plan = _append_plans.get(key)
        if plan is None:
            if len(_append_plans) >= _MAX_PLANS:
                _append_plans.clear()
            plan = _append_plans[key] = _append_plan(*plan_args)
    placeholder = k  # for pointer arguments the kernel does not read
    launch(_append_kv, plan.grid, (
        k, v, k_cache, v_cache, cache_seqlens if has_seqlens else placeholder,
        cache_batch_idx if cache_batch_idx is not None else placeholder,
        block_table if block_table is not None else placeholder,
        cos if cos is not None else placeholder, sin if sin is not None else placeholder,
        leftpad if leftpad is not None else placeholder,
    ) + plan.ints + (0 if has_seqlens else cache_seqlens,), plan.options, dynamic=_APPEND_DYNAMIC)
