"""The standard attention benchmark on a CUDA GPU, every implementation side by side in one process.

Shapes follow the FlashAttention papers: ``batch * seqlen = 16384`` and
``nheads * headdim = 2048``, headdim 64 / 128 / 256, seqlen 512 ... 16k, causal and not, bf16.
FLOPs: ``4 * batch * nheads * seqlen^2 * headdim`` forward (halved when causal), times 2.5
for the backward and 3.5 for forward + backward.  Timings are medians from
``triton.testing.do_bench`` (CUDA events).  Peers:

* ``flashtile`` -- this library (``flash_attn_func``), on the engine the dispatch rule picks
  (``flashtile/kernels/engine.py``: the Gluon kernels on Hopper, the ``tl.*`` kernels
  elsewhere); each of its records names that engine in ``path``;
* ``flashtile_triton`` -- the same call forced onto the portable ``tl.*`` kernels
  (``FLASHTILE_ENGINE=triton``), so both engines stand beside the peers;
* ``sdpa_flash`` / ``sdpa_cudnn`` / ``sdpa_efficient`` -- PyTorch SDPA pinned to one backend;
* ``flex`` -- FlexAttention under ``torch.compile`` (the recompile limit is raised, otherwise
  new shapes silently fall back to eager);
* ``naive`` -- ``softmax(q k^T) v`` materialising the scores, skipped when it would not fit.
"""

from __future__ import annotations

from pathlib import Path

import torch

from flashtile.bench.common import (compile_for_benchmark, default_out_dir, environ_set, environment, save_figure,
                                    save_results, standard_batch_heads, subplots)

SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
HEADDIMS = (64, 128, 256)
ALL_IMPLS = ("flashtile", "flashtile_triton", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "flex", "naive")
NAIVE_BYTES_LIMIT = 48 * 2**30
MEMORY_SEQLENS = (1024, 4096, 16384, 32768)


def attention_flops(batch, nheads, seqlen_q, seqlen_k, headdim, causal, mode) -> float:
    f = 4.0 * batch * nheads * seqlen_q * seqlen_k * headdim
    if causal:
        f /= 2
    return f * {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}[mode]


