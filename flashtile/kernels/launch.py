"""Launching a compiled Triton kernel directly, without Triton's per-call dispatch.

(One module over 600 lines on purpose: the key, the bound launchers and the call of Triton's
launcher are one argument -- a direct launch runs exactly what the ordinary launch runs -- and
each part's rules lean on the others', so they are read and changed together.)

``kernel[grid](*args, **constexprs)`` re-derives, on every call, what it already knew at the
previous one: it binds the arguments to the signature, specialises each of them (type,
``== 1``, divisible by 16), builds a cache key from those and the stringified options,
looks the compiled kernel up, builds launch metadata for the profiler hooks and only then
launches.  A decoding step keeps the GPU busy for ~10-20 us, so this host work decides the
eager latency.  :func:`launch` does the dispatch once per *specialisation class* and then
calls the cached ``CompiledKernel``'s launcher itself.

Why the direct launch runs exactly the kernel the ordinary one would (Triton 3.6):

* Triton picks the compiled variant from (per argument) its type and specialisation, plus
  the options (constexprs, ``num_warps``, ...).  The key here holds, per runtime argument,
  a class at least as fine as Triton's: a tensor's dtype and whether its address is a
  multiple of 16; an int's range (i32 / i64 / wider), whether it equals 1 (Triton makes it
  a constexpr) and whether it is a multiple of 16; a float / bool / None by type; a tuple
  element by element; a host TMA descriptor by its dtype, base alignment, block shape
  (plain int dims only), padding (and a Gluon one's shared layout, by its text).  The
  constexprs and launch options are in the key by value, as are the current device and the
  debug and instrumentation modes Triton adds to the options (``_compile_modes``).  Two
  calls with one key therefore get one compiled kernel from Triton, and the first call of
  every key goes through ``kernel[grid]`` itself, whose returned kernel is the one cached.
* The launcher (``CompiledKernel.run``) takes every parameter in signature order and
  ignores the constexpr ones (``None`` and ints equal to 1 included), so the runtime
  arguments are passed followed by the constexpr values, as ``JITFunction.run`` does.
* ``JITFunction.run`` passes launch metadata and the launch hooks; with no hook registered
  (``knobs.runtime.launch_enter_hook`` / ``launch_exit_hook`` empty, as they are unless a
  profiler such as proton is active) calling them does nothing, and ``None`` is passed.
  With a hook registered, or a pre-run hook on the kernel, every launch is ordinary.
* Anything the key does not classify -- a numpy scalar, a list, a callable grid, a runtime
  argument passed by keyword -- makes that call an ordinary launch, so it is dispatched by
  Triton as before.  So does Triton's interpreter (``TRITON_INTERPRET=1``: no compiled
  kernels) and ``torch.compile`` tracing (Dynamo understands ``kernel[grid](...)``, not a
  raw launcher call).

:func:`bind` goes one step further for a caller that launches one kernel again and again with
the same grid, options and non-tensor arguments (a launch plan): it keeps the compiled variant
per the only classes that can still change -- each tensor's (and each host descriptor's base
tensor's) type, dtype and 16-byte alignment, the ``dynamic`` ints' classes, the current
device and Triton's debug modes -- so a call costs a few C-level gathers and one dict look-up before the launcher.  Its
first call of each class goes through :func:`launch` (ordinary launch, or a variant
:func:`launch` already holds), and every rule above (interpreter, tracing, hooks, failures)
applies to it unchanged.

The launcher itself is called without its Python layer where that layer's structure is the one
of Triton 3.6.0 (:class:`_Direct`): ``CompiledKernel.run`` is a ``CudaLauncher`` whose
``launch`` loops over every argument to replace each host TMA descriptor by its flattened
form (an encoded tensor map, shape and strides) before the C launcher.  The positions of the
descriptors and their metadata are fixed per compiled kernel, so the flattened argument list is
built directly from them, and a descriptor a bound launcher builds from a template has a fixed
shape and strides, so its map is kept per base address.  Any other structure (another Triton,
scratch memory to allocate, an unexpected closure) launches through ``compiled.run`` as before.

If a direct launch raises, that key is marked failed and the call (and every later one with
that key) goes through the ordinary launch, which raises again if the error was the caller's
(a CPU tensor, say).  Tests set :data:`RAISE_DIRECT_ERRORS` so that a bug in this layer
cannot hide behind the fallback.
"""

from __future__ import annotations

import functools
from functools import reduce
from itertools import chain
from operator import attrgetter, is_, itemgetter, or_

import torch
import triton
from triton import knobs
from triton.runtime.jit import JITFunction

from flashtile.kernels.runtime import INTERPRET
from flashtile.kernels.tma import DescriptorTemplate

# Tests set this so that a failing direct launch raises instead of falling back.
RAISE_DIRECT_ERRORS = False

_I32 = (-(1 << 31), (1 << 31) - 1)
_I64 = (-(1 << 63), (1 << 63) - 1)
_UNCLASSIFIED = object()  # a runtime argument of a type the key does not describe
_FAILED = object()  # a key whose direct launch raised once: ordinary launches from then on


