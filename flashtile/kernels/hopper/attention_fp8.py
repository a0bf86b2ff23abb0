"""FP8 (e4m3) attention forward for Hopper in Gluon: the bf16 forward's structure on FP8 GEMMs.

The work items, the producer warp, the two ping-ponging consumer warpgroups and the online
softmax are those of ``attention_fwd.py``; what FP8 changes (the reasons are in
``flashtile/kernels/attention_fp8.py``, the portable FP8 kernel, and docs/fp8.md):

* Q and K are e4m3 and their wgmma contracts 32 elements an instruction; the descales
  ``q_descale * k_descale`` join the softmax scale in the one exp2 argument.
* P is cast to e4m3 after the **max offset**: ``P * 2^8`` (the largest power of two below
  e4m3's 448) keeps a row's probabilities on normal numbers; ``l`` carries the same factor,
  so ``O = acc / l`` is unchanged and only the LSE takes the offset back out.
* ``P V`` needs V K-major (keys contiguous): V arrives transposed, ``(batch, nheads_k,
  headdim, seqlen_k)``, and its tiles are ``[HEAD_DIM, BLOCK_N]`` boxes.
* Each tile's ``P V`` is a fresh wgmma accumulator added to the output in fp32: the FP8
  wgmma accumulates at reduced precision, and chaining every tile into one accumulator drops
  a long row's small terms.
* ``v_descale`` joins ``1 / l`` in the epilogue; the output is bf16.

Dense batches, causal (bottom-right) or not, GQA; head dims 32-128 (at 256 the output and
the per-tile accumulator alone would take 256 registers a thread).
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from flashtile.kernels.hopper.attention_fwd import CONSUMER_ROWS, hand_turn, issue_turn, softmax_step, work_item
from flashtile.kernels.runtime import cdiv, next_power_of_2, sm_count

LOG2E = 1.4426950408889634
LN2: gl.constexpr = gl.constexpr(0.6931471805599453)
# log2 of the factor P is scaled by before its e4m3 cast: 2^8 = 256 <= 448.
MAX_OFFSET = 8
MAX_HEADDIM = 128


@gluon.jit
def _producer(Q_desc, K_desc, VT_desc, q_smem, k_bufs, v_bufs, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty,
              seqlen_q, seqlen_k, nheads, group, num_items,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr):
    """As the bf16 forward's producer; V's tiles come from its transpose, at ``[b, hk, 0, key]``."""
    count = 0
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    for it in range(gl.cdiv(num_items - pid, nprog)):
        b, h, hk, m0, _qs, _ks, _sq, _sk, lo, _fl, _fh, n_tiles = work_item(
            pid + it * nprog, num_items, 0, 0, seqlen_q, seqlen_k, seqlen_q, nheads, group, -1, 0,
            BLOCK_M, BLOCK_N, False, CAUSAL, False)
        mbarrier.wait(q_empty, (it & 1) ^ 1)
        mbarrier.expect(q_ready, Q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(Q_desc, [b, m0, h, 0], q_ready, q_smem)
        for j in range(n_tiles):
            slot = count % NUM_STAGES
            free_phase = ((count // NUM_STAGES) & 1) ^ 1
            row = lo + j * BLOCK_N
            mbarrier.wait(k_empty.index(slot), free_phase)
            mbarrier.expect(k_ready.index(slot), K_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(K_desc, [b, row, hk, 0], k_ready.index(slot), k_bufs.index(slot))
            mbarrier.wait(v_empty.index(slot), free_phase)
            mbarrier.expect(v_ready.index(slot), VT_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(VT_desc, [b, hk, 0, row], v_ready.index(slot), v_bufs.index(slot))
            count += 1


@gluon.jit
def _consumer(q_smem, k_bufs, v_bufs, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, my_turn, their_turn,
              O, LSE, Q_DESCALE, K_DESCALE, V_DESCALE, stride_qdb, stride_qdh, stride_kdb, stride_kdh,
              stride_vdb, stride_vdh, stride_ob, stride_om, stride_oh,
              seqlen_q, seqlen_k, nheads, group, headdim, softmax_scale_log2, num_items, row_off,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, NUM_STAGES: gl.constexpr,
              CAUSAL: gl.constexpr, OFFSET: gl.constexpr):
    """Rows ``[row_off, row_off + 64)`` of each query tile, as in the bf16 forward."""
    ROWS: gl.constexpr = CONSUMER_ROWS
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 32])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 32])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    VEC: gl.constexpr = 8
    TPC: gl.constexpr = HEAD_DIM // VEC if HEAD_DIM // VEC < 32 else 32
    store_layout: gl.constexpr = gl.BlockedLayout([1, VEC], [32 // TPC, TPC], [4, 1], [1, 0])
    q = q_smem.reshape([BLOCK_M, HEAD_DIM]).slice(row_off, ROWS, dim=0)

    count = 0
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    for it in range(gl.cdiv(num_items - pid, nprog)):
        b, h, hk, m0, _qs, _ks, sq, sk, lo, full_lo, full_hi, n_tiles = work_item(
            pid + it * nprog, num_items, 0, 0, seqlen_q, seqlen_k, seqlen_q, nheads, group, -1, 0,
            BLOCK_M, BLOCK_N, False, CAUSAL, False)
        qk_scale = (gl.load(Q_DESCALE + b * stride_qdb + hk * stride_qdh)
                    * gl.load(K_DESCALE + b * stride_kdb + hk * stride_kdh) * softmax_scale_log2)
        v_descale = gl.load(V_DESCALE + b * stride_vdb + hk * stride_vdh)
        mbarrier.wait(q_ready, it & 1)
        offs_m = m0 + row_off + gl.arange(0, ROWS, layout=row_layout)
        m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=row_layout)
        l_i = gl.zeros([ROWS], gl.float32, layout=row_layout)
        acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
        if n_tiles > 0:
            slot = count % NUM_STAGES
            issue_turn(my_turn, count, True)
            mbarrier.wait(k_ready.index(slot), (count // NUM_STAGES) & 1)
            k_t = k_bufs.index(slot).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0))
            qk = warpgroup_mma(q, k_t, gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout), use_acc=False,
                               is_async=True)
            hand_turn(their_turn, True)
            qk = warpgroup_mma_wait(0, deps=[qk])
            mbarrier.arrive(k_empty.index(slot), count=1)
            p, alpha, m_i, l_i = softmax_step(qk, m_i, l_i, lo, offs_m, sq, sk, qk_scale, -1, 0, full_lo, full_hi,
                                              s_layout, BLOCK_N, False, CAUSAL, OFFSET)
            p_prev = gl.convert_layout(p.to(gl.float8e4nv), p_layout)
            count += 1
            first = count - 1
            end = first + n_tiles
            n_base = lo - first * BLOCK_N
            for c in range(count, end):
                slot = c % NUM_STAGES
                prev = (c - 1) % NUM_STAGES
                issue_turn(my_turn, c, True)
                mbarrier.wait(k_ready.index(slot), (c // NUM_STAGES) & 1)
                k_t = k_bufs.index(slot).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0))
                qk = warpgroup_mma(q, k_t, gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout), use_acc=False,
                                   is_async=True)
                mbarrier.wait(v_ready.index(prev), ((c - 1) // NUM_STAGES) & 1)
                v = v_bufs.index(prev).reshape([HEAD_DIM, BLOCK_N]).permute((1, 0))
                pv = warpgroup_mma(p_prev, v, gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout),
                                   use_acc=False, is_async=True)
                hand_turn(their_turn, True)
                qk, pv = warpgroup_mma_wait(1, deps=[qk, pv])
                mbarrier.arrive(k_empty.index(slot), count=1)
                p, alpha, m_i, l_i = softmax_step(qk, m_i, l_i, n_base + c * BLOCK_N, offs_m, sq, sk, qk_scale,
                                                  -1, 0, full_lo, full_hi, s_layout, BLOCK_N, False, CAUSAL, OFFSET)
                pv = warpgroup_mma_wait(0, deps=[pv])
                mbarrier.arrive(v_empty.index(prev), count=1)
                acc = (acc + pv) * gl.expand_dims(gl.convert_layout(alpha, o_rows), 1)
                p_prev = gl.convert_layout(p.to(gl.float8e4nv), p_layout)
            count = end
            mbarrier.arrive(q_empty, count=1)
            last = (count - 1) % NUM_STAGES
            mbarrier.wait(v_ready.index(last), ((count - 1) // NUM_STAGES) & 1)
            v = v_bufs.index(last).reshape([HEAD_DIM, BLOCK_N]).permute((1, 0))
            pv = warpgroup_mma(p_prev, v, gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout), use_acc=False,
                               is_async=True)
            pv = warpgroup_mma_wait(0, deps=[pv])
            mbarrier.arrive(v_empty.index(last), count=1)
            acc = acc + pv
        else:
            mbarrier.arrive(q_empty, count=1)

        # l carries 2^OFFSET as acc does: their ratio is the output; the LSE takes it out.
        empty = l_i == 0.0
        inv_l = gl.where(empty, 0.0, v_descale / gl.where(empty, 1.0, l_i))
        lse = gl.where(empty, float("-inf"), (m_i + gl.log2(gl.where(empty, 1.0, l_i)) - OFFSET) * LN2)
        lse_row = (b * nheads + h).to(gl.int64) * seqlen_q
        gl.store(LSE + lse_row + offs_m, lse, mask=offs_m < sq)
        out = acc * gl.expand_dims(gl.convert_layout(inv_l, o_rows), 1)
        out = gl.where(gl.expand_dims(gl.convert_layout(empty, o_rows), 1), 0.0, out)
        out = gl.convert_layout(out.to(gl.bfloat16), store_layout)
        rows = m0 + row_off + gl.arange(0, ROWS, layout=gl.SliceLayout(1, store_layout))
        cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, store_layout))
        o_base = b.to(gl.int64) * stride_ob + h * stride_oh
        ptrs = O + o_base + gl.expand_dims(rows.to(gl.int64) * stride_om, 1) + gl.expand_dims(cols, 0)
        gl.store(ptrs, out, mask=gl.expand_dims(rows < sq, 1) & gl.expand_dims(cols < headdim, 0))


@gluon.jit
def _attn_fwd_fp8_hopper(
    Q_desc, K_desc, VT_desc, O, LSE, Q_DESCALE, K_DESCALE, V_DESCALE,
    stride_qdb, stride_qdh, stride_kdb, stride_kdh, stride_vdb, stride_vdh, stride_ob, stride_om, stride_oh,
    seqlen_q, seqlen_k, nheads, group, headdim, softmax_scale_log2, num_items,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
    CAUSAL: gl.constexpr, OFFSET: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
):
    q_smem = gl.allocate_shared_memory(gl.float8e4nv, Q_desc.block_type.shape, Q_desc.layout)
    k_bufs = gl.allocate_shared_memory(gl.float8e4nv, [NUM_STAGES] + K_desc.block_type.shape, K_desc.layout)
    v_bufs = gl.allocate_shared_memory(gl.float8e4nv, [NUM_STAGES] + VT_desc.block_type.shape, VT_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready, count=1)
    mbarrier.init(q_empty, count=2)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)
        mbarrier.init(v_empty.index(i), count=2)
    mbarrier.init(turns.index(0), count=1)
    mbarrier.init(turns.index(1), count=1)
    mbarrier.arrive(turns.index(0), count=1)

    ROWS: gl.constexpr = CONSUMER_ROWS
    gl.warp_specialize([
        (_consumer, (q_smem, k_bufs, v_bufs, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turns.index(0),
                     turns.index(1), O, LSE, Q_DESCALE, K_DESCALE, V_DESCALE, stride_qdb, stride_qdh, stride_kdb,
                     stride_kdh, stride_vdb, stride_vdh, stride_ob, stride_om, stride_oh,
                     seqlen_q, seqlen_k, nheads, group, headdim, softmax_scale_log2, num_items, 0,
                     BLOCK_M, BLOCK_N, HEAD_DIM, NUM_STAGES, CAUSAL, OFFSET)),
        (_consumer, (q_smem, k_bufs, v_bufs, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turns.index(1),
                     turns.index(0), O, LSE, Q_DESCALE, K_DESCALE, V_DESCALE, stride_qdb, stride_qdh, stride_kdb,
                     stride_kdh, stride_vdb, stride_vdh, stride_ob, stride_om, stride_oh,
                     seqlen_q, seqlen_k, nheads, group, headdim, softmax_scale_log2, num_items, ROWS,
                     BLOCK_M, BLOCK_N, HEAD_DIM, NUM_STAGES, CAUSAL, OFFSET)),
        (_producer, (Q_desc, K_desc, VT_desc, q_smem, k_bufs, v_bufs, q_ready, q_empty, k_ready, k_empty, v_ready,
                     v_empty, seqlen_q, seqlen_k, nheads, group, num_items, BLOCK_M, BLOCK_N, NUM_STAGES, CAUSAL)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# --------------------------------------------------------------------------------------
# Launch configuration and launcher
# --------------------------------------------------------------------------------------


class HopperFp8Config:
    """Tiles of the Hopper FP8 forward (``BLOCK_M`` is two consumers' rows)."""

    def __init__(self, block_n=128, num_stages=2, consumer_regs=240, producer_regs=24):
        self.block_m = 2 * CONSUMER_ROWS.value
        self.block_n, self.num_stages = block_n, num_stages
        self.consumer_regs, self.producer_regs = consumer_regs, producer_regs
        # Three warpgroups (the producer's warp padded to one) share 64K registers.
        self.maxnreg = 65536 // (3 * 128) // 8 * 8

    def __repr__(self):
        return f"HopperFp8Config(BLOCK_N={self.block_n}, stages={self.num_stages})"


@functools.lru_cache(maxsize=None)
def config_for(head_dim_pad: int, causal: bool) -> HopperFp8Config:
    """128-key tiles, but 64 for causal d = 128: its masked tiles' extra registers beside the
    output, the tile's P V accumulator and the scores spilled 528 bytes at 128 (offline ptxas),
    none at 64."""
    return HopperFp8Config(block_n=64 if causal and head_dim_pad > 64 else 128)


def padded_headdim(d: int) -> int:
    # An FP8 wgmma contracts 32 elements an instruction: HEAD_DIM >= 32, a power of two.
    return max(32, next_power_of_2(d))


@functools.lru_cache(maxsize=None)
def _layout(block: tuple):
    return gl.NVMMASharedLayout.get_default_for(list(block), gl.float8e4nv)


def _descriptor(t: torch.Tensor, block: list) -> TensorDescriptor:
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, _layout(tuple(block)))


