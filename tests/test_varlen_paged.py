"""Packed queries against paged keys and values (``flash_attn_varlen_func(..., block_table=...)``):
chunked prefill against a KV cache.  Against the float64 oracle per sequence, through the CPU
path and the Triton kernels (the interpreter without a GPU; bf16 with ``-m gpu`` on one), pages
smaller and larger than the kernels' key tile, every sequence's pages scattered.
"""

import os

import pytest
import torch

from helpers import assert_close_to_reference, reference_attention

import flashtile
from flashtile.kernels import attention as ka

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_kernels = pytest.mark.skipif(not (INTERPRET or torch.cuda.is_available()), reason="needs a GPU or the interpreter")


def _case(page_size, lens_q, lens_k, nheads=4, nheads_k=2, headdim=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-n // page_size) for n in lens_k)
    num_blocks = len(lens_k) * max_blocks + 3
    # Sequence b's block j is page perm[b * max_blocks + j]: pages of every sequence interleaved.
    perm = torch.randperm(num_blocks, generator=g)
    table = perm[:len(lens_k) * max_blocks].reshape(len(lens_k), max_blocks).to(torch.int32)
    k_pages = torch.randn(num_blocks, page_size, nheads_k, headdim, generator=g)
    v_pages = torch.randn(num_blocks, page_size, nheads_k, headdim, generator=g)
    q = torch.randn(sum(lens_q), nheads, headdim, generator=g)
    cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32)
    cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32)
    return q, k_pages, v_pages, table, cu_q, cu_k


def _keys(pages, table, b, n):
    page_size = pages.shape[1]
    rows = [pages[table[b, j // page_size], j % page_size] for j in range(n)]
    return torch.stack(rows)[None] if rows else pages[:0, 0][None]


def _check(out, q, k_pages, v_pages, table, lens_q, lens_k, cu_q, floor, **kw):
    for b, (nq, nk) in enumerate(zip(lens_q, lens_k)):
        if nq == 0:
            continue
        qb = q[cu_q[b]:cu_q[b + 1]][None]
        kb, vb = _keys(k_pages, table, b, nk), _keys(v_pages, table, b, nk)
        ref, _ = reference_attention(qb, kb, vb, **kw)
        low, _ = reference_attention(qb, kb, vb, upcast=False, **kw)
        # Compared on the inputs' device (the oracle runs where q is).
        assert_close_to_reference(out[cu_q[b]:cu_q[b + 1]][None].to(ref.device).float(), ref, low.float(),
                                  f"sequence {b}", atol_floor=floor)


SHAPES = [
    # page size, query lengths, key lengths (each key length >= its query length: prefill chunks)
    (16, [5, 0, 17], [40, 3, 17]),
    (64, [1, 33], [100, 70]),
    (8, [9], [9]),
    # Pages larger than the kernels' key tiles: a tile never straddles two pages.
    (256, [5, 40], [300, 257]),
    (512, [33], [700]),
]


@pytest.mark.parametrize("page_size, lens_q, lens_k", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_paged_varlen_cpu_matches_reference(page_size, lens_q, lens_k, causal):
    q, kp, vp, table, cu_q, cu_k = _case(page_size, lens_q, lens_k)
    out = flashtile.flash_attn_varlen_func(q, kp, vp, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                           block_table=table)
    _check(out, q, kp, vp, table, lens_q, lens_k, cu_q, 1e-5, causal=causal)


@needs_kernels
@pytest.mark.parametrize("page_size, lens_q, lens_k", SHAPES[:2] + SHAPES[3:])
@pytest.mark.parametrize("causal, window", [(True, (-1, -1)), (False, (7, 3))])
def test_paged_varlen_kernel_matches_reference(page_size, lens_q, lens_k, causal, window):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    q, kp, vp, table, cu_q, cu_k = _case(page_size, lens_q, lens_k)
    q_, kp_, vp_ = (t.to(device=device, dtype=dtype) for t in (q, kp, vp))
    right = 0 if causal else window[1]
    out, lse = ka.varlen_attention_forward(q_, kp_, vp_, cu_q.to(device), cu_k.to(device), 32 ** -0.5, window[0],
                                           right, max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k),
                                           block_table=table.to(device))
    _check(out, q_.float(), kp_.float(), vp_.float(), table, lens_q, lens_k, cu_q, 1e-3 if device == "cpu" else 1e-2,
           causal=causal, window_size=window)


def test_paged_varlen_is_forward_only_and_checks_its_inputs():
    q, kp, vp, table, cu_q, cu_k = _case(16, [5], [20])
    with pytest.raises(NotImplementedError, match="forward only"):
        flashtile.flash_attn_varlen_func(q.requires_grad_(), kp, vp, cu_q, cu_k, 5, 20, block_table=table)
    q = q.detach()
    with pytest.raises(ValueError, match="block_table"):
        flashtile.flash_attn_varlen_func(q, kp, vp, cu_q, cu_k, 5, 20, block_table=table[:, :0])
    with pytest.raises(ValueError, match=r"block_table\[0, 1\]"):
        bad = table.clone()
        bad[0, 1] = 99
        flashtile.flash_attn_varlen_func(q, kp, vp, cu_q, cu_k, 5, 20, block_table=bad)
    with pytest.raises(ValueError, match="cache capacity|capacity"):
        flashtile.flash_attn_varlen_func(q, kp, vp, cu_q, torch.tensor([0, 50], dtype=torch.int32), 5, 50,
                                         block_table=table)
    with pytest.raises(ValueError, match="paged alike"):
        flashtile.flash_attn_varlen_func(q, kp, vp[:, :8], cu_q, cu_k, 5, 20, block_table=table)
