"""Eviction policies, registered by name. A policy scores evicting a resident block; the lowering
evicts the contiguous address window of least total (or, for `lru`, least maximum) score.

`reuse-distance` (default): Belady's farthest-next-use, weighed by the bytes a reload (and, for a
block without a valid host copy, an offload) would move: score = bytes x (1 or 2) / distance.
Across passes it does what MIN does on the cyclic trace of repeated passes: it pins a fixed set of
weights on the device (`keeps_resident`) and streams the rest.
`lru`: least recently used first (reactive). On the cyclic trace of repeated passes LRU keeps no
weight from one pass to the next, so it has no resident set: it streams every weight per pass.
`layerwise`: ZeRO-Inference-style whole-layer weight streaming: every weight lives on the host,
the first task of a layer loads every weight of the layer, and they stay until the layer ends;
otherwise LRU. `none`: never evict; every weight stays resident (fails if it does not fit).
When everything fits, every policy keeps every weight resident (zero transfers per pass).
"""
from __future__ import annotations

from dataclasses import dataclass

from einpage.errors import EinpageError


@dataclass(frozen=True)
class Candidate:
    block: int
    bytes: int
    dirty: bool          # no valid host copy: evicting it costs an offload
    next_use: int        # position of the next task using it (len(order) if none)
    last_use: int        # position of the last task that used it so far
    position: int        # the allocation horizon now


class Policy:
    name = ""
    evicts = True
    keeps_resident = False   # pins a resident weight set across passes when not all weights fit
    whole_layer_weights = False
    combine = staticmethod(sum)

    def score(self, c: Candidate) -> float:
        raise NotImplementedError


class ReuseDistance(Policy):
    name = "reuse-distance"
    keeps_resident = True

    def score(self, c: Candidate) -> float:
        distance = max(1, c.next_use - c.position)
        return c.bytes * (2 if c.dirty else 1) / distance


class LRU(Policy):
    name = "lru"
    combine = staticmethod(max)

    def score(self, c: Candidate) -> float:
        return float(c.last_use)


class Layerwise(LRU):
    name = "layerwise"
    whole_layer_weights = True


class NoEviction(Policy):
    name = "none"
    evicts = False

    def score(self, c: Candidate) -> float:
        return float("inf")


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (ReuseDistance, LRU, Layerwise, NoEviction)}


def get_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise EinpageError(f"unknown policy {name!r}; valid: {', '.join(POLICIES)}") from None
