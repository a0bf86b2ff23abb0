"""KV-cache decoding (contiguous and paged caches, appends, split-KV) and merge_attention_states."""

import os

import pytest
import torch

import flashtile
from flashtile import kvcache
from helpers import reference_attention

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_kernels = pytest.mark.skipif(not (INTERPRET or torch.cuda.is_available()), reason="needs a GPU or the interpreter")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _case(batch, seqlen_q, nheads, nheads_k, d, capacity, page_size=None, seed=0, dtype=torch.float32, device="cpu"):
    g = _gen(seed)
    q = torch.randn(batch, seqlen_q, nheads, d, generator=g)
    if page_size is None:
        kc = torch.randn(batch, capacity, nheads_k, d, generator=g)
        vc = torch.randn(batch, capacity, nheads_k, d, generator=g)
        table = None
    else:
        pages = -(-capacity // page_size)
        kc = torch.randn(batch * pages + 3, page_size, nheads_k, d, generator=g)
        vc = torch.randn(batch * pages + 3, page_size, nheads_k, d, generator=g)
        table = torch.randperm(batch * pages + 3, generator=g)[: batch * pages].reshape(batch, pages).to(torch.int32)
        table = table.to(device)
    return q.to(device, dtype), kc.to(device, dtype), vc.to(device, dtype), table


def _logical(cache, table, b, n):
    """The first n logical keys of sequence b."""
    if table is None:
        return cache[b, :n]
    return cache[table[b].long()].reshape(-1, *cache.shape[2:])[:n]


def _check(out, lse, q, kc, vc, table, lengths, causal=False, window=(-1, -1), atol=2e-5, **kw):
    for b, n in enumerate(lengths):
        k, v = _logical(kc, table, b, n), _logical(vc, table, b, n)
        slopes = kw.get("alibi_slopes")
        ref_o, ref_l = reference_attention(q[b:b + 1], k[None], v[None], softmax_scale=kw.get("softmax_scale"),
                                           causal=causal, window_size=window, softcap=kw.get("softcap", 0.0),
                                           alibi_slopes=None if slopes is None else slopes)
        torch.testing.assert_close(out[b:b + 1].double(), ref_o, atol=atol, rtol=1e-4)
        torch.testing.assert_close(lse[b:b + 1].double(), ref_l, atol=atol, rtol=1e-4)


@pytest.mark.parametrize("page_size", [None, 1, 16, 256])
@pytest.mark.parametrize("seqlen_q,causal", [(1, False), (4, True)])
def test_cpu_path_matches_reference(page_size, seqlen_q, causal):
    q, kc, vc, table = _case(3, seqlen_q, 8, 2, 32, 300, page_size)
    lengths = [0, 1, 300] if seqlen_q == 1 else [4, 1, 299]
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    out, lse = flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, block_table=table, causal=causal,
                                                 return_lse=True)
    _check(out, lse, q, kc, vc, table, lengths, causal=causal)
    if 0 in lengths:  # no key: output 0, LSE -inf
        assert (out[0] == 0).all() and (lse[0] == float("-inf")).all()


@pytest.mark.parametrize("page_size", [None, 16])
def test_append_lands_in_place_then_attends(page_size):
    q, kc, vc, table = _case(3, 2, 4, 4, 16, 64, page_size, seed=1)
    g = _gen(2)
    knew, vnew = torch.randn(3, 2, 4, 16, generator=g), torch.randn(3, 2, 4, 16, generator=g)
    seqlens = torch.tensor([0, 7, 62], dtype=torch.int32)
    before_k = kc.clone()
    out, lse = flashtile.flash_attn_with_kvcache(q, kc, vc, knew, vnew, cache_seqlens=seqlens, block_table=table,
                                                 causal=True, return_lse=True)
    for b, s in enumerate(seqlens.tolist()):
        torch.testing.assert_close(_logical(kc, table, b, s + 2)[s:], knew[b], atol=0, rtol=0)
        torch.testing.assert_close(_logical(vc, table, b, s + 2)[s:], vnew[b], atol=0, rtol=0)
        # Nothing before the append point moved.
        torch.testing.assert_close(_logical(kc, table, b, s), _logical(before_k, table, b, s), atol=0, rtol=0)
    _check(out, lse, q, kc, vc, table, [s + 2 for s in seqlens.tolist()], causal=True)


@pytest.mark.parametrize("group", [1, 4, 8])
def test_gqa_and_cache_batch_idx(group):
    q, kc, vc, _ = _case(2, 1, 8, 8 // group, 16, 40, seed=3)
    kc = torch.cat([kc, kc.flip(0)])  # 4 cached sequences; use rows 3 and 0
    vc = torch.cat([vc, vc.flip(0)])
    idx = torch.tensor([3, 0], dtype=torch.int32)
    out, lse = flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor([40, 17], dtype=torch.int32),
                                                 cache_batch_idx=idx, return_lse=True)
    _check(out, lse, q, kc[idx.long()], vc[idx.long()], None, [40, 17])


