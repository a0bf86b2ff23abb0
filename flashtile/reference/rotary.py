"""Exact float64 NumPy rotary position embedding (RoPE): the test oracle.

Written with complex numbers rather than with the ``x1 cos - x2 sin`` formula of the
kernels, so the two share no code: feature pair ``k`` of a token at position ``p`` is the
complex number ``x1 + i x2``, and the embedding multiplies it by ``exp(i theta)`` given as
``cos[p, k] + i sin[p, k]``.  ``conjugate=True`` multiplies by the conjugate, which is the
backward pass (a rotation's adjoint is its inverse).

Layouts (flash-attn's): ``x (batch, seqlen, nheads, headdim)``, or packed ``(total, nheads,
headdim)`` with ``cu_seqlens``; ``cos``, ``sin`` ``(seqlen_ro, rotary_dim / 2)``.  Pair ``k``
is features ``(k, k + rotary_dim / 2)`` (non-interleaved) or ``(2k, 2k + 1)`` (interleaved);
features past ``rotary_dim`` are returned unchanged.  Token ``t`` of sequence ``b`` is at
position ``t + seqlen_offsets[b]``.  Inputs are converted to float64 (pass CPU tensors as
``.double()``); the result is a float64 array.
"""

from __future__ import annotations

import numpy as np

__all__ = ["apply_rotary_naive"]


def apply_rotary_naive(x, cos, sin, interleaved=False, seqlen_offsets=0, cu_seqlens=None, conjugate=False):
    x = np.asarray(x, dtype=np.float64).copy()
    cos = np.asarray(cos, dtype=np.float64)
    sin = np.asarray(sin, dtype=np.float64)
    if cos.ndim != 2 or cos.shape != sin.shape:
        raise ValueError(f"cos and sin must both be (seqlen_ro, rotary_dim / 2), got {cos.shape} and {sin.shape}")
    turn = cos + 1j * sin
    if conjugate:
        turn = np.conj(turn)
    half = cos.shape[1]
    rotary_dim = 2 * half
    if rotary_dim > x.shape[-1]:
        raise ValueError(f"rotary_dim ({rotary_dim}) exceeds headdim ({x.shape[-1]})")

    if cu_seqlens is None:
        sequences = [x[b] for b in range(x.shape[0])]  # views, (seqlen, nheads, headdim)
    else:
        bounds = np.asarray(cu_seqlens, dtype=np.int64)
        sequences = [x[bounds[b]:bounds[b + 1]] for b in range(len(bounds) - 1)]
    offsets = np.broadcast_to(np.asarray(seqlen_offsets, dtype=np.int64), (len(sequences),))

    for seq, offset in zip(sequences, offsets):
        positions = offset + np.arange(seq.shape[0])
        if positions.size and (positions.min() < 0 or positions.max() >= cos.shape[0]):
            raise ValueError(f"positions {positions.min()}..{positions.max()} fall outside the table of {cos.shape[0]}")
        if interleaved:
            first, second = slice(0, rotary_dim, 2), slice(1, rotary_dim, 2)
        else:
            first, second = slice(0, half), slice(half, rotary_dim)
        pairs = seq[..., first] + 1j * seq[..., second]  # (seqlen, nheads, half)
        pairs = pairs * turn[positions][:, None, :]
        seq[..., first] = pairs.real
        seq[..., second] = pairs.imag
    return x
