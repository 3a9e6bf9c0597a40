"""The arena allocator against a direct statement of its rule, on random sequences of operations.

The allocator keeps runs, an upper bound on the longest run and a sliding-window maximum, all to
be fast; the model below keeps only the stamped free segments and tries every placement, so any
shortcut that changes a placement, a dependency or the free bytes shows up as a difference.
"""
from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from einpage.compiler import Allocator, aligned, allocator

ARENA = 24 * 256


class Model:
    """Free bytes as a map from 256-byte slot to its stamp; a placement starts at a segment
    start (a free slot whose left neighbour is used or stamped differently) and is scored by
    (newest stamp it covers, offset)."""

    def __init__(self, start: int, end: int):
        self.slots = {o: None for o in range(start, end, 256)}

    def allocate(self, size: int):
        size = aligned(max(size, 1))
        best = None
        for at in sorted(self.slots):
            left = at - 256
            if left in self.slots and self.slots[left] == self.slots[at]:
                continue  # not the start of a segment
            cover = range(at, at + size, 256)
            if not all(o in self.slots for o in cover):
                continue
            newest = max(-1 if self.slots[o] is None else self.slots[o] for o in cover)
            if best is None or (newest, at) < best[0]:
                best = ((newest, at), at)
        if best is None:
            return None
        at = best[1]
        deps = {self.slots[o] for o in range(at, at + size, 256)} - {None}
        for o in range(at, at + size, 256):
            del self.slots[o]
        return at, tuple(sorted(deps))

    def free(self, at: int, size: int, stamp: int) -> None:
        for o in range(at, at + aligned(max(size, 1)), 256):
            self.slots[o] = stamp


ops = st.lists(st.tuples(st.sampled_from(["alloc", "alloc", "free", "free", "rollback"]),
                         st.integers(1, 6 * 256), st.integers(0, 10**6)), max_size=80)


@settings(max_examples=500, deadline=None)
@given(ops)
def test_allocator_matches_the_model(script):
    _check(script)


@pytest.mark.parametrize("short", [allocator.SHORT_SPANS, 0])
def test_the_search_by_threshold_matches_the_model(short):
    """The array search `allocate` takes over many free segments, taken at every count, with
    its windows' newest stamps taken span step by span step and (`short` 0) from the sparse
    table."""
    @settings(max_examples=500, deadline=None)
    @given(ops)
    def check(script):
        _check(script)

    many, spans = allocator.MANY_SEGMENTS, allocator.SHORT_SPANS
    allocator.MANY_SEGMENTS, allocator.SHORT_SPANS = 0, short
    try:
        check()
    finally:
        allocator.MANY_SEGMENTS, allocator.SHORT_SPANS = many, spans


def _check(script) -> None:
    alloc, model = Allocator(256, ARENA), Model(256, ARENA)
    live: list = []
    stamp = 0
    for op, size, pick in script:
        if op == "alloc":
            got, want = alloc.allocate(size), model.allocate(size)
            assert (None if got is None else (got.offset, got.deps)) == want
            if got is not None:
                live.append(got)
        elif live:
            a = live.pop(pick % len(live))
            if op == "free":
                stamp += 1
                alloc.free(a.offset, a.size, stamp)
                model.free(a.offset, a.size, stamp)
            else:  # return the bytes with the stamps they had
                alloc.rollback(a)
                for lo, hi, st_ in a.pieces:
                    for o in range(lo, hi, 256):
                        model.slots[o] = st_
        assert alloc.free_bytes == 256 * len(model.slots)
        free = sorted(model.slots)
        runs = []
        for o in free:
            if runs and runs[-1][1] == o:
                runs[-1][1] = o + 256
            else:
                runs.append([o, o + 256])
        assert alloc.segments() == [tuple(r) for r in runs]


