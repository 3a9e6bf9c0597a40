"""The plan report: one frozen record of what a plan needs, moves and is predicted to take.
`compile_graph` makes it for a plan it compiled; `PlanReport.of_plan` makes it for a saved one
(`einpage inspect`); `to_json` is the `--json` form and the command line prints it."""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from types import MappingProxyType
from typing import Mapping

from einpage.ir.validator import ValidationReport
from einpage.ir.memgraph import MemGraph
from einpage.predict.simulator import Simulation


@dataclass(frozen=True, slots=True)
class Traffic:
    """Bytes a plan moves per pass. `offload_*` spills a block that is needed again (it comes
    back by a reload); `writeback_*` sends a finished output to the host, once. The reloads by
    what they carry: weights, the KV store, and activations (spilled ones coming back, inputs)."""
    reload_count: int
    reload_bytes: int
    offload_count: int
    offload_bytes: int
    writeback_count: int
    writeback_bytes: int
    reload_weight_bytes: int = 0
    reload_kv_bytes: int = 0
    reload_activation_bytes: int = 0

    @staticmethod
    def of(mg: MemGraph) -> "Traffic":
        final = {}
        for n in mg.nodes:
            if n.kind == "offload":
                final[n.tensor] = n.id
        at_host = {o.tensor for o in mg.outputs if o.at == "host"}
        back = {final[t] for t in at_host if t in final}
        spills = [n for n in mg.nodes if n.kind == "offload" and n.id not in back]
        by_role = {"weight": 0, "cache": 0}
        for n in mg.nodes:
            if n.kind == "reload":
                t = mg.tensors[n.tensor]
                role = t.role if t.role in by_role else "activation"
                by_role[role] = by_role.get(role, 0) + t.bytes
        return Traffic(mg.count("reload"), mg.moved_bytes("reload"), len(spills),
                       sum(mg.tensors[n.tensor].bytes for n in spills), len(back),
                       sum(mg.tensors[mg.nodes[i].tensor].bytes for i in back),
                       by_role["weight"], by_role["cache"], by_role.get("activation", 0))


@dataclass(frozen=True, slots=True)
class TrialSummary:
    """One lowering the compiler tried (look-ahead window, resident weights), and its result."""
    lookahead: str
    makespan_s: float
    resident_bytes: int
    live_peak_bytes: int


@dataclass(frozen=True, slots=True)
class CompileFigures:
    """What only the compiler knows: the taskgraph, the pass's needs, the search.

    `lower_bound_bytes` is the least memory a plan with this resident set can live in (its
    resident blocks + the largest task's other blocks; never above the plan's live peak).
    `largest_task_bytes` is the largest task's working set at this partition (blocks cut for
    `block_bytes`): not the smallest budget that works, since a smaller budget cuts finer blocks.
    `min_stream_bytes` and `min_compute_s` are the problem's, not the plan's: the fewest bytes any
    plan must copy host->device per pass at this budget (`resident.min_stream_bytes`), and the
    least compute time of the plans tried."""
    tasks: int
    blocks: int
    lower_bound_bytes: int        # resident weights and KV + the largest task's other blocks
    largest_task_bytes: int       # the largest task's working set at this block size
    weight_bytes: int
    resident_bytes: int           # weights kept on the device for every pass
    streamed_weight_bytes: int
    kv_bytes: int                 # the KV store the pass reads (0 for a prefill)
    kv_resident_bytes: int        # ... of which stays on the device across passes
    kv_streamed_bytes: int        # ... of which streams in each pass
    min_stream_bytes: int         # what no plan can avoid copying host->device at this budget
    activation_peak_bytes: int
    compile_seconds: float
    tasks_per_second: float | None
    lookahead: str
    block_bytes: int = 0          # the working set the partition aimed for (budget/8 unless set)
    min_compute_s: float = 0.0    # the least compute time of the plans tried
    lookahead_makespan_s: float | None = None  # the search's makespan with `lookahead` ...
    default_lookahead_makespan_s: float | None = None  # ... and with the default, to compare
    trials: tuple[TrialSummary, ...] = ()
    #: bytes of the weights per storage format, largest first (() where none is quantized)
    weight_formats: tuple[tuple[str, int], ...] = ()
    #: what no plan can avoid reading from disk at these budgets (`resident.least_disk_bytes`)
    min_disk_bytes: int = 0
    #: no plan is faster than its first persistent bytes over the link and the compute after
    #: them (`resident.front_seconds`; the least over the partitions tried)
    min_front_s: float = 0.0
    #: no plan is faster than its outputs' write-back after the tasks that finish them
    #: (`drain.tail_seconds`; the least over the partitions and orders tried)
    min_tail_s: float = 0.0
    #: no plan copies host->device in fewer copies (`resident.min_stream_copies`; the least over
    #: the partitions tried): each pays the link's latency besides its bytes
    min_stream_copies: float = 0.0
    #: the reads of the disk term (`resident.least_disk_staged`: at the staging that gives
    #: the least time, over the partitions tried): each pays the disk's latency
    min_disk_reads: int = 0
    #: ... beside a staging arena of at least this many bytes (`resident.least_disk_staged`)
    min_disk_staging: int = 0
    #: weights that tasks on the host alone read (tables whose rows the host gathers:
    #: `compiler.host_gather`): neither resident nor streamed; in `weight_bytes`
    host_read_bytes: int = 0

    @property
    def min_budget_bytes(self) -> int:
        """The old name of `largest_task_bytes` (it never was the smallest workable budget)."""
        return self.largest_task_bytes


