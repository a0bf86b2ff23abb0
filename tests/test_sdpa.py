"""flashtile.scaled_dot_product_attention against PyTorch's own, on every routing path."""

import pytest
import torch
import torch.nn.functional as F

import flashtile


def _qkv(b, h, hk, lq, lk, d, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, lq, d, generator=g)
    k = torch.randn(b, hk, lk, d, generator=g)
    v = torch.randn(b, hk, lk, d, generator=g)
    return tuple(t.requires_grad_(requires_grad) for t in (q, k, v))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lq,lk", [(17, 17), (9, 23), (23, 9)])
def test_matches_torch(causal, lq, lk):
    q, k, v = _qkv(2, 4, 4, lq, lk, 16, requires_grad=True)
    ours = flashtile.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.3)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.3)
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-4)
    g = torch.randn_like(ours)
    for a, b in zip(torch.autograd.grad(ours, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)


def test_gqa_needs_enable_gqa():
    q, k, v = _qkv(1, 8, 2, 10, 10, 16)
    with pytest.raises(ValueError, match="enable_gqa"):
        flashtile.scaled_dot_product_attention(q, k, v)
    ours = flashtile.scaled_dot_product_attention(q, k, v, enable_gqa=True, is_causal=True)
    ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=True, is_causal=True)
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-4)


def test_key_padding_mask_goes_through_varlen():
    q, k, v = _qkv(3, 2, 2, 6, 11, 16, seed=1, requires_grad=True)
    keep = torch.ones(3, 1, 1, 11, dtype=torch.bool)
    keep[0, ..., 7:] = False
    keep[1, ..., :] = False  # a batch entry with no key at all: zeros, as PyTorch
    ours = flashtile.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-4)
    g = torch.randn_like(ours)
    for a, b in zip(torch.autograd.grad(ours, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("mask_kind", ["bool-full", "additive"])
def test_general_masks_take_the_documented_slow_path(mask_kind):
    q, k, v = _qkv(2, 2, 2, 5, 7, 8, seed=2)
    g = torch.Generator().manual_seed(3)
    mask = torch.rand(2, 2, 5, 7, generator=g) > 0.3 if mask_kind == "bool-full" else torch.randn(5, 7, generator=g)
    torch.testing.assert_close(flashtile.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                               F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


def test_validation():
    q, k, v = _qkv(1, 2, 2, 4, 4, 8)
    with pytest.raises(ValueError, match="attn_mask and is_causal"):
        flashtile.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(4, 4, dtype=torch.bool), is_causal=True)
    with pytest.raises(ValueError, match="query"):
        flashtile.scaled_dot_product_attention(q[0], k, v)
    with pytest.raises(TypeError, match="key"):
        flashtile.scaled_dot_product_attention(q, None, v)
