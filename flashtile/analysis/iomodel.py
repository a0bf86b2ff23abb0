"""How many bytes attention moves between HBM and the chip, predicted kernel by kernel.

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

The shapes, tiles and result types are in :mod:`flashtile.analysis.accounting`; the
FlashAttention paper's asymptotics, Algorithms 1 and 4 and Figure 2 in
:mod:`flashtile.analysis.paper`.
"""

from __future__ import annotations

import math

from flashtile.analysis.accounting import (
    IMPLS,
    MASK_BYTES,
    MODES,
    STAT_BYTES,
    AttentionShape,
    IOEstimate,
    KernelIO,
    KernelTiles,
    ceil_to,
    check_variant,
    dtype_bytes,
    floor_to,
    resolve_tiles,
)

NAIVE_GEMM_TILE = (128, 128)  # a typical cuBLAS output tile; only the no-L2 variant uses it


# --- Which tiles the kernels visit (flashtile/kernels/masking.py; causal = window (-1, 0)) ---


def _kv_streamed(shape, block_m, block_n, row_bytes, variant):
    """(K + V bytes read, tile pairs visited) of a kernel that streams key tiles per query tile
    (the forward, the dQ kernel): every query tile's loads from HBM without L2 reuse; with
    ideal L2 each (batch, kv head) reads its widest key run once."""
    key_rows = pairs = widest = 0
    for _, visited, loaded in key_tiles_per_query_tile(shape.seqlen_q, shape.seqlen_k, block_m, block_n,
                                                       shape.causal):
        key_rows += loaded
        pairs += visited
        widest = max(widest, loaded)
    if variant == "no_l2":
        return 2 * shape.batch * shape.nheads * key_rows * row_bytes, pairs
    return 2 * shape.batch * shape.nheads_k * widest * row_bytes, pairs


def key_tiles_per_query_tile(seqlen_q, seqlen_k, block_m, block_n, causal):
    """Per query tile (forward, dQ): (query rows, key tiles visited, key rows loaded).

    Mirrors ``key_tiles``: tiles [0, ceil(hi / BLOCK_N)) with ``hi`` the last row's last
    visible key + 1.  Rows past ``seqlen_k`` are out of bounds: TMA zero-fills them
    without touching memory, so they are visited but not loaded.
    """
    off = seqlen_k - seqlen_q
    for m0 in range(0, seqlen_q, block_m):
        hi = min(seqlen_k, m0 + block_m + off) if causal else seqlen_k
        end = ceil_to(hi, block_n)
        yield min(block_m, seqlen_q - m0), end // block_n, min(end, seqlen_k)


def query_tiles_per_key_tile(seqlen_q, seqlen_k, block_m, block_n, causal):
    """Per key tile (dK/dV): (key rows, query tiles visited, query rows loaded).

    Mirrors ``query_tiles``: from the tile holding the first query that sees the key
    tile's first key to the end of the queries.
    """
    off = seqlen_k - seqlen_q
    end = ceil_to(seqlen_q, block_m)
    for n0 in range(0, seqlen_k, block_n):
        lo = min(floor_to(n0 - off, block_m), end) if causal else 0
        yield min(block_n, seqlen_k - n0), (end - lo) // block_m, max(seqlen_q - lo, 0)


# --- flashtile -----------------------------------------------------------------------------


def flashtile_forward_io(shape: AttentionShape, variant: str = "no_l2", tiles: KernelTiles | None = None) -> IOEstimate:
    """``_attn_fwd``: one program per (query tile, batch · head).

    Each program loads its Q tile once, then K and V tiles for every key tile it visits
    (all of them, or up to the diagonal when causal), writes its O tile and LSE rows.
    no-L2: K/V bytes = Σ over query tiles of the key rows visited (per query head: GQA
    heads of one group each stream the shared K/V).  ideal-L2: K/V once per kv head.
    """
    check_variant(variant)
    t = resolve_tiles(shape, tiles)
    bm, bn = t.fwd
    row = shape.headdim * shape.elem
    kv_read, tile_pairs = _kv_streamed(shape, bm, bn, row, variant)
    heads = shape.batch * shape.nheads
    flops = heads * tile_pairs * 2 * (2 * bm * bn * t.head_dim_pad)  # S = Q Kᵀ and O += P V
    kernel = KernelIO(
        "_attn_fwd", shape.q_bytes() + kv_read, shape.q_bytes() + shape.rows_q() * STAT_BYTES, flops,
        note=f"Q once, K/V {'per query tile' if variant == 'no_l2' else 'once'}; O and LSE written",
    )
    return IOEstimate(f"flashtile fwd ({variant})", (kernel,))


