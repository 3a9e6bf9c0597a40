"""Tensor parallelism: every layer of one model split over several devices.

Where a pipeline gives each device consecutive layers (`einpage.compiler.pipeline`), tensor
parallelism gives each device a share of every layer: attention heads and feed-forward columns
(Megatron-LM's split). Each device then holds 1/N of the weights and does 1/N of the work of
every layer; after the attention's output projection and after the FFN's down projection the
devices hold partial sums of the hidden state, which an *all-reduce* adds up.

The split is found on the einsum graph itself, by propagating shardings through it, so it holds
for any model written with the index letters of `einpage.models.llama` (a dense LLaMA, Qwen,
Mistral, a Mixtral's experts). Some letters are *split letters* (`split_letters`: `n`, the kv
heads, or `g`, the query heads of a group, where the kv heads do not divide by N; `f`, the FFN's
columns; `v`, the vocabulary), each used only where every einsum that names it has a size that N
divides. Every node is in one of three states:

- *replicated*: every rank holds all of it (activation inputs, fills, the residual stream);
- *sharded* along one axis: rank r holds the r-th of N equal slices (a weight or KV store whose
  einsums all name a split letter on one axis; an einsum's output that keeps the letter its
  sharded operands are split on);
- *partial*: every rank holds a tensor of the full shape, and the value is their sum (an einsum
  that contracts over the split letter, with a `sum`).

An einsum's operands may be split along one letter at most; a replicated operand that names it
is sliced on the rank (a `Slice` node: a tied embedding read by the vocabulary's einsum). A
partial value stays partial through einsums that are linear in it (`_linear_in`: the join adds
up over the ranks, `J(p1 + p2) = J(p1) + J(p2)`, every other operand replicated, a `sum` or no
aggregation: a Mixtral layer's expert outputs, scaled by their router weights and summed), held
in float32 whatever the model's dtype; anything else reads the all-reduced value. An output
that is sharded leaves each rank as its slice (`gathered`: the caller concatenates them, the
logits along the vocabulary and the new KV rows along the heads).

The all-reduce is made of the messages a pipeline already sends (`send` / `recv`, version 2 of
the plan format): rank r outputs its partial as `tp.<node>` and takes every other rank q's as an
input `tp.<node>.<q>`; the reduced value is one einsum adding all N in the order of the ranks
(`x0 + x1 + ... + x{N-1}`), so that every rank computes the same bits. Messages then go both
ways, so a pipeline's rule for freedom from deadlock (sends only forward) no longer holds; its
replacement (`einpage.ir.peers`) is an order on the exchanges that every rank keeps: each
exchange's recvs wait for the rank's own sends of it, and its sends for the rank's recvs of the
exchange before it. Each rank sends its partial to the N - 1 others: (N - 1) x its bytes, where
a ring all-reduce sends 2 (N - 1) / N x: the same for N = 2, twice as much for N = 4.
"""
from __future__ import annotations

import functools
import heapq
from types import MappingProxyType
import math
from dataclasses import dataclass, replace
from typing import Callable, Mapping

import sympy

from einpage.errors import PlanError
from einpage.ir import scalar
from einpage.ir.dtypes import DType
from einpage.ir.graph import (Concat, Einsum, Gather, Graph, Input, Node, Output,
                              Reshape, Role, Slice)
from einpage.ir.memgraph import InputNode, MemGraph, RecvNode, SendNode, boxes_meet
from einpage.ir.peers import exchange_input, exchange_name
from einpage.ir.spec import EinsumSpec

#: the letters tensor parallelism may split, in the order tried for attention (`n`, else `g`)
ATTENTION_LETTERS = ("n", "g")
OTHER_LETTERS = ("f", "v")
PARTIAL = -1  # a node's state: the ranks hold addends of its value
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


@dataclass(frozen=True)
class TensorSplit:
    """The rank graphs of a tensor-parallel split of one graph.

    `shards[r]`: rank r's slice of each sharded weight or KV-store input, `name -> (axis, start,
    stop)` of the whole input; `gathered`: each sharded output's axis (rank r's result is the
    r-th slice along it); `exchanges`: the graph nodes whose partial sums are all-reduced, in
    the order every rank reduces them; `letters`: the split letters used."""
    world: int
    graphs: tuple[Graph, ...]
    shards: tuple[Mapping[str, tuple[int, int, int]], ...]
    gathered: Mapping[str, int]
    exchanges: tuple[int, ...]
    letters: tuple[str, ...]
    stages: int = 1  # of the whole graph; every rank runs all of them

    def stage_range(self, rank: int) -> tuple[int, int]:
        return 0, self.stages - 1


