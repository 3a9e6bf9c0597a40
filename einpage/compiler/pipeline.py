"""Pipeline parallelism: one model over several devices, consecutive layers per device.

A graph's nodes carry the layer they belong to (`Node.stage`: 0 before the first layer, the last
stage after it). `plan_stages` cuts the stages into `world` contiguous ranges whose predicted
times are balanced, and `split` turns each range into a graph of its own, a *rank graph*:

- a node that depends on no weight and no cache (rotary tables, masks: functions of the
  activation inputs alone) is computed on every rank that needs it, so it crosses no link;
- every other computed node runs on the rank of its stage (an output, on its operand's rank);
- a value made on rank q and read on rank r is a *boundary*: rank q's graph outputs it and rank
  r's graph takes it as an activation input, both under the name `pipe.<node id>`; weights and
  activation inputs are inputs of every rank that reads them.

Each rank graph is compiled as any graph is, for the device's own budget (`compile_pipeline`):
resident weights, streaming, host and disk tiers all work per device. Its plan then speaks to its
peers (`einpage.ir.memgraph`, version 2): each block of a boundary output is sent, once final, by
a `send` node appended to the sender's program; on the receiver, a `recv` node per sent block
fills that box of the boundary input's host copy, and every input node of a block of that input
depends on the recvs whose boxes meet its own. Sends go only to higher ranks, which is what makes
every order of every rank's program free of deadlock (`einpage.ir.validator.validate_ranks`).

The stage cut is chosen twice: first by a model of each range's time, the larger of its compute
(FLOPs over the profile's peak) and the bytes of its weights that do not fit the budget over the
link, minimised over all contiguous cuts (dynamic programming); then refined with the compiler
itself, moving one boundary a stage at a time toward the slowest rank while the slowest rank's
predicted pass gets shorter.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

from einpage.errors import BudgetError, PlanError
from einpage.ir.graph import Einsum, Graph, Input, Node, Output, Role
from einpage.ir.memgraph import (InputNode, MemGraph, OffloadNode, RecvNode, SendNode,
                                 boxes_meet)
from einpage.ir.peers import boundary_name, is_boundary
from einpage.ir.storage import tensor_bytes
from einpage.predict.devices import DEFAULT_DEVICE, DeviceProfile, get_device

#: the share of a device's budget the stage model counts as holding weights (the rest holds the
#: activations, the blocks in flight and the KV store)
WEIGHT_SHARE = 0.8
#: most rounds of the refinement of the stage cut (each compiles up to two neighbouring cuts'
#: rank graphs, those not compiled before)
REFINE_ROUNDS = 6


@dataclass(frozen=True)
class Boundary:
    """A value made on rank `src` and read on rank `dst` (`name` on both sides)."""
    node: int
    name: str
    src: int
    dst: int


@dataclass(frozen=True)
class Split:
    """The rank graphs of a cut (`cut[r]`: the first stage of rank r + 1; stages below
    `cut[0]` are rank 0's) and the values that cross ranks."""
    cut: tuple[int, ...]
    graphs: tuple[Graph, ...]
    boundaries: tuple[Boundary, ...]
    stages: int  # of the whole graph

    def stage_range(self, rank: int) -> tuple[int, int]:
        """The first and last stage of `rank`."""
        bounds = (0, *self.cut, self.stages)
        return bounds[rank], bounds[rank + 1] - 1


# ------------------------------------------------------------------ which node runs where

def _stateful(graph: Graph) -> list[bool]:
    """Nodes that depend on a weight or a cache input (the rest are functions of activations)."""
    out = [False] * len(graph.nodes)
    for n in graph.nodes:
        if isinstance(n.op, Input):
            out[n.id] = n.op.role in (Role.weight, Role.cache)
        else:
            out[n.id] = any(out[i] for i in n.inputs) or (
                n.guard is not None and out[n.guard.tensor])
    return out


def node_ranks(graph: Graph, cut: tuple[int, ...]) -> list[frozenset[int]]:
    """The ranks each node is computed or loaded on: a stateful computed node on its stage's
    rank (an output on its operand's), a stateless one and an input on every rank that reads
    it."""
    def rank_of(stage: int) -> int:
        return sum(1 for c in cut if stage >= c)

    stateful = _stateful(graph)
    home: list[int | None] = [None] * len(graph.nodes)
    for n in graph.nodes:
        if isinstance(n.op, Output):  # an operand computed everywhere: rank 0 reports it
            home[n.id] = home[n.inputs[0]] if home[n.inputs[0]] is not None else 0
        elif stateful[n.id] and not isinstance(n.op, Input):
            home[n.id] = rank_of(n.stage)
    where: list[set[int]] = [set() if h is None else {h} for h in home]
    for n in reversed(graph.nodes):
        if home[n.id] is None:
            for u in graph.users(n.id):
                where[n.id] |= where[u]
    return [frozenset(w) for w in where]


def split(graph: Graph, cut: tuple[int, ...]) -> Split:
    """The rank graphs of `cut` (see the module's docstring)."""
    world = len(cut) + 1
    ranks = node_ranks(graph, cut)
    stateful = _stateful(graph)
    graphs, boundaries = [], []
    for r in range(world):
        nodes: list[Node] = []
        new_id: dict[int, int] = {}
        received: dict[int, int] = {}

        def add(node: Node) -> int:
            k = len(nodes)
            nodes.append(replace(node, id=k))
            return k

        def operand(i: int) -> int:
            if i in new_id:
                return new_id[i]
            if i not in received:  # made on another rank: a boundary input here
                src = graph.nodes[i]
                (owner,) = ranks[i]
                received[i] = add(Node(0, Input(boundary_name(i), Role.activation), (),
                                       src.shape, src.dtype, src.stage))
                boundaries.append(Boundary(i, boundary_name(i), owner, r))
            return received[i]

        for n in graph.nodes:
            if r not in ranks[n.id]:
                continue
            guard = n.guard
            inputs = tuple(operand(i) for i in n.inputs)
            if guard is not None:
                guard = replace(guard, tensor=operand(guard.tensor))
            new_id[n.id] = add(replace(n, inputs=inputs, guard=guard))
        for n in graph.nodes:  # values read on a later rank leave this one as outputs
            if (r in ranks[n.id] and stateful[n.id] and not isinstance(n.op, (Input, Output))
                    and any(r not in ranks[u] and not isinstance(graph.nodes[u].op, Output)
                            for u in graph.users(n.id))):
                add(Node(0, Output(boundary_name(n.id)), (new_id[n.id],), n.shape, n.dtype,
                         n.stage))
        rank_graph = Graph(tuple(nodes))
        rank_graph.verify()
        graphs.append(rank_graph)
    for b in boundaries:
        if b.src >= b.dst:
            raise PlanError(f"node %{b.node} is made on rank {b.src} and read on rank {b.dst}: "
                            "a pipeline sends only to later ranks (are the graph's stages in "
                            "the order of its layers?)")
    boundaries.sort(key=lambda b: (b.src, b.dst, b.node))
    stages = max((n.stage for n in graph.nodes), default=0) + 1
    return Split(tuple(cut), tuple(graphs), tuple(boundaries), stages)


# ------------------------------------------------------------------ the stage cut

@dataclass(frozen=True)
class StageCost:
    """What the stage model knows of each stage: FLOPs and the bytes of its weights."""
    flops: tuple[float, ...]
    weight_bytes: tuple[int, ...]


def stage_costs(graph: Graph) -> StageCost:
    stages = max((n.stage for n in graph.nodes), default=0) + 1
    flops = [0.0] * stages
    weights = [0] * stages
    for n in graph.nodes:
        if isinstance(n.op, Einsum):
            sizes = n.op.spec.sizes([graph.nodes[i].shape for i in n.inputs])
            flops[n.stage] += 2.0 * math.prod(int(v) for v in sizes.values())
        elif isinstance(n.op, Input) and n.op.role == Role.weight:
            users = graph.users(n.id)
            stage = min((graph.nodes[u].stage for u in users), default=n.stage)
            weights[stage] += tensor_bytes(tuple(int(s) for s in n.shape), n.dtype,
                                           n.op.storage)
    return StageCost(tuple(flops), tuple(weights))


def model_cut(costs: StageCost, world: int, device_bytes: int, profile) -> tuple[int, ...]:
    """The contiguous cut of the stages into `world` non-empty ranges that minimises the largest
    modelled range time: max(FLOPs / peak, streamed weight bytes / link)."""
    stages = len(costs.flops)
    if world > stages:
        raise BudgetError(f"{world} devices for a graph of {stages} stages: at most one device "
                          "per stage", world, stages)
    peak = profile.flops("f16", True)
    room = WEIGHT_SHARE * device_bytes
    flops, weights = [0.0], [0]  # prefix sums
    for f, w in zip(costs.flops, costs.weight_bytes):
        flops.append(flops[-1] + f)
        weights.append(weights[-1] + w)

    def seconds(lo: int, hi: int) -> float:
        streamed = max(0.0, weights[hi] - weights[lo] - room)
        return max((flops[hi] - flops[lo]) / peak, streamed / profile.h2d_bandwidth)

    inf = float("inf")
    # best[k][s]: the least largest time of the first s stages on k ranks; cut positions kept
    best = [[inf] * (stages + 1) for _ in range(world + 1)]
    back = [[0] * (stages + 1) for _ in range(world + 1)]
    best[0][0] = 0.0
    for k in range(1, world + 1):
        for s in range(k, stages + 1):
            for p in range(k - 1, s):
                v = max(best[k - 1][p], seconds(p, s))
                if v < best[k][s]:
                    best[k][s], back[k][s] = v, p
    cut, s = [], stages
    for k in range(world, 1, -1):
        s = back[k][s]
        cut.append(s)
    return tuple(reversed(cut))


# ------------------------------------------------------------------ compiling the ranks

@dataclass(frozen=True)
class RankPlan:
    """One rank's compiled program and what the compiler said of it."""
    rank: int
    memgraph: MemGraph
    compiled: object  # einpage.compiler.driver.Compiled


@dataclass(frozen=True)
class ParallelPlan:
    """A plan for `world` devices: one program per rank and how the graph was split (a
    pipeline's `Split`: the cut and the boundaries; tensor parallelism's
    `tensor_parallel.TensorSplit`); `host_compute`: whether the ranks were planned with applies
    allowed on the host."""
    split: object
    ranks: tuple[RankPlan, ...]
    host_compute: bool = False

    @property
    def world(self) -> int:
        return len(self.ranks)

    @property
    def programs(self) -> tuple[MemGraph, ...]:
        return tuple(r.memgraph for r in self.ranks)

    def makespan_s(self, profile: DeviceProfile | None = None) -> float:
        """The predicted seconds of one pass of the programs run together on `profile`
        (default: the default device's)."""
        from einpage.predict.simulator import simulate_ranks
        profile = profile or get_device(DEFAULT_DEVICE)
        return simulate_ranks(self.programs, [profile] * self.world).makespan_s


def compile_pipeline(graph: Graph, world: int, options,
                     compile_fn: Callable | None = None,
                     cut: tuple[int, ...] | None = None) -> ParallelPlan:
    """Compile `graph` for `world` devices of `options.device_bytes` each: the stage cut (the
    model's, refined with the compiler unless `cut` is given), each rank graph compiled with
    `options`, and the programs joined by sends and recvs."""
    from einpage.compiler.driver import compile_graph  # the driver compiles each rank
    compile_fn = compile_fn or compile_graph
    if world < 2:
        raise PlanError(f"a pipeline needs 2 devices or more, got {world}")
    if options.cuts:
        raise PlanError("per-node cuts name the whole graph's nodes; a pipeline's ranks take "
                        "none")
    profile = options.device or get_device(DEFAULT_DEVICE)
    costs = stage_costs(graph)
    cache: dict[tuple[int, int, tuple], object] = {}

    def compiled_split(c: tuple[int, ...]) -> tuple[Split, list]:
        s = split(graph, c)
        out = []
        for r, g in enumerate(s.graphs):
            lo = c[r - 1] if r else 0
            hi = c[r] if r < len(c) else len(costs.flops)
            key = (lo, hi, tuple(b.node for b in s.boundaries if r in (b.src, b.dst)))
            if key not in cache:
                cache[key] = compile_fn(g, options)
            out.append(cache[key])
        return s, out

    if cut is None:
        cut = model_cut(costs, world, options.device_bytes, profile)
        chosen = compiled_split(cut)
        chosen = _refine(cut, chosen, compiled_split, len(costs.flops))
    else:
        chosen = compiled_split(tuple(cut))
    s, compiled = chosen
    programs = join(s, [c.memgraph for c in compiled])
    if options.validate:  # the joined programs, each and together (remembered: runs check once)
        from einpage.ir.peers import validate_ranks
        validate_ranks(programs)
    return ParallelPlan(s, tuple(RankPlan(r, mg, c)
                             for r, (mg, c) in enumerate(zip(programs, compiled))),
                    options.host_compute)


def _slowest(compiled: list) -> tuple[float, int]:
    times = [c.simulation.makespan_s for c in compiled]
    return max(times), times.index(max(times))


def _refine(cut: tuple[int, ...], chosen, compiled_split, stages: int):
    """Move one boundary a stage at a time toward the slowest rank while the slowest rank's
    predicted pass shortens, for at most REFINE_ROUNDS rounds."""
    worst, at = _slowest(chosen[1])
    for _ in range(REFINE_ROUNDS):
        tries = []
        if at > 0:      # the slowest rank gives its first stage to the rank before
            tries.append(cut[:at - 1] + (cut[at - 1] + 1,) + cut[at:])
        if at < len(cut):  # ... or its last stage to the rank after
            tries.append(cut[:at] + (cut[at] - 1,) + cut[at + 1:])
        better = None
        for c in tries:
            bounds = (0, *c, stages)
            if any(bounds[k] >= bounds[k + 1] for k in range(len(bounds) - 1)):
                continue
            candidate = compiled_split(c)
            t, k = _slowest(candidate[1])
            if t < worst * (1 - 1e-3) and (better is None or t < better[0]):
                better = (t, k, c, candidate)
        if better is None:
            break
        worst, at, cut, chosen = better
    return chosen


def join(s: Split, plans: list[MemGraph]) -> list[MemGraph]:
    """The rank programs with their sends and recvs (tags numbered per sender and receiver in
    the order of the sender's output blocks)."""
    world = len(plans)
    sends: list[list[tuple]] = [[] for _ in range(world)]  # per sender: (output, dst, tag)
    recvs: list[list[tuple]] = [[] for _ in range(world)]  # (name, origin, shape, src, tag)
    tags = {}
    for b in s.boundaries:
        mg = plans[b.src]
        for o in mg.outputs:
            if o.name != b.name:
                continue
            key = (b.src, b.dst)
            tag = tags[key] = tags.get(key, -1) + 1
            sends[b.src].append((o, b.dst, tag))
            recvs[b.dst].append((b.name, tuple(o.origin), tuple(mg.tensors[o.tensor].shape),
                                 b.src, tag))
    return [_with_peers(mg, r, world, sends[r], recvs[r]) for r, mg in enumerate(plans)]


def _with_peers(mg: MemGraph, rank: int, world: int, sends: list, recvs: list) -> MemGraph:
    """`mg` with its recvs first (each input node of a block of a received input depends on the
    recvs that meet its box), the reloads of received blocks moved down the list to just before
    their first user (`late_reloads`), and its sends last."""
    mg = late_reloads(mg, {r[0] for r in recvs})
    k = len(recvs)
    nodes: list = [RecvNode(i, name, origin, shape, src, tag, ())
                   for i, (name, origin, shape, src, tag) in enumerate(recvs)]
    by_input: dict[str, list[int]] = {}
    for i, (name, *_rest) in enumerate(recvs):
        by_input.setdefault(name, []).append(i)
    for n in mg.nodes:
        deps = tuple(d + k for d in n.deps)
        if isinstance(n, InputNode):
            t = mg.tensors[n.tensor]
            if t.source is not None and t.source.input in by_input:
                deps = tuple(i for i in by_input[t.source.input]
                             if boxes_meet(recvs[i][1], recvs[i][2], t.source.origin,
                                           t.shape)) + deps
        nodes.append(replace(n, id=n.id + k, deps=deps))
    sources = send_sources(replace(mg, nodes=tuple(nodes)), [o for o, _, _ in sends], rank)
    for (o, dst, tag), (dep, offset) in zip(sends, sources):
        nodes.append(SendNode(len(nodes), o.tensor, offset, dst, tag, (dep,)))
    return replace(mg, nodes=tuple(nodes), rank=rank, world=world)


def send_sources(mg: MemGraph, blocks, rank: int) -> list[tuple[int, int | None]]:
    """What a send of each output block reads, once final: (the node it waits for, the device
    offset or None): the block's last write where the output is at the device, else its last
    offload (the host copy)."""
    last_write: dict[int, int] = {}
    last_offload: dict[int, int] = {}
    for n in mg.nodes:
        if n.kind == "apply":
            last_write[n.write.tensor] = n.id
        elif isinstance(n, OffloadNode):
            last_offload[n.tensor] = n.id
    out = []
    for o in blocks:
        if o.at == "device":
            dep, offset = last_write.get(o.tensor), o.offset
        else:
            dep, offset = last_offload.get(o.tensor), None
        if dep is None:
            raise PlanError(f"rank {rank}: block %t{o.tensor} of {o.name!r}, sent to other "
                            "ranks, is never made on this rank")
        out.append((dep, offset))
    return out


def late_reloads(mg: MemGraph, received: set[str]) -> MemGraph:
    """`mg` with each reload of a block of a `received` input moved down the node list to just
    before the first node that depends on it, every node renumbered. A copy queue runs its
    nodes in list order, so a reload that waits for a message would otherwise hold back every
    weight reload listed after it: the prefetch a rank can do while the ranks before it work.
    The moved list is still a valid order of the same plan: the reload's deps stay before it,
    and its instance only starts later, so no overlap it had with anything can appear."""
    users: dict[int, int] = {}
    for n in mg.nodes:
        for d in n.deps:
            users.setdefault(d, n.id)  # the first user in list order
    moved = {n.id for n in mg.nodes if n.kind == "reload"
             and (src := mg.tensors[n.tensor].source) is not None and src.input in received
             and n.id in users}
    if not moved:
        return mg
    before: dict[int, list[int]] = {}
    for k in sorted(moved):
        before.setdefault(users[k], []).append(k)
    order = []
    for n in mg.nodes:
        order.extend(before.get(n.id, ()))
        if n.id not in moved:
            order.append(n.id)
    new = {old: k for k, old in enumerate(order)}
    nodes = tuple(replace(mg.nodes[old], id=k, deps=tuple(new[d] for d in mg.nodes[old].deps))
                  for k, old in enumerate(order))
    return replace(mg, nodes=nodes)




# ------------------------------------------------------------------ the report

@dataclass(frozen=True)
class RankFigures:
    """One rank of a pipeline as the compiler saw it."""
    rank: int
    stages: tuple[int, int]       # first and last stage it runs
    weight_bytes: int
    resident_bytes: int
    streamed_bytes: int           # host->device per pass
    min_stream_bytes: int         # what no plan of this rank's graph can avoid streaming
    sent_bytes: int               # to later ranks, per pass
    pass_s: float                 # its pass alone, every message there at its start
    bound_s: float                # its problem's bound without the front and tail terms
                                  # (`ProblemBound.steady_s`): M passes in a row pay the
                                  # front and the tail once, not M times
    compute_s: float              # ... of which compute

    def to_json(self) -> dict:
        return {"rank": self.rank, "stages": list(self.stages), "weight_bytes": self.weight_bytes,
                "resident_bytes": self.resident_bytes, "streamed_bytes": self.streamed_bytes,
                "min_stream_bytes": self.min_stream_bytes, "sent_bytes": self.sent_bytes,
                "pass_s": self.pass_s, "bound_s": self.bound_s, "compute_s": self.compute_s}


@dataclass(frozen=True)
class RanksReport:
    """A pipeline's prediction: `micro_batches` passes of each rank in a row (`simulate_ranks`),
    the makespan, the bubble and the bound. No schedule of these rank problems beats any of:

    - M times the slowest rank's bound (each rank runs its M passes one after another);
    - the *chain* (`chain_seconds`): what each rank must stream after its first message
      arrives, before it can send on, summed along the ranks.

    Not a term: the compute of one micro-batch through every rank, since blocks of rows flow on
    as each is done, so the ranks' compute overlaps even within one micro-batch.
    """
    device: str
    device_bytes: int
    peer_bandwidth: float
    micro_batches: int
    ranks: tuple[RankFigures, ...]
    makespan_s: float
    bubble: float
    compile_seconds: float
    chain_s: float = 0.0          # `chain_seconds`
    tokens: int | None = None     # tokens of all micro-batches together
    workload: tuple = ()
    group_bandwidth: float | None = None  # within a tensor-parallel group (None: the peer link)

    @property
    def bound_s(self) -> float:
        slowest = max(r.bound_s for r in self.ranks)
        return max(self.micro_batches * slowest, self.chain_s)

    @property
    def efficiency(self) -> float:
        return self.bound_s / self.makespan_s if self.makespan_s > 0 else 1.0

    def to_json(self) -> dict:
        out = {"device": self.device, "devices": len(self.ranks),
               "device_bytes": self.device_bytes,
               "peer_bandwidth": self.peer_bandwidth, "micro_batches": self.micro_batches,
               "group_bandwidth": self.group_bandwidth,
               "makespan_s": self.makespan_s, "bubble": self.bubble, "bound_s": self.bound_s,
               "efficiency": self.efficiency, "compile_seconds": self.compile_seconds,
               "chain_s": self.chain_s,
               "ranks": [r.to_json() for r in self.ranks], **dict(self.workload)}
        if self.tokens:
            out["tokens_per_s"] = self.tokens / self.makespan_s
        return out


def ranks_report(pipeline: ParallelPlan, profile, micro_batches: int, compile_seconds: float,
                 tokens: int | None = None, workload=()) -> RanksReport:
    """The report of a pipeline just compiled: each rank's problem bound as its compiler found
    it."""
    bounds = [plan.compiled.report.bound for plan in pipeline.ranks]
    return programs_report(pipeline.programs, profile, micro_batches,
                           [pipeline.split.stage_range(r) for r in range(pipeline.world)],
                           pipeline.host_compute, bounds, compile_seconds, tokens, workload)


def programs_report(programs, profile, micro_batches: int, stages, host_compute: bool,
                    bounds=None, compile_seconds: float = 0.0, tokens: int | None = None,
                    workload=()) -> RanksReport:
    """The report of the programs of a pipeline (also one read from a file: `einpage inspect`):
    simulated together on `profile`; each rank's figures from what its compiler recorded in
    its meta, its bound the compiler's (`bounds`, a `ProblemBound` per rank) or, where not
    given, the larger of its simulated compute and its unavoidable streaming over the link."""
    from einpage.predict.simulator import simulate_ranks
    sim = simulate_ranks(programs, [profile] * len(programs), micro_batches)
    figures = []
    for r, mg in enumerate(programs):
        alone, meta = sim.alone[r], mg.meta
        least = int(meta.get("min_stream_bytes", 0))
        copies = float(meta.get("min_stream_copies", 0.0))
        bound = bounds[r] if bounds is not None else None
        sent = sum(mg.tensors[n.tensor].bytes for n in mg.nodes if isinstance(n, SendNode))
        figures.append(RankFigures(
            r, tuple(stages[r]), int(meta.get("weight_bytes", 0)),
            int(meta.get("resident_bytes", 0)), alone.h2d_bytes, least, sent, alone.makespan_s,
            bound.steady_s if bound else max(alone.compute_s, least / profile.h2d_bandwidth
                                             + copies * profile.copy_latency),
            bound.compute_s if bound else alone.compute_s))
    chain = 0.0 if host_compute else chain_seconds(programs, profile)
    return RanksReport(profile.name, programs[0].device_bytes, profile.peer_rate,
                       micro_batches, tuple(figures), sim.makespan_s, sim.bubble,
                       compile_seconds, chain, tokens, tuple(workload),
                       profile.group_bandwidth)


def chain_seconds(programs, profile) -> float:
    """A lower bound on any run of these rank programs' graphs, device-only, from what each
    rank must stream after its first message arrives.

    For a rank r, call a task *late* if it depends (through the rank graph's edges) on a block
    that rank r receives; on a rank that receives nothing, every task is late (its first
    "message" is the start of the pass). A block's *need* is the set of weight and KV-store
    blocks that late, unguarded tasks among its writers' ancestors read (a guarded task may
    not run). Let T_r be the time rank r's first message arrives (T = 0 for a rank that
    receives nothing). Every block in need(b) is read after T_r, by a task that must finish
    before b is complete; at T_r the device holds at most D bytes, so at least
    |need(b)| - D bytes cross its link after T_r before b exists. Hence a block b that rank q
    sends to rank r arrives no earlier than T_q + max(0, |need(b)| - D) / link, so
    T_r >= the least of these over the blocks r receives, and the pass ends no earlier than
    T_r + max(0, |need(all of r's outputs)| - D) / link on every rank. The chain is the largest
    of these ends. It assumes every apply runs on the device: a plan that may read weights on
    the host (host compute) gets 0 (`ranks_report`). Counted in bytes as the link moves them
    (a block's own bytes, not its aligned size)."""
    world = len(programs)
    arrival = [math.inf if any(isinstance(n, RecvNode) for n in mg.nodes) else 0.0
               for mg in programs]
    chain = 0.0
    for q, mg in enumerate(programs):  # senders come before their receivers
        tg = mg.graph
        if tg is None or arrival[q] == math.inf:
            return 0.0  # a plan that does not carry its graph: no claim
        need, weight_bytes = _needs(tg)
        link = profile.h2d_bandwidth

        def lag(blocks) -> float:
            mask = 0
            for b in blocks:
                mask |= need[b]
            return max(0, _bytes_of(mask, weight_bytes) - mg.device_bytes) / link

        for n in mg.nodes:
            if isinstance(n, SendNode) and n.peer < world:
                b = mg.tensors[n.tensor].block
                arrival[n.peer] = min(arrival[n.peer], arrival[q] + lag([b]))
        chain = max(chain, arrival[q] + lag([o.block for o in tg.outputs]))
    return chain


def _needs(tg) -> tuple[list[int], list[int]]:
    """Per block, the bitmask (over the rank graph's weight and KV-store blocks) of those that
    late, unguarded tasks among its writers' ancestors read; and each such block's bytes."""
    from einpage.ir.ops import GuardedOp
    from einpage.ir.tensors import PERSISTENT_ROLES
    stored = {b.id: k for k, b in enumerate(b for b in tg.blocks if b.source is not None
                                            and b.role in PERSISTENT_ROLES)}
    weight_bytes = [0] * len(stored)
    for b, k in stored.items():
        weight_bytes[k] = tg.blocks[b].bytes
    received = {b.id for b in tg.blocks if b.source is not None and is_boundary(b.source.input)}
    late_block = [not received or b in received for b in range(len(tg.blocks))]
    need = [0] * len(tg.blocks)
    for t in tg.tasks:  # ids are a topological order
        late = (not received or any(late_block[b] for b in t.reads)
                or (t.accumulate and late_block[t.write]))
        mask = 0
        for b in t.reads:
            mask |= need[b]
            if late and b in stored and not isinstance(t.op, GuardedOp):
                mask |= 1 << stored[b]
        need[t.write] |= mask
        late_block[t.write] = late_block[t.write] or late
    return need, weight_bytes


def _bytes_of(mask: int, sizes: list[int]) -> int:
    total, k = 0, 0
    while mask:
        if mask & 1:
            total += sizes[k]
        mask >>= 1
        k += 1
    return total