def _descriptor_types() -> tuple:
    """Triton's host TMA descriptor classes (the Gluon one where this Triton has it)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    found = [TensorDescriptor]
    try:
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

        found.append(GluonDescriptor)
    except ImportError:  # a Triton without Gluon
        pass
    return tuple(found)


_DESCRIPTORS = _descriptor_types()


def _arg_class(arg):
    """What of a runtime argument decides Triton's compiled variant (see the module doc)."""
    cls = arg.__class__
    if cls is int:
        if arg == 1:
            return 1  # a constexpr in the compiled kernel
        size = 0 if _I32[0] <= arg <= _I32[1] else 1 if _I64[0] <= arg <= _I64[1] else 2
        return (size, arg & 15 == 0)
    if cls is float or cls is bool or arg is None:
        return cls
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() & 15 == 0)
    if cls is tuple:
        # Triton specialises a tuple element by element (and passes it as it is).
        classes = tuple(map(_arg_class, arg))
        return _UNCLASSIFIED if _UNCLASSIFIED in classes else (tuple, classes)
    if cls in _DESCRIPTORS:
        # Triton specialises a host descriptor by its dtype and the text of its block shape (and
        # a Gluon one by the text of its shared layout); the base address, shape and strides
        # are runtime values the launcher turns into a TMA descriptor at every launch.  The
        # padding and whether the base is 16-byte aligned (TMA needs it) are keyed all the
        # same (finer is safe).  Equal values can print apart (True and 1; a layout's
        # transposed=0 and False), so the block shape is keyed only when its dims are plain
        # ints, and the layout by its text.
        block = tuple(arg.block_shape)
        if not all(dim.__class__ is int for dim in block):
            return _UNCLASSIFIED
        layout = getattr(arg, "layout", None)
        base = arg.base
        return (cls, base.dtype, base.data_ptr() & 15 == 0, block, None if layout is None else _layout_text(layout),
                arg.padding)
    return _UNCLASSIFIED


_layout_texts: dict[int, tuple] = {}  # id(layout) -> (the layout, its text)
_MAX_LAYOUT_TEXTS = 256


def _layout_text(layout) -> str:
    """``str(layout)``, what Triton's specialisation prints, memoised per layout object (a Gluon
    layout is a frozen dataclass: its text is fixed when it is built).  The memo keeps the
    layouts it holds alive, so an id stays its object's."""
    entry = _layout_texts.get(id(layout))
    if entry is None or entry[0] is not layout:
        if len(_layout_texts) >= _MAX_LAYOUT_TEXTS:
            _layout_texts.clear()
        entry = _layout_texts[id(layout)] = (layout, str(layout))
    return entry[1]


_constant_tuples: dict[int, tuple] = {}  # id(tuple) -> (the tuple, its class)


def constant(arg: tuple) -> tuple:
    """Register a tuple argument the caller keeps and passes again and again (a cached tuple of
    placeholders, say): its class is computed once.  The tuple is kept alive from then on, so
    its id stays its own; pass only long-lived constants."""
    _constant_tuples[id(arg)] = (arg, _arg_class(arg))
    return arg


def _tuple_class(arg: tuple):
    entry = _constant_tuples.get(id(arg))
    if entry is not None and entry[0] is arg:
        return entry[1]
    return _arg_class(arg)


class _Layout:
    """What one tuple of argument *types* lets the key skip: which arguments are tensors, which
    ints (the caller's static ones keyed through a memo of their exact values, the dynamic
    ones classified each call), and whether any argument is of a type the key does not
    describe.  Found by ``tuple(map(type, args))``, so the per-call work is a few C-level
    gathers instead of a Python function per argument."""

    __slots__ = ("tensors", "ints", "dynamic", "classified", "int_ids")

    def __init__(self, types, dynamic):
        tensors, ints, dyn = [], [], []
        self.classified = True
        for i, cls in enumerate(types):
            if cls is int or cls is tuple or cls in _DESCRIPTORS:
                # Tuples and descriptors are classified on every call, as dynamic ints are.
                (dyn if i in dynamic or cls is not int else ints).append(i)
            elif issubclass(cls, torch.Tensor):
                tensors.append(i)
            elif not (cls is float or cls is bool or cls is type(None)):
                self.classified = False  # a numpy scalar, a list, ...: ordinary launches
        self.tensors = _getter(tensors)
        self.ints = _getter(ints)
        self.dynamic = tuple(dyn)
        # Exact values of the static ints -> their classes (tuple), memoised: in a decoding
        # loop the shapes and strides repeat, so one dict look-up replaces their classification.
        self.int_ids = {}


def _getter(positions):
    """A callable returning ``tuple(args[i] for i in positions)`` at C speed."""
    if len(positions) >= 2:
        return itemgetter(*positions)
    if len(positions) == 1:
        i = positions[0]
        return lambda args: (args[i],)
    return lambda args: ()


class _KernelCache:
    """One kernel's compiled variants by key, each with the constexpr values that follow the
    runtime arguments in its signature, and its argument layouts by type tuple."""

    __slots__ = ("kernel", "variants", "layouts")

    def __init__(self, kernel):
        self.kernel = kernel
        self.variants = {}
        self.layouts = {}

    def tail(self, n_args: int, options: dict):
        """The values of the parameters after the first ``n_args``, in signature order, or
        ``None`` when one of them is not a constexpr (it would need a class in the key) or is
        neither given nor defaulted (the ordinary launch then reports it)."""
        values = []
        for param in self.kernel.params[n_args:]:
            if not param.is_constexpr:
                return None
            if param.name in options:
                values.append(options[param.name])
            elif param.has_default:
                values.append(param.default)
            else:
                return None
        return tuple(values)


