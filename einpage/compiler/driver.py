"""The compiler driver: the passes in order.

    Graph --partition--> TaskGraph --order--> task order --resident (policy)--> weights kept
          --lower, simulate (search: look-ahead windows, resident shares)--> MemGraph
          --tiers (host budget: pinned or read from disk)--> MemGraph --validate--> PlanReport

Each pass is a function of the pass before; the search (`einpage.compiler.search`, on one
partition `einpage.compiler.rooms`) lowers the taskgraph once per candidate and keeps the
fastest plan; the partitions tried are compared by their best plans."""
from __future__ import annotations

import math
import numbers
import time
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Callable, Mapping, NamedTuple

from einpage import collector
from einpage.compiler import rooms, search
from einpage.compiler.host_search import place
from einpage.compiler.allocator import aligned
from einpage.compiler.cuts import largest_reused_weight
from einpage.compiler.drain import tail_seconds
from einpage.compiler.lower_options import GUARDED_RELOAD_SHARE, LowerOptions
from einpage.compiler.placement import separated_seconds
from einpage.compiler.policies import Policy, get_policy
from einpage.compiler.report import CompileFigures, PlanReport, TrialSummary
from einpage.compiler.rungs import Partitions, Rung, known_bound, problem_bound
from einpage.compiler.resident import (PassNeeds, everything_fits, kept_bytes,
                                       memory_lower_bound)
from einpage.compiler.tier_room import weights_first_tiered, with_plan
from einpage.compiler.tiers import Tiered, by_size_tiers, place_tiers
from einpage.ir.validator import validate, vouch
from einpage.errors import BudgetError, PlanError
from einpage.ir.graph import Graph
from einpage.ir.memgraph import ALIGNMENT, ApplyNode, MemGraph
from einpage.ir.taskgraph import TaskGraph
from einpage.predict.devices import DeviceProfile
from einpage.predict.simulator import Simulation
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
    workload: Mapping[str, object] = field(default_factory=dict)  # what the plan is for (meta)
    progress: Callable[[str, int, int], None] | None = None  # (stage, done, total)
    drop_constant_blocks: bool = True   # no tasks for blocks known at partition time (masks)
    host_bytes: int | None = None       # host budget (--cpu-mem); None: unlimited, no disk tier
    host_compute: bool = False          # weigh applies placed on the host (the CLI's
                                        # --host-compute auto, its default, sets it)
    guarded_reload_share: float = GUARDED_RELOAD_SHARE  # reload an expert only when chosen
                                        # where it runs in at most this share of passes (0: never)
    pack_low: bool = True               # the blocks that stay packed from below, tried both ways
                                        # (`LowerOptions.pack_low`); False: all by stamp
    host_gather: bool = True            # a pass that does not fit gathers its embedding rows on
                                        # the host (`compiler.host_gather`; the CLI's
                                        # --host-compute off clears it)


@dataclass(frozen=True)
class Compiled:
    memgraph: MemGraph
    taskgraph: TaskGraph
    order: tuple[int, ...]
    report: PlanReport
    simulation: Simulation


#: A streaming pass whose activations peak below 1/LADDER_GATE of the budget (a decode step) is
#: also partitioned for working sets 4, 8, 16, ... times below its largest task's (halvings from
#: FIRST_RUNG, up to FINER_STEPS rungs), each searched while the rung before it gained makespan:
#: the memory it keeps for blocks in flight shrinks with the blocks, and what that frees stays
#: resident, so fewer bytes stream, while more, smaller tasks cost launches (the simulator weighs
#: both). Quarters alone missed the best rung: llama-7b decode B=1 C=2304 at 14 GB runs 20.67 ms
#: with its 250 MB tasks, 17.95 ms at 62 MB, 16.02 ms at 31 MB, 22 ms at 15 MB. (llama-7b B=16
#: C=768 at 16 GB: 1.084x -> 1.020x the bytes no plan can avoid.) Where the disk binds, the
#: ladder goes on finer on the tiered pass (`_finer_tiered`).
FINER = 2
FIRST_RUNG = 2          # the first finer rung: FINER ** FIRST_RUNG below the largest task
FINER_STEPS = 3
LADDER_GATE = 16
#: halvings of a prefill's blocks tried (`_halve_blocks`): on the planner grid every gain came
#: at the first (11 of 61 rows faster, none slower); a second added compile time for nothing
HALVINGS = 1
MIN_BLOCK = 1 << 20
#: A streaming pass that the link binds also tries its weights cut into blocks of at most
#: 1/WEIGHT_BLOCK_SHARES of its partition's working sets, each (`_stream_blocks`)
WEIGHT_BLOCK_SHARES = (8, 16)
#: ... and one that compute binds, where its compute waits on the link for more than
#: STALL_GATE of its pass (each large block copied whole just before its readers: qwen2.5-7b
#: B=16 at 1.9 GB waits 2 ms on each 136 MB feed-forward matrix, 110 ms in all), to
#: 1/STALLED_BLOCK_SHARE (1/16 costs its compute more launches than the waits: 1.95 s against
#: 1.83 s at 1/4 and 1.91 s uncapped)
STALL_GATE = 0.03
STALLED_BLOCK_SHARE = 4


