"""The KV store a generation keeps: per layer, keys and values of every row's past, at a fixed
capacity, written a row at a time.

A decode plan reads the store in place (`view(C)`: the first `C` slots of each row) and returns
the step's new rows; `write` puts them at each row's position. Capacities come in buckets
(`capacity_for`), so one plan serves every step until the positions outgrow its bucket: the
store on the host is allocated once at the largest bucket the generation will need, and a plan
of a smaller bucket reads a prefix of it.
"""
from __future__ import annotations

from typing import Iterable, Mapping

import numpy as np

from einpage.errors import InputError
from einpage.models.config import LlamaConfig
from einpage.models.schema import kv_storage
from einpage.ir.quant import quantize

#: the smallest step between bucket capacities
GRANULE = 256


def capacity_for(need: int, granule: int = GRANULE) -> int:
    """The bucket capacity that holds `need` rows: `need` rounded up to a multiple of
    `granule`, or of an eighth of the largest power of two not above `need` where that is coarser
    (so past 8 granules a bucket leaves at most 1/8 of its slots unused, and a generation of N
    tokens compiles at most 8 decode plans per doubling of its length)."""
    if need < 1:
        raise InputError(f"a KV store holds at least one row, asked for {need}")
    if granule < 1:
        raise InputError(f"the bucket granule must be at least 1, got {granule}")
    step = max(granule, (1 << (need.bit_length() - 1)) // 8)
    return -(-need // step) * step


def bucket_steps(prompt_len: int, new_tokens: int, granule: int = GRANULE,
                 ring: int | None = None) -> list[tuple[int, int]]:
    """`(capacity, steps)` of the buckets the decode steps of a generation use, in order: after a
    prompt of `prompt_len`, the step producing token k+1 (k = 1 .. new_tokens-1) runs at
    position `prompt_len + k - 1` and writes its row there. The last bucket is cut to the rows
    the generation fills (`prompt_len + new_tokens - 1`): no step reads a slot that no step
    writes. A `ring` store (`ModelConfig.kv_ring`) never has more slots than the ring."""
    out: list[tuple[int, int]] = []
    last = prompt_len + new_tokens - 1
    for pos in range(prompt_len, last):
        cap = min(capacity_for(pos + 1, granule), last, ring or last)
        if out and out[-1][0] == cap:
            out[-1] = (cap, out[-1][1] + 1)
        else:
            out.append((cap, 1))
    return out


def step_capacities(prompt_len: int, new_tokens: int, granule: int = GRANULE,
                    ring: int | None = None) -> tuple[int, ...]:
    """The bucket capacities of `bucket_steps`."""
    return tuple(cap for cap, _ in bucket_steps(prompt_len, new_tokens, granule, ring))


def store_names(cfg: LlamaConfig) -> tuple[str, ...]:
    return tuple(f"cache.{layer}.{kv}" for layer in range(cfg.layers) for kv in "kv")


class KVStore:
    """Keys and values of `batch` rows at `capacity` slots: `arrays[cache.<l>.k|v]` of shape
    [batch, capacity, kv_heads, 2, head_dim/2] in the model dtype, and `pos[b]`, the rows row b
    holds (its next position). `dtype` overrides the storage type (float64 for the reference's
    float64 mode). Under `cfg.kv_format` the arrays hold packed rows instead
    (`einpage.models.schema.kv_storage`: [batch, capacity, ...packed head rows], uint8), each
    row quantized as it is written; plans read them as they lie.

    For a model whose every layer has a sliding window the store is a ring (`cfg.kv_ring` slots
    at most): position q lies in slot `q mod ring`, and only the rows the window sees are
    kept.

    `names` keeps only those layers' arrays (a process running one rank of a pipeline holds
    its own layers' rows; default: every layer)."""

    def __init__(self, cfg: LlamaConfig, batch: int, capacity: int, dtype=None,
                 names: Iterable[str] | None = None):
        if batch < 1 or capacity < 1:
            raise InputError(f"a KV store needs batch and capacity of at least 1, got "
                             f"{batch} and {capacity}")
        self.ring = cfg.kv_ring
        capacity = min(capacity, self.ring) if self.ring else capacity
        self.cfg, self.batch, self.capacity = cfg, batch, capacity
        shape = (batch, capacity, cfg.kv_heads, 2, cfg.head_dim // 2)
        self.storage = kv_storage(cfg)
        if self.storage is not None:
            shape, dtype = self.storage.packed_shape(shape), np.uint8
        wanted = None if names is None else set(names)
        kept = [n for n in store_names(cfg) if wanted is None or n in wanted]
        self.arrays = {name: np.zeros(shape, dtype or cfg.dtype.numpy) for name in kept}
        self.pos = np.zeros(batch, np.int64)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())

    def fill(self, cache: Mapping[str, np.ndarray], lengths: np.ndarray | None = None) -> None:
        """Rows from a prefill's `cache.<l>.k|v` [B, S, ...]: row b's first `lengths[b]` (default
        all S) positions, which become its past."""
        first = cache[next(iter(self.arrays))] if self.arrays else next(iter(cache.values()))
        batch, seq = first.shape[:2]
        lengths = np.full(batch, seq, np.int64) if lengths is None else np.asarray(lengths)
        if batch != self.batch or lengths.shape != (batch,):
            raise InputError(f"prefill of {batch} rows for a store of {self.batch}")
        limit = seq if self.wraps else min(seq, self.capacity)
        if lengths.min() < 1 or lengths.max() > limit:
            raise InputError(f"prefill lengths {lengths.tolist()} do not fit a store of "
                             f"{self.capacity} slots from {seq} positions")
        for name, array in self.arrays.items():
            rows = self._packed(cache[name])
            for b, n in enumerate(lengths.tolist()):
                if self.wraps:  # the ring keeps the last `capacity` positions
                    for q in range(max(0, n - self.capacity), n):
                        array[b, q % self.capacity] = rows[b, q]
                else:
                    array[b, :n] = rows[b, :n]
        self.pos = lengths.astype(np.int64).copy()

    def fill_row(self, b: int, cache: Mapping[str, np.ndarray], length: int) -> None:
        """Row b's past from a one-row prefill's `cache.<l>.k|v` [1, S, ...]: its first
        `length` positions (a request joining a running batch)."""
        limit = self.capacity if not self.wraps else None
        if length < 1 or (limit is not None and length > limit):
            raise InputError(f"{length} positions do not fit a store of {self.capacity} slots")
        for name, array in self.arrays.items():
            rows = self._packed(cache[name])[0]
            if self.wraps:
                for q in range(max(0, length - self.capacity), length):
                    array[b, q % self.capacity] = rows[q]
            else:
                array[b, :length] = rows[:length]
        self.pos[b] = length

    def write_slots(self, step: Mapping[str, np.ndarray], rows) -> list:
        """Write a decode step's `new.<l>.k|v` [B', 1, ...] (B' <= batch: the first rows of the
        store) for the rows `rows` only, each at its position, and advance their positions;
        returns the rows written, as `write` does."""
        rows = [int(b) for b in rows]
        if any(not self.wraps and int(self.pos[b]) >= self.capacity for b in rows):
            raise InputError(f"the KV store is full: {self.capacity} slots")
        written = []
        for name, array in self.arrays.items():
            new = step["new." + name[len("cache."):]]
            packed = self._packed(new)
            for b in rows:
                slot = self.slot(int(self.pos[b]))
                array[b, slot] = packed[b, 0]
                written.append((name, (b, slot), new[b, 0] if self.storage is not None
                                else array[b, slot]))
        self.pos[rows] += 1
        return written

    def view_rows(self, batch: int, capacity: int) -> dict[str, np.ndarray]:
        """The first `capacity` slots of the first `batch` rows (views)."""
        if capacity > self.capacity or batch > self.batch:
            raise InputError(f"a plan of {batch} rows and capacity {capacity} reads a store of "
                             f"{self.batch} rows and {self.capacity} slots")
        return {name: array[:batch, :capacity] for name, array in self.arrays.items()}

    @property
    def wraps(self) -> bool:
        """Whether positions past the capacity wrap around (a full-size ring)."""
        return self.ring is not None and self.capacity == self.ring

    def slot(self, pos: int) -> int:
        """The slot position `pos` is written to."""
        return pos % self.capacity if self.wraps else pos

    @property
    def full(self) -> bool:
        """Whether some row has no slot for its next position."""
        return not self.wraps and int(self.pos.max()) >= self.capacity

    def view(self, capacity: int) -> dict[str, np.ndarray]:
        """The first `capacity` slots of every row, by input name (views: no copy)."""
        if capacity > self.capacity:
            raise InputError(f"a plan of capacity {capacity} reads a store of {self.capacity}")
        return {name: array[:, :capacity] for name, array in self.arrays.items()}

    def _packed(self, rows: np.ndarray) -> np.ndarray:
        """Rows as the store holds them (quantized under a KV format)."""
        return rows if self.storage is None else quantize(np.asarray(rows), self.storage)

    def write(self, step: Mapping[str, np.ndarray]) -> list[tuple[str, tuple[int, int], np.ndarray]]:
        """Write a decode step's `new.<l>.k|v` [B, 1, ...] rows at `pos` and advance `pos`.
        Returns the rows written, `(name, (b, slot), row)`, for copies elsewhere (a device):
        the step's own rows (a session quantizes them for a packed store as this store does)."""
        if self.full:
            raise InputError(f"the KV store is full: {self.capacity} slots")
        return self.write_rows(step, np.ones(self.batch, np.int64))

    def slot_positions(self, capacity: int) -> np.ndarray:
        """int64 [batch, capacity]: the position each of the first `capacity` slots holds, -1
        where it holds none (a ring's slots are not in position order)."""
        t = np.arange(capacity)[None, :]
        pos = self.pos[:, None]
        if not self.wraps:
            return np.where(t < pos, t, -1).astype(np.int64)
        held = pos - 1 - (pos - 1 - t) % self.capacity
        return np.where(held >= 0, held, -1).astype(np.int64)

    def write_rows(self, step: Mapping[str, np.ndarray], counts: np.ndarray
                   ) -> list[tuple[str, tuple[int, int], np.ndarray]]:
        """Write the first `counts[b]` of a verify step's `new.<l>.k|v` [B, T, ...] rows of row b
        at `pos[b]`, `pos[b] + 1`, ... and advance `pos[b]` by `counts[b]` (rows of rejected
        tokens are not written). Returns the rows written, as `write` does."""
        counts = np.asarray(counts, np.int64)
        if counts.shape != (self.batch,) or counts.min() < 0:
            raise InputError(f"row counts {counts.tolist()} for a batch of {self.batch}")
        if not self.wraps and int((self.pos + counts).max()) > self.capacity:
            raise InputError(f"the KV store of {self.capacity} slots cannot take positions up "
                             f"to {int((self.pos + counts).max()) - 1}")
        written = []
        for name, array in self.arrays.items():
            new = step["new." + name[len("cache."):]]
            if new.shape[1] < counts.max():
                raise InputError(f"{int(counts.max())} rows asked of a step of {new.shape[1]}")
            packed = self._packed(new)
            for b in range(self.batch):
                for i in range(int(counts[b])):
                    slot = self.slot(int(self.pos[b]) + i)
                    array[b, slot] = packed[b, i]
                    written.append((name, (b, slot), new[b, i] if self.storage is not None
                                    else array[b, slot]))
        self.pos += counts
        return written

    def rows(self, name: str, b: int) -> np.ndarray:
        """Row b's past in `name` in position order: [rows, kv_heads, 2, head_dim/2] (every
        position, or a ring's last `capacity`), as the store holds it (packed rows under a KV
        format)."""
        n = int(self.pos[b])
        if not self.wraps or n <= self.capacity:
            return self.arrays[name][b, :n]
        return self.arrays[name][b, [q % self.capacity for q in range(n - self.capacity, n)]]
