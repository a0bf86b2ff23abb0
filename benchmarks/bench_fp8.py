"""FP8 attention forward vs flashtile's bf16 forward on a CUDA GPU, TFLOP/s (docs/fp8.md).

Shapes follow the standard attention benchmark (``flashtile.bench.gpu``): ``batch * seqlen =
16384``, ``nheads * headdim = 2048``; FLOPs ``4 * batch * nheads * seqlen^2 * headdim``, halved
when causal; medians of ``triton.testing.do_bench``, with ``--rounds R`` the best of R such
medians taken in turns over a shape's runs.  Implementations:

* ``bf16`` -- ``flashtile.flash_attn_func`` on bf16 inputs;
* ``fp8`` -- ``flashtile.fp8.flash_attn_fp8_func`` on flash-attn-layout V (what a caller pays);
* ``fp8_pretransposed`` -- the FP8 kernel alone, V already ``(batch, nheads_k, headdim, seqlen)``;
* ``fp8_v_in_kernel`` -- the FP8 kernel on flash-attn-layout V, each V tile transposed in
  shared memory inside the loop (no host pass);
* ``v_transpose`` -- the host transpose alone (ms only), ``flashtile.fp8.transpose_v``;
* ``fp8_gluon`` / ``fp8_gluon_bn64`` -- the Hopper Gluon FP8 kernel alone (sm_90, head dims up
  to 256), V pre-transposed, in the engine's configuration (``attention_fp8.config_for``) and
  with 64-key tiles (``block_n=64``); ``--gluon-variants SPEC ...`` adds
  ``fp8_gluon:<spec>`` for each ``attention_fp8.config_from_spec`` spec (e.g. the module's
  ``ALTERNATIVES``).

``fp8`` runs whichever kernel ``FLASHTILE_ENGINE`` selects (``gluon``: on Hopper the Gluon one).

``fp8_pretransposed + v_transpose`` against ``fp8_v_in_kernel`` is the V-layout decision of
docs/fp8.md.  ``--tiles BM,BN,warps,stages ...`` also times both kernel variants with each
of these tile configurations (every kernel record carries ``tiles``, and ``default_tiles``
for the default one), so one GPU call tunes the table in
``flashtile/kernels/attention_fp8.py``.  Every FP8 configuration is first checked against
the bf16 kernel on the dequantised inputs (``rel_err``, relative RMS; > 0.05 is flagged
``BAD``: a miscompiled configuration must not win the sweep).  ``--ptxas`` compiles the
configurations for sm_90 here, without a GPU, and prints registers, spills and the FP8
wgmma (``QGMMA``) instructions instead of timing.

    python benchmarks/bench_fp8.py --out benchmarks/results
    python benchmarks/bench_fp8.py --headdims 128 --seqlens 16384 --tiles 128,128,8,3 128,128,8,2 --out /tmp/r
    python benchmarks/bench_fp8.py --ptxas --headdims 64 128 256 --tiles 128,128,8,3 128,64,8,2
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path

import torch

SEQLENS = (1024, 2048, 4096, 8192, 16384)
HEADDIMS = (64, 128, 256)
IMPLS = ("bf16", "fp8", "fp8_pretransposed", "fp8_v_in_kernel", "v_transpose", "fp8_gluon", "fp8_gluon_bn64")
CHECK_LIMIT = 0.05  # relative RMS vs bf16; FP8 itself is ~0.02 at these shapes


def parse_tiles(text: str):
    from flashtile.kernels.runtime import TileConfig

    bm, bn, warps, stages, *maxnreg = (int(x) for x in text.split(","))
    return TileConfig(bm, bn, warps, stages, maxnreg=maxnreg[0] if maxnreg else 0)


def _tiles_label(cfg) -> str:
    return f"{cfg.block_m},{cfg.block_n},{cfg.num_warps},{cfg.num_stages}" + (f",{cfg.maxnreg}" if cfg.maxnreg else "")


def _inputs(batch, seqlen, nheads, nheads_k, headdim):
    from flashtile.fp8 import quantize_fp8, transpose_v

    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(batch, seqlen, h, headdim, device="cuda", generator=gen, dtype=torch.bfloat16)
               for h in (nheads, nheads_k, nheads_k))
    (q8, qd), (k8, kd), (v8, vd) = quantize_fp8(q), quantize_fp8(k), quantize_fp8(v)
    return (q, k, v), (q8, k8, v8, qd, kd, vd), transpose_v(v8)


def _rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()


def run(seqlens, headdims, causals, impls, tiles, nheads_k_div=1, progress=True, gluon_variants=(), rounds=1):
    import triton

    import flashtile
    from flashtile.bench.common import environment, standard_batch_heads
    from flashtile.bench.gpu import attention_flops
    from flashtile.fp8 import flash_attn_fp8_func, transpose_v
    from flashtile.kernels.engine import forward_engine, fp8_forward_engine, short_masked
    from flashtile.kernels.attention_fp8 import (
        attention_fp8_forward,
        fwd_config,
        padded_headdim,
    )

    env = environment("cuda")
    records = []

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median")

    for headdim in headdims:
        for seqlen in seqlens:
            batch, nheads = standard_batch_heads(seqlen, headdim)
            nheads_k = max(1, nheads // nheads_k_div)
            (q, k, v), (q8, k8, v8, qd, kd, vd), v_t = _inputs(batch, seqlen, nheads, nheads_k, headdim)
            # The bf16 kernel on the dequantised inputs: the check for every FP8 configuration.
            deq = [(x.float() * d).to(torch.bfloat16) for x, d in ((q8, qd), (k8, kd), (v8, vd))]
            for causal in causals:
                causal = bool(causal)
                base = {"bench": "attention_fp8", "mode": "fwd", "batch": batch, "nheads": nheads,
                        "nheads_k": nheads_k, "seqlen_q": seqlen, "seqlen_k": seqlen, "headdim": headdim,
                        "causal": causal}
                flops = attention_flops(batch, nheads, seqlen, seqlen, headdim, causal, "fwd")
                check = flashtile.flash_attn_func(*deq, causal=causal)
                scale = headdim ** -0.5
                runs = []
                if "bf16" in impls:
                    runs.append(("bf16", "bfloat16", None, partial(flashtile.flash_attn_func, q, k, v, causal=causal)))
                if "fp8" in impls:
                    runs.append(("fp8", "float8_e4m3fn", None,
                                 partial(flash_attn_fp8_func, q8, k8, v8, qd, kd, vd, causal=causal)))
                # The default configuration always (default_tiles=True), then the sweep's others.
                for impl, v_in in (("fp8_pretransposed", v_t), ("fp8_v_in_kernel", v8)):
                    if impl not in impls:
                        continue
                    default = _tiles_label(fwd_config(padded_headdim(headdim), causal, v_in is v_t))
                    for cfg in [None, *(t for t in tiles or [] if _tiles_label(t) != default)]:
                        kernel = partial(attention_fp8_forward, q8, k8, v_in, qd, kd, vd, scale, causal=causal,
                                         v_transposed=v_in is v_t, config=cfg)
                        runs.append((impl, "float8_e4m3fn", cfg, kernel))
                if "v_transpose" in impls:
                    runs.append(("v_transpose", "float8_e4m3fn", None, partial(transpose_v, v8)))
                gluon_runs = [(impl, spec) for impl, spec in (("fp8_gluon", ""), ("fp8_gluon_bn64", "block_n=64"))
                              if impl in impls] + [(f"fp8_gluon:{spec}", spec) for spec in gluon_variants]
                from flashtile.kernels.hopper import attention_fp8 as hopper_fp8

                if headdim <= hopper_fp8.MAX_HEADDIM and torch.cuda.get_device_capability() == (9, 0):
                    for impl, spec in gluon_runs:
                        if spec and impl != "fp8_gluon_bn64" and hopper_fp8.is_default(
                                hopper_fp8.padded_headdim(headdim), causal, spec):
                            continue  # the default's kernel itself, timed as fp8_gluon
                        cfg = hopper_fp8.config_from_spec(hopper_fp8.padded_headdim(headdim), causal, spec)
                        # The kernel alone: V in the key order a key_order configuration reads, made once.
                        v_in = hopper_fp8.wgmma_key_order(v_t) if cfg.key_order else v_t
                        runs.append((impl, "float8_e4m3fn", None,
                                     partial(hopper_fp8.forward, q8, k8, v_in, qd, kd, vd, scale, causal=causal,
                                             config=cfg, v_in_key_order=cfg.key_order)))
                timed = []
                # Which engine ("gluon" or "triton") each row's forward ran on: the public
                # functions' choice (engine.py), the kernels' own for the rest.
                paths = {"bf16": forward_engine(q, k, short=short_masked(seqlen, -1, 0 if causal else -1)),
                         "fp8": fp8_forward_engine(q8, causal), "fp8_pretransposed": "triton",
                         "fp8_v_in_kernel": "triton"}
                for impl, dtype, cfg, fn in runs:
                    rec = {**base, "impl": impl, "dtype": dtype}
                    if impl != "v_transpose":
                        rec["path"] = paths.get(impl, "gluon")
                    if impl in ("fp8_pretransposed", "fp8_v_in_kernel"):
                        rec["tiles"] = _tiles_label(cfg) if cfg is not None else \
                            _tiles_label(fwd_config(padded_headdim(headdim), causal, impl == "fp8_pretransposed"))
                        rec["default_tiles"] = cfg is None
                    try:
                        out = fn()
                        out = out[0] if isinstance(out, tuple) else out
                        if impl.startswith("fp8"):
                            rec["rel_err"] = _rel_rms(out, check)
                        rec["ms"] = bench(fn)
                    except Exception as e:  # noqa: BLE001 - a failing tile config is recorded, the sweep goes on
                        print(f"{impl} d={headdim} n={seqlen} causal={causal} {rec.get('tiles', '')}: "
                              f"{type(e).__name__}: {str(e)[:200]}", file=sys.stderr, flush=True)
                        continue
                    timed.append((rec, fn))
                # Further rounds in turns, each run's best kept: one kernel's timing moved by up to
                # 7 % between neighbouring runs on one machine (docs/tuning.md), more than the gaps
                # between the configurations compared.
                for _ in range(rounds - 1):
                    for rec, fn in timed:
                        rec["ms"] = min(rec["ms"], bench(fn))
                for rec, _ in timed:
                    rec.update(tflops=None if rec["impl"] == "v_transpose" else flops / rec["ms"] * 1e-9, **env)
                    records.append(rec)
                    if progress:
                        _print_record(rec)
    return records


def _print_record(r):
    flag = "BAD " if r.get("rel_err", 0) > CHECK_LIMIT else ""
    tf = f"{r['tflops']:7.1f} TFLOP/s" if r["tflops"] is not None else " " * 15
    err = f" rel_err {r['rel_err']:.1e}" if "rel_err" in r else ""
    print(f"{flag}{r['impl']:18s} d={r['headdim']:3d} n={r['seqlen_q']:5d} b={r['batch']:2d} "
          f"h={r['nheads']}/{r['nheads_k']} "
          f"causal={int(r['causal'])} {r.get('tiles', ''):12s} {r['ms']:8.3f} ms {tf}{err}", flush=True)


def print_summary(records):
    """fp8 / bf16 speed-up per shape (default configs), the headline of docs/fp8.md."""
    by = collections.defaultdict(dict)
    for r in records:
        if r.get("default_tiles", True):
            shape = (r["headdim"], r["seqlen_q"], r["causal"])
            by[shape][r["impl"]] = r["ms"] if r["impl"] == "v_transpose" else r["tflops"]
    nan = float("nan")
    print("\nTFLOP/s (v_transpose: ms)")
    print("headdim seqlen causal |   bf16    fp8 | fp8 pre-T  fp8 V-in-kernel  v_transpose ms | fp8/bf16")
    for (d, n, c), t in sorted(by.items()):
        ratio = t["fp8"] / t["bf16"] if "fp8" in t and "bf16" in t else nan
        print(f"{d:7d} {n:6d} {int(c):6d} | {t.get('bf16', nan):6.1f} {t.get('fp8', nan):6.1f} | "
              f"{t.get('fp8_pretransposed', nan):9.1f} {t.get('fp8_v_in_kernel', nan):16.1f} "
              f"{t.get('v_transpose', nan):14.3f} | {ratio:.2f}x")


def plot(records, path, pretransposed_tiles=None):
    """TFLOP/s against seqlen, one panel per head dim: bf16, the public FP8 function and the
    FP8 kernel (V pre-transposed) with its default tiles -- or, for head dims listed in
    ``pretransposed_tiles`` ({headdim: "BM,BN,warps,stages"}), the records with those tiles;
    solid non-causal, dashed causal."""
    from flashtile.bench.common import save_figure, subplots

    pretransposed_tiles = pretransposed_tiles or {}

    def wanted(r):
        if r["impl"] != "fp8_pretransposed":
            return r["impl"] in ("bf16", "fp8")
        if r["headdim"] in pretransposed_tiles:
            return r["tiles"] == pretransposed_tiles[r["headdim"]]
        return r.get("default_tiles", False)

    rows = [r for r in records if r.get("tflops") and wanted(r)]
    headdims = sorted({r["headdim"] for r in rows})
    fig, axes = subplots(1, len(headdims), figsize=(5 * len(headdims), 4), squeeze=False)
    colors = {"bf16": "tab:blue", "fp8": "tab:orange", "fp8_pretransposed": "tab:red"}
    labels = {"bf16": "flashtile bf16", "fp8": "flashtile fp8 (flash_attn_fp8_func)",
              "fp8_pretransposed": "fp8 kernel, V pre-transposed"}
    for ax, d in zip(axes[0], headdims):
        for impl in colors:
            for causal, style in ((False, "-"), (True, "--")):
                pts = sorted((r["seqlen_q"], r["tflops"]) for r in rows
                             if r["impl"] == impl and r["headdim"] == d and r["causal"] == causal)
                if pts:
                    ax.plot(*zip(*pts), style, marker="o", color=colors[impl],
                            label=f"{labels[impl]}{' causal' if causal else ''}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("seqlen (batch x seqlen = 16k)")
        ax.set_ylabel("TFLOP/s")
        ax.set_ylim(bottom=0)
        ax.set_title(f"FP8 attention forward, d = {d}")
        ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=7)
    save_figure(fig, path)


# --------------------------------------------------------------------------------------
# Offline sm_90 compile report (no GPU)
# --------------------------------------------------------------------------------------


def compile_sm90(cfg, headdim_pad: int, causal: bool, offset: int = 8, v_transposed: bool = True):
    """Compile the FP8 kernel for sm_90 on any machine (Triton ships ptxas)."""
    import triton
    from triton.backends.compiler import GPUTarget

    from flashtile.kernels import attention_fp8 as kf8

    bm, bn, hd = cfg.block_m, cfg.block_n, headdim_pad
    sig = {"Q_desc": f"tensordesc<fp8e4nv[1, {bm}, 1, {hd}]>", "K_desc": f"tensordesc<fp8e4nv[1, {bn}, 1, {hd}]>",
           "V_desc": (f"tensordesc<fp8e4nv[1, 1, {hd}, {bn}]>" if v_transposed
                      else f"tensordesc<fp8e4nv[1, {bn}, 1, {hd}]>"), "O_desc": f"tensordesc<bf16[1, {bm}, 1, {hd}]>",
           "LSE": "*fp32", "Q_DESCALE": "*fp32", "K_DESCALE": "*fp32", "V_DESCALE": "*fp32",
           "softmax_scale_log2": "fp32"}
    for name in ("stride_qdb", "stride_qdh", "stride_kdb", "stride_kdh", "stride_vdb", "stride_vdh",
                 "seqlen_q", "seqlen_k", "nheads", "group"):
        sig[name] = "i32"
    consts = {"HEAD_DIM": hd, "BLOCK_M": bm, "BLOCK_N": bn, "CAUSAL": causal, "OFFSET": offset,
              "V_TRANSPOSED": v_transposed, "EXACT_ROUNDING": False}
    sig.update({name: "constexpr" for name in consts})
    src = triton.compiler.ASTSource(fn=kf8._attn_fwd_fp8, signature=sig, constexprs=consts)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=cfg.launch_options())


def ptxas_report(kernel) -> dict:
    """ptxas registers / spills and the SASS's FP8 wgmma (QGMMA) instructions by variant."""
    import triton

    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as d:
        ptx, cubin = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        Path(ptx).write_text(kernel.asm["ptx"])
        r = subprocess.run([os.path.join(bin_dir, "ptxas"), "-v", "--gpu-name=sm_90a", ptx, "-o", cubin],
                           capture_output=True, text=True, check=False)
        Path(cubin).write_bytes(kernel.asm["cubin"])
        sass = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-sass", cubin], capture_output=True, text=True,
                              check=False).stdout
    regs = re.search(r"Used (\d+) registers", r.stderr)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", r.stderr)
    return {"registers": int(regs.group(1)) if regs else None,
            "spill_stores": int(spills.group(1)) if spills else None,
            "spill_loads": int(spills.group(2)) if spills else None,
            "gmma": dict(collections.Counter(re.findall(r"\b[HQI]GMMA\.[\w.]+", sass))),
            "fp8_casts": len(re.findall(r"F2FP\.SATFINITE\.E4M3", sass))}


