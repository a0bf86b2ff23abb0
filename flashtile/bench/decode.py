"""KV-cache decoding benchmark on a CUDA GPU: flashtile vs PyTorch's attention, side by side.

One new query row per sequence (``seqlen_q = 1``) against a full cache of ``cache`` keys,
D = 128, 32 query heads sharing 4 KV heads (GQA 8:1), bf16.  Decoding is memory-bound, so
the figure of merit is the bandwidth achieved on the bytes that *must* move: the K and V
cache (read once), plus q and the output -- ``gbps = bytes / time``.  A peer that expands
K/V to all query heads moves more than that but is credited only with those bytes: the
column then shows how close each implementation gets to the ideal decode step.  The ceiling
is the device-to-device copy rate measured in the same run (``impl = "copy"``).

Each case is timed twice: ``ms`` with ``triton.testing.do_bench`` (eager launches, includes
the host-side cost of the Python call when it exceeds the GPU time, as a serving loop
without graphs would see), and ``ms_graph`` with ``do_bench_cudagraph`` (the call captured
in a CUDA graph, as serving engines run decode steps: the GPU time alone).

Implementations (``impl``):
* ``flashtile`` -- ``flash_attn_with_kvcache`` on a contiguous cache, automatic split count;
* ``flashtile_paged16`` / ``flashtile_paged256`` -- the same cache paged with page size 16 / 256
  and a shuffled block table;
* ``flashtile_nosplit`` -- ``num_splits=1``: one program per (sequence, KV head), what
  split-KV is compared with;
* ``flashtile_prefill`` -- our prefill kernel (``flash_attn_func``) used for decoding;
* ``flashtile_append`` / ``flashtile_rotary_append`` -- a decoding step with its one-token
  append (the new key and value written at position ``cache - 1``, then attention over the
  whole cache), without / with the rotary embedding of q and the new key (``rotary_cos`` /
  ``rotary_sin`` over the whole head dim).  The appended rows are the cache's last rows and
  the tables are angle 0 (cos 1, sin 0), so every call rewrites the values already there and
  the cache, shared with the other peers, stays as it was; the work is that of any angle.
  Issue 24's bar: rotary + append within 10 % of the plain append at batch >= 8, cache >= 8k;
* ``sdpa_flash`` / ``sdpa_cudnn`` / ``sdpa_efficient`` / ``sdpa_math`` -- PyTorch SDPA pinned to
  one backend, ``enable_gqa=True``; when a backend refuses GQA, K/V are expanded to all heads
  once, outside the timing (``impl`` gets the suffix ``_expanded``);
* ``flex`` -- FlexAttention under ``torch.compile`` (its decoding kernel is chosen for short q).
"""

from __future__ import annotations

import torch

from pathlib import Path

from flashtile.bench.common import compile_for_benchmark, default_out_dir, environment, save_figure, subplots, write_jsonl

BATCHES = (1, 8, 32, 128)
CACHES = (1024, 8192, 32768, 131072)
MAX_TOKENS = 4 * 2**20  # batch * cache cap: 4M tokens = 8 GiB of bf16 K + V at 4 x 128
IMPLS = ("flashtile", "flashtile_paged16", "flashtile_paged256", "flashtile_nosplit", "flashtile_prefill",
         "flashtile_append", "flashtile_rotary_append", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "sdpa_math", "flex")


def _paged(k_cache: torch.Tensor, v_cache: torch.Tensor, page_size: int, generator: torch.Generator):
    """The contiguous caches (b, n, hk, d) cut into pages stored in one shuffled order, and
    the block table that finds them (the same for K and V)."""
    b, n, hk, d = k_cache.shape
    per_seq = n // page_size
    order = torch.randperm(b * per_seq, generator=generator).to(k_cache.device)
    pools = []
    for cache in (k_cache, v_cache):
        pool = torch.empty((b * per_seq, page_size, hk, d), dtype=cache.dtype, device=cache.device)
        pool[order] = cache.reshape(b * per_seq, page_size, hk, d)
        pools.append(pool)
    return pools[0], pools[1], order.view(b, per_seq).to(torch.int32)


