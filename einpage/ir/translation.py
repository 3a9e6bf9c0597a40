"""Translation validation: a plan computes the graph it carries (DESIGN.md, "Version 2",
provenance), not only moves bytes safely.

The memory validator (`einpage.ir.validator`) proves that in every topological order each read
sees a live instance whose writers all ran, and that a tensor's writes, reloads and offloads are
totally ordered by the edges: so the *version* of a tensor a node sees (how many `apply` writes
precede it) is the same in every order, and equals the count in the plan's own node order. On
top of that, this module proves:

1. **Ops fit their operands** (every plan, version 1 too): an einsum reads as many blocks as its
   spec has operands, each of the spec's rank, every index one size wherever it appears, and
   writes the output's shape (in any dtype: the op computes in its own and casts); a fill reads
   nothing and has an origin per write dimension; a gather reads (table, integer ids) and writes
   `ids.shape + table.shape[1:]`; every copy piece reads a block the apply has, and its boxes lie
   inside their blocks (the write viewed as `view`, which holds the write's elements) and hold as
   many elements as each other.

With the graph (`MemGraph.graph`, a `TaskGraph` whose own invariants `TaskGraph.verify` holds):

2. **Tensors are blocks**: each tensor names a distinct block of the graph and has its shape,
   dtype, role, name, checkpoint source and storage format (a packed block holds whole groups
   of its weight's rows); the plan's inputs and results are the graph's, and
   only blocks of graph inputs enter by an `input` or a `read`.
3. **Applies are tasks**: each task runs exactly once, as an `apply` that names it, reads the
   tensors of the task's blocks in the task's order, writes the tensor of its block,
   accumulates exactly when the task does, and runs the task's op.
4. **Chains are complete**: an `apply` reads a tensor only at the version that counts every
   writer its block has in the graph (a summation read before its last partial, or with a
   partial deleted, is refused); an accumulating `apply` finds its block already created (all
   aggregations fold in any order, so the partials may come in any order after the first).
5. **Outputs cover results**: the plan's outputs are the graph's output blocks, each once, with
   its name and origin; at the end each holds its block's final version; and the output blocks
   of each result tile it: a grid of boxes inside its shape, every cell once.

Every failure is a `PlanError` naming the node or the tensor, as the memory validator's are.
"""
from __future__ import annotations

import math
from typing import Sequence

from einpage.errors import PlanError
from einpage.ir.memgraph import ApplyNode, InputNode, MemGraph, ReadNode, TensorInfo
from einpage.ir.ops import CopyOp, EinsumOp, FillOp, GatherOp, GuardedOp, op_text
from einpage.ir.taskgraph import TaskGraph


def check_ops(mg: MemGraph) -> None:
    """Rule 1 over every apply of `mg` (which `MemGraph.verify` has passed)."""
    tensors = mg.tensors
    for n in mg.nodes:
        if isinstance(n, ApplyNode):
            problem = op_misfit(n.op, [tensors[a.tensor] for a in n.reads],
                                tensors[n.write.tensor])
            if problem:
                raise mg.error(n.id, f"node %{n.id} (apply): {op_text(n.op)} {problem}")


def op_misfit(op, reads: Sequence[TensorInfo], write: TensorInfo) -> str | None:
    """Why `op` cannot read `reads` and write `write`, or None when it can."""
    if isinstance(op, GuardedOp):
        if not reads:
            return "reads no guard block"
        guard = reads[-1]
        if op.index >= math.prod(guard.shape):
            return (f"guards on element {op.index} of {_t(guard)}, which has "
                    f"{math.prod(guard.shape)}")
        if guard.storage is not None:
            return f"guards on {_t(guard)}, a packed block"
        return op_misfit(op.op, reads[:-1], write)
    if isinstance(op, EinsumOp):
        return _einsum_misfit(op, reads, write)
    if isinstance(op, FillOp):
        if reads:
            return f"reads {len(reads)} blocks; a fill reads none"
        if len(op.origin) != len(write.shape):
            return (f"has an origin of {len(op.origin)} dimensions for a write of "
                    f"{len(write.shape)}")
        return None
    if isinstance(op, GatherOp):
        if len(reads) != 2:
            return f"reads {len(reads)} blocks; a gather reads (table, ids)"
        table, ids = reads
        want = (*ids.shape, *table.shape[1:])
        if not table.shape or tuple(write.shape) != want:
            return (f"writes {_t(write)} from table {_t(table)} and ids {_t(ids)}; that gather "
                    f"makes {list(want)}")
        if ids.dtype.is_float:
            return f"reads ids {_t(ids)}: ids are integers"
        return None
    if isinstance(op, CopyOp):
        return _copy_misfit(op, reads, write)
    return f"is not an op ({type(op).__name__})"


