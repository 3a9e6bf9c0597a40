"""The room search on one partition: which resident set leaves the pass the room it needs.

A paced resident set (`resident.paced_at`) keeps the first layers and the large blocks resident
and spreads the streamed ones over the pass by predicted compute time, leaving the pass a share
of the budget as room beside its activation peak. The search lowers such sets on a coarse grid
of shares and climbs (`search.search_room`), weighing each by simulated makespan
(`search_resident`); where the plan still misses the planner's target, the winner's room (and
the rooms of the partitions nearest it) are climbed again on a finer grid (`refine_rooms`), the
prefetch is given more room (`prefetch_trials`), and where the host budget sends weights to
disk, the room is climbed by the tiered pass (`climb_tiers`). The driver
(`einpage.compiler.driver`) builds the partitions and calls these; `Planned` is its record of
one partition's search."""
from __future__ import annotations

import functools
import math
from dataclasses import replace
from typing import TYPE_CHECKING, NamedTuple

from einpage.compiler import search
from einpage.compiler.lowering import FAR_SHARE
from einpage.compiler.policies import Residency
from einpage.compiler.resident import (PassNeeds, guarded_shares, kept_bytes, paced_at,
                                       persistent_blocks, streamed_bytes, weights_first_at)
from einpage.compiler.rungs import Rung
from einpage.compiler.tier_room import climb_tiered
from einpage.compiler.tiers import Tiered, place_tiers
from einpage.errors import BudgetError
from einpage.ir.taskgraph import TaskGraph
from einpage.ir.tensors import PERSISTENT_ROLES

if TYPE_CHECKING:
    from einpage.compiler.driver import CompileOptions


#: The room of a plan below this share of the problem's bound is refined (`refine_room`): the
#: planner's target efficiency; above it a finer room gains a percent or two at several
#: lowerings
REFINE_BELOW = 0.95
#: The room deferred writes claim in `prefetch_trials` (`lowering.CLAIM_SHARE` elsewhere)
PREFETCH_CLAIM = 1.0


class Won(NamedTuple):
    """What won a partition's search: a paced resident set leaving the pass `share` of the
    budget as room beside its activation peak (the coarse grid's measure; a share the fine
    grid won at is kept in it, as 0 where that room is less than the outputs take), or
    (None) the policy's own set or every weight."""
    share: float | None


class Planned(NamedTuple):
    """One partition of the pass (the driver's record of it), its trials and what won them."""
    tg: TaskGraph
    needs: PassNeeds
    fits: bool            # everything stays on the device: nothing streams
    trials: search.Trials
    rung: Rung
    won: Won             # which resident set won its search
    tried: tuple[Rung, ...] = ()  # its rung, and its other order's where that was tried
    paced: bool = True    # the policy's residency leaves room: paced sets are candidates


def search_resident(trials: search.Trials, options: CompileOptions, needs: PassNeeds,
                    residency: Residency, seconds: tuple[float, ...], bound_s: float,
                    coarser: Won | None = None, alone: bool = False) -> Won:
    """The first plan with the policy's resident weights; if it spills activations or runs
    below RESIDENT_SEARCH_BELOW of the partition's bound (`bound_s`), every weight (where they
    fit) and paced resident sets leaving the pass more or less room beside its activation peak
    (`search.search_room`), weighed by makespan; then the other look-ahead windows with the best
    resident set. Given what won on a `coarser` partition of the same pass, only the policy's set
    and that winner are tried instead of the search (a finer partition moves the optimum little,
    and each probe is a lowering); `alone`: only that winner (a prefill's halved or weight-cut
    partition, where the policy's set never won on the grid; on a decode step's finer rungs it
    does), or the policy's set where that winner's set does not fit. A probe whose set leaves
    the pass too little room is no candidate. Returns what won."""
    tg = trials.tg
    windows = search.windows(options.auto_lookahead, options.lookahead_seconds, sum(seconds),
                             len(tg.tasks))
    probes = _Probes(trials, needs, options, windows[0])
    paced, shares = probes.run, probes.shares

    if (coarser is not None and alone and coarser.share is not None and residency.room > 0
            and paced(coarser.share) is not None):  # what won on the coarser partition, alone
        return _finish(trials, windows, shares)
    first = trials.run(residency.blocks, windows[0])
    if coarser is not None:
        if residency.room > 0 and coarser.share is not None:
            paced(coarser.share)
    elif residency.room > 0 and (
            first.spill_bytes > 0
            or bound_s < search.RESIDENT_SEARCH_BELOW * first.simulation.makespan_s):
        # The resident weights crowd the activations (they spill) or the prefetch (compute
        # waits), or the streaming starts late (no layer is resident before the first streamed
        # one) or bunches up: weigh other resident sets against the streaming, by makespan.
        everything = persistent_blocks(tg)
        if needs.persistent_bytes + needs.max_working_set <= options.device_bytes:
            trials.try_run(everything, windows[0])
        # Paced resident sets (the streaming spread over the compute, the first blocks and
        # the large ones resident) leaving the pass a share of the budget beside its peak.
        search.search_room(paced, probes.bound)
    return _finish(trials, windows, shares)


