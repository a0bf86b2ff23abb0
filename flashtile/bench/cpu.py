"""CPU attention benchmark: flashtile's tiled path against naive attention and PyTorch SDPA.

(One module over 600 lines on purpose: the one CPU benchmark -- timing, peak memory in a
fresh interpreter, the sweep against SDPA, its table and plot.)

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
"""

from __future__ import annotations

import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F

from flashtile.bench.common import (
    OtherCpuLoad,
    cpu_peak_memory_method,
    default_out_dir,
    environment,
    format_bytes,
    peak_memory,
    save_figure,
    subplots,
    write_jsonl,
)

IMPLS = ("flashtile", "naive", "sdpa")
MODES = ("fwd", "fwd_bwd")
DEFAULT_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
QUICK_SEQLENS = (256, 512)  # `flashtile bench --quick`: a smoke test of a few seconds
NAIVE_BUDGET_BYTES = 8 * 1024**3  # skip naive when the N x N score matrix alone exceeds this
CONTENDED = 0.1  # other processes' share of the cores above which a timing is flagged

_AUTO = "auto"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --------------------------------------------------------------------------------------------
# The implementations.  Inputs are in flash-attn's layout (batch, seqlen, heads, headdim);
# naive and sdpa get (batch, heads, seqlen, headdim) *views* of the same storage (no copy).
# --------------------------------------------------------------------------------------------


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """``softmax(q k^T * scale) v`` for ``(b, h, n, d)`` tensors, materialising the scores.

    Causal is aligned to the bottom right (query i sees key j iff j <= i + n_k - n_q), like
    flashtile.  Written to be fair to the naive approach: the scale is folded into q, the
    mask is applied in place, so the forward peaks at two N x N tensors (S and P).
    """
    s = torch.matmul(q * scale, k.transpose(-1, -2))
    if causal:
        n_q, n_k = s.shape[-2], s.shape[-1]
        mask = torch.ones(n_q, n_k, dtype=torch.bool, device=s.device).triu_(n_k - n_q + 1)
        s.masked_fill_(mask, float("-inf"))
        del mask
    p = torch.softmax(s, dim=-1)
    del s
    return torch.matmul(p, v)


def _attention_call(impl: str, causal: bool) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """A function of (q, k, v) in flash layout returning the output (layout of the impl)."""
    if impl == "flashtile":
        from flashtile import flash_attn_func

        return lambda q, k, v: flash_attn_func(q, k, v, causal=causal)
    if impl == "naive":

        def run(q, k, v):
            return naive_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), q.shape[-1] ** -0.5, causal)

        return run
    if impl == "sdpa":

        def run(q, k, v):
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)

        return run
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


class _Case:
    """Inputs for one measurement and the zero-argument call to time / measure."""

    def __init__(self, impl, mode, batch, seqlen, nheads, headdim, dtype, causal, seed=0):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        g = torch.Generator().manual_seed(seed)
        shape = (batch, seqlen, nheads, headdim)
        grad = mode == "fwd_bwd"
        self.q, self.k, self.v = (torch.randn(shape, generator=g, dtype=dtype).requires_grad_(grad) for _ in range(3))
        self.dout = torch.randn(shape, generator=g, dtype=dtype) if grad else None
        self.mode = mode
        self.attn = _attention_call(impl, causal)
        self.impl = impl

    def reset(self):
        """Drop gradients of the previous call (outside the measured region)."""
        for t in (self.q, self.k, self.v):
            t.grad = None

    def __call__(self):
        if self.mode == "fwd":
            with torch.no_grad():
                return self.attn(self.q, self.k, self.v)
        out = self.attn(self.q, self.k, self.v)
        # naive / sdpa return (b, h, n, d); hand them the matching view of dout.
        dout = self.dout if out.shape == self.dout.shape else self.dout.transpose(1, 2)
        out.backward(dout)
        return None


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _naive_skip_reason(batch, nheads, seqlen, dtype, mode, budget) -> str | None:
    s_bytes = batch * nheads * seqlen * seqlen * torch.empty((), dtype=dtype).element_size()
    if s_bytes > budget:
        return f"N x N scores need {format_bytes(s_bytes)} > budget {format_bytes(budget)}"
    need = s_bytes * (2 if mode == "fwd" else 4)
    avail = _mem_available()
    if avail is not None and need > 0.8 * avail:
        return f"estimated peak {format_bytes(need)} > 80% of available memory {format_bytes(avail)}"
    return None