def _t(t: TensorInfo) -> str:
    return f"%t{t.id} {t.dtype}{list(t.shape)}"


def _einsum_misfit(op: EinsumOp, reads, write) -> str | None:
    spec = op.spec
    if len(reads) != len(spec.inputs):
        return f"reads {len(reads)} blocks; its spec has {len(spec.inputs)} operands"
    sizes: dict[str, int] = {}
    for k, (term, t) in enumerate(zip(spec.inputs, reads)):
        if len(t.shape) != len(term):
            return f"operand {k} ({term!r}) is {_t(t)}: rank {len(t.shape)}, not {len(term)}"
        for letter, size in zip(term, t.shape):
            if sizes.setdefault(letter, size) != size:
                return (f"operand {k} ({term!r}) is {_t(t)}: index {letter!r} is {size} there "
                        f"but {sizes[letter]} in an earlier operand")
    want = [sizes[c] for c in spec.output]
    if list(write.shape) != want:
        return f"writes {_t(write)}; its spec makes {want}"
    return None


def _copy_misfit(op: CopyOp, reads, write) -> str | None:
    target = tuple(write.shape)
    if op.view is not None:
        if math.prod(op.view) != math.prod(target):
            return f"views the write {_t(write)} as {list(op.view)}, another number of elements"
        target = tuple(op.view)
    for k, p in enumerate(op.pieces):
        if not 0 <= p.src < len(reads):
            return f"piece {k} reads operand {p.src}; the apply reads {len(reads)}"
        bad = _box_misfit(p.src_box, tuple(reads[p.src].shape)) or _box_misfit(p.dst_box, target)
        if bad:
            return f"piece {k}: {bad}"
        if _volume(p.src_box) != _volume(p.dst_box):
            return f"piece {k} copies {_volume(p.src_box)} elements into {_volume(p.dst_box)}"
    return None


def _box_misfit(box, shape: tuple[int, ...]) -> str | None:
    if len(box) != len(shape) or any(not 0 <= a <= b <= n for (a, b), n in zip(box, shape)):
        return f"box {[list(b) for b in box]} does not lie in a block of shape {list(shape)}"
    return None


def _volume(box) -> int:
    return math.prod(b - a for a, b in box)


# ---------------------------------------------------------------------------- with a graph
def prove(mg: MemGraph) -> None:
    """Rules 2-5: `mg` computes `mg.graph`. Call after the memory validator passed."""
    tg = mg.graph
    assert tg is not None
    if (mg.inputs, mg.results) != (tg.inputs, tg.results):
        raise PlanError("the plan's inputs or results are not its graph's")
    _check_tensors(mg, tg)
    for n in mg.nodes:  # what enters from outside is an input of the graph
        entering = isinstance(n, (InputNode, ReadNode))
        if entering and tg.blocks[mg.tensors[n.tensor].block].source is None:
            raise mg.error(n.id, f"node %{n.id} ({n.kind}): %t{n.tensor} ({_name(mg, n.tensor)}) "
                                 "is computed by the graph, not one of its inputs")
    writers = tg.writers
    ran: list[int | None] = [None] * len(tg.tasks)
    version: dict[int, int] = {}  # tensor -> apply writes so far
    for n in mg.nodes:
        if not isinstance(n, ApplyNode):
            continue
        t = _task_of(mg, tg, n, ran)
        for k, a in enumerate(n.reads):
            b = mg.tensors[a.tensor].block
            if b != t.reads[k]:
                raise mg.error(n.id, f"node %{n.id} (apply): read {k} is %t{a.tensor} (block "
                                     f"{b}), but task {t.id} reads block {t.reads[k]} there")
            have, want = version.get(a.tensor, 0), len(writers[b])
            if have != want:
                raise mg.error(n.id, f"node %{n.id} (apply): reads %t{a.tensor} "
                                     f"({_name(mg, a.tensor)}) "
                                     f"after {have} of the {want} tasks that write its block "
                                     f"{b}: {_chain(tg, b, ran)}")
        w = mg.tensors[n.write.tensor].block
        if w != t.write:
            raise mg.error(n.id, f"node %{n.id} (apply): writes %t{n.write.tensor} (block {w}), "
                                 f"but task {t.id} writes block {t.write}")
        if n.accumulate != t.accumulate:
            raise mg.error(n.id, f"node %{n.id} (apply): accumulate is {n.accumulate}, but task "
                                 f"{t.id} {'accumulates' if t.accumulate else 'creates its block'}")
        if n.op != t.op:
            raise mg.error(n.id, f"node %{n.id} (apply): runs {op_text(n.op)}, but task {t.id} "
                                 f"runs {op_text(t.op)}")
        if n.accumulate and version.get(n.write.tensor, 0) == 0:
            raise mg.error(n.id, f"node %{n.id} (apply): accumulates into block {w} before the "
                                 f"task that creates it ran")
        version[n.write.tensor] = version.get(n.write.tensor, 0) + 1
    missing = [k for k, r in enumerate(ran) if r is None]
    if missing:
        t = tg.tasks[missing[0]]
        raise PlanError(f"task {t.id} ({op_text(t.op)} -> block {t.write}, "
                        f"{tg.blocks[t.write].name}) of the plan's graph never runs"
                        + (f" ({len(missing)} tasks do not)" if len(missing) > 1 else ""))
    _check_outputs(mg, tg, version)


