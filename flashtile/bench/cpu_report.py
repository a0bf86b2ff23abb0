"""The CPU attention benchmark's records as a text table, a comparison of two
implementations, and a plot."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from flashtile.bench.common import save_figure, subplots
from flashtile.bench.cpu_measure import CONTENDED


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
