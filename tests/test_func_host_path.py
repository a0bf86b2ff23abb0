"""flash_attn_func's host path: its memoised argument checks and the forward's launch plans.

The checks are memoised by a key of the tensors' metadata and the scalars' values and types
(``flashtile.interface._checked``); the dense forward launches from a plan per key
(``flashtile.kernels.attention.forward.cache.plans``).  These tests hold both to the general path:
every bad argument still raises after a good call with the same tensors, and a planned
launch passes the kernel exactly what the general launcher passes (in the interpreter: the
same numbers; on a stubbed GPU: the same arguments, constexprs and grid, for both engines).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from helpers import run_stubbed_tests_in_child, stubs_in_child

import flashtile
from flashtile import interface
from flashtile.kernels.runtime import INTERPRET
from flashtile.semantics.params import AttentionParams


def _qkv(shape_q=(2, 40, 4, 32), shape_k=(2, 50, 2, 32), dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(shape_q, generator=g).to(dtype)
    k, v = (torch.randn(shape_k, generator=g).to(dtype) for _ in range(2))
    return q, k, v


# --------------------------------------------------------------------------------------
# The memoised checks (any device: they run before the backend is chosen)
# --------------------------------------------------------------------------------------


def test_checks_run_once_per_key_and_a_failing_call_caches_nothing():
    q, k, v = _qkv()
    before = len(interface._checked)
    for _ in range(3):
        flashtile.flash_attn_func(q, k, v, causal=True)
    assert len(interface._checked) == before + 1
    with pytest.raises(ValueError, match="softcap"):
        flashtile.flash_attn_func(q, k, v, causal=True, softcap=-1.0)
    assert len(interface._checked) == before + 1


@pytest.mark.parametrize("bad, error, match", [
    (dict(window_size=(True, -1)), TypeError, "window_size left"),
    (dict(window_size=[-1, -1, -1]), ValueError, "window_size"),
    (dict(window_size=(-1,)), ValueError, "window_size"),
    (dict(window_size=(1, -1, 5)), ValueError, "window_size"),
    (dict(softmax_scale=True), TypeError, "softmax_scale"),
    (dict(causal=1), TypeError, "causal"),
    (dict(deterministic=0), TypeError, "deterministic"),
    (dict(return_lse=1), TypeError, "return_lse"),
    (dict(dropout_p=1), ValueError, "dropout_p"),
    (dict(softcap=float("nan")), ValueError, "softcap"),
    (dict(softmax_scale=[0.5]), TypeError, "softmax_scale"),
])
def test_bad_arguments_raise_after_a_good_call_with_the_same_tensors(bad, error, match):
    q, k, v = _qkv()
    good = dict(window_size=(1, -1), softmax_scale=1.0, causal=True, deterministic=False, return_lse=True,
                dropout_p=0.0, softcap=0.0)
    flashtile.flash_attn_func(q, k, v, **good)
    flashtile.flash_attn_func(q, k, v, **good)  # now memoised
    with pytest.raises(error, match=match):
        flashtile.flash_attn_func(q, k, v, **(good | bad))


def test_tensor_metadata_is_checked_after_a_good_call():
    q, k, v = _qkv()
    flashtile.flash_attn_func(q, k, v)
    with pytest.raises(ValueError, match="same batch size"):
        flashtile.flash_attn_func(q, k[:1], v[:1])
    with pytest.raises(ValueError, match="share one dtype"):
        flashtile.flash_attn_func(q, k.double(), v)
    with pytest.raises(ValueError, match="contiguous in its last"):
        flashtile.flash_attn_func(q, k.transpose(1, 3).contiguous().transpose(1, 3), v)
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        flashtile.flash_attn_func(q.tolist(), k, v)


def test_alibi_slopes_are_each_calls_own():
    q, k, v = _qkv()
    a, b = torch.full((4,), 0.1), torch.full((4,), 0.7)
    out_a = flashtile.flash_attn_func(q, k, v, alibi_slopes=a)
    out_b = flashtile.flash_attn_func(q, k, v, alibi_slopes=b)  # same key, other slopes
    torch.testing.assert_close(out_b, flashtile.flash_attn_func(q, k, v, alibi_slopes=b.clone()))
    assert not torch.equal(out_a, out_b)
    with pytest.raises(ValueError, match="alibi_slopes must be torch.float32"):
        flashtile.flash_attn_func(q, k, v, alibi_slopes=b.double())


def test_memoised_checks_keep_autograd():
    q, k, v = (t.requires_grad_() for t in _qkv())
    for _ in range(2):
        out = flashtile.flash_attn_func(q, k, v, causal=True)
        out.sum().backward()
    assert q.grad is not None and k.grad is not None and v.grad is not None


def test_the_engine_setting_is_in_the_key(monkeypatch):
    q, k, v = _qkv()
    flashtile.flash_attn_func(q, k, v)
    before = len(interface._checked)
    monkeypatch.setenv("FLASHTILE_ENGINE", "triton")
    flashtile.flash_attn_func(q, k, v)
    assert len(interface._checked) == before + 1


# --------------------------------------------------------------------------------------
# The forward's launch plans in Triton's interpreter: the same numbers as the general path
# --------------------------------------------------------------------------------------

needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="runs the tl.* kernels on CPU tensors in the interpreter")


@needs_interpreter
@pytest.mark.parametrize("case", ["plain", "causal", "window", "gqa", "softcap", "alibi", "alibi2d_strided",
                                  "dropout", "fp16", "strided"])
def test_planned_forward_equals_the_general_path(case):
    from flashtile.kernels.attention import forward
    from flashtile.kernels.attention.layout import Layout

    q, k, v = _qkv(dtype=torch.float16 if case == "fp16" else torch.float32)
    params = AttentionParams(0.3)
    if case == "causal":
        params = AttentionParams.causal(0.3)
    elif case == "window":
        params = AttentionParams(0.3, window_left=7, window_right=3)
    elif case == "gqa":
        k, v = k[:, :, :1], v[:, :, :1]
    elif case == "softcap":
        params = AttentionParams(0.3, softcap=2.0)
    elif case == "alibi":
        params = AttentionParams(0.3, alibi_slopes=torch.rand(4) * 0.3)
    elif case == "alibi2d_strided":
        params = AttentionParams(0.3, alibi_slopes=(torch.rand(4, 2) * 0.3).t())
    elif case == "dropout":
        params = AttentionParams(0.3, dropout_p=0.25, seed=11, offset=5)
    elif case == "strided":
        q = torch.randn(2, 40, 8, 32)[:, :, ::2]  # strided heads: TMA-ready as it is
    forward.clear_plans()
    forward.fwd(q, k, v, params)  # a key's first call goes the general way; the second builds the plan
    got = forward.fwd(q, k, v, params)
    assert len(forward.cache.plans) == 1 and next(iter(forward.cache.plans.values())) is not forward.NO_PLAN
    want = forward._forward(Layout(q, k), q, k, v, params, None)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    if case == "dropout":  # the seed is each call's own
        other = AttentionParams(0.3, dropout_p=0.25, seed=12, offset=5)
        assert torch.equal(forward.fwd(q, k, v, other)[0], forward._forward(Layout(q, k), q, k, v, other, None)[0])
        assert len(forward.cache.plans) == 1


@needs_interpreter
def test_calls_a_plan_cannot_take_go_the_general_way():
    from flashtile.kernels.attention import forward

    q, k, v = _qkv(shape_q=(1, 20, 2, 40), shape_k=(1, 20, 2, 40))  # head dim 40: padded to 64
    forward.clear_plans()
    forward.fwd(q, k, v, AttentionParams(0.3))
    out, _ = forward.fwd(q, k, v, AttentionParams(0.3))
    assert list(forward.cache.plans.values()) == [forward.NO_PLAN]
    torch.testing.assert_close(out, flashtile.flash_attn_func(q, k, v, softmax_scale=0.3))
    # A base off the 16-byte grid in one call: that call goes the general way (a padded copy).
    q, k, v = _qkv()
    params = AttentionParams(0.3)
    forward.fwd(q, k, v, params)
    forward.fwd(q, k, v, params)  # the key's second call: its plan, which the shifted call then finds
    assert len(forward.cache.plans) == 2 and list(forward.cache.plans.values())[1] is not forward.NO_PLAN
    buf = torch.empty(q.numel() + 1)
    shifted = buf[1:].view(q.shape).copy_(q)
    assert shifted.stride() == q.stride() and shifted.data_ptr() % 16
    torch.testing.assert_close(forward.fwd(shifted, k, v, params)[0], forward.fwd(q, k, v, params)[0],
                               rtol=0, atol=0)


@needs_interpreter
def test_kept_plans_go_stale_with_the_cache(monkeypatch):
    from flashtile.kernels.attention import forward
    from flashtile.ops import attention as ops

    q, k, v = _qkv()
    params = AttentionParams(0.3)
    memo = interface._Checked(params)
    forward.clear_plans()
    ops.eager_forward(q, k, v, params, memo)
    assert memo.plans is None and not forward.cache.plans, "a key's first call goes the general way, building no plan"
    ops.eager_forward(q, k, v, params, memo)
    kept = memo.plan
    assert kept is not forward.NO_PLAN and memo.plans is forward.cache.plans
    forward.clear_plans()
    for _ in range(2):  # the key is new again: seen once, then planned
        ops.eager_forward(q, k, v, params, memo)
    assert memo.plans is forward.cache.plans and memo.plan not in (kept, forward.NO_PLAN)
    assert list(forward.cache.plans.values()) == [memo.plan]


@needs_interpreter
@pytest.mark.parametrize("case", ["plain", "causal", "window", "gqa", "softcap", "fp16", "deterministic",
                                  "strided", "alibi", "dropout", "padded"])
def test_planned_backward_equals_the_general_path(case):
    from flashtile.kernels.attention import backward, forward
    from flashtile.kernels.attention.layout import Layout

    q, k, v = _qkv(dtype=torch.float16 if case == "fp16" else torch.float32)
    params = {
        "causal": AttentionParams.causal(0.3),
        "window": AttentionParams(0.3, window_left=7, window_right=3),
        "softcap": AttentionParams(0.3, softcap=2.0),
        "deterministic": AttentionParams(0.3, deterministic=True),
        "alibi": AttentionParams(0.3, alibi_slopes=torch.rand(4) * 0.3),
        "dropout": AttentionParams(0.3, dropout_p=0.25, seed=11, offset=5),
    }.get(case, AttentionParams(0.3))
    if case == "gqa":
        k, v = k[:, :, :1], v[:, :, :1]
    elif case == "strided":
        q = torch.randn(2, 40, 8, 32)[:, :, ::2]  # strided heads: TMA-ready as it is
    elif case == "padded":
        q, k, v = _qkv(shape_q=(1, 20, 2, 40), shape_k=(1, 20, 2, 40))  # head dim 40: padded to 64
    out, lse = forward.fwd(q, k, v, params)
    dout = torch.randn_like(out)
    backward.clear_plans()
    backward.bwd(dout, q, k, v, out, lse, params)  # a key's first call goes the general way; the second plans
    got = backward.bwd(dout, q, k, v, out, lse, params)
    plannable = case not in ("alibi", "dropout", "padded")
    assert len(backward.cache.plans) == (case != "alibi" and case != "dropout")
    assert any(plan is not backward.NO_PLAN for plan in backward.cache.plans.values()) == plannable
    want = backward._backward(Layout(q, k), dout, q, k, v, out, lse, params, None, None)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert torch.equal(g, w), name
    # A base off the 16-byte grid in one call: that call goes the general way, whether the plan
    # is built (above) or would be built by this very call (the key's second call).
    buf = torch.empty(dout.numel() + 1, dtype=dout.dtype)
    shifted = buf[1:].view(dout.shape).copy_(dout)
    assert shifted.stride() == dout.stride() and shifted.data_ptr() % 16
    for g, w in zip(backward.bwd(shifted, q, k, v, out, lse, params), want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    backward.clear_plans()
    backward.bwd(dout, q, k, v, out, lse, params)
    for g, w in zip(backward.bwd(shifted, q, k, v, out, lse, params), want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    assert not backward.cache.plans, "the misaligned call built no plan"
    backward.bwd(dout, q, k, v, out, lse, params)
    assert len(backward.cache.plans) == (case != "alibi" and case != "dropout")


# --------------------------------------------------------------------------------------
# On a stubbed GPU (benchmarks/profile_host_cpu.py): the plans launch what the general path
# launches, for both engines
# --------------------------------------------------------------------------------------

# The stubbed tests run in a child where this process runs real kernels (helpers.stubs_in_child).
STUBS_IN_CHILD = stubs_in_child()
in_child = pytest.mark.skipif(STUBS_IN_CHILD, reason="run by test_stubbed_gpu_without_the_interpreter")


def test_stubbed_gpu_without_the_interpreter():
    if not STUBS_IN_CHILD:
        pytest.skip("the tests below run in this process")
    summary = run_stubbed_tests_in_child(__file__, "-k", "stubbed and not without_the_interpreter")
    assert " passed" in summary and "failed" not in summary


def _describe(arg, inputs):
    """A launch argument as the kernel sees it: a tensor by dtype, shape, strides and which input
    it is (``inputs``: address -> name; outputs are fresh at every call), a descriptor by its
    fields and tensor, anything else by value and type."""
    if isinstance(arg, torch.Tensor):
        return ("tensor", arg.dtype, tuple(arg.shape), arg.stride(), inputs.get(arg.data_ptr(), "fresh"))
    if hasattr(arg, "block_shape"):
        fields = {name: value for name, value in vars(arg).items() if name != "base"}
        return (type(arg), _describe(arg.base, inputs), repr(fields))
    if isinstance(arg, tuple):
        return tuple(_describe(a, inputs) for a in arg)
    return (type(arg), arg)


def _c_parameter(arg, inputs):
    """A C launcher parameter as the kernel gets it: a plain tensor by its address (what
    Triton's launcher resolves it to), so that a tensor and an int holding its address (a bound
    launch passes those, ``launch._Direct``) describe alike; the rest as :func:`_describe`."""
    if isinstance(arg, torch.Tensor) or (type(arg) is int and arg >= 2**40):  # an address
        return ("pointer", inputs.get(arg if type(arg) is int else arg.data_ptr(), "fresh"))
    if isinstance(arg, tuple):
        return tuple(_c_parameter(a, inputs) for a in arg)
    return _describe(arg, inputs)


@pytest.fixture
def stubbed(monkeypatch):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import profile_host_cpu

    from flashtile.kernels import launch as launch_mod
    from flashtile.kernels.attention import backward, forward
    from flashtile.kernels.hopper import attention_bwd, attention_bwd_dq, attention_bwd_wide, attention_fwd

    launches, inputs = [], {}

    # The general path calls ``launch``, a plan its bound launcher: both recorded as the kernel,
    # grid, arguments and options they hand the launch layer (``dynamic`` is a hint of
    # ``launch``'s, not a launch argument; the bound launchers' own rules are
    # tests/kernels/test_launch.py's).
    def recording(kernel, grid, args, options, dynamic=()):
        launches.append((kernel.fn.__name__, grid, _describe(args, inputs), sorted(options.items())))

    for module in (forward, attention_fwd, backward, attention_bwd, attention_bwd_wide, attention_bwd_dq):
        monkeypatch.setattr(module, "launch", recording)
    monkeypatch.setattr(launch_mod.BoundLaunch, "__call__",
                        lambda self, head: recording(self.kernel, self.grid, self.arguments(head), self.options))
    forward.clear_plans()
    backward.clear_plans()
    with profile_host_cpu.stubbed_gpu():
        yield launches, inputs
    forward.clear_plans()
    backward.clear_plans()
    interface._checked.clear()


_STUB_PARAMS = {
    "full": AttentionParams(0.125),
    "causal": AttentionParams.causal(0.125),
    "window": AttentionParams(0.125, window_left=70, window_right=3),
    "softcap": AttentionParams(0.125, softcap=5.0),
    "alibi": AttentionParams(0.125, alibi_slopes=torch.rand(2, 4).t().contiguous().t()),
    "dropout": AttentionParams(0.125, dropout_p=0.1, seed=3, offset=1 << 40),
}


@in_child
@pytest.mark.parametrize("engine", ["auto", "triton"])
@pytest.mark.parametrize("d, gqa", [(64, False), (128, False), (128, True), (256, True)])
@pytest.mark.parametrize("case", list(_STUB_PARAMS))
def test_stubbed_plans_launch_what_the_general_path_launches(stubbed, monkeypatch, engine, d, gqa, case):
    from flashtile.kernels.attention import forward
    from flashtile.kernels.attention.layout import Layout

    launches, inputs = stubbed
    monkeypatch.setenv("FLASHTILE_ENGINE", engine)
    q, k, v = _qkv((2, 130, 4, d), (2, 300, 2 if gqa else 4, d), dtype=torch.bfloat16)
    params = _STUB_PARAMS[case]
    inputs.update({q.data_ptr(): "q", k.data_ptr(): "k", v.data_ptr(): "v"})
    if params.alibi_slopes is not None:
        inputs[params.alibi_slopes.data_ptr()] = "alibi"
    forward.fwd(q, k, v, params)  # builds the plan, launches from it
    forward.fwd(q, k, v, params)
    forward._forward(Layout(q, k), q, k, v, params, None)
    assert len(forward.cache.plans) == 1 and next(iter(forward.cache.plans.values())) is not forward.NO_PLAN
    planned, again, general = launches
    assert planned == again == general
    # 130 query rows with a mask are short masked: at d = 64 auto keeps them on tl.*.  Softcap
    # and ALiBi run on the Gluon forward (dropout does not).
    gluon = engine == "auto" and (case in ("full", "softcap", "alibi") or (case in ("causal", "window") and d > 64))
    assert (planned[0] == "attention_fwd_kernel") == gluon


@in_child
def test_stubbed_gluon_forward_arguments_by_name(stubbed, monkeypatch):
    """Every launch of the Gluon forward -- the general path, the plan and the FP8 launcher --
    passes each runtime parameter what its name says (the launchers list them by position)."""
    import math

    from flashtile.kernels.attention import forward
    from flashtile.kernels.hopper import attention_fp8, attention_fwd

    launches, inputs = stubbed
    monkeypatch.setenv("FLASHTILE_ENGINE", "auto")
    q, k, v = _qkv((2, 130, 4, 128), (2, 300, 2, 128), dtype=torch.bfloat16)
    slopes = torch.rand(2, 4)
    inputs.update({q.data_ptr(): "q", slopes.data_ptr(): "alibi"})
    params = AttentionParams(0.125, window_left=-1, window_right=0, softcap=5.0, alibi_slopes=slopes)
    for _ in range(3):  # the general path (which builds the plan), then the plan twice
        forward.fwd(q, k, v, params)
    names = attention_fwd.attention_fwd_kernel.arg_names
    log2e = math.log2(math.e)
    for name, grid, args, options in launches:
        assert name == "attention_fwd_kernel"
        got = dict(zip(names, args))
        assert got["ALIBI"][-1] == "alibi" and got["stride_ab"] == (int, 4)
        assert got["softcap_scale"] == (float, 2 * log2e * 0.125 / 5.0) and got["softcap_log2"] == (float, 5.0 * log2e)
        assert got["qk_scale"] == (float, 0.125 * log2e)
        assert got["window_left"] == (int, -1) and got["window_right"] == (int, 0)
        assert got["O"][0] == "tensor" and got["O"][1] == torch.bfloat16 and got["LSE"][1] == torch.float32
        assert got["seqlen_q"] == (int, 130) and got["seqlen_k"] == (int, 300) and got["group"] == (int, 2)
        assert got["headdim"] == (int, 128) and got["section_heads"][0] is int
        assert dict(options)["HAS_SOFTCAP"] is True and dict(options)["HAS_ALIBI"] is True

    # The FP8 form goes through kernel[grid] itself: record what Triton's launch receives.
    from triton.runtime.jit import JITFunction

    calls = []
    monkeypatch.setattr(JITFunction, "run", lambda self, *a, grid, warmup, **kw: calls.append((a, kw)))
    q8, k8 = (t.to(torch.float8_e4m3fn) for t in (q, k))
    v_t = k8.permute(0, 2, 3, 1).contiguous()
    one = torch.ones(1)
    attention_fp8.forward(q8, k8, v_t, one, one, one, 0.125, causal=True)
    (a, kw), = calls
    got = dict(zip(names, a))
    assert got["ALIBI"].dtype == torch.float32 and got["stride_ab"] == 0
    assert got["softcap_scale"] == 0.0 and got["softcap_log2"] == 0.0 and got["qk_scale"] == 0.125 * log2e
    assert got["window_left"] == -1 and got["window_right"] == 0 and got["DESCALES"].shape[0] == 3
    assert kw["HAS_SOFTCAP"] is False and kw["HAS_ALIBI"] is False and kw["FP8"] is True


def _backward_three_ways(stubbed, monkeypatch, engine, d, gqa, case):
    """The launches of a backward at head dim ``d`` under ``FLASHTILE_ENGINE=engine``: the key's
    first call (the general way), its second (the plan, built then) and the general path
    called directly -- asserted equal; returns the planned ones."""
    from flashtile.kernels.attention import backward
    from flashtile.kernels.attention.layout import Layout

    launches, inputs = stubbed
    monkeypatch.setenv("FLASHTILE_ENGINE", engine)
    q, k, v = _qkv((2, 130, 4, d), (2, 300, 2 if gqa else 4, d), dtype=torch.bfloat16)
    out, dout = torch.randn_like(q), torch.randn_like(q)
    lse = torch.randn(2, 4, 130)
    params = dict(_STUB_PARAMS, deterministic=AttentionParams(0.125, deterministic=True))[case]
    inputs.update({t.data_ptr(): name for t, name in ((q, "q"), (k, "k"), (v, "v"), (out, "out"), (dout, "dout"),
                                                     (lse, "lse"))})
    backward.bwd(dout, q, k, v, out, lse, params)  # the key's first call: the general way
    backward.bwd(dout, q, k, v, out, lse, params)  # builds the plan, launches from it
    backward._backward(Layout(q, k), dout, q, k, v, out, lse, params, None, None)
    n = len(launches) // 3
    first, planned, general = launches[:n], launches[n:2 * n], launches[2 * n:]
    assert first == planned == general and len(launches) == 3 * n
    return planned


@in_child
@pytest.mark.parametrize("engine", ["auto", "triton"])
@pytest.mark.parametrize("d, gqa", [(64, False), (128, False), (128, True)])
@pytest.mark.parametrize("case", ["full", "causal", "window", "softcap", "deterministic"])
def test_stubbed_backward_plans_launch_what_the_general_path_launches(stubbed, monkeypatch, engine, d, gqa, case):
    from flashtile.kernels.attention import backward

    planned = _backward_three_ways(stubbed, monkeypatch, engine, d, gqa, case)
    assert len(backward.cache.plans) == 1 and next(iter(backward.cache.plans.values())) is not backward.NO_PLAN
    # 130 query rows with a mask are short masked; at d = 64 auto keeps those on tl.*.
    gluon = engine == "auto" and case != "softcap" and (d > 64 or case in ("full", "deterministic"))
    expected = ["_bwd_preprocess", "_attn_bwd_dkdv", "_attn_bwd_dq"]
    # Deterministic, and masked (130 rows: short) above d = 64: dK and dV on the Gluon kernel, dQ in
    # a separate pass (the Gluon one above d = 64); else dQ from its workspace.
    separate = case == "deterministic" or (d > 64 and case in ("causal", "window"))
    if gluon:
        dq_pass = "attention_bwd_dq_kernel" if d > 64 else "_attn_bwd_dq"
        expected = ["_bwd_preprocess", "attention_bwd_kernel", dq_pass if separate else "_dq_from_workspace"]
    assert [name for name, *_ in planned] == expected
    if gluon:
        assert dict(planned[1][3])["WITH_DQ"] == (not separate)


@in_child
@pytest.mark.parametrize("engine", ["auto", "gluon"])
@pytest.mark.parametrize("d, gqa", [(256, False), (256, True), (192, True)])
@pytest.mark.parametrize("case", ["full", "causal", "window", "deterministic"])
def test_stubbed_wide_backward_plans_launch_what_the_general_path_launches(stubbed, monkeypatch, engine, d, gqa,
                                                                           case):
    """Above d = 128 (auto or forced Gluon): dK and dV on the wide-head kernel, dQ on the Gluon dQ
    kernel, the same launches planned or not (a padded head dim, 192, goes the general way every time)."""
    planned = _backward_three_ways(stubbed, monkeypatch, engine, d, gqa, case)
    assert [name for name, *_ in planned] == ["_bwd_preprocess", "attention_bwd_wide_kernel", "attention_bwd_dq_kernel"]
    assert dict(planned[1][3])["HEAD_DIM"] == dict(planned[2][3])["HEAD_DIM"] == 256
    # The dQ pass reads the preprocess's rows and writes a fresh dQ of q's shape and dtype.
    _name, grid, args, options = planned[2]
    dq, lse2, delta = args[4:7]
    assert dq[:3] == ("tensor", torch.bfloat16, (2, 130, 4, d)) and dq[4] == "fresh"
    assert lse2[1] == delta[1] == torch.float32 and lse2[2] == delta[2] == (2, 4, 130)
    assert grid[0] <= 132 and dict(options)["MASK_RIGHT"] == (case in ("causal", "window"))


@in_child
def test_stubbed_backward_plans_follow_the_dq_pass_rule(stubbed, monkeypatch):
    """A deterministic call at d = 128 takes dQ from the Gluon dQ pass; with the pass's threshold
    raised above it (as bench_deterministic.py does for its comparison) the same shapes get a
    new plan that launches the tl.* dQ kernel, as the general path does."""
    from flashtile.kernels import engine

    launches, inputs = stubbed
    planned = _backward_three_ways(stubbed, monkeypatch, "auto", 128, False, "deterministic")
    assert [name for name, *_ in planned] == ["_bwd_preprocess", "attention_bwd_kernel", "attention_bwd_dq_kernel"]
    launches.clear()
    inputs.clear()  # the next tensors may take the addresses of these
    monkeypatch.setattr(engine, "GLUON_DQ_MIN_HEADDIM", 129)
    planned = _backward_three_ways(stubbed, monkeypatch, "auto", 128, False, "deterministic")
    assert [name for name, *_ in planned] == ["_bwd_preprocess", "attention_bwd_kernel", "_attn_bwd_dq"]


@in_child
def test_stubbed_backward_plans_follow_the_short_masked_rule(stubbed, monkeypatch):
    """A short causal call at d = 128 takes the separate dQ pass (engine.separate_dq); with the
    rule's row threshold at 0 (as bench_hopper_bwd.py's engine variants set it) the same shapes
    get a new plan, with dQ from the workspace, as the general path."""
    from flashtile.kernels import engine

    launches, inputs = stubbed
    planned = _backward_three_ways(stubbed, monkeypatch, "auto", 128, False, "causal")
    assert [name for name, *_ in planned] == ["_bwd_preprocess", "attention_bwd_kernel", "attention_bwd_dq_kernel"]
    launches.clear()
    inputs.clear()  # the next tensors may take the addresses of these
    monkeypatch.setattr(engine, "SEPARATE_DQ_MAX_ROWS", 0)
    planned = _backward_three_ways(stubbed, monkeypatch, "auto", 128, False, "causal")
    assert [name for name, *_ in planned] == ["_bwd_preprocess", "attention_bwd_kernel", "_dq_from_workspace"]


@in_child
def test_stubbed_gluon_backward_lets_go_of_the_preprocess_rows_before_dq_conversion(stubbed, monkeypatch):
    # dQ's conversion holds the fp32 workspace, dQ, dK and dV at once (the backward's peak of
    # memory): delta and the log2 LSE are dropped before it, on the general path and the plan.
    import weakref

    from flashtile.kernels import launch as launch_mod
    from flashtile.kernels.attention import backward

    monkeypatch.setenv("FLASHTILE_ENGINE", "auto")
    rows, alive = [], []
    recording, bound_call, convert = backward.launch, launch_mod.BoundLaunch.__call__, backward.dq_from_workspace

    def launch(kernel, grid, args, options, dynamic=()):
        if kernel.fn.__name__ == "_bwd_preprocess":
            rows.append([weakref.ref(t) for t in args[4:6]])  # delta, lse2
        recording(kernel, grid, args, options, dynamic)

    def call(self, head):
        if self.kernel.fn.__name__ == "_bwd_preprocess":
            rows.append([weakref.ref(t) for t in head[4:6]])
        bound_call(self, head)

    def dq_from_workspace(*args, **kwargs):
        alive.append([ref() is not None for ref in rows[-1]])
        return convert(*args, **kwargs)

    monkeypatch.setattr(backward, "launch", launch)
    monkeypatch.setattr(launch_mod.BoundLaunch, "__call__", call)
    monkeypatch.setattr(backward, "dq_from_workspace", dq_from_workspace)
    q, k, v = _qkv((2, 130, 4, 128), (2, 300, 4, 128), dtype=torch.bfloat16)
    out, dout, lse = torch.randn_like(q), torch.randn_like(q), torch.randn(2, 4, 130)
    for _ in range(2):  # the key's first call goes the general way, the second builds and runs the plan
        dq = backward.bwd(dout, q, k, v, out, lse, AttentionParams(0.125))[0]
        assert dq.shape == q.shape and dq.dtype == q.dtype
    assert len(backward.cache.plans) == 1 and len(rows) == 2
    assert alive == [[False, False], [False, False]]


@in_child
def test_stubbed_tiny_forward_takes_the_plan_through_the_public_function(stubbed):
    from flashtile.kernels.attention import forward
    from flashtile.ops import attention as ops

    q, k, v = _qkv((1, 128, 8, 64), (1, 128, 8, 64), dtype=torch.bfloat16)
    calls = []
    real = ops.eager_forward

    def counting(q, k, v, params, memo, **kwargs):
        calls.append(memo)
        return real(q, k, v, params, memo, **kwargs)

    ops.eager_forward = counting
    try:
        for _ in range(3):  # (with the LSE: without it, a plan's launch writes it to the sink, below)
            flashtile.flash_attn_func(q, k, v, return_lse=True)
    finally:
        ops.eager_forward = real
    launches, _ = stubbed
    assert len(launches) == 3 and len(set(map(repr, launches))) == 1
    memo = calls[0]
    assert all(m is memo for m in calls) and memo.plans is forward.cache.plans and memo.plan is not forward.NO_PLAN


@in_child
@pytest.mark.parametrize("engine, seqlen_q", [("auto", 128), ("triton", 128), ("auto", 1)])
def test_stubbed_forward_without_lse_writes_it_to_the_streams_sink(stubbed, monkeypatch, engine, seqlen_q):
    """A planned forward outside autograd and without ``return_lse`` launches with the stream's
    LSE sink (``plans.lse_buffer``) where the others pass a fresh LSE: both engines, and the
    split-KV kernel of a few query rows."""
    from flashtile.kernels import workspace

    monkeypatch.setenv("FLASHTILE_ENGINE", engine)
    q, k, v = _qkv((1, seqlen_q, 8, 64), (1, 128, 8, 64), dtype=torch.bfloat16)
    launches, inputs = stubbed
    workspace.clear()
    for _ in range(3):  # the key's first call goes the general way, the second builds the plan
        out = flashtile.flash_attn_func(q, k, v)
    assert isinstance(out, torch.Tensor)
    (held,) = workspace._scratch.values()
    assert held.sink.numel() >= 8 * seqlen_q
    inputs[held.sink.data_ptr()] = "sink"
    flashtile.flash_attn_func(q, k, v)
    out, lse = flashtile.flash_attn_func(q, k, v, return_lse=True)
    assert lse.shape == (1, 8, seqlen_q) and lse.data_ptr() != held.sink.data_ptr()
    with torch.enable_grad():  # recording autograd: the backward reads the LSE
        flashtile.flash_attn_func(q, k.requires_grad_(), v)

    def passes_sink(launch):
        return "'sink')" in repr(launch[2])

    assert [passes_sink(launch) for launch in launches[-3:]] == [True, False, False]
    workspace.clear()


def _planned_case(monkeypatch, d, engine, case):
    """The stubbed-GPU harness, Triton's ``JITFunction``, the forward module, bf16 ``(q, k, v)``
    of head dim ``d``, the case's params and the inputs' names by address, with
    ``FLASHTILE_ENGINE=engine`` (skipped where the Gluon engine cannot take the case)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import profile_host_cpu
    from triton.runtime.jit import JITFunction

    from flashtile.kernels.attention import forward

    if engine == "auto" and case != "full":
        pytest.skip("the Gluon engine takes no ALiBi or dropout")
    monkeypatch.setenv("FLASHTILE_ENGINE", engine)
    q, k, v = _qkv((1, 128, 8, d), (1, 128, 8, d), dtype=torch.bfloat16)
    params = _STUB_PARAMS[case]
    if case == "alibi":
        params = AttentionParams(0.125, alibi_slopes=torch.rand(8))
    inputs = {q.data_ptr(): "q", k.data_ptr(): "k", v.data_ptr(): "v"}
    return profile_host_cpu, JITFunction, forward, (q, k, v), params, inputs


