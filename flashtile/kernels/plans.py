"""The cache of launch plans the dense forward and backward keep (``attention/forward.py``,
``attention/backward.py``).

A model calls attention with a handful of shapes, each many times, and everything of a
launch but the tensors is a function of a key (shapes, strides, dtypes, devices, the call's
scalars, the engine setting), so a plan per key is worked out once and a call allocates its
outputs and launches from it.  A key's first call goes the general way and only its second
builds the plan: a model that extends a KV cache by a token a step calls with a new shape
every time, and would pay for plans it never uses.  Keys seen once are remembered apart, so
they never evict plans.  A caller that keeps a plan beside its own memo keeps the ``plans``
dict it came from too, and uses the plan only while that is still the cache's ``plans``:
emptying the cache replaces the dict, so every kept plan goes stale with it.
"""

from __future__ import annotations

import math

import torch

from flashtile.kernels import workspace

NO_PLAN = object()  # a key whose calls go the general way
PENDING = object()  # a key with no plan yet: this call goes the general way, a later one decides


class PlanCache:
    """Plans by key (``plans``, looked up by the caller), bounded, built at a key's second call."""

    __slots__ = ("plans", "seen_once", "max_plans", "max_seen_once")

    def __init__(self, max_plans: int = 256, max_seen_once: int = 1024):
        self.plans: dict = {}
        self.seen_once: set = set()
        self.max_plans, self.max_seen_once = max_plans, max_seen_once

    def clear(self) -> None:
        """Forget every plan, kept ones included (``plans`` is a new dict), and the keys seen once."""
        self.plans = {}
        self.seen_once.clear()

    def decide(self, key, build, at_once: bool = False, ready: bool = True):
        """For a ``key`` not in ``plans``: ``PENDING`` at its first call (unless ``at_once``) and
        while the call cannot serve as the plan's sample (not ``ready``), else ``build()``'s plan
        (``NO_PLAN`` for None), kept under ``key``."""
        if not at_once:
            if key not in self.seen_once:
                if len(self.seen_once) >= self.max_seen_once:
                    self.seen_once.clear()
                self.seen_once.add(key)
                return PENDING
            if not ready:
                return PENDING
        self.seen_once.discard(key)
        plan = build() or NO_PLAN
        if len(self.plans) >= self.max_plans:
            self.clear()
        self.plans[key] = plan
        return plan


def stand_ins(device, *specs) -> tuple:
    """Contiguous tensors of these ``(shape, dtype)`` on ``device``, for a plan to be built over
    in place of a call's outputs: a plan reads their shapes, strides, dtypes, device and
    16-byte aligned bases, never their elements, so they are carved from one buffer of the
    largest one's size (they overlap).  Building a plan at a training step then adds one
    output's memory to the step's peak, not the sum of them all."""
    sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in specs]
    buffer = torch.empty(max(sizes, default=0), dtype=torch.uint8, device=device)
    return tuple(buffer[:size].view(dtype).view(shape) for size, (shape, dtype) in zip(sizes, specs))


def lse_buffer(shape: tuple, numel: int, device, needed: bool):
    """Where a plan's launch writes its float32 LSE of ``shape`` (``numel`` elements, worked out
    once by the plan): a fresh tensor when the caller
    wants it (or while the stream captures a CUDA graph), else the stream's sink
    (``flashtile.kernels.workspace``), which launches write and nothing reads -- a forward
    without autograd or ``return_lse`` saves the allocation.  The kernels write the LSE with the
    plan's own strides from the buffer's base, so the sink needs only its size."""
    if needed or workspace.capturing():
        return torch.empty(*shape, dtype=torch.float32, device=device)
    return workspace.scratch(device, 0, 0, numel).sink
