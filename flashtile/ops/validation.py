"""Argument checking for the public attention API.

Every public entry point calls :func:`check_attention_inputs` before any kernel sees a
tensor, so a wrong dtype, device, rank, shape or stride becomes a ``TypeError`` /
``ValueError`` that names the argument -- never a crash inside a kernel or a silent
wrong answer.  Supported-but-not-yet-implemented options raise ``NotImplementedError``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from flashtile.masking import normalize_window

MAX_HEADDIM = 256
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_DTYPE_NAMES = "torch.float16, torch.bfloat16 or torch.float32"


@dataclass(frozen=True)
class AttentionParams:
    """The normalised scalar arguments every backend receives."""

    softmax_scale: float
    window_left: int
    window_right: int
    softcap: float
    dropout_p: float
    deterministic: bool


def _check_tensor(name: str, t, rank: int, layout: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {layout}, got {type(t).__name__}")
    if t.dim() != rank:
        raise ValueError(f"{name} must have {rank} dimensions {layout}, got shape {tuple(t.shape)}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name} must have dtype {_DTYPE_NAMES}, got {t.dtype}")
    if t.stride(-1) != 1 and t.shape[-1] != 1:
        raise ValueError(
            f"{name} must be contiguous in its last (head) dimension, got strides {tuple(t.stride())}; "
            f"call .contiguous() first"
        )


def _check_scalar(name: str, value, kind, accepted: str):
    if isinstance(value, bool) and kind is not bool:
        raise TypeError(f"{name} must be {accepted}, got bool")
    if kind is float:
        if not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be {accepted}, got {type(value).__name__}")
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"{name} must be {accepted}, got {value}")
        return value
    if not isinstance(value, kind):
        raise TypeError(f"{name} must be {accepted}, got {type(value).__name__}")
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
    inputs and return the normalised scalar parameters."""
    rank = 3 if packed else 4
    layout_q = "(total_q, nheads, headdim)" if packed else "(batch, seqlen_q, nheads, headdim)"
    layout_k = "(total_k, nheads_k, headdim)" if packed else "(batch, seqlen_k, nheads_k, headdim)"
    _check_tensor("q", q, rank, layout_q)
    _check_tensor("k", k, rank, layout_k)
    _check_tensor("v", v, rank, layout_k)
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
    """The scalar arguments, checked and normalised (``causal`` folded into the window)."""
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


def check_cu_seqlens(name: str, cu_seqlens, total: int, device, max_seqlen, max_name: str) -> int:
    """``cu_seqlens``: int32, 1-D, ``batch + 1`` prefix sums ending at ``total``.  Returns batch.

    The values themselves (0 first, non-decreasing, last == total) are checked only for CPU
    tensors: on a GPU that check would cost a device-to-host sync on every call.
    """
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (int32 prefix sums), got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise ValueError(f"{name} must be torch.int32, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"{name} must be 1-D with batch + 1 >= 2 entries, got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.device != device:
        raise ValueError(f"{name} must be on q's device ({device}), got {cu_seqlens.device}")
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < 0:
        raise TypeError(f"{max_name} must be a non-negative int, got {max_seqlen!r}")
    if cu_seqlens.device.type == "cpu":
        lens = cu_seqlens[1:] - cu_seqlens[:-1]
        if int(cu_seqlens[0]) != 0 or bool((lens < 0).any()) or int(cu_seqlens[-1]) != total:
            raise ValueError(
                f"{name} must start at 0, be non-decreasing and end at the packed length {total}, "
                f"got {cu_seqlens.tolist()}"
            )
        if int(lens.max()) > max_seqlen:
            raise ValueError(f"{max_name} ({max_seqlen}) is smaller than the longest sequence ({int(lens.max())})")
    return cu_seqlens.numel() - 1
