"""``flash_attn_with_kvcache``'s arguments: tensors and scalars, the cache's capacity and
layout, the rotary tables, and the index inputs' values.

:func:`check_kvcache_arguments` reads no index *value*: what it accepts depends only on the
arguments' classes, shapes, strides, dtypes and devices and the scalars' types and values,
so ``flash_attn_with_kvcache`` memoises it.  The values of ``cache_seqlens``,
``cache_batch_idx``, ``block_table`` and ``cache_leftpad`` are checked by
:func:`check_kvcache_index_values`, read through :mod:`flashtile.validation.indices`
(``values_readable``, ``to_host``): one device-to-host copy for all of them, and none where
it cannot be made.
"""

from __future__ import annotations

import torch

from flashtile.semantics.params import AttentionParams
from flashtile.validation import indices
from flashtile.validation.attention import check_alibi_slopes, check_attention_scalars, check_qkv_agree
from flashtile.validation.common import check_bool, check_tensor
from flashtile.validation.indices import check_block_table, check_index_tensor
from flashtile.validation.rotary import check_rotary_arguments


def check_kvcache_arguments(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, softmax_scale,
                            causal, window_size, softcap, alibi_slopes, num_splits, return_lse,
                            cache_leftpad) -> tuple[AttentionParams, int]:
    """Every rule of ``flash_attn_with_kvcache`` that reads no index value (types, shapes,
    dtypes, devices, the cache layout, the scalars), in order: ``(params, capacity)``."""
    check_tensor("q", q, 4, "(batch, seqlen_q, nheads, headdim)")
    check_tensor("k_cache", k_cache, 4,
                 "(batch_cache, seqlen_cache, nheads_k, headdim) or (num_blocks, page_size, nheads_k, headdim)")
    check_tensor("v_cache", v_cache, 4, "like k_cache")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have one shape, got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    batch = q.shape[0]
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (new keys and values to append) or both be None")
    if k is not None:
        check_tensor("k", k, 4, "(batch, seqlen_new, nheads_k, headdim)")
        check_tensor("v", v, 4, "(batch, seqlen_new, nheads_k, headdim)")
        if k.device != q.device or v.device != q.device:
            raise ValueError(f"k and v must be on q's device ({q.device}), got {k.device} and {v.device}")
        if k.shape != v.shape or k.shape[0] != batch or k.shape[2:] != k_cache.shape[2:]:
            raise ValueError(
                f"k and v must be (batch={batch}, seqlen_new, nheads_k={k_cache.shape[2]}, headdim={k_cache.shape[3]}), "
                f"got {tuple(k.shape)} and {tuple(v.shape)}"
            )
        check_kvcache_cache_layout("k_cache", k_cache)
        check_kvcache_cache_layout("v_cache", v_cache)
    if block_table is not None:
        check_block_table(block_table, q.device, batch)
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx cannot be combined with block_table (a paged cache)")
    elif k_cache.shape[0] < batch and cache_batch_idx is None:
        raise ValueError(f"k_cache holds {k_cache.shape[0]} sequences, fewer than batch ({batch}); pass cache_batch_idx")
    if cache_batch_idx is not None:
        check_index_tensor("cache_batch_idx", cache_batch_idx, q.device, (batch,), f"(batch={batch},)")
    if isinstance(cache_seqlens, bool):
        raise TypeError("cache_seqlens must be an int or an int32 tensor (batch,), got bool")
    if cache_seqlens is not None and not isinstance(cache_seqlens, int):
        check_index_tensor("cache_seqlens", cache_seqlens, q.device, (batch,), f"(batch={batch},)")
    if cache_leftpad is not None:
        check_index_tensor("cache_leftpad", cache_leftpad, q.device, (batch,), f"(batch={batch},)")
    # The common checks, without building (batch, ...) views of the cache: a decoding step
    # lasts microseconds on the GPU, so the host path is kept to what is needed.
    check_qkv_agree(q, k_cache, v_cache, "k_cache", "v_cache")
    params = check_attention_scalars(q.shape[-1], softmax_scale=softmax_scale, causal=causal,
                                     window_size=window_size, softcap=softcap)
    if alibi_slopes is not None:
        check_alibi_slopes(alibi_slopes, batch, q.shape[2], q.device)
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0 = automatic), got {num_splits!r}")
    check_bool("return_lse", return_lse)
    return params, kvcache_capacity(k_cache, block_table)


