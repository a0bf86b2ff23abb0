"""The FP8 forward's key order (``HopperFp8Config.key_order``), on the CPU.

The kernel relabels P's keys (``fp8_key_order.key_ordered_operand``: within every 16, key bits
``c3 c2 c1 c0`` read as ``c2 c1 c3 c0``) so that its conversion to the wgmma operand moves no
data, and ``fp8_key_order.wgmma_key_order`` stores V's keys in the same order: P V must not
change.  Whether the relabelled layout is the operand's is checked by the compiler
(``assert_trivial``, in the offline compile of the ``key_order`` variants).
"""

import pytest
import torch

key_order = pytest.importorskip("flashtile.kernels.hopper.fp8_key_order")


def _kernel_relabel(p):
    # What key_ordered_operand does to the key axis, in torch.
    rows, keys = p.shape
    return p.reshape(rows, keys // 16, 2, 2, 2, 2).permute(*key_order.KEY_ORDER_DIMS.value).reshape(rows, keys)


def _source_key(k):
    # Operand position k holds key c(k): bits (k3 k2 k1 k0) of k give c = (k1 k3 k2 k0).
    k0, k1, k2, k3 = k & 1, (k >> 1) & 1, (k >> 2) & 1, (k >> 3) & 1
    return (k & ~15) | (k1 << 3) | (k3 << 2) | (k2 << 1) | k0


def test_kernel_relabelling_is_the_documented_bit_order():
    keys = torch.arange(128)
    assert torch.equal(_kernel_relabel(keys[None])[0], _source_key(keys))


@pytest.mark.parametrize("seqlen_k", [1, 16, 17, 130])
def test_v_in_key_order_keeps_p_v(seqlen_k):
    gen = torch.Generator().manual_seed(seqlen_k)
    v = torch.randn(2, 3, 8, seqlen_k, generator=gen)  # (batch, kv heads, d, keys)
    v8 = v.to(torch.float8_e4m3fn)
    ordered = key_order.wgmma_key_order(v8)
    padded = -(-seqlen_k // 16) * 16
    assert ordered.shape == (2, 3, 8, padded) and ordered.dtype == torch.float8_e4m3fn
    src = _source_key(torch.arange(padded))
    valid = src < seqlen_k
    assert torch.equal(ordered[..., valid].view(torch.uint8), v8[..., src[valid]].view(torch.uint8))
    assert (ordered[..., ~valid].view(torch.uint8) == 0).all(), "keys past the end must read as zeros"
    # P V with P relabelled as the kernel does and V in key order: the product of the originals.
    p = torch.rand(5, padded, generator=gen)
    p[:, seqlen_k:] = 0  # keys past the end are masked
    want = p[:, :seqlen_k] @ v8.float()[0, 0].T
    got = _kernel_relabel(p) @ ordered.float()[0, 0].T
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
