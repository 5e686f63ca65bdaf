"""The boxes a read crosses are found by bisection on the step's table, and never one too few: for any
tiling of a tensor (FSDP's rows, TP's columns, both, uneven, repeated boxes), the fragments found for a box
are exactly those that overlap it once intersected, whatever order the table lists them in."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from ckptstage.client import shards
from ckptstage.client.fragments import Boxes


def _cuts(total: int) -> st.SearchStrategy[list[int]]:
    """Sorted cut points 0 = c0 < ... < cn = total (zero-length pieces allowed, as an uneven shard has)."""
    return st.lists(st.integers(0, total), max_size=6).map(lambda xs: sorted({0, total, *xs}))


@st.composite
def tiling_and_box(draw: st.DrawFn) -> tuple[list[list[object]], shards.Box]:
    rows, cols = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    row_cuts, col_cuts = draw(_cuts(rows)), draw(_cuts(cols))
    table: list[list[object]] = []
    for i, (r0, r1) in enumerate(zip(row_cuts, row_cuts[1:])):
        for j, (c0, c1) in enumerate(zip(col_cuts, col_cuts[1:])):
            table.append([i * 10 + j, 0, [r0, c0], [r1 - r0, c1 - c0]])
    table = draw(st.permutations(table))
    b0, b1 = draw(st.integers(0, rows - 1)), draw(st.integers(0, cols - 1))
    size = (draw(st.integers(1, rows - b0)), draw(st.integers(1, cols - b1)))
    return table, ((b0, b1), size)


@settings(max_examples=300, deadline=None)
@given(tiling_and_box())
def test_the_fragments_crossing_a_box_are_all_that_overlap_it(case: tuple[list[list[object]], shards.Box]) -> None:
    table, box = case
    boxes = Boxes(table)
    overlapping = {f: part for f in boxes.all() if (part := shards.overlap(box, (f.origin, f.shape))) is not None}
    found = {f for f in boxes.crossing(box) if shards.overlap(box, (f.origin, f.shape)) is not None}
    assert found == set(overlapping)
    assert sum(math.prod(part[1]) for part in overlapping.values()) == math.prod(box[1])  # tiled exactly once


def test_a_thousand_row_shards_yield_the_two_a_box_straddles() -> None:
    table = [[r, 0, [r * 4, 0], [4, 16]] for r in range(1024)]
    crossing = Boxes(table).crossing(((5 * 4 + 2, 0), (4, 16)))
    assert sorted(f.rank for f in crossing) == [5, 6]
