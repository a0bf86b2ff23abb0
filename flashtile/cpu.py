"""The CPU attention path: FlashAttention's tiled online softmax, written with torch matmuls.

This is what :func:`flashtile.flash_attn_func` runs on tensors that are not on a GPU.  It is
the same algorithm as the Triton kernels, one level up: instead of a (BLOCK_M x BLOCK_N)
tile in registers, a (block_m x block_n) chunk of scores lives in an ordinary tensor, and
the running row max ``m``, row sum ``l`` and un-normalised accumulator ``acc`` are updated
chunk by chunk.  No ``seqlen_q x seqlen_k`` tensor is ever allocated, forward or backward:
peak extra memory is O(batch * nheads * block_m * block_n), which
``benchmarks/bench_cpu_memory.py`` measures.

Layouts follow flash-attn: q ``(batch, seqlen_q, nheads, d)``, k/v ``(batch, seqlen_k,
nheads_k, d)``; LSE ``(batch, nheads, seqlen_q)`` float32, natural log.  Low-precision
inputs are computed in float32 chunk by chunk and the output cast back.
"""

from __future__ import annotations

import torch

from flashtile.dropout import keep_mask
from flashtile.masking import is_masked, key_range, visible

BLOCK_M = 256
BLOCK_N = 512


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # fp16/bf16 are computed in fp32 like the GPU kernels; float64 stays float64 (oracles).
    return torch.float64 if dtype == torch.float64 else torch.float32