def test_window_softcap_alibi():
    q, kc, vc, _ = _case(2, 3, 4, 2, 16, 50, seed=4)
    slopes = torch.rand(2, 4, generator=_gen(5)) * 0.3
    kw = dict(window_size=(5, 0), softcap=3.0, alibi_slopes=slopes)
    out, lse = flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor([50, 9], dtype=torch.int32),
                                                 return_lse=True, **kw)
    for b, n in enumerate([50, 9]):
        ref_o, ref_l = reference_attention(q[b:b + 1], kc[b:b + 1, :n], vc[b:b + 1, :n], window_size=(5, 0),
                                           softcap=3.0, alibi_slopes=slopes[b])
        torch.testing.assert_close(out[b:b + 1].double(), ref_o, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(lse[b:b + 1].double(), ref_l, atol=2e-5, rtol=1e-4)


@needs_kernels
@pytest.mark.parametrize("page_size", [None, 1, 16])
@pytest.mark.parametrize("seqlen_q,group,nheads", [(1, 4, 8), (4, 1, 2), (2, 8, 8)])
def test_split_kernel_matches_reference_for_any_num_splits(page_size, seqlen_q, group, nheads):
    q, kc, vc, table = _case(3, seqlen_q, nheads, nheads // group, 32, 96, page_size, seed=6, device=DEVICE)
    lengths = torch.tensor([0, 1, 96], dtype=torch.int32, device=DEVICE)
    results = []
    for splits in (1, 5, 32):
        out, lse = kvcache._attend_triton(q, kc, vc, lengths, None, table, 32 ** -0.5, -1, 0, 0.0, None, splits)
        results.append((out, lse))
    _check(results[0][0], results[0][1], q, kc, vc, table, lengths.tolist(), causal=True)
    for out, lse in results[1:]:
        torch.testing.assert_close(out, results[0][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, results[0][1], atol=1e-5, rtol=1e-5)


@needs_kernels
def test_split_kernel_takes_strided_index_tensors():
    """cache_seqlens, cache_batch_idx and block_table as strided views (every other entry of a
    longer tensor): the same result as contiguous copies."""
    q, kc, vc, table = _case(3, 1, 4, 2, 32, 64, 16, seed=17, device=DEVICE)
    lengths = torch.tensor([64, -7, 1, -7, 40, -7], dtype=torch.int32, device=DEVICE)[::2]
    wide = torch.empty((3, 2 * table.shape[1]), dtype=torch.int32, device=DEVICE)
    wide[:, ::2], wide[:, 1::2] = table, table.flip(1)  # valid but wrong pages in between
    strided = kvcache._attend_triton(q, kc, vc, lengths, None, wide[:, ::2], 32 ** -0.5, -1, -1, 0.0, None, 3)
    dense = kvcache._attend_triton(q, kc, vc, lengths.contiguous(), None, table, 32 ** -0.5, -1, -1, 0.0, None, 3)
    assert torch.equal(strided[0], dense[0]) and torch.equal(strided[1], dense[1])
    _check(strided[0], strided[1], q, kc, vc, table, [64, 1, 40])
    q, kc, vc, _ = _case(2, 1, 4, 2, 32, 48, seed=18, device=DEVICE)
    idx = torch.tensor([1, 0, 0, 1], dtype=torch.int32, device=DEVICE)[::2]  # rows 1, 0
    strided = kvcache._attend_triton(q, kc, vc, 48, idx, None, 32 ** -0.5, -1, -1, 0.0, None, 2)
    dense = kvcache._attend_triton(q, kc, vc, 48, idx.contiguous(), None, 32 ** -0.5, -1, -1, 0.0, None, 2)
    assert torch.equal(strided[0], dense[0]) and torch.equal(strided[1], dense[1])


@needs_kernels
@pytest.mark.parametrize("page_size", [None, 16])
@pytest.mark.parametrize("seqlen_q,group,d", [(1, 4, 32), (2, 2, 40), (33, 4, 128)])
@pytest.mark.parametrize("append", [False, True])
def test_split_kernel_merges_its_splits_as_the_combine_kernel_does(page_size, seqlen_q, group, d, append,
                                                                   monkeypatch):
    """Up to ``merge_last_max_splits`` splits an eager step's last program of each query tile
    to finish merges the tile's partials in the split kernel, and a captured or traced step
    (``bound=False`` here, torch.compile's way) merges them in the combine kernel in split
    order: the same bits (the same steps per element).  Above, the combine kernel's
    reductions over the split axis: the same up to rounding.  All agree with the reference,
    with an empty sequence (every split empty: out 0, LSE -inf) and splits past a sequence's
    end; (33, 4, 128): two query tiles per (sequence, KV head), each with its own counter.
    With an append: the step that writes the cache (the empty sequence then holds its new key)."""
    from flashtile.kernels import decode as kd

    nheads = 2 * group
    q, kc, vc, table = _case(3, seqlen_q, nheads, 2, d, 80, page_size, seed=64, device=DEVICE)
    knew = vnew = None
    if append:
        knew, vnew = (torch.randn(3, 1, 2, d, generator=_gen(65 + i)).to(DEVICE) for i in range(2))
    lengths = torch.tensor([0, 30, 79], dtype=torch.int32, device=DEVICE)
    results = []
    for knob, bound in (("", True), ("", False), ("merge_last_max_splits=0", True)):
        monkeypatch.setenv(kd.TUNING_ENV, knob)
        plan = kd.step_plan(q, kc, vc, knew, vnew, table, True, False, False, None, d ** -0.5, -1, 0, 0.0, 5, None,
                            knob)
        assert plan.eager.merge_last == (knob == "") and not plan.graph.merge_last and not plan.direct
        assert plan.graph.combine_options["IN_ORDER"] == (knob == "")
        kc_run, vc_run = kc.clone(), vc.clone()
        results.append(plan.run(q, kc_run, vc_run, lengths, None, table, None, None, knew, vnew, bound=bound))
    (merged, merged_lse), (in_order, in_order_lse), (reduced, reduced_lse) = results
    assert torch.equal(merged, in_order) and torch.equal(merged_lse, in_order_lse)
    torch.testing.assert_close(reduced, merged, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(reduced_lse, merged_lse, atol=1e-6, rtol=1e-5)
    if not append:
        assert torch.isneginf(merged_lse[0]).all() and not merged[0].any()
    _check(merged, merged_lse, q, kc_run, vc_run, table, [n + append for n in lengths.tolist()], causal=True)


@needs_kernels
@pytest.mark.parametrize("page_size", [None, 16])
def test_split_kernel_takes_one_int_length_for_every_sequence(page_size):
    q, kc, vc, table = _case(2, 1, 4, 2, 32, 64, page_size, seed=12, device=DEVICE)
    as_tensor = torch.full((2,), 41, dtype=torch.int32, device=DEVICE)
    expected = kvcache._attend_triton(q, kc, vc, as_tensor, None, table, 32 ** -0.5, -1, 0, 0.0, None, 3)
    out, lse = kvcache._attend_triton(q, kc, vc, 41, None, table, 32 ** -0.5, -1, 0, 0.0, None, 3)
    assert torch.equal(out, expected[0]) and torch.equal(lse, expected[1])
    _check(out, lse, q, kc, vc, table, [41, 41], causal=True)


@needs_kernels
@pytest.mark.parametrize("page_size", [None, 16])
@pytest.mark.parametrize("lengths", ["int", "int32", "int64"])
@pytest.mark.parametrize("splits", [1, 3])
def test_kernel_step_matches_the_cpu_path(page_size, lengths, splits):
    """The GPU branch of flash_attn_with_kvcache (append kernel, then decode with the appended
    keys added in the kernel; index tensors of either int dtype passed as they are) against
    the CPU path on the same checked arguments."""
    q, kc, vc, table = _case(3, 2, 4, 2, 32, 64, page_size, seed=60, device=DEVICE)
    g = _gen(61)
    knew, vnew = (torch.randn(3, 2, 2, 32, generator=g).to(DEVICE) for _ in range(2))
    dtype = torch.int64 if lengths == "int64" else torch.int32
    seqlens = 37 if lengths == "int" else torch.tensor([0, 37, 62], dtype=dtype, device=DEVICE)
    idx = None
    if page_size is None:
        idx = torch.tensor([2, 0, 1], dtype=dtype, device=DEVICE)
    else:
        table = table.to(dtype)
    kc_ref, vc_ref = kc.cpu().clone(), vc.cpu().clone()
    out, lse = kvcache._step_triton(q, kc, vc, knew, vnew, seqlens, idx, table, 0.2, -1, 0, 0.0, None, splits)
    want = flashtile.flash_attn_with_kvcache(q.cpu(), kc_ref, vc_ref, knew.cpu(), vnew.cpu(),
                                             cache_seqlens=seqlens if isinstance(seqlens, int) else seqlens.cpu(),
                                             cache_batch_idx=None if idx is None else idx.cpu(),
                                             block_table=None if table is None else table.cpu(),
                                             softmax_scale=0.2, causal=True, return_lse=True)
    assert torch.equal(kc.cpu(), kc_ref) and torch.equal(vc.cpu(), vc_ref)
    torch.testing.assert_close(out.cpu(), want[0], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(lse.cpu(), want[1], atol=2e-5, rtol=1e-4)


@needs_kernels
@pytest.mark.parametrize("page_size", [None, 16])
def test_launch_plans_follow_strides_scalars_and_flags(page_size):
    """Launch plans are cached per key (kernels/decode.py, _split_plans / _append_plans): calls
    of one shape that differ in strides, scalars, flags or split count each launch as their
    own arguments say, and a repeated call reuses its plan."""
    from flashtile.kernels import decode as kd

    q, kc, vc, table = _case(2, 2, 4, 2, 32, 64, page_size, seed=62, device=DEVICE)
    lengths = torch.tensor([64, 23], dtype=torch.int32, device=DEVICE)
    strided_q = torch.empty(2, 2, 4, 64, device=DEVICE)[..., :32].copy_(q)  # other strides, same shape
    for args in ((q, lengths, 32 ** -0.5, -1, 0, 0.0, 1), (strided_q, lengths, 32 ** -0.5, -1, 0, 0.0, 1),
                 (q, lengths, 0.3, -1, -1, 0.0, 3), (q, lengths, 0.3, 5, 0, 2.0, 3), (q, 23, 0.3, 5, 0, 2.0, 3)):
        x, seqlens, scale, left, right, softcap, splits = args
        for _ in range(2):
            plans = len(kd._split_plans)
            out, lse = kvcache._attend_triton(x, kc, vc, seqlens, None, table, scale, left, right, softcap, None,
                                              splits)
        assert len(kd._split_plans) == plans  # the repeat reused its plan
        n = [23, 23] if isinstance(seqlens, int) else seqlens.tolist()
        _check(out, lse, q, kc, vc, table, n, window=(left, right), softmax_scale=scale, softcap=softcap)
    # The append: a strided k (another plan) lands like a contiguous one.
    knew = torch.randn(2, 1, 2, 32, generator=_gen(63)).to(DEVICE)
    for new in (knew, torch.empty(2, 1, 2, 64, device=DEVICE)[..., :32].copy_(knew)):
        kc2, vc2 = kc.clone(), vc.clone()
        kd.append_kv(kc2, vc2, new, new, lengths - 1, None, table)
        for b, s in enumerate((lengths - 1).tolist()):
            assert torch.equal(_logical(kc2, table, b, s + 1)[s], knew[b, 0])


@needs_kernels
def test_split_kernel_softcap_alibi_window_and_batch_idx():
    q, kc, vc, _ = _case(2, 2, 4, 2, 40, 64, seed=7, device=DEVICE)
    slopes = (torch.rand(4, generator=_gen(8)) * 0.3).to(DEVICE)
    idx = torch.tensor([1, 0], dtype=torch.int32, device=DEVICE)
    lengths = torch.tensor([64, 30], dtype=torch.int32, device=DEVICE)
    out, lse = kvcache._attend_triton(q, kc, vc, lengths, idx, None, 0.2, 6, 1, 2.5, slopes, 3)
    for b, n in enumerate(lengths.tolist()):
        kb, vb = kc[idx[b].long(), :n], vc[idx[b].long(), :n]
        ref_o, ref_l = reference_attention(q[b:b + 1], kb[None], vb[None], softmax_scale=0.2, window_size=(6, 1),
                                           softcap=2.5, alibi_slopes=slopes)
        torch.testing.assert_close(out[b:b + 1].double(), ref_o, atol=3e-5, rtol=1e-4)
        torch.testing.assert_close(lse[b:b + 1].double(), ref_l, atol=3e-5, rtol=1e-4)


@pytest.mark.parametrize("batch,capacity,want", [(1, 32768, 64), (8, 32768, 8), (128, 8192, 1), (1, 2048, 8),
                                                 (1, 256, 1)])
def test_num_splits_fill_one_wave_with_long_enough_chunks(batch, capacity, want, monkeypatch):
    from flashtile.kernels import decode as kd

    monkeypatch.setattr(kd, "sm_count", lambda index: 132)  # an H200
    assert kd.choose_num_splits(batch, 4, capacity, torch.device("cuda", 0), 128) == want


@pytest.mark.parametrize("batch,capacity,paged,want", [
    (1, 32768, False, (128, 33)),  # 128-key tiles, one program per SM: 33 splits x 4 KV heads
    (8, 8192, False, (128, 4)),
    (1, 8192, False, (128, 32)),
    (1, 2048, False, (64, 16)),  # a short cache: 64-key tiles for twice the splits
    (1, 32768, True, (64, 64)),  # paged: 64-key tiles, two programs per SM
    (8, 8192, True, (128, 8)),  # paged with few splits: widened to 128-key tiles
])
def test_launch_shape_rules(batch, capacity, paged, want, monkeypatch):
    from flashtile.kernels import decode as kd

    monkeypatch.setattr(kd, "sm_count", lambda index: 132)  # an H200
    monkeypatch.setattr(kd, "INTERPRET", False)
    monkeypatch.delenv(kd.TUNING_ENV, raising=False)
    assert kd.launch_shape(batch, 4, capacity, torch.device("cuda", 0), paged, 128) == want


def test_decode_tuning_environment_overrides_the_knobs(monkeypatch):
    from flashtile.kernels import decode as kd

    monkeypatch.setenv(kd.TUNING_ENV, "block_n=64, warps=4")
    assert kd.knobs() == dict(kd.knobs(), block_n=64, warps=4) and kd.knobs()["stages"] == kd.STAGES
    monkeypatch.setenv(kd.TUNING_ENV, "blocks=64")
    with pytest.raises(ValueError, match="FLASHTILE_DECODE_TUNING"):
        kd.knobs()


def test_merge_is_exact_and_associative():
    q, kc, vc, _ = _case(1, 5, 2, 2, 16, 60, seed=9)
    full_o, full_l = reference_attention(q, kc, vc)
    parts = [reference_attention(q, kc[:, a:b], vc[:, a:b]) for a, b in ((0, 10), (10, 35), (35, 60))]
    parts = [(o.float(), l.float()) for o, l in parts]
    left = flashtile.merge_attention_states(*flashtile.merge_attention_states(*parts[0], *parts[1]), *parts[2])
    right = flashtile.merge_attention_states(*parts[0], *flashtile.merge_attention_states(*parts[1], *parts[2]))
    for o, l in (left, right):
        torch.testing.assert_close(o.double(), full_o, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(l.double(), full_l, atol=1e-5, rtol=1e-5)


def test_merge_with_empty_parts():
    o = torch.randn(1, 3, 2, 8)
    lse = torch.randn(1, 2, 3)
    empty_o, empty_l = torch.zeros_like(o), torch.full_like(lse, float("-inf"))
    m_o, m_l = flashtile.merge_attention_states(o, lse, empty_o, empty_l)
    torch.testing.assert_close(m_o, o)
    torch.testing.assert_close(m_l, lse)
    z_o, z_l = flashtile.merge_attention_states(empty_o, empty_l, empty_o, empty_l)
    assert (z_o == 0).all() and (z_l == float("-inf")).all()


def test_merge_validation():
    o, lse = torch.randn(1, 3, 2, 8), torch.randn(1, 2, 3)
    with pytest.raises(ValueError, match="lse"):
        flashtile.merge_attention_states(o, lse.transpose(1, 2), o, lse.transpose(1, 2))
    with pytest.raises(TypeError, match="out_b"):
        flashtile.merge_attention_states(o, lse, None, lse)


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(k=torch.randn(2, 1, 2, 16)), ValueError, "k and v"),
        (dict(cache_seqlens=torch.tensor([1.0, 2.0])), ValueError, "cache_seqlens"),
        (dict(cache_seqlens=torch.tensor([1, 2, 3], dtype=torch.int32)), ValueError, "cache_seqlens"),
        (dict(cache_seqlens=torch.tensor([1, 99], dtype=torch.int32)), ValueError, "capacity"),
        (dict(cache_seqlens=21), ValueError, "capacity"),
        (dict(cache_seqlens=-1), ValueError, "capacity"),
        (dict(block_table=torch.zeros(2, 2)), ValueError, "block_table"),
        (dict(num_splits=-1), ValueError, "num_splits"),
        (dict(cache_batch_idx=[0, 1]), TypeError, "cache_batch_idx"),
        (dict(softmax_scale=-1.0), ValueError, "softmax_scale"),
        (dict(window_size=(2,)), ValueError, "window_size"),
    ],
)
def test_validation(kwargs, exc, match):
    q = torch.randn(2, 1, 4, 16)
    kc, vc = torch.randn(2, 20, 2, 16), torch.randn(2, 20, 2, 16)
    with pytest.raises(exc, match=match):
        flashtile.flash_attn_with_kvcache(q, kc, vc, **kwargs)


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(causal=1), TypeError, "causal"),
    (dict(softmax_scale=True), TypeError, "softmax_scale"),
    (dict(window_size=(True, -1)), TypeError, "window_size left"),
    (dict(window_size=(-1.0, -1)), TypeError, "window_size left"),
    (dict(num_splits=True), ValueError, "num_splits"),
    (dict(return_lse=1), TypeError, "return_lse"),
    (dict(cache_seqlens=True), TypeError, "cache_seqlens"),
    (dict(cache_seqlens=21), ValueError, "capacity"),
])
def test_memoised_checks_still_tell_equal_keys_of_other_types_apart(kwargs, exc, match):
    """The checks are memoised per key (kvcache._checked): after a good call, a call whose
    scalars equal the good ones as dict keys (1 == True == 1.0) but not as arguments still
    raises, caches nothing, and an int length is still checked against the capacity."""
    q = torch.randn(2, 1, 4, 16)
    kc, vc = torch.randn(2, 20, 2, 16), torch.randn(2, 20, 2, 16)
    good = dict(causal=True, softmax_scale=1, window_size=(1, -1), num_splits=1, return_lse=True, cache_seqlens=20)
    flashtile.flash_attn_with_kvcache(q, kc, vc, **good)
    flashtile.flash_attn_with_kvcache(q, kc, vc, **dict(good, window_size=[1, -1]))  # a list: checked, not memoised
    cached = len(kvcache._checked)
    with pytest.raises(exc, match=match):
        flashtile.flash_attn_with_kvcache(q, kc, vc, **dict(good, **kwargs))
    assert len(kvcache._checked) == cached


