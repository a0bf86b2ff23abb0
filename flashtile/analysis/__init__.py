"""Analyses of attention that need no GPU: the IO model of HBM traffic and the FlashAttention
paper's numbers.

* ``accounting``: the terms counted in -- shapes, element sizes, kernel tiles, per-kernel
  bytes and matmul FLOPs;
* ``iomodel``: naive attention's and flashtile's kernels, byte by byte (``predict``);
* ``paper``: the paper's asymptotics, Algorithms 1 and 4, and its Figure 2 table.

``flashtile.iomodel`` gathers their public names in one namespace (``flashtile iomodel``,
``benchmarks/measure_io.py``, ``docs/iomodel.md``).
"""
