"""Exact float64 NumPy attention: the materialising definition and the FlashAttention
algorithm, forward and backward.  Test oracles and teaching code.

Layout convention
-----------------
Every function (except :func:`attention_1d`) takes either

* **4-D, flash-attn layout** -- ``q (batch, seqlen_q, nheads, headdim)``,
  ``k (batch, seqlen_k, nheads_k, headdim)``, ``v (batch, seqlen_k, nheads_k, headdim_v)``;
  ``out`` is ``(batch, seqlen_q, nheads, headdim_v)`` and ``lse`` is
  ``(batch, nheads, seqlen_q)``.  This is what the rest of flashtile calls.
* **2-D, one head** -- ``q (seqlen_q, headdim)``, ``k (seqlen_k, headdim)``,
  ``v (seqlen_k, headdim_v)``; treated as batch 1, one head, and the results come back
  with those axes dropped: ``out (seqlen_q, headdim_v)``, ``lse (seqlen_q,)``, and the
  gradients shaped like their inputs.

q, k and v must all have the same rank.  Inputs (NumPy arrays, nested lists, CPU tensors
without grad) are converted to float64; every result is float64.  ``lse`` is the natural
log of each query's softmax denominator, ``logsumexp_j(s_ij)`` over visible keys.

Semantics (see ``docs/semantics.md``)
-------------------------------------
* ``s = (q . k) * softmax_scale``; default ``softmax_scale = headdim ** -0.5``.
* GQA/MQA: ``nheads % nheads_k == 0`` and query head h reads kv head
  ``h // (nheads // nheads_k)``.
* Which keys a query sees is decided by :mod:`flashtile.masking` (causal and sliding
  window, bottom-right aligned), ANDed with the optional boolean ``mask`` (True = visible,
  broadcastable to ``(batch, nheads, seqlen_q, seqlen_k)``; ``(seqlen_q, seqlen_k)`` in
  2-D form also works).
* A query with no visible key gets output 0 and LSE ``-inf``, never NaN, and passes no
  gradient to anything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from flashtile.masking import key_range, normalize_window, visible
from flashtile.reference.softmax import logsumexp, softmax_3pass

__all__ = [
    "attention_naive",
    "attention_blocked",
    "attention_backward_naive",
    "attention_backward_blocked",
    "attention_1d",
]

LOG2E = 1.0 / math.log(2.0)
LN2 = math.log(2.0)


# ----------------------------------------------------------------------------------------
# Argument handling shared by every entry point
# ----------------------------------------------------------------------------------------


@dataclass
class _Problem:
    """Inputs in head-major layout ``(batch, nheads, seqlen, dim)``, float64.

    ``k`` and ``v`` are already gathered per *query* head, so code below never has to
    think about GQA except when summing gradients back onto the kv heads.
    """

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    nheads_k: int
    scale: float
    left: int
    right: int
    mask: np.ndarray | None  # broadcast view (batch, nheads, seqlen_q, seqlen_k) or None
    single_head: bool  # the caller used the 2-D convention

    @property
    def seqlen_q(self):
        return self.q.shape[2]

    @property
    def seqlen_k(self):
        return self.k.shape[2]

    def visible(self, q_start, q_end, k_start, k_end):
        """Boolean visibility of the tile ``[q_start, q_end) x [k_start, k_end)``."""
        i = np.arange(q_start, q_end)[:, None]
        j = np.arange(k_start, k_end)[None, :]
        band = visible(i, j, self.seqlen_q, self.seqlen_k, self.left, self.right)[None, None]
        if self.mask is None:
            return band
        return band & self.mask[:, :, q_start:q_end, k_start:k_end]

    def key_range(self, q_start, q_end):
        return key_range(q_start, q_end, self.seqlen_q, self.seqlen_k, self.left, self.right)

    def to_user(self, x, kv=False):
        """Head-major ``(b, h, n, d)`` back to the caller's layout.  ``kv=True`` first sums
        gradients of the query heads of each GQA group onto their shared kv head."""
        if kv:
            b, h, n, d = x.shape
            x = x.reshape(b, self.nheads_k, h // self.nheads_k, n, d).sum(axis=2)
        x = x.transpose(0, 2, 1, 3)
        return x[0, :, 0] if self.single_head else x

    def lse_to_user(self, lse):
        return lse[0, 0] if self.single_head else lse


def _as_float64(name, x):
    try:
        return np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{name} must be an array of real numbers, got {type(x).__name__}") from exc


def _prepare(q, k, v, softmax_scale, causal, window_size, mask) -> _Problem:
    q, k, v = (_as_float64(n, x) for n, x in (("q", q), ("k", k), ("v", v)))
    if not q.ndim == k.ndim == v.ndim or q.ndim not in (2, 4):
        raise ValueError(
            "q, k and v must all be 4-D (batch, seqlen, nheads, headdim) or all 2-D "
            f"(seqlen, headdim), got shapes {q.shape}, {k.shape}, {v.shape}"
        )
    single_head = q.ndim == 2
    if single_head:
        q, k, v = (x[None, :, None, :] for x in (q, k, v))

    batch, seqlen_q, nheads, headdim = q.shape
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must agree in all but the head dimension, got {k.shape} and {v.shape}")
    if k.shape[0] != batch:
        raise ValueError(f"q and k must have the same batch size, got {batch} and {k.shape[0]}")
    if k.shape[3] != headdim:
        raise ValueError(f"q and k must have the same head dimension, got {headdim} and {k.shape[3]}")
    nheads_k = k.shape[2]
    if nheads_k == 0 or nheads % nheads_k != 0:
        raise ValueError(f"nheads of q ({nheads}) must be a multiple of nheads of k/v ({nheads_k})")
    seqlen_k = k.shape[1]

    if softmax_scale is None:
        softmax_scale = headdim**-0.5
    softmax_scale = float(softmax_scale)
    if not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale must be a finite float or None, got {softmax_scale}")
    if len(window_size) != 2 or any(int(w) < -1 for w in window_size):
        raise ValueError(f"window_size must be (left, right) with -1 = unbounded, got {window_size!r}")
    left, right = normalize_window(bool(causal), window_size)

    full = (batch, nheads, seqlen_q, seqlen_k)
    if mask is not None:
        mask = np.asarray(mask)
        if mask.dtype != np.bool_:
            raise ValueError(f"mask must be a boolean array (True = visible), got dtype {mask.dtype}")
        try:
            mask = np.broadcast_to(mask, full)
        except ValueError as exc:
            raise ValueError(f"mask of shape {mask.shape} does not broadcast to {full}") from exc

    # The GQA rule, written once: query head h reads kv head h // group.
    kv_head = np.arange(nheads) // (nheads // nheads_k)
    heads_first = (0, 2, 1, 3)
    return _Problem(
        q=q.transpose(heads_first),
        k=k[:, :, kv_head].transpose(heads_first),
        v=v[:, :, kv_head].transpose(heads_first),
        nheads_k=nheads_k,
        scale=softmax_scale,
        left=left,
        right=right,
        mask=mask,
        single_head=single_head,
    )


def _check_block(name, value):
    if int(value) != value or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _prepare_backward(prob, dout, out, lse):
    """Bring ``dout``, ``out`` (caller layout) and ``lse`` to head-major float64."""
    dout, out, lse = (_as_float64(n, x) for n, x in (("dout", dout), ("out", out), ("lse", lse)))
    b, h, nq, _ = prob.q.shape
    o_shape = (nq, prob.v.shape[3]) if prob.single_head else (b, nq, h, prob.v.shape[3])
    l_shape = (nq,) if prob.single_head else (b, h, nq)
    for name, x, shape in (("dout", dout, o_shape), ("out", out, o_shape), ("lse", lse, l_shape)):
        if x.shape != shape:
            raise ValueError(f"{name} must have shape {shape}, got {x.shape}")
    if prob.single_head:
        dout, out, lse = dout[None, :, None, :], out[None, :, None, :], lse[None, None]
    return dout.transpose(0, 2, 1, 3), out.transpose(0, 2, 1, 3), lse


def _lse_for_recompute(lse):
    """LSE to subtract when rebuilding ``P = exp(s - lse)``.

    A query that saw no key has ``lse = -inf`` and would give ``exp(s + inf) = inf``.
    Using ``+inf`` instead makes every ``P`` of that row ``exp(-inf) = 0``, which is
    the truth: the row has no probabilities, so it sends no gradient anywhere.
    """
    return np.where(lse == -np.inf, np.inf, lse)


# ----------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------


def attention_naive(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), mask=None):
    """Attention by its definition, materialising S and P in full.  Returns ``(out, lse)``.

    ``S = q k^T * scale`` with invisible entries set to ``-inf``, ``P = softmax(S)`` (the
    safe 3-pass softmax, which turns an all ``-inf`` row into zeros), ``out = P v``,
    ``lse = logsumexp(S)``.

    Memory: S and P are ``(batch, nheads, seqlen_q, seqlen_k)`` each -- the O(N^2)
    intermediates that FlashAttention exists to avoid.  On a GPU, writing S, reading it
    for the softmax, writing P and reading it back for ``P v`` is 4 N^2 element moves per
    head, against O(N d) for q, k, v and out.
    """
    prob = _prepare(q, k, v, softmax_scale, causal, window_size, mask)
    s = np.einsum("bhqd,bhkd->bhqk", prob.q, prob.k) * prob.scale
    s = np.where(prob.visible(0, prob.seqlen_q, 0, prob.seqlen_k), s, -np.inf)
    p = softmax_3pass(s, axis=-1)
    out = p @ prob.v
    return prob.to_user(out), prob.lse_to_user(logsumexp(s, axis=-1))


def attention_blocked(
    q,
    k,
    v,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    mask=None,
    block_m=16,
    block_n=16,
):
    """The FlashAttention(-2) forward pass, tile by tile.  Returns ``(out, lse)``.

    For each tile of ``block_m`` queries (one GPU program), walk the K/V tiles of
    ``block_n`` keys, keeping per query row a running max ``m``, a running denominator
    ``l`` and an unnormalised output ``acc``, all relative to the current max:

    1. ``s = q_tile k_tile^T`` (raw, unscaled), invisible entries excluded;
    2. ``m_new = max(m, rowmax(s))``;
    3. ``p = exp2(s * c - m_new * c)`` with ``c = softmax_scale * log2(e)``;
    4. ``alpha = exp2((m - m_new) * c)`` rescales the past: ``l = alpha l + rowsum(p)``,
       ``acc = alpha acc + p v_tile``;

    and only after the last tile divide once: ``out = acc / l`` (deferred normalisation,
    FlashAttention-2: one division per row instead of one per tile).
    ``lse = m * c * ln(2) + ln(l)``: ``m * c`` is the max in log2 units, ``* ln 2``
    converts it to natural-log units (``c * ln 2 == softmax_scale``), and ``ln(l)`` adds
    the log of the denominator taken relative to that max.

    Why ``exp2`` with the scale folded in: ``exp(scale * (s - m))`` costs a subtract, a
    multiply and an ``exp``, and GPUs have no native ``exp`` -- ``exp(x)`` is computed as
    ``exp2(x * log2(e))``, one more multiply.  Pre-multiplying ``c = scale * log2(e)``
    makes the whole exponent ``s * c - (m * c)`` a single fused multiply-add (with
    ``m * c`` computed once per row), fed straight to the hardware ``ex2`` instruction,
    and S never needs a separate scaling pass.  The max is tracked on *raw* scores
    because for ``c > 0`` scaling preserves order.  A negative ``softmax_scale`` is
    handled by negating q, which gives the same scores with a positive scale.

    Tile skipping: K/V tiles wholly outside ``masking.key_range`` of the query tile
    (e.g. above the causal diagonal, outside a sliding window) are never loaded; the
    tiles that straddle the band boundary, and any user ``mask``, are masked element by
    element.  A row whose max is still ``-inf`` (nothing visible yet) uses 0 as its
    shift, so masked entries give ``exp2(-inf) = 0`` instead of ``(-inf) - (-inf) =
    NaN``; a row that never sees a key ends with ``l = 0``, output 0 and LSE ``-inf``.

    Memory: per query tile O(block_m * (headdim_v + 2)) of state and one
    ``block_m x block_n`` score tile; nothing of size seqlen_q x seqlen_k exists.
    """
    prob = _prepare(q, k, v, softmax_scale, causal, window_size, mask)
    block_m, block_n = _check_block("block_m", block_m), _check_block("block_n", block_n)
    qh, scale = prob.q, prob.scale
    if scale < 0:
        # (-q) k * |scale| == q k * scale exactly, and a positive scale keeps "max of
        # raw scores" equal to "max of scaled scores", which the exp2 shift relies on.
        qh, scale = -qh, -scale
    c = scale * LOG2E
    batch, nheads, seqlen_q, _ = qh.shape
    out = np.zeros((batch, nheads, seqlen_q, prob.v.shape[3]))
    lse = np.full((batch, nheads, seqlen_q), -np.inf)

    # NaN/inf scores legitimately produce NaN; scale 0 produces -inf * 0 in branches
    # that np.where then discards.
    with np.errstate(invalid="ignore"):
        for q_start in range(0, seqlen_q, block_m):
            q_end = min(q_start + block_m, seqlen_q)
            q_tile = qh[:, :, q_start:q_end]
            rows = q_end - q_start
            m = np.full((batch, nheads, rows, 1), -np.inf)
            l = np.zeros((batch, nheads, rows, 1))
            acc = np.zeros((batch, nheads, rows, prob.v.shape[3]))

            lo, hi = prob.key_range(q_start, q_end)
            # K tiles sit on a fixed grid (multiples of block_n), as in the kernel; an
            # empty range (lo >= hi) loads no tile at all.
            k_tiles = range(lo - lo % block_n, hi, block_n) if lo < hi else ()
            for k_start in k_tiles:
                k_end = min(k_start + block_n, prob.seqlen_k)
                vis = prob.visible(q_start, q_end, k_start, k_end)
                s = q_tile @ prob.k[:, :, k_start:k_end].transpose(0, 1, 3, 2)

                m_new = np.maximum(m, np.where(vis, s, -np.inf).max(axis=-1, keepdims=True))
                max_scaled = np.where(m_new == -np.inf, 0.0, m_new * c)
                p = np.exp2(np.where(vis, s * c - max_scaled, -np.inf))  # the one FMA
                alpha = np.where(m == -np.inf, 0.0, np.exp2((m - m_new) * c))

                l = alpha * l + p.sum(axis=-1, keepdims=True)
                acc = alpha * acc + p @ prob.v[:, :, k_start:k_end]
                m = m_new

            empty = l == 0.0
            out[:, :, q_start:q_end] = acc / np.where(empty, 1.0, l)
            row_lse = np.where(empty, -np.inf, m * (c * LN2) + np.log(np.where(empty, 1.0, l)))
            lse[:, :, q_start:q_end] = row_lse[..., 0]

    return prob.to_user(out), prob.lse_to_user(lse)


# ----------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------
#
# With s = scale * q k^T, P = softmax(s), out = P v and upstream gradient dO:
#   dV = P^T dO
#   dP = dO V^T
#   dS = P * (dP - D),  D_i = sum_j P_ij dP_ij = dO_i . out_i    (softmax Jacobian)
#   dQ = scale * dS K,  dK = scale * dS^T Q
# D is computed from dO and out (N d work) rather than from P and dP (N^2 work), and P
# is rebuilt from the saved LSE as exp(s - lse): no max/sum pass is needed because the
# forward already knows the normaliser.


def attention_backward_naive(
    dout, q, k, v, out, lse, softmax_scale=None, causal=False, window_size=(-1, -1), mask=None
):
    """Gradients ``(dq, dk, dv)`` with P rebuilt in full from ``lse``.  Same arguments
    and results as :func:`attention_backward_blocked`; it materialises the
    ``(batch, nheads, seqlen_q, seqlen_k)`` matrices P, dP and dS in one go.
    """
    prob = _prepare(q, k, v, softmax_scale, causal, window_size, mask)
    do, o, lse = _prepare_backward(prob, dout, out, lse)
    s = np.einsum("bhqd,bhkd->bhqk", prob.q, prob.k) * prob.scale
    vis = prob.visible(0, prob.seqlen_q, 0, prob.seqlen_k)
    p = np.exp(np.where(vis, s - _lse_for_recompute(lse)[..., None], -np.inf))

    d = np.sum(do * o, axis=-1, keepdims=True)
    dv = p.transpose(0, 1, 3, 2) @ do
    dp = do @ prob.v.transpose(0, 1, 3, 2)
    ds = p * (dp - d)
    dq = prob.scale * (ds @ prob.k)
    dk = prob.scale * (ds.transpose(0, 1, 3, 2) @ prob.q)
    return prob.to_user(dq), prob.to_user(dk, kv=True), prob.to_user(dv, kv=True)


def attention_backward_blocked(
    dout,
    q,
    k,
    v,
    out,
    lse,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    mask=None,
    block_m=16,
    block_n=16,
):
    """The FlashAttention-2 backward pass, tile by tile.  Returns ``(dq, dk, dv)``.

    ``dout`` and ``out`` have the layout of ``out``, ``lse`` that of the forward's LSE;
    ``dq`` is shaped like q, ``dk``/``dv`` like k/v.

    Loop order follows FlashAttention-2: the outer loop owns one K/V tile and keeps its
    ``dK``/``dV`` accumulators on chip; the inner loop visits every query tile that can
    see it, recomputing the score tile and ``P = exp(s - lse)`` from the saved LSE
    (recomputation: P is never stored, only O(N) statistics are).  ``dQ`` of a query
    tile receives contributions from many K tiles, which a GPU adds with atomics (or a
    separate pass); here it is a plain ``+=``.  A preprocessing step computes
    ``D = rowsum(dO * out)`` once per row.  Tiles outside the causal/window band are
    skipped exactly as in the forward.

    GQA: the query heads of a group share one K/V head, so their dK/dV are summed.
    Rows with ``lse = -inf`` (no visible key) have P = 0 and contribute nothing; their
    dq rows are 0.
    """
    prob = _prepare(q, k, v, softmax_scale, causal, window_size, mask)
    block_m, block_n = _check_block("block_m", block_m), _check_block("block_n", block_n)
    do, o, lse = _prepare_backward(prob, dout, out, lse)
    scale = prob.scale
    seqlen_q, seqlen_k = prob.seqlen_q, prob.seqlen_k

    d = np.sum(do * o, axis=-1, keepdims=True)  # preprocessing: O(N d), not O(N^2)
    lse = _lse_for_recompute(lse)[..., None]
    dq = np.zeros_like(prob.q)
    dk = np.zeros_like(prob.k)
    dv = np.zeros_like(prob.v)

    for k_start in range(0, seqlen_k, block_n):
        k_end = min(k_start + block_n, seqlen_k)
        k_tile, v_tile = prob.k[:, :, k_start:k_end], prob.v[:, :, k_start:k_end]
        dk_acc = np.zeros_like(k_tile)
        dv_acc = np.zeros_like(v_tile)
        for q_start in range(0, seqlen_q, block_m):
            q_end = min(q_start + block_m, seqlen_q)
            lo, hi = prob.key_range(q_start, q_end)
            if lo >= hi or hi <= k_start or lo >= k_end:
                continue  # no query of this tile sees any key of the K tile
            q_tile, do_tile = prob.q[:, :, q_start:q_end], do[:, :, q_start:q_end]
            vis = prob.visible(q_start, q_end, k_start, k_end)

            s = q_tile @ k_tile.transpose(0, 1, 3, 2) * scale
            p = np.exp(np.where(vis, s - lse[:, :, q_start:q_end], -np.inf))
            dv_acc += p.transpose(0, 1, 3, 2) @ do_tile
            dp = do_tile @ v_tile.transpose(0, 1, 3, 2)
            ds = p * (dp - d[:, :, q_start:q_end])
            dq[:, :, q_start:q_end] += scale * (ds @ k_tile)
            dk_acc += scale * (ds.transpose(0, 1, 3, 2) @ q_tile)
        dk[:, :, k_start:k_end] = dk_acc
        dv[:, :, k_start:k_end] = dv_acc

    return prob.to_user(dq), prob.to_user(dk, kv=True), prob.to_user(dv, kv=True)


# ----------------------------------------------------------------------------------------
# One query, plain Python
# ----------------------------------------------------------------------------------------


def _dot(a, b):
    total = 0.0
    for x, y in zip(a, b):
        total += x * y
    return total


def attention_1d(q, K, V):
    """Single-query online attention in one pass over K and V, in plain Python.

    ``q`` is a length-d sequence, ``K`` N rows of length d, ``V`` N rows of length d_v;
    returns ``softmax(q K^T) V`` as a list of d_v floats.  No scaling (scale 1), as in the
    worked example of seed 002 appendix A.5.

    The state is just ``(m, l, acc)``: running max, running denominator and an
    unnormalised output, all relative to m.  Each key is read once; when it raises the
    max, ``l`` and ``acc`` are rescaled by ``exp(m_old - m_new)`` -- O(d_v) work, unlike
    the O(N) buffer rescale of ``softmax_1pass``, because the probabilities are never
    kept, only their weighted sum.  The division by ``l`` happens once at the end
    (FlashAttention-2's deferred normalisation; the seed's formula (9) divides at every
    step instead, which gives the same result with N times more divisions).  With no
    keys, or an empty V, the result is all zeros / empty.
    """
    dv = len(V[0]) if len(V) else 0
    m = -math.inf
    l = 0.0
    acc = [0.0] * dv
    for k_row, v_row in zip(K, V):
        x = _dot(q, k_row)
        m_new = x if x > m else m
        alpha = math.exp(m - m_new)  # exp(-inf) = 0 on the first key: nothing to rescale
        p = math.exp(x - m_new)
        l = l * alpha + p
        acc = [a * alpha + p * float(vj) for a, vj in zip(acc, v_row)]
        m = m_new
    if l == 0.0:
        return acc
    return [a / l for a in acc]