def test_a_failed_allocation_is_remembered_until_a_free_makes_room():
    alloc = Allocator(0, 4 * 256)
    a = alloc.allocate(256)
    b = alloc.allocate(256)
    alloc.allocate(256)
    alloc.free(a.offset, a.size, 1)
    assert alloc.allocate(2 * 256) is None   # two free slots, not adjacent
    alloc.free(b.offset, b.size, 2)
    got = alloc.allocate(2 * 256)             # now [0, 512) is one run
    assert got is not None and got.offset == 0 and got.deps == (1, 2)


def test_equal_newest_stamps_go_to_the_lowest_offset():
    alloc = Allocator(0, 4 * 256)
    a, b, c = (alloc.allocate(256) for _ in range(3))
    alloc.allocate(256)  # a fence at the end
    for block, stamp in ((a, 3), (b, 5), (c, 2)):
        alloc.free(block.offset, block.size, stamp)
    got = alloc.allocate(2 * 256)  # at 0 the newest is 5, at 256 too: the lower offset wins
    assert (got.offset, got.deps) == (0, (3, 5))
    got = alloc.allocate(256)      # the oldest stamp left is the slot freed by 2
    assert (got.offset, got.deps) == (512, (2,))


def test_a_window_that_starts_older_but_ties_at_its_newest_loses_to_the_lower_offset():
    """Stamps 3, 5, 2, 5: two slots at 0 cover 3 and 5, at 512 cover 2 and 5. Both windows'
    newest is 5 (the one at 512 starts with an older stamp, so it is measured): 0 wins."""
    alloc = Allocator(0, 5 * 256)
    blocks = [alloc.allocate(256) for _ in range(5)]
    for block, stamp in zip(blocks, (3, 5, 2, 5)):  # the fifth stays: a fence at the end
        alloc.free(block.offset, block.size, stamp)
    got = alloc.allocate(2 * 256)
    assert (got.offset, got.deps) == (0, (3, 5))


def test_lowest_placement_packs_what_placement_by_stamp_would_split():
    """Four free segments freed at different times: by stamp, a 512-byte block goes where the
    newest free is oldest (the middle), leaving no room for two more; packed from below, all
    three fit (the lowering's last resort before a budget error)."""
    a = Allocator(0, 1536)
    a.take(0, 1536)
    for lo, hi, stamp in ((0, 256, 10), (256, 768, 16), (768, 1280, 14), (1280, 1536, 11)):
        a.free(lo, hi - lo, stamp)
    assert a.allocate(512).offset == 768  # the oldest newest stamp
    assert a.allocate(512).offset == 0
    assert a.allocate(512) is None
    b = Allocator(0, 1536)
    b.take(0, 1536)
    for lo, hi, stamp in ((0, 256, 10), (256, 768, 16), (768, 1280, 14), (1280, 1536, 11)):
        b.free(lo, hi - lo, stamp)
    got = [b.allocate_lowest(512) for _ in range(3)]
    assert [g.offset for g in got] == [0, 512, 1024]
    assert got[1].deps == (14, 16) and b.free_bytes == 0


def test_a_run_made_again_is_searched_again():
    """`allocate` remembers each run's best window per size until the run changes. The run at
    512 (stamps 9 and 10) is searched and not chosen; a free joins it to the run before it,
    768 is taken and freed untouched while they are joined, and a take splits the run at 512
    off again: searched anew, its best window is the untouched 768, not 512."""
    alloc = Allocator(0, 4 * 256)
    blocks = [alloc.allocate(256) for _ in range(4)]
    for block, stamp in zip(blocks[:1] + blocks[2:], (1, 9, 10)):
        alloc.free(block.offset, block.size, stamp)
    assert alloc.allocate(256).offset == 0   # the oldest: 1 (the run at 512 searched too)
    alloc.free(256, 256, 3)                  # [256, 1024): joined to the run at 512
    alloc.take(768, 256)                     # (changed while joined)
    alloc.free(768, 256, None)
    alloc.take(256, 256)                     # the run at 512 again
    got = alloc.allocate(256)
    assert (got.offset, got.deps) == (768, ())