@dataclass(frozen=True, slots=True)
class ProblemBound:
    """The least time any plan of this problem (graph, budgets, device) can take per pass: the
    least compute time; the bytes no plan can avoid copying host->device (`stream_bytes`) over
    the link's bandwidth, and the copies no plan can avoid (`stream_copies`) at its latency;
    and the persistent bytes that the device and a host budget of `host_bytes` cannot hold
    (they must be read from disk) over the disk's bandwidth, with the staging and the reads
    they take; the persistent bytes its tasks
    read first, over the link before those tasks, and the compute from them to the end
    (`front_s`, `resident.front_seconds`); the outputs' write-back after the tasks that finish
    them (`tail_s`, `drain.tail_seconds`); whichever is most. Each plan also
    has its own bound (`PlanReport.plan_bound_s`, from the bytes it chose to stream); only this
    one compares plans with each other."""
    compute_s: float
    stream_bytes: int
    stream_s: float
    disk_bytes: int = 0
    disk_s: float = 0.0
    front_s: float = 0.0  # the first bytes over the link, then the compute after them
    tail_s: float = 0.0   # the compute to the outputs' last writers, then their write-back
    stream_copies: float = 0.0  # the fewest host->device copies (in `stream_s` at the latency)
    disk_reads: int = 0  # the fewest disk reads (in `disk_s` at the disk's latency)
    disk_staging: int = 0  # the staging arena's least bytes, read from disk besides (`disk_s`)

    @property
    def seconds(self) -> float:
        return max(self.steady_s, self.front_s, self.tail_s)

    @property
    def steady_s(self) -> float:
        """The bound without its front and tail terms, for passes of other programs than the one
        compiled (a pipeline's or tensor-parallel group's rank programs, their nodes relisted
        after the compile) or run back to back by a runtime that may overlap them: `front_s`
        and `tail_s` assume the tasks in the compiled order, a pass that starts with nothing
        copied and ends with its outputs written back."""
        return max(self.compute_s, self.stream_s, self.disk_s)

    @staticmethod
    def disk_bytes_of(host_bytes: int | None, least_disk: int) -> int:
        """The disk term's bytes: `least_disk` (`of`) under a host budget, 0 without one. (Not
        the bytes the link must carry less `host_bytes`, which it once also took: those count
        a block read before and after some task twice, as the link carries it, where host
        memory holds it once; a plan reading nothing from disk ran at 1.24 of that bound. The
        stream's bytes, its blocks counted once, are never above `least_disk`, which counts
        every persistent block once and every live block beside it.)"""
        return max(0, least_disk) if isinstance(host_bytes, int) else 0

    @staticmethod
    def of(compute_s: float, stream_bytes: int, profile,
           host_bytes: int | None = None, least_disk: int = 0,
           front_s: float = 0.0, tail_s: float = 0.0,
           stream_copies: float = 0.0, disk_reads: int = 0,
           disk_staging: int = 0) -> "ProblemBound":
        """`least_disk`: the bytes no plan can hold on the device and the host together (their
        outputs counted, `resident.least_disk_bytes`), which the disk supplies whatever the
        link does, and beside them the bytes of a staging arena of `disk_staging` that host
        memory then does not hold, in at least `disk_reads` reads, each paying the disk's
        latency (`resident.least_disk_staged`)."""
        disk = ProblemBound.disk_bytes_of(host_bytes, least_disk)
        disk_bw = getattr(profile, "disk_bandwidth", None)
        stream_s = (stream_bytes / profile.h2d_bandwidth
                    + stream_copies * getattr(profile, "copy_latency", 0.0))
        disk_s = ((disk + disk_staging) / disk_bw
                  + disk_reads * getattr(profile, "disk_latency", 0.0) if disk and disk_bw
                  else 0.0)
        return ProblemBound(compute_s, stream_bytes, stream_s, disk, disk_s, front_s, tail_s,
                            stream_copies, disk_reads if disk and disk_bw else 0,
                            disk_staging if disk and disk_bw else 0)