@in_child
@pytest.mark.parametrize("d, engine", [(64, "auto"), (128, "auto"), (128, "triton")])
@pytest.mark.parametrize("case", ["full", "alibi", "dropout"])
def test_stubbed_planned_calls_launch_directly_what_the_ordinary_launch_got(monkeypatch, d, engine, case):
    """Through the real launch layer: the first planned call of a class is Triton's ordinary
    launch, the next ones call the compiled kernel's launcher directly -- with the same
    runtime arguments (fresh outputs aside) followed by the constexprs."""
    profile_host_cpu, JITFunction, forward, (q, k, v), params, inputs = _planned_case(monkeypatch, d, engine, case)
    ordinary, direct = [], []
    forward.clear_plans()
    try:
        with profile_host_cpu.stubbed_gpu():
            stub_run = JITFunction.run

            def counting(self, *args, grid, warmup, **options):
                ordinary.append((self.fn.__name__, grid, _describe(args, inputs), options))
                compiled = stub_run(self, *args, grid=grid, warmup=warmup, **options)
                monkeypatch.setattr(type(compiled), "run", lambda _, *a: direct.append(a))
                return compiled

            monkeypatch.setattr(JITFunction, "run", counting)
            # The key's first call goes the general way (an ordinary launch, the first of its
            # class); the second builds the plan, whose bound launcher launches directly, or
            # (the ``tl.*`` engine) ordinarily once more; the later ones directly.
            for _ in range(4):
                forward.fwd(q, k, v, params)
    finally:
        forward.clear_plans()
    assert len(ordinary) in (1, 2) and len(ordinary) + len(direct) == 4
    assert all(o == ordinary[0] for o in ordinary)
    name, grid, args, options = ordinary[0]
    assert (name == "attention_fwd_kernel") == (engine == "auto")
    for call in direct:
        assert tuple(call[:3]) == (grid + (1, 1))[:3]
        assert _describe(call[9:9 + len(args)], inputs) == args


