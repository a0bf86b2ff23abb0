"""Dense forwards of a few query rows on the split-KV decode kernel (``engine.split_kv_forward``).

Under ``auto`` engine selection a forward of at most ``SPLIT_KV_MAX_SEQLEN_Q`` query rows runs
on the decode kernel of ``flash_attn_with_kvcache``; its output and LSE feed the ``tl.*``
backward.  Both are checked against the float64 oracle with flash-attn's rule, and the route
itself is observed (and absent where it must not apply).  Without a GPU these run in Triton's
interpreter (float32 / float16), on a GPU in bfloat16 too.
"""

import os

import pytest
import torch

from helpers import assert_close_to_reference, random_like, random_qkv, reference_attention_grads

from flashtile.kernels import attention as ka
from flashtile.kernels import engine
from flashtile.kernels.attention import forward as kf

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernels = pytest.mark.skipif(not (INTERPRET or torch.cuda.is_available()),
                                   reason="needs a GPU or TRITON_INTERPRET=1")

FLOOR = {torch.float32: 1e-5, torch.float16: 1e-4, torch.bfloat16: 1e-3}

CASES = [
    # batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, causal, window, softcap, alibi
    (1, 1, 1, 1, 1, 64, False, (-1, -1), 0.0, None),
    (2, 1, 300, 8, 1, 128, True, (-1, -1), 0.0, None),  # an MQA decoding step
    (1, 3, 1000, 4, 2, 40, True, (-1, -1), 0.0, None),
    (2, 16, 200, 4, 4, 96, False, (32, 0), 0.0, None),  # a sliding window, the most rows routed
    (1, 5, 3, 2, 1, 64, True, (-1, -1), 0.0, None),  # seqlen_q > seqlen_k: the first rows see nothing
    (2, 2, 257, 4, 2, 64, True, (-1, -1), 3.0, "batch-heads"),  # softcap and per-sequence ALiBi
]


@pytest.fixture
def routed(monkeypatch):
    """The calls that took the split-KV route, counted (plans are cleared first, so every call
    below decides afresh)."""
    monkeypatch.delenv(engine.ENGINE_ENV, raising=False)
    kf.clear_plans()
    calls = []
    real = kf._few_rows_plan

    def counted(*args):
        calls.append(args[0].shape)
        return real(*args)

    monkeypatch.setattr(kf, "_few_rows_plan", counted)
    yield calls
    kf.clear_plans()


def _check(case, dtype, routed_calls, expect_route):
    batch, seqlen_q, seqlen_k, nheads, nheads_k, d, causal, window, softcap, alibi = case
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, d, dtype=dtype, device=DEVICE, seed=seqlen_k)
    slopes = None
    if alibi == "batch-heads":
        slopes = (torch.rand(batch, nheads, generator=torch.Generator().manual_seed(1)) * 0.5).to(DEVICE)
    left, right = window[0], 0 if causal else window[1]
    scale = d ** -0.5
    mods = dict(softcap=softcap, alibi_slopes=slopes)
    out, lse = ka.attention_forward(q, k, v, scale, left, right, **mods)
    assert bool(routed_calls) == expect_route
    dout = random_like(out, seed=2)
    dq, dk, dv = ka.attention_backward(dout, q, k, v, out, lse, scale, left, right, **mods)
    kw = dict(softmax_scale=scale, causal=causal, window_size=window, **mods)
    ref = reference_attention_grads(q, k, v, dout, upcast=True, **kw)
    low = reference_attention_grads(q, k, v, dout, upcast=False, **kw)
    floor = FLOOR[dtype]
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (batch, nheads, seqlen_q) and lse.dtype == torch.float32
    assert_close_to_reference(out, ref[0], low[0], "out", atol_floor=floor)
    empty = ref[1] == float("-inf")
    assert torch.equal(lse == float("-inf"), empty), "rows with no visible key must have LSE -inf"
    assert torch.equal(out[empty.transpose(1, 2)], torch.zeros_like(out[empty.transpose(1, 2)]))
    assert_close_to_reference(lse[~empty], ref[1][~empty], low[1][~empty].to(torch.float64), "lse", atol_floor=floor)
    for name, got, r64, rlow in zip(("dq", "dk", "dv"), (dq, dk, dv), ref[2:], low[2:]):
        assert_close_to_reference(got, r64, rlow, name, atol_floor=floor * 10)


