"""CPU benchmark of what PyTorch's fused CPU attention kernel cannot compute, and of row softmax:
flashtile's CPU path against the PyTorch code a CPU user would write instead, side by side in one
process.

* ``bench = "cpu_features"``, attention (batch 1, 8 heads, d = 64, float32, ``fwd`` and
  ``fwd_bwd``, N = 1k and 4k), one ``case`` each:

  - ``plain``: no modification (flashtile runs PyTorch's fused kernel) against SDPA;
  - ``alibi``: ALiBi slopes against SDPA with the ALiBi bias as a float mask (its N x N per
    head, built once, outside the timing);
  - ``softcap``: ``softcap = 30`` against the naive ``cap * tanh(s / cap)``, softmax, ``P V``;
  - ``window``: causal with ``window_size = (256, 0)`` against SDPA with the band as a
    boolean mask.

  Scores in these cases reach far below their row's maximum (ALiBi's distant keys do by
  construction), which is where the tiled path's care for subnormal floats shows
  (``flashtile.cpu.numerics.exp2_flushed``).
* ``bench = "cpu_softmax"``: ``flashtile.softmax`` against ``torch.softmax`` on 4096 x 4096
  float32 rows, ``plain``, ``masked`` (a causal boolean mask; torch: ``masked_fill``, then
  softmax) and ``peaked`` (the rows times 40), ``fwd`` and ``fwd_bwd``.

Each record: ``bench``, ``impl`` (``flashtile`` or the peer's name), ``case``, ``mode``,
``dtype``, the shape, ``ms`` (median of repeats), ``other_cpu_load`` (see
:class:`~flashtile.bench.common.OtherCpuLoad`) and the environment.

    python -m flashtile.bench.cpu_features [--out DIR] [--seqlens 1024 4096]
"""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from flashtile.bench.common import OtherCpuLoad, default_out_dir, environment, save_figure, save_records, subplots

NHEADS, HEADDIM = 8, 64
SOFTCAP = 30.0
WINDOW = 256
SOFTMAX_SHAPE = (4096, 4096)


def _median_ms(fn, target_s: float = 1.0, max_repeats: int = 10) -> float:
    """Median wall time of ``fn()`` after one untimed call; about ``target_s`` of repeats."""
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    repeats = max(2, min(max_repeats, math.ceil(target_s / max(first, 1e-6))))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _bhsd(x):
    return x.transpose(1, 2)


def attention_calls(case: str, n: int):
    """``{impl: fn(q, k, v) -> out}`` of one attention case at length ``n`` (flash-attn layout
    in and out; the peers transpose to SDPA's and back, as a user would)."""
    import flashtile

    scale = HEADDIM ** -0.5
    i = torch.arange(n)
    if case == "plain":
        return {"flashtile": lambda q, k, v: flashtile.flash_attn_func(q, k, v),
                "sdpa": lambda q, k, v: _bhsd(F.scaled_dot_product_attention(_bhsd(q), _bhsd(k), _bhsd(v)))}
    if case == "alibi":
        slopes = 2.0 ** (-8.0 * torch.arange(1, NHEADS + 1) / NHEADS)
        bias = -(slopes[:, None, None] * (i[:, None] - i[None, :]).abs()).unsqueeze(0)
        return {"flashtile": lambda q, k, v: flashtile.flash_attn_func(q, k, v, alibi_slopes=slopes),
                "sdpa_bias": lambda q, k, v: _bhsd(F.scaled_dot_product_attention(_bhsd(q), _bhsd(k), _bhsd(v),
                                                                                  attn_mask=bias))}
    if case == "softcap":
        def naive(q, k, v):
            s = torch.matmul(_bhsd(q), _bhsd(k).transpose(-1, -2)) * scale
            p = torch.softmax(SOFTCAP * torch.tanh(s / SOFTCAP), dim=-1)
            return _bhsd(torch.matmul(p, _bhsd(v)))

        return {"flashtile": lambda q, k, v: flashtile.flash_attn_func(q, k, v, softcap=SOFTCAP), "naive": naive}
    if case == "window":
        band = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] <= WINDOW)
        return {"flashtile": lambda q, k, v: flashtile.flash_attn_func(q, k, v, causal=True, window_size=(WINDOW, 0)),
                "sdpa_mask": lambda q, k, v: _bhsd(F.scaled_dot_product_attention(_bhsd(q), _bhsd(k), _bhsd(v),
                                                                                  attn_mask=band))}
    raise ValueError(f"unknown attention case {case!r}")


def softmax_calls(case: str, shape=SOFTMAX_SHAPE):
    """``(x, {impl: fn(x) -> y})`` of one softmax case on ``shape`` rows."""
    import flashtile

    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    plain = {"flashtile": lambda t: flashtile.softmax(t, dim=-1), "torch": lambda t: torch.softmax(t, dim=-1)}
    if case == "plain":
        return x, plain
    if case == "peaked":
        return x * 40, plain
    if case == "masked":
        keep = torch.ones(shape, dtype=torch.bool).tril()
        return x, {"flashtile": lambda t: flashtile.softmax(t, dim=-1, mask=keep),
                   "torch": lambda t: torch.softmax(t.masked_fill(~keep, float("-inf")), dim=-1)}
    raise ValueError(f"unknown softmax case {case!r}")


