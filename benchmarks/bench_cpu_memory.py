"""The CPU path's memory is O(N), not O(N^2): measured up to N = 32k, next to PyTorch's SDPA.

    python benchmarks/bench_cpu_memory.py [--seqlens 4096 8192 16384 32768] [--bwd-max 32768]

batch 1, 1 head, headdim 64, float32, non-causal: a call flashtile's CPU path gives to
PyTorch's fused flash kernel (flashtile.cpu, engine "fused"), the kernel SDPA runs too.  For
every N it runs flashtile's and SDPA's forward and forward+backward once, each in a fresh
Python process (warmed up first, glibc set to give every allocation >= 64 KiB back on free,
see ``flashtile.bench.cpu.ISOLATED_ENV``), and records the peak extra resident memory of the
call (:func:`flashtile.bench.common.peak_memory`: peak RSS during the call minus RSS with the
inputs allocated).  It prints bytes and bytes/N, flashtile / SDPA, and a least-squares fit
peak = a + b * N: a constant (score blocks and allocator slack, a few MiB) plus a slope close
to the O(N) outputs, next to the 4 * N^2 bytes that the fp32 N x N score matrix of naive attention alone would take (computed; naive is measured for real only
where that is small, N <= 8192).

What the linear term is: the forward returns out (N x D fp32 = 256 B per token at D=64) and
the LSE (4 B per token); the backward leaves dq, dk, dv (3 x 256 B per token).  Everything
else is per-thread score blocks, independent of N.

Records are appended to benchmarks/results/cpu_memory.jsonl (bench="cpu_memory").
Runtime on 2 idle cores: about 3-4 minutes (forward+backward at 32k is ~30-60 s by itself).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


from flashtile.bench.common import (OtherCpuLoad, cpu_peak_memory_method, environment, format_bytes, read_jsonl,
                                    save_figure, subplots, write_jsonl)
from flashtile.bench.cpu import ISOLATED_ENV, memory_isolated

HERE = Path(__file__).resolve().parent
OUT = HERE / "results" / "cpu_memory.jsonl"
D = 64


# Bytes per token of the O(N) tensors a call has to produce (float32, D = 64):
# fwd: out (D*4) + LSE (4); fwd_bwd: also dq, dk, dv (3*D*4).
EXPECTED_PER_TOKEN = {"fwd": D * 4 + 4, "fwd_bwd": 4 * D * 4 + 4}


def _fit(xs, ys):
    """Least-squares line y = a + b x."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--bwd-max", type=int, default=32768, help="largest N for forward+backward")
    parser.add_argument("--naive-max", type=int, default=8192, help="largest N at which naive is run for real")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--no-sdpa", action="store_true", help="measure flashtile (and naive) only")
    parser.add_argument("--plot-only", action="store_true", help="redraw the PNG beside --out from its records")
    args = parser.parse_args(argv)
    if args.plot_only:
        plot(read_jsonl(args.out), args.out.with_suffix(".png"))
        return 0

    env = environment("cpu")
    method = cpu_peak_memory_method() + ", fresh process per case, " + " ".join(f"{k}={v}" for k, v in ISOLATED_ENV.items())
    print(f"flashtile CPU path, peak extra memory: batch 1, 1 head, headdim {D}, float32, non-causal")
    print(f"device: {env['device']}; torch {env['torch']}; method: {method}\n")

    t_start = time.perf_counter()
    cases = [("flashtile", "fwd", n) for n in args.seqlens]
    cases += [("flashtile", "fwd_bwd", n) for n in args.seqlens if n <= args.bwd_max]
    if not args.no_sdpa:
        cases += [("sdpa", "fwd", n) for n in args.seqlens]
        cases += [("sdpa", "fwd_bwd", n) for n in args.seqlens if n <= args.bwd_max]
    cases += [("naive", "fwd", n) for n in args.seqlens if n <= args.naive_max]
    records = []
    for impl, mode, n in cases:
        t0 = time.perf_counter()
        with OtherCpuLoad() as load:
            (r,) = memory_isolated([dict(impl=impl, mode=mode, seqlen=n, headdim=D)])
        wall = time.perf_counter() - t0
        rec = {
            "bench": "cpu_memory",
            "impl": impl,
            "mode": mode,
            "dtype": "float32",
            "batch": 1,
            "nheads": 1,
            "nheads_k": 1,
            "seqlen_q": n,
            "seqlen_k": n,
            "headdim": D,
            "causal": False,
            # One call, the measured one (includes faulting in fresh pages): not a tuned timing.
            "ms": r["call_ms"],
            "peak_extra_bytes": r["peak_extra_bytes"],
            "bytes_per_token": r["peak_extra_bytes"] / n,
            "naive_scores_bytes": 4 * n * n,
            "memory_method": method,
            "other_cpu_load": load.fraction,
            **env,
        }
        records.append(rec)
        write_jsonl(args.out, [rec])
        print(f"  measured {impl:9s} {mode:7s} N={n:6d}: {format_bytes(rec['peak_extra_bytes']):>10}  "
              f"({rec['ms'] / 1e3:.1f} s call, {wall:.0f} s with process start; not a timing: the "
              f"measuring allocator maps every block afresh)", flush=True)

    print()
    nd4 = lambda n: n * D * 4  # one N x D float32 tensor
    for mode in ("fwd", "fwd_bwd"):
        rows = [r for r in records if r["impl"] == "flashtile" and r["mode"] == mode]
        if not rows:
            continue
        print(f"[{mode}] flashtile")
        head = f"{'N':>6} | {'peak extra':>11} | {'bytes/N':>8} | {'x (N*D*4)':>9} | {'vs prev N':>9} | {'naive S = 4*N^2':>15} | {'S / flashtile':>13}"
        print(head)
        print("-" * len(head))
        prev = None
        for r in rows:
            n, b = r["seqlen_q"], r["peak_extra_bytes"]
            growth = f"{b / prev:.2f}x" if prev else "-"
            print(f"{n:>6} | {format_bytes(b):>11} | {b / n:>8.0f} | {b / nd4(n):>9.2f} | {growth:>9} | "
                  f"{format_bytes(4 * n * n):>15} | {4 * n * n / b:>12.0f}x")
            prev = b
        if len(rows) >= 2:
            a, slope = _fit([r["seqlen_q"] for r in rows], [r["peak_extra_bytes"] for r in rows])
            expect = EXPECTED_PER_TOKEN[mode]
            print(f"least-squares fit: peak ~ {format_bytes(a)} + {slope:.0f} B x N   "
                  f"(O(N) tensors it must return/keep: {expect} B/token; naive's S alone: 4*N B/token, "
                  f"{4 * rows[-1]['seqlen_q']} at N={rows[-1]['seqlen_q']})")
        print()
    sdpa = {(r["mode"], r["seqlen_q"]): r["peak_extra_bytes"] for r in records if r["impl"] == "sdpa"}
    if sdpa:
        print("flashtile / sdpa peak extra memory")
        for r in records:
            other = sdpa.get((r["mode"], r["seqlen_q"])) if r["impl"] == "flashtile" else None
            if other:
                print(f"  {r['mode']:7s} N={r['seqlen_q']:6d}: {format_bytes(r['peak_extra_bytes']):>10} / "
                      f"{format_bytes(other):>10} = {r['peak_extra_bytes'] / other:.2f}")
        print()
    naive = [r for r in records if r["impl"] == "naive"]
    if naive:
        print("[fwd] naive attention, measured (materialises S and P = softmax(S))")
        for r in naive:
            n, b = r["seqlen_q"], r["peak_extra_bytes"]
            print(f"{n:>6} | {format_bytes(b):>11} | {b / (4 * n * n):.2f} x 4*N^2")
        print()
    skipped = [n for n in args.seqlens if n > args.bwd_max]
    if skipped:
        print(f"forward+backward not run for N = {skipped} (--bwd-max {args.bwd_max})")
    print(f"total {time.perf_counter() - t_start:.0f} s; {len(records)} records appended to {args.out}")
    try:
        plot(read_jsonl(args.out), args.out.with_suffix(".png"))
    except ImportError:
        print("matplotlib not installed: no plot")
    return 0


def plot(records, path):
    """Peak extra memory against N (log-log), forward and forward+backward, beside the 4 * N^2
    bytes of naive attention's score matrix."""
    fig, axes = subplots(1, 2, figsize=(11, 4), sharey=True)
    colors = {impl: f"C{i}" for i, impl in enumerate(dict.fromkeys(r["impl"] for r in records))}
    for ax, mode in zip(axes, ("fwd", "fwd_bwd")):
        for impl, color in colors.items():
            rows = sorted((r["seqlen_q"], r["peak_extra_bytes"]) for r in records
                          if r["impl"] == impl and r["mode"] == mode)
            if rows:
                ax.plot([n for n, _ in rows], [b / 2**20 for _, b in rows], "o-", color=color, label=impl)
        ns = sorted({r["seqlen_q"] for r in records})
        ax.plot(ns, [4 * n * n / 2**20 for n in ns], "k--", label="4 N^2 (naive S, computed)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("N")
        ax.set_title(mode)
    axes[0].set_ylabel("peak extra memory (MiB)")
    axes[0].legend()
    r0 = records[0]
    fig.suptitle(f"CPU path memory: batch 1, 1 head, d = {r0['headdim']}, float32, {r0['device']}", fontsize=9)
    save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())
