"""The DSL: build a `Graph` by calling methods that return `Tensor` handles.

    g = GraphBuilder()
    x = g.input("x", ("B", "S", "M"), "f16")                 # sizes: ints or symbol names
    w = g.input("w", ("N", "M"), "f16", role="weight")
    y = g.einsum("bsm,nm->bsn", x, w)                         # product join, sum aggregation
    z = g.einsum("bsn->bsn", y, join=lambda a: silu(a))       # elementwise
    g.output("y", z)
    graph = g.build()

Einsums of three or more operands with the default (product) join are split into pairwise
steps along the path opt_einsum finds (minimising the largest intermediate).
"""
from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Callable, Sequence, Union

import opt_einsum
import sympy

from einpage.errors import GraphError, ShapeError, SpecError
from einpage.ir import scalar
from einpage.ir.dtypes import DType, as_dtype
from einpage.ir.graph import (Concat, Einsum, Fill, Gather, Graph, Guard, Input, Node, Output,
                              Reshape, Role, Size, Slice, check_not_empty, verify_node)
from einpage.ir.spec import EinsumSpec
from einpage.ir.storage import Storage

#: Size a symbol is assumed to have when only a path choice depends on it.
PATH_HINT_SIZE = 512


@dataclass(frozen=True, slots=True)
class Tensor:
    """A handle to a node of the graph being built."""
    builder: "GraphBuilder"
    id: int

    @property
    def node(self) -> Node:
        return self.builder._nodes[self.id]

    @property
    def shape(self) -> tuple[Size, ...]:
        return self.node.shape

    @property
    def dtype(self) -> DType:
        return self.node.dtype


JoinLike = Union[sympy.Expr, Callable[..., sympy.Expr], None]


def _size(s: Union[int, str, sympy.Expr]) -> Size:
    if isinstance(s, str):
        return scalar.size_symbol(s)
    if isinstance(s, sympy.Basic):
        return int(s) if s.is_Integer else s
    if isinstance(s, int) and not isinstance(s, bool) and s >= 0:
        return s
    raise GraphError(f"size {s!r} is not a non-negative int, a symbol name or an expression")


