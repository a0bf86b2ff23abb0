"""Gluon kernels for Hopper (sm_90a): warp-specialised, asynchronous-wgmma attention.

Gluon (``triton.experimental.gluon``) is Triton's explicit-layout dialect: the kernel says
which warps hold which rows, which shared-memory buffers the TMA engine fills, and when the
tensor cores are waited on.  It is not run by Triton's interpreter, and its API moves between
Triton releases, so everything written in it lives in this package and is pinned to the
Triton version in ``SUPPORTED_TRITON``; other versions fall back to the ``tl.*`` kernels.
"""

from __future__ import annotations

import dataclasses

import triton

# The Gluon names used here were checked against this release (its API is experimental).
SUPPORTED_TRITON = ("3.6.",)


def gluon_available() -> bool:
    """True when this Triton ships the Gluon API the Hopper kernels are written against."""
    if not triton.__version__.startswith(SUPPORTED_TRITON):
        return False
    try:
        from triton.experimental.gluon.language.nvidia import hopper  # noqa: F401
    except ImportError:
        return False
    return True


def config_changes(spec: str) -> dict:
    """The keyword arguments of a configuration spec, ``name=value+name=value`` with integer
    values (``""``: none): how the kernels' alternative configurations (each kernel module's
    ``ALTERNATIVES``) and the A/B benchmarks name a configuration."""
    return {name: int(value) for name, value in (item.split("=") for item in spec.split("+") if item)}


def configured(config_for, spec: str):
    """A kernel module's ``config_for`` with the changes of ``spec`` applied to every
    configuration it returns: what a module's ``config_from_spec`` calls, and what the tests and
    A/B benchmarks put in place of ``config_for`` to run an alternative."""
    changes = config_changes(spec)
    if not changes:
        return config_for
    return lambda *key: dataclasses.replace(config_for(*key), **changes)


class RegisterBudget:
    """The register cap of a Hopper configuration (a dataclass with ``consumer_regs`` and
    ``producer_regs``, and ``consumers`` where it has other than two): the consumer warpgroups
    and a producer warp (padded to a warpgroup)."""

    consumers = 2

    @property
    def maxnreg(self) -> int:
        # The kernel-wide cap from which ``warp_specialize`` carves each partition's budget:
        # Triton gives the workers their requests and the default partition (the first
        # consumer) what the cap leaves, so the cap is the warpgroups' mean, rounded up to a
        # multiple of 8 (down, the first consumer would get less than the others), within
        # the SM's 64K registers.
        warpgroups = self.consumers + 1
        mean = -(-(self.consumers * self.consumer_regs + self.producer_regs) // warpgroups)
        return min(-(-mean // 8) * 8, 65536 // (128 * warpgroups) // 8 * 8)
