"""The terms the IO model counts in: shapes, element sizes, kernel tiles, and the per-kernel
results (bytes read and written, matmul FLOPs) that :mod:`flashtile.analysis.iomodel` and
:mod:`flashtile.analysis.paper` produce."""

from __future__ import annotations

import types
from dataclasses import dataclass, field

VARIANTS = ("no_l2", "ideal_l2")
MODES = ("fwd", "bwd", "fwd_bwd")
IMPLS = ("naive", "flashtile")

DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
DTYPE_ALIASES = {"fp16": "float16", "half": "float16", "bf16": "bfloat16", "fp32": "float32", "float": "float32"}
STAT_BYTES = 4  # LSE, D, LSE2: always float32 in the kernels
MASK_BYTES = 1  # torch.bool


# --- Results ------------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelIO:
    """One kernel launch (or one group of identical ones): HBM bytes and matmul FLOPs."""

    name: str
    bytes_read: int
    bytes_written: int
    flops: int = 0
    note: str = ""

    @property
    def total_bytes(self) -> int:
        return self.bytes_read + self.bytes_written


@dataclass(frozen=True)
class IOEstimate:
    """The kernels of one implementation, one mode, one variant; totals as properties."""

    label: str
    kernels: tuple[KernelIO, ...] = field(default_factory=tuple)

    @property
    def bytes_read(self) -> int:
        return sum(k.bytes_read for k in self.kernels)

    @property
    def bytes_written(self) -> int:
        return sum(k.bytes_written for k in self.kernels)

    @property
    def total_bytes(self) -> int:
        return self.bytes_read + self.bytes_written

    @property
    def flops(self) -> int:
        return sum(k.flops for k in self.kernels)

    def __add__(self, other: IOEstimate) -> IOEstimate:
        return IOEstimate(f"{self.label} + {other.label}", self.kernels + other.kernels)

    def table(self) -> str:
        """The per-kernel rows and the total, as aligned text."""
        width = max([len(k.name) for k in self.kernels] + [5])
        lines = [self.label, f"  {'kernel':<{width}}  {'read':>10}  {'written':>10}  {'GFLOP':>9}"]
        for k in self.kernels:
            lines.append(f"  {k.name:<{width}}  {format_bytes(k.bytes_read):>10}  "
                         f"{format_bytes(k.bytes_written):>10}  {k.flops / 1e9:>9.2f}")
        lines.append(f"  {'total':<{width}}  {format_bytes(self.bytes_read):>10}  "
                     f"{format_bytes(self.bytes_written):>10}  {self.flops / 1e9:>9.2f}")
        return "\n".join(lines)