@dataclass(frozen=True, slots=True)
class Routing:
    """A plan's guarded applies (`einpage.ir.ops.GuardedOp`: a mixture-of-experts task run only
    where the router chose its expert): how many, how many on the host, and the least and the
    largest expected share they are priced at; and its guarded reloads (an expert copied only
    when chosen): how many, their bytes, and the bytes expected per pass. The predicted pass is
    then an expectation."""
    applies: int
    on_host: int
    share_min: float
    share_max: float
    reloads: int = 0
    reload_bytes: int = 0
    expected_reload_bytes: int = 0

    @staticmethod
    def of(mg: MemGraph) -> "Routing | None":
        guarded = [n for n in mg.nodes if n.kind == "apply" and n.guard is not None]
        if not guarded:
            return None
        shares = [n.guard.share for n in guarded]
        copies = [(mg.tensors[n.tensor].bytes, n.guard.share) for n in mg.nodes
                  if n.kind == "reload" and n.guard is not None]
        return Routing(len(guarded), sum(1 for n in guarded if n.on_host), min(shares),
                       max(shares), len(copies), sum(b for b, _ in copies),
                       round(sum(b * s for b, s in copies)))


@dataclass(frozen=True)
class PlanReport:
    """Memory: `live_peak_bytes` is what the plan needs (the most bytes live at once in its node
    order), `arena_bytes` what it reserves (the highest arena byte it addresses; the allocator
    spreads blocks over the budget, so this is near the budget whenever the plan streams), both
    of the budget `device_bytes`. Time: `efficiency` against the problem's bound (`bound`), and
    `plan_efficiency` against the plan's own (`simulation.lower_bound_s`)."""
    device_bytes: int
    nodes: int
    tensors: int
    arena_bytes: int
    live_peak_bytes: int | None
    traffic: Traffic
    simulation: Simulation
    tokens: int | None = None                      # tokens per pass, for tokens/s
    compiled: CompileFigures | None = None         # None for a plan read from a file
    workload: Mapping[str, object] = field(default_factory=lambda: MappingProxyType({}))
    notes: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    bound: ProblemBound | None = None              # None: the plan file does not say
    proven: bool | None = None   # proven to compute its graph (None: not validated)
    graph_hash: str | None = None  # of the graph it was proven against (a plan read from a file)
    routing: Routing | None = None  # guarded applies (None: the plan has none)

    @staticmethod
    def of_plan(mg: MemGraph, valid: ValidationReport | None, simulation: Simulation,
                compiled: CompileFigures | None = None, profile=None) -> "PlanReport":
        """The report of `mg` (its `meta` is the workload), validated and simulated. The
        problem's bound needs the device `profile` it was simulated on and the bytes no plan can
        avoid (the compiler's figures, or the plan's `meta` for a saved plan, whose compute then
        stands for the least compute)."""
        tokens = mg.meta.get("tokens")
        stream = compiled.min_stream_bytes if compiled else mg.meta.get("min_stream_bytes")
        compute = compiled.min_compute_s if compiled else simulation.compute_s
        disk = compiled.min_disk_bytes if compiled else mg.meta.get("min_disk_bytes", 0)
        # the front and tail terms are in seconds of the compile's device: a saved plan priced
        # on another (`einpage inspect --device`) keeps the terms it can price again
        front = compiled.min_front_s if compiled else 0.0
        tail = compiled.min_tail_s if compiled else 0.0
        copies = (compiled.min_stream_copies if compiled
                  else mg.meta.get("min_stream_copies", 0.0))
        reads = compiled.min_disk_reads if compiled else mg.meta.get("min_disk_reads", 0)
        staging = (compiled.min_disk_staging if compiled
                   else mg.meta.get("min_disk_staging", 0))
        if compiled is None and (profile is None or mg.meta.get("min_disk_priced") != [
                getattr(profile, "disk_bandwidth", None), getattr(profile, "disk_latency", None)]):
            reads = staging = 0  # the least staging and reads for another disk: its bytes only
        bound = (ProblemBound.of(compute, stream, profile, mg.meta.get("host_bytes"),
                                 disk if isinstance(disk, int) else 0, front, tail,
                                 copies if isinstance(copies, (int, float)) else 0.0,
                                 reads if isinstance(reads, int) else 0,
                                 staging if isinstance(staging, int) else 0)
                 if isinstance(stream, int) and profile is not None else None)
        return PlanReport(mg.device_bytes, len(mg.nodes), len(mg.tensors),
                          valid.peak_bytes if valid else mg.high_water(),
                          valid.live_peak_bytes if valid else mg.live_peak(), Traffic.of(mg),
                          simulation, tokens if isinstance(tokens, int) else None, compiled,
                          MappingProxyType(dict(mg.meta)), bound=bound,
                          proven=valid.proven if valid else None,
                          graph_hash=mg.graph_hash if compiled is None and valid and valid.proven
                          else None, routing=Routing.of(mg))

    @property
    def peak_bytes(self) -> int:
        """The old name of `arena_bytes`."""
        return self.arena_bytes

    @property
    def efficiency(self) -> float | None:
        """The problem's bound over the predicted time (None where the bound is unknown)."""
        if self.bound is None:
            return None
        s = self.simulation.makespan_s
        return self.bound.seconds / s if s > 0 else 1.0

    @property
    def plan_bound_s(self) -> float:
        """The plan's own bound (`simulation.lower_bound_s`: its compute, each block it streams
        moved once), or the problem's front or tail term where that is more: they hold for
        this plan too. (It can be below the problem's bound, whose stream term counts a block
        read on both sides of a position twice, and spilled activations.)"""
        b = self.bound
        return max(self.simulation.lower_bound_s, b.front_s if b else 0.0, b.tail_s if b else 0.0)

    @property
    def plan_efficiency(self) -> float:
        """The plan's own bound over the predicted time."""
        s = self.simulation.makespan_s
        return self.plan_bound_s / s if s > 0 else 1.0

    @property
    def bound_by(self) -> str:
        """The engine busiest in the predicted pass: compute, h2d, d2h, disk or host (applies
        placed on the host's CPU)."""
        sim = self.simulation
        busy = {"compute": sim.compute_s, "h2d": sim.h2d_s, "d2h": sim.d2h_s,
                "disk": getattr(sim, "disk_s", 0.0), "host": sim.host_s}
        return max(busy, key=lambda k: (busy[k], k == "compute"))

    def with_notes(self, **notes: str) -> "PlanReport":
        """Where outputs were written, warnings: shown after the figures."""
        return replace(self, notes=MappingProxyType({**self.notes, **notes}))

    @property
    def tokens_per_s(self) -> float | None:
        s = self.simulation.makespan_s
        return self.tokens / s if self.tokens and s > 0 else None

    def to_json(self) -> dict:
        """The flat `--json` object: the workload, the plan, what it moves, the prediction,
        the compiler's figures (when compiled), the notes."""
        sim = self.simulation
        out: dict = dict(self.workload)
        out.update(device_bytes=self.device_bytes, nodes=self.nodes, tensors=self.tensors,
                   arena_bytes=self.arena_bytes, live_peak_bytes=self.live_peak_bytes,
                   peak_bytes=self.arena_bytes)  # peak_bytes: the old name of arena_bytes
        out.update({f.name: getattr(self.traffic, f.name) for f in fields(Traffic)})
        out.update(device=sim.device, makespan_s=sim.makespan_s, compute_s=sim.compute_s,
                   h2d_s=sim.h2d_s, d2h_s=sim.d2h_s, stall_s=sim.stall_s,
                   stall_h2d_s=sim.stall_h2d_s, late_reloads=sim.late_reloads,
                   h2d_bytes=sim.h2d_bytes, d2h_bytes=sim.d2h_bytes, bound_by=self.bound_by,
                   plan_lower_bound_s=self.plan_bound_s,
                   plan_efficiency=round(self.plan_efficiency, 4),
                   plan_h2d_min_bytes=sim.h2d_min_bytes)
        # the problem's bound: any plan at this budget (None where a saved plan does not say)
        b = self.bound
        out.update(lower_bound_s=b.seconds if b else None,
                   efficiency=round(self.efficiency, 4) if b else None,
                   lower_bound_compute_s=b.compute_s if b else None,
                   lower_bound_stream_s=b.stream_s if b else None,
                   lower_bound_stream_copies=b.stream_copies if b else None,
                   lower_bound_disk_s=b.disk_s if b else None,
                   lower_bound_disk_reads=b.disk_reads if b else None,
                   lower_bound_disk_staging_bytes=b.disk_staging if b else None,
                   lower_bound_front_s=b.front_s if b else None,
                   lower_bound_tail_s=b.tail_s if b else None)
        # the disk tier (compiler.tiers): bytes read from disk per pass and the host budget
        out.update(disk_s=sim.disk_s, disk_read_bytes=sim.disk_bytes,
                   disk_min_bytes=sim.disk_min_bytes,
                   host_bytes=self.workload.get("host_bytes"),
                   host_peak_bytes=self.workload.get("host_peak_bytes"))
        if self.tokens:
            out["tokens_per_s"] = self.tokens_per_s
        if self.compiled is not None:
            c = self.compiled
            out.update({f.name: getattr(c, f.name) for f in fields(CompileFigures)
                        if f.name not in ("trials", "weight_formats")})
            out["weight_formats"] = dict(c.weight_formats)
            if c.trials:
                out["trials"] = [{f.name: getattr(t, f.name) for f in fields(TrialSummary)}
                                 for t in c.trials]
        out.update(proven=self.proven, graph_hash=self.graph_hash)
        r = self.routing
        out.update(guarded_applies=r.applies if r else 0,
                   guarded_host_applies=r.on_host if r else 0,
                   guarded_share_min=r.share_min if r else None,
                   guarded_share_max=r.share_max if r else None,
                   guarded_reloads=r.reloads if r else 0,
                   guarded_reload_bytes=r.reload_bytes if r else 0,
                   guarded_reload_expected_bytes=r.expected_reload_bytes if r else 0)
        out.update(self.notes)
        return out
