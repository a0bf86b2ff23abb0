"""Softmax, four ways, in exact float64 NumPy.

These are test oracles and teaching code, not fast code.  The four variants compute the
same function and differ only in how often they touch the input -- which is what decides
their speed on a GPU, where a long row does not fit on chip and every pass is a trip to
HBM.  Costs are counted in element moves (one read or one write of one element) over a
row of length N.

Shared conventions
------------------
* Inputs are converted to float64; outputs are float64.  ``axis`` selects the softmax
  dimension, every other dimension is an independent row.
* A row that is entirely ``-inf`` (every key masked) gives zeros from the safe variants,
  not NaN.  Its maximum is ``-inf`` and the textbook shift ``x - max`` would compute
  ``(-inf) - (-inf) = NaN``; so wherever the running maximum is ``-inf`` we shift by 0
  instead.  Every term is then ``exp(-inf) = 0``, the sum is 0, and dividing by 1 instead
  of 0 returns the zeros.  (``torch.softmax`` returns NaN for such a row; attention needs
  zeros, because a query that sees no key must output 0.)
* NaN anywhere in a row makes the whole row NaN, as in ``torch.softmax``.
* ``+inf`` in a row makes the whole row NaN, as ``torch.softmax`` does in float64: the
  maximum is ``+inf`` and ``inf - inf`` is NaN.  No special case hides it.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "softmax_naive",
    "softmax_3pass",
    "softmax_online_2pass",
    "softmax_1pass",
    "log_softmax",
    "logsumexp",
    "merge_softmax_states",
]


def _rows(x, axis):
    """View ``x`` as a float64 ``(rows, N)`` matrix; return it and a function undoing that."""
    x = np.asarray(x, dtype=np.float64)
    if x.ndim == 0:
        raise ValueError("x must have at least one dimension, got a scalar")
    moved = np.moveaxis(x, axis, -1)
    lead = moved.shape[:-1]
    flat = moved.reshape(int(np.prod(lead)), moved.shape[-1])  # -1 is ambiguous when N == 0

    def restore(y):
        return np.moveaxis(y.reshape(lead + (y.shape[-1],)), -1, axis)

    return flat, restore


def _shift(m):
    """The value to subtract before ``exp``: the running max, or 0 where it is ``-inf``.

    See the module docstring: shifting an all ``-inf`` row by its own max would turn
    ``-inf - -inf`` into NaN.  Any finite shift is mathematically valid (softmax is
    shift-invariant); 0 is the one that keeps such a row at exactly 0.
    """
    return np.where(m == -np.inf, 0.0, m)


def _safe_denominator(l):
    """``l`` with zeros replaced by 1: ``l == 0`` only for an all ``-inf`` row, whose
    numerators are all exactly 0, so ``0 / 1`` yields the zeros we want.  NaN stays NaN."""
    return np.where(l == 0.0, 1.0, l)


def softmax_naive(x, axis=-1):
    """Textbook ``exp(x) / sum(exp(x))`` with no max subtraction.  Do not use it.

    Kept to show why every real implementation subtracts the maximum: ``exp`` overflows
    float64 above about 709.78, so ``softmax_naive([1000, 1001, 1002])`` computes
    ``inf / inf`` and returns ``[nan, nan, nan]`` (NumPy emits an overflow warning);
    the true answer is ``[0.0900, 0.2447, 0.6652]``.  An all ``-inf`` row is ``0 / 0``
    and also gives NaN.

    Traffic: reads x twice (once for the sum, once to normalise), writes y once:
    3N element moves, or 2N if ``exp(x)`` were kept on chip.
    """
    rows, restore = _rows(x, axis)
    e = np.exp(rows)
    return restore(e / e.sum(axis=-1, keepdims=True))


def softmax_3pass(x, axis=-1):
    """Safe softmax in three passes over the input.

    Pass 1 finds the row max m, pass 2 sums ``exp(x - m)``, pass 3 writes
    ``exp(x - m) / sum``.  After the shift every exponent is <= 0, so nothing
    overflows and the largest term is exactly 1, so the sum is >= 1.

    Traffic: reads x 3 times, writes y once: 4N element moves, and ``exp`` is evaluated
    twice per element (passes 2 and 3) because nothing is cached between passes.
    """
    rows, restore = _rows(x, axis)
    m = np.max(rows, axis=-1, keepdims=True, initial=-np.inf)  # pass 1
    shift = _shift(m)
    with np.errstate(invalid="ignore"):  # +inf input: inf - inf is meant to give NaN
        l = np.exp(rows - shift).sum(axis=-1, keepdims=True)  # pass 2
        y = np.exp(rows - shift) / _safe_denominator(l)  # pass 3
    return restore(y)


def softmax_online_2pass(x, axis=-1, block=1):
    """Online softmax (Milakov & Gimelshein, 2018): max and sum fused into one pass.

    Pass 1 walks the row in chunks of ``block`` elements keeping a running max m and a
    running sum l *relative to that max*.  When a chunk raises the max from m_old to
    m_new, the old sum is re-expressed relative to the new max by one multiply::

        l = l * exp(m_old - m_new) + sum(exp(chunk - m_new))

    because ``sum exp(x_j - m_new) = exp(m_old - m_new) * sum exp(x_j - m_old)``.  At
    the end of the pass l equals the safe-softmax denominator exactly (in exact
    arithmetic).  Pass 2 writes ``exp(x - m) / l``.  ``block=1`` is the element-wise
    recurrence of the paper; larger blocks are how a GPU does it (one chunk per thread
    or tile, reduced in registers).

    Traffic: reads x twice, writes y once: 3N element moves, O(1) extra state per row.
    """
    if block < 1:
        raise ValueError(f"block must be a positive integer, got {block}")
    rows, restore = _rows(x, axis)
    n_rows, n = rows.shape
    m = np.full((n_rows, 1), -np.inf)
    l = np.zeros((n_rows, 1))
    with np.errstate(invalid="ignore"):
        for start in range(0, n, block):  # pass 1
            chunk = rows[:, start : start + block]
            m_new = np.maximum(m, chunk.max(axis=-1, keepdims=True))
            shift = _shift(m_new)
            l = l * np.exp(m - shift) + np.exp(chunk - shift).sum(axis=-1, keepdims=True)
            m = m_new
        y = np.exp(rows - _shift(m)) / _safe_denominator(l)  # pass 2
    return restore(y)


def softmax_1pass(x, axis=-1, block=1):
    """Softmax reading the input exactly once, with deferred normalisation.

    Each chunk of ``block`` elements is read once; ``exp(x_j - m)`` goes into an output
    buffer relative to the *running* max m.  When a chunk raises the max, everything
    already in the buffer (and the running sum) is multiplied by ``exp(m_old - m_new)``
    so the buffer stays relative to the current max.  At the end the buffer holds
    ``exp(x - m_N)`` and one normalisation by the final sum finishes the job, touching
    only the buffer, never x again.

    Traffic: reads x once, writes the buffer, then rescales and normalises it in place:
    x costs N reads, but the buffer is O(N) extra memory and every max increase
    rescales all of it, so a monotonically increasing row costs O(N^2) rescale
    multiplies (N^2 / (2 * block) for chunks).  This is why a single pass is not free
    for plain softmax.  Attention escapes the trap because it never keeps the
    probabilities: it folds them into a fixed-size output accumulator, so each rescale
    costs O(headdim), not O(N) (see ``flashtile.reference.attention``).
    """
    if block < 1:
        raise ValueError(f"block must be a positive integer, got {block}")
    rows, restore = _rows(x, axis)
    n_rows, n = rows.shape
    buf = np.empty_like(rows)
    m = np.full((n_rows, 1), -np.inf)
    l = np.zeros((n_rows, 1))
    with np.errstate(invalid="ignore"):
        for start in range(0, n, block):  # the only pass over x
            chunk = rows[:, start : start + block]
            m_new = np.maximum(m, chunk.max(axis=-1, keepdims=True))
            shift = _shift(m_new)
            scale = np.exp(m - shift)
            # Only rows whose max moved need the O(start) rescale; NaN != 1 keeps NaN rows.
            grew = scale[:, 0] != 1.0
            buf[grew, :start] *= scale[grew]
            e = np.exp(chunk - shift)
            buf[:, start : start + block] = e
            l = l * scale + e.sum(axis=-1, keepdims=True)
            m = m_new
        buf /= _safe_denominator(l)  # reads the buffer, not x
    return restore(buf)


def logsumexp(x, axis=-1):
    """``log(sum(exp(x)))`` along ``axis``, computed as ``m + log(sum(exp(x - m)))``.

    Shifting by the max keeps every exponent <= 0 (no overflow) and the sum >= 1 (no
    ``log(0)`` underflow to ``-inf`` for very negative rows).  Edge cases follow
    ``torch.logsumexp``: an all ``-inf`` (or empty) row gives ``-inf``; a row with
    ``+inf`` gives ``+inf`` (torch shifts by 0 when the max is infinite, so
    ``exp(inf) = inf``); NaN gives NaN.

    Traffic as written: reads x twice (max, then sum), writes one value per row:
    2N + 1 moves; an online pass (``merge_softmax_states``) would read x once.
    """
    rows, restore = _rows(x, axis)
    m = np.max(rows, axis=-1, keepdims=True, initial=-np.inf)
    shift = np.where(np.isinf(m), 0.0, m)
    with np.errstate(divide="ignore"):  # log(0) = -inf is the intended all -inf result
        out = shift + np.log(np.exp(rows - shift).sum(axis=-1, keepdims=True))
    return np.squeeze(restore(out), axis=axis)


def log_softmax(x, axis=-1):
    """``log(softmax(x))`` computed stably as ``(x - m) - log(sum(exp(x - m)))``.

    Taking the log of a softmax output would turn underflowed probabilities into
    ``-inf``; the shifted form stays finite for any finite input (e.g. ``-2000`` next to
    ``0`` gives ``-2000``, not ``-inf``).

    An all ``-inf`` row gives ``-inf`` everywhere (the log of the zeros that
    :func:`softmax_3pass` returns; ``torch.log_softmax`` returns NaN).  ``+inf`` or NaN
    in a row gives NaN for the row, as in torch.

    Traffic as written: reads x 3 times (max, sum, output), writes y once: 4N element
    moves; fusing max and sum into one online pass makes it 3N.
    """
    rows, restore = _rows(x, axis)
    m = np.max(rows, axis=-1, keepdims=True, initial=-np.inf)
    shift = _shift(m)
    with np.errstate(invalid="ignore"):
        l = np.exp(rows - shift).sum(axis=-1, keepdims=True)
        y = (rows - shift) - np.log(_safe_denominator(l))
    return restore(y)


def merge_softmax_states(m_a, l_a, m_b, l_b):
    """Combine the softmax statistics of two disjoint parts of one row.

    A part is summarised by ``(m, l)``: its max and ``sum(exp(x - m))`` over it.  The
    union has max ``m = max(m_a, m_b)`` and, since each sum was taken relative to its
    own max, each is rescaled to the common one::

        l = l_a * exp(m_a - m) + l_b * exp(m_b - m)

    The rule is associative and commutative, which is what lets a GPU split a row over
    threads, warps or K/V tiles and reduce the pieces in any order.  An empty part is
    ``(-inf, 0)`` and leaves the other unchanged; two empty parts give ``(-inf, 0)``.
    Arguments broadcast; returns float64 ``(m, l)``.
    """
    m_a, l_a, m_b, l_b = (np.asarray(t, dtype=np.float64) for t in (m_a, l_a, m_b, l_b))
    m = np.maximum(m_a, m_b)
    shift = _shift(m)
    with np.errstate(invalid="ignore"):
        l = l_a * np.exp(m_a - shift) + l_b * np.exp(m_b - shift)
    return m, l
