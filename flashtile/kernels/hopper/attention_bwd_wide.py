"""dK and dV for head dims above 128 on Hopper in Gluon: two consumer warpgroups that split each step's
queries for the score products and the head dim for the gradients.

``attention_bwd``'s consumers each keep dK and dV of their own 64 keys in fp32 registers,
``2 * d / 2`` registers a thread: at d = 256 that is the whole register file.  Here a
program owns one ``BLOCK_N = 64``-key tile and both consumers work on all of its keys:

* per step (a ``BLOCK_M = 64``-row query tile), consumer ``w`` computes the score products of
  its half of the queries, ``S^T = K Q_w^T`` and ``dP^T = V dO_w^T`` (64 keys x 32 queries,
  the full head dim contracted), then ``P^T`` and ``dS^T`` as ``attention_bwd`` does;
* it writes both (bf16) to its own shared tiles for the other consumer, and accumulates
  columns ``[w d / 2, (w + 1) d / 2)`` of ``dV += P^T dO`` and ``dK += dS^T Q`` over all 64
  queries of the step: its own half from registers, the other consumer's from its tiles
  (the product split along its contraction, the queries).

So each score product is computed once and each consumer holds ``2 * d / 2 * 64`` fp32
accumulators (128 registers a thread at d = 256).  The producer warp and the masks, tile
ranges and work order are ``attention_bwd``'s.  There is no dQ here: a second pass whose
programs own query rows computes it (``attention_bwd_dq``, chosen by
``engine.separate_dq_engine`` in ``backward.py``), so these calls are bitwise reproducible
whether or not ``deterministic`` asks for it.

A consumer rewrites its exchange tiles in step ``g`` (its ring count) only after both
consumers released step ``g - 1``'s ring slot, which they do once that step's products -- the
tiles' last readers -- have retired; the tiles of a step are ready when both consumers have
arrived on ``x_ready``.  With ``persistent`` (an alternative) a program walks key tiles as
``attention_bwd``'s persistent form does, and the ring count runs across them.
"""

from __future__ import annotations

import dataclasses

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma, \
    warpgroup_mma_wait

from flashtile.kernels.hopper import RegisterBudget, configured
from flashtile.kernels.hopper.attention_bwd import (key_tile_args, key_tile_work, operand_tiles, producer,
                                                   producer_buffers, program_items, row_strides, step_rows,
                                                   store_rows)
from flashtile.kernels.hopper.descriptors import descriptor
from flashtile.kernels.launch import bind, launch
from flashtile.kernels.masking import band_mask
from flashtile.kernels.plans import stand_ins
from flashtile.kernels.runtime import cdiv
from flashtile.kernels.tma import DescriptorTemplate, padded_headdim

# The head dims this kernel is for (above attention_bwd.MAX_HEADDIM): d / 2 columns of dK and
# dV a consumer, 128 fp32 registers a thread at d = 256.
MIN_HEADDIM, MAX_HEADDIM = 129, 256