def compile_graph(graph: Graph, options: CompileOptions) -> Compiled:
    """Partition, order, choose resident weights and KV blocks, lower (searching look-ahead
    windows and resident sets by simulated makespan), validate and report `graph` for the budget.
    Where the pass streams, finer partitions are searched too and the faster plan kept: the
    ladder where its activations are small (`LADDER_GATE`), its blocks halved where they are
    not (`_halve_blocks`). The cyclic garbage collector is paused meanwhile
    (`collector.paused`)."""
    with collector.paused():
        return _compile_graph(graph, options)


def _compile_graph(graph: Graph, options: CompileOptions) -> Compiled:
    if not isinstance(options.device_bytes, numbers.Integral):
        raise PlanError(f"device_bytes is {options.device_bytes!r}, expected an int")
    if options.device_bytes < ALIGNMENT:
        raise BudgetError(f"budget {int(options.device_bytes)} bytes is too small: a plan needs "
                          f"a device arena of at least {ALIGNMENT} bytes (one aligned block), "
                          "and in practice its largest task's blocks", ALIGNMENT,
                          int(options.device_bytes))
    if not isinstance(options.device_bytes, int):
        options = replace(options, device_bytes=int(options.device_bytes))
    t0 = time.perf_counter()
    block = options.block_bytes or max(4096, int(options.device_bytes * options.block_fraction))
    parts = Partitions(graph, options)
    planned = _plan(parts, block)
    rivals: list[rooms.Planned] = []  # the partitions planned that lost
    stepped: list[rooms.Planned] = []  # ... on the decode ladder (their rooms refined there)
    rungs = list(planned.tried)  # the partitions of the ladder: the problem's bound is the least
    ladder: _Ladder | None = None
    if (options.block_bytes is None and not planned.fits
            and planned.needs.activation_peak * LADDER_GATE < options.device_bytes):
        ladder = _Ladder(rungs[0].max_working_set, FIRST_RUNG, planned.rung.block)
        for step in range(FIRST_RUNG, FIRST_RUNG + FINER_STEPS):
            block = ladder.block(step)
            if block < MIN_BLOCK:
                break
            if planned.rung.block != rungs[-1].block:  # searched no further: bound only
                rungs.append(parts.cut(block).rung)
                continue
            finer = _plan(parts, block, planned.won)
            ladder = _Ladder(ladder.top, step + 1, finer.rung.block)
            rungs.extend(finer.tried)
            finer = rooms.refine_room(finer, options, known_bound(rungs, parts.profile),
                                      planned.trials.best().simulation.makespan_s)
            best = planned.trials.best().simulation.makespan_s
            if finer.trials.best().simulation.makespan_s < best * (1 - search.AUTO_TOLERANCE):
                planned, finer = finer, planned
            stepped.append(finer)
    elif options.block_bytes is None and not planned.fits:
        planned = _halve_blocks(parts, planned, rungs, rivals)
    if not planned.fits:
        planned = _stream_blocks(parts, planned, rungs, rivals)
        planned, coarse, won = rooms.refine_rooms(planned, rivals, options,
                                                  known_bound(rungs, parts.profile))
        if ladder is not None:
            planned, coarse, won = _split_streamed(parts, (planned, coarse, won), rungs, rivals)
        rivals.extend(stepped)
        del stepped
        if options.host_bytes is None:  # no disk to weigh them by (`rooms.climb_tiers`): let
            rivals.clear()              # their plans go
        rooms.prefetch_trials(planned, known_bound(rungs, parts.profile), coarse)
        if planned.trials.best().resident == coarse.resident:  # a trial of it won after all
            planned = planned._replace(won=won)
        planned = _drain_behind(parts, planned, rungs, rivals)
        search.stamped_trials(planned.trials, known_bound(rungs, parts.profile))
    if options.host_compute and not planned.fits:
        place(planned.trials, planned.needs, planned.won.share, options)
    if not planned.fits:  # (after the placement, which starts from what the device keeps)
        planned = rooms.by_size_trials(planned, options, known_bound(rungs, parts.profile))
    tg, trials = planned.tg, planned.trials
    best = trials.best()
    device_rungs = rungs
    if best.on_host:  # the bound of the placement it runs (a device-only bound does not hold)
        rungs = [planned.rung._replace(
            min_stream_bytes=best.simulation.h2d_min_bytes,
            compute_s=max(best.simulation.compute_s, best.simulation.host_s,
                          _separated(tg, best)), front_s=0.0,
            tail_s=0.0, min_stream_copies=0.0)]
    tiered = place_tiers(best.memgraph, best.simulation, options.host_bytes, trials.profile)
    disk_binds = tiered.choice.disk_bytes and (
        tiered.simulation.makespan_s > best.simulation.makespan_s * (1 + search.AUTO_TOLERANCE))
    climbed = _climb_device(planned, best, tiered, rivals, options) if (
        disk_binds and planned.paced) else None
    if climbed is not None and ladder is not None:
        climbed = _finer_tiered(parts, climbed, ladder, device_rungs)
    if climbed is not None and (not best.on_host or climbed[2].simulation.makespan_s
                                < tiered.simulation.makespan_s * (1 - search.AUTO_TOLERANCE)):
        (planned, best, tiered), rungs = climbed, device_rungs
        tg, trials = planned.tg, planned.trials
    elif tiered.choice.disk_bytes and planned.needs.kv_bytes:  # not climbed (the disk does
        # not bind, or a placement stays): its resident bytes tried once with weights first
        tiered, best = weights_first_tiered(trials, best, tiered, options.device_bytes,
                                            options.host_bytes)
    tiered = by_size_tiers(best.memgraph, best.simulation, tiered, options.host_bytes,
                           trials.profile)
    mg = tiered.memgraph
    if not options.validate:  # (the search simulated its plans unverified: `search.Trials`)
        mg.verify()
    valid = validate(mg) if options.validate else None
    figures = _figures(planned, best, rungs, _default_lookahead(trials, best, options), options,
                       time.perf_counter() - t0)
    meta = {"policy": options.policy, "device": trials.profile.name, "lookahead": figures.lookahead,
            "tasks": figures.tasks, "resident_bytes": figures.resident_bytes,
            "min_stream_bytes": figures.min_stream_bytes,
            "min_disk_bytes": figures.min_disk_bytes,
            "min_stream_copies": figures.min_stream_copies,
            "min_disk_reads": figures.min_disk_reads,
            "min_disk_staging": figures.min_disk_staging,
            # (the disk those two were least for: priced on another, they bound nothing)
            "min_disk_priced": [trials.profile.disk_bandwidth, trials.profile.disk_latency],
            "weight_bytes": figures.weight_bytes, "kv_bytes": figures.kv_bytes,
            "kv_resident_bytes": figures.kv_resident_bytes, **tiered.choice.to_json(),
            **options.workload}
    mg = replace(mg, meta=MappingProxyType(meta))
    if valid is not None:
        vouch(mg, valid)  # the meta is no part of what was proven: runtimes check it no more
    return Compiled(mg, tg, tuple(trials.order),
                    PlanReport.of_plan(mg, valid, tiered.simulation, figures, trials.profile),
                    tiered.simulation)