def format_bytes(n: float) -> str:
    """Decimal units, as the FlashAttention paper counts them (1 GB = 1e9 bytes)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


# --- Inputs -------------------------------------------------------------------------------


def dtype_name(dtype) -> str:
    """Canonical name ("float16", "bfloat16", "float32") of a dtype given as a name or alias
    ("bf16", "fp16", "fp32", ...) or as a torch dtype."""
    name = str(dtype).replace("torch.", "")
    name = DTYPE_ALIASES.get(name, name)
    if name not in DTYPE_BYTES:
        accepted = ", ".join(sorted(DTYPE_BYTES) + sorted(DTYPE_ALIASES))
        raise ValueError(f"dtype must be one of {accepted} (or the torch dtype); got {dtype!r}")
    return name


def dtype_bytes(dtype) -> int:
    """Bytes per element of a dtype (see :func:`dtype_name`)."""
    return DTYPE_BYTES[dtype_name(dtype)]


def positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True)
class AttentionShape:
    """Shape of one attention call, flash-attn layout ``(batch, seqlen, nheads, headdim)``.

    ``seqlen_k`` defaults to ``seqlen_q`` and ``nheads_k`` to ``nheads`` (GQA/MQA when
    smaller; it must divide ``nheads``).  ``causal`` is the bottom-right aligned mask.
    """

    batch: int
    nheads: int
    seqlen_q: int
    headdim: int
    seqlen_k: int | None = None
    nheads_k: int | None = None
    causal: bool = False
    dtype: str = "bfloat16"

    def __post_init__(self):
        for name in ("batch", "nheads", "seqlen_q", "headdim"):
            positive_int(name, getattr(self, name))
        if self.seqlen_k is None:
            object.__setattr__(self, "seqlen_k", self.seqlen_q)
        if self.nheads_k is None:
            object.__setattr__(self, "nheads_k", self.nheads)
        positive_int("seqlen_k", self.seqlen_k)
        positive_int("nheads_k", self.nheads_k)
        if self.nheads % self.nheads_k:
            raise ValueError(f"nheads_k ({self.nheads_k}) must divide nheads ({self.nheads})")
        if not isinstance(self.causal, bool):
            raise TypeError(f"causal must be a bool, got {self.causal!r}")
        object.__setattr__(self, "dtype", dtype_name(self.dtype))

    @property
    def elem(self) -> int:
        return dtype_bytes(self.dtype)

    @property
    def group(self) -> int:
        return self.nheads // self.nheads_k

    def q_bytes(self) -> int:
        """One tensor shaped like q (q, out, dout, dq)."""
        return self.batch * self.nheads * self.seqlen_q * self.headdim * self.elem

    def kv_bytes(self) -> int:
        """One tensor shaped like k (k, v, dk, dv)."""
        return self.batch * self.nheads_k * self.seqlen_k * self.headdim * self.elem

    def rows_q(self) -> int:
        """Query rows over all batch entries and heads (one LSE / D value each)."""
        return self.batch * self.nheads * self.seqlen_q


@dataclass(frozen=True)
class KernelTiles:
    """(BLOCK_M, BLOCK_N) of the forward, dK/dV and dQ kernels, and the padded head dim."""

    fwd: tuple[int, int]
    dkdv: tuple[int, int]
    dq: tuple[int, int]
    head_dim_pad: int

    def __post_init__(self):
        for name in ("fwd", "dkdv", "dq"):
            tile = getattr(self, name)
            if len(tile) != 2:
                raise ValueError(f"tiles.{name} must be (BLOCK_M, BLOCK_N), got {tile!r}")
            for v in tile:
                positive_int(f"tiles.{name} block size", v)
        positive_int("head_dim_pad", self.head_dim_pad)

    def describe(self) -> str:
        return (f"fwd {self.fwd[0]}x{self.fwd[1]}, dK/dV {self.dkdv[0]}x{self.dkdv[1]}, "
                f"dQ {self.dq[0]}x{self.dq[1]} (BLOCK_M x BLOCK_N)")


def padded_headdim(headdim: int) -> int:
    """``flashtile.kernels.attention.padded_headdim``: the next power of two, at least 16."""
    return max(16, 1 << (headdim - 1).bit_length())


def builtin_kernel_tiles(headdim: int, causal: bool = False, *, interpreter: bool = False) -> KernelTiles:
    """The tiles of ``flashtile.kernels.attention``'s ``fwd_config`` / ``bwd_config`` as plain
    Python, for machines without Triton (where the kernels cannot be imported).

    tests/test_iomodel.py checks that this table and the config functions agree for every
    head dim, dtype and mask, so a change of the kernels' tiles that is not made here fails
    the tests.  The configs do not depend on the dtype.
    """
    positive_int("headdim", headdim)
    hd = padded_headdim(headdim)
    if interpreter:
        return KernelTiles((16, 32), (16, 32), (16, 32), hd)
    if hd <= 128:
        fwd = (64, 64)
    else:
        fwd = (64, 32) if causal else (128, 64)
    if hd <= 32:
        dkdv, dq = (64, 128), (64, 64)
    elif hd <= 64:
        dkdv, dq = (64, 64), (64, 64)
    elif hd <= 128:
        dkdv, dq = (32, 128), (64, 64)
    else:
        dkdv, dq = (64, 64), (128, 64)
    return KernelTiles(fwd, dkdv, dq, hd)


def kernel_tiles(headdim: int, dtype="bfloat16", causal: bool = False, *, interpreter: bool = False) -> KernelTiles:
    """The tiles flashtile's kernels launch with, read from ``flashtile.kernels.attention``.

    The config functions pick the interpreter's small tiles when the module was imported
    with ``TRITON_INTERPRET=1`` (as the tests do).  ``interpreter=False`` (the default)
    evaluates them as on a GPU regardless, on a copy of each function whose module
    globals say so -- the module itself is left untouched.  Without Triton the kernels
    cannot be imported and :func:`builtin_kernel_tiles`, the same configs as a table, answers.
    """
    import torch

    positive_int("headdim", headdim)
    torch_dtype = getattr(torch, dtype_name(dtype))
    try:
        from flashtile.kernels import attention
    except ImportError:
        return builtin_kernel_tiles(headdim, causal, interpreter=interpreter)

    def with_interpret_flag(fn):
        return types.FunctionType(fn.__code__, {**fn.__globals__, "INTERPRET": interpreter}, fn.__name__,
                                  fn.__defaults__, fn.__closure__)

    hd = attention.padded_headdim(headdim)
    fwd = with_interpret_flag(attention.fwd_config)(hd, torch_dtype, causal)
    dkdv, dq = with_interpret_flag(attention.bwd_config)(hd, torch_dtype, causal)
    return KernelTiles((fwd.block_m, fwd.block_n), (dkdv.block_m, dkdv.block_n), (dq.block_m, dq.block_n), hd)


def check_variant(variant: str) -> None:
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(VARIANTS)}, got {variant!r}")


def resolve_tiles(shape: AttentionShape, tiles: KernelTiles | None) -> KernelTiles:
    """``tiles``, or the kernels' own tiles for ``shape`` when it is None."""
    if tiles is None:
        return kernel_tiles(shape.headdim, shape.dtype, shape.causal)
    if not isinstance(tiles, KernelTiles):
        raise TypeError(f"tiles must be a KernelTiles or None, got {type(tiles).__name__}")
    return tiles


def ceil_to(x: int, block: int) -> int:
    """``x`` rounded up to a multiple of ``block`` (0 for x <= 0)."""
    return -(-max(x, 0) // block) * block


def floor_to(x: int, block: int) -> int:
    """``x`` rounded down to a multiple of ``block`` (0 for x <= 0)."""
    return max(x, 0) // block * block
