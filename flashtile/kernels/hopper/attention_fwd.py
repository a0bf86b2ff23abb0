"""FlashAttention forward for Hopper in Gluon: a TMA producer warp and two or three consumer warpgroups.

(One module over 600 lines on purpose: the partitions read their tile sizes back from the
buffers the kernel allocates from the configuration's constexprs and the launcher's descriptor
boxes, so kernel, configuration and launcher are one argument, read top to bottom and changed
together.)

A work item is a ``BLOCK_M``-row query tile of one (batch, head), 64 rows per consumer
(``BLOCK_M = 128`` with two, 192 with three: ``config_for``); with a persistent grid each
program runs its items in turn (dealt round-robin, see ``work_item``), split between
partitions that share shared memory and talk through mbarriers:

* **producer** (1 warp, few registers): per item, TMA-loads the query tile once its buffer
  is free (``Q_BUFFERS`` of them: with two, the next item's tile arrives while the consumers
  finish this one; a 192-row tile is one 64-row box per consumer), then streams the key and value
  tiles through a ``NUM_STAGES``-deep ring of shared-memory slots that runs on across items.
  Each slot has a *ready* barrier (TMA completion, byte-counted) and an *empty* barrier (every
  consumer has finished reading it), and so has each query buffer.
* **consumers** (one warpgroup each, most of the registers): each owns 64 of the query rows
  and keeps its running softmax state -- row max ``m``, row sum ``l`` and the
  un-normalised fp32 accumulator -- in registers.  Per key tile ``j`` a consumer issues
  ``S_j = Q K_j^T`` and ``O += P_{j-1} V_{j-1}`` back to back as asynchronous wgmma, waits
  only for ``S_j``, and computes the online-softmax update of tile ``j`` before it waits for
  ``P_{j-1} V_{j-1}``.  (ptxas moves that second wait ahead of the update, unless the update
  sits in a basic block of its own: ``HopperConfig.softmax_under_pv``.)  ``P`` stays in
  registers as the A operand of its wgmma.
  With ``PINGPONG`` the consumers also take turns issuing their GEMMs (a ring of mbarriers
  passes the turn), so one warpgroup's softmax runs under the others' GEMMs.  A consumer
  computes on the key tiles its own rows see and passes the item's others (``pass_tiles``).

The masking rules are flashtile's: ``key_tiles`` decides which key tiles a query tile
visits and which of them need an element-wise mask, ``band_mask`` decides visibility inside
those (both in ``flashtile/kernels/masking.py``), and ``sequence_bounds`` finds a packed
sequence's rows (``flashtile/kernels/tile_info.py``) -- the same ``tl.*`` helpers the
portable kernels call.
Scores carry the scale folded into ``exp2``; normalisation happens once at the end; a row
with no visible key gets output 0 and LSE ``-inf``.  The LSE (natural log, fp32) is the one
the ``tl.*`` backward reads.

Inputs keep flash-attn's layout ``(batch, seqlen, heads, d)`` (or packed ``(total, heads,
d)`` with cu_seqlens) through 4-D TMA descriptors with a ``[1, rows, 1, HEAD_DIM]`` box:
rows past the tensor read as zeros, head dims below ``HEAD_DIM`` (a power of two) read as
zero columns and are never stored.  In a packed batch the rows past a sequence are the next
sequence's: key tiles there are always masked, query rows there are computed but not stored.

The same kernel runs FP8 (e4m3) inputs with ``FP8=True`` (``attention_fp8.py`` launches it):
descales, the max offset, K-major V tiles and a per-tile P V accumulator, see ``_consumer``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from flashtile.kernels import engine
from flashtile.kernels.hopper import RegisterBudget, configured
from flashtile.kernels.hopper.descriptors import descriptor
from flashtile.kernels.hopper.fp8_key_order import key_ordered_operand
from flashtile.kernels.hopper.turns import hand_turn, issue_turn
from flashtile.kernels.launch import bind, launch, placeholder
from flashtile.kernels.masking import band_mask, key_tiles
from flashtile.kernels.online_softmax import alibi_slope_log2, score_mod, score_mod_args
from flashtile.kernels.plans import lse_buffer, stand_ins
from flashtile.kernels.runtime import cdiv, l2_bytes, sm_count
from flashtile.kernels.tile_info import dealt_tile, sequence_bounds, work_schedule
from flashtile.kernels.tma import DescriptorTemplate, padded_headdim

LOG2E = 1.4426950408889634
LN2: gl.constexpr = gl.constexpr(0.6931471805599453)
# Query rows per consumer warpgroup: the M of one wgmma; a query tile is two or three consumers' rows.
CONSUMER_ROWS: gl.constexpr = gl.constexpr(64)


@gluon.jit
def work_item(t, num_items, section_heads, CU_Q, CU_K, seqlen_q, seqlen_k, max_seqlen_q, nheads, group, window_left,
              window_right, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, MASK_LEFT: gl.constexpr,
              MASK_RIGHT: gl.constexpr, VARLEN: gl.constexpr):
    """Work item ``t`` -> (b, h, hk, m0, q_start, k_start, seqlen_q, seqlen_k, lo, full_lo, full_hi, n_tiles).

    Without a causal-like mask every query tile costs the same and the tiles of one head are
    adjacent (they share its K/V in L2).  With one, cost grows with the row, and items are
    dealt across the heads of an L2-sized section, heaviest first in the last section
    (``tile_info.dealt_tile``), so that the programs' round-robin shares come out even and the
    last wave is short.  Every partition derives the same items from ``t``; an item past a
    packed sequence's end has ``n_tiles = -1`` and is skipped by all of them.
    """
    tile, bh = dealt_tile(t, num_items, gl.cdiv(max_seqlen_q, BLOCK_M), section_heads, MASK_RIGHT, True)
    b = bh // nheads
    h = bh % nheads
    m0 = tile * BLOCK_M
    # Packed: seqlen_q / seqlen_k carry the row counts that cu_seqlens are clamped into.
    q_start, seqlen_q, k_start, seqlen_k = sequence_bounds(CU_Q, CU_K, b, seqlen_q, seqlen_k, VARLEN)
    lo, full_lo, full_hi, hi = key_tiles(m0, seqlen_q, seqlen_k, window_left, window_right,
                                         BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT)
    n_tiles = gl.cdiv(gl.maximum(hi - lo, 0), BLOCK_N)
    if m0 >= seqlen_q:  # the grid covers the longest sequence of a packed batch
        n_tiles = -1
    return b, h, h // group, m0, q_start, k_start, seqlen_q, seqlen_k, lo, full_lo, full_hi, n_tiles


@gluon.jit
def load_key_tile(K_desc, V_desc, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, count, b, row, hk,
                  FP8: gl.constexpr):
    """Tile ``count`` of the key stream (keys ``row ...`` of (batch entry ``b``, kv head ``hk``)):
    K into slot ``count % K_STAGES`` of its ring and V into slot ``count % V_STAGES`` of its
    own (the rings' depths are the buffers'), each once every consumer has released the slot's
    previous tile.  FP8 reads V transposed, ``(batch, nheads_k, headdim, seqlen_k)``."""
    K_STAGES: gl.constexpr = k_bufs.shape[0]
    V_STAGES: gl.constexpr = v_bufs.shape[0]
    k_slot = count % K_STAGES
    # An mbarrier starts with its "previous" phase complete: the first waits pass.
    mbarrier.wait(k_empty.index(k_slot), ((count // K_STAGES) & 1) ^ 1)
    mbarrier.expect(k_ready.index(k_slot), K_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(K_desc, [b, row, hk, 0], k_ready.index(k_slot), k_bufs.index(k_slot))
    v_slot = count % V_STAGES
    mbarrier.wait(v_empty.index(v_slot), ((count // V_STAGES) & 1) ^ 1)
    mbarrier.expect(v_ready.index(v_slot), V_desc.block_type.nbytes)
    if FP8:
        v_coord = [b, hk, 0, row]
    else:
        v_coord = [b, row, hk, 0]
    tma.async_copy_global_to_shared(V_desc, v_coord, v_ready.index(v_slot), v_bufs.index(v_slot))


@gluon.jit
def _producer(args, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, Q_BUFFERS: gl.constexpr,
              MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, VARLEN: gl.constexpr, FP8: gl.constexpr):
    """Per work item: the query tile into buffer ``it % Q_BUFFERS`` once it is free (with two,
    the next item's tile loads while the consumers still work on this one), then K_j and V_j
    into ring slot ``count % NUM_STAGES`` once every consumer has released it (``count`` runs
    across items; ``load_key_tile``)."""
    (Q_desc, K_desc, V_desc, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty,
     CU_Q, CU_K, seqlen_q, seqlen_k, max_seqlen_q, nheads, group, window_left, window_right, num_items,
     section_heads) = args
    QUERY_BOXES: gl.constexpr = BLOCK_M // Q_desc.block_type.shape[1]
    Q_BYTES: gl.constexpr = Q_desc.block_type.nbytes * QUERY_BOXES
    count = 0
    # This program's items, spelt out rather than through attention_bwd.program_items: calling
    # it moved ptxas's allocation of the consumers (offline, d = 128 causal: 8 -> 40 bytes spilled).
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    for it in range(gl.cdiv(num_items - pid, nprog)):
        b, h, hk, m0, q_start, k_start, _sq, _sk, lo, _fl, _fh, n_tiles = work_item(
            pid + it * nprog, num_items, section_heads, CU_Q, CU_K, seqlen_q, seqlen_k, max_seqlen_q, nheads, group,
            window_left, window_right, BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT, VARLEN)
        qb = it % Q_BUFFERS
        # An mbarrier starts with its "previous" phase complete: the first waits pass.
        mbarrier.wait(q_empty.index(qb), ((it // Q_BUFFERS) & 1) ^ 1)
        if n_tiles < 0:
            mbarrier.arrive(q_ready.index(qb), count=1)  # a skipped item still turns its buffer's phase
        else:
            if VARLEN:
                b = 0  # packed tensors are one batch entry of the descriptors
            # The tile in one box, or one per consumer (a box's sides are powers of two; 3 x 64 is not).
            mbarrier.expect(q_ready.index(qb), Q_BYTES)
            for i in gl.static_range(QUERY_BOXES):
                tma.async_copy_global_to_shared(Q_desc, [b, q_start + m0 + i * (BLOCK_M // QUERY_BOXES), h, 0],
                                                q_ready.index(qb), q_bufs.index(qb * QUERY_BOXES + i))
            for j in range(n_tiles):
                load_key_tile(K_desc, V_desc, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, count,
                              b, k_start + lo + j * BLOCK_N, hk, FP8)
                count += 1


@gluon.jit
def p_operand(p, p_layout: gl.constexpr, P_DTYPE: gl.constexpr, KEY_ORDER: gl.constexpr):
    """The probabilities in the layout of the P V wgmma's A operand, as ``P_DTYPE`` (16-bit, or
    with FP8 e4m3 or fp16), with FP8's keys relabelled in the operand's order (``KEY_ORDER``)."""
    if KEY_ORDER:
        operand = key_ordered_operand(p, p_layout, P_DTYPE)
    else:
        operand = gl.convert_layout(p.to(P_DTYPE), p_layout)
    return operand


@gluon.jit
def online_update(qk, m_i, l_i, qk_scale, OFFSET: gl.constexpr):
    """The online-softmax update of one tile of (masked) scores: (p, alpha, m, l)."""
    m_new = gl.maximum(m_i, gl.max(qk, 1) * qk_scale)
    m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)
    # OFFSET (FP8's max offset) scales P, and so l, by 2^OFFSET: O = acc / l is unchanged.
    p = gl.exp2(qk * qk_scale - gl.expand_dims(m_sub - OFFSET, 1))
    alpha = gl.exp2(m_i - m_sub)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_i


@gluon.jit
def softmax_step(qk, m_i, l_i, n0, offs_m, seqlen_q, seqlen_k, qk_scale, window_left, window_right,
                  full_lo, full_hi, mods, s_layout: gl.constexpr, BLOCK_N: gl.constexpr,
                  MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, HAS_SOFTCAP: gl.constexpr,
                  HAS_ALIBI: gl.constexpr, OFFSET: gl.constexpr = 0, OWN_BLOCK: gl.constexpr = False):
    """Online-softmax update for one key tile: (p, alpha, m, l) with scores in log2 units.

    ``mods`` is ``(softcap_scale, softcap_log2, slope_log2)``: with a softcap or ALiBi the
    scores go through the portable kernels' ``score_mod`` (docs/semantics.md's order: scale,
    softcap, ALiBi, then the masks) and leave it in log2 units.  Tiles outside ``[full_lo,
    full_hi)`` are cut by the band or the sequence end and get the element-wise mask; a row
    with no visible key so far keeps ``m = -inf`` and subtracts 0, so its probabilities are
    exactly 0, never NaN.

    ``OWN_BLOCK``: the update is computed behind a branch that is always taken (``n0 >= 0``;
    the compiler cannot tell), so that no instruction of it shares a basic block with the
    caller's wait for the P V GEMM in flight: ptxas schedules that wait, ``WARPGROUP.DEPBAR``,
    at the top of its block, ahead of an update in the same block, which then runs after the
    GEMM instead of under it (a ``thread_barrier`` between them does not stop it).
    """
    if HAS_SOFTCAP or HAS_ALIBI:
        softcap_scale, softcap_log2, slope_log2 = mods
        offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        qk, _tanh = score_mod(qk, gl.expand_dims(offs_m, 1), gl.expand_dims(offs_n, 0), seqlen_q, seqlen_k,
                              qk_scale, softcap_scale, softcap_log2, slope_log2, HAS_SOFTCAP, HAS_ALIBI)
        qk_scale = 1.0  # already in log2 units
    if (n0 < full_lo) | (n0 >= full_hi):
        offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        visible = band_mask(gl.expand_dims(offs_m, 1), gl.expand_dims(offs_n, 0), seqlen_q, seqlen_k,
                            window_left, window_right, MASK_LEFT, MASK_RIGHT)
        qk = gl.where(visible, qk, float("-inf"))
    if OWN_BLOCK:
        if n0 >= 0:
            p, alpha, m_new, l_new = online_update(qk, m_i, l_i, qk_scale, OFFSET)
        else:  # never: key tiles start at key 0 or later
            p, alpha, m_new, l_new = qk, m_i, m_i, l_i
    else:
        p, alpha, m_new, l_new = online_update(qk, m_i, l_i, qk_scale, OFFSET)
    return p, alpha, m_new, l_new


@gluon.jit
def consumer_tiles(r0, item_lo, n_tiles, seqlen_q, seqlen_k, window_left, window_right, ROWS: gl.constexpr,
                   BLOCK_N: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr):
    """A consumer's share of its work item's key tiles -> (lo, full_lo, full_hi, before, n_mine,
    after).  The producer streams the item's ``n_tiles`` key tiles from key ``item_lo``, the union
    of its consumers' ranges; the consumer of rows ``r0 ...`` computes on its own rows' run of
    them (``key_tiles`` of those ``ROWS`` rows: the causal diagonal or a window's edge cuts 64
    rows more finely than the whole tile), ``n_mine`` tiles after the ``before`` it passes, and
    passes the ``after`` others -- every tile when its rows lie past the sequence's end."""
    lo, full_lo, full_hi, hi = key_tiles(r0, seqlen_q, seqlen_k, window_left, window_right, ROWS, BLOCK_N,
                                         MASK_LEFT, MASK_RIGHT)
    before = gl.minimum((lo - item_lo) // BLOCK_N, n_tiles)
    n_mine = gl.minimum(gl.cdiv(gl.maximum(hi - lo, 0), BLOCK_N), n_tiles - before)
    if r0 >= seqlen_q:
        n_mine = 0
    return lo, full_lo, full_hi, before, n_mine, n_tiles - before - n_mine


@gluon.jit
def pass_tiles(first, end, my_turn, their_turn, k_ready, k_empty, v_ready, v_empty, PINGPONG: gl.constexpr):
    """Ring counts ``[first, end)``: key tiles of the item that this consumer's rows do not see.
    It takes each tile's turn and hands it on at once, and releases the slots once the tile has
    arrived -- before that, the release would count towards the slot's previous use.  The K and
    V rings' depths are their barrier arrays' (``load_key_tile``)."""
    K_STAGES: gl.constexpr = k_ready.shape[0]
    V_STAGES: gl.constexpr = v_ready.shape[0]
    for c in range(first, end):
        issue_turn(my_turn, c, PINGPONG)
        hand_turn(their_turn, PINGPONG)
        mbarrier.wait(k_ready.index(c % K_STAGES), (c // K_STAGES) & 1)
        mbarrier.arrive(k_empty.index(c % K_STAGES), count=1)
        mbarrier.wait(v_ready.index(c % V_STAGES), (c // V_STAGES) & 1)
        mbarrier.arrive(v_empty.index(c % V_STAGES), count=1)


@gluon.jit
def _pv_mma(p, v_buf, acc, chunk: gl.constexpr, o_layout: gl.constexpr, BLOCK_N: gl.constexpr,
            HEAD_DIM: gl.constexpr, FP8: gl.constexpr):
    """Issue ``P V`` for one key tile: accumulated onto ``acc`` (16-bit), or (FP8, ``p`` e4m3, V
    stored K-major) the output columns of ``acc``'s width from ``chunk * width`` into a fresh
    accumulator that the caller adds in fp32."""
    if FP8:
        COLS: gl.constexpr = acc.shape[1]
        v = v_buf.reshape([HEAD_DIM, BLOCK_N]).slice(chunk * COLS, COLS, dim=0).permute((1, 0))
        pv = warpgroup_mma(p, v, gl.zeros(acc.shape, gl.float32, layout=o_layout), use_acc=False, is_async=True)
    else:
        pv = warpgroup_mma(p, v_buf.reshape([BLOCK_N, HEAD_DIM]), acc, is_async=True)
    return pv


@gluon.jit
def _take_pv(accs, pv, p, v_buf, v_empty, alpha, o_layout: gl.constexpr, BLOCK_N: gl.constexpr,
             HEAD_DIM: gl.constexpr, DEPTH: gl.constexpr):
    """FP8: ``acc_c * alpha + P V_c`` for each column chunk ``c`` of the output, the V slot
    ``v_buf`` released (``v_empty``) once its last GEMM is waited for.  ``pv`` is chunk 0's
    product, already waited for; the later chunks' GEMMs are issued here into fresh
    accumulators, ``DEPTH`` of them in flight at a time (1: each waited for before the next
    issues, its registers reused), each chunk of the output rescaled while its GEMM runs."""
    CHUNKS: gl.constexpr = len(accs)
    scale = gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
    if CHUNKS == 1:
        mbarrier.arrive(v_empty, count=1)
    taken = (accs[0] * scale + pv,)
    if CHUNKS > 1:
        pending = _pv_mma(p, v_buf, accs[1], 1, o_layout, BLOCK_N, HEAD_DIM, True)
    for c in gl.static_range(1, CHUNKS):
        if DEPTH == 1 and c > 1:
            pending = _pv_mma(p, v_buf, accs[c], c, o_layout, BLOCK_N, HEAD_DIM, True)
        acc_c = accs[c] * scale
        if DEPTH > 1 and c + 1 < CHUNKS:
            issued = _pv_mma(p, v_buf, accs[c + 1], c + 1, o_layout, BLOCK_N, HEAD_DIM, True)
            # Groups retire in order: chunk c is done while chunk c + 1 runs.
            pv_c, pending = warpgroup_mma_wait(1, deps=[pending, issued])
        else:
            pv_c = warpgroup_mma_wait(0, deps=[pending])
        if c == CHUNKS - 1:
            mbarrier.arrive(v_empty, count=1)
        taken = taken + (acc_c + pv_c,)
    return taken


@gluon.jit
def _consumer(args, INDEX: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, VARLEN: gl.constexpr,
              PINGPONG: gl.constexpr, FP8: gl.constexpr, OFFSET: gl.constexpr, KEY_ORDER: gl.constexpr,
              P_FP16: gl.constexpr, HAS_SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr,
              SOFTMAX_OWN_BLOCK: gl.constexpr, PV_CHUNKS: gl.constexpr, PV_DEPTH: gl.constexpr):
    """Rows ``[64 * INDEX, 64 * INDEX + 64)`` of each query tile: the pipelined online-softmax loop.

    ``args`` are the kernel's buffers, barriers and runtime arguments, the same for every
    consumer (the tuple the kernel builds once; the tile sizes are read from the buffers'
    shapes, since a tuple carries no constexpr); ``INDEX`` is this consumer's place among the
    ``BLOCK_M // 64``.  With ``PINGPONG`` consumer ``INDEX`` waits on turn barrier ``INDEX``
    and hands the turn to the next one (the last to the first).

    With ``FP8`` (e4m3 inputs, see ``attention_fp8.py``): the (batch, kv head)'s descales
    ``DESCALES[0 / 1 / 2, b, hk]`` scale the scores and the output, P is cast to e4m3 after
    the max offset ``2^OFFSET``, V's tiles are K-major ``[HEAD_DIM, BLOCK_N]``, and each
    tile's P V is a fresh wgmma accumulator added in fp32 (the FP8 wgmma accumulates at
    reduced precision, so chaining tiles in it drops a long row's small terms).  Beside the
    output a whole fresh accumulator does not fit at d = 256: there the output is ``PV_CHUNKS``
    accumulators of ``HEAD_DIM // PV_CHUNKS`` columns, and a tile's P V is issued chunk by chunk
    into fresh accumulators of that width, ``PV_DEPTH`` of them in flight (``_take_pv``).
    """
    (q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turns,
     O, LSE, CU_Q, CU_K, DESCALES, ALIBI, stride_ob, stride_om, stride_oh, stride_lb, stride_lh,
     stride_ds, stride_dsb, stride_ab, seqlen_q, seqlen_k, max_seqlen_q, nheads, group, headdim, qk_scale,
     softcap_scale, softcap_log2, window_left, window_right, num_items, section_heads) = args
    # Buffers: turns [NUM_CONSUMERS, 1], q [Q_BUFFERS * QUERY_BOXES, 1, BOX_ROWS, 1, HEAD_DIM] (a
    # query tile is QUERY_BOXES consecutive boxes), k [NUM_STAGES, 1, BLOCK_N, 1, HEAD_DIM].
    ROWS: gl.constexpr = CONSUMER_ROWS
    NUM_CONSUMERS: gl.constexpr = turns.shape[0]
    BLOCK_M: gl.constexpr = NUM_CONSUMERS * ROWS
    BOX_ROWS: gl.constexpr = q_bufs.shape[2]
    QUERY_BOXES: gl.constexpr = BLOCK_M // BOX_ROWS
    Q_BUFFERS: gl.constexpr = q_bufs.shape[0] // QUERY_BOXES
    NUM_STAGES: gl.constexpr = k_bufs.shape[0]
    BLOCK_N: gl.constexpr = k_bufs.shape[2]
    HEAD_DIM: gl.constexpr = k_bufs.shape[4]
    row_off: gl.constexpr = INDEX * ROWS
    my_turn = turns.index(INDEX)
    their_turn = turns.index((INDEX + 1) % NUM_CONSUMERS)
    dtype: gl.constexpr = q_bufs.dtype
    # The K step of one wgmma: 32 one-byte elements, 16 two-byte ones.
    K_STEP: gl.constexpr = 32 if FP8 else 16
    # P as the loop carries it from its softmax to the next step's P V GEMM: FP8's e4m3, or with
    # P_FP16 fp16, cast to e4m3 where the GEMM is issued (``mma_dtype``).
    p_dtype: gl.constexpr = (gl.float16 if P_FP16 else gl.float8e4nv) if FP8 else dtype
    mma_dtype: gl.constexpr = gl.float8e4nv if FP8 else dtype
    # The output's columns per accumulator (the whole head dim but for FP8 at d = 256).
    COLS: gl.constexpr = HEAD_DIM // PV_CHUNKS
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, K_STEP])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, COLS, K_STEP])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4 if FP8 else 2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    # 16-byte stores: each thread writes 8 consecutive columns of a row.
    VEC: gl.constexpr = 8
    TPC: gl.constexpr = COLS // VEC if COLS // VEC < 32 else 32
    store_layout: gl.constexpr = gl.BlockedLayout([1, VEC], [32 // TPC, TPC], [4, 1], [1, 0])

    # K/V tiles consumed, across work items: the ring's slot and phase, and the ping-pong
    # phase (each tile's GEMMs are issued in one turn).
    count = 0
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    for it in range(gl.cdiv(num_items - pid, nprog)):  # it: this program's item count, the query buffer's phase
        b, h, hk, m0, q_start, _ks, sq, sk, item_lo, _fl, _fh, n_tiles = work_item(
            pid + it * nprog, num_items, section_heads, CU_Q, CU_K, seqlen_q, seqlen_k, max_seqlen_q, nheads, group,
            window_left, window_right, BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT, VARLEN)
        scale = qk_scale
        if FP8:
            ds = DESCALES + b * stride_dsb + hk
            scale = qk_scale * gl.load(ds) * gl.load(ds + stride_ds)
        mods = (softcap_scale, softcap_log2, alibi_slope_log2(ALIBI, stride_ab, b, h, HAS_ALIBI))
        qb = it % Q_BUFFERS
        q_empty_b = q_empty.index(qb)
        mbarrier.wait(q_ready.index(qb), (it // Q_BUFFERS) & 1)
        if n_tiles < 0:
            mbarrier.arrive(q_empty_b, count=1)
        else:
            q = q_bufs.index(qb * QUERY_BOXES + row_off // BOX_ROWS).reshape([BOX_ROWS, HEAD_DIM])
            q = q.slice(row_off % BOX_ROWS, ROWS, dim=0)
            offs_m = m0 + row_off + gl.arange(0, ROWS, layout=row_layout)
            m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=row_layout)
            l_i = gl.zeros([ROWS], gl.float32, layout=row_layout)
            accs = (gl.zeros([ROWS, COLS], gl.float32, layout=o_layout),) * PV_CHUNKS
            lo, full_lo, full_hi, before, n_mine, after = consumer_tiles(
                m0 + row_off, item_lo, n_tiles, sq, sk, window_left, window_right, ROWS, BLOCK_N, MASK_LEFT,
                MASK_RIGHT)
            pass_tiles(count, count + before, my_turn, their_turn, k_ready, k_empty, v_ready, v_empty, PINGPONG)
            count += before
            if n_mine > 0:
                # Tile 0: scores only; its P V joins the next step's GEMMs.
                slot = count % NUM_STAGES
                issue_turn(my_turn, count, PINGPONG)
                mbarrier.wait(k_ready.index(slot), (count // NUM_STAGES) & 1)
                k_t = k_bufs.index(slot).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0))
                qk = warpgroup_mma(q, k_t, gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout), use_acc=False,
                                   is_async=True)
                hand_turn(their_turn, PINGPONG)
                qk = warpgroup_mma_wait(0, deps=[qk])
                mbarrier.arrive(k_empty.index(slot), count=1)
                p, alpha, m_i, l_i = softmax_step(qk, m_i, l_i, lo, offs_m, sq, sk, scale,
                                                  window_left, window_right, full_lo, full_hi, mods, s_layout,
                                                  BLOCK_N, MASK_LEFT, MASK_RIGHT, HAS_SOFTCAP, HAS_ALIBI, OFFSET)
                p_prev = p_operand(p, p_layout, p_dtype, KEY_ORDER)
                count += 1
                # One induction variable, the ring count c: this item's tile c - count0 starts at
                # key n_base + c * BLOCK_N.
                count0 = count - 1
                end = count0 + n_mine
                n_base = lo - count0 * BLOCK_N
                for c in range(count, end):
                    slot = c % NUM_STAGES
                    prev = (c - 1) % NUM_STAGES
                    issue_turn(my_turn, c, PINGPONG)
                    mbarrier.wait(k_ready.index(slot), (c // NUM_STAGES) & 1)
                    k_t = k_bufs.index(slot).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0))
                    qk = warpgroup_mma(q, k_t, gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout), use_acc=False,
                                   is_async=True)
                    mbarrier.wait(v_ready.index(prev), ((c - 1) // NUM_STAGES) & 1)
                    p_mma = p_prev.to(mma_dtype)
                    pv = _pv_mma(p_mma, v_bufs.index(prev), accs[0], 0, o_layout, BLOCK_N, HEAD_DIM, FP8)
                    hand_turn(their_turn, PINGPONG)
                    # wgmma groups retire in order: S_j is ready while P_{j-1} V_{j-1} still runs.
                    qk, pv = warpgroup_mma_wait(1, deps=[qk, pv])
                    mbarrier.arrive(k_empty.index(slot), count=1)
                    alpha_prev = alpha  # the scale from the tile before's running max to the next one's
                    p_c, alpha, m_i, l_i = softmax_step(qk, m_i, l_i, n_base + c * BLOCK_N, offs_m, sq, sk, scale,
                                                        window_left, window_right, full_lo, full_hi, mods, s_layout,
                                                        BLOCK_N, MASK_LEFT, MASK_RIGHT, HAS_SOFTCAP, HAS_ALIBI,
                                                        OFFSET, SOFTMAX_OWN_BLOCK)
                    pv = warpgroup_mma_wait(0, deps=[pv])
                    if FP8:
                        # A tile's P V comes in a fresh accumulator: the sum stays one tile behind
                        # the running max (in the frame of P_{j-1}'s max, as P_{j-1} V_{j-1} is),
                        # so taking it on is one FMA: acc * alpha_{j-1} + P_{j-1} V_{j-1}.
                        accs = _take_pv(accs, pv, p_mma, v_bufs.index(prev), v_empty.index(prev), alpha_prev, o_layout,
                                        BLOCK_N, HEAD_DIM, PV_DEPTH)
                    else:
                        mbarrier.arrive(v_empty.index(prev), count=1)
                        accs = (pv * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1),)
                    p_prev = p_operand(p_c, p_layout, p_dtype, KEY_ORDER)
                count = end
                # The query tile is no longer read: its buffer may take a later item's tile.
                mbarrier.arrive(q_empty_b, count=1)
                last = (count - 1) % NUM_STAGES
                mbarrier.wait(v_ready.index(last), ((count - 1) // NUM_STAGES) & 1)
                p_mma = p_prev.to(mma_dtype)
                pv = _pv_mma(p_mma, v_bufs.index(last), accs[0], 0, o_layout, BLOCK_N, HEAD_DIM, FP8)
                pv = warpgroup_mma_wait(0, deps=[pv])
                if FP8:
                    # Into the last tile's frame, with its P V: the running max's.
                    accs = _take_pv(accs, pv, p_mma, v_bufs.index(last), v_empty.index(last), alpha, o_layout, BLOCK_N,
                                    HEAD_DIM, PV_DEPTH)
                else:
                    mbarrier.arrive(v_empty.index(last), count=1)
                    accs = (pv,)
            else:
                mbarrier.arrive(q_empty_b, count=1)
            pass_tiles(count, count + after, my_turn, their_turn, k_ready, k_empty, v_ready, v_empty, PINGPONG)
            count += after

            # Deferred normalisation: one reciprocal per row; an empty row (l = 0) is selected
            # to 0, so no inf or NaN in V can reach it.
            # FP8: l carries the max offset's 2^OFFSET as acc does, so only the LSE takes it
            # out, and V's descale joins 1 / l.
            empty = l_i == 0.0
            if FP8:
                inv_l = gl.where(empty, 0.0, gl.load(DESCALES + 2 * stride_ds + b * stride_dsb + hk)
                                 / gl.where(empty, 1.0, l_i))
            else:
                inv_l = gl.where(empty, 0.0, 1.0 / gl.where(empty, 1.0, l_i))
            lse = gl.where(empty, float("-inf"), (m_i + gl.log2(gl.where(empty, 1.0, l_i)) - OFFSET) * LN2)
            lse_base = b.to(gl.int64) * stride_lb + h * stride_lh + q_start
            gl.store(LSE + lse_base + offs_m, lse, mask=offs_m < sq)
            for chunk in gl.static_range(PV_CHUNKS):
                out = accs[chunk] * gl.expand_dims(gl.convert_layout(inv_l, gl.SliceLayout(1, o_layout)), 1)
                out = gl.where(gl.expand_dims(gl.convert_layout(empty, gl.SliceLayout(1, o_layout)), 1), 0.0, out)
                out = gl.convert_layout(out.to(O.dtype.element_ty), store_layout)
                rows = m0 + row_off + gl.arange(0, ROWS, layout=gl.SliceLayout(1, store_layout))
                cols = chunk * COLS + gl.arange(0, COLS, layout=gl.SliceLayout(0, store_layout))
                o_base = b.to(gl.int64) * stride_ob + h * stride_oh + q_start.to(gl.int64) * stride_om
                ptrs = O + o_base + gl.expand_dims(rows.to(gl.int64) * stride_om, 1) + gl.expand_dims(cols, 0)
                gl.store(ptrs, out, mask=gl.expand_dims(rows < sq, 1) & gl.expand_dims(cols < headdim, 0))


# ``section_heads`` varies with the shape and only causal calls read it: not specialised, so
# its value never selects another compiled variant.  The score modifications' arguments come
# last: among the others they changed ptxas's allocation enough to spill 16 bytes in the dense
# d = 256 kernel, which spills nothing this way (offline, sm_90a).
@gluon.jit(do_not_specialize=["section_heads"])
def attention_fwd_kernel(
    Q_desc, K_desc, V_desc, O, LSE, CU_Q, CU_K, DESCALES,
    stride_ob, stride_om, stride_oh, stride_lb, stride_lh, stride_ds, stride_dsb,
    seqlen_q, seqlen_k, max_seqlen_q, nheads, group, headdim, qk_scale,
    window_left, window_right, num_items, section_heads, ALIBI, stride_ab, softcap_scale, softcap_log2,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
    Q_BUFFERS: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, VARLEN: gl.constexpr,
    PINGPONG: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, FP8: gl.constexpr,
    OFFSET: gl.constexpr, KEY_ORDER: gl.constexpr, P_FP16: gl.constexpr, HAS_SOFTCAP: gl.constexpr,
    HAS_ALIBI: gl.constexpr, SOFTMAX_OWN_BLOCK: gl.constexpr, PV_CHUNKS: gl.constexpr,
    PV_DEPTH: gl.constexpr,
):
    # Work items (query tile, batch * head) are dealt round-robin to the programs: with one
    # program per SM the producer loads the next item while the consumers store this one.
    dtype: gl.constexpr = Q_desc.dtype
    NUM_CONSUMERS: gl.constexpr = BLOCK_M // CONSUMER_ROWS
    QUERY_BOXES: gl.constexpr = BLOCK_M // Q_desc.block_type.shape[1]
    q_bufs = gl.allocate_shared_memory(dtype, [Q_BUFFERS * QUERY_BOXES] + Q_desc.block_type.shape, Q_desc.layout)
    k_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES] + K_desc.block_type.shape, K_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES] + V_desc.block_type.shape, V_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [Q_BUFFERS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [Q_BUFFERS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    turns = gl.allocate_shared_memory(gl.int64, [NUM_CONSUMERS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(Q_BUFFERS):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=NUM_CONSUMERS)  # every consumer releases a query tile
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=NUM_CONSUMERS)
        mbarrier.init(v_empty.index(i), count=NUM_CONSUMERS)
    if PINGPONG:
        # (Without turns the barriers stay uninitialised: an mbarrier that is never waited on may
        # share its memory with other buffers, which only plain memory may.)
        for i in gl.static_range(NUM_CONSUMERS):
            mbarrier.init(turns.index(i), count=1)
        # Consumer 0 issues first: its turn barrier completes phase 0 now, each other consumer's
        # when the one before it hands over.
        mbarrier.arrive(turns.index(0), count=1)

    consumer = (q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turns,
                O, LSE, CU_Q, CU_K, DESCALES, ALIBI, stride_ob, stride_om, stride_oh, stride_lb, stride_lh,
                stride_ds, stride_dsb, stride_ab, seqlen_q, seqlen_k, max_seqlen_q, nheads, group, headdim, qk_scale,
                softcap_scale, softcap_log2, window_left, window_right, num_items, section_heads)
    producer = (Q_desc, K_desc, V_desc, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, k_empty, v_ready,
                v_empty, CU_Q, CU_K, seqlen_q, seqlen_k, max_seqlen_q, nheads, group, window_left, window_right,
                num_items, section_heads)
    # The first consumer is the default partition (the kernel's own 4 warps); the others and
    # the producer are workers.
    if NUM_CONSUMERS == 3:
        gl.warp_specialize([
            (_consumer, (consumer, 0, MASK_LEFT, MASK_RIGHT, VARLEN, PINGPONG, FP8, OFFSET, KEY_ORDER, P_FP16,
                         HAS_SOFTCAP, HAS_ALIBI, SOFTMAX_OWN_BLOCK, PV_CHUNKS,
                         PV_DEPTH)),
            (_consumer, (consumer, 1, MASK_LEFT, MASK_RIGHT, VARLEN, PINGPONG, FP8, OFFSET, KEY_ORDER, P_FP16,
                         HAS_SOFTCAP, HAS_ALIBI, SOFTMAX_OWN_BLOCK, PV_CHUNKS,
                         PV_DEPTH)),
            (_consumer, (consumer, 2, MASK_LEFT, MASK_RIGHT, VARLEN, PINGPONG, FP8, OFFSET, KEY_ORDER, P_FP16,
                         HAS_SOFTCAP, HAS_ALIBI, SOFTMAX_OWN_BLOCK, PV_CHUNKS,
                         PV_DEPTH)),
            (_producer, (producer, BLOCK_M, BLOCK_N, NUM_STAGES, Q_BUFFERS, MASK_LEFT, MASK_RIGHT, VARLEN, FP8)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (consumer, 0, MASK_LEFT, MASK_RIGHT, VARLEN, PINGPONG, FP8, OFFSET, KEY_ORDER, P_FP16,
                         HAS_SOFTCAP, HAS_ALIBI, SOFTMAX_OWN_BLOCK, PV_CHUNKS,
                         PV_DEPTH)),
            (_consumer, (consumer, 1, MASK_LEFT, MASK_RIGHT, VARLEN, PINGPONG, FP8, OFFSET, KEY_ORDER, P_FP16,
                         HAS_SOFTCAP, HAS_ALIBI, SOFTMAX_OWN_BLOCK, PV_CHUNKS,
                         PV_DEPTH)),
            (_producer, (producer, BLOCK_M, BLOCK_N, NUM_STAGES, Q_BUFFERS, MASK_LEFT, MASK_RIGHT, VARLEN, FP8)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# --------------------------------------------------------------------------------------
# Launch configuration and launcher
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class HopperConfig(RegisterBudget):
    """Tiles of the Hopper forward for one head dim (``BLOCK_M`` is the consumers' rows, 64 each)."""

    block_n: int
    num_stages: int
    pingpong: bool = True
    persistent: bool = True  # one program per SM looping over work items, else one per item
    consumer_regs: int = 240
    producer_regs: int = 24
    # Causal schedules deal across the heads whose K and V fit in this share of L2 (0: all heads).
    l2_share: float = 0.5
    # Two query buffers: the producer loads the next work item's query tile during this one.
    q_buffers: int = 1
    # Consumer warpgroups (2 or 3), each owning 64 rows of the query tile.
    consumers: int = 2
    # The online-softmax update in a block of its own (``softmax_step``), so that it runs while
    # the previous tile's P V GEMM does; with two consumers only (three 160-register ones spilled
    # 56 / 424 bytes offline at d = 64, non-causal / causal, against 16 / 304).
    softmax_under_pv: bool = False

    @property
    def block_m(self) -> int:
        return self.consumers * CONSUMER_ROWS.value

    @property
    def softmax_own_block(self) -> bool:
        """Whether the kernel computes the softmax update in a block of its own (``softmax_step``)."""
        return self.softmax_under_pv and self.consumers == 2

    @property
    def query_box_rows(self) -> int:
        """Rows of the query descriptor's box: the whole tile's where they are a power of two,
        else one consumer's (the producer then loads a tile box by box)."""
        return self.block_m if self.block_m & (self.block_m - 1) == 0 else CONSUMER_ROWS.value


@functools.lru_cache(maxsize=None)
def config_for(head_dim_pad: int, two_consumers: bool = False, long_unmasked: bool = False) -> HopperConfig:
    """The tile configuration per padded head dim (shared memory: Q + stages * (K + V));
    ``two_consumers``: a call that takes two consumers at head dims up to 64 too
    (``engine.two_consumer_call``, which ``call_config`` asks); ``long_unmasked``: a call
    without mask or score modification of ``NO_TURNS_MIN_KEYS`` keys or more.  The measured
    alternatives (BLOCK_N, ping-pong, persistent grid, consumers) are in docs/tuning.md.

    Up to d = 64 three consumers share a 192-row query tile: there the softmax's ``exp2``
    take the exp2 units as long as the tile's GEMMs take the tensor cores, and with three
    warpgroups each one's softmax has two others' GEMMs to hide under (three 160-register
    consumers and the producer fill the SM's registers).  A short masked call keeps two: the
    192-row tiles cut the diagonal more coarsely, so more of their key tiles are masked and
    partly wasted (d = 64, N = 1k causal: 258 TFLOP/s with three consumers, 307 with two);
    so does an unmasked call of few rows, whose last 192-row tile is mostly empty (N = 512:
    284 against 363)."""
    if head_dim_pad <= engine.GLUON_THREE_CONSUMERS_MAX_HEADDIM and not two_consumers:
        return HopperConfig(block_n=128, num_stages=2, q_buffers=2, consumers=3, consumer_regs=160)
    if head_dim_pad <= 128:
        return HopperConfig(block_n=128, num_stages=2, q_buffers=2)
    # d = 256 (a second 64 KB query buffer does not fit): the consumers take turns at the tensor
    # cores, except on a long unmasked call, whose key loop runs faster with each consumer
    # issuing its GEMMs when ready (H100, N = 4k-16k: 1-8 % faster in three runs; 2k: mixed).
    return HopperConfig(block_n=64, num_stages=2, pingpong=not long_unmasked)


# An unmasked call of at least this many keys takes ``config_for``'s ``long_unmasked`` tiles.
NO_TURNS_MIN_KEYS = 4096


def call_config(head_dim_pad: int, seqlen_q: int, seqlen_k: int, window_left: int, window_right: int,
                score_mods: bool = False) -> HopperConfig:
    """``config_for`` of a call with ``seqlen_q`` query rows and ``seqlen_k`` keys (a packed
    batch's longest), this window (``-1``: unbounded on that side; causal is ``window_right =
    0``) and a softcap or ALiBi or neither (``score_mods``)."""
    long_unmasked = window_left < 0 and window_right < 0 and not score_mods and seqlen_k >= NO_TURNS_MIN_KEYS
    return config_for(head_dim_pad, engine.two_consumer_call(seqlen_q, window_left, window_right, score_mods),
                      long_unmasked)


# Alternatives to ``config_for``'s configurations (``config_from_spec`` specs) that the offline
# compile check covers, the GPU tests check and ``benchmarks/bench_hopper.py --variants`` times
# against the default (docs/tuning.md).
ALTERNATIVES = ("q_buffers=1", "softmax_under_pv=1")


def config_from_spec(head_dim_pad: int, spec: str, two_consumers: bool = False,
                     long_unmasked: bool = False) -> HopperConfig:
    """``config_for(head_dim_pad, two_consumers, long_unmasked)`` with the changes of ``spec``
    (``hopper.config_changes``; ``""``: the default itself)."""
    return configured(config_for, spec)(head_dim_pad, two_consumers, long_unmasked)


def layout_schedule(layout, k, cfg, window_left, window_right) -> int:
    """:func:`work_schedule` for ``layout``'s attention under ``cfg`` (for a packed batch the
    longest sequence stands for all)."""
    if window_right < 0:  # no causal-like mask: the value is not read (and keyed on nothing)
        return layout.batch * layout.nheads
    programs = min(cdiv(layout.seqlen_q, cfg.block_m) * layout.batch * layout.nheads, sm_count(k.device.index))
    return work_schedule(layout.batch * layout.nheads, layout.nheads // layout.nheads_k, layout.seqlen_q,
                         layout.seqlen_k, 2 * k.shape[-1] * k.element_size(), cfg.block_m, cfg.block_n,
                         window_left, window_right, programs if cfg.persistent else 0,
                         int(l2_bytes(k.device.index) * cfg.l2_share))


def kernel_constexprs(cfg: HopperConfig, hd: int, window_left: int, window_right: int, varlen: bool,
                      has_softcap: bool = False, has_alibi: bool = False) -> dict:
    """The 16-bit forward's constexprs and launch options for ``cfg``: what :func:`forward`,
    :func:`dense_plan` and the offline compile check (``offline.compile_forward``) launch or
    compile with."""
    return dict(
        HEAD_DIM=hd, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, NUM_STAGES=cfg.num_stages, Q_BUFFERS=cfg.q_buffers,
        MASK_LEFT=window_left >= 0, MASK_RIGHT=window_right >= 0, VARLEN=varlen, PINGPONG=cfg.pingpong,
        CONSUMER_REGS=cfg.consumer_regs, PRODUCER_REGS=cfg.producer_regs, FP8=False, OFFSET=0, KEY_ORDER=False,
        P_FP16=False, HAS_SOFTCAP=has_softcap, HAS_ALIBI=has_alibi, SOFTMAX_OWN_BLOCK=cfg.softmax_own_block,
        PV_CHUNKS=1, PV_DEPTH=1,
        num_warps=4, maxnreg=cfg.maxnreg,
    )


# The key count (``rows_k``) among the kernel's runtime arguments: it grows by a token a step
# when a model calls with a KV cache that it extends (a hint for the launch layer's key).
_DYNAMIC = (attention_fwd_kernel.arg_names.index("seqlen_k"),)


def forward(layout, q, k, v, softmax_scale, window_left, window_right, config=None, softcap=0.0, alibi_slopes=None):
    """The Hopper forward for ``layout`` (``flashtile.kernels.attention.Layout``): (out, lse).

    The output is allocated at the true head dim and written in place (no padded copy), the
    LSE laid out as the ``tl.*`` kernels lay it out, for their backward.  ``softcap`` (0: none)
    and ``alibi_slopes`` (``(nheads,)`` or ``(batch, nheads)`` fp32, or None) as in
    ``flash_attn_func``.
    """
    d = q.shape[-1]
    hd = padded_headdim(d)
    cfg = config or call_config(hd, layout.seqlen_q, layout.seqlen_k, window_left, window_right,
                                softcap > 0 or alibi_slopes is not None)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(layout.lse_shape, dtype=torch.float32, device=q.device)
    q, k, v = layout.prepare(q), layout.prepare(k), layout.prepare(v)
    if layout.varlen:
        stride_ob, stride_om, stride_oh = 0, out.stride(0), out.stride(1)
    else:
        stride_ob, stride_om, stride_oh = out.stride(0), out.stride(1), out.stride(2)
    unread = placeholder(q.device)  # the pointers the kernel does not read (not packed, not FP8, no ALiBi)
    cu_q, cu_k, stride_lb, stride_lh = layout.seq_args(unread)
    mods = score_mod_args(softmax_scale, softcap, alibi_slopes, unread)
    num_items = cdiv(layout.seqlen_q, cfg.block_m) * layout.batch * layout.nheads
    if num_items == 0:
        return out, lse
    grid = (min(num_items, sm_count(q.device.index)) if cfg.persistent else num_items,)
    # Through the launch layer: after the first call of a class, the compiled kernel is
    # launched directly (descriptors are classified by dtype, box and shared layout).
    launch(attention_fwd_kernel, grid, (
        layout.tiles(q, cfg.query_box_rows, hd, descriptor), layout.tiles(k, cfg.block_n, hd, descriptor),
        layout.tiles(v, cfg.block_n, hd, descriptor), out, lse, cu_q, cu_k, unread,  # no descales (16-bit inputs)
        stride_ob, stride_om, stride_oh, stride_lb, stride_lh, 0, 0,
        layout.rows_q, layout.rows_k, layout.seqlen_q, layout.nheads, layout.nheads // layout.nheads_k, d,
        softmax_scale * LOG2E, window_left, window_right, num_items,
        layout_schedule(layout, k, cfg, window_left, window_right),
        mods["alibi"], mods["stride_ab"], mods["softcap_scale"], mods["softcap_log2"],
    ), kernel_constexprs(cfg, hd, window_left, window_right, layout.varlen, mods["HAS_SOFTCAP"], mods["HAS_ALIBI"]),
        dynamic=_DYNAMIC)
    return out, lse


def dense_plan(q, k, v, softmax_scale, window_left, window_right, softcap=0.0, alibi_slopes=None):
    """The launch plan of :func:`forward` for dense inputs with these shapes, strides, dtypes and
    device (what ``flashtile.kernels.attention.forward`` keys its plans by; TMA-ready strides,
    no empty tensor; ``alibi_slopes`` a sample of the calls' slopes, which each call passes in
    its ``params``): a function ``(q, k, v, params) -> (out, lse)``, ``None`` for a call whose
    bases are not 16-byte aligned (the general path takes it).  Per call it allocates the
    outputs and launches, the three descriptors built from templates (``DescriptorTemplate``);
    the grid, the arguments and the constexprs are the ones :func:`forward` computes."""
    from flashtile.kernels.attention.layout import Layout

    layout = Layout(q, k)
    d = q.shape[-1]
    hd = padded_headdim(d)
    cfg = call_config(hd, layout.seqlen_q, layout.seqlen_k, window_left, window_right,
                      softcap > 0 or alibi_slopes is not None)
    out_shape, lse_shape, dtype, device = tuple(q.shape), layout.lse_shape, q.dtype, q.device
    lse_numel = math.prod(lse_shape)
    templates = tuple(DescriptorTemplate(layout.tiles(t, rows, hd, descriptor))
                      for t, rows in ((q, cfg.query_box_rows), (k, cfg.block_n), (v, cfg.block_n)))
    num_items = cdiv(layout.seqlen_q, cfg.block_m) * layout.batch * layout.nheads
    grid = (min(num_items, sm_count(device.index)) if cfg.persistent else num_items,)
    sample_out, sample_lse = stand_ins(device, (out_shape, dtype), (lse_shape, torch.float32))
    unread = placeholder(device)  # cu_seqlens and descales: not read by the dense 16-bit kernel
    mods = score_mod_args(softmax_scale, softcap, alibi_slopes, unread)
    has_alibi = mods["HAS_ALIBI"]
    args = (*templates, sample_out, sample_lse, unread, unread, unread,
            *sample_out.stride()[:3], *layout.lse_strides, 0, 0, layout.rows_q, layout.rows_k,
            layout.seqlen_q, layout.nheads, layout.nheads // layout.nheads_k, d, softmax_scale * LOG2E,
            window_left, window_right, num_items, layout_schedule(layout, k, cfg, window_left, window_right),
            mods["alibi"], mods["stride_ab"], mods["softcap_scale"], mods["softcap_log2"])
    options = kernel_constexprs(cfg, hd, window_left, window_right, False, mods["HAS_SOFTCAP"], has_alibi)
    # A bound launcher (``flashtile.kernels.launch.bind``): it builds the descriptors over the
    # call's q, k and v from the templates; the placeholders, ints and scales are its own tail,
    # so a call passes its five tensors, whose dtypes and device the plan's key holds (``fixed``):
    # it is keyed on their alignment alone.  With ALiBi the call's slopes come after the plan's
    # own objects up to them (``mid``).
    slopes_at = attention_fwd_kernel.arg_names.index("ALIBI")
    bound = bind(attention_fwd_kernel, grid, options, args, tail_from=slopes_at + 1 if has_alibi else 5, fixed=True)
    mid = args[5:slopes_at]

    def run(q, k, v, params, need_lse=True):
        if (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15:
            return None
        # Sizes as separate ints: torch parses them faster than a tuple.
        out = torch.empty(*out_shape, dtype=dtype, device=device)
        lse = lse_buffer(lse_shape, lse_numel, device, need_lse)
        if has_alibi:
            slopes = params.alibi_slopes  # the kernel steps over heads with stride 1
            bound((q, k, v, out, lse, *mid, slopes if slopes.is_contiguous() else slopes.contiguous()))
        else:
            bound((q, k, v, out, lse))
        return out, (lse if need_lse else None)

    return run
