"""Which strategy for which row length and row count, and its launch shape.

Softmax is memory-bound: the floor is one read and one write per element (the backward: two
reads and one write).  How close a kernel gets depends on whether a row fits on chip, and,
when it does not, on whether its second read can be served by the L2 cache: rows up to
``IN_REGISTER_MAX`` are held in registers (``registers.py``); longer rows, up to
``COOPERATIVE_MAX`` / ``COOP_BWD_MAX``, are held in registers by several cooperating
programs (``cooperative.py``; at most 4M forward / 2M backward on an H200, by default the
backward up to 256k); the rest are streamed twice (``streaming.py``), by persistent programs
when there are rows for every SM (fused) and by row chunks otherwise (split).  On Hopper, with
the ``staged`` knob on (off by default), unmasked rows of at least ``STAGED_MIN_BYTES`` whose
layout the TMA engine can read are held in shared memory instead, by cooperating programs
(``staged_plan``, ``flashtile/kernels/hopper/staged_softmax.py``; 1 read + 1 write); the
backward of rows of at least ``STAGED_BWD_MIN_BYTES`` takes that path by default.
"""

from __future__ import annotations

import math

import torch

from flashtile.kernels.runtime import INTERPRET, cdiv, next_power_of_2, sm_count
from flashtile.kernels.softmax.tuning import MAX_SPLITS, knobs


STRATEGIES = ("registers", "cooperative", "fused", "split", "staged")


def _floor_pow2(v: float) -> float:
    return 2.0 ** math.floor(math.log2(v))


def _sms() -> int:
    return 1 if INTERPRET else sm_count(torch.cuda.current_device())


def streaming_strategy(n_rows: int) -> str:
    """The two-pass path for rows that are not held on chip: fused when every SM gets rows."""
    return "fused" if n_rows >= knobs()["fused_min_rows_per_sm"] * _sms() else "split"


def staged_plan(n_rows: int, n_cols: int, elem_bytes: int, tensors: int, device_index: int,
                strategy: str | None = None):
    """The shared-memory path's launch shape (``staged_softmax.StagedPlan``), which the caller
    uses once it has found the rows TMA-readable, or None where the path does not run: another
    strategy asked for, the knob off, rows below ``staged_min_bytes`` (unless
    ``strategy="staged"``; a backward, ``tensors == 2``, runs it with the knob off for rows of
    at least ``staged_bwd_min_bytes``), no Gluon on this device, or rows it cannot stage
    (``staged_softmax.plan``)."""
    if strategy not in (None, "staged") or INTERPRET:
        return None
    k = knobs()
    row_bytes = n_cols * elem_bytes
    chosen = k["staged"] and row_bytes >= k["staged_min_bytes"]
    backward_default = tensors == 2 and 0 < k["staged_bwd_min_bytes"] <= row_bytes
    if strategy is None and not (chosen or backward_default):
        return None
    from flashtile.kernels.engine import gluon_device_reason

    if gluon_device_reason(device_index) is not None:
        return None
    from flashtile.kernels.hopper import staged_softmax

    return staged_softmax.plan(n_rows, n_cols, elem_bytes, tensors, sm_count(device_index))


