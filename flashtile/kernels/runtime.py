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
