"""Argument checking for the public attention API.

Every public entry point calls :func:`check_attention_inputs` before any kernel sees a
tensor, so a wrong dtype, device, rank, shape or stride becomes a ``TypeError`` /
``ValueError`` that names the argument -- never a crash inside a kernel or a silent
wrong answer.  Supported-but-not-yet-implemented options raise ``NotImplementedError``.
"""

from __future__ import annotations

import math

import torch

from flashtile.masking import normalize_window
from flashtile.semantics.params import AttentionParams

MAX_HEADDIM = 256
# What the GPU kernels take.  The CPU path takes float64 as well (computed in float64
# throughout: exact attention, and the dtype torch.autograd.gradcheck needs).
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
CPU_DTYPES = SUPPORTED_DTYPES + (torch.float64,)
_DTYPE_NAMES = "torch.float16, torch.bfloat16 or torch.float32"
_CPU_DTYPE_NAMES = "torch.float16, torch.bfloat16, torch.float32 or torch.float64"


def check_dtype(name: str, dtype: torch.dtype, device_type: str) -> None:
    """float16 / bfloat16 / float32 anywhere; float64 on the CPU path only."""
    if dtype in SUPPORTED_DTYPES:
        return
    if dtype == torch.float64:
        if device_type == "cpu":
            return
        raise ValueError(f"{name} has dtype torch.float64, which the GPU kernels do not take (float64 runs on the CPU "
                         f"path only); on {device_type} use {_DTYPE_NAMES}")
    raise ValueError(f"{name} must have dtype {_CPU_DTYPE_NAMES if device_type == 'cpu' else _DTYPE_NAMES}, "
                     f"got {dtype}")


def check_tensor(name: str, t, rank: int, layout: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {layout}, got {type(t).__name__}")
    if t.dim() != rank:
        raise ValueError(f"{name} must have {rank} dimensions {layout}, got shape {tuple(t.shape)}")
    check_dtype(name, t.dtype, t.device.type)
    if t.stride(-1) != 1 and t.shape[-1] != 1:
        raise ValueError(
            f"{name} must be contiguous in its last (head) dimension, got strides {tuple(t.stride())}; "
            f"call .contiguous() first"
        )


def _type_name(value) -> str:
    """``float``, ``numpy.float32``: builtins by name, anything else with its module."""
    cls = type(value)
    return cls.__name__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def _is_numpy_bool(value) -> bool:
    # numpy is optional: recognise its bool scalar without importing it.
    cls = type(value)
    return cls.__module__ == "numpy" and cls.__name__ in ("bool", "bool_")


def _check_scalar(name: str, value, kind, accepted: str):
    if kind is bool and _is_numpy_bool(value):
        return bool(value)
    if isinstance(value, bool) and kind is not bool:
        raise TypeError(f"{name} must be {accepted}, got bool")
    if kind is float:
        if not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be {accepted}, got {_type_name(value)}")
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"{name} must be {accepted}, got {value}")
        return value
    if not isinstance(value, kind):
        raise TypeError(f"{name} must be {accepted}, got {_type_name(value)}")
    return value


def check_window(window_size) -> tuple[int, int]:
    if not isinstance(window_size, (tuple, list)):
        raise TypeError(f"window_size must be a pair (left, right) of ints, got {window_size!r}")
    if len(window_size) != 2:
        raise ValueError(f"window_size must be a pair (left, right) of ints, got {len(window_size)} values: {window_size!r}")
    for side, w in zip(("left", "right"), window_size):
        if isinstance(w, bool) or not isinstance(w, int):
            raise TypeError(f"window_size {side} must be an int (-1 = unbounded), got {w!r}")
        if w < -1:
            raise ValueError(f"window_size {side} must be >= -1 (-1 = unbounded), got {w}")
    return int(window_size[0]), int(window_size[1])


