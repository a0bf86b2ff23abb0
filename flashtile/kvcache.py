"""``flash_attn_with_kvcache``: decoding against a contiguous or paged KV cache (inference only).

Semantics follow flash-attn (docs/semantics.md, "KV cache"): ``cache_seqlens[b]`` keys of
sequence ``b`` are valid; new ``k``, ``v`` (if given) are written in place at positions
``cache_seqlens[b] ...``; then the ``seqlen_q`` query rows -- the *last* positions of the
sequence -- attend to the first ``cache_seqlens[b] + seqlen_new`` keys, so ``causal`` and
windows are bottom-right aligned against that updated length.
"""

from __future__ import annotations

import torch

from flashtile import cpu
from flashtile.ops.validation import (
    check_tensor,
    check_alibi_slopes,
    check_attention_scalars,
    check_index_tensor,
    check_kvcache_cache_layout,
    check_kvcache_index_values,
    check_kvcache_length,
    check_qkv_agree,
    kvcache_capacity,
)

# Whether the *values* of index tensors on a GPU (``cache_seqlens``, ``cache_batch_idx``,
# ``block_table``, ``cache_leftpad``) are read and checked on the host before the launches.
# Off, as in flash-attn: reading them is a device-to-host copy that waits for the GPU on every
# decoding step.  Memory safety does not depend on it -- the append kernel writes nothing
# unless every index of the batch is valid, and the attention kernel clamps lengths into the
# capacity and drops rows and pages that do not exist (docs/semantics.md, "Index checks") --
# only the error for a bad value does.  Set it to True to get that ``ValueError`` while
# debugging (one sync per call).  CPU tensors and int ``cache_seqlens`` are always checked.
check_device_values = False


def _validate(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table):
    """Types, shapes, dtypes and devices (the index *values* are checked separately, by
    ``check_kvcache_index_values``, once the cache capacity is known)."""
    check_tensor("q", q, 4, "(batch, seqlen_q, nheads, headdim)")
    check_tensor("k_cache", k_cache, 4, "(batch_cache, seqlen_cache, nheads_k, headdim) or (num_blocks, page_size, nheads_k, headdim)")
    check_tensor("v_cache", v_cache, 4, "like k_cache")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have one shape, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
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
        check_index_tensor("block_table", block_table, q.device, (batch, None), f"(batch={batch}, max_blocks)")
        if block_table.shape[1] == 0:
            raise ValueError("block_table must have at least one column (block), got shape "
                             f"{tuple(block_table.shape)}")
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


def _check_arguments(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, softmax_scale, causal,
                     window_size, softcap, alibi_slopes, num_splits, return_lse, cache_leftpad):
    """Every check of ``flash_attn_with_kvcache`` that reads no index *value*, in order:
    ``(params, capacity)``."""
    _validate(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table)
    batch = q.shape[0]
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
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    return params, kvcache_capacity(k_cache, block_table)


# The checks above passed once for a key (below) pass again for every call with that key:
# they read the arguments' classes, shapes, strides, dtypes and devices and the scalars'
# types and values, all of which are in it.  So a decoding loop, one key for thousands of
# steps, pays them once; a call with a new key (a bad one included) runs them in full, and
# a failing call caches nothing.  What depends on index values (an int ``cache_seqlens``
# against the capacity, index tensors on the CPU) is checked at every call, after this.
# The key also holds everything the GPU step's launch plan reads, so an entry keeps that
# plan too (see _step_triton): one key per call for the checks and the launches.
_MAX_CHECKED = 256
_checked: dict = {}
_Tensor = torch.Tensor


class _Checked:
    """A memo entry: the checks' results (``params``, ``capacity``); ``rotary_ok``: the rotary
    tables checked against q and k (positions by class; an int one is checked per call);
    the GPU launch plan with the tuning value and plan generation it was built under, and
    whether the index tensors are already as the kernel reads them."""

    __slots__ = ("params", "capacity", "rotary_ok", "plan", "tuning", "generation", "as_read")

    def __init__(self, params, capacity):
        self.params, self.capacity = params, capacity
        self.rotary_ok = False
        self.plan = self.tuning = self.generation = None
        self.as_read = False