class GraphBuilder:
    def __init__(self) -> None:
        self._nodes: list[Node] = []
        self._input_names: set[str] = set()
        self._stage = 0
        self._guard: Guard | None = None

    @contextlib.contextmanager
    def stage(self, number: int):
        """Nodes made inside belong to scheduling stage `number` (e.g. a layer)."""
        old, self._stage = self._stage, number
        try:
            yield
        finally:
            self._stage = old

    @contextlib.contextmanager
    def guard(self, tensor: Tensor, index: int, share=1):
        """Nodes made inside are computed only where element `index` (flat) of `tensor` is
        nonzero, and are all zeros elsewhere (`einpage.ir.graph.Guard`): guard only what the
        model then multiplies by zero. `share`: the expected fraction of passes the guard is
        on (a number or an expression of the size symbols), for prediction."""
        self._check_tensors("guard", (tensor,))
        if self._guard is not None:
            raise GraphError("guards do not nest")
        if not isinstance(share, (int, float)):
            share = sympy.sympify(share)
        self._guard = Guard(tensor.id, int(index), share)
        try:
            yield
        finally:
            self._guard = None

    def _add(self, op, inputs: Sequence[Tensor], shape, dtype) -> Tensor:
        for t in inputs:
            if (isinstance(t, Tensor) and t.builder is self and not isinstance(op, (Einsum, Gather))
                    and getattr(self._nodes[t.id].op, "storage", None) is not None):
                raise GraphError(f"{type(op).__name__.lower()}: {self._nodes[t.id].op.name!r} is "
                                 "kept in a block format; only einsums and gathers read it")
            if not isinstance(t, Tensor) or t.builder is not self:
                raise GraphError(f"{type(op).__name__.lower()}: operand {t!r} is not a tensor of "
                                 "this graph")
        node = Node(len(self._nodes), op, tuple(t.id for t in inputs),
                    tuple(_size(s) for s in shape), as_dtype(dtype), self._stage,
                    None if isinstance(op, (Input, Output, Fill)) else self._guard)
        verify_node(self._nodes, node, set(), set())  # the new node only: O(1) per add
        self._nodes.append(node)
        return Tensor(self, node.id)

    # ------------------------------------------------------------------ nodes
    def input(self, name: str, shape, dtype="f32", role: Union[Role, str] = "activation",
              storage: Storage | None = None) -> Tensor:
        """A graph input; a weight or the KV store may be kept in a block format (`storage`),
        its rows the trailing `storage.span` axes."""
        if name in self._input_names:
            raise GraphError(f"input {name!r} defined twice")
        role = Role(role)
        if storage is not None:
            if role is Role.activation:
                raise GraphError(f"input {name!r}: only weights and the KV store take a storage "
                                 f"format ({storage.format} given to an activation)")
            shape = tuple(_size(s) for s in shape)
            if not all(isinstance(s, int) for s in shape[len(shape) - storage.span:]):
                raise GraphError(f"input {name!r}: a {storage.format} tensor needs concrete "
                                 f"rows, got {list(shape)}")
            why = storage.fits(shape)
            if why:
                raise GraphError(f"input {name!r} {list(shape)}: cannot be stored as "
                                 f"{storage.format}: {why}")
        tensor = self._add(Input(name, role, storage), (), shape, dtype)
        self._input_names.add(name)
        return tensor

    def einsum(self, spec: str, *operands: Tensor, join: JoinLike = None,
               agg: str | None = None, dtype=None) -> Tensor:
        """`out = agg over contracted indices of join(operands)`; `join` defaults to the product
        and, for the product, `agg` to `sum` when something is contracted (as `np.einsum`); a
        join of one's own that contracts must name its `agg`. `dtype` defaults to operand 0's."""
        parsed = EinsumSpec.parse(spec)
        n = len(operands)
        if n != len(parsed.inputs):
            raise SpecError(f"einsum {parsed}: {len(parsed.inputs)} operand(s) in the spec, "
                            f"{n} given")
        self._check_tensors(f"einsum {parsed}", operands)
        expr = _join_expr(join, n, f"einsum {parsed}")
        if parsed.contracted and agg is None:
            if join is not None and scalar.scaled_product_factor(expr, n) is None:
                raise SpecError(f"einsum {parsed} contracts {', '.join(parsed.contracted)} with a "
                                "join of its own: name the aggregation, agg='sum', 'max' or "
                                "'min' (only the default product join sums unless told)")
            agg = "sum"
        out_dtype = as_dtype(dtype) if dtype is not None else operands[0].dtype
        if n > 2 and expr == scalar.product(n) and agg in (None, "sum"):
            return self._pairwise(parsed, operands, out_dtype)
        shape = parsed.output_shape([t.shape for t in operands], where="")
        _check_portable(expr, f"einsum {parsed}: join")
        return self._add(Einsum(parsed, expr, agg), operands, shape, out_dtype)

    def _pairwise(self, spec: EinsumSpec, operands: Sequence[Tensor], dtype: DType) -> Tensor:
        sizes = spec.sizes([t.shape for t in operands])
        hint = {c: (int(s) if not isinstance(s, sympy.Basic) or s.is_Integer else PATH_HINT_SIZE)
                for c, s in sizes.items()}
        shapes = [tuple(hint[c] for c in term) for term in spec.inputs]
        _, info = opt_einsum.contract_path(str(spec), *shapes, shapes=True,
                                           optimize=opt_einsum.DynamicProgramming(minimize="size"))
        live: list[tuple[str, Tensor]] = list(zip(spec.inputs, operands))
        for step in info.contraction_list:
            positions, step_spec = step[0], step[2]
            picked = [live[p] for p in positions]  # positions are sorted descending
            for p in positions:
                live.pop(p)
            out_term = step_spec.split("->")[1]
            ins = ",".join(term for term, _ in picked)
            result = self.einsum(f"{ins}->{out_term}", *[t for _, t in picked], dtype=dtype)
            live.append((out_term, result))
        (term, result), = live
        if term != spec.output:  # the last step already names the output order in practice
            result = self.einsum(f"{term}->{spec.output}", result, dtype=dtype)
        return result

    def fill(self, shape, expr: Union[sympy.Expr, Callable[..., sympy.Expr], float],
             dtype="f32") -> Tensor:
        """A constant tensor; `expr` is a SymPy expression of `index(k)` symbols, a callable of
        the index symbols, or a number."""
        rank = len(shape)
        if callable(expr) and not isinstance(expr, sympy.Basic):
            expr = expr(*[scalar.index(k) for k in range(rank)])
        expr = sympy.sympify(expr)
        _check_portable(expr, "fill")
        return self._add(Fill(expr), (), shape, dtype)

    def gather(self, table: Tensor, ids: Tensor) -> Tensor:
        self._check_tensors("gather", (table, ids))
        return self._add(Gather(), (table, ids), tuple(ids.shape) + tuple(table.shape[1:]),
                         table.dtype)

    def reshape(self, t: Tensor, shape) -> Tensor:
        self._check_tensors("reshape", (t,))
        return self._add(Reshape(), (t,), shape, t.dtype)

    def concat(self, tensors: Sequence[Tensor], axis: int) -> Tensor:
        if not tensors:
            raise GraphError("concat of nothing")
        self._check_tensors("concat", tensors)
        shape = list(tensors[0].shape)
        if 0 <= axis < len(shape):
            shape[axis] = sum((t.shape[axis] for t in tensors[1:]), tensors[0].shape[axis])
        return self._add(Concat(axis), tensors, shape, tensors[0].dtype)

    def slice(self, t: Tensor, axis: int, start, stop) -> Tensor:
        self._check_tensors("slice", (t,))
        shape = list(t.shape)
        if 0 <= axis < len(shape) and all(isinstance(v, int) for v in (start, stop, shape[axis])) \
                and not 0 <= start <= stop <= shape[axis]:  # else the shape is negative: say why
            raise ShapeError(f"node %{len(self._nodes)} (slice): slice [{start}:{stop}] outside "
                             f"axis {axis} of size {shape[axis]}")
        start, stop = _size(start), _size(stop)
        if 0 <= axis < len(shape):
            shape[axis] = stop - start
        return self._add(Slice(axis, start, stop), (t,), shape, t.dtype)

    def output(self, name: str, t: Tensor) -> Tensor:
        self._check_tensors(f"output {name!r}", (t,))
        return self._add(Output(name), (t,), t.shape, t.dtype)

    def _check_tensors(self, what: str, operands: Sequence[object]) -> None:
        """Every operand a `Tensor` of this builder, else a `GraphError` naming it."""
        for k, t in enumerate(operands):
            if isinstance(t, Tensor) and t.builder is self:
                continue
            kind = ("a tensor of another graph" if isinstance(t, Tensor)
                    else f"{type(t).__name__} {_short(t)}")
            raise GraphError(f"{what}: operand {k} ({kind}) is not a tensor of this graph "
                             "(make constants with fill, data with input)")

    def build(self) -> Graph:
        """The graph built so far, verified; it must have an output, and no size of 0."""
        if not any(isinstance(n.op, Output) for n in self._nodes):
            raise GraphError("build: the graph has no output (mark a result with output(name, t))")
        g = Graph(tuple(self._nodes))
        g.verify()
        check_not_empty(g.nodes, "build")
        return g