def impl_fn(impl: str, causal: bool, headdim: int):
    """Return ``f(q, k, v) -> out`` taking flash-attn layout (b, n, h, d) tensors (``impl`` one of
    ``ALL_IMPLS``; also used by the Hopper A/B and the IO measurement scripts)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if impl == "flashtile":
        import flashtile

        return lambda q, k, v: flashtile.flash_attn_func(q, k, v, causal=causal)
    if impl == "flashtile_triton":
        import flashtile

        def on_triton(q, k, v):
            with engine_for(impl):
                return flashtile.flash_attn_func(q, k, v, causal=causal)

        return on_triton
    if impl.startswith("sdpa_"):
        backend = {
            "sdpa_flash": SDPBackend.FLASH_ATTENTION,
            "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
            "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
        }[impl]

        def sdpa(q, k, v):
            with sdpa_kernel([backend]):
                o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
            return o.transpose(1, 2)

        return sdpa
    if impl == "flex":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        compiled = compile_for_benchmark(flex_attention)
        masks = {}

        def flex(q, k, v):
            b, n, h, _ = q.shape
            block_mask = None
            if causal:
                key = (n, k.shape[1])
                if key not in masks:
                    masks[key] = create_block_mask(lambda b_, h_, i, j: j <= i, None, None, n, k.shape[1], device=q.device)
                block_mask = masks[key]
            o = compiled(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=block_mask)
            return o.transpose(1, 2)

        return flex
    if impl == "naive":

        def naive(q, k, v):
            qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            s = (qh @ kh.transpose(-1, -2)) * (headdim ** -0.5)
            if causal:
                n, m = s.shape[-2:]
                keep = torch.ones(n, m, dtype=torch.bool, device=s.device).tril(m - n)
                s = s.masked_fill(~keep, float("-inf"))
            return (torch.softmax(s.float(), dim=-1).to(q.dtype) @ vh).transpose(1, 2)

        return naive
    raise ValueError(f"unknown implementation {impl!r}; choose from {', '.join(ALL_IMPLS)}")


# The benchmark implementations that force an engine (``FLASHTILE_ENGINE``) while they run.
FORCED_ENGINES = {"flashtile_triton": "triton", "flashtile_gluon": "gluon"}


def engine_for(impl: str):
    """A context manager: ``FLASHTILE_ENGINE`` set to ``impl``'s forced engine
    (``FORCED_ENGINES``; forward and backward alike) inside the block, nothing else for other
    implementations."""
    from flashtile.kernels.engine import ENGINE_ENV

    return environ_set(ENGINE_ENV, FORCED_ENGINES.get(impl))


def time_attention(fn, mode, q, k, v):
    """Median milliseconds of ``fn(q, k, v)`` (``mode`` "fwd") or of its forward + backward."""
    import triton

    if mode == "fwd":
        return triton.testing.do_bench(lambda: fn(q, k, v), warmup=5, rep=25, return_mode="median")
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    dout = torch.randn_like(q)

    def step():
        out = fn(q, k, v)
        out.backward(dout)

    return triton.testing.do_bench(step, warmup=5, rep=25, grad_to_none=[q, k, v], return_mode="median")


def _engine_field(impl, q, k, causal) -> dict:
    """``{"path": ..., "bwd_path": ...}`` for flashtile's records: which engine ("gluon" or
    "triton") the forward and the backward ran on."""
    if impl == "flashtile":
        from flashtile.kernels.engine import backward_engine, forward_engine, short_masked, short_masked_backward

        n, right = q.shape[1], 0 if causal else -1
        return {"path": forward_engine(q, k, short=short_masked(n, -1, right)),
                "bwd_path": backward_engine(q, k, short=short_masked_backward(n, -1, right))}
    if impl == "flashtile_triton":
        return {"path": "triton", "bwd_path": "triton"}
    return {}


def peak_extra_memory(impl, causal, batch, seqlen, nheads, headdim, dtype=torch.bfloat16) -> int:
    """Peak bytes allocated beyond q, k, v and dout during one forward + backward."""
    fn = impl_fn(impl, causal, headdim)
    q, k, v = (torch.randn(batch, seqlen, nheads, headdim, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    fn(q, k, v).backward(dout)  # warm-up / compile outside the measurement
    for t in (q, k, v):
        t.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn(q, k, v).backward(dout)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def run_gpu_benchmark(
    out_dir=None,
    compare=ALL_IMPLS,
    quick=False,
    seqlens=None,
    headdims=None,
    causals=(False, True),
    modes=("fwd", "fwd_bwd"),
    dtype=torch.bfloat16,
    memory_seqlens=MEMORY_SEQLENS,
    progress=True,
) -> list[dict]:
    """Run the benchmark, append records to ``out_dir/attention.jsonl`` (speed) and
    ``out_dir/attention_memory.jsonl`` (peak memory), and draw their plots."""
    from tqdm import tqdm
    out_dir = Path(default_out_dir() if out_dir is None else out_dir)

    compare = [c.replace("-", "_") for c in compare]  # accept sdpa-flash as well as sdpa_flash
    unknown = sorted(set(compare) - set(ALL_IMPLS))
    if unknown:
        raise ValueError(f"unknown implementation(s) {', '.join(unknown)}; choose from {', '.join(ALL_IMPLS)}")
    impls = ["flashtile"] + [i for i in compare if i != "flashtile"]
    seqlens = seqlens or ((1024, 4096, 16384) if quick else SEQLENS)
    headdims = headdims or ((128,) if quick else HEADDIMS)
    env = environment("cuda")
    records = []
    jobs = [(d, c, n, m, i) for d in headdims for c in causals for n in seqlens for m in modes for i in impls]
    bar = tqdm(jobs, disable=not progress, desc="attention")
    fns = {}
    try:
        for headdim, causal, seqlen, mode, impl in bar:
            bar.set_postfix_str(f"d={headdim} causal={int(causal)} n={seqlen} {mode} {impl}")
            batch, nheads = standard_batch_heads(seqlen, headdim)
            rec = dict(bench="attention", impl=impl, mode=mode, dtype=str(dtype).replace("torch.", ""), batch=batch,
                       nheads=nheads, nheads_k=nheads, seqlen_q=seqlen, seqlen_k=seqlen, headdim=headdim, causal=causal, **env)
            naive_bytes = batch * nheads * seqlen * seqlen * (2 + 4 + 2) * (3 if mode == "fwd_bwd" else 1)
            if impl == "naive" and naive_bytes > NAIVE_BYTES_LIMIT:
                records.append(dict(rec, ms=None, tflops=None, skipped="scores would not fit"))
                continue
            key = (impl, causal, headdim)
            if key not in fns:
                fns[key] = impl_fn(impl, causal, headdim)
            gen = torch.Generator(device="cuda").manual_seed(seqlen)
            q, k, v = (torch.randn(batch, seqlen, nheads, headdim, device="cuda", dtype=dtype, generator=gen) for _ in range(3))
            try:
                with engine_for(impl):
                    ms = time_attention(fns[key], mode, q, k, v)
            except Exception as e:  # noqa: BLE001 - a peer without support for a shape is recorded, not fatal
                records.append(dict(rec, ms=None, tflops=None, skipped=f"{type(e).__name__}: {str(e)[:200]}"))
                continue
            tflops = attention_flops(batch, nheads, seqlen, seqlen, headdim, causal, mode) / (ms * 1e-3) / 1e12
            records.append(dict(rec, ms=ms, tflops=tflops, **_engine_field(impl, q, k, causal)))
            del q, k, v
            torch.cuda.empty_cache()
    except KeyboardInterrupt:  # a run cut short (Ctrl-C, a time limit's SIGINT) keeps what it measured
        print(f"interrupted after {len(records)} of {len(jobs)} timings; saving those", flush=True)
        memory_seqlens = ()

    # Peak extra memory of one forward + backward against N (16 heads, d = 128), every peer;
    # naive attention only while its N x N scores fit.  Cut short, it keeps what it measured too.
    try:
        _measure_memory(records, impls, causals, memory_seqlens or (), dtype, env)
    except KeyboardInterrupt:
        print("memory measurement interrupted; saving what was measured", flush=True)

    # Speed and memory are two benchmarks: each its own .jsonl and plot.
    save_results([r for r in records if r["bench"] == "attention"], out_dir, "attention", print_table, plot)
    memory = [r for r in records if r["bench"] == "attention_memory"]
    if memory:
        save_results(memory, out_dir, "attention_memory", print_table, plot_memory)
    return records


def _measure_memory(records, impls, causals, memory_seqlens, dtype, env) -> None:
    """Append one ``attention_memory`` record per (N, implementation, causal) to ``records``."""
    for seqlen in memory_seqlens:
        for impl in impls:
            for causal in causals:
                nheads, headdim = 16, 128
                rec = dict(bench="attention_memory", impl=impl, mode="fwd_bwd", dtype=str(dtype).replace("torch.", ""),
                           batch=1, nheads=nheads, nheads_k=nheads, seqlen_q=seqlen, seqlen_k=seqlen,
                           headdim=headdim, causal=causal, **env)
                if impl == "naive" and nheads * seqlen * seqlen * (2 + 4 + 2) * 3 > NAIVE_BYTES_LIMIT:
                    records.append(dict(rec, peak_extra_bytes=None, skipped="scores would not fit"))
                    continue
                try:
                    with engine_for(impl):
                        peak = peak_extra_memory(impl, causal, 1, seqlen, nheads, headdim, dtype)
                    records.append(dict(rec, peak_extra_bytes=peak))
                except Exception as e:  # noqa: BLE001
                    records.append(dict(rec, peak_extra_bytes=None, skipped=f"{type(e).__name__}: {str(e)[:200]}"))
                torch.cuda.empty_cache()


def print_table(records) -> None:
    rows = [r for r in records if r["bench"] == "attention"]
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    print(f"\nTFLOP/s ({rows[0]['device'] if rows else ''})")
    print(f"{'d':>4} {'causal':>6} {'mode':>8} {'N':>6} " + " ".join(f"{i:>14}" for i in impls))
    keys = list(dict.fromkeys((r["headdim"], r["causal"], r["mode"], r["seqlen_q"]) for r in rows))
    for d, c, m, n in keys:
        vals = {r["impl"]: r.get("tflops") for r in rows if (r["headdim"], r["causal"], r["mode"], r["seqlen_q"]) == (d, c, m, n)}
        cells = " ".join(f"{vals[i]:>14.1f}" if vals.get(i) else f"{'-':>14}" for i in impls)
        print(f"{d:>4} {int(c):>6} {m:>8} {n:>6} {cells}")
    mem = [r for r in records if r["bench"] == "attention_memory"]
    if mem:
        print(f"\nPeak extra memory (MiB), fwd+bwd, batch 1, {mem[0]['nheads']} heads, d={mem[0]['headdim']}")
        for r in mem:
            b = r.get("peak_extra_bytes")
            cell = f"{b / 2**20:.1f} MiB" if b is not None else "-"
            print(f"  N={r['seqlen_q']:>6} {r['impl']:>14} causal={int(r['causal'])}: {cell}")


def plot(records, path) -> None:
    rows = [r for r in records if r["bench"] == "attention" and r.get("tflops")]
    panels = sorted({(r["mode"], r["headdim"], r["causal"]) for r in rows})
    modes = sorted({p[0] for p in panels}, reverse=True)
    cols = sorted({(p[1], p[2]) for p in panels})
    fig, axes = subplots(len(modes), len(cols), figsize=(3.6 * len(cols), 3.2 * len(modes)), squeeze=False)
    for i, mode in enumerate(modes):
        for j, (d, c) in enumerate(cols):
            ax = axes[i][j]
            for impl in dict.fromkeys(r["impl"] for r in rows):
                pts = sorted((r["seqlen_q"], r["tflops"]) for r in rows if (r["impl"], r["mode"], r["headdim"], r["causal"]) == (impl, mode, d, c))
                paths = sorted({r["path"] for r in rows if r["impl"] == impl and r.get("path")})
                label = f"{impl} ({'/'.join(paths)})" if paths else impl
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label,
                            lw=2.5 if impl == "flashtile" else 1.2)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{mode}, d={d}, {'causal' if c else 'non-causal'}", fontsize=9)
            ax.set_xlabel("sequence length")
            ax.set_ylabel("TFLOP/s")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    dev = rows[0]["device"] if rows else ""
    fig.suptitle(f"Attention, bf16, batch*seqlen=16k, nheads*headdim=2048 ({dev})", fontsize=10)
    save_figure(fig, path)


def plot_memory(records, path) -> None:
    """Peak extra bytes of one forward + backward against N, log-log, one line per peer."""
    rows = [r for r in records if r["bench"] == "attention_memory" and r.get("peak_extra_bytes")]
    causals = sorted({r["causal"] for r in rows})
    fig, axes = subplots(1, len(causals), figsize=(4.5 * len(causals), 3.6), squeeze=False)
    for ax, causal in zip(axes[0], causals):
        for impl in dict.fromkeys(r["impl"] for r in rows):
            pts = sorted((r["seqlen_q"], r["peak_extra_bytes"]) for r in rows if (r["impl"], r["causal"]) == (impl, causal))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] / 2**20 for p in pts], marker="o", label=impl,
                        lw=2.5 if impl == "flashtile" else 1.2)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"fwd+bwd peak extra memory, {'causal' if causal else 'non-causal'}", fontsize=9)
        ax.set_xlabel("sequence length")
        ax.set_ylabel("MiB beyond q, k, v, dout")
        ax.grid(alpha=0.3, which="both")
    axes[0][0].legend(fontsize=7)
    save_figure(fig, path)


def _cli():
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="results folder (default: ~/.cache/flashtile; the committed results: --out benchmarks/results)")
    ap.add_argument("--compare", default=",".join(ALL_IMPLS[1:]))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--headdims", type=int, nargs="+")
    ap.add_argument("--seqlens", type=int, nargs="+")
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--modes", nargs="+", default=["fwd", "fwd_bwd"], choices=["fwd", "bwd", "fwd_bwd"])
    args = ap.parse_args()
    run_gpu_benchmark(args.out, compare=[c for c in args.compare.split(",") if c], quick=args.quick,
                      headdims=args.headdims, seqlens=args.seqlens, modes=tuple(args.modes),
                      memory_seqlens=() if args.no_memory else MEMORY_SEQLENS)


if __name__ == "__main__":
    _cli()
