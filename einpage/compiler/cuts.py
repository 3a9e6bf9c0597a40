"""Cut choice: how many parts every index of every op is cut into, chosen for the whole graph.

Cuts are chosen per *axis class*, not per op. Two tensor axes are in one class when some op ties
them: an einsum index letter ties every operand axis and the output axis it names; a gather ties
its output to the table's trailing axes and to the ids' axes; a concat or slice ties every axis
but the one it works along. All axes of a class are cut the same way (even bounds, the same number
of parts), so a tensor is written in exactly the layout its consumers read it in: no `copy` tasks
re-assemble activations between ops (LLaMA: the batch, sequence, head and feed-forward cuts run
unchanged from the projections through rotary, scores, softmax, attention-times-values and the
output projection). Regrids remain only where a layout cannot follow a class (a concat axis, a
reshape, a hand-set cut).

Constraint: every einsum and gather must have a working set (its operand blocks plus its output
block) of at most `block_bytes`. A reduction (one operand) must fit its *row* too, every
contracted index counted whole: its input is typically read again once the reduction is done
(RMSNorm, softmax), so all of a row is live at once however the reduced index is cut; rows shrink
only by cutting indices the reduction keeps.

Cost: the device-memory traffic of the plan, each task reading and writing its working set once
(`tasks x working set` per op), plus a per-task overhead. Cutting an index every operand of an op
shares (batch rows, attention heads along the attention chain) costs only the overhead; cutting one
that some operand lacks re-reads that operand once more per part (a weight per batch block, the
layer input per head).

Greedy: while some op is over its limit, the op furthest over it names the candidate classes (its
indices that still shrink its working set, or its row); each is scored by the traffic it adds over
the whole graph divided by the halvings it brings to *every* op over the limit (a batch cut helps
the attention of all layers at once, a head cut only its own layer); the cheapest is doubled. A
class some op contracts counts `CONTRACTED_COST` times: its partial sums (or a reduction's row
tiles) stay live across tasks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from einpage.ir.graph import Concat, Einsum, Gather, Graph, Input, Slice

#: Cost factor for cutting a class that some op contracts.
CONTRACTED_COST = 2
#: Per-task overhead in the traffic cost, as a share of the block budget (kernel launches, and
#: fewer tasks also compile faster).
TASK_OVERHEAD_SHARE = 1 / 256


class AxisClasses:
    """Union-find over the axes (node id, axis) of every node of a graph."""

    def __init__(self, graph: Graph):
        self.base: list[int] = []
        n = 0
        for node in graph.nodes:
            self.base.append(n)
            n += len(node.shape)
        self._parent = list(range(n))
        for node in graph.nodes:
            op = node.op
            if isinstance(op, Einsum):
                spec = op.spec
                at: dict[str, int] = {}
                for i, term in zip(node.inputs, spec.inputs):
                    for axis, c in enumerate(term):
                        self._tie(at, c, self.of(i, axis))
                for axis, c in enumerate(spec.output):
                    self._tie(at, c, self.of(node.id, axis))
            elif isinstance(op, Gather):
                table, ids = node.inputs
                k = len(graph.nodes[ids].shape)
                for axis in range(len(node.shape)):
                    other = self.of(ids, axis) if axis < k else self.of(table, axis - k + 1)
                    self.union(self.of(node.id, axis), other)
            elif isinstance(op, (Concat, Slice)):
                for i in node.inputs:
                    for axis in range(len(node.shape)):
                        if axis != op.axis:
                            self.union(self.of(node.id, axis), self.of(i, axis))

    def _tie(self, at: dict[str, int], c: str, elem: int) -> None:
        if c in at:
            self.union(at[c], elem)
        else:
            at[c] = elem

    def of(self, node_id: int, axis: int) -> int:
        """The class of one axis."""
        x = self.base[node_id] + axis
        parent = self._parent
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def union(self, a: int, b: int) -> None:
        a, b = self.of_elem(a), self.of_elem(b)
        if a != b:
            self._parent[max(a, b)] = min(a, b)

    def of_elem(self, x: int) -> int:
        parent = self._parent
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x


@dataclass(frozen=True, slots=True)
class CutOp:
    """One op the cuts must serve: its index letters, their sizes and classes, and its terms."""
    node: int
    sizes: dict[str, int]
    cls: dict[str, int]                 # letter -> axis class
    terms: tuple[tuple[str, int], ...]  # (letters, item bytes): operands, then the output
    kept: frozenset[str]                # letters of the output (not contracted)


class _OpArrays:
    """The ops as arrays (op x letter slot, op x term x letter slot) for vectorised sizing."""

    def __init__(self, ops: list[CutOp], class_index: dict[int, int]):
        n = len(ops)
        width = max((len(op.sizes) for op in ops), default=1) or 1
        nterms = max((len(op.terms) for op in ops), default=1)
        pad = len(class_index)  # a class of its own that is never cut
        self.cls = np.full((n, width), pad, np.int64)
        self.size = np.ones((n, width), np.int64)
        self.kept = np.ones((n, width), bool)
        self.first = np.zeros((n, width), bool)  # first slot of its class within the op
        self.inmask = np.zeros((n, nterms, width), bool)
        self.item = np.zeros((n, nterms), np.int64)
        self.reduction = np.array([len(op.terms) == 2 for op in ops], bool)
        for o, op in enumerate(ops):
            seen = set()
            slot = {c: j for j, c in enumerate(op.sizes)}
            for c, j in slot.items():
                k = class_index[op.cls[c]]
                self.cls[o, j] = k
                self.size[o, j] = max(1, op.sizes[c])
                self.kept[o, j] = c in op.kept
                self.first[o, j] = k not in seen
                seen.add(k)
            for t, (term, item) in enumerate(op.terms):
                self.item[o, t] = item
                for c in term:
                    self.inmask[o, t, slot[c]] = True
        # the ops that use each class, ascending: the ops of each (op, slot), grouped by class
        ops_of, classes = np.nonzero(self.cls < pad)[0], self.cls[self.cls < pad]
        by_class = np.argsort(classes, kind="stable")
        bounds = np.searchsorted(classes[by_class], np.arange(pad + 1))
        self.users = [np.unique(ops_of[by_class[bounds[k]:bounds[k + 1]]]) for k in range(pad)]

    def measure(self, parts: np.ndarray, idx=slice(None), double: int | None = None):
        """Working set, row working set and task count of ops `idx` under `parts` (with class
        `double` doubled)."""
        cls, size = self.cls[idx], self.size[idx]
        p = parts[cls]
        if double is not None:
            p = np.where(cls == double, p * 2, p)
        p = np.maximum(np.minimum(p, size), 1)
        blk = -(-size // p)
        inmask, item = self.inmask[idx], self.item[idx]
        ws = (np.where(inmask, blk[:, None, :], 1).prod(axis=2) * item).sum(axis=1)
        row_blk = np.where(self.kept[idx], blk, size)
        row = (np.where(inmask, row_blk[:, None, :], 1).prod(axis=2) * item).sum(axis=1)
        return ws.astype(float), row.astype(float), p.prod(axis=1).astype(float)


def _class_arrays(ops: list[CutOp], max_parts: dict[int, int] | None):
    """The classes the ops use, in order; the ops as arrays over them (`_OpArrays`, the last
    class index a pad that is never cut); each class's most parts (its least size among the
    ops, within `max_parts`); whether some op contracts it."""
    classes = sorted({k for op in ops for k in op.cls.values()})
    arr = _OpArrays(ops, {k: i for i, k in enumerate(classes)})
    pad = len(classes)
    class_size = np.full(pad + 1, 1, np.int64)
    for k in range(pad):
        class_size[k] = arr.size[arr.cls == k].min()
        if max_parts and classes[k] in max_parts:
            class_size[k] = min(class_size[k], max(1, max_parts[classes[k]]))
    contracting = np.zeros(pad + 1, bool)
    contracting[np.unique(arr.cls[~arr.kept])] = True
    contracting[pad] = False
    return classes, arr, class_size, contracting


def choose_class_parts(ops: list[CutOp], block_bytes: int,
                       max_parts: dict[int, int] | None = None) -> dict[int, int]:
    """Parts per axis class (powers of two) so that every op's working set fits `block_bytes`
    where cuts can achieve it (see the module docstring); a class in `max_parts` is cut into at
    most that many (the whole groups of a quantized weight's rows)."""
    if not ops:
        return {}
    classes, arr, class_size, contracting = _class_arrays(ops, max_parts)
    pad = len(classes)
    parts = np.ones(pad + 1, np.int64)
    limit = float(block_bytes)
    overhead = max(1.0, block_bytes * TASK_OVERHEAD_SHARE)
    stuck = np.zeros(len(ops), bool)
    # Each doubling changes only the measures of its class's users, so they are kept and
    # updated, as is each candidate's measure (its users with it doubled): only its users that
    # changed are measured again (`changed`: the doubling that last changed an op; `tried`:
    # class -> [doublings when last brought up to date, working sets, rows, tasks]).
    ws, row, tasks = arr.measure(parts)
    doublings, changed = 0, np.zeros(len(ops), np.int64)
    tried: dict[int, list] = {}
    while True:
        can = (parts[arr.cls] * 2 <= class_size[arr.cls]) & (arr.cls != pad)
        row_phase = arr.reduction & (row > limit) & (can & arr.kept).any(axis=1)
        value = np.where(row_phase, row, ws)
        over = (value > limit) & np.where(row_phase, True, can.any(axis=1)) & ~stuck
        if not over.any():
            break
        worst = int(np.argmax(np.where(over, value, -1.0)))
        slots = can[worst] & (arr.kept[worst] if row_phase[worst] else True)
        best = None
        for k in sorted(set(arr.cls[worst][slots].tolist())):
            users = arr.users[k]
            kept = tried.get(k)
            if kept is None:
                kept = tried[k] = [doublings, *arr.measure(parts, users, double=k)]
            elif kept[0] < doublings:  # measure again the users changed since
                stale = np.flatnonzero(changed[users] > kept[0])
                if len(stale):
                    again = arr.measure(parts, users[stale], double=k)
                    for have, new in zip(kept[1:], again):
                        have[stale] = new
                kept[0] = doublings
            ws2, row2, tasks2 = kept[1:]
            before = value[users]
            after = np.where(row_phase[users], row2, ws2)
            with np.errstate(invalid="ignore", over="ignore", divide="ignore"):  # sizes past
                shrink = np.log2(before / np.maximum(after, 1.0))      # float range: no gain
                need = np.log2(np.maximum(before / limit, 1.0))
                gain = np.minimum(shrink, need)[over[users]].sum()
            if not gain > 0:
                continue
            added = (tasks2 * (ws2 + overhead) - tasks[users] * (ws[users] + overhead)).sum()
            cost = max(added, 0.0) * (CONTRACTED_COST if contracting[k] else 1) / gain
            if best is None or (cost, k) < best:
                best = (cost, k)
        if best is None:
            stuck[worst] = True  # nothing shrinks it further; the lowering reports the budget
            continue
        k = best[1]
        parts[k] *= 2
        doublings += 1
        users = arr.users[k]
        ws[users], row[users], tasks[users] = tried.pop(k)[1:]
        changed[users] = doublings
    return {classes[k]: int(parts[k]) for k in range(pad) if parts[k] > 1}


#: A weight is cut for streaming (`cap_streamed_weights`) only where each of its elements takes
#: part in at least this many multiply-adds: a prefill's projections (one per token), not a
#: decode step's (one per row of the batch), whose extra tasks would cost more in launches than
#: their smaller blocks save in room.
STREAM_REUSE = 64


def reuse(sizes: dict[str, int], letters: str) -> float:
    """The multiply-adds each element of an operand with index `letters` takes part in, in an
    op over indices of `sizes`: the op's whole index space over the operand's."""
    return (float(np.prod([float(v) for v in sizes.values()]))
            / float(np.prod([float(sizes[c]) for c in letters])))


def largest_reused_weight(graph: Graph) -> int:
    """The bytes of the largest weight that some einsum reuses STREAM_REUSE times or more (0:
    none, a decode step): no cap at or above it can cut anything (`cap_streamed_weights`)."""
    largest = 0
    for node in graph.nodes:
        if not isinstance(node.op, Einsum):
            continue
        sizes = {c: graph.nodes[i].shape[k] for i, term in zip(node.inputs, node.op.spec.inputs)
                 for k, c in enumerate(term)}
        for i, term in zip(node.inputs, node.op.spec.inputs):
            src = graph.nodes[i]
            if (isinstance(src.op, Input) and src.op.role.value == "weight"
                    and reuse(sizes, term) >= STREAM_REUSE):
                largest = max(largest, math.prod(src.shape) * src.dtype.itemsize)
    return largest


def cap_streamed_weights(ops: list[CutOp], weights: list[tuple[int, ...]],
                         parts: dict[int, int], cap: int,
                         max_parts: dict[int, int] | None = None) -> dict[int, int]:
    """`parts` with more cuts so that no weight block some op reads is over `cap` bytes, where
    that op reuses each weight element STREAM_REUSE times or more (`weights[i]`: the positions
    among op i's operand terms that are weights). A streamed block needs room in flight beside
    the resident weights and the activations while it is copied and while it is read: llama3.1-8b
    prefill at 8 GB reads its 117 MB FFN matrices whole at the cut choice's 1 GB working sets,
    and every one of them streamed holds that much room. Each doubling goes to the weight's
    axis class that the fewest ops share (a feed-forward column, a head: not the model
    dimension, which would cut every op of the graph), within its size and `max_parts`."""
    parts = dict(parts)
    users: dict[int, int] = {}
    for op in ops:
        for k in set(op.cls.values()):
            users[k] = users.get(k, 0) + 1
    limit = dict(max_parts or {})
    for op, positions in zip(ops, weights):
        for i in positions:
            letters, item = op.terms[i]
            if reuse(op.sizes, letters) < STREAM_REUSE:
                continue
            while True:
                size = float(item)
                for c in letters:
                    size *= op.sizes[c] / parts.get(op.cls[c], 1)
                if size <= cap:
                    break
                free = [c for c in letters
                        if parts.get(op.cls[c], 1) * 2 <= min(op.sizes[c],
                                                               limit.get(op.cls[c], op.sizes[c]))]
                if not free:
                    break
                c = min(free, key=lambda c: (users[op.cls[c]], op.cls[c]))
                parts[op.cls[c]] = parts.get(op.cls[c], 1) * 2
    return parts
