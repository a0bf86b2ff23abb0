"""Sweep the softmax kernels' knobs on a GPU, or report their registers / spills offline.

GPU sweep (``M x N = 2**28`` elements, bf16 and fp32, as ``flashtile.bench.softmax``): for
every row length and every configuration -- a ``FLASHTILE_SOFTMAX_TUNING`` string, see
``flashtile/kernels/softmax/tuning.py`` -- time ``flashtile.softmax`` forward and backward through
the public API with ``triton.testing.do_bench`` and print GB/s, the fraction of the copy
rate measured in the same run, the strategy the plan picked, and ``torch.softmax``::

    python benchmarks/tune_softmax.py --out $OUT
    python benchmarks/tune_softmax.py --cols 65536 262144 --configs "" "programs_per_sm=1" "evict=0"

Each new kernel specialization costs a compile (~1-2 s).  torch and the defaults are
measured first at every shape; then each other configuration in turn, only at the shapes
where it changes the plan, until ``--budget-s`` (75 s) has passed: about 1.5-2 minutes.

Offline (no GPU: Triton compiles for an explicit target and its wheel carries ``ptxas``)::

    python benchmarks/tune_softmax.py --report

compiles the streaming kernels for sm_90 and prints ptxas's registers and spill bytes,
local-memory instructions, the 16-byte loads and the eviction hints in the PTX, and the
programs per SM that the register count allows.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TOTAL = 2**28
DEVICE = "cuda"
DEFAULT_COLS = (16384, 32768, 65536, 262144, 1048576, 4194304)
# The defaults first, then one change at a time.  Each string is a FLASHTILE_SOFTMAX_TUNING
# value; "" is the module defaults.
DEFAULT_CONFIGS = (
    "",
    "programs_per_sm=1",  # one row per SM in flight at most: less L2 pressure, exposed row ends
    "l2_budget_mb=80",  # more rows in flight than the default budget allows
    "warps_per_sm=32",  # twice the bytes in flight per SM
    "evict=0",
    "stages=2",  # cp.async pipelining of the streaming loops through shared memory
    "fused_min_rows_per_sm=1000000",  # force the split path where the fused one would run
    "min_programs_per_sm=0.5,stages=3,unroll=2",  # longest rows: half the SMs, 32 warps, L2-sized
    "in_register_max=32768",  # 32k rows in registers (32 warps) instead of fused
    "in_register_max=8192",  # 16k rows fused instead of in registers
)


# ---------------------------------------------------------------------------------------
# GPU sweep
# ---------------------------------------------------------------------------------------


def _bench(fn, rep_ms):
    if DEVICE != "cuda":  # the interpreter dry run (--device cpu): one timed call
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton

    return triton.testing.do_bench(fn, warmup=5, rep=rep_ms, return_mode="median")


def _plans(ks, m, n, elt, config):
    """The forward and backward plans of an (m, n) problem under a tuning string."""
    from flashtile.kernels.softmax.planning import staged_plan

    os.environ[ks.TUNING_ENV] = config
    try:
        device = 0 if DEVICE == "cuda" else None
        fwd = staged_plan(m, n, elt, 1, device) if device is not None else None
        bwd = staged_plan(m, n, elt, 2, device) if device is not None else None
        # (contiguous rows of 2^28 elements: the shared-memory path takes what its plan takes)
        return (dict(strategy="staged", plan=fwd) if fwd else ks.plan(m, n, elem_bytes=elt, reread_bytes=n * elt),
                dict(strategy="staged", plan=bwd) if bwd else
                ks.plan(m, n, elem_bytes=elt, reread_bytes=2 * n * elt, backward=True))
    finally:
        os.environ.pop(ks.TUNING_ENV, None)


def _describe(p):
    if p["strategy"] == "staged":
        sp = p["plan"]
        return f"staged s{sp.splits} g{sp.groups} {sp.chunk_boxes}x16KB b{sp.buffers}"
    if p["strategy"] == "registers":
        return f"registers w{p['num_warps']}"
    if p["strategy"] == "cooperative":
        cap = f" r{p['maxnreg']}" if p["maxnreg"] else ""
        return f"cooperative {p['BLOCK_N']} w{p['num_warps']} s{p['splits']}{cap}" + ("" if p["pack"] else " unpacked")
    extra = f"p{p['programs']}" if p["strategy"] == "fused" else f"s{p['splits']}"
    return f"{p['strategy']} {p['BLOCK_N']}x{p['UNROLL']} w{p['num_warps']} {extra}"


def sweep(cols, configs, dtypes, rep_ms, out_dir, modes, budget_s):
    """Phase 1 measures torch and the defaults everywhere; phase 2 each other configuration in
    turn (both dtypes, every row length), skipping shapes where its plans equal the
    defaults', and starts nothing new after ``budget_s``."""
    import torch

    import flashtile
    from flashtile.kernels import softmax as ks

    records, copy_rates = [], {}
    t_start = time.time()
    elem = {dtype: torch.finfo(dtype).bits // 8 for dtype in dtypes}
    phase1 = [(dtype, n, c) for dtype in dtypes for n in cols for c in (None, "")]
    phase2 = [(dtype, n, c) for c in configs if c for dtype in dtypes for n in cols
              if _plans(ks, TOTAL // n, n, elem[dtype], c) != _plans(ks, TOTAL // n, n, elem[dtype], "")]
    header = (f"{'dtype':<8} {'N':>8} {'config':<30} {'fwd plan':<30} "
              f"{'fwd GB/s':>8} {'/copy':>5} {'bwd GB/s':>8} {'/copy':>5}")
    current, x, dy = None, None, None
    for phase, jobs in enumerate((phase1, phase2)):
        print("\n" + ("torch and the defaults" if phase == 0 else
                      "other configurations (only where their plan differs from the defaults')"), flush=True)
        print(header, flush=True)
        for dtype, n, config in jobs:
            if phase == 1 and time.time() - t_start > budget_s:
                print(f"stopped starting measurements at the {budget_s:.0f} s budget (--budget-s)", flush=True)
                break
            name = str(dtype).replace("torch.", "")
            if name not in copy_rates:
                current, x, dy = None, None, None  # free the shapes' buffers for the copy's
                src = torch.randn(TOTAL, device=DEVICE, dtype=dtype)
                dst = torch.empty_like(src)
                ms = _bench(lambda dst=dst, src=src: dst.copy_(src), rep_ms)
                copy_rates[name] = 2 * TOTAL * elem[dtype] / ms * 1e-6
                del src, dst
                print(f"{name:<8} copy {copy_rates[name]:.0f} GB/s", flush=True)
            if current != (dtype, n):
                x = dy = None
                if DEVICE == "cuda":
                    torch.cuda.empty_cache()
                x = torch.randn(TOTAL // n, n, device=DEVICE, dtype=dtype)
                dy = torch.randn_like(x)
                current = (dtype, n)
            copy = copy_rates[name]
            r = _measure(torch, flashtile, ks, x, dy, config, elem[dtype], rep_ms, modes, name, copy)
            records.append(r)
            f, b = r.get("fwd_gbps"), r.get("bwd_gbps")
            cells = (f"{f:>8.0f} {f / copy:>5.2f}" if f else f"{'-':>8} {'-':>5}") + " " + (
                f"{b:>8.0f} {b / copy:>5.2f}" if b else f"{'-':>8} {'-':>5}")
            print(f"{name:<8} {n:>8} {r['config']:<30} {r['plan']:<30} {cells}"
                  + (f"  {r['error']}" if "error" in r else ""), flush=True)
    print(f"\nsweep took {time.time() - t_start:.0f} s")
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "tune_softmax.jsonl"), "w") as fh:
            for r in records:
                fh.write(json.dumps(r) + "\n")
    return records


def _measure(torch, flashtile, ks, x, dy, config, elt, rep_ms, modes, dtype_name, copy):
    m, n = x.shape
    rec = dict(dtype=dtype_name, rows=m, cols=n, copy_gbps=copy,
               config="torch" if config is None else (config or "defaults"))
    if config is None:
        rec["plan"] = "torch.softmax"
        fn = lambda t: torch.softmax(t, dim=-1)
    else:
        fwd_plan, bwd_plan = _plans(ks, m, n, elt, config)
        rec.update(plan=_describe(fwd_plan), bwd_plan=_describe(bwd_plan))
        fn = lambda t: flashtile.softmax(t, dim=-1)
        os.environ[ks.TUNING_ENV] = config
    try:
        if "fwd" in modes:
            ms = _bench(lambda: fn(x), rep_ms)
            rec.update(fwd_ms=ms, fwd_gbps=2 * m * n * elt / ms * 1e-6)
        if "bwd" in modes:
            xr = x.detach().requires_grad_(True)
            y = fn(xr)
            ms = _bench(lambda: torch.autograd.grad(y, xr, dy, retain_graph=True), rep_ms)
            rec.update(bwd_ms=ms, bwd_gbps=3 * m * n * elt / ms * 1e-6)
            del y, xr
    except Exception as e:  # noqa: BLE001 - recorded, the sweep goes on
        rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    finally:
        os.environ.pop(ks.TUNING_ENV, None)
    return rec


# ---------------------------------------------------------------------------------------
# Offline report (sm_90)
# ---------------------------------------------------------------------------------------

H200_SMS = 132
POINTERS = {"X", "Y", "MASK", "G", "DX", "M_PART", "L_PART", "S_PART", "ARRIVED"}
FLOATS = {"scale_log2", "scale"}
ONES = {"sxc", "smc", "L1"}  # contiguous rows: Triton specializes arguments equal to 1
ALIGNED = {"n_cols", "n_words", "chunk", "L2", "sx0", "sx1", "sx2", "sm0", "sm1", "sm2"}  # multiples of 16


def compile_for_sm90(fn, dtype, constexprs, num_warps, num_stages=3, maxnreg=0):
    import triton
    from triton.backends.compiler import GPUTarget

    sig, attrs, consts = {}, {}, dict(constexprs)
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name in ONES:
            sig[name], consts[name] = "constexpr", 1
        elif name in POINTERS:
            sig[name] = {"ARRIVED": "*i32"}.get(name, "*fp32" if name.endswith("_PART") else f"*{dtype}")
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in FLOATS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name in ALIGNED:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    if maxnreg:
        options["maxnreg"] = maxnreg  # ptxas -v then reports the capped count and its spills
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def ptx_report(kernel, num_warps) -> dict:
    import triton

    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as d:
        ptx, cubin = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        r = subprocess.run([os.path.join(bin_dir, "ptxas"), "-v", "--gpu-name=sm_90a", ptx, "-o", cubin],
                           capture_output=True, text=True, check=False)
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        sass = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-sass", cubin],
                              capture_output=True, text=True, check=False).stdout
    regs = int(m.group(1)) if (m := re.search(r"Used (\d+) registers", r.stderr)) else 0
    spill = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", r.stderr)
    text = kernel.asm["ptx"]
    regs_per_warp = -(-max(1, regs) * 32 // 256) * 256
    per_sm = max(1, min(2048 // (32 * num_warps), 65536 // regs_per_warp // num_warps))
    return dict(regs=regs, spill_st=int(spill[0][0]) if spill else 0, spill_ld=int(spill[0][1]) if spill else 0,
                LDL=sass.count("LDL"), STL=sass.count("STL"), ld_v4=len(re.findall(r"ld\.global[^ ]*\.v4", text)),
                evict_hints=len(re.findall(r"evict_(?:first|last)|L2::cache_hint", text)),
                smem=kernel.metadata.shared, per_sm=per_sm,
                async_copies=kernel.asm["ttgir"].count("async_copy_global_to_local"))


def report(configs, dtypes):
    os.environ.pop("TRITON_INTERPRET", None)
    from flashtile.kernels import softmax as ks
    from flashtile.kernels.softmax import cooperative, planning, registers, streaming

    planning._sms = lambda: H200_SMS  # no GPU here: plan for the target's SM count

    def variants(dtype, k):
        pol = dict(FIRST_READ="evict_last", LAST_READ="evict_first", WRITE="evict_first") if k["evict"] else \
            dict(FIRST_READ="", LAST_READ="", WRITE="")
        elem = 2 if dtype in ("bf16", "fp16") else 4
        for strategy, n_rows, n_cols in (("fused", 4096, 65536), ("fused", 1024, 262144), ("split", 64, 4194304)):
            p = ks.plan(n_rows, n_cols, strategy=strategy, elem_bytes=elem)
            tiles = dict(BLOCK_N=p["BLOCK_N"], UNROLL=p["UNROLL"], STAGES=p["STAGES"])
            w = p["num_warps"]
            tag = f"{strategy} N={n_cols} block={p['BLOCK_N']}x{p['UNROLL']} warps={w}"
            if strategy == "fused":
                for log in (False, True):
                    consts = dict(LOG=log, MASK_KIND=0, **tiles, **pol)
                    yield f"{tag} fwd log={int(log)}", streaming._softmax_fwd_fused, consts, w
                    yield f"{tag} bwd log={int(log)}", streaming._softmax_bwd_fused, consts, w
                yield (f"{tag} fwd bool mask", streaming._softmax_fwd_fused,
                       dict(LOG=False, MASK_KIND=1, **tiles, **pol), w)
            else:
                write = dict(LOG=False, MASK_KIND=0, SPLITS=64, LAST_READ=pol["LAST_READ"], WRITE=pol["WRITE"], **tiles)
                yield (f"{tag} fwd partials", streaming._softmax_fwd_partials,
                       dict(MASK_KIND=0, FIRST_READ=pol["FIRST_READ"], **tiles), w)
                yield f"{tag} fwd write", streaming._softmax_fwd_write, write, w
                yield (f"{tag} bwd partials", streaming._softmax_bwd_partials,
                       dict(LOG=False, FIRST_READ=pol["FIRST_READ"], **tiles), w)
                yield f"{tag} bwd write", streaming._softmax_bwd_write, write, w
        coop = ((False, cooperative._softmax_fwd_cooperative), (True, cooperative._softmax_bwd_cooperative))
        for backward, fn in coop:
            p = ks.plan(1024, 262144, strategy="cooperative", backward=backward, elem_bytes=elem)
            w = p["num_warps"]
            for log, mask_kind in ((False, 0), (True, 0), (False, 1), (False, 2)):
                # Unmasked 16-bit rows are held as pairs in int32 words (packing.word_kind).
                kind = ks.KIND_PLAIN.value
                if mask_kind == 0:
                    kind = {"bf16": ks.KIND_BF16X2, "fp16": ks.KIND_F16X2}.get(dtype, ks.KIND_PLAIN).value
                pairs = 1 if kind == ks.KIND_PLAIN.value else 2
                consts = dict(LOG=log, MASK_KIND=mask_kind, SPLITS=p["SPLITS"], PHASE=0, KIND=kind,
                              WORDS=p["BLOCK_N"] // pairs, ASM=True)
                yield (f"cooperative chunk={p['BLOCK_N']} warps={w} {'bwd' if backward else 'fwd'} log={int(log)} "
                       f"mask={mask_kind}", fn, consts, w)
        for n_cols in (16384, 32768):
            for name, fn in (("fwd", registers._softmax_fwd_in_registers),
                             ("bwd", registers._softmax_bwd_in_registers)):
                p = ks.plan(1, n_cols, strategy="registers", backward=name == "bwd")
                yield (f"registers N={n_cols} warps={p['num_warps']} {name}", fn,
                       dict(LOG=False, MASK_KIND=0, ROWS=1, BLOCK_N=p["BLOCK_N"]), p["num_warps"])

    for config in configs:
        os.environ[ks.TUNING_ENV] = config
        for dtype in dtypes:
            k = ks.knobs()
            for name, fn, consts, w in variants(dtype, k):
                # The cooperative kernels' register caps, as their plan() sets them.
                maxnreg = {cooperative._softmax_fwd_cooperative: k["coop_fwd_maxnreg"] or k["coop_maxnreg"],
                           cooperative._softmax_bwd_cooperative: k["coop_maxnreg"]}.get(fn, 0)
                r = ptx_report(compile_for_sm90(fn, dtype, consts, w, maxnreg=maxnreg), w)
                print(f"{config or 'defaults':<16} {dtype:<5} {name:<52} " +
                      " ".join(f"{key}={val}" for key, val in r.items()), flush=True)
        os.environ.pop(ks.TUNING_ENV, None)


def main():
    global TOTAL, DEVICE
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cols", type=int, nargs="+", default=list(DEFAULT_COLS))
    ap.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS),
                    help='FLASHTILE_SOFTMAX_TUNING strings; "" = the module defaults')
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--modes", nargs="+", default=["fwd", "bwd"], choices=["fwd", "bwd"])
    ap.add_argument("--rep-ms", type=int, default=25, help="do_bench's time budget per measurement")
    ap.add_argument("--out", default=None, help="folder for tune_softmax.jsonl")
    ap.add_argument("--budget-s", type=float, default=75.0, help="start no new measurement after this many seconds")
    ap.add_argument("--total", type=int, default=2**28, help="M x N of every shape")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run in the interpreter (TRITON_INTERPRET=1)")
    ap.add_argument("--report", action="store_true", help="offline: compile for sm_90, print registers / spills")
    args = ap.parse_args()
    if args.report:
        report(args.configs if args.configs != list(DEFAULT_CONFIGS) else [""], args.dtypes)
        return
    import torch

    TOTAL, DEVICE = args.total, args.device
    dtypes = [{"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[d] for d in args.dtypes]
    sweep(args.cols, args.configs, dtypes, args.rep_ms, args.out, args.modes, args.budget_s)


if __name__ == "__main__":
    main()
