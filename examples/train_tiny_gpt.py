"""Train a tiny GPT whose attention is flashtile's, on a synthetic task, and plot the loss.

The task: each sequence is a random prefix of symbols followed by a separator and the same
prefix again, so the second half can only be predicted by attending back -- a model that
learns it is using its (causal) attention.  Runs on the CPU in a couple of minutes and on a
GPU much faster::

    python examples/train_tiny_gpt.py --steps 300

The loss plot goes to ``--out`` (default: tiny_gpt_loss.png in the per-user results folder,
``~/.cache/flashtile``); the committed ``examples/tiny_gpt_loss.png`` is that run with
``--out examples/tiny_gpt_loss.png``.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import flashtile
from flashtile.bench.common import default_out_dir


class Block(nn.Module):
    def __init__(self, dim: int, nheads: int):
        super().__init__()
        self.nheads = nheads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, n, dim = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, n, 3, self.nheads, dim // self.nheads)
        q, k, v = qkv.unbind(2)  # (b, n, heads, head_dim) views: flash-attn layout, no copy
        x = x + self.proj(flashtile.flash_attn_func(q, k, v, causal=True).reshape(b, n, dim))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, seqlen: int, dim: int = 64, nheads: int = 4, layers: int = 2):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seqlen, dim))
        self.blocks = nn.ModuleList(Block(dim, nheads) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def copy_task(batch: int, half: int, vocab: int, generator, device):
    prefix = torch.randint(1, vocab, (batch, half), generator=generator).to(device)
    sep = torch.zeros(batch, 1, dtype=torch.long, device=device)
    seq = torch.cat([prefix, sep, prefix], dim=1)
    return seq[:, :-1], seq[:, 1:]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--half", type=int, default=24, help="prefix length; sequences are 2 * half + 1 long")
    ap.add_argument("--vocab", type=int, default=16)
    ap.add_argument("--out", default=None,
                    help="loss plot (PNG; default: tiny_gpt_loss.png in $XDG_CACHE_HOME/flashtile, else ~/.cache/flashtile)")
    args = ap.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    model = TinyGPT(args.vocab, 2 * args.half).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses, copy_losses = [], []
    start = time.time()
    for step in range(args.steps):
        x, y = copy_task(args.batch, args.half, args.vocab, gen, device)
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, args.vocab), y.reshape(-1))
        # The copied half alone: only attention can predict it (chance: log(vocab - 1)).
        copy_loss = F.cross_entropy(logits[:, args.half:].reshape(-1, args.vocab), y[:, args.half:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        copy_losses.append(copy_loss.item())
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.3f}  copied half {copy_loss.item():.3f}  "
                  f"(chance {math.log(args.vocab - 1):.3f})  {time.time() - start:.0f}s", flush=True)

    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no loss plot (pip install matplotlib)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(losses, label="all tokens")
    ax.plot(copy_losses, label="copied half (needs attention)")
    ax.axhline(math.log(args.vocab - 1), color="k", ls="--", lw=1, label="chance")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy")
    ax.set_title(f"tiny GPT with flashtile attention ({device})", fontsize=10)
    ax.legend(fontsize=8)
    out = Path(args.out) if args.out is not None else default_out_dir() / "tiny_gpt_loss.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"loss curve: {out}")


if __name__ == "__main__":
    main()
