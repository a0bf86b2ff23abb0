"""Long rows staged in shared memory: a softmax (and its backward) at one read and one write.

A row too long for one SM is cut into chunks, one per program, and each chunk sits in shared
memory from its read to its write: the TMA engine loads it in 16 KB boxes, the program
reduces it to its partial state as the boxes arrive (forward: the online ``(m, l)``;
backward: ``sum(g * y)``, or ``sum(g)`` for log-softmax), publishes that partial, waits on an
arrival counter until the row's other chunk programs have published theirs, merges them,
rewrites each box in place and has the TMA engine store it.  Held bytes are limited by
shared memory (192 KB a program), not by registers, and with two buffers a program loads its
next row's chunk while it waits for this row's partials and writes it out.

Launch shape (``plan``): a row's ``splits`` chunk programs form a group, ``groups`` groups
run at once (one program per SM), and group ``g`` takes rows ``g, g + groups, ...`` in
order.  Programs of a group wait only for each other, so the launch is cooperative (every
program resident: nobody waits for a program that has not started).

Rows are read through a 3-D view ``(rows, n_cols / INNER, INNER)`` with 128-byte inner
rows (64 16-bit or 32 fp32 elements), so ``n_cols`` must be a multiple of ``INNER`` and the
rows 16-byte aligned; boxes past a row's end load zeros (masked to ``-inf`` here) and store
nothing.  The semantics are the ``tl.*`` kernels' (``flashtile/kernels/softmax/rows.py``): a
row with no finite entry gives zeros (log-softmax ``-inf``); NaN and ``+inf`` propagate.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from flashtile.kernels.runtime import cdiv, next_power_of_2

# One TMA box: 128 inner rows of 128 bytes (16 KB); a program's shared memory holds SLOTS
# boxes (192 KB: one program per SM).
BOX_ROWS = 128
ROW_BYTES = 128
SLOTS = 12
NUM_WARPS = 8
LN2: gl.constexpr = gl.constexpr(0.6931471805599453)


def inner_cols(elem_bytes: int) -> int:
    """Elements per 128-byte inner row of the 3-D view."""
    return ROW_BYTES // elem_bytes


@dataclasses.dataclass(frozen=True)
class StagedPlan:
    splits: int        # chunk programs per row
    groups: int        # rows in flight
    chunk_boxes: int   # boxes per chunk (per streamed tensor)
    buffers: int       # 2: the next row's chunk loads while this one finishes; 1: one chunk at a time

    @property
    def programs(self) -> int:
        return self.splits * self.groups


def plan(n_rows: int, n_cols: int, elem_bytes: int, tensors: int, sms: int) -> StagedPlan | None:
    """The launch shape for ``n_rows`` rows of ``n_cols`` elements, ``tensors`` streamed per row
    (1 forward, 2 backward), on ``sms`` SMs; None when the rows cannot be staged (``n_cols`` not
    a multiple of the inner row, or a row larger than the GPU's shared memory).

    Two buffers when a row's chunks fit in half of every program's slots, else one.  Among the
    chunk counts that fit, the one that keeps the most SMs busy (with the rows there are),
    then the fewest chunks (fewer partials to merge).
    """
    inner = inner_cols(elem_bytes)
    if n_rows < 1 or n_cols < inner or n_cols % inner:
        return None
    row_boxes = cdiv(n_cols // inner, BOX_ROWS)
    for buffers in (2, 1):
        capacity = SLOTS // (buffers * tensors)
        fewest = cdiv(row_boxes, capacity)
        if fewest <= sms:
            break
    else:
        return None
    best = None
    for wanted in range(fewest, min(sms, row_boxes) + 1):
        boxes = cdiv(row_boxes, wanted)
        splits = cdiv(row_boxes, boxes)
        groups = min(n_rows, sms // splits)
        key = (groups * splits, -splits)
        if best is None or key > best[0]:
            best = (key, StagedPlan(splits, groups, boxes, buffers))
    return best[1]


@gluon.jit
def _load_chunk(desc, bufs, ready, first_slot, row, v0, CHUNK_BOXES: gl.constexpr, BOX_ROWS: gl.constexpr,
                EXTRA_desc=None, extra_bufs=None):
    """TMA-load a chunk's boxes (and, in the backward, the second tensor's) into slots
    ``first_slot ...``, each counted on its slot's ready barrier."""
    for i in gl.static_range(CHUNK_BOXES):
        bar = ready.index(first_slot + i)
        if EXTRA_desc is None:
            mbarrier.expect(bar, desc.block_type.nbytes)
        else:
            mbarrier.expect(bar, desc.block_type.nbytes + EXTRA_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(desc, [row, v0 + i * BOX_ROWS, 0], bar, bufs.index(first_slot + i))
        if EXTRA_desc is not None:
            tma.async_copy_global_to_shared(EXTRA_desc, [row, v0 + i * BOX_ROWS, 0], bar,
                                            extra_bufs.index(first_slot + i))


@gluon.jit
def _arrive(ARRIVED, g):
    """Count this program's partial as published on its group's counter."""
    gl.thread_barrier()  # every thread's partial store happens before the release
    gl.atomic_add(ARRIVED + g, 1, sem="release", scope="gpu")


@gluon.jit
def _wait(ARRIVED, g, target):
    """Wait until the group's counter reaches ``target``: every chunk program of this row (and
    of the group's rows before it) has published its partial."""
    arrived = gl.atomic_add(ARRIVED + g, 0, sem="acquire", scope="gpu")
    while arrived < target:
        arrived = gl.atomic_add(ARRIVED + g, 0, sem="acquire", scope="gpu")


@gluon.jit
def _chunk_program(n_rows, groups, splits, CHUNK_BOXES: gl.constexpr, BOX_ROWS: gl.constexpr,
                   SPLITS_P2: gl.constexpr):
    """This program's group ``g``, chunk ``c``, its count of rows, its chunk's first inner row,
    and the indices of its group's partials (``SPLITS_P2`` of them, ``splits`` real)."""
    pid = gl.program_id(0)
    g = pid // splits
    c = pid % splits
    pidx = gl.arange(0, SPLITS_P2, layout=gl.BlockedLayout([1], [32], [gl.num_warps()], [0]))
    return g, c, gl.cdiv(n_rows - g, groups), c * (CHUNK_BOXES * BOX_ROWS), pidx


@gluon.jit
def _box_ring(desc, SLOTS: gl.constexpr):
    """``SLOTS`` boxes of ``desc``'s shape and layout in shared memory."""
    return gl.allocate_shared_memory(desc.dtype, [SLOTS] + desc.block_type.shape, desc.layout)


@gluon.jit
def _ready_barriers(SLOTS: gl.constexpr):
    """One ready barrier a slot, counting its box's TMA bytes."""
    ready = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(SLOTS):
        mbarrier.init(ready.index(i), count=1)
    return ready


@gluon.jit
def _finish(ready, SLOTS: gl.constexpr):
    """The last stores have read their boxes (shared memory lives until then); barriers retired."""
    tma.store_wait(0)
    for i in gl.static_range(SLOTS):
        mbarrier.invalidate(ready.index(i))


@gluon.jit
def _safe(m):
    # (-inf) - (-inf) is NaN: a state with no finite entry is shifted by 0 instead.
    return gl.where(m == float("-inf"), 0.0, m)


@gluon.jit
def staged_softmax_fwd_kernel(X_desc, Y_desc, M_PART, L_PART, ARRIVED, n_rows, vrows, groups, splits, scale_log2,
                              LOG: gl.constexpr, CHUNK_BOXES: gl.constexpr, BUFFERS: gl.constexpr,
                              SPLITS_P2: gl.constexpr, BOX_LAYOUT: gl.constexpr):
    """Program ``(g, c)`` = ``(pid // splits, pid % splits)`` holds chunk ``c`` (``CHUNK_BOXES``
    boxes) of rows ``g, g + groups, ...``; ``vrows`` is the row's count of 128-byte inner rows,
    ``scale_log2`` the scale times log2(e); ``BOX_LAYOUT`` the registers' layout of a box
    (``box_registers``)."""
    BOX_ROWS: gl.constexpr = X_desc.block_type.shape[1]
    layout: gl.constexpr = BOX_LAYOUT
    g, c, rounds, v0, pidx = _chunk_program(n_rows, groups, splits, CHUNK_BOXES, BOX_ROWS, SPLITS_P2)
    bufs = _box_ring(X_desc, BUFFERS * CHUNK_BOXES)
    ready = _ready_barriers(BUFFERS * CHUNK_BOXES)
    vr = gl.arange(0, BOX_ROWS, layout=gl.SliceLayout(0, gl.SliceLayout(2, layout)))
    vr = gl.expand_dims(gl.expand_dims(vr, 0), 2) + v0  # the box's first inner rows, [1, BOX_ROWS, 1]

    if rounds > 0:
        _load_chunk(X_desc, bufs, ready, 0, g, v0, CHUNK_BOXES, BOX_ROWS)
    for k in range(rounds):
        row = g + k * groups
        first = (k % BUFFERS) * CHUNK_BOXES
        phase = (k // BUFFERS) & 1
        # The chunk's state (m, l) in log2 units, box by box as the boxes arrive.
        for i in gl.static_range(CHUNK_BOXES):
            mbarrier.wait(ready.index(first + i), phase)
            x = bufs.index(first + i).load(layout).to(gl.float32)
            t = gl.where(vr + i * BOX_ROWS < vrows, x * scale_log2, float("-inf"))
            m_box = gl.max(gl.max(gl.max(t, 2), 1), 0)
            if i == 0:
                m = m_box
                acc = gl.exp2(t - _safe(m))
            else:
                m_new = gl.maximum(m, m_box)
                alpha = gl.where(m == float("-inf"), 0.0, gl.exp2(m - _safe(m_new)))
                acc = acc * alpha + gl.exp2(t - _safe(m_new))
                m = m_new
        l = gl.sum(gl.sum(gl.sum(acc, 2), 1), 0)
        part = ((g * 2 + (k & 1)) * splits).to(gl.int64)  # two slots a group: rows k and k + 1 overlap
        gl.store(M_PART + part + c, m)
        gl.store(L_PART + part + c, l)
        _arrive(ARRIVED, g)
        if BUFFERS == 2:
            if k + 1 < rounds:  # the next row's chunk, once the stores of the row before have read its slots
                tma.store_wait(0)
                _load_chunk(X_desc, bufs, ready, CHUNK_BOXES - first, row + groups, v0, CHUNK_BOXES, BOX_ROWS)
        _wait(ARRIVED, g, (k + 1) * splits)
        # The row's state: m = max m_c, l = sum l_c 2^(m_c - m).
        ok = pidx < splits
        m_c = gl.load(M_PART + part + pidx, mask=ok, other=float("-inf"), cache_modifier=".cg")
        l_c = gl.load(L_PART + part + pidx, mask=ok, other=0.0, cache_modifier=".cg")
        shift = _safe(gl.max(m_c, 0))
        l_row = gl.sum(l_c * gl.exp2(m_c - shift), 0)
        empty = l_row == 0.0  # no finite entry: zeros (log-softmax -inf), not NaN
        inv_l = 1.0 / gl.where(empty, 1.0, l_row)
        log2_l = gl.where(empty, 0.0, gl.log2(gl.where(empty, 1.0, l_row)))
        for i in gl.static_range(CHUNK_BOXES):
            box = bufs.index(first + i)
            x = box.load(layout).to(gl.float32)
            if LOG:
                y = (x * scale_log2 - (shift + log2_l)) * LN2
            else:
                y = gl.exp2(x * scale_log2 - shift) * inv_l
            box.store(y.to(Y_desc.dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(Y_desc, [row, v0 + i * BOX_ROWS, 0], box)
        if BUFFERS == 1:
            if k + 1 < rounds:  # each slot's next box as soon as its store has read it
                for i in gl.static_range(CHUNK_BOXES):
                    tma.store_wait(CHUNK_BOXES - 1 - i)
                    _load_chunk(X_desc, bufs, ready, i, row + groups, v0 + i * BOX_ROWS, 1, BOX_ROWS)
    _finish(ready, BUFFERS * CHUNK_BOXES)


@gluon.jit
def staged_softmax_bwd_kernel(Y_desc, G_desc, DX_desc, S_PART, ARRIVED, n_rows, vrows, groups, splits, scale,
                              LOG: gl.constexpr, CHUNK_BOXES: gl.constexpr, BUFFERS: gl.constexpr,
                              SPLITS_P2: gl.constexpr, BOX_LAYOUT: gl.constexpr):
    """The backward, with the forward's launch shape: chunks of ``y`` and ``g`` staged side by
    side, the row sum ``s`` (``sum(g * y)``; log-softmax ``sum(g)``) merged through ``S_PART``,
    then ``dx = scale * y * (g - s)`` (log-softmax ``scale * (g - exp(y) * s)``) written over
    ``y``'s boxes and stored."""
    BOX_ROWS: gl.constexpr = Y_desc.block_type.shape[1]
    layout: gl.constexpr = BOX_LAYOUT
    g, c, rounds, v0, pidx = _chunk_program(n_rows, groups, splits, CHUNK_BOXES, BOX_ROWS, SPLITS_P2)
    y_bufs = _box_ring(Y_desc, BUFFERS * CHUNK_BOXES)
    g_bufs = _box_ring(G_desc, BUFFERS * CHUNK_BOXES)
    ready = _ready_barriers(BUFFERS * CHUNK_BOXES)

    if rounds > 0:
        _load_chunk(Y_desc, y_bufs, ready, 0, g, v0, CHUNK_BOXES, BOX_ROWS, G_desc, g_bufs)
    for k in range(rounds):
        row = g + k * groups
        first = (k % BUFFERS) * CHUNK_BOXES
        phase = (k // BUFFERS) & 1
        # Boxes past the row's end hold zeros: they add nothing to the sum.
        for i in gl.static_range(CHUNK_BOXES):
            mbarrier.wait(ready.index(first + i), phase)
            gv = g_bufs.index(first + i).load(layout).to(gl.float32)
            if LOG:
                term = gv
            else:
                term = gv * y_bufs.index(first + i).load(layout).to(gl.float32)
            if i == 0:
                acc = term
            else:
                acc += term
        s_c = gl.sum(gl.sum(gl.sum(acc, 2), 1), 0)
        part = ((g * 2 + (k & 1)) * splits).to(gl.int64)
        gl.store(S_PART + part + c, s_c)
        _arrive(ARRIVED, g)
        if BUFFERS == 2:
            if k + 1 < rounds:
                tma.store_wait(0)
                _load_chunk(Y_desc, y_bufs, ready, CHUNK_BOXES - first, row + groups, v0, CHUNK_BOXES, BOX_ROWS,
                            G_desc, g_bufs)
        _wait(ARRIVED, g, (k + 1) * splits)
        s = gl.sum(gl.load(S_PART + part + pidx, mask=pidx < splits, other=0.0, cache_modifier=".cg"), 0)
        for i in gl.static_range(CHUNK_BOXES):
            box = y_bufs.index(first + i)
            yv = box.load(layout).to(gl.float32)
            gv = g_bufs.index(first + i).load(layout).to(gl.float32)
            if LOG:
                dx = (gv - gl.exp(yv) * s) * scale
            else:
                dx = yv * (gv - s) * scale
            box.store(dx.to(DX_desc.dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(DX_desc, [row, v0 + i * BOX_ROWS, 0], box)
        if BUFFERS == 1:
            if k + 1 < rounds:
                for i in gl.static_range(CHUNK_BOXES):
                    tma.store_wait(CHUNK_BOXES - 1 - i)
                    _load_chunk(Y_desc, y_bufs, ready, i, row + groups, v0 + i * BOX_ROWS, 1, BOX_ROWS,
                                G_desc, g_bufs)
    _finish(ready, BUFFERS * CHUNK_BOXES)


_GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16, torch.float32: gl.float32}


@functools.lru_cache(maxsize=None)
def box_layout(torch_dtype: torch.dtype):
    """The shared-memory layout of one box (128-byte rows: the TMA engine's 128-byte swizzle)."""
    return gl.NVMMASharedLayout.get_default_for([1, BOX_ROWS, inner_cols(torch_dtype.itemsize)],
                                                _GL_DTYPES[torch_dtype])


@functools.lru_cache(maxsize=None)
def box_registers(elem_bytes: int):
    """The registers' layout of a box: 16 bytes a thread, 8 threads along a 128-byte inner row,
    4 inner rows a warp, the ``NUM_WARPS`` warps down the box."""
    return gl.BlockedLayout([1, 1, 16 // elem_bytes], [1, 4, 8], [1, NUM_WARPS, 1], [2, 1, 0])


def _view_descriptor(t: torch.Tensor, n_rows: int, n_cols: int, row_stride: int) -> TensorDescriptor:
    inner = inner_cols(t.element_size())
    return TensorDescriptor(t, [n_rows, n_cols // inner, inner], [row_stride, inner, 1], [1, BOX_ROWS, inner],
                            box_layout(t.dtype))


def stageable(t: torch.Tensor, row_stride: int, n_cols: int) -> bool:
    """Rows of ``t`` (unit column stride, ``row_stride`` apart) can be read by the TMA engine:
    16-byte aligned base and row stride, rows that do not overlap (a broadcast row's stride 0
    is no stride a tensor map takes), and whole 128-byte inner rows."""
    elem = t.element_size()
    return (t.dtype in _GL_DTYPES and t.data_ptr() % 16 == 0 and (row_stride * elem) % 16 == 0
            and row_stride >= n_cols and n_cols % inner_cols(elem) == 0)


def _launch(kernel, p: StagedPlan, descs, parts, n_rows, n_cols, elem_bytes, scalar, log) -> bool:
    """Launch cooperatively (the driver refuses a grid whose programs cannot all be resident at
    once, so no program waits for one that cannot start); False when it refused."""
    arrived = torch.zeros(p.groups, dtype=torch.int32, device=parts[0].device)
    try:
        kernel[(p.programs,)](*descs, *parts, arrived, n_rows, n_cols // inner_cols(elem_bytes), p.groups,
                              p.splits, scalar, LOG=log, CHUNK_BOXES=p.chunk_boxes, BUFFERS=p.buffers,
                              SPLITS_P2=max(2, next_power_of_2(p.splits)), BOX_LAYOUT=box_registers(elem_bytes),
                              num_warps=NUM_WARPS, launch_cooperative_grid=True)
    except RuntimeError as e:  # e.g. SMs taken by a green context or MPS limit: the other paths
        if "cooperative" not in str(e).lower():
            raise
        return False
    return True


def forward(x: torch.Tensor, y: torch.Tensor, n_rows: int, n_cols: int, row_stride: int, scale_log2: float,
            log: bool, p: StagedPlan) -> bool:
    """``y`` (contiguous ``(n_rows, n_cols)``) = (log-)softmax of the rows of ``x`` (``row_stride``
    apart, unit column stride, ``stageable``), scores ``x * scale_log2`` in log2 units; False,
    nothing written, when the driver refused the cooperative launch."""
    parts = torch.empty((2, 2 * p.groups * p.splits), dtype=torch.float32, device=x.device)
    descs = (_view_descriptor(x, n_rows, n_cols, row_stride), _view_descriptor(y, n_rows, n_cols, n_cols))
    return _launch(staged_softmax_fwd_kernel, p, descs, (parts[0], parts[1]), n_rows, n_cols, x.element_size(),
                   scale_log2, log)


def backward(y: torch.Tensor, g: torch.Tensor, dx: torch.Tensor, n_rows: int, n_cols: int, scale: float, log: bool,
             p: StagedPlan) -> bool:
    """``dx`` of contiguous ``(n_rows, n_cols)`` ``y`` and ``g`` (one dtype), into contiguous ``dx``;
    False, nothing written, when the driver refused the cooperative launch."""
    part = torch.empty((2 * p.groups * p.splits,), dtype=torch.float32, device=y.device)
    descs = tuple(_view_descriptor(t, n_rows, n_cols, n_cols) for t in (y, g, dx))
    return _launch(staged_softmax_bwd_kernel, p, descs, (part,), n_rows, n_cols, y.element_size(), scale, log)
