"""Rules of ``flashtile.validation`` shared across families: the page-table rule (paged
attention and the KV cache), numpy bools taken as bools (``return_lse``, the rotary flags),
the kvcache argument check reading no index value, the CPU engine and the transformers
backend's options."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import flashtile
from flashtile import validation

B, H, HK, D, PAGE = 2, 4, 2, 16, 4


def _cache(paged: bool):
    q = torch.randn(B, 1, H, D)
    rows = 3 if paged else B
    kc, vc = torch.randn(rows, PAGE if paged else 12, HK, D), torch.randn(rows, PAGE if paged else 12, HK, D)
    return q, kc, vc


def test_block_table_needs_a_column_in_every_family():
    message = r"block_table must have at least one column \(block\), got shape \(2, 0\)"
    empty = torch.zeros(B, 0, dtype=torch.int32)
    q, kc, vc = _cache(paged=True)
    with pytest.raises(ValueError, match=message):
        flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=0, block_table=empty)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match=message):
        flashtile.flash_attn_varlen_func(q.reshape(B, H, D), kc, vc, cu, cu, 1, 1, block_table=empty)
    with pytest.raises(ValueError, match=message):
        validation.check_block_table(empty, q.device, B)


def test_kvcache_arguments_read_no_index_value():
    q, kc, vc = _cache(paged=True)
    table = torch.full((B, 2), 10**6, dtype=torch.int32)  # pages that do not exist
    lengths = torch.tensor([-5, 10**6], dtype=torch.int32)
    params, capacity = validation.check_kvcache_arguments(q, kc, vc, None, None, lengths, None, table, None, True,
                                                          (-1, -1), 0.0, None, 0, False, None)
    assert capacity == 2 * PAGE and params.window_right == 0
    with pytest.raises(ValueError, match=r"cache_seqlens\[0\] = -5"):
        validation.check_kvcache_index_values(lengths, None, table, seqlen_new=0, capacity=capacity,
                                              cache_rows=kc.shape[0])


def test_numpy_bools_are_bools():
    q, kc, vc = _cache(paged=False)
    k, v = torch.randn(B, 1, HK, D), torch.randn(B, 1, HK, D)
    cos, sin = torch.rand(16, D // 4), torch.rand(16, D // 4)
    want = flashtile.flash_attn_with_kvcache(q, kc.clone(), vc.clone(), k, v, cache_seqlens=3, return_lse=True,
                                             rotary_cos=cos, rotary_sin=sin, rotary_interleaved=True)
    got = flashtile.flash_attn_with_kvcache(q, kc.clone(), vc.clone(), k, v, cache_seqlens=3, return_lse=np.True_,
                                            rotary_cos=cos, rotary_sin=sin, rotary_interleaved=np.True_)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    x = torch.randn(B, 3, H, D)
    assert torch.equal(flashtile.apply_rotary_emb(x, cos, sin, interleaved=np.True_),
                       flashtile.apply_rotary_emb(x, cos, sin, interleaved=True))
    assert validation.check_kvcache_rotary_pair(cos, sin, np.False_) is False


def test_engine_rules():
    for engine in validation.ENGINES:
        validation.check_engine(engine)
    with pytest.raises(ValueError, match="engine must be one of"):
        validation.check_engine("fast")
    validation.check_fused_engine("auto", None)
    with pytest.raises(ValueError, match="engine='fused' does not compute this call"):
        validation.check_fused_engine("fused", None)


def test_transformers_rules():
    assert validation.check_sliding_window(None) is None
    assert validation.check_sliding_window(4.0) == 4
    with pytest.raises(ValueError, match="sliding_window must be a positive"):
        validation.check_sliding_window(0)
    with pytest.raises(TypeError, match="attention_mask must be a torch.Tensor"):
        validation.check_transformers_mask([[1, 0]])
    with pytest.raises(ValueError, match="2-D \\(batch, keys\\) or 4-D"):
        validation.check_transformers_mask(torch.ones(2, 3, 4))
    keep = torch.ones(2, 5, dtype=torch.bool)
    validation.check_transformers_padding(keep, 2, 3, 8, causal=True)  # fewer keys than seq_k: causal only
    with pytest.raises(ValueError, match="a 2-D attention_mask must be"):
        validation.check_transformers_padding(keep, 2, 3, 8, causal=False)
    with pytest.raises(ValueError, match="must cover the 6 query positions"):
        validation.check_transformers_padding(keep, 2, 6, 8, causal=True)
    q = torch.randn(1, 2, 3, 8)
    with pytest.raises(NotImplementedError, match="s_aux"):
        validation.check_transformers_inputs(q, q, q, {"s_aux": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"\(batch, heads, seq, dim\)"):
        validation.check_transformers_inputs(q[0], q, q, {})
