"""Measure attention's HBM traffic with Nsight Compute and compare it with flashtile.iomodel.

    python3 benchmarks/measure_io.py --out DIR [--seqlens 1024 4096 16384] [--headdims 64 128]
                                     [--impls flashtile naive] [--modes fwd bwd] [--batch 1] [--nheads 16]
                                     [--causal] [--cache-control all|none] [--isolate] [--time-budget 270]
    python3 benchmarks/measure_io.py --from-jsonl FILE [--out DIR] [--repredict]   # table and plot only

Runs on a CUDA GPU with ``ncu`` on the PATH.  The driver (this script without ``--worker``)
starts one Nsight Compute process per (impl, headdim) -- or per case with ``--isolate`` --
profiling a worker (this script with ``--worker``) that, for every case of its group:

1. allocates q, k, v (and dout) in bf16, layout ``(batch, seqlen, nheads, headdim)``;
2. warms up: one forward (+ backward) outside the profiled range, so Triton compiles and
   cuBLAS picks its kernels before anything is measured;
3. runs the measured op once between ``torch.cuda.profiler.start()`` and ``stop()``
   (``ncu --profile-from-start off``): the forward, or the backward of a forward run
   before ``start()``.  A tiny marker kernel launched first in each profiled range splits
   ncu's kernel list into cases.

ncu reads ``dram__bytes_read.sum`` and ``dram__bytes_write.sum`` of every kernel with its
default ``--cache-control all`` (caches flushed before each kernel: reads are cold; an
output small enough to stay in L2 when its kernel ends is under-counted as written) and
``--clock-control none``.  The driver sums the bytes per case and compares them with the
model's two brackets (``no_l2``: every tile load from HBM; ``ideal_l2``: each tensor
once).  ``naive`` is ``flashtile.bench.gpu``'s peer: ``q @ kᵀ``, scale, fp32 softmax,
cast, ``@ v`` on ``(b, h, n, d)`` views.

Output: ``DIR/iomodel.jsonl`` (appended; one record per case, ``bench="iomodel"``) and
``DIR/iomodel.png`` (predicted band and measured bytes vs N, per mode and head dim; needs
matplotlib).  If ncu fails for a group, its stderr is printed and the other groups still
run.  The whole default sweep (24 cases, four ncu processes) took 61 s on an H200, about
30 s more when Triton has to compile the kernels first.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from a checkout without installing

from flashtile import iomodel

MARKER = "iomodel_case_marker"
METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum")
DTYPE = "bfloat16"
DEFAULT_SEQLENS = (1024, 4096, 16384)
DEFAULT_HEADDIMS = (64, 128)
DEFAULT_IMPLS = ("flashtile", "naive")
DEFAULT_MODES = ("fwd", "bwd")
_UNITS = {"byte": 1, "kbyte": 1e3, "mbyte": 1e6, "gbyte": 1e9, "tbyte": 1e12,
          "kibyte": 2**10, "mibyte": 2**20, "gibyte": 2**30}


# --------------------------------------------------------------------------------------
# Worker: runs under ncu, one profiled range per case
# --------------------------------------------------------------------------------------


def _attention_fn(impl: str, causal: bool, headdim: int):
    """``f(q, k, v) -> out`` on flash-attn layout tensors: the attention benchmark's own peers
    (the model's naive_forward_io follows its naive one)."""
    if impl not in DEFAULT_IMPLS:
        raise ValueError(f"impl must be one of {', '.join(DEFAULT_IMPLS)}, got {impl!r}")
    from flashtile.bench.gpu import impl_fn

    return impl_fn(impl, causal, headdim)


def _run_case(case: dict, marker, progress: dict) -> None:
    """Run one case; ``progress["marked"]`` turns True once its marker kernel is launched."""
    import torch

    fn = _attention_fn(case["impl"], case["causal"], case["headdim"])
    gen = torch.Generator(device="cuda").manual_seed(case["seqlen_q"])
    dtype = getattr(torch, case["dtype"])
    shape_q = (case["batch"], case["seqlen_q"], case["nheads"], case["headdim"])
    shape_k = (case["batch"], case["seqlen_k"], case["nheads_k"], case["headdim"])
    q = torch.randn(shape_q, device="cuda", dtype=dtype, generator=gen)
    k, v = (torch.randn(shape_k, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
    if case["mode"] == "fwd":
        with torch.no_grad():
            fn(q, k, v)  # warm-up: compiles, loads modules
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
            marker()
            progress["marked"] = True
            fn(q, k, v)
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
        return
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    dout = torch.randn(shape_q, device="cuda", dtype=dtype, generator=gen)
    fn(q, k, v).backward(dout)  # warm-up
    for t in (q, k, v):
        t.grad = None  # so the measured backward hands its gradients over as in a first step
    out = fn(q, k, v)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    marker()
    progress["marked"] = True
    out.backward(dout)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def worker(cases_path: Path, manifest_path: Path) -> int:
    import gc

    import torch
    import triton
    import triton.language as tl

    from flashtile.bench.common import environment

    @triton.jit
    def iomodel_case_marker(X):
        tl.store(X, tl.load(X) + 1)

    counter = torch.zeros(1, device="cuda", dtype=torch.int32)

    def marker():
        iomodel_case_marker[(1,)](counter)

    marker()  # compile it outside any profiled range
    torch.cuda.synchronize()
    cases = json.loads(Path(cases_path).read_text())
    manifest = {"environment": environment("cuda"), "cases": []}
    for case in cases:
        status, progress = "ok", {"marked": False}
        try:
            _run_case(case, marker, progress)
        except Exception as e:  # noqa: BLE001 - one failing case (OOM, say) must not end the group
            status = f"{type(e).__name__}: {str(e)[:300]}"
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            if not progress["marked"]:
                # A range with only the marker keeps ncu's kernel list aligned with the cases.
                torch.cuda.profiler.start()
                marker()
                torch.cuda.synchronize()
                torch.cuda.profiler.stop()
        manifest["cases"].append(dict(case, status=status))
        Path(manifest_path).write_text(json.dumps(manifest))  # after every case: a crash keeps the rest
        gc.collect()
        torch.cuda.empty_cache()
    return 0


# --------------------------------------------------------------------------------------
# ncu output
# --------------------------------------------------------------------------------------


def _to_bytes(value: str, unit: str) -> float:
    text = value.replace(",", "").strip()
    if not text or text.lower() in ("n/a", "nan"):
        raise ValueError(f"no value ({value!r})")
    factor = _UNITS.get(unit.strip().lower().replace(" ", ""), None)
    if factor is None:
        raise ValueError(f"unknown unit {unit!r} for a byte count")
    return float(text) * factor


def parse_ncu_csv(text: str) -> list[dict]:
    """Kernels in launch order, ``{"name", "read", "write"}`` (bytes), from ncu's ``--csv`` output.

    Accepts the ``--page raw`` form (one row per kernel, a units row after the header) and
    the ``--page details`` form (one row per kernel and metric); other lines of the log
    (``==PROF==`` and the application's own output) are skipped.
    """
    lines = [line for line in text.splitlines() if line.startswith('"')]
    rows = list(csv.reader(io.StringIO("\n".join(lines))))
    if not rows:
        return []
    header = rows[0]
    name_col = next((header.index(c) for c in ("Kernel Name", "Function Name", "Name") if c in header), None)
    if name_col is None or "ID" not in header:
        raise ValueError(f"not an ncu CSV header: {header[:8]}")
    id_col = header.index("ID")
    kernels: dict[str, dict] = {}
    if "Metric Name" in header:  # details page: long format
        m_name, m_unit, m_value = (header.index(c) for c in ("Metric Name", "Metric Unit", "Metric Value"))
        for row in rows[1:]:
            if len(row) != len(header) or row[m_name] not in METRICS:
                continue
            k = kernels.setdefault(row[id_col], {"name": row[name_col], "read": None, "write": None})
            k["read" if row[m_name] == METRICS[0] else "write"] = _to_bytes(row[m_value], row[m_unit])
    else:  # raw page: wide format, second row holds the units
        cols = {m: header.index(m) for m in METRICS if m in header}
        if len(cols) != len(METRICS):
            raise ValueError(f"ncu CSV lacks {', '.join(m for m in METRICS if m not in cols)}")
        units = rows[1] if len(rows) > 1 and not rows[1][id_col].strip() else None
        for row in rows[1 + (units is not None):]:
            if len(row) != len(header):
                continue
            unit = (lambda m: units[cols[m]] if units else "byte")
            kernels[row[id_col]] = {
                "name": row[name_col],
                "read": _to_bytes(row[cols[METRICS[0]]], unit(METRICS[0])),
                "write": _to_bytes(row[cols[METRICS[1]]], unit(METRICS[1])),
            }
    return [kernels[i] for i in sorted(kernels, key=lambda s: int(s) if s.isdigit() else s)]


def split_cases(kernels: list[dict], marker: str = MARKER) -> list[list[dict]]:
    """Kernels grouped per profiled case: each group starts at a marker kernel (not included)."""
    groups: list[list[dict]] = []
    for k in kernels:
        if marker in k["name"]:
            groups.append([])
        elif groups:
            groups[-1].append(k)
    return groups


# --------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------


def _shape(case: dict) -> iomodel.AttentionShape:
    return iomodel.AttentionShape(case["batch"], case["nheads"], case["seqlen_q"], case["headdim"],
                                  seqlen_k=case["seqlen_k"], nheads_k=case["nheads_k"], causal=case["causal"],
                                  dtype=case["dtype"])


def predicted(case: dict) -> dict:
    shape = _shape(case)
    out = {}
    for variant in iomodel.VARIANTS:
        est = iomodel.predict(case["impl"], case["mode"], shape, variant)
        out[variant] = est
    return {
        "predicted_bytes": {v: e.total_bytes for v, e in out.items()},
        "predicted_read": {v: e.bytes_read for v, e in out.items()},
        "predicted_write": {v: e.bytes_written for v, e in out.items()},
        "predicted_kernels": [k.name for k in out["no_l2"].kernels],
        "flops": out["no_l2"].flops,
    }


def _ncu_command(ncu: str, cache_control: str, log: Path, cases: Path, manifest: Path) -> list[str]:
    return [
        ncu, "--clock-control", "none", "--cache-control", cache_control,
        "--metrics", ",".join(METRICS), "--csv", "--page", "raw", "--print-units", "base",
        "--profile-from-start", "off", "--target-processes", "all", "--log-file", str(log),
        "python3", str(Path(__file__).resolve()), "--worker", str(cases), "--manifest", str(manifest),
    ]


def _run_group(ncu: str, cases: list[dict], cache_control: str, timeout: float) -> tuple[list[dict], dict]:
    """Profile one group of cases; returns (records' measured parts, environment)."""
    with tempfile.TemporaryDirectory(prefix="measure_io_") as tmp:
        tmp = Path(tmp)
        (tmp / "cases.json").write_text(json.dumps(cases))
        cmd = _ncu_command(ncu, cache_control, tmp / "ncu.csv", tmp / "cases.json", tmp / "manifest.json")
        # Own process group: on a timeout the profiled Python dies with ncu.
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            stderr += f"\n[measure_io] killed after {timeout:.0f} s"
        log = (tmp / "ncu.csv").read_text(errors="replace") if (tmp / "ncu.csv").exists() else ""
        manifest = json.loads((tmp / "manifest.json").read_text()) if (tmp / "manifest.json").exists() else {}
    if proc.returncode != 0 or not manifest:
        print(f"ncu failed (exit {proc.returncode}) for {len(cases)} case(s):", file=sys.stderr)
        print("  command: " + " ".join(cmd), file=sys.stderr)
        print((stderr or "")[-3000:] + (stdout or "")[-2000:] + "\n" + log[-2000:], file=sys.stderr)
    try:
        groups = split_cases(parse_ncu_csv(log))
    except ValueError as e:
        print(f"could not parse ncu's CSV: {e}\n{log[-2000:]}", file=sys.stderr)
        groups = []
    done = manifest.get("cases", [])
    results = []
    for i, case in enumerate(cases):
        status = done[i]["status"] if i < len(done) else "not run (worker ended early)"
        kernels = groups[i] if i < len(groups) and status == "ok" else None
        if status == "ok" and kernels is None:
            status = "no ncu data"
        measured = {"measured_read": None, "measured_write": None, "measured_bytes": None, "kernels": None}
        if kernels is not None:
            read = sum(k["read"] for k in kernels)
            write = sum(k["write"] for k in kernels)
            measured = {"measured_read": read, "measured_write": write, "measured_bytes": read + write,
                        "kernels": [{"name": k["name"][:120], "read": k["read"], "write": k["write"]} for k in kernels]}
        results.append(dict(measured, status=status))
    return results, manifest.get("environment", {})


def make_cases(impls, modes, seqlens, headdims, batch, nheads, causal) -> list[dict]:
    return [{"impl": impl, "mode": mode, "dtype": DTYPE, "batch": batch, "nheads": nheads, "nheads_k": nheads,
             "seqlen_q": n, "seqlen_k": n, "headdim": d, "causal": causal}
            for impl in impls for d in headdims for mode in modes for n in seqlens]


def measure(args) -> list[dict]:
    ncu = shutil.which("ncu")
    if ncu is None:
        raise SystemExit("measure_io: ncu (Nsight Compute) is not on the PATH")
    cases = make_cases(args.impls, args.modes, args.seqlens, args.headdims, args.batch, args.nheads, args.causal)
    for case in cases:
        _shape(case)  # bad arguments fail here, before any profiling
    if args.isolate:
        groups = [[c] for c in cases]
    else:
        keys = list(dict.fromkeys((c["impl"], c["headdim"]) for c in cases))
        groups = [[c for c in cases if (c["impl"], c["headdim"]) == key] for key in keys]
    start = time.monotonic()
    records = []
    for group in groups:
        left = args.time_budget - (time.monotonic() - start)
        label = f"{group[0]['impl']} d={group[0]['headdim']}" + (f" {group[0]['mode']} N={group[0]['seqlen_q']}" if args.isolate else "")
        if left < 10:
            print(f"[measure_io] time budget spent: skipping {label}", file=sys.stderr)
            continue
        t0 = time.monotonic()
        results, env = _run_group(ncu, group, args.cache_control, timeout=left)
        print(f"[measure_io] {label}: {len(group)} case(s) in {time.monotonic() - t0:.0f} s", file=sys.stderr)
        for case, result in zip(group, results):
            records.append(dict(bench="iomodel", **case, **predicted(case), **result,
                                ncu_cache_control=args.cache_control, **env))
    return records


# --------------------------------------------------------------------------------------
# Table and plot
# --------------------------------------------------------------------------------------


def _gb(x) -> str:
    return f"{x / 1e9:9.3f}" if x is not None else f"{'-':>9}"


def print_table(records: list[dict]) -> None:
    print(f"\nHBM bytes (GB = 1e9), predicted (ideal-L2 .. no-L2) vs measured by ncu "
          f"({records[0].get('device', '?') if records else ''})")
    # Reads get their own ratio: writes that stay in L2 when a kernel ends are under-counted.
    print(f"{'impl':<9} {'mode':<4} {'d':>4} {'N':>6} {'ideal-L2':>9} {'no-L2':>9} {'measured':>9} "
          f"{'read':>9} {'write':>9} {'meas/ideal':>10} {'read/ideal':>10}  status")
    for r in records:
        p = r["predicted_bytes"]
        ratio = f"{r['measured_bytes'] / p['ideal_l2']:10.2f}" if r.get("measured_bytes") else f"{'-':>10}"
        read_ratio = (f"{r['measured_read'] / r['predicted_read']['ideal_l2']:10.2f}" if r.get("measured_read")
                      else f"{'-':>10}")
        print(f"{r['impl']:<9} {r['mode']:<4} {r['headdim']:>4} {r['seqlen_q']:>6} {_gb(p['ideal_l2'])} "
              f"{_gb(p['no_l2'])} {_gb(r.get('measured_bytes'))} {_gb(r.get('measured_read'))} "
              f"{_gb(r.get('measured_write'))} {ratio} {read_ratio}  {r.get('status', '')}")


def plot(records: list[dict], path: Path) -> bool:
    from flashtile.bench.common import save_figure, subplots

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("[measure_io] matplotlib is not installed: no plot", file=sys.stderr)
        return False

    modes = [m for m in ("fwd", "bwd", "fwd_bwd") if any(r["mode"] == m for r in records)]
    dims = sorted({r["headdim"] for r in records})
    if not modes or not dims:
        return False
    colors = {"flashtile": "tab:blue", "naive": "tab:red"}
    fig, axes = subplots(len(modes), len(dims), figsize=(4.6 * len(dims), 3.6 * len(modes)), squeeze=False)
    for i, mode in enumerate(modes):
        for j, d in enumerate(dims):
            ax = axes[i][j]
            for impl in dict.fromkeys(r["impl"] for r in records):
                rows = sorted((r for r in records if (r["impl"], r["mode"], r["headdim"]) == (impl, mode, d)),
                              key=lambda r: r["seqlen_q"])
                if not rows:
                    continue
                n = [r["seqlen_q"] for r in rows]
                hi = [r["predicted_bytes"]["no_l2"] for r in rows]
                lo = [r["predicted_bytes"]["ideal_l2"] for r in rows]
                c = colors.get(impl)
                ax.fill_between(n, lo, hi, color=c, alpha=0.18, label=f"{impl} predicted (ideal-L2 .. no-L2)")
                ax.plot(n, lo, color=c, lw=1, ls="--")
                ax.plot(n, hi, color=c, lw=1, ls=":")
                pts = [(r["seqlen_q"], r["measured_bytes"]) for r in rows if r.get("measured_bytes")]
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], color=c, marker="o", lw=2,
                            label=f"{impl} measured (ncu)")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{mode}, d={d}", fontsize=10)
            ax.set_xlabel("sequence length N")
            ax.set_ylabel("HBM bytes read + written")
            ax.grid(alpha=0.3, which="both")
    axes[0][0].legend(fontsize=7)
    r0 = records[0]
    fig.suptitle(f"Attention HBM traffic, {r0['dtype']}, batch {r0['batch']}, {r0['nheads']} heads "
                 f"({r0.get('device', '')})", fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, path)
    return True


def latest_records(records: list[dict]) -> list[dict]:
    """One record per case (the last one in the file), for re-plotting an appended history."""
    keys = ("impl", "mode", "dtype", "batch", "nheads", "nheads_k", "seqlen_q", "seqlen_k", "headdim", "causal")
    last = {}
    for r in records:
        if r.get("bench") == "iomodel":
            last[tuple(r.get(k) for k in keys)] = r
    return list(last.values())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="results folder (default benchmarks/results)")
    ap.add_argument("--seqlens", type=int, nargs="+", default=list(DEFAULT_SEQLENS))
    ap.add_argument("--headdims", type=int, nargs="+", default=list(DEFAULT_HEADDIMS))
    ap.add_argument("--impls", nargs="+", choices=DEFAULT_IMPLS, default=list(DEFAULT_IMPLS))
    ap.add_argument("--modes", nargs="+", choices=DEFAULT_MODES, default=list(DEFAULT_MODES))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--nheads", type=int, default=16)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--cache-control", choices=("all", "none"), default="all",
                    help="ncu's: flush caches before each kernel (all, default) or not")
    ap.add_argument("--isolate", action="store_true", help="one ncu process per case (slower, more robust)")
    ap.add_argument("--time-budget", type=float, default=270.0, help="seconds; later groups are skipped past it")
    ap.add_argument("--from-jsonl", type=Path, default=None, help="only print the table and plot from this file")
    ap.add_argument("--repredict", action="store_true",
                    help="with --from-jsonl: recompute the predictions with the current model (the tiles it reads "
                         "must still be the ones measured)")
    ap.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--manifest", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.worker is not None:
        return worker(args.worker, args.manifest)

    from flashtile.bench.common import read_jsonl, write_jsonl

    if args.from_jsonl is not None:
        records = latest_records(read_jsonl(args.from_jsonl))
        if args.repredict:
            records = [dict(r, **predicted(r)) for r in records]
        out = args.out or args.from_jsonl.parent
    else:
        out = args.out or HERE / "results"
        records = measure(args)
        if records:
            write_jsonl(out / "iomodel.jsonl", records)
            print(f"[measure_io] {len(records)} records appended to {out / 'iomodel.jsonl'}", file=sys.stderr)
    if not records:
        print("measure_io: no records", file=sys.stderr)
        return 1
    print_table(records)
    if plot(records, out / "iomodel.png"):
        print(f"[measure_io] plot: {out / 'iomodel.png'}", file=sys.stderr)
    return 0 if any(r.get("measured_bytes") for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
