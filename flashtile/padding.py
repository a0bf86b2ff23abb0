"""Padded batch <-> packed tokens, so a padded batch runs without computing on padding.

``unpad_input(x, key_padding_mask)`` gathers the real tokens of a ``(batch, seqlen, ...)``
tensor into ``(total, ...)`` and returns what ``flash_attn_varlen_func`` needs;
``pad_input`` scatters a packed result back to ``(batch, seqlen, ...)`` with zeros in the
padding.  Both are differentiable (gather / scatter).
"""

from __future__ import annotations

import torch

from flashtile import validation


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
    validation.check_unpad_args(hidden_states, attention_mask)
    mask = attention_mask.bool()
    seqlens = mask.sum(dim=1, dtype=torch.int32)
    indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    max_seqlen = int(seqlens.max()) if seqlens.numel() else 0
    packed = hidden_states.reshape(-1, *hidden_states.shape[2:])[indices]
    return packed, indices, cu_seqlens, max_seqlen


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """Inverse of :func:`unpad_input`: ``(total, ...)`` -> ``(batch, seqlen, ...)``, zeros at padding."""
    validation.check_pad_args(hidden_states, indices)
    out = hidden_states.new_zeros((batch * seqlen, *hidden_states.shape[1:]))
    try:
        out = out.index_put((indices,), hidden_states)
    except IndexError:
        # The indices' bounds are checked only here: checking them up front would read them
        # on the host on every call (a GPU sync, a graph break under torch.compile).
        raise validation.pad_indices_error(indices, batch, seqlen) from None
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])
