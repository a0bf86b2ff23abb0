"""What every kernel module needs to know about where it runs."""

import functools
import os

import torch

# Triton's interpreter (CPU tensors, numpy semantics) is chosen when the kernels are
# defined, so the flag is read once at import: tests set it before importing flashtile.kernels.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (1 in the interpreter), for grid sizing."""
    if INTERPRET:
        return 1
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=None)
def has_programmatic_launch(device_index: int) -> bool:
    """Programmatic dependent launch (Hopper and later): a kernel may start while the one
    before it drains, and waits (``griddepcontrol.wait``) only where it reads that kernel's
    results.  Never in the interpreter, which runs no PTX."""
    if INTERPRET:
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


@functools.lru_cache(maxsize=32)
def parse_tuning(env_name: str, text: str, names: tuple[str, ...], float_names: tuple[str, ...] = ()) -> dict:
    """``"name=value,..."`` (the value of the environment variable ``env_name``) -> overrides.

    Each kernel family keeps its launch knobs as module constants and lets one environment
    variable override them, so a tuning sweep on a GPU needs no code edits.
    """
    overrides = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or name not in names:
            raise ValueError(f"{env_name}: expected name=value with name in {sorted(names)}, got {item!r}")
        overrides[name] = float(value) if name in float_names else int(value)
    return overrides


# Host-side integer helpers.  ``triton.cdiv`` / ``triton.next_power_of_2`` are
# ``constexpr_function``s in Triton 3.6 and cost microseconds per call on the host, which
# a decoding step (~20 us on the GPU) cannot afford; these are the plain-Python equivalents.
def cdiv(x: int, y: int) -> int:
    return -(-x // y)


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs must not silently drop to tf32 (~1e-3 relative error).
    return "ieee" if dtype == torch.float32 else "tf32"


class TileConfig:
    """One tile configuration; small enough to read at a glance."""

    def __init__(self, block_m, block_n, num_warps, num_stages, maxnreg=0):
        self.block_m, self.block_n = block_m, block_n
        self.num_warps, self.num_stages = num_warps, num_stages
        self.maxnreg = maxnreg  # ptxas register cap, 0 = none (FP8 forward tile sweeps)

    def launch_options(self) -> dict:
        """The launch keywords of this configuration (``num_warps``, ``num_stages``, ``maxnreg``)."""
        opts = dict(num_warps=self.num_warps, num_stages=self.num_stages)
        if self.maxnreg:
            opts["maxnreg"] = self.maxnreg
        return opts

    def __repr__(self):
        return (f"TileConfig(BLOCK_M={self.block_m}, BLOCK_N={self.block_n}, warps={self.num_warps}, "
                f"stages={self.num_stages}, maxnreg={self.maxnreg})")
