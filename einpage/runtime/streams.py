"""The stream program: a memgraph put on in-order queues, the way the plan was priced.

Every node that does work goes on one queue: `compute` (apply), `h2d` (reload, input at device),
`h2d_host` (a reload of a block an apply on the host wrote: `queues_of`), `d2h` (offload),
`disk` (read: checkpoint file -> host staging buffer), `host` (an apply placed on the host: it
computes on host copies, on the CPU), and in a program of one rank of several
`send` and `recv` (messages to and from peer ranks: a recv blocks only its own queue). `free`
nodes and inputs at host or disk move no byte: they only order, so they fold into the nodes
that depend on them (a node's *queue deps* are its deps with every folded node
replaced by that node's own queue deps, transitively). A queue runs its nodes in plan order, so
a node needs at most one wait per other queue: on the latest node of that queue among its queue
deps, and none where what the node's queue already knows implies it (tracked as a vector of the
latest node known complete on each queue, merged along waits). Events are recorded only for
nodes that something waits on. Every wait names an earlier node of the plan order, so running
the queues can never deadlock: the plan order itself is a schedule that meets every wait.

Nodes that are complete before the pass starts (`preloaded`: the weights loaded with the model
and the KV-store blocks kept on the device — `input at device` nodes of persistent inputs
without deps) fold like frees: nothing waits on them during the pass. A runtime that holds a
plan open for many passes loads them once; activations come in on the h2d queue every pass.

`check_program` proves, independently of how the waits were chosen, that every memgraph edge
is ordered by the program (same queue in order, or a chain of waits).
"""
from __future__ import annotations

from dataclasses import dataclass

from einpage.errors import PlanError
from einpage.ir.memgraph import (ApplyNode, InputNode, MemGraph, MemNode, OffloadNode, ReadNode,
                                 RecvNode, ReloadNode, SendNode)
from einpage.ir.tensors import PERSISTENT_ROLES

QUEUES = ("compute", "h2d", "d2h", "disk", "host", "send", "recv", "h2d_host")


def host_prologue(mg: MemGraph) -> list[ApplyNode]:
    """The host applies that read only the pass's inputs and depend on nothing but inputs and
    each other (no device work before them: a host gather's table and ids,
    `compiler.host_gather`), in plan order: a runtime that replays a captured pass runs them
    before its launch (the CuPy backend's CUDA graphs)."""
    nodes = mg.nodes
    inputs = {n.tensor for n in nodes if isinstance(n, InputNode)}
    out: list[ApplyNode] = []
    ids: set[int] = set()
    for n in nodes:
        if (isinstance(n, ApplyNode) and n.on_host and n.guard is None
                and all(a.tensor in inputs for a in n.reads)
                and all(isinstance(nodes[d], InputNode) or d in ids for d in n.deps)):
            out.append(n)
            ids.add(n.id)
    return out


def queue_of(n: MemNode) -> str | None:
    """The queue a node runs on, or None for a node that only orders (free, input at host or
    disk)."""
    if isinstance(n, ApplyNode):
        return "host" if n.on_host else "compute"
    if isinstance(n, ReloadNode) or (isinstance(n, InputNode) and n.at == "device"):
        return "h2d"
    if isinstance(n, OffloadNode):
        return "d2h"
    if isinstance(n, ReadNode):
        return "disk"
    if isinstance(n, SendNode):
        return "send"
    if isinstance(n, RecvNode):
        return "recv"
    return None


def queues_of(mg: MemGraph) -> list[str | None]:
    """Every node's queue (`queue_of`), with the reloads of blocks that applies on the host wrote
    on a queue of their own, `h2d_host`: such a block is ready only when its host apply ends,
    late in the plan order, and a device task waits for it, while the h2d queue runs the
    prefetches the allocation horizon issued long before, in plan order; behind them, the
    host's result would wait for every weight fetched ahead (llama3.1-8b decode B=16 at 8 GB,
    its attention on the host: 234.6 ms a step on one copy queue, 170.6 ms on two). The two
    queues share the link: the simulator charges each copy's bytes to it."""
    back = mg.host_written()
    return ["h2d_host" if isinstance(n, ReloadNode) and n.tensor in back else queue_of(n)
            for n in mg.nodes]


@dataclass(frozen=True, slots=True)
class Step:
    """One memgraph node on its queue, with the nodes of other queues it waits for."""
    node: int
    queue: str
    waits: tuple[int, ...]


@dataclass(frozen=True)
class StreamProgram:
    steps: tuple[Step, ...]                 # in plan order
    events: frozenset[int]                  # nodes that record an event (someone waits on them)
    preloaded: tuple[int, ...] = ()         # done before the pass, in plan order (see module doc)

    def report(self) -> dict:
        """Nodes per queue, waits and events."""
        out = {f"{q}_nodes": sum(1 for s in self.steps if s.queue == q) for q in QUEUES}
        out.update(waits=sum(len(s.waits) for s in self.steps), events=len(self.events),
                   preloaded=len(self.preloaded))
        return out

    def __str__(self) -> str:
        lines = [f"stream program: {len(self.steps)} steps, "
                 + ", ".join(f"{k} {v}" for k, v in self.report().items())]
        for s in self.steps:
            wait = f" wait[{','.join(f'%{w}' for w in s.waits)}]" if s.waits else ""
            record = " record" if s.node in self.events else ""
            lines.append(f"{s.queue:<7} %{s.node}{wait}{record}")
        return "\n".join(lines)