def test_memoised_checks_key_on_shapes_strides_and_devices():
    """A cached good call does not let a tensor through that differs in what the checks read."""
    q = torch.randn(2, 1, 4, 16)
    kc, vc = torch.randn(2, 20, 2, 16), torch.randn(2, 20, 2, 16)
    flashtile.flash_attn_with_kvcache(q, kc, vc, kc[:, :1], vc[:, :1], cache_seqlens=3)
    with pytest.raises(ValueError, match="stride 0"):  # same shape, an expanded view
        flashtile.flash_attn_with_kvcache(q, kc[:1].expand(2, -1, -1, -1), vc, kc[:, :1], vc[:, :1], cache_seqlens=3)
    with pytest.raises(ValueError, match="contiguous in its last"):
        flashtile.flash_attn_with_kvcache(q.transpose(2, 3).contiguous().transpose(2, 3), kc, vc, cache_seqlens=3)
    with pytest.raises(ValueError, match="dtype"):
        flashtile.flash_attn_with_kvcache(q.half(), kc, vc, cache_seqlens=3)
    with pytest.raises(ValueError, match="q's device"):
        flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor([1, 2], device="meta"))


@pytest.mark.parametrize("k_cache,match", [
    (torch.randn(2, 20, 2, 16, dtype=torch.float16), "q, k_cache and v_cache must share one dtype"),
    (torch.randn(2, 20, 3, 16), "k_cache and v_cache must have one shape"),
    (torch.randn(2, 20, 3, 16), "nheads of k_cache/v_cache"),
    (torch.randn(2, 20, 2, 8), "head dimension"),
])
def test_cache_validation_names_the_cache(k_cache, match):
    q = torch.randn(2, 1, 4, 16)
    v_cache = k_cache.clone() if "nheads" in match or "head dim" in match else torch.randn(2, 20, 2, 16)
    with pytest.raises(ValueError, match=match):
        flashtile.flash_attn_with_kvcache(q, k_cache, v_cache)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [None, 16, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_decode_matches_reference(page_size, dtype):
    q, kc, vc, table = _case(4, 1, 32, 4, 128, 4096, page_size, seed=10, dtype=dtype, device="cuda")
    g = _gen(11)
    knew = torch.randn(4, 1, 4, 128, generator=g).to("cuda", dtype)
    vnew = torch.randn(4, 1, 4, 128, generator=g).to("cuda", dtype)
    seqlens = torch.tensor([0, 1, 1000, 4095], dtype=torch.int32, device="cuda")
    out, lse = flashtile.flash_attn_with_kvcache(q, kc, vc, knew, vnew, cache_seqlens=seqlens, block_table=table,
                                                 causal=True, return_lse=True)
    _check(out, lse, q, kc, vc, table, [s + 1 for s in seqlens.tolist()], causal=True, atol=2e-2)
    # One int length for every sequence: passed to the kernel as it is.
    out, lse = flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=3000, block_table=table, return_lse=True)
    _check(out, lse, q, kc, vc, table, [3000] * 4, causal=False, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("capacity,merged", [(1024, True), (8192, False)])
def test_gpu_decode_scratch_is_reused_and_left_ready(capacity, merged):
    """A step's partials (and the merge's counters) live in its stream's scratch
    (``flashtile.kernels.workspace``): steps on one stream reuse it, every step leaves the
    counters zero, and 200 repeats of a step -- merged by whichever split finishes last, or
    by the combine kernel at more splits -- are bitwise equal, equal to the step captured in
    a CUDA graph (merged by the combine kernel), and match the reference."""
    from flashtile.kernels import decode as kd
    from flashtile.kernels import workspace

    workspace.clear()
    q, kc, vc, _ = _case(1, 1, 32, 4, 128, capacity, None, seed=70, dtype=torch.bfloat16, device="cuda")
    plan = kd.step_plan(q, kc, vc, None, None, None, False, False, False, None, 128 ** -0.5, -1, -1, 0.0, 0, None, "")
    assert plan.eager.merge_last == merged and plan.num_splits > 1
    first, first_lse = flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=capacity - 24, return_lse=True)
    outs = [flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=capacity - 24) for _ in range(200)]
    torch.cuda.synchronize()
    assert len(workspace._scratch) == 1
    held = next(iter(workspace._scratch.values()))
    assert held.n_floats >= plan.part_numel and not held.counters.any()
    assert all(torch.equal(out, first) for out in outs)
    _check(first, first_lse, q, kc, vc, None, [capacity - 24], atol=2e-2)
    # Captured in a graph, the step merges in the combine kernel: the same bits.
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=capacity - 24, return_lse=True)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured, captured_lse = flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=capacity - 24,
                                                                   return_lse=True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, first) and torch.equal(captured_lse, first_lse)