_caches: dict[int, _KernelCache] = {}
_device_functions = None  # (current device, current stream) getters of the active driver
# Bounds on the memos (cleared when full): a workload cycling through more shapes than this
# pays the classification again, nothing else.
_MAX_LAYOUTS = 64
_MAX_INT_IDS = 4096
_MAX_VARIANTS = 1024
_data_ptr = torch.Tensor.data_ptr
_on_gpu = attrgetter("is_cuda")  # a tensor whose address a direct launch may pass as an int
_dtype = attrgetter("dtype")


_ENTER_HOOKS = knobs.runtime.launch_enter_hook
_EXIT_HOOKS = knobs.runtime.launch_exit_hook


def _hooks_idle() -> bool:
    """No launch hook would run: Triton 3.6 keeps them in (empty) ``HookChain``s."""
    enter, exit_ = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    if enter is _ENTER_HOOKS and exit_ is _EXIT_HOOKS:  # Triton's own chains: their lists say it
        return not (enter.calls or exit_.calls)
    for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook):
        if hook is not None and (not isinstance(hook, knobs.HookChain) or hook.calls):
            return False
    return True


def _compile_modes(kernel) -> tuple:
    """What ``JITFunction.run`` adds to the options it compiles with from outside the call:
    ``debug`` (the kernel's own, or ``knobs.runtime.debug``) and
    ``knobs.compilation.instrumentation_mode``.  Either changes the compiled variant, so both
    are in the keys (setting ``knobs.runtime.debug = True`` must reach every launch)."""
    return getattr(kernel, "debug", None), knobs.runtime.debug, knobs.compilation.instrumentation_mode


def _ordinary(kernel, grid, args, options):
    return kernel[grid](*args, **options)


# ---------------------------------------------------------------------------------------
# Triton 3.6.0's launcher without its per-argument Python loop
# ---------------------------------------------------------------------------------------

# The Triton whose launcher structure _Direct reproduces (triton/backends/nvidia/driver.py):
# ``CudaLauncher.__call__(gridX, gridY, gridZ, stream, function, *args)`` allocates the global
# and profile scratch (``None`` when their sizes are 0) and calls ``self.launch(gridX, gridY,
# gridZ, stream, function, launch_cooperative_grid, launch_pdl, global_scratch,
# profile_scratch, *args)``, where ``args`` are the packed metadata, the launch metadata, the
# two hooks and then every kernel parameter in signature order.  ``self.launch`` is the C
# launcher itself when the signature has no descriptor, else ``wrap_handle_tensordesc``'s
# ``inner``, which passes the 13 leading arguments on and replaces the parameter at each of its
# ``tensordesc_indices`` by ``make_tensordesc_arg(arg, tensordesc_meta[k])`` (k counting the
# descriptors in order).  Another version, or another structure, keeps ``compiled.run``.
_TRITON_LAUNCHER = "3.6.0"
_MAX_MAPS = 64  # encoded tensor maps kept per template position and compiled kernel


_parts_of: dict = {}  # compiled kernel -> _launcher_parts (a compiled kernel never changes)


def _launcher_parts(compiled):
    """``(C launcher, launch_cooperative_grid, launch_pdl, {parameter position: descriptor
    metadata})`` of ``compiled`` when its launcher is Triton 3.6.0's ``CudaLauncher`` as
    described above with no scratch to allocate, else ``None``; read once per compiled kernel
    (every launch plan binding it asks again)."""
    parts = _parts_of.get(compiled, _parts_of)
    if parts is _parts_of:
        if len(_parts_of) >= 256:
            _parts_of.clear()
        parts = _parts_of[compiled] = _read_launcher_parts(compiled)
    return parts


def _read_launcher_parts(compiled):
    if triton.__version__ != _TRITON_LAUNCHER:
        return None
    try:
        from triton.backends.nvidia import driver as nvidia
    except ImportError:
        return None
    runner = compiled.run
    if runner.__class__ is not nvidia.CudaLauncher or nvidia._BASE_ARGS_FORMAT_LEN != 13:
        return None
    if runner.global_scratch_size or runner.profile_scratch_size:
        return None  # CudaLauncher allocates them per launch: its own path does
    inner = runner.launch
    code = getattr(inner, "__code__", None)
    # ``inner`` of this very ``wrap_handle_tensordesc``: its code object is one of the wrapper's
    # constants.  Its closure holds the C launcher, the descriptor positions and metadata.
    if code is None or code not in nvidia.wrap_handle_tensordesc.__code__.co_consts:
        # Not wrapped: the C launcher itself, which the wrapper returns for a signature
        # without descriptors (the signature CudaLauncher was built from).
        signature = getattr(getattr(compiled, "src", None), "signature", None)
        if not isinstance(signature, dict) or any(isinstance(sig, str) and sig.startswith("tensordesc")
                                                  for sig in signature.values()):
            return None
        return inner, runner.launch_cooperative_grid, runner.launch_pdl, {}
    if inner.__closure__ is None:
        return None
    cells = dict(zip(code.co_freevars, (c.cell_contents for c in inner.__closure__)))
    try:
        raw, positions, meta = cells["launcher"], sorted(cells["tensordesc_indices"]), list(cells["tensordesc_meta"])
    except (KeyError, TypeError):
        return None
    if len(meta) != len(positions):
        return None
    return raw, runner.launch_cooperative_grid, runner.launch_pdl, dict(zip(positions, meta))