class _Probes:
    """The room search's points on one partition's trials: the paced resident set of each room
    share (`resident.paced_at`, beside the activation peak, or with `written_back` beside the
    peak of a pass that writes its outputs back), its trial with `window`, the share each tried
    set came from, and a bound on each share's pass."""

    def __init__(self, trials: search.Trials, needs: PassNeeds, options: CompileOptions,
                 window: float | None, written_back: bool = False,
                 knobs: search.Knobs = search.DEFAULT_KNOBS,
                 sets: dict[float, frozenset] | None = None, weights_first: bool = False,
                 by_size: bool = False):
        self.trials, self.needs, self.window, self.knobs = trials, needs, window, knobs
        self.pace = (weights_first_at if weights_first
                     else functools.partial(paced_at, by_size=by_size))
        self.peak = needs.written_back_peak if written_back else needs.activation_peak
        self.budget = options.device_bytes
        self.compute = sum(trials.base.task_seconds)
        self.guarded = guarded_shares(trials.tg, options.guarded_reload_share)
        self.sets = {} if sets is None else sets    # room share -> its paced resident set
        self.shares: dict[frozenset, float] = {}    # a tried set -> the room share it came from

    def set(self, at: float) -> frozenset:
        if at not in self.sets:
            trials = self.trials
            self.sets[at] = self.pace(trials.tg, trials.order, self.peak, self.budget, at,
                                      trials.base.task_seconds)
        return self.sets[at]

    def run(self, at: float) -> search.Trial | None:
        """The trial of `at`'s paced set; None where that set leaves the pass too little room
        (a set with fewer blocks is another share's)."""
        try:
            trial = self.trials.run(self.set(at), self.window, exact=True, knobs=self.knobs)
        except BudgetError:
            return None
        self.shares.setdefault(trial.resident, at)
        return trial

    def bound(self, at: float) -> float:
        """No plan of `at`'s set beats its compute or the link time of the persistent bytes
        it leaves off the device (an expert copied only when chosen at its expected share)."""
        return max(self.compute, streamed_bytes(self.trials.tg, self.set(at), self.guarded)
                   / self.trials.profile.h2d_bandwidth)


