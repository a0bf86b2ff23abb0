"""A/B of the attention forward engines on a Hopper GPU, with the peers, in one process.

For each shape (bf16, ``batch * seqlen = 16k``, ``heads * d = 2048``) times, with
``triton.testing.do_bench`` (median of CUDA-event timings):

* ``gluon`` variants -- the Hopper forward in its default configuration (``gluon``), then as
  changed by ``--variants`` (``attention_fwd.config_from_spec`` specs, keywords joined by ``+``,
  ``gluon:<spec>``; default: ``attention_fwd.ALTERNATIVES``), then with the tile configurations
  of ``--configs``
  (``BLOCK_N,stages,pingpong,persistent[,consumer_regs[,l2_share_percent[,query_buffers]]]``;
  one query buffer unless given);
* ``triton`` -- the portable ``tl.*`` forward;
* ``sdpa_cudnn`` / ``sdpa_flash`` -- PyTorch SDPA pinned to one backend;

and checks every flashtile variant against cuDNN's output before timing it.  Writes one JSON
object a line (``--out``) and prints a table::

    python benchmarks/bench_hopper.py --out results/hopper_fwd.jsonl --headdims 64 128 256
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from flashtile.bench.common import environment, shape_sweep, standard_batch_heads
from flashtile.bench.gpu import engine_for, impl_fn
from flashtile.kernels import attention as ka
from flashtile.kernels.hopper import attention_fwd as hopper
from flashtile.kernels.tma import padded_headdim


def _gluon(cfg, causal):
    def run(q, k, v):
        layout = ka.Layout(q, k)
        return hopper.forward(layout, q, k, v, q.shape[-1] ** -0.5, -1, 0 if causal else -1, config=cfg)[0]

    return run


def _triton(causal):
    def run(q, k, v):
        with engine_for("flashtile_triton"):
            return ka.attention_forward(q, k, v, q.shape[-1] ** -0.5, -1, 0 if causal else -1)[0]

    return run


def parse_config(text: str) -> hopper.HopperConfig:
    parts = [int(x) for x in text.split(",")]
    block_n, stages, pingpong, persistent = parts[:4]
    regs = parts[4] if len(parts) > 4 else 240
    l2_share = parts[5] / 100 if len(parts) > 5 else 0.5
    q_buffers = parts[6] if len(parts) > 6 else 1
    return hopper.HopperConfig(block_n=block_n, num_stages=stages, pingpong=bool(pingpong),
                               persistent=bool(persistent), consumer_regs=regs, l2_share=l2_share,
                               q_buffers=q_buffers)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--headdims", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--causal", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--variants", nargs="*", default=list(hopper.ALTERNATIVES),
                    help="Gluon variants: name=value[+name=value...] on the default configuration "
                         "(default: attention_fwd.ALTERNATIVES)")
    ap.add_argument("--configs", nargs="*", default=[],
                    help="extra Gluon configs BLOCK_N,stages,pingpong,persistent[,regs[,l2_share%%[,q_buffers]]]")
    ap.add_argument("--peers", nargs="*", default=["triton", "sdpa_cudnn", "sdpa_flash"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    env = environment("cuda")
    records = []
    for d, causal, n in shape_sweep(args.headdims, args.causal, args.seqlens):
        batch, heads = standard_batch_heads(n, d)
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(batch, n, heads, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                   for _ in range(3))
        impls = {"gluon": _gluon(None, causal)}
        for spec in args.variants:
            impls[f"gluon:{spec}"] = _gluon(hopper.config_from_spec(padded_headdim(d), spec), causal)
        for text in args.configs:
            impls[f"gluon[{text}]"] = _gluon(parse_config(text), causal)
        for peer in args.peers:
            impls[peer] = _triton(causal) if peer == "triton" else impl_fn(peer, causal, d)
        ref = impl_fn("sdpa_cudnn", causal, d)(q, k, v).float()
        flops = 4.0 * batch * heads * n * n * d / (2 if causal else 1)
        row = {}
        for name, fn in impls.items():
            try:
                out = fn(q, k, v)
                err = (out.float() - ref).abs().max().item()
                ms = triton.testing.do_bench(lambda: fn(q, k, v), warmup=25, rep=100, return_mode="median")
            except Exception as e:  # a variant that fails to build or launch is reported, not fatal
                print(f"{name} d={d} causal={causal} N={n}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            rec = {"bench": "hopper_fwd", "impl": name, "mode": "fwd", "dtype": "bfloat16", "batch": batch,
                   "seqlen": n, "nheads": heads, "headdim": d, "causal": causal, "ms": ms,
                   "tflops": flops / ms * 1e-9, "max_abs_err_vs_cudnn": err, **env}
            records.append(rec)
            row[name] = rec["tflops"]
        cudnn = row.get("sdpa_cudnn", float("nan"))
        print(f"d={d:3d} causal={int(causal)} N={n:5d} " + " ".join(
            f"{k}={t:6.1f}({t / cudnn:.2f})" for k, t in row.items()), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
