"""``unpad_input`` / ``pad_input``'s arguments (flashtile's and flash-attn's)."""

from __future__ import annotations

import torch


def check_unpad_args(hidden_states, attention_mask) -> None:
    """Tensors, ``attention_mask`` ``(batch, seqlen)`` = the first two dimensions of
    ``hidden_states``."""
    if not isinstance(hidden_states, torch.Tensor) or not isinstance(attention_mask, torch.Tensor):
        raise TypeError("hidden_states and attention_mask must be torch.Tensors")
    if attention_mask.dim() != 2 or tuple(attention_mask.shape) != tuple(hidden_states.shape[:2]):
        raise ValueError(
            f"attention_mask must be (batch, seqlen) = {tuple(hidden_states.shape[:2])}, got {tuple(attention_mask.shape)}"
        )


def check_unused_mask(unused_mask, attention_mask) -> None:
    """flash-attn's ``unused_mask``: a tensor of ``attention_mask``'s shape."""
    if not isinstance(unused_mask, torch.Tensor):
        raise TypeError(f"unused_mask must be a torch.Tensor or None, got {type(unused_mask).__name__}")
    if not isinstance(attention_mask, torch.Tensor) or unused_mask.shape != attention_mask.shape:
        raise ValueError(f"unused_mask must have attention_mask's shape (batch, seqlen), got "
                         f"{tuple(unused_mask.shape)}")


def check_pad_args(hidden_states, indices) -> None:
    """Tensors, ``indices`` 1-D with one entry per row of ``hidden_states``.  Their values are
    checked by :func:`pad_indices_error` once the scatter has failed: an up-front bounds check
    would read them on the host on every call (a GPU sync, a graph break under torch.compile)."""
    if not isinstance(hidden_states, torch.Tensor) or not isinstance(indices, torch.Tensor):
        raise TypeError("hidden_states and indices must be torch.Tensors")
    if indices.dim() != 1 or indices.shape[0] != hidden_states.shape[0]:
        raise ValueError(
            f"indices must be 1-D with one entry per row of hidden_states ({hidden_states.shape[0]}), "
            f"got shape {tuple(indices.shape)}"
        )


def pad_indices_error(indices: torch.Tensor, batch: int, seqlen: int) -> ValueError:
    """The error for ``indices`` outside ``[0, batch * seqlen)``, naming the range they span."""
    return ValueError(
        f"indices must lie in [0, batch * seqlen) = [0, {batch * seqlen}) for batch={batch}, seqlen={seqlen}, "
        f"got indices from {int(indices.min())} to {int(indices.max())}: pass the batch and seqlen of the "
        "tensor given to unpad_input"
    )