def refine_room(planned: Planned, options: CompileOptions, bound_s: float,
                 best_s: float = math.inf) -> Planned:
    """The winning partition's room (and each decode ladder rung's, before the ladder weighs
    it: llama-7b decode B=8 at 16 GB wins on its 65.7 MB rung at 0.005 of the budget, 16.82 ms,
    where the 32.8 MB rung ran 17.40) refined on the finer grid (`search.FINE_ROOM_SHARES`),
    its rooms beside the peak of a pass that writes its outputs back (`_Probes`'s
    `written_back`: the coarse grid counts them to the pass's end, so a room smaller than the
    KV rows a prefill writes was out of its reach: llama-13b at 12 GB 316.7 -> 309.1 ms,
    llama3.2-3b B=4 at 3.3 GB 277.8 -> 266.5 ms), climbing from what won (from the room the
    policy's set leaves, where that won), with the winner's look-ahead window: the coarse
    grid's points are 2-5% of the budget apart, and where the pass turns on a few streamed
    blocks in flight the best room lies between them
    (llama3.1-8b prefill at 8 GB: 188.97 -> 185.87 ms; llama-7b decode B=1 at 14 GB: 0.0025,
    16.12 -> 15.67 ms); climbed twice, with the blocks that stay packed from below and with
    every block placed by stamp (`search.STAMPED`: that decode step 15.63 -> 15.41 ms). Only
    where the plan runs below REFINE_BELOW of the problem's bound known so far (`bound_s`;
    `best_s`: the best pass of another partition so far, on the ladder or among the rivals of
    `refine_rooms`), where its partition's own bound could beat `best_s` by AUTO_TOLERANCE, and
    below RESIDENT_SEARCH_BELOW of its partition's bound (each probe is a lowering; refined
    everywhere, rows above the target gained up to 2% at up to 2.8x the compile time:
    mixtral-8x7b prefill at 47 GB 0.952 -> 0.967, 2.95 -> 8.39 s). A probe whose set leaves
    the pass too little room is no candidate; one whose bound cannot improve the climb is not
    lowered."""
    trials, needs, rung = planned.trials, planned.needs, planned.rung
    best = trials.best()
    if not planned.paced:  # a policy that keeps nothing resident (lru) is compared as it is
        return planned
    own = max(rung.compute_s, rung.front_s, rung.tail_s,
              rung.min_stream_bytes / trials.profile.h2d_bandwidth)
    makespan = best.simulation.makespan_s
    if (min(best_s, makespan) * REFINE_BELOW <= bound_s
            or makespan * search.RESIDENT_SEARCH_BELOW <= own
            or own >= best_s * (1 - search.AUTO_TOLERANCE)):
        return planned  # within the target of the problem's bound, or near its partition's,
        # or no plan of it can beat another partition's best
    start = _won_share(planned, best, options.device_bytes)
    shares: dict[frozenset, float] = {}
    sets: dict[float, frozenset] = {}  # (both climbs pace the same sets)
    for knobs in (search.DEFAULT_KNOBS, search.STAMPED) if trials.base.pack_low else (
            search.STAMPED,):
        probes = _Probes(trials, needs, options, best.window, True, knobs, sets)
        search.search_room(probes.run, probes.bound, shares=search.FINE_ROOM_SHARES,
                           start=start)
        shares = {**probes.shares, **shares}
    return _fine_winner(planned, best, shares, options.device_bytes)


def _fine_winner(planned: Planned, best: search.Trial, shares: dict[frozenset, float],
                 budget: int) -> Planned:
    """`planned`, with the share of the fine grid (beside the written-back peak: `shares`, by
    resident set) that a set won at, where one beat `best`: as the coarse grid measures it
    (`Won`)."""
    winner = planned.trials.best()
    if winner is best or winner.resident not in shares:
        return planned
    return planned._replace(won=Won(max(0.0, shares[winner.resident]
                                         - planned.needs.outputs_held / budget)))


#: Partitions that lost the coarse comparison by at most RIVAL_NEAR (at most RIVALS of them,
#: the nearest first) have their rooms refined too, each from its own winner. (On the grid the
#: rivals that won after refining had lost by at most 0.5%; none between 1% and 3% did, and
#: qwen2.5-7b B=16's halved partition, 2.8% behind with 2.4x the tasks, cost 18 s for nothing)
RIVAL_NEAR = 0.02
RIVALS = 2


