"""The work schedules of ``flashtile/kernels/tile_info.py``, run as kernels (the interpreter on the
CPU): every work item lands on exactly one (tile, head); a causal schedule deals the heads
in L2-sized sections, the last one heaviest tile first and the ones before it alternating;
and the host's choice of section evens out the programs' loads."""

import pytest
import torch
import triton
import triton.language as tl

from flashtile.kernels.tile_info import _imbalance, dealt_tile, key_tile_costs, schedule, section_heads
from flashtile.masking import visible

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _deal(OUT, num_items, num_tiles, section, SPREAD_HEADS: tl.constexpr, HEAVY_LAST: tl.constexpr):
    t = tl.program_id(0)
    tile, bh = dealt_tile(t, num_items, num_tiles, section, SPREAD_HEADS, HEAVY_LAST)
    tl.store(OUT + 2 * t, tile)
    tl.store(OUT + 2 * t + 1, bh)


def deal(num_tiles, heads, section, spread, heavy_last):
    num_items = num_tiles * heads
    out = torch.full((num_items, 2), -1, dtype=torch.int32, device=DEVICE)
    _deal[(num_items,)](out, num_items, num_tiles, section, spread, heavy_last)
    return [tuple(row) for row in out.cpu().tolist()]


@pytest.mark.parametrize("num_tiles,heads,section", [(1, 1, 1), (3, 7, 3), (8, 16, 5), (5, 4, 4), (4, 6, 100)])
@pytest.mark.parametrize("heavy_last", [True, False])
def test_causal_schedule_visits_every_tile_once_section_by_section(num_tiles, heads, section, heavy_last):
    order = deal(num_tiles, heads, section, True, heavy_last)
    assert sorted(order) == [(t, h) for t in range(num_tiles) for h in range(heads)]
    sections = [h // section for _, h in order]
    assert sections == sorted(sections), "a section's items come after all of the one before"
    num_sections = max(sections) + 1
    for s in range(num_sections):
        tiles = [t for t, h in order if h // section == s]
        assert len(tiles) == num_tiles * min(section, heads - s * section)
        # The last section heaviest first -- the last query tiles (forward) or the first key
        # tiles (backward) -- and the ones before it alternating.
        heavy_first = (num_sections - 1 - s) % 2 == 0
        assert tiles == sorted(tiles, reverse=heavy_last == heavy_first)


def test_uniform_schedule_keeps_a_heads_tiles_adjacent():
    assert deal(6, 5, 2, False, True) == [(t, h) for h in range(5) for t in range(6)]


def test_section_heads_fill_the_budget():
    assert section_heads(512 << 10, 256, 25 << 20) == 50
    assert section_heads(64 << 20, 16, 25 << 20) == 1  # one head's tensors exceed the budget
    assert section_heads(1, 16, 25 << 20) == 16  # never more than the heads
    assert section_heads(512 << 10, 256, 0) == 256  # no budget: all heads at once


def _loads(order, costs, programs):
    # The programs' loads when program p runs items p, p + programs, ... (the persistent grid).
    load = [0] * programs
    for t, (tile, _) in enumerate(order):
        load[t % programs] += costs[tile]
    return load


@pytest.mark.parametrize("num_tiles,heads,max_section,block_ratio",
                         [(8, 256, 50, 1), (32, 64, 12, 1), (128, 16, 3, 1), (16, 64, 12, 2), (128, 8, 1, 2)])
def test_schedule_evens_out_the_programs(num_tiles, heads, max_section, block_ratio):
    # Causal, d = 128 (block_ratio 1) and d = 256 (64-key tiles: 2): tile i visits (i + 1) * ratio key tiles.
    costs = tuple((i + 1) * block_ratio + 1 for i in range(num_tiles))
    programs = 132
    section = schedule(costs, heads, programs, max_section)
    assert max(1, max_section // 2) <= section <= max_section
    load = _loads(deal(num_tiles, heads, section, True, True), costs, programs)
    imbalance = max(load) * programs / sum(load)
    assert _imbalance(costs, heads, section, programs) == pytest.approx(imbalance)
    # The planner compares a few sizes of the range: its pick is within 2 % of the range's best.
    candidates = range(max(1, max_section // 2), max_section + 1)
    assert imbalance <= min(_imbalance(costs, heads, s, programs) for s in candidates) + 0.02
    assert imbalance < 1.05
    # Dealing heaviest-first in every section instead is what the alternation fixes here.
    if (num_tiles, heads) == (128, 8):
        assert _imbalance_heaviest_first_everywhere(costs, heads, section, programs) > 1.5


def _imbalance_heaviest_first_everywhere(costs, heads, section, programs):
    num_tiles, load = len(costs), [0] * programs
    for t in range(num_tiles * heads):
        sec = t // (section * num_tiles)
        tile = num_tiles - 1 - (t - sec * section * num_tiles) // min(section, heads - sec * section)
        load[t % programs] += costs[tile]
    return max(load) * programs / sum(load)


@pytest.mark.parametrize("max_section,unit", [(50, 8), (12, 4), (7, 8), (33, 1)])
def test_schedule_keeps_gqa_groups_whole(max_section, unit):
    # A section of whole groups: the query heads that share one K and V stay in one section.
    costs = tuple(range(2, 34))
    section = schedule(costs, 64, 132, max_section, unit)
    if max_section >= unit:
        assert section % unit == 0 and max_section // 2 - unit < section <= max_section
    else:
        assert 1 <= section <= max_section


@pytest.mark.parametrize("seqlen_q,seqlen_k,left,right", [
    (1000, 1000, -1, 0), (300, 1000, -1, 0), (1000, 130, -1, 0), (700, 900, 100, 37), (200, 2000, 100, 0),
    (17, 17, -1, -1),
])
def test_key_tile_costs_count_the_query_tiles_that_see_each_key_tile(seqlen_q, seqlen_k, left, right):
    block_m, block_n, group = 64, 128, 3
    costs = key_tile_costs(seqlen_q, seqlen_k, block_m, block_n, left, right, group)
    i = torch.arange(seqlen_q)[:, None]
    j = torch.arange(seqlen_k)[None, :]
    seen = visible(i, j, seqlen_q, seqlen_k, left, right)
    expected = []
    for n0 in range(0, seqlen_k, block_n):
        rows = seen[:, n0:n0 + block_n].any(1).nonzero().flatten().tolist()
        # The kernels walk the query tiles from the first row that sees the tile to the last.
        tiles = len(range(rows[0] // block_m, rows[-1] // block_m + 1)) if rows else 0
        expected.append(tiles * group + 1)
    assert costs == tuple(reversed(expected))  # heaviest last, as schedule's model deals them


def test_the_backward_order_is_the_model_of_the_reversed_key_tile_costs():
    # dealt_tile deals a backward section's first key tiles first where the forward deals its
    # last query tiles first: schedule's model of the reversed costs is the backward's load.
    costs_by_tile = tuple(reversed(key_tile_costs(4096, 4096, 64, 128, -1, 0)))  # key tile order
    num_tiles, heads, programs = len(costs_by_tile), 24, 132
    for section in (24, 13, 7):
        load = _loads(deal(num_tiles, heads, section, True, False), costs_by_tile, programs)
        modelled = _imbalance(tuple(reversed(costs_by_tile)), heads, section, programs)
        assert max(load) * programs / sum(load) == pytest.approx(modelled)
