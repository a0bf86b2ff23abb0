"""Padded batch <-> packed tokens, so a padded batch runs without computing on padding.

``unpad_input(x, key_padding_mask)`` gathers the real tokens of a ``(batch, seqlen, ...)``
tensor into ``(total, ...)`` and returns what ``flash_attn_varlen_func`` needs;
``pad_input`` scatters a packed result back to ``(batch, seqlen, ...)`` with zeros in the
padding.  Both are differentiable (gather / scatter).
"""

from __future__ import annotations

import torch


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor):
    """Pack the tokens where ``attention_mask`` is true.

    Args:
        hidden_states: ``(batch, seqlen, ...)``.
        attention_mask: ``(batch, seqlen)``, bool or 0/1 integers, 1 = real token.

    Returns:
        ``(packed, indices, cu_seqlens, max_seqlen)``: ``packed (total, ...)``, the flat
        ``indices`` of the kept tokens in ``batch * seqlen``, int32 ``cu_seqlens`` of length
        ``batch + 1`` and the longest sequence length (a Python int).
    """
    if not isinstance(hidden_states, torch.Tensor) or not isinstance(attention_mask, torch.Tensor):
        raise TypeError("hidden_states and attention_mask must be torch.Tensors")
    if attention_mask.dim() != 2 or tuple(attention_mask.shape) != tuple(hidden_states.shape[:2]):
        raise ValueError(
            f"attention_mask must be (batch, seqlen) = {tuple(hidden_states.shape[:2])}, got {tuple(attention_mask.shape)}"
        )
    mask = attention_mask.bool()
    seqlens = mask.sum(dim=1, dtype=torch.int32)
    indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    max_seqlen = int(seqlens.max()) if seqlens.numel() else 0
    packed = hidden_states.reshape(-1, *hidden_states.shape[2:])[indices]
    return packed, indices, cu_seqlens, max_seqlen


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """Inverse of :func:`unpad_input`: ``(total, ...)`` -> ``(batch, seqlen, ...)``, zeros at padding."""
    if not isinstance(hidden_states, torch.Tensor) or not isinstance(indices, torch.Tensor):
        raise TypeError("hidden_states and indices must be torch.Tensors")
    if indices.dim() != 1 or indices.shape[0] != hidden_states.shape[0]:
        raise ValueError(
            f"indices must be 1-D with one entry per row of hidden_states ({hidden_states.shape[0]}), "
            f"got shape {tuple(indices.shape)}"
        )
    out = hidden_states.new_zeros((batch * seqlen, *hidden_states.shape[1:]))
    try:
        out = out.index_put((indices,), hidden_states)
    except IndexError:
        # Checked here rather than up front: an up-front bounds check would read the indices
        # back to the host on every call (a GPU sync, a graph break under torch.compile).
        raise ValueError(
            f"indices must lie in [0, batch * seqlen) = [0, {batch * seqlen}) for batch={batch}, seqlen={seqlen}, "
            f"got indices from {int(indices.min())} to {int(indices.max())}: pass the batch and seqlen of the "
            "tensor given to unpad_input"
        ) from None
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])
