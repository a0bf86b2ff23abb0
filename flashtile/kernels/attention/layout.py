"""How the attention kernels see their inputs: dense and packed tensors, descriptors, stores.

Tensors keep flash-attn's layout ``(batch, seqlen, nheads, headdim)`` and any strides with
a unit last stride: a 4-D tensor descriptor, built once on the host, addresses tile
``[b, row0:row0+BLOCK, h, :]`` directly, rows past the sequence read as zeros and are never
written.  Head dims that are not a power of two are padded to one *inside* the descriptor
(out-of-range columns read as zeros), so no copy is made.

Packed (varlen) batches ``(total, nheads, headdim)`` use the same host descriptors over the
whole tensor viewed as ``(1, total, nheads, headdim)``, tiles at row ``q_start + m0`` /
``k_start + n0`` (building one per sequence inside the kernel costs a descriptor write and a
fence per program).  Rows past a sequence's end then read the *next* sequence, not zeros, so
masks carry correctness there: keys at or past ``seqlen_k`` are masked out of every softmax
(``key_tiles`` never leaves the boundary tile unmasked), query rows past ``seqlen_q`` get
LSE = +inf in the backward (P exactly 0, given finite inputs), and every store of a packed
tile is a pointer store masked to its sequence's rows (:func:`store_tile`).

Also here: the small host-side helpers the forward and backward launchers share (dropout's
kernel arguments, the longest packed sequence, removing the head-dim padding).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from flashtile.kernels.tma import checks_pass, descriptor, tma_ready


@triton.jit
def store_tile(desc, ptr, b, row, h, tile, row_end, VARLEN: tl.constexpr):
    """Store a ``(BLOCK, HEAD_DIM)`` tile at the descriptor's ``[b, row, h, 0]``.

    A packed descriptor spans every sequence, so its bounds would not stop a tile that runs
    past its own sequence from overwriting the next one: packed tiles are stored through
    ``ptr`` (the descriptor's tensor), rows below ``row_end`` only, with the descriptor's strides.
    """
    if VARLEN:
        # TMA already required 16-byte strides and rows; rebuilding them as multiples of
        # 16 bytes (exact divisions) lets the compiler see it and store 16 bytes at a time.
        VEC: tl.constexpr = 128 // desc.dtype.primitive_bitwidth
        row_stride = (desc.strides[1] // VEC) * VEC
        head_stride = (desc.strides[2] // VEC) * VEC
        cols = (desc.shape[3] // VEC) * VEC
        offs_r = tl.arange(0, tile.shape[0])
        offs_d = tl.arange(0, tile.shape[1])
        ptrs = ptr + row.to(tl.int64) * row_stride + h * head_stride + offs_r[:, None] * row_stride + offs_d[None, :]
        tl.store(ptrs, tile.to(desc.dtype), mask=(offs_r < row_end - row)[:, None] & (offs_d < cols)[None, :])
    else:
        desc.store([b, row, h, 0], tile.to(desc.dtype).reshape([1, tile.shape[0], 1, tile.shape[1]]))


class Layout:
    """Dense ``(batch, seqlen, heads, d)`` or packed ``(total, heads, d)`` inputs, as the kernels see them.

    Both are addressed through host TMA descriptors: a packed tensor is viewed as one batch
    entry ``(1, total, heads, d)`` and the kernels offset rows by cu_seqlens (see the module
    docstring for what keeps sequences apart).
    """

    def __init__(self, q, k, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0,
                 block_table=None):
        self.varlen = cu_seqlens_q is not None
        self.nheads, self.nheads_k = q.shape[-2], k.shape[-2]
        # Paged K/V (packed queries only): k, v are (num_blocks, page_size, heads_k, d) pages
        # that block_table maps each sequence's keys to; cu_seqlens_k gives the lengths.
        self.block_table = block_table
        if self.varlen:
            self.batch = cu_seqlens_q.numel() - 1
            self.seqlen_q, self.seqlen_k = max_seqlen_q, max_seqlen_k  # grid extent; kernels read the rest
            # What the kernels' seqlen arguments carry for a packed batch: the row counts that
            # bound every cu_seqlens value (see sequence_bounds).  Paged keys have no packed
            # rows: their lengths are bounded by each sequence's pages instead (see
            # forward._kv_tile).
            self.rows_q = q.shape[0]
            self.rows_k = k.shape[0] if block_table is None else 2**31 - 1
            # The kernels read cu_seqlens[b] at offset b: a strided view is copied first.
            self.cu_q, self.cu_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
            self.lse_shape = (self.nheads, q.shape[0])
            self.lse_strides = (0, q.shape[0])  # (batch, head): packed rows are already offset
            self.rng_cols = max_seqlen_k  # dropout counters: row * rng_cols + key
        else:
            self.batch, self.seqlen_q = q.shape[0], q.shape[1]
            self.seqlen_k = k.shape[1]
            self.rows_q, self.rows_k = self.seqlen_q, self.seqlen_k
            self.cu_q = self.cu_k = None
            self.lse_shape = (self.batch, self.nheads, self.seqlen_q)
            self.lse_strides = (self.nheads * self.seqlen_q, self.seqlen_q)
            self.rng_cols = self.seqlen_k

    def prepare(self, t):
        return tma_ready(t)

    def tiles(self, t, rows, hd, make=None):
        """A ``[1, rows, 1, hd]``-box descriptor over ``t`` (``make``: the descriptor factory,
        default ``descriptor``; the Gluon kernels pass theirs)."""
        make = make or descriptor
        if not self.varlen:
            return make(t, rows, hd)
        if t.shape[0] == 0:
            # A descriptor needs a non-empty shape; with no rows no program reads or writes one.
            t = t.new_zeros((1, *t.shape[1:]))
        return make(t.unsqueeze(0), rows, hd)

    def seq_args(self, placeholder):
        cu_q = self.cu_q if self.varlen else placeholder
        cu_k = self.cu_k if self.varlen else placeholder
        return cu_q, cu_k, *self.lse_strides


def fast_descriptor(t, rows, hd):
    """``descriptor(t, rows, hd)`` (a ``[1, rows, 1, hd]`` box over ``t``) without
    ``TensorDescriptor``'s per-call checks where they are known to pass: ``t`` is
    ``tma_ready`` (16-byte aligned base and strides, unit last stride; checked again here),
    non-empty, and the box valid (``tma.checks_pass``).  Anything else goes
    through the checked constructor, which raises as before."""
    shape, strides = list(t.shape), list(t.stride())
    if not checks_pass(shape, strides, t, rows, hd):
        return descriptor(t, rows, hd)
    desc = object.__new__(TensorDescriptor)
    desc.__dict__.update(base=t, shape=shape, strides=strides, block_shape=[1, rows, 1, hd], padding="zero")
    return desc



def dropout_args(dropout: tuple | None) -> dict:
    """``dropout = (p, seed, offset)`` or None -> kernel arguments (see ``flashtile/kernels/dropout.py``)."""
    p, seed, offset = dropout if dropout is not None else (0.0, 0, 0)
    return dict(HAS_DROPOUT=p > 0, dropout_p=float(p), seed=int(seed), rng_offset=int(offset))


def max_seqlens(cu_q, cu_k, max_q, max_k):
    """The longest query and key sequence of a packed batch (a host sync for each not given)."""
    if max_q is None:
        max_q = int((cu_q[1:] - cu_q[:-1]).max())
    if max_k is None:
        max_k = int((cu_k[1:] - cu_k[:-1]).max())
    return max_q, max_k


def unpad(x, d):
    """``x`` without the head-dim padding past ``d``.

    Contiguous like the custom ops' fake implementations promise (a copy only for padded head dims)."""
    return x[..., :d].contiguous() if x.shape[-1] != d else x