def check_float32_tensor(name: str, t, device, shapes: dict[tuple, str]) -> None:
    """A small float32 side tensor (ALiBi slopes, FP8 descales): a tensor, float32, on the
    inputs' device, with one of ``shapes`` (each with the words that explain it)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if t.dtype != torch.float32:
        raise ValueError(f"{name} must be torch.float32, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} must be on q's device ({device}), got {t.device}")
    if tuple(t.shape) not in shapes:
        accepted = " or ".join(f"{s} {words}".rstrip() for s, words in shapes.items())
        raise ValueError(f"{name} must have shape {accepted}, got {tuple(t.shape)}")


def check_alibi_slopes(alibi_slopes, batch, nheads, device) -> None:
    """ALiBi slopes: float32 ``(nheads,)`` or ``(batch, nheads)`` on the inputs' device."""
    shapes = {(nheads,): ""} | ({(batch, nheads): ""} if batch is not None else {})
    check_float32_tensor("alibi_slopes", alibi_slopes, device, shapes)


def check_attention_inputs(
    q,
    k,
    v,
    *,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    packed: bool = False,
    packed_batch: int | None = None,
) -> AttentionParams:
    """Validate dense ``(batch, seqlen, nheads, headdim)`` (or packed ``(total, nheads, headdim)``)
    inputs and return the normalised parameters (``alibi_slopes`` included; the dropout RNG's
    seed and offset are drawn later, only when ``dropout_p > 0``)."""
    rank = 3 if packed else 4
    layout_q = "(total_q, nheads, headdim)" if packed else "(batch, seqlen_q, nheads, headdim)"
    layout_k = "(total_k, nheads_k, headdim)" if packed else "(batch, seqlen_k, nheads_k, headdim)"
    check_tensor("q", q, rank, layout_q)
    check_tensor("k", k, rank, layout_k)
    check_tensor("v", v, rank, layout_k)
    if not packed and not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(
            f"q, k and v must have the same batch size, got {q.shape[0]}, {k.shape[0]}, {v.shape[0]}"
        )
    check_qkv_agree(q, k, v)
    params = check_attention_scalars(q.shape[-1], dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                                     window_size=window_size, softcap=softcap, deterministic=deterministic)
    if alibi_slopes is not None:
        check_alibi_slopes(alibi_slopes, batch=packed_batch if packed else q.shape[0], nheads=q.shape[-2],
                           device=q.device)
        params = params.with_alibi(alibi_slopes)
    return params


def check_qkv_agree(q, k, v, k_name: str = "k", v_name: str = "v") -> None:
    """What q, k and v (already shape-checked one by one) must share: dtype, device, the
    sequence / head axes of k and v, the head dimension, and nheads a multiple of nheads_k."""
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, {k_name} and {v_name} must share one dtype, got q {q.dtype}, {k_name} {k.dtype}, "
                         f"{v_name} {v.dtype}")
    device = q.device
    if k.device != device or v.device != device:
        raise ValueError(f"q, {k_name} and {v_name} must be on one device, got q {device}, {k_name} {k.device}, "
                         f"{v_name} {v.device}")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"q must be on a cpu or cuda device, got {device}")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"{k_name} and {v_name} must agree in all but the head dimension, got {k_name} "
                         f"{tuple(k.shape)}, {v_name} {tuple(v.shape)}")
    headdim = q.shape[-1]
    if k.shape[-1] != headdim:
        raise ValueError(f"q and {k_name} must have the same head dimension, got {headdim} and {k.shape[-1]}")
    if v.shape[-1] != headdim:
        raise ValueError(f"{v_name} must have the same head dimension as q ({headdim}), got {v.shape[-1]}")
    if not 1 <= headdim <= MAX_HEADDIM:
        raise ValueError(f"head dimension must be between 1 and {MAX_HEADDIM}, got {headdim}")
    nheads, nheads_k = q.shape[-2], k.shape[-2]
    if nheads_k == 0 or nheads % nheads_k != 0:
        raise ValueError(
            f"nheads of q ({nheads}) must be a multiple of nheads of {k_name}/{v_name} ({nheads_k}) (GQA/MQA)"
        )


