"""FlashAttention backward for Hopper in Gluon: a TMA producer warp, two consumer warpgroups, a dQ writer warp.

(One module over 600 lines on purpose: as in the forward, the partitions read their tile sizes
back from the buffers the kernel allocates from the configuration's constexprs and the
launcher's descriptor boxes, so kernel, configuration and launcher are one argument, read top
to bottom and changed together.)

A program owns one ``BLOCK_N = 128``-key tile of one (batch, kv head) and walks the query
tiles that see it (``query_tiles``), for every query head of its GQA group, recomputing the
probabilities from the saved LSE.  Four partitions share shared memory:

* **producer** (1 warp): TMA-loads the key and value tile once, then streams the query and
  output-gradient tiles (``Q_i``, ``dO_i``, ``BLOCK_M`` rows: 128 up to d = 64, else 64) through a
  ``NUM_STAGES``-deep ring, with the tiles' rows of the log2 LSE and of delta (``cp.async``);
  each slot has a *ready* barrier (both tiles and both rows have landed) and an *empty* one
  (both consumers are done with it).  The empty barrier also frees the shared dS tile: its
  last reader is the step before's dQ GEMM, retired before that step's slot is released.
* **two consumers** (one warpgroup each): each owns 64 of the 128 keys and keeps their dK and
  dV rows in fp32 registers for the whole walk.  Per query tile it computes, on asynchronous
  wgmma, the transposed tiles ``S^T = K Q^T`` and ``dP^T = V dO^T`` (keys x queries, so the
  probabilities are already the A operand of the dV and dK products), then
  ``P^T = exp2(S^T * scale * log2 e - LSE * log2 e)``, ``dS^T = P^T (dP^T - delta)``,
  ``dV += P^T dO`` and ``dK += dS^T Q``.  Both write their rows of ``dS^T`` into one shared
  tile, and each computes half of dQ's columns, ``dS K[:, half]`` over all 128 keys, which it
  adds into an fp32 workspace.
* **dQ writer** (1 warp; with ``dq_writer``, else it returns at once): per step, has the TMA
  engine add both consumers' staged dQ shares into the workspace and hands each staging tile
  back once the engine has read it (a *full* and an *empty* barrier per consumer).

How a step's dQ share is made is ``HopperBwdConfig``'s choice (``config_for`` per head dim;
the other combinations are ``ALTERNATIVES``): ``dq_tma`` stages each consumer's share in
shared memory and has the TMA engine add it into the workspace
(``tma_reduce.async_reduce_add``, one instruction instead of 16-byte vector atomics and their
addresses); ``dq_writer`` leaves issuing that add, and waiting for the engine to have read
the tile, to the writer warp (else each consumer does both, behind a barrier of its four
warps, on its own path through the step); ``dq_lag`` double-buffers the dS tile and issues a
step's dQ GEMM one step later, so a consumer waits for the other one's dS of the step before
(already written, unless it is a whole step behind) instead of meeting it at every step;
``dk_smem`` reads dK's dS operand from the shared tile instead of registers; ``dk_early`` issues
dK's GEMM (operand in registers) before the consumer stores its dS rows, so it runs under the
store, the fence and the barriers; ``dq_publish_late`` stages a step's dQ share at the end of
the step but hands it on (the fence, then the writer's barrier or the TMA's add) only once the
next step's first GEMMs are queued; ``third_ds_buffer`` (with ``dq_lag``, 64-row query tiles)
adds a third dS tile, so a consumer stores a step's dS rows without waiting for the other
one to have finished the step before.

With ``persistent`` (an alternative, ``HopperBwdConfig``) one program per SM walks key tiles
round-robin: the ring's count runs across them, the next tile's first Q / dO tiles load while
the consumers finish this one, and its K and V (one buffer, released on ``kv_empty``) while they
store this one's dK and dV -- instead of a new program paying for its start and its first loads.

A ``deterministic=True`` call runs the kernel without dQ (``with_dq=False``,
``separate_dq_config``): the consumers compute dK and dV alone, never waiting for each
other, and dQ comes from a separate pass whose programs own their rows
(``engine.separate_dq_engine``), so no sum depends on the order in which programs finish.
Short masked calls run so too (``engine.separate_dq``): their dQ, written directly, needs no
fp32 workspace to clear and convert.

``delta = rowsum(dO * O)`` and the LSE in log2 units (``+inf`` for rows with no visible key, so
their probabilities are exactly 0) come from the ``tl.*`` preprocess kernel, and the dQ
workspace is scaled and cast by the caller.  Masks and tile ranges are flashtile's
(``flashtile/kernels/masking.py``, ``tile_info.py``), as in the forward.

Query rows past a sequence's end add nothing: in a packed batch (the next sequence's rows)
the consumers give them LSE ``+inf``, so their probabilities and ``dS`` are 0; in a dense one
their Q and dO tiles are TMA zeros, so ``P^T dO`` and ``dS^T Q`` add exact zeros.  Their dQ
rows are not written.  Keys past a sequence's end (TMA zeros, or the next packed sequence's
keys) are masked on every step of the sequence's last key tile, and their dK / dV rows are
not stored.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from flashtile.kernels.hopper import RegisterBudget, configured
from flashtile.kernels.hopper.descriptors import descriptor
from flashtile.kernels.hopper.tma_reduce import async_reduce_add
from flashtile.kernels.launch import bind, launch
from flashtile.kernels.masking import band_mask, query_tiles
from flashtile.kernels.plans import stand_ins
from flashtile.kernels.runtime import cdiv, l2_bytes, sm_count
from flashtile.kernels.tile_info import dealt_tile, key_tile_costs, schedule, section_heads, sequence_bounds
from flashtile.kernels.tma import DescriptorTemplate, padded_headdim

LOG2E = 1.4426950408889634
# Keys per consumer warpgroup: the M of its wgmmas; a program's key tile is two consumers' keys.
CONSUMER_KEYS: gl.constexpr = gl.constexpr(64)


@gluon.jit
def key_tile_work(pid, num_items, section_heads, CU_Q, CU_K, seqlen_q, seqlen_k, max_seqlen_k, nheads_k, window_left,
          window_right, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr,
          VARLEN: gl.constexpr):
    """Program ``pid`` -> (b, hk, n0, q_start, k_start, seqlen_q, seqlen_k, lo, full_lo, full_hi, key_edge, n_steps).

    With a causal-like mask the first key tiles are seen by the most query tiles.  The items
    go in sections of heads whose Q and dO fit in half of L2, tile by tile across a section's
    heads (``tile_info.dealt_tile``: the last section's first key tiles first, so the lightest
    programs make up the last wave; the sections before it alternate direction).  A key tile
    past a packed sequence's end has ``n_steps = -1``: nothing to load, compute or store.
    """
    tile, bh = dealt_tile(pid, num_items, gl.cdiv(max_seqlen_k, BLOCK_N), section_heads, MASK_RIGHT, False)
    b = bh // nheads_k
    hk = bh % nheads_k
    n0 = tile * BLOCK_N
    q_start, seqlen_q, k_start, seqlen_k = sequence_bounds(CU_Q, CU_K, b, seqlen_q, seqlen_k, VARLEN)
    lo, full_lo, full_hi, hi = query_tiles(n0, seqlen_q, seqlen_k, window_left, window_right,
                                           BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT)
    n_steps = gl.cdiv(gl.maximum(hi - lo, 0), BLOCK_M)
    if n0 >= seqlen_k:
        n_steps = -1
    # The sequence's last key tile: keys past its end must be masked on every step.
    key_edge = n0 + BLOCK_N > seqlen_k
    return b, hk, n0, q_start, k_start, seqlen_q, seqlen_k, lo, full_lo, full_hi, key_edge, n_steps


@gluon.jit
def step_rows(step, hk, group, n_steps, lo, BLOCK_M: gl.constexpr):
    """Step ``step`` of a program -> (its query head, its first query row in the sequence): the
    steps go query tile by query tile for each query head of the GQA group in turn."""
    return hk * group + step // n_steps, lo + (step % n_steps) * BLOCK_M


@gluon.jit
def _load_step(Q_desc, DO_desc, q_bufs, do_bufs, lse_bufs, delta_bufs, ready, empty, LSE2, Delta, stride_lh, lse_base,
               g, c, b, hk, group, n_steps, lo, q_start, sq, BLOCK_M: gl.constexpr, NUM_STAGES: gl.constexpr):
    """Step ``c`` of a key tile (query head ``c // n_steps``, query tile ``c % n_steps``), ring
    count ``g``: Q and dO into slot ``g % NUM_STAGES`` once both consumers have released it, with
    the step's rows of the log2 LSE and of delta (zeros past the sequence)."""
    vec_layout: gl.constexpr = gl.BlockedLayout([BLOCK_M // 32], [32], [1], [0])
    h = hk * group + c // n_steps
    row = q_start + lo + (c % n_steps) * BLOCK_M
    slot = g % NUM_STAGES
    # An mbarrier starts with its "previous" phase complete: the first waits pass.
    mbarrier.wait(empty.index(slot), ((g // NUM_STAGES) & 1) ^ 1)
    mbarrier.expect(ready.index(slot), Q_desc.block_type.nbytes + DO_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(Q_desc, [b, row, h, 0], ready.index(slot), q_bufs.index(slot))
    tma.async_copy_global_to_shared(DO_desc, [b, row, h, 0], ready.index(slot), do_bufs.index(slot))
    # The rows are too few for a TMA box; ``cp.async`` copies them while the tiles stream, and
    # the producer's own arrival (the barrier's second) follows their landing.
    offs_q = row - q_start + gl.arange(0, BLOCK_M, layout=vec_layout)
    rows = lse_base + h * stride_lh + offs_q
    async_copy.async_copy_global_to_shared(lse_bufs.index(slot), LSE2 + rows, mask=offs_q < sq)
    async_copy.async_copy_global_to_shared(delta_bufs.index(slot), Delta + rows, mask=offs_q < sq)
    async_copy.commit_group()
    async_copy.wait_group(0)
    mbarrier.arrive(ready.index(slot), count=1)


@gluon.jit
def program_items(num_items, PERSISTENT: gl.constexpr):
    """(first item, item stride, items) of this program: its round-robin share of a persistent
    grid, or the one item of a program per item."""
    pid = gl.program_id(0)
    if PERSISTENT:
        nprog = gl.num_programs(0)
        return pid, nprog, gl.cdiv(num_items - pid, nprog)
    return pid, 1, 1


@gluon.jit
def producer(Q_desc, K_desc, V_desc, DO_desc, k_smem, v_smem, q_bufs, do_bufs, lse_bufs, delta_bufs, kv_ready,
              kv_empty, ready, empty, LSE2, Delta, stride_lb, stride_lh,
              CU_Q, CU_K, seqlen_q, seqlen_k, max_seqlen_k, nheads_k, group, window_left, window_right, num_items,
              section_heads, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
              MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, VARLEN: gl.constexpr,
              PERSISTENT: gl.constexpr = False):
    """Per key tile: K and V once, then its steps' Q, dO and rows through the ring
    (``_load_step``; the ring count runs across a persistent program's items).  One barrier
    pair a slot for all four: fewer barrier operations in the consumers' loop.  With a
    persistent grid, a key tile's first ``NUM_STAGES`` steps load while the consumers finish
    the tile before (its last steps free the slots first), and its K and V once both consumers
    have let go of the previous ones (``kv_empty``)."""
    first_item, item_stride, n_items = program_items(num_items, PERSISTENT)
    g = 0  # ring count of the key tile's first step
    kv_count = 0  # key tiles whose K and V were loaded
    for it in range(n_items):
        b, hk, n0, q_start, k_start, sq, _sk, lo, _fl, _fh, _edge, n_steps = key_tile_work(
            first_item + it * item_stride, num_items, section_heads, CU_Q, CU_K, seqlen_q, seqlen_k, max_seqlen_k,
            nheads_k, window_left, window_right, BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT, VARLEN)
        if n_steps >= 0:
            lse_base = b.to(gl.int64) * stride_lb + q_start
            if VARLEN:
                b = 0  # packed tensors are one batch entry of the descriptors
            total = n_steps * group
            early = 0
            if PERSISTENT:
                early = gl.minimum(total, NUM_STAGES)
                for c in range(early):
                    _load_step(Q_desc, DO_desc, q_bufs, do_bufs, lse_bufs, delta_bufs, ready, empty, LSE2, Delta,
                               stride_lh, lse_base, g + c, c, b, hk, group, n_steps, lo, q_start, sq, BLOCK_M,
                               NUM_STAGES)
                mbarrier.wait(kv_empty, (kv_count & 1) ^ 1)
            mbarrier.expect(kv_ready, K_desc.block_type.nbytes + V_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(K_desc, [b, k_start + n0, hk, 0], kv_ready, k_smem)
            tma.async_copy_global_to_shared(V_desc, [b, k_start + n0, hk, 0], kv_ready, v_smem)
            for c in range(early, total):
                _load_step(Q_desc, DO_desc, q_bufs, do_bufs, lse_bufs, delta_bufs, ready, empty, LSE2, Delta,
                           stride_lh, lse_base, g + c, c, b, hk, group, n_steps, lo, q_start, sq, BLOCK_M,
                           NUM_STAGES)
            g += total
            kv_count += 1


@gluon.jit
def producer_buffers(Q_desc, K_desc, V_desc, DO_desc, NUM_STAGES: gl.constexpr, BLOCK_M: gl.constexpr,
                     PERSISTENT: gl.constexpr = False):
    """What :func:`producer` fills, allocated and its barriers initialised: the key and value
    tiles with ``kv_ready`` (and ``kv_empty``, initialised for persistent grids only), and the
    ring of Q / dO tiles and LSE / delta rows with a *ready* barrier (the tiles' expect and the
    rows' landing) and an *empty* one (both consumers) a slot."""
    dtype: gl.constexpr = Q_desc.dtype
    k_smem = gl.allocate_shared_memory(dtype, K_desc.block_type.shape, K_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, V_desc.block_type.shape, V_desc.layout)
    q_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES] + Q_desc.block_type.shape, Q_desc.layout)
    do_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES] + DO_desc.block_type.shape, DO_desc.layout)
    vec_smem: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])  # a slot's rows (the ring index outside it)
    lse_bufs = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, BLOCK_M], vec_smem)
    delta_bufs = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, BLOCK_M], vec_smem)
    kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready, count=1)
    if PERSISTENT:
        # Both consumers are done with a key tile.  Without a persistent grid nothing uses it, and
        # initialised it would be an mbarrier in memory that the compiler lends to other buffers.
        mbarrier.init(kv_empty, count=2)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=2)
        mbarrier.init(empty.index(i), count=2)
    return k_smem, v_smem, q_bufs, do_bufs, lse_bufs, delta_bufs, kv_ready, kv_empty, ready, empty