def _letter_sizes(graph: Graph) -> dict[str, set[int]]:
    sizes: dict[str, set[int]] = {}
    for n in graph.nodes:
        if isinstance(n.op, Einsum):
            got = n.op.spec.sizes([graph.nodes[i].shape for i in n.inputs])
            for c, s in got.items():
                sizes.setdefault(c, set()).add(int(s))
    return sizes


def split_letters(graph: Graph, world: int) -> tuple[str, ...]:
    """The letters this graph splits over `world` ranks: every einsum that names one has a size
    `world` divides (and at least `world`); of the attention's, `n` where it divides, else `g`."""
    sizes = _letter_sizes(graph)

    def ok(c: str) -> bool:
        return c in sizes and all(s >= world and s % world == 0 for s in sizes[c])

    attention = next((c for c in ATTENTION_LETTERS if ok(c)), None)
    return tuple(c for c in ((attention,) if attention else ()) + OTHER_LETTERS if ok(c))


def _linear_in(join: sympy.Expr, positions, n: int) -> bool:
    """Whether `join` (of operands x0..x{n-1}) adds up over the operands at `positions` taken
    together: J(a + b) = J(a) + J(b), the others held fixed."""
    return _linear(join, tuple(positions), n)


@functools.lru_cache(maxsize=256)
def _linear(join: sympy.Expr, positions: tuple[int, ...], n: int) -> bool:
    xs = [scalar.x(k) for k in range(n)]
    a = {xs[k]: sympy.Symbol(f"_a{k}") for k in positions}
    b = {xs[k]: sympy.Symbol(f"_b{k}") for k in positions}
    both = {xs[k]: a[xs[k]] + b[xs[k]] for k in positions}
    gap = join.xreplace(both) - join.xreplace(a) - join.xreplace(b)
    return sympy.simplify(sympy.expand(gap)) == 0


