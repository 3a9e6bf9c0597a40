"""The stream simulator: a memgraph run as the CuPy runtime runs it, in predicted seconds.

Engines, each in order: the compute stream runs `apply` nodes, the host->device copy engine
runs `reload` nodes (those of blocks the host's applies wrote on a second queue, `h2d_host`,
beside it: `streams.queues_of`; the link carries both, so an h2d copy that meets a copy there
ends that copy's seconds later, each such copy counted once), the device->host copy engine runs
`offload` nodes, the disk reader runs `read` nodes (disk -> host staging) and the host's CPU
runs the applies placed on the host (priced on the profile's host, `einpage.predict.hosts`),
each in the order of the node list (CUDA streams are FIFO and the runtime enqueues nodes in that
order). A node starts when
every dependency has finished and its engine is free; `input` and `free` nodes take no time (they
finish when their dependencies do). Durations come from `einpage.predict.cost`; a guarded reload (`ReloadGuard`)
takes its expected share of its bytes' time, as a guarded apply its share of its op's.

The lower bound for the same graph is `max(compute, host compute, min h2d bytes / h2d bandwidth
+ min h2d copies * copy latency, d2h bytes / d2h bandwidth, min disk bytes / disk bandwidth)`,
where the minimum host->device bytes count each tensor that starts on the host (or the disk)
and is needed on the device once (a weight block that does not stay resident, the token ids; a
block whose every reload is guarded at its expected share), the minimum copies one per such
tensor, and the minimum disk bytes each tensor at disk that is read, once.
Efficiency is lower bound / makespan.

A program of one rank of several also runs its sends, in order, on an engine of its own, the link
to its peers (`peer_seconds`: bytes over the profile's peer link, or its group link for a message
within a tensor-parallel group of a pipeline of them); a recv takes no time and
finishes when its message arrives (`arrivals`: the matched send's end on the sender's clock).
`simulate_ranks` runs the programs of a pipeline together, `micro_batches` passes of each in a
row (a rank's next pass starts when its last one ended: the passes share the arena's offsets),
and reports the bubble: the share of the ranks' time spent waiting for their inputs, 1 - the sum
over ranks of M times the rank's pass run alone (every message there at its start) over world x
the makespan: (N - 1) / (M + N - 1) for N equal stages.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from einpage.ir.memgraph import ApplyNode, InputNode, MemGraph, RecvNode, ReloadNode, SendNode
from einpage.predict.cost import (apply_seconds, d2h_seconds, disk_seconds, h2d_seconds,
                                  host_apply_seconds, peer_seconds)
from einpage.predict.devices import DeviceProfile

ENGINES = ("compute", "h2d", "d2h", "disk", "host", "peer", "h2d_host")
#: the engines that move a tensor's bytes (between the host and the device, or disk -> host)
COPY_ENGINES = ("h2d", "h2d_host", "d2h", "disk")
_ENGINE_OF = {"apply": "compute", "reload": "h2d", "offload": "d2h", "read": "disk",
              "send": "peer"}


def engine_of(n) -> str | None:
    """The engine a node runs on (None: it takes no time)."""
    if isinstance(n, ApplyNode) and n.on_host:
        return "host"
    return _ENGINE_OF.get(n.kind)


@dataclass(frozen=True)
class Simulation:
    device: str
    start: tuple[float, ...]        # per node, seconds
    end: tuple[float, ...]
    engine: tuple[str | None, ...]  # per node: `ENGINES`' name, None (instant)
    makespan_s: float
    compute_s: float                # busy time of each engine
    h2d_s: float                    # (the link's: both host->device queues)
    d2h_s: float
    stall_s: float                  # compute stream idle, waiting on dependencies
    stall_h2d_s: float              # ... of which waiting on a reload (a prefetch came late)
    late_reloads: int               # reloads that an apply waited for
    h2d_bytes: int
    h2d_min_bytes: int
    d2h_bytes: int
    lower_bound_s: float
    disk_s: float = 0.0             # busy time of the disk reader
    disk_bytes: int = 0             # read from disk this pass
    disk_min_bytes: int = 0         # ... of which no plan with this tier choice can avoid
    host_s: float = 0.0             # busy time of the host's CPU (applies placed on the host)
    peer_s: float = 0.0             # busy time of the link to peer devices (sends)
    start_s: float = 0.0            # when the pass began (`start`, `end` are absolute)

    @property
    def efficiency(self) -> float:
        return self.lower_bound_s / self.makespan_s if self.makespan_s > 0 else 1.0



def node_seconds(mg: MemGraph, profile: DeviceProfile,
                 tasks: Sequence[float] | None = None) -> list[float]:
    """Predicted duration of every node (0 for input and free); `tasks`: the seconds of every
    task of the plan's taskgraph where they are known already (`cost.task_seconds` on this
    profile, each where its apply runs): an apply of a task takes its task's."""
    tensors = mg.tensors
    group = mg.meta.get("group") if mg.meta.get("parallel") == "hybrid" else None
    out = []
    priced: dict = {}  # blocks of one layer repeat: price each distinct (op, shapes) once
    for n in mg.nodes:
        if isinstance(n, ApplyNode) and tasks is not None and n.task is not None:
            out.append(tasks[n.task])
        elif isinstance(n, ApplyNode):
            reads = [tensors[a.tensor] for a in n.reads]
            w = tensors[n.write.tensor]
            key = (n.op, tuple((t.shape, t.bytes, t.dtype, t.storage) for t in reads), w.shape,
                   w.bytes, w.dtype, n.accumulate, n.on)
            if key not in priced:
                priced[key] = (host_apply_seconds(profile.host, n.op, reads, w, n.accumulate)
                               if n.on_host else
                               apply_seconds(profile, n.op, reads, w, n.accumulate))
            out.append(priced[key])
        elif n.kind == "reload":
            out.append(h2d_seconds(profile, moved_bytes(mg, n)))
        elif n.kind == "offload":
            out.append(d2h_seconds(profile, tensors[n.tensor].bytes))
        elif n.kind == "read":
            out.append(disk_seconds(profile, tensors[n.tensor].bytes))
        elif n.kind == "send":
            out.append(peer_seconds(profile, tensors[n.tensor].bytes,
                                    group is not None and n.peer // group == mg.rank // group))
        else:
            out.append(0.0)
    return out


def moved_bytes(mg: MemGraph, n) -> float:
    """The bytes transfer node `n` is expected to move: a guarded reload its share of them."""
    nbytes = mg.tensors[n.tensor].bytes
    guard = getattr(n, "guard", None)
    return nbytes * guard.share if guard is not None and n.kind == "reload" else nbytes


def min_h2d_bytes(mg: MemGraph) -> int:
    """Bytes that must cross host->device once per pass: every tensor that starts on the host
    and is reloaded at least once, counted once; one whose every reload is guarded at its
    expected share (a pass copies it only where its guard is on)."""
    return round(sum(_least_reloads(mg).values()))


def min_h2d_copies(mg: MemGraph) -> int:
    """Copies that must cross host->device once per pass, each paying the link's latency (a
    guarded one too: `node_seconds` prices its expected bytes and the whole latency): one per
    tensor of `min_h2d_bytes`."""
    return len(_least_reloads(mg))


def _least_reloads(mg: MemGraph) -> dict[int, float]:
    """{tensor starting on the host and reloaded: the most bytes a reload of it moves}."""
    at_host = {n.tensor for n in mg.nodes if isinstance(n, InputNode) and n.at in ("host", "disk")}
    least: dict[int, float] = {}
    for n in mg.nodes:
        if n.kind == "reload" and n.tensor in at_host:
            least[n.tensor] = max(least.get(n.tensor, 0.0), moved_bytes(mg, n))
    return least


def min_disk_bytes(mg: MemGraph) -> int:
    """Bytes that must come from disk once per pass: every tensor at disk that is read, once."""
    read = {n.tensor for n in mg.nodes if n.kind == "read"}
    return sum(mg.tensors[t].bytes for t in read)


def simulate(mg: MemGraph, profile: DeviceProfile, durations: list[float] | None = None,
             arrivals: Mapping[int, float] | None = None, start_at: float = 0.0,
             verify: bool = True) -> Simulation:
    """`mg` run once from `start_at`: `arrivals` gives when each recv's message arrives.
    `verify`: check its structure first (`MemGraph.verify`); the compiler's search leaves that
    out for the plans it lowers itself, one simulation each (2-4% of a compile), and checks
    the plan it keeps (validated, or verified where validation is off)."""
    run = _Run(mg, profile, durations, start_at, verify)
    for n in mg.nodes:
        run.step(arrivals.get(n.id, 0.0) if arrivals is not None and isinstance(n, RecvNode)
                 else 0.0)
    return run.finish()


class _Run:
    """One pass of a program, simulated node by node in list order (`step`), so that the
    passes of several ranks can advance together (`simulate_ranks`)."""

    def __init__(self, mg: MemGraph, profile: DeviceProfile, durations: list[float] | None,
                 start_at: float, verify: bool = True):
        if verify:
            mg.verify()
        dur = durations if durations is not None else node_seconds(mg, profile)
        n_nodes = len(mg.nodes)
        if len(dur) != n_nodes:
            raise ValueError(f"{len(dur)} durations for {n_nodes} nodes")
        self.mg, self.profile, self.dur = mg, profile, dur
        self.start = [0.0] * n_nodes
        self.end = [0.0] * n_nodes
        self.engine: list[str | None] = [None] * n_nodes
        self.origin = start_at
        self.free_at = dict.fromkeys(ENGINES, start_at)
        self.busy = dict.fromkeys(ENGINES, 0.0)
        self.stall = self.stall_h2d = 0.0
        self.late: set[int] = set()
        self.h2d_bytes = self.d2h_bytes = self.disk_bytes = 0
        self.next = 0  # the next node to step
        #: blocks applies on the host write: their reloads run on h2d_host (`streams.queues_of`)
        self.back = mg.host_written()
        #: (start, end, seconds) of h2d_host copies no h2d copy has made room for yet
        self.beside: list[tuple[float, float, float]] = []
        self.h2d_start = start_at  # when the h2d queue's last copy so far started

    @property
    def done(self) -> bool:
        return self.next == len(self.mg.nodes)

    def step(self, arrival: float = 0.0) -> None:
        """Run the next node; a recv's message arrives at `arrival`."""
        mg, end, free_at = self.mg, self.end, self.free_at
        n = mg.nodes[self.next]
        self.next += 1
        ready, last = self.origin, None
        for d in n.deps:
            if end[d] > ready:
                ready, last = end[d], d
        if isinstance(n, RecvNode):
            ready = max(ready, arrival)
        eng = engine_of(n)
        if eng is None:
            self.start[n.id] = end[n.id] = ready
            return
        if eng == "h2d" and n.tensor in self.back and isinstance(n, ReloadNode):
            eng = "h2d_host"
        self.engine[n.id] = eng
        t0 = ready if ready > free_at[eng] else free_at[eng]
        if eng == "compute":
            wait = t0 - free_at[eng]
            if wait > 0:
                self.stall += wait
                if last is not None and self.engine[last] in ("h2d", "h2d_host"):
                    self.stall_h2d += wait
                    self.late.add(last)
        elif eng == "h2d":
            self.h2d_bytes += moved_bytes(mg, n)
        elif eng == "h2d_host":
            self.h2d_bytes += moved_bytes(mg, n)
        elif eng == "d2h":
            self.d2h_bytes += mg.tensors[n.tensor].bytes
        elif eng == "disk":
            self.disk_bytes += mg.tensors[n.tensor].bytes
        self.start[n.id], end[n.id] = t0, t0 + self.dur[n.id]
        if eng == "h2d_host":
            self._share_link(t0, end[n.id], self.dur[n.id])
        elif eng == "h2d":
            self.h2d_start = t0
            if self.beside:
                end[n.id] = self._shared_end(t0, end[n.id])
        free_at[eng] = end[n.id]
        self.busy[eng] += self.dur[n.id]

    def _share_link(self, t0: float, t1: float, seconds: float) -> None:
        """An h2d_host copy over [t0, t1): where the h2d queue's last copy so far overlaps it,
        the link gives this one `seconds` of that copy's time, and the h2d queue's next copy
        starts that much later; where that copy ends before t0, the first h2d copy to overlap
        it does (`_shared_end`); where it starts after t1, none does (the queue is in order)."""
        if self.free_at["h2d"] <= t0:
            self.beside.append((t0, t1, seconds))
        elif self.h2d_start < t1:
            self.free_at["h2d"] += seconds

    def _shared_end(self, t0: float, t1: float) -> float:
        """The end of an h2d copy over [t0, t1) at the link's full rate, later by the seconds
        of each h2d_host copy beside it that no h2d copy has made room for."""
        left = []
        for a, b, seconds in self.beside:
            if b <= t0:
                continue  # (h2d copies start in order: no later one meets it)
            if a < t1:
                t1 += seconds
            else:
                left.append((a, b, seconds))
        self.beside = left
        return t1

    def finish(self) -> Simulation:
        mg, profile, busy, origin = self.mg, self.profile, self.busy, self.origin
        makespan = max(self.end, default=origin) - origin
        least = _least_reloads(mg)  # (`min_h2d_bytes`, `min_h2d_copies`: one walk)
        h2d_min = round(sum(least.values()))
        disk_min = min_disk_bytes(mg)
        lower = max(busy["compute"], busy["host"], h2d_min / profile.h2d_bandwidth
                    + len(least) * profile.copy_latency,
                    self.d2h_bytes / profile.d2h_bandwidth, disk_min / profile.disk_bandwidth)
        return Simulation(profile.name, tuple(self.start), tuple(self.end), tuple(self.engine),
                          makespan, busy["compute"], busy["h2d"] + busy["h2d_host"], busy["d2h"],
                          self.stall,
                          self.stall_h2d, len(self.late), round(self.h2d_bytes), h2d_min,
                          self.d2h_bytes, lower, busy["disk"], self.disk_bytes, disk_min,
                          busy["host"], busy["peer"], origin)


@dataclass(frozen=True)
class RankedSimulation:
    """The programs of a pipeline run together: each rank's passes, the makespan of them all,
    each rank's pass alone, and the bubble (the module's docstring)."""
    passes: tuple[tuple[Simulation, ...], ...]  # [rank][micro-batch]
    makespan_s: float
    bubble: float
    alone: tuple[Simulation, ...]               # per rank: one pass, every message at its start

    @property
    def world(self) -> int:
        return len(self.passes)


def simulate_ranks(programs: Sequence[MemGraph], profiles: Sequence[DeviceProfile],
                   micro_batches: int = 1) -> RankedSimulation:
    """The ranks advanced together, each `micro_batches` passes in a row (pass m's recvs meet
    pass m's sends): each rank steps through its node list while its next node is not a recv
    whose message is unsent, then the next rank; messages may go both ways (a tensor-parallel
    plan's all-reduces). A state where every unfinished rank waits is a deadlock of the list
    orders, refused (`PlanError`)."""
    from einpage.errors import PlanError
    world = len(programs)
    sent: dict[tuple[int, int, int, int], float] = {}  # (src, dst, tag, pass) -> arrival
    durations = [node_seconds(mg, profiles[r]) for r, mg in enumerate(programs)]
    runs: list[_Run | None] = [_Run(mg, profiles[r], durations[r], 0.0)
                               for r, mg in enumerate(programs)]
    passes: list[list[Simulation]] = [[] for _ in programs]
    while any(run is not None for run in runs):
        moved = False
        for r in range(world):
            run, m = runs[r], len(passes[r])
            if run is None:
                continue
            nodes = run.mg.nodes
            while not run.done:
                n = nodes[run.next]
                arrival = 0.0
                if isinstance(n, RecvNode):
                    key = (n.peer, r, n.tag, m)
                    if key not in sent:
                        break
                    arrival = sent[key]
                run.step(arrival)
                moved = True
                if isinstance(n, SendNode):
                    sent[(r, n.peer, n.tag, m)] = run.end[n.id]
            if run.done:
                sim = run.finish()
                passes[r].append(sim)
                runs[r] = (_Run(programs[r], profiles[r], durations[r],
                                sim.start_s + sim.makespan_s)
                           if len(passes[r]) < micro_batches else None)
                moved = True
        if not moved:
            stuck = [r for r in range(world) if runs[r] is not None]
            raise PlanError(f"ranks {stuck} all wait for messages no rank has sent: the "
                            "programs deadlock in the order of their node lists")
    makespan = max((max(run.end, default=0.0) for runs_ in passes for run in runs_),
                   default=0.0)
    alone = tuple(simulate(mg, profiles[r]) for r, mg in enumerate(programs))
    work = micro_batches * sum(s.makespan_s for s in alone)
    bubble = max(0.0, 1 - work / (len(programs) * makespan)) if makespan > 0 else 0.0
    return RankedSimulation(tuple(tuple(p) for p in passes), makespan, bubble, alone)