def check_kvcache_rotary_pair(cos, sin, interleaved) -> bool:
    """``rotary_cos`` and ``rotary_sin`` given together; returns ``rotary_interleaved`` as a bool."""
    if cos is None or sin is None:
        raise ValueError("rotary_cos and rotary_sin must be given together")
    return check_bool("rotary_interleaved", interleaved)


def check_kvcache_rotary(q, k, cos, sin, interleaved, positions, local: bool) -> bool:
    """The rotary tables against q and the new keys ``k`` (or ``None``) at ``positions`` (an int
    or a ``(batch,)`` tensor), as the kernels rotate them: the new key row ``i`` at
    ``positions[b] + i``; q row ``i`` there too when ``local``, else every q row at
    ``positions[b]``.  Returns ``rotary_interleaved`` as a bool."""
    interleaved = check_kvcache_rotary_pair(cos, sin, interleaved)
    if k is not None:
        check_rotary_arguments(k, cos, sin, interleaved, False, positions, None, None)
    if not local:
        batch, seqlen_q, nheads, d = q.shape
        q = q.reshape(batch, 1, seqlen_q * nheads, d)
    check_rotary_arguments(q, cos, sin, interleaved, False, positions, None, None)
    return interleaved


def kvcache_capacity(k_cache: torch.Tensor, block_table) -> int:
    """Key positions one sequence of a KV cache can hold: the cache length, or the pages of a
    block-table row times the page size."""
    return block_table.shape[1] * k_cache.shape[1] if block_table is not None else k_cache.shape[1]


def check_kvcache_cache_layout(name: str, cache: torch.Tensor) -> None:
    """A cache that receives an in-place append must give every position its own memory: an
    expanded (stride-0) view would write one value to many positions."""
    for dim, (size, stride) in enumerate(zip(cache.shape, cache.stride())):
        if stride == 0 and size > 1:
            raise ValueError(
                f"{name} has stride 0 in dimension {dim} (an expanded view, shape {tuple(cache.shape)}, strides "
                f"{tuple(cache.stride())}): an in-place append would write several positions at once; pass a "
                f"cache with its own memory (e.g. .contiguous())"
            )


