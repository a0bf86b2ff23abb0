"""Which work a program does: its tile, its (batch, head), its sequence's rows.

One flat grid dimension everywhere (CUDA caps grid y/z at 65535), and the rows of a packed
(varlen) batch read from cu_seqlens -- clamped into the packed tensors, so no value of
cu_seqlens can move a read or write outside them.  Which key / query tiles a program visits
is ``flashtile/kernels/masking.py``'s.
"""

import functools

import numpy as np
import triton
import triton.language as tl

from flashtile.kernels.runtime import cdiv
from flashtile.masking import key_range, query_range


@triton.jit
def tile_and_head(seqlen, BLOCK: tl.constexpr, HEAVY_LAST: tl.constexpr):
    """Map the 1-D program id to (tile index, batch * head).

    One flat grid dimension: CUDA caps grid y/z at 65535, which batch * heads can exceed.
    Tiles of one head are adjacent so they share that head's K/V stream in L2.  With a
    causal-like mask later tiles have more work (HEAVY_LAST): they start first, so the
    longest programs do not run last on a half-empty GPU.
    """
    pid = tl.program_id(0)
    num_tiles = tl.cdiv(seqlen, BLOCK)
    tile = pid % num_tiles
    if HEAVY_LAST:
        tile = num_tiles - 1 - tile
    return tile, pid // num_tiles


@triton.jit
def dealt_tile(t, num_items, num_tiles, section_heads, SPREAD_HEADS: tl.constexpr, HEAVY_LAST: tl.constexpr):
    """Work item ``t`` of a persistent or flat grid -> (tile index, batch * head).

    Without a causal-like mask every tile of a head costs the same, and a head's tiles are
    adjacent (they share its K/V or Q/dO in L2).  With one (``SPREAD_HEADS``), the items are
    dealt tile by tile across the heads of a section of ``section_heads`` heads (the last
    section may be smaller), one section after the other, so that each head's tiles, dealt
    apart in time, still find its streamed tensors in L2.  The last section goes heaviest
    first -- the last query tiles (``HEAVY_LAST``, forward) or the first key tiles (backward)
    -- so the last wave is short, and the sections before it take turns going lightest-first
    and heaviest-first, so that the costs drawn by consecutive rounds of programs change
    smoothly across a section's end and the round-robin shares come out even.
    ``schedule()`` below picks ``section_heads`` on the host.
    """
    if SPREAD_HEADS:
        heads = num_items // num_tiles
        per_section = section_heads * num_tiles
        section = t // per_section
        first_head = section * section_heads
        in_section = tl.minimum(section_heads, heads - first_head)
        r = t - section * per_section
        tile = r // in_section
        num_sections = (heads + section_heads - 1) // section_heads
        heavy_first = (num_sections - 1 - section) % 2 == 0
        # Heaviest first is the tiles in reverse for the forward (heavy last), in order for the backward.
        reverse = heavy_first if HEAVY_LAST else heavy_first == 0
        tile = tl.where(reverse, num_tiles - 1 - tile, tile)
        return tile, first_head + r % in_section
    return t % num_tiles, t // num_tiles


@triton.jit
def clamped_span(CU, b, rows):
    # Sequence b's rows [start, end) clamped into the packed tensor's [0, rows): the host
    # checks cu_seqlens, but not under CUDA-graph capture or torch.compile tracing, and a
    # bad value must never turn into an out-of-bounds read or write.
    start = tl.minimum(tl.maximum(tl.load(CU + b), 0), rows)
    end = tl.minimum(tl.maximum(tl.load(CU + b + 1), start), rows)
    return start, end - start


@triton.jit
def sequence_bounds(CU_Q, CU_K, b, seqlen_q, seqlen_k, VARLEN: tl.constexpr):
    """(q_start, seqlen_q, k_start, seqlen_k) of batch entry ``b``.

    Dense: ``seqlen_q``/``seqlen_k`` are the lengths.  Packed: they are the packed tensors'
    row counts, and sequence ``b`` is read from cu_seqlens, clamped into them.
    """
    if VARLEN:
        q_start, seqlen_q = clamped_span(CU_Q, b, seqlen_q)
        k_start, seqlen_k = clamped_span(CU_K, b, seqlen_k)
        return q_start, seqlen_q, k_start, seqlen_k
    return 0, seqlen_q, 0, seqlen_k


# --- The causal schedule, on the host ------------------------------------------------------


