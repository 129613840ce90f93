"""Selected-key attention (longdoc.parallel.selection) with tiles of a few rows, so that every branch of
selection.tiles runs: tiles past a block's first row (r0 > 0) in causal squares (the causal offset) and in band
blocks (the band shifted into the tile's coordinates, a window's lower edge included). The production bound
(MASK_ELEMENTS) makes every test block one tile. Against the float64 reference, both layouts and strategies."""

from __future__ import annotations

import pytest

import longdoc
from tests.support.cp_reference import PATTERNS, check_cases, pattern_cases, run_pattern_case
from tests.support.distributed import run_ranks
from tests.support.small_tiles import small_tiles


def _cases(rank: int, world_size: int) -> tuple[list, dict]:
    factory = lambda layout: longdoc.ContextParallel(layout=layout, timeout=60)  # noqa: E731
    results, seen = [], {}
    # 16 cells: tiles of 1-2 rows (the band blocks here are 3-4 x 3-4); 60: 2-3 rows of the wide blocks
    for mask in (16, 60):
        with small_tiles(mask=mask) as counted:
            for i, case in enumerate(c for c in pattern_cases() if "selected" in PATTERNS[c[0]]):
                results.append((case, run_pattern_case(factory, case, seed=3000 + i, world_size=world_size)))
        seen[mask] = dict(counted)
    return results, seen


@pytest.mark.parametrize("world_size", [2, 3])
def test_selected_keys_in_small_tiles_match_reference(world_size):
    for results, seen in run_ranks(world_size, _cases, deadline=600):
        check_cases(results, world_size)
        assert seen[16].get("band_lo", 0) > 0 and all(c.get("causal", 0) > 0 for c in seen.values()), seen
