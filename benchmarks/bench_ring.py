"""Context-parallel (ring) attention benchmark: one sequence sharded over N ranks.

GPUs (NCCL), from the repository root:

    torchrun --standalone --nproc_per_node=8 benchmarks/bench_ring.py --seqlens 32k 64k 128k 256k 512k 1M --out DIR

CPU (gloo; small defaults: 4 heads, d = 64, float32):

    torchrun --standalone --nproc_per_node=2 benchmarks/bench_ring.py --backend gloo --device cpu --out DIR

For every sequence length N (global), causal (zigzag shards) and not, forward and forward +
backward, it times ``ring_flash_attn_func`` on shards of N / world tokens (a fixed number of
calls on every rank, after a barrier: CUDA events on a GPU, ``time.perf_counter`` on the CPU;
the slowest rank's mean per call counts), and on rank 0 the single-device
``flash_attn_func`` on the full sequence where it fits (``--baseline-max-seqlen``; longer
baselines are extrapolated as N^2 from the longest measured one and marked so).  Reported:
``ms`` per call, ``ring_step_ms = ms / world`` (one ring step), TFLOP/s per device
(``4 B H N^2 D``, halved when causal, x3.5 for forward + backward, divided by world) and
``efficiency = baseline_ms / (world * ms)``.  Before timing, the ring's output and gradients
are checked against the single-device result at one length.

Writes ``DIR/ring.jsonl`` (appended; one record per measurement, with ``bench="ring"``),
``DIR/ring_check.json`` and, when matplotlib is installed, ``DIR/ring.png``.
"""

from __future__ import annotations

import os

# NVLink multicast off (NCCL's NVLS, symmetric-memory multicast): the ring needs only p2p, and
# multicast on a shared host can take its GPUs out of service.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

try:
    import flashtile
except ImportError:  # run from a checkout that is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import flashtile
from flashtile.bench.common import environment, save_figure, save_results, subplots
from flashtile.distributed import ring_flash_attn_func, zigzag_shard

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32}


def parse_len(s: str) -> int:
    s = s.strip().lower()
    mult = {"k": 1024, "m": 1024 * 1024}.get(s[-1], 1)
    return int(float(s[:-1] if s[-1] in "km" else s) * mult)


def fmt_len(n: int) -> str:
    for unit, m in (("M", 1 << 20), ("k", 1 << 10)):
        if n >= m and n % m == 0:
            return f"{n // m}{unit}"
    return str(n)


def attention_flops(batch, nheads, seqlen, headdim, causal, mode) -> float:
    f = 4.0 * batch * nheads * seqlen * seqlen * headdim
    return f / (2 if causal else 1) * (3.5 if mode == "fwd_bwd" else 1.0)


def parse_args():
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqlens", nargs="+", default=None, help="global sequence lengths, e.g. 32k 64k 1M "
                   "(default GPU: 32k 64k 128k; CPU: 1k 2k 4k); comma lists accepted")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if cuda else "cpu")
    p.add_argument("--backend", choices=("nccl", "gloo"), default=None, help="default: nccl on cuda, gloo on cpu")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--nheads", type=int, default=None, help="default 32 (GPU) / 4 (CPU)")
    p.add_argument("--nheads-k", type=int, default=None, help="K/V heads (GQA), default nheads")
    p.add_argument("--headdim", type=int, default=None, help="default 128 (GPU) / 64 (CPU)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default bf16 (GPU) / fp32 (CPU)")
    p.add_argument("--modes", default="fwd,fwd_bwd", help="comma list of fwd, fwd_bwd")
    p.add_argument("--causal", choices=("both", "true", "false"), default="both",
                   help="causal runs use zigzag shards")
    p.add_argument("--impls", default="ring", help="comma list of ring, allgather")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls before the first length of each "
                   "(impl, mode, causal); later lengths reuse the compiled kernels")
    p.add_argument("--reps", type=int, default=None, help="most timed calls per point (default 10 GPU / 3 CPU)")
    p.add_argument("--target-s", type=float, default=None,
                   help="timed calls per point: as many as fit this many seconds (default 0.5 GPU / 2.0 CPU)")
    p.add_argument("--baseline-max-seqlen", default=None,
                   help="longest full sequence timed on one device (default 256k GPU / 16k CPU)")
    p.add_argument("--no-baseline", action="store_true")
    p.add_argument("--check-seqlen", default=None, help="length of the startup correctness check (default: "
                   "the smallest of 8k and the first --seqlens on GPU, 256 * world on CPU); 0 = skip")
    p.add_argument("--out", default="benchmarks/results")
    a = p.parse_args()
    gpu = a.device == "cuda"
    a.backend = a.backend or ("nccl" if gpu else "gloo")
    a.nheads = a.nheads or (32 if gpu else 4)
    a.nheads_k = a.nheads_k or a.nheads
    a.headdim = a.headdim or (128 if gpu else 64)
    a.dtype = DTYPES[a.dtype or ("bf16" if gpu else "fp32")]
    a.seqlens = [parse_len(x) for s in (a.seqlens or (["32k", "64k", "128k"] if gpu else ["1k", "2k", "4k"]))
                 for x in s.split(",") if x]
    a.modes = [m for m in a.modes.split(",") if m]
    a.impls = [m for m in a.impls.split(",") if m]
    a.causals = {"both": [False, True], "true": [True], "false": [False]}[a.causal]
    a.reps = a.reps or (10 if gpu else 3)
    a.target_s = a.target_s or (0.5 if gpu else 2.0)
    a.baseline_max_seqlen = parse_len(a.baseline_max_seqlen or ("256k" if gpu else "16k"))
    for m in a.modes:
        if m not in ("fwd", "fwd_bwd"):
            p.error(f"unknown mode {m!r}")
    for m in a.impls:
        if m not in ("ring", "allgather"):
            p.error(f"unknown impl {m!r}")
    return a


