"""The logical graph: einsum operations on whole tensors, shapes possibly symbolic.

A `Graph` is an immutable tuple of `Node`s in topological order; a node's `op` says what it
computes (one frozen record per kind). Build graphs with `einpage.ir.builder.GraphBuilder`.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, replace
from typing import Mapping, Union

import sympy

from einpage.errors import GraphError, ShapeError, SpecError
from einpage.ir import scalar
from einpage.ir.dtypes import DType
from einpage.ir.spec import EinsumSpec
from einpage.ir.storage import Storage

Size = Union[int, sympy.Expr]


class Role(enum.Enum):
    weight = "weight"          # starts in host storage; read-only
    activation = "activation"  # supplied by the caller for each pass
    cache = "cache"            # KV store kept by the caller across passes; either tier


@dataclass(frozen=True, slots=True)
class Input:
    name: str
    role: Role
    #: a weight or KV store kept in a block format (`einpage.ir.storage`): its bytes are
    #: packed; einsums and gathers read the logical tensor of the node's shape and dtype
    storage: Storage | None = None


@dataclass(frozen=True, slots=True)
class Einsum:
    """`out[o] = agg over contracted of join(in0[...], in1[...], ...)`."""
    spec: EinsumSpec
    join: sympy.Expr
    agg: str | None  # set exactly when some index is contracted


@dataclass(frozen=True, slots=True)
class Fill:
    """A constant tensor: `expr` of index symbols `i0, i1, ...` (and size symbols)."""
    expr: sympy.Expr


@dataclass(frozen=True, slots=True)
class Gather:
    """`out[ids..., rest...] = table[ids[...], rest...]` (embedding lookup); inputs (table, ids)."""


@dataclass(frozen=True, slots=True)
class Reshape:
    """Split or merge dims; the node's shape is the new shape."""


@dataclass(frozen=True, slots=True)
class Concat:
    axis: int


@dataclass(frozen=True, slots=True)
class Slice:
    axis: int
    start: Size
    stop: Size


@dataclass(frozen=True, slots=True)
class Output:
    name: str


Op = Union[Input, Einsum, Fill, Gather, Reshape, Concat, Slice, Output]


@dataclass(frozen=True, slots=True)
class Guard:
    """A node computed only where element `index` (flat, C order) of node `tensor` is nonzero;
    elsewhere its value is all zeros. A model guards what it then multiplies by zero anyway (a
    mixture of experts: an expert's FFN, guarded by whether any token chose it), so a runtime
    may skip the work. `share` is the expected fraction of passes the guard is on (a number in
    (0, 1], or an expression of the size symbols until `bind`): prediction prices the node at
    that share."""
    tensor: int
    index: int
    share: Size = 1


@dataclass(frozen=True, slots=True)
class Node:
    id: int
    op: Op
    inputs: tuple[int, ...]
    shape: tuple[Size, ...]
    dtype: DType
    stage: int = 0  # a scheduling hint: the layer a node belongs to (0 where there are none)
    guard: Guard | None = None

    @property
    def kind(self) -> str:
        return type(self.op).__name__.lower()


def _subs(value, sizes: Mapping[sympy.Symbol, int]):
    if isinstance(value, sympy.Basic):
        out = value.xreplace(sizes)
        return int(out) if out.is_Integer else out
    return value