def _separated(tg: TaskGraph, plan: search.Trial) -> float:
    """`placement.separated_seconds` of `plan`'s placement, each task taking what its apply
    takes in `plan`'s simulation (a task's seconds where it runs: a guarded one its share)."""
    sim, seconds = plan.simulation, [0.0] * len(tg.tasks)
    for n in plan.memgraph.nodes:
        if isinstance(n, ApplyNode) and n.task is not None:
            seconds[n.task] = sim.end[n.id] - sim.start[n.id]
    return separated_seconds(tg, plan.on_host, seconds)


class _Ladder(NamedTuple):
    """A decode step's ladder of partitions: the largest task's working set (`top`), the first
    rung (`step`: halvings of `top`) not planned and the block of the finest one planned."""
    top: int
    step: int
    finest: int

    def block(self, step: int) -> int:
        return self.top // FINER ** step


def _finer_tiered(parts: Partitions, chosen: tuple[rooms.Planned, search.Trial, Tiered],
                  ladder: _Ladder, rungs: list[Rung]
                  ) -> tuple[rooms.Planned, search.Trial, Tiered]:
    """Where the disk binds a decode step and its finest rung planned wins the tiered climb
    (`chosen`, from `_climb_device`) and misses REFINE_BELOW of the problem's bound: the
    ladder continued on the tiered pass, each finer rung planned (with what won on the rung
    before), tiered and its room climbed (`rooms.climb_tier`), while each gains by
    AUTO_TOLERANCE. On the device the ladder stops where launches cost more than the smaller
    blocks in flight save; where the disk binds, every byte the device keeps for blocks in
    flight and the host keeps for staging is a byte read from disk, and the launches hide
    behind the disk: llama-7b decode B=8 at 8 GB with a 14 GB host, 462 ms on the device's
    finest rung (66 MB working sets), 425 ms at 33 MB, 417 ms at 16 MB, 425 ms at 8 MB. Each
    rung planned is a rung of the problem's bound (`rungs`)."""
    options, profile = parts.options, parts.profile
    _, step, finest = ladder
    bound = problem_bound(rungs, profile, options.host_bytes).seconds
    if chosen[2].simulation.makespan_s * rooms.REFINE_BELOW <= bound:
        return chosen
    while chosen[0].rung.block == finest:
        block = ladder.block(step)
        if block < MIN_BLOCK:
            break
        try:
            finer = _plan(parts, block, chosen[0].won)
        except BudgetError:  # too many tasks, or no set fits beside its pass
            break
        finest, step = finer.rung.block, step + 1
        rungs.extend(r for r in finer.tried if r not in rungs)
        plan = finer.trials.best()
        if plan.on_host or not finer.paced:
            break
        try:
            tiered = place_tiers(plan.memgraph, plan.simulation, options.host_bytes, profile)
        except BudgetError:  # its host needs do not fit
            break
        tiered, plan = rooms.climb_tier(finer, plan, tiered, options,
                                        kept_bytes(chosen[0].tg, chosen[1].resident))
        if tiered.simulation.makespan_s >= chosen[2].simulation.makespan_s * (
                1 - search.AUTO_TOLERANCE):
            break
        chosen = (finer, plan, tiered)
    return chosen


