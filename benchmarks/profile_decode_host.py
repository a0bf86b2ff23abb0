"""Host (CPU) time per call of a decoding step and of a tiny attention forward (GPU machine only).

A decode step at batch 1 keeps the GPU busy for ~10-20 us, so whatever Python does per call
shows directly in eager latency.  Each case is timed *GPU-idle-bound*: the GPU work is tiny
(cache 1k, batch 1); rounds of ``calls`` calls are issued back to back and timed on the host,
each round short enough that the launch queue never fills (a full queue would make the host
wait for the GPU), then one synchronisation waits for the queue: ``us`` = the median round's
host seconds per call.  Nothing in the timed
loop may synchronise, so a case whose call reads values on the host (flashtile's index
check of tensor lengths, ``cache_seqlens`` as a CUDA tensor) measures that wait too -- the
int-length rows are the call without it.

Rows (``bench = "decode_host"``), ``mode``:
* ``kvcache`` / ``kvcache+append`` / ``kvcache+append+rotary`` -- ``flash_attn_with_kvcache``
  without / with a one-token append (and with the rotary of q and the new key), ``layout``
  contiguous or paged16, ``lengths`` int or tensor; ``impl`` flashtile (direct launches),
  flashtile_ordinary (every launch through ``kernel[grid]``, what the launch layer replaces),
  sdpa_cudnn / sdpa_flash (SDPA on the whole cache; with an append, the two copies into the
  cache first);
* ``func`` -- ``flash_attn_func`` forward at (1, 128, 8, 64) against SDPA (cuDNN, flash);
* ``func growing`` -- ``flash_attn_func`` of one query row against keys and values one longer
  every 8 calls, as transformers' dynamic cache makes them (:func:`growing_cases`), against
  SDPA (flash, efficient; cuDNN sets itself up again for every new length);
* ``fp8 func d128`` / ``fp8 func d256`` -- ``flash_attn_fp8_func`` at (1, 128, 8, d), flashtile
  and flashtile_ordinary (the ``tl.*`` kernel at d = 128; on Hopper the Gluon one at d = 256).

Then a cProfile of the flashtile append step.  Records go to ``--out`` (a folder; the
committed results: ``--out benchmarks/results``) as ``decode_host.jsonl``.

    python benchmarks/profile_decode_host.py --out "$OUT"
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
import types
from pathlib import Path

import torch

import flashtile
from flashtile.bench.common import environment, write_jsonl


def per_call_us(fn, calls=250, rounds=8, warmup=50):
    """Host microseconds per call: the median over ``rounds`` of ``calls`` calls issued back to
    back from an idle GPU, each round followed by one sync.  A round stays below the launch
    queue's depth (about a thousand pending kernels), so a host that issues faster than the GPU
    runs never waits for a free slot: the time is the host's, not the GPU's."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return sorted(times)[len(times) // 2]


class ordinary_launches:
    """Every Triton launch through ``kernel[grid](...)`` inside the block (the launch layer's
    interpreter rule, which makes it dispatch the ordinary way)."""

    def __enter__(self):
        from flashtile.kernels import launch

        self.launch, self.saved = launch, launch.INTERPRET
        launch.INTERPRET = True

    def __exit__(self, *exc):
        self.launch.INTERPRET = self.saved


