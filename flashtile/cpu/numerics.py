"""The CPU tiled engine's arithmetic in log2 units: ``exp2`` with subnormal results flushed to 0,
and the natural-log LSE in and out of log2 units without a second rounding.

The tiled engine scales its queries by ``softmax_scale * log2 e`` once per chunk, so that every
probability is one ``exp2``; docs/algorithm.md (step 3) says why the CPU wants ``exp2`` and the
flush.
"""

from __future__ import annotations

import torch

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp16 / bf16 are computed in fp32 like the GPU kernels; float64 stays float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def exp2_flushed(x):
    """``2 ** x`` in place, with the results below the smallest normal number flushed to 0.

    Subnormal floats are slow on the CPU: on the one measured (an AMD EPYC, torch's CPU build)
    ``exp2`` ran 7-10 times slower where its results are subnormal or 0, and a forward whose
    probabilities were subnormal 13 times slower (ALiBi's distant keys, or any key far below
    its row's maximum, give them); ``exp2`` of ``-inf`` is as fast as any other.  The flushed
    terms are under ``2 ** -126`` (float64: ``2 ** -1022``) times a row sum of at least 1."""
    floor = -1022.0 if x.dtype == torch.float64 else -126.0
    return torch.nn.functional.threshold_(x, floor, float("-inf")).exp2_()


def natural_lse(m2, l):
    """The natural-log LSE of rows whose max ``m2`` is in log2 units, rounded once (in float64)
    to the rows' dtype: the backward rebuilds P from it."""
    return ((m2.double() + torch.log2(l).double()) * LN2).to(m2.dtype)


def log2_lse(lse, dtype):
    """``(lse_hi, correction)`` with ``2^(s - lse * log2 e) = 2^(s - lse_hi) * correction``:
    ``lse_hi`` the log2-unit LSE rounded to ``dtype`` (+inf for rows with no visible key, whose
    recomputed P is then exactly 0) and ``correction = 2^-(rounding)`` per row (``None`` in
    float64), so that the backward's P is the forward's to the LSE's own precision -- an
    LSE of 1000 rounded twice would shift P by ~1e-4."""
    exact = lse.double() * LOG2E
    hi = torch.where(exact == float("-inf"), float("inf"), exact).to(dtype)
    if dtype == torch.float64:
        return hi, None
    rest = torch.where(torch.isinf(hi), 0.0, exact - hi.double())
    return hi, torch.exp2(-rest).to(dtype)

