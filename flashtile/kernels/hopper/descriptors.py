"""Host TMA descriptors of the Gluon kernels: a ``[1, rows, 1, hd]`` box over a ``(batch, seqlen, heads, d)``
(or packed ``(total, heads, d)``, viewed 4-D by the layout) tensor, with its shared-memory layout."""

from __future__ import annotations

import functools

import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from flashtile.kernels.tma import checks_pass


@functools.lru_cache(maxsize=None)
def _nvmma_layout(rows: int, hd: int, torch_dtype: torch.dtype):
    # Cached: building the layout costs microseconds per descriptor, per call.
    gl_dtype = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16, torch.float32: gl.float32}[torch_dtype]
    return gl.NVMMASharedLayout.get_default_for([1, rows, 1, hd], gl_dtype)


def descriptor(t: torch.Tensor, rows: int, hd: int) -> TensorDescriptor:
    """A ``[1, rows, 1, hd]`` box over ``t``; the shape keeps the true head dim (columns past it
    read as zeros).  ``TensorDescriptor``'s own checks (aligned base and strides, unit last
    stride, non-empty shape, a valid box) cost microseconds per descriptor: where the cheap
    tests below (and the box, validated once with its layout) show they pass, the descriptor
    is built without them; anything else goes through the checked constructor."""
    shape, strides = list(t.shape), list(t.stride())
    layout = _nvmma_layout(rows, hd, t.dtype)
    if not checks_pass(shape, strides, t, rows, hd):
        return TensorDescriptor(t, shape, strides, [1, rows, 1, hd], layout)
    desc = object.__new__(TensorDescriptor)
    desc.__dict__.update(base=t, shape=shape, strides=strides, block_shape=[1, rows, 1, hd], layout=layout,
                         padding="zero")
    return desc