@pytest.mark.gpu
def test_gpu_decode_steps_on_two_streams_keep_their_own_scratch():
    """Steps issued on two streams at once, each its own inputs: each stream has its own
    scratch, so neither reads the other's partials or counters."""
    from flashtile.kernels import workspace

    workspace.clear()
    cases = [_case(1, 1, 32, 4, 128, 2048, None, seed=71 + i, dtype=torch.bfloat16, device="cuda") for i in range(2)]
    expected = [flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=2000) for q, kc, vc, _ in cases]
    streams = [torch.cuda.Stream() for _ in cases]
    results = [[], []]
    for stream in streams:
        stream.wait_stream(torch.cuda.current_stream())
    for _ in range(100):
        for (q, kc, vc, _), stream, outs in zip(cases, streams, results):
            with torch.cuda.stream(stream):
                outs.append(flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=2000))
    torch.cuda.synchronize()
    assert len(workspace._scratch) == 3
    for outs, want in zip(results, expected):
        assert all(torch.equal(out, want) for out in outs)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [None, 16])
def test_gpu_decode_step_replays_in_a_cuda_graph(page_size):
    """A decode step with an append, captured once and replayed as the lengths grow: the
    lengths are read on the device, so the replay is exact with no re-capture."""
    q, kc, vc, table = _case(2, 1, 8, 2, 128, 2048, page_size, seed=14, dtype=torch.bfloat16, device="cuda")
    knew = torch.randn(2, 1, 2, 128, generator=_gen(15)).to("cuda", torch.bfloat16)
    vnew = torch.randn(2, 1, 2, 128, generator=_gen(16)).to("cuda", torch.bfloat16)
    seqlens = torch.tensor([5, 700], dtype=torch.int32, device="cuda")
    kc0, vc0 = kc.clone(), vc.clone()

    def step():
        return flashtile.flash_attn_with_kvcache(q, kc, vc, knew, vnew, cache_seqlens=seqlens, block_table=table,
                                                 causal=True, return_lse=True)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = step()
    for lengths in ([5, 700], [6, 1500], [2046, 0]):
        kc.copy_(kc0), vc.copy_(vc0)
        seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        expected = flashtile.flash_attn_with_kvcache(q, kc0.clone(), vc0.clone(), knew, vnew, cache_seqlens=seqlens,
                                                     block_table=table, causal=True, return_lse=True)
        torch.testing.assert_close(out, expected[0], atol=0, rtol=0)
        torch.testing.assert_close(lse, expected[1], atol=0, rtol=0)
        _check(out, lse, q, kc, vc, table, [n + 1 for n in lengths], causal=True, atol=2e-2)


