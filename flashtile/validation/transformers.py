"""The transformers attention backend's arguments (:mod:`flashtile.integrations.transformers`):
the tensors, masks and options a model's attention layer passes."""

from __future__ import annotations

import torch

UNSUPPORTED_KWARGS = ("s_aux", "head_mask")


def check_transformers_inputs(query, key, value, kwargs: dict) -> None:
    """No attention sinks (``s_aux``) or ``head_mask``; query, key and value
    ``(batch, heads, seq, dim)``."""
    for name in UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"the flashtile attention backend does not support {name}")
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(f"query, key and value must be (batch, heads, seq, dim), got {tuple(query.shape)}, "
                         f"{tuple(key.shape)}, {tuple(value.shape)}")


def check_sliding_window(sliding_window) -> int | None:
    """transformers' ``sliding_window``: a positive number of tokens, or None; returned as an int."""
    if sliding_window is None:
        return None
    size = int(sliding_window)
    if size <= 0:
        raise ValueError(f"sliding_window must be a positive number of tokens or None, got {sliding_window!r}")
    return size


def check_transformers_mask(attention_mask) -> None:
    """A mask tensor (``None`` is taken before): 2-D ``(batch, keys)`` or 4-D
    ``(batch, 1, queries, keys)``."""
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a torch.Tensor or None, got {type(attention_mask).__name__}")
    if attention_mask.dim() not in (2, 4):
        raise ValueError(f"attention_mask must be None, 2-D (batch, keys) or 4-D (batch, 1, queries, keys), got shape "
                         f"{tuple(attention_mask.shape)}")


def check_transformers_padding(key_keep: torch.Tensor, batch: int, seqlen_q: int, seqlen_k: int, causal: bool) -> None:
    """A 2-D padding mask ``(batch, n)`` over the first ``n`` keys: all ``seqlen_k`` of them, or,
    for a causal layer, at most ``seqlen_k`` and at least the ``seqlen_q`` query positions."""
    visible = key_keep.shape[1]
    if key_keep.shape[0] != batch or visible > seqlen_k or (not causal and visible != seqlen_k):
        raise ValueError(f"a 2-D attention_mask must be (batch={batch}, keys={seqlen_k}) (causal layers: at most "
                         f"{seqlen_k} keys), got {tuple(key_keep.shape)}")
    if causal and visible < seqlen_q:
        raise ValueError(f"a causal layer's 2-D attention_mask must cover the {seqlen_q} query positions, "
                         f"got {visible} keys")
