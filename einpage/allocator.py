"""Offsets in one device arena.

Free bytes are kept as sorted, non-overlapping segments, each stamped with the memgraph node that
freed it (or None: never used). Adjacent segments coalesce for fitting but keep their stamps, so
an allocation returns exactly the nodes that last touched its bytes: the new writer depends on
them. Among the ranges that fit, the one whose stamps are oldest is chosen (its dependency stalls
the pipeline least); ties go to the lowest offset.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

from einpage.ir.memgraph import ALIGNMENT


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
        # parallel sorted lists: segment starts, ends, stamps
        self._lo: list[int] = [start] if end > start else []
        self._hi: list[int] = [end] if end > start else []
        self._stamp: list[int | None] = [None] if end > start else []

    @property
    def free_bytes(self) -> int:
        return sum(h - l for l, h in zip(self._lo, self._hi))

    def runs(self) -> list[tuple[int, int, int, int]]:
        """Maximal runs of adjacent free segments: (start, end, first index, last index + 1)."""
        out = []
        k = 0
        while k < len(self._lo):
            j = k
            while j + 1 < len(self._lo) and self._hi[j] == self._lo[j + 1]:
                j += 1
            out.append((self._lo[k], self._hi[j], k, j + 1))
            k = j + 1
        return out

    def _stamp_key(self, k0: int, k1: int, lo: int, hi: int) -> int:
        newest = -1
        for k in range(k0, k1):
            if self._hi[k] > lo and self._lo[k] < hi and self._stamp[k] is not None:
                newest = max(newest, self._stamp[k])
        return newest

    def allocate(self, size: int) -> Allocation | None:
        size = aligned(max(size, 1))
        best = None
        for lo, hi, k0, k1 in self.runs():
            if hi - lo < size:
                continue
            # candidate placements: the start of each segment in the run that leaves room
            for k in range(k0, k1):
                at = self._lo[k]
                if at + size > hi:
                    break
                key = (self._stamp_key(k0, k1, at, at + size), at)
                if best is None or key < best[0]:
                    best = (key, at)
        if best is None:
            return None
        return self.take(best[1], size)

    def take(self, at: int, size: int) -> Allocation:
        """Claim [at, at+size), which must be free."""
        size = aligned(max(size, 1))
        deps, pieces = set(), []
        k = bisect.bisect_right(self._lo, at) - 1
        new_lo, new_hi, new_stamp = [], [], []
        end = at + size
        j = k
        while j < len(self._lo) and self._lo[j] < end:
            lo, hi, st = self._lo[j], self._hi[j], self._stamp[j]
            cut_lo, cut_hi = max(lo, at), min(hi, end)
            pieces.append((cut_lo, cut_hi, st))
            if st is not None:
                deps.add(st)
            if lo < cut_lo:
                new_lo.append(lo); new_hi.append(cut_lo); new_stamp.append(st)
            if cut_hi < hi:
                new_lo.append(cut_hi); new_hi.append(hi); new_stamp.append(st)
            j += 1
        covered = sum(h - l for l, h, _ in pieces)
        if covered != size:
            raise RuntimeError(f"allocator: [{at}, {end}) is not free")
        self._lo[k:j], self._hi[k:j], self._stamp[k:j] = new_lo, new_hi, new_stamp
        return Allocation(at, size, tuple(sorted(deps)), tuple(pieces))

    def free(self, offset: int, size: int, stamp: int | None) -> None:
        self._insert(offset, offset + aligned(max(size, 1)), stamp)

    def rollback(self, alloc: Allocation) -> None:
        """Undo an allocation nothing has used: its bytes return with their old stamps."""
        for lo, hi, st in alloc.pieces:
            self._insert(lo, hi, st)

    def _insert(self, lo: int, hi: int, stamp) -> None:
        k = bisect.bisect_left(self._lo, lo)
        if (k < len(self._lo) and self._lo[k] < hi) or (k > 0 and self._hi[k - 1] > lo):
            raise RuntimeError(f"allocator: double free of [{lo}, {hi})")
        self._lo.insert(k, lo); self._hi.insert(k, hi); self._stamp.insert(k, stamp)
        # merge with neighbours of the same stamp to keep the lists short
        for j in (k, k - 1):
            if 0 <= j < len(self._lo) - 1 and self._hi[j] == self._lo[j + 1] \
                    and self._stamp[j] == self._stamp[j + 1]:
                self._hi[j] = self._hi[j + 1]
                del self._lo[j + 1], self._hi[j + 1], self._stamp[j + 1]