# ---------------------------------------------------------------------------------------
# Index values: checked before anything is written; a failed call changes nothing
# ---------------------------------------------------------------------------------------


def _append_case(page_size=None, batch=2, rows=None, capacity=8, seed=20):
    """q, caches, new k/v (2 positions each) for a small cache of ``rows`` rows (or pages)."""
    g = _gen(seed)
    rows = rows or (batch if page_size is None else 4)
    shape = (rows, capacity if page_size is None else page_size, 2, 8)
    kc, vc = torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)
    q = torch.randn(batch, 1, 2, 8, generator=g)
    knew, vnew = torch.randn(batch, 2, 2, 8, generator=g), torch.randn(batch, 2, 2, 8, generator=g)
    return q, kc, vc, knew, vnew


def _assert_rejected_unchanged(match, *args, **kwargs):
    """flash_attn_with_kvcache(*args, **kwargs) raises ValueError and leaves every tensor as it was."""
    tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
    before = [t.clone() for t in tensors]
    with pytest.raises(ValueError, match=match):
        flashtile.flash_attn_with_kvcache(*args, **kwargs)
    for t, b in zip(tensors, before):
        assert torch.equal(t, b), "a rejected call changed an input"


@pytest.mark.parametrize("lengths,knew", [([-1, 0], True), ([-3, 2], False)])
def test_negative_cache_seqlens_rejected(lengths, knew):
    """Item 1: a negative length wrote at the end of the cache (append) or failed in torch.arange."""
    q, kc, vc, kn, vn = _append_case()
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    if knew:
        _assert_rejected_unchanged(r"cache_seqlens\[0\] = -1", q, kc, vc, kn, vn, cache_seqlens=seqlens)
    else:
        _assert_rejected_unchanged(r"cache_seqlens\[0\] = -3", q, kc, vc, cache_seqlens=seqlens)


@pytest.mark.parametrize("idx,match", [([0, 5], r"cache_batch_idx\[1\] = 5"), ([-1, 0], r"cache_batch_idx\[0\] = -1"),
                                       ([1, 1], r"cache_batch_idx\[0\] = cache_batch_idx\[1\] = 1")])
def test_bad_cache_batch_idx_rejected_before_any_write(idx, match):
    """Items 2, 3, 6: out of range (IndexError after writing k_cache only), negative (read the
    last row), duplicated with an append (one sequence read the other's new keys)."""
    q, kc, vc, kn, vn = _append_case(rows=4)
    _assert_rejected_unchanged(match, q, kc, vc, kn, vn, cache_seqlens=torch.tensor([1, 2], dtype=torch.int32),
                               cache_batch_idx=torch.tensor(idx, dtype=torch.int32))


def test_duplicate_cache_batch_idx_without_append_is_a_read():
    q, kc, vc, _, _ = _append_case(rows=4)
    out = flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor([3, 5], dtype=torch.int32),
                                           cache_batch_idx=torch.tensor([2, 2], dtype=torch.int32))
    ref = reference_attention(q[1:], kc[2:3, :5], vc[2:3, :5])[0]
    torch.testing.assert_close(out[1:].double(), ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("table,match", [([[0, 1], [2, 9]], r"block_table\[1, 1\] = 9"),
                                         ([[0, -1], [2, 3]], r"block_table\[0, 1\] = -1"),
                                         ([[0, 1], [3, 1]], r"block_table\[0, 1\] = 1 receives")])
def test_bad_block_table_rejected_before_any_write(table, match):
    """Items 4, 5: a page id out of range (IndexError after a partial write) or negative
    (wrapped to the last page); and a page written by one sequence and read by another."""
    q, kc, vc, kn, vn = _append_case(page_size=4, rows=4)
    _assert_rejected_unchanged(match, q, kc, vc, kn, vn, cache_seqlens=torch.tensor([3, 3], dtype=torch.int32),
                               block_table=torch.tensor(table, dtype=torch.int32))


def test_negative_page_rejected_without_append():
    """Item 5 without an append: the output equalled reading the last page."""
    q, kc, vc, _, _ = _append_case(page_size=4, rows=4)
    with pytest.raises(ValueError, match=r"block_table\[0, 1\] = -1"):
        flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor([6, 2], dtype=torch.int32),
                                          block_table=torch.tensor([[0, -1], [2, 3]], dtype=torch.int32))


