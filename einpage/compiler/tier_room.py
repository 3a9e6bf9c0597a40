"""The room search weighed by the tiered pass, where the host budget sends blocks to disk.

The resident search (`rooms.search_resident`, `rooms.refine_room`) weighs each resident set by
the device pass alone: more resident bytes stream fewer, but leave the prefetch less room, and on
the device the best room is where those balance. When the host budget cannot hold every
streamed block, the disk reads them (`tiers.place_tiers`), and the disk is an order of
magnitude slower than the link: each resident byte more is a byte fewer read from disk, and the
device's own stalls hide behind the disk's. So there the room is climbed again on the fine grid
(`search.FINE_ROOM_SHARES`, beside the activation peak of a pass that writes its outputs
back) from what won, each set lowered with the winner's look-ahead window and placement and
tiered, by the tiered makespan. llama-7b prefill at 4 GB with an 8 GB host: the device search's
set reads 3.57 GB from disk per pass, 1203 ms; the climb's 3.23 GB, 1088 ms.

The tiered makespan is not unimodal in the room everywhere (a set that leaves the pass too
little room evicts streamed blocks and reads them from disk twice), so the climb stops at the
first neighbour that does not improve, as the device search does. It probes the smaller room
first: where the disk binds, the device's best room is too large for the tiered pass (every
byte more resident is a byte fewer read from disk); on the planner grid's disk rows every climb
went that way, and the larger room, probed first, lost each time (17 of 17: a lowering and a
tiering each, a quarter of the climbs' probes).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

from einpage.compiler import search
from einpage.compiler.lower_options import LowerOptions
from einpage.compiler.lowering import lower
from einpage.compiler.report import Traffic
from einpage.compiler.resident import kept_bytes, weights_first
from einpage.compiler.tiers import Tiered, place_tiers
from einpage.errors import BudgetError
from einpage.ir.memgraph import MemGraph
from einpage.predict.cost import task_seconds
from einpage.predict.simulator import node_seconds, simulate


def climb_tiered(trials: search.Trials, best: search.Trial, tiered: Tiered, start: float,
                 set_at: Callable[[float], frozenset], streamed_at: Callable[[float], int],
                 host_bytes: int) -> tuple[Tiered, search.Trial]:
    """The resident set of least tiered makespan among the paced sets of the fine room grid
    (`set_at(share)`), climbing from `start` (the share `best` came from), each lowered with
    `best`'s window, placement and lowering options and tiered within `host_bytes`; `tiered` is
    `best`'s own tiering. A share whose persistent bytes off the device (`streamed_at`) are
    more than the host can hold by a margin that the disk alone makes slower than the best so
    far is not lowered. Returns the fastest (tiering, trial) pair, `(tiered, best)` itself where
    nothing beats it by `search.AUTO_TOLERANCE`."""
    profile = trials.profile
    opts = _options_of(trials, best)
    shares = search.FINE_ROOM_SHARES
    chosen = [(tiered, best)]  # the fastest so far; only it keeps its plan
    seen: dict[frozenset, search.Trial | None] = {best.resident: _light(best, tiered)}

    def trial_at(i: int) -> search.Trial | None:
        resident = set_at(shares[i])
        if resident not in seen:
            seen[resident] = None
            try:
                mg = lower(trials.tg, trials.order, replace(opts, resident=resident))
                other, plan = _tiered(trials, opts, best, resident, mg, host_bytes)
            except BudgetError:  # too little room for the pass, or for its host needs
                return None
            seen[resident] = _light(plan, other)
            if other.simulation.makespan_s < chosen[0][0].simulation.makespan_s:
                chosen[0] = (other, plan)
        return seen[resident]

    def bound(i: int) -> float:
        return max(0, streamed_at(shares[i]) - host_bytes) / profile.disk_bandwidth

    search.climb(len(shares), shares.index(start), trial_at, bound_at=bound, first=-1)
    other, plan = chosen[0]
    if other.simulation.makespan_s >= tiered.simulation.makespan_s * (1 - search.AUTO_TOLERANCE):
        return tiered, best
    return other, plan


def weights_first_tiered(trials: search.Trials, best: search.Trial, tiered: Tiered,
                         device_bytes: int, host_bytes: int) -> tuple[Tiered, search.Trial]:
    """Where the host budget sends weights to disk and the pass reads a KV store: the same
    resident bytes with weights kept before KV blocks (`resident.weights_first`) also lowered
    and tiered, and the faster plan kept with its trial (the device-side search weighs the link
    alone, where a resident KV block and a resident weight save the same bytes)."""
    tg = trials.tg
    room = kept_bytes(tg, best.resident)
    resident = weights_first(tg, trials.order, room, trials.base.task_seconds,
                             max(1, (device_bytes - room) // 2))
    if resident == best.resident:
        return tiered, best
    opts = _options_of(trials, best)
    try:
        mg, resident = search.lower_shrinking(tg, trials.order, replace(opts, resident=resident))
        other, plan = _tiered(trials, opts, best, resident, mg, host_bytes)
    except BudgetError:  # too little room for the pass, or for its host needs
        return tiered, best
    if other.simulation.makespan_s >= tiered.simulation.makespan_s:
        return tiered, best
    return other, plan


def with_plan(trials: search.Trials, trial: search.Trial) -> search.Trial:
    """`trial` with its plan: lowered and simulated again, as it was, where its plan was
    dropped (a faster trial had won)."""
    if trial.memgraph is not None:
        return trial
    opts = _options_of(trials, trial)
    mg = lower(trials.tg, trials.order, replace(opts, resident=trial.resident))
    sim = simulate(mg, trials.profile, node_seconds(mg, trials.profile, opts.task_seconds),
                   verify=False)
    return replace(trial, memgraph=mg, simulation=sim)


def _options_of(trials: search.Trials, best: search.Trial) -> LowerOptions:
    """The lowering options `best` was lowered with, its resident set aside."""
    return best.knobs.lower_options(replace(
        trials.base, lookahead_seconds=best.window, on_host=best.on_host,
        task_seconds=tuple(task_seconds(trials.profile, trials.tg, best.on_host)),
        progress=None))


def _tiered(trials: search.Trials, opts: LowerOptions, best: search.Trial, resident: frozenset,
            mg: MemGraph, host_bytes: int) -> tuple[Tiered, search.Trial]:
    """`mg` (`best` lowered again with `resident` and `opts`) simulated as its trials are and
    tiered within `host_bytes` (`BudgetError` where its host needs do not fit), with its
    trial."""
    profile = trials.profile
    seconds = node_seconds(mg, profile, opts.task_seconds)
    sim = simulate(mg, profile, seconds, verify=False)
    return place_tiers(mg, sim, host_bytes, profile, seconds=seconds), replace(
        best, resident=resident, memgraph=mg, simulation=sim,
        spill_bytes=Traffic.of(mg).offload_bytes, live_peak=mg.live_peak())


def _light(plan: search.Trial, tiered: Tiered) -> search.Trial:
    """`plan` as the climb weighs it: by its tiered pass, without its plan."""
    return search.without_plan(replace(plan, simulation=tiered.simulation))


__all__ = ["climb_tiered", "weights_first_tiered", "with_plan"]
