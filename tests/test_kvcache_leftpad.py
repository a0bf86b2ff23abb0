"""Left-padded KV caches (``cache_leftpad``), against the float64 attention oracle.

Sequence b's keys are cache positions ``cache_leftpad[b] <= j < cache_seqlens[b]`` (+ the
appended keys); masks and ALiBi are aligned as if they started at 0.  The CPU path and the
Triton decode kernel (in the interpreter without a GPU) are both checked, contiguous and
paged, with and without an append, with split-KV.
"""

import os

import pytest
import torch

from helpers import assert_close_to_reference, reference_attention

import flashtile
from flashtile import kvcache

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernels = pytest.mark.skipif(not (INTERPRET or torch.cuda.is_available()), reason="needs a GPU or the interpreter")

LENGTHS = [5, 29]
PADS = [2, 11]


def _inputs(dtype, seqlen_q=2, headdim=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, seqlen_q, 4, headdim, generator=g)
    k_cache = torch.randn(2, 48, 2, headdim, generator=g)
    v_cache = torch.randn(2, 48, 2, headdim, generator=g)
    slopes = torch.rand(4, generator=g) * 0.3
    return q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), slopes


def _reference(q, k_cache, v_cache, lengths, pads, **kw):
    outs = []
    for b, (n, p) in enumerate(zip(lengths, pads)):
        ref, _ = reference_attention(q[b:b + 1], k_cache[b:b + 1, p:n], v_cache[b:b + 1, p:n], **kw)
        low, _ = reference_attention(q[b:b + 1], k_cache[b:b + 1, p:n], v_cache[b:b + 1, p:n], upcast=False, **kw)
        outs.append((ref, low))
    return outs


@pytest.mark.parametrize("causal, window, alibi", [(True, (-1, -1), False), (False, (-1, -1), True),
                                                   (False, (3, 2), False)])
def test_leftpad_cpu_matches_reference(causal, window, alibi):
    q, kc, vc, slopes = _inputs(torch.float32)
    lengths = torch.tensor(LENGTHS, dtype=torch.int32)
    pads = torch.tensor(PADS, dtype=torch.int32)
    kw = dict(causal=causal, window_size=window, alibi_slopes=slopes if alibi else None)
    out = flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lengths, cache_leftpad=pads, **kw)
    for b, (ref, low) in enumerate(_reference(q, kc, vc, LENGTHS, PADS, **kw)):
        assert_close_to_reference(out[b:b + 1], ref, low, f"out[{b}]", atol_floor=1e-5)


def test_leftpad_with_an_append_writes_at_cache_seqlens():
    q, kc, vc, _ = _inputs(torch.float32)
    g = torch.Generator().manual_seed(5)
    kn, vn = torch.randn(2, 3, 2, 32, generator=g), torch.randn(2, 3, 2, 32, generator=g)
    lengths = torch.tensor(LENGTHS, dtype=torch.int32)
    pads = torch.tensor(PADS, dtype=torch.int32)
    k_before = kc.clone()
    out = flashtile.flash_attn_with_kvcache(q, kc, vc, k=kn, v=vn, cache_seqlens=lengths, cache_leftpad=pads,
                                            causal=True)
    for b, n in enumerate(LENGTHS):
        assert torch.equal(kc[b, n:n + 3], kn[b]) and torch.equal(kc[b, :n], k_before[b, :n])
    after = [n + 3 for n in LENGTHS]
    for b, (ref, low) in enumerate(_reference(q, kc, vc, after, PADS, causal=True)):
        assert_close_to_reference(out[b:b + 1], ref, low, f"out[{b}]", atol_floor=1e-5)


@needs_kernels
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("splits", [1, 3])
def test_leftpad_decode_kernel_matches_cpu_path(paged, splits):
    dtype = torch.float32 if INTERPRET else torch.bfloat16
    q, kc, vc, slopes = _inputs(dtype)
    lengths = torch.tensor(LENGTHS, dtype=torch.int32)
    pads = torch.tensor(PADS, dtype=torch.int32)
    table = None
    k_store, v_store = kc, vc
    if paged:  # 16-row pages, sequence b's pages in reverse order
        page, pages = 16, 3
        table = torch.tensor([[b * pages + (pages - 1 - i) for i in range(pages)] for b in range(2)], dtype=torch.int32)
        k_store = torch.empty(6, page, 2, 32, dtype=dtype)
        v_store = torch.empty_like(k_store)
        for b in range(2):
            for i in range(pages):
                k_store[table[b, i]] = kc[b, i * page:(i + 1) * page]
                v_store[table[b, i]] = vc[b, i * page:(i + 1) * page]
    move = lambda t: t.to(DEVICE) if t is not None else None  # noqa: E731
    out, lse = kvcache._attend_triton(move(q), move(k_store), move(v_store), move(lengths), None, move(table),
                                      32 ** -0.5, -1, 0, 0.0, move(slopes), splits, leftpad=move(pads))
    for b, (ref, low) in enumerate(_reference(q, kc, vc, LENGTHS, PADS, causal=True, alibi_slopes=slopes)):
        assert_close_to_reference(out[b:b + 1].cpu(), ref, low, f"out[{b}]",
                                  atol_floor=1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("pads, match", [([-1, 0], r"cache_leftpad\[0\] = -1"), ([0, 30], r"cache_leftpad\[1\] = 30")])
def test_leftpad_values_are_checked_before_any_write(pads, match):
    q, kc, vc, _ = _inputs(torch.float32)
    kn = vn = torch.zeros(2, 1, 2, 32)
    before = kc.clone()
    with pytest.raises(ValueError, match=match):
        flashtile.flash_attn_with_kvcache(q, kc, vc, k=kn, v=vn, cache_seqlens=torch.tensor(LENGTHS, dtype=torch.int32),
                                          cache_leftpad=torch.tensor(pads, dtype=torch.int32))
    assert torch.equal(kc, before)


def test_leftpad_shape_and_type_are_checked():
    q, kc, vc, _ = _inputs(torch.float32)
    with pytest.raises(ValueError, match="cache_leftpad"):
        flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=7, cache_leftpad=torch.zeros(3, dtype=torch.int32))
    with pytest.raises(TypeError, match="cache_leftpad"):
        flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=7, cache_leftpad=[0, 0])
