"""Training-feature benchmark on a CUDA GPU: packed varlen batches, sliding windows, dropout, softcap and ALiBi.

Four questions, each answered side by side in one process (bf16, D = 128, 16 heads):

* ``bench = "varlen"`` -- a packed batch of sequences with lengths drawn from 128 ... 8k
  (seeded) summing to 64k tokens: ``flashtile_varlen`` (one launch) against the same batch
  padded to its longest sequence through our dense kernel and SDPA-flash / cuDNN (which then
  compute on padding), and, for uniform lengths, varlen against our dense kernel at the same
  length (``flashtile_dense``).  TFLOP/s count useful work only:
  ``sum_b 4 * H * L_b^2 * D`` (halved when causal).
* ``bench = "window"`` -- causal sliding-window attention, ``window_size = (4096, 0)`` at
  N = 32k, against FlexAttention with the equivalent block mask.  FLOPs count the visible
  (query, key) pairs exactly.
* ``bench = "dropout"`` -- forward + backward with ``dropout_p = 0.1`` against 0.0, at
  batch * N = 16k; ``overhead`` = time ratio - 1.
* ``bench = "scoremods"`` -- a softcap (``softcap = 30``) or ALiBi slopes (``mods``), at
  batch * N = 16k: ``flashtile`` (the ``auto`` engine: the Gluon forward on Hopper, the
  ``tl.*`` backward), ``flashtile_triton`` (the ``tl.*`` kernels forced) and FlexAttention
  with the same score modification; ``flashtile_plain`` is the call without it.
"""

from __future__ import annotations

import random

import torch

from flashtile.bench.common import compile_for_benchmark, default_out_dir, environment, save_figure, save_results, subplots
from flashtile.bench.gpu import time_attention

NHEADS, HEADDIM = 16, 128


def _flops_pairs(pairs: int, nheads: int, headdim: int, mode: str) -> float:
    return 4.0 * pairs * nheads * headdim * {"fwd": 1.0, "fwd_bwd": 3.5}[mode]


def _pairs(lq: int, lk: int, causal: bool, left: int = -1) -> int:
    """Visible (query, key) pairs of one sequence under the bottom-right aligned band."""
    total = 0
    for i in range(lq):
        hi = i + lk - lq if causal else lk - 1
        lo = max(0, i + lk - lq - left) if left >= 0 else 0
        total += max(0, min(hi, lk - 1) - lo + 1)
    return total


def length_mix(total_tokens=65536, lo=128, hi=8192, seed=0) -> list[int]:
    """Sequence lengths drawn log-uniformly from [lo, hi], the last one trimmed to the total."""
    rng = random.Random(seed)
    lengths = []
    while sum(lengths) < total_tokens:
        lengths.append(int(round(2 ** rng.uniform(lo.bit_length() - 1, hi.bit_length() - 1))))
    lengths[-1] -= sum(lengths) - total_tokens
    return [n for n in lengths if n > 0]


def _varlen_records(env, lengths, causal, modes, label):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import flashtile

    dtype, dev = torch.bfloat16, "cuda"
    total, batch, longest = sum(lengths), len(lengths), max(lengths)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device=dev)
    q, k, v = (torch.randn(total, NHEADS, HEADDIM, device=dev, dtype=dtype) for _ in range(3))
    pairs = sum(_pairs(n, n, causal) for n in lengths)

    def varlen(q_, k_, v_):
        return flashtile.flash_attn_varlen_func(q_, k_, v_, cu, cu, longest, longest, causal=causal)

    def padded(impl):
        def run(q_, k_, v_):
            if impl == "flashtile_padded":
                return flashtile.flash_attn_func(q_, k_, v_, causal=causal)
            backend = {"sdpa_flash_padded": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn_padded": SDPBackend.CUDNN_ATTENTION}[impl]
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q_.transpose(1, 2), k_.transpose(1, 2), v_.transpose(1, 2),
                                                      is_causal=causal).transpose(1, 2)
        return run

    uniform = len(set(lengths)) == 1
    cases = [("flashtile_varlen", varlen, (q, k, v))]
    qp, kp, vp = (torch.zeros(batch, longest, NHEADS, HEADDIM, device=dev, dtype=dtype) for _ in range(3))
    for b, (s, n) in enumerate(zip(cu[:-1].tolist(), lengths)):
        qp[b, :n], kp[b, :n], vp[b, :n] = q[s:s + n], k[s:s + n], v[s:s + n]
    if uniform:
        cases.append(("flashtile_dense", padded("flashtile_padded"), (qp, kp, vp)))
    else:
        cases += [(i, padded(i), (qp, kp, vp)) for i in ("flashtile_padded", "sdpa_flash_padded", "sdpa_cudnn_padded")]
    records = []
    for mode in modes:
        for impl, fn, args in cases:
            rec = dict(bench="varlen", impl=impl, mode=mode, dtype="bfloat16", batch=batch, nheads=NHEADS, nheads_k=NHEADS,
                       seqlen_q=longest, seqlen_k=longest, headdim=HEADDIM, causal=causal, total_tokens=total,
                       lengths=label, **env)
            try:
                ms = time_attention(fn, mode, *args)
            except Exception as e:  # noqa: BLE001
                records.append(dict(rec, ms=None, tflops=None, skipped=f"{type(e).__name__}: {str(e)[:200]}"))
                continue
            records.append(dict(rec, ms=ms, tflops=_flops_pairs(pairs, NHEADS, HEADDIM, mode) / (ms * 1e-3) / 1e12))
    return records