def decode_inputs(batch, cache, nheads, nheads_k, d, dtype, device="cuda"):
    """One decode step's tensors: q, the contiguous cache and its paged16 copy, one new key."""
    from flashtile.bench.decode import _paged

    q = torch.randn(batch, 1, nheads, d, device=device, dtype=dtype)
    kc = torch.randn(batch, cache, nheads_k, d, device=device, dtype=dtype)
    vc = torch.randn_like(kc)
    knew, vnew = (torch.randn(batch, 1, nheads_k, d, device=device, dtype=dtype) for _ in range(2))
    kp, vp, table = _paged(kc, vc, 16, torch.Generator().manual_seed(0))
    length = cache - 1  # room for the appended key
    lengths = torch.full((batch,), length, dtype=torch.int32, device=device)
    # Rotary tables over every position of the cache (rotary dim = d, as Llama's).
    angles = torch.arange(cache, dtype=torch.float32)[:, None] * torch.rand(d // 2)[None, :]
    cos, sin = angles.cos().to(device), angles.sin().to(device)
    return types.SimpleNamespace(q=q, kc=kc, vc=vc, knew=knew, vnew=vnew, kp=kp, vp=vp, table=table,
                                 length=length, lengths=lengths, cos=cos, sin=sin)


def flashtile_decode_cases(x):
    """``(record fields, fn)`` for flashtile's decode calls on ``decode_inputs``' tensors:
    contiguous / paged16, with / without an appended key (and with the append, the rotary
    of q and the new key: ``kvcache+append+rotary``), int / tensor lengths."""
    for layout in ("contiguous", "paged16"):
        k_cache, v_cache, bt = (x.kc, x.vc, None) if layout == "contiguous" else (x.kp, x.vp, x.table)
        for mode in ("kvcache", "kvcache+append", "kvcache+append+rotary"):
            for seqlens in (x.length, x.lengths):
                new = (x.knew, x.vnew) if mode != "kvcache" else (None, None)
                rotary = dict(rotary_cos=x.cos, rotary_sin=x.sin) if mode.endswith("rotary") else {}

                def fn(k_cache=k_cache, v_cache=v_cache, bt=bt, new=new, seqlens=seqlens, rotary=rotary):
                    return flashtile.flash_attn_with_kvcache(x.q, k_cache, v_cache, *new, cache_seqlens=seqlens,
                                                             block_table=bt, **rotary)

                yield dict(mode=mode, layout=layout, lengths="int" if isinstance(seqlens, int) else "tensor"), fn


def kvcache_cases(batch, cache, nheads, nheads_k, d, dtype):
    """``(record fields, fn)`` for every decode case."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    x = decode_inputs(batch, cache, nheads, nheads_k, d, dtype)
    q, kc, vc, knew, vnew, length = x.q, x.kc, x.vc, x.knew, x.vnew, x.length
    for fields, fn in flashtile_decode_cases(x):
        yield dict(fields, impl="flashtile"), fn

        def ordinary(fn=fn):
            with ordinary_launches():
                return fn()

        yield dict(fields, impl="flashtile_ordinary"), ordinary
    qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)
    for impl, backend in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
        for append in (False, True):
            def sdpa(backend=backend, append=append):
                if append:
                    kc[:, length:length + 1] = knew
                    vc[:, length:length + 1] = vnew
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)

            yield dict(mode="kvcache+append" if append else "kvcache", layout="contiguous", lengths="none",
                       impl=impl), sdpa


def func_cases(batch, seqlen, nheads, d, dtype):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (torch.randn(batch, seqlen, nheads, d, device="cuda", dtype=dtype) for _ in range(3))
    yield dict(impl="flashtile"), lambda: flashtile.flash_attn_func(q, k, v)

    def ordinary():
        with ordinary_launches():
            return flashtile.flash_attn_func(q, k, v)

    yield dict(impl="flashtile_ordinary"), ordinary
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    for impl, backend in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
        def sdpa(backend=backend):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(qt, kt, vt)

        yield dict(impl=impl), sdpa


def fp8_cases(batch, seqlen, nheads, d):
    """``flash_attn_fp8_func`` on e4m3 inputs of this shape (per-tensor descales): its launch plans
    (``flashtile``) against every launch through ``kernel[grid]`` (``flashtile_ordinary``)."""
    from flashtile.fp8 import flash_attn_fp8_func

    q, k, v = (torch.randn(batch, seqlen, nheads, d, device="cuda").to(torch.float8_e4m3fn) for _ in range(3))
    one = torch.ones(1, device="cuda")
    yield dict(impl="flashtile"), lambda: flash_attn_fp8_func(q, k, v, one, one, one)

    def ordinary():
        with ordinary_launches():
            return flash_attn_fp8_func(q, k, v, one, one, one)

    yield dict(impl="flashtile_ordinary"), ordinary


def growing_cases(layers=8, start=4096, nheads=16, nheads_k=4, d=128, dtype=torch.bfloat16):
    """``(record fields, fn)`` for a decode step as transformers' dynamic cache makes it: one
    query row against keys and values one longer every ``layers`` calls (the layers of a step
    share the length: ``flashtile.bench.decode.growing_cache_views``); causal.  Each impl grows
    its own cache from ``start``."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashtile.bench.decode import growing_cache_views

    q = torch.randn(1, 1, nheads, d, device="cuda", dtype=dtype)
    storage = torch.randn(2, nheads_k * (start + 20000) * d, device="cuda", dtype=dtype)

    def stepper(attend):
        next_kv = growing_cache_views(storage, start, layers, nheads_k, d)
        return lambda: attend(*next_kv())

    fields = dict(batch=1, nheads=nheads, nheads_k=nheads_k, seqlen_q=1, seqlen_k=start, headdim=d,
                  mode="func growing", layout="dense", lengths="none")
    yield dict(fields, impl="flashtile"), stepper(lambda k, v: flashtile.flash_attn_func(q, k, v, causal=True))
    qt = q.transpose(1, 2)
    for impl, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_efficient", SDPBackend.EFFICIENT_ATTENTION)):
        def sdpa(k, v, backend=backend):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(qt, k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True)

        yield dict(fields, impl=impl), stepper(sdpa)


def plot(records, path):
    """Host microseconds per call, one bar per case, flashtile's bars beside the peers'."""
    from flashtile.bench.common import plot_host_us

    rows = [r for r in records if r.get("us") is not None]
    labels = [f"{r['mode']} {r['layout']} {r['lengths']} {r['impl']}" for r in rows]
    colors = ["C0" if r["impl"] == "flashtile" else "C7" if r["impl"] == "flashtile_ordinary" else "C1" for r in rows]
    plot_host_us(labels, [r["us"] for r in rows], colors,
                 f"Host time per call: decode step (batch {rows[0]['batch']}, cache {rows[0]['seqlen_k']}) and a tiny "
                 f"flash_attn_func, {rows[0]['device']}", path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--calls", type=int, default=250,
                    help="calls per round (at most 2 launches each: under the launch queue's depth)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--out", default=None, help="folder for decode_host.jsonl (default: print only)")
    ap.add_argument("--no-profile", action="store_true", help="skip the cProfile of the append step")
    args = ap.parse_args()

    torch.manual_seed(0)
    dtype = torch.bfloat16
    env = environment("cuda")
    nheads, nheads_k, d = 32, 4, 128
    shape = dict(batch=args.batch, nheads=nheads, nheads_k=nheads_k, seqlen_q=1, seqlen_k=args.cache, headdim=d)
    records = []
    cases = [(dict(shape, **fields), fn) for fields, fn in kvcache_cases(args.batch, args.cache, nheads, nheads_k, d,
                                                                         dtype)]
    tiny = dict(batch=1, nheads=8, nheads_k=8, seqlen_q=128, seqlen_k=128, headdim=64)
    cases += [(dict(tiny, mode="func", layout="dense", lengths="none", **fields), fn)
              for fields, fn in func_cases(1, 128, 8, 64, dtype)]
    cases += list(growing_cases())
    # flash_attn_fp8_func at (1, 128, 8, d): the tl.* kernel at d = 128, on Hopper the Gluon one at d = 256.
    for fp8_d in (128, 256):
        cases += [(dict(tiny, headdim=fp8_d, mode=f"fp8 func d{fp8_d}", layout="dense", lengths="none", **fields), fn)
                  for fields, fn in fp8_cases(1, 128, 8, fp8_d)]
    print(f"{'mode':15s} {'layout':10s} {'lengths':7s} {'impl':20s} host us/call")
    for fields, fn in cases:
        try:
            us = per_call_us(fn, calls=args.calls, rounds=args.rounds)
        except Exception as e:  # noqa: BLE001 - a peer missing on this machine must not stop the rest
            print(f"{fields['mode']:15s} {fields['layout']:10s} {fields['lengths']:7s} {fields['impl']:20s} "
                  f"{type(e).__name__}: {str(e)[:120]}")
            records.append(dict(bench="decode_host", dtype="bfloat16", **fields, us=None,
                                skipped=f"{type(e).__name__}: {str(e)[:200]}", **env))
            continue
        print(f"{fields['mode']:15s} {fields['layout']:10s} {fields['lengths']:7s} {fields['impl']:20s} {us:8.1f}")
        records.append(dict(bench="decode_host", dtype="bfloat16", **fields, us=us, **env))
    if args.out:
        path = write_jsonl(Path(args.out) / "decode_host.jsonl", records)
        print(f"{len(records)} records appended to {path}")
        try:
            plot(records, Path(args.out) / "decode_host.png")
        except ImportError:
            print("matplotlib not installed: no plot")
    if not args.no_profile:
        fn = next(fn for fields, fn in cases if fields["impl"] == "flashtile" and fields["mode"] == "kvcache+append"
                  and fields["layout"] == "contiguous" and fields["lengths"] == "int")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(1000):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
        print(s.getvalue())


if __name__ == "__main__":
    main()
