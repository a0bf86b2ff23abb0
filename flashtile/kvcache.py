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
from flashtile.devices import on_input_device
from flashtile.validation import (
    check_kvcache_arguments,
    check_kvcache_index_values,
    check_kvcache_length,
    check_kvcache_rotary,
    check_kvcache_rotary_pair,
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


# check_kvcache_arguments, passed once for a key (below), passes again for every call with
# that key: it reads the arguments' classes, shapes, strides, dtypes and devices and the
# scalars' types and values, all of which are in it.  So a decoding loop, one key for
# thousands of steps, pays it once; a call with a new key (a bad one included) runs it in
# full, and a failing call caches nothing.  What depends on index values (an int
# ``cache_seqlens`` against the capacity, index tensors on the CPU) is checked at every
# call, after this.
# The key also holds everything the GPU step's launch plan reads, so an entry keeps that
# plan too (see _step_triton): one key per call for the checks and the launches.
_MAX_CHECKED = 256
_checked: dict = {}
_Tensor = torch.Tensor


class _Checked:
    """A memo entry: the checks' results (``params``, ``capacity``); ``interleaved``: once the
    rotary tables are checked against q and k, ``rotary_interleaved`` as a bool, else None
    (positions by class; an int one is checked per call); the GPU launch plan with the tuning
    value and plan generation it was built under, and whether the index tensors are already
    as the kernel reads them."""

    __slots__ = ("params", "capacity", "interleaved", "plan", "tuning", "generation", "as_read")

    def __init__(self, params, capacity):
        self.params, self.capacity = params, capacity
        self.interleaved = None
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
    """:func:`~flashtile.validation.check_kvcache_arguments` as a :class:`_Checked`, memoised by
    key (see ``_checked``; the rotary arguments are in the key, for the rotary checks and the
    plan); not while torch.compile traces (the shapes may be symbolic: the checks are traced as they stand)."""
    args = (q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, softmax_scale, causal,
            window_size, softcap, alibi_slopes, num_splits, return_lse, cache_leftpad)
    if torch.compiler.is_compiling():
        return _Checked(*check_kvcache_arguments(*args))
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
        return _Checked(*check_kvcache_arguments(*args))
    if checked is None:
        checked = _Checked(*check_kvcache_arguments(*args))
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


def _rotate(q, k, cos, sin, interleaved, positions, local):
    """(q, k) with the rotary embedding at their cache positions (see flash_attn_with_kvcache),
    computed by :func:`flashtile.apply_rotary_emb` (the CPU path)."""
    from flashtile.rotary import apply_rotary_emb

    interleaved = check_kvcache_rotary_pair(cos, sin, interleaved)
    if k is not None:
        k = apply_rotary_emb(k, cos, sin, interleaved=interleaved, seqlen_offsets=positions)
    if local:
        return apply_rotary_emb(q, cos, sin, interleaved=interleaved, seqlen_offsets=positions), k
    # Every query row at position cache_seqlens[b]: the rows become one position's heads.
    batch, seqlen_q, nheads, d = q.shape
    flat = q.reshape(batch, 1, seqlen_q * nheads, d)
    q = apply_rotary_emb(flat, cos, sin, interleaved=interleaved, seqlen_offsets=positions).reshape(q.shape)
    return q, k


def _attend_cpu(q, k_cache, v_cache, seqlens_k, batch_rows, block_table, scale, left, right, softcap, alibi_slopes,
                leftpad=None):
    """Per sequence: its keys (from ``leftpad[b]`` on) and the CPU path.  A contiguous cache is
    read through slices, without copies, and in one call when every sequence has the same
    keys' span and the cache rows ``0 ... batch - 1``; a paged cache's keys are gathered."""
    batch = q.shape[0]
    lens = seqlens_k.tolist()
    starts = leftpad.tolist() if leftpad is not None else [0] * batch
    rows = batch_rows.tolist()
    if (block_table is None and rows == list(range(batch)) and len(set(lens)) <= 1 and len(set(starts)) <= 1
            and batch > 0):
        span = slice(starts[0], lens[0])
        out, lse = cpu.attention_forward(q, k_cache[:batch, span], v_cache[:batch, span], scale, left, right,
                                         softcap=softcap, alibi_slopes=alibi_slopes)
        return out, lse.float()
    out = torch.zeros_like(q)
    lse = torch.full((batch, q.shape[2], q.shape[1]), float("-inf"), dtype=torch.float32, device=q.device)
    for b, n in enumerate(lens):
        if block_table is None:
            kb, vb = k_cache[rows[b]:rows[b] + 1, starts[b]:n], v_cache[rows[b]:rows[b] + 1, starts[b]:n]
        else:
            positions = torch.arange(starts[b], n, device=q.device)[None, :]
            idx, pos = _physical_rows(positions, batch_rows[b:b + 1], block_table[b:b + 1], k_cache.shape[1])
            kb, vb = k_cache[idx[0], pos[0]][None], v_cache[idx[0], pos[0]][None]
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
                 alibi_slopes, num_splits, leftpad=None, rotary=None, entry=None, need_lse=True):
    """The append (if ``k`` is given) and the attention, on checked arguments, in one split
    kernel launch (plus the combine kernel for a step of many splits or one captured into a
    CUDA graph; see ``decode.MERGE_LAST_MAX_SPLITS``): the kernel writes the new keys
    into the cache and attends to them; with ``rotary`` ``(cos, sin, interleaved, local)`` it
    rotates q and the new keys (see :func:`flashtile.kernels.decode._decode_split`).

    A decoding step lasts microseconds on the GPU, so nothing but the kernels is launched:
    index tensors go to them as they are (int32 or int64), one int length for every sequence
    as an int.  ``entry``: the call's memo entry (:class:`_Checked`), which keeps the launch
    plan; ``None`` builds the plan for this call alone.  ``need_lse`` False: the LSE is not
    returned (None), nor allocated."""
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
                    cos, sin, bound=not compiling, need_lse=need_lse)


@on_input_device
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
            interleaved = entry.interleaved
            if (interleaved is None or (positions.__class__ is int and not (
                    0 <= positions and positions + span <= rotary_cos.shape[0]))):
                interleaved = entry.interleaved = check_kvcache_rotary(q, k, rotary_cos, rotary_sin,
                                                                       rotary_interleaved, positions, local)
            rotary = (rotary_cos, rotary_sin, interleaved, local)
    args = (params.softmax_scale, params.window_left, params.window_right, params.softcap, alibi_slopes)
    if is_cuda:
        out, lse = _step_triton(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, *args,
                                num_splits, leftpad=cache_leftpad, rotary=rotary, entry=entry, need_lse=return_lse)
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
