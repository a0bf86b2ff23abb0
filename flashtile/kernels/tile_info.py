"""Which work a program does: its tile, its (batch, head), its sequence's rows.

One flat grid dimension everywhere (CUDA caps grid y/z at 65535), and the rows of a packed
(varlen) batch read from cu_seqlens -- clamped into the packed tensors, so no value of
cu_seqlens can move a read or write outside them.  Which key / query tiles a program visits
is ``flashtile/kernels/masking.py``'s.
"""

import triton
import triton.language as tl


@triton.jit
def tile_and_head(seqlen, BLOCK: tl.constexpr, HEAVY_LAST: tl.constexpr):
    """Map the 1-D program id to (tile index, batch * head).

    One flat grid dimension: CUDA caps grid y/z at 65535, which batch * heads can exceed.
    Tiles of one head are adjacent so they share that head's K/V stream in L2.  With a
    causal-like mask later tiles have more work (HEAVY_LAST): they start first, so the
    longest programs do not run last on a half-empty GPU.
    """
    pid = tl.program_id(0)
    num_tiles = tl.cdiv(seqlen, BLOCK)
    tile = pid % num_tiles
    if HEAVY_LAST:
        tile = num_tiles - 1 - tile
    return tile, pid // num_tiles


@triton.jit
def dealt_tile(t, num_items, num_tiles, SPREAD_HEADS: tl.constexpr, HEAVY_LAST: tl.constexpr):
    """Work item ``t`` of a persistent or flat grid -> (tile index, batch * head).

    Without a causal-like mask every tile of a head costs the same, and a head's tiles are
    adjacent (they share its K/V or Q/dO in L2).  With one (``SPREAD_HEADS``), the items are
    dealt tile by tile across all heads, heaviest first -- the last query tiles
    (``HEAVY_LAST``, forward) or the first key tiles (backward) -- so the programs' shares
    come out even and the last wave is short.
    """
    if SPREAD_HEADS:
        heads = num_items // num_tiles
        tile = t // heads
        if HEAVY_LAST:
            tile = num_tiles - 1 - tile
        return tile, t % heads
    return t % num_tiles, t // num_tiles


@triton.jit
def clamped_span(CU, b, rows):
    # Sequence b's rows [start, end) clamped into the packed tensor's [0, rows): the host
    # checks cu_seqlens, but not under CUDA-graph capture or torch.compile tracing, and a
    # bad value must never turn into an out-of-bounds read or write.
    start = tl.minimum(tl.maximum(tl.load(CU + b), 0), rows)
    end = tl.minimum(tl.maximum(tl.load(CU + b + 1), start), rows)
    return start, end - start


@triton.jit
def sequence_bounds(CU_Q, CU_K, b, seqlen_q, seqlen_k, VARLEN: tl.constexpr):
    """(q_start, seqlen_q, k_start, seqlen_k) of batch entry ``b``.

    Dense: ``seqlen_q``/``seqlen_k`` are the lengths.  Packed: they are the packed tensors'
    row counts, and sequence ``b`` is read from cu_seqlens, clamped into them.
    """
    if VARLEN:
        q_start, seqlen_q = clamped_span(CU_Q, b, seqlen_q)
        k_start, seqlen_k = clamped_span(CU_K, b, seqlen_k)
        return q_start, seqlen_q, k_start, seqlen_k
    return 0, seqlen_q, 0, seqlen_k
