"""FlashAttention forward and backward in Triton ``tl.*`` (Hopper first, any CUDA GPU, and the interpreter).

Read in this order:

* ``layout.py``   -- how the kernels address dense, packed and paged tensors (``Layout``, the
  host TMA descriptors, the masked store that keeps packed sequences apart);
* ``forward.py``  -- the forward kernel (online softmax over key tiles), its tile
  configuration ``fwd_config`` and the launchers ``fwd`` / ``varlen_fwd``;
* ``backward.py`` -- the backward by recomputation (preprocess, dK/dV, dQ), ``bwd_config``
  and the launchers ``bwd`` / ``varlen_bwd``.

The launchers take the call's ``AttentionParams`` (``flashtile.semantics.params``), as the
custom ops of ``flashtile.ops.attention`` pass it; ``attention_forward``,
``attention_backward`` and their ``varlen_`` forms are the same with its fields as keyword
arguments and dropout as one ``(p, seed, offset)``, for direct calls.

The pieces every kernel family shares live in ``flashtile/kernels/``: ``tile_info``,
``online_softmax``, ``masking`` and ``tma``.  This package re-exports the launchers, the
configs, ``Layout`` (the Gluon kernels of ``flashtile/kernels/hopper/`` take one) and
``padded_headdim`` (the head dim the kernels compute with).
"""

from flashtile.kernels.attention.backward import (
    attention_backward,
    bwd,
    bwd_config,
    varlen_attention_backward,
    varlen_bwd,
)
from flashtile.kernels.attention.forward import (
    attention_forward,
    fwd,
    fwd_config,
    varlen_attention_forward,
    varlen_fwd,
)
from flashtile.kernels.attention.layout import Layout
from flashtile.kernels.tma import padded_headdim

__all__ = [
    "Layout",
    "attention_backward",
    "attention_forward",
    "bwd",
    "bwd_config",
    "fwd",
    "fwd_config",
    "padded_headdim",
    "varlen_attention_backward",
    "varlen_attention_forward",
    "varlen_bwd",
    "varlen_fwd",
]
