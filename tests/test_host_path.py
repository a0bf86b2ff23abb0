"""The GPU host path on the CPU (benchmarks/profile_host_cpu.py's stubs): CPU tensors that claim
to be CUDA ones, Triton's ordinary launch and the device queries stubbed.  Checks what the host
path decides -- direct launches after the first call of a class, the custom op skipped only
where nothing needs it, no host read of GPU index values -- without a GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from helpers import run_stubbed_tests_in_child, stubs_in_child

# Triton's interpreter (CI on the CPU) makes every kernel an interpreted function, which the
# launch layer never launches directly: the tests below then run in a child process with the
# compiled-kernel path (helpers.stubs_in_child).
STUBS_IN_CHILD = stubs_in_child()
in_child = pytest.mark.skipif(STUBS_IN_CHILD, reason="run by test_host_path_without_the_interpreter")


def test_host_path_without_the_interpreter():
    if not STUBS_IN_CHILD:
        pytest.skip("the tests below run in this process")
    summary = run_stubbed_tests_in_child(__file__)
    assert "17 passed, 1 skipped" in summary, summary

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import profile_host_cpu  # noqa: E402

import flashtile  # noqa: E402
from flashtile.kernels import launch as launch_mod  # noqa: E402
from flashtile.ops import attention as ops  # noqa: E402
from flashtile.validation import indices as validation  # noqa: E402


@pytest.fixture
def stub(monkeypatch):
    """Counts of ordinary and direct launches under the stubbed GPU."""
    counts = {"ordinary": 0, "direct": 0}
    real = launch_mod._ordinary

    def ordinary(*args):
        counts["ordinary"] += 1
        return real(*args)

    def direct(self, *args):
        counts["direct"] += 1

    monkeypatch.setattr(launch_mod, "_ordinary", ordinary)
    monkeypatch.setattr(profile_host_cpu._StubCompiled, "run", direct)
    launch_mod.clear()
    from flashtile import kvcache

    kvcache._checked.clear()  # its entries keep launch plans: each test counts its own launches
    with profile_host_cpu.stubbed_gpu():
        yield counts


def _decode_inputs():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 1, 8, 64, generator=g, dtype=torch.bfloat16)
    kc, vc = (torch.randn(2, 128, 2, 64, generator=g, dtype=torch.bfloat16) for _ in range(2))
    kn, vn = (torch.randn(2, 1, 2, 64, generator=g, dtype=torch.bfloat16) for _ in range(2))
    return q, kc, vc, kn, vn


@in_child
@pytest.mark.parametrize("lengths", ["int", "tensor"])
def test_decode_steps_launch_directly_after_the_first(stub, lengths):
    q, kc, vc, kn, vn = _decode_inputs()
    for step in range(6):
        seqlens = 100 + step if lengths == "int" else torch.tensor([100 + step, 7 + step], dtype=torch.int32)
        flashtile.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seqlens)
    # One launch per step (the append is fused into the split kernel; one split at this
    # shape): the first compiles, a growing int length changes its class at most at
    # multiples of 16 (none between 100 and 105).
    assert stub["ordinary"] == 1 and stub["direct"] == 5


@in_child
def test_decode_steps_reuse_their_checks_and_launch_plans(stub):
    """A decoding loop (one shape, a growing length) checks its arguments and plans its
    launches once: the memo of the checks gains one entry, which holds the step's plan (the
    append fused into the split kernel, the combine launch's plan included), whatever the
    number of steps; the standalone plans of decode() / append_kv() are not used."""
    from flashtile import kvcache
    from flashtile.kernels import decode as kd

    q, kc, vc, kn, vn = _decode_inputs()
    kc, vc = (torch.zeros(2, 4096, 2, 64, dtype=torch.bfloat16) for _ in range(2))  # long enough to split
    checked = len(kvcache._checked)  # 0: the fixture cleared it
    for step in range(6):
        flashtile.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=1000 + step)
    assert len(kvcache._checked) == checked + 1
    assert not kd._split_plans and not kd._append_plans
    plans = [e.plan for e in kvcache._checked.values() if e.plan is not None]
    assert len(plans) == 1 and not plans[0].direct  # the H200's split count: the combine kernel runs too
    assert plans[0].eager.options["APPEND"]
    assert stub["ordinary"] == 2 and stub["direct"] == 10


@in_child
def test_decode_step_launches_trust_the_memo_key_for_dtypes(stub):
    """The step plan's bound launches skip classifying their tensors' dtypes (launch.bind's
    ``fixed``): safe because the memo key holds every tensor's dtype.  Lengths as int32 and then
    int64 tensors are two keys, two plans, two compiled variants; decode()'s plans, shared
    across index dtypes, classify every call."""
    from flashtile import kvcache
    from flashtile.kernels import decode as kd

    q, kc, vc, kn, vn = _decode_inputs()
    for dtype in (torch.int32, torch.int64):
        for step in range(3):
            seqlens = torch.tensor([100 + step, 7 + step], dtype=dtype)
            flashtile.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seqlens)
    plans = [e.plan for e in kvcache._checked.values() if e.plan is not None]
    assert len(plans) == 2 and all(p.eager.split_launch.fixed for p in plans)
    assert stub["ordinary"] == 2 and stub["direct"] == 4
    kd.decode(q, kc, vc, torch.tensor([5, 6], dtype=torch.int32), None, None, 0.125, -1, -1, 0.0, None, 0)
    (shared,) = kd._split_plans.values()
    assert not shared.fixed_classes and not shared.eager.split_launch.fixed


@in_child
def test_rotary_decode_steps_launch_once_per_kernel(stub):
    """Rotary + append: q and the new keys are rotated by the split kernel, so the step makes
    the launches of a plain append step (no rotary kernel, no torch op on q)."""
    q, kc, vc, kn, vn = _decode_inputs()
    angles = torch.rand(110, 32)
    cos, sin = angles.cos(), angles.sin()
    for step in range(6):
        flashtile.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=100 + step, rotary_cos=cos,
                                          rotary_sin=sin, causal=True)
    assert stub["ordinary"] == 1 and stub["direct"] == 5
    with pytest.raises(ValueError, match="seqlen_offsets"):  # an int position past the tables, checked per call
        flashtile.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=110, rotary_cos=cos, rotary_sin=sin)


@in_child
def test_tuning_environment_rebuilds_the_memoised_plan(stub, monkeypatch):
    from flashtile import kvcache
    from flashtile.kernels import decode as kd

    q, kc, vc, kn, vn = _decode_inputs()
    monkeypatch.delenv(kd.TUNING_ENV, raising=False)
    flashtile.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=10)
    (entry,) = [e for e in kvcache._checked.values() if e.plan is not None]
    first = entry.plan
    flashtile.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=11)
    assert entry.plan is first
    monkeypatch.setenv(kd.TUNING_ENV, "warps=8")
    flashtile.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=12)
    assert entry.plan is not first and entry.plan.eager.options["num_warps"] == 8


@in_child
def test_gpu_index_tensors_are_not_read_on_the_host(stub, monkeypatch):
    q, kc, vc, kn, vn = _decode_inputs()

    def no_read(*tensors):
        raise AssertionError("index values read on the host")

    monkeypatch.setattr(validation, "to_host", no_read)
    bad = torch.tensor([10**6, -5], dtype=torch.int32)  # clamped by the kernels, not checked here
    flashtile.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=bad)
    with pytest.raises(ValueError, match=r"cache_seqlens \(300\)"):  # an int is checked for free
        flashtile.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=300)
    from flashtile import kvcache

    monkeypatch.setattr(kvcache, "check_device_values", True)
    with pytest.raises(AssertionError, match="read on the host"):
        flashtile.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=bad)


@in_child
def test_tiny_forward_skips_the_custom_op_only_when_nothing_needs_it(stub, monkeypatch):
    q, k, v = (torch.randn(1, 128, 8, 64, dtype=torch.bfloat16) for _ in range(3))
    assert ops.eager_forward_ok(q, k, v, None)
    with torch.no_grad():
        assert ops.eager_forward_ok(q, k.requires_grad_(), v, None)
    assert not ops.eager_forward_ok(q, k, v, None)  # k requires grad: autograd needs the op
    k.requires_grad_(False)

    class PassThrough(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with PassThrough():
        assert not ops.eager_forward_ok(q, k, v, None)
    with monkeypatch.context() as m:
        m.setattr(torch.compiler, "is_compiling", lambda: True)
        assert not ops.eager_forward_ok(q, k, v, None)
    calls = []
    monkeypatch.setattr(ops, "attention_forward", lambda *a: calls.append(a) or (q, q))
    for _ in range(3):
        flashtile.flash_attn_func(q, k, v)
    assert not calls  # the op was skipped
    # Descriptors and tuples are classified: the first call of the launch class is Triton's
    # ordinary launch, the plan's launcher (built at the second call) may take one more.
    assert stub["ordinary"] in (1, 2) and stub["ordinary"] + stub["direct"] == 3
    with PassThrough():
        flashtile.flash_attn_func(q, k, v)
    assert len(calls) == 1


@in_child
def test_while_dynamo_traces_the_eager_test_asks_is_compiling_alone(stub, monkeypatch):
    # Dynamo cannot trace the mode queries (C functions): under torch.compile, eager_ok must
    # return at is_compiling() before reaching them (fullgraph=True would fail there).
    def untraceable():
        raise AssertionError("a mode query while torch.compile traces")

    for name in ("_function_mode_enabled", "_dispatch_stack_depth", "_functorch_transforms_active"):
        monkeypatch.setattr(ops, name, untraceable)
    q = torch.randn(1, 128, 8, 64, dtype=torch.bfloat16, requires_grad=True)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not ops.eager_ok(q, q, q, None)


@in_child
def test_a_call_recording_autograd_skips_both_ops_only_when_nothing_needs_them(stub, monkeypatch):
    q, k, v = (torch.randn(1, 128, 8, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    assert ops.eager_ok(q, k, v, None) and ops.records_autograd(q, k, v)
    assert not ops.eager_ok(q, k, v, torch.rand(8, requires_grad=True))  # the op's autograd decides for the slopes
    calls = []
    monkeypatch.setattr(ops, "attention_forward", lambda *a: calls.append("forward op"))
    monkeypatch.setattr(ops, "attention_backward", lambda *a: calls.append("backward op"))
    saved = []
    for _ in range(3):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out, lse = flashtile.flash_attn_func(q, k, v, causal=True, return_lse=True)
        assert type(out.grad_fn).__name__ == "EagerAttentionBackward" and lse.grad_fn is out.grad_fn
        out.backward(torch.ones_like(out))
    assert not calls and all(t.grad is not None and t.grad.shape == t.shape for t in (q, k, v))
    assert len(saved) == 3 * 5  # q, k, v, out and lse, through the hooks
    # Only the LSE in the loss: the backward gets a zero output gradient.
    _, lse = flashtile.flash_attn_func(q, k, v, return_lse=True)
    lse.sum().backward()
    assert not calls
    with torch.no_grad():
        flashtile.flash_attn_func(q, k, v)
    assert not calls  # nothing records autograd: the forward launcher alone




@in_child
@pytest.mark.parametrize("headdim, engine", [(128, "triton"), (256, "gluon")])
def test_fp8_calls_launch_directly_after_the_first(stub, headdim, engine):
    from flashtile.fp8 import flash_attn_fp8_func
    from flashtile.kernels.engine import fp8_forward_engine

    q, k, v = (torch.randn(1, 128, 8, headdim).to(torch.float8_e4m3fn) for _ in range(3))
    assert fp8_forward_engine(q) == engine
    ones = torch.ones(1)
    for _ in range(4):
        flash_attn_fp8_func(q, k, v, ones, ones, ones)
    # Two kernels a call, V's transpose and the attention: the first call of each compiles.
    assert stub["ordinary"] == 2 and stub["direct"] == 6


@in_child
def test_fp8_box_descriptors_are_the_checked_constructors():
    """The Gluon FP8 forward's descriptors, built without TensorDescriptor's checks where the
    cheap test passes, hold what the checked constructor makes; a box that fails the test goes
    through the constructor (which raises)."""
    pytest.importorskip("triton.experimental.gluon")
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from flashtile.kernels.hopper.descriptors import _nvmma_layout, box_descriptor

    v_t = torch.zeros(2, 4, 256, 1024, dtype=torch.uint8).view(torch.float8_e4m3fn)
    for t, block in ((v_t, (1, 1, 256, 64)), (v_t.permute(0, 2, 1, 3)[:, :128], (1, 64, 1, 256))):
        fast = box_descriptor(t, block)
        checked = TensorDescriptor(t, list(t.shape), list(t.stride()), list(block), _nvmma_layout(block, t.dtype))
        assert fast.__dict__ == checked.__dict__
    with pytest.raises(AssertionError, match="16-byte aligned"):
        box_descriptor(v_t[..., 1:], (1, 1, 256, 64))  # a base one byte in: not 16-byte aligned


def _launch_record(args):
    """What a launch's arguments say, tensors by layout and descriptors by their fields."""
    def one(a):
        if isinstance(a, torch.Tensor):
            return ("tensor", tuple(a.shape), a.stride(), a.dtype)
        if hasattr(a, "block_shape"):
            return ("descriptor", type(a), one(a.base), a.shape, a.strides, a.block_shape, a.padding,
                    getattr(a, "layout", None))
        return a
    return [one(a) for a in args]