def refine_rooms(planned: Planned, rivals: list[Planned], options: CompileOptions,
                 bound_s: float) -> tuple[Planned, search.Trial, Won]:
    """The winning partition's room refined (`refine_room`), and then, while the plan misses
    REFINE_BELOW of the problem's bound (`bound_s`), the rooms of the partitions that lost to it
    by at most RIVAL_NEAR before any room was refined (the nearest RIVALS first), each from its
    own winner; the fastest kept (`rivals` left holding the others). Returns it, its best trial
    before the refining (without its plan: `refine_room` adds its trials to the partition's own)
    and what won its coarse search. The partitions are compared on their coarse grids, and the
    finer room moves them apart: llama3-8b prefill at 4 GB, its three partitions within 0.4%
    coarse (whole 266.0 ms, halved 265.5, capped 265.0), refined 264.5, 256.1 and 258.0."""
    def best_s(p: Planned) -> float:
        return p.trials.best().simulation.makespan_s

    lead = best_s(planned)
    near = sorted((k for k, p in enumerate(rivals) if best_s(p) <= lead * (1 + RIVAL_NEAR)),
                  key=lambda k: best_s(rivals[k]))
    coarse, won = search.without_plan(planned.trials.best()), planned.won
    planned = refine_room(planned, options, bound_s)
    for k in near[:RIVALS]:
        rival = rivals[k]
        before = search.without_plan(rival.trials.best())
        refined = refine_room(rival, options, bound_s, best_s(planned))
        if best_s(refined) < best_s(planned) * (1 - search.AUTO_TOLERANCE):
            rivals[k] = planned
            planned, coarse, won = refined, before, rival.won
        else:
            rivals[k] = refined
    return planned, coarse, won


#: Where the disk binds, the room is climbed by the tiered pass on the winning partition and on
#: the TIER_RIVALS other partitions whose best plans, tiered as they are, run fastest
#: (`climb_tiers`)
TIER_RIVALS = 2


def climb_tiers(planned: Planned, best: search.Trial, tiered: Tiered,
                rivals: list[Planned], options: CompileOptions
                ) -> tuple[Planned, search.Trial, Tiered]:
    """Where the host budget sends weights to disk and the disk binds the pass: every partition
    planned (the winner, `best` tiered as `tiered`, and its `rivals`: the other partitions and
    the decode ladder's other rungs) tiered with its best plan, the room climbed by the tiered
    pass (`climb_tier`) on the winner and the TIER_RIVALS fastest others, and the fastest
    tiered plan kept with its partition. The disk weighs partitions apart from the device: a
    disk read needs a staging buffer, two of the largest block at least, and every staging
    byte is a weight byte read from disk, while the device pass hides behind the disk whatever
    it costs. llama-7b prefill at 4 GB with an 8 GB host:
    its halved partition wins on the device (204 ms), reads 3.21 GB from disk beside 172 MB of
    staging and runs 1083 ms; the same partition with its weights capped at 14 MB blocks reads
    2.89 GB beside 21 MB and runs 998 ms. A decode step's 66 MB rung, llama-7b B=8 at 8 GB with
    a 14 GB host: 462 ms against 752 on the 1 GB rung the device chose. Climbed, a partition
    gains 1-24% on the grid's disk rows, and the order unclimbed says little (llama-7b at 4 GB /
    8 GB: capped at 1/8 1216 ms, at 1/16 1226; climbed 1008 and 998); the coarse partition, the
    slowest unclimbed in every disk row, never won."""
    tiers = []
    for rival in rivals:
        plan = rival.trials.best()
        if rival.paced and not plan.on_host and plan.memgraph is not None:
            try:
                tiers.append((place_tiers(plan.memgraph, plan.simulation, options.host_bytes,
                                          rival.trials.profile), rival, plan))
            except BudgetError:  # its host needs do not fit
                pass
    tiers.sort(key=lambda t: t[0].simulation.makespan_s)
    chosen = (planned, best, tiered)
    for tiered, rival, plan in [(tiered, planned, best), *tiers[:TIER_RIVALS]]:
        tiered, plan = climb_tier(rival, plan, tiered, options)
        if tiered.simulation.makespan_s < chosen[2].simulation.makespan_s * (
                1 - search.AUTO_TOLERANCE):
            chosen = (rival, plan, tiered)
    return chosen


