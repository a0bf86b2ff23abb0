"""Where one forward + backward spends its time, kernel by kernel (GPU machine only).

In the standard benchmark (``flashtile.bench.gpu``) forward + backward at ``batch * N = 16k``
takes 1.7-2.0 ms at N = 512, 1k and 2k alike on an H200 (cuDNN: 0.6 / 1.0 / 1.7 ms), on
either backward engine, while the forward alone scales with N: a fixed cost of about a
millisecond that this script splits into kernels and the gaps between them.

For each shape (bf16, ``batch * N = 16k``, ``heads * d = 2048``) and each engine it runs the
benchmark's step (forward, then ``out.backward(dout)``) a few times under
``torch.profiler`` and reports, per step: the wall time between CUDA events around it, the
sum of the device time of its kernels (the difference is time the GPU sat idle: host work
or a synchronisation), and each kernel's count and device time.  One JSON object a line
(``--out``)::

    python benchmarks/profile_fwd_bwd.py --seqlens 512 16384 --out profile_fwd_bwd.jsonl
"""

from __future__ import annotations

import argparse
import os

import torch
from torch.profiler import ProfilerActivity, profile

import flashtile
from flashtile.bench.common import environment, shape_sweep, standard_batch_heads, write_jsonl
from flashtile.kernels.engine import ENGINE_ENV

STEPS = 5


def _step_fn(causal, q, k, v, dout):
    def step():
        out = flashtile.flash_attn_func(q, k, v, causal=causal)
        out.backward(dout)
        for t in (q, k, v):
            t.grad = None
    return step


def profile_shape(engine: str, d: int, n: int, causal: bool) -> dict:
    os.environ[ENGINE_ENV] = engine
    batch, heads = standard_batch_heads(n, d)
    q, k, v = (torch.randn(batch, n, heads, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn_like(q)
    step = _step_fn(causal, q, k, v, dout)
    for _ in range(3):  # compile and warm up outside the profile
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start.record()
        for _ in range(STEPS):
            step()
        end.record()
        torch.cuda.synchronize()
    wall_us = start.elapsed_time(end) * 1e3 / STEPS
    kernels = {}
    for e in prof.key_averages():
        device_us = getattr(e, "device_time_total", None)
        if device_us is None:
            device_us = e.cuda_time_total
        if device_us and e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.key] = {"count": e.count / STEPS, "device_us": device_us / STEPS}
    device_us = sum(x["device_us"] for x in kernels.values())
    return {"engine": engine, "headdim": d, "seqlen": n, "batch": batch, "nheads": heads, "causal": causal,
            "wall_us": wall_us, "kernel_us": device_us, "idle_us": wall_us - device_us,
            "kernels": dict(sorted(kernels.items(), key=lambda kv: -kv[1]["device_us"]))}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--headdims", type=int, nargs="+", default=[128])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[512, 2048, 16384])
    ap.add_argument("--causal", type=int, nargs="+", default=[0])
    ap.add_argument("--engines", nargs="+", default=["auto", "triton"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    env = environment("cuda")
    records = []
    for d, causal, n in shape_sweep(args.headdims, args.causal, args.seqlens):
        for engine in args.engines:
            rec = profile_shape(engine, d, n, causal)
            records.append({"bench": "profile_fwd_bwd", "mode": "fwd_bwd", "dtype": "bfloat16", **rec, **env})
            print(f"d={d} causal={int(causal)} N={n:5d} {engine:6s} wall {rec['wall_us']:8.1f} us, kernels "
                  f"{rec['kernel_us']:8.1f} us, idle {rec['idle_us']:8.1f} us", flush=True)
            for name, x in list(rec["kernels"].items())[:8]:
                print(f"    {x['device_us']:8.1f} us  x{x['count']:4.1f}  {name[:90]}", flush=True)
    if args.out:
        write_jsonl(args.out, records)


if __name__ == "__main__":
    main()
