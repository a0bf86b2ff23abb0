"""A/B of the attention backward engines on a Hopper GPU, with cuDNN, in one process.

For each shape (bf16, ``batch * seqlen = 16k``, ``heads * d = 2048``) times forward +
backward with ``triton.testing.do_bench`` (the forward is the same Gluon forward for every
flashtile row):

* ``gluon`` -- the Gluon backward with its default tiles, and ``gluon:<config>`` variants
  (``--variants``: ``attention_bwd.config_from_spec`` specs, keywords joined by ``+``, e.g.
  ``num_stages=3``; default: the configurations in ``attention_bwd.ALTERNATIVES``);
* ``triton`` -- the ``tl.*`` dK/dV and dQ kernels;
* ``sdpa_cudnn`` -- PyTorch SDPA pinned to cuDNN.

Prints one line a shape and writes one JSON object a line (``--out``)::

    python benchmarks/bench_hopper_bwd.py --variants num_stages=3 --out hopper_bwd.jsonl
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from flashtile.bench.common import environment, shape_sweep
from flashtile.bench.gpu import attention_flops, impl_fn, time_attention
from flashtile.kernels.engine import ENGINE_ENV
from flashtile.kernels.hopper import attention_bwd, configured


def _timed(impl, variant, causal, q, k, v):
    """Milliseconds of forward + backward for one implementation (and Gluon variant)."""
    if impl == "sdpa_cudnn":
        return time_attention(impl_fn(impl, causal, q.shape[-1]), "fwd_bwd", q, k, v)
    saved_env, saved_cfg = os.environ.get(ENGINE_ENV), attention_bwd.config_for
    os.environ[ENGINE_ENV] = impl
    if variant:
        attention_bwd.config_for = configured(saved_cfg, variant)
    try:
        if impl == "triton":  # the Gluon forward, the tl.* backward
            fwd = impl_fn("flashtile", causal, q.shape[-1])

            def fn(q_, k_, v_):
                os.environ[ENGINE_ENV] = "gluon"
                out = fwd(q_, k_, v_)
                os.environ[ENGINE_ENV] = "triton"
                return out

            return time_attention(fn, "fwd_bwd", q, k, v)
        return time_attention(impl_fn("flashtile", causal, q.shape[-1]), "fwd_bwd", q, k, v)
    finally:
        attention_bwd.config_for = saved_cfg
        if saved_env is None:
            os.environ.pop(ENGINE_ENV, None)
        else:
            os.environ[ENGINE_ENV] = saved_env


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--headdims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--causal", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--variants", nargs="*", default=list(attention_bwd.ALTERNATIVES),
                    help="Gluon variants: name=value[+name=value...] (default: attention_bwd.ALTERNATIVES)")
    ap.add_argument("--peers", nargs="*", default=["triton", "sdpa_cudnn"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    env = environment("cuda")
    rows = [("gluon", "")] + [("gluon", v) for v in args.variants] + [(p, "") for p in args.peers]
    records = []
    for d, causal, n in shape_sweep(args.headdims, args.causal, args.seqlens):
        b, h = max(1, 16384 // n), 2048 // d
        q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = attention_flops(b, h, n, n, d, causal, "fwd_bwd")
        line = []
        for impl, variant in rows:
            ms = _timed(impl, variant, causal, q, k, v)
            name = impl + (f":{variant}" if variant else "")
            line.append(f"{name}={flops / ms / 1e9:.0f}")
            records.append(dict(bench="hopper_bwd", impl=name, mode="fwd_bwd", dtype="bfloat16", batch=b,
                                nheads=h, seqlen_q=n, seqlen_k=n, headdim=d, causal=causal, ms=ms,
                                tflops=flops / ms / 1e9, **env))
        print(d, int(causal), n, " ".join(line), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