def _check_portable(expr: sympy.Expr, what: str) -> None:
    """An expression a plan file could not carry is refused where the model writes it."""
    problem = scalar.portable(expr)
    if problem:
        raise SpecError(f"{what}: {problem}; a plan can carry the functions "
                        f"{', '.join(sorted(scalar.FUNCTIONS))} and the constants "
                        f"{', '.join(sorted(scalar.CONSTANTS))}")


def _join_expr(join: JoinLike, n: int, what: str) -> sympy.Expr:
    """The join as a SymPy expression of `x0..x{n-1}`: the product by default, or `join` itself,
    or what the callable `join` builds from the `n` placeholders (one argument per operand;
    SymPy functions, as `einpage.ir.scalar` has them, not NumPy's)."""
    if join is None:
        return scalar.product(n)
    if isinstance(join, sympy.Basic):
        return join
    if not callable(join):
        raise SpecError(f"join must be a SymPy expression or a callable, not {join!r}")
    try:
        inspect.signature(join).bind(*range(n))
    except TypeError:
        raise SpecError(f"{what}: the join takes arguments {inspect.signature(join)}, but the "
                        f"einsum has {n} operand(s): it must take {n}") from None
    except ValueError:  # no signature to read (a builtin): calling it will tell
        pass
    try:
        value = join(*[scalar.x(i) for i in range(n)])
    except (TypeError, AttributeError, ValueError) as exc:
        raise SpecError(f"{what}: the join must build a SymPy expression from its operands "
                        "(with einpage.ir.scalar or sympy functions, not NumPy's): "
                        f"{type(exc).__name__}: {exc}") from None
    if type(value).__module__.split(".")[0] == "numpy":
        raise SpecError(f"{what}: the join returned a NumPy {type(value).__name__}, not a SymPy "
                        "expression (use einpage.ir.scalar or sympy functions, not NumPy's)")
    try:
        return sympy.sympify(value, strict=True)
    except sympy.SympifyError:
        raise SpecError(f"{what}: the join returned {type(value).__name__} {_short(value)}, not "
                        "a SymPy expression of its operands") from None


def _short(value: object) -> str:
    """`repr(value)` on one line, at most 40 characters."""
    text = " ".join(repr(value).split())
    return text if len(text) <= 40 else text[:37] + "..."