def _plain_descriptor(meta):
    """The flattened form of a descriptor argument: Triton's own ``make_tensordesc_arg``."""
    from triton.backends.nvidia.driver import make_tensordesc_arg

    return lambda desc: make_tensordesc_arg(desc, meta)


def _template_descriptor(template, meta):
    """The flattened form of ``template.over(t)`` for a tensor ``t``, as ``make_tensordesc_arg``
    builds it, or ``None`` where that would raise for every tensor (a last stride other than 1):
    the ordinary launcher then raises it.

    Everything but ``t`` is fixed: the template's shape, strides and padding (the descriptors
    it builds share its fields) and the compiled kernel's metadata.  With metadata the form is
    ``[map, *shape, *strides]``; the map ``fill_tma_descriptor`` encodes depends on the base
    address, the swizzle, element size and type, the box, the shape, the strides and the
    padding, every one fixed here but the address, so two tensors at one address get equal
    maps.  The maps are kept per address (the caching allocator hands the same addresses out
    again), a bounded memo local to this template and this compiled kernel; the launcher copies
    a map into the kernel's parameters at each launch, so a kept map is never read later."""
    from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST

    fields = template.fields
    shape, strides, padding = fields["shape"], fields["strides"], fields["padding"]
    if meta is None:
        tail = [*shape, *strides, padding == "nan", *shape, *strides]
        return lambda t: [t, *tail]
    if strides[-1] != 1:
        return None
    if meta["fp4_padded"]:
        shape = list(shape)
        shape[-1] *= 2
    encode_args = (meta["swizzle"], meta["elem_size"], TMA_DTYPE_DEVICE_TO_HOST[meta["elem_type"]], meta["block_size"],
                   shape, strides, 1 if padding == "nan" else 0)
    sizes = (*shape, *strides)
    maps = {}

    def flattened(t):
        address = t.data_ptr()
        entry = maps.get(address)
        if entry is None:
            # Looked up per encode, as make_tensordesc_arg does (a test may stub the driver).
            encoded = triton.runtime.driver.active.utils.fill_tma_descriptor(address, *encode_args)
            if len(maps) >= _MAX_MAPS:
                maps.clear()
            entry = maps[address] = (encoded, *sizes)
        return entry

    return flattened


class _Direct:
    """One compiled kernel's launch as ``compiled.run`` makes it, less its Python layer:
    ``self(gridX, gridY, gridZ, stream, function, packed_metadata, head)`` calls the C launcher
    with the leading arguments ``CudaLauncher`` passes (no launch metadata and no hooks, as
    every direct launch here) and the parameters ``head + tail`` flattened as
    ``wrap_handle_tensordesc`` flattens them: each descriptor position of ``head`` replaced by
    its step's list.

    With ``pointers`` (a bound launcher's :func:`_addressed_head`) the call also passes the
    addresses of its tensors, and each plain tensor parameter of the head goes to the C
    launcher as its address.  The launcher takes an int as the pointer itself; a tensor it asks for
    ``data_ptr()`` and then asks the driver (``cuPointerGetAttribute``) for the device address
    of that pointer, which for memory of a CUDA tensor is the same address (unified
    addressing), and which rejects host memory.  The caller passes addresses only of CUDA
    tensors, so the kernel gets the same parameters without a driver call per pointer."""

    __slots__ = ("raw", "cooperative", "pdl", "steps", "tail", "pointers")

    def __init__(self, raw, cooperative, pdl, steps, tail, pointers=None):
        self.raw, self.cooperative, self.pdl, self.steps, self.tail = raw, cooperative, pdl, steps, tail
        self.pointers = pointers

    def __call__(self, grid_0, grid_1, grid_2, stream, function, packed_metadata, head, addresses=None):
        # The leading arguments, then the parameters: head's runs between descriptor positions,
        # each descriptor position's list, the tail.
        flat = [grid_0, grid_1, grid_2, stream, function, self.cooperative, self.pdl, None, None, packed_metadata,
                None, None, None]
        if addresses is not None:
            head = self.pointers(head + addresses)
        start = 0
        for i, expand in self.steps:
            flat += head[start:i]
            flat += expand(head[i])
            start = i + 1
        flat += head[start:]
        flat += self.tail
        self.raw(*flat)


def _addressed_head(n_head: int, tensor_positions: tuple, templates: dict):
    """``pick(head + addresses)``: ``head`` with each plain tensor position holding its tensor's
    address, for a bound launcher whose call passes the addresses of its head's tensor
    positions first (``tensor_positions``, in order; a template's position keeps its tensor,
    which the launch turns into a descriptor).  The tail's tensors stay tensors."""
    source = {pos: n_head + j for j, pos in enumerate(tensor_positions) if pos not in templates}
    return _getter([source.get(i, i) for i in range(n_head)])


