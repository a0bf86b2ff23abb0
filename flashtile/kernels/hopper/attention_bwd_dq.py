"""dQ of the Hopper backward in Gluon, for the calls whose dK / dV kernel computes none: head dims above 128,
short masked calls, and from head dim 65 deterministic ones (``engine.separate_dq``, ``separate_dq_engine``).

``attention_bwd`` adds each step's dQ share into an fp32 workspace from the kernel that owns
a key tile; the wide-head kernel (``attention_bwd_wide``) has neither the registers nor the
shared memory for that, so dQ comes from a second pass over the keys, as in a
``deterministic=True`` call.  This kernel is that pass with the forward's structure: a work
item is a ``BLOCK_M``-row query tile of one (batch, query head), 64 rows per consumer
warpgroup -- the forward's work items (``attention_fwd.work_item``), dealt the same way --
and its program walks the key tiles those rows see:

* **producer** (1 warp): per item, the Q and dO tiles into their buffers once the consumers
  have finished the item before, then the key tiles through two rings of shared-memory
  slots (``attention_fwd.load_key_tile``, the forward's key stream), K's one slot deeper
  than V's: a consumer holds ``K_j`` one step longer than ``V_j``.
* **consumers** (one or two warpgroups, 64 rows each): per key tile ``j`` a consumer issues
  ``S_j = Q K_j^T`` and ``dP_j = dO V_j^T`` as asynchronous wgmma and, behind them,
  ``dQ += dS_{j-1} K_{j-1}``; it waits for ``S_j`` and ``dP_j`` only, releases ``V_j``, and
  computes ``P_j = exp2(S_j * scale * log2 e - LSE * log2 e)`` and ``dS_j = P_j (dP_j - delta)``
  while the tensor cores still work on the dQ product; then it waits for that and releases
  ``K_{j-1}``.  ``dS`` stays in registers as the A operand of its wgmma.  With ``PINGPONG``
  two consumers take turns issuing their GEMMs (``turns``), as in the forward.

The masks, tile ranges and sequence bounds are the forward's (``key_tiles``, ``band_mask``,
``sequence_bounds``).  ``lse2`` (LSE * log2 e, ``+inf`` on rows with no visible key) and
``delta = rowsum(dO * O)`` come from the ``tl.*`` preprocess; rows past the sequence read
``+inf``, so their probabilities and ``dS`` are exactly 0, and are not stored.  Each program
owns its rows and writes ``dQ * softmax_scale`` once, in the input dtype: no workspace, no
atomics, and the same bits on every run.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from flashtile.kernels.hopper import RegisterBudget, configured
from flashtile.kernels.hopper.attention_bwd import program_items, row_strides
from flashtile.kernels.hopper.attention_fwd import (CONSUMER_ROWS, consumer_tiles, layout_schedule, load_key_tile,
                                                   pass_tiles, work_item)
from flashtile.kernels.hopper.descriptors import descriptor
from flashtile.kernels.hopper.turns import hand_turn, issue_turn
from flashtile.kernels.launch import bind, launch
from flashtile.kernels.masking import band_mask
from flashtile.kernels.plans import stand_ins
from flashtile.kernels.runtime import cdiv, sm_count
from flashtile.kernels.tma import DescriptorTemplate, padded_headdim

LOG2E = 1.4426950408889634


@gluon.jit
def _producer(args, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr,
              VARLEN: gl.constexpr):
    """Per work item: Q and dO once the consumers have released the previous item's, then the
    item's key tiles (``count`` runs across items).  The constexprs come as arguments of their
    own, as the forward's producer takes them: inside a tuple, a partition's argument arrives
    as a runtime value (``tests/kernels/hopper/test_partition_loops.py``)."""
    (Q_desc, K_desc, V_desc, DO_desc, q_buf, do_buf, k_bufs, v_bufs, q_ready, q_empty, k_ready, k_empty, v_ready,
     v_empty, CU_Q, CU_K, seqlen_q, seqlen_k, max_seqlen_q, nheads, group, window_left, window_right, num_items,
     section_heads) = args
    count = 0
    first_item, item_stride, n_items = program_items(num_items, True)
    for it in range(n_items):
        b, h, hk, m0, q_start, k_start, _sq, _sk, lo, _fl, _fh, n_tiles = work_item(
            first_item + it * item_stride, num_items, section_heads, CU_Q, CU_K, seqlen_q, seqlen_k, max_seqlen_q,
            nheads, group, window_left, window_right, BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT, VARLEN)
        # An mbarrier starts with its "previous" phase complete: the first wait passes.
        mbarrier.wait(q_empty, (it & 1) ^ 1)
        if n_tiles < 0:
            mbarrier.arrive(q_ready, count=1)  # a skipped item still turns the buffers' phase
        else:
            if VARLEN:
                b = 0  # packed tensors are one batch entry of the descriptors
            mbarrier.expect(q_ready, Q_desc.block_type.nbytes + DO_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(Q_desc, [b, q_start + m0, h, 0], q_ready, q_buf)
            tma.async_copy_global_to_shared(DO_desc, [b, q_start + m0, h, 0], q_ready, do_buf)
            for j in range(n_tiles):
                load_key_tile(K_desc, V_desc, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, count,
                              b, k_start + lo + j * BLOCK_N, hk, False)
                count += 1


@gluon.jit
def _score_products(q, do, k_bufs, v_bufs, k_ready, v_ready, c, s_layout: gl.constexpr):
    """``S = Q K_c^T`` and ``dP = dO V_c^T`` of ring count ``c``, issued as asynchronous wgmma
    once each tile has landed (the caller waits for them and releases ``V_c``)."""
    K_STAGES: gl.constexpr = k_bufs.shape[0]
    V_STAGES: gl.constexpr = v_bufs.shape[0]
    BLOCK_N: gl.constexpr = k_bufs.shape[2]
    HEAD_DIM: gl.constexpr = k_bufs.shape[4]
    ROWS: gl.constexpr = q.shape[0]
    mbarrier.wait(k_ready.index(c % K_STAGES), (c // K_STAGES) & 1)
    k = k_bufs.index(c % K_STAGES).reshape([BLOCK_N, HEAD_DIM])
    s = warpgroup_mma(q, k.permute((1, 0)), gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout), use_acc=False,
                      is_async=True)
    mbarrier.wait(v_ready.index(c % V_STAGES), (c // V_STAGES) & 1)
    v = v_bufs.index(c % V_STAGES).reshape([BLOCK_N, HEAD_DIM])
    dp = warpgroup_mma(do, v.permute((1, 0)), gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout), use_acc=False,
                       is_async=True)
    return s, dp


@gluon.jit
def _ds_tile(s, dp, lse2, delta, n0, offs_m, seqlen_q, seqlen_k, qk_scale, window_left, window_right, full_lo,
             full_hi, s_layout: gl.constexpr, BLOCK_N: gl.constexpr, MASK_LEFT: gl.constexpr,
             MASK_RIGHT: gl.constexpr):
    """``dS = P (dP - delta)`` of the key tile at ``n0``, ``P`` recomputed from the log2 LSE; a
    tile outside ``[full_lo, full_hi)`` is cut by the band or the sequence end and gets the
    element-wise mask (``softmax_step``'s rule)."""
    p = gl.exp2(s * qk_scale - gl.expand_dims(lse2, 1))
    if (n0 < full_lo) | (n0 >= full_hi):
        offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        visible = band_mask(gl.expand_dims(offs_m, 1), gl.expand_dims(offs_n, 0), seqlen_q, seqlen_k,
                            window_left, window_right, MASK_LEFT, MASK_RIGHT)
        p = gl.where(visible, p, 0.0)
    return p * (dp - gl.expand_dims(delta, 1))


@gluon.jit
def _consumer(args, INDEX: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, VARLEN: gl.constexpr,
              PINGPONG: gl.constexpr):
    """Rows ``[64 * INDEX, 64 * INDEX + 64)`` of each query tile: their dQ over the key tiles
    they see, stored once.  ``args`` are the kernel's buffers, barriers and runtime arguments,
    the same for every consumer; the tile sizes are read from the buffers' shapes."""
    (q_buf, do_buf, k_bufs, v_bufs, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turns,
     DQ, LSE2, Delta, CU_Q, CU_K, stride_qb, stride_qm, stride_qh, stride_lb, stride_lh,
     seqlen_q, seqlen_k, max_seqlen_q, nheads, group, headdim, qk_scale, softmax_scale,
     window_left, window_right, num_items, section_heads) = args
    ROWS: gl.constexpr = CONSUMER_ROWS
    NUM_CONSUMERS: gl.constexpr = turns.shape[0]
    BLOCK_M: gl.constexpr = NUM_CONSUMERS * ROWS
    K_STAGES: gl.constexpr = k_bufs.shape[0]
    V_STAGES: gl.constexpr = v_bufs.shape[0]
    BLOCK_N: gl.constexpr = k_bufs.shape[2]
    HEAD_DIM: gl.constexpr = k_bufs.shape[4]
    row_off: gl.constexpr = INDEX * ROWS
    my_turn = turns.index(INDEX)
    their_turn = turns.index((INDEX + 1) % NUM_CONSUMERS)
    dtype: gl.constexpr = q_buf.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HEAD_DIM, 16])
    ds_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dq_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

    count = 0  # key tiles consumed across items: the rings' slots and phases, and the turn's phase
    first_item, item_stride, n_items = program_items(num_items, True)
    for it in range(n_items):
        b, h, hk, m0, q_start, _ks, sq, sk, item_lo, _fl, _fh, n_tiles = work_item(
            first_item + it * item_stride, num_items, section_heads, CU_Q, CU_K, seqlen_q, seqlen_k, max_seqlen_q,
            nheads, group, window_left, window_right, BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT, VARLEN)
        mbarrier.wait(q_ready, it & 1)
        if n_tiles < 0:
            mbarrier.arrive(q_empty, count=1)
        else:
            q = q_buf.reshape([BLOCK_M, HEAD_DIM]).slice(row_off, ROWS, dim=0)
            do = do_buf.reshape([BLOCK_M, HEAD_DIM]).slice(row_off, ROWS, dim=0)
            offs_m = m0 + row_off + gl.arange(0, ROWS, layout=row_layout)
            rows = b.to(gl.int64) * stride_lb + h * stride_lh + q_start + offs_m
            # Rows past the sequence (TMA zeros, or the next packed sequence's) add nothing.
            lse2 = gl.load(LSE2 + rows, mask=offs_m < sq, other=float("inf"))
            delta = gl.load(Delta + rows, mask=offs_m < sq, other=0.0)
            dq = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=dq_layout)
            lo, full_lo, full_hi, before, n_mine, after = consumer_tiles(
                m0 + row_off, item_lo, n_tiles, sq, sk, window_left, window_right, ROWS, BLOCK_N, MASK_LEFT,
                MASK_RIGHT)
            pass_tiles(count, count + before, my_turn, their_turn, k_ready, k_empty, v_ready, v_empty, PINGPONG)
            count += before
            if n_mine > 0:
                # Tile 0: S and dP only; its dQ product joins the next step's GEMMs.
                issue_turn(my_turn, count, PINGPONG)
                s, dp = _score_products(q, do, k_bufs, v_bufs, k_ready, v_ready, count, s_layout)
                hand_turn(their_turn, PINGPONG)
                s, dp = warpgroup_mma_wait(0, deps=[s, dp])
                mbarrier.arrive(v_empty.index(count % V_STAGES), count=1)
                ds = _ds_tile(s, dp, lse2, delta, lo, offs_m, sq, sk, qk_scale, window_left, window_right, full_lo,
                              full_hi, s_layout, BLOCK_N, MASK_LEFT, MASK_RIGHT)
                ds_prev = gl.convert_layout(ds.to(dtype), ds_layout)
                count += 1
                # One induction variable, the ring count c: this item's tile c - count0 starts at
                # key n_base + c * BLOCK_N.
                count0 = count - 1
                end = count0 + n_mine
                n_base = lo - count0 * BLOCK_N
                for c in range(count, end):
                    k_prev = (c - 1) % K_STAGES
                    issue_turn(my_turn, c, PINGPONG)
                    s, dp = _score_products(q, do, k_bufs, v_bufs, k_ready, v_ready, c, s_layout)
                    dq = warpgroup_mma(ds_prev, k_bufs.index(k_prev).reshape([BLOCK_N, HEAD_DIM]), dq, is_async=True)
                    hand_turn(their_turn, PINGPONG)
                    # wgmma groups retire in order: S_j and dP_j are ready while dS_{j-1} K_{j-1} runs.
                    s, dp, dq = warpgroup_mma_wait(1, deps=[s, dp, dq])
                    mbarrier.arrive(v_empty.index(c % V_STAGES), count=1)
                    ds = _ds_tile(s, dp, lse2, delta, n_base + c * BLOCK_N, offs_m, sq, sk, qk_scale, window_left,
                                  window_right, full_lo, full_hi, s_layout, BLOCK_N, MASK_LEFT, MASK_RIGHT)
                    dq = warpgroup_mma_wait(0, deps=[dq])
                    mbarrier.arrive(k_empty.index(k_prev), count=1)
                    ds_prev = gl.convert_layout(ds.to(dtype), ds_layout)
                count = end
                # Q and dO are no longer read: the producer may load the next item's.
                mbarrier.arrive(q_empty, count=1)
                k_last = (count - 1) % K_STAGES
                dq = warpgroup_mma(ds_prev, k_bufs.index(k_last).reshape([BLOCK_N, HEAD_DIM]), dq, is_async=True)
                dq = warpgroup_mma_wait(0, deps=[dq])
                mbarrier.arrive(k_empty.index(k_last), count=1)
            else:
                mbarrier.arrive(q_empty, count=1)
            pass_tiles(count, count + after, my_turn, their_turn, k_ready, k_empty, v_ready, v_empty, PINGPONG)
            count += after
            # Stored from the wgmma layout: a conversion to wider stores would take a 32 KB
            # shared-memory scratch at d = 256, which the buffers leave no room for.
            base = b.to(gl.int64) * stride_qb + h * stride_qh + q_start.to(gl.int64) * stride_qm
            out = (dq * softmax_scale).to(DQ.dtype.element_ty)
            out_rows = m0 + row_off + gl.arange(0, ROWS, layout=gl.SliceLayout(1, dq_layout))
            cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, dq_layout))
            ptrs = DQ + base + gl.expand_dims(out_rows.to(gl.int64) * stride_qm, 1) + gl.expand_dims(cols, 0)
            gl.store(ptrs, out, mask=gl.expand_dims(out_rows < sq, 1) & gl.expand_dims(cols < headdim, 0))


