"""``apply_rotary_emb``: rotary position embedding (RoPE), with autograd.

Semantics are flash-attn's (``flash_attn.layers.rotary.apply_rotary_emb``): the first
``rotary_dim = 2 * cos.shape[1]`` features of every head are rotated pair by pair, by the
angle of the token's position; the other features pass through unchanged.  CUDA tensors run
the Triton kernel (:mod:`flashtile.kernels.rotary`), CPU tensors the PyTorch function
below; both compute in float32 and round once.
"""

from __future__ import annotations

import torch

from flashtile.ops.validation import SUPPORTED_DTYPES, check_cu_seqlens

_DTYPE_NAMES = "torch.float16, torch.bfloat16 or torch.float32"


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
    check_rotary_arguments(x, cos, sin, interleaved, inplace, seqlen_offsets, cu_seqlens, max_seqlen)
    return _ApplyRotaryEmb.apply(x, cos, sin, interleaved, inplace, seqlen_offsets, cu_seqlens, max_seqlen)


def check_rotary_arguments(x, cos, sin, interleaved, inplace, seqlen_offsets, cu_seqlens, max_seqlen):
    """``apply_rotary_emb``'s checks, for callers that rotate inside another kernel (the
    KV-cache append): a bad argument raises before anything is computed or written."""
    varlen = cu_seqlens is not None
    layout = "(total, nheads, headdim) with cu_seqlens" if varlen else "(batch, seqlen, nheads, headdim)"
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor of shape {layout}, got {type(x).__name__}")
    if x.dim() != (3 if varlen else 4):
        raise ValueError(f"x must have shape {layout}, got {tuple(x.shape)}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"x must have dtype {_DTYPE_NAMES}, got {x.dtype}")
    if x.device.type not in ("cpu", "cuda"):
        raise ValueError(f"x must be on a cpu or cuda device, got {x.device}")
    for name, flag in (("interleaved", interleaved), ("inplace", inplace)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")

    for name, table in (("cos", cos), ("sin", sin)):
        if not isinstance(table, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of shape (seqlen_ro, rotary_dim / 2), got "
                            f"{type(table).__name__}")
        if table.dim() != 2 or table.shape[1] == 0:
            raise ValueError(f"{name} must have shape (seqlen_ro, rotary_dim / 2) with rotary_dim / 2 >= 1, "
                             f"got {tuple(table.shape)}")
        if table.device != x.device:
            raise ValueError(f"{name} must be on x's device ({x.device}), got {table.device}")
    if sin.shape != cos.shape:
        raise ValueError(f"sin must have cos's shape {tuple(cos.shape)}, got {tuple(sin.shape)}")
    if sin.dtype != cos.dtype:
        raise ValueError(f"cos and sin must share one dtype, got cos {cos.dtype} and sin {sin.dtype}")
    if cos.dtype not in (x.dtype, torch.float32):
        raise ValueError(f"cos and sin must have x's dtype ({x.dtype}) or torch.float32, got {cos.dtype}")
    seqlen_ro, half = cos.shape
    headdim = x.shape[-1]
    if 2 * half > headdim:
        raise ValueError(f"rotary_dim = 2 * cos.shape[1] = {2 * half} exceeds x's head dimension ({headdim})")

    if varlen:
        batch = check_cu_seqlens("cu_seqlens", cu_seqlens, x.shape[0], x.device, max_seqlen, "max_seqlen")
        seqlen = max_seqlen
    else:
        batch, seqlen = x.shape[0], x.shape[1]
    if seqlen > seqlen_ro:
        what = "max_seqlen" if varlen else "seqlen (x.shape[1])"
        raise ValueError(f"cos and sin hold {seqlen_ro} positions, fewer than {what} = {seqlen}")

    if isinstance(seqlen_offsets, torch.Tensor):
        if seqlen_offsets.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"seqlen_offsets must be an int32 or int64 tensor, got {seqlen_offsets.dtype}")
        if tuple(seqlen_offsets.shape) != (batch,):
            raise ValueError(f"seqlen_offsets must have shape (batch,) = ({batch},), got {tuple(seqlen_offsets.shape)}")
        if seqlen_offsets.device != x.device:
            raise ValueError(f"seqlen_offsets must be on x's device ({x.device}), got {seqlen_offsets.device}")
        if not x.is_cuda and batch > 0:
            lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long() if varlen else torch.full((batch,), seqlen)
            last = seqlen_offsets.long() + lengths
            if bool((seqlen_offsets < 0).any()) or int(last.max()) > seqlen_ro:
                raise ValueError(f"seqlen_offsets + sequence lengths must be in [0, {seqlen_ro}] (the positions cos "
                                 f"and sin hold), got offsets {seqlen_offsets.tolist()} and ends {last.tolist()}")
    else:
        if isinstance(seqlen_offsets, bool) or not isinstance(seqlen_offsets, int):
            raise TypeError(f"seqlen_offsets must be an int or a (batch,) int tensor, got {type(seqlen_offsets).__name__}")
        if seqlen_offsets < 0 or seqlen_offsets + seqlen > seqlen_ro:
            raise ValueError(f"seqlen_offsets ({seqlen_offsets}) + seqlen ({seqlen}) must be within the {seqlen_ro} "
                             f"positions cos and sin hold (and the offset >= 0)")

    if inplace and x.requires_grad and x.is_leaf and torch.is_grad_enabled():
        raise ValueError("inplace=True cannot write into x, a leaf tensor that requires grad; "
                         "pass a non-leaf tensor or inplace=False")
