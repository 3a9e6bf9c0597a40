"""The NumPy executor: runs a memgraph on one `uint8` arena of `device_bytes` (DESIGN.md,
"Runtimes"). Every device instance is a view of the arena at its offset; host storage maps a
tensor id to its host copy (an offloaded block, or `None`: the block is read from its input's
source when a reload needs it).

Nodes run in the plan's order, or in a seeded random topological order of the edges alone: the
check that a plan's edges are enough. With `poison_freed`, freed bytes (and every byte the plan
uses, before it is first written) hold 0xFF, a NaN in every float type, so reading an instance
before it is written or after it is freed shows up as wrong numbers.

Instances are computed into fresh arrays and stored after the apply's `frees` are released, so an
apply may write into the bytes of an input it consumes.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np

from einpage.errors import CheckpointError, InputError, PlanError
from einpage.ir import scalar
from einpage.ir.memgraph import (Access, ApplyNode, FreeNode, InputNode, MemGraph, OffloadNode,
                                 OutputRef, ReloadNode, TensorInfo)
from einpage.ir.ops import BlockOp, Box, CopyOp, EinsumOp, FillOp, GatherOp, op_text
from einpage.ir.tensors import WeightSource
from einpage.runtime import kernels

#: The byte freed (and not yet written) arena bytes hold with `poison_freed`: NaN in f16, bf16,
#: f32 and f64; -1 in i64.
POISON = 0xFF



# ------------------------------------------------------------------ orders

def node_order(mg: MemGraph, order: str | int = "sequential") -> list[int]:
    """The node ids to run: the plan's list for "sequential", else a random topological order of
    the edges drawn with seed `order`. Verifies the plan's structure first (`MemGraph.verify`).
    """
    mg.verify()
    if isinstance(order, str) and order == "sequential":
        return list(range(len(mg.nodes)))
    if isinstance(order, (int, np.integer)) and not isinstance(order, bool):
        return random_topological_order(mg, int(order))
    raise ValueError(f"order must be 'sequential' or an integer seed, got {order!r}")


def random_topological_order(mg: MemGraph, seed: int) -> list[int]:
    """Kahn's algorithm, picking uniformly among the ready nodes with `default_rng(seed)`;
    the same seed gives the same order. Deps must name earlier ids (see `node_order`)."""
    users: list[list[int]] = [[] for _ in mg.nodes]
    missing = [0] * len(mg.nodes)
    for n in mg.nodes:
        deps = sorted(set(n.deps))
        missing[n.id] = len(deps)
        for d in deps:
            users[d].append(n.id)
    ready = [n.id for n in mg.nodes if missing[n.id] == 0]
    rng = np.random.default_rng(seed)
    out: list[int] = []
    while ready:
        k = int(rng.integers(len(ready)))
        ready[k], ready[-1] = ready[-1], ready[k]
        nid = ready.pop()
        out.append(nid)
        for u in users[nid]:
            missing[u] -= 1
            if missing[u] == 0:
                ready.append(u)
    return out


# ------------------------------------------------------------------ the interpreter

def run(mg: MemGraph, inputs: Mapping[str, np.ndarray] | None = None,
        weights: WeightSource | None = None, order: str | int = "sequential",
        poison_freed: bool = True) -> dict[str, np.ndarray]:
    """`NumpyExecutor().run(...)`: execute `mg` once and return its outputs by name."""
    return NumpyExecutor().run(mg, inputs, weights, order, poison_freed)


class NumpyExecutor:
    """Interpreter of memgraphs on NumPy, one method per node kind. After `run`, `arena` (the
    device bytes) and `host` (tensor id -> host copy) hold the final state, for tests."""

    def run(self, mg: MemGraph, inputs: Mapping[str, np.ndarray] | None = None,
            weights: WeightSource | None = None, order: str | int = "sequential",
            poison_freed: bool = True) -> dict[str, np.ndarray]:
        """Execute `mg`: activation and cache inputs by logical name from `inputs`, weights from
        `weights(name)` (the whole logical array; only the blocks the plan reads are sliced out,
        before any dtype conversion). Returns the logical outputs by name, assembled from their
        output blocks, shapes and dtypes as in `mg.results`.

        Raises InputError for a missing or mis-shaped input, CheckpointError for a mis-shaped
        weight, PlanError (naming the node) for a plan that cannot run."""
        self.mg = mg
        self.inputs = {name: np.asarray(value) for name, value in (inputs or {}).items()}
        self.weights = weights
        self.poison_freed = poison_freed
        self._whole: dict[str, Any] = {}
        self._roles = {t.name: t.role for t in mg.inputs}
        self._check_inputs()
        sequence = node_order(mg, order)
        self.arena = np.zeros(mg.device_bytes, dtype=np.uint8)
        if poison_freed:  # only the bytes the plan touches: np.zeros pages in lazily
            self.arena[:min(mg.high_water(), mg.device_bytes)] = POISON
        self.host: dict[int, np.ndarray | None] = {}
        handlers = {"input": self._input, "reload": self._reload, "offload": self._offload,
                    "free": self._free, "apply": self._apply}
        for nid in sequence:
            node = mg.nodes[nid]
            try:
                handlers[node.kind](node)
            except Exception as exc:
                cls = type(exc) if isinstance(exc, (InputError, CheckpointError)) else PlanError
                raise cls(f"while executing node %{node.id} ({node.kind}): {exc}\n"
                          f"{mg.around(node.id)}") from exc
        return self._results()

    # -------------------------------------------------------------- node kinds
    def _input(self, n: InputNode) -> None:
        if n.at == "host":
            self.host[n.tensor] = None  # the source is the host copy; read at reload
        elif n.at == "device":
            self._view(n.tensor, n.offset)[...] = self._source_block(n.tensor)
        else:
            raise PlanError(f"input at {n.at!r}; expected 'host' or 'device'")

    def _reload(self, n: ReloadNode) -> None:
        if n.tensor not in self.host:
            raise PlanError(f"%t{n.tensor} has no host copy (no input at host or offload of it "
                            f"ran before)")
        data = self.host[n.tensor]
        self._view(n.tensor, n.offset)[...] = (self._source_block(n.tensor) if data is None
                                               else data)

    def _offload(self, n: OffloadNode) -> None:
        self.host[n.tensor] = self._view(n.tensor, n.offset).copy()

    def _free(self, n: FreeNode) -> None:
        self._release(Access(n.tensor, n.offset))

    def _apply(self, n: ApplyNode) -> None:
        reads = [self._view(a.tensor, a.offset) for a in n.reads]
        write = self._view(n.write.tensor, n.write.offset)
        info = self.mg.tensors[n.write.tensor]
        part, compute, agg = _compute(n.op, reads, [self.mg.tensors[a.tensor] for a in n.reads],
                                      info)
        if part.shape != write.shape:
            raise PlanError(f"{op_text(n.op)} produced shape {part.shape}, but the write "
                            f"%t{info.id} is {info.dtype}{list(info.shape)}")
        if n.accumulate:
            part = kernels.combine(agg, write.astype(compute), part.astype(compute, copy=False))
        result = part.astype(info.dtype.numpy, copy=False)
        if np.may_share_memory(result, self.arena):  # e.g. an identity einsum returns a view
            result = result.copy()
        for a in n.frees:  # consumed in place: the write may take these bytes
            self._release(a)
        write[...] = result

    # -------------------------------------------------------------- memory
    def _tensor(self, tid: int) -> TensorInfo:
        if not 0 <= tid < len(self.mg.tensors):
            raise PlanError(f"no tensor %t{tid} (the plan has {len(self.mg.tensors)})")
        return self.mg.tensors[tid]

    def _view(self, tid: int, offset: int | None) -> np.ndarray:
        """The instance of `tid` at `offset`: a view of the arena."""
        t = self._tensor(tid)
        if offset is None or offset < 0 or offset + t.bytes > self.mg.device_bytes:
            raise PlanError(f"%t{tid} ({t.bytes} bytes) at offset {offset} lies outside the "
                            f"arena of {self.mg.device_bytes} bytes")
        need = math.prod(t.shape) * t.dtype.itemsize
        if need > t.bytes:
            raise PlanError(f"%t{tid} is {t.dtype}{list(t.shape)}, {need} bytes, but has only "
                            f"{t.bytes} bytes")
        return self.arena[offset:offset + need].view(t.dtype.numpy).reshape(t.shape)

    def _release(self, a: Access) -> None:
        self._view(a.tensor, a.offset)  # bounds
        if self.poison_freed:
            self.arena[a.offset:a.offset + self.mg.tensors[a.tensor].bytes] = POISON

    # -------------------------------------------------------------- inputs
    def _check_inputs(self) -> None:
        """Every activation or cache input the plan reads is given, with its logical shape."""
        expected = {t.name: (t.role, tuple(t.shape)) for t in self.mg.inputs}
        for n in self.mg.nodes:
            if isinstance(n, InputNode) and 0 <= n.tensor < len(self.mg.tensors):
                t = self.mg.tensors[n.tensor]
                if t.source is not None and t.source.input not in expected:
                    expected[t.source.input] = (t.role, tuple(t.source.full_shape))
        for name, (role, shape) in expected.items():
            if role == "weight":
                continue
            if name not in self.inputs:
                raise InputError(f"missing input {name!r} ({role}, shape {shape})")
            if self.inputs[name].shape != shape:
                raise InputError(f"input {name!r}: expected shape {shape}, got "
                                 f"{self.inputs[name].shape}")

    def _whole_input(self, name: str, role: str, full_shape: tuple[int, ...]) -> Any:
        if name in self._whole:
            return self._whole[name]
        if role == "weight":
            if self.weights is None:
                raise InputError(f"no weights given for weight input {name!r}")
            whole = self.weights(name)
            if tuple(np.shape(whole)) != full_shape:
                raise CheckpointError(f"weight {name!r}: expected shape {full_shape}, got "
                                      f"{tuple(np.shape(whole))}")
        else:
            if name not in self.inputs:
                raise InputError(f"missing input {name!r} ({role}, shape {full_shape})")
            whole = self.inputs[name]
            if whole.shape != full_shape:
                raise InputError(f"input {name!r}: expected shape {full_shape}, got "
                                 f"{whole.shape}")
        self._whole[name] = whole
        return whole

    def _source_block(self, tid: int) -> np.ndarray:
        """The block of an input tensor, sliced from its whole input, in the storage dtype."""
        t = self._tensor(tid)
        s = t.source
        if s is None:
            raise PlanError(f"%t{tid} ({t.name}) is an input block without a source")
        full = tuple(s.full_shape)
        if not len(s.origin) == len(full) == len(t.shape) or any(
                o < 0 or o + n > f for o, n, f in zip(s.origin, t.shape, full)):
            raise PlanError(f"%t{tid} ({t.name}): block {list(t.shape)} at {list(s.origin)} "
                            f"lies outside input {s.input!r} of shape {list(full)}")
        whole = self._whole_input(s.input, self._roles.get(s.input, t.role), full)
        index = tuple(slice(o, o + n) for o, n in zip(s.origin, t.shape))
        return np.asarray(whole[index]).astype(t.dtype.numpy, copy=False)

    # -------------------------------------------------------------- outputs
    def _output_block(self, o: OutputRef) -> np.ndarray:
        where = f"output %t{o.tensor} of {o.name!r} at {o.at}"
        if o.at == "device":
            try:
                return self._view(o.tensor, o.offset).copy()
            except PlanError as exc:
                raise PlanError(f"{where}: {exc}") from None
        if o.at == "host":
            if o.tensor not in self.host:
                raise PlanError(f"{where}: no host copy (never offloaded)")
            data = self.host[o.tensor]
            return self._source_block(o.tensor) if data is None else data
        raise PlanError(f"{where}: expected 'host' or 'device'")

    def _results(self) -> dict[str, np.ndarray]:
        """Whole outputs from their blocks; a name missing from `mg.results` takes the blocks'
        extent and dtype."""
        blocks: dict[str, list[tuple[tuple[int, ...], np.ndarray]]] = {}
        for o in self.mg.outputs:
            blocks.setdefault(o.name, []).append((tuple(o.origin), self._output_block(o)))
        declared = {r.name: (tuple(r.shape), r.dtype.numpy) for r in self.mg.results}
        for name in declared:
            if name not in blocks:
                raise PlanError(f"result {name!r} has no output blocks")
        out = {}
        for name, parts in blocks.items():
            shape, dtype = declared.get(name) or (_extent(parts), parts[0][1].dtype)
            out[name] = _assemble(name, shape, dtype, parts)
        return out


# ------------------------------------------------------------------ block ops

def _compute(op: BlockOp, reads: Sequence[np.ndarray], read_infos: Sequence[TensorInfo],
             info: TensorInfo) -> tuple[np.ndarray, np.dtype, str | None]:
    """(the op's block, the dtype to accumulate in, the aggregation that accumulates it)."""
    if isinstance(op, EinsumOp):
        compute = op.dtype.compute
        return kernels.einsum(op.spec, op.join, op.agg, reads, compute), compute, op.agg
    if isinstance(op, FillOp):
        value = scalar.evaluate_fill(op.expr, op.origin, info.shape, info.dtype.numpy)
        return value, info.dtype.compute, "sum"
    if isinstance(op, GatherOp):
        if len(reads) != 2:
            raise PlanError(f"gather reads (table, ids), got {len(reads)} blocks")
        return _gather(op, reads[0], reads[1], read_infos[0]), info.dtype.compute, "sum"
    if isinstance(op, CopyOp):
        return _copy(op, reads, info), info.dtype.compute, "sum"
    raise PlanError(f"unknown op {type(op).__name__}")


def _gather(op: GatherOp, table: np.ndarray, ids: np.ndarray, table_info: TensorInfo
            ) -> np.ndarray:
    """A table block that holds every row range-checks its ids; a row block of a table cut by
    rows gives zeros for ids outside its rows (its partial results are summed)."""
    src = table_info.source
    whole = src is not None and len(src.full_shape) > 0 and src.full_shape[0] == table.shape[0]
    return kernels.gather(table, ids, op.row_offset, partial=not whole)


def _copy(op: CopyOp, reads: Sequence[np.ndarray], info: TensorInfo) -> np.ndarray:
    out = np.zeros(info.shape, dtype=info.dtype.numpy)
    target = out
    if op.view is not None:
        if math.prod(op.view) != out.size:
            raise PlanError(f"copy view {list(op.view)} does not hold the {out.size} elements "
                            f"of the write {list(info.shape)}")
        target = out.reshape(op.view)
    for k, p in enumerate(op.pieces):
        if not 0 <= p.src < len(reads):
            raise PlanError(f"copy piece {k} reads block {p.src}; the apply reads {len(reads)}")
        src = reads[p.src][_slices(p.src_box, reads[p.src].shape, f"piece {k} source")]
        dst = target[_slices(p.dst_box, target.shape, f"piece {k} destination")]
        if src.shape != dst.shape:
            if src.size != dst.size:
                raise PlanError(f"copy piece {k}: source box {list(src.shape)} and destination "
                                f"box {list(dst.shape)} differ in size")
            src = src.reshape(dst.shape)
        dst[...] = src
    return out


def _slices(box: Box, shape: tuple[int, ...], what: str) -> tuple[slice, ...]:
    if len(box) != len(shape) or any(not 0 <= a <= b <= n for (a, b), n in zip(box, shape)):
        raise PlanError(f"copy {what} box {[list(b) for b in box]} does not fit a block of "
                        f"shape {list(shape)}")
    return tuple(slice(a, b) for a, b in box)


# ------------------------------------------------------------------ helpers

def _extent(parts) -> tuple[int, ...]:
    origin, block = parts[0]
    return tuple(max(o[k] + b.shape[k] for o, b in parts) for k in range(block.ndim))


def _assemble(name: str, shape: tuple[int, ...], dtype: np.dtype, parts) -> np.ndarray:
    """The whole output `name` from its blocks, each exactly once."""
    whole = np.empty(shape, dtype=dtype)
    seen = np.zeros(shape, dtype=bool)
    for origin, block in parts:
        if len(origin) != len(shape) or block.ndim != len(shape) or any(
                o < 0 or o + n > s for o, n, s in zip(origin, block.shape, shape)):
            raise PlanError(f"result {name!r}: block {list(block.shape)} at {list(origin)} lies "
                            f"outside its shape {list(shape)}")
        index = tuple(slice(o, o + n) for o, n in zip(origin, block.shape))
        if seen[index].any():
            raise PlanError(f"result {name!r}: blocks overlap at {list(origin)}")
        whole[index] = block
        seen[index] = True
    if not seen.all():
        raise PlanError(f"result {name!r}: blocks cover {int(seen.sum())} of {seen.size} "
                        f"elements")
    return whole