# As the forward: ``section_heads`` unspecialised (only causal calls read it).
@gluon.jit(do_not_specialize=["section_heads"])
def attention_bwd_dq_kernel(
    Q_desc, K_desc, V_desc, DO_desc, DQ, LSE2, Delta, CU_Q, CU_K,
    stride_qb, stride_qm, stride_qh, stride_lb, stride_lh,
    seqlen_q, seqlen_k, max_seqlen_q, nheads, group, headdim, qk_scale, softmax_scale,
    window_left, window_right, num_items, section_heads,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, K_STAGES: gl.constexpr,
    V_STAGES: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, VARLEN: gl.constexpr,
    PINGPONG: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
):
    dtype: gl.constexpr = Q_desc.dtype
    NUM_CONSUMERS: gl.constexpr = BLOCK_M // CONSUMER_ROWS
    q_buf = gl.allocate_shared_memory(dtype, Q_desc.block_type.shape, Q_desc.layout)
    do_buf = gl.allocate_shared_memory(dtype, DO_desc.block_type.shape, DO_desc.layout)
    k_bufs = gl.allocate_shared_memory(dtype, [K_STAGES] + K_desc.block_type.shape, K_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [V_STAGES] + V_desc.block_type.shape, V_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], mbarrier.MBarrierLayout())
    turns = gl.allocate_shared_memory(gl.int64, [NUM_CONSUMERS, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready, count=1)
    mbarrier.init(q_empty, count=NUM_CONSUMERS)
    for i in gl.static_range(K_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=NUM_CONSUMERS)
    for i in gl.static_range(V_STAGES):
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=NUM_CONSUMERS)
    if PINGPONG:  # (as in the forward: no turns, no barriers to initialise)
        for i in gl.static_range(NUM_CONSUMERS):
            mbarrier.init(turns.index(i), count=1)
        mbarrier.arrive(turns.index(0), count=1)  # consumer 0 issues first (``turns``)

    consumer = (q_buf, do_buf, k_bufs, v_bufs, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turns,
                DQ, LSE2, Delta, CU_Q, CU_K, stride_qb, stride_qm, stride_qh, stride_lb, stride_lh,
                seqlen_q, seqlen_k, max_seqlen_q, nheads, group, headdim, qk_scale, softmax_scale,
                window_left, window_right, num_items, section_heads)
    producer = (Q_desc, K_desc, V_desc, DO_desc, q_buf, do_buf, k_bufs, v_bufs, q_ready, q_empty, k_ready, k_empty,
                v_ready, v_empty, CU_Q, CU_K, seqlen_q, seqlen_k, max_seqlen_q, nheads, group, window_left,
                window_right, num_items, section_heads)
    # The first consumer is the default partition (the kernel's own 4 warps).
    if NUM_CONSUMERS == 2:
        gl.warp_specialize([
            (_consumer, (consumer, 0, MASK_LEFT, MASK_RIGHT, VARLEN, PINGPONG)),
            (_consumer, (consumer, 1, MASK_LEFT, MASK_RIGHT, VARLEN, PINGPONG)),
            (_producer, (producer, BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT, VARLEN)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (consumer, 0, MASK_LEFT, MASK_RIGHT, VARLEN, False)),
            (_producer, (producer, BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT, VARLEN)),
        ], [1], [PRODUCER_REGS])