# ----------------------------------------------------------------------------------------
# Process group and timing
# ----------------------------------------------------------------------------------------


def init(args):
    if "RANK" not in os.environ:  # plain `python bench_ring.py`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29517"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    # Long timeout: rank 0 times the single-device baseline while the others wait at a barrier.
    dist.init_process_group(args.backend, timeout=datetime.timedelta(minutes=30))
    return device


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def max_over_ranks(x: float, device) -> float:
    t = torch.tensor([x], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def time_calls(fn, n, device, group_barrier=True) -> float:
    """Mean ms per call of ``n`` back-to-back calls (after a barrier when distributed)."""
    if group_barrier:
        dist.barrier()
    sync(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / n
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) * 1e3 / n


_warm = set()


def bench(fn, args, device, key, distributed=True) -> float:
    """Warm up (only the first time ``key`` is timed: the kernels are compiled by then), time one
    call, then as many more as fit ``target_s`` (the same count on every rank); the slowest
    rank's mean ms per call."""
    for _ in range(0 if key in _warm else args.warmup):
        fn()
    _warm.add(key)
    agree = (lambda x: max_over_ranks(x, device)) if distributed else (lambda x: x)
    first = agree(time_calls(fn, 1, device, distributed))
    reps = min(args.reps, int(args.target_s * 1e3 / max(first, 1e-3)))
    if reps < 2:
        return first
    return agree(time_calls(fn, reps, device, distributed))


def make_step(fn, q, k, v, mode):
    if mode == "fwd":
        def step():
            with torch.no_grad():
                fn(q, k, v)
        return step
    dout = torch.randn_like(q)
    for t in (q, k, v):
        t.requires_grad_(True)

    def step():
        torch.autograd.grad(fn(q, k, v), (q, k, v), dout)
    return step


def fits(device, nbytes: float) -> bool:
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    return nbytes < 0.9 * free


def footprint(batch, n, nheads, nheads_k, headdim, elt, mode, ring):
    """Rough peak bytes: q/out/dout/dq and k/v/dk/dv, plus the ring's float32 accumulators and buffers."""
    qb, kb = batch * n * nheads * headdim * elt, batch * n * nheads_k * headdim * elt
    if mode == "fwd":
        return 2 * qb + 2 * kb + (qb * 4 / elt + 2 * kb if ring else qb)
    return 4 * qb + 4 * kb + (3 * qb * 4 / elt + 8 * kb * 4 / elt if ring else 2 * qb)


# ----------------------------------------------------------------------------------------
# Correctness check
# ----------------------------------------------------------------------------------------


def check(args, device, rank, world, n):
    """Ring (and all-gather) output and gradients vs single-device flash_attn_func, every rank."""
    g = torch.Generator(device=device).manual_seed(1234)
    shape_q = (args.batch, n, args.nheads, args.headdim)
    shape_k = (args.batch, n, args.nheads_k, args.headdim)
    q, k, v, dout = (torch.randn(s, generator=g, device=device, dtype=args.dtype)
                     for s in (shape_q, shape_k, shape_k, shape_q))
    results = []
    for causal in (False, True):
        zz = causal

        def shard(x, zz=zz):
            return zigzag_shard(x, rank, world) if zz else x.chunk(world, dim=1)[rank]

        qf, kf, vf = (t.clone().requires_grad_(True) for t in (q, k, v))
        ref = flashtile.flash_attn_func(qf, kf, vf, causal=causal)
        ref_grads = torch.autograd.grad(ref, (qf, kf, vf), dout)
        for impl in args.impls:
            ql, kl, vl = (shard(t).clone().requires_grad_(True) for t in (q, k, v))
            out = ring_flash_attn_func(ql, kl, vl, causal=causal, zigzag=zz, mode=impl)
            grads = torch.autograd.grad(out, (ql, kl, vl), shard(dout))
            errs = {}
            for name, got, want in zip(("out", "dq", "dk", "dv"), (out,) + grads, (ref,) + ref_grads):
                want = shard(want).float()
                errs[name] = max_over_ranks(float((got.float() - want).abs().max() / want.abs().max().clamp_min(1e-6)),
                                            device)
            tol = 1e-4 if args.dtype == torch.float32 else 3e-2
            ok = all(e <= tol for e in errs.values())
            results.append(dict(impl=impl, causal=causal, zigzag=zz, seqlen=n, world_size=world, ok=ok, tol=tol,
                                **{f"max_rel_err_{k_}": e for k_, e in errs.items()}))
    return results


# ----------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------


def print_table(records):
    print(f"{'impl':<10}{'mode':<8}{'causal':<7}{'seqlen':>8}{'world':>6}{'ms':>11}{'step ms':>10}"
          f"{'TFLOP/s/dev':>12}{'efficiency':>11}")
    for r in records:
        eff = "-" if r["efficiency"] is None else f"{r['efficiency']:.3f}" + ("*" if r.get("baseline") == "extrapolated" else "")
        step = "-" if r.get("ring_step_ms") is None else f"{r['ring_step_ms']:.2f}"
        print(f"{r['impl']:<10}{r['mode']:<8}{r['causal']!s:<7}{fmt_len(r['seqlen_q']):>8}{r['world_size']:>6}"
              f"{r['ms']:>11.2f}{step:>10}{r['tflops']:>12.3g}{eff:>11}")
    if any(r.get("baseline") == "extrapolated" for r in records):
        print("* baseline extrapolated as N^2 from the longest measured single-device run")


def plot(records, path):
    fig, axes = subplots(1, 2, figsize=(12, 4.5))
    keys = sorted({(r["impl"], r["mode"], r["causal"]) for r in records})
    for impl, mode, causal in keys:
        rs = sorted((r for r in records if (r["impl"], r["mode"], r["causal"]) == (impl, mode, causal)),
                    key=lambda r: r["seqlen_q"])
        label = f"{impl} {mode} {'causal' if causal else 'full'}"
        xs = [r["seqlen_q"] for r in rs]
        axes[1].plot(xs, [r["tflops"] for r in rs], marker="o", label=label, linestyle="--" if impl == "single" else "-")
        eff = [(r["seqlen_q"], r["efficiency"]) for r in rs if r["efficiency"] is not None]
        if eff:
            axes[0].plot(*zip(*eff), marker="o", label=label)
    world = max(r["world_size"] for r in records)
    axes[0].set(xscale="log", xlabel="global sequence length", ylabel="efficiency = T_1 / (world x T_ring)",
                title=f"ring attention, world {world}")
    axes[1].set(xscale="log", xlabel="global sequence length", ylabel="TFLOP/s per device",
                title=f"{records[0]['device']}")
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    save_figure(fig, path)
    print(f"plot: {path}")


# ----------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------


def main():
    args = parse_args()
    device = init(args)
    rank, world = dist.get_rank(), dist.get_world_size()
    t_start = time.perf_counter()
    for n in args.seqlens:
        if n % (2 * world):
            raise SystemExit(f"seqlen {n} is not divisible by 2 * world = {2 * world}")
    env = environment(device)
    if rank == 0:
        print(f"ring attention benchmark: world {world}, {args.backend}, {env['device']}, {args.dtype}, "
              f"batch {args.batch}, heads {args.nheads}/{args.nheads_k}, d {args.headdim}", flush=True)

    out_dir = Path(args.out)
    check_n = parse_len(args.check_seqlen) if args.check_seqlen is not None else (
        min(8192, args.seqlens[0]) if device.type == "cuda" else 256 * world)
    if check_n:
        check_n -= check_n % (2 * world)
        results = check(args, device, rank, world, check_n)
        if rank == 0:
            for r in results:
                errs = ", ".join(f"{k[12:]} {v:.1e}" for k, v in r.items() if k.startswith("max_rel_err_"))
                print(f"check N={fmt_len(check_n)} {r['impl']} causal={r['causal']}: "
                      f"{'OK' if r['ok'] else 'FAIL'} (max |err| / max |ref|: {errs})", flush=True)
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "ring_check.json").write_text(json.dumps(dict(results=results, **env), indent=1))
        if not all(r["ok"] for r in results):
            raise SystemExit("ring attention disagrees with the single-device result")

    elt = torch.empty((), dtype=args.dtype).element_size()
    base = {"bench": "ring", "dtype": str(args.dtype).replace("torch.", ""), "batch": args.batch,
            "nheads": args.nheads, "nheads_k": args.nheads_k, "headdim": args.headdim, "backend": args.backend}
    records = []
    measured_baseline = {}  # (mode, causal) -> (n, ms) of the longest single-device run
    for n in args.seqlens:
        local = n // world
        for mode in args.modes:
            for causal in args.causals:
                flops = attention_flops(args.batch, args.nheads, n, args.headdim, causal, mode)
                # Single-device baseline on the full sequence, rank 0 only.
                baseline_ms, baseline_kind = None, None
                if not args.no_baseline:
                    ok = n <= args.baseline_max_seqlen and fits(
                        device, footprint(args.batch, n, args.nheads, args.nheads_k, args.headdim, elt, mode, False))
                    if rank == 0 and ok:
                        try:
                            q = torch.randn(args.batch, n, args.nheads, args.headdim, device=device, dtype=args.dtype)
                            k, v = (torch.randn(args.batch, n, args.nheads_k, args.headdim, device=device,
                                                dtype=args.dtype) for _ in range(2))
                            step = make_step(lambda q_, k_, v_, c=causal: flashtile.flash_attn_func(q_, k_, v_, causal=c),
                                             q, k, v, mode)
                            baseline_ms = bench(step, args, device, ("single", mode, causal), distributed=False)
                            baseline_kind = "measured"
                            measured_baseline[(mode, causal)] = (n, baseline_ms)
                            records.append(dict(base, impl="single", mode=mode, seqlen_q=n, seqlen_k=n, causal=causal,
                                                zigzag=False, world_size=1, ms=baseline_ms, ring_step_ms=None,
                                                tflops=flops / baseline_ms / 1e9, efficiency=None, baseline=None,
                                                baseline_ms=None, **env))
                            del q, k, v, step
                        except torch.cuda.OutOfMemoryError:
                            print(f"single-device baseline at N={fmt_len(n)} out of memory: skipped", flush=True)
                        if device.type == "cuda":
                            torch.cuda.empty_cache()
                    if rank == 0 and baseline_ms is None and (mode, causal) in measured_baseline:
                        n0, ms0 = measured_baseline[(mode, causal)]
                        baseline_ms, baseline_kind = ms0 * (n / n0) ** 2, "extrapolated"
                    dist.barrier()
                # The ring, every rank.
                need = footprint(args.batch, local, args.nheads, args.nheads_k, args.headdim, elt, mode, True)
                free_everywhere = -max_over_ranks(-float(fits(device, need)), device)
                if not free_everywhere:
                    if rank == 0:
                        print(f"ring at N={fmt_len(n)} {mode} would not fit in memory: skipped", flush=True)
                    continue
                for impl in args.impls:
                    q = torch.randn(args.batch, local, args.nheads, args.headdim, device=device, dtype=args.dtype)
                    k, v = (torch.randn(args.batch, local, args.nheads_k, args.headdim, device=device, dtype=args.dtype)
                            for _ in range(2))
                    step = make_step(lambda q_, k_, v_, c=causal, m=impl: ring_flash_attn_func(q_, k_, v_, causal=c, mode=m),
                                     q, k, v, mode)
                    ms = bench(step, args, device, (impl, mode, causal))
                    del q, k, v, step
                    eff = None if baseline_ms is None else baseline_ms / (world * ms)
                    rec = dict(base, impl=impl, mode=mode, seqlen_q=n, seqlen_k=n, causal=causal, zigzag=causal,
                               world_size=world, ms=ms, ring_step_ms=ms / world, tflops=flops / world / ms / 1e9,
                               efficiency=eff, baseline=baseline_kind, baseline_ms=baseline_ms, **env)
                    records.append(rec)
                    if rank == 0:
                        print(f"  {impl} {mode} causal={causal} N={fmt_len(n)}: {ms:.2f} ms, "
                              f"{rec['tflops']:.3g} TFLOP/s/dev, efficiency "
                              f"{'-' if eff is None else f'{eff:.3f}'} ({time.perf_counter() - t_start:.0f} s)",
                              flush=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    if rank == 0:
        order = {"single": 0, "ring": 1, "allgather": 2}
        records.sort(key=lambda r: (r["mode"], r["causal"], order[r["impl"]], r["seqlen_q"]))
        save_results(records, out_dir, "ring", print_table, plot)
        print(f"wrote {out_dir / 'ring.jsonl'} in {time.perf_counter() - t_start:.0f} s")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
