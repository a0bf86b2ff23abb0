"""Packed variable-length batches on the CPU: the same attention per sequence
(:mod:`flashtile.cpu.attention`), paged keys and values gathered into packed rows first."""

from __future__ import annotations

import torch

from flashtile.cpu.attention import bwd, fwd
from flashtile.cpu.numerics import compute_dtype
from flashtile.semantics.params import AttentionParams


def _sequences(cu_seqlens_q, cu_seqlens_k):
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        yield b, cq[b], cq[b + 1], ck[b], ck[b + 1]


def _sequence_params(params: AttentionParams, b: int) -> AttentionParams:
    """Sequence ``b``'s params: its row of ``(batch, nheads)`` ALiBi slopes; the rest shared."""
    slopes = params.alibi_slopes
    return params if slopes is None or slopes.dim() == 1 else params.with_alibi(slopes[b])


def _varlen_rng_rows(q, cu_seqlens_k, q0, max_seqlen_k):
    # Packed LSE rows: head * total_q + token; columns: max_seqlen_k, as the kernels count them.
    if max_seqlen_k is None:
        lens = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
        max_seqlen_k = int(lens.max()) if lens.numel() else 0
    return (0, q.shape[0], q0, max_seqlen_k)


def varlen_attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, window_left=-1, window_right=-1,
                             softcap=0.0, alibi_slopes=None, dropout=None, max_seqlen_q=None, max_seqlen_k=None,
                             block_table=None):
    """:func:`varlen_fwd` with the params as arguments; ``dropout``: ``(p, seed, offset)`` or None."""
    params = AttentionParams.from_launcher(softmax_scale, window_left, window_right, softcap, alibi_slopes, dropout)
    return varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, params, max_seqlen_q=max_seqlen_q,
                      max_seqlen_k=max_seqlen_k, block_table=block_table)


def varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, params: AttentionParams, *, max_seqlen_q=None, max_seqlen_k=None,
               block_table=None):
    """Packed ``(total, nheads, d)`` forward; LSE ``(nheads, total_q)``.  With ``block_table``,
    k / v are ``(num_blocks, page_size, nheads_k, d)`` pages, gathered into packed rows first."""
    if block_table is not None:
        k, v = _gather_pages(k, block_table, cu_seqlens_k), _gather_pages(v, block_table, cu_seqlens_k)
    out = torch.zeros_like(q, memory_format=torch.contiguous_format)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=compute_dtype(q.dtype), device=q.device)
    for b, q0, q1, k0, k1 in _sequences(cu_seqlens_q, cu_seqlens_k):
        if q1 == q0:
            continue
        o, l = fwd(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], _sequence_params(params, b),
                   rng_rows=_varlen_rng_rows(q, cu_seqlens_k, q0, max_seqlen_k))
        out[q0:q1] = o[0]
        lse[:, q0:q1] = l[0]
    return out, lse


def _gather_pages(cache, block_table, cu_seqlens_k):
    """Paged ``(num_blocks, page_size, h, d)`` keys -> packed ``(total_k, h, d)`` rows in
    cu_seqlens_k's order (sequence b's key j: page ``block_table[b, j // page_size]``)."""
    page_size = cache.shape[1]
    lens = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).tolist()
    rows = [block_table[b, torch.arange(n) // page_size].long() * page_size + torch.arange(n) % page_size
            for b, n in enumerate(lens)]
    flat = cache.reshape(-1, *cache.shape[2:])
    return flat[torch.cat(rows)] if rows else flat[:0]


def varlen_attention_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, softmax_scale, window_left=-1,
                              window_right=-1, softcap=0.0, alibi_slopes=None, dlse=None, dropout=None,
                              max_seqlen_q=None, max_seqlen_k=None, deterministic=False):
    """:func:`varlen_bwd` with the params as arguments; ``dropout``: ``(p, seed, offset)`` or None."""
    params = AttentionParams.from_launcher(softmax_scale, window_left, window_right, softcap, alibi_slopes, dropout,
                                           deterministic)
    return varlen_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, params, dlse=dlse,
                      max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)


def varlen_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, params: AttentionParams, *, dlse=None,
               max_seqlen_q=None, max_seqlen_k=None):
    """Packed backward: each sequence through :func:`bwd` on its own rows."""
    dq = torch.zeros_like(q, memory_format=torch.contiguous_format)
    dk = torch.zeros_like(k, memory_format=torch.contiguous_format)
    dv = torch.zeros_like(v, memory_format=torch.contiguous_format)
    for b, q0, q1, k0, k1 in _sequences(cu_seqlens_q, cu_seqlens_k):
        if q1 == q0 or k1 == k0:
            continue
        g = bwd(
            dout[None, q0:q1], q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], out[None, q0:q1],
            lse[None, :, q0:q1], _sequence_params(params, b), dlse=None if dlse is None else dlse[None, :, q0:q1],
            rng_rows=_varlen_rng_rows(q, cu_seqlens_k, q0, max_seqlen_k),
        )
        dq[q0:q1], dk[k0:k1], dv[k0:k1] = g[0][0], g[1][0], g[2][0]
    return dq, dk, dv
