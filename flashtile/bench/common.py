"""Helpers shared by the benchmarks: environment record, JSONL output, peak-memory probe, knobs
set for a block.

Every benchmark record carries :func:`environment` so a JSONL line says on which machine,
with which torch/triton, and when it was measured.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime as _dt
import gc
import json
import os
import platform
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

__all__ = [
    "default_out_dir",
    "environ_set",
    "environment",
    "write_jsonl",
    "read_jsonl",
    "peak_memory",
    "cpu_peak_memory_method",
    "format_bytes",
    "standard_batch_heads",
    "OtherCpuLoad",
]


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _cpu_name() -> str:
    name = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    if not name:
        name = platform.processor() or platform.machine() or "cpu"
    return f"{name} ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"


def environment(device: str | torch.device | None = None) -> dict[str, Any]:
    """Where and with what a measurement was taken.

    Keys: ``device`` (``torch.cuda.get_device_name()`` for a CUDA device, else the CPU's model
    name with its core and torch-thread counts), ``date`` (ISO 8601, UTC), ``torch``,
    ``triton`` (version string, or ``None`` when triton is not installed), ``python``.

    ``device``: the device the benchmark ran on; default CUDA when available, else CPU.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda":
        dev_name = torch.cuda.get_device_name(device)
    else:
        dev_name = _cpu_name()
    return {
        "device": dev_name,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "python": platform.python_version(),
    }


@contextlib.contextmanager
def environ_set(name: str, value: str | None):
    """``os.environ[name]`` set to ``value`` inside the block and restored after (unset again
    if it was); ``None`` leaves it as it is.  flashtile reads its knob variables at every call,
    so a benchmark switches engines and tunings this way without patching anything."""
    if value is None:
        yield
        return
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


def default_out_dir() -> Path:
    """Where a benchmark writes when no folder is given: ``$XDG_CACHE_HOME/flashtile``, else
    ``~/.cache/flashtile``.

    A per-user folder rather than the current directory, so that running a benchmark inside
    a checkout of this repository leaves the checkout as it was (the committed results in
    ``benchmarks/results`` are regenerated with an explicit ``--out benchmarks/results``).
    """
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "flashtile"


