"""``async_reduce_add``: a TMA element-wise add of a shared-memory tile into global memory.

Triton 3.6's Gluon wraps TMA loads and stores (``hopper.tma``) but not the TMA reduction
(``cp.reduce.async.bulk.tensor ... .add``), which its IR already has (``ttng.async_tma_reduce``,
the op ``tl``'s ``descriptor.atomic_add`` lowers to) and its builder already exposes.  This is
the missing wrapper, written the way ``hopper.tma.async_copy_shared_to_global`` is: the
copy engine reads the tile and adds it into the box at ``coord`` in L2 (elements outside the
tensor are dropped), and ``tma.store_wait`` waits for the read of the tile like for a store.
"""

from __future__ import annotations

from triton._C.libtriton import ir
from triton.experimental.gluon.language._core import builtin


@builtin
def async_reduce_add(tensor_desc, coord, src, _semantic=None):
    """Add shared-memory tile ``src`` into ``tensor_desc``'s box at ``coord`` (asynchronous)."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)
