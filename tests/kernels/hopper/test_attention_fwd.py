"""The Gluon (Hopper) attention forward against the float64 oracle, on an sm_90 GPU.

Every test forces the engine with ``FLASHTILE_ENGINE=gluon``, so a call the Gluon forward
cannot take fails instead of silently running the ``tl.*`` kernels.  The gradients of these
calls are checked too (``test_attention_bwd.py`` covers the Gluon backward on its own).
Tolerance is flash-attn's rule (see ``helpers.assert_close_to_reference``).
"""

import pytest
import torch

from helpers import assert_close_to_reference, is_hopper, random_like, random_qkv, reference_attention_grads

import flashtile

# Its configurations parametrise the tests (a Triton without Gluon has none to run).
attention_fwd = pytest.importorskip("flashtile.kernels.hopper.attention_fwd")

pytestmark = pytest.mark.gpu
needs_hopper = pytest.mark.skipif(not is_hopper(), reason="the Gluon kernels need an sm_90 GPU")

FLOOR = {torch.float16: 1e-4, torch.bfloat16: 1e-3}


def _check(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, causal, window, dtype, backward=True, seed=0,
           **mods):
    """One call of ``flash_attn_func`` (``mods``: its ``softcap`` / ``alibi_slopes``) against the
    float64 oracle: out, LSE and, with ``backward``, the gradients."""
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype=dtype, device="cuda",
                         requires_grad=backward, seed=seed)
    torch.cuda.synchronize()
    out, lse = flashtile.flash_attn_func(q, k, v, causal=causal, window_size=window, return_lse=True, **mods)
    kw = dict(causal=causal, window_size=window, **mods)
    dout = random_like(out, seed=seed + 1)
    ref = reference_attention_grads(q, k, v, dout, **kw)
    low = reference_attention_grads(q, k, v, dout, upcast=False, **kw)
    floor = FLOOR[dtype]
    assert_close_to_reference(out, ref[0], low[0], "out", atol_floor=floor)
    empty = ref[1] == float("-inf")
    assert torch.equal(lse == float("-inf"), empty), "rows with no visible key must have LSE -inf"
    assert_close_to_reference(lse[~empty], ref[1][~empty], low[1][~empty].to(torch.float64), "lse", atol_floor=floor)
    if backward:
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
        for name, got, r64, rlow in zip(("dq", "dk", "dv"), (dq, dk, dv), ref[2:], low[2:]):
            assert_close_to_reference(got, r64, rlow, name, atol_floor=floor * 10)


CASES = [
    # batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, causal, window
    (1, 1, 1, 1, 1, 64, False, (-1, -1)),
    (2, 17, 17, 2, 2, 128, False, (-1, -1)),
    (1, 17, 17, 2, 1, 96, True, (-1, -1)),
    (1, 1000, 1000, 2, 2, 128, True, (-1, -1)),
    (1, 4097, 4097, 2, 2, 128, False, (-1, -1)),
    (2, 1000, 1000, 8, 1, 64, True, (-1, -1)),  # GQA 8:1
    (1, 128, 1000, 2, 1, 40, False, (-1, -1)),  # Nq < Nk
    (1, 1000, 128, 4, 2, 128, True, (-1, -1)),  # Nq > Nk: the first 872 rows see nothing
    (1, 300, 1000, 2, 2, 256, True, (-1, -1)),
    (1, 1000, 1000, 2, 2, 256, False, (-1, -1)),
    (1, 300, 4500, 2, 1, 256, False, (-1, -1)),  # 4096+ keys unmasked: d = 256 without turns (call_config)
    (1, 1000, 1000, 2, 2, 128, False, (64, 0)),  # sliding window
    (1, 700, 900, 2, 1, 96, False, (100, 37)),
    (1, 2048, 2048, 2, 2, 64, False, (-1, -1)),
    # More work items than SMs: each persistent program runs several query tiles in turn.
    (4, 2048, 2048, 8, 2, 64, True, (-1, -1)),
    (2, 1500, 1500, 12, 12, 128, False, (-1, -1)),
    # d <= 64 from 2048 query rows with a mask (any length without): three consumers, 192-row tiles.
    (1, 2500, 3000, 4, 2, 64, True, (-1, -1)),
    (1, 3000, 2100, 2, 1, 48, False, (300, 0)),
    # Consumers whose rows see none of some of the tile's key tiles pass them: Nq > Nk causal
    # (tiles whose earlier consumers see no key at all) and a right-only window.
    (1, 2500, 700, 2, 2, 64, True, (-1, -1)),
    (1, 1100, 1300, 2, 1, 64, False, (-1, 100)),
]


@needs_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}-q{}-k{}-h{}/{}-d{}-{}-w{}".format(
    *c[:6], "causal" if c[6] else "full", c[7]))
def test_gluon_forward_matches_reference(case, dtype):
    # Forcing Gluon forces the backward too, which takes head dims up to 128.
    _check(*case, dtype=dtype, backward=dtype == torch.bfloat16 and case[5] <= 128)


