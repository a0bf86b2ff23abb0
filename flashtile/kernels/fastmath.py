"""exp2 on the FMA pipe, so a tile's exponentials can be shared between two hardware units.

Every score costs one exp2.  On sm_90 the MUFU unit that evaluates it issues 16 per clock
per SM, an eighth of the FP32 FMA rate, so where the tensor cores finish a tile quickly
(head dim 64, or FP8 operands at twice the bf16 rate) the exponentials rather than the
matrix products bound the forward loop.  A polynomial costs about nine FP32 and integer
instructions per exp2 (six on the FMA pipe): evaluating every other column that way moves
half of the work off MUFU.  Experimental (``FLASHTILE_EXP2_SPLIT=1``) until measured on a GPU.
"""

import os

import triton
import triton.language as tl

# Read by the forward launchers (bf16 / fp16 / fp8 inputs only); off until measured.
EXP2_SPLIT = os.environ.get("FLASHTILE_EXP2_SPLIT", "0") == "1"

# 2^f for f in [-1/2, 1/2]: degree 3, coefficients fitted (weighted least squares towards
# minimax) for relative error, 7.5e-5 at most -- below the 2^-8 of a bf16 probability and
# the 2^-11 of an fp16 one.  float32 inputs keep the exact MUFU exp2.
EXP2_C0 = tl.constexpr(0.9999280571937561)
EXP2_C1 = tl.constexpr(0.6932606101036072)
EXP2_C2 = tl.constexpr(0.24261128902435303)
EXP2_C3 = tl.constexpr(0.05517362803220749)
# 1.5 * 2^23: adding it rounds a float32 of magnitude < 2^22 to an integer n, which then sits
# in the low mantissa bits (two's complement), and (bits << 23) is n << 23 exactly.
ROUND_MAGIC = tl.constexpr(12582912.0)


@triton.jit
def exp2_fma(x):
    """2^x on the FMA and integer pipes only: x = n + f with n = round(x) by the magic-number
    addition (no float-to-int conversion instruction: those are low-throughput too), a polynomial for
    2^f, and n added to the result's exponent bits.  Exactly 0 below 2^-125 (where 2^f < 1
    would push the exponent field to 0), so -inf gives 0 as masked scores need; the select
    also discards what the bit arithmetic made of such inputs."""
    t = x + ROUND_MAGIC
    f = x - (t - ROUND_MAGIC)
    p = ((EXP2_C3 * f + EXP2_C2) * f + EXP2_C1) * f + EXP2_C0
    bits = p.to(tl.int32, bitcast=True) + (t.to(tl.int32, bitcast=True) << 23)
    return tl.where(x < -125.0, 0.0, bits.to(tl.float32, bitcast=True))


@triton.jit
def exp2_tile(x, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr):
    """exp2 of a (BLOCK_M, BLOCK_N) tile; with ``SPLIT`` the odd columns go to :func:`exp2_fma`.

    Odd/even columns, not halves: in the tensor-core accumulator layout a thread holds column
    pairs (2q, 2q + 1), so splitting the minor axis of size 2 moves no data between threads.
    """
    if SPLIT:
        even, odd = tl.split(tl.reshape(x, [BLOCK_M, BLOCK_N // 2, 2]))
        return tl.reshape(tl.join(tl.math.exp2(even), exp2_fma(odd)), [BLOCK_M, BLOCK_N])
    return tl.math.exp2(x)
