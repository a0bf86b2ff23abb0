"""The FP8 forward's key order: P handed to its P V wgmma without moving data between threads.

An FP8 wgmma takes its A operand as four adjacent keys a 32-bit register, while the score
accumulator gives each thread pairs of adjacent keys, so the plain layout conversion of P
shuffles the tile between threads (16-bit operands hold pairs, as the scores do: no issue
there).  Since ``P V`` sums over keys, any order of the keys serves, provided P's columns and
V's rows take the same one.  Within every 16 keys, reading the key bits ``c3 c2 c1 c0`` as
``c2 c1 c3 c0`` (``KEY_BITS_ORDER``) puts in each thread exactly the keys the operand wants of
it: the conversion becomes a renaming of registers, which ``key_ordered_operand`` asserts at
compile time, and ``wgmma_key_order`` stores V's keys in that order on the host.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

# Key bit i of the relabelled order is bit KEY_BITS_ORDER[i] of the original (bits c3 c2 c1 c0,
# most significant first, as the reshape below splits them).
KEY_BITS_ORDER = (1, 2, 0, 3)
KEY_ORDER_DIMS: gl.constexpr = gl.constexpr((0, 1) + tuple(2 + i for i in KEY_BITS_ORDER))


@gluon.jit
def key_ordered_operand(p, p_layout: gl.constexpr, dtype: gl.constexpr):
    """FP8 P (fp32, the score tile's wgmma layout) in the layout of the e4m3 A operand
    (``p_layout``) of its P V wgmma, as ``dtype`` (e4m3, or fp16 cast to e4m3 at the wgmma),
    keys in the relabelled order; V must be in it too (``wgmma_key_order``)."""
    ROWS: gl.constexpr = p.shape[0]
    KEYS: gl.constexpr = p.shape[1]
    D: gl.constexpr = KEY_ORDER_DIMS
    x = p.reshape([ROWS, KEYS // 16, 2, 2, 2, 2]).permute(D[0], D[1], D[2], D[3], D[4], D[5])
    return gl.convert_layout(x.reshape([ROWS, KEYS]), p_layout, assert_trivial=True).to(dtype)


@functools.lru_cache(maxsize=64)
def _key_order_index(padded_keys: int, device: torch.device) -> torch.Tensor:
    # Position k of every 16 keys takes key c(k): the kernel's relabelling applied to key indices.
    order = (0,) + tuple(1 + i for i in KEY_BITS_ORDER)
    return torch.arange(padded_keys, device=device).view(-1, 2, 2, 2, 2).permute(order).reshape(-1)


def wgmma_key_order(v_t: torch.Tensor) -> torch.Tensor:
    """``v_t (b, hk, d, n)`` (keys contiguous) with the keys of every 16 in the order the FP8
    P operand takes them, zero-padded to a multiple of 16 keys: a new ``(b, hk, d, 16 * ceil(n /
    16))`` tensor (one pass over V)."""
    n = v_t.shape[-1]
    padded = -(-n // 16) * 16
    raw = v_t.view(torch.uint8)  # bytes: no fp8 arithmetic happens here
    if padded != n:
        raw = torch.nn.functional.pad(raw, (0, padded - n))
    return raw.index_select(-1, _key_order_index(padded, v_t.device)).view(v_t.dtype)
