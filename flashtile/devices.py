"""Launching on the inputs' GPU.

Triton launches a kernel on the *current* CUDA device, on that device's current stream,
whatever device its tensor arguments live on.  A call whose tensors are on another GPU than
the current one (a model spread over GPUs, as ``device_map="auto"`` makes it) would run its
kernels on the wrong device, against memory it may not reach and out of order with the
stream that produced its inputs.  So every public function that may launch a kernel makes
the device of its first argument current for the call, as PyTorch's own operators do: its
kernels then run on that device and its current stream, where PyTorch's operators on those
tensors run too.
"""

from __future__ import annotations

import functools
import inspect

import torch

# torch's C getter of the current device (no lazy-initialisation layer); absent without CUDA.
_current_device = getattr(torch._C, "_cuda_getDevice", None)


def on_input_device(fn):
    """``fn`` run with the CUDA device of its first argument current, when that argument is a
    CUDA tensor on another device than the current one (a check of a few tenths of a
    microsecond otherwise).  Not while torch.compile traces, where Inductor places the work."""

    first = next(iter(inspect.signature(fn).parameters))

    @functools.wraps(fn)
    def call(*args, **kwargs):
        x = args[0] if args else kwargs.get(first)
        if isinstance(x, torch.Tensor):
            index = x.get_device()  # -1 on the CPU
            # is_compiling() before the C device getter, which Dynamo does not trace.
            if index >= 0 and not torch.compiler.is_compiling() and index != _current_device():
                with torch.cuda.device(index):
                    return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    return call
