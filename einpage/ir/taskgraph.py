"""The taskgraph: every logical tensor cut into a grid of blocks, every op into block tasks.

A `Block` is a sub-box of one logical tensor (a graph node) in one layout; a `Task` computes one
block op (`einpage.ir.ops`) reading blocks and writing one block, accumulating into it when a
contracted index is cut. Task ids are a topological order; `deps` derives the edges from blocks.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from einpage import collector
from einpage.errors import GraphError
from einpage.ir.dtypes import DType
from einpage.ir.ops import BlockOp, GuardedOp, op_text
from einpage.ir.storage import Storage, tensor_bytes
from einpage.ir.tensors import LogicalTensor, Source


@dataclass(frozen=True, slots=True)
class Block:
    id: int
    node: int                    # the graph node whose tensor this block is part of
    origin: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: DType
    role: str                    # weight | activation | cache | temp
    name: str
    source: Source | None = None  # set for blocks of graph inputs
    storage: Storage | None = None  # a packed weight or KV block (`einpage.ir.storage`)
    # its size, derived once: the lowering and the search ask for it millions of times
    bytes: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "bytes", tensor_bytes(self.shape, self.dtype, self.storage))


@dataclass(frozen=True, slots=True)
class Task:
    id: int
    reads: tuple[int, ...]
    write: int
    accumulate: bool
    op: BlockOp
    node: int
    stage: int


@dataclass(frozen=True, slots=True)
class OutputBlock:
    block: int
    name: str
    origin: tuple[int, ...]


@dataclass(frozen=True)
class TaskGraph:
    blocks: tuple[Block, ...]
    tasks: tuple[Task, ...]
    outputs: tuple[OutputBlock, ...]
    inputs: tuple[LogicalTensor, ...]
    results: tuple[LogicalTensor, ...]
    #: tasks the partition runs on the host (a gather of rows from a table in host memory:
    #: `compiler.host_gather`): no plan moves what only they read to the device
    host_tasks: frozenset[int] = frozenset()

    @cached_property
    def device_read(self) -> frozenset[int]:
        """The blocks some task on the device reads (every task but `host_tasks`)."""
        host = self.host_tasks
        return frozenset(b for t in self.tasks if t.id not in host for b in t.reads)

    @cached_property
    def writers(self) -> tuple[tuple[int, ...], ...]:
        """Tasks writing each block, in id order (the first creates it, the rest accumulate)."""
        out: list[list[int]] = [[] for _ in self.blocks]
        for t in self.tasks:
            out[t.write].append(t.id)
        return tuple(tuple(w) for w in out)

    @cached_property
    def touched(self) -> tuple[tuple[int, ...], ...]:
        """The blocks each task touches: its reads, then its write, each once."""
        return tuple(tuple(dict.fromkeys((*t.reads, t.write))) for t in self.tasks)

    @cached_property
    def read_once(self) -> tuple[tuple[int, ...], ...]:
        """The blocks each task reads, each once, in the order it reads them."""
        return tuple(tuple(dict.fromkeys(t.reads)) for t in self.tasks)

    @cached_property
    def deps(self) -> tuple[tuple[int, ...], ...]:
        """Task edges: every writer of each read block, and the previous writer of an
        accumulated block."""
        writers = self.writers
        out = []
        for t in self.tasks:
            d: set[int] = set()
            for b in t.reads:
                d.update(writers[b])
            if t.accumulate:
                d.update(w for w in writers[t.write] if w < t.id)
            out.append(tuple(sorted(d)))
        return tuple(out)

    @cached_property
    def guard_keys(self) -> dict[int, tuple[int, int, float]]:
        """{weight block: (guard block, index, share)} for the input blocks no task writes
        whose every reader is guarded by the same element of the same block (one written in
        the pass), at any share (`reload_guards` asks a share of at most its `most`)."""
        guard_of: dict[int, tuple[int, int, float] | None] = {}
        blocks, writers = self.blocks, self.writers
        for t in self.tasks:
            mine = {b for b in t.reads if blocks[b].role == "weight" and not writers[b]}
            if not mine:
                continue
            op = t.op
            key = ((t.reads[-1], op.index, op.share) if isinstance(op, GuardedOp)
                   and t.reads[-1] not in mine and writers[t.reads[-1]] else None)
            for b in mine:
                guard_of[b] = key if guard_of.get(b, key) == key else None
        return {b: key for b, key in guard_of.items() if key is not None}

    @property
    def input_blocks(self) -> list[Block]:
        return [b for b in self.blocks if b.source is not None]

    def verify(self) -> None:
        """Invariants: ids are positions; every block id a task or an output names exists; a task
        reads only input blocks or blocks whose every writer is an earlier task (never a block
        still being accumulated); each non-input block's first writer does not accumulate and
        later ones do; input blocks are never written; every output block is written or is an
        input block."""
        count = len(self.blocks)
        for k, b in enumerate(self.blocks):
            if b.id != k:
                raise GraphError(f"block at position {k} has id {b.id}")
        for k, t in enumerate(self.tasks):
            if t.id != k:
                raise GraphError(f"task at position {k} has id {t.id}")
            for b in (*t.reads, t.write):
                if not 0 <= b < count:
                    raise GraphError(f"task {k} ({op_text(t.op)}) names block %b{b}, but the "
                                     f"taskgraph has blocks %b0..%b{count - 1}")
        for o in self.outputs:
            if not 0 <= o.block < count:
                raise GraphError(f"output {o.name} names block %b{o.block}, but the taskgraph "
                                 f"has blocks %b0..%b{count - 1}")
        writers = self.writers
        for k, b in enumerate(self.blocks):
            if b.source is not None and writers[k]:
                raise GraphError(f"input block %b{k} ({b.name}) is written by task {writers[k][0]}")
            for n, w in enumerate(writers[k]):
                if self.tasks[w].accumulate != (n > 0):
                    raise GraphError(f"task {w}: accumulate flag wrong for writer {n} of %b{k}")
        for k, t in enumerate(self.tasks):
            for b in t.reads:
                if self.blocks[b].source is None and (not writers[b] or writers[b][0] >= k):
                    raise GraphError(f"task {k} ({op_text(t.op)}) reads %b{b} before it is written")
                if self.blocks[b].source is None and writers[b][-1] >= k:
                    raise GraphError(f"task {k} ({op_text(t.op)}) reads %b{b} before its last "
                                     f"write (task {writers[b][-1]})")
        for o in self.outputs:
            if self.blocks[o.block].source is None and not writers[o.block]:
                raise GraphError(f"output {o.name} block %b{o.block} is never written")

    def __str__(self) -> str:
        lines = []
        for t in self.tasks:
            args = ", ".join(f"%b{b}" for b in t.reads)
            w = self.blocks[t.write]
            acc = " +=" if t.accumulate else ""
            lines.append(f"task {t.id}: {op_text(t.op)}({args}) ->{acc} %b{w.id} "
                         f"{w.dtype}[{','.join(map(str, w.shape))}] {w.name}")
        return "\n".join(lines)


def reload_guards(tg: TaskGraph, most: float = 1.0
                  ) -> dict[int, tuple[int, int, float]]:
    """{weight block: (guard block, index, share)} for the blocks whose reloads may be guarded:
    an input block no task writes, every task that reads it guarded by the same element of the
    same block (one written in the pass), expected on in at most `most` of the passes
    (`TaskGraph.guard_keys`, made once per taskgraph: every lowering asks)."""
    return {b: key for b, key in tg.guard_keys.items() if key[2] <= most}


def prune_dead(tg: TaskGraph) -> TaskGraph:
    """`tg` without its dead tasks and unused blocks, ids renumbered densely in the same order.

    A task is live when its block is an output's or is read by a live task (with every writer of
    such a block: the partials of an accumulated block live together); the rest are dead. A block
    is kept when a live task reads or writes it or an output names it (so input blocks no live task
    reads go too). Returns `tg` itself when nothing is dead."""
    needed = bytearray(len(tg.blocks))
    for o in tg.outputs:
        needed[o.block] = 1
    live = bytearray(len(tg.tasks))
    for t in reversed(tg.tasks):  # readers come after writers: one backward sweep decides all
        if needed[t.write]:
            live[t.id] = 1
            for b in t.reads:
                needed[b] = 1
    if all(live) and all(needed):
        return tg
    # Hundreds of thousands of new acyclic records: the cyclic collector would only rescan them
    # (60% of the time on llama-65b B=16 S=8192).
    with collector.paused():
        return _renumbered(tg, needed, live)


def _renumbered(tg: TaskGraph, needed: bytearray, live: bytearray) -> TaskGraph:
    new_id = [-1] * len(tg.blocks)
    blocks = []
    for b in tg.blocks:
        if needed[b.id]:
            k = new_id[b.id] = len(blocks)
            blocks.append(b if b.id == k else
                          Block(k, b.node, b.origin, b.shape, b.dtype, b.role, b.name, b.source,
                                b.storage))
    tasks = []
    for t in tg.tasks:
        if live[t.id]:
            tasks.append(Task(len(tasks), tuple([new_id[b] for b in t.reads]), new_id[t.write],
                              t.accumulate, t.op, t.node, t.stage))
    outputs = tuple(OutputBlock(new_id[o.block], o.name, o.origin) for o in tg.outputs)
    return TaskGraph(tuple(blocks), tuple(tasks), outputs, tg.inputs, tg.results)
