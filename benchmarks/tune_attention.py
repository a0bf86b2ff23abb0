"""Sweep tile configurations of the Triton attention kernels on the GPU (bf16).

Prints TFLOP/s per config for the forward and the backward at a few shapes, so the
launch heuristics / autotune lists in ``flashtile/kernels/attention/`` are chosen from
measurements.  Usage: ``python benchmarks/tune_attention.py [--out results.jsonl]``.
"""

import argparse
import itertools
import json
import sys

import torch
import triton

from flashtile import cpu
from flashtile.bench.common import standard_batch_heads
from flashtile.bench.gpu import attention_flops
from flashtile.kernels import attention as ka
from flashtile.kernels.runtime import TileConfig
from flashtile.kernels.tma import padded_headdim


def flops(b, h, n, d, causal, mode):
    return attention_flops(b, h, n, n, d, causal, mode)


def _bwd_candidates(hd, kv_tiles=None):
    """(dK/dV config, dQ config) pairs: vary one kernel at a time around a base."""
    if kv_tiles:
        dq_base = (64, 64, 4, 3) if hd <= 128 else (128, 64, 8, 2)
        return [(TileConfig(*t), TileConfig(*dq_base)) for t in kv_tiles]
    kv = [(64, 128, 8, 2), (64, 128, 8, 3), (32, 128, 4, 3), (64, 64, 4, 3), (128, 128, 8, 2), (64, 128, 4, 2), (128, 64, 8, 2)]
    dq = [(128, 64, 8, 2), (128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 2), (64, 128, 4, 2), (128, 32, 4, 3)]
    if hd >= 256:
        kv = [(64, 64, 8, 2), (32, 64, 4, 2), (32, 64, 8, 2), (64, 32, 4, 2), (32, 32, 4, 2), (64, 128, 8, 2), (32, 128, 8, 2)]
        dq = [(64, 32, 4, 2), (64, 64, 8, 2), (128, 32, 8, 2), (128, 64, 8, 2), (32, 64, 4, 2)]
    base_kv, base_q = kv[0], dq[0]
    pairs = [(c, base_q) for c in kv] + [(base_kv, c) for c in dq[1:]]
    return [(TileConfig(*a), TileConfig(*b)) for a, b in pairs]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--headdims", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--bwd", action="store_true")
    ap.add_argument("--fwd", action="store_true")
    ap.add_argument("--causal", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--kv", nargs="+", help="dK/dV tiles to try, as BLOCK_M,BLOCK_N,warps,stages")
    args = ap.parse_args()
    rows = []
    n = args.seqlen
    for d in args.headdims:
        b, h = standard_batch_heads(n, d)
        q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        hd = padded_headdim(d)
        for causal in args.causal:
            right = 0 if causal else -1
            if args.fwd:
                best = None
                tiles = [(64, 64, 4), (64, 128, 4), (128, 64, 8), (128, 128, 8), (64, 32, 4)]
                for (bm, bn, w), s in itertools.product(tiles, (2, 3, 4)):
                    if hd == 256 and bn > 64:
                        continue
                    cfg = TileConfig(bm, bn, w, s)
                    try:
                        fn = lambda: ka.attention_forward(q, k, v, d ** -0.5, -1, right, config=cfg)
                        fn()
                        ms = triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median")
                    except Exception as e:  # noqa: BLE001 - record and move on
                        print(f"fwd d={d} causal={causal} {cfg}: {type(e).__name__}: {str(e)[:100]}", file=sys.stderr)
                        continue
                    tf = flops(b, h, n, d, causal, "fwd") / ms * 1e-9
                    rows.append(dict(kernel="fwd", headdim=d, causal=causal, cfg=repr(cfg), ms=ms, tflops=tf))
                    if best is None or tf > best[0]:
                        best = (tf, cfg)
                print(f"FWD d={d} causal={causal}: best {best[0]:.1f} TFLOP/s {best[1]}", flush=True)
            if args.bwd:
                o, lse = ka.attention_forward(q, k, v, d ** -0.5, -1, right)
                do = torch.randn_like(o)
                # Correctness of every config on an awkward shape, against the fp32 torch path.
                qs, ks, vs = (torch.randn(2, 1000, 4, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                os_, lses = ka.attention_forward(qs, ks, vs, d ** -0.5, -1, right)
                dos = torch.randn_like(os_)
                ref = cpu.attention_backward(dos.float(), qs.float(), ks.float(), vs.float(), os_.float(), lses,
                                             d ** -0.5, -1, right, block_m=1024, block_n=1024)
                kv_tiles = [tuple(map(int, t.split(","))) for t in args.kv] if args.kv else None
                for cfg_kv, cfg_q in _bwd_candidates(hd, kv_tiles):
                    try:
                        got = ka.attention_backward(dos, qs, ks, vs, os_, lses, d ** -0.5, -1, right, configs=(cfg_kv, cfg_q))
                        errs = [((a.float() - r).norm() / r.norm()).item() for a, r in zip(got, ref)]
                        fn = lambda: ka.attention_backward(do, q, k, v, o, lse, d ** -0.5, -1, right, configs=(cfg_kv, cfg_q))
                        ms = triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median")
                    except Exception as e:  # noqa: BLE001
                        print(f"bwd d={d} causal={causal} {cfg_kv}/{cfg_q}: {type(e).__name__}: {str(e)[:100]}", file=sys.stderr)
                        continue
                    tf = flops(b, h, n, d, causal, "bwd") / ms * 1e-9
                    rows.append(dict(kernel="bwd", headdim=d, causal=causal, cfg=f"{cfg_kv}/{cfg_q}", ms=ms, tflops=tf, rel_err=errs))
                    flag = "BAD" if max(errs) > 2e-2 else "ok "
                    print(f"{flag} bwd d={d} causal={causal} {cfg_kv} / {cfg_q}: {tf:.1f} TFLOP/s ({ms:.2f} ms) "
                          f"rel err dq/dk/dv {['%.1e' % e for e in errs]}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
