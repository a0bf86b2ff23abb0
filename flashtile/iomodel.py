"""The IO model of attention's HBM traffic, in one namespace: what ``flashtile iomodel`` prints,
``benchmarks/measure_io.py`` checks against Nsight Compute, and ``docs/iomodel.md`` explains.

The code is in :mod:`flashtile.analysis`: ``accounting`` (shapes, tiles, results),
``iomodel`` (naive attention's and flashtile's kernels, byte by byte) and ``paper`` (the
FlashAttention paper's asymptotics, Algorithms 1 and 4, Figure 2).
"""

from flashtile.analysis.accounting import (
    IMPLS,
    MODES,
    VARIANTS,
    AttentionShape,
    IOEstimate,
    KernelIO,
    KernelTiles,
    builtin_kernel_tiles,
    dtype_bytes,
    dtype_name,
    format_bytes,
    kernel_tiles,
)
from flashtile.analysis.iomodel import (
    flashtile_backward_io,
    flashtile_forward_io,
    naive_backward_io,
    naive_forward_io,
    predict,
)
from flashtile.analysis.paper import (
    A100_SRAM_BYTES,
    FIGURE2_PAPER_GB,
    FIGURE2_SHAPE,
    Figure2Row,
    asymptotic_hbm_accesses,
    figure2_rows,
    figure2_standard_io,
    flash_paper_io,
    format_figure2,
    paper_block_sizes,
)

__all__ = [
    "A100_SRAM_BYTES",
    "FIGURE2_PAPER_GB",
    "FIGURE2_SHAPE",
    "IMPLS",
    "MODES",
    "VARIANTS",
    "AttentionShape",
    "Figure2Row",
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
