"""Softmax bandwidth benchmark on a CUDA GPU: flashtile vs PyTorch, side by side in one process.

Shapes ``M x N`` with ``M * N = 2**28`` elements and N from 128 to 4M, bf16 and fp32.
Achieved bandwidth = bytes that must move / time: forward reads x and writes y
(2 tensors), backward reads y and dy and writes dx (3 tensors).  The physical limit is the
device-to-device copy rate measured in the same run (``impl = "copy"``).  Peers:
``torch`` (``torch.softmax``), ``compiled`` (``torch.compile``d softmax), ``naive`` (three
kernels: max, exp-and-sum, divide).
"""

from __future__ import annotations


import torch

from flashtile.bench.common import compile_for_benchmark, default_out_dir, environment, save_figure, save_results, subplots

COLS = (128, 512, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304)
TOTAL = 2**28
IMPLS = ("flashtile", "torch", "compiled", "naive")


def _naive(x):
    m = x.amax(dim=-1, keepdim=True)
    e = torch.exp(x - m)
    return e / e.sum(dim=-1, keepdim=True)


def _fwd_fn(impl):
    import flashtile

    if impl == "flashtile":
        return lambda x: flashtile.softmax(x, dim=-1)
    if impl == "torch":
        return lambda x: torch.softmax(x, dim=-1)
    if impl == "compiled":
        return compile_for_benchmark(lambda x: torch.softmax(x, dim=-1))
    if impl == "naive":
        return _naive
    raise ValueError(f"unknown implementation {impl!r}")


def run_softmax_benchmark(out_dir=None, cols=COLS, dtypes=(torch.bfloat16, torch.float32),
                          impls=IMPLS, modes=("fwd", "bwd"), progress=True) -> list[dict]:
    import triton
    from tqdm import tqdm
    out_dir = default_out_dir() if out_dir is None else out_dir

    env = environment("cuda")
    records = []
    for dtype in dtypes:
        elt = torch.finfo(dtype).bits // 8
        # The ceiling: a device-to-device copy of the largest buffer of the run.
        src = torch.randn(TOTAL, device="cuda", dtype=dtype)
        dst = torch.empty_like(src)
        ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=10, rep=50, return_mode="median")
        records.append(dict(bench="softmax", impl="copy", mode="copy", dtype=str(dtype).replace("torch.", ""),
                            rows=1, cols=TOTAL, ms=ms, gbps=2 * TOTAL * elt / ms * 1e-6, **env))
        src = dst = None  # free the copy buffers before the softmax shapes
        jobs = [(n, mode, impl) for n in cols for mode in modes for impl in impls]
        for n, mode, impl in tqdm(jobs, disable=not progress, desc=f"softmax {dtype}"):
            m = TOTAL // n
            x = torch.randn(m, n, device="cuda", dtype=dtype)
            fn = _fwd_fn(impl)
            rec = dict(bench="softmax", impl=impl, mode=mode, dtype=str(dtype).replace("torch.", ""), rows=m, cols=n, **env)
            try:
                if mode == "fwd":
                    ms = triton.testing.do_bench(lambda: fn(x), warmup=10, rep=50, return_mode="median")
                    moved = 2 * m * n * elt
                else:
                    xr = x.detach().requires_grad_(True)
                    y = fn(xr)
                    dy = torch.randn_like(y)
                    ms = triton.testing.do_bench(lambda: torch.autograd.grad(y, xr, dy, retain_graph=True),
                                                 warmup=10, rep=50, return_mode="median")
                    moved = 3 * m * n * elt
            except Exception as e:  # noqa: BLE001 - recorded, not fatal
                records.append(dict(rec, ms=None, gbps=None, skipped=f"{type(e).__name__}: {str(e)[:200]}"))
                continue
            records.append(dict(rec, ms=ms, gbps=moved / ms * 1e-6))
            x = None
            torch.cuda.empty_cache()
    save_results(records, out_dir, "softmax", print_table, plot)
    return records


def print_table(records):
    for dtype in dict.fromkeys(r["dtype"] for r in records):
        copy = next(r["gbps"] for r in records if r["impl"] == "copy" and r["dtype"] == dtype)
        print(f"\nsoftmax {dtype}: GB/s (copy {copy:.0f} GB/s)")
        impls = [i for i in dict.fromkeys(r["impl"] for r in records) if i != "copy"]
        print(f"{'mode':>5} {'N':>8} " + " ".join(f"{i:>10}" for i in impls) + "  flashtile/copy")
        for mode in ("fwd", "bwd"):
            for n in sorted({r["cols"] for r in records if r["mode"] == mode}):
                vals = {r["impl"]: r.get("gbps") for r in records if (r["dtype"], r["mode"], r["cols"]) == (dtype, mode, n)}
                cells = " ".join(f"{vals[i]:>10.0f}" if vals.get(i) else f"{'-':>10}" for i in impls)
                ours = vals.get("flashtile")
                print(f"{mode:>5} {n:>8} {cells}  {ours / copy:.2f}" if ours else f"{mode:>5} {n:>8} {cells}")


def plot(records, path):
    dtypes = list(dict.fromkeys(r["dtype"] for r in records))
    fig, axes = subplots(2, len(dtypes), figsize=(5 * len(dtypes), 7), squeeze=False)
    for j, dtype in enumerate(dtypes):
        copy = next(r["gbps"] for r in records if r["impl"] == "copy" and r["dtype"] == dtype)
        for i, mode in enumerate(("fwd", "bwd")):
            ax = axes[i][j]
            for impl in dict.fromkeys(r["impl"] for r in records if r["impl"] != "copy"):
                pts = sorted((r["cols"], r["gbps"]) for r in records
                             if (r["impl"], r["dtype"], r["mode"]) == (impl, dtype, mode) and r.get("gbps"))
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl, lw=2.5 if impl == "flashtile" else 1.2)
            ax.axhline(copy, color="k", ls="--", lw=1, label="copy")
            ax.set_xscale("log", base=2)
            ax.set_title(f"softmax {mode}, {dtype}", fontsize=9)
            ax.set_xlabel("row length N (M*N = 2^28)")
            ax.set_ylabel("GB/s")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    save_figure(fig, path)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="results folder (default: ~/.cache/flashtile; the committed results: --out benchmarks/results)")
    ap.add_argument("--cols", type=int, nargs="+", default=list(COLS))
    args = ap.parse_args()
    run_softmax_benchmark(args.out, cols=args.cols)
