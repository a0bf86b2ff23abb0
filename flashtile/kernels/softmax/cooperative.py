"""Rows cut into chunks held in registers by programs that wait for each other: 1 read + 1 write
however long the row (up to ``COOPERATIVE_MAX`` / ``COOP_BWD_MAX`` elements).

A row too long for one SM is cut into chunks (``COOP_BLOCK``), one per program, and every
chunk stays in registers from its read to its write.  Each program publishes its chunk's
``(m, l)`` and waits until the row's other chunk programs have published theirs (a per-row
arrival counter), then merges them with the online-softmax rule and writes.  Waiting on
another program is only safe when that program is running, so the grid is launched
*cooperatively* (the driver refuses a grid whose programs cannot all be resident at once)
and holds as many rows' chunk programs as fit, each group of chunk programs taking its rows
in the same order.  Only the programs of one row wait for each other, so groups drift apart
and one group's wait overlaps another's streaming.  Rows whose chunks cannot all be resident
at once fall back to the streaming paths (``forward`` / ``backward`` return False).

The interpreter runs programs one after another, so there the kernel runs as two launches of
the same code: publish every chunk's ``(m, l)``, then re-read and write.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashtile.kernels.runtime import INTERPRET
from flashtile.kernels.softmax.packing import (
    KIND_BF16X2, KIND_PLAIN, max_bf16x2, max_f16x2, min_bf16x2, min_f16x2, opaque, pack, unpack,
)
from flashtile.kernels.softmax.residency import resident_programs
from flashtile.kernels.softmax.rows import (
    apply_mask, bwd_dx, merge_partials, normalizers, row_offset, safe_shift, softmax_out, sum_partials,
)


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


@triton.jit
def _chunk_logits(w, h: tl.constexpr, MASK, m_off, idx, ok, smc,
                  KIND: tl.constexpr, PAIRS: tl.constexpr, MASK_KIND: tl.constexpr, POLICY: tl.constexpr,
                  NAN_PADDED: tl.constexpr):
    """Half ``h`` of a held chunk as ``(x, bias)`` (see ``logits``): column ``idx * PAIRS + h``.
    ``NAN_PADDED``: the padding was loaded as NaN and the caller drops it (bias 0 here)."""
    x = unpack(w, h, KIND)
    if NAN_PADDED:
        bias = 0.0  # pairs are never masked
    else:
        x, bias = apply_mask(x, tl.where(ok, 0.0, float("-inf")), MASK, m_off, idx, ok, smc, MASK_KIND, POLICY)
    return x, bias


@triton.jit
def _chunk_max(w, MASK, m_off, idx, ok, smc, scale_log2,
               KIND: tl.constexpr, PAIRS: tl.constexpr, MASK_KIND: tl.constexpr, PACKED_MAX: tl.constexpr):
    """The chunk's largest logit, log2 units (-inf for an empty chunk)."""
    if PACKED_MAX:
        # max(x * s) = s * (max x if s >= 0 else min x), reduced on the packed words; the
        # padding words are NaN, which max / min ignore (every chunk has a real column).
        if scale_log2 >= 0:
            best = tl.reduce(w, 0, max_bf16x2 if KIND == KIND_BF16X2 else max_f16x2)
            x = tl.maximum(unpack(best, 0, KIND), unpack(best, 1, KIND))
        else:
            best = tl.reduce(w, 0, min_bf16x2 if KIND == KIND_BF16X2 else min_f16x2)
            x = tl.minimum(unpack(best, 0, KIND), unpack(best, 1, KIND))
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
        x_off = row_offset(row, L1, L2, sx0, sx1, sx2)
        m_off = row_offset(row, L1, L2, sm0, sm1, sm2)
        w = tl.load(XW + x_off + idx * sxc, mask=ok, other=PAD, eviction_policy="evict_first")
        if PHASE != 2:
            m_c = _chunk_max(w, MASK, m_off, idx, ok, smc, scale_log2, KIND, PAIRS, MASK_KIND, PACKED_MAX)
            shift_c = safe_shift(m_c)
            x, bias = _chunk_logits(w, 0, MASK, m_off, idx, ok, smc, KIND, PAIRS, MASK_KIND, "", PACKED_MAX)
            e = tl.math.exp2(x * scale_log2 + (bias - shift_c))
            if PAIRS == 2:
                x, bias = _chunk_logits(w, 1, MASK, m_off, idx, ok, smc, KIND, PAIRS, MASK_KIND, "", PACKED_MAX)
                e += tl.math.exp2(x * scale_log2 + (bias - shift_c))
            if PACKED_MAX:
                e = tl.where(ok, e, 0.0)
            # The true max, -inf for an empty chunk (see the split path, streaming._softmax_fwd_partials).
            tl.store(M_PART + row * splits + c, m_c)
            tl.store(L_PART + row * splits + c, tl.sum(e, axis=0))
            if PHASE == 0:
                _arrive_and_wait(ARRIVED, row, splits)
        if PHASE != 1:
            shift, l = merge_partials(M_PART, L_PART, row, splits, SPLITS)
            inv_l, log2_l = normalizers(l)
            if PACKED_MAX:
                w = opaque(w)
            x, bias = _chunk_logits(w, 0, MASK, m_off, idx, ok, smc, KIND, PAIRS, MASK_KIND, "evict_first", PACKED_MAX)
            y = softmax_out(x, bias, shift, inv_l, log2_l, scale_log2, LOG)
            if PAIRS == 2:
                x, bias = _chunk_logits(w, 1, MASK, m_off, idx, ok, smc, KIND, PAIRS, MASK_KIND, "evict_first",
                                        PACKED_MAX)
                y = pack(y, softmax_out(x, bias, shift, inv_l, log2_l, scale_log2, LOG), KIND)
            y_off = tl.cast(row, tl.int64) * n_words  # YW is a fresh contiguous (rows, words) buffer
            tl.store(YW + y_off + idx, y.to(YW.dtype.element_ty), mask=ok, eviction_policy="evict_first")


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
            g = unpack(gw, 0, KIND)
            part = g if LOG else g * unpack(yw, 0, KIND)
            if PAIRS == 2:
                g = unpack(gw, 1, KIND)
                part += g if LOG else g * unpack(yw, 1, KIND)
            tl.store(S_PART + row * splits + c, tl.sum(part, axis=0))
            if PHASE == 0:
                _arrive_and_wait(ARRIVED, row, splits)
        if PHASE != 1:
            s = sum_partials(S_PART, row, splits, SPLITS)
            m_off = row_offset(row, L1, L2, sm0, sm1, sm2)
            if ASM and PAIRS == 2:  # recompute from the held words (see the forward's opaque)
                yw = opaque(yw)
                gw = opaque(gw)
            dx = bwd_dx(MASK, unpack(yw, 0, KIND), unpack(gw, 0, KIND), s, m_off, idx, ok, smc, scale,
                        LOG, MASK_KIND, "evict_first")
            if PAIRS == 2:
                dx = pack(dx, bwd_dx(MASK, unpack(yw, 1, KIND), unpack(gw, 1, KIND), s, m_off, idx, ok,
                                     smc, scale, LOG, MASK_KIND, "evict_first"), KIND)
            tl.store(DXW + offs, dx.to(DXW.dtype.element_ty), mask=ok, eviction_policy="evict_first")


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
    slots = min(p["slots"], resident_programs(kernel, args, kwargs, device) // p["splits"])
    if slots < 1 and not maxnreg:  # more programs per SM at fewer registers each
        kwargs["maxnreg"] = 64
        slots = min(p["slots"], resident_programs(kernel, args, kwargs, device) // p["splits"])
    while slots >= 1:
        try:
            kernel[(slots * p["splits"],)](*args, **kwargs)
            return True
        except RuntimeError as e:  # our residency estimate above the driver's: fewer rows at once
            if "cooperative" not in str(e).lower():
                raise
            slots //= 2
    return False


def forward(x, mask, y, n_rows, n_cols, L1, L2, x_strides, m_strides, scale_log2, log, mask_kind, packing, p) -> bool:
    """y (a fresh contiguous (rows, n_cols) buffer) = softmax of the rows of ``x``, each chunk
    held as ``packing`` says (a ``KIND_*``); False, launching nothing, when not even one row's
    chunk programs can be resident at once."""
    parts = torch.empty((2, n_rows * p["splits"]), dtype=torch.float32, device=x.device)
    arrived = torch.zeros((n_rows,), dtype=torch.int32, device=x.device)
    pairs = 1 if packing == KIND_PLAIN.value else 2
    sxw = tuple(st // pairs for st in x_strides[:3]) + (x_strides[3],)
    args = (x, mask, y, parts[0], parts[1], arrived, n_rows, n_cols // pairs, L1, L2, *sxw, *m_strides,
            scale_log2, p["splits"])
    kw = dict(LOG=log, MASK_KIND=mask_kind, KIND=packing, WORDS=p["BLOCK_N"] // pairs, SPLITS=p["SPLITS"],
              ASM=not INTERPRET, num_warps=p["num_warps"])
    return _launch_cooperative(_softmax_fwd_cooperative, args, kw, p, x.device)


def backward(y, g, mask, dx, n_rows, n_cols, L1, L2, m_strides, scale, log, mask_kind, packing, p) -> bool:
    """dx of contiguous (rows, n_cols) ``y`` and ``g``, held as ``packing`` says; False,
    launching nothing, when not even one row's chunk programs can be resident at once."""
    part = torch.empty((n_rows * p["splits"],), dtype=torch.float32, device=y.device)
    arrived = torch.zeros((n_rows,), dtype=torch.int32, device=y.device)
    pairs = 1 if packing == KIND_PLAIN.value else 2
    args = (y, g, mask, dx, part, arrived, n_rows, n_cols // pairs, L1, L2, *m_strides, scale, p["splits"])
    kw = dict(LOG=log, MASK_KIND=mask_kind, KIND=packing, WORDS=p["BLOCK_N"] // pairs, SPLITS=p["SPLITS"],
              ASM=not INTERPRET, num_warps=p["num_warps"])
    return _launch_cooperative(_softmax_bwd_cooperative, args, kw, p, y.device)
