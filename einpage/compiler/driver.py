"""The compiler driver: the passes in order.

    Graph --partition--> TaskGraph --order--> [task ids] --resident--> --lower--> MemGraph
          --simulate--> predicted times --validate--> report

With `auto_lookahead`, the lowering runs once per look-ahead window and the plan of least
simulated makespan is kept (the least peak memory among near-ties).
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping

from einpage.compiler.allocator import aligned
from einpage.compiler.lowering import LowerOptions, lower
from einpage.compiler.order import memory_aware_order
from einpage.compiler.partitioner import PartitionOptions, partition
from einpage.compiler.policies import get_policy
from einpage.compiler.resident import choose_resident, everything_fits, pass_needs, pass_reserve
from einpage.errors import BudgetError
from einpage.ir.graph import Graph
from einpage.ir.memgraph import MemGraph
from einpage.ir.taskgraph import TaskGraph
from einpage.predict.cost import task_seconds
from einpage.predict.devices import DEFAULT_DEVICE, DeviceProfile, get_device
from einpage.predict.simulator import Simulation, simulate
from einpage.units import format_size


@dataclass(frozen=True)
class CompileOptions:
    device_bytes: int
    policy: str = "reuse-distance"
    block_fraction: float = 1 / 8       # target working set of a task, as a share of the budget
    block_bytes: int | None = None      # ... or in bytes
    lookahead_bytes: int | None = None  # cap on bytes prefetched ahead of execution
    lookahead_seconds: float | None = None  # cap on predicted compute seconds ahead of execution
    auto_lookahead: bool = False        # search the look-ahead that minimizes simulated makespan
    device: DeviceProfile | None = None  # cost-model profile (default: h100-pcie)
    cuts: Mapping[int, Mapping[str, int]] = field(default_factory=dict)
    sources: Mapping[str, str] = field(default_factory=dict)
    validate: bool = True
    progress: Callable[[str, int, int], None] | None = None  # (stage, done, total)


@dataclass(frozen=True)
class Compiled:
    memgraph: MemGraph
    taskgraph: TaskGraph
    order: tuple[int, ...]
    report: dict
    simulation: Simulation


# The automatic look-ahead tries memory-bound prefetch and windows of these shares of the pass's
# predicted compute; above AUTO_MAX_TASKS it keeps memory-bound prefetch (each try is a lowering).
AUTO_SHARES = (1 / 512, 1 / 128, 1 / 32, 1 / 8)
AUTO_MAX_TASKS = 50_000
AUTO_TOLERANCE = 0.005  # makespans within 0.5% of the best count as equal; the least peak wins
# When the first plan spills activations or its efficiency is below RESIDENT_SEARCH_BELOW, shares
# of the resident room on this grid are searched as well (and every weight, where they all fit).
RESIDENT_SHARES = (1, 3 / 4, 1 / 2, 1 / 4, 0)
RESIDENT_SEARCH_BELOW = 0.98


@dataclass(frozen=True)
class Trial:
    """One lowering: its look-ahead window, resident weights, plan and simulation. The plan and
    the simulation's per-node times are dropped (None, empty) once another trial is faster
    beyond AUTO_TOLERANCE: it can no longer win, and a plan of a million tasks is gigabytes."""
    window: float | None
    resident: frozenset
    memgraph: MemGraph | None
    simulation: Simulation
    spill_bytes: int
    live_peak: int


def compile_graph(graph: Graph, options: CompileOptions) -> Compiled:
    """Partition, order, choose resident weights, lower, simulate and validate `graph` for the
    budget."""
    t0 = time.perf_counter()
    policy = get_policy(options.policy)
    profile = options.device or get_device(DEFAULT_DEVICE)
    block = options.block_bytes or max(4096, int(options.device_bytes * options.block_fraction))
    tg = partition(graph, PartitionOptions(block, options.cuts, options.sources))
    order = memory_aware_order(tg)
    needs = pass_needs(tg, order)
    if needs.max_working_set > options.device_bytes:
        raise BudgetError(f"budget {format_size(options.device_bytes)} is too small: one task "
                          f"needs {format_size(needs.max_working_set)} at once; the smallest budget "
                          f"that would work is {format_size(needs.max_working_set)}",
                          needs.max_working_set, options.device_bytes)
    fits = everything_fits(needs, options.device_bytes)
    # A pass that streams weights writes its outputs (logits, the KV cache) back to the host as
    # soon as each block is final, so the device keeps that memory for resident weights.
    outputs_to_host = not fits and policy.evicts
    room = 0
    if fits or not policy.evicts:
        resident = frozenset(b.id for b in tg.input_blocks if b.role == "weight")
    elif policy.keeps_resident:
        room = options.device_bytes - pass_reserve(pass_needs(tg, order, outputs_stay=False))
        resident = choose_resident(tg, order, room)
    else:
        resident = frozenset()
    seconds = tuple(task_seconds(profile, tg))
    windows = _windows(options, sum(seconds), len(tg.tasks))

    def trial(resident, window):
        progress = None
        if options.progress is not None:
            progress = functools.partial(options.progress, f"lowering {len(trials) + 1}")
        lower_opts = LowerOptions(options.device_bytes, policy, resident,
                                  inputs_at_device=fits and policy.evicts,
                                  outputs_to_host=outputs_to_host,
                                  lookahead_bytes=options.lookahead_bytes,
                                  lookahead_seconds=window, task_seconds=seconds,
                                  progress=progress)
        mg, resident = _lower_shrinking(tg, order, lower_opts)
        trials.append(Trial(window, resident, mg, simulate(mg, profile),
                            offloads(mg)["offload_bytes"], mg.live_peak()))
        fastest = min(t.simulation.makespan_s for t in trials) * (1 + AUTO_TOLERANCE)
        trials[:] = [t if t.memgraph is None or t.simulation.makespan_s <= fastest
                     else replace(t, memgraph=None, simulation=replace(
                         t.simulation, start=(), end=(), engine=())) for t in trials]
        return replace(trials[-1], memgraph=None)  # `trials` alone holds the plans

    trials: list[Trial] = []
    first = trial(resident, windows[0])
    if room > 0 and (first.spill_bytes > 0
                     or first.simulation.efficiency < RESIDENT_SEARCH_BELOW):
        # The resident weights crowd the activations (they spill) or the prefetch (compute
        # waits): weigh fewer or more resident weights against the streaming, by makespan.
        everything = frozenset(b.id for b in tg.input_blocks if b.role == "weight")
        if needs.weight_bytes + needs.max_working_set <= options.device_bytes:
            _try(trial, everything, windows[0])
        _search_resident(lambda share: trial(choose_resident(tg, order, int(room * share)),
                                             windows[0]), first)
        resident = _best(trials).resident
    for window in windows[1:]:
        trial(resident, window)
    best = _best(trials)
    window, resident, mg, sim = best.window, best.resident, best.memgraph, best.simulation
    report_valid = None
    if options.validate:
        from einpage.compiler.validator import validate
        report_valid = validate(mg)
    elapsed = time.perf_counter() - t0
    report = summarize(mg, tg, needs, resident, elapsed, report_valid)
    report.update(sim.report())
    report["lookahead"] = _describe(options, window)
    if len(trials) > 1:
        report["trials"] = [
            {"lookahead": _describe(options, t.window), "makespan_s": t.simulation.makespan_s,
             "resident_bytes": sum(aligned(tg.blocks[b].bytes) for b in t.resident),
             "live_peak_bytes": t.live_peak} for t in trials]
    meta = {"policy": options.policy, "device": profile.name, "lookahead": report["lookahead"],
            **{k: report[k] for k in ("tasks", "resident_bytes", "weight_bytes")}}
    mg = MemGraph(mg.device_bytes, mg.tensors, mg.nodes, mg.outputs, mg.inputs, mg.results, meta)
    return Compiled(mg, tg, tuple(order), report, sim)


def _search_resident(trial_at: Callable[[float], Trial], first: Trial) -> None:
    """Search the share of the resident room on the RESIDENT_SHARES grid, from the first plan
    (share 1). The makespan falls as fewer resident weights leave the pass more room, until the
    extra streaming binds: it is taken as unimodal in the share. Probe the middle; if it beats
    the first plan the best share may lie on either side of it, else it lies before it. Then
    climb to the better neighbour while that improves, and stop once a plan spills nothing and
    runs within AUTO_TOLERANCE of its compute time (the same for every share, unlike the h2d
    term of each plan's own bound, so no other share can beat it by more than the tolerance):
    two or three lowerings instead of five."""
    shares = RESIDENT_SHARES
    seen = {0: first}

    def makespan(i: int) -> float:
        if i not in seen:
            seen[i] = trial_at(shares[i])
        return seen[i].simulation.makespan_s

    def done(i: int) -> bool:
        t = seen[i]
        return (t.spill_bytes == 0
                and t.simulation.makespan_s <= (1 + AUTO_TOLERANCE) * t.simulation.compute_s)

    i = len(shares) // 2
    steps = (1, -1) if makespan(i) < makespan(0) else (-1,)
    while not done(i):
        for step in steps:
            j = i + step
            if 0 <= j < len(shares) and makespan(j) < makespan(i):
                i, steps = j, (step,)  # unimodal: keep going this way
                break
        else:
            return


def _try(trial, resident, window) -> None:
    """A trial that may not fit at all (then it is not a candidate)."""
    try:
        trial(resident, window)
    except BudgetError:
        pass


def _windows(options: CompileOptions, compute_s: float, tasks: int) -> list[float | None]:
    """Look-ahead windows (predicted compute seconds; None: bounded by memory only) to try."""
    if not options.auto_lookahead:
        return [options.lookahead_seconds]
    if tasks > AUTO_MAX_TASKS or compute_s <= 0:
        return [None]
    return [None, *(compute_s * share for share in AUTO_SHARES)]


def _best(trials: list["Trial"]) -> "Trial":
    """The trial of least makespan; among those within AUTO_TOLERANCE of it, the one that moves
    the fewest bytes, then the one with the fewest bytes live at once (the same speed with less
    traffic and less memory in flight)."""
    fastest = min(t.simulation.makespan_s for t in trials)
    near = [t for t in trials if t.simulation.makespan_s <= fastest * (1 + AUTO_TOLERANCE)]
    return min(near, key=lambda t: (t.simulation.h2d_bytes + t.simulation.d2h_bytes,
                                    t.live_peak, t.simulation.makespan_s))


def _describe(options: CompileOptions, window: float | None) -> str:
    parts = []
    if options.lookahead_bytes is not None:
        parts.append(format_size(options.lookahead_bytes))
    if window is not None:
        parts.append(f"{window * 1e3:.3g} ms of compute")
    text = " and ".join(parts) if parts else "memory-bound"
    return f"auto: {text}" if options.auto_lookahead else text


def _lower_shrinking(tg: TaskGraph, order, opts: LowerOptions) -> tuple[MemGraph, frozenset]:
    """Lower; if the resident weights leave the pass too little room, keep fewer and retry."""
    while True:
        try:
            return lower(tg, order, opts), opts.resident
        except BudgetError:
            if not opts.resident or not opts.policy.evicts:
                raise
            keep = len(opts.resident) // 2  # give the pass more room and try again
            opts = replace(opts, resident=frozenset(sorted(opts.resident)[:keep]))


def summarize(mg: MemGraph, tg: TaskGraph, needs, resident, seconds, valid) -> dict:
    resident_bytes = sum(aligned(tg.blocks[b].bytes) for b in resident)
    streamed = needs.weight_bytes - resident_bytes
    return {
        "device_bytes": mg.device_bytes,
        "peak_bytes": valid.peak_bytes if valid else mg.high_water(),
        "live_peak_bytes": valid.live_peak_bytes if valid else None,
        "lower_bound_bytes": resident_bytes + needs.max_working_set,
        "min_budget_bytes": needs.max_working_set,
        "tasks": len(tg.tasks),
        "blocks": len(tg.blocks),
        "nodes": len(mg.nodes),
        "weight_bytes": needs.weight_bytes,
        "resident_bytes": resident_bytes,
        "streamed_weight_bytes": streamed,
        "reload_count": mg.count("reload"),
        "reload_bytes": mg.moved_bytes("reload"),
        **offloads(mg),
        "activation_peak_bytes": needs.activation_peak,
        "compile_seconds": round(seconds, 3),
        "tasks_per_second": round(len(tg.tasks) / seconds, 1) if seconds > 0 else None,
    }


def offloads(mg: MemGraph) -> dict:
    """Device->host traffic, split: `offload_*` spills a block that is needed again (it comes
    back by a reload); `writeback_*` sends a finished output to the host, once."""
    final = {}
    for n in mg.nodes:
        if n.kind == "offload":
            final[n.tensor] = n.id
    at_host = {o.tensor for o in mg.outputs if o.at == "host"}
    back = {final[t] for t in at_host if t in final}
    spills = [n for n in mg.nodes if n.kind == "offload" and n.id not in back]
    return {"offload_count": len(spills),
            "offload_bytes": sum(mg.tensors[n.tensor].bytes for n in spills),
            "writeback_count": len(back),
            "writeback_bytes": sum(mg.tensors[mg.nodes[i].tensor].bytes for i in back)}
