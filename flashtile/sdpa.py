"""A drop-in for ``torch.nn.functional.scaled_dot_product_attention``.

PyTorch's signature, layout ``(batch, heads, seq, dim)`` and semantics -- including its
*top-left* aligned ``is_causal`` (query ``i`` sees keys ``j <= i``), which differs from
flash-attn's bottom-right alignment when the lengths differ.  Where flashtile's kernels can
compute exactly what PyTorch would, they do, on transposed *views* of the inputs (a
``(batch, heads, seq, dim)`` tensor transposed is the ``(batch, seq, heads, dim)`` layout
the kernels read, so nothing is copied); everything else goes to PyTorch's own SDPA.

Routing (``attn_mask`` is first reduced to a boolean "may attend" mask when it is boolean,
or floating with only ``0`` and ``-inf`` entries; a float mask with any other value is a real
bias and is never reinterpreted):

========================================================  ==========================================
mask                                                      path
========================================================  ==========================================
none, ``is_causal=False``                                 kernels, no mask
none, ``is_causal=True``                                  kernels, causal; top-left alignment is
                                                          kept by slicing the keys (``L < S``) or
                                                          by the window ``(-1, L - S)`` (``L > S``)
key padding: size 1 along heads and queries,              packed variable-length kernels on the
e.g. ``(batch, 1, 1, S)``, ``(1, S)`` or ``(S,)``         kept keys (one host sync for the longest)
one ``(L, S)`` pattern shared by every batch and head:    kernels, no mask / causal
all true, top-left or bottom-right causal                 (detected by comparing: one host sync)
anything else (per-batch or per-head patterns, biases,    ``torch.nn.functional.
masks that require grad, float64, ``E != Ev``, ...)       scaled_dot_product_attention`` (slow path)
========================================================  ==========================================

A query row whose keys are all masked gives zeros -- what PyTorch >= 2.5 gives as well
(older versions give NaN there).  Reading the mask's values costs a device-to-host sync,
which under ``torch.compile`` is a graph break: to compile a model end to end, pass no mask
(or use :func:`flashtile.flash_attn_func` / :func:`flashtile.flash_attn_varlen_func`).
"""

from __future__ import annotations

import torch

from flashtile.interface import flash_attn_func, flash_attn_varlen_func
from flashtile.masking import mask_array
from flashtile import validation


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """``torch.nn.functional.scaled_dot_product_attention``, served by flashtile's kernels where it can be.

    Args:
        query: ``(batch, heads, L, E)`` (or ``(heads, L, E)``).
        key: ``(batch, heads_kv, S, E)``; value: ``(batch, heads_kv, S, Ev)``.
        attn_mask: ``None``, boolean (True = may attend) or floating (added to the scores),
            broadcastable to ``(batch, heads, L, S)``.
        dropout_p: dropout probability on the attention weights.
        is_causal: top-left aligned causal mask (query ``i`` sees keys ``j <= i``); not
            together with ``attn_mask``.
        scale: score scale, default ``E ** -0.5``.
        enable_gqa: allow ``heads_kv < heads`` with ``heads % heads_kv == 0`` (query head ``h``
            reads key/value head ``h // (heads // heads_kv)``, no copy).

    Returns:
        ``(batch, heads, L, Ev)``, like PyTorch (a transposed view of the kernels' output when
        they ran).  Gradients flow to ``query``, ``key`` and ``value``.
    """
    dropout_p, is_causal, scale, enable_gqa = validation.check_sdpa_inputs(query, key, value, attn_mask, dropout_p,
                                                                           is_causal, scale, enable_gqa)
    if query.dim() == 3:  # (heads, seq, dim): one batch entry; a mask broadcasts the same way
        out = scaled_dot_product_attention(query[None], key[None], value[None], attn_mask, dropout_p, is_causal,
                                           scale, enable_gqa)
        return out[0]

    if not _kernels_can_serve(query, key, value, attn_mask, scale):
        return _torch_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    # Views in the kernels' (batch, seq, heads, dim) layout: no copy.
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    if attn_mask is None:
        return _unmasked(q, k, v, is_causal, scale, dropout_p).transpose(1, 2)

    keep = _as_visibility(attn_mask)
    if keep is not None:
        keep = keep.reshape((1,) * (4 - keep.dim()) + tuple(keep.shape))
        batch, seqlen_q, seqlen_k = query.shape[0], query.shape[2], key.shape[2]
        if keep.shape[1] == 1 and keep.shape[2] == 1:
            keys_kept = keep[:, 0, 0, :].expand(batch, seqlen_k)
            if bool(keys_kept.all()):
                return _unmasked(q, k, v, False, scale, dropout_p).transpose(1, 2)
            return _key_padding(q, k, v, keys_kept, scale, dropout_p).transpose(1, 2)
        if keep.shape[0] == 1 and keep.shape[1] == 1:
            pattern = keep[0, 0].expand(seqlen_q, seqlen_k)
            if bool(pattern.all()):
                return _unmasked(q, k, v, False, scale, dropout_p).transpose(1, 2)
            if torch.equal(pattern, torch.ones_like(pattern).tril()):
                return _unmasked(q, k, v, True, scale, dropout_p).transpose(1, 2)
            if torch.equal(pattern, mask_array(seqlen_q, seqlen_k, -1, 0, xp=torch, device=pattern.device)):
                return flash_attn_func(q, k, v, dropout_p=dropout_p, softmax_scale=scale, causal=True).transpose(1, 2)

    # The slow path: PyTorch's own implementation (materialises the L x S scores).
    return _torch_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def _kernels_can_serve(query, key, value, attn_mask, scale) -> bool:
    """True when flashtile's kernels compute exactly what PyTorch's SDPA would for these inputs."""
    tensors = (query, key, value)
    return (
        query.dtype in validation.SUPPORTED_DTYPES and key.dtype == query.dtype and value.dtype == query.dtype
        and query.device.type in ("cpu", "cuda") and key.device == query.device and value.device == query.device
        and value.shape[-1] == query.shape[-1] and 1 <= query.shape[-1] <= validation.MAX_HEADDIM
        and all(t.numel() > 0 for t in tensors)
        and all(t.stride(-1) == 1 for t in tensors)
        and (scale is None or scale > 0)  # the kernels fold the scale into the running max: it must be positive
        and (attn_mask is None or not attn_mask.requires_grad)  # a learned mask needs its gradient
    )


