"""``flashtile.compat``: flash-attn 2.8's names, signatures, defaults and return conventions.

The signatures below are written out from flash-attn 2.8's documentation
(``flash_attn.flash_attn_interface``, ``flash_attn.bert_padding``,
``flash_attn.layers.rotary``): a change to any compat function that would break code
written for flash-attn fails here.
"""

import inspect

import pytest
import torch

import flashtile
from flashtile import compat

REQUIRED = inspect.Parameter.empty
_ATTN_OPTIONS = [
    ("dropout_p", 0.0), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)), ("softcap", 0.0),
    ("alibi_slopes", None), ("deterministic", False), ("return_attn_probs", False),
]
FLASH_ATTN_2_8 = {
    "flash_attn_func": [("q", REQUIRED), ("k", REQUIRED), ("v", REQUIRED), *_ATTN_OPTIONS],
    "flash_attn_qkvpacked_func": [("qkv", REQUIRED), *_ATTN_OPTIONS],
    "flash_attn_kvpacked_func": [("q", REQUIRED), ("kv", REQUIRED), *_ATTN_OPTIONS],
    "flash_attn_varlen_func": [
        ("q", REQUIRED), ("k", REQUIRED), ("v", REQUIRED), ("cu_seqlens_q", REQUIRED), ("cu_seqlens_k", REQUIRED),
        ("max_seqlen_q", REQUIRED), ("max_seqlen_k", REQUIRED), *_ATTN_OPTIONS, ("block_table", None),
    ],
    "flash_attn_varlen_qkvpacked_func": [("qkv", REQUIRED), ("cu_seqlens", REQUIRED), ("max_seqlen", REQUIRED),
                                         *_ATTN_OPTIONS],
    "flash_attn_varlen_kvpacked_func": [
        ("q", REQUIRED), ("kv", REQUIRED), ("cu_seqlens_q", REQUIRED), ("cu_seqlens_k", REQUIRED),
        ("max_seqlen_q", REQUIRED), ("max_seqlen_k", REQUIRED), *_ATTN_OPTIONS,
    ],
    "flash_attn_with_kvcache": [
        ("q", REQUIRED), ("k_cache", REQUIRED), ("v_cache", REQUIRED), ("k", None), ("v", None),
        ("rotary_cos", None), ("rotary_sin", None), ("cache_seqlens", None), ("cache_batch_idx", None),
        ("cache_leftpad", None), ("block_table", None), ("softmax_scale", None), ("causal", False),
        ("window_size", (-1, -1)), ("softcap", 0.0), ("rotary_interleaved", True), ("alibi_slopes", None),
        ("num_splits", 0), ("return_softmax_lse", False),
    ],
    "unpad_input": [("hidden_states", REQUIRED), ("attention_mask", REQUIRED), ("unused_mask", None)],
    "pad_input": [("hidden_states", REQUIRED), ("indices", REQUIRED), ("batch", REQUIRED), ("seqlen", REQUIRED)],
    "apply_rotary_emb": [
        ("x", REQUIRED), ("cos", REQUIRED), ("sin", REQUIRED), ("interleaved", False), ("inplace", False),
        ("seqlen_offsets", 0), ("cu_seqlens", None), ("max_seqlen", None),
    ],
}


@pytest.mark.parametrize("name", sorted(FLASH_ATTN_2_8))
def test_signature_is_flash_attn_2_8s(name):
    params = list(inspect.signature(getattr(compat, name)).parameters.values())
    assert [(p.name, p.default) for p in params] == FLASH_ATTN_2_8[name]
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params), "callable positionally, as flash-attn"


def test_all_lists_exactly_the_pinned_functions():
    assert sorted(compat.__all__) == sorted(FLASH_ATTN_2_8)
    assert flashtile.compat is compat


def _qkv(b=2, n=5, h=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, n, h, d, generator=g) for _ in range(3)]