def check_kvcache_index_values(cache_seqlens, cache_batch_idx, block_table, *, seqlen_new: int, capacity: int,
                               cache_rows: int, cache_leftpad=None) -> None:
    """The values of ``flash_attn_with_kvcache``'s index inputs, when readable (one
    device-to-host copy for all of them on a GPU; see ``values_readable``).

    ``cache_seqlens[b] >= 0`` and ``cache_seqlens[b] + seqlen_new <= capacity``;
    ``0 <= cache_batch_idx[b] < cache_rows`` and, with an append, no row twice; the pages of
    ``block_table`` that hold a sequence's keys (after the append) in ``[0, cache_rows)``, and
    with an append every page that receives new keys held by that one sequence at one block
    (else another sequence, or another block of the same one, would read them);
    ``0 <= cache_leftpad[b] <= cache_seqlens[b]``.
    ``cache_seqlens`` may be a Python int (checked for free)."""
    if isinstance(cache_seqlens, int):
        check_kvcache_length(cache_seqlens, seqlen_new, capacity)
        if cache_batch_idx is None and block_table is None and cache_leftpad is None:
            return
    tensors = [t for t in (cache_seqlens, cache_batch_idx, block_table, cache_leftpad) if isinstance(t, torch.Tensor)]
    if not indices.values_readable(*tensors):
        return
    lens, rows, table, pads = indices.to_host(cache_seqlens if isinstance(cache_seqlens, torch.Tensor) else None,
                                              cache_batch_idx, block_table, cache_leftpad)
    batch = next(t for t in (rows, table, lens, pads) if t is not None).shape[0]
    if lens is None:
        lens = torch.full((batch,), cache_seqlens, dtype=torch.int64)
    else:
        for b in (lens < 0).nonzero().flatten().tolist() + (lens + seqlen_new > capacity).nonzero().flatten().tolist():
            raise ValueError(_seqlen_message(f"cache_seqlens[{b}] = {int(lens[b])}", int(lens[b]), seqlen_new,
                                             capacity))
    if pads is not None:
        for b in ((pads < 0) | (pads > lens)).nonzero().flatten().tolist():
            raise ValueError(f"cache_leftpad[{b}] = {int(pads[b])} must be in [0, cache_seqlens[{b}] = {int(lens[b])}]: "
                             f"a sequence's keys start at cache_leftpad and end at cache_seqlens")
    if rows is not None:
        for b in ((rows < 0) | (rows >= cache_rows)).nonzero().flatten().tolist():
            raise ValueError(f"cache_batch_idx[{b}] = {int(rows[b])} is not a row of the cache: it must be in "
                             f"[0, {cache_rows}) (k_cache.shape[0])")
        if seqlen_new:
            order = rows.argsort(stable=True)
            same = (rows[order][1:] == rows[order][:-1]).nonzero().flatten().tolist()
            if same:
                first, second = order[same[0]].item(), order[same[0] + 1].item()
                raise ValueError(f"cache_batch_idx[{first}] = cache_batch_idx[{second}] = {int(rows[first])}: with an "
                                 f"append (k, v) each sequence needs its own cache row, else it reads the other's "
                                 f"new keys")
    if table is not None:
        page_size = capacity // table.shape[1]
        used = torch.arange(table.shape[1])[None, :] < ((lens + seqlen_new + page_size - 1) // page_size)[:, None]
        bad = (used & ((table < 0) | (table >= cache_rows))).nonzero().tolist()
        if bad:
            b, j = bad[0]
            raise ValueError(f"block_table[{b}, {j}] = {int(table[b, j])} is not a page of the cache: the pages that "
                             f"hold keys must be in [0, {cache_rows}) (k_cache.shape[0])")
        if seqlen_new:
            first = lens // page_size
            last = (lens + seqlen_new - 1) // page_size
            cols = torch.arange(table.shape[1])[None, :]
            written = (cols >= first[:, None]) & (cols <= last[:, None])
            count = torch.bincount(table[used], minlength=cache_rows)
            shared = (written & (count[table.clamp(0, cache_rows - 1)] > 1)).nonzero().tolist()
            if shared:
                b, j = shared[0]
                raise ValueError(f"block_table[{b}, {j}] = {int(table[b, j])} receives appended keys of sequence {b} "
                                 f"but holds other keys too (another sequence, or another block of this one, maps "
                                 f"to that page): each page written by an append must be used once")


def check_kvcache_length(cache_seqlens: int, seqlen_new: int, capacity: int) -> None:
    """One int ``cache_seqlens`` for every sequence: ``0 <= cache_seqlens`` and
    ``cache_seqlens + seqlen_new <= capacity``."""
    if cache_seqlens < 0 or cache_seqlens + seqlen_new > capacity:
        raise ValueError(_seqlen_message(f"cache_seqlens ({cache_seqlens})", cache_seqlens, seqlen_new, capacity))


def _seqlen_message(what: str, value: int, seqlen_new: int, capacity: int) -> str:
    appended = f" (+ seqlen_new {seqlen_new} = {value + seqlen_new})" if seqlen_new else ""
    return (f"{what}{appended} is out of range: cache_seqlens must be >= 0 and cache_seqlens + seqlen_new <= "
            f"the cache capacity ({capacity} positions per sequence)")
