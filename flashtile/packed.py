"""Attention on packed inputs: q, k, v (or k, v) stacked in one tensor.

Each function takes views of the packed tensor (``unbind`` along the packing axis: no copy,
unit stride in the head dimension kept) and calls :func:`flashtile.flash_attn_func` or
:func:`flashtile.flash_attn_varlen_func`, which read strided inputs in place.  The gradient
of every view lands in the packed tensor: ``qkv.grad`` has ``qkv``'s shape.
"""

from __future__ import annotations

import torch

from flashtile.interface import flash_attn_func, flash_attn_varlen_func
from flashtile import validation


def _unpack(name: str, packed, rank: int, count: int, layout: str):
    validation.check_stacked(name, packed, rank, count, layout)
    return packed.unbind(dim=-3)


def flash_attn_qkvpacked_func(
    qkv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_lse: bool = False,
):
    """:func:`flashtile.flash_attn_func` on ``qkv (batch, seqlen, 3, nheads, headdim)``.

    Self-attention with equal head counts (for GQA/MQA use :func:`flash_attn_kvpacked_func`).
    Returns ``out (batch, seqlen, nheads, headdim)``, or ``(out, lse)`` when ``return_lse``.
    """
    q, k, v = _unpack("qkv", qkv, 5, 3, "(batch, seqlen, 3, nheads, headdim)")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_lse)


def flash_attn_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_lse: bool = False,
):
    """:func:`flashtile.flash_attn_func` on ``q (batch, seqlen_q, nheads, headdim)`` and
    ``kv (batch, seqlen_k, 2, nheads_k, headdim)`` (``nheads % nheads_k == 0``)."""
    k, v = _unpack("kv", kv, 5, 2, "(batch, seqlen_k, 2, nheads_k, headdim)")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_lse)


def flash_attn_varlen_qkvpacked_func(
    qkv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_lse: bool = False,
):
    """:func:`flashtile.flash_attn_varlen_func` on ``qkv (total, 3, nheads, headdim)``, one
    ``cu_seqlens`` / ``max_seqlen`` for queries and keys.  ``lse`` is ``(nheads, total)``."""
    q, k, v = _unpack("qkv", qkv, 4, 3, "(total, 3, nheads, headdim)")
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_lse)


def flash_attn_varlen_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_lse: bool = False,
):
    """:func:`flashtile.flash_attn_varlen_func` on ``q (total_q, nheads, headdim)`` and
    ``kv (total_k, 2, nheads_k, headdim)``."""
    k, v = _unpack("kv", kv, 4, 2, "(total_k, 2, nheads_k, headdim)")
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_lse)