@dataclass(frozen=True)
class Graph:
    nodes: tuple[Node, ...]
    _users: tuple[tuple[int, ...], ...] = field(default=(), repr=False, compare=False)

    def __post_init__(self):
        users: list[list[int]] = [[] for _ in self.nodes]
        for n in self.nodes:
            for i in n.inputs:
                if 0 <= i < len(users):
                    users[i].append(n.id)
            if n.guard is not None and 0 <= n.guard.tensor < len(users):
                users[n.guard.tensor].append(n.id)
        object.__setattr__(self, "_users", tuple(tuple(u) for u in users))

    def users(self, node_id: int) -> tuple[int, ...]:
        return self._users[node_id]

    @property
    def inputs(self) -> list[Node]:
        return [n for n in self.nodes if isinstance(n.op, Input)]

    @property
    def outputs(self) -> list[Node]:
        return [n for n in self.nodes if isinstance(n.op, Output)]

    def input(self, name: str) -> Node:
        for n in self.inputs:
            if n.op.name == name:
                return n
        raise GraphError(f"graph has no input named {name!r}")

    @property
    def symbols(self) -> set[sympy.Symbol]:
        out: set[sympy.Symbol] = set()
        for n in self.nodes:
            for s in n.shape:
                if isinstance(s, sympy.Basic):
                    out |= s.free_symbols
            if isinstance(n.op, Fill):
                out |= {s for s in n.op.expr.free_symbols if not s.name.startswith("i")}
            if n.guard is not None and isinstance(n.guard.share, sympy.Basic):
                out |= n.guard.share.free_symbols
        return out

    @property
    def is_concrete(self) -> bool:
        return not self.symbols

    # ---------------------------------------------------------------- bind
    def bind(self, **sizes: int) -> "Graph":
        """A concrete graph: every size symbol replaced by the given integer."""
        known = {s.name: s for s in self.symbols}
        unknown = sorted(set(sizes) - set(known))
        if unknown:
            raise GraphError(f"bind: graph has no size symbol {unknown[0]!r} "
                             f"(it has {', '.join(sorted(known)) or 'none'})")
        missing = sorted(set(known) - set(sizes))
        if missing:
            raise GraphError(f"bind: no size given for symbol(s) {', '.join(missing)}")
        for k, v in sizes.items():
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise GraphError(f"bind: size {k}={v!r} is not a non-negative integer")
        table = {known[k]: sympy.Integer(v) for k, v in sizes.items()}
        nodes = []
        for n in self.nodes:
            op = n.op
            if isinstance(op, Fill):
                op = Fill(op.expr.xreplace(table))
            elif isinstance(op, Slice):
                op = Slice(op.axis, _subs(op.start, table), _subs(op.stop, table))
            guard = n.guard
            if guard is not None and isinstance(guard.share, sympy.Basic):
                share = guard.share.xreplace(table)
                guard = replace(guard, share=float(share) if share.is_number else share)
            nodes.append(replace(n, op=op, shape=tuple(_subs(s, table) for s in n.shape),
                                 guard=guard))
        g = Graph(tuple(nodes))
        g.verify()
        check_not_empty(g.nodes, "bind", sizes)
        return g

    # ---------------------------------------------------------------- printer
    def __str__(self) -> str:
        return "\n".join(format_node(n) for n in self.nodes)

    # ---------------------------------------------------------------- verify
    def verify(self) -> None:
        """Check the graph's invariants; raise `GraphError`/`SpecError`/`ShapeError` naming the
        node on the first one broken.

        Invariants:
        1. `nodes[k].id == k`; every input id is smaller than the node's id (topological order).
        2. Input and fill nodes have no inputs; output, reshape and slice nodes have one; gather two.
        3. Input names are unique; output names are unique.
        4. An einsum has one input per spec operand, each of the spec's rank; every index has one
           size across operands; its shape is the spec's output shape; `agg` is one of
           sum/max/min exactly when an index is contracted; its join mentions only `x0..x{n-1}`.
        5. A gather's ids are i64, its shape is `ids.shape + table.shape[1:]`.
        6. A reshape keeps the element count; a concat's operands agree off its axis and its axis
           size is their sum; a slice has `0 <= start <= stop <= size` on its axis. Reshape, slice
           and concat keep their operands' dtype; a gather keeps its table's.
        7. An output has its input's shape and dtype.
        8. Fills mention only index symbols `i<k>` with k < rank, and size symbols.
        9. A guard names an earlier node that is no output, an element inside it, and a share
           in (0, 1] once concrete; inputs, outputs and fills are never guarded.
        """
        names: set[str] = set()
        outs: set[str] = set()
        for k, n in enumerate(self.nodes):
            if n.id != k:
                raise GraphError(f"node at position {k} has id {n.id}")
            for i in n.inputs:
                if not 0 <= i < k:
                    raise GraphError(f"{_where(n)}: input %{i} is not an earlier node")
            verify_node(self.nodes, n, names, outs)


