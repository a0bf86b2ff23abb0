"""Host side of the TMA tiles: head-dim padding, TMA-ready tensors, tensor descriptors."""

import functools

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from flashtile.kernels.runtime import next_power_of_2


def padded_headdim(d: int) -> int:
    """The head dim the kernels tile with: the next power of two, at least 16 (a tl.arange
    and a bf16 wgmma K step); the descriptors read the columns past ``d`` as zeros."""
    return max(16, next_power_of_2(d))


def tma_strides(t: torch.Tensor) -> bool:
    """Whether :func:`tma_ready` passes ``t`` through uncopied, the alignment of its base aside
    (what a launch plan's key fixes; the base is tested per call)."""
    elt = t.element_size()
    return t.stride(-1) == 1 and all((s * elt) % 16 == 0 for s in t.stride()[:-1])


def tma_ready(t: torch.Tensor) -> torch.Tensor:
    """TMA needs a 16-byte aligned base and 16-byte multiples for every stride but the last.

    Tensors from ordinary allocations with headdim a multiple of 8 (fp16/bf16) already
    qualify; anything else is copied once into a padded, contiguous buffer.
    """
    if t.data_ptr() % 16 == 0 and tma_strides(t):
        return t
    elt = t.element_size()
    d = t.shape[-1]
    d_pad = -(-d * elt // 16) * 16 // elt
    return torch.nn.functional.pad(t, (0, d_pad - d)).contiguous()


def descriptor(t: torch.Tensor, block_rows: int, head_dim_pad: int) -> TensorDescriptor:
    # Shape keeps the *true* head dim: columns past it read as zeros and are never written.
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, block_rows, 1, head_dim_pad])


def checks_pass(shape: list, strides: list, t: torch.Tensor, rows: int, hd: int) -> bool:
    """Whether ``TensorDescriptor``'s constructor checks would pass for a ``[1, rows, 1, hd]``
    box over ``t`` (``shape``, ``strides``: ``t``'s): :func:`box_checks_pass` of that box."""
    return box_checks_pass(shape, strides, t, (1, rows, 1, hd))


def box_checks_pass(shape: list, strides: list, t: torch.Tensor, block: tuple) -> bool:
    """Whether ``TensorDescriptor``'s constructor checks would pass for a 4-D ``block`` over
    ``t`` (``shape``, ``strides``: ``t``'s): 4-D, non-empty, unit last stride, 16-byte aligned
    base and strides, a valid box.  They cost microseconds per descriptor, so the launchers
    build a descriptor without them where this cheap test passes (and through the checked
    constructor, which raises, where it does not)."""
    elt = t.element_size()
    return not (len(shape) != 4 or 0 in shape or strides[-1] != 1 or t.data_ptr() & 15
                or any((s * elt) & 15 for s in strides[:-1]) or not _valid_box(block))


@functools.lru_cache(maxsize=None)
def _valid_box(block: tuple) -> bool:
    from triton._utils import validate_block_shape

    try:
        validate_block_shape(list(block))
    except (AssertionError, ValueError):
        return False
    return True


class DescriptorTemplate:
    """A built host descriptor without its tensor, to build the same descriptor over other
    tensors cheaply (a launch plan, or its bound launcher, makes one per operand and call).

    Valid for a tensor with the template tensor's dtype, shape and strides whose base is
    16-byte aligned: everything a descriptor's checks read then equals what passed them when
    the template was built, so :attr:`over` skips them (a few microseconds per descriptor).
    The caller keeps to that (the plan's key holds dtype, shape and strides; it tests the
    alignment per call).  The descriptors share the template's shape, stride and block-shape
    lists, which nothing writes to."""

    __slots__ = ("cls", "fields", "over")

    def __init__(self, desc):
        self.cls = cls = desc.__class__
        self.fields = fields = {name: value for name, value in desc.__dict__.items() if name != "base"}
        new = object.__new__

        # A closure rather than a method: no attribute look-ups per descriptor.
        def over(t: torch.Tensor):
            """The template's descriptor over ``t``."""
            made = new(cls)
            made.__dict__.update(fields)
            made.base = t
            return made

        self.over = over
