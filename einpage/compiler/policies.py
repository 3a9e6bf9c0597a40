"""Eviction policies, registered by name. A policy scores evicting a resident block; the lowering
evicts the contiguous address window of least total (or, for `lru`, least maximum) score.

`reuse-distance` (default): Belady's farthest-next-use, weighed by the bytes a reload (and, for a
block without a valid host copy, an offload) would move: score = bytes x (1 or 2) / distance.
Across passes it does what MIN does on the cyclic trace of repeated passes: it pins a fixed set of
weights on the device (`resident`) and streams the rest.
`lru`: least recently used first (reactive). On the cyclic trace of repeated passes LRU keeps no
weight from one pass to the next, so it has no resident set: it streams every weight per pass.
`layerwise`: ZeRO-Inference-style whole-layer weight streaming: every weight lives on the host,
the first task of a layer loads every weight of the layer, and they stay until the layer ends
(its `groups`); otherwise LRU. `none`: never evict; every weight stays resident (fails if it does not fit).
When everything fits, every policy keeps every weight resident (zero transfers per pass).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from einpage.compiler.resident import (choose_resident, pass_needs, pass_reserve,
                                       persistent_blocks)
from einpage.errors import EinpageError
from einpage.ir.taskgraph import TaskGraph


@dataclass(frozen=True, slots=True)
class Group:
    """Blocks that the lowering keeps on the device together, from the task at position
    `start` of the order to the one at `end` (inclusive): one stage's weights, for `layerwise`."""
    stage: int
    start: int
    end: int
    blocks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Residency:
    """The persistent blocks (weights, KV) a policy keeps on the device for every pass, and the
    room it chose
    them in (0: no choice was made, so none is worth searching)."""
    blocks: frozenset[int]
    room: int = 0


class Candidate(NamedTuple):
    """A block the policy may evict (a tuple: the lowering makes one per live block at every
    eviction, a million for a small budget)."""
    block: int
    bytes: int
    dirty: bool          # no valid host copy: evicting it costs an offload
    next_use: int        # position of the next task using it (len(order) if none)
    last_use: int        # position of the last task that used it so far
    position: int        # the allocation horizon now


class Policy:
    """A paging policy: which resident block to evict (`score`, and `combine` over a window of
    blocks: the window of least combined score goes), which weights stay resident across passes
    (`resident`), and which blocks must be on the device together (`groups`)."""
    name = ""
    evicts = True
    combine = staticmethod(sum)

    def score(self, c: Candidate) -> float:
        raise NotImplementedError

    def resident(self, tg: TaskGraph, order: list[int], device_bytes: int,
                 fits: bool) -> Residency:
        """Every weight and KV block where the whole pass fits (zero transfers per pass); none
        otherwise (the reactive policies keep nothing from one pass to the next)."""
        return Residency(persistent_blocks(tg) if fits else frozenset())

    def groups(self, tg: TaskGraph, order: list[int]) -> tuple[Group, ...]:
        return ()


class ReuseDistance(Policy):
    name = "reuse-distance"

    def score(self, c: Candidate) -> float:
        distance = max(1, c.next_use - c.position)
        return c.bytes * (2 if c.dirty else 1) / distance

    def resident(self, tg: TaskGraph, order: list[int], device_bytes: int,
                 fits: bool) -> Residency:
        """What MIN keeps on the cyclic trace of repeated passes: the weights that fit beside
        the pass's own needs (`einpage.compiler.resident`)."""
        if fits:
            return Residency(persistent_blocks(tg))
        room = device_bytes - pass_reserve(pass_needs(tg, order, outputs_stay=False))
        return Residency(choose_resident(tg, order, room), room)


class LRU(Policy):
    name = "lru"
    combine = staticmethod(max)

    def score(self, c: Candidate) -> float:
        return float(c.last_use)


class Layerwise(LRU):
    name = "layerwise"

    def groups(self, tg: TaskGraph, order: list[int]) -> tuple[Group, ...]:
        """Each stage's weights: every weight read by the tasks from the stage's first task in
        the order to its last, on the device together for that span."""
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        for p, tid in enumerate(order):
            stage = tg.tasks[tid].stage
            first.setdefault(stage, p)
            last[stage] = p
        out = []
        for stage, start in first.items():
            end = last[stage]
            blocks = dict.fromkeys(b for q in range(start, end + 1)  # (a task on the host
                                   if order[q] not in tg.host_tasks  # reads host memory)
                                   for b in tg.tasks[order[q]].reads
                                   if tg.blocks[b].role == "weight")
            out.append(Group(stage, start, end, tuple(blocks)))
        return tuple(out)


class NoEviction(Policy):
    name = "none"
    evicts = False

    def score(self, c: Candidate) -> float:
        return float("inf")

    def resident(self, tg: TaskGraph, order: list[int], device_bytes: int,
                 fits: bool) -> Residency:
        return Residency(persistent_blocks(tg))  # nothing leaves the device: all of it stays


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (ReuseDistance, LRU, Layerwise, NoEviction)}


def get_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise EinpageError(f"unknown policy {name!r}; valid: {', '.join(POLICIES)}") from None
