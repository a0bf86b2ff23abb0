"""``deterministic=True`` against the default backward on a CUDA GPU, in one process.

For each shape (bf16, ``batch * N = 16k``, ``heads * d = 2048``) times forward + backward with
``triton.testing.do_bench`` twice -- the default call and ``deterministic=True`` -- and reports
the ratio, with the engine each backward ran on; where the backward is the Gluon one, a third
time with its separate dQ pass on the other dQ kernel than ``engine.separate_dq_engine`` picks
(``flashtile_deterministic_gluon_dq``: the Gluon ``attention_bwd_dq``, or
``flashtile_deterministic_triton_dq``: the ``tl.*`` one), the measurement behind that rule's
threshold.  Then, at ``--repeat-shape``, runs the
deterministic forward + backward ``--repeats`` times on the same inputs and counts the
repeats whose dQ, dK or dV differ in any bit from the first (``differing``: 0 is the claim).
One JSON object a line (``--out``), and a plot beside it (the ``.png`` of the same name)::

    python benchmarks/bench_deterministic.py --out deterministic.jsonl
"""

from __future__ import annotations

import argparse

import torch

import flashtile
from flashtile.bench.common import (environment, save_figure, save_records, shape_sweep, standard_batch_heads,
                                    subplots)
from flashtile.bench.gpu import attention_flops, time_attention
from flashtile.kernels import engine
from flashtile.kernels.engine import backward_engine, short_masked_backward


def _fn(causal, deterministic):
    return lambda q, k, v: flashtile.flash_attn_func(q, k, v, causal=causal, deterministic=deterministic)


def _inputs(n, d, seed):
    batch, heads = standard_batch_heads(n, d)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(batch, n, heads, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3)]


def differing_repeats(n, d, causal, repeats) -> int:
    """How many of ``repeats`` deterministic forward + backward runs give gradients that differ
    in any bit from the first run's."""
    q, k, v = (t.requires_grad_(True) for t in _inputs(n, d, 0))
    dout = torch.randn_like(q)
    first, differing = None, 0
    for _ in range(repeats):
        flashtile.flash_attn_func(q, k, v, causal=causal, deterministic=True).backward(dout)
        grads = [t.grad.clone() for t in (q, k, v)]
        for t in (q, k, v):
            t.grad = None
        if first is None:
            first = grads
        elif any(not torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(first, grads)):
            differing += 1
    return differing


def plot(records, path) -> None:
    """TFLOP/s of the default and the deterministic forward + backward per shape, the ratio above each pair."""
    rows = [r for r in records if r["bench"] == "deterministic"]
    shapes = sorted({(r["headdim"], r["causal"], r["seqlen_q"]) for r in rows})
    by = {(r["headdim"], r["causal"], r["seqlen_q"], r["impl"]): r["tflops"] for r in rows}
    fig, ax = subplots(figsize=(max(6.0, 0.55 * len(shapes) + 2), 3.6))
    xs = range(len(shapes))
    for offset, impl, label in ((-0.2, "flashtile", "default"), (0.2, "flashtile_deterministic", "deterministic=True")):
        ax.bar([x + offset for x in xs], [by[(*s, impl)] for s in shapes], width=0.4, label=label)
    for x, s in zip(xs, shapes):
        ratio = by[(*s, "flashtile_deterministic")] / by[(*s, "flashtile")]
        ax.text(x, max(by[(*s, "flashtile")], by[(*s, "flashtile_deterministic")]), f"{ratio:.2f}", ha="center",
                va="bottom", fontsize=7)
    ax.set_xticks(list(xs), [f"d={d}\n{'causal' if c else 'full'}\nN={n}" for d, c, n in shapes], fontsize=7)
    ax.set_ylabel("fwd+bwd TFLOP/s")
    bitwise = [r for r in records if r["bench"] == "deterministic_bitwise"]
    note = f"; bitwise: {bitwise[-1]['differing']} of {bitwise[-1]['repeats'] - 1} repeats differ" if bitwise else ""
    ax.set_title(f"deterministic=True against the default backward (ratio above), bf16, {rows[0]['device']}\n"
                 f"batch x N = 16k, heads x d = 2048{note}", fontsize=8)
    ax.legend(fontsize=7, loc="lower right")
    ax.margins(y=0.12)
    save_figure(fig, path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--headdims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--causal", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--repeats", type=int, default=100)
    ap.add_argument("--repeat-shape", type=int, nargs=3, default=[4096, 128, 1], metavar=("N", "D", "CAUSAL"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    env = environment("cuda")
    records = []
    for d, causal, n in shape_sweep(args.headdims, args.causal, args.seqlens):
        q, k, v = _inputs(n, d, n)
        batch, heads = q.shape[0], q.shape[2]
        flops = attention_flops(batch, heads, n, n, d, causal, "fwd_bwd")
        ms = {det: time_attention(_fn(causal, det), "fwd_bwd", q, k, v) for det in (False, True)}
        rec = {"bench": "deterministic", "mode": "fwd_bwd", "dtype": "bfloat16", "batch": batch, "nheads": heads,
               "seqlen_q": n, "seqlen_k": n, "headdim": d, "causal": causal}
        for det in (False, True):
            records.append({**rec, "impl": "flashtile_deterministic" if det else "flashtile", "ms": ms[det],
                            "tflops": flops / (ms[det] * 1e-3) / 1e12,
                            "bwd_path": backward_engine(q, k, short=short_masked_backward(n, -1, 0 if causal else -1)),
                            **env})
        line = (f"d={d} causal={int(causal)} N={n:5d} default {flops / ms[False] / 1e9:6.1f} "
                f"({records[-2]['bwd_path']}), deterministic {flops / ms[True] / 1e9:6.1f} "
                f"({records[-1]['bwd_path']}) TFLOP/s, ratio {ms[False] / ms[True]:.3f}")
        if records[-1]["bwd_path"] == "gluon":
            # The other dQ kernel: the threshold moved to either side of this head dim.
            other = "triton" if engine.separate_dq_engine(q.shape[-1], True) == "gluon" else "gluon"
            saved = engine.GLUON_DQ_MIN_HEADDIM
            engine.GLUON_DQ_MIN_HEADDIM = 0 if other == "gluon" else q.shape[-1] + 1
            try:
                ms_dq = time_attention(_fn(causal, True), "fwd_bwd", q, k, v)
            finally:
                engine.GLUON_DQ_MIN_HEADDIM = saved
            records.append({**records[-1], "impl": f"flashtile_deterministic_{other}_dq", "ms": ms_dq,
                            "tflops": flops / (ms_dq * 1e-3) / 1e12})
            line += f"; with the {other} dQ pass {flops / ms_dq / 1e9:6.1f}, ratio {ms[False] / ms_dq:.3f}"
        print(line, flush=True)
    n, d, causal = args.repeat_shape
    differing = differing_repeats(n, d, bool(causal), args.repeats)
    print(f"bitwise: {differing} of {args.repeats - 1} repeats differ from the first (N={n}, d={d}, causal={causal})")
    records.append({"bench": "deterministic_bitwise", "impl": "flashtile_deterministic", "mode": "fwd_bwd",
                    "dtype": "bfloat16", "seqlen_q": n, "seqlen_k": n, "headdim": d, "causal": bool(causal),
                    "repeats": args.repeats, "differing": differing, **env})
    if args.out:
        save_records(records, args.out, plot)


if __name__ == "__main__":
    main()