# Each alternative configuration (attention_fwd.ALTERNATIVES) on the cases up to d = 128
# (where the alternatives are meant to run), forward only, through the kernel's launcher.
ALTERNATIVE_CASES = [c for c in CASES if c[5] <= 128]


def _check_config(case, cfg):
    """The forward of ``case`` through the kernel's launcher in configuration ``cfg``, forward only."""
    from flashtile.kernels import attention as ka

    batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, causal, window = case
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype=torch.bfloat16, device="cuda")
    left, right = (window[0], 0) if causal else window
    out, lse = attention_fwd.forward(ka.Layout(q, k), q, k, v, headdim ** -0.5, left, right, config=cfg)
    kw = dict(causal=causal, window_size=window)
    dout = random_like(out, seed=1)
    ref = reference_attention_grads(q, k, v, dout, **kw)
    low = reference_attention_grads(q, k, v, dout, upcast=False, **kw)
    assert_close_to_reference(out, ref[0], low[0], "out", atol_floor=FLOOR[torch.bfloat16])
    empty = ref[1] == float("-inf")
    assert torch.equal(lse == float("-inf"), empty), "rows with no visible key must have LSE -inf"
    assert_close_to_reference(lse[~empty], ref[1][~empty], low[1][~empty].to(torch.float64), "lse",
                              atol_floor=FLOOR[torch.bfloat16])


@needs_hopper
@pytest.mark.parametrize("alternative", attention_fwd.ALTERNATIVES)
@pytest.mark.parametrize("case", ALTERNATIVE_CASES, ids=lambda c: "b{}-q{}-k{}-h{}/{}-d{}-{}-w{}".format(
    *c[:6], "causal" if c[6] else "full", c[7]))
def test_gluon_forward_alternative_configurations_match_reference(case, alternative):
    from flashtile.kernels.tma import padded_headdim

    _check_config(case, attention_fwd.config_from_spec(padded_headdim(case[5]), alternative))


# Both configurations of head dims up to 64 on every such case, whatever the call's own rule
# (``call_config``) would pick: three consumers (192-row tiles) and the two of short calls.
@needs_hopper
@pytest.mark.parametrize("two_consumers", [False, True], ids=["three-consumers", "two-consumers"])
@pytest.mark.parametrize("case", [c for c in CASES if c[5] <= 64], ids=lambda c: "b{}-q{}-k{}-h{}/{}-d{}-{}-w{}".format(
    *c[:6], "causal" if c[6] else "full", c[7]))
def test_gluon_forward_both_small_head_dim_configurations_match_reference(case, two_consumers):
    cfg = attention_fwd.config_for(64, two_consumers)
    assert cfg.consumers == (2 if two_consumers else 3)
    _check_config(case, cfg)


# Softcap and ALiBi: score modifications of the Gluon forward (docs/semantics.md's order: scale,
# softcap, ALiBi, masks).  The backward of such calls is the tl.* one, so the gradients are
# checked under ``auto`` (Gluon forward, tl.* backward reading its LSE).
MOD_CASES = [
    # batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, causal, window
    (1, 17, 17, 2, 2, 128, False, (-1, -1)),
    (2, 1000, 1000, 4, 2, 128, True, (-1, -1)),
    (1, 300, 1000, 2, 1, 64, True, (-1, -1)),  # Nq < Nk, GQA, three consumers
    (1, 2500, 2500, 2, 2, 64, False, (-1, -1)),
    (1, 1000, 700, 2, 2, 256, True, (-1, -1)),  # Nq > Nk: rows that see nothing
    (1, 1100, 1300, 2, 1, 96, False, (100, 37)),
]


def _mods(kind, batch, nheads):
    slopes = torch.rand(batch, nheads, device="cuda", dtype=torch.float32) * 0.3
    return {"softcap": dict(softcap=4.0), "alibi": dict(alibi_slopes=slopes),
            "alibi-per-head": dict(alibi_slopes=slopes[0].contiguous()),
            "both": dict(softcap=10.0, alibi_slopes=slopes)}[kind]


@needs_hopper
@pytest.mark.parametrize("kind", ["softcap", "alibi", "alibi-per-head", "both"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", MOD_CASES, ids=lambda c: "b{}-q{}-k{}-h{}/{}-d{}-{}-w{}".format(
    *c[:6], "causal" if c[6] else "full", c[7]))
def test_gluon_forward_softcap_and_alibi_match_reference(case, dtype, kind):
    _check(*case, dtype=dtype, backward=False, **_mods(kind, case[0], case[3]))


@needs_hopper
@pytest.mark.parametrize("kind", ["softcap", "both"])
@pytest.mark.parametrize("case", [c for c in MOD_CASES if c[5] <= 128], ids=lambda c: "b{}-q{}-k{}-h{}/{}-d{}".format(
    *c[:6]))
def test_softcap_and_alibi_gradients_through_the_tl_backward(case, kind, monkeypatch):
    from flashtile.kernels import engine

    monkeypatch.setenv("FLASHTILE_ENGINE", "auto")
    mods = _mods(kind, case[0], case[3])
    q = torch.empty(1, 1, 1, case[5], device="cuda", dtype=torch.bfloat16)
    assert engine.forward_engine(q, q, **mods) == "gluon" and engine.backward_engine(q, q, **mods) == "triton"
    _check(*case, dtype=torch.bfloat16, backward=True, **mods)


