"""flash-attn 2's public functions under flash-attn's names, signatures and return conventions.

Code written for flash-attn 2.8 switches with its imports only::

    from flashtile.compat import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
    from flashtile.compat import unpad_input, pad_input, apply_rotary_emb

Where flashtile's own API differs, this module translates:

* ``return_attn_probs=True`` returns ``(out, softmax_lse, None)``.  The third value, the
  debug probability matrix ``S_dmask`` of flash-attn, is not provided (always ``None``);
  ``softmax_lse`` is flashtile's LSE, as flash-attn's: float32 ``(batch, nheads, seqlen_q)``,
  or ``(nheads, total_q)`` for the varlen functions.
* ``flash_attn_with_kvcache(..., return_softmax_lse=True)`` returns ``(out, softmax_lse)``.
* ``unpad_input`` returns flash-attn 2.8's five values.

Every argument of these functions is implemented (the paged ``block_table`` of
``flash_attn_varlen_func`` in the forward only, as in flash-attn).
"""

from __future__ import annotations

import torch

from flashtile import interface as _interface
from flashtile import validation
from flashtile import kvcache as _kvcache
from flashtile import packed as _packed
from flashtile.padding import pad_input as _pad_input
from flashtile.padding import unpad_input as _unpad_input
from flashtile.rotary import apply_rotary_emb

__all__ = [
    "flash_attn_func",
    "flash_attn_varlen_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_with_kvcache",
    "unpad_input",
    "pad_input",
    "apply_rotary_emb",
]


def _with_probs(result, return_attn_probs):
    if return_attn_probs:
        out, lse = result
        return out, lse, None
    return result


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash-attn's ``flash_attn_func``: :func:`flashtile.flash_attn_func`; with
    ``return_attn_probs=True`` returns ``(out, softmax_lse, None)`` (no ``S_dmask``)."""
    return_attn_probs = validation.check_bool("return_attn_probs", return_attn_probs)
    result = _interface.flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                                        alibi_slopes, deterministic, return_attn_probs)
    return _with_probs(result, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """flash-attn's ``flash_attn_varlen_func``: :func:`flashtile.flash_attn_varlen_func`; with
    ``return_attn_probs=True`` returns ``(out, softmax_lse, None)`` (no ``S_dmask``).
    ``block_table``: paged ``k`` / ``v`` (forward only)."""
    return_attn_probs = validation.check_bool("return_attn_probs", return_attn_probs)
    result = _interface.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                               dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                               deterministic, return_attn_probs, block_table=block_table)
    return _with_probs(result, return_attn_probs)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash-attn's ``flash_attn_qkvpacked_func``: :func:`flashtile.flash_attn_qkvpacked_func`;
    with ``return_attn_probs=True`` returns ``(out, softmax_lse, None)`` (no ``S_dmask``)."""
    return_attn_probs = validation.check_bool("return_attn_probs", return_attn_probs)
    result = _packed.flash_attn_qkvpacked_func(qkv, dropout_p, softmax_scale, causal, window_size, softcap,
                                               alibi_slopes, deterministic, return_attn_probs)
    return _with_probs(result, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash-attn's ``flash_attn_kvpacked_func``: :func:`flashtile.flash_attn_kvpacked_func`;
    with ``return_attn_probs=True`` returns ``(out, softmax_lse, None)`` (no ``S_dmask``)."""
    return_attn_probs = validation.check_bool("return_attn_probs", return_attn_probs)
    result = _packed.flash_attn_kvpacked_func(q, kv, dropout_p, softmax_scale, causal, window_size, softcap,
                                              alibi_slopes, deterministic, return_attn_probs)
    return _with_probs(result, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """flash-attn's ``flash_attn_varlen_qkvpacked_func``:
    :func:`flashtile.flash_attn_varlen_qkvpacked_func`; with ``return_attn_probs=True``
    returns ``(out, softmax_lse, None)`` (no ``S_dmask``)."""
    return_attn_probs = validation.check_bool("return_attn_probs", return_attn_probs)
    result = _packed.flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal,
                                                      window_size, softcap, alibi_slopes, deterministic,
                                                      return_attn_probs)
    return _with_probs(result, return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash-attn's ``flash_attn_varlen_kvpacked_func``:
    :func:`flashtile.flash_attn_varlen_kvpacked_func`; with ``return_attn_probs=True``
    returns ``(out, softmax_lse, None)`` (no ``S_dmask``)."""
    return_attn_probs = validation.check_bool("return_attn_probs", return_attn_probs)
    result = _packed.flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                     dropout_p, softmax_scale, causal, window_size, softcap,
                                                     alibi_slopes, deterministic, return_attn_probs)
    return _with_probs(result, return_attn_probs)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """flash-attn's ``flash_attn_with_kvcache``: :func:`flashtile.flash_attn_with_kvcache`
    (inference only; ``k_cache`` / ``v_cache`` updated in place when ``k``, ``v`` are given).

    Returns ``out``, or ``(out, softmax_lse)`` with ``return_softmax_lse=True``.
    ``rotary_cos`` / ``rotary_sin`` rotate ``q`` and the new ``k`` inside the call, as
    flash-attn does (``rotary_interleaved`` picks the pairs); ``cache_leftpad`` left-pads the
    cache.
    """
    rotary_interleaved = validation.check_bool("rotary_interleaved", rotary_interleaved)
    return_softmax_lse = validation.check_bool("return_softmax_lse", return_softmax_lse)
    return _kvcache.flash_attn_with_kvcache(
        q, k_cache, v_cache, k=k, v=v, cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx,
        block_table=block_table, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
        softcap=softcap, alibi_slopes=alibi_slopes, num_splits=num_splits, return_lse=return_softmax_lse,
        rotary_cos=rotary_cos, rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved,
        cache_leftpad=cache_leftpad,
    )


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """flash-attn 2.8's ``bert_padding.unpad_input``.

    Keeps the tokens where ``attention_mask`` or ``unused_mask`` (``(batch, seqlen)``, bool or
    0/1; "allocated but unused" tokens) is set and returns five values:
    ``(hidden_states (total, ...), indices (total,), cu_seqlens int32 (batch + 1,),
    max_seqlen_in_batch (int), used_seqlens_in_batch int32 (batch,))`` -- the last counting
    only ``attention_mask``'s tokens.  Differentiable in ``hidden_states``.
    """
    if unused_mask is None:
        kept = attention_mask
    else:
        validation.check_unused_mask(unused_mask, attention_mask)
        kept = attention_mask.bool() | unused_mask.bool()
    packed, indices, cu_seqlens, max_seqlen = _unpad_input(hidden_states, kept)
    used_seqlens = attention_mask.bool().sum(dim=-1, dtype=torch.int32)
    return packed, indices, cu_seqlens, max_seqlen, used_seqlens


def pad_input(hidden_states, indices, batch, seqlen):
    """flash-attn's ``bert_padding.pad_input``: ``(total, ...)`` -> ``(batch, seqlen, ...)``,
    zeros at the padding."""
    return _pad_input(hidden_states, indices, batch, seqlen)