@needs_kernels
@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}-q{}-k{}-h{}/{}-d{}".format(*c[:6]))
def test_few_query_rows_run_on_the_decode_kernel(case, routed):
    _check(case, torch.float32, routed, expect_route=True)


@needs_kernels
@pytest.mark.parametrize("case", CASES[1:4], ids=lambda c: "q{}-k{}-d{}".format(c[1], c[2], c[5]))
def test_few_query_rows_run_on_the_decode_kernel_fp16(case, routed):
    _check(case, torch.float16, routed, expect_route=True)


@needs_kernels
def test_more_query_rows_run_on_the_forward_kernel(routed):
    case = (1, engine.SPLIT_KV_MAX_SEQLEN_Q + 1, 100, 2, 1, 64, True, (-1, -1), 0.0, None)
    _check(case, torch.float32, routed, expect_route=False)


@needs_kernels
def test_a_forced_engine_runs_its_forward_kernel_at_few_rows(routed, monkeypatch):
    monkeypatch.setenv(engine.ENGINE_ENV, "triton")
    _check(CASES[2], torch.float32, routed, expect_route=False)


@needs_kernels
def test_dropout_keeps_the_forward_kernel(routed):
    q, k, v = random_qkv(1, 2, 64, 2, 2, 64, dtype=torch.float32, device=DEVICE, seed=0)
    ka.attention_forward(q, k, v, 0.125, -1, -1, dropout=(0.1, 0, 0))
    assert not routed