def _timed(fn, inputs, mode):
    """Median ms of ``fn(*inputs)`` (``fwd``: under no_grad) or of it and its backward."""
    if mode == "fwd":
        def call():
            with torch.no_grad():
                fn(*inputs)
    else:
        leaves = [t.detach().requires_grad_() for t in inputs]
        grad = None

        def call():
            nonlocal grad
            out = fn(*leaves)
            if grad is None:
                grad = torch.randn_like(out)
            out.backward(grad)
            for t in leaves:
                t.grad = None
    with OtherCpuLoad() as load:
        ms = _median_ms(call)
    return ms, load.fraction


def _entries(seqlens, modes):
    """``(fields, fn, inputs, mode)`` of every timed call."""
    gen = torch.Generator().manual_seed(0)
    for n in seqlens:
        q, k, v = (torch.randn(1, n, NHEADS, HEADDIM, generator=gen) for _ in range(3))
        for case in ("plain", "alibi", "softcap", "window"):
            for impl, fn in attention_calls(case, n).items():
                for mode in modes:
                    fields = dict(bench="cpu_features", impl=impl, case=case, mode=mode, dtype="float32", batch=1,
                                  nheads=NHEADS, nheads_k=NHEADS, seqlen_q=n, seqlen_k=n, headdim=HEADDIM)
                    yield fields, fn, (q, k, v), mode
    for case in ("plain", "masked", "peaked"):
        x, calls = softmax_calls(case)
        for impl, fn in calls.items():
            for mode in modes:
                fields = dict(bench="cpu_softmax", impl=impl, case=case, mode=mode, dtype="float32",
                              rows=SOFTMAX_SHAPE[0], cols=SOFTMAX_SHAPE[1])
                yield fields, fn, (x,), mode


def run(seqlens=(1024, 4096), modes=("fwd", "fwd_bwd"), rounds: int = 2) -> list[dict]:
    """Every call timed in ``rounds`` rounds (the first warms the process up), the best round's
    median kept."""
    env = environment("cpu")
    entries = list(_entries(seqlens, modes))
    best = [None] * len(entries)
    for _ in range(rounds):
        for e, (fields, fn, inputs, mode) in enumerate(entries):
            ms, load = _timed(fn, inputs, mode)
            if best[e] is None or ms < best[e][0]:
                best[e] = (ms, load)
    records = []
    for (fields, *_), (ms, load) in zip(entries, best):
        records.append(dict(fields, ms=ms, other_cpu_load=load, **env))
        shape = f"N={fields['seqlen_q']}" if "seqlen_q" in fields else f"{fields['rows']}x{fields['cols']}"
        print(f"{fields['bench']:12s} {shape:10s} {fields['case']:8s} {fields['impl']:10s} {fields['mode']:8s} "
              f"{ms:9.1f} ms")
    return records


def plot(records, path) -> None:
    """One panel per (bench, N): ms per case and mode, flashtile beside its peer."""
    panels = sorted({(r["bench"], r.get("seqlen_q", 0)) for r in records})
    fig, axes = subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, (bench, n) in zip(axes[0], panels):
        rows = [r for r in records if r["bench"] == bench and r.get("seqlen_q", 0) == n]
        groups = sorted({(r["case"], r["mode"]) for r in rows}, key=lambda g: (g[1], g[0]))
        for g, (case, mode) in enumerate(groups):
            pair = sorted((r for r in rows if (r["case"], r["mode"]) == (case, mode)),
                          key=lambda r: r["impl"] != "flashtile")
            for j, r in enumerate(pair):
                ax.bar(g + 0.4 * j - 0.2, r["ms"], width=0.38, color="tab:blue" if j == 0 else "tab:gray")
                ax.text(g + 0.4 * j - 0.2, r["ms"], r["impl"], rotation=90, fontsize=6, ha="center", va="bottom")
        ax.set_xticks(range(len(groups)), [f"{c}\n{m}" for c, m in groups], fontsize=6)
        ax.set_ylabel("ms (CPU, float32)")
        ax.set_yscale("log")
        ax.margins(y=0.25)
        ax.set_title(f"{bench}" + (f", N = {n}" if n else f", {SOFTMAX_SHAPE[0]} x {SOFTMAX_SHAPE[1]}"), fontsize=8)
    save_figure(fig, path)


def main(argv=None) -> int:
    """Time the CPU path's score modifications and row softmax against PyTorch, then write
    ``cpu_features.jsonl`` and its plot."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m flashtile.bench.cpu_features",
                                     description=main.__doc__.split(",")[0])
    parser.add_argument("--out", metavar="DIR", default=None, help="results folder (default: the per-user cache)")
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096])
    args = parser.parse_args(argv)
    out = Path(args.out) if args.out else default_out_dir()
    out.mkdir(parents=True, exist_ok=True)
    save_records(run(tuple(args.seqlens)), out / "cpu_features.jsonl", plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