def test_flash_attn_func_return_conventions():
    q, k, v = _qkv()
    out = compat.flash_attn_func(q, k, v, causal=True)
    assert isinstance(out, torch.Tensor)
    result = compat.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert isinstance(result, tuple) and len(result) == 3
    out_p, lse, s_dmask = result
    assert s_dmask is None
    want_out, want_lse = flashtile.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert torch.equal(out_p, want_out) and torch.equal(out, want_out) and torch.equal(lse, want_lse)
    assert lse.shape == (2, 2, 5) and lse.dtype == torch.float32


def test_positional_call_as_in_flash_attn():
    q, k, v = _qkv()
    out, lse, s_dmask = compat.flash_attn_func(q, k, v, 0.0, None, True, (-1, -1), 0.0, None, False, True)
    assert s_dmask is None and torch.equal(out, flashtile.flash_attn_func(q, k, v, causal=True))


def test_varlen_return_conventions_and_block_table():
    q, k, v = (t.reshape(-1, 2, 8) for t in _qkv())
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    out, lse, s_dmask = compat.flash_attn_varlen_func(q, k, v, cu, cu, 6, 6, return_attn_probs=True)
    assert s_dmask is None and lse.shape == (2, 10)
    assert torch.equal(out, compat.flash_attn_varlen_func(q, k, v, cu, cu, 6, 6))
    # Paged keys: sequence 0's 4 keys in page 0, sequence 1's 6 in page 1 and half of page 2.
    junk = torch.full((2, 2, 8), 7.0)
    k_pages = torch.stack([k[0:4], k[4:8], torch.cat([k[8:10], junk])])
    v_pages = torch.stack([v[0:4], v[4:8], torch.cat([v[8:10], junk])])
    table = torch.tensor([[0, 0], [1, 2]], dtype=torch.int32)
    paged = compat.flash_attn_varlen_func(q, k_pages, v_pages, cu, cu, 6, 6, block_table=table, causal=True)
    assert torch.equal(paged, compat.flash_attn_varlen_func(q, k, v, cu, cu, 6, 6, causal=True))


def test_packed_return_conventions():
    q, k, v = _qkv()
    qkv = torch.stack((q, k, v), dim=2)
    out, lse, s_dmask = compat.flash_attn_qkvpacked_func(qkv, causal=True, return_attn_probs=True)
    assert s_dmask is None
    want_out, want_lse = flashtile.flash_attn_func(q, k, v, causal=True, return_lse=True)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)
    assert isinstance(compat.flash_attn_kvpacked_func(q, qkv[:, :, 1:]), torch.Tensor)
    assert len(compat.flash_attn_kvpacked_func(q, qkv[:, :, 1:], return_attn_probs=True)) == 3

    packed = qkv.reshape(10, 3, 2, 8)
    cu = torch.tensor([0, 5, 10], dtype=torch.int32)
    out, lse, s_dmask = compat.flash_attn_varlen_qkvpacked_func(packed, cu, 5, return_attn_probs=True)
    assert s_dmask is None and lse.shape == (2, 10)
    assert isinstance(compat.flash_attn_varlen_qkvpacked_func(packed, cu, 5), torch.Tensor)
    out, lse, s_dmask = compat.flash_attn_varlen_kvpacked_func(packed[:, 0], packed[:, 1:], cu, cu, 5, 5,
                                                               return_attn_probs=True)
    assert s_dmask is None and lse.shape == (2, 10)


@pytest.mark.parametrize("fn,args", [
    ("flash_attn_func", lambda: _qkv()),
    ("flash_attn_qkvpacked_func", lambda: [torch.stack(_qkv(), dim=2)]),
])
def test_return_attn_probs_must_be_a_bool(fn, args):
    with pytest.raises(TypeError, match="return_attn_probs must be a bool"):
        getattr(compat, fn)(*args(), return_attn_probs=1)


def _cache():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 1, 4, 8, generator=g)
    k_cache, v_cache = torch.randn(2, 2, 16, 2, 8, generator=g).unbind(0)
    k_new, v_new = torch.randn(2, 2, 1, 2, 8, generator=g).unbind(0)
    seqlens = torch.tensor([3, 7], dtype=torch.int32)
    return q, k_cache, v_cache, k_new, v_new, seqlens


