"""Accuracy of FP8 attention against a float64 reference: bf16 vs FP8 with and without the max offset.

At N = 4096, D = 128, batch 1, 8 heads (non-causal; ``--causal`` for the mask), RMSE and max
error of the output against float64 attention on the *original* fp32 inputs -- the error a
user sees, input quantisation included -- and, for FP8, also against float64 attention on
the dequantised inputs (``kernel_*``: the kernel's own error, P's rounding and the bf16
output).  Implementations:

* ``bf16`` -- ``flashtile.flash_attn_func`` on the inputs rounded to bf16;
* ``fp8_no_offset`` / ``fp8`` -- ``flash_attn_fp8_func`` with ``max_offset`` False / True,
  per-tensor descales (``quantize_fp8(x, "tensor")``);
* ``fp8_head`` -- the same with per-(batch, head) descales.

Inputs: ``gaussian`` (q, k, v ~ N(0, 1)); ``peaked_vmean``: q ~ N(0, 4) (scores spread ~2,
a moderately peaked softmax) and v ~ N(1, 1) -- where the max offset matters: without it
the probabilities below 2^-10 of a row's max round to 0 while the row sum keeps them, so
every output shrinks toward 0 by the lost mass, which shows wherever V has a common
component; ``outlier_x10`` / ``outlier_x100``: Gaussian with 4 channels of q and 4 channels
of k (each chosen at random, the same for every token and head) multiplied by 10 / 100 --
the outlier features of LLM activations that the FlashAttention-3 paper tests FP8 against.

``--granularity-study`` instead compares per-head with per-token-block (128 tokens) scales in
a float64 emulation of the FP8 forward (runs on a CPU; the measurement behind
``quantize_fp8``'s missing ``"block"`` mode, docs/fp8.md).

    python benchmarks/fp8_accuracy.py --out benchmarks/results      # GPU, ~20 s
    python benchmarks/fp8_accuracy.py --granularity-study --out /tmp  # CPU, ~2 min
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

DATA = ("gaussian", "peaked_vmean", "outlier_x10", "outlier_x100")
OUTLIER_CHANNELS = 4


def make_inputs(kind: str, batch: int, seqlen: int, nheads: int, headdim: int, seed: int = 0, device="cuda"):
    """fp32 q, k, v (batch, seqlen, nheads, headdim) of one of the DATA kinds."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, seqlen, nheads, headdim, generator=gen) for _ in range(3))
    if kind.startswith("outlier_x"):
        factor = float(kind.removeprefix("outlier_x"))
        q[..., torch.randperm(headdim, generator=gen)[:OUTLIER_CHANNELS]] *= factor
        k[..., torch.randperm(headdim, generator=gen)[:OUTLIER_CHANNELS]] *= factor
    elif kind == "peaked_vmean":
        q *= 2  # scores with standard deviation ~2: a moderately peaked softmax
        v += 1  # values with a common component, as real value vectors have
    elif kind != "gaussian":
        raise ValueError(f"unknown data kind {kind!r}; choose from {DATA}")
    return q.to(device), k.to(device), v.to(device)


