"""A/B of the attention backward engines on a Hopper GPU, with cuDNN, in one process.

For each shape (bf16, ``batch * seqlen = 16k``, ``heads * d = 2048``) times forward +
backward with ``triton.testing.do_bench`` (the forward is the same Gluon forward for every
flashtile row):

* ``gluon`` -- the Gluon backward with its default tiles, and ``gluon:<config>`` variants
  (``--variants``: ``attention_bwd.config_from_spec`` specs, keywords joined by ``+``, e.g.
  ``num_stages=3``; ``dq:<spec>`` / ``wide:<spec>`` change the dQ pass's
  (``attention_bwd_dq``) or the wide-head dK / dV kernel's (``attention_bwd_wide``)
  configuration instead, and ``engine:<NAME>=<int>`` sets a threshold of
  ``flashtile.kernels.engine`` for the row, e.g. ``engine:SEPARATE_DQ_MAX_ROWS=0`` (dQ from the
  workspace on short masked calls too); default: the configurations in ``attention_bwd.ALTERNATIVES``);
* ``triton`` -- the ``tl.*`` dK/dV and dQ kernels;
* ``sdpa_cudnn`` -- PyTorch SDPA pinned to cuDNN.

Prints one line a shape and writes one JSON object a line (``--out``) and a plot beside it
(the ``.png`` of the same name)::

    python benchmarks/bench_hopper_bwd.py --variants num_stages=3 --out hopper_bwd.jsonl
"""

from __future__ import annotations

import argparse

import torch

from flashtile.bench.common import (environ_set, environment, save_figure, save_records, shape_sweep,
                                    standard_batch_heads, subplots)
from flashtile.bench.gpu import attention_flops, impl_fn, time_attention
from flashtile.kernels import engine
from flashtile.kernels.engine import ENGINE_ENV
from flashtile.kernels.hopper import attention_bwd, attention_bwd_dq, attention_bwd_wide, configured

# The kernel module whose ``config_for`` a variant's prefix changes (none: ``attention_bwd``).
VARIANT_MODULES = {"dq": attention_bwd_dq, "wide": attention_bwd_wide}


def _variant(variant):
    """``(module, spec)`` of a ``--variants`` entry."""
    prefix, _, spec = variant.rpartition(":")
    if prefix == "engine":
        return engine, spec
    return VARIANT_MODULES[prefix] if prefix else attention_bwd, spec


def _engine_values(spec: str) -> dict:
    """``{NAME: int}`` of an ``engine:`` variant's ``NAME=VALUE[+NAME=VALUE...]``; a name the
    engine module has no int of raises ``ValueError``."""
    values = {}
    for item in spec.split("+"):
        name, _, value = item.partition("=")
        if not isinstance(getattr(engine, name, None), int):
            raise ValueError(f"--variants engine:{spec}: flashtile.kernels.engine has no int {name!r}")
        values[name] = int(value)
    return values


def _timed(impl, variant, causal, q, k, v):
    """Milliseconds of forward + backward for one implementation (and Gluon variant)."""
    if impl == "sdpa_cudnn":
        return time_attention(impl_fn(impl, causal, q.shape[-1]), "fwd_bwd", q, k, v)
    module, spec = _variant(variant)
    thresholds = _engine_values(spec) if module is engine and spec else {}
    saved_cfg = getattr(module, "config_for", None)
    saved_thresholds = {name: getattr(engine, name) for name in thresholds}
    if spec and module is not engine:
        module.config_for = configured(saved_cfg, spec)
    for name, value in thresholds.items():
        setattr(engine, name, value)
    try:
        with environ_set(ENGINE_ENV, impl):
            if impl == "triton":  # the Gluon forward, the tl.* backward
                fwd = impl_fn("flashtile", causal, q.shape[-1])

                def fn(q_, k_, v_):
                    with environ_set(ENGINE_ENV, "gluon"):  # the backward reads "triton" again
                        return fwd(q_, k_, v_)

                return time_attention(fn, "fwd_bwd", q, k, v)
            return time_attention(impl_fn("flashtile", causal, q.shape[-1]), "fwd_bwd", q, k, v)
    finally:
        if module is not engine:
            module.config_for = saved_cfg
        for name, value in saved_thresholds.items():
            setattr(engine, name, value)


def plot(records, path) -> None:
    """Forward + backward TFLOP/s per shape, one bar per implementation (and Gluon variant) measured there."""
    rows = [r for r in records if r["bench"] == "hopper_bwd"]
    shapes = sorted({(r["headdim"], r["causal"], r["seqlen_q"]) for r in rows})
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    by = {(r["headdim"], r["causal"], r["seqlen_q"], r["impl"]): r["tflops"] for r in rows}
    colors = {impl: f"C{i}" for i, impl in enumerate(impls)}
    fig, ax = subplots(figsize=(max(6.0, 0.9 * len(shapes) + 2), 3.8))
    labelled = set()
    for x, shape in enumerate(shapes):
        here = [impl for impl in impls if (*shape, impl) in by]
        width = 0.8 / len(here)
        for i, impl in enumerate(here):
            ax.bar(x + (i - (len(here) - 1) / 2) * width, by[(*shape, impl)], width=width, color=colors[impl],
                   label=None if impl in labelled else impl)
            labelled.add(impl)
    ax.set_xticks(range(len(shapes)), [f"d={d}\n{'causal' if c else 'full'}\nN={n}" for d, c, n in shapes], fontsize=7)
    ax.set_ylabel("fwd+bwd TFLOP/s")
    ax.set_title(f"Hopper backward: the default Gluon configuration (gluon), its variants and peers, bf16, "
                 f"{rows[0]['device']}\nbatch x N = 16k, heads x d = 2048", fontsize=8)
    ax.legend(fontsize=7, loc="lower right")
    save_figure(fig, path)


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
        b, h = standard_batch_heads(n, d)
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
        save_records(records, args.out, plot)


if __name__ == "__main__":
    main()
