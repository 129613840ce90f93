"""Tiny tiles for the selected-key and DSA paths, inside spawned ranks: the production tile bounds
(selection.MASK_ELEMENTS, dsa.SCORE_ELEMENTS) are far above the tests' sizes, so without this every block is one
tile and the r0 > 0 branches of selection.tiles (band shift, causal offset) and dsa._select never run.

    with small_tiles() as seen:      # seen: which branches of selection.tiles ran, counted
        ... run the CP case ...
    assert seen["causal"] and seen["band"]
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

MASK = 40  # bool cells per selected-key tile: 2-5 rows of a test block
SCORE = 96  # index scores per DSA query tile: 1-3 queries of a test row


@contextlib.contextmanager
def small_tiles(mask: int = MASK, score: int = SCORE) -> Iterator[Counter]:
    """Shrink both tile bounds and count the tiles selection.tiles emits past a block's first row (r0 > 0): "rows"
    every such tile, "causal" in a causal-square block, "band" / "band_lo" in a band block (any edge / a window's
    lower edge); and "dsa": DSA query tilings narrower than their row (a run's queries cut into several tiles)."""
    from longdoc.hf.kinds import dsa
    from longdoc.parallel import selection

    seen: Counter = Counter()
    tiles, tile_rows = selection.tiles, dsa._tile_rows

    def counted(blk, selected, cols_pos, seq_len):
        out = tiles(blk, selected, cols_pos, seq_len)
        for rows, _, _ in out:
            if rows.start > blk.rows.start:
                seen["rows"] += 1
                seen["causal"] += blk.causal
                seen["band"] += blk.band is not None
                seen["band_lo"] += blk.band is not None and blk.band[0] is not None
        return out

    def rows(heads, batch, row_len):
        step = tile_rows(heads, batch, row_len)
        seen["dsa"] += step < row_len
        return step

    saved = selection.MASK_ELEMENTS, dsa.SCORE_ELEMENTS
    selection.MASK_ELEMENTS, dsa.SCORE_ELEMENTS = mask, score
    selection.tiles, dsa._tile_rows = counted, rows
    try:
        yield seen
    finally:
        selection.MASK_ELEMENTS, dsa.SCORE_ELEMENTS = saved
        selection.tiles, dsa._tile_rows = tiles, tile_rows