def _window_records(env, seqlen, left, modes):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    import flashtile

    compiled = compile_for_benchmark(flex_attention)
    block_mask = create_block_mask(lambda b, h, i, j: (j <= i) & (i - j <= left), None, None, seqlen, seqlen, device="cuda")

    def ours(q, k, v):
        return flashtile.flash_attn_func(q, k, v, causal=True, window_size=(left, 0))

    def flex(q, k, v):
        return compiled(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=block_mask).transpose(1, 2)

    def dense_causal(q, k, v):
        return flashtile.flash_attn_func(q, k, v, causal=True)

    q, k, v = (torch.randn(1, seqlen, NHEADS, HEADDIM, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    pairs = _pairs(seqlen, seqlen, True, left)
    records = []
    for mode in modes:
        for impl, fn in (("flashtile", ours), ("flex", flex), ("flashtile_full_causal", dense_causal)):
            rec = dict(bench="window", impl=impl, mode=mode, dtype="bfloat16", batch=1, nheads=NHEADS, nheads_k=NHEADS,
                       seqlen_q=seqlen, seqlen_k=seqlen, headdim=HEADDIM, causal=True,
                       window_left=left if impl != "flashtile_full_causal" else -1, window_right=0, **env)
            try:
                ms = time_attention(fn, mode, q, k, v)
            except Exception as e:  # noqa: BLE001
                records.append(dict(rec, ms=None, tflops=None, skipped=f"{type(e).__name__}: {str(e)[:200]}"))
                continue
            # The full-causal row does more work; its TFLOP/s count its own pairs.
            p = pairs if impl != "flashtile_full_causal" else _pairs(seqlen, seqlen, True)
            records.append(dict(rec, ms=ms, tflops=_flops_pairs(p, NHEADS, HEADDIM, mode) / (ms * 1e-3) / 1e12))
    return records


def _dropout_records(env, seqlens):
    import flashtile

    records = []
    for seqlen in seqlens:
        batch = max(1, 16384 // seqlen)
        q, k, v = (torch.randn(batch, seqlen, NHEADS, HEADDIM, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for causal in (False, True):
            base = None
            for p in (0.0, 0.1):
                rec = dict(bench="dropout", impl="flashtile", mode="fwd_bwd", dtype="bfloat16", batch=batch, nheads=NHEADS,
                           nheads_k=NHEADS, seqlen_q=seqlen, seqlen_k=seqlen, headdim=HEADDIM, causal=causal,
                           dropout_p=p, **env)
                ms = time_attention(lambda q_, k_, v_: flashtile.flash_attn_func(q_, k_, v_, dropout_p=p, causal=causal), "fwd_bwd", q, k, v)
                base = ms if p == 0.0 else base
                pairs = batch * _pairs(seqlen, seqlen, causal) if causal else batch * seqlen * seqlen
                records.append(dict(rec, ms=ms, tflops=_flops_pairs(pairs, NHEADS, HEADDIM, "fwd_bwd") / (ms * 1e-3) / 1e12,
                                    overhead=ms / base - 1.0))
    return records


def _score_mod_records(env, seqlens, modes):
    from torch.nn.attention.flex_attention import flex_attention

    import flashtile
    from flashtile.bench.gpu import engine_for

    compiled = compile_for_benchmark(flex_attention)
    cap = 30.0
    slopes = 2.0 ** (-8.0 * torch.arange(1, NHEADS + 1, device="cuda") / NHEADS)  # ALiBi's geometric slopes

    def softcap_mod(score, b, h, i, j):
        return cap * torch.tanh(score / cap)

    records = []
    for seqlen in seqlens:
        batch = max(1, 16384 // seqlen)

        def alibi_mod(score, b, h, i, j):
            return score - slopes[h] * (i - j).abs()

        q, k, v = (torch.randn(batch, seqlen, NHEADS, HEADDIM, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for causal in (False, True):
            block_mask = _causal_block_mask(seqlen) if causal else None
            for mods, kw, score_mod in (("softcap", dict(softcap=cap), softcap_mod),
                                        ("alibi", dict(alibi_slopes=slopes), alibi_mod)):
                def ours(q_, k_, v_, kw=kw):
                    return flashtile.flash_attn_func(q_, k_, v_, causal=causal, **kw)

                def on_triton(q_, k_, v_, kw=kw):
                    with engine_for("flashtile_triton"):
                        return flashtile.flash_attn_func(q_, k_, v_, causal=causal, **kw)

                def plain(q_, k_, v_):
                    return flashtile.flash_attn_func(q_, k_, v_, causal=causal)

                def flex(q_, k_, v_, score_mod=score_mod, block_mask=block_mask):
                    return compiled(q_.transpose(1, 2), k_.transpose(1, 2), v_.transpose(1, 2), score_mod=score_mod,
                                    block_mask=block_mask).transpose(1, 2)

                for mode in modes:
                    for impl, fn in (("flashtile", ours), ("flashtile_triton", on_triton), ("flex", flex),
                                     ("flashtile_plain", plain)):
                        rec = dict(bench="scoremods", impl=impl, mode=mode, dtype="bfloat16", batch=batch,
                                   nheads=NHEADS, nheads_k=NHEADS, seqlen_q=seqlen, seqlen_k=seqlen, headdim=HEADDIM,
                                   causal=causal, mods=mods if impl != "flashtile_plain" else "none", **env)
                        try:
                            ms = time_attention(fn, mode, q, k, v)
                        except Exception as e:  # noqa: BLE001
                            records.append(dict(rec, ms=None, tflops=None, skipped=f"{type(e).__name__}: {str(e)[:200]}"))
                            continue
                        pairs = batch * (_pairs(seqlen, seqlen, True) if causal else seqlen * seqlen)
                        records.append(dict(rec, ms=ms,
                                            tflops=_flops_pairs(pairs, NHEADS, HEADDIM, mode) / (ms * 1e-3) / 1e12))
    return records


def _causal_block_mask(seqlen):
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(lambda b, h, i, j: j <= i, None, None, seqlen, seqlen, device="cuda")


def run_features_benchmark(out_dir=None, parts=("varlen", "window", "dropout", "scoremods"), progress=True):
    out_dir = default_out_dir() if out_dir is None else out_dir
    env = environment("cuda")
    records = []
    modes = ("fwd", "fwd_bwd")
    if "varlen" in parts:
        mix = length_mix()
        for causal in (False, True):
            records += _varlen_records(env, mix, causal, modes, f"mix of {len(mix)} in 128..8k (seed 0)")
            for n in (1024, 4096):
                records += _varlen_records(env, [n] * (65536 // n), causal, modes, f"{65536 // n} x {n}")
    if "window" in parts:
        records += _window_records(env, 32768, 4096, modes)
    if "dropout" in parts:
        records += _dropout_records(env, (2048, 8192))
    if "scoremods" in parts:
        records += _score_mod_records(env, (2048, 8192), modes)
    save_results(records, out_dir, "features", print_table, plot)
    return records


def print_table(records):
    for bench in dict.fromkeys(r["bench"] for r in records):
        print(f"\n{bench}: TFLOP/s (useful work), ms")
        for r in (r for r in records if r["bench"] == bench):
            extra = {"varlen": f"{r.get('lengths')}", "window": f"window {r.get('window_left')}",
                     "dropout": f"p={r.get('dropout_p')} overhead {r.get('overhead', 0):+.1%}",
                     "scoremods": f"{r.get('mods')}"}[bench]
            t = f"{r['tflops']:7.1f} {r['ms']:9.3f}" if r.get("tflops") else f"{'-':>7} {r.get('skipped', '')[:60]}"
            print(f"  {r['impl']:>22} {r['mode']:>8} causal={int(r['causal'])} N={r['seqlen_q']:>6} {t}  {extra}")


def plot(records, path):
    rows = [r for r in records if r.get("tflops")]
    groups = list(dict.fromkeys((r["bench"], r["mode"], r["causal"], r.get("lengths", "")) for r in rows))
    fig, ax = subplots(figsize=(10, 0.32 * len(rows) + 1.5))
    labels, vals = [], []
    for g in groups:
        for r in rows:
            if (r["bench"], r["mode"], r["causal"], r.get("lengths", "")) == g:
                extra = f" p={r['dropout_p']}" if r["bench"] == "dropout" else ""
                mods = f" {r['mods']}" if r["bench"] == "scoremods" else ""
                labels.append(f"{g[0]} {g[1]} c={int(g[2])} {g[3]}{mods} N={r['seqlen_q']} {r['impl']}{extra}")
                vals.append(r["tflops"])
    ax.barh(range(len(vals)), vals, color=["C0" if "flashtile" in s.split()[-1] or "p=" in s else "C1" for s in labels])
    ax.set_yticks(range(len(vals)), labels, fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("TFLOP/s (useful work)")
    ax.set_title(f"Training features, bf16, d={HEADDIM}, {NHEADS} heads ({rows[0]['device'] if rows else ''})", fontsize=9)
    ax.grid(alpha=0.3, axis="x")
    save_figure(fig, path)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="results folder (default: ~/.cache/flashtile; the committed results: --out benchmarks/results)")
    ap.add_argument("--parts", nargs="+", default=["varlen", "window", "dropout", "scoremods"])
    args = ap.parse_args()
    run_features_benchmark(args.out, parts=args.parts)