@in_child
@pytest.mark.parametrize("headdim, seqlen_q, causal, kernels", [
    (256, 200, False, 2), (256, 200, True, 2),  # Gluon: V's transpose into the key order, the forward
    (128, 200, True, 2),  # tl.*: V transposed on the host, the forward
    (128, 8, False, 1),  # tl.*: few rows, V transposed in the kernel
])
def test_fp8_plan_launches_what_the_general_path_launches(stub, monkeypatch, headdim, seqlen_q, causal, kernels):
    """flash_attn_fp8_func's launch plans (built at a key's second call) pass the kernels the
    arguments, grid and constexprs of the general path (the first call), the descriptors built
    from templates over the call's tensors; an unaligned q goes the general way again."""
    from flashtile import fp8
    from flashtile.kernels import attention_fp8 as tl_fp8
    from flashtile.kernels.hopper import attention_fp8 as hopper_fp8

    launches = []
    real_launch = launch_mod.launch

    def recording_launch(kernel, grid, args, options, dynamic=()):
        launches.append((kernel, grid, _launch_record(args), options))
        real_launch(kernel, grid, args, options, dynamic)

    def recording_bind(kernel, grid, options, args, dynamic=(), tail_from=None):
        bound = launch_mod.bind(kernel, grid, options, args, dynamic, tail_from)

        def call(head):
            launches.append((kernel, grid, _launch_record(bound.arguments(head)), options))
            bound(head)
        return call

    for module in (hopper_fp8, tl_fp8):
        monkeypatch.setattr(module, "launch", recording_launch)
        monkeypatch.setattr(module, "bind", recording_bind)
    fp8.clear_plans()
    q = torch.randn(2, seqlen_q, 8, headdim).to(torch.float8_e4m3fn)
    k, v = (torch.randn(2, 300, 4, headdim).to(torch.float8_e4m3fn) for _ in range(2))
    descales = torch.ones(2, 4), torch.ones(1), torch.rand(2, 4) + 0.5
    unaligned = torch.empty(q.numel() + 1, dtype=q.dtype)[1:].view(q.shape)
    unaligned.copy_(q)
    for q_in in (q, q, q, unaligned):
        fp8.flash_attn_fp8_func(q_in, k, v, *descales, causal=causal)
    assert len(launches) == 4 * kernels
    assert fp8._plans.plans and all(callable(p) for p in fp8._plans.plans.values())
    for call in range(1, 4):
        assert launches[call * kernels:(call + 1) * kernels] == launches[:kernels], call
    fp8.clear_plans()
