"""How many bytes attention moves between HBM and the chip, predicted kernel by kernel.

(One module over 600 lines on purpose: one model -- the byte count of every kernel of both
implementations, the tile table it reads them with, and the report that sets them against
Nsight Compute's counters -- which only makes sense read together.)

Two implementations are modelled, each as the list of kernels it launches:

* **naive** attention, the ``softmax(q kᵀ · scale) v`` of PyTorch ops that
  ``flashtile.bench.gpu`` times as its ``naive`` peer (the scores cross HBM several times:
  written by the first GEMM, read and written by every element-wise op, upcast to fp32
  for the softmax), and its autograd backward;
* **flashtile**'s Triton kernels with their real tile sizes (taken from
  ``flashtile.kernels.attention``'s ``fwd_config`` / ``bwd_config``), counting every
  tile load the kernels issue: the forward reads each query tile once and the whole K/V
  stream once per query tile; the backward runs the preprocess (D = rowsum(dO ∘ O)), the
  dK/dV kernel (K/V resident, Q/dO/LSE/D streamed once per key tile and per query head of
  the GQA group) and the dQ kernel (Q/dO resident, K/V streamed once per query tile).

Two variants bracket what a profiler will see:

* ``"no_l2"`` -- **L2 reuse is ignored**: every tile a kernel loads comes from HBM, so
  K/V are read ``ceil(N / BLOCK_M)`` times by the forward.  An upper bound on reads.
* ``"ideal_l2"`` -- every tensor a kernel touches is read from HBM **once** (a perfect,
  infinitely large L2).  A lower bound on reads.

Writes are the same in both: each output element is written once.  (A profiler that
flushes the caches before each kernel may count *fewer* writes than that for outputs small
enough to stay in L2 when the kernel ends: dirty lines are written back later.)

What is not modelled: DRAM sector granularity (32 B), cuBLAS' split-K
workspaces, the L2 of the naive element-wise kernels (each reads and writes every element
once in both variants: a softmax row fits on chip), and element-wise FLOPs -- ``flops`` is
tensor-core (matmul) work only, ``2·m·n·k`` per product, counted over the tiles a kernel
actually visits (a causal mask skips tiles; partial tiles count in full).

Also here: the asymptotic IO of the FlashAttention paper (Dao et al. 2022, Theorem 2:
Θ(N·d + N²) for standard attention, Θ(N²·d²/M) for FlashAttention with M elements of
SRAM), an exact count of the paper's Algorithms 1 and 4 with its SRAM-limited block sizes,
and the reproduction of its Figure 2 table (GPT-2 medium, A100: 40.3 GB vs 4.4 GB); see
``figure2_rows`` and ``docs/iomodel.md``.
"""

from __future__ import annotations

import math
import types
from dataclasses import dataclass, field

__all__ = [
    "A100_SRAM_BYTES",
    "FIGURE2_SHAPE",
    "VARIANTS",
    "AttentionShape",
    "IOEstimate",
    "KernelIO",
    "KernelTiles",
    "asymptotic_hbm_accesses",
    "builtin_kernel_tiles",
    "dtype_bytes",
    "dtype_name",
    "figure2_rows",
    "figure2_standard_io",
    "flash_paper_io",
    "flashtile_backward_io",
    "flashtile_forward_io",
    "format_bytes",
    "format_figure2",
    "kernel_tiles",
    "naive_backward_io",
    "naive_forward_io",
    "paper_block_sizes",
    "predict",
]

VARIANTS = ("no_l2", "ideal_l2")
MODES = ("fwd", "bwd", "fwd_bwd")
IMPLS = ("naive", "flashtile")

_DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
_DTYPE_ALIASES = {"fp16": "float16", "half": "float16", "bf16": "bfloat16", "fp32": "float32", "float": "float32"}
_STAT_BYTES = 4  # LSE, D, LSE2: always float32 in the kernels
_MASK_BYTES = 1  # torch.bool
NAIVE_GEMM_TILE = (128, 128)  # a typical cuBLAS output tile; only the no-L2 variant uses it


# --------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------