def _direct(compiled, n_head: int, tail: tuple, templates: dict, pointers=None):
    """The :class:`_Direct` launch of ``compiled`` for parameters ``head + tail`` (``head`` of
    ``n_head`` values; ``templates``: position in ``head`` -> the ``DescriptorTemplate`` whose
    descriptor the call's tensor there stands for; ``pointers``: a bound launcher's
    :func:`_addressed_head`), or ``None``: ``compiled.run`` then.

    The descriptor positions are the launcher's own: a position of ``head`` that it flattens is
    flattened here (from its template, or by ``make_tensordesc_arg`` on whatever the call
    passes), so the list is the one ``inner`` builds.  A descriptor position in the tail, or a
    template at a position the launcher does not flatten, is not the expected structure."""
    try:
        parts = _launcher_parts(compiled)
    except Exception:  # noqa: BLE001 - e.g. the handles fail to load: compiled.run raises it
        return None
    if parts is None:
        return None
    raw, cooperative, pdl, descriptors = parts
    if any(i >= n_head for i in descriptors) or any(i not in descriptors for i in templates):
        return None
    steps = []
    for i, meta in sorted(descriptors.items()):
        expand = _template_descriptor(templates[i], meta) if i in templates else _plain_descriptor(meta)
        if expand is None:
            return None
        steps.append((i, expand))
    return _Direct(raw, cooperative, pdl, tuple(steps), tuple(tail), pointers)


def _key(cache, device, args, options, dynamic):
    """The call's key (see the module doc), or ``None`` when an argument is of a type the key
    does not describe.  Raises TypeError for an unhashable option value."""
    types = tuple(map(type, args))
    layout = cache.layouts.get((types, dynamic))
    if layout is None:
        if len(cache.layouts) >= _MAX_LAYOUTS:
            cache.layouts.clear()
        layout = cache.layouts[types, dynamic] = _Layout(types, frozenset(dynamic))
    if not layout.classified:
        return None
    ints = layout.ints(args)
    int_classes = layout.int_ids.get(ints)
    if int_classes is None:
        if len(layout.int_ids) >= _MAX_INT_IDS:
            layout.int_ids.clear()
        int_classes = layout.int_ids[ints] = tuple(map(_arg_class, ints))
    tensors = layout.tensors(args)
    if tensors:
        # One OR over the addresses: all 16-byte aligned (the usual case) is one class;
        # otherwise each tensor's alignment is in the key.
        aligned = True if not reduce(or_, map(_data_ptr, tensors)) & 15 else \
            tuple(not p & 15 for p in map(_data_ptr, tensors))
        tensor_classes = (tuple(map(_dtype, tensors)), aligned)
    else:
        tensor_classes = None
    dyn = None
    if layout.dynamic:
        dyn = tuple(_tuple_class(a) if a.__class__ is tuple else _arg_class(a) for a in map(args.__getitem__,
                                                                                            layout.dynamic))
        if _UNCLASSIFIED in dyn:
            return None  # e.g. a tuple holding a numpy scalar
    # The option types too: True == 1 as dict keys, but Triton compiles them apart.
    return (device, _compile_modes(cache.kernel), tuple(options.items()), tuple(map(type, options.values())), types,
            int_classes, dyn, tensor_classes)


def launch(kernel, grid: tuple, args: tuple, options: dict, dynamic: tuple = ()) -> None:
    """``kernel[grid](*args, **options)``, launched directly once this call's class has been
    compiled.  ``args``: the runtime arguments, positional, in signature order; ``options``:
    the constexpr arguments and launch options (``num_warps``, ``num_stages``, ...).

    ``dynamic``: positions in ``args`` of ints that change from call to call (a length that
    grows every decoding step).  Those ints are classified on every call, the others through a
    memo of their exact values.  The hint is part of the key: a class launched with and without
    it is compiled once (Triton's own cache) but launched ordinarily once under each."""
    _launch(kernel, grid, args, options, dynamic)