@gluon.jit
def store_rows(ptr, base, rows, nrows, stride_row, headdim, x, HEAD_DIM: gl.constexpr, ROWS: gl.constexpr,
                col_off: gl.constexpr = 0):
    """Rows ``rows`` (< ``nrows``) of a ``(rows, HEAD_DIM)`` tile at ``ptr + base``, as columns
    ``col_off ...``; columns past ``headdim`` are the padded head dim's and are not stored."""
    # 16-byte stores: each thread writes 8 consecutive columns of a row.
    VEC: gl.constexpr = 8
    TPC: gl.constexpr = HEAD_DIM // VEC if HEAD_DIM // VEC < 32 else 32
    store_layout: gl.constexpr = gl.BlockedLayout([1, VEC], [32 // TPC, TPC], [4, 1], [1, 0])
    x = gl.convert_layout(x.to(ptr.dtype.element_ty), store_layout)
    r = rows + gl.arange(0, ROWS, layout=gl.SliceLayout(1, store_layout))
    cols = col_off + gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, store_layout))
    ptrs = ptr + base + gl.expand_dims(r.to(gl.int64) * stride_row, 1) + gl.expand_dims(cols, 0)
    gl.store(ptrs, x, mask=gl.expand_dims(r < nrows, 1) & gl.expand_dims(cols < headdim, 0))


