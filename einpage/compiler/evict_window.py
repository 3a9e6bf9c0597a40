"""Which contiguous window of the arena to evict for a block that does not fit (the lowering's
`_make_room`, the thesis' simMallocOffld).

The arena's items lie by offset: free segments and live blocks. A window runs from an item to
the first item past which it spans the bytes needed, over items that are all evictable (free
bytes, or a block no reserved task pins) and adjacent (no gap between one's end and the next's
start); its cost is the policy's `combine` of its blocks' costs, in offset order. The cheapest
window wins, then the lowest offset. Two pointers walk each run of adjacent evictable items (a
window's right end never moves left as its left end moves right), and each window's costs are
a slice of one list, so the choice is that of trying every window in linear passes.
"""
from __future__ import annotations

from typing import Callable, Sequence


def cheapest_window(items: Sequence[tuple[int, int, int | None]], ok: Sequence[bool],
                    costs: Sequence[float], before: Sequence[int], need: int,
                    combine: Callable[[Sequence[float]], float]) -> tuple[int, int] | None:
    """The window `items[left:right + 1]` to evict for `need` bytes, as (left, right), or None
    where no run of evictable items spans them. `items`: (start, end, block or None for free
    bytes) by offset; `ok[k]`: item k may be evicted; `costs`: the evictable blocks' costs in
    offset order; `before[k]`: how many of them lie in `items[:k]` (`len(items) + 1` entries).
    An all-free window costs 0."""
    n = len(items)
    best = None
    left = 0
    while left < n:
        if not ok[left]:
            left += 1
            continue
        end = left  # the run of adjacent evictable items from `left`: [left, end]
        while end + 1 < n and ok[end + 1] and items[end + 1][0] == items[end][1]:
            end += 1
        right = left
        for lo in range(left, end + 1):
            start = items[lo][0]
            if right < lo:
                right = lo
            while right <= end and items[right][1] - start < need:
                right += 1
            if right > end:
                break  # later windows of the run start higher: none spans the size
            window = costs[before[lo]:before[right + 1]]
            key = (combine(window) if window else 0.0, start)
            if best is None or key < best[0]:
                best = (key, lo, right)
        left = end + 1
    return None if best is None else best[1:]
