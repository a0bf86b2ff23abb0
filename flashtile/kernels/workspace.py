"""Scratch memory that one launch fills and the same or the next launch on its stream consumes.

A decoding step's split kernel leaves partial outputs that its own last programs (or the
combine kernel launched right after it) merge; the memory is dead once that launch is done.
Allocating it at every step costs one ``torch.empty`` (several microseconds of host time on
a GPU host, against a step of a few tens), so each (device, stream) keeps one scratch that
grows to the largest request and is reused: launches on one stream run in order, so a step
never overwrites what an earlier step still reads.

The counters of the in-kernel merge live here too, zeroed once at allocation: every launch
that counts leaves them zeroed (the last program of each tile resets its counter).

So does the sink, where a launch writes an output its caller drops (the LSE of a decoding
step without ``return_lse``, or of a forward that records no autograd): the kernels take
the LSE's strides from their plan and only its base from the tensor, so one buffer as large
as the largest such LSE serves every call on the stream.

While the current stream captures a CUDA graph, a caller asks for fresh tensors (the
graph's own memory, the counters zeroed by a node of the graph), so a graph replayed on any
stream never shares scratch with eager launches.  While torch.compile traces, the caller
allocates instead (tensors of the traced graph).
"""

from __future__ import annotations

import torch

# (device index, raw stream handle) -> _Scratch; bounded (cleared when full: a freed scratch
# is returned to torch's allocator on the stream that allocated it, so in-flight launches stay
# ordered before any reuse of its memory).
_MAX_STREAMS = 64
_scratch: dict = {}
# The current stream's raw handle and capture state, torch's C getters (what Triton's launcher
# uses too); a CPU-only build of torch has neither (nothing here runs there).
_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)


class _Scratch:
    """One stream's scratch: ``floats`` (float32, contents undefined), ``counters`` (int32,
    zero between launches), ``sink`` (float32, written and never read: an output the caller
    does not want); ``n_*`` their sizes."""

    __slots__ = ("floats", "counters", "sink", "n_floats", "n_counters", "n_sink")

    def __init__(self, device: torch.device, n_floats: int, n_counters: int, n_sink: int):
        self.n_floats, self.n_counters, self.n_sink = n_floats, n_counters, n_sink
        self.floats = torch.empty(n_floats, dtype=torch.float32, device=device)
        self.counters = torch.zeros(n_counters, dtype=torch.int32, device=device)
        self.sink = torch.empty(n_sink, dtype=torch.float32, device=device)


def capturing() -> bool:
    """Whether the current CUDA stream captures a graph (torch's C query, ~0.1 us)."""
    return _capturing()


def scratch(device: torch.device, n_floats: int, n_counters: int, n_sink: int, fresh: bool = False) -> _Scratch:
    """The scratch of the current stream of ``device`` (a CUDA device with its index), at least
    as large as asked: the launch it is for must leave ``counters`` zero.  ``fresh``: the
    current stream captures a graph (:func:`capturing`, asked by the caller), so new tensors."""
    if fresh:
        return _Scratch(device, n_floats, n_counters, n_sink)
    index = device.index
    key = (index, _current_stream(index))
    held = _scratch.get(key)
    if held is None or held.n_floats < n_floats or held.n_counters < n_counters or held.n_sink < n_sink:
        if held is not None:
            n_floats, n_counters = max(n_floats, held.n_floats), max(n_counters, held.n_counters)
            n_sink = max(n_sink, held.n_sink)
        elif len(_scratch) >= _MAX_STREAMS:
            _scratch.clear()
        held = _scratch[key] = _Scratch(device, n_floats, n_counters, n_sink)
    return held


def clear() -> None:
    """Release every held scratch (to torch's caching allocator)."""
    _scratch.clear()
