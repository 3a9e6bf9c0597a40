"""Partition: `Graph` -> `TaskGraph`.

Every einsum's index space is cut into a grid (parts per index letter); its output tensor takes the
cuts of its output indices, each operand is read in the cuts of its indices. Cutting a contracted
index gives partial results folded into the output block (accumulating tasks). Inputs and fills
are materialised in whatever layout a consumer asks for (straight from host or computed on the
device); a produced tensor read in another layout is regridded by `copy` tasks.

Cuts are chosen for the whole graph at once, per axis class (`einpage.compiler.cuts`): axes that ops tie
together are cut alike, so producers write the layout their consumers read and activations are
not re-assembled between ops; each task's working set (its operand blocks plus its output block)
is at most `block_bytes` where cuts can achieve it. `cuts` sets one op's parts by hand for
experiments (its operands are then regridded as needed).

Blocks known at partition time (`einpage.compiler.constants`) get no task: a fill block that is
constant over its box (a causal or sliding-window mask's blocks off the band), an einsum block
whose join folds to a constant given its constant operands (`scores + mask` = -inf, `exp` of it 0,
`0 / sum` 0), a copy of constant blocks of one value, and a contraction's output none of whose
partials is left. A contraction's partial equal to its aggregation's identity (a sum adding 0, a max
of -inf) is dropped; a task whose constant operands fold away reads only the others (`scores + 0`
below the diagonal reads no mask block). A constant block that some task still reads (a copy, a
gather, an einsum that cannot fold it, a graph output) is materialised by a constant fill just
before its first reader. Tasks whose block then has no live reader and is not an output are
removed (`prune_dead`): the scores above a causal mask's diagonal, whose only reader folded.
`PartitionOptions.drop_constant_blocks=False` partitions without any of this (for comparison).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from einpage.compiler.constants import (constant_expr, dtype_value, fill_constant, fold,
                                       identity)
from einpage.compiler.cuts import (AxisClasses, CutOp, cap_streamed_weights,
                                   choose_class_parts)
from einpage.errors import BudgetError, GraphError
from einpage.ir.graph import (Concat, Einsum, Fill, Gather, Graph, Input, Node, Output, Reshape,
                              Slice)
from einpage.ir.ops import CopyOp, EinsumOp, FillOp, GatherOp, GuardedOp, Piece
from einpage.ir.spec import EinsumSpec
from einpage.ir.taskgraph import Block, OutputBlock, Task, TaskGraph, prune_dead
from einpage.ir.tensors import LogicalTensor, Source
from einpage.ir.storage import tensor_bytes
from einpage.units import format_size

Bounds = tuple[tuple[int, ...], ...]  # per dim: cut points 0 = c0 < c1 < ... < ck = size


@dataclass(frozen=True)
class PartitionOptions:
    block_bytes: int                    # target working set of one task
    cuts: Mapping[int, Mapping[str, int]] = field(default_factory=dict)  # node id -> parts per index
    sources: Mapping[str, str] = field(default_factory=dict)  # weight name -> checkpoint tensor
    # Past this many tasks the plan is too large to compile and keep in memory (about 5 KB a task
    # over the passes): a million covers llama-65b prefill of 32 x 8192 tokens at 16 GB.
    max_tasks: int = 1_000_000
    # Drop the tasks of blocks whose value is known at partition time (masked-out attention
    # blocks; see the module docstring). False: every block gets its tasks, as before.
    drop_constant_blocks: bool = True
    # Weights that ops reuse many times (a prefill's projections) cut into blocks of at most
    # this many bytes for streaming (`cuts.cap_streamed_weights`); None: the cut choice alone.
    weight_block_bytes: int | None = None
    # Weights (graph node ids) whose readers cut them into blocks of at most `split_bytes`
    # along the axes they contract, whatever their reuse (`Partitioner._split`): the weights a
    # plan streams, cut finer than the rest.
    split_weights: frozenset[int] = frozenset()
    split_bytes: int | None = None


def even_bounds(size: int, parts: int) -> tuple[int, ...]:
    parts = max(1, min(parts, size)) if size else 1
    return tuple((k * size) // parts for k in range(parts + 1))


@dataclass
class _Grid:
    bounds: Bounds
    blocks: dict[tuple[int, ...], int]  # block coordinates -> block id


class _Partitioner:
    def __init__(self, graph: Graph, options: PartitionOptions):
        self.g, self.opt = graph, options
        self.blocks: list[Block] = []
        self.tasks: list[Task] = []
        self.grids: dict[tuple[int, Bounds], _Grid] = {}
        self.primary: dict[int, Bounds] = {}  # layout a produced node was written in
        self.drop = options.drop_constant_blocks
        self.known: dict[int, float] = {}   # block id -> its value, known at partition time
        self.pending: dict[int, float] = {}  # ... of those, the ones no task has written yet
        self.const_nodes: set[int] = set()  # nodes with a block in `known`
        self.written: set[int] = set()      # blocks some emitted task writes
        self.guard_elements: dict[tuple[int, int], tuple[int, int]] = {}  # (tensor, index) ->
                                            # (its block, the flat index in it)

    # ------------------------------------------------------------ blocks and tasks
    def _new_grid(self, node: Node, bounds: Bounds) -> _Grid:
        grid = _Grid(bounds, {})
        role = node.op.role.value if isinstance(node.op, Input) else "activation"
        base = node.op.name if isinstance(node.op, Input) else f"%{node.id}"
        for coords in itertools.product(*[range(len(b) - 1) for b in bounds]):
            origin = tuple(b[c] for b, c in zip(bounds, coords))
            shape = tuple(b[c + 1] - b[c] for b, c in zip(bounds, coords))
            source = None
            if isinstance(node.op, Input):
                source = Source(node.op.name, origin, tuple(node.shape),
                                self.opt.sources.get(node.op.name))
            bid = len(self.blocks)
            suffix = f"[{','.join(map(str, coords))}]" if coords else ""
            storage = node.op.storage if isinstance(node.op, Input) else None
            self.blocks.append(Block(bid, node.id, origin, shape, node.dtype, role, base + suffix,
                                     source, storage))
            grid.blocks[coords] = bid
        self.grids[(node.id, bounds)] = grid
        return grid

    def _too_many(self, where: str) -> BudgetError:
        return BudgetError(
            f"graph too large to plan for this budget: with blocks of at most "
            f"{format_size(self.opt.block_bytes)} per task it needs more than "
            f"{self.opt.max_tasks} tasks ({where}); use a bigger --gpu-mem or a smaller batch or "
            f"sequence", self.opt.block_bytes * 8, self.opt.block_bytes)

    def _task(self, reads, write, accumulate, op, node: Node) -> None:
        """Emit a task; constant blocks it reads that no task has written yet are materialised
        first (so task ids stay a topological order)."""
        if self.pending:
            for b in reads:
                if b in self.pending:
                    self._materialize(b)
        self._append(reads, write, accumulate, op, node)

    def _append(self, reads, write, accumulate, op, node: Node) -> None:
        if len(self.tasks) >= self.opt.max_tasks:
            raise self._too_many(f"stopped at node %{node.id} of {len(self.g.nodes)}")
        if node.guard is not None:  # the guard's block is the task's last read
            block, index = self._guard_element(node)
            reads, op = (*reads, block), GuardedOp(op, index, float(node.guard.share))
        self.tasks.append(Task(len(self.tasks), tuple(reads), write, accumulate, op, node.id,
                               node.stage))
        self.written.add(write)

    def _guard_element(self, node: Node) -> tuple[int, int]:
        """(the block of `node`'s guard tensor holding its guard element, the element's flat
        index in that block), the block written first if it is a constant not yet written."""
        g = node.guard
        key = (g.tensor, g.index)  # the guard tensor's layout is fixed once it is made
        if key not in self.guard_elements:
            self.guard_elements[key] = self._find_guard_element(g)
        bid, index = self.guard_elements[key]
        if bid in self.pending:
            self._materialize(bid)
        return bid, index

    def _find_guard_element(self, g) -> tuple[int, int]:
        src = self.g.nodes[g.tensor]
        bounds = self.primary.get(g.tensor) or tuple((0, s) for s in src.shape)
        at = [int(v) for v in np.unravel_index(g.index, src.shape)]
        for bid in self.layout(g.tensor, bounds).blocks.values():
            blk = self.blocks[bid]
            if all(o <= a < o + n for a, o, n in zip(at, blk.origin, blk.shape)):
                local = [a - o for a, o in zip(at, blk.origin)]
                return bid, sum(v * math.prod(blk.shape[k + 1:]) for k, v in enumerate(local))
        raise GraphError(f"partition: no block of %{g.tensor} holds guard element {g.index}")

    # ------------------------------------------------------------ constant blocks
    def _set_constant(self, bid: int, value: float) -> None:
        """Block `bid` holds `value` everywhere (already as its dtype stores it): no task writes
        it unless some task reads it. A guarded node's block is zero where its guard is off, so
        it is no constant: a (guarded) fill writes it now."""
        blk = self.blocks[bid]
        node = self.g.nodes[blk.node]
        if node.guard is not None:
            self._append((), bid, bid in self.written, FillOp(constant_expr(value), blk.origin),
                         node)
            return
        self.known[bid] = value
        self.pending[bid] = value
        self.const_nodes.add(self.blocks[bid].node)

    def _materialize(self, bid: int) -> None:
        """A constant fill task for a constant block that a task reads."""
        value = self.pending.pop(bid)
        blk = self.blocks[bid]
        self._append((), bid, False, FillOp(constant_expr(value), blk.origin),
                     self.g.nodes[blk.node])

    def _copy_task(self, reads, write, op, node: Node) -> None:
        """A copy task, or none where every block it reads is one constant (then so is the
        write)."""
        if self.drop and reads and self.known:
            values = {self.known.get(b) for b in reads}
            if len(values) == 1 and None not in values:
                self._set_constant(write, values.pop())
                return
        self._task(reads, write, False, op, node)

    def layout(self, node_id: int, bounds: Bounds) -> _Grid:
        """The blocks of `node_id` in `bounds`, made (from host, by fills or by copies) if new."""
        key = (node_id, bounds)
        if key in self.grids:
            return self.grids[key]
        node = self.g.nodes[node_id]
        if isinstance(node.op, Input):
            return self._new_grid(node, bounds)
        if isinstance(node.op, Fill):
            grid = self._new_grid(node, bounds)
            for bid in grid.blocks.values():
                blk = self.blocks[bid]
                value = fill_constant(node.op.expr, blk.origin, blk.shape) if self.drop else None
                if value is not None:
                    value = dtype_value(value, node.dtype)
                if value is None:
                    self._task((), bid, False, FillOp(node.op.expr, blk.origin), node)
                else:
                    self._set_constant(bid, value)
            return grid
        if node_id not in self.primary:
            raise GraphError(f"partition: %{node_id} used before it is partitioned")
        return self._regrid(node, self.grids[(node_id, self.primary[node_id])], bounds)

    def _regrid(self, node: Node, src: _Grid, bounds: Bounds) -> _Grid:
        grid = self._new_grid(node, bounds)
        for bid in grid.blocks.values():
            dst = self.blocks[bid]
            reads, pieces = [], []
            for sid in src.blocks.values():
                s = self.blocks[sid]
                lo = [max(a, b) for a, b in zip(dst.origin, s.origin)]
                hi = [min(a + n, b + m) for a, n, b, m in zip(dst.origin, dst.shape, s.origin,
                                                               s.shape)]
                if all(l < h for l, h in zip(lo, hi)) or not dst.shape:
                    pieces.append(Piece(len(reads),
                                        tuple((l - o, h - o) for l, h, o in zip(lo, hi, s.origin)),
                                        tuple((l - o, h - o) for l, h, o in zip(lo, hi, dst.origin))))
                    reads.append(sid)
            self._copy_task(reads, bid, CopyOp(tuple(pieces)), node)
        return grid

    def _produce(self, node: Node, bounds: Bounds) -> _Grid:
        self.primary[node.id] = bounds
        return self._new_grid(node, bounds)

    # ------------------------------------------------------------ cut choice
    def _plan_cuts(self) -> None:
        """Parts per axis class for the whole graph (see `einpage.compiler.cuts`)."""
        self.classes = AxisClasses(self.g)
        ops = []
        for node in self.g.nodes:
            if node.id in self.opt.cuts:
                continue
            if isinstance(node.op, Einsum):
                letters, terms, out_term = self._einsum_letters(node)
            elif isinstance(node.op, Gather):
                letters, terms, out_term = self._gather_letters(node)
            else:
                continue
            sizes = {c: s for c, (s, _) in letters.items()}
            cls = {c: k for c, (_, k) in letters.items()}
            items = [self.g.nodes[i].dtype.itemsize for i in node.inputs] + [node.dtype.itemsize]
            ops.append(CutOp(node.id, sizes, cls, tuple(zip((*terms, out_term), items)),
                             frozenset(out_term)))
        self._plan_groups()
        limits = {k: size // q for k, (q, size) in self.quantum.items()}
        limits.update({k: 1 for k in self.whole})
        self.class_parts = choose_class_parts(ops, self.opt.block_bytes, limits)
        if self.opt.weight_block_bytes:
            weights = [tuple(k for k, i in enumerate(self.g.nodes[op.node].inputs)
                             if isinstance(self.g.nodes[op.node].op, Einsum)
                             and isinstance(self.g.nodes[i].op, Input)
                             and self.g.nodes[i].op.role.value == "weight") for op in ops]
            self.class_parts = cap_streamed_weights(ops, weights, self.class_parts,
                                                    self.opt.weight_block_bytes, limits)
        # The einsum and gather tasks alone, counted before any is made: fail in a second, not
        # after building a million tasks.
        planned = 0
        for node in self.g.nodes:
            if isinstance(node.op, Einsum):
                planned += math.prod(self._class_parts(node, self._einsum_letters(node)[0]).values())
            elif isinstance(node.op, Gather):
                planned += math.prod(self._class_parts(node, self._gather_letters(node)[0]).values())
        if planned > self.opt.max_tasks:
            raise self._too_many(f"{planned} planned")

    def _plan_groups(self) -> None:
        """Where quantized weights constrain the cuts: the first axis of each one's packed row
        is cut at multiples of its quantum (whole groups), the axes after it not at all."""
        self.quantum: dict[int, tuple[int, int]] = {}  # class -> (cut quantum, its extent)
        self.whole: set[int] = set()
        for node in self.g.nodes:
            st = node.op.storage if isinstance(node.op, Input) else None
            if st is None:
                continue
            k = len(node.shape) - st.span
            cls = self.classes.of(node.id, k)
            q, size = self.quantum.get(cls, (1, node.shape[k]))
            self.quantum[cls] = (math.lcm(q, st.quantum(tuple(node.shape))), size)
            self.whole.update(self.classes.of(node.id, d) for d in range(k + 1, len(node.shape)))

    def _bounds(self, cls: int | None, size: int, parts: int) -> tuple[int, ...]:
        """Even cut points of an axis of class `cls`, at whole groups where that is needed."""
        q = self.quantum.get(cls, (1, 0))[0] if cls is not None else 1
        if cls in self.whole:
            parts = 1
        if q == 1 or not size:
            return even_bounds(size, parts)
        return tuple(q * b for b in even_bounds(size // q, parts))

    def _einsum_letters(self, node: Node):
        """Index letter -> (size, axis class), the operand terms and the output term."""
        spec: EinsumSpec = node.op.spec
        letters = {}
        for i, term in zip(node.inputs, spec.inputs):
            for axis, c in enumerate(term):
                letters.setdefault(c, (self.g.nodes[i].shape[axis], self.classes.of(i, axis)))
        return letters, list(spec.inputs), spec.output

    def _gather_letters(self, node: Node):
        """Gather as an op over letters: table `V` + rest, ids idx, output idx + rest."""
        table, ids = (self.g.nodes[i] for i in node.inputs)
        rest = "".join(chr(ord("A") + k) for k in range(len(table.shape) - 1))
        idx = "".join(chr(ord("a") + k) for k in range(len(ids.shape)))
        letters = {"V": (table.shape[0], self.classes.of(table.id, 0))}
        for k, c in enumerate(rest):
            letters[c] = (table.shape[k + 1], self.classes.of(table.id, k + 1))
        for k, c in enumerate(idx):
            letters[c] = (ids.shape[k], self.classes.of(ids.id, k))
        return letters, ["V" + rest, idx], idx + rest

    def _class_parts(self, node: Node, letters) -> dict[str, int]:
        if node.id in self.opt.cuts:
            manual = dict(self.opt.cuts[node.id])
            return {c: max(1, min(manual.get(c, 1), size or 1)) for c, (size, _) in letters.items()}
        return {c: max(1, min(self.class_parts.get(k, 1), size or 1))
                for c, (size, k) in letters.items()}

    def _split(self, node: Node, letters, parts: dict[str, int]) -> dict[str, int]:
        """`parts` with the contracted axes of each weight of `opt.split_weights` that `node`
        reads cut further (halvings, the largest block axis first, whole groups kept) until its
        blocks are at most `opt.split_bytes`: its blocks accumulate into the same output blocks,
        and only the node's other operands (a decode step's few rows) are laid out again."""
        cap = self.opt.split_bytes
        if not cap or not self.opt.split_weights or node.id in self.opt.cuts:
            return parts  # (a node cut by hand keeps its cuts)
        spec = node.op.spec
        contracted = set(spec.contracted)
        for i, term in zip(node.inputs, spec.inputs):
            if i not in self.opt.split_weights:
                continue
            weight = self.g.nodes[i]
            storage = weight.op.storage if isinstance(weight.op, Input) else None
            item = (tensor_bytes(tuple(weight.shape), weight.dtype, storage)
                    / max(1, math.prod(weight.shape)))  # bytes an element (packed: its share)
            while item * math.prod(letters[c][0] / parts[c] for c in term) > cap:
                free = [c for c in term if c in contracted and letters[c][1] not in self.whole
                        and parts[c] * 2 <= letters[c][0] // self.quantum.get(
                            letters[c][1], (1, 0))[0]]
                if not free:
                    break
                c = max(free, key=lambda c: (letters[c][0] / parts[c], c))
                parts = {**parts, c: parts[c] * 2}
        return parts

    def _axis_parts(self, node: Node, axis: int) -> int:
        return max(1, min(self.class_parts.get(self.classes.of(node.id, axis), 1),
                          node.shape[axis] or 1))

    # ------------------------------------------------------------ per node kind
    def einsum(self, node: Node) -> None:
        op: Einsum = node.op
        spec: EinsumSpec = op.spec
        sizes = spec.sizes([self.g.nodes[i].shape for i in node.inputs])
        letters = self._einsum_letters(node)[0]
        parts = self._split(node, letters, self._class_parts(node, letters))
        bounds = {c: self._bounds(letters[c][1], sizes[c], parts[c]) for c in sizes}
        out = self._produce(node, tuple(bounds[c] for c in spec.output))
        grids = [self.layout(i, tuple(bounds[c] for c in term))
                 for i, term in zip(node.inputs, spec.inputs)]
        block_op = EinsumOp(spec, op.join, op.agg, node.dtype)
        letters = spec.join_indices
        ranges = [range(len(bounds[c]) - 1) for c in letters]
        if not any(i in self.const_nodes for i in node.inputs):
            contracted = spec.contracted
            for coords in itertools.product(*ranges):
                at = dict(zip(letters, coords))
                reads = [g.blocks[tuple(at[c] for c in term)]
                         for g, term in zip(grids, spec.inputs)]
                write = out.blocks[tuple(at[c] for c in spec.output)]
                acc = any(at[c] for c in contracted)
                self._task(reads, write, acc, block_op, node)
            return
        # Some operand blocks are constants: fold them into the join, task by task (one
        # decision per pattern of constant operands and their values).
        known, decisions = self.known, {}
        for coords in itertools.product(*ranges):
            at = dict(zip(letters, coords))
            reads = [g.blocks[tuple(at[c] for c in term)] for g, term in zip(grids, spec.inputs)]
            write = out.blocks[tuple(at[c] for c in spec.output)]
            pattern = tuple((k, known[b]) for k, b in enumerate(reads) if b in known)
            kind, kept, task_op = "full", None, block_op
            if pattern:
                if pattern not in decisions:
                    decisions[pattern] = self._fold_decision(node, pattern, block_op)
                kind, kept, task_op = decisions[pattern]
            if kind == "constant":
                self._set_constant(write, kept)
            elif kind == "reduced":
                self._task([reads[k] for k in kept], write, write in self.written, task_op, node)
            elif kind == "full":
                self._task(reads, write, write in self.written, task_op, node)
            # "drop": a partial equal to the aggregation's identity adds nothing
        if spec.contracted:  # blocks all of whose partials were dropped: the identity
            for bid in out.blocks.values():
                if bid not in self.written:
                    self._set_constant(bid, dtype_value(identity(op.agg), node.dtype))

    def _fold_decision(self, node: Node, pattern, block_op: EinsumOp):
        """What the tasks of einsum `node` whose operands `pattern` ((operand, value), ...) are
        constant become: ("constant", value, None) its output block is that constant (no
        contraction); ("drop", None, None) the partial adds the aggregation's identity;
        ("reduced", kept operands, op) a task reading the other operands only; ("full", None, op)
        the task as it is, reading the constants (materialised)."""
        op, spec = node.op, node.op.spec
        folded = fold(op.join, dict(pattern), len(spec.inputs))
        full = ("full", None, block_op)
        if folded is None:
            return full
        if folded.value is not None:
            if not spec.contracted:
                value = dtype_value(folded.value, node.dtype)
                return full if value is None else ("constant", value, None)
            if (folded.value == identity(op.agg)
                    and dtype_value(folded.value, node.dtype) is not None):
                return ("drop", None, None)
            return full
        kept_letters = set("".join(spec.inputs[k] for k in folded.kept))
        if all(c in kept_letters for k, _ in pattern for c in spec.inputs[k]):
            reduced = EinsumSpec(tuple(spec.inputs[k] for k in folded.kept), spec.output)
            return ("reduced", folded.kept, EinsumOp(reduced, folded.join, op.agg, node.dtype))
        return full

    def gather(self, node: Node) -> None:
        table, ids = (self.g.nodes[i] for i in node.inputs)
        rest = "".join(chr(ord("A") + k) for k in range(len(table.shape) - 1))
        idx = "".join(chr(ord("a") + k) for k in range(len(ids.shape)))
        sizes = dict(zip("V" + rest, table.shape)) | dict(zip(idx, ids.shape))
        letters = self._gather_letters(node)[0]
        parts = self._class_parts(node, letters)
        bounds = {c: self._bounds(letters[c][1], sizes[c], parts[c]) for c in sizes}
        out = self._produce(node, tuple(bounds[c] for c in idx + rest))
        tgrid = self.layout(table.id, tuple(bounds[c] for c in "V" + rest))
        igrid = self.layout(ids.id, tuple(bounds[c] for c in idx))
        letters = idx + rest + "V"
        for coords in itertools.product(*[range(len(bounds[c]) - 1) for c in letters]):
            at = dict(zip(letters, coords))
            t = tgrid.blocks[tuple(at[c] for c in "V" + rest)]
            i = igrid.blocks[tuple(at[c] for c in idx)]
            self._task((t, i), out.blocks[tuple(at[c] for c in idx + rest)], at["V"] > 0,
                       GatherOp(bounds["V"][at["V"]]), node)

    def _split_dims(self, node: Node, fixed_axis: int | None, axis_bounds=None) -> Bounds:
        """Bounds for a copy-produced node: halve its largest dim until a block is at most half
        the task budget (a copy reads about as much as it writes), starting from its classes'
        cuts."""
        parts = [self._axis_parts(node, d) if d != fixed_axis else 1
                 for d in range(len(node.shape))]
        def block_bytes():
            n = node.dtype.itemsize
            for d, s in enumerate(node.shape):
                n *= -(-s // parts[d]) if d != fixed_axis else max(
                    (b - a for a, b in zip(axis_bounds, axis_bounds[1:])), default=0)
            return n
        while block_bytes() > self.opt.block_bytes // 2:
            cands = [d for d in range(len(node.shape)) if d != fixed_axis
                     and parts[d] * 2 <= node.shape[d]]
            if not cands:
                break
            d = max(cands, key=lambda d: (-(-node.shape[d] // parts[d]), -d))
            parts[d] *= 2
        return tuple(axis_bounds if d == fixed_axis else
                     self._bounds(self.classes.of(node.id, d), s, parts[d])
                     for d, s in enumerate(node.shape))

    def _axis_bounds(self, extent: int, item_bytes_per_row: int) -> tuple[int, ...]:
        rows = max(1, (self.opt.block_bytes // 2) // max(1, item_bytes_per_row))
        return even_bounds(extent, -(-extent // rows)) if extent else (0, 0)

    def concat(self, node: Node) -> None:
        axis = node.op.axis
        row = node.dtype.itemsize * math.prod(s for d, s in enumerate(node.shape) if d != axis)
        axis_bounds, pieces_of, start = [0], [], 0
        for i in node.inputs:
            ext = self.g.nodes[i].shape[axis]
            local = self._axis_bounds(ext, row)
            pieces_of.append(local)
            axis_bounds += [start + b for b in local[1:]]
            start += ext
        out_bounds = self._split_dims(node, axis, tuple(axis_bounds))
        out = self._produce(node, out_bounds)
        start = 0
        for i, local in zip(node.inputs, pieces_of):
            in_bounds = tuple(local if d == axis else b for d, b in enumerate(out_bounds))
            ext = self.g.nodes[i].shape[axis]
            self._copy_blocks(node, self.layout(i, in_bounds), out, axis, start, (start, start + ext))
            start += ext

    def slice(self, node: Node) -> None:
        op: Slice = node.op
        src = self.g.nodes[node.inputs[0]]
        if src.id in self.primary:
            src_bounds = self.primary[src.id]
        else:
            src_bounds = self._split_dims(src, None)
        cuts = sorted({b for b in src_bounds[op.axis] if op.start < b < op.stop}
                      | {op.start, op.stop} | {0, src.shape[op.axis]})
        src_bounds = tuple(tuple(cuts) if d == op.axis else b for d, b in enumerate(src_bounds))
        grid = self.layout(src.id, src_bounds)
        out_axis = tuple(c - op.start for c in cuts if op.start <= c <= op.stop)
        out = self._produce(node, tuple(out_axis if d == op.axis else b
                                        for d, b in enumerate(src_bounds)))
        self._copy_blocks(node, grid, out, op.axis, -op.start, (0, op.stop - op.start))

    def _copy_blocks(self, node, src: _Grid, out: _Grid, axis: int, shift: int,
                     covers: tuple[int, int]) -> None:
        """One copy task per output block whose origin on `axis` is in `covers`; it lies inside
        one source block shifted by `shift`."""
        index = {}
        for coords, sid in src.blocks.items():
            b = self.blocks[sid]
            key = tuple(o + (shift if d == axis else 0) for d, o in enumerate(b.origin))
            index[key] = sid
        for bid in out.blocks.values():
            dst = self.blocks[bid]
            if not covers[0] <= dst.origin[axis] < covers[1]:
                continue
            for key, sid in index.items():
                s = self.blocks[sid]
                if all(k <= o < k + n for k, o, n in zip(key, dst.origin, s.shape)):
                    lo = [o - k for o, k in zip(dst.origin, key)]
                    box_src = tuple((l, l + n) for l, n in zip(lo, dst.shape))
                    box_dst = tuple((0, n) for n in dst.shape)
                    self._copy_task((sid,), bid, CopyOp((Piece(0, box_src, box_dst),)), node)
                    break
            else:
                raise GraphError(f"partition: no source block for {dst.name}")

    def reshape(self, node: Node) -> None:
        src = self.g.nodes[node.inputs[0]]
        whole_src = tuple((0, s) for s in src.shape)
        grid = self.layout(src.id, self.primary.get(src.id, whole_src))
        out = self._produce(node, tuple((0, s) for s in node.shape))
        reads, pieces = [], []
        for sid in grid.blocks.values():
            b = self.blocks[sid]
            pieces.append(Piece(len(reads), tuple((0, n) for n in b.shape),
                                tuple((o, o + n) for o, n in zip(b.origin, b.shape))))
            reads.append(sid)
        (bid,) = out.blocks.values()
        self._copy_task(reads, bid, CopyOp(tuple(pieces), tuple(src.shape)), node)

    # ------------------------------------------------------------ driver
    def run(self) -> TaskGraph:
        self._plan_cuts()
        outputs: list[OutputBlock] = []
        for node in self.g.nodes:
            op = node.op
            if isinstance(op, Einsum):
                self.einsum(node)
            elif isinstance(op, Gather):
                self.gather(node)
            elif isinstance(op, Concat):
                self.concat(node)
            elif isinstance(op, Slice):
                self.slice(node)
            elif isinstance(op, Reshape):
                self.reshape(node)
            elif isinstance(op, Output):
                src = self.g.nodes[node.inputs[0]]
                bounds = self.primary.get(src.id) or tuple((0, s) for s in src.shape)
                for bid in self.layout(src.id, bounds).blocks.values():
                    if bid in self.pending:
                        self._materialize(bid)
                    outputs.append(OutputBlock(bid, op.name, self.blocks[bid].origin))
        inputs = tuple(LogicalTensor(n.op.name, n.op.role.value, tuple(n.shape), n.dtype)
                       for n in self.g.inputs)
        results = tuple(LogicalTensor(n.op.name, "output", tuple(n.shape), n.dtype)
                        for n in self.g.outputs)
        tg = TaskGraph(tuple(self.blocks), tuple(self.tasks), tuple(outputs), inputs, results)
        return tg


def partition(graph: Graph, options: PartitionOptions) -> TaskGraph:
    """Cut a concrete graph into block tasks (see the module docstring)."""
    if not graph.is_concrete:
        raise GraphError("partition: bind the graph's size symbols first")
    tg = _Partitioner(graph, options).run()
    if options.drop_constant_blocks:
        tg = prune_dead(tg)
    tg.verify()
    return tg
