"""The compiler's search: which look-ahead window and which resident weights make the fastest
plan. Each candidate is a `Trial`: one lowering, simulated on the device profile; `Trials`
keeps them and drops the plans that can no longer win. `search_room` probes how much of the
budget a paced resident set leaves to the pass (`climb`: a unimodal search on a grid); `best` picks the winner (least makespan, then least
traffic, then least memory)."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Callable

from einpage.compiler.lower_options import LowerOptions
from einpage.compiler.lowering import lower
from einpage.compiler.report import Traffic
from einpage.errors import BudgetError
from einpage.ir.memgraph import MemGraph
from einpage.ir.taskgraph import TaskGraph
from einpage.predict.devices import DeviceProfile
from einpage.predict.simulator import Simulation, node_seconds, simulate
from einpage.units import format_size

# The automatic look-ahead tries memory-bound prefetch and windows of these shares of the pass's
# predicted compute; above AUTO_MAX_TASKS it keeps memory-bound prefetch (each try is a lowering).
AUTO_SHARES = (1 / 512, 1 / 128, 1 / 32, 1 / 8)
AUTO_MAX_TASKS = 50_000
AUTO_TOLERANCE = 0.005  # makespans within 0.5% of the best count as equal; the least peak wins
# When the first plan spills activations or runs below RESIDENT_SEARCH_BELOW of the problem's
# bound at its partition (compute, or the bytes no plan can avoid streaming), paced
# resident sets (`resident.paced_resident`) leaving these shares of the budget to the pass beside
# its activation peak are searched as well, from ROOM_START (and every weight, where they fit).
# (At 0.96 a first plan a few percent off its bound was kept unsearched: llama3-8b B=16 at
# 17 GB 0.969 where the search finds 1.000, qwen3-32b B=4 at 8.2 GB 0.979 likewise; two rows
# searched now compile 2.1-2.2x longer: mixtral-8x7b at 47 GB, llama-30b B=4 at 16 GB.)
RESIDENT_SEARCH_BELOW = 1 - AUTO_TOLERANCE
ROOM_SHARES = (0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.45)
ROOM_START = 0.05
#: The most trials within AUTO_TOLERANCE of the best lowered again by stamp (`stamped_trials`)
STAMPED_TRIALS = 3
#: The finer grid the winning partition's room is refined on (`rooms.refine_room`): where a
#: few streamed blocks in flight decide the pass, the best room lies between the coarse points
#: (llama3.1-8b prefill at 8 GB: 0.01; llama-7b decode B=1 at 14 GB: 0.0025)
FINE_ROOM_SHARES = (0.0, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075,
                    0.1, 0.15, 0.2, 0.25, 0.3, 0.375, 0.45)


@dataclass(frozen=True)
class Knobs:
    """The lowering options a trial may vary beyond its resident set and window: the
    `LowerOptions` of the same names (the defaults: the base's)."""
    evict_ahead: bool = False          # reserving ahead may let far clean blocks go
    claim_share: float | None = None   # room kept for deferred writes (None: the base's)
    pack_low: bool = True              # blocks that stay packed from below

    def lower_options(self, base: LowerOptions) -> LowerOptions:
        return replace(base, evict_ahead=self.evict_ahead or base.evict_ahead,
                       claim_share=base.claim_share if self.claim_share is None
                       else self.claim_share, pack_low=self.pack_low and base.pack_low)


DEFAULT_KNOBS = Knobs()
STAMPED = Knobs(pack_low=False)  # every block where bytes were freed longest ago


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
    on_host: frozenset = frozenset()  # the tasks it runs on the host (`compiler.placement`)
    knobs: Knobs = DEFAULT_KNOBS      # lowered with these options


class Trials:
    """The lowerings tried for one taskgraph and order, each from `base` with its own resident
    set and look-ahead window. Only trials that may still win keep their plan."""

    def __init__(self, tg: TaskGraph, order: list[int], base: LowerOptions,
                 profile: DeviceProfile, progress: Callable[[str, int, int], None] | None = None):
        self.tg, self.order, self.base, self.profile = tg, order, base, profile
        self.progress = progress
        self.items: list[Trial] = []
        self._tried: dict[tuple, Trial | None] = {}

    def run(self, resident: frozenset, window: float | None, exact: bool = False,
            knobs: Knobs = DEFAULT_KNOBS) -> Trial:
        """Lower and simulate; returns the trial without its plan and per-node times (`items`
        alone holds those). `base.task_seconds` price the tasks where `base.on_host` runs them.
        Where `resident` leaves the pass too little room, fewer blocks are kept
        (`lower_shrinking`), or, `exact`, `BudgetError` is raised: a point of a search, whose
        set halved is no neighbour of it. A resident set and window tried before are not
        lowered again (paced sets of several room shares are often the same set: all empty
        where no weight fits beside the pass): that trial is returned, and `items` keeps it
        once. `knobs`: lowered with those `LowerOptions`."""
        knobs = Knobs(knobs.evict_ahead or self.base.evict_ahead,  # what it is lowered with
                      knobs.claim_share, knobs.pack_low and self.base.pack_low)
        key = (resident, window, exact, knobs)
        if key in self._tried:
            if self._tried[key] is None:
                raise BudgetError(f"{len(resident)} resident blocks leave the pass too little "
                                  "room (tried before)", 0, self.base.device_bytes)
            return self._tried[key]
        progress = None
        if self.progress is not None:
            progress = functools.partial(self.progress, f"lowering {len(self.items) + 1}")
        opts = knobs.lower_options(replace(self.base, resident=resident,
                                           lookahead_seconds=window, progress=progress))
        try:
            mg, kept = ((lower(self.tg, self.order, opts), resident) if exact
                        else lower_shrinking(self.tg, self.order, opts))
        except BudgetError:
            if exact:
                self._tried[key] = None
            raise
        sim = simulate(mg, self.profile,
                       node_seconds(mg, self.profile, self.base.task_seconds or None),
                       verify=False)
        self.items.append(Trial(window, kept, mg, sim, Traffic.of(mg).offload_bytes,
                                mg.live_peak(), self.base.on_host, knobs))
        self._drop_losers()
        trial = self.items[-1]  # kept without its plan and timelines (`items` keeps those)
        self._tried[key] = without_plan(trial)
        return self._tried[key]

    def reference(self, resident: frozenset,
                  knobs: Knobs = DEFAULT_KNOBS) -> Simulation | None:
        """The simulation of `resident` with the default look-ahead (bounded by memory only), to
        weigh a look-ahead the user set against (lowered with the trial's `knobs`); not a
        candidate (None if it does not fit)."""
        opts = knobs.lower_options(replace(self.base, resident=resident, lookahead_bytes=None,
                                           lookahead_seconds=None, progress=None))
        try:
            mg, _ = lower_shrinking(self.tg, self.order, opts)
        except BudgetError:
            return None
        return simulate(mg, self.profile, verify=False)

    def try_run(self, resident: frozenset, window: float | None) -> None:
        """A trial that may not fit at all (then it is not a candidate)."""
        try:
            self.run(resident, window)
        except BudgetError:
            pass

    def adopt(self, items: list[Trial]) -> None:
        """Take `items` (trials of the same taskgraph and order lowered from another base: a
        placement) as candidates of this search."""
        self.items.extend(items)
        self._drop_losers()

    def _drop_losers(self) -> None:
        fastest = min(t.simulation.makespan_s for t in self.items) * (1 + AUTO_TOLERANCE)
        self.items = [t if t.memgraph is None or t.simulation.makespan_s <= fastest
                      else without_plan(t) for t in self.items]

    def best(self) -> Trial:
        return best(self.items)


def stamped_trials(trials: Trials, bound_s: float) -> None:
    """The best plans (up to STAMPED_TRIALS within AUTO_TOLERANCE of the best) lowered again
    with every block placed where bytes were freed longest ago (`LowerOptions.pack_low` off),
    as more trials, where the best is not within AUTO_TOLERANCE of the problem's bound
    (`bound_s`): the blocks that stay, packed from below, keep the free room in one run, but
    a block placed so may wait on a free the allocator's rule would have passed over, or leave
    a hole where a stamp would have filled one."""
    fastest = trials.best().simulation.makespan_s
    if fastest <= bound_s * (1 + AUTO_TOLERANCE) or not trials.base.pack_low:
        return
    near = {(t.resident, t.window, t.knobs): t.simulation.makespan_s for t in trials.items
            if t.knobs.pack_low and t.simulation.makespan_s <= fastest * (1 + AUTO_TOLERANCE)}
    for resident, window, knobs in sorted(near, key=near.get)[:STAMPED_TRIALS]:
        try:
            trials.run(resident, window, exact=True, knobs=replace(knobs, pack_low=False))
        except BudgetError:
            pass


def without_plan(trial: Trial) -> Trial:
    """`trial` without its plan and its simulation's per-node times (its figures kept)."""
    return replace(trial, memgraph=None, simulation=replace(trial.simulation, start=(), end=(),
                                                            engine=()))


def search_room(trial_at: Callable[[float], Trial | None],
                bound_at: Callable[[float], float] | None = None, start: float = ROOM_START,
                seen: dict[float, Trial] | None = None,
                shares: tuple[float, ...] = ROOM_SHARES) -> float:
    """Search the room a paced resident set leaves for the pass beside its activation peak
    (`resident.paced_at`: counting its outputs or not), as a share of the budget on the grid
    `shares` (`resident.paced_resident`): little room streams the fewest bytes but leaves the
    prefetch none to work ahead in; much room the reverse. Unimodal like the resident share:
    start at `start` and `climb` (`bound_at`: a lower bound on a share's makespan, to skip
    probes that cannot move the climb; `seen`: the shares probed already). Returns the best
    share probed."""
    best = climb(len(shares), shares.index(start),
                 lambda i: trial_at(shares[i]),
                 {shares.index(at): t for at, t in (seen or {}).items()},
                 None if bound_at is None else lambda i: bound_at(shares[i]))
    return shares[best]


def climb(count: int, start: int, trial_at: Callable[[int], Trial | None],
          seen: dict[int, Trial | None] | None = None,
          bound_at: Callable[[int], float] | None = None, first: int = 1) -> int:
    """Minimise the makespan over grid points 0..count-1, taken as unimodal: probe `start`; if
    a point in `seen` (known already) beats it, climb towards it, else probe its neighbours,
    the one at `start + first` first (1 or -1: the side the caller expects the best on), and
    climb to the first that improves by more than AUTO_TOLERANCE while that improves; where
    `start` does not fit, from `start + 1` (more room). Stop once a plan spills nothing and runs
    within AUTO_TOLERANCE of its compute time (the same for every point, unlike the h2d term of
    each plan's own bound, so no other point can beat it by more than the tolerance). A
    neighbour whose lower bound (`bound_at`) already misses the improvement is not probed: the
    climb takes the same path with fewer lowerings. Returns the point it stopped at: the best
    it probed on its way. A point whose trial is None (its plan does not fit) counts as
    infinitely slow."""
    seen = dict(seen or {})

    def makespan(i: int) -> float:
        if i not in seen:
            seen[i] = trial_at(i)
        return math.inf if seen[i] is None else seen[i].simulation.makespan_s

    def done(i: int) -> bool:
        t = seen[i]
        return (t is not None and t.spill_bytes == 0
                and t.simulation.makespan_s <= (1 + AUTO_TOLERANCE) * t.simulation.compute_s)

    i = start
    makespan(i)
    known = [j for j in seen if j != i and makespan(j) < makespan(i)]
    if known:  # a point known already beats the start: the best lies towards it
        j = min(known, key=makespan)
        steps: tuple[int, ...] = (1 if j > i else -1,)
    else:
        steps = (first, -first) if makespan(i) < math.inf else (1, -1)
    while not done(i):
        for step in steps:
            j = i + step
            if not 0 <= j < count:
                continue
            goal = makespan(i) * (1 - AUTO_TOLERANCE)
            if j not in seen and bound_at is not None and bound_at(j) >= goal:
                continue
            if makespan(j) < goal:
                i, steps = j, (step,)  # unimodal: keep going this way
                break
        else:
            return i
    return i


def windows(auto: bool, seconds: float | None, compute_s: float,
            tasks: int) -> list[float | None]:
    """Look-ahead windows (predicted compute seconds; None: bounded by memory only) to try."""
    if not auto:
        return [seconds]
    if tasks > AUTO_MAX_TASKS or compute_s <= 0:
        return [None]
    return [None, *(compute_s * share for share in AUTO_SHARES)]


def best(trials: list["Trial"]) -> "Trial":
    """The trial of least makespan; among those within AUTO_TOLERANCE of it, the one that moves
    the fewest bytes, then the one with the fewest bytes live at once (the same speed with less
    traffic and less memory in flight)."""
    fastest = min(t.simulation.makespan_s for t in trials)
    near = [t for t in trials if t.simulation.makespan_s <= fastest * (1 + AUTO_TOLERANCE)]
    return min(near, key=lambda t: (t.simulation.h2d_bytes + t.simulation.d2h_bytes,
                                    t.live_peak, t.simulation.makespan_s))


def describe(lookahead_bytes: int | None, window: float | None, auto: bool) -> str:
    parts = []
    if lookahead_bytes is not None:
        parts.append(format_size(lookahead_bytes))
    if window is not None:
        parts.append(f"{window * 1e3:.3g} ms of compute")
    text = " and ".join(parts) if parts else "memory-bound"
    return f"auto: {text}" if auto else text


def lower_shrinking(tg: TaskGraph, order, opts: LowerOptions) -> tuple[MemGraph, frozenset]:
    """Lower; if the resident weights leave the pass too little room, keep fewer and retry."""
    while True:
        try:
            return lower(tg, order, opts), opts.resident
        except BudgetError:
            if not opts.resident or not opts.policy.evicts:
                raise
            keep = len(opts.resident) // 2  # give the pass more room and try again
            opts = replace(opts, resident=frozenset(sorted(opts.resident)[:keep]))
