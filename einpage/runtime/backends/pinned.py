"""Weight blocks pinned once per loaded model (DESIGN.md, "Stream program"): the CuPy backend
streams a weight block by one asynchronous copy from pinned host memory, and pinning is slow
(the pages are locked, block by block), so the pinned copies outlive the session that made them
and serve every later plan of the same weights: each decode bucket's plan, each prefill.

`PinnedWeights.for_source(weights)` is the store of one `WeightSource` (held weakly: the copies
go with the model). A session `acquire`s the blocks its plan streams, filled from the source
the first time, and `release`s them at close. Blocks that no open session holds and the last
acquire did not ask for are freed then, so the store holds at most the blocks of the plans open
now and of the last one opened: plans that cut the weights alike share their blocks, plans that
cut them otherwise do not accumulate.
"""
from __future__ import annotations

import ctypes
import threading
import weakref
from typing import Any, Callable, Hashable

import numpy as np

_STORES: "weakref.WeakKeyDictionary[Any, PinnedWeights]" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


class PinnedWeights:
    """Pinned copies of weight blocks, by key (`(input, origin, shape, dtype, storage)`), each its own
    `cupy.cuda.PinnedMemory`."""

    def __init__(self, cp: Any):
        self.cp = cp
        self.blocks: dict[Hashable, tuple[Any, int]] = {}   # key -> (PinnedMemory, nbytes)
        self.users: dict[Hashable, int] = {}
        self.pinned_bytes = 0
        self.fills = 0              # blocks read from the source and pinned, ever

    @staticmethod
    def for_source(cp: Any, weights: Any) -> "PinnedWeights | None":
        """The store of `weights`, or None where the source cannot be held weakly (a bound
        method made for one call: nothing would outlive the session anyway)."""
        if weights is None:
            return None
        with _LOCK:
            try:
                store = _STORES.get(weights)
                if store is None or store.cp is not cp:
                    store = _STORES[weights] = PinnedWeights(cp)
            except TypeError:
                return None
        return store

    def acquire(self, wanted: dict[Hashable, tuple[int, Callable[[np.ndarray], None]]]
                ) -> dict[Hashable, int]:
        """Host addresses of the blocks `wanted` (key -> (bytes, fill: writes the block into a
        `uint8` array of that many bytes)), pinned and filled where new; frees the blocks no one
        holds that are not wanted."""
        out = {}
        with _LOCK:
            for key in [k for k, n in self.users.items() if n == 0 and k not in wanted]:
                mem, nbytes = self.blocks.pop(key)
                del self.users[key]
                self.pinned_bytes -= nbytes
            for key, (nbytes, fill) in wanted.items():
                if key not in self.blocks:
                    mem = self.cp.cuda.PinnedMemory(max(nbytes, 1))
                    fill(np.ctypeslib.as_array((ctypes.c_uint8 * max(nbytes, 1))
                                               .from_address(int(mem.ptr)))[:nbytes])
                    self.blocks[key] = (mem, nbytes)
                    self.users[key] = 0
                    self.pinned_bytes += nbytes
                    self.fills += 1
                self.users[key] += 1
                out[key] = int(self.blocks[key][0].ptr)
        return out

    def release(self, keys) -> None:
        with _LOCK:
            for key in keys:
                if key in self.users:
                    self.users[key] -= 1


__all__ = ["PinnedWeights"]
