"""The FlashAttention paper (Dao et al. 2022) in numbers: the asymptotic IO of Theorem 2
(Θ(N·d + N²) for standard attention, Θ(N²·d²/M) for FlashAttention with M elements of
SRAM), an exact count of Algorithms 1 and 4 with the paper's SRAM-limited block sizes, and
the reproduction of its Figure 2 table (GPT-2 medium, A100: 40.3 GB vs 4.4 GB) next to
flashtile's own kernels; see ``figure2_rows`` and ``docs/iomodel.md``."""

from __future__ import annotations

import math
from dataclasses import dataclass

from flashtile.analysis.accounting import (
    MASK_BYTES,
    MODES,
    STAT_BYTES,
    VARIANTS,
    AttentionShape,
    IOEstimate,
    KernelIO,
    KernelTiles,
    floor_to,
    positive_int,
    resolve_tiles,
)
from flashtile.analysis.iomodel import predict

A100_SRAM_BYTES = 192 * 1024  # shared memory + L1 per SM, the paper's "M" on an A100
FIGURE2_SHAPE = AttentionShape(batch=64, nheads=16, seqlen_q=1024, headdim=64, causal=True, dtype="float16")
FIGURE2_PAPER_GB = {"standard": 40.3, "flash": 4.4}


def asymptotic_hbm_accesses(seqlen: int, headdim: int, sram_elements: int) -> tuple[float, float]:
    """(standard, FlashAttention) HBM accesses in elements, without constants (Theorem 2):
    N·d + N² and N²·d²/M, for one head."""
    for name, v in (("seqlen", seqlen), ("headdim", headdim), ("sram_elements", sram_elements)):
        positive_int(name, v)
    if not headdim <= sram_elements:
        raise ValueError(f"the theorem needs d <= M; got headdim={headdim}, sram_elements={sram_elements}")
    return float(seqlen * headdim + seqlen * seqlen), seqlen * seqlen * headdim * headdim / sram_elements


def paper_block_sizes(headdim: int, sram_bytes: int = A100_SRAM_BYTES, elem_bytes: int = 2) -> tuple[int, int]:
    """(B_r, B_c) of Algorithm 1: B_c = ceil(M / 4d), B_r = min(B_c, d), M = SRAM in elements."""
    positive_int("headdim", headdim)
    positive_int("sram_bytes", sram_bytes)
    positive_int("elem_bytes", elem_bytes)
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
        first = min(floor_to(j0 - off, block_r), nq) if (shape.causal and skip_masked_blocks) else 0
        visited_rows += nq - first
        visited_pairs += (nq - first) * min(block_c, nk - j0)
    row, two_stats = d * e, 2 * STAT_BYTES
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
    keep_mask = bh * nq * nk * MASK_BYTES
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
    tiles = resolve_tiles(shape, tiles)
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