def _launch(kernel, grid, args, options, dynamic):
    """:func:`launch`; returns what the key of this call holds once it is done: ``(compiled
    kernel, constexpr tail, its _Direct or None)`` when later calls of its class may launch directly, ``_FAILED``
    when they may not, ``None`` when this call does not tell (no key, hooks active, ...)."""
    # While torch.compile traces, the kernel is its graph node: Dynamo cannot test its class,
    # so is_compiling() comes first.
    if torch.compiler.is_compiling() or INTERPRET or grid.__class__ is not tuple or not isinstance(kernel, JITFunction):
        _ordinary(kernel, grid, args, options)
        return None
    global _device_functions
    if _device_functions is None:
        driver = triton.runtime.driver.active
        current_device = driver.get_current_device
        if current_device is torch.cuda.current_device:
            # The same answer without its Python layer (a lazy-init check per call, ~1.5 us on
            # a GPU host, twice per decoding step): torch's C getter initialises CUDA itself.
            current_device = getattr(torch._C, "_cuda_getDevice", current_device)
        _device_functions = (current_device, driver.get_current_stream)
    cache = _caches.get(id(kernel))
    if cache is None or cache.kernel is not kernel:
        cache = _caches[id(kernel)] = _KernelCache(kernel)
    device = _device_functions[0]()
    try:
        key = _key(cache, device, args, options, dynamic)
        compiled = cache.variants.get(key) if key is not None else None
    except TypeError:  # an unhashable option value: Triton's own key handles it
        _ordinary(kernel, grid, args, options)
        return None
    if key is None:
        _ordinary(kernel, grid, args, options)
        return _FAILED  # a type the key does not describe: ordinary launches for this class
    if compiled is None or compiled is _FAILED or kernel.pre_run_hooks or not _hooks_idle():
        returned = _ordinary(kernel, grid, args, options)
        if compiled is None:
            return _remember(cache, key, returned, len(args), options)
        return compiled if compiled is _FAILED else None
    grid_0, grid_1, grid_2 = (grid + (1, 1))[:3]
    try:
        if compiled[2] is not None:
            compiled[2](grid_0, grid_1, grid_2, _device_functions[1](device), compiled[0].function,
                        compiled[0].packed_metadata, args)
        else:
            compiled[0].run(grid_0, grid_1, grid_2, _device_functions[1](device), compiled[0].function,
                            compiled[0].packed_metadata, None, None, None, *args, *compiled[1])
    except Exception:
        if RAISE_DIRECT_ERRORS:
            raise
        cache.variants[key] = _FAILED
        _ordinary(kernel, grid, args, options)
        return _FAILED
    return compiled


def _remember(cache, key, returned, n_args, options):
    """Keep the kernel the ordinary launch used, when a later direct launch can reproduce
    that launch exactly (see the module doc)."""
    tail = cache.tail(n_args, options)
    if len(cache.variants) >= _MAX_VARIANTS:
        cache.variants.clear()
    if (tail is None or any(v.__class__ is float for v in options.values())
            or hasattr(returned, "result") or not hasattr(returned, "packed_metadata")):
        # Ordinary launches for this key: Triton classifies what the key cannot (a float
        # constexpr is keyed by value, and 0.0 == -0.0 compile apart), and an asynchronous
        # compile returns a future, not a kernel.
        cache.variants[key] = _FAILED
        return _FAILED
    entry = cache.variants[key] = (returned, tail, _direct(returned, n_args, tail, {}))
    return entry


def compiled_variants(kernel) -> list:
    """The compiled kernels :func:`launch` holds for ``kernel`` (tests and reports)."""
    cache = _caches.get(id(kernel))
    if cache is None or cache.kernel is not kernel:
        return []
    return [v[0] for v in cache.variants.values() if v is not _FAILED]