def growing_cache_views(storage: torch.Tensor, start: int, layers: int, nheads_k: int, d: int):
    """A function that returns, call after call, ``(k, v)`` as transformers' dynamic cache
    makes them for a decoding loop: one longer every ``layers`` calls (the layers of a step
    share the length), starting at ``start``, seen as ``(1, nheads_k, n, d)`` tensors transposed
    to flash-attn's layout, so the length and two strides change every step.  Views over
    ``storage`` (``(2, nheads_k * longest * d)``) stand for the cache's fresh tensors."""
    state = {"call": 0}

    def next_kv():
        n = start + state["call"] // layers
        state["call"] += 1
        return tuple(storage[i, :nheads_k * n * d].as_strided((1, n, nheads_k, d), (nheads_k * n * d, d, n * d, 1))
                     for i in (0, 1))

    return next_kv


def _make_fn(impl, q, k_cache, v_cache, generator):
    """``f() -> out`` for one implementation, with its inputs prepared outside the timing."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import flashtile

    if impl == "flashtile":
        return lambda: flashtile.flash_attn_with_kvcache(q, k_cache, v_cache)
    if impl == "flashtile_nosplit":
        return lambda: flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, num_splits=1)
    if impl.startswith("flashtile_paged"):
        page = int(impl.removeprefix("flashtile_paged"))
        kp, vp, table = _paged(k_cache, v_cache, page, generator)
        return lambda: flashtile.flash_attn_with_kvcache(q, kp, vp, block_table=table)
    if impl == "flashtile_prefill":
        return lambda: flashtile.flash_attn_func(q, k_cache, v_cache)
    if impl in ("flashtile_append", "flashtile_rotary_append"):
        last = k_cache.shape[1] - 1
        k_new, v_new = k_cache[:, last:].clone(), v_cache[:, last:].clone()
        rotary = {}
        if impl == "flashtile_rotary_append":
            half = q.shape[-1] // 2
            rotary = dict(rotary_cos=torch.ones(last + 1, half, device=q.device, dtype=q.dtype),
                          rotary_sin=torch.zeros(last + 1, half, device=q.device, dtype=q.dtype))
        return lambda: flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=last,
                                                         **rotary)
    qh, kh, vh = q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    if impl.startswith("sdpa_"):
        backend = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
                   "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION, "sdpa_math": SDPBackend.MATH}[impl]

        def sdpa_gqa():
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(qh, kh, vh, enable_gqa=True).transpose(1, 2)

        try:
            sdpa_gqa()
            return sdpa_gqa
        except RuntimeError:
            group = q.shape[2] // k_cache.shape[2]
            ke, ve = kh.repeat_interleave(group, dim=1), vh.repeat_interleave(group, dim=1)

            def sdpa_expanded():
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(qh, ke, ve).transpose(1, 2)

            sdpa_expanded.expanded = True
            return sdpa_expanded
    if impl == "flex":
        from torch.nn.attention.flex_attention import flex_attention

        compiled = compile_for_benchmark(flex_attention)
        return lambda: compiled(qh, kh, vh, enable_gqa=True).transpose(1, 2)
    raise ValueError(f"unknown implementation {impl!r}; choose from {', '.join(IMPLS)}")


def run_decode_benchmark(out_dir=None, batches=BATCHES, caches=CACHES, impls=IMPLS,
                         nheads=32, nheads_k=4, headdim=128, dtype=torch.bfloat16, progress=True) -> list[dict]:
    import triton
    from tqdm import tqdm
    out_dir = Path(default_out_dir() if out_dir is None else out_dir)

    env = environment("cuda")
    elt = torch.finfo(dtype).bits // 8
    records = []
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=10, rep=50, return_mode="median")
    records.append(dict(bench="decode", impl="copy", mode="copy", dtype="uint8", ms=ms, gbps=2 * src.numel() / ms * 1e-6, **env))
    write_jsonl(Path(out_dir) / "decode.jsonl", records)
    src = dst = None
    gen = torch.Generator().manual_seed(0)
    cases = [(b, n) for b in batches for n in caches if b * n <= MAX_TOKENS]
    for batch, cache in tqdm(cases, disable=not progress, desc="decode"):
        q = torch.randn(batch, 1, nheads, headdim, device="cuda", dtype=dtype)
        k_cache = torch.randn(batch, cache, nheads_k, headdim, device="cuda", dtype=dtype)
        v_cache = torch.randn_like(k_cache)
        moved = (2 * k_cache.numel() + 2 * q.numel()) * elt
        reference = None
        first = len(records)
        for impl in impls:
            rec = dict(bench="decode", mode="fwd", dtype=str(dtype).replace("torch.", ""), batch=batch, nheads=nheads,
                       nheads_k=nheads_k, seqlen_q=1, seqlen_k=cache, headdim=headdim, causal=False, **env)
            if impl == "sdpa_math" and batch * cache > 2**20:
                # The math backend materialises K/V expanded to every query head (8x the cache).
                records.append(dict(rec, impl=impl, ms=None, gbps=None, skipped="expanded cache too large"))
                continue
            try:
                fn = _make_fn(impl, q, k_cache, v_cache, gen)
                name = impl + ("_expanded" if getattr(fn, "expanded", False) else "")
                out = fn()
                if reference is None:
                    reference = out.float()
                if out.shape != reference.shape:  # every peer returns flash-attn's (b, 1, h, d) layout
                    raise RuntimeError(f"{impl} returned shape {tuple(out.shape)}, expected {tuple(reference.shape)}")
                err = (out.float() - reference).abs().max().item()
                ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
                try:
                    ms_graph = triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
                except Exception:  # noqa: BLE001 - not every peer can be captured
                    ms_graph = None
            except Exception as e:  # noqa: BLE001 - recorded, not fatal
                records.append(dict(rec, impl=impl, ms=None, gbps=None, skipped=f"{type(e).__name__}: {str(e)[:200]}"))
                continue
            best = min(t for t in (ms, ms_graph) if t is not None)
            records.append(dict(rec, impl=name, ms=ms, ms_graph=ms_graph, gbps=moved / ms * 1e-6,
                                gbps_graph=moved / ms_graph * 1e-6 if ms_graph else None,
                                gbps_best=moved / best * 1e-6, max_abs_diff_vs_flashtile=err, bytes=moved))
            fn = out = None
            torch.cuda.empty_cache()
        write_jsonl(Path(out_dir) / "decode.jsonl", records[first:])
        q = k_cache = v_cache = reference = None
        torch.cuda.empty_cache()
    # Appended case by case (above), so a run cut short by a time limit keeps what it measured.
    print_table(records)
    print(f"{len(records)} records appended to {out_dir / 'decode.jsonl'}")
    try:
        plot(records, out_dir / "decode.png")
    except ImportError:
        print("matplotlib not installed: no plot")
    else:
        print(f"plot: {out_dir / 'decode.png'}")
    return records


def print_table(records):
    copy = next(r["gbps"] for r in records if r["impl"] == "copy")
    print(f"\ndecode (seqlen_q 1, bf16): GB/s on K/V + q + out bytes; eager / CUDA graph (copy {copy:.0f} GB/s)")
    impls = [i for i in dict.fromkeys(r["impl"] for r in records if r.get("gbps")) if i != "copy"]
    print(f"{'batch':>5} {'cache':>7} " + " ".join(f"{i[:17]:>17}" for i in impls))
    for batch, cache in dict.fromkeys((r["batch"], r["seqlen_k"]) for r in records if r["impl"] != "copy"):
        vals = {r["impl"]: r for r in records if r.get("batch") == batch and r.get("seqlen_k") == cache and r.get("gbps")}
        cells = []
        for i in impls:
            r = vals.get(i)
            cells.append(f"{r['gbps']:>8.0f}/{r['gbps_graph'] or 0:>8.0f}" if r else f"{'-':>17}")
        print(f"{batch:>5} {cache:>7} " + " ".join(cells))


def plot(records, path):
    copy = next(r["gbps"] for r in records if r["impl"] == "copy")
    batches = sorted({r["batch"] for r in records if r["impl"] != "copy"})
    fig, axes = subplots(1, len(batches), figsize=(4.2 * len(batches), 3.8), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        for impl in dict.fromkeys(r["impl"] for r in records if r["impl"] != "copy"):
            pts = sorted((r["seqlen_k"], r["gbps_best"]) for r in records
                         if r["impl"] == impl and r.get("batch") == batch and r.get("gbps_best"))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl,
                        lw=2.5 if impl == "flashtile" else 1.2)
        ax.axhline(copy, color="k", ls="--", lw=1, label="copy")
        ax.set_xscale("log", base=2)
        ax.set_title(f"decode, batch {batch}, GQA 32:4, d=128", fontsize=9)
        ax.set_xlabel("cache length")
        ax.set_ylabel("GB/s (best of eager / graph)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=6)
    save_figure(fig, path)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="results folder (default: ~/.cache/flashtile; the committed results: --out benchmarks/results)")
    ap.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    ap.add_argument("--caches", type=int, nargs="+", default=list(CACHES))
    ap.add_argument("--impls", nargs="+", default=list(IMPLS))
    args = ap.parse_args()
    run_decode_benchmark(args.out, batches=args.batches, caches=args.caches, impls=args.impls)