def _check_tensors(mg: MemGraph, tg: TaskGraph) -> None:
    """Rule 2: each tensor a distinct block of the graph, with its shape, dtype, role, name and
    source."""
    tensor_of: dict[int, int] = {}  # block -> the tensor that is it
    for t in mg.tensors:
        b = t.block
        if not isinstance(b, int) or not 0 <= b < len(tg.blocks):
            raise PlanError(f"tensor %t{t.id} ({t.name}): names block {b!r}, but the plan's "
                            f"graph has blocks 0..{len(tg.blocks) - 1}")
        if b in tensor_of:
            raise PlanError(f"tensor %t{t.id} ({t.name}): block {b} is tensor %t{tensor_of[b]} "
                            "already")
        tensor_of[b] = t.id
        blk = tg.blocks[b]
        if (tuple(t.shape), t.dtype) != (tuple(blk.shape), blk.dtype):
            raise PlanError(f"tensor %t{t.id} ({t.name}) is {t.dtype}{list(t.shape)}, but its "
                            f"block {b} ({blk.name}) is {blk.dtype}{list(blk.shape)}")
        if (t.role, t.name) != (blk.role, blk.name):  # runtimes act on a tensor's role
            raise PlanError(f"tensor %t{t.id} is {t.name!r} ({t.role}), but its block {b} is "
                            f"{blk.name!r} ({blk.role})")
        if t.source != blk.source:
            raise PlanError(f"tensor %t{t.id} ({t.name}) comes from {_src(t.source)}, but its "
                            f"block {b} ({blk.name}) comes from {_src(blk.source)}")
        if t.storage != blk.storage:
            raise PlanError(f"tensor %t{t.id} ({t.name}) is stored {_fmt(t.storage)}, but its "
                            f"block {b} ({blk.name}) is stored {_fmt(blk.storage)}")
        if t.storage is not None:  # whole groups of the weight's rows (PlanError if not)
            if t.source is None:
                raise PlanError(f"tensor %t{t.id} ({t.name}) is stored {_fmt(t.storage)} but "
                                "is no input block")
            t.storage.packed_box(t.source.origin, t.shape, t.source.full_shape)


def _fmt(storage) -> str:
    return "unpacked" if storage is None else f"as {storage.format} (span {storage.span})"


def _src(s) -> str:
    if s is None:
        return "no checkpoint tensor"
    return f"{s.checkpoint or s.input}{list(s.origin)} of {list(s.full_shape)}"


