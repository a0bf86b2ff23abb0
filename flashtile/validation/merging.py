"""``merge_attention_states``'s arguments."""

from __future__ import annotations

import torch


def check_merge_states(out_a, lse_a, out_b, lse_b) -> None:
    """Tensors; ``out_a`` and ``out_b`` of one shape, ``lse_a`` and ``lse_b`` of out's shape
    without its last dimension and with heads before sequence."""
    for name, t in (("out_a", out_a), ("lse_a", lse_a), ("out_b", out_b), ("lse_b", lse_b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if out_a.shape != out_b.shape:
        raise ValueError(f"out_a and out_b must have one shape, got {tuple(out_a.shape)} and {tuple(out_b.shape)}")
    if (lse_a.shape != lse_b.shape or lse_a.dim() != out_a.dim() - 1
            or tuple(lse_a.transpose(-1, -2).shape) != tuple(out_a.shape[:-1])):
        raise ValueError(
            f"lse_a / lse_b must be out's shape without d, heads before sequence: out {tuple(out_a.shape)}, "
            f"lse_a {tuple(lse_a.shape)}, lse_b {tuple(lse_b.shape)}"
        )
