"""The decode step's kernels keep every read and write inside the caches, whatever the index values.

On a GPU ``flash_attn_with_kvcache`` does not read its index tensors on the host (no sync per
step): ``cache_seqlens``, ``cache_batch_idx``, ``block_table`` and ``cache_leftpad`` reach the
kernels unchecked, and the kernels clamp them (docs/semantics.md, "Index checks").  Each case
below draws a random decode step -- contiguous or paged cache, append or not, GQA, masks,
softcap, ALiBi, rotary tables, split count, int32 or int64 indices -- and plants out-of-range
values among the indices, int32 and int64 extremes included, then calls the kernel path
(``kvcache._step_triton``, which skips the host's value checks as on a GPU).  NaN canaries
surround the caches and the rotary tables, so a read past them poisons the output and a
write past the caches shows in the canaries.  Then:

* the canaries are untouched and the output holds no NaN;
* an append whose own lengths, rows or pages are invalid writes nothing (anywhere);
* a step whose indices are all valid gives the CPU path's cache and output.
"""

import os
import random

import pytest
import torch

import flashtile
from flashtile import kvcache
from flashtile.validation import check_kvcache_index_values

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not (INTERPRET or torch.cuda.is_available()),
                                reason="needs a GPU or TRITON_INTERPRET=1")

CANARY = 2  # rows of NaN before and after each cache and rotary table
EXTREMES = {torch.int32: (2**31 - 1, 2**31 - 2, -2**31), torch.int64: (2**31 - 1, -2**31, 2**32 + 1, 2**40)}


def _guarded(rows, *shape):
    """A random ``(rows, *shape)`` tensor inside a NaN-filled buffer: (buffer, view)."""
    buf = torch.full((rows + 2 * CANARY, *shape), float("nan"), device=DEVICE)
    view = buf[CANARY:CANARY + rows]
    view.copy_(torch.randn(view.shape, device=DEVICE))
    return buf, view


def _canaries_intact(buf):
    return bool(torch.isnan(buf[:CANARY]).all() and torch.isnan(buf[-CANARY:]).all())