def flashtile_backward_io(shape: AttentionShape, variant: str = "no_l2", tiles: KernelTiles | None = None,
                          zero_filled_dlse: bool = True) -> IOEstimate:
    """The backward as ``flashtile.flash_attn_func``'s autograd runs it.

    ``zero_filled_dlse``: autograd materialises the gradient of the unused LSE output as
    zeros (one fill kernel), and the preprocess then reads it (``HAS_DLSE``); True is what
    ``flash_attn_func(..., return_lse=False)`` does.

    * ``_bwd_preprocess``: reads O, dO (and LSE, dLSE); writes D and LSE·log2(e).
    * ``_attn_bwd_dkdv``: one program per (key tile, batch · kv head) loads K, V once and,
      for each query head of its group, every query tile it visits: Q, dO, LSE2, D.
      Writes dK, dV.  4 matmuls per tile pair.
    * ``_attn_bwd_dq``: one program per (query tile, batch · head) loads Q, dO, LSE2, D once
      and K, V for every key tile it visits.  Writes dQ.  3 matmuls per tile pair.
    """
    check_variant(variant)
    t = resolve_tiles(shape, tiles)
    row = shape.headdim * shape.elem
    stats = shape.rows_q() * STAT_BYTES
    kernels = []
    if zero_filled_dlse:
        kernels.append(KernelIO("dlse zero fill (autograd)", 0, stats, note="gradient of the unused LSE output"))
    kernels.append(KernelIO("_bwd_preprocess", 2 * shape.q_bytes() + stats * (2 if zero_filled_dlse else 1), 2 * stats,
                            note="reads O, dO, LSE (, dLSE); writes D, LSE2"))

    # dK/dV: per key tile, the query rows it streams (Q and dO in the input dtype, LSE2 and D in fp32).
    bm, bn = t.dkdv
    q_rows = pairs = widest = 0
    for _, visited, loaded in query_tiles_per_key_tile(shape.seqlen_q, shape.seqlen_k, bm, bn, shape.causal):
        q_rows += loaded
        pairs += visited
        widest = max(widest, loaded)
    per_q_row = 2 * row + 2 * STAT_BYTES
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


# --- naive (flashtile.bench.gpu's peer: matmul, scale, [mask], fp32 softmax, cast, matmul) --


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
    return slices * shape.seqlen_q * shape.seqlen_k * MASK_BYTES


def naive_forward_io(shape: AttentionShape, variant: str = "ideal_l2", softmax_dtype="float32") -> IOEstimate:
    """The naive forward, one kernel per PyTorch op, as ``flashtile.bench.gpu``'s peer runs it.

    ``q.transpose(1, 2) @ k.transpose(1, 2).transpose(-1, -2)`` (cuBLAS reads the strided
    views in place when batch is 1), ``* scale``, for causal masks the mask construction
    (``ones``, ``tril``, ``~``) and ``masked_fill``, ``.float()``, ``softmax``,
    ``.to(dtype)``, ``@ v``.  ``softmax_dtype=None`` models a softmax in the input dtype
    (no casts).  GQA adds the K/V head expansion a naive implementation needs.
    """
    check_variant(variant)
    e, es = shape.elem, _softmax_bytes(shape, softmax_dtype)
    bh, nq, nk, d = shape.batch * shape.nheads, shape.seqlen_q, shape.seqlen_k, shape.headdim
    scores = bh * nq * nk
    kernels = []
    if shape.group > 1:
        kernels.append(KernelIO("K/V head expansion (GQA)", 2 * shape.kv_bytes(), 2 * shape.kv_bytes() * shape.group))
    kernels.append(_gemm("S = Q Kᵀ (GEMM)", bh, nq, nk, d, e, e, e, variant))
    kernels.append(_elementwise("S * scale", scores, e, e))
    if shape.causal:
        mask = nq * nk * MASK_BYTES
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
    check_variant(variant)
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
    check_variant(variant)
    if impl == "naive":
        parts = {"fwd": lambda: naive_forward_io(shape, variant), "bwd": lambda: naive_backward_io(shape, variant)}
    else:
        tiles = resolve_tiles(shape, tiles)
        parts = {"fwd": lambda: flashtile_forward_io(shape, variant, tiles),
                 "bwd": lambda: flashtile_backward_io(shape, variant, tiles)}
    if mode == "fwd_bwd":
        both = parts["fwd"]() + parts["bwd"]()
        return IOEstimate(f"{impl} fwd_bwd ({variant})", both.kernels)
    return parts[mode]()
