"""The CPU path's attention, forward and backward: PyTorch's fused CPU kernel where it computes
the call exactly (:mod:`flashtile.cpu.fused`), else the tiled engine below.

The tiled engine is the Triton kernels' algorithm one level up: a (block_m x block_n) chunk
of scores is an ordinary tensor, and the running row max ``m``, row sum ``l`` and
un-normalised accumulator ``acc`` are updated chunk by chunk, in log2 units
(:mod:`flashtile.cpu.numerics`).  No ``seqlen_q x seqlen_k`` tensor is ever allocated.
"""

from __future__ import annotations

from pathlib import Path

import torch

from flashtile.cpu import fused
from flashtile.cpu.numerics import LN2, LOG2E, compute_dtype, exp2_flushed, log2_lse, natural_lse
from flashtile.dropout import keep_mask
from flashtile.masking import is_masked, key_range, visible
from flashtile.semantics.params import AttentionParams

BLOCK_M = 256
BLOCK_N = 512


def _l2_bytes() -> int:
    """One core's L2 cache (Linux sysfs), 1 MiB where unknown."""
    try:
        for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
            if (index / "level").read_text().strip() == "2":
                text = (index / "size").read_text().strip().upper()
                scale = {"K": 1024, "M": 1024**2}.get(text[-1], 1)
                return int(text.rstrip("KM")) * scale
    except (OSError, ValueError):
        pass
    return 1024**2


_L2_BYTES = _l2_bytes()


