"""Greedy generation with a Hugging Face Llama: flashtile's attention backend against SDPA (CUDA GPU).

A randomly initialised Llama (no download; 8 layers, hidden 2048, 16 query / 4 KV heads of
d = 128, bf16) generates ``--new-tokens`` tokens greedily after a ``--prompt``-token prompt,
with ``attn_implementation="flashtile"`` (``flashtile``; on Hopper also ``flashtile_gluon``,
under ``FLASHTILE_ENGINE=gluon``: every attention call on the Gluon forward, decoding steps
included, where ``auto`` runs those on the split-KV decode kernel) and with ``"sdpa"``, in one
process.  Each generation is timed on the host with a synchronisation at both ends (the
eager ``generate()`` loop a user runs: prefill, then one forward per token through
transformers' dynamic KV cache), best of ``--repeats``, the implementations in turns, after
a warm-up generation of a few tokens from the same prompt.  ``tokens_as_sdpa`` counts the
leading generated tokens equal to SDPA's (bf16 rounding may flip a near-tie of the random
model's logits, after which the sequences differ; the exact token-for-token check against
eager attention is in tests/integrations).  Records (``bench = "generate"``) go to
``--out``/generate.jsonl with a plot beside it::

    python benchmarks/bench_generate.py [--prompt 4096] [--new-tokens 256] [--out DIR]

``--decode-tunings SPEC ...`` also times flashtile's model under ``FLASHTILE_DECODE_TUNING=SPEC``
(``flashtile[SPEC]``, in the same turns): the decode kernel's knobs in the loop they serve.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from flashtile.bench.common import (default_out_dir, environ_set, environment, save_figure, save_results,
                                    subplots)
from flashtile.bench.gpu import engine_for

# flashtile_gluon forces the Gluon forward at every call, decoding steps included (``auto`` runs
# those on the split-KV decode kernel, see flashtile.kernels.engine.split_kv_forward).
IMPLS = ("flashtile", "flashtile_gluon", "sdpa")
DEVICE = "cuda"


def model_for(impl: str, seed: int = 0):
    import transformers

    import flashtile.integrations.transformers  # noqa: F401  (registers "flashtile")

    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                                      num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
                                      max_position_embeddings=16384, pad_token_id=0)
    torch.manual_seed(seed)  # the same weights for every implementation
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=impl.split("_")[0])
    return model.to(device=DEVICE, dtype=torch.bfloat16).eval()


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def timed_generate(model, ids, new_tokens: int):
    sync()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    sync()
    return out[:, ids.shape[1]:], (time.perf_counter() - t0) * 1e3


def decode_tuning(spec: str):
    """A context manager: ``FLASHTILE_DECODE_TUNING`` set to ``spec`` inside the block (read at
    every call); nothing for ``""``."""
    from flashtile.kernels.decode import TUNING_ENV

    return environ_set(TUNING_ENV, spec or None)


def run(prompt: int, new_tokens: int, repeats: int, decode_tunings=()) -> list[dict]:
    ids = torch.randint(1, 32000, (1, prompt), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    impls = [impl for impl in IMPLS
             if impl != "flashtile_gluon" or torch.cuda.get_device_capability() == (9, 0)]  # Gluon: Hopper only
    models = {impl: model_for(impl) for impl in impls}
    # (name, model's implementation, decode knobs): each --decode-tunings spec on flashtile's model.
    runs = [(impl, impl, "") for impl in impls] + [(f"flashtile[{spec}]", "flashtile", spec) for spec in decode_tunings]

    def generate(impl, spec, tokens):
        with engine_for(impl), decode_tuning(spec):
            return timed_generate(models[impl], ids, tokens)

    for _, impl, spec in runs:  # compile the kernels at the prompt's shapes, warm the allocator
        generate(impl, spec, 8)
    results = {name: (None, float("inf"), spec) for name, _, spec in runs}
    # In turns: the loop is bound by the host's Python, whose speed moved by up to a quarter
    # between rounds a minute apart (docs/tuning.md), so each implementation's best is taken
    # across the same stretch of time.
    for _ in range(repeats):
        for name, impl, spec in runs:
            tokens, ms = generate(impl, spec, new_tokens)
            if ms < results[name][1]:
                results[name] = (tokens, ms, spec)
    env = environment(DEVICE)
    reference = results["sdpa"][0]
    records = []
    for impl, (tokens, ms, spec) in results.items():
        records.append({"bench": "generate", "impl": impl, "decode_tuning": spec, "mode": "generate",
                        "dtype": "bfloat16", "batch": 1,
                        "prompt": prompt, "new_tokens": new_tokens, "layers": 8, "nheads": 16, "nheads_k": 4,
                        "headdim": 128, "ms": ms, "tokens_per_s": new_tokens / ms * 1e3,
                        "tokens_as_sdpa": _common_prefix(tokens[0], reference[0]), **env})
    return records


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    differ = (a != b).nonzero()
    return int(differ[0, 0]) if len(differ) else len(a)


def plot(records, path):
    fig, ax = subplots(figsize=(5, 3.5))
    colors = {"flashtile": "C0", "flashtile_gluon": "C2", "sdpa": "C1"}
    ax.bar([r["impl"] for r in records], [r["tokens_per_s"] for r in records],
           color=[colors.get(r["impl"], "C3") for r in records])
    for i, r in enumerate(records):
        ax.text(i, r["tokens_per_s"], f"{r['tokens_per_s']:.0f}", ha="center", va="bottom")
    ax.set_ylabel("generated tokens / s (whole generate())")
    r0 = records[0]
    ax.set_title(f"Llama 8 x 2048, bf16, prompt {r0['prompt']}, {r0['new_tokens']} new tokens\n{r0['device']}",
                 fontsize=9)
    save_figure(fig, path)


def print_table(records):
    for r in records:
        print(f"{r['impl']:16s} {r['ms']:9.1f} ms  {r['tokens_per_s']:7.1f} tokens/s  "
              f"{r['tokens_as_sdpa']} leading tokens as SDPA's")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=4096)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-tunings", nargs="*", default=[], metavar="SPEC",
                        help="also time flashtile under FLASHTILE_DECODE_TUNING=SPEC, as flashtile[SPEC]")
    parser.add_argument("--out", type=Path, default=None, help="results folder (committed: benchmarks/results)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_generate.py needs a CUDA GPU")
    records = run(args.prompt, args.new_tokens, args.repeats, args.decode_tunings)
    save_results(records, args.out or default_out_dir(), "generate", print_table, plot)


if __name__ == "__main__":
    main()