def _descale_strides(descale: torch.Tensor) -> tuple[int, int]:
    return (0, 0) if descale.dim() == 1 else (descale.stride(0), descale.stride(1))


def forward(q, k, v_t, q_descale, k_descale, v_descale, softmax_scale, causal=False, max_offset=True, config=None):
    """The FP8 forward on Hopper: ``q (b, nq, h, d)``, ``k (b, nk, hk, d)`` e4m3 with TMA-ready
    strides, ``v_t (b, hk, d, nk)`` (V transposed, keys contiguous), descales fp32 ``(1,)`` or
    ``(b, hk)``.  Returns ``(out bf16 (b, nq, h, d), lse fp32 (b, h, nq))``, as the portable
    FP8 kernel does."""
    batch, seqlen_q, nheads, d = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    hd = padded_headdim(d)
    cfg = config or config_for(hd, bool(causal))
    out = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty(batch, nheads, seqlen_q, dtype=torch.float32, device=q.device)
    num_items = cdiv(seqlen_q, cfg.block_m) * batch * nheads
    if num_items == 0:
        return out, lse
    _attn_fwd_fp8_hopper[(min(num_items, sm_count(q.device.index)),)](
        _descriptor(q, [1, cfg.block_m, 1, hd]), _descriptor(k, [1, cfg.block_n, 1, hd]),
        _descriptor(v_t, [1, 1, hd, cfg.block_n]), out, lse, q_descale, k_descale, v_descale,
        *_descale_strides(q_descale), *_descale_strides(k_descale), *_descale_strides(v_descale),
        out.stride(0), out.stride(1), out.stride(2),
        seqlen_q, seqlen_k, nheads, nheads // nheads_k, d, softmax_scale * LOG2E, num_items,
        HEAD_DIM=hd, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, NUM_STAGES=cfg.num_stages, CAUSAL=bool(causal),
        OFFSET=MAX_OFFSET if max_offset else 0, CONSUMER_REGS=cfg.consumer_regs, PRODUCER_REGS=cfg.producer_regs,
        num_warps=4, maxnreg=cfg.maxnreg,
    )
    return out, lse