def test_unused_block_table_entries_are_not_checked():
    """Pages past a sequence's length may hold anything (serving engines pad with -1)."""
    q, kc, vc, kn, vn = _append_case(page_size=4, rows=4)
    table = torch.tensor([[0, -1], [2, 99]], dtype=torch.int32)
    out = flashtile.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=torch.tensor([1, 0], dtype=torch.int32),
                                           block_table=table)
    assert torch.isfinite(out).all()
    assert torch.equal(kc[0, 1:3], kn[0]) and torch.equal(kc[2, 0:2], kn[1])


def test_capacity_counts_the_appended_keys():
    q, kc, vc, kn, vn = _append_case(capacity=8)
    _assert_rejected_unchanged(r"cache_seqlens\[1\] = 7 \(\+ seqlen_new 2 = 9\)", q, kc, vc, kn, vn,
                               cache_seqlens=torch.tensor([6, 7], dtype=torch.int32))
    _assert_rejected_unchanged(r"cache_seqlens \(7\) \(\+ seqlen_new 2 = 9\)", q, kc, vc, kn, vn, cache_seqlens=7)
    out = flashtile.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=6)  # exactly full
    assert torch.equal(kc[:, 6:], kn) and torch.isfinite(out).all()


@pytest.mark.parametrize("which", ["k_cache", "v_cache"])
def test_expanded_cache_rejected_for_an_append(which):
    """Item 7: a stride-0 cache accepted an append, so its rows aliased."""
    q, kc, vc, kn, vn = _append_case()
    expanded = kc[:1].expand(2, -1, -1, -1)
    kc, vc = (expanded, vc) if which == "k_cache" else (kc, vc[:1].expand(2, -1, -1, -1))
    with pytest.raises(ValueError, match=f"{which} has stride 0"):
        flashtile.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=1)
    flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=1)  # reading an expanded cache is fine


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(cache_seqlens=True), TypeError, "cache_seqlens"),
    (dict(cache_seqlens=[1, 2]), TypeError, "cache_seqlens"),
    (dict(cache_batch_idx=torch.tensor([[0, 1]], dtype=torch.int32)), ValueError, "cache_batch_idx"),
    (dict(block_table=torch.zeros(2, 0, dtype=torch.int32)), ValueError, "block_table"),
    (dict(block_table=torch.zeros(3, 1, dtype=torch.int32)), ValueError, "block_table"),
])
def test_index_argument_types_and_shapes(kwargs, exc, match):
    q, kc, vc, _, _ = _append_case()
    with pytest.raises(exc, match=match):
        flashtile.flash_attn_with_kvcache(q, kc, vc, **kwargs)


@pytest.mark.parametrize("page_size", [None, 4])
def test_empty_row_is_zero_even_when_v_holds_inf(page_size):
    """Item 10 on the KV-cache path: causal, seqlen_q 5 > 3 keys: rows 0-1 see no key."""
    g = _gen(30)
    q = torch.randn(1, 5, 2, 8, generator=g)
    kc, vc = torch.randn(1, 4, 2, 8, generator=g), torch.randn(1, 4, 2, 8, generator=g)
    table = None
    if page_size is not None:
        table = torch.tensor([[0]], dtype=torch.int32)
    vc[0, 0, 0, 0] = float("inf")
    out, lse = flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=3, block_table=table, causal=True,
                                                 return_lse=True)
    assert torch.equal(out[0, :2], torch.zeros_like(out[0, :2])) and (lse[0, :, :2] == float("-inf")).all()


# ---------------------------------------------------------------------------------------
# The kernels: in bounds whatever the index values (the host checks are skipped in capture)
# ---------------------------------------------------------------------------------------


def _guarded(shape, seed):
    """A tensor in the middle of a larger buffer filled with a sentinel: a write outside it shows."""
    rows = shape[0]
    buf = torch.full((rows + 4, *shape[1:]), 7.0)
    buf[2:2 + rows] = torch.randn(*shape, generator=_gen(seed))
    return buf, buf[2:2 + rows]


@needs_kernels
@pytest.mark.parametrize("case", ["negative_length", "too_long", "row_out_of_range", "negative_row", "bad_page",
                                  "negative_page"])
