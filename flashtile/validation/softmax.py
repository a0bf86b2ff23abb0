"""``flashtile.softmax`` / ``flashtile.log_softmax``'s arguments."""

from __future__ import annotations

import torch

from flashtile.validation.common import check_dtype, check_scalar


def check_softmax_args(x, dim, scale, mask) -> tuple[int, float]:
    """A tensor ``x`` of at least one dimension in a dtype the path takes; ``dim`` an int in
    ``[-x.dim(), x.dim())``; ``scale`` a finite float (``None`` = 1); ``mask`` ``None`` or a
    boolean / floating tensor on x's device that broadcasts to x's shape without enlarging it.
    Returns ``(dim, scale)`` normalised (``dim`` non-negative, ``scale`` a float)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    check_dtype("x", x.dtype, x.device.type)
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension, got a 0-d tensor")
    dim = check_scalar("dim", dim, int, "an int")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim must be in [{-x.dim()}, {x.dim() - 1}] for a {x.dim()}-d x, got {dim}")
    scale = check_scalar("scale", 1.0 if scale is None else scale, float, "a finite float or None")
    if mask is not None:
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"mask must be a torch.Tensor or None, got {type(mask).__name__}")
        if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
            raise ValueError(f"mask must be boolean (True = keep) or floating (added to the scores), got {mask.dtype}")
        if mask.device != x.device:
            raise ValueError(f"mask must be on x's device ({x.device}), got {mask.device}")
        try:
            shape = torch.broadcast_shapes(mask.shape, x.shape)
        except RuntimeError:
            raise ValueError(f"mask of shape {tuple(mask.shape)} does not broadcast to x's shape {tuple(x.shape)}") from None
        if shape != x.shape:
            raise ValueError(f"mask of shape {tuple(mask.shape)} would enlarge x's shape {tuple(x.shape)}")
    return dim % x.dim(), scale