def check_not_empty(nodes, what: str, sizes: dict | None = None) -> None:
    """No computed result is empty: an einsum, fill, gather or output with a size of 0, or an
    einsum aggregating over an index of size 0 (a max over nothing has no value), is a
    `GraphError` naming the first such node and, after `bind`, the sizes given. Inputs and the
    views of them (concat, slice, reshape) may be empty: a KV cache of no rows yet."""
    given = " (" + ", ".join(f"{k}={v}" for k, v in sizes.items()) + ")" if sizes else ""
    for n in nodes:
        if isinstance(n.op, (Input, Concat, Slice, Reshape)):
            continue
        for axis, size in enumerate(n.shape):
            if size == 0:
                raise GraphError(f"{what}: {_where(n)} has shape {tuple(n.shape)}, size 0 on "
                                 f"axis {axis}{given}: a result needs every size at least 1")
        if isinstance(n.op, Einsum) and n.op.spec.contracted:
            index = n.op.spec.sizes([nodes[i].shape for i in n.inputs])
            empty = [c for c in n.op.spec.contracted if index[c] == 0]
            if empty:
                raise GraphError(f"{what}: {_where(n)} aggregates ({n.op.agg}) over index "
                                 f"{empty[0]!r} of size 0{given}: there is nothing to aggregate")


def _where(n: Node) -> str:
    return f"node %{n.id} ({n.kind})"


def _arity(n: Node, want: int) -> None:
    if len(n.inputs) != want:
        raise GraphError(f"{_where(n)}: expected {want} input(s), got {len(n.inputs)}")


def verify_node(nodes, n: Node, names: set, outs: set) -> None:
    """Invariants 2-9 of `Graph.verify` for one node; `nodes` holds at least its inputs."""
    op = n.op
    if n.guard is not None:
        _verify_guard(nodes, n)
    shapes = [nodes[i].shape for i in n.inputs]
    where = _where(n)
    if isinstance(op, Input):
        _arity(n, 0)
        if op.name in names:
            raise GraphError(f"{where}: duplicate input name {op.name!r}")
        names.add(op.name)
    elif isinstance(op, Einsum):
        out = op.spec.output_shape(shapes, where=f"{where}: ")
        if tuple(out) != tuple(n.shape):
            raise ShapeError(f"{where}: einsum {op.spec} gives shape {tuple(out)}, node says "
                             f"{tuple(n.shape)}")
        if bool(op.spec.contracted) != (op.agg is not None):
            raise SpecError(f"{where}: einsum {op.spec}: aggregation "
                            + ("required: index(es) " + repr(op.spec.contracted) + " are contracted"
                               if op.spec.contracted else f"{op.agg!r} given but nothing is contracted"))
        if op.agg is not None and op.agg not in scalar.AGGREGATIONS:
            raise SpecError(f"{where}: unknown aggregation {op.agg!r}; valid: "
                            + ", ".join(scalar.AGGREGATIONS))
        bad = scalar.free_operands(op.join) - set(range(len(n.inputs)))
        if bad:
            raise SpecError(f"{where}: join {op.join} mentions x{min(bad)} but the einsum has "
                            f"{len(n.inputs)} operand(s)")
    elif isinstance(op, Fill):
        _arity(n, 0)
        for s in op.expr.free_symbols:
            if s.name.startswith("i") and s.name[1:].isdigit() and int(s.name[1:]) >= len(n.shape):
                raise GraphError(f"{where}: fill uses {s} but has rank {len(n.shape)}")
    elif isinstance(op, Gather):
        _arity(n, 2)
        table, ids = (nodes[i] for i in n.inputs)
        if ids.dtype is not DType.i64:
            raise GraphError(f"{where}: gather ids %{ids.id} must be i64, not {ids.dtype}")
        want = tuple(ids.shape) + tuple(table.shape[1:])
        if want != tuple(n.shape):
            raise ShapeError(f"{where}: gather of table {tuple(table.shape)} by ids "
                             f"{tuple(ids.shape)} gives {want}, node says {tuple(n.shape)}")
    elif isinstance(op, Reshape):
        _arity(n, 1)
        a, b = math.prod(shapes[0]), math.prod(n.shape)
        if sympy.simplify(a - b) != 0:
            raise ShapeError(f"{where}: reshape {tuple(shapes[0])} -> {tuple(n.shape)} changes "
                             f"the element count ({a} vs {b})")
    elif isinstance(op, Concat):
        _verify_concat(n, shapes)
    elif isinstance(op, Slice):
        _arity(n, 1)
        size = shapes[0][op.axis] if 0 <= op.axis < len(shapes[0]) else None
        if size is None:
            raise ShapeError(f"{where}: slice axis {op.axis} out of range for {tuple(shapes[0])}")
        want = list(shapes[0])
        want[op.axis] = op.stop - op.start
        if tuple(want) != tuple(n.shape):
            raise ShapeError(f"{where}: slice gives {tuple(want)}, node says {tuple(n.shape)}")
        if all(isinstance(v, int) for v in (op.start, op.stop, size)) and not (
                0 <= op.start <= op.stop <= size):
            raise ShapeError(f"{where}: slice [{op.start}:{op.stop}] outside axis {op.axis} "
                             f"of size {size}")
    if isinstance(op, (Reshape, Slice, Concat, Gather)):
        for i in n.inputs[:1] if isinstance(op, Gather) else n.inputs:
            if nodes[i].dtype is not n.dtype:
                raise GraphError(f"{where}: operand %{i} is {nodes[i].dtype}, the node {n.dtype}")
    if isinstance(op, Output):
        _arity(n, 1)
        src = nodes[n.inputs[0]]
        if op.name in outs:
            raise GraphError(f"{where}: duplicate output name {op.name!r}")
        outs.add(op.name)
        if tuple(src.shape) != tuple(n.shape) or src.dtype is not n.dtype:
            raise GraphError(f"{where}: output differs from its input in shape or dtype")