def check_attention_scalars(headdim: int, *, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                            softcap=0.0, deterministic=False) -> AttentionParams:
    """The scalar arguments, checked and normalised (``causal`` folded into the window); no ALiBi
    slopes and no dropout seed or offset yet."""
    dropout_p = _check_scalar("dropout_p", dropout_p, float, "a float in [0, 1)")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if softmax_scale is None:
        softmax_scale = headdim ** -0.5
    softmax_scale = _check_scalar("softmax_scale", softmax_scale, float, "a finite float > 0 or None")
    if softmax_scale <= 0:
        # The kernels fold the scale into the row max (max(s) * scale), valid for scale > 0.
        raise ValueError(f"softmax_scale must be > 0 (or None for headdim ** -0.5), got {softmax_scale}")
    causal = _check_scalar("causal", causal, bool, "a bool")
    left, right = normalize_window(causal, check_window(window_size))
    softcap = _check_scalar("softcap", softcap, float, "a finite float >= 0")
    if softcap < 0:
        raise ValueError(f"softcap must be >= 0 (0 = off), got {softcap}")
    deterministic = _check_scalar("deterministic", deterministic, bool, "a bool")
    return AttentionParams(
        softmax_scale=softmax_scale,
        window_left=left,
        window_right=right,
        softcap=softcap,
        dropout_p=dropout_p,
        deterministic=deterministic,
    )


# ----------------------------------------------------------------------------------------
# Index-like inputs (cu_seqlens, cache_seqlens, cache_batch_idx, block_table)
# ----------------------------------------------------------------------------------------
#
# Their dtype, shape and device are checked on every call.  Their *values* decide which
# memory a kernel touches, so they are checked too, before anything is written -- but
# reading a CUDA tensor's values on the host is a device-to-host copy that waits for the
# GPU (a sync), impossible inside CUDA-graph capture and a graph break under
# torch.compile.  The rule: values are read whenever ``values_readable`` says so (CPU
# tensors always; CUDA tensors outside capture and tracing, with one copy for all of a
# call's index tensors, so one sync per call).  When they cannot be read, the kernels
# that take them (the decode and append kernels) clamp every index they load, so no
# value makes them read or write out of bounds.


def values_readable(*tensors) -> bool:
    """Whether the values of ``tensors`` may be read on the host now: not while torch.compile
    traces, and for CUDA tensors not while the current stream captures a CUDA graph."""
    if torch.compiler.is_compiling():
        return False
    if any(t.is_cuda for t in tensors if isinstance(t, torch.Tensor)):
        return not torch.cuda.is_current_stream_capturing()
    return True


def to_host(*tensors) -> list[torch.Tensor]:
    """CPU int64 copies of index tensors, with one device-to-host copy (one sync) for all of
    them when they are on a GPU."""
    present = [t for t in tensors if t is not None]
    if not present or not present[0].is_cuda:
        flat = [t.long() for t in present]
    else:
        joined = torch.cat([t.reshape(-1).long() for t in present]).cpu()
        flat = list(joined.split([t.numel() for t in present]))
        flat = [f.reshape(t.shape) for f, t in zip(flat, present)]
    it = iter(flat)
    return [None if t is None else next(it) for t in tensors]


