"""``flashtile.scaled_dot_product_attention``'s arguments, as PyTorch's SDPA takes them."""

from __future__ import annotations

import torch

from flashtile.validation.common import check_bool, check_dropout_p, type_name

BHSD = "(batch, heads, seq, dim)"


def check_sdpa_inputs(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """PyTorch SDPA's contract: ``query (batch, heads, L, E)``, ``key (batch, heads_kv, S, E)``,
    ``value (batch, heads_kv, S, Ev)`` (or all without batch); heads a multiple of heads_kv,
    unequal only with ``enable_gqa``; ``dropout_p`` in ``[0, 1)``; ``scale`` a number or
    ``None``; ``attn_mask`` ``None`` or a boolean / floating tensor on query's device that
    broadcasts to the scores ``(batch, heads, L, S)``, never together with ``is_causal``.

    Returns ``(dropout_p, is_causal, scale, enable_gqa)`` normalised (floats and bools)."""
    tensors = (("query", query), ("key", key), ("value", value))
    for name, t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor {BHSD}, got {type(t).__name__}")
    for name, t in tensors:
        if t.dim() not in (3, 4) or t.dim() != query.dim():
            shapes = ", ".join(f"{n} {tuple(x.shape)}" for n, x in tensors)
            raise ValueError(
                f"{name} must be {BHSD} (or (heads, seq, dim)), with query, key and value of one rank; got {shapes}"
            )
    if query.dim() == 4 and not query.shape[0] == key.shape[0] == value.shape[0]:
        raise ValueError(f"query, key and value must have one batch size, got {query.shape[0]}, {key.shape[0]}, "
                         f"{value.shape[0]}")
    if key.shape[-2] != value.shape[-2] or key.shape[-3] != value.shape[-3]:
        raise ValueError(f"key and value must have the same heads and sequence length, got key {tuple(key.shape)} "
                         f"and value {tuple(value.shape)}")
    if key.shape[-1] != query.shape[-1]:
        raise ValueError(f"query and key must have the same head dimension, got {query.shape[-1]} and {key.shape[-1]}")
    is_causal = check_bool("is_causal", is_causal)
    enable_gqa = check_bool("enable_gqa", enable_gqa)
    heads, heads_kv = query.shape[-3], key.shape[-3]
    if heads != heads_kv and not enable_gqa:
        raise ValueError(
            f"query has {heads} heads and key {heads_kv}: pass enable_gqa=True for grouped-query attention"
        )
    if heads_kv == 0 or heads % heads_kv != 0:
        raise ValueError(f"the number of query heads ({heads}) must be a multiple of the key/value heads ({heads_kv})")
    dropout_p = check_dropout_p(dropout_p)
    # Any real scale: one the kernels cannot take (<= 0) goes to PyTorch's own SDPA.
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise TypeError(f"scale must be a float or None, got {type_name(scale)}")
        scale = float(scale)
    if attn_mask is not None:
        check_sdpa_mask(attn_mask, query, key, is_causal)
    return dropout_p, is_causal, scale, enable_gqa


def check_sdpa_mask(attn_mask, query, key, is_causal: bool) -> None:
    """A boolean (True = may attend) or floating (added to the scores) tensor on query's device,
    broadcastable to ``(batch, heads, L, S)``; not together with ``is_causal``."""
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
    if is_causal:
        raise ValueError("attn_mask and is_causal cannot both be set (as in PyTorch): fold the causal mask into attn_mask")
    if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
        raise ValueError(f"attn_mask must be boolean (True = may attend) or floating (added to the scores), "
                         f"got {attn_mask.dtype}")
    scores_shape = (*query.shape[:-1], key.shape[-2])
    try:
        broadcast = torch.broadcast_shapes(attn_mask.shape, scores_shape)
    except RuntimeError:
        broadcast = None
    if broadcast != torch.Size(scores_shape):
        raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to the scores' shape "
                         f"{tuple(scores_shape)} (batch, heads, L, S)")
    if attn_mask.device != query.device:
        raise ValueError(f"attn_mask must be on query's device ({query.device}), got {attn_mask.device}")
