"""The decode benchmark's peers compute the same attention (checked on CPU tensors)."""

import pytest
import torch

import flashtile
from flashtile.bench.decode import _make_fn


@pytest.mark.parametrize("impl", ["flashtile_nosplit", "flashtile_paged16", "flashtile_prefill", "flashtile_append",
                                  "flashtile_rotary_append", "sdpa_math"])
def test_decode_peers_agree_with_flashtile(impl):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 1, 8, 64, generator=gen)
    k_cache, v_cache = (torch.randn(2, 64, 2, 64, generator=gen) for _ in range(2))
    want = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    fn = _make_fn(impl, q, k_cache, v_cache, torch.Generator().manual_seed(1))
    for _ in range(2):  # a peer that appends leaves the shared cache as it was, call after call
        got = fn()
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(k_cache, k_before) and torch.equal(v_cache, v_before)


def test_growing_cache_views_grow_one_key_every_step_of_layers():
    from flashtile.bench.decode import growing_cache_views

    storage = torch.arange(2 * 3 * 20 * 4, dtype=torch.float32).reshape(2, -1)
    next_kv = growing_cache_views(storage, start=5, layers=2, nheads_k=3, d=4)
    shapes = []
    for _ in range(6):
        k, v = next_kv()
        n = k.shape[1]
        shapes.append(n)
        # (1, nheads_k, n, d) seen transposed: head h, key j at storage offset (h * n + j) * d.
        assert k.stride() == v.stride() == (3 * n * 4, 4, n * 4, 1)
        assert torch.equal(k[0, 2, 1], storage[0, (1 * n + 2) * 4:(1 * n + 2) * 4 + 4])
        assert torch.equal(v[0, 0, 2], storage[1, (2 * n) * 4:(2 * n) * 4 + 4])
    assert shapes == [5, 5, 6, 6, 7, 7]
