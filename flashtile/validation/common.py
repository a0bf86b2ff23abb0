"""The rules every family shares: dtypes, one tensor's rank and layout, scalars.

Each rule raises ``TypeError`` for a value of the wrong type and ``ValueError`` for a wrong
value, shape, dtype, device or layout, with a message that names the argument; a rule that
normalises (a scalar to ``float``, a numpy bool to ``bool``) returns the normalised value.
"""

from __future__ import annotations

import math

import torch

MAX_HEADDIM = 256
# What the GPU kernels take.  The CPU path takes float64 as well (computed in float64
# throughout: exact attention, and the dtype torch.autograd.gradcheck needs).
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
CPU_DTYPES = SUPPORTED_DTYPES + (torch.float64,)
DTYPE_NAMES = "torch.float16, torch.bfloat16 or torch.float32"
CPU_DTYPE_NAMES = "torch.float16, torch.bfloat16, torch.float32 or torch.float64"


def type_name(value) -> str:
    """``float``, ``numpy.float32``: builtins by name, anything else with its module."""
    cls = type(value)
    return cls.__name__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def _is_numpy_bool(value) -> bool:
    # numpy is optional: recognise its bool scalar without importing it.
    cls = type(value)
    return cls.__module__ == "numpy" and cls.__name__ in ("bool", "bool_")


# ----------------------------------------------------------------------------------------
# Tensors
# ----------------------------------------------------------------------------------------


def check_dtype(name: str, dtype: torch.dtype, device_type: str) -> None:
    """float16 / bfloat16 / float32 anywhere; float64 on the CPU path only."""
    if dtype in SUPPORTED_DTYPES:
        return
    if dtype == torch.float64:
        if device_type == "cpu":
            return
        raise ValueError(f"{name} has dtype torch.float64, which the GPU kernels do not take (float64 runs on the CPU "
                         f"path only); on {device_type} use {DTYPE_NAMES}")
    raise ValueError(f"{name} must have dtype {CPU_DTYPE_NAMES if device_type == 'cpu' else DTYPE_NAMES}, "
                     f"got {dtype}")


def check_rank(name: str, t, rank: int, layout: str) -> None:
    """A ``torch.Tensor`` with ``rank`` dimensions (``layout`` names them)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {layout}, got {type(t).__name__}")
    if t.dim() != rank:
        raise ValueError(f"{name} must have {rank} dimensions {layout}, got shape {tuple(t.shape)}")


def check_tensor(name: str, t, rank: int, layout: str, *, dtype: torch.dtype | None = None,
                 dtype_hint: str = "") -> None:
    """:func:`check_rank`, a dtype the kernels take (:func:`check_dtype`, or exactly ``dtype``
    when given; ``dtype_hint`` says where to get one), and unit stride in the last (head)
    dimension, the one layout rule the kernels have."""
    check_rank(name, t, rank, layout)
    if dtype is None:
        check_dtype(name, t.dtype, t.device.type)
    elif t.dtype != dtype:
        raise ValueError(f"{name} must have dtype {dtype}{dtype_hint}, got {t.dtype}")
    if t.stride(-1) != 1 and t.shape[-1] != 1:
        raise ValueError(
            f"{name} must be contiguous in its last (head) dimension, got strides {tuple(t.stride())}; "
            f"call .contiguous() first"
        )


def check_same_device(q, k, v, k_name: str = "k", v_name: str = "v") -> None:
    """q, k and v on one device, a cpu or cuda one."""
    device = q.device
    if k.device != device or v.device != device:
        raise ValueError(f"q, {k_name} and {v_name} must be on one device, got q {device}, {k_name} {k.device}, "
                         f"{v_name} {v.device}")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"q must be on a cpu or cuda device, got {device}")


def check_gqa_heads(nheads: int, nheads_k: int, kv_name: str = "k/v") -> None:
    """Query heads a multiple of the key/value heads (GQA/MQA), at least one key/value head."""
    if nheads_k == 0 or nheads % nheads_k != 0:
        raise ValueError(
            f"nheads of q ({nheads}) must be a multiple of nheads of {kv_name} ({nheads_k}) (GQA/MQA)"
        )


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


# ----------------------------------------------------------------------------------------
# Scalars
# ----------------------------------------------------------------------------------------


def check_scalar(name: str, value, kind, accepted: str):
    """``value`` of type ``kind`` (``bool``, ``int``, ``float`` or a tuple of types); returns it.

    A bool is never taken for a number; a numpy bool is a bool.  ``float`` takes ints and
    floats, returns a ``float`` and rejects NaN and infinities.  ``accepted`` completes the
    message: "``name`` must be ``accepted``, got ..."."""
    if kind is bool and _is_numpy_bool(value):
        return bool(value)
    if isinstance(value, bool) and kind is not bool:
        raise TypeError(f"{name} must be {accepted}, got bool")
    if kind is float:
        if not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be {accepted}, got {type_name(value)}")
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"{name} must be {accepted}, got {value}")
        return value
    if not isinstance(value, kind):
        raise TypeError(f"{name} must be {accepted}, got {type_name(value)}")
    return value


def check_bool(name: str, value) -> bool:
    """A bool (a numpy bool is one)."""
    return check_scalar(name, value, bool, "a bool")


def check_dropout_p(dropout_p) -> float:
    """A float in ``[0, 1)``."""
    dropout_p = check_scalar("dropout_p", dropout_p, float, "a float in [0, 1)")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    return dropout_p


def check_softmax_scale(softmax_scale, headdim: int) -> float:
    """A finite float > 0; ``None`` is ``headdim ** -0.5``."""
    if softmax_scale is None:
        softmax_scale = headdim ** -0.5
    softmax_scale = check_scalar("softmax_scale", softmax_scale, float, "a finite float > 0 or None")
    if softmax_scale <= 0:
        # The kernels fold the scale into the row max (max(s) * scale), valid for scale > 0.
        raise ValueError(f"softmax_scale must be > 0 (or None for headdim ** -0.5), got {softmax_scale}")
    return softmax_scale


def check_window(window_size) -> tuple[int, int]:
    """A pair ``(left, right)`` of ints >= -1 (-1 = unbounded)."""
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