def _as_visibility(attn_mask: torch.Tensor) -> torch.Tensor | None:
    """The mask as booleans (True = may attend), or None if it carries biases other than 0 / -inf."""
    if attn_mask.dtype == torch.bool:
        return attn_mask
    allowed = torch.isneginf(attn_mask)
    if not bool((allowed | (attn_mask == 0)).all()):
        return None
    return ~allowed


def _unmasked(q, k, v, top_left_causal: bool, scale, dropout_p):
    """Attention without a mask tensor, ``(batch, seq, heads, dim)`` views in and out."""
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    if not top_left_causal or seqlen_q == seqlen_k:
        return flash_attn_func(q, k, v, dropout_p=dropout_p, softmax_scale=scale, causal=top_left_causal)
    if seqlen_q < seqlen_k:
        # Top-left alignment: no query sees a key past index seqlen_q - 1, so those keys drop
        # out (a view) and what remains is the square causal case.
        return flash_attn_func(q, k[:, :seqlen_q], v[:, :seqlen_q], dropout_p=dropout_p, softmax_scale=scale,
                               causal=True)
    # seqlen_q > seqlen_k: the bottom-right diagonal of query i is key i + seqlen_k - seqlen_q, so
    # a right window of seqlen_q - seqlen_k moves it back to key i.
    return flash_attn_func(q, k, v, dropout_p=dropout_p, softmax_scale=scale, window_size=(-1, seqlen_q - seqlen_k))


def _key_padding(q, k, v, keys_kept: torch.Tensor, scale, dropout_p):
    """Key-padding mask ``(batch, S)``: pack the kept keys and run the variable-length kernels."""
    batch, seqlen_q = q.shape[:2]
    seqlen_k = k.shape[1]
    lens_k = keys_kept.sum(dim=1, dtype=torch.int32)
    cu_k = torch.nn.functional.pad(torch.cumsum(lens_k, 0, dtype=torch.int32), (1, 0))
    cu_q = torch.arange(0, (batch + 1) * seqlen_q, seqlen_q, dtype=torch.int32, device=q.device)
    kept = keys_kept.flatten().nonzero().flatten()
    packed_k = k.reshape(batch * seqlen_k, *k.shape[2:])[kept]
    packed_v = v.reshape(batch * seqlen_k, *v.shape[2:])[kept]
    max_k = int(lens_k.max())  # the one host sync: it sizes the kernel grid
    out = flash_attn_varlen_func(q.reshape(batch * seqlen_q, *q.shape[2:]), packed_k, packed_v, cu_q, cu_k, seqlen_q,
                                 max_k, dropout_p=dropout_p, softmax_scale=scale)
    # A batch entry with no key left gives zeros, as PyTorch's SDPA (>= 2.5) does.
    return out.reshape(batch, seqlen_q, *out.shape[1:])


def _torch_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    kwargs = {"enable_gqa": True} if enable_gqa else {}  # torch < 2.5 has no enable_gqa
    return torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **kwargs,
    )
