"""The host placement search: which blocks to keep in host memory so that the tasks reading
them run on the host (`einpage.compiler.placement`), weighed by simulated makespan beside the
device-only plans of the partition the driver chose (`driver.compile_graph`)."""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, NamedTuple

from einpage.compiler import placement, search
from einpage.compiler.resident import PassNeeds, guarded_shares, paced_at, streamed_bytes
from einpage.errors import BudgetError
from einpage.predict.cost import task_seconds

if TYPE_CHECKING:
    from einpage.compiler.driver import CompileOptions

#: Rounds of `place`'s refinement (a placement, plus what its own plan streams of the rest),
#: and how many of a kind's best placements it refines
REFINE_ROUNDS = 2
REFINED = 2
#: ... of those within this share of the kind's best pass
REFINE_WITHIN = 0.10
#: A placement's room is searched (`search.search_room`) only where its plan at the device-only
#: winner's room is within this share of the best pass so far (or does not fit); otherwise that
#: one lowering is its trial (qwen3-8b decode B=4 at 8 GB lowered 20 placement plans, none within
#: 4%), and none where the placement's floor already misses this share
PLACEMENT_CLIMB_WITHIN = 0.03


def place(trials: search.Trials, needs: PassNeeds, won_share: float | None,
          options: "CompileOptions") -> None:
    """Host placement (`einpage.compiler.placement`) weighed beside the device-only plans: for
    each candidate set of blocks kept in host memory (the KV store, the experts' weights: all of
    them, or only those the best device-only plan streams, so what it keeps resident is still
    computed on the device, or shares of those that balance the host against the link), the
    tasks that read them run on the host, and paced resident sets
    over the other persistent blocks are searched as the device-only ones were: from the
    device-only winner's room, climbed only where that first plan is within
    PLACEMENT_CLIMB_WITHIN of the best, and not lowered at all where a floor of that plan (its
    longest chain of tasks, either queue's compute, the link time of what it leaves off the
    device: `floor`) already misses that (llama-7b decode B=8 at 16 GB lowered five placements,
    27.7-32.5 ms against 17.4 ms, before the floor; none since), though such a placement still
    seeds a refinement by its floor (`_Unlowered`). Every trial
    joins the partition's; a placement wins only by more than AUTO_TOLERANCE, so a tie keeps
    the device-only plan."""
    tg = trials.tg
    order, profile = trials.order, trials.profile
    device = trials.best()
    budget = options.device_bytes
    tried: set[frozenset] = set()
    placements: dict[frozenset, search.Trials] = {}  # tasks on the host -> their trials
    memo: dict[frozenset, tuple[frozenset, tuple[float, ...]]] = {}

    def hosted(kept: frozenset) -> tuple[frozenset, tuple[float, ...]]:
        """(the tasks that run on the host with `kept` there, every task's seconds then)."""
        if kept not in memo:
            on_host = placement.place_on_host(tg, order, kept)
            memo[kept] = on_host, (tuple(task_seconds(profile, tg, on_host,
                                                      trials.base.task_seconds))
                                   if on_host else ())
        return memo[kept]

    def paced_set(at: float, kept: frozenset, seconds: tuple[float, ...]) -> frozenset:
        return paced_at(tg, order, needs.activation_peak, budget, at, seconds, exclude=kept)

    guarded = guarded_shares(tg, options.guarded_reload_share)

    compute_floor: dict[frozenset, tuple[float, list[int]]] = {}  # on_host -> (floor, device)

    def floor(on_host: frozenset, seconds: tuple[float, ...], resident: frozenset) -> float:
        """No plan of the placement keeping `resident` on the device beats its longest chain
        of tasks, either queue's compute (those two once per placement), or the link time of
        what device tasks read of the persistent blocks left off the device."""
        if on_host not in compute_floor:
            host = on_host | tg.host_tasks  # (and the partition's own: its gathers)
            device_tasks = [t for t in range(len(seconds)) if t not in host]
            compute_floor[on_host] = max(
                placement.critical_path(tg, order, seconds), sum(seconds[t] for t in host),
                sum(seconds[t] for t in device_tasks)), device_tasks
        least, device_tasks = compute_floor[on_host]
        return max(least, streamed_bytes(tg, resident, guarded, readers=device_tasks)
                   / profile.h2d_bandwidth)

    def attempt(kept: frozenset) -> search.Trial | _Unlowered | None:
        """Lower and search the placement keeping `kept` in host memory; its best trial (adopted
        by `trials`), or None where it is not tried (nothing to save, tried before, hopeless,
        no room share's set fits), or `_Unlowered` where its floor rules its first plan out."""
        if not kept - device.resident:
            return None  # they stay on the device already: nothing to save
        on_host, seconds = hosted(kept)
        if not on_host or on_host in tried:
            return None
        tried.add(on_host)
        if sum(seconds[t] for t in on_host) >= trials.best().simulation.makespan_s:
            return None  # the host alone (one queue) would outlast the best pass so far
        start = (search.ROOM_START if won_share is None else  # a refined share: the nearest
                 min(search.ROOM_SHARES, key=lambda at: (abs(at - won_share), at)))
        first_set = paced_set(start, kept, seconds)
        low = floor(on_host, seconds, first_set)
        if low > trials.best().simulation.makespan_s * (1 + PLACEMENT_CLIMB_WITHIN):
            return _Unlowered(first_set, low)  # its first plan would neither win nor be climbed
        placed = search.Trials(tg, order, replace(trials.base, on_host=on_host,
                                                  task_seconds=seconds), profile,
                               options.progress)

        def paced(at: float) -> search.Trial | None:
            try:  # None: that set leaves the pass too little room
                return placed.run(paced_set(at, kept, seconds), device.window, exact=True)
            except BudgetError:
                return None

        # from the device-only winner's room; climbed only where that is near the best
        first = paced(start)
        if first is None or (first.simulation.makespan_s
                             <= trials.best().simulation.makespan_s
                             * (1 + PLACEMENT_CLIMB_WITHIN)):
            search.search_room(paced, lambda at: floor(on_host, seconds,
                                                       paced_set(at, kept, seconds)),
                               start=start, seen={start: first})
        if not placed.items:
            return None  # no room share's set fits beside the pass
        trials.adopt(placed.items)
        best = placed.best()
        placed.items = [search.without_plan(t) for t in placed.items]  # `trials` holds the plans
        placements[on_host] = placed
        return best

    seen: set[frozenset] = set()
    for kind in placement.KINDS:
        every = placement.host_blocks(tg, kind)
        if every in seen:
            continue  # "kv+experts" of a model without experts is "kv"
        seen.add(every)
        # all of them, or only those the device-only plan streams (what it keeps resident
        # stays there and is computed on the device; in whole groups: `placement.groups`), or
        # a share of them, so that the host and the link work at once
        candidates = [every, *placement.streamed_groups(tg, every, device.resident)]
        candidates += [placement.share_of(tg, every, f) for f in placement.balanced_shares(
            tg, every, *hosted(every), profile, device.resident,
            options.guarded_reload_share)]
        tried_kind = [(kept, attempt(kept)) for kept in candidates]
        tried_kind = [(kept, t) for kept, t in tried_kind if t is not None]
        if not tried_kind:
            continue
        # then the best REFINED of them (within REFINE_WITHIN of the best), each with what its
        # own plan still streams of the rest moved to the host too (its resident set differs
        # from the device-only plan's), while that gains
        # (a placement not lowered takes part by its floor: refined, it may win)
        tried_kind.sort(key=lambda kt: _pass_s(kt[1]))
        near = _pass_s(tried_kind[0][1]) * (1 + REFINE_WITHIN)
        for kept, best in tried_kind[:REFINED]:
            if _pass_s(best) > near:
                break
            for _ in range(REFINE_ROUNDS):
                more = placement.streamed_groups(tg, every - kept, best.resident)[1]
                better = attempt(kept | more) if more else None
                if better is None or _pass_s(better) >= _pass_s(best):
                    break
                kept, best = kept | more, better
    best = trials.best()
    if best.on_host:  # its best plans placed by stamp too (`search.stamped_trials`)
        placed = placements[best.on_host]
        lowered = len(placed.items)
        search.stamped_trials(placed, 0.0)
        trials.adopt(placed.items[lowered:])
        best = trials.best()
    if best.on_host and not (best.simulation.makespan_s < device.simulation.makespan_s
                             * (1 - search.AUTO_TOLERANCE)):
        trials.items = [t for t in trials.items if not t.on_host]


class _Unlowered(NamedTuple):
    """A placement `place` did not lower (its floor misses the best pass by more than the
    climb allows): its first resident set, and the floor standing in for its pass, so that it
    can still seed a refinement (what its plan would stream moved to the host too: qwen2.5-72b
    decode B=16 at 36 GB refines such a candidate twice into the winner, 2221.6 ms)."""
    resident: frozenset
    floor_s: float


def _pass_s(attempted: "search.Trial | _Unlowered") -> float:
    """A placement's pass: its best trial's, or the floor of one not lowered."""
    return (attempted.floor_s if isinstance(attempted, _Unlowered)
            else attempted.simulation.makespan_s)
