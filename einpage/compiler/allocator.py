"""Offsets in one device arena.

Free bytes are kept as sorted, non-overlapping segments, each stamped with the memgraph node that
freed it (or `NEVER`: never used, older than every node). Adjacent segments coalesce for fitting
but keep their stamps, so an allocation returns exactly the nodes that last touched its bytes:
the new writer depends on them. Among the ranges that fit, the one whose stamps are oldest is
chosen (its dependency stalls the pipeline least); ties go to the lowest offset.

The maximal runs of adjacent free bytes are kept as well, with an upper bound on the longest, so
an allocation looks only at the runs it fits in and one that cannot fit fails at once: the
lowering asks the allocator about a million times for a large graph. Each run's best window for
a size is remembered until the run changes.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from einpage.ir.memgraph import ALIGNMENT


#: The stamp of bytes no node has used: older than every node id
NEVER = -1
_ABOVE = 1 << 62  # ... and a key newer than every one

#: Beyond this many free segments `allocate` searches by threshold over arrays
#: (`Allocator._allocate_many`), below it with a sliding window in Python
MANY_SEGMENTS = 512
#: `Allocator._allocate_many` takes the maximum over windows of at most this many segments step
#: by step, over wider ones from a sparse table
SHORT_SPANS = 8


def aligned(n: int, alignment: int = ALIGNMENT) -> int:
    return -(-n // alignment) * alignment


@dataclass(frozen=True, slots=True)
class Allocation:
    offset: int
    size: int
    deps: tuple[int, ...]  # nodes that last touched these bytes
    pieces: tuple[tuple[int, int, int | None], ...]  # the free segments consumed, for rollback


class Allocator:
    def __init__(self, start: int, end: int):
        self.start, self.end = start, end
        empty = end <= start
        # parallel sorted lists: segment starts, ends, stamps (-1: never used)
        self._lo: list[int] = [] if empty else [start]
        self._hi: list[int] = [] if empty else [end]
        self._key: list[int] = [] if empty else [NEVER]
        # maximal runs of adjacent segments: sorted starts and ends
        self._run_lo: list[int] = [] if empty else [start]
        self._run_hi: list[int] = [] if empty else [end]
        self._free = max(0, end - start)
        self._max_run: int | None = None  # an upper bound on the longest run (None: unknown)
        # run start -> {size: the run's best window for it (`_run_best`)}, dropped as the run
        # changes
        self._memo: dict[int, dict[int, tuple[int, int]]] = {}

    @property
    def free_bytes(self) -> int:
        return self._free

    def free_segments(self) -> list[tuple[int, int]]:
        """The free byte ranges as kept, one per stamp, in address order (adjacent ones not
        coalesced)."""
        return list(zip(self._lo, self._hi))

    def segments(self) -> list[tuple[int, int]]:
        """The free byte ranges, coalesced, in address order."""
        return list(zip(self._run_lo, self._run_hi))

    def allocate(self, size: int) -> Allocation | None:
        """Place `size` bytes at the start of a free segment: the placement whose newest stamp
        is oldest, then the lowest offset: the best of each run that fits (`_run_best`),
        remembered per run and size until the run changes (a take or a free changes one run or
        joins two or three; a fragmented arena keeps a hundred runs, and the lowering asks for
        the same few block sizes again and again: llama3.2-1b prefill at B=16 and 2.6 GB, its
        allocator 1.67 -> 1.11 s a lowering, the same placements)."""
        size = aligned(max(size, 1))
        if size > self._free or (self._max_run is not None and size > self._max_run):
            return None
        lo = self._lo
        if len(lo) > MANY_SEGMENTS:  # the windows to slide: the segments of the runs that fit
            fit = sum(bisect.bisect_left(lo, b) - bisect.bisect_left(lo, a)
                      for a, b in zip(self._run_lo, self._run_hi) if b - a >= size)
            if fit > MANY_SEGMENTS:
                return self._allocate_many(size)
        best_key, best_at = _ABOVE, -1  # no window yet
        largest = 0
        memo = self._memo
        for run_lo, run_hi in zip(self._run_lo, self._run_hi):
            if run_hi - run_lo > largest:
                largest = run_hi - run_lo
            if run_hi - run_lo < size:
                continue
            known = memo.get(run_lo)
            if known is None:
                known = memo[run_lo] = {}
            got = known.get(size)
            if got is None:
                got = known[size] = self._run_best(run_lo, run_hi, size)
            if got[0] < best_key:
                # untouched bytes (-1) are the least key possible, at the lowest offset that
                # has it: the best
                if got[0] < 0:
                    return self.take(got[1], size)
                best_key, best_at = got
        if best_at < 0:
            self._max_run = largest  # taking bytes only shrinks runs; a free updates this
            return None
        return self.take(best_at, size)

    def _run_best(self, run_lo: int, run_hi: int, size: int) -> tuple[int, int]:
        """The window of the run [run_lo, run_hi) (`size` bytes or more) whose newest stamp is
        oldest, then the lowest: (its newest stamp, its offset). The windows slide right (the
        window of the segment at s covers segments [s, m), m never moving left); most cover one
        segment, so each window's newest is a slice's maximum, and a window whose first stamp
        is no older than the best so far is passed over unmeasured."""
        lo, key = self._lo, self._key
        n = len(lo)
        last = run_hi - size  # the last offset in the run where `size` bytes fit
        best_key, best_at = _ABOVE, -1
        s = m = bisect.bisect_left(lo, run_lo)
        while s < n:
            at = lo[s]
            if at > last:
                break
            if key[s] < best_key:
                end = at + size  # (m reaches past s: lo[s] < end)
                while m < n and lo[m] < end:
                    m += 1
                newest = key[s] if m == s + 1 else max(key[s:m])
                if newest < best_key:
                    if newest < 0:  # (the least key possible)
                        return newest, at
                    best_key, best_at = newest, at
            s += 1
        return best_key, best_at

    def _allocate_many(self, size: int) -> Allocation | None:
        """`allocate` over many free segments, in array passes: each candidate window (a
        segment start whose `size` bytes stay inside its run) covers segments [s, m); its
        newest stamp is the maximum of the stamps [s, m): taken one span step at a time where
        the widest window covers at most SHORT_SPANS segments (most cover one), else answered
        from a sparse table of the stamps (the maxima of every power-of-two span, O(n log n) to
        build, two lookups a query). The least key at the lowest offset is the first minimum
        in address order: the sliding window's choice."""
        lo = np.array(self._lo, dtype=np.int64)
        stamp = np.array(self._key, dtype=np.int64)
        run_lo = np.array(self._run_lo, dtype=np.int64)
        run_hi = np.array(self._run_hi, dtype=np.int64)
        run = np.searchsorted(run_lo, lo, side="right") - 1  # the run of each segment
        end = lo + size
        ok = end <= run_hi[run]
        if not ok.any():
            self._max_run = int((run_hi - run_lo).max())  # a free updates this
            return None
        starts = np.flatnonzero(ok)
        stop = np.searchsorted(lo, end[starts], side="left")  # window of start s: [s, stop)
        span = stop - starts
        widest = int(span.max())
        if widest <= SHORT_SPANS:
            newest = stamp[starts]
            for step in range(1, widest):
                more = np.flatnonzero(span > step)
                newest[more] = np.maximum(newest[more], stamp[starts[more] + step])
        else:
            levels = widest.bit_length()  # spans 2^k for k < levels
            table = np.full((levels, len(stamp)), NEVER, dtype=np.int64)  # row k: the newest
            table[0] = stamp                                              # of [i, i + 2^k)
            for k in range(1, levels):
                half = 1 << (k - 1)
                np.maximum(table[k - 1, :-half], table[k - 1, half:], out=table[k, :-half])
            k = np.log2(span).astype(np.int64)  # exact for spans below 2^53
            newest = np.maximum(table[k, starts], table[k, stop - (1 << k)])
        return self.take(int(lo[starts[int(np.argmin(newest))]]), size)

    def allocate_lowest(self, size: int) -> Allocation | None:
        """Place `size` bytes at the lowest offset where they fit (first fit, stamps ignored):
        the packing that leaves the largest run free above it, for when `allocate`'s choice by
        stamp would split the room a set of blocks needs together."""
        size = aligned(max(size, 1))
        if size > self._free or (self._max_run is not None and size > self._max_run):
            return None
        for run_lo, run_hi in zip(self._run_lo, self._run_hi):
            if run_hi - run_lo >= size:
                return self.take(run_lo, size)
        # taking bytes only shrinks runs; a free updates this
        self._max_run = max((hi - lo for lo, hi in zip(self._run_lo, self._run_hi)), default=0)
        return None

    def take(self, at: int, size: int) -> Allocation:
        """Claim [at, at+size), which must be free."""
        size = aligned(max(size, 1))
        end = at + size
        lo_, hi_ = self._lo, self._hi
        k = bisect.bisect_right(lo_, at) - 1
        if k >= 0 and hi_[k] >= end:  # (the common case: within one segment)
            lo, hi, st = lo_[k], hi_[k], self._key[k]
            if lo < at and end < hi:
                hi_[k] = at
                lo_.insert(k + 1, end), hi_.insert(k + 1, hi), self._key.insert(k + 1, st)
            elif lo < at:
                hi_[k] = at
            elif end < hi:
                lo_[k] = end
            else:
                del lo_[k], hi_[k], self._key[k]
            self._take_run(at, end)
            if st == NEVER:
                return Allocation(at, size, (), ((at, end, None),))
            return Allocation(at, size, (st,), ((at, end, st),))
        return self._take_pieces(at, size)

    def _take_run(self, at: int, end: int) -> None:
        """[at, end) leaves the run of free bytes that holds it."""
        run_lo, run_hi = self._run_lo, self._run_hi
        r = bisect.bisect_right(run_lo, at) - 1
        lo, hi = run_lo[r], run_hi[r]
        self._memo.pop(lo, None)
        if lo < at and end < hi:
            run_hi[r] = at
            run_lo.insert(r + 1, end), run_hi.insert(r + 1, hi)
        elif lo < at:
            run_hi[r] = at
        elif end < hi:
            run_lo[r] = end
        else:
            del run_lo[r], run_hi[r]
        self._free -= end - at

    def _take_pieces(self, at: int, size: int) -> Allocation:
        """`take` across several free segments."""
        deps, pieces = set(), []
        k = bisect.bisect_right(self._lo, at) - 1
        new_lo, new_hi, new_stamp = [], [], []
        end = at + size
        j = max(k, 0)
        while j < len(self._lo) and self._lo[j] < end:
            lo, hi, st = self._lo[j], self._hi[j], self._key[j]
            cut_lo, cut_hi = max(lo, at), min(hi, end)
            if st == NEVER:
                pieces.append((cut_lo, cut_hi, None))
            else:
                pieces.append((cut_lo, cut_hi, st))
                deps.add(st)
            if lo < cut_lo:
                new_lo.append(lo); new_hi.append(cut_lo); new_stamp.append(st)
            if cut_hi < hi:
                new_lo.append(cut_hi); new_hi.append(hi); new_stamp.append(st)
            j += 1
        covered = sum(h - l for l, h, _ in pieces)
        if k < 0 or covered != size:
            raise RuntimeError(f"allocator: [{at}, {end}) is not free")
        self._lo[k:j], self._hi[k:j], self._key[k:j] = new_lo, new_hi, new_stamp
        self._take_run(at, end)
        return Allocation(at, size, tuple(sorted(deps)), tuple(pieces))

    def free(self, offset: int, size: int, stamp: int | None) -> None:
        self._insert(offset, offset + aligned(max(size, 1)), NEVER if stamp is None else stamp)

    def rollback(self, alloc: Allocation) -> None:
        """Undo an allocation nothing has used: its bytes return with their old stamps."""
        for lo, hi, st in alloc.pieces:
            self._insert(lo, hi, NEVER if st is None else st)

    def _insert(self, lo: int, hi: int, stamp: int) -> None:
        k = bisect.bisect_left(self._lo, lo)
        if (k < len(self._lo) and self._lo[k] < hi) or (k > 0 and self._hi[k - 1] > lo):
            raise RuntimeError(f"allocator: double free of [{lo}, {hi})")
        self._lo.insert(k, lo); self._hi.insert(k, hi); self._key.insert(k, stamp)
        # merge with neighbours of the same stamp to keep the lists short
        for j in (k, k - 1):
            if 0 <= j < len(self._lo) - 1 and self._hi[j] == self._lo[j + 1] \
                    and self._key[j] == self._key[j + 1]:
                self._hi[j] = self._hi[j + 1]
                del self._lo[j + 1], self._hi[j + 1], self._key[j + 1]
        # the runs: join the run ending at lo and the one starting at hi
        r = bisect.bisect_left(self._run_lo, lo)
        run_lo, run_hi = lo, hi
        first, last = r, r
        if r > 0 and self._run_hi[r - 1] == lo:
            first, run_lo = r - 1, self._run_lo[r - 1]
            self._memo.pop(run_lo, None)
        if r < len(self._run_lo) and self._run_lo[r] == hi:
            last, run_hi = r + 1, self._run_hi[r]
            self._memo.pop(hi, None)
        self._run_lo[first:last] = [run_lo]
        self._run_hi[first:last] = [run_hi]
        self._free += hi - lo
        if self._max_run is not None:  # only this run grew
            self._max_run = max(self._max_run, run_hi - run_lo)