def default_blocks(rows: int, seqlen_q: int, seqlen_k: int, itemsize: int) -> tuple[int, int]:
    """(block_m, block_n) for the tiled engine: one score chunk, ``rows`` (batch x heads)
    matrices of block_m x block_n, about the size of the L2 caches of the threads that share
    it, so that the elementwise passes over it stay in cache while each Python-level step (a
    fixed ~10 us per op) covers as much work as the cache allows.  On 2 cores with 1 MiB of L2
    each this gives 512 x 512 for one head and 128 x 256 for 16, within ~10% of the best of a
    sweep from 128 x 256 to 1024 x 1024."""
    budget = _L2_BYTES * max(1, torch.get_num_threads()) // (itemsize * max(rows, 1))
    block_n = 512 if budget >= 512 * 256 else 256 if budget >= 256 * 128 else 128
    block_m = max(64, min(512, budget // block_n))
    block_m = 1 << (block_m.bit_length() - 1)  # a power of two
    return min(block_m, max(seqlen_q, 1)), min(block_n, max(seqlen_k, 1))


def _heads_first(x: torch.Tensor, nheads_k: int) -> torch.Tensor:
    """(b, n, h, d) -> (b, h_k, group, n, d) as a view: GQA without copying K/V."""
    b, n, h, d = x.shape
    return x.permute(0, 2, 1, 3).reshape(b, nheads_k, h // nheads_k, n, d)


def _kv_rows(x: torch.Tensor, dtype) -> torch.Tensor:
    """(b, n, h_k, d) -> contiguous (b * h_k, n, d) in ``dtype``: one O(N d) copy (none for a
    contiguous single head already in ``dtype``) so that every chunk product is a plain bmm."""
    b, n, hk, d = x.shape
    return x.permute(0, 2, 1, 3).to(dtype).contiguous().view(b * hk, n, d)


def _q_rows(x5: torch.Tensor, q0: int, q1: int, dtype, scale=None) -> torch.Tensor:
    """Rows q0:q1 of a (b, h_k, g, n, d) view as a fresh contiguous (b * h_k, g * m, d): the
    query heads of a GQA group stacked along M share one product with their K/V head (and
    the products ds^T q, p^T dO sum over the group for free)."""
    b, hk, g, _, d = x5.shape
    c = x5[..., q0:q1, :].to(dtype, copy=True).contiguous()
    if scale is not None:
        c.mul_(scale)
    return c.view(b * hk, g * (q1 - q0), d)


def _chunk_mask(q0, q1, k0, k1, seqlen_q, seqlen_k, left, right, device):
    i = torch.arange(q0, q1, device=device)[:, None]
    j = torch.arange(k0, k1, device=device)[None, :]
    return visible(i, j, seqlen_q, seqlen_k, left, right)


def _chunk_all_visible(q0, q1, k0, k1, seqlen_q, seqlen_k, left, right) -> bool:
    """Whether every (i, j) of the chunk is in the band (then no mask is needed)."""
    offset = seqlen_k - seqlen_q
    if right >= 0 and k1 - 1 > q0 + offset + right:
        return False
    if left >= 0 and k0 < q1 - 1 + offset - left:
        return False
    return True


def _slopes(alibi_slopes, batch, nheads_k, group, dtype):
    """ALiBi slopes (nheads,) or (batch, nheads) -> broadcastable (b|1, hk, g, 1, 1), in log2
    units (times log2 e, as the scores)."""
    if alibi_slopes is None:
        return None
    s = alibi_slopes.to(dtype) * LOG2E
    if s.dim() == 1:
        s = s.unsqueeze(0)
    return s.reshape(s.shape[0], nheads_k, group, 1, 1)


def _score_mods(s, q0, q1, k0, k1, seqlen_q, seqlen_k, softcap, slopes, need_tanh=False):
    """Softcap then ALiBi on a (b, hk, g, m, n) chunk of scaled scores in log2 units, in place
    (SEMANTICS order; ``cap * tanh(s / cap)`` keeps its form with ``cap`` in log2 units too).
    Returns (s, tanh or None): the softcap's tanh, kept for the backward when ``need_tanh``."""
    t = None
    if softcap > 0:
        cap = softcap * LOG2E
        if need_tanh:
            t = torch.tanh(s.mul_(1.0 / cap))
            s = torch.mul(t, cap, out=s)
        else:
            s.mul_(1.0 / cap).tanh_().mul_(cap)
    if slopes is not None:
        i = torch.arange(q0 + seqlen_k - seqlen_q, q1 + seqlen_k - seqlen_q, dtype=s.dtype, device=s.device)
        distance = (i[:, None] - torch.arange(k0, k1, dtype=s.dtype, device=s.device)).abs_()
        s.addcmul_(slopes, distance, value=-1.0)  # one pass over the chunk, no (heads, m, n) temporary
    return s, t


def _rng_head_rows(batch, nheads_k, group, seqlen_q, rng_rows, device):
    """First dropout-RNG row of every (batch, head), shaped (b, hk, g, 1, 1): LSE-row numbering.

    ``rng_rows = (batch stride, head stride, base, columns)``; dense calls use
    ``(nheads * seqlen_q, seqlen_q, 0, seqlen_k)``, see ``flashtile.dropout``.
    """
    sb, sh, base, _ = rng_rows
    b = torch.arange(batch, device=device).reshape(batch, 1, 1, 1, 1)
    h = torch.arange(nheads_k * group, device=device).reshape(1, nheads_k, group, 1, 1)
    return b * sb + h * sh + base


def _dropout_factor(dropout, head_rows, rng_rows, q0, q1, k0, k1, dtype):
    """1 / (1 - p) where kept, 0 where dropped, for a chunk; the kernels' mask exactly."""
    p, seed, offset = dropout
    rows = head_rows + torch.arange(q0, q1, device=head_rows.device)[:, None]
    cols = torch.arange(k0, k1, device=head_rows.device)
    keep = keep_mask(seed, offset, rows, cols, rng_rows[3], p)
    return keep.to(dtype) * (1.0 / (1.0 - p))


def _key_chunks(q0, q1, seqlen_q, seqlen_k, left, right, block_n):
    lo, hi = key_range(q0, q1, seqlen_q, seqlen_k, left, right)
    for k0 in range(lo - lo % block_n, hi, block_n):  # chunk starts aligned to block_n
        yield max(k0, lo), min(k0 + block_n, hi)


class _Chunking:
    """What the tiled forward and backward share about a call: its sizes, the chunk sizes, and
    each chunk's scores (the scale, score modifications and mask applied, in log2 units) and
    dropout factor."""

    def __init__(self, q, k, params: AttentionParams, block_m, block_n, rng_rows):
        self.params = params
        self.batch, self.seqlen_q, self.nheads, self.d = q.shape
        self.seqlen_k, self.nheads_k = k.shape[1], k.shape[2]
        self.group = self.nheads // self.nheads_k
        self.rows = self.batch * self.nheads_k  # (b * hk): the leading dim of every chunk product
        self.dtype = compute_dtype(q.dtype)
        self.device = q.device
        dm, dn = default_blocks(self.batch * self.nheads, self.seqlen_q, self.seqlen_k,
                                torch.empty((), dtype=self.dtype).element_size())
        self.block_m, self.block_n = block_m or dm, block_n or dn
        self.masked = is_masked(params.window_left, params.window_right)
        self.slopes = _slopes(params.alibi_slopes, self.batch, self.nheads_k, self.group, self.dtype)
        self.rng_rows = self.head_rows = None
        if params.dropout is not None:
            self.rng_rows = rng_rows or (self.nheads * self.seqlen_q, self.seqlen_q, 0, self.seqlen_k)
            self.head_rows = _rng_head_rows(self.batch, self.nheads_k, self.group, self.seqlen_q, self.rng_rows,
                                            q.device)

    def query_chunks(self):
        for q0 in range(0, self.seqlen_q, self.block_m):
            yield q0, min(q0 + self.block_m, self.seqlen_q)

    def key_chunks(self, q0, q1):
        return _key_chunks(q0, q1, self.seqlen_q, self.seqlen_k, self.params.window_left, self.params.window_right,
                           self.block_n)

    def scaled_queries(self, qh, q0, q1):
        """Query rows q0:q1 as ``(b * hk, g * m, d)``, times ``softmax_scale * log2 e``: scaled once
        per query chunk, not per score, and alike in the forward and the backward, so that the
        backward's scores round as the forward's did."""
        return _q_rows(qh, q0, q1, self.dtype, self.params.softmax_scale * LOG2E)

    def chunk(self, s, q0, q1, k0, k1):
        """A ``(b * hk, g * m, n)`` chunk seen as ``(b, hk, g, m, n)``."""
        return s.view(self.batch, self.nheads_k, self.group, q1 - q0, k1 - k0)

    def scores(self, qc, kc, q0, q1, k0, k1, need_tanh=False):
        """``(s, tanh)``: the chunk's scores ``(b * hk, g * m, n)`` in log2 units with the score
        modifications and the mask (-inf) applied, and the softcap's tanh when ``need_tanh``."""
        p = self.params
        s = torch.bmm(qc, kc.transpose(1, 2))
        s5 = self.chunk(s, q0, q1, k0, k1)
        _, tanh = _score_mods(s5, q0, q1, k0, k1, self.seqlen_q, self.seqlen_k, p.softcap, self.slopes, need_tanh)
        if self.masked and not _chunk_all_visible(q0, q1, k0, k1, self.seqlen_q, self.seqlen_k, p.window_left,
                                                  p.window_right):
            s5.masked_fill_(~_chunk_mask(q0, q1, k0, k1, self.seqlen_q, self.seqlen_k, p.window_left,
                                         p.window_right, self.device), float("-inf"))
        return s, tanh

    def dropout_factor(self, q0, q1, k0, k1):
        """The chunk's ``(b, hk, g, m, n)`` dropout factor, or None without dropout."""
        if self.params.dropout is None:
            return None
        return _dropout_factor(self.params.dropout, self.head_rows, self.rng_rows, q0, q1, k0, k1, self.dtype)

    def heads_last(self, x, dtype, heads):
        """``(b * h, n, d)`` rows back to flash-attn's ``(b, n, h, d)``, in ``dtype``."""
        n, d = x.shape[-2], x.shape[-1]
        return x.reshape(self.batch, heads, n, d).permute(0, 2, 1, 3).to(dtype).contiguous()


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    window_left: int = -1,
    window_right: int = -1,
    block_m: int | None = None,
    block_n: int | None = None,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    dropout: tuple | None = None,
    rng_rows: tuple | None = None,
    engine: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fwd` with the params as arguments; ``dropout``: ``(p, seed, offset)`` or None."""
    params = AttentionParams.from_launcher(softmax_scale, window_left, window_right, softcap, alibi_slopes, dropout)
    return fwd(q, k, v, params, block_m=block_m, block_n=block_n, rng_rows=rng_rows, engine=engine)


def fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    params: AttentionParams,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    rng_rows: tuple | None = None,
    engine: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward. Returns ``out`` (like q) and ``lse`` (batch, nheads, seqlen_q), float32
    (float64 for float64 inputs).  ``engine``: ``"auto"`` (the fused kernel where it applies),
    ``"fused"`` (an error where it does not) or ``"tiled"``; ``block_m`` / ``block_n`` are the
    tiled engine's chunk sizes (default: :func:`default_blocks`); ``rng_rows``: the dropout
    RNG's row numbering (see :func:`_rng_head_rows`; default: the dense LSE's)."""
    plan = fused.plan_for(engine, q, k, params)
    if plan is not None:
        return fused.forward(q, k, v, params.softmax_scale, plan)
    c = _Chunking(q, k, params, block_m, block_n, rng_rows)
    qh = _heads_first(q, c.nheads_k)  # (b, hk, g, nq, d) view
    kr, vr = _kv_rows(k, c.dtype), _kv_rows(v, c.dtype)  # (b * hk, nk, d)
    out = torch.empty(c.batch, c.nheads_k, c.group, c.seqlen_q, c.d, dtype=q.dtype, device=q.device)
    lse = torch.empty(c.batch, c.nheads_k, c.group, c.seqlen_q, dtype=c.dtype, device=q.device)

    for q0, q1 in c.query_chunks():
        qc = c.scaled_queries(qh, q0, q1)
        m = torch.full((c.rows, c.group * (q1 - q0)), float("-inf"), dtype=c.dtype, device=q.device)
        l = torch.zeros_like(m)
        acc = torch.zeros(c.rows, c.group * (q1 - q0), c.d, dtype=c.dtype, device=q.device)
        for k0, k1 in c.key_chunks(q0, q1):
            s, _ = c.scores(qc, kr[:, k0:k1], q0, q1, k0, k1)
            m_new = torch.maximum(m, s.amax(dim=-1))
            # A row that has seen only masked keys keeps m = -inf; shift by 0 instead so that
            # exp(-inf - (-inf)) = NaN never appears and its p stays exactly 0.
            m_safe = torch.where(m_new == float("-inf"), 0.0, m_new)
            p = exp2_flushed(s.sub_(m_safe[..., None]))
            alpha = torch.exp2(m - m_safe)
            l.mul_(alpha).add_(p.sum(dim=-1))  # the denominator counts dropped entries too
            drop = c.dropout_factor(q0, q1, k0, k1)
            if drop is not None:
                c.chunk(p, q0, q1, k0, k1).mul_(drop)
            acc.mul_(alpha[..., None]).baddbmm_(p, vr[:, k0:k1])
            m = m_new
        empty = l == 0
        # Deferred normalisation: one division per row at the end, not one per chunk.  A row
        # with no visible key gives 0 by selection: its acc may hold 0 * inf = NaN from a
        # masked key's V.
        o = torch.where(empty[..., None], 0.0, acc / torch.where(empty, 1.0, l)[..., None])
        out[..., q0:q1, :] = o.view(c.batch, c.nheads_k, c.group, q1 - q0, c.d)
        lse[..., q0:q1] = torch.where(empty, float("-inf"), natural_lse(m, l)).view(c.batch, c.nheads_k, c.group,
                                                                                    q1 - q0)
    return c.heads_last(out, q.dtype, c.nheads), lse.reshape(c.batch, c.nheads, c.seqlen_q)


def attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    softmax_scale: float,
    window_left: int = -1,
    window_right: int = -1,
    block_m: int | None = None,
    block_n: int | None = None,
    dlse: torch.Tensor | None = None,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    dropout: tuple | None = None,
    rng_rows: tuple | None = None,
    deterministic: bool = False,
    engine: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`bwd` with the params as arguments; ``dropout``: ``(p, seed, offset)`` or None."""
    params = AttentionParams.from_launcher(softmax_scale, window_left, window_right, softcap, alibi_slopes, dropout,
                                           deterministic)
    return bwd(dout, q, k, v, out, lse, params, dlse=dlse, block_m=block_m, block_n=block_n, rng_rows=rng_rows,
               engine=engine)


def bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    params: AttentionParams,
    *,
    dlse: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    rng_rows: tuple | None = None,
    engine: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward by recomputation: P is rebuilt block by block from Q, K and the LSE (either
    engine's LSE: both are the natural-log LSE of the same scores).

    Always deterministic (no atomics, fixed reduction orders), so ``params.deterministic``
    changes nothing here.  The other arguments as in :func:`fwd`."""
    if dlse is not None and not bool(dlse.any()):
        dlse = None  # autograd hands an unused LSE's gradient over as zeros
    plan = fused.plan_for(engine, q, k, params, dlse)
    if plan is not None:
        return fused.backward(dout, q, k, v, out, lse, params.softmax_scale, plan)
    c = _Chunking(q, k, params, block_m, block_n, rng_rows)
    qh, doh, oh = (_heads_first(x, c.nheads_k) for x in (q, dout, out))
    kr, vr = _kv_rows(k, c.dtype), _kv_rows(v, c.dtype)
    lseh = lse.reshape(c.batch, c.nheads_k, c.group, c.seqlen_q)
    dlseh = None if dlse is None else dlse.reshape(c.batch, c.nheads_k, c.group, c.seqlen_q).to(c.dtype)

    dq = torch.empty(c.batch, c.nheads_k, c.group, c.seqlen_q, c.d, dtype=c.dtype, device=q.device)
    # dK/dV are summed over the query heads of a GQA group, which the (g * m)-row products
    # below do by themselves.
    dk = torch.zeros(c.rows, c.seqlen_k, c.d, dtype=c.dtype, device=q.device)
    dv = torch.zeros_like(dk)

    def rows_of(x4, q0, q1):  # (b, hk, g, n) -> (b * hk, g * m)
        return x4[..., q0:q1].reshape(c.rows, c.group * (q1 - q0))

    for q0, q1 in c.query_chunks():
        qc = c.scaled_queries(qh, q0, q1)
        doc = _q_rows(doh, q0, q1, c.dtype)
        # D_i = rowsum(dO_i * O_i) = rowsum(P_i * dP_i): the softmax Jacobian's correction term.
        delta = (doc * _q_rows(oh, q0, q1, c.dtype)).sum(dim=-1)
        if dlseh is not None:  # d lse_i / d s_ij = P_ij, so a gradient on the LSE shifts D_i
            delta = delta - rows_of(dlseh, q0, q1)
        lse_hi, correction = log2_lse(rows_of(lseh, q0, q1), c.dtype)
        # P_ij = 2^(s_ij - lse_hi_i) * correction_i: the row factor goes into dO's row and D_i,
        # which dV = P^T dO and dS = P * (dO V^T - D) take it from (rows, not scores).
        if correction is not None:
            doc.mul_(correction[..., None])
            delta = delta * correction
        dqc = torch.zeros_like(qc)
        for k0, k1 in c.key_chunks(q0, q1):
            kc, vc = kr[:, k0:k1], vr[:, k0:k1]
            s, tanh = c.scores(qc, kc, q0, q1, k0, k1, need_tanh=True)
            p = exp2_flushed(s.sub_(lse_hi[..., None]))
            dp = torch.bmm(doc, vc.transpose(1, 2))
            drop = c.dropout_factor(q0, q1, k0, k1)
            if drop is not None:
                dv[:, k0:k1].baddbmm_((c.chunk(p, q0, q1, k0, k1) * drop).view(p.shape).transpose(1, 2), doc)
                c.chunk(dp, q0, q1, k0, k1).mul_(drop)
            else:
                dv[:, k0:k1].baddbmm_(p.transpose(1, 2), doc)
            ds = dp.sub_(delta[..., None]).mul_(p)
            if tanh is not None:  # d(cap * tanh(s / cap)) / ds = 1 - tanh^2
                c.chunk(ds, q0, q1, k0, k1).mul_(1 - tanh * tanh)
            dqc.baddbmm_(ds, kc)
            dk[:, k0:k1].baddbmm_(ds.transpose(1, 2), qc)  # qc carries the scale and log2 e: see below
        dq[..., q0:q1, :] = dqc.mul_(params.softmax_scale).view(c.batch, c.nheads_k, c.group, q1 - q0, c.d)

    dk.mul_(LN2)  # the log2 e that qc carried into dk
    return (c.heads_last(dq, q.dtype, c.nheads), c.heads_last(dk, k.dtype, c.nheads_k),
            c.heads_last(dv, v.dtype, c.nheads_k))