def _climb_device(planned: rooms.Planned, best: search.Trial, tiered: Tiered,
                  rivals: list[rooms.Planned], options: CompileOptions):
    """Where the disk binds: the partitions' device-only plans climbed by the tiered pass
    (`rooms.climb_tiers`) from the fastest of `planned` (`best`, tiered as `tiered`, where it
    places no task on the host: a placement's sets leave out the blocks its host tasks read,
    `host_search`); None where no device-only plan is there to climb or its host needs do not
    fit. A placement that won on the device may lose once the disk binds: llama-7b decode B=8
    at 8 GB with a 14 GB host, 652 ms with its applies placed, 462 ms device-only, tiered (417
    ms with the ladder continued, `_finer_tiered`)."""
    device = [t for t in planned.trials.items if not t.on_host]
    if not device:
        return None
    plan = with_plan(planned.trials, search.best(device))
    if plan is not best:
        try:
            tiered = place_tiers(plan.memgraph, plan.simulation, options.host_bytes,
                                 planned.trials.profile)
        except BudgetError:
            return None
    return rooms.climb_tiers(planned, plan, tiered, rivals, options)


def _halve_blocks(parts: Partitions, planned: "rooms.Planned", rungs: list[Rung],
                  rivals: list["rooms.Planned"]) -> "rooms.Planned":
    """A streaming pass whose activations are too large for the ladder (a prefill): its blocks
    halved (HALVINGS times at most, while each gains makespan), the faster plan kept. Streaming
    a block needs room for it in flight beside the resident weights, and the largest blocks set
    that room: llama3.1-8b prefill at 12 GB cuts its 1.05 GB logits projection whole at the
    default 1.5 GB working sets and streams 5.77 GB (0.120 s); at 750 MB it streams 5.64 GB
    beside 2 ms more compute (0.114 s). And smaller query and key blocks leave more of a causal
    mask's blocks out: mistral-7b prefill of 4096 tokens at 8 GB computes 0.338 s at 1 GB
    working sets, 0.278 s at 500 MB. Finer still, launches and the activations' blocks cost
    more than that saves (0.119 s and 0.289 s at a quarter). A halving is lowered where the link
    binds the best plan, or where the halved partition's compute alone is below the best plan's
    pass; it is a rung of the problem's bound either way (the bound does not depend on the
    search)."""
    searching = True
    for step in range(1, HALVINGS + 1):
        block = rungs[0].block // FINER ** step
        if block < MIN_BLOCK:
            break
        sim = planned.trials.best().simulation
        rung = None
        if searching and not sim.h2d_s > sim.compute_s:
            rung = parts.cut(block).rung
            searching = rung.compute_s < sim.makespan_s * (1 - search.AUTO_TOLERANCE)
        if not searching:  # cannot be faster, or the last halving gained nothing: a bound only
            rungs.append(rung or parts.cut(block).rung)
            continue
        finer = _plan(parts, block, planned.won, unless_like=planned.tg, alone=True)
        if finer is None:  # the halved blocks needed no further cut: the same plans
            rungs.append(parts.cut(block).rung)
            searching = False
            continue
        rungs.extend(finer.tried)
        best = sim.makespan_s
        if finer.trials.best().simulation.makespan_s < best * (1 - search.AUTO_TOLERANCE):
            planned, finer = finer, planned
        else:
            searching = False
        rivals.append(finer)
    return planned