WARMUP_SEQLENS = (256, 1024)


def _warmup(impls: Iterable[str], modes: Iterable[str], headdim: int, dtype: torch.dtype, causal: bool) -> None:
    """Pay one-time costs (lazy imports, op registration, thread pools) before measuring.

    Two sizes, because PyTorch's fused CPU kernel (behind SDPA and flashtile's CPU path)
    picks its block sizes by seqlen_q (< 192, < 768, >= 768), each a separate template
    instance: without the larger warm-up the first case measured at N >= 768 pays for
    faulting in that code (~0.6 MiB of resident set), which whichever implementation runs
    second then gets for free."""
    for n in WARMUP_SEQLENS:
        for impl in impls:
            for mode in modes:
                case = _Case(impl, mode, 1, n, 1, headdim, dtype, causal)
                case()
                case.reset()


def time_one(
    impl: str,
    mode: str,
    seqlen: int,
    batch: int = 1,
    nheads: int = 1,
    headdim: int = 64,
    dtype: torch.dtype = torch.float32,
    causal: bool = False,
    quick: bool = False,
    target_s: float = 1.0,
    max_repeats: int = 10,
) -> dict:
    """Median wall time of one case: ``{"ms", "repeats"}``.

    A first, untimed call warms the case up and its duration picks the number of timed
    repeats: about ``target_s`` seconds of them, at least 2 and at most ``max_repeats``
    (1 when ``quick``).  Call after :func:`_warmup` (``run_cpu_benchmark`` does).
    """
    case = _Case(impl, mode, batch, seqlen, nheads, headdim, dtype, causal)
    t0 = time.perf_counter()
    case()
    first_s = time.perf_counter() - t0
    if quick:
        repeats = 1
    else:
        repeats = max(min(2, max_repeats), min(max_repeats, math.ceil(target_s / max(first_s, 1e-6))))
    times = []
    for _ in range(repeats):
        case.reset()
        t0 = time.perf_counter()
        case()
        times.append(time.perf_counter() - t0)
    return {"ms": statistics.median(times) * 1e3, "repeats": repeats}


def memory_one(
    impl: str,
    mode: str,
    seqlen: int,
    batch: int = 1,
    nheads: int = 1,
    headdim: int = 64,
    dtype: torch.dtype = torch.float32,
    causal: bool = False,
) -> dict:
    """Peak extra memory of one call, in this process: ``{"peak_extra_bytes", "call_ms"}``.

    Fresh inputs, then :func:`~flashtile.bench.common.peak_memory` (gc, ``malloc_trim``,
    peak-RSS reset, call).  ``call_ms`` is that single call's duration (it includes faulting
    in fresh pages: not a timing to compare).  Call after :func:`_warmup`.
    """
    case = _Case(impl, mode, batch, seqlen, nheads, headdim, dtype, causal)
    t0 = time.perf_counter()
    _, peak = peak_memory(case)
    return {"peak_extra_bytes": peak, "call_ms": (time.perf_counter() - t0) * 1e3}


