"""Rotary embedding inside flash_attn_with_kvcache, against the float64 rotary and attention oracles.

flash-attn's rule: the new ``k`` row i is rotated at position ``cache_seqlens[b] + i`` before
it is written; ``q`` row i at ``cache_seqlens[b] + i`` with ``causal`` or a window, else
every ``q`` row at ``cache_seqlens[b]``.  Without a GPU the CPU path runs; the ``gpu`` test
runs the same cases through the Triton kernels.
"""

import numpy as np
import pytest
import torch

from helpers import assert_close_to_reference, reference_attention

import flashtile
from flashtile.reference.rotary import apply_rotary_naive

SEQLENS = [3, 9]


def _case(device, dtype, headdim, rotary_fraction, seqlen_q, seqlen_new, paged, seed=0):
    g = torch.Generator().manual_seed(seed)
    batch, nheads, nheads_k, capacity = 2, 4, 2, 32
    q = torch.randn(batch, seqlen_q, nheads, headdim, generator=g)
    k_new = torch.randn(batch, seqlen_new, nheads_k, headdim, generator=g) if seqlen_new else None
    v_new = torch.randn(batch, seqlen_new, nheads_k, headdim, generator=g) if seqlen_new else None
    k_cache = torch.randn(batch, capacity, nheads_k, headdim, generator=g)
    v_cache = torch.randn(batch, capacity, nheads_k, headdim, generator=g)
    angles = torch.rand(64, int(headdim * rotary_fraction) // 2, generator=g) * 6.0
    cos, sin = angles.cos(), angles.sin()
    table = None
    if paged:  # 8-row pages, sequence b's pages in reverse order
        page = 8
        pages = capacity // page
        table = torch.tensor([[b * pages + (pages - 1 - i) for i in range(pages)] for b in range(batch)],
                             dtype=torch.int32)
        k_pages = torch.empty(batch * pages, page, nheads_k, headdim)
        v_pages = torch.empty_like(k_pages)
        for b in range(batch):
            for i in range(pages):
                k_pages[table[b, i]] = k_cache[b, i * page:(i + 1) * page]
                v_pages[table[b, i]] = v_cache[b, i * page:(i + 1) * page]
        k_store, v_store = k_pages, v_pages
    else:
        k_store, v_store = k_cache.clone(), v_cache.clone()
    move = lambda t: t.to(device=device, dtype=dtype) if t is not None else None  # noqa: E731
    return dict(q=move(q), k_new=move(k_new), v_new=move(v_new), k_cache=k_cache, v_cache=v_cache,
                k_store=move(k_store), v_store=move(v_store), cos=cos.to(device), sin=sin.to(device),
                table=table.to(device) if table is not None else None)


def _check(device, dtype, interleaved, rotary_fraction, causal, window, seqlen_new, paged, floor):
    headdim, seqlen_q = 16, 2
    c = _case(device, dtype, headdim, rotary_fraction, seqlen_q, seqlen_new, paged)
    seqlens = torch.tensor(SEQLENS, dtype=torch.int32, device=device)
    out = flashtile.flash_attn_with_kvcache(
        c["q"], c["k_store"], c["v_store"], k=c["k_new"], v=c["v_new"], cache_seqlens=seqlens,
        block_table=c["table"], causal=causal, window_size=window, rotary_cos=c["cos"], rotary_sin=c["sin"],
        rotary_interleaved=interleaved)
    cos, sin = c["cos"].cpu().numpy(), c["sin"].cpu().numpy()
    local = causal or window != (-1, -1)
    q64 = c["q"].double().cpu().numpy()
    for b, length in enumerate(SEQLENS):
        if local:
            q_rot = apply_rotary_naive(q64[b:b + 1], cos, sin, interleaved, length)
        else:  # every query row at position cache_seqlens[b]
            q_rot = np.concatenate([apply_rotary_naive(q64[b:b + 1, i:i + 1], cos, sin, interleaved, length)
                                    for i in range(seqlen_q)], axis=1)
        keys, values = c["k_cache"][b:b + 1, :length].double(), c["v_cache"][b:b + 1, :length].double()
        if seqlen_new:
            k_rot = apply_rotary_naive(c["k_new"][b:b + 1].double().cpu().numpy(), cos, sin, interleaved, length)
            keys = torch.cat([keys, torch.from_numpy(k_rot)], dim=1)
            values = torch.cat([values, c["v_new"][b:b + 1].double().cpu()], dim=1)
            # The cache holds the rotated keys.
            rows = torch.arange(length, length + seqlen_new)
            if c["table"] is not None:
                page = c["k_store"].shape[1]
                stored = c["k_store"][c["table"][b, rows // page].long(), rows % page]
            else:
                stored = c["k_store"][b, rows]
            torch.testing.assert_close(stored.double().cpu(), torch.from_numpy(k_rot[0]), rtol=0, atol=floor * 10)
        kw = dict(causal=causal, window_size=window)
        ref, _ = reference_attention(torch.from_numpy(q_rot), keys, values, **kw)
        low, _ = reference_attention(torch.from_numpy(q_rot).to(dtype), keys.to(dtype), values.to(dtype),
                                     upcast=False, **kw)
        assert_close_to_reference(out[b:b + 1].cpu(), ref, low, f"out[{b}]", atol_floor=floor)


CASES = [
    # interleaved, rotary fraction, causal, window, seqlen_new, paged
    (False, 1.0, True, (-1, -1), 2, False),
    (True, 0.5, True, (-1, -1), 2, True),
    (False, 0.5, False, (-1, -1), 2, False),  # non-causal: q rows share one position
    (True, 1.0, False, (4, 1), 2, False),  # a window counts as local
    (False, 1.0, True, (-1, -1), 0, True),  # no append: q rotated only
    (True, 0.5, False, (-1, -1), 0, False),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "inter{}-frac{}-causal{}-w{}-new{}-paged{}".format(*c))
def test_rotary_in_the_cache_call_matches_the_oracles_cpu(case):
    _check("cpu", torch.float32, *case, floor=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: "inter{}-frac{}-causal{}-w{}-new{}-paged{}".format(*c))
def test_rotary_in_the_cache_call_matches_the_oracles_gpu(case):
    _check("cuda", torch.bfloat16, *case, floor=1e-2)


def test_rotary_needs_both_tables_and_a_bad_table_writes_nothing():
    c = _case("cpu", torch.float32, 16, 1.0, 1, 1, False)
    before = c["k_store"].clone()
    seqlens = torch.tensor(SEQLENS, dtype=torch.int32)
    with pytest.raises(ValueError, match="rotary_cos and rotary_sin"):
        flashtile.flash_attn_with_kvcache(c["q"], c["k_store"], c["v_store"], k=c["k_new"], v=c["v_new"],
                                          cache_seqlens=seqlens, rotary_cos=c["cos"])
    with pytest.raises(ValueError):
        flashtile.flash_attn_with_kvcache(c["q"], c["k_store"], c["v_store"], k=c["k_new"], v=c["v_new"],
                                          cache_seqlens=seqlens, rotary_cos=c["cos"][:, :3], rotary_sin=c["sin"])
    with pytest.raises(TypeError, match="rotary_interleaved"):
        flashtile.flash_attn_with_kvcache(c["q"], c["k_store"], c["v_store"], k=c["k_new"], v=c["v_new"],
                                          cache_seqlens=seqlens, rotary_cos=c["cos"], rotary_sin=c["sin"],
                                          rotary_interleaved=1)
    assert torch.equal(c["k_store"], before), "a refused call appends nothing"


# The append kernel rotates the new keys itself on a GPU (one launch fewer): it must write
# what apply_rotary_emb followed by the plain append writes -- bit for bit in the interpreter
# and in bf16; float32 on a GPU within a few ulps (the two kernels' x cos - y sin contract into
# FMAs differently: all 24 float32 cases differed in last bits on an H200, every bf16 one matched).
_needs_kernels = pytest.mark.skipif(not (torch.cuda.is_available()
                                         or __import__("os").environ.get("TRITON_INTERPRET") == "1"),
                                    reason="needs a GPU or the interpreter")


@_needs_kernels
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_fraction", [1.0, 0.5])
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("lengths", ["int", "tensor", "leftpad"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_append_kernel_rotation_writes_what_the_rotary_kernel_writes(interleaved, rotary_fraction, paged, lengths,
                                                                    dtype):
    from flashtile.kernels.decode import append_kv
    from flashtile.kernels.rotary import rotate

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(3)
    batch, seqlen_new, nheads_k, d, capacity = 2, 3, 2, 40, 32
    k_new, v_new = (torch.randn(batch, seqlen_new, nheads_k, d, generator=g).to(device, dtype) for _ in range(2))
    # inf: a rotated feature follows the pair rule, an unrotated one (past rotary_dim, or a
    # position past the table) keeps its value and gives its partner no NaN.
    k_new[0, 1, 0, 3] = k_new[0, 0, 1, d - 1] = k_new[1, 2, 0, 3] = float("inf")
    rotary_dim = int(d * rotary_fraction) // 2 * 2
    # 30 table rows: the last new key of sequence 1 (position 29 + 2 - 1 = 30) lies past them: unrotated.
    angles = torch.rand(30, rotary_dim // 2, generator=g) * 6.0
    cos, sin = angles.cos().to(device), angles.sin().to(device)
    if paged:
        page, pages = 8, capacity // 8
        k_cache, v_cache = (torch.randn(batch * pages, page, nheads_k, d, generator=g).to(device, dtype)
                            for _ in range(2))
        table = torch.arange(batch * pages, dtype=torch.int32).flip(0).reshape(batch, pages).to(device)
    else:
        k_cache, v_cache = (torch.randn(batch, capacity, nheads_k, d, generator=g).to(device, dtype) for _ in range(2))
        table = None
    seqlens = 5 if lengths == "int" else torch.tensor([5, 29], dtype=torch.int32, device=device)
    leftpad = torch.tensor([2, 0], dtype=torch.int32, device=device) if lengths == "leftpad" else None
    positions = seqlens if leftpad is None else seqlens - leftpad
    want_k, want_v = k_cache.clone(), v_cache.clone()
    # The rotary kernel itself (apply_rotary_emb would reject the position past the table).
    rotated = rotate(k_new, cos, sin, torch.empty_like(k_new), interleaved=interleaved, conjugate=False,
                     seqlen_offsets=positions, cu_seqlens=None, max_seqlen=None)
    append_kv(want_k, want_v, rotated, v_new, seqlens, None, table)
    append_kv(k_cache, v_cache, k_new, v_new, seqlens, None, table, rotary=(cos, sin, interleaved, leftpad))
    assert torch.equal(v_cache, want_v)
    assert torch.equal(k_cache.isnan(), want_k.isnan())
    assert torch.equal(k_cache.isinf(), want_k.isinf())
    if device == "cuda" and dtype == torch.float32:
        torch.testing.assert_close(k_cache.nan_to_num(), want_k.nan_to_num(), rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(k_cache.nan_to_num(), want_k.nan_to_num())


@_needs_kernels
@pytest.mark.parametrize("case", CASES, ids=lambda c: "inter{}-frac{}-causal{}-w{}-new{}-paged{}".format(*c))
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("leftpad", [False, True])
def test_fused_step_matches_the_cpu_path(case, splits, leftpad):
    """The GPU step (one split-kernel launch: append, rotary of q and the new k, attention)
    against the CPU path (apply_rotary_emb, scatter, attention) on the same arguments."""
    from flashtile import kvcache

    interleaved, fraction, causal, window, seqlen_new, paged = case
    device = "cuda" if torch.cuda.is_available() else "cpu"
    c = _case(device, torch.float32, 16, fraction, 2, seqlen_new, paged)
    seqlens = torch.tensor(SEQLENS, dtype=torch.int32, device=device)
    pad = torch.tensor([2, 0], dtype=torch.int32, device=device) if leftpad else None
    kc_ref, vc_ref = c["k_store"].cpu().clone(), c["v_store"].cpu().clone()
    want = flashtile.flash_attn_with_kvcache(
        c["q"].cpu(), kc_ref, vc_ref, k=None if c["k_new"] is None else c["k_new"].cpu(),
        v=None if c["v_new"] is None else c["v_new"].cpu(), cache_seqlens=seqlens.cpu(),
        block_table=None if c["table"] is None else c["table"].cpu(), causal=causal, window_size=window,
        rotary_cos=c["cos"].cpu(), rotary_sin=c["sin"].cpu(), rotary_interleaved=interleaved,
        cache_leftpad=None if pad is None else pad.cpu(), return_lse=True)
    left, right = (window[0], 0) if causal else window
    local = left >= 0 or right >= 0
    out, lse = kvcache._step_triton(c["q"], c["k_store"], c["v_store"], c["k_new"], c["v_new"], seqlens, None,
                                    c["table"], 16 ** -0.5, left, right, 0.0, None, splits, leftpad=pad,
                                    rotary=(c["cos"], c["sin"], interleaved, local))
    torch.testing.assert_close(c["k_store"].cpu(), kc_ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(c["v_store"].cpu(), vc_ref, rtol=0, atol=0)
    torch.testing.assert_close(out.cpu(), want[0], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(lse.cpu(), want[1], atol=2e-5, rtol=1e-4)