def ptxas_main(tiles, headdims, causals):
    from flashtile.kernels.attention_fp8 import fwd_config, padded_headdim

    for d in headdims:
        hd = padded_headdim(d)
        for causal in causals:
            for cfg in tiles or [None]:
                cfg = cfg or fwd_config(hd, bool(causal), interpret=False)
                rep = ptxas_report(compile_sm90(cfg, hd, bool(causal)))
                print(f"fp8 fwd d={d} causal={causal} tiles={_tiles_label(cfg)}: {rep}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results", help="directory for attention_fp8.jsonl")
    ap.add_argument("--seqlens", type=int, nargs="+", default=list(SEQLENS))
    ap.add_argument("--headdims", type=int, nargs="+", default=list(HEADDIMS))
    ap.add_argument("--causal", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated subset of {','.join(IMPLS)}")
    ap.add_argument("--gluon-variants", nargs="*", default=[],
                    help="Gluon FP8 configuration specs name=value[+name=value...] to time as fp8_gluon:<spec>")
    ap.add_argument("--tiles", nargs="+", type=parse_tiles, default=None,
                    help="BLOCK_M,BLOCK_N,warps,stages[,maxnreg] configurations to sweep for the two kernel variants")
    ap.add_argument("--gqa", type=int, default=1, help="nheads / nheads_k (default 1: MHA)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time each shape's runs this many times in turns and keep each one's best")
    ap.add_argument("--ptxas", action="store_true", help="compile for sm_90 offline and report; no GPU needed")
    ap.add_argument("--plot-from", default=None, metavar="JSONL",
                    help="no GPU: draw attention_fp8.png in --out from these records")
    ap.add_argument("--plot-tiles", nargs="*", default=[], metavar="D=BM,BN,W,S",
                    help="with --plot-from: the pre-transposed kernel's tiles to plot for head dim D")
    args = ap.parse_args()
    if args.ptxas:
        ptxas_main(args.tiles, args.headdims, args.causal)
        return
    if args.plot_from:
        from flashtile.bench.common import read_jsonl

        tiles = {int(d): t for d, t in (item.split("=") for item in args.plot_tiles)}
        plot(read_jsonl(args.plot_from), Path(args.out) / "attention_fp8.png", tiles)
        return
    if not torch.cuda.is_available():
        sys.exit("bench_fp8.py times a CUDA GPU (use --ptxas for the offline compile report)")
    impls = tuple(s.strip() for s in args.impls.split(",") if s.strip())
    unknown = set(impls) - set(IMPLS)
    if unknown:
        sys.exit(f"unknown --impls {sorted(unknown)}; choose from {', '.join(IMPLS)}")
    from flashtile.bench.common import write_jsonl

    records = run(args.seqlens, args.headdims, args.causal, impls, args.tiles, args.gqa,
                  gluon_variants=args.gluon_variants, rounds=args.rounds)
    path = write_jsonl(Path(args.out) / "attention_fp8.jsonl", records)
    print_summary(records)
    try:
        plot(records, Path(args.out) / "attention_fp8.png")
    except ImportError:
        print("matplotlib not installed: no plot")
    best = {}
    for r in records:
        if "tiles" in r and r["rel_err"] <= CHECK_LIMIT:
            key = (r["impl"], r["headdim"], r["seqlen_q"], r["causal"])
            if key not in best or r["tflops"] > best[key]["tflops"]:
                best[key] = r
    for (impl, d, n, c), r in sorted(best.items()):
        print(f"best tiles {impl} d={d} n={n} causal={int(c)}: {r['tiles']} {r['tflops']:.1f} TFLOP/s")
    print(f"{len(records)} records appended to {path}")


if __name__ == "__main__":
    main()