class _States:
    """Each node's state (None: replicated; an axis: sharded along it; PARTIAL) and the partial
    nodes read all-reduced (`reduced`), found to a fixed point."""

    def __init__(self, graph: Graph, letters: tuple[str, ...], world: int):
        self.g, self.letters, self.world = graph, letters, world
        self.reduced: set[int] = set()
        self.letter: dict[int, str | None] = {}  # einsum -> the letter it is split along
        while True:
            before = len(self.reduced)
            self.state = self._propagate()
            if len(self.reduced) == before:
                break
        # a node marked in an earlier round may have become replicated since (its operand
        # now read reduced): only what is still a partial sum is all-reduced
        self.reduced = {i for i in self.reduced if self.state[i] == PARTIAL}

    def read(self, i: int):
        """The state a consumer sees of node i (an all-reduced partial is replicated)."""
        s = self.state[i]
        return None if s == PARTIAL and i in self.reduced else s

    def _need_reduced(self, i: int) -> None:
        if self.state[i] == PARTIAL:
            self.reduced.add(i)

    def _input_axis(self, n: Node) -> int | None:
        """A weight or KV store is sharded where every reader is an einsum that names a split
        letter on the same axis (the first such axis of each reader); one kept in a block format
        too, its slices cut as `_check_packed_slice` requires."""
        if n.op.role == Role.activation:
            return None
        axes = set()
        for u in self.g.users(n.id):
            user = self.g.nodes[u]
            if not isinstance(user.op, Einsum) or (user.guard and user.guard.tensor == n.id):
                return None
            for term, i in zip(user.op.spec.inputs, user.inputs):
                if i == n.id:
                    axes.add(next((a for a, c in enumerate(term) if c in self.letters), None))
        return axes.pop() if len(axes) == 1 and None not in axes else None

    def _propagate(self) -> list:
        g = self.g
        state: list = [None] * len(g.nodes)
        self.state, self.letter = state, {}
        for n in g.nodes:
            op = n.op
            if isinstance(op, Input):
                state[n.id] = self._input_axis(n)
            elif isinstance(op, Einsum):
                state[n.id] = self._einsum(n)
            elif isinstance(op, Reshape):
                state[n.id] = self._reshape(n)
            elif isinstance(op, (Concat, Slice)):
                for i in n.inputs:
                    self._need_reduced(i)
                axes = {self.read(i) for i in n.inputs}
                if op.axis in axes:
                    raise PlanError(f"node %{n.id} ({n.kind}) cuts along the axis its operand is "
                                    "split on for tensor parallelism")
                state[n.id] = axes.pop() if len(axes) == 1 else _conflict(n)
            elif isinstance(op, Gather):
                if any(self.read(i) not in (None, PARTIAL) for i in n.inputs):
                    raise PlanError(f"node %{n.id} (gather) reads a table split for tensor "
                                    "parallelism")
                for i in n.inputs:
                    self._need_reduced(i)
            elif isinstance(op, Output):
                self._need_reduced(n.inputs[0])
                state[n.id] = self.read(n.inputs[0])
            if n.guard is not None:
                self._need_reduced(n.guard.tensor)
                if self.read(n.guard.tensor) is not None:
                    raise PlanError(f"node %{n.id}: its guard is split for tensor parallelism")
        return state

    def _einsum(self, n: Node):
        op: Einsum = n.op
        spec = op.spec
        partial = [k for k, i in enumerate(n.inputs) if self.read(i) == PARTIAL]
        if partial:
            others_replicated = all(self.read(i) is None for k, i in enumerate(n.inputs)
                                    if k not in partial)
            if (others_replicated and op.agg in (None, "sum")
                    and _linear_in(op.join, partial, len(n.inputs))):
                return PARTIAL
            for k in partial:
                self._need_reduced(n.inputs[k])
            return None  # this pass reads them reduced from the next round on
        c = self.letter[n.id] = self._split_letter(n)
        if c is None:
            return None
        if c in spec.output:
            return spec.output.index(c)
        if op.agg != "sum":
            raise PlanError(f"node %{n.id} (einsum {spec}) takes the {op.agg} over {c!r}, which "
                            "tensor parallelism splits (only a sum of the parts is reduced)")
        return PARTIAL

    def _split_letter(self, n: Node) -> str | None:
        """The letter einsum `n` is split along: its sharded operands'; where none is sharded,
        a split letter of a weight it reads (a tied embedding's vocabulary, sliced here)."""
        spec = n.op.spec
        letters = {spec.inputs[k][self.read(i)] for k, i in enumerate(n.inputs)
                   if self.read(i) is not None}
        if len(letters) > 1:
            return _conflict(n)
        if letters:
            return letters.pop()
        for term, i in zip(spec.inputs, n.inputs):
            op = self.g.nodes[i].op
            if isinstance(op, Input) and op.role == Role.weight:
                for c in term:
                    if c in self.letters:
                        return c
        return None

    def _reshape(self, n: Node):
        src = self.read(n.inputs[0])
        if src is None or src == PARTIAL:
            return src
        before = math.prod(int(s) for s in self.g.nodes[n.inputs[0]].shape[:src])
        world_ok = [b for b in range(len(n.shape))
                    if math.prod(int(s) for s in n.shape[:b]) == before]
        if not world_ok:
            raise PlanError(f"node %{n.id} (reshape) merges the axis its operand is split on "
                            "for tensor parallelism into another")
        fits = [b for b in world_ok if int(n.shape[b]) > 1]  # a size-1 axis holds no slice
        if not fits or int(n.shape[fits[0]]) % self.world != 0:
            raise PlanError(f"node %{n.id} (reshape) moves the axis its operand is split on "
                            "for tensor parallelism to one the devices do not divide")
        return fits[0]


