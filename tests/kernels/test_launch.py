"""The direct launch layer (flashtile/kernels/launch.py).

On the CPU the layer's bookkeeping is checked with a ``JITFunction`` whose ``run`` (the
ordinary launch) is replaced by a recorder that returns a fake compiled kernel: which calls
go the ordinary way, which are launched directly, with which arguments.  The key's argument
classes are checked against Triton's own specialisation (``native_specialize_impl``).  The
C launcher called directly is checked against Triton's own ``CudaLauncher`` (its descriptor
loop) over a recording C launcher.  On a GPU (``gpu`` marker) the decode and dense forward
kernels launched directly must give bitwise the results of ordinary launches (the decode ones
in eager mode and replayed from a CUDA graph).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import triton.language as tl
from triton import knobs
from triton.runtime.jit import JITFunction

from flashtile.kernels import launch as launch_mod


def _toy(X, Y, n, scale, BLOCK: tl.constexpr, FLAG: tl.constexpr = False):
    pass  # never compiled: the ordinary launch is a recorder


class _FakeCompiled:
    """What the ordinary launch returns: a kernel whose launcher records its calls."""

    function = "function-handle"
    packed_metadata = "packed-metadata"

    def __init__(self, calls):
        self.calls = calls

    def run(self, *args):
        self.calls.append(("direct", args))


@pytest.fixture
def toy(monkeypatch):
    """(kernel, calls): a JITFunction launched outside the interpreter, recording every launch."""
    kernel = JITFunction(_toy)
    calls = []
    compiled = _FakeCompiled(calls)

    def ordinary(*args, grid, warmup, **options):
        calls.append(("ordinary", grid, args, options))
        return compiled

    kernel.run = ordinary
    monkeypatch.setattr(launch_mod, "INTERPRET", False)
    monkeypatch.setattr(launch_mod, "_device_functions", (lambda: 0, lambda device: 1234))
    monkeypatch.setattr(launch_mod, "RAISE_DIRECT_ERRORS", False)
    launch_mod.clear()
    yield kernel, calls
    launch_mod.clear()


def _kinds(calls):
    return [c[0] for c in calls]


def test_second_launch_of_a_class_is_direct_with_the_constexprs_appended(toy):
    kernel, calls = toy
    x, y = torch.zeros(64), torch.zeros(64)
    launch_mod.launch(kernel, (3,), (x, y, 40, 0.5), dict(BLOCK=16, num_warps=4))
    launch_mod.launch(kernel, (3,), (x, y, 40, 0.5), dict(BLOCK=16, num_warps=4))
    assert _kinds(calls) == ["ordinary", "direct"]
    assert calls[0][1:] == ((3,), (x, y, 40, 0.5), dict(BLOCK=16, num_warps=4))
    # grid padded to 3 axes, the current stream, the handle, metadata, no launch metadata or
    # hooks, then every parameter in signature order (FLAG from its default).
    assert calls[1][1] == (3, 1, 1, 1234, "function-handle", "packed-metadata", None, None, None,
                           x, y, 40, 0.5, 16, False)
    assert launch_mod.compiled_variants(kernel) and not launch_mod.compiled_variants(JITFunction(_toy))


def test_new_tensors_and_ints_of_one_class_reuse_the_variant(toy):
    kernel, calls = toy
    launch_mod.launch(kernel, (1, 2), (torch.zeros(8), torch.zeros(8), 17, 0.5), dict(BLOCK=16))
    launch_mod.launch(kernel, (1, 2), (torch.zeros(9), torch.zeros(3), 18, 2.0), dict(BLOCK=16))
    assert _kinds(calls) == ["ordinary", "direct"]
    assert calls[1][1][:3] == (1, 2, 1)


@pytest.mark.parametrize("dynamic", [(), (2,)])
def test_dynamic_ints_are_a_hint_only(toy, dynamic):
    """Ints named ``dynamic`` are classified each call, the others through a memo of their
    exact values: either way a new value of one class reuses the variant and a new class
    compiles."""
    kernel, calls = toy
    x, y = torch.zeros(8), torch.zeros(8)
    for n in (17, 18, 17, 32, 2**40, 1, 19):
        launch_mod.launch(kernel, (1,), (x, y, n, 0.5), dict(BLOCK=16), dynamic=dynamic)
    # 17, 18, 19: one class; 32 (a multiple of 16), 2**40 (i64) and 1 (a constexpr): new ones.
    assert _kinds(calls) == ["ordinary", "direct", "direct", "ordinary", "ordinary", "ordinary", "direct"]


def test_one_misaligned_tensor_among_aligned_ones_is_its_own_class(toy):
    kernel, calls = toy
    x, y = torch.zeros(64), torch.zeros(64)
    # x[4:]: 16 bytes in, aligned; y[1:] and x[2:]: 4 and 8 bytes in.
    for args in ((x, y), (x, y[1:]), (x[4:], y), (x[4:], y[4:]), (x[4:], y[1:]), (x[2:], y), (x[2:], y[1:])):
        launch_mod.launch(kernel, (1,), (*args, 40, 0.5), dict(BLOCK=16))
    assert _kinds(calls) == ["ordinary", "ordinary", "direct", "direct", "direct", "ordinary", "ordinary"]


@pytest.mark.parametrize("change", ["misaligned_tensor", "dtype", "int_one", "int_multiple_of_16", "int64",
                                    "float_for_int", "constexpr", "bool_for_int_constexpr", "launch_option"])
def test_every_change_of_specialisation_class_compiles_through_triton(toy, change):
    kernel, calls = toy
    x, y = torch.zeros(64), torch.zeros(64)
    base = ((x, y, 40, 0.5), dict(BLOCK=16, FLAG=1, num_warps=4))
    args, options = list(base[0]), dict(base[1])
    if change == "misaligned_tensor":
        args[0] = x[1:]  # 4 bytes past a 16-byte boundary
    elif change == "dtype":
        args[1] = y.to(torch.float16)
    elif change == "int_one":
        args[2] = 1  # a constexpr in Triton's compiled kernel
    elif change == "int_multiple_of_16":
        args[2] = 48
    elif change == "int64":
        args[2] = 40 + 2**32
    elif change == "float_for_int":
        args[2] = 40.0
    elif change == "constexpr":
        options["BLOCK"] = 32
    elif change == "bool_for_int_constexpr":
        options["FLAG"] = True  # == 1 as a dict key, another constexpr for Triton
    elif change == "launch_option":
        options["num_warps"] = 8
    launch_mod.launch(kernel, (1,), base[0], base[1])
    launch_mod.launch(kernel, (1,), tuple(args), options)
    launch_mod.launch(kernel, (1,), tuple(args), options)
    assert _kinds(calls) == ["ordinary", "ordinary", "direct"]


@pytest.mark.parametrize("case", ["tuple_with_a_numpy_scalar", "numpy_scalar", "float_constexpr", "runtime_by_keyword",
                                  "callable_grid"])
def test_what_the_key_cannot_describe_always_launches_the_ordinary_way(toy, case):
    import numpy as np

    kernel, calls = toy
    x, y = torch.zeros(64), torch.zeros(64)
    args, options, grid = (x, y, 40, 0.5), dict(BLOCK=16), (1,)
    if case == "tuple_with_a_numpy_scalar":
        args = (x, y, (40, np.int32(41)), 0.5)
    elif case == "numpy_scalar":
        args = (x, y, np.int32(40), 0.5)
    elif case == "float_constexpr":
        options = dict(BLOCK=16, FLAG=0.0)  # 0.0 == -0.0 as a key, two constexprs for Triton
    elif case == "runtime_by_keyword":
        args, options = (x, y, 40), dict(BLOCK=16, scale=0.5)
    elif case == "callable_grid":
        grid = lambda meta: (1,)  # noqa: E731
    for _ in range(3):
        launch_mod.launch(kernel, grid, args, options)
    assert _kinds(calls) == ["ordinary"] * 3


def test_launch_hooks_and_pre_run_hooks_force_ordinary_launches(toy):
    kernel, calls = toy
    args, options = (torch.zeros(8), torch.zeros(8), 40, 0.5), dict(BLOCK=16)
    launch_mod.launch(kernel, (1,), args, options)

    def hook(metadata):
        pass

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        launch_mod.launch(kernel, (1,), args, options)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    kernel.add_pre_run_hook(lambda *a, **k: None)
    launch_mod.launch(kernel, (1,), args, options)
    kernel.pre_run_hooks.clear()
    launch_mod.launch(kernel, (1,), args, options)
    assert _kinds(calls) == ["ordinary", "ordinary", "ordinary", "direct"]


@pytest.mark.parametrize("knob", ["runtime_debug", "kernel_debug", "instrumentation_mode"])
def test_tritons_debug_and_instrumentation_modes_are_in_the_key(toy, monkeypatch, knob):
    """JITFunction.run compiles with ``debug`` (the kernel's own or ``knobs.runtime.debug``) and
    ``knobs.compilation.instrumentation_mode`` among its options: a variant compiled without
    them must not be launched directly once they are set (nor the other way round), through
    launch() and through a bound launcher."""
    kernel, calls = toy
    x, y = torch.zeros(8), torch.zeros(8)
    args, options = (x, y, 40, 0.5), dict(BLOCK=16)
    bound = launch_mod.bind(kernel, (1,), options, args)

    def set_mode(on):
        if knob == "runtime_debug":
            monkeypatch.setattr(knobs.runtime, "debug", on)
        elif knob == "kernel_debug":
            monkeypatch.setattr(kernel, "debug", on)
        else:
            monkeypatch.setattr(knobs.compilation, "instrumentation_mode", "consan" if on else "")

    for call in (lambda: launch_mod.launch(kernel, (1,), args, options), lambda: bound(args)):
        launch_mod.clear()
        calls.clear()
        set_mode(False)
        call()
        call()
        set_mode(True)  # Triton compiles another variant: the first launch is ordinary
        call()
        call()
        set_mode(False)
        call()
        assert _kinds(calls) == ["ordinary", "direct", "ordinary", "direct", "direct"]


def test_a_failing_direct_launch_falls_back_once_and_for_good(toy):
    kernel, calls = toy
    args, options = (torch.zeros(8), torch.zeros(8), 40, 0.5), dict(BLOCK=16)
    launch_mod.launch(kernel, (1,), args, options)
    compiled = launch_mod.compiled_variants(kernel)[0]

    def broken(*a):
        calls.append(("broken", a))
        raise RuntimeError("launcher failed")

    compiled.run = broken
    launch_mod.launch(kernel, (1,), args, options)  # direct fails: relaunched the ordinary way
    launch_mod.launch(kernel, (1,), args, options)  # marked failed: ordinary from now on
    assert _kinds(calls) == ["ordinary", "broken", "ordinary", "ordinary"]
    assert launch_mod.compiled_variants(kernel) == []


def test_tests_can_make_a_failing_direct_launch_raise(toy, monkeypatch):
    kernel, calls = toy
    args, options = (torch.zeros(8), torch.zeros(8), 40, 0.5), dict(BLOCK=16)
    launch_mod.launch(kernel, (1,), args, options)

    def broken(*a):
        raise RuntimeError("launcher failed")

    launch_mod.compiled_variants(kernel)[0].run = broken
    monkeypatch.setattr(launch_mod, "RAISE_DIRECT_ERRORS", True)
    with pytest.raises(RuntimeError, match="launcher failed"):
        launch_mod.launch(kernel, (1,), args, options)


def test_interpreter_and_tracing_launch_the_ordinary_way(toy, monkeypatch):
    kernel, calls = toy
    args, options = (torch.zeros(8), torch.zeros(8), 40, 0.5), dict(BLOCK=16)
    launch_mod.launch(kernel, (1,), args, options)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    launch_mod.launch(kernel, (1,), args, options)
    monkeypatch.undo()
    monkeypatch.setattr(launch_mod, "INTERPRET", True)
    monkeypatch.setattr(launch_mod, "_device_functions", (lambda: 0, lambda device: 1234))
    launch_mod.launch(kernel, (1,), args, options)
    assert _kinds(calls) == ["ordinary", "ordinary", "ordinary"]


def test_argument_classes_are_at_least_as_fine_as_tritons_specialisation():
    """Two arguments of one class get one specialisation from Triton (what picks the
    compiled variant), for ints around every boundary, floats, bools, None and tensors."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend

    backend = CUDABackend(GPUTarget("cuda", 90, 32))
    ints = [0, 1, 2, 15, 16, 17, 32, -1, -16, -17, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, -2**31, -2**31 - 1,
            -2**31 - 16, 2**63 - 16, 2**63 - 1, -2**63, 2**63, 2**63 + 16, 2**64 - 16, 2**64 - 1]
    base = torch.zeros(64, dtype=torch.float32)
    tensors = [base, base[1:], base[4:], base[8:], base.to(torch.bfloat16), base.to(torch.bfloat16)[8:],
               base.to(torch.bfloat16)[1:], base.to(torch.int32), base.to(torch.int64)[2:]]
    from triton.tools.tensor_descriptor import TensorDescriptor

    grid4 = torch.zeros(2, 64, 4, 64, dtype=torch.bfloat16)
    descriptors = [TensorDescriptor(t, list(t.shape), list(t.stride()), block)
                   for t in (grid4, grid4[1:], grid4.to(torch.float16)) for block in ([1, 64, 1, 64], [1, 32, 1, 64])]
    descriptors.append(TensorDescriptor(grid4, list(grid4.shape), list(grid4.stride()), [1, 64, 1, 64], "nan"))
    try:
        import triton.experimental.gluon.language as gl
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

        for rows in (64, 128):
            layout = gl.NVMMASharedLayout.get_default_for([1, rows, 1, 64], gl.bfloat16)
            descriptors.append(GluonDescriptor(grid4, list(grid4.shape), list(grid4.stride()), [1, rows, 1, 64],
                                               layout))
    except ImportError:
        pass
    tuples = [(base, 40), (base[1:], 40), (base, 48), (base, 1), (base, 40, None), (2**40, base.to(torch.int32))]
    values = ints + [0.0, -0.0, 1.0, 2.5, True, False, None] + tensors + descriptors + tuples
    seen = {}
    for value in values:
        cls = launch_mod._arg_class(value)
        try:
            spec = native_specialize_impl(backend, value, False, True, True)
        except Exception:  # noqa: BLE001 - a value Triton itself rejects (above u64)
            spec = "rejected"
        spec = repr((spec[0], spec[1])) if spec != "rejected" else spec
        if cls in seen:
            assert seen[cls][1] == spec, (value, seen[cls][0], cls, spec, seen[cls][1])
        else:
            seen[cls] = (value, spec)
    assert len({launch_mod._arg_class(d) for d in descriptors}) == len({repr(
        native_specialize_impl(backend, d, False, True, True)[0]) for d in descriptors}) + 1  # the padding
    assert launch_mod._arg_class((1, [2])) is launch_mod._UNCLASSIFIED


def test_descriptor_classes_follow_the_text_triton_specialises():
    """A block shape with a dim that equals an int but prints apart (True for 1) is not keyed;
    equal Gluon layouts that print apart are two classes."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    grid4 = torch.zeros(2, 64, 4, 64, dtype=torch.bfloat16)
    desc = TensorDescriptor(grid4, list(grid4.shape), list(grid4.stride()), [1, 64, 1, 64])
    assert launch_mod._arg_class(desc) is not launch_mod._UNCLASSIFIED
    desc.block_shape = [True, 64, 1, 64]
    assert launch_mod._arg_class(desc) is launch_mod._UNCLASSIFIED
    gl = pytest.importorskip("triton.experimental.gluon.language")
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

    layouts = [gl.NVMMASharedLayout(128, 16, rank=4, transposed=t) for t in (False, 0)]
    assert layouts[0] == layouts[1] and str(layouts[0]) != str(layouts[1])
    classes = {launch_mod._arg_class(GluonDescriptor(grid4, list(grid4.shape), list(grid4.stride()), [1, 64, 1, 64],
                                                     layout)) for layout in layouts}
    assert len(classes) == 2


# ---------------------------------------------------------------------------------------
# Bound launchers (launch.bind)
# ---------------------------------------------------------------------------------------


def _grid4(dtype=torch.float32, offset=0):
    """A (2, 16, 2, 8) tensor whose base is ``offset`` elements past an allocation's."""
    flat = torch.zeros(2 * 16 * 2 * 8 + offset, dtype=dtype)
    return flat[offset:].view(2, 16, 2, 8)


def _template(block=(1, 4, 1, 8), layout=None):
    from triton.tools.tensor_descriptor import TensorDescriptor

    from flashtile.kernels.tma import DescriptorTemplate

    t = _grid4()
    if layout is None:
        return DescriptorTemplate(TensorDescriptor(t, list(t.shape), list(t.stride()), list(block)))
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

    return DescriptorTemplate(GluonDescriptor(t, list(t.shape), list(t.stride()), list(block), layout))


def test_bound_launches_are_direct_with_the_calls_tensors_and_descriptors(toy):
    kernel, calls = toy
    template = _template()
    bound = launch_mod.bind(kernel, (2,), dict(BLOCK=16), (template.over(_grid4()), torch.zeros(8), 40, 0.5),
                            tail_from=2)
    passed = []
    for _ in range(3):
        head = (template.over(_grid4()), torch.zeros(8))
        passed.append(head)
        bound(head)
    assert _kinds(calls) == ["ordinary", "direct", "direct"]
    assert calls[0][1:] == ((2,), passed[0] + (40, 0.5), dict(BLOCK=16))
    for (_, args), head in zip(calls[1:], passed[1:]):
        assert args[:9] == (2, 1, 1, 1234, "function-handle", "packed-metadata", None, None, None)
        assert args[9] is head[0] and args[10] is head[1] and args[11:] == (40, 0.5, 16, False)


@pytest.mark.parametrize("dynamic", [(2,), (2, 3)])
def test_bound_dynamic_ints_of_every_class_launch(toy, dynamic):
    """A bound launcher's dynamic ints through every class (1 is a constexpr of its own): each
    new class launches the ordinary way once, then directly."""
    kernel, calls = toy
    x = torch.zeros(8)
    bound = launch_mod.bind(kernel, (1,), dict(BLOCK=16), (x, x, 40, 0.5), dynamic=dynamic)
    for n in (1, 1, 17, 18, 32, 1):
        bound((x, x, n, 0.5))
    assert _kinds(calls) == ["ordinary", "direct", "ordinary", "direct", "ordinary", "direct"]


def _gluon_layouts():
    gl = pytest.importorskip("triton.experimental.gluon.language")
    return [gl.NVMMASharedLayout(swizzle, 32, rank=4, transposed=t) for swizzle, t in ((32, False), (64, False),
                                                                                       (32, 0))]


@pytest.mark.parametrize("change", ["block_shape", "block_shape_with_a_bool", "dtype", "misaligned_base", "padding",
                                    "class", "layout", "layout_printing_apart", "tensor_for_descriptor"])
def test_a_descriptor_of_another_class_does_not_reuse_the_bound_variant(toy, change):
    """The sample's class for two calls, then a changed descriptor twice: Triton compiles it
    (its first call is ordinary) unless it is launched the ordinary way for good."""
    kernel, calls = toy
    gluon = change in ("class", "layout", "layout_printing_apart")
    layouts = _gluon_layouts() if gluon else [None]
    template = _template(layout=layouts[0] if change != "class" else None)
    bound = launch_mod.bind(kernel, (1,), dict(BLOCK=16), (template.over(_grid4()), torch.zeros(8), 40, 0.5),
                            tail_from=2)
    for _ in range(2):
        bound((template.over(_grid4()), torch.zeros(8)))

    def changed():
        if change == "block_shape":
            return _template(block=(1, 8, 1, 8)).over(_grid4())
        if change == "block_shape_with_a_bool":
            desc = template.over(_grid4())
            desc.block_shape = [True, 4, 1, 8]
            return desc
        if change == "dtype":
            return template.over(_grid4(torch.float16))
        if change == "misaligned_base":
            return template.over(_grid4(offset=1))
        if change == "padding":
            desc = template.over(_grid4())
            desc.padding = "nan"
            return desc
        if change == "class":
            return _template(layout=layouts[0]).over(_grid4())
        if change == "layout":
            return _template(layout=layouts[1]).over(_grid4())
        if change == "layout_printing_apart":  # equal to the sample's layout, another text for Triton
            return _template(layout=layouts[2]).over(_grid4())
        return _grid4()

    for _ in range(2):
        bound((changed(), torch.zeros(8)))
    ordinary_for_good = change == "block_shape_with_a_bool"
    assert _kinds(calls) == ["ordinary", "direct", "ordinary", "ordinary" if ordinary_for_good else "direct"]


@pytest.mark.parametrize("change", [None, "dtype", "misaligned_base"])
def test_a_template_position_takes_a_tensor_and_launches_the_templates_descriptor(toy, change):
    kernel, calls = toy
    template = _template()
    bound = launch_mod.bind(kernel, (1,), dict(BLOCK=16), (template, torch.zeros(8), 40, 0.5), tail_from=2)
    tensors = [_grid4() for _ in range(2)]
    for t in tensors:
        bound((t, torch.zeros(8)))
    if change is not None:
        for _ in range(2):
            bound((_grid4(torch.float16) if change == "dtype" else _grid4(offset=1), torch.zeros(8)))
    assert _kinds(calls) == ["ordinary", "direct"] + (["ordinary", "direct"] if change else [])
    launched = (calls[0][2][0], calls[1][1][9])
    for desc, t in zip(launched, tensors):
        assert desc.__class__ is template.cls and desc.base is t
        assert {name: value for name, value in vars(desc).items() if name != "base"} == template.fields
    with pytest.raises(ValueError, match="no template"):
        launch_mod.bind(kernel, (1,), dict(BLOCK=16), (torch.zeros(8), template, 40, 0.5), tail_from=1)
    with pytest.raises(ValueError, match="cannot be dynamic"):
        launch_mod.bind(kernel, (1,), dict(BLOCK=16), (template, torch.zeros(8), 40, 0.5), dynamic=(0,))


def test_bound_statics_are_the_samples_objects(toy):
    """A call passing another object where the sample had a non-tensor goes through launch()
    and its full key: a new class (48, a multiple of 16) compiles."""
    kernel, calls = toy
    x, y = torch.zeros(8), torch.zeros(8)
    args = (x, y, 40, 0.5)
    bound = launch_mod.bind(kernel, (1,), dict(BLOCK=16), args)
    bound(args)
    bound(args)
    bound((x, y, 48, 0.5))
    bound((x, y, 48, 0.5))
    assert _kinds(calls) == ["ordinary", "direct", "ordinary", "direct"]


def test_bound_tail_tensors_are_classified_at_every_call(toy):
    kernel, calls = toy
    x, placeholder = torch.zeros(8), torch.zeros(8)
    bound = launch_mod.bind(kernel, (1,), dict(BLOCK=16), (x, placeholder, 40, 0.5), tail_from=1)
    bound((torch.zeros(8),))
    bound((torch.zeros(8),))
    assert calls[1][1][10] is placeholder
    placeholder.set_(torch.zeros(16).untyped_storage(), 1, (8,))  # now 4 bytes past a 16-byte boundary
    bound((torch.zeros(8),))
    bound((torch.zeros(8),))
    assert _kinds(calls) == ["ordinary", "direct", "ordinary", "direct"]
    with pytest.raises(ValueError, match="no descriptor"):
        launch_mod.bind(kernel, (1,), dict(BLOCK=16), (x, _template().over(_grid4()), 40, 0.5), tail_from=1)


def test_bound_launchers_keep_every_fallback(toy, monkeypatch):
    """Hooks, a pre-run hook, tracing and the interpreter launch the ordinary way; clear()
    makes the next launch ordinary again; a failing direct launch falls back for good, or
    raises under RAISE_DIRECT_ERRORS."""
    kernel, calls = toy
    template = _template()
    bound = launch_mod.bind(kernel, (1,), dict(BLOCK=16), (template.over(_grid4()), torch.zeros(8), 40, 0.5),
                            tail_from=2)

    def call():
        bound((template.over(_grid4()), torch.zeros(8)))

    call()
    call()

    def hook(metadata):
        pass

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        call()
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    kernel.add_pre_run_hook(lambda *a, **k: None)
    call()
    kernel.pre_run_hooks.clear()
    with monkeypatch.context() as m:
        m.setattr(torch.compiler, "is_compiling", lambda: True)
        call()
    with monkeypatch.context() as m:
        m.setattr(launch_mod, "INTERPRET", True)
        call()
    call()
    launch_mod.clear()
    call()
    call()
    assert _kinds(calls) == ["ordinary", "direct"] + ["ordinary"] * 4 + ["direct", "ordinary", "direct"]

    compiled = launch_mod.compiled_variants(kernel)[0]
    with monkeypatch.context() as m:
        m.setattr(launch_mod, "RAISE_DIRECT_ERRORS", True)
        m.setattr(type(compiled), "run", lambda self, *a: (_ for _ in ()).throw(RuntimeError("launcher failed")))
        with pytest.raises(RuntimeError, match="launcher failed"):
            call()
        del calls[:]
        m.setattr(launch_mod, "RAISE_DIRECT_ERRORS", False)
        call()  # the direct launch fails: relaunched the ordinary way
        call()  # marked failed: ordinary from now on
    assert _kinds(calls) == ["ordinary", "ordinary"]


# ---------------------------------------------------------------------------------------
# The C launcher called directly (launch._Direct): Triton 3.6.0's CudaLauncher, less its loop
# ---------------------------------------------------------------------------------------


def _desc_toy(D, X, E, n, scale, BLOCK: tl.constexpr, FLAG: tl.constexpr = False):
    pass  # never compiled: the ordinary launch is a recorder


_DESC_SIGNATURE = {0: "tensordesc<fp32[1, 4, 1, 8]>", 1: "*fp32", 2: "tensordesc<fp32[1, 8, 1, 8]>", 3: "i32",
                   4: "fp32", 5: "constexpr", 6: "constexpr"}


def _meta(block, fp4_padded=False):
    """A descriptor's metadata as a Hopper compile records it (fp32, 32-byte swizzle)."""
    return dict(swizzle=1, elem_size=4, elem_type=7, block_size=list(block), fp4_padded=fp4_padded)


# Per case, the compiled kernel's ``tensordesc_meta``: for D and E, or None (no TMA lowering).
_METAS = {"maps": [_meta((1, 4, 1, 8)), _meta((1, 8, 1, 8))], "none": None,
          "mixed": [None, _meta((1, 8, 1, 8), fp4_padded=True)], "fp4": [_meta((1, 4, 1, 8), fp4_padded=True), None]}


class _CLauncher:
    """A stand-in for the compiled C launcher (no ``__code__``, as a C function): records calls."""

    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


class _LauncherCompiled:
    """A compiled kernel whose ``run`` is Triton's own ``CudaLauncher`` over a recording C launcher."""

    function = "function-handle"
    packed_metadata = (4, 1, 0)

    def __init__(self, signature, meta, scratch=0):
        from triton.backends.nvidia.driver import CudaLauncher, wrap_handle_tensordesc

        self.raw = _CLauncher()
        runner = object.__new__(CudaLauncher)
        runner.num_ctas = 1
        runner.launch = wrap_handle_tensordesc(self.raw, signature, meta)
        runner.global_scratch_size, runner.global_scratch_align = scratch, 8
        runner.profile_scratch_size, runner.profile_scratch_align = 0, 1
        runner.launch_cooperative_grid, runner.launch_pdl = False, False
        self.run = runner
        self.src = SimpleNamespace(signature=signature)


@pytest.fixture
def raw_toy(monkeypatch):
    """(kernel, make, encodes, via_python): ``make(meta, signature=..., scratch=...)`` sets the
    compiled kernel the ordinary launch returns; ``fill_tma_descriptor`` is stubbed to return
    ``("map", *its inputs)`` and record them in ``encodes``; ``via_python`` counts calls of
    ``CudaLauncher.__call__`` (the launcher's Python layer)."""
    import triton
    from triton.backends.nvidia import driver as nvidia

    kernel = JITFunction(_desc_toy)
    made = {}

    def make(meta, signature=_DESC_SIGNATURE, scratch=0):
        made["compiled"] = _LauncherCompiled(signature, meta, scratch)
        return made["compiled"]

    def ordinary(*args, grid, warmup, **options):
        return made["compiled"]

    encodes = []

    def fill(*args):
        encodes.append(args)
        return ("map", *args)

    via_python = []
    real_call = nvidia.CudaLauncher.__call__

    def counted(self, *args):
        via_python.append(args)
        return real_call(self, *args)

    kernel.run = ordinary
    monkeypatch.setattr(nvidia.CudaLauncher, "__call__", counted)
    driver = SimpleNamespace(utils=SimpleNamespace(fill_tma_descriptor=fill))
    monkeypatch.setattr(triton.runtime.driver, "_active", driver)
    monkeypatch.setattr(launch_mod, "INTERPRET", False)
    monkeypatch.setattr(launch_mod, "_device_functions", (lambda: 0, lambda device: 1234))
    monkeypatch.setattr(launch_mod, "RAISE_DIRECT_ERRORS", True)
    launch_mod.clear()
    yield kernel, make, encodes, via_python
    launch_mod.clear()


def _descriptor(t, block):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(t, list(t.shape), list(t.stride()), list(block))


def _through_triton(compiled, grid3, params):
    """What Triton's launcher passes its C launcher for these parameters (``wrap_handle_tensordesc``'s
    ``inner`` at work): the call recorded, then removed from the record."""
    compiled.run(*grid3, 1234, compiled.function, compiled.packed_metadata, None, None, None, *params)
    return compiled.raw.calls.pop()


@pytest.mark.parametrize("meta", list(_METAS))
def test_a_direct_launch_passes_the_c_launcher_what_tritons_loop_passes(raw_toy, meta):
    kernel, make, encodes, via_python = raw_toy
    compiled = make(_METAS[meta])
    x = torch.zeros(8)
    args = (_descriptor(_grid4(), (1, 4, 1, 8)), x, _descriptor(_grid4(), (1, 8, 1, 8)), 40, 0.5)
    launch_mod.launch(kernel, (3,), args, dict(BLOCK=16))  # ordinary (the recorder)
    for _ in range(2):
        launch_mod.launch(kernel, (3,), args, dict(BLOCK=16))
    assert not via_python and len(compiled.raw.calls) == 2
    direct = compiled.raw.calls[:]
    want = _through_triton(compiled, (3, 1, 1), args + (16, False))
    assert direct == [want, want]
    if meta == "maps":  # the maps as make_tensordesc_arg encodes them, at every launch
        assert want[13][:2] == ("map", args[0].base.data_ptr()) and len(encodes) == 6
    assert want[:13] == (3, 1, 1, 1234, "function-handle", False, False, None, None, (4, 1, 0), None, None, None)


@pytest.mark.parametrize("meta", list(_METAS))
def test_a_bound_launch_flattens_template_and_descriptor_positions_as_triton(raw_toy, meta):
    """Template position D (a tensor passed, the template's descriptor built over it), a plain
    descriptor at E: the C launcher gets what Triton's loop would give it for the descriptors
    the ordinary launch takes; one encode per address at the template position."""
    kernel, make, encodes, via_python = raw_toy
    compiled = make(_METAS[meta])
    template, e_template = _template(), _template((1, 8, 1, 8))
    x = torch.zeros(8)
    bound = launch_mod.bind(kernel, (2, 3), dict(BLOCK=16), (template, x, e_template.over(_grid4()), 40, 0.5),
                            tail_from=3)
    tensors = [_grid4() for _ in range(3)]
    heads = [(t, x, e_template.over(_grid4())) for t in tensors]
    bound(heads[0])  # ordinary
    for head in heads + heads:  # each address twice
        bound(head)
    assert not via_python and [entry[2] is not None for entry in bound.variants.values()] == [True]
    direct = compiled.raw.calls[:]
    for head, got in zip(heads + heads, direct):
        assert got == _through_triton(compiled, (2, 3, 1), bound.arguments(head) + (16, False))
    if meta == "maps":
        # D: one encode per address (3), E: one per launch (6), Triton's loop: 2 per launch (12).
        assert len(encodes) == 3 + 6 + 12


@pytest.mark.parametrize("meta", [_meta((1, 4, 1, 8)), None])
def test_a_bound_launch_passes_gpu_tensors_as_their_addresses(raw_toy, monkeypatch, meta):
    """Where every tensor of the call is a CUDA tensor (stood in for here), each plain tensor
    of the head reaches the C launcher as its address -- what Triton's launcher resolves it to
    -- a template position as its descriptor, a tail tensor as itself; one host tensor among
    them and the call passes the tensors as Triton's loop does."""
    kernel, make, _, via_python = raw_toy
    compiled = make([meta], signature={**_DESC_SIGNATURE, 2: "*fp32"})  # E a plain pointer: the tail's placeholder
    template, placeholder = _template(), torch.zeros(8)
    bound = launch_mod.bind(kernel, (2,), dict(BLOCK=16), (template, torch.zeros(8), placeholder, 40, 0.5),
                            tail_from=2)
    host = []
    monkeypatch.setattr(launch_mod, "_on_gpu", lambda t: not any(t is h for h in host))
    heads = [(_grid4(), torch.zeros(8)) for _ in range(3)]
    for head in heads:
        bound(head)
    host.append(heads[-1][1])
    bound(heads[-1])
    assert not via_python
    calls = compiled.raw.calls  # the first call was the ordinary launch
    assert len(calls) == 3
    for head, got in zip(heads[1:], calls):
        want = _through_triton(compiled, (2, 1, 1), bound.arguments(head) + (16, False))
        as_address = [a.data_ptr() if a is head[1] else a for a in want]
        assert len(got) == len(want) and all(g is w or g == w for g, w in zip(got, as_address))
        # Without TMA lowering a descriptor is passed as its base tensor (and its sizes).
        assert [id(a) for a in got if isinstance(a, torch.Tensor)] == [id(head[0])] * (meta is None) + [id(placeholder)]
    assert calls[2] == _through_triton(compiled, (2, 1, 1), bound.arguments(heads[-1]) + (16, False))


def test_kept_maps_are_each_addresses_and_each_templates_own(raw_toy):
    """Self-attention passes one tensor at positions whose templates differ (another box), and
    bound launchers with other templates (another shape and strides) see the same addresses:
    each gets the map Triton would encode for it, however many addresses go by (the memo of
    maps is bounded), and an address seen again reuses its map."""
    kernel, make, encodes, _ = raw_toy
    compiled = make(_METAS["maps"])
    from triton.tools.tensor_descriptor import TensorDescriptor

    from flashtile.kernels.tma import DescriptorTemplate

    first, second = _template((1, 4, 1, 8)), _template((1, 8, 1, 8))
    wide_sample = torch.zeros(4, 16, 2, 8)
    other = DescriptorTemplate(TensorDescriptor(wide_sample, list(wide_sample.shape), list(wide_sample.stride()),
                                                [1, 4, 1, 8]))
    x = torch.zeros(8)
    bound = launch_mod.bind(kernel, (1,), dict(BLOCK=16), (first, x, second, 40, 0.5), tail_from=3)
    other_bound = launch_mod.bind(kernel, (1,), dict(BLOCK=16), (other, x, second, 40, 0.5), tail_from=3)
    pool = [torch.zeros(4 * 16 * 2 * 8) for _ in range(launch_mod._MAX_MAPS + 8)]

    def narrow(flat):
        return flat[:2 * 16 * 2 * 8].view(2, 16, 2, 8)

    def heads(flat):
        return ((bound, (narrow(flat), x, narrow(flat))), (other_bound, (flat.view(4, 16, 2, 8), x, narrow(flat))))

    for launcher, head in heads(pool[0]):
        launcher(head)  # ordinary
    compiled.raw.calls.clear()
    launched = []
    for _ in range(2):
        for flat in pool:
            for launcher, head in heads(flat):
                launcher(head)
                launched.append((launcher, head))
    encoded = len(encodes)
    bound(heads(pool[-1])[0][1])  # kept: no encode for the two template positions
    assert len(encodes) == encoded
    calls = compiled.raw.calls[:-1]
    assert len(calls) == len(launched)
    for (launcher, head), call in zip(launched, calls):
        assert call == _through_triton(compiled, (1, 1, 1), launcher.arguments(head) + (16, False))


@pytest.mark.parametrize("change", ["version", "scratch", "other_wrapper", "template_not_a_descriptor",
                                    "descriptor_signature_unwrapped", "not_a_cuda_launcher"])
def test_an_unexpected_launcher_keeps_tritons_python_layer(raw_toy, monkeypatch, change):
    """Another Triton, scratch memory to allocate, a launch that is not the wrapper's ``inner``,
    a template where the launcher flattens no descriptor: the direct launch calls
    ``compiled.run`` itself, which passes the C launcher what it always does."""
    from triton.backends.nvidia import driver as nvidia

    kernel, make, _, via_python = raw_toy
    signature = _DESC_SIGNATURE
    if change == "template_not_a_descriptor":
        signature = {**_DESC_SIGNATURE, 0: "*fp32"}
    compiled = make(_METAS["maps"] if change != "template_not_a_descriptor" else _METAS["maps"][1:], signature,
                    scratch=16 if change == "scratch" else 0)
    if change == "version":
        monkeypatch.setattr(launch_mod, "_TRITON_LAUNCHER", "3.5.0")
    elif change == "other_wrapper":
        wrapped = compiled.run.launch
        compiled.run.launch = lambda *args: wrapped(*args)
    elif change == "descriptor_signature_unwrapped":
        compiled.run.launch = compiled.raw
    elif change == "not_a_cuda_launcher":
        runner = compiled.run

        class Subclass(nvidia.CudaLauncher):
            pass

        compiled.run = object.__new__(Subclass)
        compiled.run.__dict__.update(runner.__dict__)
    if change == "scratch":  # the scratch Triton allocates is recorded
        from triton.runtime import _allocation

        token = _allocation._allocator.set(lambda size, align, stream: ("scratch", size))
    template = _template()
    x = torch.zeros(8)
    e = _template((1, 8, 1, 8)).over(_grid4())
    bound = launch_mod.bind(kernel, (1,), dict(BLOCK=16), (template, x, e, 40, 0.5), tail_from=3)
    try:
        for _ in range(3):
            bound((_grid4(), x, e))
    finally:
        if change == "scratch":
            _allocation._allocator.reset(token)
    assert len(via_python) == 2
    assert [entry[2] for entry in bound.variants.values()] == [None]
    if change == "descriptor_signature_unwrapped":
        return  # the C launcher then gets descriptors: on a GPU it would raise, and the launch falls back
    if change == "scratch":
        assert compiled.raw.calls[0][7] == ("scratch", 16)
    assert len(compiled.raw.calls) == 2


# ---------------------------------------------------------------------------------------
# GPU: direct launches of the decode kernels are bitwise the ordinary launches
# ---------------------------------------------------------------------------------------


@pytest.fixture
def strict_direct(monkeypatch):
    """Direct launches that raise instead of falling back, counted."""
    monkeypatch.setattr(launch_mod, "RAISE_DIRECT_ERRORS", True)
    launch_mod.clear()
    counts = {"ordinary": 0}
    real = launch_mod._ordinary

    def counted(*args):
        counts["ordinary"] += 1
        return real(*args)

    monkeypatch.setattr(launch_mod, "_ordinary", counted)
    yield counts
    launch_mod.clear()


def _decode_inputs(page_size, batch=3, cache=3000, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, 1, 32, 128, generator=g).to("cuda", torch.bfloat16)
    if page_size is None:
        kc, vc = (torch.randn(batch, cache, 4, 128, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
        table = None
    else:
        pages = -(-cache // page_size)
        kc, vc = (torch.randn(batch * pages, page_size, 4, 128, generator=g).to("cuda", torch.bfloat16)
                  for _ in range(2))
        table = torch.randperm(batch * pages, generator=g).reshape(batch, pages).to("cuda", torch.int32)
    knew, vnew = (torch.randn(batch, 1, 4, 128, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
    seqlens = torch.tensor([0, 1500, cache - 1][:batch], dtype=torch.int32, device="cuda")
    return q, kc, vc, knew, vnew, seqlens, table


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [None, 16, 256])
@pytest.mark.parametrize("num_splits", [1, 0])
@pytest.mark.parametrize("lengths", ["tensor", "int"])
def test_gpu_direct_decode_is_bitwise_the_ordinary_launch(page_size, num_splits, lengths, strict_direct,
                                                          monkeypatch):
    import flashtile

    q, kc, vc, knew, vnew, seqlens, table = _decode_inputs(page_size)
    seqlens = seqlens if lengths == "tensor" else 1200
    kc0, vc0 = kc.clone(), vc.clone()

    def step(k_cache, v_cache):
        return flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, knew, vnew, cache_seqlens=seqlens,
                                                 block_table=table, causal=True, num_splits=num_splits,
                                                 return_lse=True)

    results = []
    for call in range(3):  # the first compiles (ordinary launches), the next two launch directly
        k_cache, v_cache = kc0.clone(), vc0.clone()
        out, lse = step(k_cache, v_cache)
        results.append((out, lse, k_cache, v_cache))
        if call == 0:
            after_first = strict_direct["ordinary"]
            assert after_first >= 1  # the split kernel, the append fused in (and the combine, if any)
    torch.cuda.synchronize()
    assert strict_direct["ordinary"] == after_first
    monkeypatch.setattr(launch_mod, "INTERPRET", True)  # every launch the ordinary way
    k_cache, v_cache = kc0.clone(), vc0.clone()
    want = step(k_cache, v_cache) + (k_cache, v_cache)
    torch.cuda.synchronize()
    for got in results:
        for a, b in zip(got, want):
            assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [None, 16])
def test_gpu_direct_launches_replay_in_a_cuda_graph(page_size, strict_direct, monkeypatch):
    import flashtile

    q, kc, vc, knew, vnew, seqlens, table = _decode_inputs(page_size, seed=1)
    kc0, vc0 = kc.clone(), vc.clone()

    def step():
        return flashtile.flash_attn_with_kvcache(q, kc, vc, knew, vnew, cache_seqlens=seqlens, block_table=table,
                                                 causal=True, return_lse=True)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compiles the eager step's kernels
    torch.cuda.current_stream().wait_stream(stream)
    # A captured step of few splits merges them in the combine kernel where an eager one merges
    # in the split kernel (decode.MERGE_LAST_MAX_SPLITS): a first capture binds the captured
    # way's launches (ordinary at their first call), the capture below launches directly.
    with torch.cuda.graph(torch.cuda.CUDAGraph()):
        step()
    before = strict_direct["ordinary"]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = step()
    assert strict_direct["ordinary"] == before  # captured through the direct path
    for lengths in ([5, 700, 2], [6, 1500, 2998]):
        kc.copy_(kc0), vc.copy_(vc0)
        seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        monkeypatch.setattr(launch_mod, "INTERPRET", True)
        k_ref, v_ref = kc0.clone(), vc0.clone()
        want = flashtile.flash_attn_with_kvcache(q, k_ref, v_ref, knew, vnew, cache_seqlens=seqlens,
                                                 block_table=table, causal=True, return_lse=True)
        monkeypatch.setattr(launch_mod, "INTERPRET", False)
        assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
        assert torch.equal(kc, k_ref) and torch.equal(vc, v_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("engine, d", [("auto", 64), ("auto", 128), ("triton", 128)])
def test_gpu_direct_forward_calls_the_c_launcher_bitwise_as_the_ordinary_launch(engine, d, strict_direct,
                                                                                monkeypatch):
    """The dense forward's bound launches reach Triton's C launcher directly on this Triton (the
    pinned structure is recognised: no variant keeps ``compiled.run``), and give bitwise the
    ordinary launch's results: new inputs at addresses the allocator hands out again (kept
    tensor maps), one tensor at every descriptor position (a map per position's box)."""
    import flashtile

    monkeypatch.setenv("FLASHTILE_ENGINE", engine)
    made = []
    real_direct = launch_mod._direct

    def recorded(*args):
        made.append(real_direct(*args))
        return made[-1]

    monkeypatch.setattr(launch_mod, "_direct", recorded)
    g = torch.Generator().manual_seed(2)

    def new():
        return torch.randn(2, 256, 8, d, generator=g).to("cuda", torch.bfloat16)

    def ordinary(q, k, v):
        monkeypatch.setattr(launch_mod, "INTERPRET", True)  # every launch the ordinary way
        try:
            return flashtile.flash_attn_func(q, k, v, causal=True)
        finally:
            monkeypatch.setattr(launch_mod, "INTERPRET", False)

    k, v = new(), new()
    for step in range(4):
        q = new()  # the previous q is freed: the allocator may hand its address out again
        counted = strict_direct["ordinary"]
        got = flashtile.flash_attn_func(q, k, v, causal=True)
        torch.cuda.synchronize()
        # Ordinary launches: the first call (a shape seen once takes the general path, its launch
        # keyed with the growing-length hint) and the second (which builds the plan: its bound
        # launcher keys the class without the hint); direct from then on.
        assert strict_direct["ordinary"] == counted + (step <= 1)
        assert torch.equal(got, ordinary(q, k, v))
    counted = strict_direct["ordinary"]
    got = flashtile.flash_attn_func(q, q, q, causal=True)
    torch.cuda.synchronize()
    assert strict_direct["ordinary"] == counted
    assert torch.equal(got, ordinary(q, q, q))
    assert made and all(direct is not None for direct in made)


def test_dynamic_hints_name_the_growing_lengths():
    """The decode launchers' ``dynamic`` positions point at the shared int length, and for a
    plan serving every key length at the arguments a call passes after it (a stale position
    would only cost speed, not correctness: the hint does not change the key)."""
    import inspect

    from flashtile.kernels import decode

    sized = ["seqlen_k_all", "capacity", "chunk", "stride_kb", "stride_kn", "stride_kh", "stride_vb", "stride_vn",
             "stride_vh"]
    for kernel, positions, names in ((decode._decode_split, decode._SPLIT_DYNAMIC, ["seqlen_k_all"]),
                                     (decode._decode_split, decode._SPLIT_SIZED, sized),
                                     (decode._append_kv, decode._APPEND_DYNAMIC, ["seqlen_all"])):
        params = list(inspect.signature(kernel.fn).parameters)
        assert [params[i] for i in positions] == names
    from flashtile.kernels.attention import forward

    params = list(inspect.signature(forward._attn_fwd.fn).parameters)
    assert [params[i] for i in forward._FWD_DYNAMIC] == ["seqlen_k", "seed", "rng_offset", "rng_cols"]
    from flashtile.kernels.hopper import attention_fwd

    params = list(inspect.signature(attention_fwd.attention_fwd_kernel.fn).parameters)
    assert [params[i] for i in attention_fwd._DYNAMIC] == ["seqlen_k"]