def _stream_blocks(parts: Partitions, planned: "rooms.Planned", rungs: list[Rung],
                   rivals: list["rooms.Planned"]) -> "rooms.Planned":
    """Where the link binds the best plan, the same partition with its reused weights (a
    prefill's projections) cut into blocks of at most 1/8 and 1/16 of its working sets
    (`WEIGHT_BLOCK_SHARES`, `cuts.cap_streamed_weights`), each tried with what won (`coarser`,
    `alone`: the winner's room, one lowering; the full search finds a little more at several
    times the compile time); the fastest plan kept, the others as `rivals`. Each streamed
    block holds room while it is copied and read, beside the resident weights and the
    activations: the smaller the blocks, the more weights stay resident and the fewer bytes
    stream, but each copy pays the link's latency. llama3.1-8b prefill at 8 GB reads its 117
    MB feed-forward matrices whole at 500 MB working sets and streams 9.33 GB (0.193 s); cut to
    31 MB blocks it streams 9.28 GB (0.189 s; 0.185 s with the full search). qwen2.5-7b at 3.8
    GB: 244.4 ms at 1/8 (57 MB blocks), 247.2 ms at 1/16 with 837 copies; a pass whose disk
    binds wants the small blocks (its staging buffers hold two of the largest: llama-7b at 4
    GB with an 8 GB host, 998 ms at 1/16, 1008 ms at 1/8). Where compute binds, smaller tasks
    only cost more (llama3.2-1b prefill at 310 MB with every partition capped: 0.098 -> 0.145
    s), unless the compute waits on the link (STALL_GATE): then the cap is
    1/STALLED_BLOCK_SHARE. Each capped partition is a rung of the problem's bound beside the
    uncapped one, so the bound never rises by it."""
    sim = planned.trials.best().simulation
    block, won, tried = planned.rung.block, planned.won, [planned.tg]
    shares = (WEIGHT_BLOCK_SHARES if sim.h2d_s > sim.compute_s else
              (STALLED_BLOCK_SHARE,) if sim.stall_h2d_s > STALL_GATE * sim.makespan_s else ())
    for share in shares:
        if largest_reused_weight(parts.graph) <= block // share:
            continue  # (a decode step reuses no weight enough: no partition to build)
        capped = _plan(parts, block, won, weight_block=block // share, unless_like=tried[-1],
                       alone=True)
        if capped is None:  # its weights were cut below the cap already: the same partition
            continue
        tried.append(capped.tg)
        rungs.extend(capped.tried)
        best = planned.trials.best().simulation.makespan_s
        if capped.trials.best().simulation.makespan_s < best * (1 - search.AUTO_TOLERANCE):
            planned, capped = capped, planned
        rivals.append(capped)
    return planned


#: A decode step streaming SPLIT_GATE more than its partition's least bytes (the room its
#: blocks in flight hold) also tries the weights its best plan streams cut to blocks of at
#: most SPLIT_SHARES times the size where room and copies cost the same (`_split_streamed`)
SPLIT_GATE = 0.02
SPLIT_SHARES = (2, 1)


