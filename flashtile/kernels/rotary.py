"""Rotary position embedding (RoPE) as one Triton kernel.

Feature pair ``k`` of a token at position ``p`` is a point ``(x1, x2)`` in the plane, turned
by the angle whose cosine and sine are ``cos[p, k]`` and ``sin[p, k]``::

    out1 = x1 * cos - x2 * sin
    out2 = x1 * sin + x2 * cos

The two layouts only differ in which features form pair ``k``: features ``k`` and
``k + rotary_dim / 2`` (non-interleaved, GPT-NeoX) or ``2k`` and ``2k + 1`` (interleaved,
GPT-J).  The backward pass is the same rotation by the opposite angle (``-sin``,
``CONJUGATE``), since a rotation's transpose is its inverse.

One program rotates a tile of ``BLOCK_M`` tokens x ``BLOCK_H`` heads x ``BLOCK_K`` pairs of
one sequence: the ``(BLOCK_M, BLOCK_K)`` cos / sin tile is loaded once and serves every head.
Each program reads exactly the elements it writes, so ``out`` may be ``x`` (in place).
Out of place, the features past ``rotary_dim`` are copied through by the same program.
"""

import torch
import triton
import triton.language as tl

from flashtile.kernels.runtime import cdiv, next_power_of_2

BLOCK_M = 4
# Elements of one (heads x pairs) slice of a tile; BLOCK_H is chosen to fill it.
HEAD_TILE_ELEMENTS = 512


