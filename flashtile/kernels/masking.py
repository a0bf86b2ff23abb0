"""Which tiles to visit, and which of them need an element-wise mask.

The rule is the band of ``flashtile/masking.py``: query ``i`` sees key ``j`` iff
``0 <= j < seqlen_k`` and ``diag(i) - left <= j <= diag(i) + right`` with
``diag(i) = i + seqlen_k - seqlen_q`` (``left``/``right`` unused when the matching
``MASK_LEFT``/``MASK_RIGHT`` flag is off).  The kernels split the tiles a program visits
into three runs::

    [lo, full_lo)        tiles cut by the band's lower edge   -> masked
    [full_lo, full_hi)   tiles wholly inside the band         -> no mask at all
    [full_hi, hi)        tiles cut by the upper edge / the end -> masked

so the hot loop over interior tiles carries no comparison, and tiles outside the band are
never loaded (causal skips ~half the work).  All bounds are multiples of the tile size.
Integer division in Triton truncates toward zero, so every value is clamped to >= 0
before it is rounded.
"""

import triton
import triton.language as tl


@triton.jit
def _floor_to(x, block: tl.constexpr):
    return (tl.maximum(x, 0) // block) * block


@triton.jit
def _ceil_to(x, block: tl.constexpr):
    return ((tl.maximum(x, 0) + block - 1) // block) * block


@triton.jit
def key_tiles(
    m0,
    seqlen_q,
    seqlen_k,
    window_left,
    window_right,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASK_LEFT: tl.constexpr,
    MASK_RIGHT: tl.constexpr,
):
    """Key tiles for the query tile starting at row ``m0`` (forward and dQ kernels).

    Keys past ``seqlen_k`` read as zeros through TMA (or, in a packed batch, as the next
    sequence's keys) and would score like real keys, so the last partial tile always goes to
    the masked run, and no tile starting at or past ``seqlen_k`` is visited.
    """
    off = seqlen_k - seqlen_q
    hi = seqlen_k
    full_hi = seqlen_k
    if MASK_RIGHT:
        hi = tl.minimum(hi, m0 + BLOCK_M + off + window_right)  # last row's last key + 1
        full_hi = tl.minimum(full_hi, m0 + off + window_right + 1)  # first row's last key + 1
    lo = 0
    full_lo = 0
    if MASK_LEFT:
        lo = tl.maximum(m0 + off - window_left, 0)  # first row's first key
        full_lo = m0 + BLOCK_M - 1 + off - window_left  # last row's first key
    hi = tl.maximum(hi, 0)
    lo = _floor_to(lo, BLOCK_N)
    hi_tiles = _ceil_to(hi, BLOCK_N)
    full_lo = tl.minimum(tl.maximum(_ceil_to(full_lo, BLOCK_N), lo), hi_tiles)
    full_hi = tl.minimum(tl.maximum(_floor_to(full_hi, BLOCK_N), full_lo), hi_tiles)
    return lo, full_lo, full_hi, hi


@triton.jit
def query_tiles(
    n0,
    seqlen_q,
    seqlen_k,
    window_left,
    window_right,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASK_LEFT: tl.constexpr,
    MASK_RIGHT: tl.constexpr,
):
    """Query tiles for the key tile starting at column ``n0`` (dK/dV kernel).

    Rows past ``seqlen_q`` need no mask: they read as zeros (or, in a packed batch, as the
    next sequence's finite rows) and their LSE as +inf, so their recomputed probabilities
    are exactly 0.
    """
    off = seqlen_k - seqlen_q
    lo = 0
    full_lo = 0
    if MASK_RIGHT:
        lo = n0 - off - window_right  # first row that sees the tile's first key
        full_lo = n0 + BLOCK_N - 1 - off - window_right  # first row that sees all its keys
    hi = seqlen_q
    full_hi = seqlen_q + BLOCK_M  # past every row tile: no left edge to cut
    if MASK_LEFT:
        hi = tl.minimum(hi, n0 + BLOCK_N - off + window_left)  # last row that sees its last key + 1
        full_hi = n0 - off + window_left + 1  # last row that sees its first key + 1
    hi = tl.maximum(hi, 0)
    lo = tl.minimum(_floor_to(lo, BLOCK_M), _ceil_to(hi, BLOCK_M))
    hi_tiles = _ceil_to(hi, BLOCK_M)
    full_lo = tl.minimum(tl.maximum(_ceil_to(full_lo, BLOCK_M), lo), hi_tiles)
    full_hi = tl.minimum(tl.maximum(_floor_to(full_hi, BLOCK_M), full_lo), hi_tiles)
    return lo, full_lo, full_hi, hi


@triton.jit
def band_mask(
    q_idx,
    k_idx,
    seqlen_q,
    seqlen_k,
    window_left,
    window_right,
    MASK_LEFT: tl.constexpr,
    MASK_RIGHT: tl.constexpr,
):
    """Element-wise visibility ``flashtile.masking.visible`` of a tile.

    ``q_idx`` / ``k_idx`` are query and key indices shaped to broadcast to the tile, in
    either orientation: ``(offs_m[:, None], offs_n[None, :])`` for a (queries x keys) tile,
    ``(offs_m[None, :], offs_n[:, None])`` for its transpose.
    """
    diag = q_idx + (seqlen_k - seqlen_q)
    ok = k_idx < seqlen_k
    if MASK_RIGHT:
        ok = ok & (k_idx <= diag + window_right)
    if MASK_LEFT:
        ok = ok & (k_idx >= diag - window_left)
    return ok
