"""``apply_rotary_emb``'s arguments: the input, the cos / sin tables, the positions.

Also called by ``flash_attn_with_kvcache``, which rotates q and the new keys inside its
kernels: a bad table raises before anything is computed or written.
"""

from __future__ import annotations

import torch

from flashtile.validation.common import DTYPE_NAMES, SUPPORTED_DTYPES, check_bool
from flashtile.validation.indices import check_cu_seqlens


def check_rotary_arguments(x, cos, sin, interleaved, inplace, seqlen_offsets, cu_seqlens,
                           max_seqlen) -> tuple[bool, bool]:
    """Every rule of ``apply_rotary_emb``; returns ``(interleaved, inplace)`` as bools.

    Positions must lie in ``[0, seqlen_ro)``: checked for an int offset and for CPU offset
    tensors; a CUDA offset tensor is not read on the host (the kernel leaves a token whose
    position is past the table unrotated)."""
    varlen = cu_seqlens is not None
    layout = "(total, nheads, headdim) with cu_seqlens" if varlen else "(batch, seqlen, nheads, headdim)"
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor of shape {layout}, got {type(x).__name__}")
    if x.dim() != (3 if varlen else 4):
        raise ValueError(f"x must have shape {layout}, got {tuple(x.shape)}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"x must have dtype {DTYPE_NAMES}, got {x.dtype}")
    if x.device.type not in ("cpu", "cuda"):
        raise ValueError(f"x must be on a cpu or cuda device, got {x.device}")
    interleaved = check_bool("interleaved", interleaved)
    inplace = check_bool("inplace", inplace)

    for name, table in (("cos", cos), ("sin", sin)):
        if not isinstance(table, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of shape (seqlen_ro, rotary_dim / 2), got "
                            f"{type(table).__name__}")
        if table.dim() != 2 or table.shape[1] == 0:
            raise ValueError(f"{name} must have shape (seqlen_ro, rotary_dim / 2) with rotary_dim / 2 >= 1, "
                             f"got {tuple(table.shape)}")
        if table.device != x.device:
            raise ValueError(f"{name} must be on x's device ({x.device}), got {table.device}")
    if sin.shape != cos.shape:
        raise ValueError(f"sin must have cos's shape {tuple(cos.shape)}, got {tuple(sin.shape)}")
    if sin.dtype != cos.dtype:
        raise ValueError(f"cos and sin must share one dtype, got cos {cos.dtype} and sin {sin.dtype}")
    if cos.dtype not in (x.dtype, torch.float32):
        raise ValueError(f"cos and sin must have x's dtype ({x.dtype}) or torch.float32, got {cos.dtype}")
    seqlen_ro, half = cos.shape
    headdim = x.shape[-1]
    if 2 * half > headdim:
        raise ValueError(f"rotary_dim = 2 * cos.shape[1] = {2 * half} exceeds x's head dimension ({headdim})")

    if varlen:
        batch = check_cu_seqlens("cu_seqlens", cu_seqlens, x.shape[0], x.device, max_seqlen, "max_seqlen")
        seqlen = max_seqlen
    else:
        batch, seqlen = x.shape[0], x.shape[1]
    if seqlen > seqlen_ro:
        what = "max_seqlen" if varlen else "seqlen (x.shape[1])"
        raise ValueError(f"cos and sin hold {seqlen_ro} positions, fewer than {what} = {seqlen}")

    if isinstance(seqlen_offsets, torch.Tensor):
        _check_offset_tensor(seqlen_offsets, x, batch, seqlen, seqlen_ro, cu_seqlens)
    else:
        if isinstance(seqlen_offsets, bool) or not isinstance(seqlen_offsets, int):
            raise TypeError(f"seqlen_offsets must be an int or a (batch,) int tensor, got {type(seqlen_offsets).__name__}")
        if seqlen_offsets < 0 or seqlen_offsets + seqlen > seqlen_ro:
            raise ValueError(f"seqlen_offsets ({seqlen_offsets}) + seqlen ({seqlen}) must be within the {seqlen_ro} "
                             f"positions cos and sin hold (and the offset >= 0)")

    if inplace and x.requires_grad and x.is_leaf and torch.is_grad_enabled():
        raise ValueError("inplace=True cannot write into x, a leaf tensor that requires grad; "
                         "pass a non-leaf tensor or inplace=False")
    return interleaved, inplace


def _check_offset_tensor(seqlen_offsets, x, batch, seqlen, seqlen_ro, cu_seqlens) -> None:
    """A ``(batch,)`` int32 / int64 offset tensor on x's device; its values on the CPU."""
    if seqlen_offsets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"seqlen_offsets must be an int32 or int64 tensor, got {seqlen_offsets.dtype}")
    if tuple(seqlen_offsets.shape) != (batch,):
        raise ValueError(f"seqlen_offsets must have shape (batch,) = ({batch},), got {tuple(seqlen_offsets.shape)}")
    if seqlen_offsets.device != x.device:
        raise ValueError(f"seqlen_offsets must be on x's device ({x.device}), got {seqlen_offsets.device}")
    if not x.is_cuda and batch > 0:
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long() if cu_seqlens is not None else torch.full((batch,), seqlen)
        last = seqlen_offsets.long() + lengths
        if bool((seqlen_offsets < 0).any()) or int(last.max()) > seqlen_ro:
            raise ValueError(f"seqlen_offsets + sequence lengths must be in [0, {seqlen_ro}] (the positions cos "
                             f"and sin hold), got offsets {seqlen_offsets.tolist()} and ends {last.tolist()}")