@gluon.jit
def _add_dq(DQ, dq, b, h, m0, q_start, sq, stride_dqb, stride_dqm, stride_dqh, dq_rows, dq_cols,
            add_layout: gl.constexpr):
    """Add one step's dQ share into the fp32 workspace (rows past the sequence are not written)."""
    rows = m0 + dq_rows
    base = b.to(gl.int64) * stride_dqb + h * stride_dqh + q_start.to(gl.int64) * stride_dqm
    ptrs = DQ + base + gl.expand_dims(rows.to(gl.int64) * stride_dqm, 1) + gl.expand_dims(dq_cols, 0)
    # The workspace is padded to HEAD_DIM columns: no column mask, so the adds vectorise.
    gl.atomic_add(ptrs, gl.convert_layout(dq, add_layout), mask=gl.expand_dims(rows < sq, 1), sem="relaxed")


@gluon.jit
def _dq_out(DQ, DQ_desc, dq_smem, dq_full, dq_empty, step, dq, b, h, m0, q_start, sq, col_off, stride_dqb, stride_dqm,
            stride_dqh, dq_rows, dq_cols, add_layout: gl.constexpr, dq_layout: gl.constexpr, BLOCK_M: gl.constexpr,
            VARLEN: gl.constexpr, DQ_TMA: gl.constexpr, DQ_WRITER: gl.constexpr, PUBLISH: gl.constexpr = True):
    """Add step ``step``'s dQ share into the fp32 workspace: staged in shared memory and added by
    the TMA engine (``DQ_TMA``; issued by the dQ writer warp with ``DQ_WRITER``), or with
    vector atomics from registers.  Without ``PUBLISH`` the share is only staged: the caller
    hands it on later (:func:`_dq_publish`)."""
    if DQ_TMA:
        if VARLEN:
            # The box's rows past the sequence are the next packed sequence's: add exact zeros.
            rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, dq_layout))
            dq = gl.where(gl.expand_dims(rows < sq, 1), dq, 0.0)
        if DQ_WRITER:
            # Once the engine has read this consumer's tile of the step before, stage this one.
            mbarrier.wait(dq_empty, (step & 1) ^ 1)
        else:
            tma.store_wait(0)  # the previous step's add has read the staging tile
        dq_smem.reshape(dq.shape).store(dq)
        if PUBLISH:
            _dq_publish(DQ_desc, dq_smem, dq_full, b, h, m0, q_start, col_off, dq_layout, VARLEN, DQ_WRITER)
    else:
        _add_dq(DQ, dq, b, h, m0, q_start, sq, stride_dqb, stride_dqm, stride_dqh, dq_rows, dq_cols, add_layout)


@gluon.jit
def _dq_publish(DQ_desc, dq_smem, dq_full, b, h, m0, q_start, col_off, dq_layout: gl.constexpr, VARLEN: gl.constexpr,
                DQ_WRITER: gl.constexpr):
    """Hand a staged dQ share (of query head ``h``, rows from ``m0``) on: to the dQ writer warp
    (``DQ_WRITER``), or to the TMA engine's add."""
    fence_async_shared()
    if DQ_WRITER:
        mbarrier.arrive(dq_full, count=1)
    else:
        if VARLEN:
            b = 0  # packed tensors are one batch entry of the descriptor
        # Rows past a dense tensor's end fall outside the descriptor and are dropped.
        async_reduce_add(DQ_desc, [b, q_start + m0, h, col_off], dq_smem)


