"""What ptxas and the SASS say of a kernel compiled for sm_90a, without a GPU.

Triton compiles for an explicit target on any machine and its wheel carries ``ptxas`` and
``cuobjdump``: registers, spilled bytes, shared memory and the count of telling instructions
(``HGMMA`` = wgmma, ``LDL``/``STL`` = local memory, ``MUFU.EX2`` = exp2) can be read here,
before any device time is spent; for a ``tl.*`` kernel also what Triton's software pipeliner
made of its loop (:func:`pipeline`).  Used by the Gluon compile check
(``flashtile/kernels/hopper/offline.py``) and ``benchmarks/kernel_report.py``.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget

TARGET = GPUTarget("cuda", 90, 32)
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
COUNTED = ("HGMMA", "QGMMA", "LDL", "STL", "MUFU.EX2", "SYNCS")


def report(kernel) -> dict:
    """ptxas's registers / spills / stack / shared memory, and SASS instruction counts."""
    with tempfile.TemporaryDirectory() as d:
        ptx, cubin = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        r = subprocess.run([os.path.join(BIN, "ptxas"), "-v", "--gpu-name=sm_90a", ptx, "-o", cubin],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"ptxas failed:\n{r.stderr}")
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", cubin], capture_output=True, text=True).stdout

    def number(pattern):
        m = re.search(pattern, r.stderr)
        return int(m.group(1)) if m else 0

    return {"registers": number(r"Used (\d+) registers"), "spill_stores": number(r"(\d+) bytes spill stores"),
            "spill_loads": number(r"(\d+) bytes spill loads"), "stack": number(r"(\d+) bytes stack frame"),
            "shared": kernel.metadata.shared, "warnings": [line for line in r.stderr.splitlines() if "warning" in line],
            # ptxas C7514: wgmma serialised (every wgmma waited for before the next issues).
            "wgmma_serialized": "C7514" in r.stderr,
            **{op: sass.count(op) for op in COUNTED}}


def pipeline(kernel) -> dict:
    """What Triton's software pipeliner made of a ``tl.*`` kernel's loops, from its TTGIR:
    ``buffers``, the shared-memory buffers allocated without a value -- the pipeliner's rings,
    whose leading dimension is their depth (``"2x64x128xbf16"``: two 64 x 128 tiles in flight),
    and TMA destinations -- and ``loop_loads``, the loads left synchronous in a loop body (up
    to its first ``scf.yield``, so an outer loop's loads after an inner loop are not counted).  A load
    whose address comes from another load in the loop (a paged cache's block table) takes a
    stage of its own, so at the same ``num_stages`` its ring holds fewer tiles."""
    ir = kernel.asm["ttgir"]
    rings = re.findall(r"local_alloc : \(\) -> !ttg\.memdesc<([0-9x]+x\w+),", ir)
    loops = ir.split("scf.for")[1:]
    return {"buffers": rings, "loop_loads": sum(len(re.findall(r"= tt\.load ", body.split("scf.yield")[0]))
                                                 for body in loops)}