def check_index_tensor(name: str, t, device, shape: tuple, layout: str) -> None:
    """An int32 / int64 index tensor of ``shape`` (``None`` entries: any size) on ``device``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {layout}, got {_type_name(t)}")
    if t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be an int32 (or int64) tensor, got {t.dtype}")
    if t.dim() != len(shape) or any(want is not None and got != want for got, want in zip(t.shape, shape)):
        raise ValueError(f"{name} must have shape {layout}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on q's device ({device}), got {t.device}")


def check_max_seqlen(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {_type_name(value)}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def check_cu_seqlens(name: str, cu_seqlens, total: int, device, max_seqlen, max_name: str, values: bool = True) -> int:
    """``cu_seqlens``: int32, 1-D, ``batch + 1`` entries on ``device``; ``max_seqlen`` an int
    >= 0.  Returns batch.  With ``values``, also :func:`check_cu_seqlens_values` (a caller
    with two such tensors passes False and checks both values with one copy)."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (int32 prefix sums), got {_type_name(cu_seqlens)}")
    if cu_seqlens.dtype != torch.int32:
        raise ValueError(f"{name} must be torch.int32, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"{name} must be 1-D with batch + 1 >= 2 entries, got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.device != device:
        raise ValueError(f"{name} must be on q's device ({device}), got {cu_seqlens.device}")
    check_max_seqlen(max_name, max_seqlen)
    if values:
        check_cu_seqlens_values((name, cu_seqlens, total, max_seqlen, max_name))
    return cu_seqlens.numel() - 1


def check_cu_seqlens_values(*specs) -> None:
    """Each ``(name, cu_seqlens, total, max_seqlen, max_name)``: 0 first, non-decreasing, the
    packed length ``total`` last (``None``: no packed tensor, e.g. paged keys), no sequence
    longer than ``max_seqlen`` -- when the values are readable (one device-to-host copy for
    all of them on a GPU)."""
    if not values_readable(*(spec[1] for spec in specs)):
        return
    for (name, _, total, max_seqlen, max_name), cu in zip(specs, to_host(*(spec[1] for spec in specs))):
        lens = cu[1:] - cu[:-1]
        bad = (lens < 0).nonzero()
        if int(cu[0]) != 0 or bad.numel() or (total is not None and int(cu[-1]) != total):
            where = (f"{name}[0] = {int(cu[0])}" if int(cu[0]) != 0 else
                     f"{name}[{int(bad[0]) + 1}] = {int(cu[int(bad[0]) + 1])} < {name}[{int(bad[0])}] = "
                     f"{int(cu[int(bad[0])])}" if bad.numel() else f"{name}[-1] = {int(cu[-1])}")
            end = f" and end at the packed length {total}" if total is not None else ""
            raise ValueError(f"{name} must start at 0, be non-decreasing{end}; got {where} ({cu.tolist()})")
        longest = int(lens.max())
        if longest > max_seqlen:
            raise ValueError(f"{max_name} ({max_seqlen}) is smaller than the longest sequence "
                             f"({longest}, sequence {int(lens.argmax())})")


def check_paged_kv(q, k, v, block_table, batch: int) -> None:
    """Paged keys and values for packed queries: ``k``, ``v`` ``(num_blocks, page_size,
    nheads_k, headdim)`` alike, ``block_table`` an int32 ``(batch, max_blocks)`` index tensor on
    q's device, and no gradient asked of anything (the paged forward has no backward)."""
    for name, t in (("k", k), ("v", v)):
        check_tensor(name, t, 4, "(num_blocks, page_size, nheads_k, headdim) with block_table")
    if k.shape != v.shape:
        raise ValueError(f"k and v must be paged alike with block_table, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[0] == 0 or k.shape[1] == 0:
        raise ValueError(f"k must hold at least one page of at least one row with block_table, got {tuple(k.shape)}")
    check_index_tensor("block_table", block_table, q.device, (batch, None), f"(batch={batch}, max_blocks)")
    if block_table.shape[1] == 0:
        raise ValueError(f"block_table must have at least one column (block), got shape {tuple(block_table.shape)}")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise NotImplementedError("block_table: attention over paged keys and values is forward only (inference); "
                                  "call it under torch.no_grad() or on tensors that do not require grad")


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
    if not values_readable(*tensors):
        return
    lens, rows, table, pads = to_host(cache_seqlens if isinstance(cache_seqlens, torch.Tensor) else None,
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