def preloadable(mg: MemGraph) -> tuple[int, ...]:
    """The nodes a runtime may run before the pass: `input at device` nodes of persistent inputs
    (weights, KV store) without deps — resident blocks, loaded once, which the simulator prices at
    zero."""
    return tuple(n.id for n in mg.nodes
                 if isinstance(n, InputNode) and n.at == "device" and not n.deps
                 and 0 <= n.tensor < len(mg.tensors)
                 and mg.tensors[n.tensor].role in PERSISTENT_ROLES)


def queue_deps(mg: MemGraph, preloaded: frozenset[int] = frozenset()) -> list[frozenset[int]]:
    """For every node, its deps with folded nodes replaced by their own queue deps."""
    out: list[frozenset[int]] = []
    for n in mg.nodes:
        deps: set[int] = set()
        for d in n.deps:
            if queue_of(mg.nodes[d]) is None or d in preloaded:
                deps |= out[d]
            else:
                deps.add(d)
        out.append(frozenset(deps))
    return out


def compile_streams(mg: MemGraph, preload: bool = False) -> StreamProgram:
    """The stream program of `mg` (see the module docstring); with `preload`, the nodes of
    `preloadable(mg)` run before the pass instead of on the h2d queue."""
    mg.verify()
    pre = preloadable(mg) if preload else ()
    preloaded = frozenset(pre)
    qdeps = queue_deps(mg, preloaded)
    queues = queues_of(mg)
    known: dict[int, dict[str, int]] = {}  # node -> latest node known complete on each queue
    last: dict[str, int] = {}              # queue -> its latest node so far
    steps, events = [], set()
    for n in mg.nodes:
        q = queues[n.id]
        if q is None or n.id in preloaded:
            continue
        clock: dict[str, int] = {}
        if q in last:  # in order: the previous node of this queue, and all it knew, are done
            _merge(clock, known[last[q]], q, last[q])
        need = {}
        for d in qdeps[n.id]:
            dq = queues[d]
            if dq != q and d > need.get(dq, -1):
                need[dq] = d
        waits = []
        for d in sorted(need.values(), reverse=True):  # later nodes imply more: try them first
            dq = queues[d]
            if clock.get(dq, -1) >= d:
                continue  # implied by an earlier wait or by this queue's order
            waits.append(d)
            events.add(d)
            _merge(clock, known[d], dq, d)
        known[n.id] = clock
        last[q] = n.id
        steps.append(Step(n.id, q, tuple(sorted(waits))))
    return StreamProgram(tuple(steps), frozenset(events), pre)


def _merge(clock: dict[str, int], other: dict[str, int], queue: str, node: int) -> None:
    """`clock` learns that `node` (on `queue`) and everything `other` knew are complete."""
    for q, k in other.items():
        if k > clock.get(q, -1):
            clock[q] = k
    if node > clock.get(queue, -1):
        clock[queue] = node


def check_program(mg: MemGraph, program: StreamProgram) -> None:
    """Raise `PlanError` unless `program` runs every working node of `mg` once on its queue in
    plan order, every wait names an earlier node of another queue that records an event (so no
    wait can deadlock), and every memgraph edge is ordered by the program: for each queue dep u
    of a node v, u is earlier on v's queue or reached by a chain of waits."""
    preloaded = frozenset(program.preloaded)
    if not preloaded <= frozenset(preloadable(mg)):
        raise PlanError("stream program: it preloads a node that has deps or is not an input at "
                        "device of a weight or the KV store")
    queues = queues_of(mg)
    want = [n.id for n in mg.nodes if queues[n.id] is not None and n.id not in preloaded]
    if [s.node for s in program.steps] != want:
        raise PlanError("stream program: its steps are not the plan's working nodes in order")
    done: dict[int, dict[str, int]] = {}  # node -> latest node known complete on each queue
    last: dict[str, int] = {}
    for s in program.steps:
        n = mg.nodes[s.node]
        if s.queue != queues[s.node]:
            raise mg.error(s.node, f"stream program: node %{s.node} ({n.kind}) is on queue "
                                   f"{s.queue}, expected {queues[s.node]}")
        clock: dict[str, int] = {}
        if s.queue in last:
            _merge(clock, done[last[s.queue]], s.queue, last[s.queue])
        for w in s.waits:
            if not 0 <= w < s.node or w not in done or queues[w] == s.queue:
                raise mg.error(s.node, f"stream program: node %{s.node} waits on %{w}, which is "
                                       "not an earlier node of another queue")
            if w not in program.events:
                raise mg.error(s.node, f"stream program: node %{s.node} waits on %{w}, which "
                                       "records no event")
            _merge(clock, done[w], queues[w], w)
        done[s.node] = clock
        last[s.queue] = s.node
    qdeps = queue_deps(mg, preloaded)
    for s in program.steps:
        clock = done[s.node]
        for u in sorted(qdeps[s.node]):
            if clock.get(queues[u], -1) < u:
                raise mg.error(s.node, f"stream program: the edge %{u} -> %{s.node} is not "
                                       "ordered (no queue order or chain of waits)")