def _task_of(mg: MemGraph, tg: TaskGraph, n: ApplyNode, ran: list):
    k = n.task
    if not isinstance(k, int) or not 0 <= k < len(tg.tasks):
        raise mg.error(n.id, f"node %{n.id} (apply): names task {k!r}, but the plan's graph has "
                             f"tasks 0..{len(tg.tasks) - 1}")
    if ran[k] is not None:
        raise mg.error(n.id, f"node %{n.id} (apply): runs task {k}, which node %{ran[k]} ran "
                             f"already (each task runs once)")
    ran[k] = n.id
    t = tg.tasks[k]
    if len(n.reads) != len(t.reads):
        raise mg.error(n.id, f"node %{n.id} (apply): reads {len(n.reads)} tensors, but task {k} "
                             f"reads {len(t.reads)} blocks")
    return t


def _name(mg: MemGraph, t: int) -> str:
    return mg.tensors[t].name or f"%t{t}"


def _chain(tg: TaskGraph, b: int, ran: list) -> str:
    tasks = tg.writers[b]
    pending = [k for k in tasks if ran[k] is None]
    return (f"tasks {', '.join(map(str, pending[:4]))}{' ...' if len(pending) > 4 else ''} "
            f"have not run" if pending else "a write of it ran twice")


def _check_outputs(mg: MemGraph, tg: TaskGraph, version: dict[int, int]) -> None:
    want = {(o.block, o.name, tuple(o.origin)) for o in tg.outputs}
    seen = set()
    for o in mg.outputs:
        b = mg.tensors[o.tensor].block
        key = (b, o.name, tuple(o.origin))
        if key not in want:
            raise PlanError(f"output {o.name!r}{list(o.origin)} is %t{o.tensor} (block {b}), "
                            f"which the plan's graph does not name as that output")
        if key in seen:
            raise PlanError(f"output {o.name!r}{list(o.origin)} is named twice")
        seen.add(key)
        have, need = version.get(o.tensor, 0), len(tg.writers[b])
        if have != need:
            raise PlanError(f"output {o.name!r}{list(o.origin)} %t{o.tensor}: {have} of the "
                            f"{need} tasks that write its block {b} ran")
    if len(seen) != len(want):
        o = next(o for o in tg.outputs if (o.block, o.name, tuple(o.origin)) not in seen)
        raise PlanError(f"output {o.name!r}{list(o.origin)} (block {o.block}) of the plan's "
                        f"graph is missing from the plan's outputs")
    shapes = {r.name: tuple(r.shape) for r in tg.results}
    boxes: dict[str, list] = {}
    for o in tg.outputs:
        boxes.setdefault(o.name, []).append((o.origin, tuple(tg.blocks[o.block].shape)))
    for name, shape in shapes.items():
        problem = _tiling_misfit(boxes.get(name, []), shape)
        if problem:
            raise PlanError(f"result {name!r} {list(shape)}: its output blocks {problem}")
    extra = sorted(set(boxes) - set(shapes))
    if extra and tg.results:
        raise PlanError(f"output {extra[0]!r} is no result of the plan")


def _tiling_misfit(boxes: list, shape: tuple[int, ...]) -> str | None:
    """Why `boxes` ((origin, extent) pairs) are not a grid tiling `shape`, or None."""
    if not boxes:
        return "are missing" if math.prod(shape) else None
    if not math.prod(shape):
        return None  # an empty result: any (empty) blocks cover it
    cuts = [set() for _ in shape]
    for origin, extent in boxes:
        if len(origin) != len(shape) or len(extent) != len(shape):
            return f"have {len(origin)} dimensions"
        for d, (a, n) in enumerate(zip(origin, extent)):
            if n <= 0 or not 0 <= a < a + n <= shape[d]:
                return f"include [{a}, {a + n}) in dimension {d} of {shape[d]}"
            cuts[d].update((a, a + n))
    grid = [sorted(c | {0, shape[d]}) for d, c in enumerate(cuts)]
    at = [{cut: k for k, cut in enumerate(g)} for g in grid]
    cells = set()
    for origin, extent in boxes:
        cell = []
        for d, (a, n) in enumerate(zip(origin, extent)):
            k = at[d][a]
            if grid[d][k + 1] != a + n:
                return f"are no grid: [{a}, {a + n}) spans a cut in dimension {d}"
            cell.append(k)
        if tuple(cell) in cells:
            return f"cover {list(origin)} twice"
        cells.add(tuple(cell))
    need = math.prod(len(g) - 1 for g in grid)
    if len(cells) != need:
        return f"cover {len(cells)} of the {need} cells of their grid"
    return None