def dtype_name(dtype) -> str:
    """Canonical name ("float16", "bfloat16", "float32") of a dtype given as a name or alias
    ("bf16", "fp16", "fp32", ...) or as a torch dtype."""
    name = str(dtype).replace("torch.", "")
    name = _DTYPE_ALIASES.get(name, name)
    if name not in _DTYPE_BYTES:
        accepted = ", ".join(sorted(_DTYPE_BYTES) + sorted(_DTYPE_ALIASES))
        raise ValueError(f"dtype must be one of {accepted} (or the torch dtype); got {dtype!r}")
    return name


def dtype_bytes(dtype) -> int:
    """Bytes per element of a dtype (see :func:`dtype_name`)."""
    return _DTYPE_BYTES[dtype_name(dtype)]


def _positive_int(name: str, value) -> int:
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
            _positive_int(name, getattr(self, name))
        if self.seqlen_k is None:
            object.__setattr__(self, "seqlen_k", self.seqlen_q)
        if self.nheads_k is None:
            object.__setattr__(self, "nheads_k", self.nheads)
        _positive_int("seqlen_k", self.seqlen_k)
        _positive_int("nheads_k", self.nheads_k)
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
                _positive_int(f"tiles.{name} block size", v)
        _positive_int("head_dim_pad", self.head_dim_pad)

    def describe(self) -> str:
        return (f"fwd {self.fwd[0]}x{self.fwd[1]}, dK/dV {self.dkdv[0]}x{self.dkdv[1]}, "
                f"dQ {self.dq[0]}x{self.dq[1]} (BLOCK_M x BLOCK_N)")


def _padded_headdim(headdim: int) -> int:
    """``flashtile.kernels.attention.padded_headdim``: the next power of two, at least 16."""
    return max(16, 1 << (headdim - 1).bit_length())


def builtin_kernel_tiles(headdim: int, causal: bool = False, *, interpreter: bool = False) -> KernelTiles:
    """The tiles of ``flashtile.kernels.attention``'s ``fwd_config`` / ``bwd_config`` as plain
    Python, for machines without Triton (where the kernels cannot be imported).

    tests/test_iomodel.py checks that this table and the config functions agree for every
    head dim, dtype and mask, so a change of the kernels' tiles that is not made here fails
    the tests.  The configs do not depend on the dtype.
    """
    _positive_int("headdim", headdim)
    hd = _padded_headdim(headdim)
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

    _positive_int("headdim", headdim)
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


def _check_variant(variant: str) -> None:
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(VARIANTS)}, got {variant!r}")


# --------------------------------------------------------------------------------------
# Which tiles the kernels visit (flashtile/kernels/masking.py, causal = window (-1, 0))
# --------------------------------------------------------------------------------------