# --------------------------------------------------------------------------------------
# Launch configuration and launcher
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class HopperDqConfig(RegisterBudget):
    """Tiles of the dQ kernel: ``consumers`` warpgroups of 64 query rows, ``block_n``-key
    tiles, K's ring ``k_stages`` deep and V's ``v_stages`` (K is held a step longer)."""

    block_n: int = 32
    k_stages: int = 3
    v_stages: int = 2
    consumers: int = 2
    pingpong: bool = True
    persistent: bool = True  # one program per SM looping over work items, else one per item
    consumer_regs: int = 240
    producer_regs: int = 24
    # Causal schedules deal across the heads whose K and V fit in this share of L2 (0: all heads).
    l2_share: float = 0.5

    @property
    def block_m(self) -> int:
        return self.consumers * CONSUMER_ROWS.value

    @property
    def maxnreg(self) -> int:
        # One consumer: ptxas compiles the default partition (the consumer) under the kernel-wide
        # cap itself (offline, sm_90a: 136, the warpgroups' mean, is too few for one instruction
        # at d = 256), and one program's two warpgroups fit the SM's registers at the consumer's.
        if self.consumers == 1:
            return self.consumer_regs
        return super().maxnreg


@functools.lru_cache(maxsize=None)
def config_for(head_dim_pad: int) -> HopperDqConfig:
    """The configuration per padded head dim (shared memory: Q and dO of ``block_m`` rows plus
    the K and V rings).  At d = 256 two consumers' Q and dO take 128 KB, which leaves room for
    32-key tiles (K 3 x 16 KB, V 2 x 16 KB: 208 KB); one consumer with 64-key tiles (224 KB,
    the tensor cores fed by one warpgroup) is the alternative.  Up to d = 128: 64-key tiles
    (144 KB at d = 128).  Not yet measured against each other on a GPU (docs/tuning.md)."""
    if head_dim_pad > 128:
        return HopperDqConfig(block_n=32)
    return HopperDqConfig(block_n=64)