def test_with_kvcache_return_softmax_lse_and_names():
    q, k_cache, v_cache, k_new, v_new, seqlens = _cache()
    k2, v2 = k_cache.clone(), v_cache.clone()
    out, lse = compat.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, causal=True,
                                              return_softmax_lse=True)
    want_out, want_lse = flashtile.flash_attn_with_kvcache(q, k2, v2, k=k_new, v=v_new, cache_seqlens=seqlens,
                                                           causal=True, return_lse=True)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    assert torch.equal(k_cache, k2) and torch.equal(v_cache, v2), "the cache is updated in place, as flash-attn's"
    out_only = compat.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens + 1)
    assert isinstance(out_only, torch.Tensor)


def test_with_kvcache_cache_leftpad_passes_through():
    q, k_cache, v_cache, k_new, v_new, seqlens = _cache()
    k2, v2 = k_cache.clone(), v_cache.clone()
    pad = torch.tensor([1, 4], dtype=torch.int32)
    out = compat.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens,
                                         cache_leftpad=pad, causal=True)
    want = flashtile.flash_attn_with_kvcache(q, k2, v2, k=k_new, v=v_new, cache_seqlens=seqlens, cache_leftpad=pad,
                                             causal=True)
    assert torch.equal(out, want) and torch.equal(k_cache, k2)


def test_with_kvcache_rotary_defaults_to_interleaved_pairs_as_flash_attn():
    q, k_cache, v_cache, k_new, v_new, seqlens = _cache()
    k2, v2 = k_cache.clone(), v_cache.clone()
    g = torch.Generator().manual_seed(4)
    angles = torch.rand(64, k_cache.shape[-1] // 4, generator=g) * 6
    cos, sin = angles.cos(), angles.sin()
    out = compat.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
                                         cache_seqlens=seqlens, causal=True)
    want = flashtile.flash_attn_with_kvcache(q, k2, v2, k=k_new, v=v_new, cache_seqlens=seqlens, causal=True,
                                             rotary_cos=cos, rotary_sin=sin, rotary_interleaved=True)
    assert torch.equal(out, want) and torch.equal(k_cache, k2)


def test_unpad_input_returns_five_values_and_pad_input_inverts_it():
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(3, 4, 5, generator=g)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    packed, indices, cu_seqlens, max_seqlen, used = compat.unpad_input(hidden, mask)
    assert packed.shape == (6, 5) and indices.tolist() == [0, 1, 4, 5, 6, 7]
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.tolist() == [0, 2, 6, 6]
    assert max_seqlen == 4 and isinstance(max_seqlen, int)
    assert used.dtype == torch.int32 and used.tolist() == [2, 4, 0]
    restored = compat.pad_input(packed, indices, 3, 4)
    assert torch.equal(restored, hidden * mask[..., None])


def test_unpad_input_unused_mask_keeps_allocated_tokens_but_not_in_used_counts():
    hidden = torch.arange(2 * 4, dtype=torch.float32).reshape(2, 4, 1)
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    unused = torch.tensor([[0, 0, 1, 0], [0, 1, 1, 0]], dtype=torch.bool)
    packed, indices, cu_seqlens, max_seqlen, used = compat.unpad_input(hidden, mask, unused)
    assert indices.tolist() == [0, 1, 2, 4, 5, 6]
    assert cu_seqlens.tolist() == [0, 3, 6] and max_seqlen == 3
    assert used.tolist() == [2, 1]
    with pytest.raises(ValueError, match="unused_mask"):
        compat.unpad_input(hidden, mask, unused[:, :3])


def test_unpad_input_is_differentiable():
    hidden = torch.randn(2, 3, 4, requires_grad=True)
    mask = torch.tensor([[1, 0, 1], [1, 1, 0]])
    packed, indices, *_ = compat.unpad_input(hidden, mask)
    compat.pad_input(packed * 2, indices, 2, 3).sum().backward()
    assert torch.equal(hidden.grad, 2 * mask[..., None].float().expand(2, 3, 4))
