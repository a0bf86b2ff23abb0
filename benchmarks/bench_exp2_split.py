"""A/B of ``FLASHTILE_EXP2_SPLIT`` (half of each forward tile's exp2 on the FMA pipe) on a GPU.

One process, the two settings interleaved (off, on, off, on) at every shape so that clock and
thermal drift hit both alike; the flag is read at call time (``fastmath.EXP2_SPLIT``), each
setting is its own kernel specialization.  Shapes as ``flashtile.bench.gpu`` (``batch * seqlen
= 16384``, ``nheads * headdim = 2048``), forward only (the flag changes nothing else):

* ``bf16`` -- ``flashtile.flash_attn_func``;
* ``fp8_pretransposed`` -- the FP8 forward kernel, V already in its GEMM layout
  (``benchmarks/bench_fp8.py``), whose softmax is the larger share of a tile's time.

Each record carries ``exp2_split`` (0 / 1) and ``round`` (0 / 1); the summary prints the
best of the two rounds per setting and the ratio on / off.

    python benchmarks/bench_exp2_split.py --out $OUT
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def run(headdims, seqlens, causals, impls):
    import triton

    import flashtile
    from bench_fp8 import _inputs
    from flashtile.bench.common import environment
    from flashtile.bench.gpu import attention_flops
    from flashtile.kernels import fastmath
    from flashtile.kernels.attention_fp8 import attention_fp8_forward

    env = environment("cuda")
    records = []
    for headdim in headdims:
        for seqlen in seqlens:
            batch, nheads = max(1, 16384 // seqlen), 2048 // headdim
            (q, k, v), (q8, k8, _v8, qd, kd, vd), v_t = _inputs(batch, seqlen, nheads, nheads, headdim)
            for causal in map(bool, causals):
                fns = {"bf16": partial(flashtile.flash_attn_func, q, k, v, causal=causal),
                       "fp8_pretransposed": partial(attention_fp8_forward, q8, k8, v_t, qd, kd, vd, headdim ** -0.5,
                                                    causal=causal, v_transposed=True)}
                flops = attention_flops(batch, nheads, seqlen, seqlen, headdim, causal, "fwd")
                for impl in impls:
                    outs = {}
                    for rnd in range(2):
                        for split in (False, True):
                            fastmath.EXP2_SPLIT = split
                            out = fns[impl]()
                            outs[split] = (out[0] if isinstance(out, tuple) else out).float()
                            ms = triton.testing.do_bench(fns[impl], warmup=5, rep=40, return_mode="median")
                            records.append(dict(bench="attention_exp2_split", impl=impl, mode="fwd",
                                                dtype="bfloat16" if impl == "bf16" else "float8_e4m3fn",
                                                batch=batch, nheads=nheads, nheads_k=nheads, seqlen_q=seqlen,
                                                seqlen_k=seqlen, headdim=headdim, causal=causal,
                                                exp2_split=int(split), round=rnd, ms=ms,
                                                tflops=flops / ms * 1e-9, **env))
                    fastmath.EXP2_SPLIT = False
                    diff = (outs[True] - outs[False]).abs().max().item()
                    best = {s: max(r["tflops"] for r in records[-4:] if r["exp2_split"] == s) for s in (0, 1)}
                    print(f"{impl:>18} d={headdim:<3} N={seqlen:<6} causal={int(causal)}  off {best[0]:6.1f}  "
                          f"on {best[1]:6.1f} TFLOP/s  on/off {best[1] / best[0]:.3f}  max|diff| {diff:.2e}",
                          flush=True)
    return records


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--headdims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--causal", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--impls", default="bf16,fp8_pretransposed")
    ap.add_argument("--out", default=None, help="folder for attention_exp2_split.jsonl")
    args = ap.parse_args()
    records = run(args.headdims, args.seqlens, args.causal, args.impls.split(","))
    if args.out:
        from flashtile.bench.common import write_jsonl

        write_jsonl(os.path.join(args.out, "attention_exp2_split.jsonl"), records)


if __name__ == "__main__":
    main()