def _split_streamed(parts: Partitions,
                    chosen: tuple[rooms.Planned, search.Trial, rooms.Won], rungs: list[Rung],
                    rivals: list[rooms.Planned]) -> tuple[rooms.Planned, search.Trial, rooms.Won]:
    """Where a decode step's best plan (`chosen`: the partition, as `rooms.refine_rooms` gives
    it) misses REFINE_BELOW of the problem's bound and streams more than SPLIT_GATE over its
    partition's least bytes: the weights that plan streams cut finer than the rest
    (`PartitionOptions.split_weights`, along the axes they contract), on the coarse partition
    and on the winner's, each tried with what won (`alone`) and its room refined
    (`rooms.refine_room`); the fastest kept (with its best trial before refining and what won
    its coarse search), the others as `rivals`. Each streamed block holds room in flight
    beside the resident set, and every byte of that room streams: the ladder's finer rungs
    shrink it, but cut every task (the attention over the KV store too), and each launch
    costs. With blocks of s bytes, two in flight, S bytes to stream at
    bandwidth B and a latency L per copy, the room costs 2s/B and the copies S L / s: both the
    same at s = sqrt(S L B / 2), 13 MB for 0.7 GB on h100-pcie; the cuts halve, so the caps
    are SPLIT_SHARES times that. llama-7b decode B=8 over 768 rows at 16 GB: its 66 MB rung
    streams 24 whole 33.5 MB projections, 0.805 GB against 0.699 no plan can avoid, 16.31 ms;
    the coarse partition with those halved 0.754 GB, 15.44 ms; B=1 over 2304 at 14 GB: its
    33 MB rung 15.41 ms (15.07 ms of compute), the coarse partition with its streamed weights
    halved 14.87 ms (12.39). Each split partition is a rung of the problem's bound."""
    planned = chosen[0]
    best = planned.trials.best()
    sim, tg = best.simulation, planned.tg
    profile, options = parts.profile, parts.options
    if (sim.h2d_bytes <= planned.rung.min_stream_bytes * (1 + SPLIT_GATE)
            or sim.makespan_s * rooms.REFINE_BELOW <= known_bound(rungs, profile)):
        return chosen
    streamed = [b for b in tg.input_blocks if b.role == "weight" and b.id not in best.resident
                and b.id in tg.device_read]
    if not streamed:
        return chosen
    nodes = frozenset(b.node for b in streamed)
    even = math.sqrt(planned.rung.min_stream_bytes * profile.copy_latency
                     * profile.h2d_bandwidth / 2)
    for block in dict.fromkeys((rungs[0].block, planned.rung.block)):
        for share in SPLIT_SHARES:
            try:
                split = _plan(parts, block, planned.won, alone=True,
                              unless_like=planned.tg if block == planned.rung.block else None,
                              split=(nodes, max(MIN_BLOCK, int(even * share))))
            except BudgetError:  # no set fits beside its pass
                continue
            if split is None:  # its streamed weights were cut that fine already
                continue
            rungs.extend(split.tried)
            ahead = chosen[0].trials.best().simulation.makespan_s
            before, won = search.without_plan(split.trials.best()), split.won
            split = rooms.refine_room(split, options, known_bound(rungs, profile), ahead)
            if split.trials.best().simulation.makespan_s < ahead * (1 - search.AUTO_TOLERANCE):
                rivals.append(chosen[0])
                chosen = (split, before, won)
            else:
                rivals.append(split)
    return chosen


def _read_apart(tg: TaskGraph, order: list[int]) -> bool:
    """Whether the readers of some weight block within one stage are not one run of `order`
    (a tied table read by the first stage and the last is not: the order by weight block
    regroups readers within a stage only)."""
    first: dict[tuple[int, int], int] = {}
    count: dict[tuple[int, int], int] = {}
    blocks, tasks = tg.blocks, tg.tasks
    for k, t in enumerate(order):
        stage = tasks[t].stage
        for b in dict.fromkeys(tasks[t].reads):
            if blocks[b].role == "weight":
                key = (b, stage)
                first.setdefault(key, k)
                count[key] = count.get(key, 0) + 1
                if k - first[key] >= count[key]:
                    return True
    return False


