"""The attention forward in ``tl.*`` (any CUDA GPU and the interpreter), its tiles and launchers.

One program per (query tile, batch * head).  The query tile stays in registers; key/value
tiles stream through shared memory by TMA (tensor descriptors), scores go through the
tensor cores, and the softmax is kept *online*: a running row max ``m``, a running row sum
``l`` and an un-normalised fp32 accumulator ``acc``.  Normalisation happens once at the end
and the log-sum-exp is written for the backward.  Nothing of size seqlen_q x seqlen_k ever
reaches HBM.

The key tiles of a query tile come in up to three runs (``key_tiles``): the masked tiles at
the left edge of a sliding window, the unmasked ones, the masked ones at the right edge
(the causal diagonal, and the last key tile when it is partial).  ``_fwd_tiles`` walks one
run, so only the edge tiles pay for the mask.  How tensors are addressed (dense, packed,
paged) is in ``layout.py``.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from flashtile.kernels.attention.layout import Layout, dropout_args, fast_descriptor, max_seqlens, store_tile, unpad
from flashtile.kernels.dropout import dropout_scale
from flashtile.kernels.engine import engine_setting, forward_engine, short_masked, split_kv_forward
from flashtile.kernels.launch import constant as launch_constant
from flashtile.kernels.launch import bind, launch, placeholder
from flashtile.kernels.masking import band_mask, key_tiles
from flashtile.kernels.online_softmax import LOG2E, alibi_slope_log2, online_max, score_mod, score_mod_args
from flashtile.kernels.plans import NO_PLAN, PENDING, PlanCache, lse_buffer, stand_ins
from flashtile.kernels.runtime import INTERPRET, TileConfig, cdiv, dot_precision
from flashtile.kernels.tile_info import sequence_bounds, tile_and_head
from flashtile.kernels.tma import DescriptorTemplate, padded_headdim, tma_strides
from flashtile.semantics.params import AttentionParams


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
    acc, l_i, m_i, q, K_desc, V_desc, paged_kv, bt_row, b, hk, m0, k_start, start, end, seq, mods, rng, rng_row,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    MASKED: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
):
    """One run of key tiles ``[start, end)`` into the online softmax of query tile ``m0``.

    ``seq``, ``mods`` and ``rng`` are the bundles of ``online_softmax`` and ``dropout``, built once
    per kernel.  The constexprs stay separate arguments: Triton turns a constexpr into a tensor
    when a tuple holding it is assigned or unpacked.  ``rng_row``: the head's first dropout row.
    """
    seqlen_q, seqlen_k, window_left, window_right = seq
    qk_scale, softcap_scale, softcap_log2, slope_log2 = mods
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
            p = p * dropout_scale(rng, rng_row + m0, start_n, BLOCK_M, BLOCK_N, HAS_DROPOUT)
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

    # Also the dropout RNG's row.
    lse_row = (bh // nheads).to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh + q_start
    # Packed: rows past seqlen_q are the next sequence's queries; computed, never stored.
    q = Q_desc.load([b, q_start + m0, h, 0]).reshape([BLOCK_M, HEAD_DIM])
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    lo, full_lo, full_hi, hi = key_tiles(m0, seqlen_q, seqlen_k, window_left, window_right,
                                         BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT)
    seq = (seqlen_q, seqlen_k, window_left, window_right)
    mods = (qk_scale, softcap_scale, softcap_log2, slope_log2)
    rng = (dropout_p, seed, rng_offset, rng_cols)
    if MASK_LEFT:
        acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, K_desc, V_desc, paged_kv, bt_row, b, hk, m0, k_start, lo, full_lo,
                                   seq, mods, rng, lse_row, BLOCK_M, BLOCK_N, HEAD_DIM, True, MASK_LEFT, MASK_RIGHT,
                                   HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, DOT_PRECISION, PAGED, PAGE_SIZE)
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, K_desc, V_desc, paged_kv, bt_row, b, hk, m0, k_start, full_lo, full_hi,
                               seq, mods, rng, lse_row, BLOCK_M, BLOCK_N, HEAD_DIM, False, MASK_LEFT, MASK_RIGHT,
                               HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, DOT_PRECISION, PAGED, PAGE_SIZE)
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, K_desc, V_desc, paged_kv, bt_row, b, hk, m0, k_start, full_hi, hi,
                               seq, mods, rng, lse_row, BLOCK_M, BLOCK_N, HEAD_DIM, True, MASK_LEFT, MASK_RIGHT,
                               HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, DOT_PRECISION, PAGED, PAGE_SIZE)

    # Deferred normalisation: one reciprocal per row.  A row with no visible key has
    # l = 0: its output is 0 and its LSE -inf, never NaN.
    empty = l_i == 0.0
    inv_l = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, l_i))
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    tl.store(LSE + lse_row + offs_m, lse, mask=offs_m < seqlen_q)
    # Selected, not multiplied: acc may hold 0 * inf = NaN from a masked key's V.
    store_tile(O_desc, O, b, q_start + m0, h, tl.where(empty[:, None], 0.0, acc * inv_l[:, None]),
               q_start + seqlen_q, VARLEN)


# --------------------------------------------------------------------------------------
# Tiles and launchers
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


@functools.lru_cache(maxsize=None)
def _unpaged_args(device: torch.device) -> tuple:
    """The kernel's ``paged_kv`` tuple without paged keys: placeholders it never reads (not
    ``PAGED``), one constant tuple per device, so the launch layer classifies it once."""
    unread = placeholder(device)
    return launch_constant((unread, unread, unread, 0, 0, 0, 0, 0, 0, 0, 0, 0))


# The forward's runtime arguments that change from call to call -- dropout's seed and counter
# offset, and the key count (``rows_k``) with dropout's row pitch (``rng_cols``), which grow by
# a token a step when a model calls with a KV cache that it extends -- for the launch layer's
# key; a plan's bound launcher takes dropout_p from each call too (its plan's key holds only
# whether there is dropout).
_FWD_DYNAMIC = tuple(_attn_fwd.arg_names.index(name) for name in ("seqlen_k", "seed", "rng_offset", "rng_cols"))
_FWD_BOUND_DYNAMIC = tuple(_attn_fwd.arg_names.index(name) for name in ("dropout_p", "seed", "rng_offset"))


def _forward(layout, q, k, v, params: AttentionParams, config):
    softmax_scale, window_left, window_right = params.softmax_scale, params.window_left, params.window_right
    softcap, alibi_slopes, dropout = params.softcap, params.alibi_slopes, params.dropout
    if config is None and forward_engine(q, k, dropout, softcap, alibi_slopes, paged=layout.block_table is not None,
                                         short=short_masked(layout.seqlen_q, window_left, window_right)) == "gluon":
        from flashtile.kernels.hopper import attention_fwd

        return attention_fwd.forward(layout, q, k, v, softmax_scale, window_left, window_right, softcap=softcap,
                                     alibi_slopes=alibi_slopes)
    d = q.shape[-1]
    hd = padded_headdim(d)
    cfg = config or fwd_config(hd, q.dtype, window_right >= 0)
    q_ = layout.prepare(q)
    out_ = torch.empty(q_.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(layout.lse_shape, dtype=torch.float32, device=q.device)
    grid = (cdiv(layout.seqlen_q, cfg.block_m) * layout.batch * layout.nheads,)
    unread = placeholder(q.device)  # the pointers the kernel does not read (no ALiBi, not packed)
    mods = score_mod_args(softmax_scale, softcap, alibi_slopes, unread)
    drop = dropout_args(dropout)
    table = layout.block_table
    if table is None:
        k_desc = layout.tiles(layout.prepare(k), cfg.block_n, hd, fast_descriptor)
        v_desc = layout.tiles(layout.prepare(v), cfg.block_n, hd, fast_descriptor)
        paged_kv, stride_bt, page_size = _unpaged_args(q.device), 0, 1
    else:
        # Gathered through the block table, not TMA: the key descriptors are never read.
        k_desc = v_desc = layout.tiles(q_, cfg.block_n, hd, fast_descriptor)
        table = table if table.stride(1) == 1 else table.contiguous()
        paged_kv = (k, v, table, k.shape[0], table.shape[1], d, *k.stride()[:3], *v.stride()[:3])
        stride_bt, page_size = table.stride(0), k.shape[1]
    launch(_attn_fwd, grid, (
        layout.tiles(q_, cfg.block_m, hd, fast_descriptor), k_desc, v_desc, paged_kv, stride_bt,
        layout.tiles(out_, cfg.block_m, hd, fast_descriptor), out_, lse, mods["alibi"], mods["stride_ab"],
        *layout.seq_args(unread),
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
    return unpad(out_, d), lse


# --- Launch plans of the dense forward --------------------------------------------------
# A model calls the forward with a handful of shapes, each many times.  Everything of a
# launch but the tensors and the dropout RNG's seed and offset -- the engine, tiles, grid,
# constexprs, the int and float arguments, the descriptors' shapes, strides and boxes -- is a
# function of the shapes, strides, dtypes and devices of q, k and v, the call's scalars and
# the engine setting, so it is worked out once per such key (a plan) and a call allocates its
# outputs, builds its descriptors from the plan's templates and launches.  What a plan cannot
# take (a head dim that needs padding, an unaligned stride, an empty tensor, a 16-byte
# misaligned base in one call) goes the general way, ``_forward``, which decides as before.
# When a plan is built, and how a kept one goes stale: ``flashtile.kernels.plans``.  The public
# function's memo keeps ``cache.plans`` beside its plan.
cache = PlanCache()
_Tensor = torch.Tensor


def clear_plans() -> None:
    """Forget the cached launch plans, kept ones included, and the keys seen once (after a test
    changes what a plan was built from)."""
    cache.clear()



def _few_rows_plan(q, k, v, params: AttentionParams, tuning_text: str):
    """The launch plan of a dense forward on the split-KV decode kernel (``engine.split_kv_forward``
    says when) for calls that differ from this one in the key length and the K and V strides
    alone (``decode.few_rows_plan``): ``k`` and ``v`` as a cache every sequence fills, no
    append.  The decode kernel has the forward's semantics -- the queries are the last
    ``seqlen_q`` positions, so masks are bottom-right aligned; out 0 and LSE ``-inf`` for a row
    without a visible key -- and writes the LSE as ``(batch, nheads, seqlen_q)`` fp32, what the
    backward reads."""
    from flashtile.kernels import decode

    few = decode.few_rows_plan(q, k, v, params.alibi_slopes, params.softmax_scale, params.window_left,
                               params.window_right, params.softcap, tuning_text)

    def run(q, k, v, params: AttentionParams, need_lse=True):
        slopes = params.alibi_slopes
        if slopes is not None and not slopes.is_contiguous():
            slopes = slopes.contiguous()  # the kernel reads (batch,) nheads slopes at stride 1
        return few.run(q, k, v, slopes, bound=not torch.compiler.is_compiling(), need_lse=need_lse)

    return run


def _dense_plan(q, k, v, params: AttentionParams):
    """The launch plan of ``fwd(q, k, v, params)``: a function ``(q, k, v, params) -> (out,
    lse)`` for tensors of these shapes, strides, dtypes and devices (``None`` for a call with a
    misaligned base), or None when the call needs the general path."""
    if 0 in q.shape or 0 in k.shape:
        return None
    softmax_scale, window_left, window_right = params.softmax_scale, params.window_left, params.window_right
    softcap, alibi_slopes, dropout = params.softcap, params.alibi_slopes, params.dropout
    if not (tma_strides(q) and tma_strides(k) and tma_strides(v)):
        return None
    if forward_engine(q, k, dropout, softcap, alibi_slopes,
                      short=short_masked(q.shape[1], window_left, window_right)) == "gluon":
        from flashtile.kernels.hopper import attention_fwd

        return attention_fwd.dense_plan(q, k, v, softmax_scale, window_left, window_right, softcap, alibi_slopes)
    layout = Layout(q, k)
    d = q.shape[-1]
    hd = padded_headdim(d)
    if hd != d:
        return None  # the output is written padded and copied back: the general path
    cfg = fwd_config(hd, q.dtype, window_right >= 0)
    out_shape, lse_shape, dtype, device = tuple(q.shape), layout.lse_shape, q.dtype, q.device
    lse_numel = math.prod(lse_shape)
    out_template, lse_template = stand_ins(device, (out_shape, dtype), (lse_shape, torch.float32))
    q_desc, k_desc, v_desc, o_desc = (DescriptorTemplate(layout.tiles(t, rows, hd, fast_descriptor)) for t, rows in (
        (q, cfg.block_m), (k, cfg.block_n), (v, cfg.block_n), (out_template, cfg.block_m)))
    unread = placeholder(device)
    mods = score_mod_args(softmax_scale, softcap, alibi_slopes, unread)
    has_alibi, alibi_contiguous = alibi_slopes is not None, alibi_slopes is None or alibi_slopes.is_contiguous()
    has_dropout = dropout is not None
    grid = (cdiv(layout.seqlen_q, cfg.block_m) * layout.batch * layout.nheads,)
    paged_kv = _unpaged_args(device)
    options = dict(
        HEAD_DIM=hd, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        MASK_LEFT=window_left >= 0, MASK_RIGHT=window_right >= 0,
        HAS_SOFTCAP=mods["HAS_SOFTCAP"], HAS_ALIBI=has_alibi, HAS_DROPOUT=has_dropout,
        VARLEN=False, DOT_PRECISION=dot_precision(dtype), PAGED=False, PAGE_SIZE=1,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    # A bound launcher (``flashtile.kernels.launch.bind``): it builds the descriptors over the
    # call's q, k, v and output from the templates, every other non-tensor argument is this
    # plan's own object, and the plan's key holds the tensors' dtypes and device (``fixed``), so
    # a call is keyed on its tensors' alignment alone.  A call passes the arguments up to the
    # last one of its own -- the output and LSE, the ALiBi slopes, or dropout's p, seed and
    # offset (dynamic: the plan's key holds only whether there is dropout) -- and the launcher
    # holds the rest.
    args = (q_desc, k_desc, v_desc, paged_kv, 0, o_desc, out_template, lse_template,
            mods["alibi"], mods["stride_ab"], unread, unread, *layout.lse_strides, layout.rows_q, layout.rows_k,
            layout.seqlen_q, layout.nheads, layout.nheads // layout.nheads_k, softmax_scale * LOG2E, window_left,
            window_right, mods["softcap_scale"], mods["softcap_log2"], 0.0, 0, 0, layout.rng_cols)
    if has_dropout:
        bound = bind(_attn_fwd, grid, options, args, _FWD_BOUND_DYNAMIC, tail_from=_FWD_BOUND_DYNAMIC[-1] + 1,
                     fixed=True)
        mid = args[9:_FWD_BOUND_DYNAMIC[0]]
    else:
        bound = bind(_attn_fwd, grid, options, args, tail_from=9 if has_alibi else 8, fixed=True)

    def run(q, k, v, params: AttentionParams, need_lse=True):
        # The key fixed everything but the bases; TMA needs them 16-byte aligned.
        if (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15:
            return None
        # Sizes as separate ints: torch parses them faster than a tuple.
        out = torch.empty(*out_shape, dtype=dtype, device=device)
        lse = lse_buffer(lse_shape, lse_numel, device, need_lse)
        head = (q, k, v, paged_kv, 0, out, out, lse)
        if has_alibi:
            head += (params.alibi_slopes if alibi_contiguous else params.alibi_slopes.contiguous(),)
        elif has_dropout:
            head += (unread,)
        if has_dropout:
            head += mid + (float(params.dropout_p), int(params.seed), int(params.offset))
        bound(head)
        return out, (lse if need_lse else None)

    return run


def lookup_plan(q, k, v, params: AttentionParams):
    """This call's plan (see ``flashtile.kernels.plans``): a function ``(q, k, v, params) -> (out, lse) or
    None``, ``NO_PLAN`` (the key's calls go the general way), or ``PENDING`` (not decided yet:
    the key's first call, or a second one with a base off the 16-byte grid, which the plan's
    descriptor templates need; a split-KV call's plan is made at its first call)."""
    if (q.__class__ is not _Tensor or k.__class__ is not _Tensor or v.__class__ is not _Tensor
            or torch.compiler.is_compiling()):
        return NO_PLAN
    alibi = params.alibi_slopes
    if alibi is not None:
        if alibi.__class__ is not _Tensor:
            return NO_PLAN
        alibi = (alibi.shape, alibi.stride(), alibi.dtype, alibi.device)
    scale, left, right, softcap = params.softmax_scale, params.window_left, params.window_right, params.softcap
    # The scalars by value and type (True == 1 == 1.0 as dict keys, not as launch arguments).
    scalars = (scale, left, right, softcap, params.dropout_p > 0, alibi, scale.__class__, left.__class__,
               right.__class__, softcap.__class__, engine_setting())
    key = (q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype, k.device, v.shape, v.stride(),
           v.dtype, v.device) + scalars
    plan = cache.plans.get(key)
    if plan is not None:
        return plan
    if split_kv_forward(q, k, v, params.dropout):
        # One plan for every key length and K / V strides (``decode.few_rows_plan``), built at
        # once, at any alignment (the decode kernel reads through pointers, not TMA).
        from flashtile.kernels import decode

        raw = decode.tuning_raw()
        few_key = ("few rows", q.shape, q.stride(), q.dtype, q.device, k.shape[0], k.shape[2], k.shape[3], k.dtype,
                   k.device, v.shape[0], v.shape[2], v.shape[3], v.dtype, v.device, raw) + scalars
        plan = cache.plans.get(few_key)
        if plan is None:
            plan = cache.decide(few_key, lambda: _few_rows_plan(q, k, v, params, decode.tuning_text(raw)), at_once=True)
        return plan
    return cache.decide(key, lambda: _dense_plan(q, k, v, params),
                        ready=not (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15)


def plan_for(q, k, v, params: AttentionParams):
    """:func:`lookup_plan`'s plan, or None: the general path."""
    plan = lookup_plan(q, k, v, params)
    return None if plan is NO_PLAN or plan is PENDING else plan


def general(q, k, v, params: AttentionParams):
    """:func:`fwd` the general way (no plan)."""
    if split_kv_forward(q, k, v, params.dropout):
        from flashtile.kernels import decode

        return _few_rows_plan(q, k, v, params, decode.tuning_text(decode.tuning_raw()))(q, k, v, params)
    return _forward(Layout(q, k), q, k, v, params, None)


def fwd(q, k, v, params: AttentionParams, config=None):
    """Forward. q ``(b, nq, h, d)``, k/v ``(b, nk, hk, d)`` -> (out like q, lse ``(b, h, nq)`` fp32).

    ``config``: a ``TileConfig`` that replaces :func:`fwd_config`'s (and keeps the ``tl.*`` engine).
    Without one, the launch comes from the plan of the call's key where there is one, and a
    few query rows run on the split-KV decode kernel (``engine.split_kv_forward``)."""
    if config is None:
        plan = plan_for(q, k, v, params)
        if plan is not None:
            result = plan(q, k, v, params)
            if result is not None:
                return result
        return general(q, k, v, params)
    return _forward(Layout(q, k), q, k, v, params, config)


def varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, params: AttentionParams, max_seqlen_q=None, max_seqlen_k=None,
               config=None, block_table=None):
    """Packed forward: q ``(total_q, h, d)``, k/v ``(total_k, hk, d)`` -> (out, lse ``(h, total_q)``).

    One launch for the whole batch; ``max_seqlen_*`` size the grid (computed with a host sync
    when not given).  With ``block_table`` int32 ``(batch, max_blocks)``, k / v are a paged
    cache ``(num_blocks, page_size, hk, d)`` and sequence b's key j sits in page
    ``block_table[b, j // page_size]``, row ``j % page_size``."""
    layout = Layout(q, k, cu_seqlens_q, cu_seqlens_k, *max_seqlens(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k),
                    block_table=block_table)
    return _forward(layout, q, k, v, params, config)


def attention_forward(q, k, v, softmax_scale, window_left=-1, window_right=-1, config=None, softcap=0.0,
                      alibi_slopes=None, dropout=None):
    """:func:`fwd` with the params as arguments; ``dropout``: ``(p, seed, offset)`` or None
    (see ``flashtile.dropout``)."""
    params = AttentionParams.from_launcher(softmax_scale, window_left, window_right, softcap, alibi_slopes, dropout)
    return fwd(q, k, v, params, config)


def varlen_attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, window_left=-1, window_right=-1,
                             softcap=0.0, alibi_slopes=None, max_seqlen_q=None, max_seqlen_k=None, config=None,
                             dropout=None, block_table=None):
    """:func:`varlen_fwd` with the params as arguments; ``dropout``: ``(p, seed, offset)`` or None."""
    params = AttentionParams.from_launcher(softmax_scale, window_left, window_right, softcap, alibi_slopes, dropout)
    return varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, params, max_seqlen_q, max_seqlen_k, config, block_table)