def _growing_cache_steps(routed, monkeypatch, dtype, lengths, max_splits):
    """Forwards of one query row against keys and values as a model growing its cache makes
    them: a fresh ``(batch, nheads_k, n, d)`` tensor per length, seen transposed, so the
    length and the batch and head strides change at every call.  The split counts follow
    the length as the rule makes them (``choose_num_splits``' form, capped at ``max_splits``,
    so that several splits are reached in the interpreter too, whose device has one SM)."""
    from flashtile.kernels import decode

    def splits(batch, nheads_k, capacity, device, block_n, programs_per_sm=2, min_tiles=decode.MIN_TILES_PER_SPLIT):
        return max(1, min(max_splits, capacity // (min_tiles * block_n)))

    monkeypatch.setattr(decode, "choose_num_splits", splits)
    decode.cached_launch_config.cache_clear()
    built = []
    real = decode._split_plan
    monkeypatch.setattr(decode, "_split_plan", lambda *a, **kw: built.append(a[1].shape[1]) or real(*a, **kw))
    batch, nheads, nheads_k, d = 2, 4, 2, 64
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, 1, nheads, d, generator=gen).to(DEVICE, dtype)
    used = set()
    try:
        for n in lengths:
            k, v = (torch.randn(batch, nheads_k, n, d, generator=gen).to(DEVICE, dtype).transpose(1, 2)
                    for _ in range(2))
            out, lse = ka.attention_forward(q, k, v, d ** -0.5, -1, 0)
            ref = reference_attention_grads(q, k, v, torch.zeros_like(out), upcast=True, softmax_scale=d ** -0.5,
                                            causal=True)
            low = reference_attention_grads(q, k, v, torch.zeros_like(out), upcast=False, softmax_scale=d ** -0.5,
                                            causal=True)
            assert_close_to_reference(out, ref[0], low[0], f"out at n = {n}", atol_floor=FLOOR[dtype])
            assert_close_to_reference(lse, ref[1], low[1].to(torch.float64), f"lse at n = {n}",
                                      atol_floor=FLOOR[dtype])
            plan = kf.lookup_plan(q, k, v, kf.AttentionParams.from_launcher(d ** -0.5, -1, 0, 0.0, None, None))
            used.add(plan)
    finally:
        decode.cached_launch_config.cache_clear()
    unit, _ = decode.length_class_unit(decode.knobs())
    assert len(routed) == 1 and len(used) == 1, "one plan for every key length"
    assert built == sorted({n // unit: n for n in reversed(lengths)}.values()), "one split plan per length class"


@needs_kernels
def test_a_growing_cache_shares_one_plan(routed, monkeypatch):
    from flashtile.kernels import decode

    unit, _ = decode.length_class_unit(decode.knobs())
    # Across two class boundaries: one, two and three splits (in the interpreter's 16-key tiles).
    lengths = [unit - 2, unit - 1, unit, unit + 1, 2 * unit - 1, 2 * unit + 3, 3 * unit + 5]
    _growing_cache_steps(routed, monkeypatch, torch.float32, lengths, max_splits=3)


@pytest.mark.gpu
def test_gpu_a_growing_cache_shares_one_plan(routed, monkeypatch):
    from flashtile.kernels import decode

    unit, _ = decode.length_class_unit(decode.knobs())
    lengths = list(range(4 * unit - 3, 4 * unit + 4)) + [8 * unit + 1, 16 * unit + 7, 64 * unit + 9]
    _growing_cache_steps(routed, monkeypatch, torch.bfloat16, lengths, max_splits=64)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}-q{}-k{}-h{}/{}-d{}".format(*c[:6]))
def test_gpu_few_query_rows_bf16(case, routed):
    _check(case, torch.bfloat16, routed, expect_route=True)


@pytest.mark.gpu
def test_gpu_public_function_routes_a_decoding_step_and_its_plan(routed):
    """``flash_attn_func`` on a transformers-style decoding step (keys one longer each step, in
    transposed views): every call routed, within the flash-attn rule of the oracle, one plan
    for every length, made at the first call."""
    import flashtile

    torch.manual_seed(0)
    kv = torch.randn(2, 1, 4, 600, 128, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(1, 1, 16, 128, device="cuda", dtype=torch.bfloat16)
    for n in (500, 501, 502):
        k, v = (kv[i, :, :, :n].transpose(1, 2) for i in (0, 1))
        for _ in range(3):
            out = flashtile.flash_attn_func(q, k, v, causal=True)
        ref = reference_attention_grads(q, k, v, torch.zeros_like(q), upcast=True, causal=True)[0]
        low = reference_attention_grads(q, k, v, torch.zeros_like(q), upcast=False, causal=True)[0]
        assert_close_to_reference(out, ref, low, "out", atol_floor=FLOOR[torch.bfloat16])
    assert len(routed) == 1  # one plan for every length, made at the first call


@pytest.mark.parametrize("tuning", ["", "block_n=64", "block_n=16", "min_tiles_per_split=4",
                                    "block_n=256,min_tiles_per_split=2", "narrow_short_caches=0,programs_per_sm_wide=2"])
def test_length_classes_share_the_launch_configuration(tuning, monkeypatch):
    """``decode.length_class_unit``'s claim, on an H200's launch rule (132 SMs, its shared
    memory): every cache length of one class gets the launch configuration of the class's
    first length, so the class's one split plan is the one each length would have built."""
    from flashtile.kernels import decode

    monkeypatch.setattr(decode, "INTERPRET", False)
    monkeypatch.setattr(decode, "sm_count", lambda index: 132)
    monkeypatch.setattr(decode, "smem_budget", lambda index: decode.DEFAULT_SMEM_BYTES)
    knob = decode.TUNING.parse(tuning)
    unit, top = decode.length_class_unit(knob)
    device = torch.device("cuda", 0)
    for batch, nheads_k, hd, rows in ((1, 4, 128, 8), (1, 1, 64, 16), (8, 8, 128, 4), (2, 2, 256, 8)):
        def config(n):
            return decode.launch_config(batch, nheads_k, n, device, False, hd, rows, 2, knob)

        first = {}
        for n in list(range(1, 4 * unit, 7)) + [top * unit + i * 977 for i in range(5)]:
            length_class = min(n // unit, top)
            want = first.setdefault(length_class, config(n))
            assert config(n) == want, f"length {n} (class {length_class}) against the class's first length"
        assert len({c.num_splits for c in first.values()}) > 1  # the lengths span several split counts