def _verify_guard(nodes, n: Node) -> None:
    g, where = n.guard, _where(n)
    if isinstance(n.op, (Input, Output, Fill)):
        raise GraphError(f"{where}: an {n.kind} cannot be guarded")
    if not 0 <= g.tensor < n.id or isinstance(nodes[g.tensor].op, Output):
        raise GraphError(f"{where}: its guard %{g.tensor} is not an earlier node's tensor")
    size = math.prod(nodes[g.tensor].shape)
    if g.index < 0 or (isinstance(size, int) and g.index >= size):
        raise GraphError(f"{where}: guard element {g.index} is outside %{g.tensor} "
                         f"({size} elements)")
    share = g.share
    if isinstance(share, sympy.Basic) and share.is_number:
        share = float(share)
    if isinstance(share, (int, float)) and not 0 < share <= 1:
        raise GraphError(f"{where}: guard share {share} is not in (0, 1]")


def _verify_concat(n: Node, shapes) -> None:
    op = n.op
    where = _where(n)
    if not shapes:
        raise GraphError(f"{where}: concat of nothing")
    rank = len(shapes[0])
    if not 0 <= op.axis < rank:
        raise ShapeError(f"{where}: concat axis {op.axis} out of range for rank {rank}")
    total = 0
    for k, s in enumerate(shapes):
        if len(s) != rank or any(a != b for d, (a, b) in enumerate(zip(s, shapes[0])) if d != op.axis):
            raise ShapeError(f"{where}: concat operand {k} has shape {tuple(s)}, operand 0 has "
                             f"{tuple(shapes[0])} (they may differ only on axis {op.axis})")
        total = total + s[op.axis]
    want = list(shapes[0])
    want[op.axis] = total
    if tuple(want) != tuple(n.shape):
        raise ShapeError(f"{where}: concat gives {tuple(want)}, node says {tuple(n.shape)}")


# -------------------------------------------------------------------- printer
def _shape_text(shape) -> str:
    return ",".join(str(s) for s in shape)


def _op_text(n: Node) -> str:
    op = n.op
    if isinstance(op, Input):
        return f"input[{op.role.value}] {op.name!r}"
    if isinstance(op, Einsum):
        extra = ""
        if op.join != scalar.product(len(n.inputs)):
            extra += f", join={scalar.to_text(op.join)}"
        if op.agg is not None:
            extra += f", agg={op.agg}"
        return f"einsum[{op.spec}{extra}]"  # inside the brackets: `agg=sum(%0)` reads as a call
    if isinstance(op, Fill):
        return f"fill[{scalar.to_text(op.expr)}]"
    if isinstance(op, Concat):
        return f"concat[axis={op.axis}]"
    if isinstance(op, Slice):
        return f"slice[axis={op.axis}, {op.start}:{op.stop}]"
    if isinstance(op, Output):
        return f"output {op.name!r}"
    return n.kind


def format_node(n: Node) -> str:
    """`%5 = einsum[bsm,nm->bsn, agg=sum](%3, %4) f16[B,S,N]`: one deterministic line per node."""
    args = ", ".join(f"%{i}" for i in n.inputs)
    call = f"({args})" if n.inputs else ""
    guard = f" if %{n.guard.tensor}[{n.guard.index}]" if n.guard is not None else ""
    return f"%{n.id} = {_op_text(n)}{call} {n.dtype}[{_shape_text(n.shape)}]{guard}"