def _plan(parts: Partitions, block: int, coarser: rooms.Won | None = None,
          weight_block: int | None = None, unless_like: TaskGraph | None = None,
          alone: bool = False, by_weight: bool = False, drained: bool = False,
          split: tuple[frozenset[int], int] | None = None) -> rooms.Planned | None:
    """The partition for `block`-byte working sets (weights in blocks of at most `weight_block`
    bytes, and the weights of `split` in blocks of at most its bytes; ordered by weight block
    where `by_weight`, its rows drained behind compute where `drained`) with its resident set
    searched (or, given what won on a `coarser` partition of the same pass, that and the
    policy's set tried, or that `alone`). None where the partition is `unless_like` (the same
    cuts: nothing to search again) or its rows cannot be drained.

    Where a weight block's readers run apart in its order (a prefill whose sequence is cut:
    each row block goes through a layer before the next, so each projection block is held, or
    streamed again, from the first row block's read to the last), the same partition ordered by
    weight block (`memory_aware_order(by_weight=True)`: each block's readers together) is tried
    with what won (`alone`), and the faster plan kept; not lowered where that order's rung (its
    compute, front and stream terms) cannot beat the plan by AUTO_TOLERANCE. Both orders are
    rungs of the problem's bound (`tried`), lowered or not, wherever the partition is planned
    (a partition that is a rung only, not searched, has no plan in either order). llama-7b
    prefill at 1.7 GB: its halved partition runs 400 ms in row order (18.2 GB streamed), 249 ms
    by weight block, against 257 ms before."""
    options, profile = parts.options, parts.profile
    policy = get_policy(options.policy)
    cut = parts.cut(block, weight_block, by_weight, drained, split)
    if cut is None:  # no drained order
        return None
    tg, order, needs, seconds, rung = cut
    if unless_like is not None and _same_partition(tg, unless_like):
        return None
    _check_largest_task(needs, options.device_bytes, block)
    fits = everything_fits(needs, options.device_bytes)
    residency = policy.resident(tg, order, options.device_bytes, fits)
    trials = search.Trials(tg, order, _lower_options(options, profile, policy, fits, seconds),
                           profile, options.progress)
    won = rooms.search_resident(trials, options, needs, residency, seconds,
                                max(rung.compute_s, rung.min_stream_bytes / profile.h2d_bandwidth),
                                coarser, alone)
    planned = rooms.Planned(tg, needs, fits, trials, rung, won, (rung,), residency.room > 0)
    if by_weight or drained or fits or not _read_apart(tg, order):
        return planned
    cut = parts.cut(block, weight_block, by_weight=True, split=split)
    if cut.order == order:
        return planned
    grouped = cut.rung
    planned = planned._replace(tried=(rung, grouped))
    best = trials.best().simulation.makespan_s
    if max(grouped.compute_s, grouped.front_s, grouped.tail_s,
           grouped.min_stream_bytes / profile.h2d_bandwidth) >= best * (1 - search.AUTO_TOLERANCE):
        return planned  # no plan in that order could win
    try:
        other = _plan(parts, block, won, weight_block, alone=True, by_weight=True, split=split)
    except BudgetError:  # no set fits beside that order's pass: the row order's plan stands
        return planned
    if other.trials.best().simulation.makespan_s < best * (1 - search.AUTO_TOLERANCE):
        return other._replace(tried=planned.tried)
    return planned


def _drain_behind(parts: Partitions, planned: rooms.Planned, rungs: list[Rung],
                  rivals: list[rooms.Planned]) -> rooms.Planned:
    """Where the plan's order ends in a write-back that bounds its pass (`drain.tail_seconds`
    of it above its rung's other terms by AUTO_TOLERANCE), the same partition with its rows
    drained behind compute (`drain.drained_order`) searched, and the faster plan kept.
    llama3.2-1b prefill at B=16 and 2.6 GB: 703 ms in the stage order, 7.5 GB of logits
    drained at its end; 614 ms drained."""
    rung, trials, profile = planned.rung, planned.trials, parts.profile
    steady = max(rung.compute_s, rung.front_s, rung.min_stream_bytes / profile.h2d_bandwidth)
    tail = tail_seconds(planned.tg, trials.order, trials.base.task_seconds,
                        parts.options.device_bytes, profile.d2h_bandwidth)
    if rung.drained or tail <= steady * (1 + search.AUTO_TOLERANCE):
        return planned
    parts.hold(rung, planned.tg, trials.order, planned.needs, trials.base.task_seconds)
    try:
        other = _plan(parts, rung.block, None, rung.weight_block, by_weight=rung.by_weight,
                      drained=True, split=rung.split)
    except BudgetError:  # no set fits beside that order's pass
        return planned
    if other is None:  # the rows meet, or nothing drains
        return planned
    rungs.extend(other.tried)
    best = trials.best().simulation.makespan_s
    if known_bound([other.rung], profile) < best * (1 - search.AUTO_TOLERANCE):
        # its prefetch given room as the stage order's was (`rooms.prefetch_trials`), where it
        # could still win: both groups read every weight, and the first group's early layers
        # are held for the second
        rooms.prefetch_trials(other, known_bound(rungs, profile), other.trials.best())
    if other.trials.best().simulation.makespan_s < best * (1 - search.AUTO_TOLERANCE):
        planned, other = other, planned
    if parts.options.host_bytes is not None:  # (what `rooms.climb_tiers` may weigh)
        rivals.append(other)
    return planned


def _same_partition(a: TaskGraph, b: TaskGraph) -> bool:
    """Whether two partitions of one pass are the same: a smaller block or weight cap that
    needed no further cut."""
    return (len(a.tasks), len(a.blocks)) == (len(b.tasks), len(b.blocks)) and (
        a.tasks == b.tasks and a.blocks == b.blocks)


def _check_largest_task(needs: PassNeeds, device_bytes: int, block: int) -> None:
    if needs.max_working_set > device_bytes:
        raise BudgetError(f"budget {format_size(device_bytes)} is too small: one task "
                          f"needs {format_size(needs.max_working_set)} at once with blocks cut for "
                          f"{format_size(block)} working sets: at least "
                          f"{format_size(needs.max_working_set)} at this block size",
                          needs.max_working_set, device_bytes)


