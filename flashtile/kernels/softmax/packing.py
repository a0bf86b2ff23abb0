"""16-bit floats held as pairs in 32-bit words, and the inline PTX that works on them.

Only the cooperative kernels hold rows this way; ``word_kind`` decides, per launch, whether
a row's layout allows it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# The cooperative forward holds its chunk as loaded -- unmasked bf16 / fp16 rows as their
# own 16-bit pairs in int32 words (PAIRS = 2), anything else one element a word -- and
# recomputes the logits from it for the write: an fp32 copy of the chunk would take twice
# the registers of a 16-bit one, and registers are what bounds the rows in flight per SM.
KIND_PLAIN = tl.constexpr(0)  # one element per word, any float dtype
KIND_BF16X2 = tl.constexpr(1)
KIND_F16X2 = tl.constexpr(2)


@triton.jit
def unpack(w, h: tl.constexpr, KIND: tl.constexpr):
    """Element ``h`` (0 = low half, 1 = high half) of each word, as fp32."""
    if KIND == KIND_BF16X2:  # a bf16 is the top half of the fp32 with the same value
        bits = (w << 16) if h == 0 else (w & -65536)
        return bits.to(tl.float32, bitcast=True)
    elif KIND == KIND_F16X2:
        half = w if h == 0 else (w >> 16)
        return half.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        return w.to(tl.float32)


@triton.jit
def pack(y_lo, y_hi, KIND: tl.constexpr):
    """Two fp32 halves -> one word of two 16-bit floats (the inverse of ``unpack``)."""
    if KIND == KIND_BF16X2:
        lo = y_lo.to(tl.bfloat16).to(tl.int16, bitcast=True)
        hi = y_hi.to(tl.bfloat16).to(tl.int16, bitcast=True)
    else:
        lo = y_lo.to(tl.float16).to(tl.int16, bitcast=True)
        hi = y_hi.to(tl.float16).to(tl.int16, bitcast=True)
    return (lo.to(tl.int32) & 65535) | (hi.to(tl.int32) << 16)


@triton.jit
def _max_pairs(a, b, KIND: tl.constexpr, MIN: tl.constexpr):
    """Elementwise max (``MIN``: min) of both halves of two words at once, NaN-ignoring like
    ``tl.max``: reduces a packed chunk without unpacking it to fp32 registers."""
    op: tl.constexpr = ("min" if MIN else "max") + (".bf16x2" if KIND == KIND_BF16X2 else ".f16x2")
    return tl.inline_asm_elementwise(op + " $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def max_bf16x2(a, b):
    return _max_pairs(a, b, KIND_BF16X2, False)


@triton.jit
def min_bf16x2(a, b):
    return _max_pairs(a, b, KIND_BF16X2, True)


@triton.jit
def max_f16x2(a, b):
    return _max_pairs(a, b, KIND_F16X2, False)


@triton.jit
def min_f16x2(a, b):
    return _max_pairs(a, b, KIND_F16X2, True)


@triton.jit
def opaque(w):
    """``w``, through an instruction the compiler cannot see through: the write recomputes
    the logits from the held words instead of keeping the first pass's fp32 copies."""
    return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [w], dtype=tl.int32, is_pure=False, pack=1)


def word_kind(x, mask, x_strides, n_cols, out_dtype):
    """How the cooperative forward holds its chunk: unmasked 16-bit rows that are contiguous
    and start on a word (y in x's dtype) as pairs in int32 words, anything else one element
    a word."""
    if mask is not None or x.dtype != out_dtype or x.dtype not in (torch.bfloat16, torch.float16):
        return KIND_PLAIN.value
    if n_cols % 2 or x_strides[3] != 1 or any(st % 2 for st in x_strides[:3]) or x.data_ptr() % 4:
        return KIND_PLAIN.value
    return (KIND_BF16X2 if x.dtype == torch.bfloat16 else KIND_F16X2).value
