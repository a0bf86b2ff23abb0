"""What every strategy shares about a row: its address, its logits (the scale and mask rule),
its normaliser, the merge of chunk partials, and the backward's dx rule.

Rows are addressed through up to three leading indices with arbitrary strides plus a column
stride (``collapse_rows`` on the host, ``row_offset`` in the kernels), so transposed / sliced
/ broadcast (stride-0) inputs and masks are read in place.  The scale and the mask are
applied on the fly: the masked scores never exist in memory.  Everything is computed in
float32 and in log2 units (one FMA and an ``exp2`` per element).
"""

from __future__ import annotations

import triton
import triton.language as tl


def collapse_rows(shape, *stride_sets):
    """Merge adjacent leading dims that every tensor can merge; None if more than 3 remain.

    ``shape`` is the shape with the softmax dim last; each stride set gives that tensor's
    strides in the same order.  Returns ``(lead_shape, [lead_strides per tensor])`` with the
    leading part padded to exactly three dims.
    """
    lead = list(shape[:-1])
    strides = [list(s[:-1]) for s in stride_sets]
    i = len(lead) - 1
    while i > 0:
        if all(st[i - 1] == st[i] * lead[i] for st in strides) or lead[i] == 1 or lead[i - 1] == 1:
            if lead[i] == 1:
                merged = [st[i - 1] for st in strides]
            elif lead[i - 1] == 1:
                merged = [st[i] for st in strides]
            else:
                merged = [st[i] for st in strides]
            lead[i - 1] = lead[i - 1] * lead[i]
            for st, mst in zip(strides, merged):
                st[i - 1] = mst
                del st[i]
            del lead[i]
        i -= 1
    if len(lead) > 3:
        return None
    while len(lead) < 3:
        lead.insert(0, 1)
        for st in strides:
            st.insert(0, 0)
    return tuple(lead), [tuple(st) for st in strides]


@triton.jit
def row_offset(row, L1, L2, s0, s1, s2):
    """Offset of row ``row`` for a tensor whose leading dims (L0, L1, L2) have strides s0, s1, s2."""
    i2 = row % L2
    t = row // L2
    return (t // L1).to(tl.int64) * s0 + (t % L1).to(tl.int64) * s1 + i2.to(tl.int64) * s2


@triton.jit
def logits(X, MASK, x_off, m_off, cols, ok, sxc, smc, MASK_KIND: tl.constexpr, POLICY: tl.constexpr):
    """A block of logits as ``x`` (fp32) and a ``bias`` in log2 units.

    The logit is ``x * scale * log2(e) + bias``; keeping the two apart lets each use fold the
    scale, the bias and the max subtraction into one FMA, ``x * s + (bias - max)``, rounded
    once -- rounding ``x * s`` first would cost absolute accuracy when scores are large.
    Padding and masked-out entries get ``bias = -inf`` and ``x = 0`` (so a NaN hidden by the
    mask stays hidden, and a negative scale cannot turn the padding into +inf).
    """
    x = tl.load(X + x_off + cols * sxc, mask=ok, other=0.0, eviction_policy=POLICY).to(tl.float32)
    return apply_mask(x, tl.where(ok, 0.0, float("-inf")), MASK, m_off, cols, ok, smc, MASK_KIND, POLICY)


@triton.jit
def apply_mask(x, bias, MASK, m_off, cols, ok, smc, MASK_KIND: tl.constexpr, POLICY: tl.constexpr):
    """Fold the mask of ``cols`` into ``(x, bias)``: the one mask rule of every forward kernel."""
    if MASK_KIND == 1:  # boolean, True = keep
        keep = tl.load(MASK + m_off + cols * smc, mask=ok, other=0, eviction_policy=POLICY) != 0
        bias = tl.where(keep, bias, float("-inf"))
        x = tl.where(keep, x, 0.0)
    elif MASK_KIND == 2:  # additive, in natural-log units like x * scale
        add = tl.load(MASK + m_off + cols * smc, mask=ok, other=0.0, eviction_policy=POLICY)
        bias = bias + add.to(tl.float32) * 1.4426950408889634
    return x, bias


@triton.jit
def safe_shift(m):
    # (-inf) - (-inf) is NaN: a row with no finite entry is shifted by 0, so it stays 0.
    return tl.where(m == float("-inf"), 0.0, m)


@triton.jit
def softmax_out(x, bias, shift, inv_l, log2_l, scale_log2, LOG: tl.constexpr):
    if LOG:
        return (x * scale_log2 + (bias - shift - log2_l)) * 0.6931471805599453
    return tl.math.exp2(x * scale_log2 + (bias - shift)) * inv_l


@triton.jit
def normalizers(l):
    # An empty row (l = 0) keeps y = 0 (softmax) / -inf (log-softmax) instead of NaN.
    return 1.0 / tl.where(l == 0.0, 1.0, l), tl.where(l == 0.0, 0.0, tl.math.log2(l))


@triton.jit
def merge_partials(M_PART, L_PART, row, splits, SPLITS: tl.constexpr):
    """Merge a row's chunk states: m = max m_c, l = sum l_c * 2^(m_c - m)."""
    idx = tl.arange(0, SPLITS)
    ok = idx < splits
    m_c = tl.load(M_PART + row * splits + idx, mask=ok, other=float("-inf"))
    l_c = tl.load(L_PART + row * splits + idx, mask=ok, other=0.0)
    m = tl.max(m_c, axis=0)
    shift = safe_shift(m)
    return shift, tl.sum(l_c * tl.math.exp2(m_c - shift), axis=0)


@triton.jit
def sum_partials(S_PART, row, splits, SPLITS: tl.constexpr):
    """The backward's row sum: the sum of the row's chunk sums."""
    idx = tl.arange(0, SPLITS)
    return tl.sum(tl.load(S_PART + row * splits + idx, mask=idx < splits, other=0.0), axis=0)


# Backward.  With y the output (contiguous) and g = dL/dy:
#   softmax:     dx = scale * y * (g - sum(g * y))
#   log_softmax: dx = scale * (g - exp(y) * sum(g))
# Entries removed by a boolean mask get dx = 0 (they did not influence y).  The row sum
# needs g * y (softmax) or g alone (log-softmax: y is not read in that pass).


@triton.jit
def bwd_dx(MASK, y, g, s, m_off, cols, ok, smc, scale,
           LOG: tl.constexpr, MASK_KIND: tl.constexpr, POLICY: tl.constexpr):
    if LOG:
        dx = g - tl.math.exp(y) * s  # exp(-inf) = 0 for masked entries
    else:
        dx = y * (g - s)
    keep = ok
    if MASK_KIND == 1:
        keep = keep & (tl.load(MASK + m_off + cols * smc, mask=ok, other=0, eviction_policy=POLICY) != 0)
    return tl.where(keep, dx * scale, 0.0)
