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

from typing import Mapping

import numpy as np

from einpage.errors import CheckpointError, InputError, PlanError
from einpage.ir.memgraph import (Access, ApplyNode, FreeNode, InputNode, MemGraph, OffloadNode,
                                 OutputRef, ReadNode, RecvNode, ReloadNode, SendNode)
from einpage.ir.tensors import WeightSource
from einpage.ir.validator import checked
from einpage.runtime.blockops import apply_into, guard_on, host_apply_into
from einpage.runtime.planio import (PlanIO, arena_view, receive_into, received_inputs, stored,
                                    typed_view)

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
        poison_freed: bool = True, check: bool = True, comm=None) -> dict[str, np.ndarray]:
    """`NumpyExecutor().run(...)`: execute `mg` once and return its outputs by name."""
    return NumpyExecutor().run(mg, inputs, weights, order, poison_freed, check, comm)


class NumpyExecutor:
    """Interpreter of memgraphs on NumPy, one method per node kind. After `run`, `arena` (the
    device bytes) and `host` (tensor id -> host copy) hold the final state, for tests."""

    def run(self, mg: MemGraph, inputs: Mapping[str, np.ndarray] | None = None,
            weights: WeightSource | None = None, order: str | int = "sequential",
            poison_freed: bool = True, check: bool = True, comm=None) -> dict[str, np.ndarray]:
        """Execute `mg`: activation and cache inputs by logical name from `inputs`, weights from
        `weights(name)` (the whole logical array; only the blocks the plan reads are sliced out,
        before any dtype conversion). Returns the logical outputs by name, assembled from their
        output blocks, shapes and dtypes as in `mg.results`.

        The plan is validated first (`einpage.ir.validator.checked`: once per plan object; a plan
        the compiler made in this process was validated there). `check=False` runs it unchecked:
        for harnesses that study what a broken plan does (`bench/mutants.py`).

        A program of one rank of several (`send`, `recv` nodes) talks to its peers through
        `comm` (`einpage.runtime.comm.Communicator`); the inputs its recvs fill are not given.

        Raises InputError for a missing or mis-shaped input, CheckpointError for a mis-shaped
        weight, PlanError (naming the node) for a plan that is invalid or cannot run."""
        if check:
            checked(mg)
        self.mg = mg
        self.poison_freed = poison_freed
        self.comm = comm
        self.received = received_inputs(mg, poison_freed)
        if self.received and comm is None:
            raise PlanError(f"the plan receives {', '.join(map(repr, self.received))} from "
                            f"other ranks (rank {mg.rank} of {mg.world}): it needs a communicator")
        self.io = PlanIO(mg, {**(inputs or {}), **self.received}, weights)
        sequence = node_order(mg, order)
        self.arena = np.zeros(mg.device_bytes, dtype=np.uint8)
        if poison_freed:  # only the bytes the plan touches: np.zeros pages in lazily
            self.arena[:min(mg.high_water(), mg.device_bytes)] = POISON
        self.host: dict[int, np.ndarray | None] = {}
        # the host arena of the disk tier's staging buffers, poisoned like the device arena
        self.staging = np.full(mg.host_arena_bytes, POISON if poison_freed else 0, np.uint8)
        handlers = {"input": self._input, "read": self._read, "reload": self._reload,
                    "offload": self._offload, "free": self._free, "apply": self._apply,
                    "send": self._send, "recv": self._recv}
        for nid in sequence:
            node = mg.nodes[nid]
            try:
                handlers[node.kind](node)
            except Exception as exc:
                cls = type(exc) if isinstance(exc, (InputError, CheckpointError)) else PlanError
                raise cls(f"while executing node %{node.id} ({node.kind}): {exc}\n"
                          f"{mg.around(node.id)}") from exc
        return self.io.results(self._output_block)

    # -------------------------------------------------------------- node kinds
    def _input(self, n: InputNode) -> None:
        if n.at == "host":
            self.host[n.tensor] = None  # the source is the host copy; read at reload
        elif n.at == "device":
            self._view(n.tensor, n.offset)[...] = self.io.source_block(n.tensor)
            if self.mg.tensors[n.tensor].role == "weight":  # a host apply may read its source
                self.host[n.tensor] = None
        elif n.at != "disk":  # at disk: only a read brings it into host memory
            raise PlanError(f"input at {n.at!r}; expected 'host', 'device' or 'disk'")

    def _staged(self, tid: int, host_offset: int) -> np.ndarray:
        t = self.mg.tensors[tid]
        if host_offset < 0 or host_offset + t.bytes > len(self.staging):
            raise PlanError(f"%t{tid} at host offset {host_offset} lies outside the host arena "
                            f"of {len(self.staging)} bytes")
        return typed_view(self.staging, host_offset, t)

    def _read(self, n: ReadNode) -> None:
        self._staged(n.tensor, n.host_offset)[...] = self.io.source_block(n.tensor)

    def _reload(self, n: ReloadNode) -> None:
        if n.guard is not None and not guard_on(self._view, n):
            # skipped: it moves no byte (its staging buffer is consumed all the same); poisoned,
            # the instance shows any reader the validator should have refused
            if self.poison_freed:
                self._view(n.tensor, n.offset).view(np.uint8)[...] = POISON
                if n.host_offset is not None:
                    self._staged(n.tensor, n.host_offset).view(np.uint8)[...] = POISON
            return
        if n.host_offset is not None:  # from its staging buffer, which it consumes
            self._view(n.tensor, n.offset)[...] = self._staged(n.tensor, n.host_offset)
            if self.poison_freed:
                self._staged(n.tensor, n.host_offset).view(np.uint8)[...] = POISON
            return
        if n.tensor not in self.host:
            raise PlanError(f"%t{n.tensor} has no host copy (no input at host or offload of it "
                            f"ran before)")
        data = self.host[n.tensor]
        self._view(n.tensor, n.offset)[...] = (self.io.source_block(n.tensor) if data is None
                                               else data)

    def _offload(self, n: OffloadNode) -> None:
        self.host[n.tensor] = self._view(n.tensor, n.offset).copy()

    def _send(self, n: SendNode) -> None:
        data = (self._view(n.tensor, n.offset) if n.offset is not None
                else self._host_copy(n.tensor))
        self.comm.send(np.ascontiguousarray(data), n.peer, n.tag)

    def _recv(self, n: RecvNode) -> None:
        receive_into(self.received[n.input], n, self.comm)

    def _free(self, n: FreeNode) -> None:
        self._release(Access(n.tensor, n.offset))

    def _apply(self, n: ApplyNode) -> None:
        if n.on_host:
            self._host_apply(n)
            return
        reads = [self._view(a.tensor, a.offset) for a in n.reads]
        write = self._view(n.write.tensor, n.write.offset)
        # consumed inputs are released first: the write may take their bytes
        apply_into(n, self.mg.tensors, reads, write, self._release)

    def _host_apply(self, n: ApplyNode) -> None:
        """An apply on host copies: its write's host copy is a fresh array (or, accumulating,
        the current one, updated)."""
        reads = [self._host_copy(a.tensor) for a in n.reads]
        t = self.mg.tensors[n.write.tensor]
        if n.accumulate:
            write = self._host_copy(n.write.tensor)
        else:
            dtype, shape = stored(t)
            write = np.empty(shape, dtype)
        host_apply_into(n, self.mg.tensors, reads, write)
        self.host[n.write.tensor] = write

    def _host_copy(self, tid: int) -> np.ndarray:
        if tid not in self.host:
            raise PlanError(f"%t{tid} has no host copy (no input at host, offload or host apply "
                            "of it ran before)")
        data = self.host[tid]
        return self.io.source_block(tid) if data is None else data

    # -------------------------------------------------------------- memory
    def _view(self, tid: int, offset: int | None) -> np.ndarray:
        """The instance of `tid` at `offset`: a view of the arena."""
        return arena_view(self.arena, self.mg, tid, offset)

    def _release(self, a: Access) -> None:
        self._view(a.tensor, a.offset)  # bounds
        if self.poison_freed:
            self.arena[a.offset:a.offset + self.mg.tensors[a.tensor].bytes] = POISON

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
            return self.io.source_block(o.tensor) if data is None else data
        raise PlanError(f"{where}: expected 'host' or 'device'")