def climb_tier(planned: Planned, plan: search.Trial, tiered: Tiered, options: CompileOptions,
               kept: int | None = None) -> tuple[Tiered, search.Trial]:
    """One partition's room climbed by the tiered pass (`tier_room.climb_tiered`) from `plan`,
    tiered as `tiered`: where the pass reads a KV store and the host budget sends weights to
    disk, over resident sets that keep weights before KV blocks (`resident.weights_first_at`).
    The runtime keeps the whole KV store in host memory, so a resident KV block saves link
    bytes only, while a resident weight saves the same link bytes and a disk read: llama-7b
    decode B=8 at 8 GB with a 14 GB host, its 66 MB rung, 562 ms climbing paced sets and then
    keeping weights first, 462 ms climbing weights-first sets (each a room share: the best room
    for weights-first sets is not the paced sets' best). The climb starts from the share `plan`
    won at, or from the room that `kept` resident bytes leave (what won on a coarser partition
    of the same pass). Returns the fastest (tiering, trial) pair."""
    kv_first = bool(tiered.choice.disk_bytes and planned.needs.kv_bytes)
    probes = _Probes(planned.trials, planned.needs, options, plan.window, written_back=True,
                     weights_first=kv_first)
    start = (_won_share(planned, plan, options.device_bytes) if kept is None
             else _room_share(planned.needs, kept, options.device_bytes))
    return climb_tiered(
        planned.trials, plan, tiered, start,
        probes.set, lambda at: streamed_bytes(planned.tg, probes.set(at), probes.guarded),
        options.host_bytes)


def _won_share(planned: Planned, best: search.Trial, budget: int) -> float:
    """The point of the fine room grid (`search.FINE_ROOM_SHARES`, beside the written-back
    peak) nearest the room `best`'s resident set leaves: the share it won at, or (the policy's
    own set, or every weight) the budget its set and that peak leave."""
    share = planned.won.share
    if share is None:
        return _room_share(planned.needs, kept_bytes(planned.tg, best.resident), budget)
    share += planned.needs.outputs_held / budget
    return min(search.FINE_ROOM_SHARES, key=lambda at: (abs(at - share), at))


def _room_share(needs: PassNeeds, kept: int, budget: int) -> float:
    """The point of the fine room grid nearest the room `kept` resident bytes leave beside the
    written-back peak of `needs`' pass."""
    share = max(0.0, (budget - needs.written_back_peak - kept) / budget)
    return min(search.FINE_ROOM_SHARES, key=lambda at: (abs(at - share), at))


def prefetch_trials(planned: Planned, bound_s: float, coarse: search.Trial) -> None:
    """Where the best plan misses REFINE_BELOW of the problem's bound (`bound_s`) and its
    compute waits on reloads while the link has time to spare, its prefetch lacks room: its
    resident set and window are lowered again with room made for it, as more trials. The
    writes deferred claim PREFETCH_CLAIM of their bytes instead of `lowering.CLAIM_SHARE`
    (llama-7b prefill at 1.7 GB: 249.3 -> 247.7 ms; where the link binds
    the prefetch takes room those writes then need: llama3.1-8b at 8 GB 185.9 -> 192.0 ms with
    every plan at 1.0); and where some persistent block is read again far later in the order
    (`lowering.FAR_SHARE`: a tied table, gathered first and read again by the logits; a weight
    both groups of a drained order read), the allocation horizon may let such blocks go for its
    prefetch (`LowerOptions.evict_ahead`; they stream again later), with either claim.
    llama3.2-1b prefill at 310 MB held 180 MB of its table through the pass: 93.2 -> 76.5 ms
    evicting ahead, 70.8 ms with the smaller claim too; where the link binds, the bytes streamed
    again cost more than the room saves (llama3.2-3b B=4 at 3.3 GB: 0.5% slower). The coarse
    search's winner (`coarse`) is tried so too where the fine room refined another set: the
    refined one may gain less from it (llama3.2-1b at 310 MB: 78.5 ms against 70.8)."""
    trials = planned.trials
    best = trials.best()
    if (best.knobs.evict_ahead or best.knobs.claim_share is not None
            or best.simulation.makespan_s * REFINE_BELOW <= bound_s):
        return
    variants = [(False, PREFETCH_CLAIM)]
    if _read_far_apart(planned.tg, trials.order):
        variants += [(True, None), (True, PREFETCH_CLAIM)]
    for plan in (best, coarse) if coarse.resident != best.resident else (best,):
        sim = plan.simulation
        if (sim.stall_h2d_s <= search.AUTO_TOLERANCE * sim.makespan_s
                or sim.h2d_s >= (1 - search.AUTO_TOLERANCE) * sim.makespan_s):
            continue
        for ahead, claim in variants:
            try:
                trials.run(plan.resident, plan.window, exact=True,
                           knobs=replace(plan.knobs, evict_ahead=ahead, claim_share=claim))
            except BudgetError:
                pass