def reference(q, k, v, causal: bool):
    """float64 attention, one head at a time (an N x N float64 score matrix per head)."""
    batch, seqlen_q, nheads, _ = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    group = nheads // nheads_k
    scale = q.shape[-1] ** -0.5
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    lse = torch.empty(batch, nheads, seqlen_q, dtype=torch.float64, device=q.device)
    if causal:
        i = torch.arange(seqlen_q, device=q.device)[:, None]
        j = torch.arange(seqlen_k, device=q.device)[None, :]
        hidden = j > i + seqlen_k - seqlen_q
    for b in range(batch):
        for h in range(nheads):
            s = (q[b, :, h].double() @ k[b, :, h // group].double().T) * scale
            if causal:
                s = s.masked_fill(hidden, float("-inf"))
            lse[b, h] = torch.logsumexp(s, dim=-1)
            out[b, :, h] = torch.softmax(s, dim=-1) @ v[b, :, h // group].double()
    return out, lse


def error_stats(out, ref, prefix=""):
    diff = out.double() - ref
    return {f"{prefix}rmse": diff.pow(2).mean().sqrt().item(),
            f"{prefix}max_abs": diff.abs().max().item(),
            f"{prefix}mean_err": diff.mean().item(),  # signed: the lost-mass shrinkage shows here
            f"{prefix}rel_rmse": (diff.pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()}


def dequantized(x8, descale, heads_per_descale=1):
    d = descale.double()
    if d.dim() == 2:
        d = d.repeat_interleave(heads_per_descale, dim=1)[:, None, :, None]
    return x8.double() * d


def run_gpu(data, batch, seqlen, nheads, headdim, causal):
    import flashtile
    from flashtile.bench.common import environment
    from flashtile.fp8 import flash_attn_fp8_func, quantize_fp8
    from flashtile.kernels.engine import forward_engine, fp8_forward_engine, short_masked

    env = environment("cuda")
    records = []
    for kind in data:
        q, k, v = make_inputs(kind, batch, seqlen, nheads, headdim)
        ref_out, ref_lse = reference(q, k, v, causal)
        base = {"bench": "fp8_accuracy", "data": kind, "batch": batch, "nheads": nheads, "seqlen": seqlen,
                "headdim": headdim, "causal": causal, "reference": "float64 on the fp32 inputs"}
        qb, kb, vb = (t.bfloat16() for t in (q, k, v))
        out, lse = flashtile.flash_attn_func(qb, kb, vb, causal=causal, return_lse=True)
        # Which engine ("gluon" or "triton") each row ran on (engine.py's choice).
        bf16_path = forward_engine(qb, kb, short=short_masked(seqlen, -1, 0 if causal else -1))
        records.append({**base, "impl": "bf16", "dtype": "bfloat16", "path": bf16_path, **error_stats(out, ref_out),
                        "lse_max_abs": (lse.double() - ref_lse).abs().max().item(), **env})
        for impl, granularity, offset in (("fp8_no_offset", "tensor", False), ("fp8", "tensor", True),
                                          ("fp8_head", "head", True)):
            (q8, qd), (k8, kd), (v8, vd) = (quantize_fp8(t, granularity) for t in (q, k, v))
            out, lse = flash_attn_fp8_func(q8, k8, v8, qd, kd, vd, causal=causal, return_lse=True, max_offset=offset)
            deq_out, _ = reference(dequantized(q8, qd), dequantized(k8, kd), dequantized(v8, vd), causal)
            records.append({**base, "impl": impl, "dtype": "float8_e4m3fn", "path": fp8_forward_engine(q8, causal),
                            "granularity": granularity,
                            "max_offset": offset, **error_stats(out, ref_out), **error_stats(out, deq_out, "kernel_"),
                            "lse_max_abs": (lse.double() - ref_lse).abs().max().item(), **env})
        for r in records[-4:]:
            kernel = (f" | kernel-only rmse {r['kernel_rmse']:.3e} max {r['kernel_max_abs']:.3e}"
                      if "kernel_rmse" in r else "")
            print(f"{r['data']:13s} {r['impl']:14s} rmse {r['rmse']:.3e} max {r['max_abs']:.3e} "
                  f"mean {r['mean_err']:+.1e} rel {r['rel_rmse']:.3e}{kernel} | lse max {r['lse_max_abs']:.2e}",
                  flush=True)
    return records


# --------------------------------------------------------------------------------------
# Scale granularity, emulated in float64 (CPU)
# --------------------------------------------------------------------------------------


def _quantize_emulated(x, granularity, block=128, gen=None):
    """x (b, n, h, d) float64 -> dequantised float64 after e4m3 rounding with one scale per group.

    ``head_jitter``: per-head scales enlarged by a random 0-15 %, a null control -- it moves
    every rounding point like a change of granularity does, without adapting to the data.
    """
    b, n, h, d = x.shape
    if granularity == "block":
        xb = x.reshape(b, n // block, block, h, d)
        descale = xb.abs().amax(dim=(2, 4), keepdim=True) / 448
        return ((xb / descale).clamp(-448, 448).to(torch.float8_e4m3fn).double() * descale).reshape(x.shape)
    descale = x.abs().amax(dim=(1, 3), keepdim=True) / 448  # per (batch, head)
    if granularity == "head_jitter":
        descale = descale * (1 + 0.15 * torch.rand(descale.shape, generator=gen, dtype=torch.float64))
    return (x / descale).clamp(-448, 448).to(torch.float8_e4m3fn).double() * descale


def _emulated_fp8_attention(q, k, v):
    """Non-causal FP8 attention in float64: P * 2^8 rounded to e4m3 (exact row max), fp32-free."""
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * (q.shape[-1] ** -0.5 * math.log2(math.e))
    p = torch.exp2(s - s.amax(dim=-1, keepdim=True) + 8)
    p_fp8 = p.to(torch.float8_e4m3fn).double()
    return torch.einsum("bhqk,bkhd->bqhd", p_fp8 / p.sum(dim=-1, keepdim=True), v)


def granularity_study(seeds=10, seqlen=1024, nheads=2, headdim=128):
    """RMSE of per-token-block scales (and of the jittered null control) relative to per-head scales."""
    import statistics

    records = []
    kinds = (*DATA, "outlier_tokens")
    for kind in kinds:
        ratios = {"block": [], "head_jitter": []}
        for seed in range(seeds):
            if kind == "outlier_tokens":
                # A few tokens (attention-sink like) 10x larger in k and 100x in v.
                q, k, v = make_inputs("gaussian", 1, seqlen, nheads, headdim, seed, device="cpu")
                tokens = torch.randperm(seqlen, generator=torch.Generator().manual_seed(seed))[:4]
                k[:, tokens] *= 10
                v[:, tokens] *= 100
            else:
                q, k, v = make_inputs(kind, 1, seqlen, nheads, headdim, seed, device="cpu")
            q, k, v = q.double(), k.double(), v.double()
            ref = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(
                torch.einsum("bqhd,bkhd->bhqk", q, k) * headdim ** -0.5, dim=-1), v)
            rmse = {}
            gen = torch.Generator().manual_seed(1000 + seed)
            for granularity in ("head", "block", "head_jitter"):
                out = _emulated_fp8_attention(*(_quantize_emulated(t, granularity, gen=gen) for t in (q, k, v)))
                rmse[granularity] = (out - ref).pow(2).mean().sqrt().item()
            for name, per_seed in ratios.items():
                per_seed.append(rmse[name] / rmse["head"])
            records.append({"bench": "fp8_scale_granularity", "data": kind, "seed": seed, "seqlen": seqlen,
                            "nheads": nheads, "headdim": headdim, "block_tokens": 128,
                            **{f"rmse_{g}": e for g, e in rmse.items()}})
        for name, r in ratios.items():
            print(f"{kind:15s} rmse({name}) / rmse(head): median {statistics.median(r):.3f} "
                  f"mean {statistics.mean(r):.3f} range {min(r):.2f}-{max(r):.2f} over {len(r)} seeds", flush=True)
    return records


def plot(records, path):
    """RMSE and mean error against the float64 reference, per input kind and implementation
    (log scale: the kinds' errors span orders of magnitude)."""
    from flashtile.bench.common import save_figure, subplots

    kinds = list(dict.fromkeys(r["data"] for r in records))
    impls = list(dict.fromkeys(r["impl"] for r in records))
    fig, axes = subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(impls)
    for ax, field, title in ((axes[0], "rmse", "RMSE vs float64"), (axes[1], "mean_err", "|mean error| vs float64")):
        for i, impl in enumerate(impls):
            by_kind = {r["data"]: abs(r[field]) for r in records if r["impl"] == impl}
            ax.bar([j + i * width for j in range(len(kinds))], [by_kind.get(k, 0.0) for k in kinds], width,
                   label=impl)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(kinds))], kinds)
        ax.set_yscale("log")
        ax.set_title(title)
    axes[0].legend()
    r0 = records[0]
    fig.suptitle(f"FP8 attention accuracy: batch {r0['batch']}, {r0['nheads']} heads, N = {r0['seqlen']}, "
                 f"d = {r0['headdim']}, {r0['device']}", fontsize=9)
    save_figure(fig, path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results", help="directory for fp8_accuracy.jsonl")
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--headdim", type=int, default=128)
    ap.add_argument("--nheads", type=int, default=8)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--data", nargs="+", default=list(DATA), choices=DATA)
    ap.add_argument("--granularity-study", action="store_true", help="CPU emulation: per-head vs per-block scales")
    ap.add_argument("--plot-only", action="store_true", help="redraw fp8_accuracy.png from the jsonl in --out")
    args = ap.parse_args()
    from flashtile.bench.common import environment, read_jsonl, write_jsonl

    if args.plot_only:
        plot(read_jsonl(Path(args.out) / "fp8_accuracy.jsonl"), Path(args.out) / "fp8_accuracy.png")
        return

    if args.granularity_study:
        env = environment("cpu")
        records = [{**r, **env} for r in granularity_study()]
        path = write_jsonl(Path(args.out) / "fp8_scale_granularity.jsonl", records)
    else:
        if not torch.cuda.is_available():
            sys.exit("fp8_accuracy.py runs the FP8 kernel on a CUDA GPU (--granularity-study runs on a CPU)")
        records = run_gpu(args.data, args.batch, args.seqlen, args.nheads, args.headdim, args.causal)
        path = write_jsonl(Path(args.out) / "fp8_accuracy.jsonl", records)
        try:
            plot(read_jsonl(path), Path(args.out) / "fp8_accuracy.png")
        except ImportError:
            print("matplotlib not installed: no plot")
    print(f"{len(records)} records appended to {path}")


if __name__ == "__main__":
    main()
