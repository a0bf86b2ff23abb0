"""flashtile's Python host path per call, measured on a machine without a GPU.

``benchmarks/profile_decode_host.py`` times a decode step on a GPU, where the host time is
flashtile's Python plus torch's allocations plus Triton's launcher.  This script times the
first part alone, anywhere: it runs the real Python path of ``flash_attn_with_kvcache`` and
``flash_attn_func`` -- argument checks, the launch configuration, allocations, the launch
layer's key and cache look-up -- with only the GPU-side pieces replaced:

* tensors are CPU tensors that claim to be CUDA ones (``torch.Tensor.is_cuda`` is patched to
  ``True`` for the run, a Python property where torch has a C one: ~0.05 us per use), so
  every ``is_cuda`` branch takes the GPU path; the device queries flashtile makes
  (capability, SM count, current device, stream capture, and the decode configuration's
  device and shared memory) answer as an H200 would, so a decode call makes the H200's
  launches and allocations (at the cases' shape: the split kernel, which merges its splits itself);
* Triton's ordinary launch (``JITFunction.run``) returns a stand-in compiled kernel per
  kernel, argument types and descriptor boxes, whose launcher is Triton's own Python launcher
  object (``CudaLauncher``, with its per-argument descriptor handling,
  ``wrap_handle_tensordesc``) over a C launcher that does nothing but count its calls; the
  descriptors' metadata has the form a Hopper compile records, and the driver's
  ``fill_tma_descriptor`` (an encode in C on a GPU) returns its inputs.  The driver's current
  device / stream getters are constants.  The launch layer (``flashtile.kernels.launch``)
  runs as it does on a GPU: the first call of a specialisation class goes through the
  ordinary launch, later ones launch directly.

So ``us`` here is what the Python of flashtile and of Triton's launcher costs per call; on
a GPU, torch's CUDA allocator, the C launcher and the descriptor encodes the launches make
(a few us per launch) come on top; ``launches`` counts the C launcher's calls per call.  A
launch that goes Triton's ordinary way (``kernel[grid](...)``, 40-90 us of binding on a GPU
host) costs nothing here: compare such paths on a GPU (``profile_decode_host.py``).  Cases
(batch 1, cache 1k, 32 / 4 heads, d = 128, bf16, one query row): ``kvcache`` /
``kvcache+append`` / ``kvcache+append+rotary``, contiguous or paged16, int or tensor
``cache_seqlens``; ``func``: ``flash_attn_func`` at (1, 128, 8, 64), eager (``torch.no_grad``
and not) and its custom-op dispatch; ``fp8 func``: ``flash_attn_fp8_func`` at (1, 128, 8, 128)
and (1, 128, 8, 256).  Then a cProfile of one case.

    python benchmarks/profile_host_cpu.py [--calls 20000] [--profile kvcache+append] [--json out.jsonl]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import io
import json
import operator
import os
import pstats
import sys
import time
from types import SimpleNamespace

import torch


class _StubCompiled:
    """What the stubbed ordinary launch returns: a compiled kernel whose launcher (``run``) is
    Triton's ``CudaLauncher`` over a C launcher (``_raw``) that only counts its calls
    (``launches``).  A test may replace ``run`` or ``_raw`` on the class."""

    function = 0
    packed_metadata = (4, 1, 0)
    launches = 0
    run = property(lambda self: self.launcher)

    def __init__(self, kernel, args, options):
        from triton.backends.nvidia.driver import CudaLauncher, wrap_handle_tensordesc

        from flashtile.kernels.launch import _DESCRIPTORS

        signature, meta = {}, []
        for i, param in enumerate(kernel.params):
            value = args[i] if i < len(args) else options.get(param.name, param.default)
            if param.is_constexpr:
                signature[i] = "constexpr"
            elif value.__class__ in _DESCRIPTORS:
                block = list(value.block_shape)
                signature[i] = f"tensordesc<bf16{block}>"
                # Metadata of the form a Hopper compile records (a 128-byte swizzle, 2-byte elements).
                meta.append(dict(swizzle=3, elem_size=2, elem_type=10, block_size=block, fp4_padded=False))
            else:
                signature[i] = "i32"
        launcher = object.__new__(CudaLauncher)
        launcher.num_ctas = 1
        launcher.launch = wrap_handle_tensordesc(self._raw, signature, meta or None)
        launcher.global_scratch_size = launcher.profile_scratch_size = 0
        launcher.global_scratch_align = launcher.profile_scratch_align = 1
        launcher.launch_cooperative_grid = launcher.launch_pdl = False
        self.launcher = launcher
        self.src = SimpleNamespace(signature=signature)  # what CudaLauncher reads of the source

    @staticmethod
    def _raw(*args):
        _StubCompiled.launches += 1


def _fill_tma_descriptor(*args):
    return args


@contextlib.contextmanager
def stubbed_gpu():
    """CPU tensors on the GPU path, with Triton's launches and the device queries stubbed."""
    from triton.runtime.jit import JITFunction

    from flashtile.kernels import decode as decode_mod
    from flashtile.kernels import launch as launch_mod
    from flashtile.kernels import runtime, workspace

    import triton

    compiled = {}

    def ordinary(self, *args, grid, warmup, **options):
        # One compiled kernel per kernel, argument types and descriptor boxes (its metadata's).
        key = (id(self), tuple(map(type, args)), tuple(tuple(a.block_shape) for a in args if hasattr(a, "block_shape")))
        if key not in compiled:
            compiled[key] = _StubCompiled(self, args, options)
        return compiled[key]

    class _Driver:
        """The active driver as far as the launchers ask it: the descriptor encode."""

        class utils:
            fill_tma_descriptor = staticmethod(_fill_tma_descriptor)

    class _Props:
        multi_processor_count = 132
        L2_cache_size = 60 << 20  # as torch reports it on an H200
        major, minor = 9, 0

    saved = []

    def patch(obj, name, value):
        saved.append((obj, name, obj.__dict__.get(name, _MISSING) if isinstance(obj, type) else getattr(obj, name)))
        setattr(obj, name, value)

    # True for every tensor, computed in C (``None is not self``): a Python getter would cost
    # each use a frame, where torch's own getter costs tens of nanoseconds.
    patch(torch.Tensor, "is_cuda", property(functools.partial(operator.is_not, None)))
    patch(JITFunction, "run", ordinary)
    patch(triton.runtime.driver, "_active", _Driver)
    patch(launch_mod, "_device_functions", (lambda: 0, lambda device: 0))
    patch(launch_mod, "INTERPRET", False)
    patch(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    patch(torch.cuda, "get_device_properties", lambda *a: _Props)
    patch(torch.cuda, "current_device", lambda: 0)
    patch(torch.cuda, "is_current_stream_capturing", lambda: False)
    patch(workspace, "_capturing", lambda: False)
    patch(workspace, "_current_stream", lambda index: 0)
    # The decode launch configuration asks the device's type (CPU tensors here: one SM, no
    # split) and Triton's driver (shared memory): answered as on an H200 (132 SMs, 227 KB), so
    # that the split count, and with it the launches and allocations, are the H200's.
    real_config = decode_mod.cached_launch_config
    h200 = torch.device("cuda", 0)
    patch(decode_mod, "cached_launch_config", lambda batch, nheads_k, capacity, device, *rest: real_config(
        batch, nheads_k, capacity, h200 if device.type == "cpu" else device, *rest))
    patch(decode_mod, "smem_budget", lambda index: decode_mod.DEFAULT_SMEM_BYTES)
    # The decode launch plans hold answers of the device queries (PDL, SM count): built afresh
    # under the stubs, and not kept past them.
    runtime.has_programmatic_launch.cache_clear()
    decode_mod.clear_plans()
    try:
        yield
    finally:
        for obj, name, value in reversed(saved):
            if value is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, value)
        runtime.has_programmatic_launch.cache_clear()
        decode_mod.clear_plans()
        launch_mod.clear()
        workspace.clear()