class BoundLaunch:
    """One kernel launched with one grid, one set of options and the same non-tensor
    arguments at every call but for the ``dynamic`` ints: see :func:`bind`."""

    __slots__ = ("kernel", "grid", "grid3", "options", "dynamic", "n_head", "tensors", "tensor_positions", "descs",
                 "desc_sample", "desc_fields", "layout_descs", "layouts", "statics", "static_values", "dynamic_of",
                 "tail", "tail_tensors", "builds", "templates", "variants", "generation", "fixed")

    def __init__(self, kernel, grid, options, args, dynamic, tail_from, fixed=False):
        n = len(args) if tail_from is None else tail_from
        self.kernel, self.grid, self.options, self.dynamic = kernel, grid, options, tuple(dynamic)
        self.grid3 = (grid + (1, 1))[:3] if grid.__class__ is tuple else None
        self.n_head = n
        self.tail = tuple(args[n:])
        if (any(a.__class__ in _DESCRIPTORS or a.__class__ is DescriptorTemplate for a in self.tail)
                or any(i >= n for i in self.dynamic)):
            raise ValueError("bind: the arguments from tail_from on must hold no descriptor, no template and no "
                             "dynamic position")
        # The tail's tensors (placeholders, say), each distinct one once: classified at every
        # call with the head's, since a tensor's address is not fixed by its identity alone.
        tail_tensors = []
        for a in self.tail:
            if isinstance(a, torch.Tensor) and not any(a is t for t in tail_tensors):
                tail_tensors.append(a)
        self.tail_tensors = tuple(tail_tensors)
        head = tuple(args[:n])
        if any(head[i].__class__ is DescriptorTemplate for i in self.dynamic):
            raise ValueError("bind: a template's position cannot be dynamic")
        # A template's position takes a tensor, over which the launcher builds the descriptor.
        self.builds = tuple((i, a.over) for i, a in enumerate(head) if a.__class__ is DescriptorTemplate)
        self.templates = {i: a for i, a in enumerate(head) if a.__class__ is DescriptorTemplate}
        tensors = [i for i, a in enumerate(head) if (isinstance(a, torch.Tensor) or a.__class__ is DescriptorTemplate)
                   and i not in self.dynamic]
        descs = [i for i, a in enumerate(head) if a.__class__ in _DESCRIPTORS and i not in self.dynamic]
        self.tensors = _getter(tensors)
        self.tensor_positions = tuple(tensors)
        # A descriptor position: the class, block shape and padding (and a Gluon descriptor's
        # shared layout) must be the sample's very objects at every call.
        self.descs = _getter(descs) if descs else None
        with_layout = [i for i in descs if hasattr(head[i], "layout")]
        # The layouts are read with the other fields when every descriptor has one.
        self.desc_fields = _desc_fields_layout if with_layout and len(with_layout) == len(descs) else _desc_fields
        self.desc_sample = tuple(chain.from_iterable(map(self.desc_fields, self.descs(head)))) if descs else ()
        mixed = with_layout and self.desc_fields is _desc_fields
        self.layout_descs = _getter(with_layout) if mixed else None
        self.layouts = tuple(head[i].layout for i in with_layout) if mixed else ()
        statics = [i for i in range(n) if i not in tensors and i not in descs and i not in self.dynamic]
        self.statics = _getter(statics) if statics else None
        self.static_values = self.statics(head) if statics else ()
        # One dynamic position (the usual case) is read directly; several through a getter.
        self.dynamic_of = (None if not self.dynamic else self.dynamic[0] if len(self.dynamic) == 1
                           else _getter(list(self.dynamic)))
        self.variants = {}
        self.generation = _generation
        self.fixed = bool(fixed and not descs and all(t.is_cuda for t in self.tensors(head) + self.tail_tensors
                                                      if isinstance(t, torch.Tensor)))

    def __call__(self, head: tuple) -> None:
        """``launch(kernel, grid, self.arguments(head), options, dynamic)``: ``head`` holds
        tensors (any) where the binding call had tensors or templates, descriptors sharing the
        binding call's class, block shape, padding and layout objects where it had descriptors
        (any base), the ``dynamic`` values (any), and elsewhere the binding call's very objects;
        a call that does not is handed to :func:`launch` whole."""
        statics = None if self.fixed else self.statics
        if (torch.compiler.is_compiling() or len(head) != self.n_head
                or (statics is not None and not all(map(is_, statics(head), self.static_values)))
                or INTERPRET or self.grid3 is None):
            launch(self.kernel, self.grid, self.arguments(head), self.options, self.dynamic)
            return
        if self.generation is not _generation:  # clear() was called: forget the variants too
            self.variants.clear()
            self.generation = _generation
        try:
            tensors = self.tensors(head)
            descs = self.descs
            if descs is not None:
                descs = descs(head)
                if not (all(map(is_, chain.from_iterable(map(self.desc_fields, descs)), self.desc_sample))
                        and (self.layout_descs is None
                             or all(map(is_, map(_layout, self.layout_descs(head)), self.layouts)))):
                    launch(self.kernel, self.grid, self.arguments(head), self.options, self.dynamic)
                    return
                # Keyed like tensors: Triton's variant depends on a descriptor's base dtype
                # alone (the rest is the sample's); TMA needs the base 16-byte aligned.
                tensors += tuple(map(_base, descs))
            tensors += self.tail_tensors
            addresses = tuple(map(_data_ptr, tensors))
            # All 16-byte aligned (the usual case) is one class; otherwise each tensor's own.
            aligned = True if not reduce(or_, addresses, 0) & 15 else tuple(not p & 15 for p in addresses)
            # With fixed classes the caller's own key holds the tensors' types and dtypes.
            dtypes = None if self.fixed else tuple(map(_dtype, tensors))
        except (TypeError, AttributeError):  # not a tensor / descriptor where the binding call had one
            launch(self.kernel, self.grid, self.arguments(head), self.options, self.dynamic)
            return
        dyn_of = self.dynamic_of
        if dyn_of is None:
            dyn = None
        elif dyn_of.__class__ is int:
            a = head[dyn_of]
            dyn = _tuple_class(a) if a.__class__ is tuple else _arg_class(a)
        else:
            dyn = tuple(_tuple_class(a) if a.__class__ is tuple else _arg_class(a) for a in dyn_of(head))
        device = _device_functions[0]() if _device_functions is not None else None
        key = (device, _compile_modes(self.kernel), None if dtypes is None else tuple(map(type, tensors)), dtypes,
               aligned, dyn)
        entry = self.variants.get(key)
        kernel = self.kernel
        if entry is None:
            # The first call of this class (or a class launch() left undecided): launch() keys
            # it in full, launches it and says what later calls may do.
            entry = _launch(kernel, self.grid, self.arguments(head), self.options, self.dynamic)
            # One dynamic position's class is ``dyn`` itself (1 for the int 1, not a tuple); several
            # positions' classes are a tuple of them.
            unclassified = dyn is _UNCLASSIFIED or (dyn_of is not None and dyn_of.__class__ is not int
                                                    and _UNCLASSIFIED in dyn)
            if entry is not None and not unclassified:
                if len(self.variants) >= _MAX_VARIANTS:
                    self.variants.clear()
                # The launcher's own arguments and the constexprs follow the call's, in one tuple.
                if entry is _FAILED:
                    self.variants[key] = entry
                else:
                    tail = self.tail + entry[1]
                    pointers = _addressed_head(self.n_head, self.tensor_positions, self.templates)
                    self.variants[key] = (entry[0], tail, _direct(entry[0], self.n_head, tail, self.templates,
                                                                  pointers))
            return
        if entry is _FAILED or kernel.pre_run_hooks or not _hooks_idle():
            _ordinary(kernel, self.grid, self.arguments(head), self.options)
            return
        compiled, tail, direct = entry
        try:
            if direct is not None:
                # The templates' descriptors are flattened from the call's tensors directly, and
                # the tensors go as their addresses where all are CUDA tensors (_Direct); a host
                # tensor is left to the C launcher, which rejects it.
                direct(*self.grid3, _device_functions[1](device), compiled.function, compiled.packed_metadata, head,
                       addresses if self.fixed or all(map(_on_gpu, tensors)) else None)
            else:
                built = head
                if self.builds:
                    built = list(head)
                    for i, over in self.builds:
                        built[i] = over(built[i])
                compiled.run(*self.grid3, _device_functions[1](device), compiled.function, compiled.packed_metadata,
                             None, None, None, *built, *tail)
        except Exception:
            if RAISE_DIRECT_ERRORS:
                raise
            self.variants[key] = _FAILED
            _ordinary(kernel, self.grid, self.arguments(head), self.options)

    def arguments(self, head: tuple) -> tuple:
        """The runtime arguments a call with ``head`` launches with: ``head`` and the tail, a
        descriptor built over the call's tensor at each template's position."""
        if not self.builds:
            return head + self.tail
        args = list(head)
        for i, over in self.builds:
            args[i] = over(args[i])
        return tuple(args) + self.tail


