"""Sweep the split-KV decode launch knobs on a GPU (bf16, GQA 32:4, d = 128, CUDA graph timing).

Each configuration is set through ``FLASHTILE_DECODE_TUNING`` (read at every call, see
``flashtile/kernels/decode.py``), so nothing is patched.  GB/s counts the K and V bytes read.
Usage::

    python benchmarks/tune_decode.py --batches 1 8 --caches 32768 --paged 0 16 256 --out tune_decode.jsonl
"""

import argparse
import itertools
import json
import os
import traceback

import torch
import triton

import flashtile
from flashtile.bench.common import write_jsonl
from flashtile.bench.decode import _paged
from flashtile.kernels import decode as kd


def gbps(batch, cache, page, splits, generator):
    q = torch.randn(batch, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, cache, 4, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    kw = dict(num_splits=splits)
    if page:
        k, v, kw["block_table"] = _paged(k, v, page, generator)
    fn = lambda: flashtile.flash_attn_with_kvcache(q, k, v, **kw)  # noqa: E731
    fn()
    ms = triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
    return 2 * k.numel() * k.element_size() / ms * 1e-6


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--caches", type=int, nargs="+", default=[32768])
    ap.add_argument("--paged", type=int, nargs="+", default=[0, 16, 256], help="page sizes (0 = contiguous)")
    ap.add_argument("--block-n", type=int, nargs="+", default=[64, 128], help="0 = the automatic choice")
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--stages", type=int, nargs="+", default=[3, 4])
    ap.add_argument("--splits", type=int, nargs="+", default=[0], help="0 = the automatic choice")
    ap.add_argument("--extra", nargs="+", default=[""],
                    help='further knob settings to sweep, each "name=value,..." (e.g. programs_per_sm=1)')
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for batch, cache, page in itertools.product(args.batches, args.caches, args.paged):
        for bn, warps, stages, splits, extra in itertools.product(args.block_n, args.warps, args.stages, args.splits,
                                                                  args.extra):
            knob = "block_n_paged" if page else "block_n"
            # The tile is the one asked for, neither widened for few splits nor narrowed for short
            # caches; block_n 0: the automatic choice.
            tiles = f"{knob}={bn},paged_wide_below_splits=0,narrow_short_caches=0," if bn else ""
            os.environ[kd.TUNING_ENV] = f"{tiles}warps={warps},stages={stages}" + (f",{extra}" if extra else "")
            rec = dict(bench="decode_tune", batch=batch, seqlen_k=cache, page_size=page, block_n=bn, warps=warps,
                       stages=stages, num_splits=splits, extra=extra)
            try:
                rec["gbps_graph"] = gbps(batch, cache, page, splits, gen)
            except Exception as e:  # noqa: BLE001 - a config that fails to compile is recorded
                rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                traceback.print_exc()
            rows.append(rec)
            print(json.dumps(rec), flush=True)
    os.environ.pop(kd.TUNING_ENV, None)
    if args.out:
        write_jsonl(args.out, rows)


if __name__ == "__main__":
    main()
