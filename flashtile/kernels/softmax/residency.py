"""How many programs of a compiled kernel the GPU holds at once.

The fused path's persistent grid and the cooperative path's grid are both sized by it: a
persistent program that is not resident only starts when another has finished all its rows,
and the driver refuses a cooperative grid that cannot be resident as a whole.
"""

from __future__ import annotations

import functools

import torch

from flashtile.kernels.runtime import sm_count


@functools.cache
def _device_limits(device_index: int):
    props = torch.cuda.get_device_properties(device_index)
    return (getattr(props, "max_threads_per_multi_processor", 2048),
            getattr(props, "regs_per_multiprocessor", 65536),
            getattr(props, "shared_memory_per_multiprocessor", 233472))


_RESIDENT: dict = {}


def resident_programs_per_sm(compiled, num_warps: int, device_index: int) -> int:
    """How many programs of ``compiled`` one SM holds at once (threads, registers, shared memory)."""
    compiled._init_handles()
    threads, regs, smem = _device_limits(device_index)
    regs_per_warp = -(-max(1, compiled.n_regs) * 32 // 256) * 256  # allocated per warp, 256 at a time
    fits = [threads // (32 * num_warps), regs // regs_per_warp // num_warps, 32]
    if compiled.metadata.shared:
        fits.append(smem // (compiled.metadata.shared + 1024))  # 1 KB reserved per block
    return max(1, min(fits))


def resident_programs(kernel, args, kwargs, device) -> int:
    """How many programs of ``kernel`` (compiled for these arguments) the whole GPU holds at once."""
    key = (kernel.fn.__name__ if hasattr(kernel, "fn") else id(kernel), device.index,
           tuple(str(a.dtype) for a in args if isinstance(a, torch.Tensor)), tuple(sorted(kwargs.items())))
    per_sm = _RESIDENT.get(key)
    if per_sm is None:
        compiled = kernel.warmup(*args, grid=(1,), **kwargs)
        per_sm = _RESIDENT[key] = resident_programs_per_sm(compiled, kwargs["num_warps"], device.index)
    return per_sm * sm_count(device.index)
