"""``flashtile.softmax`` / ``flashtile.log_softmax``: layout, autograd, the CPU path.

The softmax dim is moved last *as a view*; rows are then described to the kernels by up to
three leading indices with their strides (``collapse_rows``), so transposed, sliced and
broadcast inputs and masks are read in place.  Only when a layout needs more than three
leading indices is a contiguous copy made.  CUDA tensors run the Triton kernels (and so do
CPU tensors under ``TRITON_INTERPRET=1``, the interpreter); otherwise plain PyTorch runs.
float64 is a CPU-path dtype: computed in float64 by plain PyTorch (also under the
interpreter), rejected on CUDA tensors.
"""

from __future__ import annotations

import os

import torch

from flashtile import validation
from flashtile.devices import on_input_device


def _use_triton(x: torch.Tensor) -> bool:
    if x.dtype == torch.float64:  # the kernels compute in float32; float64 is the CPU path's
        return False
    return x.is_cuda or os.environ.get("TRITON_INTERPRET", "0") == "1"


def _torch_softmax(x, dim, scale, mask, log):
    """The CPU path: the same function by ``torch.softmax`` / ``torch.log_softmax`` in float32
    (float64 for float64 x), with empty rows set to 0 / -inf, where torch gives NaN."""
    if x.shape[dim] == 0:
        return x.clone()  # empty, and still in x's autograd graph as torch.softmax's result is
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    t = x.to(compute)
    if scale != 1.0:
        t = t * scale
    if mask is not None:
        # The mask receives no gradient, as on the Triton path (README, softmax).
        t = t.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else t + mask.detach().to(compute)
    # A row with nothing kept (all -inf) has max -inf; a row holding a NaN has max NaN and
    # stays NaN, as in torch.softmax.  Empty rows go through torch's softmax as zeros, whose
    # result and gradient are finite, and are then set to 0 / -inf (their gradient is 0).
    empty = t.detach().amax(dim=dim, keepdim=True) == float("-inf")
    if not bool(empty.any()):
        y = torch.log_softmax(t, dim) if log else torch.softmax(t, dim)
        return y.to(x.dtype)
    t = t.masked_fill(empty, 0.0)
    y = torch.log_softmax(t, dim) if log else torch.softmax(t, dim)
    return y.masked_fill(empty, float("-inf") if log else 0.0).to(x.dtype)


def _rows(x, dim, mask):
    """(x view with dim last, mask view, lead shape, x strides, mask strides), copying only if needed."""
    from flashtile.kernels.softmax import collapse_rows

    xm = x.movedim(dim, -1)
    mm = None if mask is None else mask.expand(x.shape).movedim(dim, -1)
    ref = mm if mm is not None else xm
    layout = collapse_rows(tuple(xm.shape), tuple(xm.stride()), tuple(ref.stride()))
    if layout is None:  # more than three non-mergeable leading dims: copy once
        xm = xm.contiguous()
        mm = None if mm is None else mm.contiguous()
        ref = mm if mm is not None else xm
        layout = collapse_rows(tuple(xm.shape), tuple(xm.stride()), tuple(ref.stride()))
    lead, (sx, sm) = layout
    return xm, mm, lead, sx + (xm.stride(-1),), sm + (ref.stride(-1),)


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, scale, mask, log):
        from flashtile.kernels import softmax as k

        xm, mm, lead, sx, sm = _rows(x, dim, mask)
        n_cols = xm.shape[-1]
        y2 = k.softmax_forward(xm, mm, lead, sx, sm, n_cols, scale, log, x.dtype)
        ctx.save_for_backward(y2, mm if (mm is not None and mm.dtype == torch.bool) else None)
        ctx.meta = (dim, scale, log, lead, sm, tuple(xm.shape))
        return y2.view(xm.shape).movedim(-1, dim)

    @staticmethod
    def backward(ctx, gy):
        from flashtile.kernels import softmax as k

        y2, mm = ctx.saved_tensors
        dim, scale, log, lead, sm, moved_shape = ctx.meta
        g2 = gy.movedim(dim, -1).contiguous().view(y2.shape)
        dx2 = k.softmax_backward(y2, g2, mm, lead, sm, scale, log, gy.dtype)
        return dx2.view(moved_shape).movedim(-1, dim), None, None, None, None


def _apply(x, dim, scale, mask, log):
    dim, scale = validation.check_softmax_args(x, dim, scale, mask)
    if not _use_triton(x):
        return _torch_softmax(x, dim, scale, mask, log)
    return _Softmax.apply(x, dim, scale, mask, log)


@on_input_device
def softmax(x: torch.Tensor, dim: int = -1, *, scale: float | None = None, mask: torch.Tensor | None = None):
    """``softmax(x * scale + mask)`` along ``dim``, computed in float32, returned in x's dtype.

    ``mask``: boolean (True = keep; False entries become -inf) or floating (added after the
    scale), broadcastable to ``x``; it is applied on the fly and receives no gradient.
    A row with nothing kept (or all ``-inf``) gives zeros, not NaN; NaN / ``+inf`` inputs
    propagate as in ``torch.softmax``.
    """
    return _apply(x, dim, scale, mask, log=False)


@on_input_device
def log_softmax(x: torch.Tensor, dim: int = -1, *, scale: float | None = None, mask: torch.Tensor | None = None):
    """``log_softmax(x * scale + mask)`` along ``dim``; an empty row gives ``-inf``."""
    return _apply(x, dim, scale, mask, log=True)
