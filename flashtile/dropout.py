"""Attention dropout from a counter-based RNG: the mask is a pure function of (seed, offset, position).

Neither pass stores the ``seqlen_q x seqlen_k`` mask.  The forward draws the keep/drop
decisions from Philox-4x32-10 and the backward draws the same numbers again.  One Philox call
gives four 32-bit words = eight 16-bit numbers, for 8 keys of one row: keys go in blocks of 32,
and key ``col = 32 * blk + 8 * j + 2 * q + b`` takes half ``b`` (low when 0) of word ``j`` of the
call with counter ``offset + row * 4 * ceil(seqlen_k / 32) + 4 * blk + q``.  (That order matches
the sm_90 tensor-core accumulator layout, see ``flashtile/kernels/dropout.py``.)  A key is kept
when its number ``u`` satisfies ``u + 1/2 > p * 2^16`` (``u >= round(p * 2^16)``, p in float32).
``row`` is the query's row in the LSE, ``(batch * nheads + head) * seqlen_q + i`` for dense
inputs, ``head * total_q + token`` for packed ones (``seqlen_k`` is then the longest key
sequence).  The Triton kernels use ``tl.randint4x``; :func:`philox4x32` is the same generator
written with torch integer ops, bit-for-bit equal, so the CPU path and the tests see the very
same mask.

``(seed, offset)`` come from torch's generator of the device (``torch.manual_seed`` makes a
run reproducible), and the offset advances by the number of counters used, as PyTorch's
own CUDA dropout does.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_PHILOX_A, _PHILOX_B = 0xD2511F53, 0xCD9E8D57
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85


def _mul32(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit halves of the 64-bit product a * b, for a constant a and uint32 values b.

    int64 cannot hold the full product, so b is split into 16-bit halves (each partial
    product fits in 48 bits).
    """
    lo16, hi16 = b & 0xFFFF, b >> 16
    t = a * lo16
    u = a * hi16
    high = (u + (t >> 16)) >> 16
    low = (((u & 0xFFFF) << 16) + t) & _MASK32
    return high, low


def philox4x32(seed: int, counters: torch.Tensor, rounds: int = 10) -> tuple[torch.Tensor, ...]:
    """The four uint32 words (as int64) of Philox-4x32-``rounds`` per int64 counter, identical to
    ``tl.randint4x(seed, counters, rounds)``."""
    c = counters.to(torch.int64)
    c0, c1 = c & _MASK32, (c >> 32) & _MASK32
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32
    for _ in range(rounds):
        hi_b, lo_b = _mul32(_PHILOX_B, c2)
        hi_a, lo_a = _mul32(_PHILOX_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _KEY_A) & _MASK32, (k1 + _KEY_B) & _MASK32
    return c0, c1, c2, c3


def philox_uniform(seed: int, counters: torch.Tensor) -> torch.Tensor:
    """Uniform float32 in [0, 1) for each int64 counter, identical to ``tl.rand(seed, counters)``."""
    c0 = philox4x32(seed, counters)[0]
    # Triton's uint -> float: reinterpret as int32, fold negatives, scale by ~2^-31.
    x = torch.where(c0 >= 2**31, c0 - 2**32, c0)
    x = torch.where(x < 0, -x - 1, x).to(torch.int32)
    return x.to(torch.float32) * torch.tensor(4.6566127342e-10, dtype=torch.float32)


KEYS_PER_BLOCK = 32  # keys sharing one group of 4 Philox calls (8 keys per call)
# Philox rounds of the dropout mask: 10, Random123's default, a safety margin over the 7 that
# already pass BigCrush (7 would save 9 % of forward + backward at d = 128, N = 4k,
# dropout 0.1; docs/tuning.md).  The kernels read this constant too, so their masks and the
# CPU path's agree.
PHILOX_ROUNDS = 10


def counters_per_row(row_length: int) -> int:
    """Philox counters one query row consumes: 4 per started block of 32 keys."""
    return 4 * -(-row_length // KEYS_PER_BLOCK)


def keep_threshold(dropout_p: float) -> int:
    """The smallest kept 16-bit number: floor(p * 2^16 + 1/2) with p rounded to float32, as the kernels compute it."""
    import numpy as np

    return int(np.floor(float(np.float32(dropout_p)) * 65536.0 + 0.5))


def keep_mask(seed: int, offset: int, rows: torch.Tensor, cols: torch.Tensor, row_length: int, dropout_p: float):
    """Boolean keep-mask (probability ``1 - dropout_p``, to within 2^-17) at broadcast ``rows`` x ``cols``."""
    cols = cols.to(torch.int64)
    block, j, q, b = cols // KEYS_PER_BLOCK, (cols // 8) % 4, (cols // 2) % 4, cols % 2
    words = philox4x32(seed, offset + rows.to(torch.int64) * counters_per_row(row_length) + 4 * block + q, PHILOX_ROUNDS)
    word = torch.where(j < 2, torch.where(j == 0, words[0], words[1]), torch.where(j == 2, words[2], words[3]))
    u16 = (word >> (16 * b)) & 0xFFFF
    return u16 >= keep_threshold(dropout_p)


_captures: list[list] = []


class capture:
    """Test hook: records the ``(seed, offset)`` of every dropout call made inside the block.

    >>> with flashtile.dropout.capture() as calls:
    ...     out = flashtile.flash_attn_func(q, k, v, dropout_p=0.1)
    >>> seed, offset = calls[0]
    >>> mask = flashtile.dropout.dropout_mask(seed, offset, batch, nheads, seqlen_q, seqlen_k, 0.1)
    """

    def __enter__(self):
        self.calls = []
        _captures.append(self.calls)
        return self.calls

    def __exit__(self, *exc):
        _captures.remove(self.calls)
        return False


def next_seed_offset(device: torch.device, counters: int) -> tuple[int, int]:
    """Draw ``(seed, offset)`` for one call from the device's torch generator and advance it."""
    seed, offset = _draw(device, counters)
    for calls in _captures:
        calls.append((seed, offset))
    return seed, offset


def _draw(device: torch.device, counters: int) -> tuple[int, int]:
    if device.type == "cuda":
        gen = torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
        seed, offset = gen.initial_seed(), gen.get_offset()
        # Philox yields 4 numbers per counter in torch's own kernels; advance in those units.
        gen.set_offset(offset + (counters + 3) // 4 * 4)
        return int(seed), int(offset)
    # The CPU generator (Mersenne Twister) has no offset: draw a fresh seed instead.
    return int(torch.randint(0, 2**62, (1,)).item()), 0


def dropout_mask(seed: int, offset: int, batch: int, nheads: int, seqlen_q: int, seqlen_k: int, dropout_p: float,
                 device=None) -> torch.Tensor:
    """The realised keep-mask ``(batch, nheads, seqlen_q, seqlen_k)`` of a dense call (tests only)."""
    rows = torch.arange(batch * nheads * seqlen_q, device=device).reshape(batch, nheads, seqlen_q, 1)
    cols = torch.arange(seqlen_k, device=device)
    return keep_mask(seed, offset, rows, cols, seqlen_k, dropout_p)