class _Unkeyed(Exception):
    """An argument the memo does not describe (a tensor subclass, a list window): full checks."""


def _meta(t):
    """What the checks read of an optional tensor argument."""
    if t is None:
        return None
    if t.__class__ is _Tensor:
        return t.shape, t.stride(), t.dtype, t.device
    raise _Unkeyed


def _checked_arguments(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, softmax_scale, causal,
                       window_size, softcap, alibi_slopes, num_splits, return_lse, cache_leftpad, rotary_cos=None,
                       rotary_sin=None, rotary_interleaved=False):
    """:func:`_check_arguments` as a :class:`_Checked`, memoised by key (see ``_checked``; the
    rotary arguments are in the key, for the rotary checks and the plan); not while
    torch.compile traces (the shapes may be symbolic: the checks are traced as they stand)."""
    args = (q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, softmax_scale, causal,
            window_size, softcap, alibi_slopes, num_splits, return_lse, cache_leftpad)
    if torch.compiler.is_compiling():
        return _Checked(*_check_arguments(*args))
    try:
        if window_size.__class__ is not tuple or cache_seqlens.__class__ not in (int, type(None), _Tensor):
            raise _Unkeyed
        # Scalars by value *and* type (True == 1 == 1.0 as dict keys, but the checks tell them
        # apart), the window's elements too; an int cache_seqlens by its class only.
        key = (_meta(q), _meta(k_cache), _meta(v_cache), _meta(k), _meta(v),
               cache_seqlens.__class__ if cache_seqlens.__class__ is not _Tensor else _meta(cache_seqlens),
               _meta(cache_batch_idx), _meta(block_table), _meta(alibi_slopes), _meta(cache_leftpad),
               _meta(rotary_cos), _meta(rotary_sin), rotary_interleaved,
               softmax_scale, causal, window_size, softcap, num_splits, return_lse,
               tuple(map(type, (softmax_scale, causal, softcap, num_splits, return_lse, rotary_interleaved,
                                *window_size))))
        checked = _checked.get(key)
    except (_Unkeyed, TypeError):  # TypeError: an unhashable scalar
        return _Checked(*_check_arguments(*args))
    if checked is None:
        checked = _Checked(*_check_arguments(*args))
        if len(_checked) >= _MAX_CHECKED:
            _checked.clear()
        _checked[key] = checked
    return checked