def test_append_kernel_writes_nothing_on_bad_indices(case):
    paged = "page" in case
    kbuf, kc = _guarded((4, 4 if paged else 8, 2, 8), 40)
    vbuf, vc = _guarded((4, 4 if paged else 8, 2, 8), 41)
    kbuf, vbuf = kbuf.to(DEVICE), vbuf.to(DEVICE)
    kc, vc = kbuf[2:6], vbuf[2:6]
    kn = torch.randn(2, 2, 2, 8, generator=_gen(42)).to(DEVICE)
    vn = torch.randn(2, 2, 2, 8, generator=_gen(43)).to(DEVICE)
    lengths = {"negative_length": [-1, 0], "too_long": [7, 0]}.get(case, [1, 2])
    idx = {"row_out_of_range": [0, 4], "negative_row": [-1, 0]}.get(case)
    table = {"bad_page": [[0, 1], [2, 4]], "negative_page": [[0, -2], [2, 3]]}.get(case)
    seqlens = torch.tensor(lengths if not paged else [3, 3], dtype=torch.int32, device=DEVICE)
    idx = None if idx is None else torch.tensor(idx, dtype=torch.int32, device=DEVICE)
    table = None if table is None else torch.tensor(table, dtype=torch.int32, device=DEVICE)
    kb, vb = kbuf.clone(), vbuf.clone()
    from flashtile.kernels.decode import append_kv

    append_kv(kc, vc, kn, vn, seqlens, idx, table)
    assert torch.equal(kbuf, kb) and torch.equal(vbuf, vb)
    # The same call with valid values writes exactly the new rows.
    seqlens = torch.tensor([1, 2], dtype=torch.int32, device=DEVICE)
    table = None if table is None else torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=DEVICE)
    idx = None if idx is None else torch.tensor([3, 0], dtype=torch.int32, device=DEVICE)
    append_kv(kc, vc, kn, vn, seqlens, idx, table)
    expected_k = kb.clone()
    kexp = expected_k[2:6]
    for b, s in enumerate([1, 2]):
        for t in range(2):
            pos = s + t
            if table is not None:
                kexp[int(table[b, pos // 4]), pos % 4] = kn[b, t]
            else:
                kexp[b if idx is None else int(idx[b]), pos] = kn[b, t]
    assert torch.equal(kbuf, expected_k)


@needs_kernels
@pytest.mark.parametrize("case", ["negative_length", "too_long", "row_out_of_range", "negative_row", "bad_page",
                                  "negative_page"])
def test_decode_kernel_stays_in_bounds_on_bad_indices(case):
    """The decode kernel clamps lengths into [0, capacity] and drops rows / pages that do not
    exist: finite output, and keys are read only from the cache (a sentinel of NaN around the
    cache would poison the output if any were read)."""
    paged = "page" in case
    kbuf = torch.full((8, 4 if paged else 8, 2, 8), float("nan"), device=DEVICE)
    vbuf = torch.full((8, 4 if paged else 8, 2, 8), float("nan"), device=DEVICE)
    kc, vc = kbuf[2:6], vbuf[2:6]
    kc.copy_(torch.randn(kc.shape, generator=_gen(44)).to(DEVICE))
    vc.copy_(torch.randn(vc.shape, generator=_gen(45)).to(DEVICE))
    q = torch.randn(2, 1, 4, 8, generator=_gen(46)).to(DEVICE)
    lengths = {"negative_length": [-5, 3], "too_long": [100, 3]}.get(case, [8 if not paged else 8, 3])
    idx = {"row_out_of_range": [0, 4], "negative_row": [-1, 0]}.get(case)
    table = {"bad_page": [[0, 1], [2, 400]], "negative_page": [[0, -2], [2, 3]]}.get(case)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    idx = None if idx is None else torch.tensor(idx, dtype=torch.int32, device=DEVICE)
    table = None if table is None else torch.tensor(table, dtype=torch.int32, device=DEVICE)
    for splits in (1, 3):
        out, lse = kvcache._attend_triton(q, kc, vc, seqlens, idx, table, 8 ** -0.5, -1, -1, 0.0, None, splits)
        assert not torch.isnan(out).any() and not torch.isnan(lse).any()


# ---------------------------------------------------------------------------------------
# Launch configs within the shared-memory budget for every legal shape (item 9)
# ---------------------------------------------------------------------------------------

# flash-attn's kvcache parametrisation: seqlen_q up to 128, MHA / GQA / MQA (6 query heads),
# d up to 256, contiguous and paged (page 256), several cache lengths.
_FA_SHAPES = [(sq, nheads, nheads_k, d, paged, seqlen_k, dtype)
              for sq in (1, 3, 64, 128) for nheads, nheads_k in ((6, 6), (6, 3), (6, 1))
              for d in (32, 59, 64, 80, 128, 256) for paged in (False, True) for seqlen_k in (256, 800, 2048)
              for dtype in (torch.float16, torch.float32)]


def test_launch_configs_fit_the_shared_memory_budget(monkeypatch):
    from flashtile.kernels import decode as kd
    from flashtile.kernels.tma import padded_headdim

    monkeypatch.setattr(kd, "sm_count", lambda index: 132)  # an H200
    monkeypatch.setattr(kd, "INTERPRET", False)
    monkeypatch.setattr(kd, "smem_budget", lambda index: 232448)
    monkeypatch.delenv(kd.TUNING_ENV, raising=False)
    for sq, nheads, nheads_k, d, paged, seqlen_k, dtype in _FA_SHAPES:
        hd = padded_headdim(d)
        capacity = -(-seqlen_k // 256) * 256 if paged else seqlen_k
        elt = torch.empty((), dtype=dtype).element_size()
        cfg = kd.launch_config(2, nheads_k, capacity, torch.device("cuda", 0), paged, hd, sq * nheads // nheads_k,
                               elt)
        need = kd.smem_bytes(cfg.block_m, cfg.block_n, hd, cfg.stages, elt)
        assert need <= 232448, (sq, nheads, nheads_k, d, paged, seqlen_k, dtype, cfg)
        assert cfg.block_m * hd <= kd.MAX_TILE_ELEMENTS or cfg.block_m == 16
    # The tuned decode configs are kept where they fit: one query row per head, d = 128.
    cfg = kd.launch_config(1, 4, 32768, torch.device("cuda", 0), False, 128, 8, 2)
    assert (cfg.block_m, cfg.block_n, cfg.stages, cfg.num_splits) == (16, 128, kd.STAGES, 33)


@needs_kernels
@pytest.mark.parametrize("paged", [False, True])
def test_long_query_groups_run_in_several_row_tiles(paged, monkeypatch):
    """seqlen_q * group above one query tile: the rows are cut over a third grid axis."""
    from flashtile.kernels import decode as kd

    monkeypatch.setattr(kd, "MAX_TILE_ELEMENTS", 16 * 32)  # 16-row tiles at d = 32
    # Configs and launch plans are cached per shape: computed afresh here, from the patched constant.
    monkeypatch.setattr(kd, "cached_launch_config", kd.cached_launch_config.__wrapped__)
    monkeypatch.setattr(kd, "_split_plans", {})
    q, kc, vc, table = _case(2, 7, 6, 1, 32, 80, 16 if paged else None, seed=50, device=DEVICE)
    lengths = torch.tensor([80, 33], dtype=torch.int32, device=DEVICE)
    assert kd.launch_config(2, 1, 80, q.device, paged, 32, 42, 4).block_m == 16
    out, lse = kvcache._attend_triton(q, kc, vc, lengths, None, table, 32 ** -0.5, -1, 0, 0.0, None, 2)
    _check(out, lse, q, kc, vc, table, lengths.tolist(), causal=True)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("page_size", [None, 256])
@pytest.mark.parametrize("seqlen_q", [1, 64, 128])
@pytest.mark.parametrize("nheads_k", [6, 3, 1])
def test_gpu_decode_long_query_groups_run(d, page_size, seqlen_q, nheads_k):
    """Item 9: seqlen_q = 64 with MQA at d = 256 (and d = 128 paged) ran out of shared memory."""
    for seqlen_k in (256, 800, 2048):
        q, kc, vc, table = _case(2, seqlen_q, 6, nheads_k, d, seqlen_k, page_size, seed=51, dtype=torch.bfloat16,
                                 device="cuda")
        g = _gen(52)
        knew = torch.randn(2, 3, nheads_k, d, generator=g).to("cuda", torch.bfloat16)
        vnew = torch.randn(2, 3, nheads_k, d, generator=g).to("cuda", torch.bfloat16)
        lengths = [seqlen_k - 3, seqlen_k // 3]
        seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
        out, lse = flashtile.flash_attn_with_kvcache(q, kc, vc, knew, vnew, cache_seqlens=seqlens, block_table=table,
                                                     causal=True, return_lse=True)
        _check(out, lse, q, kc, vc, table, [n + 3 for n in lengths], causal=True, atol=3e-2)


@pytest.mark.gpu
def test_gpu_decode_smem_estimate_bounds_the_compiler(monkeypatch):
    """smem_bytes (which launch_config keeps under the device's budget) is at least what the
    compiler allocates, for the configs of long query groups."""
    from flashtile.kernels import decode as kd

    compiled = []
    real = kd._decode_split

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                kernel = real[grid](*args, **kwargs)
                compiled.append((kwargs, kernel.metadata.shared))
                return kernel
            return launch

    monkeypatch.setattr(kd, "_decode_split", Recorder())
    for seqlen_q, d, page_size in ((1, 128, None), (64, 256, None), (64, 256, 256), (64, 128, 256), (128, 256, None)):
        q, kc, vc, table = _case(1, seqlen_q, 6, 1, d, 2048, page_size, seed=53, dtype=torch.bfloat16, device="cuda")
        flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=2048, block_table=table)
    for kwargs, shared in compiled:
        bound = kd.smem_bytes(kwargs["BLOCK_M"], kwargs["BLOCK_N"], kwargs["HEAD_DIM"], kwargs["num_stages"], 2)
        assert shared <= bound <= kd.smem_budget(0), (kwargs["BLOCK_M"], kwargs["BLOCK_N"], kwargs["HEAD_DIM"],
                                                      kwargs["num_stages"], shared, bound)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 256])
def test_gpu_seqlens_beyond_the_block_table_clamped(page_size, monkeypatch):
    """Item 8 (flash-attn's test_flash_attn_kvcache_paged_block_table_bounds): cache_seqlens
    past block_table.shape[1] * page_size, no append.  Index tensors on a GPU are not read on
    the host (no sync per step): the kernel clamps the length to the table instead of reading
    past it.  With ``check_device_values`` the host check raises, naming the entry."""
    q, kc, vc, table = _case(2, 1, 4, 2, 64, 512, page_size, seed=54, dtype=torch.bfloat16, device="cuda")
    capacity = table.shape[1] * page_size
    seqlens = torch.tensor([capacity + page_size, 5], dtype=torch.int32, device="cuda")
    out, lse = flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, block_table=table,
                                                 softmax_scale=0.125, return_lse=True)
    expected = flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor([capacity, 5], dtype=torch.int32,
                                                 device="cuda"), block_table=table, softmax_scale=0.125,
                                                 return_lse=True)
    torch.testing.assert_close(out, expected[0], atol=0, rtol=0)
    torch.testing.assert_close(lse, expected[1], atol=0, rtol=0)
    bad = table.clone()
    bad[1, 0] = -1
    five = torch.tensor([5, 5], dtype=torch.int32, device="cuda")
    out = flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=five, block_table=bad)
    assert not torch.isnan(out).any()  # the page that does not exist is dropped, nothing read past the cache
    monkeypatch.setattr(kvcache, "check_device_values", True)
    with pytest.raises(ValueError, match=r"cache_seqlens\[0\]"):
        flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, block_table=table)
    with pytest.raises(ValueError, match=r"block_table\[1, 0\] = -1"):
        flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=five, block_table=bad)
    with pytest.raises(ValueError, match=r"cache_seqlens \(\d+\)"):  # an int is checked whatever the setting
        monkeypatch.setattr(kvcache, "check_device_values", False)
        flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=capacity + 1, block_table=table)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [None, 16])