def write_jsonl(path: str | os.PathLike, records: Iterable[dict]) -> Path:
    """Append ``records`` to ``path``, one JSON object per line; creates parent directories.

    Appending (never truncating) keeps earlier runs, so one file accumulates a history that
    readers can filter by ``date``/``device``.  Each line is written whole with a single
    ``write`` call in append mode.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec, sort_keys=False) + "\n")
    return path


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Read back a JSONL file written by :func:`write_jsonl` (blank lines ignored)."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def format_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


# --------------------------------------------------------------------------------------------
# Peak memory
# --------------------------------------------------------------------------------------------

_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"


def _proc_status_bytes(key: str) -> int | None:
    try:
        with open(_STATUS) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        return None
    return None


def _malloc_trim() -> None:
    """Give free heap pages back to the OS (glibc only), so that they count again when reused."""
    try:
        libc = ctypes.CDLL(None)
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _reset_hwm() -> bool:
    """Reset the kernel's peak-RSS counter (VmHWM) to the current RSS (Linux >= 4.0)."""
    try:
        with open(_CLEAR_REFS, "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _ru_maxrss_bytes() -> int:
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024  # bytes on macOS, KiB on Linux


def cpu_peak_memory_method() -> str:
    """Name of the method :func:`peak_memory` uses for CPU calls on this machine."""
    if _proc_status_bytes("VmHWM") is not None and os.access(_CLEAR_REFS, os.W_OK):
        return "rss-hwm"
    return "ru_maxrss"


def peak_memory(fn: Callable[[], Any], device: str | torch.device = "cpu") -> tuple[Any, int]:
    """Run ``fn()`` once and return ``(result, peak_extra_bytes)``.

    ``peak_extra_bytes`` is the highest amount of memory the call needed *on top of* what was
    in use when it started -- so allocate the inputs before calling this, and they are the
    baseline.  Whatever ``fn`` returns (e.g. the attention output, or gradients it leaves in
    ``.grad``) is part of the peak, since the call had to allocate it.

    CUDA (``device`` on a GPU): ``torch.cuda.reset_peak_memory_stats()``, then
    ``torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()`` measured before
    the call.  These are exact byte counts of tensor allocations (caching-allocator slack
    is not counted).

    CPU: torch has no allocator statistics for CPU tensors (and ``tracemalloc`` does not see
    them), so this measures the process's resident set size, the memory the OS actually had
    to provide:

    1. ``gc.collect()`` and glibc's ``malloc_trim(0)``, so that heap memory freed by earlier
       work is returned to the OS and must be faulted in again (and so counted) if reused;
    2. reset the kernel's peak-RSS counter to the current RSS by writing ``5`` to
       ``/proc/self/clear_refs`` (Linux >= 4.0);
    3. baseline = current RSS (``VmRSS`` in ``/proc/self/status``), after the inputs exist;
    4. run ``fn()``; peak = ``VmHWM`` (the peak RSS since the reset).

    ``peak - baseline`` is then the call's own high-water mark, with page (4 KiB) and
    allocator-rounding granularity.  One-time costs of a *first* call (lazy imports,
    code pages of libraries faulted in, thread pools) are counted too, so warm the function
    up on a small input first when those are not what you want to measure; the benchmarks
    in :mod:`flashtile.bench` do.  Only tensors that are written count (untouched
    ``torch.empty`` pages are not resident) -- attention writes all it allocates.

    Where ``/proc/self/clear_refs`` is not writable (non-Linux), this falls back to
    ``ru_maxrss`` after minus before the call, which is only a lower bound: the lifetime peak
    before the call hides any part of the call's peak below it.  Run such a measurement
    in a fresh process.  :func:`cpu_peak_memory_method` tells which method applies.
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        result = fn()
        torch.cuda.synchronize(device)
        return result, max(0, torch.cuda.max_memory_allocated(device) - before)

    gc.collect()
    _malloc_trim()
    if cpu_peak_memory_method() == "rss-hwm":
        _reset_hwm()
        baseline = _proc_status_bytes("VmRSS")
        result = fn()
        peak = _proc_status_bytes("VmHWM")
        return result, max(0, peak - baseline)
    before = _ru_maxrss_bytes()
    result = fn()
    return result, max(0, _ru_maxrss_bytes() - before)


# --------------------------------------------------------------------------------------------
# Contention
# --------------------------------------------------------------------------------------------


def _proc_stat_busy_s() -> float | None:
    """Busy CPU seconds of the whole machine (all cores) since boot, from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class OtherCpuLoad:
    """Context manager: how busy *other* processes kept the machine during the block.

    ``fraction`` = (machine busy CPU time - this process's and its waited children's CPU
    time) / (wall time * cores), clipped to [0, 1]; ``None`` where /proc/stat is missing.
    CPU timings are only comparable when it is near 0: torch's OpenMP threads spin-wait,
    so a second busy process on a 2-core machine can slow a call many times over.
    """

    def __enter__(self):
        self._busy0, self._own0, self._t0 = _proc_stat_busy_s(), _own_cpu_s(), time.perf_counter()
        self.fraction = None
        return self

    def __exit__(self, *exc):
        busy1, own1, wall = _proc_stat_busy_s(), _own_cpu_s(), time.perf_counter() - self._t0
        if self._busy0 is not None and busy1 is not None and wall > 0:
            other = (busy1 - self._busy0) - (own1 - self._own0)
            self.fraction = round(min(1.0, max(0.0, other / (wall * (os.cpu_count() or 1)))), 3)
        return False



def shape_sweep(headdims, causal, seqlens):
    """``(headdim, causal, seqlen)`` of a benchmark's ``--headdims`` / ``--causal`` (0 / 1) /
    ``--seqlens`` sweep, in that nesting order (head dim outermost)."""
    return [(d, bool(c), n) for d in headdims for c in causal for n in seqlens]


def standard_batch_heads(seqlen: int, headdim: int) -> tuple[int, int]:
    """``(batch, heads)`` of the standard attention shape at this sequence length and head dim:
    batch * seqlen = 16k tokens (at least one sequence, so 32k and longer keep batch 1) and
    heads * headdim = 2048."""
    return max(1, 16384 // seqlen), 2048 // headdim


def compile_for_benchmark(fn):
    """``torch.compile(fn, dynamic=False)`` with dynamo's recompile limit raised: a benchmark
    compiles once per shape, and past the default limit dynamo silently falls back to eager."""
    from torch import _dynamo

    _dynamo.config.cache_size_limit = 1024
    if hasattr(_dynamo.config, "recompile_limit"):
        _dynamo.config.recompile_limit = 1024
    return torch.compile(fn, dynamic=False)


def subplots(*args, **kwargs):
    """``matplotlib.pyplot.subplots`` on the Agg backend (files only, no display needed).

    Raises ImportError without matplotlib, which the benchmarks treat as "no plot"."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(*args, **kwargs)


def save_figure(fig, path, dpi: int = 110) -> None:
    """Lay out, write and close a figure made by :func:`subplots`."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def plot_host_us(labels, us, colors, title: str, path) -> None:
    """One horizontal bar of host microseconds per call for each case, labelled."""
    fig, ax = subplots(figsize=(9, 0.27 * len(us) + 1.2))
    ax.barh(range(len(us)), us, color=colors)
    ax.set_yticks(range(len(us)), labels, fontsize=7)
    ax.invert_yaxis()
    for i, x in enumerate(us):
        ax.text(x, i, f" {x:.0f}", va="center", fontsize=7)
    ax.set_xlabel("host us per call (GPU idle-bound)")
    ax.set_title(title, fontsize=8)
    save_figure(fig, path)


def save_results(records, out_dir, name: str, print_table, plot) -> None:
    """Append ``records`` to ``out_dir/name.jsonl``, print the table, draw ``out_dir/name.png``."""
    print_table(records)
    save_records(records, Path(out_dir) / f"{name}.jsonl", plot)


def save_records(records, path, plot) -> None:
    """Append ``records`` to ``path`` (a ``.jsonl``) and draw ``plot(records, png)`` beside it."""
    jsonl = write_jsonl(path, records)
    print(f"{len(records)} records appended to {jsonl}")
    png = jsonl.with_suffix(".png")
    try:
        plot(records, png)
    except ImportError:
        print("matplotlib not installed: no plot")
    else:
        print(f"plot: {png}")