@gluon.jit
def _consumer(k_smem, v_smem, q_bufs, do_bufs, lse_bufs, delta_bufs, p_tiles, ds_tiles, kv_ready, kv_empty, ready,
              empty, x_ready, DK, DV, CU_Q, CU_K, stride_kb, stride_km, stride_kh,
              seqlen_q, seqlen_k, max_seqlen_k, nheads_k, group, headdim, qk_scale, softmax_scale,
              window_left, window_right, num_items, section_heads, me: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, NUM_STAGES: gl.constexpr,
              MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, VARLEN: gl.constexpr, PERSISTENT: gl.constexpr):
    """Consumer ``me`` (0 or 1): queries ``[me * BLOCK_M / 2, (me + 1) * BLOCK_M / 2)`` of each
    step for ``S^T`` and ``dP^T``; columns ``[me * HEAD_DIM / 2, (me + 1) * HEAD_DIM / 2)`` of
    dK and dV for all ``BLOCK_N`` keys."""
    HALF_Q: gl.constexpr = BLOCK_M // 2
    HALF_D: gl.constexpr = HEAD_DIM // 2
    q_off: gl.constexpr = me * HALF_Q
    other_off: gl.constexpr = (1 - me) * HALF_Q
    col_off: gl.constexpr = me * HALF_D
    dtype: gl.constexpr = q_bufs.dtype
    # (keys x own queries) score tiles, (keys x d / 2) dK / dV.
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HALF_Q, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HALF_D, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    q_vec: gl.constexpr = gl.SliceLayout(0, s_layout)

    first_item, item_stride, n_items = program_items(num_items, PERSISTENT)
    base = 0  # ring count of the key tile's first step (runs across a persistent program's tiles)
    kv_count = 0  # key tiles whose K and V have been read
    for it in range(n_items):
        b, hk, n0, q_start, k_start, sq, sk, lo, full_lo, full_hi, key_edge, n_steps = key_tile_work(
            first_item + it * item_stride, num_items, section_heads, CU_Q, CU_K, seqlen_q, seqlen_k, max_seqlen_k,
            nheads_k, window_left, window_right, BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT, VARLEN)
        if n_steps >= 0:
            k_all = k_smem.reshape([BLOCK_N, HEAD_DIM])
            v_all = v_smem.reshape([BLOCK_N, HEAD_DIM])
            offs_k = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
            my_p = p_tiles.index(me)
            my_ds = ds_tiles.index(me)
            other_p = p_tiles.index(1 - me)
            other_ds = ds_tiles.index(1 - me)
            dk = gl.zeros([BLOCK_N, HALF_D], gl.float32, layout=acc_layout)
            dv = gl.zeros([BLOCK_N, HALF_D], gl.float32, layout=acc_layout)
            mbarrier.wait(kv_ready, kv_count & 1)
            for c in range(n_steps * group):
                g = base + c  # the step's ring count: slots, phases and the exchange's turn
                h, m0 = step_rows(c, hk, group, n_steps, lo, BLOCK_M)
                slot = g % NUM_STAGES
                mbarrier.wait(ready.index(slot), (g // NUM_STAGES) & 1)
                q = q_bufs.index(slot).reshape([BLOCK_M, HEAD_DIM])
                do = do_bufs.index(slot).reshape([BLOCK_M, HEAD_DIM])
                q_mine = q.slice(q_off, HALF_Q, dim=0)
                do_mine = do.slice(q_off, HALF_Q, dim=0)
                s_t = warpgroup_mma(k_all, q_mine.permute((1, 0)),
                                    gl.zeros([BLOCK_N, HALF_Q], gl.float32, layout=s_layout), use_acc=False, is_async=True)
                dp_t = warpgroup_mma(v_all, do_mine.permute((1, 0)),
                                     gl.zeros([BLOCK_N, HALF_Q], gl.float32, layout=s_layout), use_acc=False, is_async=True)
                s_t = warpgroup_mma_wait(1, deps=[s_t])
                rows = lse_bufs.index(slot).slice(q_off, HALF_Q)
                lse_q = rows.load(q_vec)
                if VARLEN:  # rows past the sequence: the next packed sequence's (attention_bwd's docstring)
                    lse_q = gl.where(m0 + q_off + gl.arange(0, HALF_Q, layout=q_vec) < sq, lse_q, float("inf"))
                p_t = gl.exp2(s_t * qk_scale - gl.expand_dims(lse_q, 0))
                if (m0 < full_lo) | (m0 >= full_hi) | key_edge:
                    offs_q = m0 + q_off + gl.arange(0, HALF_Q, layout=q_vec)
                    visible = band_mask(gl.expand_dims(offs_q, 0), gl.expand_dims(offs_k, 1), sq, sk,
                                        window_left, window_right, MASK_LEFT, MASK_RIGHT)
                    p_t = gl.where(visible, p_t, 0.0)
                p_b = p_t.to(dtype)
                dp_t = warpgroup_mma_wait(0, deps=[dp_t])
                delta_q = delta_bufs.index(slot).slice(q_off, HALF_Q).load(q_vec)
                ds_b = (p_t * (dp_t - gl.expand_dims(delta_q, 0))).to(dtype)
                # This step's own halves over the own queries, from registers.
                dv = warpgroup_mma(gl.convert_layout(p_b, a_layout), do_mine.slice(col_off, HALF_D, dim=1), dv,
                                   is_async=True)
                dk = warpgroup_mma(gl.convert_layout(ds_b, a_layout), q_mine.slice(col_off, HALF_D, dim=1), dk,
                                   is_async=True)
                # The exchange tiles' last readers were step g - 1's products (of this key tile or
                # the one before): both consumers retired them before releasing that step's slot
                # (step 0 waits on a fresh phase).
                before = g + NUM_STAGES - 1
                mbarrier.wait(empty.index(before % NUM_STAGES), (before // NUM_STAGES + 1) & 1)
                my_p.store(p_b)
                my_ds.store(ds_b)
                fence_async_shared()
                mbarrier.arrive(x_ready, count=1)
                # The other consumer's queries, from its tiles.
                mbarrier.wait(x_ready, g & 1)
                dv = warpgroup_mma(other_p, do.slice(other_off, HALF_Q, dim=0).slice(col_off, HALF_D, dim=1), dv,
                                   is_async=True)
                dk = warpgroup_mma(other_ds, q.slice(other_off, HALF_Q, dim=0).slice(col_off, HALF_D, dim=1), dk,
                                   is_async=True)
                dv, dk = warpgroup_mma_wait(0, deps=[dv, dk])
                mbarrier.arrive(empty.index(slot), count=1)
            if PERSISTENT:
                mbarrier.arrive(kv_empty, count=1)  # K and V are no longer read: the next tile's may load
            kv_base = b.to(gl.int64) * stride_kb + hk * stride_kh + k_start.to(gl.int64) * stride_km
            store_rows(DV, kv_base, n0, sk, stride_km, headdim, dv, HALF_D, BLOCK_N, col_off)
            store_rows(DK, kv_base, n0, sk, stride_km, headdim, dk * softmax_scale, HALF_D, BLOCK_N, col_off)
            base += n_steps * group
            kv_count += 1


# As attention_bwd_kernel: ``section_heads`` and ``group`` unspecialised.
@gluon.jit(do_not_specialize=["section_heads", "group"])
def attention_bwd_wide_kernel(
    Q_desc, K_desc, V_desc, DO_desc, DK, DV, LSE2, Delta, CU_Q, CU_K,
    stride_kb, stride_km, stride_kh, stride_lb, stride_lh,
    seqlen_q, seqlen_k, max_seqlen_k, nheads_k, group, headdim, qk_scale, softmax_scale,
    window_left, window_right, num_items, section_heads,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
    MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, VARLEN: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, PERSISTENT: gl.constexpr,
):
    dtype: gl.constexpr = Q_desc.dtype
    k_smem, v_smem, q_bufs, do_bufs, lse_bufs, delta_bufs, kv_ready, kv_empty, ready, empty = producer_buffers(
        Q_desc, K_desc, V_desc, DO_desc, NUM_STAGES, BLOCK_M, PERSISTENT)
    # Each consumer's P^T and dS^T of its queries (keys x BLOCK_M / 2), for the other one.
    x_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M // 2], dtype)
    p_tiles = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M // 2], x_layout)
    ds_tiles = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M // 2], x_layout)
    x_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(x_ready, count=2)  # both consumers have written this step's tiles

    gl.warp_specialize([
        (_consumer, (k_smem, v_smem, q_bufs, do_bufs, lse_bufs, delta_bufs, p_tiles, ds_tiles, kv_ready, kv_empty,
                     ready, empty, x_ready, DK, DV, CU_Q, CU_K, stride_kb, stride_km, stride_kh,
                     seqlen_q, seqlen_k, max_seqlen_k, nheads_k, group, headdim, qk_scale, softmax_scale,
                     window_left, window_right, num_items, section_heads, 0,
                     BLOCK_M, BLOCK_N, HEAD_DIM, NUM_STAGES, MASK_LEFT, MASK_RIGHT, VARLEN, PERSISTENT)),
        (_consumer, (k_smem, v_smem, q_bufs, do_bufs, lse_bufs, delta_bufs, p_tiles, ds_tiles, kv_ready, kv_empty,
                     ready, empty, x_ready, DK, DV, CU_Q, CU_K, stride_kb, stride_km, stride_kh,
                     seqlen_q, seqlen_k, max_seqlen_k, nheads_k, group, headdim, qk_scale, softmax_scale,
                     window_left, window_right, num_items, section_heads, 1,
                     BLOCK_M, BLOCK_N, HEAD_DIM, NUM_STAGES, MASK_LEFT, MASK_RIGHT, VARLEN, PERSISTENT)),
        (producer, (Q_desc, K_desc, V_desc, DO_desc, k_smem, v_smem, q_bufs, do_bufs, lse_bufs, delta_bufs,
                     kv_ready, kv_empty, ready, empty, LSE2, Delta, stride_lb, stride_lh,
                     CU_Q, CU_K, seqlen_q, seqlen_k, max_seqlen_k, nheads_k, group, window_left, window_right,
                     num_items, section_heads, BLOCK_M, BLOCK_N, NUM_STAGES, MASK_LEFT, MASK_RIGHT, VARLEN,
                     PERSISTENT)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# --------------------------------------------------------------------------------------
# Launch configuration and launcher
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class HopperBwdWideConfig(RegisterBudget):
    """Tiles of the wide-head backward: 64-key tiles, 64-row query steps, two ring stages (shared
    memory at d = 256: K, V and two stages of Q and dO, 192 KB, and the exchange tiles, 16 KB)."""

    block_n: int = 64
    block_m: int = 64
    num_stages: int = 2
    consumer_regs: int = 240
    producer_regs: int = 24
    # One program per SM walking key tiles round-robin (``attention_bwd.HopperBwdConfig.persistent``).
    persistent: bool = False


def config_for(head_dim_pad: int) -> HopperBwdWideConfig:
    """The configuration per padded head dim (one so far: not yet measured against others)."""
    return HopperBwdWideConfig()


# Alternatives to ``config_for`` (``config_from_spec`` specs) that the offline compile check
# covers, the GPU tests check and ``benchmarks/bench_hopper_bwd.py --variants wide:<spec>`` times.
ALTERNATIVES = ("persistent=1",)


def config_from_spec(head_dim_pad: int, spec: str) -> HopperBwdWideConfig:
    """``config_for(head_dim_pad)`` with the changes of ``spec`` (``hopper.config_changes``)."""
    return configured(config_for, spec)(head_dim_pad)


def kernel_constexprs(cfg, head_dim_pad, mask_left, mask_right, varlen) -> dict:
    """The kernel's constexprs for configuration ``cfg``: what the launcher passes and the
    offline compile check compiles."""
    return dict(HEAD_DIM=head_dim_pad, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, NUM_STAGES=cfg.num_stages,
                MASK_LEFT=mask_left, MASK_RIGHT=mask_right, VARLEN=varlen,
                CONSUMER_REGS=cfg.consumer_regs, PRODUCER_REGS=cfg.producer_regs, PERSISTENT=cfg.persistent)


def _launch_args(layout, q, k, v, dout, dk, dv, lse2, delta, headdim, softmax_scale, window_left, window_right, cfg,
                 make=descriptor):
    """``(grid, args, options)`` of the kernel's launch (``make`` builds the descriptors; a plan
    turns them into templates)."""
    hd = padded_headdim(headdim)
    grid, scalars = key_tile_args(layout, q, headdim, softmax_scale, window_left, window_right, cfg)
    cu_q, cu_k, stride_lb, stride_lh = layout.seq_args(lse2)
    args = (*operand_tiles(layout, q, k, v, dout, cfg, hd, make), dk, dv, lse2, delta, cu_q, cu_k,
            *row_strides(dk, layout.varlen), stride_lb, stride_lh, *scalars)
    options = dict(kernel_constexprs(cfg, hd, window_left >= 0, window_right >= 0, layout.varlen),
                   num_warps=4, maxnreg=cfg.maxnreg)
    return grid, args, options


# The launch arguments a call passes (q, k, v, dO, dK, dV, the LSE and delta, and the two
# cu_seqlens stand-ins: the LSE): the rest is fixed per launch plan.
_HEAD = 10


def backward(layout, q, k, v, dout, lse2, delta, headdim, softmax_scale, window_left, window_right, config=None):
    """``(None, dK, dV)`` of ``layout``'s attention, as ``attention_bwd.backward`` returns them for a
    call without dQ (the caller computes it); the arguments are that function's."""
    cfg = config or config_for(padded_headdim(headdim))
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if cdiv(layout.seqlen_k, cfg.block_n) * layout.batch * layout.nheads_k > 0:  # else no tile to build a descriptor for
        launch(attention_bwd_wide_kernel, *_launch_args(layout, q, k, v, dout, dk, dv, lse2, delta, headdim,
                                                        softmax_scale, window_left, window_right, cfg))
    return None, dk, dv


def dense_plan(layout, q, k, v, dout, lse2, delta, softmax_scale, window_left, window_right):
    """The launch plan of :func:`backward` for dense inputs with these shapes, strides, dtypes and
    device (``attention_bwd.dense_plan``'s contract, without dQ): a function ``(q, k, v, dout,
    lse2, delta) -> (None, dk, dv)``."""
    d = q.shape[-1]
    cfg = config_for(d)
    dtype, device = q.dtype, q.device
    k_shape, v_shape = tuple(k.shape), tuple(v.shape)
    sample_dk, sample_dv = stand_ins(device, (k_shape, dtype), (v_shape, dtype))
    grid, args, options = _launch_args(layout, q, k, v, dout, sample_dk, sample_dv, lse2, delta, d, softmax_scale,
                                       window_left, window_right, cfg)
    args = tuple(DescriptorTemplate(a) if i < 4 else a for i, a in enumerate(args))
    bound = bind(attention_bwd_wide_kernel, grid, options, args, tail_from=_HEAD)

    def run(q, k, v, dout, lse2, delta):
        dk = torch.empty(*k_shape, dtype=dtype, device=device)
        dv = torch.empty(*v_shape, dtype=dtype, device=device)
        bound((q, k, v, dout, dk, dv, lse2, delta, lse2, lse2))
        return None, dk, dv

    return run