@gluon.jit
def _dq_writer(DQ_desc, dq_smem, dq_full, dq_empty, CU_Q, CU_K, seqlen_q, seqlen_k, max_seqlen_k, nheads_k, group,
               window_left, window_right, num_items, section_heads, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               HEAD_DIM: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, VARLEN: gl.constexpr,
               DQ_WRITER: gl.constexpr, PERSISTENT: gl.constexpr):
    """Per step, both consumers' staged dQ shares added into the workspace by the TMA engine, in
    step order; each staging tile handed back once the engine has read it (so a consumer's
    part of the dQ add is a shared-memory store and two barrier operations).  The steps are
    counted across a persistent program's key tiles, as the consumers count them."""
    if DQ_WRITER:
        first_item, item_stride, n_items = program_items(num_items, PERSISTENT)
        g = 0  # steps of the key tiles before
        for it in range(n_items):
            b, hk, n0, q_start, _k_start, _sq, _sk, lo, _fl, _fh, _edge, n_steps = key_tile_work(
                first_item + it * item_stride, num_items, section_heads, CU_Q, CU_K, seqlen_q, seqlen_k, max_seqlen_k,
                nheads_k, window_left, window_right, BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT, VARLEN)
            if n_steps >= 0:
                if VARLEN:
                    b = 0  # packed tensors are one batch entry of the descriptor
                for step in range(n_steps * group):
                    h, m0 = step_rows(step, hk, group, n_steps, lo, BLOCK_M)
                    row = q_start + m0
                    for i in gl.static_range(2):
                        mbarrier.wait(dq_full.index(i), (g + step) & 1)
                        # Rows past a dense tensor's end fall outside the descriptor and are dropped.
                        async_reduce_add(DQ_desc, [b, row, h, i * (HEAD_DIM // 2)], dq_smem.index(i))
                    tma.store_wait(1)
                    mbarrier.arrive(dq_empty.index(0), count=1)
                    tma.store_wait(0)
                    mbarrier.arrive(dq_empty.index(1), count=1)
                g += n_steps * group


@gluon.jit
def _consumer(k_smem, v_smem, q_bufs, do_bufs, lse_bufs, delta_bufs, ds_smem, dq_smem, dq_full, dq_empty, kv_ready,
              kv_empty, ready, empty, ds_ready, DQ, DQ_desc, DK, DV, CU_Q, CU_K,
              stride_dqb, stride_dqm, stride_dqh, stride_kb, stride_km, stride_kh,
              seqlen_q, seqlen_k, max_seqlen_k, nheads_k, group, headdim, qk_scale, softmax_scale,
              window_left, window_right, num_items, section_heads, key_off, col_off,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, NUM_STAGES: gl.constexpr,
              MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, VARLEN: gl.constexpr,
              WITH_DQ: gl.constexpr, DQ_TMA: gl.constexpr, DQ_LAG: gl.constexpr, DK_SMEM: gl.constexpr,
              DQ_WRITER: gl.constexpr, PERSISTENT: gl.constexpr, DK_EARLY: gl.constexpr,
              DQ_PUBLISH_LATE: gl.constexpr, DS_BUFS: gl.constexpr):
    """Keys ``[key_off, key_off + 64)`` of each of the program's key tiles (their dK, dV and dS rows),
    and columns ``[col_off, col_off + HEAD_DIM / 2)`` of each step's dQ (without ``WITH_DQ``:
    no dQ, and the consumers never wait for each other; the dS tile stays in registers).

    With ``DQ_LAG`` the dS tile is double-buffered (``DS_BUFS``: or triple) and a step's dQ GEMM is issued one step
    later, after the consumer's own dV and dK GEMMs of the next step: a consumer waits for
    the other one's dS of the step before, not of this one, so the two need not run in
    lock-step (their softmax phases can interleave).

    Every wgmma retires within its step: one still running across the loop's back edge makes
    ptxas serialise all of them (its C7514 note; the offline check fails on it).
    """
    KEYS: gl.constexpr = CONSUMER_KEYS
    DQ_COLS: gl.constexpr = HEAD_DIM // 2
    # How many steps back the last reader of the dS buffer a step writes is: the dQ GEMM of the
    # step after the one that wrote it (DQ_LAG), or of that step itself.
    DS_REUSE: gl.constexpr = DS_BUFS - 1 if DQ_LAG else DS_BUFS
    dtype: gl.constexpr = q_bufs.dtype
    # (keys x queries) score tiles, (keys x d) dK / dV, (queries x d / 2) dQ share.
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, DQ_COLS, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    q_vec: gl.constexpr = gl.SliceLayout(0, s_layout)
    # dQ's adds: 4 consecutive fp32 a thread (one 16-byte vector add), a warp on whole rows,
    # so a thread needs few addresses (the wgmma layout holds pairs and would need 4x more).
    ADD_TPR: gl.constexpr = DQ_COLS // 4 if DQ_COLS // 4 < 32 else 32
    add_layout: gl.constexpr = gl.BlockedLayout([1, 4], [32 // ADD_TPR, ADD_TPR], [4, 1], [1, 0])

    first_item, item_stride, n_items = program_items(num_items, PERSISTENT)
    base = 0  # ring count of the key tile's first step (runs across a persistent program's tiles)
    kv_count = 0  # key tiles whose K and V have been read
    for it in range(n_items):
        b, hk, n0, q_start, k_start, sq, sk, lo, full_lo, full_hi, key_edge, n_steps = key_tile_work(
            first_item + it * item_stride, num_items, section_heads, CU_Q, CU_K, seqlen_q, seqlen_k, max_seqlen_k,
            nheads_k, window_left, window_right, BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT, VARLEN)
        if n_steps >= 0:
            k_all = k_smem.reshape([BLOCK_N, HEAD_DIM])
            k_h = k_all.slice(key_off, KEYS, dim=0)
            v_h = v_smem.reshape([BLOCK_N, HEAD_DIM]).slice(key_off, KEYS, dim=0)
            k_cols = k_all.slice(col_off, DQ_COLS, dim=1)
            offs_k = n0 + key_off + gl.arange(0, KEYS, layout=gl.SliceLayout(1, s_layout))
            dq_rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, add_layout))
            dq_cols = col_off + gl.arange(0, DQ_COLS, layout=gl.SliceLayout(0, add_layout))
            dk = gl.zeros([KEYS, HEAD_DIM], gl.float32, layout=acc_layout)
            dv = gl.zeros([KEYS, HEAD_DIM], gl.float32, layout=acc_layout)
            total = n_steps * group
            mbarrier.wait(kv_ready, kv_count & 1)
            for c in range(total):
                g = base + c  # the step's ring count: slots, phases and dS buffers
                h, m0 = step_rows(c, hk, group, n_steps, lo, BLOCK_M)
                slot = g % NUM_STAGES
                phase = (g // NUM_STAGES) & 1
                mbarrier.wait(ready.index(slot), phase)
                q = q_bufs.index(slot).reshape([BLOCK_M, HEAD_DIM])
                s_t = warpgroup_mma(k_h, q.permute((1, 0)), gl.zeros([KEYS, BLOCK_M], gl.float32, layout=s_layout),
                                    use_acc=False, is_async=True)
                do = do_bufs.index(slot).reshape([BLOCK_M, HEAD_DIM])
                dp_t = warpgroup_mma(v_h, do.permute((1, 0)), gl.zeros([KEYS, BLOCK_M], gl.float32, layout=s_layout),
                                     use_acc=False, is_async=True)
                if DQ_PUBLISH_LATE:
                    # The dQ share staged at the end of the step before (of step c - 2) is handed
                    # on once this step's first GEMMs are queued.
                    if c > 1:
                        held_h, held_m0 = step_rows(c - 2, hk, group, n_steps, lo, BLOCK_M)
                        _dq_publish(DQ_desc, dq_smem, dq_full, b, held_h, held_m0, q_start, col_off, dq_layout,
                                    VARLEN, DQ_WRITER)
                s_t = warpgroup_mma_wait(1, deps=[s_t])
                # Read in the score layout straight from the slot, only where used, so the rows
                # hold no registers while the GEMMs run.  Rows past the sequence read 0 (module
                # docstring: a packed batch's get +inf here).
                lse_q = lse_bufs.index(slot).load(q_vec)
                if VARLEN:
                    lse_q = gl.where(m0 + gl.arange(0, BLOCK_M, layout=q_vec) < sq, lse_q, float("inf"))
                p_t = gl.exp2(s_t * qk_scale - gl.expand_dims(lse_q, 0))
                if (m0 < full_lo) | (m0 >= full_hi) | key_edge:
                    offs_q_s = m0 + gl.arange(0, BLOCK_M, layout=q_vec)
                    visible = band_mask(gl.expand_dims(offs_q_s, 0), gl.expand_dims(offs_k, 1), sq, sk,
                                        window_left, window_right, MASK_LEFT, MASK_RIGHT)
                    p_t = gl.where(visible, p_t, 0.0)
                # dV's GEMM runs while dS is computed.
                dv = warpgroup_mma(gl.convert_layout(p_t.to(dtype), a_layout), do, dv, is_async=True)
                dp_t = warpgroup_mma_wait(1, deps=[dp_t])
                ds_t = (p_t * (dp_t - gl.expand_dims(delta_bufs.index(slot).load(q_vec), 0))).to(dtype)
                if not WITH_DQ:
                    dk = warpgroup_mma(gl.convert_layout(ds_t, a_layout), q, dk, is_async=True)
                    dv, dk = warpgroup_mma_wait(0, deps=[dv, dk])
                    mbarrier.arrive(empty.index(slot), count=1)
                else:
                    # dQ = dS K needs every key's dS, with queries as rows: each consumer writes its
                    # rows of the shared dS^T tile (once both have read what it held before), and both
                    # read it transposed once both have written it.  dK's GEMM is queued in between,
                    # so the tensor cores have dV, dK and dQ back to back.
                    buf = g % DS_BUFS
                    ds_all = ds_smem.index(buf)
                    my_ds = ds_all.slice(key_off, KEYS, dim=0)
                    if DK_EARLY:
                        # dK's operand is in registers: its GEMM runs while the tile is stored.
                        dk = warpgroup_mma(gl.convert_layout(ds_t, a_layout), q, dk, is_async=True)
                    # The buffer's last reader is a dQ GEMM that both consumers retired in step
                    # g - DS_REUSE just before releasing that step's ring slot: the slot's release
                    # is the buffer's (no barrier of its own; the first steps wait on a fresh
                    # phase).  The last step of a key tile before is step g - 1: its late dQ GEMM,
                    # after the loop, reads another buffer.  A release NUM_STAGES steps back
                    # came before this step's tiles were loaded into the slot (the producer waits
                    # for it): no wait then.
                    if DS_REUSE < NUM_STAGES:
                        before = g + NUM_STAGES - DS_REUSE
                        mbarrier.wait(empty.index(before % NUM_STAGES), (before // NUM_STAGES + 1) & 1)
                    my_ds.store(ds_t)
                    fence_async_shared()
                    mbarrier.arrive(ds_ready.index(buf), count=1)
                    if DK_SMEM:
                        dk = warpgroup_mma(my_ds, q, dk, is_async=True)
                    elif not DK_EARLY:
                        dk = warpgroup_mma(gl.convert_layout(ds_t, a_layout), q, dk, is_async=True)
                    if DQ_LAG:
                        # The previous step's dQ (its dS in the other buffer).  A key tile's step 0
                        # has none: it multiplies its own dS tile once both consumers have written
                        # it and drops the product, so that the wgmma waits stay outside any
                        # run-time branch.
                        prev = base + gl.maximum(c - 1, 0)
                        mbarrier.wait(ds_ready.index(prev % DS_BUFS), (prev // DS_BUFS) & 1)
                        dq = warpgroup_mma(ds_smem.index(prev % DS_BUFS).permute((1, 0)), k_cols,
                                           gl.zeros([BLOCK_M, DQ_COLS], gl.float32, layout=dq_layout),
                                           use_acc=False, is_async=True)
                        dv, dk, dq = warpgroup_mma_wait(0, deps=[dv, dk, dq])
                        mbarrier.arrive(empty.index(slot), count=1)
                        if c > 0:
                            prev_h, prev_m0 = step_rows(prev - base, hk, group, n_steps, lo, BLOCK_M)
                            _dq_out(DQ, DQ_desc, dq_smem, dq_full, dq_empty, prev, dq, b, prev_h, prev_m0, q_start,
                                    sq, col_off, stride_dqb, stride_dqm, stride_dqh, dq_rows, dq_cols, add_layout,
                                    dq_layout, BLOCK_M, VARLEN, DQ_TMA, DQ_WRITER, not DQ_PUBLISH_LATE)
                    else:
                        mbarrier.wait(ds_ready.index(0), g & 1)
                        dq = warpgroup_mma(ds_all.permute((1, 0)), k_cols,
                                           gl.zeros([BLOCK_M, DQ_COLS], gl.float32, layout=dq_layout),
                                           use_acc=False, is_async=True)
                        dv, dk, dq = warpgroup_mma_wait(0, deps=[dv, dk, dq])
                        mbarrier.arrive(empty.index(slot), count=1)
                        _dq_out(DQ, DQ_desc, dq_smem, dq_full, dq_empty, g, dq, b, h, m0, q_start, sq, col_off,
                                stride_dqb, stride_dqm, stride_dqh, dq_rows, dq_cols, add_layout, dq_layout, BLOCK_M,
                                VARLEN, DQ_TMA, DQ_WRITER)
            if DQ_LAG and WITH_DQ:
                if DQ_PUBLISH_LATE:
                    if total > 1:
                        held_h, held_m0 = step_rows(total - 2, hk, group, n_steps, lo, BLOCK_M)
                        _dq_publish(DQ_desc, dq_smem, dq_full, b, held_h, held_m0, q_start, col_off, dq_layout,
                                    VARLEN, DQ_WRITER)
                if total > 0:
                    last = base + total - 1
                    mbarrier.wait(ds_ready.index(last % DS_BUFS), (last // DS_BUFS) & 1)
                    dq = warpgroup_mma(ds_smem.index(last % DS_BUFS).permute((1, 0)), k_cols,
                                       gl.zeros([BLOCK_M, DQ_COLS], gl.float32, layout=dq_layout),
                                       use_acc=False, is_async=True)
                    dq = warpgroup_mma_wait(0, deps=[dq])
                    last_h, last_m0 = step_rows(last - base, hk, group, n_steps, lo, BLOCK_M)
                    _dq_out(DQ, DQ_desc, dq_smem, dq_full, dq_empty, last, dq, b, last_h, last_m0, q_start, sq,
                            col_off, stride_dqb, stride_dqm, stride_dqh, dq_rows, dq_cols, add_layout, dq_layout,
                            BLOCK_M, VARLEN, DQ_TMA, DQ_WRITER)
            if PERSISTENT:
                mbarrier.arrive(kv_empty, count=1)  # K and V are no longer read: the next tile's may load
            kv_base = b.to(gl.int64) * stride_kb + hk * stride_kh + k_start.to(gl.int64) * stride_km
            store_rows(DV, kv_base, n0 + key_off, sk, stride_km, headdim, dv, HEAD_DIM, KEYS)
            store_rows(DK, kv_base, n0 + key_off, sk, stride_km, headdim, dk * softmax_scale, HEAD_DIM, KEYS)
            base += total
            kv_count += 1
    if DQ_TMA and not DQ_WRITER:
        tma.store_wait(0)  # the staging tile stays until the engine has read it


# ``section_heads`` varies with the shape and only causal calls read it: not specialised, so
# its value never selects another compiled variant.
# ``group`` unspecialised: with it and the sequence lengths all 1 (one query head per key
# head, one row), Triton 3.6's lowering of the late dQ GEMM's loop to LLVM fails an assertion.
@gluon.jit(do_not_specialize=["section_heads", "group"])
def attention_bwd_kernel(
    Q_desc, K_desc, V_desc, DO_desc, DQ_desc, DQ, DK, DV, LSE2, Delta, CU_Q, CU_K,
    stride_dqb, stride_dqm, stride_dqh, stride_kb, stride_km, stride_kh, stride_lb, stride_lh,
    seqlen_q, seqlen_k, max_seqlen_k, nheads_k, group, headdim, qk_scale, softmax_scale,
    window_left, window_right, num_items, section_heads,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
    MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, VARLEN: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    WITH_DQ: gl.constexpr, DQ_TMA: gl.constexpr, DQ_LAG: gl.constexpr, DK_SMEM: gl.constexpr,
    DQ_WRITER: gl.constexpr, PERSISTENT: gl.constexpr, DK_EARLY: gl.constexpr, DQ_PUBLISH_LATE: gl.constexpr,
    DS_BUFS: gl.constexpr,
):
    dtype: gl.constexpr = Q_desc.dtype
    KEYS: gl.constexpr = CONSUMER_KEYS
    k_smem, v_smem, q_bufs, do_bufs, lse_bufs, delta_bufs, kv_ready, kv_empty, ready, empty = producer_buffers(
        Q_desc, K_desc, V_desc, DO_desc, NUM_STAGES, BLOCK_M, PERSISTENT)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
    ds_smem = gl.allocate_shared_memory(dtype, [DS_BUFS, BLOCK_N, BLOCK_M], ds_layout)
    if DQ_TMA:  # each consumer's dQ share, staged for the TMA add
        dq_smem = gl.allocate_shared_memory(gl.float32, [2] + DQ_desc.block_type.shape, DQ_desc.layout)
    else:  # not read: a stand-in for the consumers' argument
        dq_smem = gl.allocate_shared_memory(gl.float32, [2, 1, 8, 1, DQ_desc.block_type.shape[3]], DQ_desc.layout)
    ds_ready = gl.allocate_shared_memory(gl.int64, [DS_BUFS, 1], mbarrier.MBarrierLayout())
    dq_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    # Only the barriers a configuration uses are initialised: one that is never waited on may
    # share its memory with other buffers, which only plain memory may.
    if DQ_WRITER:
        for i in gl.static_range(2):
            mbarrier.init(dq_full.index(i), count=1)  # consumer i has staged its dQ share
            mbarrier.init(dq_empty.index(i), count=1)  # the TMA engine has read it
    if WITH_DQ:
        for i in gl.static_range(DS_BUFS):
            mbarrier.init(ds_ready.index(i), count=2)  # both consumers have written their rows of dS

    gl.warp_specialize([
        (_consumer, (k_smem, v_smem, q_bufs, do_bufs, lse_bufs, delta_bufs, ds_smem, dq_smem.index(0), dq_full.index(0),
                     dq_empty.index(0), kv_ready, kv_empty, ready, empty, ds_ready, DQ, DQ_desc, DK, DV, CU_Q, CU_K,
                     stride_dqb, stride_dqm, stride_dqh, stride_kb, stride_km, stride_kh,
                     seqlen_q, seqlen_k, max_seqlen_k, nheads_k, group, headdim, qk_scale, softmax_scale,
                     window_left, window_right, num_items, section_heads, 0, 0,
                     BLOCK_M, BLOCK_N, HEAD_DIM, NUM_STAGES, MASK_LEFT, MASK_RIGHT, VARLEN, WITH_DQ, DQ_TMA, DQ_LAG,
                     DK_SMEM, DQ_WRITER, PERSISTENT, DK_EARLY, DQ_PUBLISH_LATE, DS_BUFS)),
        (_consumer, (k_smem, v_smem, q_bufs, do_bufs, lse_bufs, delta_bufs, ds_smem, dq_smem.index(1), dq_full.index(1),
                     dq_empty.index(1), kv_ready, kv_empty, ready, empty, ds_ready, DQ, DQ_desc, DK, DV, CU_Q, CU_K,
                     stride_dqb, stride_dqm, stride_dqh, stride_kb, stride_km, stride_kh,
                     seqlen_q, seqlen_k, max_seqlen_k, nheads_k, group, headdim, qk_scale, softmax_scale,
                     window_left, window_right, num_items, section_heads, KEYS, HEAD_DIM // 2,
                     BLOCK_M, BLOCK_N, HEAD_DIM, NUM_STAGES, MASK_LEFT, MASK_RIGHT, VARLEN, WITH_DQ, DQ_TMA, DQ_LAG,
                     DK_SMEM, DQ_WRITER, PERSISTENT, DK_EARLY, DQ_PUBLISH_LATE, DS_BUFS)),
        (producer, (Q_desc, K_desc, V_desc, DO_desc, k_smem, v_smem, q_bufs, do_bufs, lse_bufs, delta_bufs,
                     kv_ready, kv_empty, ready, empty, LSE2, Delta, stride_lb, stride_lh,
                     CU_Q, CU_K, seqlen_q, seqlen_k, max_seqlen_k, nheads_k, group, window_left, window_right,
                     num_items, section_heads, BLOCK_M, BLOCK_N, NUM_STAGES, MASK_LEFT, MASK_RIGHT, VARLEN,
                     PERSISTENT)),
        (_dq_writer, (DQ_desc, dq_smem, dq_full, dq_empty, CU_Q, CU_K, seqlen_q, seqlen_k, max_seqlen_k, nheads_k, group,
                      window_left, window_right, num_items, section_heads, BLOCK_M, BLOCK_N, HEAD_DIM, MASK_LEFT,
                      MASK_RIGHT, VARLEN, DQ_WRITER, PERSISTENT)),
    ], [4, 1, 1], [CONSUMER_REGS, PRODUCER_REGS, PRODUCER_REGS])


# --------------------------------------------------------------------------------------
# Launch configuration and launcher
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class HopperBwdConfig(RegisterBudget):
    """Tiles of the Hopper backward (``BLOCK_N`` is two consumers' keys)."""

    block_m: int = 64
    num_stages: int = 2
    consumer_regs: int = 240
    producer_regs: int = 24
    # dQ added by the TMA engine from a staged tile (else: vector atomics); that add issued by
    # the writer warp (else: by each consumer); a step's dQ GEMM issued one step late (the dS
    # tile double-buffered); dK's dS operand read from shared memory (else: registers).
    # ``config_for`` picks them per head dim.
    dq_tma: bool = False
    dq_writer: bool = False
    dq_lag: bool = False
    dk_smem: bool = False
    # dK's GEMM (its dS operand in registers) issued before the consumer stores its dS rows, so
    # it runs under the store, the fence and the barriers; with the late dQ GEMM and the TMA's
    # add, a step's staged dQ share handed on (fence, then the writer's barrier or the add)
    # only once the next step's first GEMMs are queued.
    dk_early: bool = False
    dq_publish_late: bool = False
    # With dq_lag and 64-row query tiles, a third dS tile: a consumer writes a step's dS rows
    # without waiting for the other one to finish the step before (whose dQ GEMM read the
    # buffer two steps back).  128-row tiles (d <= 64) keep two: three do not fit shared memory.
    third_ds_buffer: bool = False
    # dQ at all: without it the kernel computes dK and dV alone (``separate_dq_config``).
    with_dq: bool = True
    # One program per SM walking key tiles round-robin (else one program per key tile): the
    # next tile's first Q / dO tiles load while this one finishes, and its K and V while this
    # one's dK and dV are stored.
    persistent: bool = False

    def __post_init__(self):
        if self.dk_early and self.dk_smem:
            raise ValueError("dk_early issues dK's GEMM from registers: not with dk_smem")
        if self.dq_publish_late and not (self.dq_tma and self.dq_lag and self.with_dq):
            raise ValueError("dq_publish_late hands on a staged dQ share: it needs dq_tma, dq_lag and with_dq")
        if self.third_ds_buffer and not (self.dq_lag and self.with_dq):
            raise ValueError("third_ds_buffer holds the late dQ GEMM's dS tiles: it needs dq_lag and with_dq")

    @property
    def block_n(self) -> int:
        return 2 * CONSUMER_KEYS.value

    @property
    def ds_buffers(self) -> int:
        """dS tiles in shared memory: two with the late dQ GEMM (three with ``third_ds_buffer``
        where they fit), else one."""
        if not self.dq_lag:
            return 1
        return 3 if self.third_ds_buffer and self.block_m <= 64 else 2

    @property
    def writer_adds_dq(self) -> bool:
        """Whether the writer warp has work: the TMA's dQ add, left to it, in a kernel with dQ."""
        return bool(self.dq_writer and self.dq_tma and self.with_dq)


# The alternatives to the default configuration (``config_from_spec`` specs) that the
# offline compile check covers, the GPU tests check and ``benchmarks/bench_hopper_bwd.py
# --variants`` times against the default (docs/tuning.md); ``dq_writer=0`` changes only the
# head dims whose default has the writer.
ALTERNATIVES = ("dq_tma=0+dq_lag=0+dq_publish_late=0", "dq_tma=0+dq_lag=1+dq_publish_late=0",
                "dk_smem=1+dk_early=0", "block_m=64+dq_lag=0+dq_publish_late=0", "dq_writer=0", "persistent=1",
                "dk_early=0+dq_publish_late=0", "dk_early=1", "dk_early=1+dq_publish_late=1",
                "dk_early=1+dq_publish_late=1+third_ds_buffer=1")

# dK and dV of 64 keys stay in fp32 registers: 2 * d / 2 registers a thread, which fits the
# consumers' budget up to d = 128; wider heads go to ``attention_bwd_wide`` (dK and dV only).
MAX_HEADDIM = 128


def returns_dq_workspace(head_dim_pad: int, separate_dq: bool) -> bool:
    """Whether :func:`backward` (and a :func:`dense_plan`) computes dQ, as an fp32 workspace; else
    it returns None for it and the caller runs a separate dQ pass (``engine.separate_dq_engine``).
    ``separate_dq``: ``engine.separate_dq``'s answer for the call."""
    return not separate_dq and head_dim_pad <= MAX_HEADDIM


@functools.lru_cache(maxsize=None)
def config_for(head_dim_pad: int) -> HopperBwdConfig:
    """The tile configuration per padded head dim, the fastest measured on an H200 (forward +
    backward, bf16, N = 1k-16k; docs/tuning.md): the TMA's dQ add and the late dQ GEMM, with
    128-row query tiles up to d = 64 (each consumer's score tiles 64 keys x 128 queries: half
    the steps, each with twice the GEMM work per barrier and exchange) and the writer warp
    issuing the add above d = 64 (with it against without: 0.99-1.05x at d = 128, 0.92-0.95x
    at d = 64 causal); above d = 64 dK's GEMM issued before the dS store and a step's dQ share
    handed on after the next step's first GEMMs (H100, d = 128: 0.99-1.06x non-causal,
    1.00-1.20x causal; at d = 64 within noise)."""
    small = head_dim_pad <= 64
    return HopperBwdConfig(dq_tma=True, dq_lag=True, dq_writer=not small, block_m=128 if small else 64,
                           dk_early=not small, dq_publish_late=not small)


def separate_dq_config(head_dim_pad: int) -> HopperBwdConfig:
    """The configuration of a backward whose dQ is a separate pass (``engine.separate_dq``:
    ``deterministic=True``, short masked calls): dK and dV only (every program
    owns its keys' rows, so they are reproducible bit for bit), dQ left to a pass whose
    programs own their rows too; the query tiles of ``config_for`` (128 rows up to d = 64: at
    d = 64, N = 4k / 16k, 1.17 / 1.11x the 64-row tiles non-causal, docs/tuning.md)."""
    return HopperBwdConfig(with_dq=False, block_m=config_for(head_dim_pad).block_m)


def config_from_spec(head_dim_pad: int, spec: str) -> HopperBwdConfig:
    """``config_for(head_dim_pad)`` with the changes of ``spec`` (``hopper.config_changes``;
    ``""``: the default itself)."""
    return configured(config_for, spec)(head_dim_pad)


def operand_tiles(layout, q, k, v, dout, cfg, hd, make=descriptor) -> tuple:
    """The descriptors of Q, K, V and dO with ``cfg``'s boxes (``make`` builds them; a plan
    turns them into templates): the first four arguments of both backward kernels."""
    return (layout.tiles(q, cfg.block_m, hd, make), layout.tiles(k, cfg.block_n, hd, make),
            layout.tiles(v, cfg.block_n, hd, make), layout.tiles(dout, cfg.block_m, hd, make))


def row_strides(t, varlen: bool) -> tuple:
    """(batch, row, head) strides of a ``(batch, seqlen, heads, d)`` output, or of a packed
    ``(total, heads, d)`` one (batch stride 0)."""
    return (0, t.stride(0), t.stride(1)) if varlen else (t.stride(0), t.stride(1), t.stride(2))


def key_tile_args(layout, q, headdim, softmax_scale, window_left, window_right, cfg) -> tuple:
    """``(grid, scalars)``: the grid of ``cfg``'s ``block_n``-key tiles (one program per tile, or
    per SM with ``cfg.persistent``) and both backward kernels' trailing arguments -- sizes,
    scales, the window, the item count and the causal schedule's section of heads
    (``key_tile_work``): the heads whose Q and dO fit in half of L2, and on a persistent grid
    the size below that whose round-robin shares come out most even
    (``tile_info.schedule``)."""
    num_items = cdiv(layout.seqlen_k, cfg.block_n) * layout.batch * layout.nheads_k
    group = layout.nheads // layout.nheads_k
    heads = layout.batch * layout.nheads_k
    section = section_heads(2 * layout.seqlen_q * q.shape[-1] * q.element_size() * group, heads,
                            l2_bytes(q.device.index) // 2)
    programs = min(num_items, sm_count(q.device.index)) if cfg.persistent else num_items
    if cfg.persistent and window_right >= 0:
        costs = key_tile_costs(layout.seqlen_q, layout.seqlen_k, cfg.block_m, cfg.block_n, window_left, window_right,
                               group)
        section = schedule(costs, heads, programs, section)
    return (programs,), (
        layout.rows_q, layout.rows_k, layout.seqlen_k, layout.nheads_k, group, headdim,
        softmax_scale * LOG2E, softmax_scale, window_left, window_right, num_items, section,
    )


def _launch_args(layout, q, k, v, dout, dq_acc, dk, dv, lse2, delta, headdim, softmax_scale, window_left,
                 window_right, cfg, make=descriptor):
    """``(grid, args, options)`` of the kernel's launch: the general launcher's and a launch
    plan's sample (``make`` builds the descriptors; a plan turns them into templates)."""
    hd = padded_headdim(headdim)
    grid, scalars = key_tile_args(layout, q, headdim, softmax_scale, window_left, window_right, cfg)
    cu_q, cu_k, stride_lb, stride_lh = layout.seq_args(lse2)
    args = (
        *operand_tiles(layout, q, k, v, dout, cfg, hd, make),
        layout.tiles(dq_acc, cfg.block_m, hd // 2, make), dq_acc, dk, dv, lse2, delta, cu_q, cu_k,
        *row_strides(dq_acc, layout.varlen), *row_strides(dk, layout.varlen), stride_lb, stride_lh, *scalars,
    )
    options = dict(kernel_constexprs(cfg, hd, window_left >= 0, window_right >= 0, layout.varlen),
                   num_warps=4, maxnreg=cfg.maxnreg)
    return grid, args, options


def kernel_constexprs(cfg, head_dim_pad, mask_left, mask_right, varlen) -> dict:
    """The kernel's constexprs for configuration ``cfg``: what the launcher passes and the
    offline compile check compiles."""
    return dict(
        HEAD_DIM=head_dim_pad, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, NUM_STAGES=cfg.num_stages,
        MASK_LEFT=mask_left, MASK_RIGHT=mask_right, VARLEN=varlen,
        CONSUMER_REGS=cfg.consumer_regs, PRODUCER_REGS=cfg.producer_regs,
        WITH_DQ=cfg.with_dq, DQ_TMA=cfg.dq_tma, DQ_LAG=cfg.dq_lag, DK_SMEM=cfg.dk_smem,
        DQ_WRITER=cfg.writer_adds_dq, PERSISTENT=cfg.persistent, DK_EARLY=cfg.dk_early,
        DQ_PUBLISH_LATE=cfg.dq_publish_late, DS_BUFS=cfg.ds_buffers,
    )


# The launch arguments a call passes (q, k, v, dO, the dQ workspace's descriptor and tensor,
# dK, dV, the LSE and delta, and the two cu_seqlens stand-ins: the LSE): the rest is fixed per
# launch plan.
_HEAD = 12


def backward(layout, q, k, v, dout, lse2, delta, headdim, softmax_scale, window_left, window_right, config=None,
             separate_dq=False):
    """(dQ's workspace, dK, dV) of ``layout``'s attention (``flashtile.kernels.attention.Layout``),
    from the preprocess's ``lse2`` (LSE * log2 e, ``+inf`` on empty rows) and ``delta``.  ``q``,
    ``k``, ``v``, ``dout`` are the TMA-ready tensors (their last dim may be padded past the true
    ``headdim``); dK and dV come back shaped like ``k`` and ``v`` (columns past ``headdim``
    unwritten).  dQ comes as the kernel's fp32 workspace, which ``backward.dq_from_workspace`` turns
    into dQ once the caller has dropped ``lse2`` and ``delta`` (the conversion is the backward's
    peak of memory) -- or None with ``separate_dq`` (dK and dV alone: ``separate_dq_config``;
    the caller computes dQ)."""
    d = headdim
    hd = padded_headdim(d)
    if hd > MAX_HEADDIM:
        from flashtile.kernels.hopper import attention_bwd_wide

        return attention_bwd_wide.backward(layout, q, k, v, dout, lse2, delta, headdim, softmax_scale, window_left,
                                           window_right)
    cfg = config or (separate_dq_config(hd) if separate_dq else config_for(hd))
    # fp32 and HEAD_DIM columns wide: the kernel adds whole rows, unmasked, vectorised.  Without
    # dQ, one tile of it for the descriptor the kernel's signature takes.
    if cfg.with_dq:
        dq_acc = torch.zeros((*q.shape[:-1], hd), dtype=torch.float32, device=q.device)
    else:
        dq_acc = torch.empty((cfg.block_m, 1, hd) if layout.varlen else (1, cfg.block_m, 1, hd), dtype=torch.float32,
                             device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if cdiv(layout.seqlen_k, cfg.block_n) * layout.batch * layout.nheads_k > 0:  # else no tile to build a descriptor for
        # Through the launch layer: after the first call of a class, the compiled kernel is
        # launched directly.
        launch(attention_bwd_kernel, *_launch_args(layout, q, k, v, dout, dq_acc, dk, dv, lse2, delta, d,
                                                   softmax_scale, window_left, window_right, cfg))
    return (dq_acc if cfg.with_dq else None), dk, dv


def dense_plan(layout, q, k, v, dout, lse2, delta, softmax_scale, window_left, window_right, separate_dq=False):
    """The launch plan of :func:`backward` for dense inputs with these shapes, strides, dtypes
    and device, the head dim a power of two (no padding), no tensor empty: a function
    ``(q, k, v, dout, lse2, delta) -> (dq's workspace, dk, dv)`` (the workspace as :func:`backward`
    returns it, None with ``separate_dq``) for TMA-ready tensors with 16-byte aligned
    bases (the caller checks the bases).  Per call it allocates the workspace and the
    gradients and launches; the descriptors come from templates (``DescriptorTemplate``), the
    grid, the other arguments and the constexprs are the ones :func:`backward` computes."""
    d = q.shape[-1]
    if d > MAX_HEADDIM:
        from flashtile.kernels.hopper import attention_bwd_wide

        return attention_bwd_wide.dense_plan(layout, q, k, v, dout, lse2, delta, softmax_scale, window_left,
                                             window_right)
    cfg = separate_dq_config(d) if separate_dq else config_for(d)
    acc_shape, dtype, device = tuple(q.shape), q.dtype, q.device
    k_shape, v_shape = tuple(k.shape), tuple(v.shape)
    sample_acc, sample_dk, sample_dv = stand_ins(device, (acc_shape, torch.float32), (k_shape, dtype), (v_shape, dtype))
    # Without dQ, the plan's own tile for the descriptor (the kernel never reads it).
    placeholder_acc = torch.empty((1, cfg.block_m, 1, d), dtype=torch.float32, device=device)
    grid, args, options = _launch_args(layout, q, k, v, dout, sample_acc if cfg.with_dq else placeholder_acc, sample_dk,
                                       sample_dv, lse2, delta, d, softmax_scale, window_left, window_right, cfg)
    args = tuple(DescriptorTemplate(a) if i < 5 else a for i, a in enumerate(args))
    bound = bind(attention_bwd_kernel, grid, options, args, tail_from=_HEAD)

    def run(q, k, v, dout, lse2, delta):
        dk = torch.empty(*k_shape, dtype=dtype, device=device)
        dv = torch.empty(*v_shape, dtype=dtype, device=device)
        if not cfg.with_dq:
            bound((q, k, v, dout, placeholder_acc, placeholder_acc, dk, dv, lse2, delta, lse2, lse2))
            return None, dk, dv
        dq_acc = torch.zeros(*acc_shape, dtype=torch.float32, device=device)
        bound((q, k, v, dout, dq_acc, dq_acc, dk, dv, lse2, delta, lse2, lse2))
        return dq_acc, dk, dv

    return run