def _heads_first(x: torch.Tensor, nheads_k: int) -> torch.Tensor:
    """(b, n, h, d) -> (b, h_k, group, n, d) as a view: GQA without copying K/V."""
    b, n, h, d = x.shape
    return x.permute(0, 2, 1, 3).reshape(b, nheads_k, h // nheads_k, n, d)


def _chunk_mask(q0, q1, k0, k1, seqlen_q, seqlen_k, left, right, device):
    i = torch.arange(q0, q1, device=device)[:, None]
    j = torch.arange(k0, k1, device=device)[None, :]
    return visible(i, j, seqlen_q, seqlen_k, left, right)


def _slopes(alibi_slopes, batch, nheads_k, group, dtype):
    """ALiBi slopes (nheads,) or (batch, nheads) -> broadcastable (b|1, hk, g, 1, 1)."""
    if alibi_slopes is None:
        return None
    s = alibi_slopes.to(dtype)
    if s.dim() == 1:
        s = s.unsqueeze(0)
    return s.reshape(s.shape[0], nheads_k, group, 1, 1)


def _score_mods(s, q0, q1, k0, k1, seqlen_q, seqlen_k, softcap, slopes):
    """Softcap then ALiBi on a chunk of scaled scores (SEMANTICS order). Returns (s, tanh or None)."""
    t = None
    if softcap > 0:
        t = torch.tanh(s / softcap)
        s = t * softcap
    if slopes is not None:
        i = torch.arange(q0, q1, device=s.device)[:, None]
        j = torch.arange(k0, k1, device=s.device)[None, :]
        s = s - slopes * (i + (seqlen_k - seqlen_q) - j).abs().to(s.dtype)
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


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    window_left: int = -1,
    window_right: int = -1,
    block_m: int = BLOCK_M,
    block_n: int = BLOCK_N,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    dropout: tuple | None = None,
    rng_rows: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tiled forward. Returns ``out`` (like q) and ``lse`` (batch, nheads, seqlen_q), float32
    (float64 for float64 inputs)."""
    batch, seqlen_q, nheads, d = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    group = nheads // nheads_k
    masked = is_masked(window_left, window_right)
    acc_dtype = _compute_dtype(q.dtype)

    slopes = _slopes(alibi_slopes, batch, nheads_k, group, acc_dtype)
    if dropout is not None:
        rng_rows = rng_rows or (nheads * seqlen_q, seqlen_q, 0, seqlen_k)
        head_rows = _rng_head_rows(batch, nheads_k, group, seqlen_q, rng_rows, q.device)
    qh = _heads_first(q, nheads_k)  # (b, hk, g, nq, d)
    kh = k.permute(0, 2, 1, 3).unsqueeze(2)  # (b, hk, 1, nk, d)
    vh = v.permute(0, 2, 1, 3).unsqueeze(2)

    out = torch.empty(batch, nheads_k, group, seqlen_q, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, nheads_k, group, seqlen_q, dtype=acc_dtype, device=q.device)

    for q0 in range(0, seqlen_q, block_m):
        q1 = min(q0 + block_m, seqlen_q)
        qc = qh[..., q0:q1, :].to(acc_dtype) * softmax_scale  # scale once per Q chunk, not per score
        m = torch.full(qc.shape[:-1], float("-inf"), dtype=acc_dtype, device=q.device)
        l = torch.zeros_like(m)
        acc = torch.zeros(qc.shape, dtype=acc_dtype, device=q.device)
        lo, hi = key_range(q0, q1, seqlen_q, seqlen_k, window_left, window_right)
        for k0 in range(lo - lo % block_n, hi, block_n):  # chunks aligned like the kernels' tiles
            k1 = min(k0 + block_n, hi)
            k0 = max(k0, lo)
            s = qc @ kh[..., k0:k1, :].to(acc_dtype).transpose(-1, -2)
            s, _ = _score_mods(s, q0, q1, k0, k1, seqlen_q, seqlen_k, softcap, slopes)
            if masked:
                s = s.masked_fill(~_chunk_mask(q0, q1, k0, k1, seqlen_q, seqlen_k, window_left, window_right, q.device), float("-inf"))
            m_new = torch.maximum(m, s.amax(dim=-1))
            # A row that has seen only masked keys keeps m = -inf; shift by 0 instead so that
            # exp(-inf - (-inf)) = NaN never appears and its p stays exactly 0.
            m_safe = torch.where(m_new == float("-inf"), 0.0, m_new)
            p = torch.exp(s - m_safe[..., None])
            alpha = torch.exp(m - m_safe)
            l = l * alpha + p.sum(dim=-1)  # the denominator counts dropped entries too
            if dropout is not None:
                p = p * _dropout_factor(dropout, head_rows, rng_rows, q0, q1, k0, k1, acc_dtype)
            acc = acc * alpha[..., None] + p @ vh[..., k0:k1, :].to(acc_dtype)
            m = m_new
        empty = l == 0
        # Deferred normalisation: one division per row at the end, not one per chunk.  A row
        # with no visible key gives 0 by selection: its acc may hold 0 * inf = NaN from a
        # masked key's V.
        out[..., q0:q1, :] = torch.where(empty[..., None], 0.0, acc / torch.where(empty, 1.0, l)[..., None]).to(q.dtype)
        lse[..., q0:q1] = torch.where(empty, float("-inf"), m + torch.log(l))
    return (
        out.reshape(batch, nheads, seqlen_q, d).permute(0, 2, 1, 3).contiguous(),
        lse.reshape(batch, nheads, seqlen_q),
    )


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
    block_m: int = BLOCK_M,
    block_n: int = BLOCK_N,
    dlse: torch.Tensor | None = None,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    dropout: tuple | None = None,
    rng_rows: tuple | None = None,
    deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tiled backward by recomputation: P is rebuilt chunk by chunk from Q, K and the LSE.

    Always deterministic (no atomics); ``deterministic`` is accepted like the GPU backend's."""
    batch, seqlen_q, nheads, d = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    group = nheads // nheads_k
    masked = is_masked(window_left, window_right)
    acc_dtype = _compute_dtype(q.dtype)

    slopes = _slopes(alibi_slopes, batch, nheads_k, group, acc_dtype)
    if dropout is not None:
        rng_rows = rng_rows or (nheads * seqlen_q, seqlen_q, 0, seqlen_k)
        head_rows = _rng_head_rows(batch, nheads_k, group, seqlen_q, rng_rows, q.device)
    qh = _heads_first(q, nheads_k)
    doh = _heads_first(dout, nheads_k)
    oh = _heads_first(out, nheads_k)
    kh = k.permute(0, 2, 1, 3).unsqueeze(2)
    vh = v.permute(0, 2, 1, 3).unsqueeze(2)
    lseh = lse.reshape(batch, nheads_k, group, seqlen_q)
    dlseh = None if dlse is None else dlse.reshape(batch, nheads_k, group, seqlen_q).to(acc_dtype)

    dq = torch.zeros(qh.shape, dtype=acc_dtype, device=q.device)
    # dK/dV are summed over the query heads of a GQA group: accumulate in (b, hk, 1, nk, d).
    dk = torch.zeros(batch, nheads_k, 1, seqlen_k, d, dtype=acc_dtype, device=q.device)
    dv = torch.zeros_like(dk)

    for q0 in range(0, seqlen_q, block_m):
        q1 = min(q0 + block_m, seqlen_q)
        # Scale q once, exactly as the forward did, so the recomputed P matches its rounding.
        qc = qh[..., q0:q1, :].to(acc_dtype) * softmax_scale
        doc = doh[..., q0:q1, :].to(acc_dtype)
        # D_i = rowsum(dO_i * O_i) = rowsum(P_i * dP_i): the softmax Jacobian's correction term.
        delta = (doc * oh[..., q0:q1, :].to(acc_dtype)).sum(dim=-1)
        if dlseh is not None:  # d lse_i / d s_ij = P_ij, so a gradient on the LSE shifts D_i
            delta = delta - dlseh[..., q0:q1]
        lse_c = lseh[..., q0:q1]
        # Rows with no visible key have lse = -inf; exp(s - (-inf)) would be inf, so shift
        # them by +inf instead, which makes their recomputed P exactly 0.
        lse_safe = torch.where(lse_c == float("-inf"), float("inf"), lse_c)
        lo, hi = key_range(q0, q1, seqlen_q, seqlen_k, window_left, window_right)
        for k0 in range(lo - lo % block_n, hi, block_n):
            k1 = min(k0 + block_n, hi)
            k0 = max(k0, lo)
            kc = kh[..., k0:k1, :].to(acc_dtype)
            vc = vh[..., k0:k1, :].to(acc_dtype)
            s = qc @ kc.transpose(-1, -2)
            s, tanh = _score_mods(s, q0, q1, k0, k1, seqlen_q, seqlen_k, softcap, slopes)
            if masked:
                s = s.masked_fill(~_chunk_mask(q0, q1, k0, k1, seqlen_q, seqlen_k, window_left, window_right, q.device), float("-inf"))
            p = torch.exp(s - lse_safe[..., None])
            drop = 1.0
            if dropout is not None:
                drop = _dropout_factor(dropout, head_rows, rng_rows, q0, q1, k0, k1, acc_dtype)
            dv[..., k0:k1, :] += ((p * drop).transpose(-1, -2) @ doc).sum(dim=2, keepdim=True)
            dp = doc @ vc.transpose(-1, -2)
            ds = p * (dp * drop - delta[..., None])
            if tanh is not None:  # d(cap * tanh(s / cap)) / ds = 1 - tanh^2
                ds = ds * (1 - tanh * tanh)
            dq[..., q0:q1, :] += (ds @ kc) * softmax_scale
            dk[..., k0:k1, :] += (ds.transpose(-1, -2) @ qc).sum(dim=2, keepdim=True)  # qc carries the scale

    def back(x, dtype, heads):
        b, hk, g, n, dd = x.shape
        return x.reshape(b, hk * g, n, dd).permute(0, 2, 1, 3).to(dtype).contiguous()

    return back(dq, q.dtype, nheads), back(dk, k.dtype, nheads_k), back(dv, v.dtype, nheads_k)


# ----------------------------------------------------------------------------------------
# Packed variable-length batches: the same tiled algorithm per sequence
# ----------------------------------------------------------------------------------------


def _sequences(cu_seqlens_q, cu_seqlens_k):
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        yield b, cq[b], cq[b + 1], ck[b], ck[b + 1]


def _sequence_slopes(alibi_slopes, b):
    return alibi_slopes if alibi_slopes is None or alibi_slopes.dim() == 1 else alibi_slopes[b]


def _varlen_rng_rows(q, cu_seqlens_k, q0, max_seqlen_k):
    # Packed LSE rows: head * total_q + token; columns: max_seqlen_k, as the kernels count them.
    if max_seqlen_k is None:
        lens = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
        max_seqlen_k = int(lens.max()) if lens.numel() else 0
    return (0, q.shape[0], q0, max_seqlen_k)


def varlen_attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, window_left=-1, window_right=-1,
                             softcap=0.0, alibi_slopes=None, dropout=None, max_seqlen_q=None, max_seqlen_k=None):
    """Packed ``(total, nheads, d)`` forward; LSE ``(nheads, total_q)``."""
    out = torch.zeros_like(q, memory_format=torch.contiguous_format)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=_compute_dtype(q.dtype), device=q.device)
    for b, q0, q1, k0, k1 in _sequences(cu_seqlens_q, cu_seqlens_k):
        if q1 == q0:
            continue
        o, l = attention_forward(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], softmax_scale, window_left,
                                 window_right, softcap=softcap, alibi_slopes=_sequence_slopes(alibi_slopes, b),
                                 dropout=dropout, rng_rows=_varlen_rng_rows(q, cu_seqlens_k, q0, max_seqlen_k))
        out[q0:q1] = o[0]
        lse[:, q0:q1] = l[0]
    return out, lse


def varlen_attention_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, softmax_scale, window_left=-1,
                              window_right=-1, softcap=0.0, alibi_slopes=None, dlse=None, dropout=None,
                              max_seqlen_q=None, max_seqlen_k=None, deterministic=False):
    dq = torch.zeros_like(q, memory_format=torch.contiguous_format)
    dk = torch.zeros_like(k, memory_format=torch.contiguous_format)
    dv = torch.zeros_like(v, memory_format=torch.contiguous_format)
    for b, q0, q1, k0, k1 in _sequences(cu_seqlens_q, cu_seqlens_k):
        if q1 == q0 or k1 == k0:
            continue
        g = attention_backward(
            dout[None, q0:q1], q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], out[None, q0:q1],
            lse[None, :, q0:q1], softmax_scale, window_left, window_right,
            dlse=None if dlse is None else dlse[None, :, q0:q1],
            softcap=softcap, alibi_slopes=_sequence_slopes(alibi_slopes, b),
            dropout=dropout, rng_rows=_varlen_rng_rows(q, cu_seqlens_k, q0, max_seqlen_k),
        )
        dq[q0:q1], dk[k0:k1], dv[k0:k1] = g[0][0], g[1][0], g[2][0]
    return dq, dk, dv