def by_size_trials(planned: Planned, options: CompileOptions, bound_s: float) -> Planned:
    """Paced sets that stream the largest blocks their pace allows (`resident.paced_resident`'s
    `by_size`), climbed on the fine room grid from the best plan's room with its window and
    knobs, as more trials: the same bytes in fewer copies, each of which costs the link its
    latency, against more room in flight for the larger blocks (so their best room is another:
    llama-7b prefill at 4 GB, by size at the best plan's room 214.6 ms, climbed 197.2 ms
    against 199.6 ms streaming 726 blocks of 8-22 MB in order, 7.3 ms of copy latency). Climbed
    from the best plan only: as candidates of the search itself, sets by size won the coarse
    grid where the refined sets in order win in the end (qwen2.5-7b at 3.8 GB 222.9 -> 224.7
    ms, qwen3-32b at 33 GB 676.3 -> 681.6 ms). Not where the plan is within AUTO_TOLERANCE of
    the problem's bound (`bound_s`). (Where the copies' latency is below that share of the
    pass, larger blocks still pace the link better: llama2-70b at 35 GB 2123.4 -> 2103.3 ms.)
    Returns `planned`, with the share a set by size won at where one did (the tiered climb
    starts from it)."""
    trials, needs, budget = planned.trials, planned.needs, options.device_bytes
    best = trials.best()
    if (not planned.paced or best.on_host
            or best.simulation.makespan_s * (1 - search.AUTO_TOLERANCE) <= bound_s):
        return planned
    # from the room its set leaves (the share it won at says less where that room is below
    # what the outputs take: qwen2.5-7b at 3.8 GB won at 0.05, kept as 0, read back as 0.1)
    start = _room_share(needs, kept_bytes(planned.tg, best.resident), budget)
    probes = _Probes(trials, needs, options, best.window, True, best.knobs, by_size=True)
    search.search_room(probes.run, probes.bound, shares=search.FINE_ROOM_SHARES, start=start)
    return _fine_winner(planned, best, probes.shares, budget)


def _read_far_apart(tg: TaskGraph, order: list[int]) -> bool:
    """Whether some persistent block is read again further after a read than FAR_SHARE of the
    positions left after it (`lowering._Lowering._far`)."""
    n, last = len(order), {}
    blocks, tasks, host = tg.blocks, tg.tasks, tg.host_tasks
    for k, t in enumerate(order):
        if t in host:  # (it reads host memory)
            continue
        for b in tasks[t].reads:
            if blocks[b].role in PERSISTENT_ROLES:
                if b in last and k - last[b] > FAR_SHARE * (n - last[b]):
                    return True
                last[b] = k
    return False


def _finish(trials: search.Trials, windows: list[float | None],
            shares: dict[frozenset, float]) -> Won:
    """The other look-ahead windows with the best resident set; what won."""
    resident = trials.best().resident
    for window in windows[1:]:
        trials.run(resident, window)
    return Won(shares.get(trials.best().resident))


__all__ = ["Planned", "Won", "by_size_trials", "climb_tier", "climb_tiers", "prefetch_trials",
           "refine_room", "refine_rooms", "search_resident", "PREFETCH_CLAIM", "REFINE_BELOW",
           "RIVALS", "RIVAL_NEAR", "TIER_RIVALS"]