# Alternatives to ``config_for`` (``config_from_spec`` specs) that the offline compile check
# covers, the GPU tests check and ``benchmarks/bench_hopper_bwd.py --variants`` times.
ALTERNATIVES = ("consumers=1+block_n=64+pingpong=0", "k_stages=2", "pingpong=0")


def config_from_spec(head_dim_pad: int, spec: str) -> HopperDqConfig:
    """``config_for(head_dim_pad)`` with the changes of ``spec`` (``hopper.config_changes``)."""
    return configured(config_for, spec)(head_dim_pad)


def kernel_constexprs(cfg: HopperDqConfig, head_dim_pad: int, mask_left: bool, mask_right: bool,
                      varlen: bool) -> dict:
    """The kernel's constexprs and launch options for ``cfg``: what the launcher passes and the
    offline compile check compiles.  K's ring needs two slots: a consumer holds a K tile until
    the next one has arrived."""
    if cfg.k_stages < 2:
        raise ValueError(f"k_stages must be at least 2, got {cfg.k_stages}")
    return dict(HEAD_DIM=head_dim_pad, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, K_STAGES=cfg.k_stages,
                V_STAGES=cfg.v_stages, MASK_LEFT=mask_left, MASK_RIGHT=mask_right, VARLEN=varlen,
                PINGPONG=cfg.pingpong and cfg.consumers > 1, CONSUMER_REGS=cfg.consumer_regs,
                PRODUCER_REGS=cfg.producer_regs, num_warps=4, maxnreg=cfg.maxnreg)


