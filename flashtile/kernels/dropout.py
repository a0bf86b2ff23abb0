"""The dropout keep-mask inside the attention kernels (the rule lives in ``flashtile.dropout``).

Every kernel that touches P -- the forward, the dK/dV and the dQ kernel -- rebuilds the same
(queries x keys) tile of the mask from (seed, offset, row, key), so the mask is never stored.
"""

import triton
import triton.language as tl

from flashtile import dropout as _dropout

PHILOX_ROUNDS = tl.constexpr(_dropout.PHILOX_ROUNDS)
KEYS_PER_BLOCK = tl.constexpr(_dropout.KEYS_PER_BLOCK)


@triton.jit
def dropout_scale(rng, row0, col0, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                  KEYS_FIRST: tl.constexpr = False):
    """The (BLOCK_Q queries x BLOCK_K keys) tile from (row0, col0) of ``flashtile.dropout.keep_mask``,
    as 1 / (1 - p) where a probability is kept and 0 where it is dropped (1 without dropout;
    laid out keys x queries with ``KEYS_FIRST``).  ``col0`` and ``BLOCK_K`` are multiples of 32.
    ``rng = (dropout_p, seed, rng_offset, rng_cols)``: the attention kernels' last four runtime
    arguments, bundled once per kernel.

    One Philox call serves 8 keys of one row, but *which* 8 is chosen for the tensor cores'
    accumulator layout on sm_90: there a thread holds the column pairs 2q, 2q + 1 (+8, +16,
    +24) of each 32-key block, so key 32 * blk + 8 * j + 2 * q + b takes half b of word j of
    call (row, 4 * blk + q).  Built that way the tile needs no register shuffle and no trip
    through shared memory to meet P.  Consecutive keys per call would need both: +1176
    instructions per forward program over no dropout (d = 128, sm_90 SASS) against +800
    this way, and forward + backward +93 % / +118 % (non-causal / causal, N = 4k) against
    +89 % / +99 % (docs/tuning.md, "Dropout").
    """
    dropout_p, seed, rng_offset, rng_cols = rng
    if HAS_DROPOUT:
        tl.static_assert(BLOCK_K % 32 == 0, "dropout needs key tiles of a multiple of 32")
        NB: tl.constexpr = BLOCK_K // 32
        calls_per_row = tl.cdiv(rng_cols, 32) * 4
        rows = (row0 + tl.arange(0, BLOCK_Q)).to(tl.int64)
        blocks = col0 // 32 + tl.arange(0, NB)
        lanes = tl.arange(0, 4)
        counters = rng_offset + (rows * calls_per_row)[:, None, None] + (blocks * 4)[None, :, None] + lanes[None, None, :]
        r0, r1, r2, r3 = tl.randint4x(seed, counters, PHILOX_ROUNDS)
        # tl.join adds a minor axis, so words[..., x, y] = word 2x + y: numbers is [Q, NB, q, j (2 x 2), b].
        words = tl.join(tl.join(r0, r2), tl.join(r1, r3))
        numbers = tl.join(words & 0xFFFF, words >> 16)
        # Kept iff u + 1/2 > p * 2^16, i.e. u >= floor(p * 2^16 + 1/2) (exact in float32).
        threshold = tl.full([], dropout_p * 65536.0 + 0.5, tl.float32).to(tl.int32)
        keep = numbers >= threshold
        if KEYS_FIRST:
            keep = tl.reshape(tl.permute(keep, (1, 3, 4, 2, 5, 0)), [BLOCK_K, BLOCK_Q])
        else:
            keep = tl.reshape(tl.permute(keep, (0, 1, 3, 4, 2, 5)), [BLOCK_Q, BLOCK_K])
        drop = tl.where(keep, 1.0 / (1.0 - dropout_p), 0.0)
    else:
        drop = 1.0
    return drop