def _lower_options(options: CompileOptions, profile: DeviceProfile, policy: Policy,
                   fits: bool, seconds: tuple[float, ...]) -> LowerOptions:
    """What every trial's lowering shares. A pass that streams weights writes its outputs (logits,
    the KV cache) back to the host as soon as each block is final, so the device keeps that
    memory for resident weights."""
    return LowerOptions(options.device_bytes, policy, inputs_at_device=fits and policy.evicts,
                        outputs_to_host=not fits and policy.evicts,
                        lookahead_bytes=options.lookahead_bytes, task_seconds=seconds,
                        guarded_reload_share=options.guarded_reload_share,
                        pack_low=options.pack_low)


def _default_lookahead(trials: search.Trials, best: search.Trial,
                       options: CompileOptions) -> float | None:
    """The makespan of the same resident set with the default look-ahead (as far as memory
    allows), for the report to weigh `--lookahead` against: from the trials of `auto`, or one more
    lowering for a window the user set; None without `--lookahead`."""
    if options.auto_lookahead:
        same = [t.simulation.makespan_s for t in trials.items
                if t.window is None and t.resident == best.resident
                and t.knobs == best.knobs]
        return min(same, default=None)
    if options.lookahead_bytes is None and options.lookahead_seconds is None:
        return None
    reference = trials.reference(best.resident, best.knobs)
    return reference.makespan_s if reference is not None else None


def _figures(planned: rooms.Planned, best: search.Trial, rungs: list[Rung],
             default_makespan: float | None, options: CompileOptions,
             elapsed: float) -> CompileFigures:
    tg, needs, trials = planned.tg, planned.needs, planned.trials
    disk = problem_bound(rungs, trials.profile, options.host_bytes)

    def resident_bytes(blocks, role: str | None = None) -> int:
        return sum(aligned(tg.blocks[b].bytes) for b in blocks
                   if role is None or tg.blocks[b].role == role)

    def lookahead(window) -> str:
        return search.describe(options.lookahead_bytes, window, options.auto_lookahead)

    kept, kept_kv = resident_bytes(best.resident, "weight"), resident_bytes(best.resident, "cache")
    host_read = sum(aligned(b.bytes) for b in tg.input_blocks  # (as `PassNeeds` counts them)
                    if b.role == "weight" and b.id not in tg.device_read)
    summaries = tuple(TrialSummary(lookahead(t.window), t.simulation.makespan_s,
                                   resident_bytes(t.resident), t.live_peak)
                      for t in trials.items) if len(trials.items) > 1 else ()
    return CompileFigures(
        tasks=len(tg.tasks), blocks=len(tg.blocks), block_bytes=planned.rung.block,
        lower_bound_bytes=memory_lower_bound(tg, best.resident),
        largest_task_bytes=needs.max_working_set,
        weight_bytes=needs.weight_bytes + host_read, resident_bytes=kept,
        streamed_weight_bytes=needs.weight_bytes - kept, host_read_bytes=host_read,
        kv_bytes=needs.kv_bytes, kv_resident_bytes=kept_kv,
        kv_streamed_bytes=needs.kv_bytes - kept_kv,
        min_stream_bytes=min(r.min_stream_bytes for r in rungs),
        min_compute_s=min(r.compute_s for r in rungs),
        min_front_s=min(r.front_s for r in rungs), min_tail_s=min(r.tail_s for r in rungs),
        activation_peak_bytes=needs.activation_peak, compile_seconds=round(elapsed, 3),
        tasks_per_second=round(len(tg.tasks) / elapsed, 1) if elapsed > 0 else None,
        lookahead=lookahead(best.window), lookahead_makespan_s=best.simulation.makespan_s,
        default_lookahead_makespan_s=default_makespan,
        trials=summaries, weight_formats=_weight_formats(tg),
        min_disk_bytes=min(r.min_disk_bytes for r in rungs),
        min_stream_copies=min(r.min_stream_copies for r in rungs),
        min_disk_reads=disk.disk_reads, min_disk_staging=disk.disk_staging)


def _weight_formats(tg: TaskGraph) -> tuple[tuple[str, int], ...]:
    """Bytes of the weight blocks per storage format (unpacked ones under their dtype), largest
    first; () where no weight is packed."""
    weights = [b for b in tg.blocks if b.role == "weight"]
    if not any(b.storage is not None for b in weights):
        return ()
    per: dict[str, int] = {}
    for b in weights:  # aligned, as `weight_bytes` counts them
        key = b.storage.format if b.storage is not None else b.dtype.value
        per[key] = per.get(key, 0) + aligned(b.bytes)
    return tuple(sorted(per.items(), key=lambda kv: (-kv[1], kv[0])))
