"""Index-like inputs: ``cu_seqlens``, ``cache_seqlens``, ``cache_batch_idx``, ``block_table``.

Their dtype, shape and device are checked on every call.  Their *values* decide which
memory a kernel touches, so they are checked too, before anything is written -- but
reading a CUDA tensor's values on the host is a device-to-host copy that waits for the
GPU (a sync), impossible inside CUDA-graph capture and a graph break under
torch.compile.  The rule: values are read whenever :func:`values_readable` says so (CPU
tensors always; CUDA tensors outside capture and tracing, with one copy for all of a
call's index tensors, so one sync per call).  When they cannot be read, the kernels
that take them (the decode and append kernels) clamp every index they load, so no
value makes them read or write out of bounds.

:func:`to_host` is the one place index values are copied to the host.
"""

from __future__ import annotations

import weakref

import torch

from flashtile.validation.common import check_scalar, type_name


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
        raise TypeError(f"{name} must be a torch.Tensor {layout}, got {type_name(t)}")
    if t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be an int32 (or int64) tensor, got {t.dtype}")
    if t.dim() != len(shape) or any(want is not None and got != want for got, want in zip(t.shape, shape)):
        raise ValueError(f"{name} must have shape {layout}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on q's device ({device}), got {t.device}")



def check_block_table(block_table, device, batch: int) -> None:
    """A page table: an int32 / int64 ``(batch, max_blocks)`` index tensor on ``device`` with at
    least one column."""
    check_index_tensor("block_table", block_table, device, (batch, None), f"(batch={batch}, max_blocks)")
    if block_table.shape[1] == 0:
        raise ValueError(f"block_table must have at least one column (block), got shape {tuple(block_table.shape)}")

def check_max_seqlen(name: str, value) -> int:
    """An int >= 0."""
    value = check_scalar(name, value, int, "an int")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def check_cu_seqlens(name: str, cu_seqlens, total: int, device, max_seqlen, max_name: str, values: bool = True) -> int:
    """``cu_seqlens``: int32, 1-D, ``batch + 1`` entries on ``device``; ``max_seqlen`` an int
    >= 0.  Returns batch.  With ``values``, also :func:`check_cu_seqlens_values` (a caller
    with two such tensors passes False and checks both values with one copy)."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (int32 prefix sums), got {type_name(cu_seqlens)}")
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


def check_cu_seqlens_pair(cu_seqlens_q, cu_seqlens_k, total_q: int, total_k: int, device, max_seqlen_q,
                          max_seqlen_k, values: bool = True) -> int:
    """``cu_seqlens_q`` and ``cu_seqlens_k`` (each as :func:`check_cu_seqlens`) describing one
    batch: the same number of sequences.  Returns batch."""
    batch = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, total_q, device, max_seqlen_q, "max_seqlen_q", values=values)
    batch_k = check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, total_k, device, max_seqlen_k, "max_seqlen_k",
                               values=values)
    if batch_k != batch:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same batch, got {batch} and {batch_k} sequences")
    return batch


# cu_seqlens tensors whose values passed check_cu_seqlens_values: (id, packed length, max_seqlen)
# -> (a weak reference to the tensor, its version counter then).
_passed: dict[tuple, tuple] = {}
_MAX_PASSED = 64


def _version(t):
    """``t``'s version counter, or None for a tensor without one (made under inference mode)."""
    return None if t.is_inference() else t._version


def _already_passed(spec) -> bool:
    _, t, total, max_seqlen, _ = spec
    entry = _passed.get((id(t), total, max_seqlen))
    return entry is not None and entry[0]() is t and entry[1] is not None and entry[1] == _version(t)


def check_cu_seqlens_values(*specs) -> None:
    """Each ``(name, cu_seqlens, total, max_seqlen, max_name)``: 0 first, non-decreasing, the
    packed length ``total`` last (``None``: no packed tensor, e.g. paged keys), no sequence
    longer than ``max_seqlen`` -- when the values are readable (one device-to-host copy for
    all of them on a GPU).

    A tensor whose values passed is remembered with its version counter, which every in-place
    change through PyTorch bumps: a model's layers call with one batch's ``cu_seqlens`` again
    and again, and only the first call copies it to the host (a sync that would otherwise
    leave the GPU idle while the host prepares each layer's launch).  Values written into it
    outside PyTorch (through its raw pointer) are not seen; the kernels clamp every
    ``cu_seqlens`` value they load, so even those cannot make them read or write out of
    bounds."""
    if all(_already_passed(spec) for spec in specs) or not values_readable(*(spec[1] for spec in specs)):
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
    for _, t, total, max_seqlen, _ in specs:
        if len(_passed) >= _MAX_PASSED:
            _passed.clear()
        _passed[id(t), total, max_seqlen] = (weakref.ref(t), _version(t))