def section_heads(streamed_bytes_per_head: int, heads: int, budget_bytes: int) -> int:
    """The most heads a causal schedule may deal across at a time: as many as keep the tensors
    streamed per head (a query tile's K and V, a key tile's Q and dO) within ``budget_bytes``
    of L2, at least one, at most ``heads``; a budget of 0 means all."""
    if budget_bytes <= 0 or streamed_bytes_per_head <= 0:
        return max(heads, 1)
    return max(1, min(heads, budget_bytes // streamed_bytes_per_head))


def _imbalance(costs, heads, section, programs):
    # The most loaded program's total over the mean, for the order ``dealt_tile`` gives and
    # programs taking items round-robin (``costs[i]``: query tile i's cost, heaviest last).
    num_tiles = len(costs)
    t = np.arange(num_tiles * heads)
    sec = t // (section * num_tiles)
    in_section = np.minimum(section, heads - sec * section)
    tile = (t - sec * section * num_tiles) // in_section
    num_sections = -(-heads // section)
    tile = np.where((num_sections - 1 - sec) % 2 == 0, num_tiles - 1 - tile, tile)
    w = np.asarray(costs, dtype=np.float64)[tile]
    load = np.bincount(t % programs, weights=w, minlength=programs)
    return load.max() * programs / w.sum()


# How many section sizes ``schedule`` compares: each costs a pass over all work items (about
# 2.5 ms for 65k items on a 2-core CI machine).
_MAX_CANDIDATES = 8


@functools.lru_cache(maxsize=256)
def schedule(costs: tuple, heads: int, programs: int, max_section: int, unit: int = 1) -> int:
    """``section_heads`` for a causal persistent grid of ``programs`` programs: among up to
    ``_MAX_CANDIDATES`` section sizes spread over ``max_section / 2 .. max_section`` heads (what
    fits in L2), multiples of ``unit`` where ``max_section`` allows (a GQA group's query heads,
    adjacent in the order, read one K and V), the one whose most loaded program carries the
    least by the cost model ``costs`` (per query tile, heaviest last: its key tiles plus one for
    the tile's fixed work); the largest of equals.  Evaluated once per shape: up to tens of
    milliseconds for the largest grids."""
    if max_section >= unit > 1:
        max_section -= max_section % unit
    else:
        unit = 1
    if heads <= 0 or not costs or len(costs) * heads <= programs or min(costs) == max(costs):
        return max(max_section, 1)  # one round, or equal items: nothing to even out
    low = max(unit, max_section // 2 // unit * unit)
    step = max(1, (max_section - low) // unit // (_MAX_CANDIDATES - 1)) * unit
    candidates = range(max_section, low - 1, -step)
    return min(candidates, key=lambda section: round(_imbalance(costs, heads, section, programs), 6))


def query_tile_costs(seqlen_q, seqlen_k, block_m, block_n, window_left, window_right) -> tuple:
    """Per query tile, the key tiles it visits (the band's ``key_range``, as the kernel's
    ``key_tiles`` rounds it) plus one for its fixed work (the query load, the first tile's
    unpipelined scores, the store): the cost model of the causal schedule."""
    costs = []
    for m0 in range(0, seqlen_q, block_m):
        lo, hi = key_range(m0, m0 + block_m, seqlen_q, seqlen_k, window_left, window_right)
        costs.append((cdiv(hi, block_n) - lo // block_n if hi > lo else 0) + 1)
    return tuple(costs)


@functools.lru_cache(maxsize=256)  # once per shape: a backward call would otherwise walk its key tiles
def key_tile_costs(seqlen_q, seqlen_k, block_m, block_n, window_left, window_right, group=1) -> tuple:
    """Per key tile of the backward, in the order :func:`schedule`'s model deals them (heaviest
    last): the query-tile steps that see it (the band's ``query_range``, as the kernels'
    ``query_tiles`` rounds it, for each of the ``group`` query heads) plus one for its fixed
    work (the K and V load, the dK and dV store)."""
    costs = []
    for n0 in range(0, seqlen_k, block_n):
        lo, hi = query_range(n0, n0 + block_n, seqlen_q, seqlen_k, window_left, window_right)
        costs.append((cdiv(hi, block_m) - lo // block_m if hi > lo else 0) * group + 1)
    # The backward deals a section's first key tiles (the heaviest) first where the forward
    # deals its last query tiles first: reversed, the same model holds.
    return tuple(reversed(costs))


@functools.lru_cache(maxsize=1024)
def work_schedule(heads, group, seqlen_q, seqlen_k, kv_row_bytes, block_m, block_n, window_left, window_right,
                  programs, l2_budget) -> int:
    """The Hopper forward's ``section_heads`` (``dealt_tile``) for ``heads`` (batch * heads)
    query heads in GQA groups of ``group``, K and V rows of ``kv_row_bytes`` each.  Causal-like
    (``window_right >= 0``): sections of at most the heads whose K and V fit in ``l2_budget``
    bytes (a group's query heads share theirs), sized by :func:`schedule` for
    ``programs`` persistent programs (0: one program per item)."""
    if window_right < 0:
        return heads
    max_section = section_heads(seqlen_k * kv_row_bytes // group, heads, l2_budget)
    if programs == 0:
        return max_section
    costs = query_tile_costs(seqlen_q, seqlen_k, block_m, block_n, window_left, window_right)
    return schedule(costs, heads, programs, max_section, group)
