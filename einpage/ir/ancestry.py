"""What the memgraph validator (`einpage.ir.validator`) checks a plan against while it replays
the node order: the device instance records it keeps (`LiveInstance`), ancestor queries on the
dependency DAG (`Ancestry`: a numbered spanning forest first, then one pruned backward search)
and the arena's segment map (`Arena`: which instance last occupied each byte)."""
from __future__ import annotations

from bisect import bisect_right

from einpage.ir.memgraph import MemNode


class LiveInstance:
    """One device copy of a tensor while the checker replays the node order."""
    __slots__ = ("serial", "tensor", "offset", "nbytes", "creator", "last_writer", "readers",
                 "ender", "guard")

    def __init__(self, serial: int, tensor: int, offset: int, nbytes: int, creator: int):
        self.serial = serial
        self.tensor = tensor
        self.offset = offset
        self.nbytes = nbytes
        self.creator = creator
        self.last_writer = creator
        self.readers: list[int] = []  # reads and offloads since the last writer
        self.ender: int | None = None
        #: made by a guarded reload: (guard tensor, its version then, index, share) (rule 11)
        self.guard: tuple[int, int, int, float] | None = None


class Ancestry:
    """Ancestor queries on the dep DAG (whose deps `_check_structure` has checked).

    A spanning forest of the DAG, in which each node's parent is its latest dep, is numbered in
    pre-order; a forest ancestor is a DAG ancestor, found in O(1). A query first tries the
    direct deps and the forest, then searches backwards from `v` over ids >= the smallest one
    sought (an ancestor always has a smaller id), checking each node it meets against the forest,
    and stops once everything is found. On chain-like plans the forest answers almost every query;
    only a "no" (an error) pays for a whole search."""

    def __init__(self, nodes: tuple[MemNode, ...]):
        n = len(nodes)
        self.deps = [node.deps for node in nodes]
        children: list[list[int]] = [[] for _ in range(n)]
        roots = []
        for v, deps in enumerate(self.deps):
            (children[max(deps)] if deps else roots).append(v)
        self.first = [0] * n  # pre-order number
        self.last = [0] * n   # the largest pre-order number in its subtree
        count = 0
        for root in roots:
            stack = [root]
            while stack:
                v = stack.pop()
                if v < 0:
                    self.last[~v] = count - 1
                    continue
                self.first[v] = count
                count += 1
                stack.append(~v)
                stack.extend(reversed(children[v]))
        self.mark = [0] * n
        self.stamp = 0

    def _in_tree(self, u: int, d: int) -> bool:
        """Whether `u` is `d` or its ancestor in the forest."""
        return self.first[u] <= self.first[d] <= self.last[u]

    def missing(self, targets: list[int], v: int) -> list[int]:
        """The targets (other than `v` itself) that are not ancestors of `v`, sorted."""
        need = {u for u in targets if u != v}
        if need:
            need.difference_update(self.deps[v])
        if need:
            late = sorted(u for u in need if u > v)
            if late:
                return late
            need = {u for u in need if not self._in_tree(u, v)}
        return self._search(need, v, find_all=True) if need else []

    def any_of(self, targets: list[int], v: int) -> bool:
        """Whether some target is `v` or an ancestor of `v`."""
        need = {u for u in targets if u <= v}
        if not need:
            return False
        if any(self._in_tree(u, v) for u in need) or not need.isdisjoint(self.deps[v]):
            return True
        count = len(need)
        return len(self._search(need, v, find_all=False)) < count

    def _search(self, need: set[int], v: int, find_all: bool) -> list[int]:
        """Backward search from `v` over ids >= min(need); returns what stayed unfound (stops at
        the first find unless `find_all`). Mutates `need`."""
        deps, mark, first, last = self.deps, self.mark, self.first, self.last
        self.stamp += 1
        stamp = self.stamp
        lo = min(need)
        stack = [v]
        while stack:
            for d in deps[stack.pop()]:
                if d < lo or mark[d] == stamp:
                    continue
                mark[d] = stamp
                here = first[d]
                hits = [u for u in need if first[u] <= here <= last[u]]
                if hits:
                    need.difference_update(hits)
                    if not need or not find_all:
                        return sorted(need)
                    lo = min(need)
                stack.append(d)
        return sorted(need)


class Arena:
    """The most recent occupant of every byte: sorted segment starts with their owners."""

    def __init__(self, size: int):
        self.size = size
        self.starts = [0]
        self.owners: list[LiveInstance | None] = [None]

    def _split(self, x: int) -> int:
        i = bisect_right(self.starts, x) - 1
        if self.starts[i] != x:
            i += 1
            self.starts.insert(i, x)
            self.owners.insert(i, self.owners[i - 1])
        return i

    def claim(self, lo: int, hi: int, inst: LiveInstance) -> list[LiveInstance]:
        """Make `inst` the occupant of [lo, hi); return the distinct previous occupants."""
        if lo >= hi:
            return []
        i = self._split(lo)
        j = self._split(hi) if hi < self.size else len(self.starts)
        previous = {o.serial: o for o in self.owners[i:j] if o is not None}
        self.starts[i:j] = [lo]
        self.owners[i:j] = [inst]
        return list(previous.values())


def at_offset(offset: int) -> str:
    return f"@0x{offset:08x}"
