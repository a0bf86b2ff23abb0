"""Property-style checks of the public API on random inputs (seeded, small, CPU).

Legal inputs: the result matches the float64 reference (``flashtile.reference``).
Illegal inputs (one thing wrong: a type, a shape, a dtype, a scalar, an index value):
``ValueError`` / ``TypeError``, and every input tensor bitwise unchanged -- in particular no
partial KV-cache append.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import flashtile
from flashtile.reference import attention_naive, log_softmax as ref_log_softmax, softmax_3pass

CASES = 24


def _tensors(*objs):
    found = []
    for o in objs:
        if isinstance(o, torch.Tensor):
            found.append(o)
        elif isinstance(o, dict):
            found += _tensors(*o.values())
        elif isinstance(o, (list, tuple)):
            found += _tensors(*o)
    return found


def _assert_rejected(fn, args, kwargs):
    tensors = _tensors(args, kwargs)
    before = [t.clone() for t in tensors]
    with pytest.raises((ValueError, TypeError)):
        fn(*args, **kwargs)
    for t, b in zip(tensors, before):
        assert t.dtype == b.dtype and t.shape == b.shape and torch.equal(t, b), "a rejected call changed an input"


def _close(got, want, atol=3e-5):
    want = torch.as_tensor(np.asarray(want))
    torch.testing.assert_close(got.double(), want, atol=atol, rtol=1e-4)


# ---------------------------------------------------------------------------------------
# Random legal problems
# ---------------------------------------------------------------------------------------


def _attention_problem(rng: random.Random):
    batch, nheads_k = rng.randint(1, 2), rng.choice([1, 2])
    nheads = nheads_k * rng.choice([1, 2, 3])
    seqlen_q, seqlen_k, d = rng.randint(1, 9), rng.randint(1, 11), rng.choice([8, 16, 24])
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    q = torch.randn(batch, seqlen_q, nheads, d, generator=g)
    k = torch.randn(batch, seqlen_k, nheads_k, d, generator=g)
    v = torch.randn(batch, seqlen_k, nheads_k, d, generator=g)
    kw = dict(causal=rng.random() < 0.5, softmax_scale=rng.choice([None, 0.3, 1.1]))
    if rng.random() < 0.3:
        kw["window_size"] = (rng.randint(-1, 4), rng.randint(-1, 4) if not kw["causal"] else 0)
    return q, k, v, kw


def _reference(q, k, v, kw):
    return attention_naive(q.numpy(), k.numpy(), v.numpy(), softmax_scale=kw.get("softmax_scale"),
                           causal=kw.get("causal", False), window_size=kw.get("window_size", (-1, -1)))


@pytest.mark.parametrize("seed", range(CASES))
def test_legal_inputs_match_the_reference(seed):
    rng = random.Random(seed)
    q, k, v, kw = _attention_problem(rng)
    ref_o, ref_l = _reference(q, k, v, kw)

    out, lse = flashtile.flash_attn_func(q, k, v, return_lse=True, **kw)
    _close(out, ref_o), _close(lse, ref_l)

    # The same batch packed: flash_attn_varlen_func.
    batch, seqlen_q, nheads, d = q.shape
    cu_q = torch.arange(0, (batch + 1) * seqlen_q, seqlen_q, dtype=torch.int32)
    cu_k = torch.arange(0, (batch + 1) * k.shape[1], k.shape[1], dtype=torch.int32)
    out_p = flashtile.flash_attn_varlen_func(q.reshape(-1, nheads, d), k.reshape(-1, *k.shape[2:]),
                                             v.reshape(-1, *v.shape[2:]), cu_q, cu_k, seqlen_q, k.shape[1], **kw)
    _close(out_p.reshape(q.shape), ref_o)

    # A KV cache holding the first keys, the rest appended; contiguous or paged.
    n_old = rng.randint(0, k.shape[1])
    page = rng.choice([None, 1, 4])
    cap = k.shape[1] + rng.randint(0, 5)
    if page is None:
        kc, vc, table = torch.zeros(batch, cap, *k.shape[2:]), torch.zeros(batch, cap, *k.shape[2:]), None
        kc[:, :n_old], vc[:, :n_old] = k[:, :n_old], v[:, :n_old]
    else:
        per = -(-cap // page)
        table = torch.randperm(batch * per + 2)[:batch * per].reshape(batch, per).to(torch.int32)
        kc = torch.zeros(batch * per + 2, page, *k.shape[2:])
        vc = torch.zeros_like(kc)
        for b in range(batch):
            for j in range(n_old):
                kc[table[b, j // page], j % page], vc[table[b, j // page], j % page] = k[b, j], v[b, j]
    kv_kw = {key: val for key, val in kw.items()}
    out_c, lse_c = flashtile.flash_attn_with_kvcache(q, kc, vc, k[:, n_old:], v[:, n_old:], cache_seqlens=n_old,
                                                     block_table=table, return_lse=True, **kv_kw)
    _close(out_c, ref_o), _close(lse_c, ref_l)

    # Two disjoint key halves merged.
    if k.shape[1] >= 2 and "window_size" not in kw and not kw["causal"]:
        h = k.shape[1] // 2
        a = flashtile.flash_attn_func(q, k[:, :h], v[:, :h], return_lse=True, softmax_scale=kw["softmax_scale"])
        b = flashtile.flash_attn_func(q, k[:, h:], v[:, h:], return_lse=True, softmax_scale=kw["softmax_scale"])
        m_o, m_l = flashtile.merge_attention_states(*a, *b)
        _close(m_o, ref_o), _close(m_l, ref_l)

    # SDPA drop-in (PyTorch's layout; is_causal is top-left: use it only when square).
    if seqlen_q == k.shape[1] and nheads == k.shape[2] and "window_size" not in kw:
        o = flashtile.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                   is_causal=kw["causal"], scale=kw["softmax_scale"])
        _close(o.transpose(1, 2), ref_o)

    # Row softmax of random rows with a random boolean mask.
    x = torch.randn(rng.randint(1, 4), rng.randint(1, 40), generator=torch.Generator().manual_seed(seed))
    keep = torch.rand(x.shape, generator=torch.Generator().manual_seed(seed + 1)) < 0.8
    scale = rng.choice([None, 0.5, -1.0])
    t = x.double().numpy() * (1.0 if scale is None else scale)
    t = np.where(keep.numpy(), t, -np.inf)
    _close(flashtile.softmax(x, -1, scale=scale, mask=keep), softmax_3pass(t, axis=-1), atol=1e-5)
    got = flashtile.log_softmax(x, -1, scale=scale, mask=keep)
    want = ref_log_softmax(t, axis=-1)
    finite = np.isfinite(want)
    assert torch.equal(torch.isfinite(got), torch.as_tensor(finite))
    _close(got[torch.as_tensor(finite)], want[finite], atol=1e-5)


# ---------------------------------------------------------------------------------------
# Random illegal inputs: one thing wrong
# ---------------------------------------------------------------------------------------


def _bad_attention_call(rng: random.Random):
    q, k, v, kw = _attention_problem(rng)
    mutations = [
        lambda: ((q.double(), k, v), kw),
        lambda: ((q[0], k, v), kw),
        lambda: ((q, k[..., :-1], v), kw),
        lambda: ((q, k, v), dict(kw, causal=1)),
        lambda: ((q, k, v), dict(kw, softmax_scale=-rng.random())),
        lambda: ((q, k, v), dict(kw, window_size=(-2, 0))),
        lambda: ((q, k, v), dict(kw, softcap=-1.0)),
        lambda: ((q, k, v), dict(kw, dropout_p=1.0)),
        lambda: ((q, k, v), dict(kw, alibi_slopes=torch.ones(q.shape[2] + 1))),
        lambda: ((q, k.transpose(-1, -2), v), kw),
    ]
    return flashtile.flash_attn_func, *rng.choice(mutations)()


def _bad_varlen_call(rng: random.Random):
    q, k, v, kw = _attention_problem(rng)
    batch, seqlen_q, nheads, d = q.shape
    qp, kp, vp = q.reshape(-1, nheads, d), k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:])
    cu_q = torch.arange(0, (batch + 1) * seqlen_q, seqlen_q, dtype=torch.int32)
    cu_k = torch.arange(0, (batch + 1) * k.shape[1], k.shape[1], dtype=torch.int32)
    bad_cu = cu_q.clone()
    bad_cu[rng.randrange(1, batch + 1)] = rng.choice([-1, qp.shape[0] + 3])
    mutations = [
        lambda: (qp, kp, vp, bad_cu, cu_k, seqlen_q, k.shape[1]),
        lambda: (qp, kp, vp, cu_q.long(), cu_k, seqlen_q, k.shape[1]),
        lambda: (qp, kp, vp, cu_q, cu_k, -rng.randint(1, 5), k.shape[1]),
        lambda: (qp, kp, vp, cu_q, cu_k, seqlen_q, max(0, k.shape[1] - 1) if k.shape[1] > 0 else -1),
        lambda: (qp, kp, vp, cu_q, cu_k, float(seqlen_q), k.shape[1]),
        lambda: (qp, kp, vp, cu_q, cu_k[:-1] if batch > 1 else cu_k[:1], seqlen_q, k.shape[1]),
    ]
    return flashtile.flash_attn_varlen_func, rng.choice(mutations)(), kw


def _bad_kvcache_call(rng: random.Random):
    batch, nheads_k, d = rng.randint(1, 3), rng.choice([1, 2]), 8
    paged = rng.random() < 0.5
    page, cap = 4, 8
    rows = batch * (cap // page) + 1 if paged else batch + 1
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    kc = torch.randn(rows, page if paged else cap, nheads_k, d, generator=g)
    vc = torch.randn_like(kc)
    q = torch.randn(batch, 1, 2 * nheads_k, d, generator=g)
    n_new = rng.randint(1, 3)
    kn, vn = torch.randn(batch, n_new, nheads_k, d, generator=g), torch.randn(batch, n_new, nheads_k, d, generator=g)
    lens = torch.tensor([rng.randint(0, cap - n_new) for _ in range(batch)], dtype=torch.int32)
    kw = dict(cache_seqlens=lens)
    if paged:
        kw["block_table"] = torch.randperm(rows)[:batch * 2].reshape(batch, 2).to(torch.int32)
    else:
        kw["cache_batch_idx"] = torch.randperm(rows)[:batch].to(torch.int32)
    b = rng.randrange(batch)

    def with_entry(name, value, col=None):
        t = kw[name].clone()
        if col is None:
            t[b] = value
        else:
            t[b, col] = value
        return dict(kw, **{name: t})

    def seq_needs_col(col):  # make sequence b reach block col so the bad page is read
        lens2 = lens.clone()
        lens2[b] = max(int(lens[b]), col * page + 1 - n_new, 0)
        return lens2

    mutations = [
        lambda: with_entry("cache_seqlens", -rng.randint(1, 5)),
        lambda: with_entry("cache_seqlens", cap - n_new + rng.randint(1, 3)),
        lambda: dict(kw, cache_seqlens=-1),
        lambda: dict(kw, cache_seqlens=cap),
        lambda: dict(kw, cache_seqlens=lens.float()),
        lambda: dict(kw, cache_seqlens=lens[:-1] if batch > 1 else lens.repeat(2)),
    ]
    if paged:
        mutations += [
            lambda: dict(with_entry("block_table", rng.choice([-1, rows, rows + 7]), col=1), cache_seqlens=seq_needs_col(1)),
            lambda: dict(kw, block_table=kw["block_table"].float()),
            lambda: dict(kw, cache_batch_idx=torch.zeros(batch, dtype=torch.int32)),
        ]
    else:
        mutations += [
            lambda: with_entry("cache_batch_idx", rng.choice([-1, rows, rows + 5])),
            lambda: dict(kw, cache_batch_idx=torch.zeros(batch, dtype=torch.int32)) if batch > 1 else
            with_entry("cache_batch_idx", -2),
        ]
    args = (q, kc, vc, kn, vn)
    if rng.random() < 0.15:
        args = (q, kc[:1].expand_as(kc), vc, kn, vn)
        return flashtile.flash_attn_with_kvcache, args, kw
    return flashtile.flash_attn_with_kvcache, args, rng.choice(mutations)()


def _bad_softmax_call(rng: random.Random):
    x = torch.randn(3, 5)
    fn = rng.choice([flashtile.softmax, flashtile.log_softmax])
    mutations = [
        ((x.long(),), {}),
        ((x, 2), {}),
        ((x, 0.5), {}),
        ((x,), dict(scale=float("nan"))),
        ((x,), dict(scale="1")),
        ((x,), dict(mask=torch.ones(4, 5, dtype=torch.bool))),
        ((x,), dict(mask=torch.ones(3, 5, dtype=torch.int32))),
        ((x,), dict(mask=[True] * 5)),
    ]
    return fn, *rng.choice(mutations)


def _bad_merge_call(rng: random.Random):
    o, lse = torch.randn(1, 3, 2, 8), torch.randn(1, 2, 3)
    mutations = [
        (o, lse.transpose(1, 2), o, lse.transpose(1, 2)),
        (o, lse, None, lse),
        (o, lse, o[..., :4], lse),
        (o, lse[..., :2], o, lse[..., :2]),
    ]
    return flashtile.merge_attention_states, rng.choice(mutations), {}


@pytest.mark.parametrize("seed", range(CASES))
@pytest.mark.parametrize("make", [_bad_attention_call, _bad_varlen_call, _bad_kvcache_call, _bad_softmax_call,
                                  _bad_merge_call], ids=lambda f: f.__name__[5:-5])
def test_illegal_inputs_rejected_and_nothing_changed(make, seed):
    fn, args, kwargs = make(random.Random(1000 * seed + 7))
    _assert_rejected(fn, args, kwargs)
