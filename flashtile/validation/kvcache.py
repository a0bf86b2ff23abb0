"""``flash_attn_with_kvcache``'s cache rules: capacity, layout, and the index inputs' values.

The values of ``cache_seqlens``, ``cache_batch_idx``, ``block_table`` and ``cache_leftpad``
are read through :mod:`flashtile.validation.indices` (``values_readable``, ``to_host``):
one device-to-host copy for all of them, and none where it cannot be made.
"""

from __future__ import annotations

import torch

from flashtile.validation import indices


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
