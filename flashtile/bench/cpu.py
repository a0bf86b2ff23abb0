"""CPU attention benchmark: flashtile's tiled path against naive attention and PyTorch SDPA.

For each sequence length N it times the forward (and, up to ``bwd_max_seqlen``, forward +
backward) of

* ``flashtile``: :func:`flashtile.flash_attn_func` on CPU tensors (the tiled online-softmax
  path of :mod:`flashtile.cpu`, which never allocates an N x N tensor);
* ``naive``: ``softmax(q k^T * scale) v`` in plain torch, materialising the N x N scores
  (peak about two N x N tensors forward, more with autograd);
* ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` on CPU,

and measures each call's peak extra memory with :func:`flashtile.bench.common.peak_memory`
(resident-set high-water mark of the process, see there), by default in a separate fresh
interpreter (:func:`memory_isolated`).  ``sdpa`` on CPU is itself a fused, tiled
(flash-attention) kernel: no N x N tensor in its forward or backward either, which the
memory column shows.  Records go to a JSONL file, one
per (impl, mode, N), in the schema shared with the GPU benchmark::

    bench="attention_cpu", impl, mode ("fwd" | "fwd_bwd"), dtype, batch, nheads, nheads_k,
    seqlen_q, seqlen_k, headdim, causal, ms (median), peak_extra_bytes, repeats,
    memory_method, threads, other_cpu_load (share of the cores other processes used during
    the case: timings with it well above 0 are inflated), skipped (reason or None),
    device, date, torch, triton, python

One case's measurement is in :mod:`flashtile.bench.cpu_measure`, the table and plot in
:mod:`flashtile.bench.cpu_report`.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path
from typing import Sequence

import torch

from flashtile.bench.common import OtherCpuLoad, cpu_peak_memory_method, default_out_dir, environment, write_jsonl
from flashtile.bench.cpu_measure import (
    CONTENDED,
    IMPLS,
    ISOLATED_ENV,
    MODES,
    dtype_name,
    memory_isolated,
    memory_one,
    naive_skip_reason,
    time_one,
    warmup,
)
from flashtile.bench.cpu_report import format_ratios, format_table, plot_cpu

# The run, and the names the command line and benchmarks/bench_cpu_memory.py take from here.
__all__ = [
    "DEFAULT_SEQLENS", "IMPLS", "ISOLATED_ENV", "MODES", "QUICK_SEQLENS", "memory_isolated", "plot_cpu",
    "run_cpu_benchmark", "run_cpu_sweep",
]

DEFAULT_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
QUICK_SEQLENS = (256, 512)  # `flashtile bench --quick`: a smoke test of a few seconds
NAIVE_BUDGET_BYTES = 8 * 1024**3  # skip naive when the N x N score matrix alone exceeds this

_AUTO = "auto"


def run_cpu_benchmark(
    seqlens: Sequence[int] = DEFAULT_SEQLENS,
    batch: int = 1,
    nheads: int = 1,
    headdim: int = 64,
    dtype: torch.dtype = torch.float32,
    causal: bool = False,
    out_path: str | Path | None = _AUTO,
    progress: bool = True,
    impls: Sequence[str] = IMPLS,
    modes: Sequence[str] = MODES,
    bwd_max_seqlen: int = 8192,
    naive_budget_bytes: int = NAIVE_BUDGET_BYTES,
    quick: bool = False,
    print_table: bool = True,
    memory: str | None = None,
    contention_retries: int = 2,
    bwd_seqlens: Sequence[int] | None = None,
    run: str | None = None,
) -> list[dict]:
    """Benchmark attention on the CPU; returns the records and appends them to ``out_path``.

    ``out_path``: JSONL file to append to; ``"auto"`` (default) is
    ``default_out_dir() / "attention_cpu.jsonl"``, ``None`` writes nothing.
    ``modes``: ``"fwd"`` for every N, ``"fwd_bwd"`` only for N <= ``bwd_max_seqlen`` (and in
    ``bwd_seqlens`` when given).  ``run``: recorded in every record (default: this call's start
    time), so that the records of one run -- e.g. the several shapes of :func:`run_cpu_sweep` --
    can be told apart from earlier ones in the same file.
    ``naive`` is skipped (recorded with ``skipped`` set, ``ms`` None) where its N x N
    scores would exceed ``naive_budget_bytes`` or its estimated peak would not fit in memory.
    ``quick``: one timed repeat per case, no contention retries, memory measured in-process
    (a smoke test).

    Two phases.  Memory: ``memory="isolated"`` (the default unless ``quick``) measures every
    case's peak extra memory in one fresh interpreter (:func:`memory_isolated`, allocator set
    up so readings repeat to ~0.1 MiB); ``"inprocess"`` measures in this process
    (:func:`memory_one`; cheaper, but allocator state left by earlier cases can shift a
    reading by a few MiB).  Timing, in this process: median of repeats (:func:`time_one`).
    ``contention_retries``: a case during whose timing other processes used more than 10%
    of the CPU is timed again, up to this many times; the least disturbed attempt is kept
    and its ``other_cpu_load`` recorded.

    With the defaults (N = 512 ... 16384, fwd_bwd up to 8192) a run took 81 s on 2 idle
    cores (more when other processes compete for them).
    """
    impls = tuple(impls)
    for impl in impls:
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if memory is None:
        memory = "inprocess" if quick else "isolated"
    if memory not in ("inprocess", "isolated"):
        raise ValueError(f"memory must be 'inprocess' or 'isolated', got {memory!r}")
    seqlens = sorted(int(n) for n in seqlens)
    if not seqlens:
        raise ValueError("seqlens must not be empty")
    if seqlens[0] < 1:
        raise ValueError(f"seqlens must be positive, got {seqlens[0]}")
    for name, value in (("batch", batch), ("nheads", nheads), ("headdim", headdim)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if out_path == _AUTO:
        out_path = default_out_dir() / "attention_cpu.jsonl"

    env = environment("cpu")
    run = run or env["date"]
    method = cpu_peak_memory_method() + (", fresh process, MALLOC_MMAP_THRESHOLD_=65536" if memory == "isolated" else ", in-process")
    records = []
    for mode in modes:
        for n in seqlens:
            if mode == "fwd_bwd" and (n > bwd_max_seqlen or (bwd_seqlens is not None and n not in bwd_seqlens)):
                continue
            for impl in impls:
                reason = naive_skip_reason(batch, nheads, n, dtype, mode, naive_budget_bytes) if impl == "naive" else None
                records.append({
                    "bench": "attention_cpu",
                    "run": run,
                    "impl": impl,
                    "mode": mode,
                    "dtype": dtype_name(dtype),
                    "batch": batch,
                    "nheads": nheads,
                    "nheads_k": nheads,
                    "seqlen_q": n,
                    "seqlen_k": n,
                    "headdim": headdim,
                    "causal": causal,
                    "ms": None,
                    "peak_extra_bytes": None,
                    "repeats": 0,
                    "memory_method": method,
                    "threads": torch.get_num_threads(),
                    "other_cpu_load": None,
                    "skipped": reason,
                    **env,
                })
    todo = [r for r in records if r["skipped"] is None]
    shape = dict(batch=batch, nheads=nheads, headdim=headdim, dtype=dtype, causal=causal)

    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=2 * len(todo), desc="attention_cpu", unit="step", leave=True)

    def step(label):
        if bar is not None:
            bar.set_postfix_str(label, refresh=False)
            bar.update(1)

    try:
        # Phase 1: memory.
        if memory == "isolated":
            it = iter(todo)

            def got(res):
                r = next(it)
                r["peak_extra_bytes"] = res["peak_extra_bytes"]
                step(f"memory {r['mode']} N={r['seqlen_q']} {r['impl']}")

            if bar is not None:
                bar.set_postfix_str("memory: starting a fresh interpreter")
            memory_isolated([dict(impl=r["impl"], mode=r["mode"], seqlen=r["seqlen_q"], **shape) for r in todo], on_result=got)
        # Phase 2 (and in-process memory): this process.
        warmup(impls, modes, headdim, dtype, causal)
        # peak_memory() runs a full gc.collect(); with torch's (and dynamo's) objects moved
        # out of the collector's way that takes milliseconds instead of ~0.3 s.
        gc.collect()
        gc.freeze()
        try:
            if memory == "inprocess":
                for r in todo:
                    r["peak_extra_bytes"] = memory_one(r["impl"], r["mode"], r["seqlen_q"], **shape)["peak_extra_bytes"]
                    step(f"memory {r['mode']} N={r['seqlen_q']} {r['impl']}")
            for r in records:
                if r["skipped"] is None:
                    best, best_load = None, None
                    for _attempt in range(1 + (0 if quick else contention_retries)):
                        with OtherCpuLoad() as load:
                            res = time_one(r["impl"], r["mode"], r["seqlen_q"], quick=quick, **shape)
                        frac = load.fraction or 0.0
                        if best is None or frac < best_load:
                            best, best_load = res, frac
                        if frac <= CONTENDED:
                            break
                    r.update(best)
                    # Other processes slow CPU timings a lot (torch's OpenMP threads spin-wait):
                    # the share of the cores they used during the timing flags that.
                    r["other_cpu_load"] = best_load
                    step(f"timing {r['mode']} N={r['seqlen_q']} {r['impl']}")
                if out_path is not None:
                    write_jsonl(out_path, [r])  # as we go: an interrupted run keeps what it measured
        finally:
            gc.unfreeze()
    finally:
        if bar is not None:
            bar.close()
    if print_table:
        print(format_table(records))
        if out_path is not None:
            print(f"\n{len(records)} records appended to {out_path}")
    return records


def run_cpu_sweep(
    seqlens: Sequence[int] = (1024, 4096, 16384),
    headdims: Sequence[int] = (64, 128),
    causals: Sequence[bool] = (False, True),
    out_dir: str | Path | None = _AUTO,
    impls: Sequence[str] = ("flashtile", "sdpa"),
    progress: bool = True,
    **kwargs,
) -> list[dict]:
    """:func:`run_cpu_benchmark` for every (headdim, causal), as one run (one ``run`` id, one
    thread count): forward and forward + backward at every N by default.  Appends the records
    to ``out_dir / "attention_cpu.jsonl"``, draws them to ``attention_cpu.png`` there (when
    matplotlib is installed) and prints :func:`format_ratios`."""
    if out_dir == _AUTO:
        out_dir = default_out_dir()
    out_path = None if out_dir is None else Path(out_dir) / "attention_cpu.jsonl"
    kwargs.setdefault("bwd_max_seqlen", max(seqlens))
    run = environment("cpu")["date"]
    records = []
    for headdim in headdims:
        for causal in causals:
            records += run_cpu_benchmark(seqlens=seqlens, headdim=headdim, causal=causal, out_path=out_path,
                                         impls=impls, progress=progress, print_table=False, run=run, **kwargs)
    print(format_ratios(records))
    if out_dir is not None:
        print(f"\n{len(records)} records appended to {out_path}")
        try:
            plot_cpu(records, Path(out_dir) / "attention_cpu.png")
        except ImportError:
            print("matplotlib is not installed: no plot")
        else:
            print(f"plot of this run: {Path(out_dir) / 'attention_cpu.png'}")
    return records


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m flashtile.bench.cpu [--out DIR] [--seqlens N ...] [--headdims D ...]``: the
    sweep of :func:`run_cpu_sweep` (flashtile against PyTorch's SDPA)."""
    import argparse

    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="python -m flashtile.bench.cpu", description=main.__doc__.split(".")[0])
    parser.add_argument("--out", metavar="DIR", default=None, help="results folder (default: the per-user cache)")
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--headdims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if min(args.seqlens) < 1 or not all(1 <= d <= 256 for d in args.headdims):
        parser.error("--seqlens must be >= 1 and --headdims in [1, 256]")
    out = _AUTO if args.out is None else Path(args.out)
    if out is not _AUTO:
        out.mkdir(parents=True, exist_ok=True)
    run_cpu_sweep(seqlens=args.seqlens, headdims=args.headdims, out_dir=out, progress=not args.no_progress)
    return 0


if __name__ == "__main__":
    sys.exit(main())
