"""One case of the CPU attention benchmark, measured: its inputs, its median time, and its
peak extra memory in this process or in a fresh interpreter (:func:`memory_isolated`).

``python -m flashtile.bench.cpu_measure JSON`` is that fresh interpreter: it measures the
cases of the JSON list and prints one result a line.
"""

from __future__ import annotations

import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time
from typing import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F

from flashtile.bench.common import format_bytes, peak_memory

IMPLS = ("flashtile", "naive", "sdpa")
MODES = ("fwd", "fwd_bwd")
CONTENDED = 0.1  # other processes' share of the cores above which a timing is flagged


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --------------------------------------------------------------------------------------------
# The implementations.  Inputs are in flash-attn's layout (batch, seqlen, heads, headdim);
# naive and sdpa get (batch, heads, seqlen, headdim) *views* of the same storage (no copy).
# --------------------------------------------------------------------------------------------


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """``softmax(q k^T * scale) v`` for ``(b, h, n, d)`` tensors, materialising the scores.

    Causal is aligned to the bottom right (query i sees key j iff j <= i + n_k - n_q), like
    flashtile.  Written to be fair to the naive approach: the scale is folded into q, the
    mask is applied in place, so the forward peaks at two N x N tensors (S and P).
    """
    s = torch.matmul(q * scale, k.transpose(-1, -2))
    if causal:
        n_q, n_k = s.shape[-2], s.shape[-1]
        mask = torch.ones(n_q, n_k, dtype=torch.bool, device=s.device).triu_(n_k - n_q + 1)
        s.masked_fill_(mask, float("-inf"))
        del mask
    p = torch.softmax(s, dim=-1)
    del s
    return torch.matmul(p, v)


def attention_call(impl: str, causal: bool) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """A function of (q, k, v) in flash layout returning the output (layout of the impl)."""
    if impl == "flashtile":
        from flashtile import flash_attn_func

        return lambda q, k, v: flash_attn_func(q, k, v, causal=causal)
    if impl == "naive":

        def run(q, k, v):
            return naive_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), q.shape[-1] ** -0.5, causal)

        return run
    if impl == "sdpa":

        def run(q, k, v):
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)

        return run
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


class Case:
    """Inputs for one measurement and the zero-argument call to time / measure."""

    def __init__(self, impl, mode, batch, seqlen, nheads, headdim, dtype, causal, seed=0):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        g = torch.Generator().manual_seed(seed)
        shape = (batch, seqlen, nheads, headdim)
        grad = mode == "fwd_bwd"
        self.q, self.k, self.v = (torch.randn(shape, generator=g, dtype=dtype).requires_grad_(grad) for _ in range(3))
        self.dout = torch.randn(shape, generator=g, dtype=dtype) if grad else None
        self.mode = mode
        self.attn = attention_call(impl, causal)
        self.impl = impl

    def reset(self):
        """Drop gradients of the previous call (outside the measured region)."""
        for t in (self.q, self.k, self.v):
            t.grad = None

    def __call__(self):
        if self.mode == "fwd":
            with torch.no_grad():
                return self.attn(self.q, self.k, self.v)
        out = self.attn(self.q, self.k, self.v)
        # naive / sdpa return (b, h, n, d); hand them the matching view of dout.
        dout = self.dout if out.shape == self.dout.shape else self.dout.transpose(1, 2)
        out.backward(dout)
        return None


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def naive_skip_reason(batch, nheads, seqlen, dtype, mode, budget) -> str | None:
    s_bytes = batch * nheads * seqlen * seqlen * torch.empty((), dtype=dtype).element_size()
    if s_bytes > budget:
        return f"N x N scores need {format_bytes(s_bytes)} > budget {format_bytes(budget)}"
    need = s_bytes * (2 if mode == "fwd" else 4)
    avail = _mem_available()
    if avail is not None and need > 0.8 * avail:
        return f"estimated peak {format_bytes(need)} > 80% of available memory {format_bytes(avail)}"
    return None


WARMUP_SEQLENS = (256, 1024)


def warmup(impls: Iterable[str], modes: Iterable[str], headdim: int, dtype: torch.dtype, causal: bool) -> None:
    """Pay one-time costs (lazy imports, op registration, thread pools) before measuring.

    Two sizes, because PyTorch's fused CPU kernel (behind SDPA and flashtile's CPU path)
    picks its block sizes by seqlen_q (< 192, < 768, >= 768), each a separate template
    instance: without the larger warm-up the first case measured at N >= 768 pays for
    faulting in that code (~0.6 MiB of resident set), which whichever implementation runs
    second then gets for free."""
    for n in WARMUP_SEQLENS:
        for impl in impls:
            for mode in modes:
                case = Case(impl, mode, 1, n, 1, headdim, dtype, causal)
                case()
                case.reset()


