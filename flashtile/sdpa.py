"""A drop-in for ``torch.nn.functional.scaled_dot_product_attention``.

PyTorch's signature, layout ``(batch, heads, seq, dim)`` and semantics -- including its
*top-left* aligned ``is_causal`` (query ``i`` sees keys ``j <= i``), which differs from
flash-attn's bottom-right alignment when the lengths differ.  Routing:

* no mask, ``is_causal`` with equal lengths or no causal mask -> flashtile's kernels on
  transposed *views* (no copy);
* a boolean key-padding mask (shape ``(batch, 1, 1, seq_k)``, True = attend) -> the packed
  variable-length kernels on the kept keys (one small host sync for the longest length);
* any other mask (or top-left causal with unequal lengths) -> PyTorch's own SDPA, which
  materialises the scores: correct, and documented as the slow path.
"""

from __future__ import annotations

import torch

from flashtile.interface import flash_attn_func, flash_attn_varlen_func


def _is_key_padding(attn_mask, batch, seqlen_k) -> bool:
    return (attn_mask.dtype == torch.bool and attn_mask.dim() == 4
            and tuple(attn_mask.shape) == (batch, 1, 1, seqlen_k))


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """``torch.nn.functional.scaled_dot_product_attention`` served by flashtile where it can be.

    Args: as PyTorch's: ``query (batch, heads, L, d)``, ``key/value (batch, heads_kv, S, d)``;
    ``enable_gqa`` allows ``heads % heads_kv == 0``.  Returns ``(batch, heads, L, d)``.
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be (batch, heads, seq, dim) for flashtile's SDPA, got shape {tuple(t.shape)}")
    if key.shape[1] != query.shape[1] and not enable_gqa:
        raise ValueError(
            f"query has {query.shape[1]} heads and key {key.shape[1]}: pass enable_gqa=True for grouped-query attention"
        )
    if attn_mask is not None and is_causal:
        raise ValueError("attn_mask and is_causal cannot both be set (as in PyTorch)")
    batch, _, seqlen_q, _ = query.shape
    seqlen_k = key.shape[2]
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # views: flash-attn layout

    if attn_mask is None and (not is_causal or seqlen_q == seqlen_k):
        out = flash_attn_func(q, k, v, dropout_p=dropout_p, softmax_scale=scale, causal=is_causal)
        return out.transpose(1, 2)

    if attn_mask is not None and _is_key_padding(attn_mask, batch, seqlen_k) and query.dtype in (
            torch.float16, torch.bfloat16, torch.float32):
        keep = attn_mask[:, 0, 0, :]
        lens_k = keep.sum(dim=1, dtype=torch.int32)
        cu_k = torch.nn.functional.pad(torch.cumsum(lens_k, 0, dtype=torch.int32), (1, 0))
        cu_q = torch.arange(0, (batch + 1) * seqlen_q, seqlen_q, dtype=torch.int32, device=query.device)
        idx = keep.flatten().nonzero().flatten()
        kp = k.reshape(batch * seqlen_k, *k.shape[2:])[idx]
        vp = v.reshape(batch * seqlen_k, *v.shape[2:])[idx]
        max_k = int(lens_k.max()) if batch else 0  # the one host sync: sizes the kernel grid
        out = flash_attn_varlen_func(q.reshape(batch * seqlen_q, *q.shape[2:]), kp, vp, cu_q, cu_k, seqlen_q, max_k,
                                     dropout_p=dropout_p, softmax_scale=scale)
        # A query whose keys are all masked gets 0, as PyTorch's SDPA gives it (torch 2.13).
        return out.reshape(batch, seqlen_q, *out.shape[1:]).transpose(1, 2)

    # The slow path: PyTorch's own implementation (materialises the seq_q x seq_k scores).
    return torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
        enable_gqa=enable_gqa,
    )