def _check_packed_slice(op: Input, shape: tuple[int, ...], axis: int, world: int) -> None:
    """A rank's slice of an input kept in a block format (`einpage.ir.storage`) must be a box of
    the packed bytes (`Storage.packed_box`): cut along an axis before the packed rows, or along
    the rows' first axis at whole groups (a down projection's rows of FFN columns split in N)."""
    st = op.storage
    part = tuple(s // world if a == axis else s for a, s in enumerate(shape))
    origin = tuple(part[axis] if a == axis else 0 for a in range(len(shape)))
    try:
        st.packed_box(origin, part, shape)  # the second rank's slice: every cut is like it
    except PlanError:
        raise PlanError(f"tensor parallelism: input {op.name!r} is kept in {st.format} rows of "
                        f"{st.row(shape)} elements, which {world} devices cannot split at "
                        f"whole groups of {st.group}: use a pipeline (--parallel pipeline)") from None


def _conflict(n: Node):
    raise PlanError(f"node %{n.id} ({n.kind}) reads operands split along different axes for "
                    "tensor parallelism")


def shard_graph(graph: Graph, world: int, letters: tuple[str, ...] | None = None) -> TensorSplit:
    """Split `graph` (concrete) over `world` ranks (the module's docstring)."""
    if world < 2:
        raise PlanError(f"tensor parallelism needs 2 devices or more, got {world}")
    letters = split_letters(graph, world) if letters is None else tuple(letters)
    states = _States(graph, letters, world)
    if not any(s not in (None,) for s in states.state):
        raise PlanError(f"nothing in this graph splits over {world} devices (no head count, FFN "
                        f"width or vocabulary that {world} divides): use a pipeline")
    graphs, shards = [], []
    gathered: dict[str, int] = {}
    exchanges = tuple(sorted(states.reduced))
    for r in range(world):
        g, s = _rank_graph(graph, states, world, r, gathered)
        graphs.append(g)
        shards.append(s)
    stages = max((n.stage for n in graph.nodes), default=0) + 1
    return TensorSplit(world, tuple(graphs), tuple(shards), dict(gathered), exchanges, letters,
                       stages)


def _part(size: int, world: int, r: int) -> tuple[int, int]:
    k = size // world
    return r * k, (r + 1) * k


def _rank_graph(graph: Graph, states: _States, world: int, r: int, gathered: dict):
    nodes: list[Node] = []
    new: dict[int, int] = {}     # old node -> the node its consumers read here
    sliced: dict[tuple[int, int], int] = {}
    shards: dict[str, tuple[int, int, int]] = {}

    def add(node: Node) -> int:
        k = len(nodes)
        nodes.append(replace(node, id=k))
        return k

    def local_slice(i: int, axis: int) -> int:
        """Replicated node i's slice of this rank along `axis`."""
        if (i, axis) not in sliced:
            src = nodes[new[i]]
            start, stop = _part(int(src.shape[axis]), world, r)
            shape = tuple(stop - start if a == axis else s for a, s in enumerate(src.shape))
            sliced[(i, axis)] = add(Node(0, Slice(axis, start, stop), (new[i],), shape,
                                         src.dtype, src.stage))
        return sliced[(i, axis)]

    def divided(shape, axis) -> tuple:
        return tuple(int(s) // world if a == axis else int(s) for a, s in enumerate(shape))

    for n in graph.nodes:
        st = states.state[n.id]
        op = n.op
        guard = n.guard if n.guard is None else replace(n.guard, tensor=new[n.guard.tensor])
        if isinstance(op, Input):
            shape = tuple(n.shape)
            if st is not None:
                shape = divided(n.shape, st)
                start, stop = _part(int(n.shape[st]), world, r)
                shards[op.name] = (st, start, stop)
                if op.storage is not None:
                    _check_packed_slice(op, tuple(int(s) for s in n.shape), st, world)
            new[n.id] = add(replace(n, shape=shape))
            continue
        if isinstance(op, Einsum):
            c = states.letter.get(n.id)
            inputs = []
            for term, i in zip(op.spec.inputs, n.inputs):
                if c is not None and c in term and states.read(i) is None:
                    inputs.append(local_slice(i, term.index(c)))
                else:
                    inputs.append(new[i])
            shape = op.spec.output_shape([nodes[i].shape for i in inputs])
            dtype = n.dtype
            if st == PARTIAL and dtype.is_float and dtype.itemsize < 4:
                dtype = DType.f32  # addends are kept, and added, in float32
            new[n.id] = add(replace(n, inputs=tuple(inputs), shape=tuple(shape), dtype=dtype,
                                    guard=guard))
        elif isinstance(op, Output):
            src = nodes[new[n.inputs[0]]]
            if st is not None:
                gathered[op.name] = st
            new[n.id] = add(replace(n, inputs=(new[n.inputs[0]],), shape=src.shape,
                                    dtype=src.dtype))
            continue
        else:  # fill, gather, reshape, concat, slice: the shape follows the operand's split
            inputs = tuple(new[i] for i in n.inputs)
            shape = tuple(n.shape)
            if st not in (None, PARTIAL):
                shape = divided(n.shape, st)
            dtype = n.dtype
            if st == PARTIAL:
                dtype = nodes[inputs[0]].dtype
            new[n.id] = add(replace(n, inputs=inputs, shape=shape, dtype=dtype, guard=guard))
        if st == PARTIAL and n.id in states.reduced:
            new[n.id] = _all_reduce(nodes, add, new[n.id], n, world, r)
    g = Graph(tuple(nodes))
    g.verify()
    return g, shards


def _all_reduce(nodes: list[Node], add: Callable, local: int, n: Node, world: int,
                r: int) -> int:
    """The all-reduced value of partial node `n` (here `local`): its addend leaves as output
    `tp.<n>`, every other rank's comes in as input `tp.<n>.<q>`, and one einsum adds the N in
    the order of the ranks, cast to the node's own dtype."""
    mine = nodes[local]
    add(Node(0, Output(exchange_name(n.id)), (local,), mine.shape, mine.dtype, mine.stage))
    terms = []
    for q in range(world):
        if q == r:
            terms.append(local)
        else:
            terms.append(add(Node(0, Input(exchange_input(n.id, q), Role.activation), (),
                                  mine.shape, mine.dtype, mine.stage)))
    idx = _LETTERS[:len(mine.shape)]
    spec = EinsumSpec((idx,) * world, idx)
    join = sum((scalar.x(k) for k in range(1, world)), scalar.x(0))
    return add(Node(0, Einsum(spec, join, None), tuple(terms), mine.shape, n.dtype, mine.stage))


# ------------------------------------------------------------------ compiling the ranks

def compile_tensor_parallel(graph: Graph, world: int, options,
                            compile_fn: Callable | None = None):
    """Compile `graph` split over `world` devices of `options.device_bytes` each: each rank
    graph compiled with `options` (its weights 1/N of the model's), the programs joined by the
    all-reduces' messages and validated together. Each program's meta says how its inputs are
    sliced (`shards`: name -> [axis, start, stop] of the whole input) and its outputs gathered
    (`gathered`: name -> axis), so that a plan file runs on its own."""
    from einpage.compiler.driver import compile_graph
    from einpage.compiler.pipeline import ParallelPlan, RankPlan
    compile_fn = compile_fn or compile_graph
    if options.cuts:
        raise PlanError("per-node cuts name the whole graph's nodes; tensor-parallel ranks take "
                        "none")
    split = shard_graph(graph, world)
    compiled, programs = compile_ranks(split, options, compile_fn)
    programs = [with_shards(mg, split, r, parallel="tensor") for r, mg in enumerate(programs)]
    if options.validate:
        from einpage.ir.peers import validate_ranks
        validate_ranks(programs)
    return ParallelPlan(split, tuple(RankPlan(r, mg, c) for r, (mg, c)
                                     in enumerate(zip(programs, compiled))),
                        options.host_compute)


def compile_ranks(split: TensorSplit, options, compile_fn: Callable) -> tuple[list, list]:
    """The ranks of `split` compiled with `options`, and their programs joined by the
    all-reduces' messages (`join_exchanges`). The ranks are compiled apart, and each may choose
    another partition order; the join needs their exchanges in one order, and where one rank
    makes a later exchange's block only after it has read an earlier one's sum while another
    makes them the other way, the messages make a cycle (`PlanError`). Then the ranks are
    compiled again with every block placed by stamp (`CompileOptions.pack_low` off), which
    moves their searches (of two quantized llamas over two ranks, one's ranks agree only
    packed, the other's only by stamp). Where they disagree both ways, the error stands."""
    compiled = [compile_fn(g, options) for g in split.graphs]
    try:
        return compiled, join_exchanges(split, [c.memgraph for c in compiled])
    except PlanError:
        if not options.pack_low:
            raise
    compiled = [compile_fn(g, replace(options, pack_low=False)) for g in split.graphs]
    return compiled, join_exchanges(split, [c.memgraph for c in compiled])


def with_shards(mg: MemGraph, split: TensorSplit, r: int, **meta) -> MemGraph:
    """`mg` (rank r of `split`) with what its meta says of the split: how its inputs are sliced
    and its outputs gathered, and `meta`."""
    return replace(mg, meta=MappingProxyType({
        **mg.meta, **meta, "shards": {k: list(v) for k, v in split.shards[r].items()},
        "gathered": dict(split.gathered)}))


# ------------------------------------------------------------------ joining the programs

def join_exchanges(split: TensorSplit, plans: list[MemGraph]) -> list[MemGraph]:
    """Each rank's program with the messages of its all-reduces. An *exchange* is one block of
    one partial sum (output `tp.<node>`): each rank sends its block to every other rank once
    final, and receives theirs (input `tp.<node>.<q>`). Exchanges are ordered as rank 0 makes
    their blocks, the same on every rank; on each rank the recvs of an exchange wait for the
    rank's own sends of it, and its sends for the rank's recvs of the exchange before (the order
    that makes every run free of deadlock: `einpage.ir.peers`). The nodes are then listed in a
    topological order as close to the compiled one as the new deps allow (`_stable_order`),
    each reload of a received block first moved to just before its user
    (`pipeline.late_reloads`). Tags count up per (sender, receiver) over the exchanges by
    partial sum and block."""
    from einpage.compiler.pipeline import late_reloads, send_sources
    world = split.world
    received = [{exchange_input(k, q) for k in split.exchanges for q in range(world) if q != r}
                for r in range(world)]
    plans = [late_reloads(mg, received[r]) for r, mg in enumerate(plans)]
    blocks = [[(k, o) for k in split.exchanges for o in mg.outputs if o.name == exchange_name(k)]
              for mg in plans]
    boxes = [[(k, tuple(o.origin)) for k, o in b] for b in blocks]
    if any(b != boxes[0] for b in boxes):
        raise PlanError("the ranks cut a partial sum into different blocks; the all-reduce "
                        "needs the same blocks on every rank")
    made = [send_sources(mg, [o for _, o in blocks[r]], r) for r, mg in enumerate(plans)]
    order = exchange_order([dep for dep, _ in made[0]])
    tags: dict[tuple[int, int], int] = {}
    tag_of: dict[tuple[int, int, int], int] = {}  # (src, dst, exchange) -> tag
    for e in range(len(boxes[0])):
        for q in range(world):
            for r in range(world):
                if r != q:
                    tag_of[(q, r, e)] = tags[(q, r)] = tags.get((q, r), -1) + 1
    out = []
    for r, mg in enumerate(plans):
        nodes = list(mg.nodes)
        key = [float(n.id) for n in nodes]   # where each node goes in the list (stable order)
        deps = [tuple(n.deps) for n in nodes]
        recvs_by_input: dict[str, list[int]] = {}
        last_recvs: list[int] = []
        for e in order:
            k, o = blocks[r][e]
            dep, offset = made[r][e]
            sends = []
            for q in range(world):
                if q != r:
                    sends.append(len(nodes))
                    nodes.append(SendNode(len(nodes), o.tensor, offset, q, tag_of[(r, q, e)], ()))
                    deps.append((dep, *last_recvs))
                    key.append(key[dep] + 0.5)
            last_recvs = []
            for q in range(world):
                if q != r:
                    theirs = blocks[q][e][1]
                    name = exchange_input(k, q)
                    last_recvs.append(len(nodes))
                    recvs_by_input.setdefault(name, []).append(len(nodes))
                    nodes.append(RecvNode(len(nodes), name, tuple(theirs.origin),
                                          tuple(plans[q].tensors[theirs.tensor].shape), q,
                                          tag_of[(q, r, e)], ()))
                    deps.append(tuple(sends))
                    key.append(key[dep] + 0.75)
        for n in mg.nodes:  # an input block of a received partial waits for the recvs meeting it
            if isinstance(n, InputNode):
                t = mg.tensors[n.tensor]
                if t.source is not None and t.source.input in recvs_by_input:
                    deps[n.id] = tuple(i for i in recvs_by_input[t.source.input]
                                       if boxes_meet(nodes[i].origin, nodes[i].shape,
                                                     t.source.origin, t.shape)) + deps[n.id]
        out.append(replace(mg, nodes=_stable_order(nodes, deps, key), rank=r, world=world))
    return out


def exchange_order(makers: list[int]) -> list[int]:
    """The exchanges in the order they are made (`makers[e]`: the node of rank 0's program
    that finishes exchange e's block)."""
    return sorted(range(len(makers)), key=lambda e: (makers[e], e))


def _stable_order(nodes: list, deps: list[tuple[int, ...]], key: list[float]) -> tuple:
    """The nodes in a topological order of `deps`, each as close to its `key` as the order
    allows (Kahn's algorithm taking the smallest key ready), renumbered."""
    users: list[list[int]] = [[] for _ in nodes]
    waiting = [len(set(d)) for d in deps]
    for k, d in enumerate(deps):
        for p in set(d):
            users[p].append(k)
    ready = [(key[k], k) for k in range(len(nodes)) if waiting[k] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, k = heapq.heappop(ready)
        order.append(k)
        for u in users[k]:
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, (key[u], u))
    if len(order) != len(nodes):
        raise PlanError("the messages of the all-reduces make a cycle with the program")
    new = {old: i for i, old in enumerate(order)}
    return tuple(replace(nodes[old], id=i, deps=tuple(sorted(new[d] for d in deps[old])))
                 for i, old in enumerate(order))