@in_child
@pytest.mark.parametrize("d, engine", [(64, "auto"), (128, "auto"), (128, "triton")])
@pytest.mark.parametrize("case", ["full", "alibi", "dropout"])
def test_stubbed_planned_calls_pass_the_c_launcher_what_tritons_launcher_passes(monkeypatch, d, engine, case):
    """With Triton's own launcher object (``CudaLauncher``, its descriptor loop) over a recording
    C launcher: the planned calls launched directly hand the C launcher the flattened
    arguments -- tensor maps, shapes, strides, the other arguments and the constexprs -- that
    Triton's launcher hands it for the ordinary launch's arguments (outputs fresh at each call;
    a map described by its inputs, its address by the input it is)."""
    profile_host_cpu, JITFunction, forward, (q, k, v), params, inputs = _planned_case(monkeypatch, d, engine, case)
    raw, ordinary = [], []
    monkeypatch.setattr(profile_host_cpu._StubCompiled, "_raw", staticmethod(lambda *args: raw.append(args)))
    monkeypatch.setattr(profile_host_cpu, "_fill_tma_descriptor",
                        lambda address, *rest: ("map", inputs.get(address, "fresh"), *rest))
    forward.clear_plans()
    try:
        with profile_host_cpu.stubbed_gpu():
            stub_run = JITFunction.run

            def counting(self, *args, grid, warmup, **options):
                compiled = stub_run(self, *args, grid=grid, warmup=warmup, **options)
                ordinary.append((self, grid, args, options, compiled))
                return compiled

            monkeypatch.setattr(JITFunction, "run", counting)
            # As above: one or two ordinary launches, the rest direct.
            for _ in range(4):
                forward.fwd(q, k, v, params)
            assert len(ordinary) in (1, 2) and len(ordinary) + len(raw) == 4
            kernel, grid, args, options, compiled = ordinary[0]
            constexprs = [options.get(p.name, p.default) for p in kernel.params[len(args):]]
            compiled.run(*(grid + (1, 1))[:3], 0, compiled.function, compiled.packed_metadata, None, None, None,
                         *args, *constexprs)
    finally:
        forward.clear_plans()
    want = _c_parameter(raw[-1], inputs)
    assert all(_c_parameter(r, inputs) == want for r in raw[:-1])
    assert any(isinstance(a, tuple) and a[:2] == ("map", "q") for a in raw[-1])


