"""One small Gluon forward per head dim against cuDNN, each in a fresh process-safe order: fails fast, never hangs silently."""
import sys
import time

import torch
import torch.nn.functional as F

from flashtile.kernels import attention as ka
from flashtile.kernels.hopper import attention_fwd as hopper

for d, n, causal in [(128, 256, False), (128, 1000, True), (64, 1000, False), (256, 777, True)]:
    q, k, v = (torch.randn(2, n, 4, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    t = time.time()
    out, lse = hopper.forward(ka.Layout(q, k), q, k, v, d ** -0.5, -1, 0 if causal else -1)
    torch.cuda.synchronize()
    ref = F.scaled_dot_product_attention(q.transpose(1, 2).float(), k.transpose(1, 2).float(), v.transpose(1, 2).float(),
                                         is_causal=causal).transpose(1, 2)
    print(f"d={d} n={n} causal={causal}: max err {(out.float() - ref).abs().max().item():.2e} "
          f"({time.time() - t:.1f} s incl. compile)", flush=True)
sys.exit(0)