def _ceil_to(x: int, block: int) -> int:
    return -(-max(x, 0) // block) * block


def _floor_to(x: int, block: int) -> int:
    return max(x, 0) // block * block


def _kv_streamed(shape, block_m, block_n, row_bytes, variant):
    """(K + V bytes read, tile pairs visited) of a kernel that streams key tiles per query tile
    (the forward, the dQ kernel): every query tile's loads from HBM without L2 reuse; with
    ideal L2 each (batch, kv head) reads its widest key run once."""
    key_rows = pairs = widest = 0
    for _, visited, loaded in _key_tiles_per_query_tile(shape.seqlen_q, shape.seqlen_k, block_m, block_n,
                                                        shape.causal):
        key_rows += loaded
        pairs += visited
        widest = max(widest, loaded)
    if variant == "no_l2":
        return 2 * shape.batch * shape.nheads * key_rows * row_bytes, pairs
    return 2 * shape.batch * shape.nheads_k * widest * row_bytes, pairs


def _key_tiles_per_query_tile(seqlen_q, seqlen_k, block_m, block_n, causal):
    """Per query tile (forward, dQ): (query rows, key tiles visited, key rows loaded).

    Mirrors ``key_tiles``: tiles [0, ceil(hi / BLOCK_N)) with ``hi`` the last row's last
    visible key + 1.  Rows past ``seqlen_k`` are out of bounds: TMA zero-fills them
    without touching memory, so they are visited but not loaded.
    """
    off = seqlen_k - seqlen_q
    for m0 in range(0, seqlen_q, block_m):
        hi = min(seqlen_k, m0 + block_m + off) if causal else seqlen_k
        end = _ceil_to(hi, block_n)
        yield min(block_m, seqlen_q - m0), end // block_n, min(end, seqlen_k)


def _query_tiles_per_key_tile(seqlen_q, seqlen_k, block_m, block_n, causal):
    """Per key tile (dK/dV): (key rows, query tiles visited, query rows loaded).

    Mirrors ``query_tiles``: from the tile holding the first query that sees the key
    tile's first key to the end of the queries.
    """
    off = seqlen_k - seqlen_q
    end = _ceil_to(seqlen_q, block_m)
    for n0 in range(0, seqlen_k, block_n):
        lo = min(_floor_to(n0 - off, block_m), end) if causal else 0
        yield min(block_n, seqlen_k - n0), (end - lo) // block_m, max(seqlen_q - lo, 0)


# --------------------------------------------------------------------------------------
# flashtile
# --------------------------------------------------------------------------------------


def _tiles_for(shape: AttentionShape, tiles: KernelTiles | None) -> KernelTiles:
    if tiles is None:
        return kernel_tiles(shape.headdim, shape.dtype, shape.causal)
    if not isinstance(tiles, KernelTiles):
        raise TypeError(f"tiles must be a KernelTiles or None, got {type(tiles).__name__}")
    return tiles


def flashtile_forward_io(shape: AttentionShape, variant: str = "no_l2", tiles: KernelTiles | None = None) -> IOEstimate:
    """``_attn_fwd``: one program per (query tile, batch · head).

    Each program loads its Q tile once, then K and V tiles for every key tile it visits
    (all of them, or up to the diagonal when causal), writes its O tile and LSE rows.
    no-L2: K/V bytes = Σ over query tiles of the key rows visited (per query head: GQA
    heads of one group each stream the shared K/V).  ideal-L2: K/V once per kv head.
    """
    _check_variant(variant)
    t = _tiles_for(shape, tiles)
    bm, bn = t.fwd
    row = shape.headdim * shape.elem
    kv_read, tile_pairs = _kv_streamed(shape, bm, bn, row, variant)
    heads = shape.batch * shape.nheads
    flops = heads * tile_pairs * 2 * (2 * bm * bn * t.head_dim_pad)  # S = Q Kᵀ and O += P V
    kernel = KernelIO(
        "_attn_fwd", shape.q_bytes() + kv_read, shape.q_bytes() + shape.rows_q() * _STAT_BYTES, flops,
        note=f"Q once, K/V {'per query tile' if variant == 'no_l2' else 'once'}; O and LSE written",
    )
    return IOEstimate(f"flashtile fwd ({variant})", (kernel,))


def flashtile_backward_io(shape: AttentionShape, variant: str = "no_l2", tiles: KernelTiles | None = None,
                          zero_filled_dlse: bool = True) -> IOEstimate:
    """The backward as ``flashtile.flash_attn_func``'s autograd runs it.

    ``zero_filled_dlse``: autograd materialises the gradient of the unused LSE output as
    zeros (one fill kernel), and the preprocess then reads it (``HAS_DLSE``); True is what
    ``flash_attn_func(..., return_lse=False)`` does today.

    * ``_bwd_preprocess``: reads O, dO (and LSE, dLSE); writes D and LSE·log2(e).
    * ``_attn_bwd_dkdv``: one program per (key tile, batch · kv head) loads K, V once and,
      for each query head of its group, every query tile it visits: Q, dO, LSE2, D.
      Writes dK, dV.  4 matmuls per tile pair.
    * ``_attn_bwd_dq``: one program per (query tile, batch · head) loads Q, dO, LSE2, D once
      and K, V for every key tile it visits.  Writes dQ.  3 matmuls per tile pair.
    """
    _check_variant(variant)
    t = _tiles_for(shape, tiles)
    row = shape.headdim * shape.elem
    stats = shape.rows_q() * _STAT_BYTES
    kernels = []
    if zero_filled_dlse:
        kernels.append(KernelIO("dlse zero fill (autograd)", 0, stats, note="gradient of the unused LSE output"))
    kernels.append(KernelIO("_bwd_preprocess", 2 * shape.q_bytes() + stats * (2 if zero_filled_dlse else 1), 2 * stats,
                            note="reads O, dO, LSE (, dLSE); writes D, LSE2"))

    # dK/dV: per key tile, the query rows it streams (Q and dO in the input dtype, LSE2 and D in fp32).
    bm, bn = t.dkdv
    q_rows = pairs = widest = 0
    for _, visited, loaded in _query_tiles_per_key_tile(shape.seqlen_q, shape.seqlen_k, bm, bn, shape.causal):
        q_rows += loaded
        pairs += visited
        widest = max(widest, loaded)
    per_q_row = 2 * row + 2 * _STAT_BYTES
    kv_programs = shape.batch * shape.nheads_k
    if variant == "no_l2":
        streamed = kv_programs * shape.group * q_rows * per_q_row
    else:
        streamed = shape.batch * shape.nheads * widest * per_q_row
    kernels.append(KernelIO(
        "_attn_bwd_dkdv", 2 * shape.kv_bytes() + streamed, 2 * shape.kv_bytes(),
        kv_programs * shape.group * pairs * 4 * (2 * bm * bn * t.head_dim_pad),
        note=f"K/V once; Q, dO, LSE2, D {'per key tile' if variant == 'no_l2' else 'once'}",
    ))

    # dQ: per query tile, the key rows it streams.
    bm, bn = t.dq
    kv_read, pairs = _kv_streamed(shape, bm, bn, row, variant)
    heads = shape.batch * shape.nheads
    kernels.append(KernelIO(
        "_attn_bwd_dq", 2 * shape.q_bytes() + 2 * stats + kv_read, shape.q_bytes(),
        heads * pairs * 3 * (2 * bm * bn * t.head_dim_pad),
        note=f"Q, dO, LSE2, D once; K/V {'per query tile' if variant == 'no_l2' else 'once'}",
    ))
    return IOEstimate(f"flashtile bwd ({variant})", tuple(kernels))


# --------------------------------------------------------------------------------------
# naive (flashtile.bench.gpu's peer: matmul, scale, [mask], fp32 softmax, cast, matmul)
# --------------------------------------------------------------------------------------


def _gemm(name, batch, m, n, k, a_bytes, b_bytes, c_bytes, variant, tile=NAIVE_GEMM_TILE, note="") -> KernelIO:
    """C (m x n) = A (m x k) · B (k x n), ``batch`` times; element sizes in bytes.

    ideal-L2: A, B read once.  no-L2: each (tile_m x tile_n) output tile reads its rows of
    A and columns of B, so A is read ceil(n / tile_n) times and B ceil(m / tile_m) times.
    """
    a_reads = b_reads = 1
    if variant == "no_l2":
        a_reads = math.ceil(n / tile[1])
        b_reads = math.ceil(m / tile[0])
    read = batch * (m * k * a_bytes * a_reads + k * n * b_bytes * b_reads)
    return KernelIO(name, read, batch * m * n * c_bytes, batch * 2 * m * n * k, note=note)


def _elementwise(name, count, read_bytes, write_bytes, note="") -> KernelIO:
    return KernelIO(name, count * read_bytes, count * write_bytes, note=note)


def _softmax_bytes(shape: AttentionShape, softmax_dtype) -> int:
    return shape.elem if softmax_dtype is None else dtype_bytes(softmax_dtype)


def _mask_reads(shape: AttentionShape, variant: str) -> int:
    # One (seqlen_q x seqlen_k) bool mask broadcast over batch and heads: read once per
    # (batch, head) slice unless L2 keeps it.
    slices = shape.batch * shape.nheads if variant == "no_l2" else 1
    return slices * shape.seqlen_q * shape.seqlen_k * _MASK_BYTES


def naive_forward_io(shape: AttentionShape, variant: str = "ideal_l2", softmax_dtype="float32") -> IOEstimate:
    """The naive forward, one kernel per PyTorch op, as ``flashtile.bench.gpu``'s peer runs it.

    ``q.transpose(1, 2) @ k.transpose(1, 2).transpose(-1, -2)`` (cuBLAS reads the strided
    views in place when batch is 1), ``* scale``, for causal masks the mask construction
    (``ones``, ``tril``, ``~``) and ``masked_fill``, ``.float()``, ``softmax``,
    ``.to(dtype)``, ``@ v``.  ``softmax_dtype=None`` models a softmax in the input dtype
    (no casts).  GQA adds the K/V head expansion a naive implementation needs.
    """
    _check_variant(variant)
    e, es = shape.elem, _softmax_bytes(shape, softmax_dtype)
    bh, nq, nk, d = shape.batch * shape.nheads, shape.seqlen_q, shape.seqlen_k, shape.headdim
    scores = bh * nq * nk
    kernels = []
    if shape.group > 1:
        kernels.append(KernelIO("K/V head expansion (GQA)", 2 * shape.kv_bytes(), 2 * shape.kv_bytes() * shape.group))
    kernels.append(_gemm("S = Q Kᵀ (GEMM)", bh, nq, nk, d, e, e, e, variant))
    kernels.append(_elementwise("S * scale", scores, e, e))
    if shape.causal:
        mask = nq * nk * _MASK_BYTES
        kernels += [KernelIO("mask: ones", 0, mask), KernelIO("mask: tril", mask, mask), KernelIO("mask: ~", mask, mask),
                    KernelIO("masked_fill", scores * e + _mask_reads(shape, variant), scores * e)]
    if es != e:
        kernels.append(_elementwise("S.float()", scores, e, es))
    kernels.append(_elementwise("softmax", scores, es, es, note="a row read once: it fits on chip"))
    if es != e:
        kernels.append(_elementwise("P.to(dtype)", scores, es, e))
    kernels.append(_gemm("O = P V (GEMM)", bh, nq, d, nk, e, e, e, variant))
    return IOEstimate(f"naive fwd ({variant})", tuple(kernels))


def naive_backward_io(shape: AttentionShape, variant: str = "ideal_l2", softmax_dtype="float32",
                      grad_layout_copies: bool | None = None) -> IOEstimate:
    """Autograd's backward of :func:`naive_forward_io`'s ops.

    dP = dO Vᵀ, dV = Pᵀ dO, the cast back to the softmax dtype, the softmax backward
    (PyTorch's: an element-wise dP ∘ P, then a row reduction reading that product and the
    saved fp32 P), the cast to the input dtype, [masked_fill backward],
    the scale, dQ = dS K, dK = dSᵀ Q.  ``grad_layout_copies`` (default: when nheads > 1):
    the gradients arrive as ``(b, h, n, d)`` tensors viewed as ``(b, n, h, d)``, which do
    not match the leaves' layout, so autograd copies each into place.
    """
    _check_variant(variant)
    e, es = shape.elem, _softmax_bytes(shape, softmax_dtype)
    bh, nq, nk, d = shape.batch * shape.nheads, shape.seqlen_q, shape.seqlen_k, shape.headdim
    scores = bh * nq * nk
    kernels = [
        _gemm("dP = dO Vᵀ (GEMM)", bh, nq, nk, d, e, e, e, variant),
        _gemm("dV = Pᵀ dO (GEMM)", bh, nk, d, nq, e, e, e, variant),
    ]
    if es != e:
        kernels.append(_elementwise("dP.float() (cast backward)", scores, e, es))
    # PyTorch's softmax backward is two kernels: tmp = dP * P, then dS = tmp - P * rowsum(tmp).
    # A row longer than a warp's registers hold (4 kB) is read twice by the second one: once
    # for the sum, once for the epilogue -- from HBM unless L2 keeps it.
    kernels.append(KernelIO("softmax backward: dP * P", 2 * scores * es, scores * es))
    tmp_reads = 2 if variant == "no_l2" and nk * es > 4096 else 1
    kernels.append(KernelIO("softmax backward: rowsum, epilogue", (tmp_reads + 1) * scores * es, scores * es,
                            note="reads dP * P and the saved P"))
    if es != e:
        kernels.append(_elementwise("dS.to(dtype) (cast backward)", scores, es, e))
    if shape.causal:
        kernels.append(KernelIO("masked_fill backward", scores * e + _mask_reads(shape, variant), scores * e))
    kernels += [
        _elementwise("dS * scale", scores, e, e),
        _gemm("dQ = dS K (GEMM)", bh, nq, d, nk, e, e, e, variant),
        _gemm("dK = dSᵀ Q (GEMM)", bh, nk, d, nq, e, e, e, variant),
    ]
    kv_expanded = bh * nk * d * e
    if shape.group > 1:
        kernels.append(KernelIO("dK/dV group sum (GQA)", 2 * kv_expanded, 2 * shape.kv_bytes()))
    if grad_layout_copies is None:
        grad_layout_copies = shape.nheads > 1
    if grad_layout_copies:
        moved = shape.q_bytes() + 2 * shape.kv_bytes()
        kernels.append(KernelIO("grad layout copies (dQ, dK, dV)", moved, moved))
    return IOEstimate(f"naive bwd ({variant})", tuple(kernels))


def predict(impl: str, mode: str, shape: AttentionShape, variant: str = "no_l2",
            tiles: KernelTiles | None = None) -> IOEstimate:
    """``impl`` in ("naive", "flashtile"), ``mode`` in ("fwd", "bwd", "fwd_bwd")."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {', '.join(IMPLS)}, got {impl!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    _check_variant(variant)
    if impl == "naive":
        parts = {"fwd": lambda: naive_forward_io(shape, variant), "bwd": lambda: naive_backward_io(shape, variant)}
    else:
        tiles = _tiles_for(shape, tiles)
        parts = {"fwd": lambda: flashtile_forward_io(shape, variant, tiles),
                 "bwd": lambda: flashtile_backward_io(shape, variant, tiles)}
    if mode == "fwd_bwd":
        both = parts["fwd"]() + parts["bwd"]()
        return IOEstimate(f"{impl} fwd_bwd ({variant})", both.kernels)
    return parts[mode]()


# --------------------------------------------------------------------------------------
# The FlashAttention paper: asymptotics, Algorithms 1 and 4, Figure 2
# --------------------------------------------------------------------------------------

A100_SRAM_BYTES = 192 * 1024  # shared memory + L1 per SM, the paper's "M" on an A100
FIGURE2_SHAPE = AttentionShape(batch=64, nheads=16, seqlen_q=1024, headdim=64, causal=True, dtype="float16")
FIGURE2_PAPER_GB = {"standard": 40.3, "flash": 4.4}


def asymptotic_hbm_accesses(seqlen: int, headdim: int, sram_elements: int) -> tuple[float, float]:
    """(standard, FlashAttention) HBM accesses in elements, without constants (Theorem 2):
    N·d + N² and N²·d²/M, for one head."""
    for name, v in (("seqlen", seqlen), ("headdim", headdim), ("sram_elements", sram_elements)):
        _positive_int(name, v)
    if not headdim <= sram_elements:
        raise ValueError(f"the theorem needs d <= M; got headdim={headdim}, sram_elements={sram_elements}")
    return float(seqlen * headdim + seqlen * seqlen), seqlen * seqlen * headdim * headdim / sram_elements


def paper_block_sizes(headdim: int, sram_bytes: int = A100_SRAM_BYTES, elem_bytes: int = 2) -> tuple[int, int]:
    """(B_r, B_c) of Algorithm 1: B_c = ceil(M / 4d), B_r = min(B_c, d), M = SRAM in elements."""
    _positive_int("headdim", headdim)
    _positive_int("sram_bytes", sram_bytes)
    _positive_int("elem_bytes", elem_bytes)
    block_c = math.ceil(sram_bytes // elem_bytes / (4 * headdim))
    return min(block_c, headdim), block_c


def flash_paper_io(shape: AttentionShape, mode: str = "fwd_bwd", sram_bytes: int = A100_SRAM_BYTES,
                   skip_masked_blocks: bool = False) -> IOEstimate:
    """HBM traffic of the paper's Algorithm 1 (forward) and Algorithm 4 (backward), line by line.

    The outer loop runs over key/value blocks (B_c rows), the inner one over query blocks
    (B_r rows), so Q, O, ℓ, m (forward) and Q, O, dO, dQ, ℓ, m (backward) cross HBM once
    per key block -- T_c = ceil(N / B_c) times -- and K, V once.  O, ℓ, m (forward) and
    dQ, dK, dV (backward) are first initialised in HBM, as the algorithms state; dK_j, dV_j
    are written once at the end of their outer iteration.  ℓ and m are counted as float32.
    ``skip_masked_blocks``: with a causal mask, query blocks wholly above the diagonal are
    not visited (the algorithms as printed visit them; real kernels skip them).
    FLOPs: 2 matmuls per visited (query, key) pair forward, 5 backward (S recomputed).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    e, d = shape.elem, shape.headdim
    nq, nk = shape.seqlen_q, shape.seqlen_k
    block_r, block_c = paper_block_sizes(d, sram_bytes, e)
    heads = shape.batch * shape.nheads
    off = nk - nq
    visited_rows = visited_pairs = 0  # query rows loaded per key block, summed; (query, key) pairs
    for j0 in range(0, nk, block_c):
        first = min(_floor_to(j0 - off, block_r), nq) if (shape.causal and skip_masked_blocks) else 0
        visited_rows += nq - first
        visited_pairs += (nq - first) * min(block_c, nk - j0)
    row, two_stats = d * e, 2 * _STAT_BYTES
    kv_once = 2 * heads * nk * row
    fwd = KernelIO(
        "FlashAttention fwd (Algorithm 1)",
        kv_once + heads * visited_rows * (2 * row + two_stats),  # Q_i, O_i, ℓ_i, m_i per visit
        heads * (nq + visited_rows) * (row + two_stats),  # O, ℓ, m initialised, then written per visit
        heads * visited_pairs * 2 * 2 * d,
        note=f"B_r={block_r}, B_c={block_c}",
    )
    bwd = KernelIO(
        "FlashAttention bwd (Algorithm 4)",
        kv_once + heads * visited_rows * (4 * row + two_stats),  # Q_i, O_i, dO_i, dQ_i, ℓ_i, m_i per visit
        heads * (nq + visited_rows) * row + 2 * kv_once,  # dQ init + per visit; dK, dV init + final
        heads * visited_pairs * 5 * 2 * d,
        note="dQ, dK, dV initialised in HBM; dQ_i written per visit",
    )
    kernels = {"fwd": (fwd,), "bwd": (bwd,), "fwd_bwd": (fwd, bwd)}[mode]
    return IOEstimate(f"FlashAttention paper {mode} (B_r={block_r}, B_c={block_c})", kernels)


def figure2_standard_io(shape: AttentionShape = FIGURE2_SHAPE, mask_and_dropout: bool = True) -> IOEstimate:
    """Standard attention, forward + backward, in the GPT-2 training path of the paper's
    Figure 2: every op its own kernel, everything in the input dtype (fp16).

    Forward: S = scale · Q Kᵀ (one GEMM, the scale fused as its alpha), S + causal mask
    (a separate element-wise kernel), P = softmax(S), dropout (writes the kept values and
    a 1-byte keep mask), O = P V.  Backward: dV = Pᵀ dO, dP = dO Vᵀ, dropout backward
    (reads the mask), softmax backward (reads dP and P), dQ = dS K, dK = dSᵀ Q; the mask
    addition's backward is the identity (no kernel).  The additive mask (one N x N
    matrix shared by all heads) is assumed to stay in L2.  Every operand is read once
    (cuBLAS' re-reads of Q/K/V tiles hit L2 here: they are d-wide, the N x N terms dominate).

    ``mask_and_dropout=False`` leaves the two GPT-2-specific kernels out: the textbook
    accounting of the paper's Algorithms 0 and 3 (S, P and dP, dS each written and read).

    The softmax backward is one kernel here, as Algorithm 3 writes it; PyTorch runs it as
    two (``naive_backward_io``), which would add 3 passes.  Only the paper's total is known,
    so this decomposition is one that reproduces it, not the only one (docs/iomodel.md).
    """
    e = shape.elem
    bh, nq, nk, d = shape.batch * shape.nheads, shape.seqlen_q, shape.seqlen_k, shape.headdim
    scores = bh * nq * nk * e
    keep_mask = bh * nq * nk * _MASK_BYTES
    q, kv = shape.q_bytes(), shape.kv_bytes()
    gemm = 2 * bh * nq * nk * d
    fwd = [KernelIO("S = scale · Q Kᵀ", q + kv, scores, gemm)]
    if mask_and_dropout:
        fwd.append(KernelIO("S + causal mask", scores, scores))
    fwd.append(KernelIO("P = softmax(S)", scores, scores))
    if mask_and_dropout:
        fwd.append(KernelIO("dropout(P)", scores, scores + keep_mask))
    fwd.append(KernelIO("O = P V", scores + kv, q, gemm))
    bwd = [KernelIO("dV = Pᵀ dO", scores + q, kv, gemm), KernelIO("dP = dO Vᵀ", q + kv, scores, gemm)]
    if mask_and_dropout:
        bwd.append(KernelIO("dropout backward", scores + keep_mask, scores))
    bwd += [
        KernelIO("dS = softmax backward", 2 * scores, scores),
        KernelIO("dQ = scale · dS K", scores + kv, q, gemm),
        KernelIO("dK = scale · dSᵀ Q", scores + q, kv, gemm),
    ]
    what = "with mask and dropout kernels" if mask_and_dropout else "S, P, dP, dS only"
    return IOEstimate(f"standard attention fwd_bwd ({what})", tuple(fwd + bwd))


@dataclass(frozen=True)
class Figure2Row:
    label: str
    estimate: IOEstimate
    paper_gb: float | None = None

    @property
    def gb(self) -> float:
        return self.estimate.total_bytes / 1e9


def figure2_rows(shape: AttentionShape = FIGURE2_SHAPE, sram_bytes: int = A100_SRAM_BYTES,
                 tiles: KernelTiles | None = None) -> list[Figure2Row]:
    """The paper's Figure 2 table (HBM R/W, forward + backward) next to this model's numbers.

    Rows: standard attention as GPT-2 runs it (the 40.3 GB row), the same without the
    mask and dropout kernels, the paper's Algorithms 1 + 4 with its A100 block sizes (the
    4.4 GB row; causal blocks visited as printed, then skipped), and flashtile's kernels
    with their own tiles (no-L2 and ideal-L2).
    """
    block_r, block_c = paper_block_sizes(shape.headdim, sram_bytes, shape.elem)
    tiles = _tiles_for(shape, tiles)
    rows = [
        Figure2Row("standard attention (GPT-2: + mask, dropout kernels)", figure2_standard_io(shape),
                   FIGURE2_PAPER_GB["standard"]),
        Figure2Row("standard attention (S, P, dP, dS only)", figure2_standard_io(shape, mask_and_dropout=False)),
        Figure2Row(f"FlashAttention Alg. 1+4, B_r={block_r}, B_c={block_c}", flash_paper_io(shape, "fwd_bwd", sram_bytes),
                   FIGURE2_PAPER_GB["flash"]),
    ]
    if shape.causal:
        rows.append(Figure2Row("  same, causal blocks skipped",
                               flash_paper_io(shape, "fwd_bwd", sram_bytes, skip_masked_blocks=True)))
    for variant in VARIANTS:
        rows.append(Figure2Row(f"flashtile kernels, {tiles.fwd[0]}x{tiles.fwd[1]} fwd tiles ({variant})",
                               predict("flashtile", "fwd_bwd", shape, variant, tiles)))
    return rows


def format_figure2(shape: AttentionShape = FIGURE2_SHAPE, sram_bytes: int = A100_SRAM_BYTES,
                   tiles: KernelTiles | None = None) -> str:
    rows = figure2_rows(shape, sram_bytes, tiles)
    width = max(len(r.label) for r in rows)
    head = (f"FlashAttention paper, Figure 2: attention of GPT-2 medium, forward + backward "
            f"(N={shape.seqlen_q}, d={shape.headdim}, {shape.nheads} heads, batch {shape.batch}, {shape.dtype}"
            f"{', causal' if shape.causal else ''}; SRAM M = {sram_bytes // 1024} KiB)")
    lines = [head, f"  {'':<{width}}  {'HBM R/W':>9}  {'paper':>7}  {'matmul GFLOP':>12}"]
    for r in rows:
        paper = f"{r.paper_gb:.1f} GB" if r.paper_gb is not None else ""
        lines.append(f"  {r.label:<{width}}  {r.gb:>6.2f} GB  {paper:>7}  {r.estimate.flops / 1e9:>12.1f}")
    return "\n".join(lines)