def _launch_args(layout, q, k, v, dout, dq, lse2, delta, headdim, softmax_scale, window_left, window_right, cfg,
                 make=descriptor):
    """``(grid, args, options)`` of the kernel's launch (``make`` builds the descriptors; a plan
    turns them into templates)."""
    hd = padded_headdim(headdim)
    num_items = cdiv(layout.seqlen_q, cfg.block_m) * layout.batch * layout.nheads
    grid = (min(num_items, sm_count(q.device.index)) if cfg.persistent else num_items,)
    cu_q, cu_k, stride_lb, stride_lh = layout.seq_args(lse2)
    args = (
        layout.tiles(q, cfg.block_m, hd, make), layout.tiles(k, cfg.block_n, hd, make),
        layout.tiles(v, cfg.block_n, hd, make), layout.tiles(dout, cfg.block_m, hd, make),
        dq, lse2, delta, cu_q, cu_k, *row_strides(dq, layout.varlen), stride_lb, stride_lh,
        layout.rows_q, layout.rows_k, layout.seqlen_q, layout.nheads, layout.nheads // layout.nheads_k, headdim,
        softmax_scale * LOG2E, softmax_scale, window_left, window_right, num_items,
        layout_schedule(layout, k, cfg, window_left, window_right),
    )
    return grid, args, kernel_constexprs(cfg, hd, window_left >= 0, window_right >= 0, layout.varlen)