# --------------------------------------------------------------------------------------
# On the GPU: the eager autograd path and the backward's plans give the ops' gradients
# --------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("deterministic", [False, True])
def test_gpu_eager_autograd_gives_the_ops_gradients(monkeypatch, d, causal, deterministic):
    from flashtile.kernels.attention import backward
    from flashtile.ops import attention as ops

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 300, 4, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    k, v = (torch.randn(2, 333, 2, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
            for _ in range(2))
    dout = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16, generator=g)

    def grads():
        out = flashtile.flash_attn_func(q, k, v, causal=causal, deterministic=deterministic)
        assert (type(out.grad_fn).__name__ == "EagerAttentionBackward") == (ops.eager_ok is real_ok)
        return out, torch.autograd.grad(out, (q, k, v), dout)

    real_ok = ops.eager_ok
    backward.clear_plans()
    eager = [grads() for _ in range(3)]  # the general way, then the backward's plan
    assert len(backward.cache.plans) == 1 and next(iter(backward.cache.plans.values())) is not backward.NO_PLAN
    monkeypatch.setattr(ops, "eager_ok", lambda *args: False)
    out_op, grads_op = grads()
    for out, got in eager:
        assert torch.equal(out, out_op)
        for name, a, b in zip(("dq", "dk", "dv"), got, grads_op):
            if deterministic or name != "dq":
                assert torch.equal(a, b), name
            else:  # the Gluon backward adds dQ in no fixed order
                torch.testing.assert_close(a, b, rtol=1.6e-2, atol=1e-3)