@needs_hopper
def test_gluon_forward_plan_reads_each_calls_alibi_slopes():
    """The dense plan (a key's later calls) passes the call's own slopes: new values, and a
    non-contiguous view of them, change the output as the oracle says."""
    q, k, v = random_qkv(1, 256, 256, 4, 4, 128, dtype=torch.bfloat16, device="cuda")
    for i in range(4):
        slopes = torch.rand(1, 4, device="cuda") * (i + 1) * 0.1
        got = flashtile.flash_attn_func(q, k, v, alibi_slopes=slopes, causal=True)
        ref = reference_attention_grads(q, k, v, torch.zeros_like(q), alibi_slopes=slopes, causal=True)
        low = reference_attention_grads(q, k, v, torch.zeros_like(q), upcast=False, alibi_slopes=slopes, causal=True)
        assert_close_to_reference(got, ref[0], low[0], f"out, call {i}", atol_floor=FLOOR[torch.bfloat16])
        strided = torch.rand(4, 2, device="cuda").t()[0]  # (nheads,) at stride 2
        got = flashtile.flash_attn_func(q, k, v, alibi_slopes=strided)
        ref = reference_attention_grads(q, k, v, torch.zeros_like(q), alibi_slopes=strided)
        low = reference_attention_grads(q, k, v, torch.zeros_like(q), upcast=False, alibi_slopes=strided)
        assert_close_to_reference(got, ref[0], low[0], f"out, strided slopes, call {i}",
                                  atol_floor=FLOOR[torch.bfloat16])


@needs_hopper
def test_gluon_forward_empty_rows_are_zero_whatever_v_holds():
    q, k, v = random_qkv(1, 5, 3, 1, 1, 64, dtype=torch.bfloat16, device="cuda")
    v[0, 0, 0, 0] = float("inf")
    out, lse = flashtile.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert torch.equal(out[0, :2], torch.zeros_like(out[0, :2]))
    assert torch.isinf(lse[0, 0, :2]).all()


@needs_hopper
@pytest.mark.parametrize("causal", [False, True])
def test_gluon_varlen_matches_dense_per_sequence(causal):
    lens = [0, 1, 17, 300, 1000, 129]
    q, k, v = random_qkv(1, sum(lens), sum(lens), 4, 2, 128, dtype=torch.bfloat16, device="cuda")
    q, k, v = q[0], k[0], v[0]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device="cuda")
    out = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=causal)
    for b, n in enumerate(lens):
        s, e = int(cu[b]), int(cu[b + 1])
        if n == 0:
            continue
        want = flashtile.flash_attn_func(q[None, s:e], k[None, s:e], v[None, s:e], causal=causal)[0]
        assert torch.equal(out[s:e], want), f"sequence {b} (length {n}) differs from its dense call"


@needs_hopper
def test_forcing_gluon_on_an_unsupported_call_names_the_reason():
    q, k, v = random_qkv(1, 16, 16, 1, 1, 64, dtype=torch.float32, device="cuda")
    with pytest.raises(NotImplementedError, match="dtype"):
        flashtile.flash_attn_func(q, k, v)


@needs_hopper
@pytest.mark.parametrize("l2_share", [1e-4, 0.01, 0.5])
def test_gluon_causal_schedules_change_the_order_not_the_result(l2_share):
    """The causal work order (L2-sized sections of heads, alternating directions, see
    ``tile_info.dealt_tile``) only decides which program runs which query tile: the outputs
    and LSE are bit for bit those of a schedule with no L2 budget, with more items than SMs
    (3 * 12 heads * 8 tiles), GQA 3:1, and sections down to one head."""
    from flashtile.kernels import attention as ka
    from flashtile.kernels.hopper import attention_fwd as hopper

    q, k, v = random_qkv(3, 1024, 1024, 12, 4, 128, dtype=torch.bfloat16, device="cuda", seed=3)
    layout = ka.Layout(q, k)
    everything = hopper.HopperConfig(block_n=128, num_stages=2, l2_share=0.0)
    sectioned = hopper.HopperConfig(block_n=128, num_stages=2, l2_share=l2_share)
    assert hopper.layout_schedule(layout, k, everything, -1, 0) >= 18  # no L2 budget: half the heads or more
    if l2_share < 0.5:
        assert hopper.layout_schedule(layout, k, sectioned, -1, 0) < 18
    want = hopper.forward(layout, q, k, v, 0.1, -1, 0, config=everything)
    got = hopper.forward(layout, q, k, v, 0.1, -1, 0, config=sectioned)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # The public function twice: the first call goes the general way, the second runs the plan.
    first = flashtile.flash_attn_func(q, k, v, softmax_scale=0.1, causal=True, return_lse=True)
    second = flashtile.flash_attn_func(q, k, v, softmax_scale=0.1, causal=True, return_lse=True)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    assert torch.equal(first[0], want[0])