@triton.jit
def _rotary_kernel(
    X, OUT, COS, SIN, CU_SEQLENS, SEQLEN_OFFSETS,
    seqlen, nheads, seqlen_ro, half_rotary, headdim,
    stride_xb, stride_xs, stride_xh, stride_xd,
    stride_ob, stride_os, stride_oh, stride_od,
    stride_cos_p, stride_cos_k, stride_sin_p, stride_sin_k,
    INTERLEAVED: tl.constexpr, CONJUGATE: tl.constexpr, IS_VARLEN: tl.constexpr,
    OFFSETS_IN_TENSOR: tl.constexpr, COPY_REST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_REST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_h = tl.program_id(1)
    batch = tl.program_id(2)

    # Where this sequence's tokens are: a batch slice, or rows first_token... of a packed tensor.
    if IS_VARLEN:
        first_token = tl.load(CU_SEQLENS + batch)
        seqlen = tl.load(CU_SEQLENS + batch + 1) - first_token
    else:
        first_token = 0
        X += batch.to(tl.int64) * stride_xb
        OUT += batch.to(tl.int64) * stride_ob
    if pid_m * BLOCK_M >= seqlen:
        return
    if OFFSETS_IN_TENSOR:
        offset = tl.load(SEQLEN_OFFSETS + batch)
    else:
        offset = SEQLEN_OFFSETS

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    heads = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    pairs = tl.arange(0, BLOCK_K)
    row_ok = rows < seqlen
    pair_ok = pairs < half_rotary

    # cos / sin of each token's position; a position outside the table is left unrotated.
    positions = rows + offset
    angle_ok = (row_ok & (positions >= 0) & (positions < seqlen_ro))[:, None] & pair_ok[None, :]
    cos = tl.load(COS + positions[:, None] * stride_cos_p + pairs[None, :] * stride_cos_k,
                  mask=angle_ok, other=1.0).to(tl.float32)
    sin = tl.load(SIN + positions[:, None] * stride_sin_p + pairs[None, :] * stride_sin_k,
                  mask=angle_ok, other=0.0).to(tl.float32)
    if CONJUGATE:
        sin = -sin
    cos = cos[:, None, :]
    sin = sin[:, None, :]
    # An unrotated token keeps its features as they are (x * 1 - partner * 0 is NaN for an
    # inf partner).
    turned = angle_ok[:, None, :]

    tokens = (first_token + rows).to(tl.int64)
    token_head_ok = row_ok[:, None, None] & (heads < nheads)[None, :, None]
    x_tile = X + tokens[:, None, None] * stride_xs + heads[None, :, None] * stride_xh
    out_tile = OUT + tokens[:, None, None] * stride_os + heads[None, :, None] * stride_oh

    if INTERLEAVED:
        # Pair k is features (2k, 2k + 1): load the rotary features as one contiguous run and
        # split it into (even, odd) through a (..., BLOCK_K, 2) view.
        features = tl.arange(0, 2 * BLOCK_K)
        mask = token_head_ok & (features < 2 * half_rotary)[None, None, :]
        x = tl.load(x_tile + features[None, None, :] * stride_xd, mask=mask, other=0.0).to(tl.float32)
        x1, x2 = tl.split(tl.reshape(x, [BLOCK_M, BLOCK_H, BLOCK_K, 2]))
        out1 = tl.where(turned, x1 * cos - x2 * sin, x1)
        out2 = tl.where(turned, x1 * sin + x2 * cos, x2)
        out = tl.reshape(tl.join(out1, out2), [BLOCK_M, BLOCK_H, 2 * BLOCK_K])
        tl.store(out_tile + features[None, None, :] * stride_od, out.to(OUT.dtype.element_ty), mask=mask)
    else:
        # Pair k is features (k, k + rotary_dim / 2): the two halves, each contiguous.
        mask = token_head_ok & pair_ok[None, None, :]
        first = pairs[None, None, :]
        second = first + half_rotary
        x1 = tl.load(x_tile + first * stride_xd, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_tile + second * stride_xd, mask=mask, other=0.0).to(tl.float32)
        out1 = tl.where(turned, x1 * cos - x2 * sin, x1)
        out2 = tl.where(turned, x1 * sin + x2 * cos, x2)
        tl.store(out_tile + first * stride_od, out1.to(OUT.dtype.element_ty), mask=mask)
        tl.store(out_tile + second * stride_od, out2.to(OUT.dtype.element_ty), mask=mask)

    if COPY_REST:
        rest = 2 * half_rotary + tl.arange(0, BLOCK_REST)
        mask = token_head_ok & (rest < headdim)[None, None, :]
        rest = rest[None, None, :]
        tl.store(out_tile + rest * stride_od, tl.load(x_tile + rest * stride_xd, mask=mask), mask=mask)


def rotate(x, cos, sin, out, *, interleaved, conjugate, seqlen_offsets, cu_seqlens, max_seqlen):
    """Write ``x`` with its first ``rotary_dim = 2 * cos.shape[1]`` features rotated into ``out``.

    ``x`` and ``out`` are ``(batch, seqlen, nheads, headdim)``, or packed ``(total, nheads,
    headdim)`` with int32 ``cu_seqlens`` and ``max_seqlen``, any strides; ``out`` may be ``x``.
    ``seqlen_offsets`` is an int or an int ``(batch,)`` tensor.  Arguments are checked by
    :func:`flashtile.rotary.apply_rotary_emb`.
    """
    varlen = cu_seqlens is not None
    if varlen:
        batch, seqlen = cu_seqlens.shape[0] - 1, max_seqlen
        nheads = x.shape[1]
        stride_xb = stride_ob = 0
        cu_seqlens = cu_seqlens.contiguous()
    else:
        batch, seqlen, nheads = x.shape[:3]
        stride_xb, stride_ob = x.stride(0), out.stride(0)
    half_rotary = cos.shape[1]
    offsets_in_tensor = isinstance(seqlen_offsets, torch.Tensor)
    if offsets_in_tensor:
        seqlen_offsets = seqlen_offsets.contiguous()
    if batch == 0 or seqlen == 0 or nheads == 0 or x.numel() == 0:
        return out

    headdim = x.shape[-1]
    copy_rest = out is not x and 2 * half_rotary < headdim
    block_k = next_power_of_2(half_rotary)
    block_h = min(next_power_of_2(nheads), max(1, HEAD_TILE_ELEMENTS // block_k))
    grid = (cdiv(seqlen, BLOCK_M), cdiv(nheads, block_h), batch)
    _rotary_kernel[grid](
        x, out, cos, sin, cu_seqlens, seqlen_offsets,
        seqlen, nheads, cos.shape[0], half_rotary, headdim,
        stride_xb, x.stride(-3), x.stride(-2), x.stride(-1),
        stride_ob, out.stride(-3), out.stride(-2), out.stride(-1),
        cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
        INTERLEAVED=interleaved, CONJUGATE=conjugate, IS_VARLEN=varlen,
        OFFSETS_IN_TENSOR=offsets_in_tensor, COPY_REST=copy_rest,
        BLOCK_M=BLOCK_M, BLOCK_H=block_h, BLOCK_K=block_k,
        BLOCK_REST=next_power_of_2(headdim - 2 * half_rotary) if copy_rest else 1,
        num_warps=4,
    )
    return out
