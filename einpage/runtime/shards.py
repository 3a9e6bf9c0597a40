"""What a tensor-parallel program's rank reads and gives back, in the model's whole tensors
(`einpage.compiler.tensor_parallel`): its plan's meta says which inputs it holds a slice of
(`shards`: name -> [axis, start, stop]) and which outputs leave it as slices (`gathered`: name ->
axis). A pipeline's programs, and a plan for one device, have neither: every function here
passes their tensors through unchanged."""
from __future__ import annotations

from dataclasses import replace
from typing import Mapping, Sequence

import numpy as np

from einpage.errors import PlanError
from einpage.ir.memgraph import MemGraph
from einpage.ir.peers import is_boundary
from einpage.ir.quant import dequantize_box
from einpage.ir.storage import Storage
from einpage.ir.tensors import WeightSource
from einpage.runtime.planio import held_storage


def shards_of(mg: MemGraph) -> dict[str, tuple[int, int, int]]:
    return {name: tuple(int(v) for v in box)
            for name, box in dict(mg.meta.get("shards") or {}).items()}


def gathered_of(mg: MemGraph) -> dict[str, int]:
    return {name: int(axis) for name, axis in dict(mg.meta.get("gathered") or {}).items()}


def _cut(axis: int, start: int, stop: int) -> tuple[slice, ...]:
    return (slice(None),) * axis + (slice(start, stop),)


class ShardedWeights:
    """A rank's weights: each sharded weight is its slice of the whole one `source` gives (a
    view: a memory map is read only where the rank's blocks lie). A weight the source holds
    packed (`storage(name)`: a GGUF file's block format) is sliced in its packed bytes where the
    slice holds whole groups (`Storage.packed_box`), and otherwise handed out dequantized, its
    `storage` then None. `locate` (the disk tier) points into the file where the slice is one
    run of bytes (a cut of the first axis of an unpacked weight); `config`, ... pass through.
    `wholes`: each sharded weight's whole logical shape (`whole_shape`)."""

    def __init__(self, source: WeightSource, shards: Mapping[str, tuple[int, int, int]],
                 wholes: Mapping[str, tuple[int, ...]] | None = None):
        self.source, self.shards = source, dict(shards)
        self.wholes = dict(wholes or {})

    def _box(self, name: str) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """(origin, shape, whole shape) of this rank's slice of packed weight `name`, logical."""
        axis, start, stop = self.shards[name]
        full = tuple(self.wholes[name])
        shape = tuple(stop - start if a == axis else s for a, s in enumerate(full))
        origin = tuple(start if a == axis else 0 for a in range(len(full)))
        return origin, shape, full

    def _packed_cut(self, name: str, held: Storage) -> tuple[slice, ...] | None:
        origin, shape, full = self._box(name)
        try:
            o, n = held.packed_box(origin, shape, full)
        except PlanError:
            return None
        return tuple(slice(a, a + b) for a, b in zip(o, n))

    def __call__(self, name: str):
        whole = self.source(name)
        if name not in self.shards:
            return whole
        held = held_storage(self.source, name)
        if held is None:
            return whole[_cut(*self.shards[name])]
        cut = self._packed_cut(name, held)
        if cut is not None:
            return whole[cut]
        return dequantize_box(whole, held, *self._box(name), np.float32)  # cut groups

    def storage(self, name: str) -> Storage | None:
        held = held_storage(self.source, name)
        if held is None or name not in self.shards or self._packed_cut(name, held) is not None:
            return held
        return None

    def locate(self, name: str):
        find = getattr(self.source, "locate", None)
        where = find(name) if find is not None else None
        if where is None or name not in self.shards:
            return where
        axis, start, stop = self.shards[name]
        if axis != 0 or where.storage is not None:
            return None
        row = int(np.prod(where.shape[1:], dtype=np.int64)) * where.dtype.itemsize
        return replace(where, offset=where.offset + start * row,
                       shape=(stop - start, *where.shape[1:]))

    def __getattr__(self, attr: str):  # `config`, ... of the source
        return getattr(self.source, attr)


def rank_weights(weights: WeightSource | None, mg: MemGraph) -> WeightSource | None:
    """`weights` as rank `mg.rank` reads them: sliced where its plan holds a shard."""
    shards = shards_of(mg)
    if weights is None or not shards:
        return weights
    wholes = {t.source.input: whole_shape(mg, t.source.input, t.source.full_shape)
              for t in mg.tensors if t.source is not None and t.source.input in shards}
    return ShardedWeights(weights, shards, wholes)


def rank_inputs(mg: MemGraph, inputs: Mapping[str, np.ndarray] | None
                ) -> Mapping[str, np.ndarray] | None:
    """The caller's inputs (whole tensors: a KV store) as rank `mg.rank` reads them: views of
    its slices, so a store the caller updates in place stays seen."""
    shards = shards_of(mg)
    if not inputs or not any(name in shards for name in inputs):
        return inputs
    return {name: (value[_cut(*shards[name])] if name in shards else value)
            for name, value in inputs.items()}


def whole_shape(mg: MemGraph, name: str, shape: Sequence[int]) -> tuple[int, ...]:
    """The whole tensor's shape of input `name`, which this rank reads as `shape`."""
    box = shards_of(mg).get(name)
    if box is None:
        return tuple(shape)
    axis, start, stop = box
    parts = int(mg.meta.get("group") or mg.world)  # the ranks the input is split over
    return tuple(s * parts if a == axis else s for a, s in enumerate(shape))


def assemble(programs: Sequence[MemGraph], outs: Mapping[int, Mapping[str, np.ndarray]]
             ) -> dict[str, np.ndarray]:
    """The model's results from each rank's (`outs[r]`): a gathered output is the slices of the
    ranks that make it (every rank of a tensor-parallel plan, a group of a pipeline of them)
    joined along its axis, in rank order; any other is taken from the lowest rank that has it
    (a tensor-parallel rank's replicated outputs are equal on every rank; a pipeline's are made
    on one). Values that only cross ranks are left out."""
    merged: dict[str, np.ndarray] = {}
    ranks = sorted(outs)
    for r in ranks:
        gathered = gathered_of(programs[r])
        for name, value in outs[r].items():
            if is_boundary(name) or name in merged:
                continue
            if name in gathered:
                makers = makers_of(programs, name)
                missing = [q for q in makers if q not in outs]
                if missing:
                    raise ValueError(f"{name!r} is gathered from ranks {makers}; the results "
                                     f"of {missing} are not here")
                merged[name] = np.concatenate([outs[q][name] for q in makers],
                                              axis=gathered[name])
            else:
                merged[name] = value
    return merged


def makers_of(programs: Sequence[MemGraph], name: str) -> list[int]:
    """The ranks whose programs make result `name` (all, some or one of them)."""
    return [r for r, mg in enumerate(programs) if any(t.name == name for t in mg.results)]


def rank_rows(mg: MemGraph, name: str, lead: tuple[int, ...], values: np.ndarray) -> np.ndarray:
    """The part of `values` (rows written at `lead` into input `name`, in the whole tensor's
    shape) that rank `mg.rank` holds."""
    box = shards_of(mg).get(name)
    if box is None:
        return values
    axis, start, stop = box
    if axis < len(lead):
        raise ValueError(f"{name!r} is split along axis {axis}, which the write at {lead} "
                         "indexes")
    return values[_cut(axis - len(lead), start, stop)]
