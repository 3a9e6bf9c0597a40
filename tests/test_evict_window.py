"""`evict_window.cheapest_window` against trying every window of random arenas."""
from __future__ import annotations

import random

from einpage.compiler.evict_window import cheapest_window


def _brute(items, ok, costs, before, need, combine):
    best = None
    for lo in range(len(items)):
        for hi in range(lo, len(items)):
            if not all(ok[lo:hi + 1]) or any(items[k + 1][0] != items[k][1]
                                             for k in range(lo, hi)):
                break
            if items[hi][1] - items[lo][0] >= need:
                window = costs[before[lo]:before[hi + 1]]
                key = (combine(window) if window else 0.0, items[lo][0])
                if best is None or key < best[0]:
                    best = (key, lo, hi)
                break  # (the first item past which it spans the size)
    return None if best is None else best[1:]


def test_the_window_is_the_cheapest_of_every_window():
    rng = random.Random(0)
    found = 0
    for combine in (sum, max):
        for _ in range(2000):
            items, ok, costs, before, at = [], [], [], [0], 0
            for _ in range(rng.randint(0, 12)):
                at += rng.choice((0, 0, 0, rng.randint(1, 3)))  # gaps: not adjacent
                size = rng.randint(1, 6)
                block = None if rng.random() < 0.3 else len(items)
                items.append((at, at + size, block))
                at += size
                evictable = block is None or rng.random() < 0.8
                ok.append(evictable)
                if block is not None and evictable:
                    costs.append(rng.choice((0.5, 1.0, 2.0, rng.random())))
                before.append(len(costs))
            need = rng.randint(1, 15)
            got = cheapest_window(items, ok, costs, before, need, combine)
            assert got == _brute(items, ok, costs, before, need, combine)
            found += got is not None
    assert found > 500  # (both answers occur)