_desc_fields = attrgetter("__class__", "block_shape", "padding")
_desc_fields_layout = attrgetter("__class__", "block_shape", "padding", "layout")
_layout = attrgetter("layout")
_base = attrgetter("base")


def bind(kernel, grid: tuple, options: dict, args: tuple, dynamic: tuple = (), tail_from: int | None = None,
         fixed: bool = False) -> BoundLaunch:
    """A launcher of ``kernel`` with this grid and these options: ``bound(args)`` is
    ``launch(kernel, grid, args, options, dynamic)``, cheaper per call.

    ``args`` is a sample of the runtime arguments.  A later call must pass, at every position
    holding a tensor in the sample, a tensor (any dtype, address, shape); at every position
    holding a host TMA descriptor, a descriptor over any tensor whose class, ``block_shape``,
    ``padding`` and (a Gluon descriptor's) ``layout`` are the sample descriptor's very objects
    (descriptors built from one ``flashtile.kernels.tma.DescriptorTemplate`` share them); at the
    ``dynamic`` positions any value; and at every other position the sample's very object
    (``is``: the caller keeps its ints, floats and flags in one place, such as a launch plan).
    Then the compiled variant depends only on the tensors' and the descriptors' bases' types,
    dtypes and alignment, the dynamic arguments' classes, the current device and Triton's debug
    modes (``_compile_modes``), which are the bound launcher's key; a call that breaks the rule goes through :func:`launch` and its full
    key, so it is still exact.

    Why a descriptor's objects suffice: Triton specialises a descriptor by its class, its
    base's dtype and the text of its block shape and layout (see :func:`_arg_class`).  A Gluon
    layout is a frozen dataclass, and a block-shape list is never written once its descriptor
    is built (Triton's constructor validates it there; a template's descriptors share it), so
    the sample's objects mean the sample's texts at every call.

    At a position holding a ``flashtile.kernels.tma.DescriptorTemplate`` in the sample, a call
    passes a tensor and the launch gets ``template.over(tensor)``: the descriptor's class,
    block shape, padding and layout are the template's by construction, and the tensor is keyed
    as any tensor is, so nothing of the descriptor needs checking.  The tensor must be one the
    template is valid for (see ``DescriptorTemplate``), as a descriptor built by the caller
    would have to be.

    ``tail_from``: the arguments from this position on (no descriptor, no template and no
    dynamic one among them) are the bound launcher's own: a call passes only ``args[:tail_from]``.  Nothing of
    the tail needs checking but its tensors (placeholders for pointers a kernel does not
    read), which are classified at every call as the call's own are, each distinct one once.

    ``fixed``: the caller's own memo, keyed by what it passes, guarantees that every call
    passes tensors of the sample's types, dtypes and device and the sample's very objects at
    every other position but the ``dynamic`` ones; then a call is classified by its tensors'
    alignment, the dynamic arguments' classes, the device and the debug modes alone (a
    decoding step's launch, which ``flash_attn_with_kvcache``'s memo keys; a forward plan's,
    which the forward's plan key does).  A call that breaks the guarantee launches a variant
    compiled for other arguments.  Ignored unless the sample's tensors are all CUDA tensors and
    it holds no descriptor (templates are fine: a call passes their tensors)."""
    return BoundLaunch(kernel, grid, options, args, dynamic, tail_from, fixed)


@functools.lru_cache(maxsize=None)
def placeholder(device: torch.device) -> torch.Tensor:
    """One float32 tensor per device for pointer arguments a kernel does not read (behind a
    constexpr flag).  Triton specialises it as it does any fresh float32 tensor (16-byte
    aligned); as a constant it can sit in a bound launcher's tail, where it is classified
    once per call however many arguments it stands for."""
    return torch.empty(4, dtype=torch.float32, device=device)


_generation = object()  # replaced by clear(): bound launchers forget their variants


def clear() -> None:
    """Forget every cached variant (the next launch of each class is ordinary again)."""
    global _generation
    _caches.clear()
    _parts_of.clear()
    _generation = object()