def _step(seed):
    """A random decode step with out-of-range index values planted among valid ones."""
    r = random.Random(seed)
    torch.manual_seed(seed)
    batch, nheads_k, group, d = r.randint(1, 3), r.randint(1, 2), r.choice([1, 2, 4]), r.choice([16, 40, 64])
    page = r.choice([None, 1, 16, 256])
    if page is None:
        capacity = r.choice([1, 7, 40, 300])
        rows, row_len = batch + r.randint(0, 2), capacity
    else:
        pages_per_seq = r.randint(1, 3)
        capacity = pages_per_seq * page
        rows, row_len = batch * pages_per_seq + r.randint(0, 3), page
    new = min(r.choice([0, 0, 1, 3]), capacity)
    dtype = r.choice([torch.int32, torch.int64])
    extremes = EXTREMES[dtype]

    def value(lo, hi, bad):  # valid four times in seven
        return r.choice([r.randint(lo, hi)] * 4 + [r.choice(bad), r.choice(bad), r.choice(extremes)])

    s = dict(seed=seed, batch=batch, new=new, capacity=capacity, rows=rows, page=page)
    s["kbuf"], s["k_cache"] = _guarded(rows, row_len, nheads_k, d)
    s["vbuf"], s["v_cache"] = _guarded(rows, row_len, nheads_k, d)
    s["q"] = torch.randn(batch, r.choice([1, 1, 2, 5]), nheads_k * group, d, device=DEVICE)
    s["k"] = torch.randn(batch, new, nheads_k, d, device=DEVICE) if new else None
    s["v"] = torch.randn(batch, new, nheads_k, d, device=DEVICE) if new else None
    if r.random() < 0.2:
        s["seqlens"] = r.randint(0, capacity - new)  # an int: checked on the host, always valid here
    else:
        s["seqlens"] = torch.tensor([value(0, capacity - new, [-1, capacity - new + 1, capacity + 5])
                                     for _ in range(batch)], dtype=dtype, device=DEVICE)
    s["batch_idx"] = s["table"] = s["leftpad"] = None
    order = list(range(rows))
    r.shuffle(order)
    if page is None and r.random() < 0.5:
        s["batch_idx"] = torch.tensor([order[b] if r.random() < 0.8 else r.choice([-1, rows, rows + 7, extremes[0]])
                                       for b in range(batch)], dtype=dtype, device=DEVICE)
    if page is not None:
        table = torch.tensor(order[:batch * pages_per_seq], dtype=dtype).reshape(batch, pages_per_seq)
        if r.random() < 0.4:
            table[r.randrange(batch), r.randrange(pages_per_seq)] = r.choice([-1, rows, rows + 100, *extremes])
        s["table"] = table.to(DEVICE)
    if r.random() < 0.3:
        s["leftpad"] = torch.tensor([value(0, 3, [-1, capacity + 1]) for _ in range(batch)], dtype=dtype,
                                    device=DEVICE)
    s["causal"] = r.random() < 0.5
    s["window"] = (-1, 0) if s["causal"] else (-1, -1)
    if r.random() < 0.2:
        s["causal"], s["window"] = False, (r.randint(0, 20), r.choice([-1, 0, 3]))
    s["softcap"] = r.choice([0.0, 0.0, 5.0])
    s["alibi"] = torch.rand(nheads_k * group, device=DEVICE) if r.random() < 0.2 else None
    s["splits"] = r.choice([0, 1, 2, 3])
    s["interleaved"] = r.random() < 0.5
    s["rotary"] = None
    if r.random() < 0.4:
        rotary_dim = r.choice([d, d // 2 - (d // 2) % 2, 8])
        positions = r.choice([capacity, capacity + 4, max(1, capacity // 2)])  # too short for some steps
        s["cos_buf"], s["cos"] = _guarded(positions, rotary_dim // 2)
        s["sin_buf"], s["sin"] = _guarded(positions, rotary_dim // 2)
        s["cos"].copy_(s["cos"].cos())
        s["sin"].copy_(s["sin"].sin())
        local = s["window"][0] >= 0 or s["window"][1] >= 0
        s["rotary"] = (s["cos"], s["sin"], s["interleaved"], local)
    return s


def _append_indices_valid(s):
    """Whether the lengths, cache rows and pages the append writes through are all valid."""
    batch, new, page = s["batch"], s["new"], s["page"]
    lengths = [s["seqlens"]] * batch if isinstance(s["seqlens"], int) else s["seqlens"].tolist()
    for b, length in enumerate(lengths):
        if not 0 <= length <= s["capacity"] - new:
            return False
        if s["batch_idx"] is not None and not 0 <= int(s["batch_idx"][b]) < s["rows"]:
            return False
        if page is not None and any(not 0 <= int(s["table"][b, p // page]) < s["rows"]
                                    for p in range(length, length + new)):
            return False
    return True


def _indices_valid(s):
    try:
        check_kvcache_index_values(s["seqlens"], s["batch_idx"], s["table"], seqlen_new=s["new"],
                                   capacity=s["capacity"], cache_rows=s["rows"], cache_leftpad=s["leftpad"])
    except ValueError:
        return False
    return True


def _cpu_step(s, k_cache, v_cache):
    """The CPU path on the same step (it checks every value on the host): (out, lse), or None
    where a rotary table is too short for the step's positions."""
    cpu = (lambda t: None if t is None else t.cpu() if isinstance(t, torch.Tensor) else t)
    try:
        return flashtile.flash_attn_with_kvcache(
            cpu(s["q"]), k_cache, v_cache, cpu(s["k"]), cpu(s["v"]), cache_seqlens=cpu(s["seqlens"]),
            cache_batch_idx=cpu(s["batch_idx"]), block_table=cpu(s["table"]), softmax_scale=s["q"].shape[-1] ** -0.5,
            causal=s["causal"], window_size=(-1, -1) if s["causal"] else s["window"], softcap=s["softcap"],
            alibi_slopes=cpu(s["alibi"]), return_lse=True, cache_leftpad=cpu(s["leftpad"]),
            rotary_cos=cpu(s.get("cos")), rotary_sin=cpu(s.get("sin")), rotary_interleaved=s["interleaved"])
    except ValueError as e:
        if s["rotary"] is None:
            raise
        assert "cos" in str(e) or "rotary" in str(e), e
        return None


@pytest.mark.parametrize("seed", range(48))
def test_decode_step_stays_inside_the_caches_whatever_the_indices(seed):
    s = _step(seed)
    kbuf, vbuf = s["kbuf"].clone(), s["vbuf"].clone()
    out, lse = kvcache._step_triton(s["q"], s["k_cache"], s["v_cache"], s["k"], s["v"], s["seqlens"], s["batch_idx"],
                                    s["table"], s["q"].shape[-1] ** -0.5, *s["window"], s["softcap"], s["alibi"],
                                    s["splits"], leftpad=s["leftpad"], rotary=s["rotary"])
    buffers = [s["kbuf"], s["vbuf"]] + ([s["cos_buf"], s["sin_buf"]] if s["rotary"] is not None else [])
    assert all(map(_canaries_intact, buffers)), "a write landed outside a cache"
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "a read landed outside a cache or table"
    if s["new"] and not _append_indices_valid(s):
        assert torch.equal(s["kbuf"].nan_to_num(7.0), kbuf.nan_to_num(7.0)), "an invalid append wrote keys"
        assert torch.equal(s["vbuf"].nan_to_num(7.0), vbuf.nan_to_num(7.0)), "an invalid append wrote values"
    if _indices_valid(s):
        k_cache, v_cache = kbuf[CANARY:-CANARY].cpu(), vbuf[CANARY:-CANARY].cpu()
        want = _cpu_step(s, k_cache, v_cache)
        if want is not None:
            torch.testing.assert_close(s["k_cache"].cpu(), k_cache, atol=1e-5, rtol=0)
            torch.testing.assert_close(s["v_cache"].cpu(), v_cache, atol=0, rtol=0)
            torch.testing.assert_close(out.cpu(), want[0], atol=1e-4, rtol=1e-3)
            torch.testing.assert_close(lse.cpu(), want[1], atol=1e-4, rtol=1e-3)


def test_the_cases_plant_bad_values_and_keep_valid_ones():
    """The draw above exercises both sides: steps with every index valid (compared with the
    CPU path), appends with invalid indices (nothing written) and extreme values."""
    steps = [_step(seed) for seed in range(48)]
    valid = sum(map(_indices_valid, steps))
    bad_appends = sum(bool(s["new"]) and not _append_indices_valid(s) for s in steps)
    extreme = sum(any(isinstance(t, torch.Tensor) and bool((t.abs() >= 2**31 - 2).any())
                      for t in (s["seqlens"], s["batch_idx"], s["table"])) for s in steps)
    assert valid >= 8 and bad_appends >= 4 and extreme >= 4, (valid, bad_appends, extreme)