_MISSING = object()


def cases(batch=1, cache=1024, nheads=32, nheads_k=4, d=128, dtype=torch.bfloat16):
    """``(name, fn)`` for every case."""
    import flashtile
    from profile_decode_host import decode_inputs, flashtile_decode_cases

    for fields, fn in flashtile_decode_cases(decode_inputs(batch, cache, nheads, nheads_k, d, dtype, device="cpu")):
        yield f"{fields['mode']} {fields['layout']} {fields['lengths']}", fn
    tq, tk, tv = (torch.randn(1, 128, 8, 64, dtype=dtype) for _ in range(3))
    yield "func (1,128,8,64)", lambda: flashtile.flash_attn_func(tq, tk, tv)

    def no_grad_func():
        with torch.no_grad():
            return flashtile.flash_attn_func(tq, tk, tv)

    yield "func (1,128,8,64) no_grad", no_grad_func
    gq, gk, gv = (t.clone().requires_grad_() for t in (tq, tk, tv))
    yield "func (1,128,8,64) requires_grad", lambda: flashtile.flash_attn_func(gq, gk, gv)
    tq2, tk2, tv2 = (torch.randn(1, 128, 8, 128, dtype=dtype) for _ in range(3))
    yield "func (1,128,8,128) gluon", lambda: flashtile.flash_attn_func(tq2, tk2, tv2)
    yield "func growing cache, 8 layers", growing_cache_decode(dtype)
    # flash_attn_fp8_func at (1, 128, 8, d): the tl.* kernel at d = 128, the Gluon one (with
    # the V transpose into its key order) at d = 256.  The descales are CPU tensors here, so
    # the validation's positivity check (made on CPU descales only) runs, as on a GPU it does not.
    from flashtile.fp8 import flash_attn_fp8_func

    for hd, engine in ((128, "tl.*"), (256, "gluon")):
        q8, k8, v8 = (torch.randn(1, 128, 8, hd).to(torch.float8_e4m3fn) for _ in range(3))
        ones = torch.ones(1)
        yield f"fp8 func (1,128,8,{hd}) {engine}", functools.partial(flash_attn_fp8_func, q8, k8, v8, ones, ones, ones)


