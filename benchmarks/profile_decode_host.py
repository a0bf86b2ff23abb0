"""Host (CPU) time of one eager decoding step, piece by piece (GPU machine only).

A decode step at batch 1 keeps the GPU busy for ~20 us, so whatever Python does per call
shows directly in eager latency.  This script times, per call, in a loop whose GPU work is
kept tiny (cache 1k) so the host is the bottleneck:
  the whole ``flash_attn_with_kvcache``; the argument checks; ``kernels.decode.decode`` (allocations
  and launches) with and without programmatic dependent launch; a bare ``torch.empty``; cuDNN SDPA for comparison;
then prints a cProfile of the whole call.  ``--out FILE`` appends JSON lines.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

import flashtile
from flashtile.bench.common import environment, write_jsonl


def per_call_us(fn, calls=3000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return host


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", type=int, default=1024)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import os

    from flashtile.kernels import decode as kd
    from flashtile.kvcache import _validate
    from flashtile.ops.validation import check_attention_scalars, check_qkv_agree

    torch.manual_seed(0)
    dev = "cuda"
    batch, nheads, nheads_k, d = 1, 32, 4, 128
    q = torch.randn(batch, 1, nheads, d, device=dev, dtype=torch.bfloat16)
    kc = torch.randn(batch, args.cache, nheads_k, d, device=dev, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    seqlens = torch.full((batch,), args.cache, dtype=torch.int32, device=dev)
    scale = d ** -0.5

    def no_pdl():
        os.environ[kd.TUNING_ENV] = "pdl=0"
        try:
            return kd.decode(q, kc, vc, seqlens, None, None, scale, -1, -1, 0.0, None, 0)
        finally:
            del os.environ[kd.TUNING_ENV]

    def checks():
        _validate(q, kc, vc, None, None, seqlens, None, None)
        check_qkv_agree(q, kc, vc, "k_cache", "v_cache")
        check_attention_scalars(d, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0)

    pieces = {
        "flash_attn_with_kvcache": lambda: flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens),
        "flash_attn_with_kvcache_int_len": lambda: flashtile.flash_attn_with_kvcache(q, kc, vc,
                                                                                      cache_seqlens=args.cache),
        "checks": checks,
        "decode": lambda: kd.decode(q, kc, vc, seqlens, None, None, scale, -1, -1, 0.0, None, 0),
        "decode_no_pdl": no_pdl,
        "torch_empty": lambda: torch.empty((16, 1, 1, 32, 128), device=dev, dtype=torch.float32),
        "sdpa_cudnn": None,
    }
    from torch.nn.attention import SDPBackend, sdpa_kernel
    qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
    pieces["sdpa_cudnn"] = cudnn

    env = environment()
    records = []
    for name, fn in pieces.items():
        try:
            us = per_call_us(fn)
        except Exception as e:  # a peer missing on this machine must not stop the rest
            print(f"{name}: {type(e).__name__}: {e}")
            continue
        print(f"{name:34s} {us:8.1f} us/call (host)")
        records.append(dict(bench="decode_host", impl=name, batch=batch, nheads=nheads, nheads_k=nheads_k,
                            seqlen_q=1, seqlen_k=args.cache, headdim=d, dtype="bfloat16", host_us=us, **env))
    prof = cProfile.Profile()
    fn = pieces["flash_attn_with_kvcache"]
    prof.enable()
    for _ in range(2000):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
    print(s.getvalue())
    if args.out:
        write_jsonl(args.out, records)


if __name__ == "__main__":
    main()
