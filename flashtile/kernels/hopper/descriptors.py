"""Host TMA descriptors of the Gluon kernels: a ``[1, rows, 1, hd]`` box over a ``(batch, seqlen, heads, d)``
(or packed ``(total, heads, d)``, viewed 4-D by the layout) tensor, or any 4-D box (the FP8 forward's
transposed V), with its shared-memory layout."""

from __future__ import annotations

import functools

import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from flashtile.kernels.tma import box_checks_pass

_GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16, torch.float32: gl.float32,
              torch.float8_e4m3fn: gl.float8e4nv}


@functools.lru_cache(maxsize=None)
def _nvmma_layout(block: tuple, torch_dtype: torch.dtype):
    # Cached: building the layout costs microseconds per descriptor, per call.
    return gl.NVMMASharedLayout.get_default_for(list(block), _GL_DTYPES[torch_dtype])


def descriptor(t: torch.Tensor, rows: int, hd: int) -> TensorDescriptor:
    """A ``[1, rows, 1, hd]`` box over ``t``; the shape keeps the true head dim (columns past it
    read as zeros)."""
    return box_descriptor(t, (1, rows, 1, hd))


def box_descriptor(t: torch.Tensor, block: tuple) -> TensorDescriptor:
    """A 4-D ``block`` over ``t`` with its NVMMA shared layout.  ``TensorDescriptor``'s own
    checks (aligned base and strides, unit last stride, non-empty shape, a valid box) cost
    microseconds per descriptor: where the cheap tests below (and the box, validated once with
    its layout) show they pass, the descriptor is built without them; anything else goes
    through the checked constructor."""
    shape, strides = list(t.shape), list(t.stride())
    layout = _nvmma_layout(block, t.dtype)
    if not box_checks_pass(shape, strides, t, block):
        return TensorDescriptor(t, shape, strides, list(block), layout)
    desc = object.__new__(TensorDescriptor)
    desc.__dict__.update(base=t, shape=shape, strides=strides, block_shape=list(block), layout=layout,
                         padding="zero")
    return desc
