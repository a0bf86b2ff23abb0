"""Host (CPU) time per call of a training step's attention, forward and forward + backward
(GPU machine only).

At small N a forward + backward keeps the GPU busy for about a millisecond, so the host's time
per call decides whether the GPU waits.  Each case runs at a tiny shape (batch 1, N = 128,
8 heads), GPU-idle-bound, timed on the host as ``profile_decode_host.per_call_us`` does: ``us``
is the host microseconds per call.  Rows (``bench = "host_fwd_bwd"``): ``mode`` fwd or
fwd_bwd, ``headdim`` 64 / 128, ``impl`` flashtile (``auto``: the Gluon kernels at d = 128),
flashtile_triton (the ``tl.*`` kernels), sdpa_cudnn, sdpa_flash.  Then flashtile's step at
d = 128 layer by layer (``mode`` = the layer: the public function, the custom ops, the
kernels' launchers, each alone; ``breakdown``), a check that one step never synchronises
with the GPU, and a cProfile of the step, by own time and by cumulative time.

    python benchmarks/profile_host_fwd_bwd.py --out host_fwd_bwd.jsonl
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats

import torch

from flashtile.bench.common import environment, plot_host_us, save_records
from flashtile.bench.gpu import impl_fn
from flashtile.kernels.engine import ENGINE_ENV
from profile_decode_host import per_call_us

IMPLS = ("flashtile", "flashtile_triton", "sdpa_cudnn", "sdpa_flash")


def step_fn(impl, mode, d, causal=False, seqlen=128):
    fn = impl_fn(impl, causal, d)
    q, k, v = (torch.randn(1, seqlen, 8, d, device="cuda", dtype=torch.bfloat16, requires_grad=mode == "fwd_bwd")
               for _ in range(3))
    if mode == "fwd":
        return lambda: fn(q, k, v)
    dout = torch.randn_like(q)

    def step():
        fn(q, k, v).backward(dout)
        q.grad = k.grad = v.grad = None
    return step


def breakdown_cases(d):
    """``(layer, fn)``: one forward + backward's host work, layer by layer."""
    import flashtile
    from flashtile.kernels import attention as kernels
    from flashtile.ops import attention as ops
    from flashtile.semantics.params import AttentionParams

    q, k, v = (torch.randn(1, 128, 8, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    params = AttentionParams(d ** -0.5)
    with torch.no_grad():
        out, lse = kernels.fwd(q, k, v, params)

    def no_grad(fn):
        def run():
            with torch.no_grad():
                return fn()
        return run

    def grads_none():
        q.grad = k.grad = v.grad = None

    def step():
        flashtile.flash_attn_func(q, k, v).backward(dout)
        grads_none()

    def step_autograd_grad():
        torch.autograd.grad(flashtile.flash_attn_func(q, k, v), (q, k, v), dout)

    yield "step: flash_attn_func + .backward", step
    yield "step: flash_attn_func + autograd.grad", step_autograd_grad
    yield "fwd recording autograd: flash_attn_func", lambda: flashtile.flash_attn_func(q, k, v)
    yield "fwd recording autograd: ops.forward", lambda: ops.forward(q, k, v, params)
    yield "fwd no grad: ops.attention_forward", no_grad(lambda: ops.attention_forward(q, k, v, *params.op_args()))
    yield "fwd no grad: kernels.fwd", no_grad(lambda: kernels.fwd(q, k, v, params))
    yield "bwd no grad: ops.backward", no_grad(lambda: ops.backward(dout, q, k, v, out, lse, None, params))
    yield "bwd no grad: kernels.bwd", no_grad(lambda: kernels.bwd(dout, q, k, v, out, lse, params))


def sync_check(step):
    """Run ``step`` with PyTorch's synchronisation check raising: a step that waits for the GPU
    (a ``.item()``, a host copy) would make every host-time figure above a GPU time."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        print("sync check: one step, no synchronisation with the GPU", flush=True)
    except RuntimeError as e:
        import traceback

        print(f"sync check: the step synchronises: {e}", flush=True)
        traceback.print_exc()
    finally:
        torch.cuda.set_sync_debug_mode(0)


def plot(records, path) -> None:
    """Host microseconds per call, one bar per case (the breakdown's layers below the peers)."""
    labels = [f"d={r['headdim']} {r['mode']} {r['impl']}" if r["bench"] == "host_fwd_bwd" else f"d={r['headdim']} {r['mode']}"
              for r in records]
    colors = ["C0" if r["impl"] == "flashtile" and r["bench"] == "host_fwd_bwd" else "C7" if r["impl"] == "flashtile"
              else "C2" if r["impl"] == "flashtile_triton" else "C1" for r in records]
    plot_host_us(labels, [r["us"] for r in records], colors,
                 f"Host time per call at (1, 128, 8, d), bf16, {records[0]['device']}", path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--headdims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--calls", type=int, default=100, help="calls per round (a fwd+bwd is ~6 launches)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-profile", action="store_true")
    args = ap.parse_args()
    os.environ.pop(ENGINE_ENV, None)
    env = environment("cuda")
    records = []
    for d in args.headdims:
        for mode in ("fwd", "fwd_bwd"):
            for impl in IMPLS:
                us = per_call_us(step_fn(impl, mode, d), calls=args.calls)
                print(f"d={d:3d} {mode:7s} {impl:18s} {us:8.1f} host us/call", flush=True)
                records.append(dict(bench="host_fwd_bwd", impl=impl, mode=mode, dtype="bfloat16", batch=1, nheads=8,
                                    nheads_k=8, seqlen_q=128, seqlen_k=128, headdim=d, us=us, **env))
    for mode, fn in breakdown_cases(128):
        us = per_call_us(fn, calls=args.calls)
        print(f"d=128 {mode:34s} {us:8.1f} host us/call", flush=True)
        records.append(dict(bench="host_fwd_bwd_breakdown", impl="flashtile", mode=mode, dtype="bfloat16", batch=1,
                            nheads=8, nheads_k=8, seqlen_q=128, seqlen_k=128, headdim=128, us=us, **env))
    sync_check(step_fn("flashtile", "fwd_bwd", 128))
    if args.out:
        save_records(records, args.out, plot)
    if not args.no_profile:
        step = step_fn("flashtile", "fwd_bwd", 128)
        for _ in range(20):
            step()
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(300):
            step()
        prof.disable()
        torch.cuda.synchronize()
        for key in ("tottime", "cumtime"):
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats(key).print_stats(30)
            print(s.getvalue())


if __name__ == "__main__":
    main()