def plan(n_rows: int, n_cols: int, strategy: str | None = None, block: int | None = None,
         splits: int | None = None, unroll: int | None = None, programs: int | None = None,
         elem_bytes: int = 4, reread_bytes: int | None = None, backward: bool = False,
         masked: bool = False):
    """Pick the strategy and its launch shape for (n_rows, n_cols).

    ``elem_bytes`` is the size of the streamed tensors' elements (sub-tiles are one 16-byte
    vector per thread); ``reread_bytes`` the bytes per row that pass 2 reads again (default
    ``n_cols * elem_bytes``), which sets how many rows the fused path keeps in flight;
    ``backward`` picks the backward's chunk size on the cooperative path; ``masked`` (the
    forward has a mask) keeps the forward off the cooperative path by default: its masked
    variants spill 0.3-1.6 KB a thread at the 64-register cap (offline ptxas), so their
    speed there is not established (docs/tuning.md).
    ``strategy``, ``block`` (sub-tile elements; cooperative: chunk elements), ``unroll``
    (sub-tiles per iteration), ``splits`` (chunks per row, split path) and ``programs``
    (persistent grid, fused and cooperative paths; still capped by occupancy at launch)
    override the knobs, for tests and tuning.
    """
    k = knobs()
    sms = _sms()
    if backward:
        cooperative = n_cols <= k["coop_bwd_max"]
    else:
        cooperative = (not masked and k["coop_fwd_min_bytes"] <= n_cols * elem_bytes
                       and n_cols <= k["cooperative_max"])
    if strategy is None:
        if n_cols <= k["in_register_max"]:
            strategy = "registers"
        elif cooperative:
            strategy = "cooperative"
        else:
            strategy = streaming_strategy(n_rows)
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES} or None, got {strategy!r}")
    if strategy == "staged":  # launch.py runs it where staged_plan allows; here it did not
        raise ValueError("strategy 'staged' runs on Hopper only, for unmasked rows that the TMA engine can read")
    if strategy == "cooperative":
        if INTERPRET:
            chunk, num_warps = block or 64, 1
        else:
            fwd_chunk = k["coop_block"] or 32768 // elem_bytes
            chunk, num_warps = block or (k["coop_bwd_block"] if backward else fwd_chunk), k["coop_warps"]
        chunk = next_power_of_2(chunk)
        n_splits = cdiv(n_cols, chunk)
        slots = n_rows if programs is None else max(1, programs // n_splits)
        maxnreg = k["coop_maxnreg"] if backward else (k["coop_fwd_maxnreg"] or k["coop_maxnreg"])
        return dict(strategy=strategy, BLOCK_N=chunk, num_warps=num_warps, splits=n_splits,
                    SPLITS=max(2, next_power_of_2(n_splits)), slots=min(n_rows, slots),
                    maxnreg=0 if INTERPRET else maxnreg, pack=bool(k["coop_pack"]))
    if strategy == "registers":
        block_n = max(16, next_power_of_2(n_cols))
        if INTERPRET:
            rows = 4 if block_n <= 64 else 1
            return dict(strategy=strategy, BLOCK_N=block_n, ROWS=rows, num_warps=1)
        rows = max(1, min(64, 4096 // block_n))
        # 8k+ rows: 32 values per thread (16k: 16 warps; 32k: 32 warps, which does not spill).
        # The backward of 16k rows takes 32 warps (16 values of y and of dy per thread):
        # bf16 0.96 of the copy rate against 0.76 with 16 (fp32 1.03 either way; H200,
        # docs/tuning.md).
        num_warps = 4 if block_n <= 4096 else min(32, block_n // (512 if backward and block_n >= 16384 else 1024))
        if block_n >= 8192 and k["register_warps"]:
            num_warps = k["register_warps"]
        return dict(strategy=strategy, BLOCK_N=block_n, ROWS=rows, num_warps=num_warps)

    if strategy == "fused":
        # Rows in flight: as many as L2 can hold the re-read part of, within [min, max]
        # programs per SM, rounded down to a power of two so that num_warps is one too.
        reread = reread_bytes or n_cols * elem_bytes
        rows_fit = k["l2_budget_mb"] * 2**20 / max(1, reread)
        per_sm = _floor_pow2(min(k["programs_per_sm"], max(k["min_programs_per_sm"], rows_fit / sms)))
        num_warps = int(min(32, max(4, _floor_pow2(k["warps_per_sm"] / per_sm))))
    else:
        num_warps = k["split_warps"]
    if INTERPRET:
        num_warps, default_block, unroll = 1, 64, unroll or 2
    else:
        default_block = k["block"] or num_warps * 32 * max(1, 16 // elem_bytes)
    block_n = block or default_block
    unroll = unroll or k["unroll"]
    tile = block_n * unroll
    common = dict(strategy=strategy, BLOCK_N=block_n, UNROLL=unroll, num_warps=num_warps,
                  STAGES=k["stages"] or None, evict=bool(k["evict"]) and not INTERPRET)
    if strategy == "fused":
        return dict(common, programs=max(1, min(n_rows, programs or int(per_sm * sms))))
    if splits is None:
        target = k["split_programs_per_sm"] * sms
        splits = max(1, min(MAX_SPLITS, -(-target // n_rows), cdiv(n_cols, tile)))
    chunk = cdiv(cdiv(n_cols, splits), tile) * tile
    splits = cdiv(n_cols, chunk)
    return dict(common, splits=splits, chunk=chunk, SPLITS=max(2, next_power_of_2(splits)))