def time_one(
    impl: str,
    mode: str,
    seqlen: int,
    batch: int = 1,
    nheads: int = 1,
    headdim: int = 64,
    dtype: torch.dtype = torch.float32,
    causal: bool = False,
    quick: bool = False,
    target_s: float = 1.0,
    max_repeats: int = 10,
) -> dict:
    """Median wall time of one case: ``{"ms", "repeats"}``.

    A first, untimed call warms the case up and its duration picks the number of timed
    repeats: about ``target_s`` seconds of them, at least 2 and at most ``max_repeats``
    (1 when ``quick``).  Call after :func:`warmup` (``run_cpu_benchmark`` does).
    """
    case = Case(impl, mode, batch, seqlen, nheads, headdim, dtype, causal)
    t0 = time.perf_counter()
    case()
    first_s = time.perf_counter() - t0
    if quick:
        repeats = 1
    else:
        repeats = max(min(2, max_repeats), min(max_repeats, math.ceil(target_s / max(first_s, 1e-6))))
    times = []
    for _ in range(repeats):
        case.reset()
        t0 = time.perf_counter()
        case()
        times.append(time.perf_counter() - t0)
    return {"ms": statistics.median(times) * 1e3, "repeats": repeats}


def memory_one(
    impl: str,
    mode: str,
    seqlen: int,
    batch: int = 1,
    nheads: int = 1,
    headdim: int = 64,
    dtype: torch.dtype = torch.float32,
    causal: bool = False,
) -> dict:
    """Peak extra memory of one call, in this process: ``{"peak_extra_bytes", "call_ms"}``.

    Fresh inputs, then :func:`~flashtile.bench.common.peak_memory` (gc, ``malloc_trim``,
    peak-RSS reset, call).  ``call_ms`` is that single call's duration (it includes faulting
    in fresh pages: not a timing to compare).  Call after :func:`warmup`.
    """
    case = Case(impl, mode, batch, seqlen, nheads, headdim, dtype, causal)
    t0 = time.perf_counter()
    _, peak = peak_memory(case)
    return {"peak_extra_bytes": peak, "call_ms": (time.perf_counter() - t0) * 1e3}


# In the measuring process every allocation of 64 KiB or more gets its own mapping and is
# unmapped on free (glibc's dynamic threshold is off), so the resident set follows the live
# tensors instead of the heap's history: readings then repeat to ~0.1 MiB, where with the
# default allocator they drift by a few MiB from run to run.
ISOLATED_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def memory_isolated(
    specs: Sequence[dict], on_result: Callable[[dict], None] | None = None, timeout: float | None = None
) -> list[dict]:
    """:func:`memory_one` for each spec, in one fresh Python interpreter, in order.

    Each spec is a dict of :func:`memory_one`'s arguments (``dtype`` a torch dtype or its
    name, e.g. ``"float32"``).  The interpreter runs with :data:`ISOLATED_ENV`, warms every
    (impl, mode) up (:func:`warmup`), then measures the specs one after the other, so it holds no
    heap from anything else.  ``on_result`` is called with each result as it arrives.
    Start-up costs a few seconds (importing torch, the first custom-op call).
    """
    specs = [dict(s) for s in specs]
    for spec in specs:
        if isinstance(spec.get("dtype"), torch.dtype):
            spec["dtype"] = dtype_name(spec["dtype"])
    env = {**os.environ, **ISOLATED_ENV}
    proc = subprocess.Popen(
        [sys.executable, "-m", "flashtile.bench.cpu_measure", json.dumps(specs)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    results = []
    try:
        for line in proc.stdout:
            line = line.strip()
            if not line.startswith("{"):
                continue
            res = json.loads(line)
            results.append(res)
            if on_result is not None:
                on_result(res)
        stderr = proc.stderr.read()
        rc = proc.wait(timeout=timeout)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    if rc != 0 or len(results) != len(specs):
        raise RuntimeError(
            f"memory measurement subprocess failed (exit {rc}, {len(results)}/{len(specs)} results):\n{stderr[-4000:]}"
        )
    return results


def _memory_worker(specs_json: str) -> None:
    specs = json.loads(specs_json)
    for spec in specs:
        spec["dtype"] = getattr(torch, spec.get("dtype", "float32"))
    for impl, mode, headdim, dtype, causal in dict.fromkeys(
        (s["impl"], s["mode"], s.get("headdim", 64), s["dtype"], s.get("causal", False)) for s in specs
    ):
        warmup([impl], [mode], headdim, dtype, causal)
    gc.collect()
    gc.freeze()  # keeps peak_memory's full gc.collect() cheap
    for spec in specs:
        print(json.dumps(memory_one(**spec)), flush=True)


if __name__ == "__main__":
    _memory_worker(sys.argv[1])