def backward_dq(layout, q, k, v, dout, lse2, delta, headdim, softmax_scale, window_left, window_right, config=None):
    """dQ of ``layout``'s attention (``flashtile.kernels.attention.Layout``), shaped like ``q`` in its
    dtype (columns past ``headdim`` unwritten), from the preprocess's ``lse2`` and ``delta``;
    ``q``, ``k``, ``v``, ``dout`` are the TMA-ready tensors ``attention_bwd.backward`` takes."""
    cfg = config or config_for(padded_headdim(headdim))
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if cdiv(layout.seqlen_q, cfg.block_m) * layout.batch * layout.nheads > 0:  # else no tile for a descriptor
        # Through the launch layer: after the first call of a class, the compiled kernel is
        # launched directly.
        launch(attention_bwd_dq_kernel, *_launch_args(layout, q, k, v, dout, dq, lse2, delta, headdim, softmax_scale,
                                                      window_left, window_right, cfg))
    return dq


# The launch arguments a call passes (q, k, v, dO, dQ, the LSE and delta, and the two
# cu_seqlens stand-ins: the LSE): the rest is fixed per launch plan.
_HEAD = 9


def dense_plan(layout, q, k, v, dout, lse2, delta, softmax_scale, window_left, window_right):
    """The launch plan of :func:`backward_dq` for dense inputs with these shapes, strides, dtypes
    and device (``attention_bwd.dense_plan``'s contract): a function ``(q, k, v, dout, lse2,
    delta) -> dq``."""
    d = q.shape[-1]
    cfg = config_for(padded_headdim(d))
    dtype, device, shape = q.dtype, q.device, tuple(q.shape)
    (sample_dq,) = stand_ins(device, (shape, dtype))
    grid, args, options = _launch_args(layout, q, k, v, dout, sample_dq, lse2, delta, d, softmax_scale, window_left,
                                       window_right, cfg)
    args = tuple(DescriptorTemplate(a) if i < 4 else a for i, a in enumerate(args))
    bound = bind(attention_bwd_dq_kernel, grid, options, args, tail_from=_HEAD)

    def run(q, k, v, dout, lse2, delta):
        dq = torch.empty(*shape, dtype=dtype, device=device)
        bound((q, k, v, dout, dq, lse2, delta, lse2, lse2))
        return dq

    return run