# In the measuring process every allocation of 64 KiB or more gets its own mapping and is
# unmapped on free (glibc's dynamic threshold is off), so the resident set follows the live
# tensors instead of the heap's history: readings then repeat to ~0.1 MiB, where with the
# default allocator they drift by a few MiB from run to run.
ISOLATED_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def memory_isolated(
    specs: Sequence[dict], on_result: Callable[[dict], None] | None = None, timeout: float | None = None
) -> list[dict]:
    """:func:`memory_one` for each spec, in one fresh Python interpreter, in order.

    Each spec is a dict of :func:`memory_one`'s arguments (``dtype`` a torch dtype or its
    name, e.g. ``"float32"``).  The interpreter runs with :data:`ISOLATED_ENV`, warms every
    (impl, mode) up (:func:`_warmup`), then measures the specs one after the other, so it holds no
    heap from anything else.  ``on_result`` is called with each result as it arrives.
    Start-up costs a few seconds (importing torch, the first custom-op call).
    """
    specs = [dict(s) for s in specs]
    for spec in specs:
        if isinstance(spec.get("dtype"), torch.dtype):
            spec["dtype"] = dtype_name(spec["dtype"])
    env = {**os.environ, **ISOLATED_ENV}
    proc = subprocess.Popen(
        [sys.executable, "-m", "flashtile.bench.cpu", "--measure-memory", json.dumps(specs)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    results = []
    try:
        for line in proc.stdout:
            line = line.strip()
            if not line.startswith("{"):
                continue
            res = json.loads(line)
            results.append(res)
            if on_result is not None:
                on_result(res)
        stderr = proc.stderr.read()
        rc = proc.wait(timeout=timeout)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    if rc != 0 or len(results) != len(specs):
        raise RuntimeError(
            f"memory measurement subprocess failed (exit {rc}, {len(results)}/{len(specs)} results):\n{stderr[-4000:]}"
        )
    return results


def _memory_worker(specs_json: str) -> None:
    specs = json.loads(specs_json)
    for spec in specs:
        spec["dtype"] = getattr(torch, spec.get("dtype", "float32"))
    for impl, mode, headdim, dtype, causal in dict.fromkeys(
        (s["impl"], s["mode"], s.get("headdim", 64), s["dtype"], s.get("causal", False)) for s in specs
    ):
        _warmup([impl], [mode], headdim, dtype, causal)
    gc.collect()
    gc.freeze()  # keeps peak_memory's full gc.collect() cheap
    for spec in specs:
        print(json.dumps(memory_one(**spec)), flush=True)


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
                reason = _naive_skip_reason(batch, nheads, n, dtype, mode, naive_budget_bytes) if impl == "naive" else None
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
        _warmup(impls, modes, headdim, dtype, causal)
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


def plot_cpu(records: Sequence[dict], path: str | Path) -> None:
    """Draw ``records`` (one run of :func:`run_cpu_benchmark` or :func:`run_cpu_sweep`) to
    ``path``: median time and peak extra memory against N, a line per (impl, mode), log-log;
    one row of two panels per (headdim, causal) shape.

    Raises ImportError without matplotlib."""
    shapes = list(dict.fromkeys((r["headdim"], r["causal"]) for r in records)) or [(None, None)]
    fig, axes = subplots(len(shapes), 2, figsize=(10, 3.8 * len(shapes)), squeeze=False)
    styles = {"fwd": "-", "fwd_bwd": "--"}
    impls = list(dict.fromkeys(r["impl"] for r in records))
    for (ax_t, ax_m), (headdim, causal) in zip(axes, shapes):
        rows_of_shape = [r for r in records if (r["headdim"], r["causal"]) == (headdim, causal)]
        for i, impl in enumerate(impls):
            color = f"C{i}"
            for mode in dict.fromkeys(r["mode"] for r in rows_of_shape):
                rows = sorted((r for r in rows_of_shape if r["impl"] == impl and r["mode"] == mode
                               and r.get("ms") is not None), key=lambda r: r["seqlen_q"])
                if not rows:
                    continue
                label = f"{impl} {mode.replace('_', '+')}"
                n = [r["seqlen_q"] for r in rows]
                ax_t.plot(n, [r["ms"] for r in rows], styles.get(mode, "-"), color=color, marker="o", ms=3, label=label)
                mem = [(r["seqlen_q"], r["peak_extra_bytes"] / 2**20) for r in rows if r.get("peak_extra_bytes")]
                if mem:
                    ax_m.plot(*zip(*mem), styles.get(mode, "-"), color=color, marker="o", ms=3, label=label)
        r0 = rows_of_shape[0] if rows_of_shape else {}
        title = (f"CPU attention: batch {r0.get('batch')}, heads {r0.get('nheads')}, d={r0.get('headdim')}, "
                 f"{r0.get('dtype')}, causal={r0.get('causal')}, {r0.get('threads')} threads")
        seqlens = sorted({r["seqlen_q"] for r in rows_of_shape})
        for ax, ylabel in ((ax_t, "median ms"), (ax_m, "peak extra MiB")):
            ax.set_xscale("log", base=2)
            ax.set_xticks(seqlens, [str(n) for n in seqlens])
            ax.minorticks_off()
            ax.set_yscale("log")
            ax.set_xlabel("sequence length N")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3, which="both")
        ax_t.set_title(title, fontsize=9)
        ax_m.set_title(str(r0.get("device", "")), fontsize=8)
        ax_t.legend(fontsize=7)
    save_figure(fig, path)


def format_ratios(records: Sequence[dict], baseline: str = "sdpa", impl: str = "flashtile") -> str:
    """``impl`` against ``baseline`` case by case: speed-up (baseline ms / impl ms, > 1 means
    ``impl`` is faster) and peak-extra-memory ratio (impl / baseline, < 1 means it uses less)."""
    by = {(r["impl"], r["mode"], r["headdim"], r["causal"], r["seqlen_q"]): r for r in records}
    lines = [f"{impl} vs {baseline}: speed-up = {baseline} ms / {impl} ms; memory = {impl} / {baseline} peak extra",
             f"{'mode':>8} {'d':>4} {'causal':>6} {'N':>6} | {impl + ' ms':>13} {baseline + ' ms':>10} "
             f"{'speed-up':>8} | {'memory':>6}"]
    lines.append("-" * len(lines[-1]))
    for (name, mode, d, causal, n), r in by.items():
        b = by.get((baseline, mode, d, causal, n))
        if name != impl or b is None or r.get("ms") is None or b.get("ms") is None:
            continue
        mem = (f"{r['peak_extra_bytes'] / b['peak_extra_bytes']:>6.2f}"
               if r.get("peak_extra_bytes") and b.get("peak_extra_bytes") else f"{'-':>6}")
        lines.append(f"{mode:>8} {d:>4} {str(causal):>6} {n:>6} | {r['ms']:>13.1f} {b['ms']:>10.1f} "
                     f"{b['ms'] / r['ms']:>8.2f} | {mem}")
    return "\n".join(lines)


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


def format_table(records: Sequence[dict]) -> str:
    """Plain-text table: one block per mode, a row per N, ms and peak MiB per impl."""
    if not records:
        return "(no records)"
    lines = []
    contended = False
    r0 = records[0]
    lines.append(
        f"attention on CPU: batch {r0['batch']}, heads {r0['nheads']}, headdim {r0['headdim']}, "
        f"{r0['dtype']}, causal={r0['causal']}; median ms, peak extra MiB ({r0.get('memory_method', '?')})"
    )
    lines.append(f"device: {r0.get('device', '?')}, torch {r0.get('torch', '?')}")
    impls = list(dict.fromkeys(r["impl"] for r in records))
    for mode in dict.fromkeys(r["mode"] for r in records):
        rows = [r for r in records if r["mode"] == mode]
        seqlens = sorted({r["seqlen_q"] for r in rows})
        by = {(r["seqlen_q"], r["impl"]): r for r in rows}
        head = f"{'N':>7}" + "".join(f" | {impl + ' ms':>13} {'MiB':>8}" for impl in impls)
        lines.append("")
        lines.append(f"[{mode}]")
        lines.append(head)
        lines.append("-" * len(head))
        for n in seqlens:
            cells = []
            for impl in impls:
                r = by.get((n, impl))
                if r is None or r.get("skipped") or r.get("ms") is None:
                    cells.append(f" | {'skipped' if r is not None and r.get('skipped') else '-':>13} {'-':>8}")
                else:
                    mib = r["peak_extra_bytes"] / 2**20 if r.get("peak_extra_bytes") is not None else float("nan")
                    busy = (r.get("other_cpu_load") or 0) > CONTENDED
                    contended |= busy
                    cells.append(f" | {r['ms']:>12.2f}{'*' if busy else ' '} {mib:>8.1f}")
            lines.append(f"{n:>7}" + "".join(cells))
    if contended:
        lines.append("")
        lines.append(f"* other processes used > {CONTENDED:.0%} of the CPU during that case: its time is inflated")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m flashtile.bench.cpu [--out DIR] [--seqlens N ...] [--headdims D ...]``: the
    sweep of :func:`run_cpu_sweep` (flashtile against PyTorch's SDPA).  Also the worker of
    :func:`memory_isolated` (``--measure-memory JSON``)."""
    import argparse

    argv = sys.argv[1:] if argv is None else list(argv)
    if len(argv) == 2 and argv[0] == "--measure-memory":
        _memory_worker(argv[1])
        return 0
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