def test_gpu_bad_indices_in_a_cuda_graph_touch_nothing(page_size):
    """Inside capture the host cannot check the values: a replay with bad ones writes nothing
    (the append kernel checks the whole batch first) and reads in bounds (finite output)."""
    q, kc, vc, table = _case(2, 1, 8, 2, 128, 256, page_size, seed=55, dtype=torch.bfloat16, device="cuda")
    knew = torch.randn(2, 1, 2, 128, generator=_gen(56)).to("cuda", torch.bfloat16)
    vnew = torch.randn(2, 1, 2, 128, generator=_gen(57)).to("cuda", torch.bfloat16)
    seqlens = torch.tensor([5, 70], dtype=torch.int32, device="cuda")

    def step():
        return flashtile.flash_attn_with_kvcache(q, kc, vc, knew, vnew, cache_seqlens=seqlens, block_table=table,
                                                 causal=True)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for lengths in ([-1, 3], [5, 256], [10**6, 0]):
        kc0, vc0 = kc.clone(), vc.clone()
        seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(kc, kc0) and torch.equal(vc, vc0)
        assert not torch.isnan(out).any()


@pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")
def test_shared_memory_query_is_a_constant_for_dynamo(monkeypatch):
    """The launch configuration asks Triton's driver for the device's shared memory, a C
    extension Dynamo cannot trace: under ``torch.compile(fullgraph=True)`` the answer must be a
    constant of the trace, not a graph break (stood in for here by a compiler-disabled query)."""
    import triton

    from flashtile.kernels import decode as kd

    real = triton.runtime.driver.active if torch.cuda.is_available() else None

    class Driver:
        class utils:
            get_device_properties = staticmethod(torch.compiler.disable(lambda index: {"max_shared_mem": 1234}))

        def __getattr__(self, name):  # the rest (what Inductor asks on a GPU machine) from the real driver
            if real is None:
                raise AttributeError(name)
            return getattr(real, name)

    monkeypatch.setattr(triton.runtime.driver, "_active", Driver())
    monkeypatch.setattr(kd, "INTERPRET", False)
    kd.smem_budget.cache_clear()
    try:
        torch._dynamo.reset()
        budget = torch.compile(lambda x: x + kd.smem_budget(0), fullgraph=True)(torch.zeros(2))
        assert budget.tolist() == [1234.0, 1234.0]
    finally:
        kd.smem_budget.cache_clear()
        torch._dynamo.reset()


@pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")
def test_decode_launch_configuration_traces_under_fullgraph_compile():
    """The decode launch configuration is built inside a ``torch.compile(fullgraph=True)`` trace
    of ``flash_attn_with_kvcache``: its class must be one Dynamo can construct."""
    from flashtile.kernels import decode as kd

    device = torch.device("cpu")
    want = kd.launch_config(2, 2, 1024, device, False, 128, 16, 2)
    try:
        torch._dynamo.reset()
        got = torch.compile(lambda x: x + kd.launch_config(2, 2, 1024, device, False, 128, 16, 2).block_n,
                            fullgraph=True)(torch.zeros(2))
        assert got.tolist() == [float(want.block_n)] * 2
    finally:
        torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.parametrize("append, lengths, page_size, rotary", [
    (False, "int", None, False), (False, "tensor", None, False), (True, "int", None, False),
    (True, "tensor", None, False), (False, "tensor", 16, False), (True, "int", 16, False), (True, "tensor", 16, False),
    (True, "tensor", None, True), (True, "int", 16, True),
], ids=lambda v: str(v))
def test_gpu_torch_compile_fullgraph_matches_eager(append, lengths, page_size, rotary):
    """``torch.compile(fullgraph=True)`` of a function calling ``flash_attn_with_kvcache`` (the
    step traced: checks, plan, kernel launches through Dynamo's Triton support) gives eager's
    outputs and leaves the cache as eager leaves it; two steps, the length growing between
    them (an int length: a new value, so a recompile or a symbolic int)."""
    torch._dynamo.reset()
    q, kc, vc, table = _case(2, 1, 8, 2, 128, 1024, page_size, seed=40, dtype=torch.bfloat16, device="cuda")
    g = _gen(41)
    knew, vnew = (torch.randn(2, 1, 2, 128, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
    cos = sin = None
    if rotary:
        angles = torch.rand(1100, 32, generator=g) * 6.0
        cos, sin = angles.cos().to("cuda"), angles.sin().to("cuda")

    def step(q, k_cache, v_cache, k, v, seqlens):
        out, lse = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens,
                                                     block_table=table, causal=True, return_lse=True,
                                                     rotary_cos=cos, rotary_sin=sin)
        return out * 2, lse  # a torch op after the call: the graph continues past it

    compiled = torch.compile(step, fullgraph=True)
    caches = {"eager": (kc.clone(), vc.clone()), "compiled": (kc.clone(), vc.clone())}
    for length in (700, 701):
        seqlens = length if lengths == "int" else torch.tensor([length, length // 3], dtype=torch.int32,
                                                                device="cuda")
        new = (knew, vnew) if append else (None, None)
        want = step(q, *caches["eager"], *new, seqlens)
        got = compiled(q, *caches["compiled"], *new, seqlens)
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
        assert torch.equal(caches["compiled"][0], caches["eager"][0])
        assert torch.equal(caches["compiled"][1], caches["eager"][1])
