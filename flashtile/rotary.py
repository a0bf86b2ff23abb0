"""``apply_rotary_emb``: rotary position embedding (RoPE), with autograd.

Semantics are flash-attn's (``flash_attn.layers.rotary.apply_rotary_emb``): the first
``rotary_dim = 2 * cos.shape[1]`` features of every head are rotated pair by pair, by the
angle of the token's position; the other features pass through unchanged.  CUDA tensors run
the Triton kernel (:mod:`flashtile.kernels.rotary`), CPU tensors the PyTorch function
below; both compute in float32 and round once.
"""

from __future__ import annotations

import torch

from flashtile.devices import on_input_device
from flashtile.validation.rotary import check_rotary_arguments


def rotate_torch(x, cos, sin, out, *, interleaved, conjugate, seqlen_offsets, cu_seqlens, max_seqlen):
    """The PyTorch path: same contract as :func:`flashtile.kernels.rotary.rotate`."""
    half = cos.shape[1]
    rotary_dim = 2 * half
    if out is not x and rotary_dim < x.shape[-1]:
        out[..., rotary_dim:] = x[..., rotary_dim:]
    positions = _positions(x, seqlen_offsets, cu_seqlens)  # x's leading (token) axes
    cos_at = cos.float()[positions].unsqueeze(-2)  # (..., 1, half): one angle for every head
    sin_at = sin.float()[positions].unsqueeze(-2)
    if conjugate:
        sin_at = -sin_at
    features = x[..., :rotary_dim].float()
    if interleaved:
        x1, x2 = features[..., 0::2], features[..., 1::2]
    else:
        x1, x2 = features[..., :half], features[..., half:]
    out1 = x1 * cos_at - x2 * sin_at
    out2 = x1 * sin_at + x2 * cos_at
    if interleaved:
        rotated = torch.stack((out1, out2), dim=-1).flatten(-2)
    else:
        rotated = torch.cat((out1, out2), dim=-1)
    out[..., :rotary_dim] = rotated
    return out


def _positions(x, seqlen_offsets, cu_seqlens):
    """The position of every token: ``(batch, seqlen)``, or ``(total,)`` for packed ``x``."""
    device = x.device
    if cu_seqlens is None:
        batch, seqlen = x.shape[:2]
        positions = torch.arange(seqlen, device=device).expand(batch, seqlen)
        if isinstance(seqlen_offsets, torch.Tensor):
            return positions + seqlen_offsets.long()[:, None]
        return positions + seqlen_offsets
    starts = cu_seqlens.long()
    lengths = starts[1:] - starts[:-1]
    sequence = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths)
    positions = torch.arange(x.shape[0], device=device) - starts[sequence]
    if isinstance(seqlen_offsets, torch.Tensor):
        return positions + seqlen_offsets.long()[sequence]
    return positions + seqlen_offsets


def _backend(x):
    if x.is_cuda:
        from flashtile.kernels.rotary import rotate

        return rotate
    return rotate_torch


def _rotary(x, cos, sin, inplace, conjugate, args):
    out = x if inplace else torch.empty_like(x)
    return _backend(x)(x, cos, sin, out, conjugate=conjugate, **args)


class _ApplyRotaryEmb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, interleaved, inplace, seqlen_offsets, cu_seqlens, max_seqlen):
        args = dict(interleaved=interleaved, seqlen_offsets=seqlen_offsets, cu_seqlens=cu_seqlens,
                     max_seqlen=max_seqlen)
        out = _rotary(x, cos, sin, inplace, False, args)
        offsets_tensor = seqlen_offsets if isinstance(seqlen_offsets, torch.Tensor) else None
        ctx.save_for_backward(cos, sin, cu_seqlens, offsets_tensor)
        ctx.int_offset = None if offsets_tensor is not None else seqlen_offsets
        ctx.interleaved, ctx.max_seqlen = interleaved, max_seqlen
        if inplace:
            ctx.mark_dirty(x)
        return out

    @staticmethod
    def backward(ctx, dout):
        cos, sin, cu_seqlens, offsets_tensor = ctx.saved_tensors
        args = dict(interleaved=ctx.interleaved, cu_seqlens=cu_seqlens, max_seqlen=ctx.max_seqlen,
                    seqlen_offsets=offsets_tensor if offsets_tensor is not None else ctx.int_offset)
        dx = _rotary(dout, cos, sin, False, True, args)
        return dx, None, None, None, None, None, None, None


@on_input_device
def apply_rotary_emb(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool = False,
    inplace: bool = False,
    seqlen_offsets: int | torch.Tensor = 0,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
) -> torch.Tensor:
    """Rotary position embedding of the first ``rotary_dim = 2 * cos.shape[1]`` features.

    Args:
        x: ``(batch, seqlen, nheads, headdim)``, or ``(total, nheads, headdim)`` (the sequences
            concatenated) with ``cu_seqlens``; float16 / bfloat16 / float32, any strides.
        cos, sin: ``(seqlen_ro, rotary_dim / 2)``: the cosine and sine of the angle of pair
            ``k`` at position ``p`` are ``cos[p, k]``, ``sin[p, k]``.  Same dtype as each other,
            ``x``'s dtype or float32; ``rotary_dim <= headdim``.  They get no gradient.
        interleaved: pairs are features ``(2k, 2k + 1)`` (GPT-J) instead of
            ``(k, k + rotary_dim / 2)`` (GPT-NeoX, the default).
        inplace: write the result into ``x`` and return ``x``.
        seqlen_offsets: position of each sequence's first token: an int, or an int32 / int64
            ``(batch,)`` tensor (a KV cache's lengths).  Token ``t`` of sequence ``b`` is at
            position ``t + seqlen_offsets[b]``.
        cu_seqlens: int32 ``(batch + 1,)`` prefix sums for packed ``x``; ``max_seqlen`` (an
            int, at least the longest sequence) is then required.

    Returns:
        ``x`` rotated: pair ``(x1, x2)`` becomes ``(x1 cos - x2 sin, x1 sin + x2 cos)``,
        computed in float32; features past ``rotary_dim`` unchanged.  Differentiable in ``x``:
        the gradient is ``dout`` rotated by the opposite angles.

    Every position must lie in ``[0, seqlen_ro)``.  That is checked for int offsets and for
    CPU tensors; a CUDA offset tensor is not read on the host (no synchronisation), and the
    kernel leaves a token whose position is past the table unrotated.
    """
    interleaved, inplace = check_rotary_arguments(x, cos, sin, interleaved, inplace, seqlen_offsets, cu_seqlens,
                                                  max_seqlen)
    return _ApplyRotaryEmb.apply(x, cos, sin, interleaved, inplace, seqlen_offsets, cu_seqlens, max_seqlen)

