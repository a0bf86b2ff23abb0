"""A few query rows against many keys through ``flash_attn_func`` (CUDA GPU): the split-KV route.

Under ``auto`` engine selection a forward of at most ``engine.SPLIT_KV_MAX_SEQLEN_Q`` query
rows runs on the decode kernel of ``flash_attn_with_kvcache`` (``engine.split_kv_forward``);
a forced engine keeps its forward kernel.  For each shape (bf16, 32 query / 8 KV heads,
d = 128, not causal, so that SDPA's top-left causal alignment does not enter) this times, in
one process, with ``triton.testing.do_bench`` (median, GPU time):

* ``flashtile`` -- ``auto``: the split-KV decode kernel;
* ``flashtile_gluon`` / ``flashtile_triton`` -- ``FLASHTILE_ENGINE=gluon`` / ``triton``: the
  Gluon forward (Hopper) / the ``tl.*`` forward;
* ``sdpa_cudnn`` / ``sdpa_flash`` -- PyTorch SDPA pinned to one backend (``enable_gqa``).

``gbps``: the keys and values read (the bytes that bound such a call) per second.  Records
(``bench = "few_rows"``) go to ``--out``/few_rows.jsonl with a plot beside it::

    python benchmarks/bench_few_rows.py [--out DIR]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import triton

from flashtile.bench.common import default_out_dir, environment, save_figure, save_results, subplots
from flashtile.bench.gpu import engine_for

IMPLS = ("flashtile", "flashtile_gluon", "flashtile_triton", "sdpa_cudnn", "sdpa_flash")
NHEADS, NHEADS_K, HEADDIM = 32, 8, 128


def impl_fn(impl: str):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import flashtile

    if impl.startswith("flashtile"):
        def run(q, k, v):
            with engine_for(impl):
                return flashtile.flash_attn_func(q, k, v)

        return run
    backend = {"sdpa_cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa_flash": SDPBackend.FLASH_ATTENTION}[impl]

    def sdpa(q, k, v):
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  enable_gqa=True).transpose(1, 2)

    return sdpa


def run(batches, seqlens_q, seqlens_k) -> list[dict]:
    env = environment("cuda")
    records = []
    for batch in batches:
        for seqlen_k in seqlens_k:
            k, v = (torch.randn(batch, seqlen_k, NHEADS_K, HEADDIM, device="cuda", dtype=torch.bfloat16)
                    for _ in range(2))
            for seqlen_q in seqlens_q:
                q = torch.randn(batch, seqlen_q, NHEADS, HEADDIM, device="cuda", dtype=torch.bfloat16)
                try:  # the reference output; the errors are left out where no SDPA backend runs
                    ref = impl_fn("sdpa_flash")(q, k, v).float()
                except Exception:  # noqa: BLE001
                    ref = None
                row = {}
                for impl in IMPLS:
                    fn = impl_fn(impl)
                    try:
                        out = fn(q, k, v)
                        err = None if ref is None else (out.float() - ref).abs().max().item()
                        ms = triton.testing.do_bench(lambda: fn(q, k, v), warmup=10, rep=50, return_mode="median")
                    except Exception as e:  # noqa: BLE001 - a backend missing here must not stop the rest
                        print(f"{impl} b={batch} q={seqlen_q} k={seqlen_k}: {type(e).__name__}: {str(e)[:200]}")
                        continue
                    bytes_kv = 2 * k.numel() * k.element_size()
                    records.append({"bench": "few_rows", "impl": impl, "mode": "fwd", "dtype": "bfloat16",
                                    "batch": batch, "seqlen_q": seqlen_q, "seqlen_k": seqlen_k, "nheads": NHEADS,
                                    "nheads_k": NHEADS_K, "headdim": HEADDIM, "causal": False, "ms": ms,
                                    "gbps": bytes_kv / ms * 1e-6, "max_abs_err_vs_sdpa_flash": err, **env})
                    row[impl] = records[-1]["gbps"]
                print(f"b={batch:3d} q={seqlen_q:2d} k={seqlen_k:6d} "
                      + " ".join(f"{i}={g:7.0f}" for i, g in row.items()), flush=True)
    return records


def plot(records, path):
    shapes = sorted({(r["batch"], r["seqlen_q"], r["seqlen_k"]) for r in records})
    fig, ax = subplots(figsize=(max(6, 0.5 * len(shapes) + 2), 4))
    width = 0.8 / len(IMPLS)
    for n, impl in enumerate(IMPLS):
        by_shape = {(r["batch"], r["seqlen_q"], r["seqlen_k"]): r["gbps"] for r in records if r["impl"] == impl}
        xs = [i + n * width for i, s in enumerate(shapes) if s in by_shape]
        ax.bar(xs, [by_shape[s] for s in shapes if s in by_shape], width, label=impl)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(shapes))], [f"b{b} q{q} k{k // 1024}k" for b, q, k in shapes],
                  rotation=70, fontsize=7)
    ax.set_ylabel("K and V read, GB/s")
    ax.set_title(f"flash_attn_func with a few query rows, bf16, {NHEADS}/{NHEADS_K} heads, d = {HEADDIM}\n"
                 f"{records[0]['device']}", fontsize=9)
    ax.legend(fontsize=7)
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--seqlens-q", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--seqlens-k", type=int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--out", type=Path, default=None, help="results folder (committed: benchmarks/results)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_few_rows.py needs a CUDA GPU")
    # The rows were printed as they were measured: no table after them.
    save_results(run(args.batches, args.seqlens_q, args.seqlens_k), args.out or default_out_dir(), "few_rows",
                 lambda records: None, plot)

if __name__ == "__main__":
    main()