def growing_cache_decode(dtype, layers=8, start=4096, heads=16, heads_k=4, d=128):
    """A decode step per ``layers`` calls as transformers' dynamic cache makes them: one query
    row against keys and values one longer every step, in fresh tensors (``(batch, heads_k,
    n, d)`` transposed to flash-attn's layout, so their strides change with ``n``), causal; the
    same length for every layer of a step.  Views over one storage stand for the fresh tensors."""
    import flashtile
    from flashtile.bench.decode import growing_cache_views

    q = torch.randn(1, 1, heads, d, dtype=dtype)
    storage = torch.randn(2, heads_k * (start + 10**6) * d, dtype=dtype)
    next_kv = growing_cache_views(storage, start, layers, heads_k, d)
    return lambda: flashtile.flash_attn_func(q, *next_kv(), causal=True)


def per_call_us(fn, calls, repeats=5):
    """The best of ``repeats`` runs of ``calls`` calls: host microseconds per call."""
    for _ in range(50):
        fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def main():
    if os.environ.pop("TRITON_INTERPRET", None) and "flashtile" in sys.modules:
        raise SystemExit("run without TRITON_INTERPRET: the compiled-kernel path is what is timed")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--profile", default="kvcache+append contiguous int",
                    help="the case to cProfile (a prefix of its name; '' for none)")
    ap.add_argument("--json", default=None, help="append one JSON record per case to this file")
    args = ap.parse_args()
    torch.manual_seed(0)
    with stubbed_gpu():
        results = []
        for name, fn in cases():
            us = per_call_us(fn, args.calls)
            before = _StubCompiled.launches
            for _ in range(10):
                fn()
            launches = (_StubCompiled.launches - before) / 10
            results.append((name, us, fn))
            print(f"{name:40s} {us:7.1f} us/call  {launches:g} launches")
        if args.json:
            with open(args.json, "a") as f:
                for name, us, _ in results:
                    f.write(json.dumps(dict(bench="host_cpu", case=name, us=us)) + "\n")
        if args.profile:
            name, _, fn = next(r for r in results if r[0].startswith(args.profile))
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(1000):
                fn()
            prof.disable()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
            print(f"cProfile, 1000 calls of {name}:\n{s.getvalue()}")


if __name__ == "__main__":
    main()