def _physical_rows(positions, batch_rows, block_table, page_size):
    """(cache index, row) of logical ``positions`` (batch, n) of each sequence."""
    if block_table is None:
        return batch_rows[:, None].expand_as(positions), positions
    pages = torch.gather(block_table.long(), 1, positions // page_size)
    return pages, positions % page_size


def _append(k_cache, v_cache, k, v, cache_seqlens, batch_rows, block_table):
    """Write new keys/values at positions cache_seqlens[b] ... in place (one scatter each);
    the indices were checked (check_kvcache_index_values), so both scatters complete."""
    positions = cache_seqlens.long()[:, None] + torch.arange(k.shape[1], device=k.device)[None, :]
    idx, rows = _physical_rows(positions, batch_rows, block_table, k_cache.shape[1])
    k_cache[idx, rows] = k.to(k_cache.dtype)
    v_cache[idx, rows] = v.to(v_cache.dtype)


def _rotary_flags(cos, sin, interleaved):
    if cos is None or sin is None:
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if not isinstance(interleaved, bool):
        raise TypeError(f"rotary_interleaved must be a bool, got {type(interleaved).__name__}")


def _rotate(q, k, cos, sin, interleaved, positions, local):
    """(q, k) with the rotary embedding at their cache positions (see flash_attn_with_kvcache),
    computed by :func:`flashtile.apply_rotary_emb` (the CPU path)."""
    from flashtile.rotary import apply_rotary_emb

    _rotary_flags(cos, sin, interleaved)
    if k is not None:
        k = apply_rotary_emb(k, cos, sin, interleaved=interleaved, seqlen_offsets=positions)
    if local:
        return apply_rotary_emb(q, cos, sin, interleaved=interleaved, seqlen_offsets=positions), k
    # Every query row at position cache_seqlens[b]: the rows become one position's heads.
    batch, seqlen_q, nheads, d = q.shape
    flat = q.reshape(batch, 1, seqlen_q * nheads, d)
    q = apply_rotary_emb(flat, cos, sin, interleaved=interleaved, seqlen_offsets=positions).reshape(q.shape)
    return q, k


def _check_rotary_fused(q, k, cos, sin, interleaved, positions, local):
    """:func:`_rotate`'s checks without computing anything: on a GPU the split kernel rotates q
    and the new k itself (a bad table raises here, before anything is written)."""
    from flashtile.rotary import check_rotary_arguments

    _rotary_flags(cos, sin, interleaved)
    if k is not None:
        check_rotary_arguments(k, cos, sin, interleaved, False, positions, None, None)
    if not local:
        batch, seqlen_q, nheads, d = q.shape
        q = q.reshape(batch, 1, seqlen_q * nheads, d)
    check_rotary_arguments(q, cos, sin, interleaved, False, positions, None, None)


def _attend_cpu(q, k_cache, v_cache, seqlens_k, batch_rows, block_table, scale, left, right, softcap, alibi_slopes,
                leftpad=None):
    """Per sequence: gather its keys (from ``leftpad[b]`` on) and run the CPU path."""
    batch, seqlen_q, nheads, d = q.shape
    out = torch.zeros_like(q)
    lse = torch.full((batch, nheads, seqlen_q), float("-inf"), dtype=torch.float32, device=q.device)
    starts = leftpad.tolist() if leftpad is not None else [0] * batch
    for b, n in enumerate(seqlens_k.tolist()):
        positions = torch.arange(starts[b], n, device=q.device)[None, :]
        idx, rows = _physical_rows(positions, batch_rows[b:b + 1], None if block_table is None else block_table[b:b + 1],
                                   k_cache.shape[1])
        kb, vb = k_cache[idx[0], rows[0]][None], v_cache[idx[0], rows[0]][None]
        slopes = alibi_slopes if alibi_slopes is None or alibi_slopes.dim() == 1 else alibi_slopes[b]
        o, l = cpu.attention_forward(q[b:b + 1], kb, vb, scale, left, right, softcap=softcap, alibi_slopes=slopes)
        out[b], lse[b] = o[0], l[0]
    return out, lse


def _attend_triton(q, k_cache, v_cache, seqlens_k, cache_batch_idx, block_table, scale, left, right, softcap,
                   alibi_slopes, num_splits, leftpad=None, seqlen_new=0):
    from flashtile.kernels.decode import decode

    return decode(q, k_cache, v_cache, seqlens_k, cache_batch_idx, block_table, scale, left, right, softcap,
                  alibi_slopes, num_splits, cache_leftpad=leftpad, seqlen_new=seqlen_new)


def _step_triton(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, scale, left, right, softcap,
                 alibi_slopes, num_splits, leftpad=None, rotary=None, entry=None):
    """The append (if ``k`` is given) and the attention, on checked arguments, in one split
    kernel launch (plus the combine when the keys are split): the kernel writes the new keys
    into the cache and attends to them; with ``rotary`` ``(cos, sin, interleaved, local)`` it
    rotates q and the new keys (see :func:`flashtile.kernels.decode._decode_split`).

    A decoding step lasts microseconds on the GPU, so nothing but the kernels is launched:
    index tensors go to them as they are (int32 or int64), one int length for every sequence
    as an int.  ``entry``: the call's memo entry (:class:`_Checked`), which keeps the launch
    plan; ``None`` builds the plan for this call alone."""
    from flashtile.kernels import decode as kd

    compiling = torch.compiler.is_compiling()
    plan = None
    if entry is not None and not compiling:
        raw = kd.tuning_raw()
        plan = entry.plan
        if plan is None or entry.tuning != raw or entry.generation is not kd.plan_generation:
            plan = None
            entry.plan = None
    if plan is None or not entry.as_read:
        # The kernel reads entry b of the index tensors at offset b (block-table rows with their
        # own stride, columns at stride 1): strided views are copied first.
        as_read = ((not isinstance(cache_seqlens, torch.Tensor) or cache_seqlens.is_contiguous())
                   and (cache_batch_idx is None or cache_batch_idx.is_contiguous())
                   and (leftpad is None or leftpad.is_contiguous())
                   and (block_table is None or block_table.stride(1) == 1)
                   and (alibi_slopes is None or alibi_slopes.is_contiguous()))
        if not as_read:
            if isinstance(cache_seqlens, torch.Tensor):
                cache_seqlens = cache_seqlens.contiguous()
            cache_batch_idx = None if cache_batch_idx is None else cache_batch_idx.contiguous()
            leftpad = None if leftpad is None else leftpad.contiguous()
            if block_table is not None and block_table.stride(1) != 1:
                block_table = block_table.contiguous()
            alibi_slopes = None if alibi_slopes is None else alibi_slopes.contiguous()
        if plan is None:
            raw = kd.tuning_raw()
            plan = kd.step_plan(q, k_cache, v_cache, k, v, block_table, isinstance(cache_seqlens, torch.Tensor),
                                cache_batch_idx is not None, leftpad is not None, alibi_slopes, scale, left, right,
                                softcap, num_splits, rotary, kd.tuning_text(raw))
            if entry is not None and not compiling:
                entry.plan, entry.tuning, entry.generation, entry.as_read = plan, raw, kd.plan_generation, as_read
    cos, sin = (rotary[0], rotary[1]) if rotary is not None else (None, None)
    return plan.run(q, k_cache, v_cache, cache_seqlens, cache_batch_idx, block_table, leftpad, alibi_slopes, k, v,
                    cos, sin, bound=not compiling)


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    cache_seqlens=None,
    cache_batch_idx: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    num_splits: int = 0,
    return_lse: bool = False,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    rotary_interleaved: bool = False,
    cache_leftpad: torch.Tensor | None = None,
):
    """Attention of a few new query rows against a KV cache, appending new keys/values first.

    Args:
        q: ``(batch, seqlen_q, nheads, d)``; seqlen_q is small (1 for decoding).
        k_cache, v_cache: ``(batch_cache, seqlen_cache, nheads_k, d)`` or, with ``block_table``,
            paged ``(num_blocks, page_size, nheads_k, d)``.  Updated in place when k, v are given.
        k, v: optional new ``(batch, seqlen_new, nheads_k, d)`` written at ``cache_seqlens[b] ...``.
        cache_seqlens: int or int32 ``(batch,)`` valid lengths before the append (default: full).
        cache_batch_idx: int32 ``(batch,)`` rows of a contiguous cache to use for each sequence.
        block_table: int32 ``(batch, max_blocks)``; ``block_table[b, i]`` holds positions
            ``i * page_size ... (i + 1) * page_size - 1`` of sequence b.
        num_splits: split-KV chunks per (sequence, kv head) on a GPU; 0 picks from the shape
            and the SM count.  The result does not depend on it beyond rounding.
        rotary_cos, rotary_sin: ``(seqlen_ro, rotary_dim / 2)``, given together: rotary
            embedding (see :func:`flashtile.apply_rotary_emb`) applied inside the call -- the
            new ``k`` row i at position ``cache_seqlens[b] + i`` before it is written (the
            cache holds rotated keys), ``q`` row i at ``cache_seqlens[b] + i`` with ``causal``
            or a window, else every ``q`` row at ``cache_seqlens[b]`` (flash-attn's rule).
        rotary_interleaved: pairs ``(2k, 2k + 1)`` (GPT-J) instead of ``(k, k + rotary_dim / 2)``
            (GPT-NeoX, the default here; flash-attn's own default is interleaved).
        cache_leftpad: int32 ``(batch,)``: sequence b's keys start at cache position
            ``cache_leftpad[b]`` (a left-padded cache): its keys are positions
            ``cache_leftpad[b] <= j < cache_seqlens[b]`` (+ the appended ones), masks and ALiBi
            are aligned as if they started at 0, and rotary positions count from there
            (``cache_seqlens[b] - cache_leftpad[b] + i``).
        Other arguments as in :func:`flashtile.flash_attn_func`.

    Returns:
        ``out`` like q, or ``(out, lse)`` with lse float32 ``(batch, nheads, seqlen_q)``.
    """
    entry = _checked_arguments(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, softmax_scale,
                               causal, window_size, softcap, alibi_slopes, num_splits, return_lse, cache_leftpad,
                               rotary_cos, rotary_sin, rotary_interleaved)
    params, capacity = entry.params, entry.capacity
    batch = q.shape[0]
    seqlen_new = 0 if k is None else k.shape[1]
    if cache_seqlens is None:
        cache_seqlens = capacity if k is None else 0
    is_cuda = q.is_cuda
    if not is_cuda or check_device_values:
        check_kvcache_index_values(cache_seqlens, cache_batch_idx, block_table, seqlen_new=seqlen_new,
                                   capacity=capacity, cache_rows=k_cache.shape[0], cache_leftpad=cache_leftpad)
    elif cache_seqlens.__class__ is int:
        # An int is checked for free; index *tensors* on a GPU are not read on the host (that
        # would wait for the GPU every step): the kernels clamp them (see check_device_values).
        check_kvcache_length(cache_seqlens, seqlen_new, capacity)
    if seqlen_new == 0:
        k = v = None  # nothing to write: an empty append is no append
    rotary = None
    if rotary_cos is not None or rotary_sin is not None:
        # Checked before anything is computed or written, so a bad table changes nothing in
        # the cache.  Positions count from the left padding.
        local = params.window_left >= 0 or params.window_right >= 0
        if not is_cuda:
            positions = cache_seqlens if cache_leftpad is None else cache_seqlens - cache_leftpad
            q, k = _rotate(q, k, rotary_cos, rotary_sin, rotary_interleaved, positions, local)
        else:
            # The split kernel rotates q and the new keys.  On a GPU a position tensor is checked
            # by dtype, shape and device only (cache_leftpad's stand in for the difference), so
            # the checks are memoised with the call's key; an int position is checked per call
            # against the table's length.
            positions = cache_seqlens if cache_leftpad is None else cache_leftpad
            span = max(q.shape[1] if local else 1, seqlen_new)
            if (not entry.rotary_ok or (positions.__class__ is int and not (
                    0 <= positions and positions + span <= rotary_cos.shape[0]))):
                _check_rotary_fused(q, k, rotary_cos, rotary_sin, rotary_interleaved, positions, local)
                entry.rotary_ok = True
            rotary = (rotary_cos, rotary_sin, rotary_interleaved, local)
    args = (params.softmax_scale, params.window_left, params.window_right, params.softcap, alibi_slopes)
    if is_cuda:
        out, lse = _step_triton(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, *args,
                                num_splits, leftpad=cache_leftpad, rotary=rotary, entry=entry)
        return (out, lse) if return_lse else out
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=q.device)
    rows = cache_batch_idx.long() if cache_batch_idx is not None else torch.arange(batch)
    with torch.no_grad():
        if k is not None:
            _append(k_cache, v_cache, k, v, cache_seqlens, rows, block_table)
            seqlens_k = cache_seqlens + seqlen_new
        else:
            seqlens_k = cache_seqlens
        out, lse = _attend_cpu(q, k_cache, v_cache, seqlens_k, rows, block_table, *args, leftpad=cache_leftpad)
    return (out, lse) if return_lse else out
