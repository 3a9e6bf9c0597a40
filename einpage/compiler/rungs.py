"""The partitions of one compile and the rungs of the problem's bound they give.

Each partition the compiler tries (the coarse one, the ladder's, a halving, its weights capped
or the weights a plan streams cut finer, one ordered by weight block or with its rows drained)
is a *rung*: what any plan of it must copy
host->device, its compute, and the terms of its order (the first bytes before their tasks, the
outputs after theirs). The problem's bound is taken over the rungs (`known_bound`): no plan of
any partition tried beats it."""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from einpage.compiler.drain import drained_order, tail_seconds
from einpage.compiler.order import memory_aware_order
from einpage.compiler.partitioner import PartitionOptions, partition
from einpage.compiler.report import ProblemBound
from einpage.compiler.host_gather import LINK_SHARE, with_host_gathers
from einpage.compiler.resident import (PassNeeds, disk_block_sizes, front_seconds, front_waits,
                                       least_disk_bytes, least_disk_staged, min_stream_bytes,
                                       min_stream_copies, pass_needs, stream_positions)
from einpage.ir.graph import Graph
from einpage.ir.taskgraph import TaskGraph
from einpage.ir.tensors import PERSISTENT_ROLES
from einpage.predict.cost import task_seconds
from einpage.predict.devices import DEFAULT_DEVICE, DeviceProfile, get_device

if TYPE_CHECKING:
    from einpage.compiler.driver import CompileOptions


class Rung(NamedTuple):
    """One partition tried (the coarse one, the ladder's, a halving) in one order, for the
    problem's bound: what any plan of it must copy host->device (`resident.min_stream_bytes`,
    in at least `resident.min_stream_copies` copies), its compute time (every plan of a
    taskgraph runs the same tasks), and its order's front and tail terms."""
    block: int
    max_working_set: int
    min_stream_bytes: int
    compute_s: float
    front_s: float = 0.0  # `resident.front_seconds`: the link's first bytes before their tasks
    weight_block: int | None = None  # its weights cut to at most this (`driver._stream_blocks`)
    by_weight: bool = False          # ordered by weight block (`driver._plan`)
    #: `drain.tail_seconds`: the outputs' write-back after their tasks, the least of its order
    #: and that order with its rows drained (`drain.drained_order`), planned or not
    tail_s: float = 0.0
    drained: bool = False            # its rows drained behind compute (`driver._drain_behind`)
    #: `resident.least_disk_bytes`: what it must read from disk at the host budget
    min_disk_bytes: int = 0
    #: `resident.min_stream_copies`: how many host->device copies any plan of it makes
    min_stream_copies: float = 0.0
    #: the weights (graph node ids) it cuts finer, and to at most how many bytes
    #: (`driver._split_streamed`)
    split: tuple[frozenset[int], int] | None = None
    #: with a host budget, its persistent blocks' bytes, largest first: the fewest disk reads
    #: of its plans (`resident.least_disk_reads`)
    disk_blocks: tuple[int, ...] = ()


class Cut(NamedTuple):
    """A partition of the pass, ordered, with what every plan of it shares."""
    tg: TaskGraph
    order: list[int]
    needs: PassNeeds
    seconds: tuple[float, ...]
    rung: Rung


class _Known(NamedTuple):
    """What `Partitions` found of a partition in an order: its needs and, where found, its
    stream bounds' positions (`resident.stream_positions`)."""
    order: list[int]
    needs: PassNeeds
    positions: list | None = None


class Partitions:
    """The partitions of one compile, the last one kept: a rung of the bound and then the
    search may ask for the same block size (`driver._halve_blocks`), and a partition of a large pass
    takes seconds (and gigabytes: only the last is kept beside the plans that hold theirs)."""

    def __init__(self, graph: Graph, options: CompileOptions):
        self.graph, self.options = graph, options
        self.profile = options.device or get_device(DEFAULT_DEVICE)
        self._made: dict[tuple, Cut] = {}

    def cut(self, block: int, weight_block: int | None = None, by_weight: bool = False,
            drained: bool = False, split: tuple[frozenset[int], int] | None = None
            ) -> Cut | None:
        """The partition for `block`-byte working sets (weights in blocks of at most
        `weight_block` bytes), ordered by weight block where `by_weight` (the same partition as
        without it: made once), its rows drained behind compute where `drained` (None where
        they cannot be: `drain.drained_order`). Its rung's tail term is the least of both
        orders: a bound is not raised by an order the search did not plan."""
        key = (block, weight_block, by_weight, drained, split)
        if key not in self._made:
            options, profile = self.options, self.profile
            same = next((c for k, c in self._made.items()
                         if k[:2] == key[:2] and k[4] == split), None)
            known: _Known | None = None  # what `_gathered` found of the partition in its order
            if same is not None:
                tg, seconds = same.tg, same.seconds
            else:
                tg = partition(self.graph, PartitionOptions(
                    block, options.cuts, options.sources,
                    drop_constant_blocks=options.drop_constant_blocks,
                    weight_block_bytes=weight_block,
                    split_weights=split[0] if split else frozenset(),
                    split_bytes=split[1] if split else None))
                seconds = tuple(task_seconds(profile, tg))
                gathered, known = self._gathered(tg, seconds)
                if gathered is not tg:  # (its gathers priced on the host)
                    tg, seconds = gathered, tuple(task_seconds(profile, gathered,
                                                               on_device=seconds))
            order = (known.order if known is not None and not by_weight
                     else memory_aware_order(tg, by_weight))
            rows = drained_order(tg, order, seconds, profile.d2h_bandwidth)
            if drained and rows is None:
                return None
            orders = [rows] if drained else [order] if rows is None else [order, rows]
            order = orders[0]
            # the device's compute, for the bound (a task on the host runs beside it, on the
            # host's one queue: the compute term is the longer of the two)
            device = (seconds if not tg.host_tasks else
                      tuple(0.0 if t in tg.host_tasks else s for t, s in enumerate(seconds)))
            hosted = sum(seconds[t] for t in tg.host_tasks)
            waits = [front_waits(tg, o, options.device_bytes, profile.h2d_bandwidth)
                     for o in orders]
            tail = min(tail_seconds(tg, o, device, options.device_bytes, profile.d2h_bandwidth,
                                    w) for o, w in zip(orders, waits))
            if known is None or order is not known.order:
                known = _Known(order, pass_needs(tg, order))
            needs = known.needs
            positions = known.positions or stream_positions(tg, order)
            rung = Rung(block, needs.max_working_set,
                        min_stream_bytes(tg, order, options.device_bytes, positions),
                        max(sum(device), hosted),
                        front_seconds(tg, order, device, options.device_bytes,
                                      profile.h2d_bandwidth, waits[0]), weight_block, by_weight,
                        tail,
                        drained, least_disk_bytes(tg, order, options.device_bytes,
                                                  options.host_bytes),
                        min_stream_copies(tg, order, options.device_bytes, positions), split,
                        disk_block_sizes(tg) if options.host_bytes is not None else ())
            self._made = {key: Cut(tg, order, needs, seconds, rung)}
        return self._made[key]

    def _gathered(self, tg: TaskGraph, seconds: tuple[float, ...]
                  ) -> tuple[TaskGraph, _Known | None]:
        """`tg` with its gathers on the host (`host_gather`) where the options allow it, the
        link (nearly) binds its pass (the bytes no plan of it can keep on the device take the
        link at least `host_gather.LINK_SHARE` of its compute, `seconds`), and the host budget
        holds every persistent block (a tied table only where it is larger than the room its
        pass leaves: `host_gather.host_gathers`); else `tg`. With it, what was found of `tg`
        in its memory-aware order on the way (None where nothing was, or `tg` was gathered):
        `cut` finds it again otherwise."""
        options = self.options
        persistent = sum(b.bytes for b in tg.input_blocks if b.role in PERSISTENT_ROLES)
        if not options.host_gather or (options.host_bytes is not None
                                       and persistent > options.host_bytes):
            return tg, None
        order = memory_aware_order(tg)
        needs = pass_needs(tg, order)
        gathered = with_host_gathers(tg, self.profile, options.device_bytes
                                     - needs.written_back_peak - needs.max_working_set)
        if gathered is tg:
            return tg, _Known(order, needs)
        positions = stream_positions(tg, order)
        streamed = min_stream_bytes(tg, order, options.device_bytes, positions)
        link_s = streamed / self.profile.h2d_bandwidth
        if link_s >= LINK_SHARE * sum(seconds):
            return gathered, None
        return tg, _Known(order, needs, positions)

    def hold(self, rung: Rung, tg: TaskGraph, order: list[int], needs: PassNeeds,
             seconds: tuple[float, ...]) -> None:
        """Keep `rung`'s partition (what a plan of it carries: its taskgraph, order, needs and
        task seconds) as the one made, so that `cut` asks no partition again for it in another
        order (`driver._drain_behind`, after a capped partition was tried and lost)."""
        key = (rung.block, rung.weight_block, rung.by_weight, rung.drained, rung.split)
        self._made = {key: Cut(tg, order, needs, seconds, rung)}


def problem_bound(rungs: list[Rung], profile: DeviceProfile,
                  host_bytes: int | None = None) -> ProblemBound:
    """The problem's bound over the rungs so far, each term the least over the rungs (the
    stream term's bytes and copies each so); with `host_bytes`, its disk term too (its bytes,
    and the staging and reads they take at least in a rung's blocks, the least over the rungs:
    `resident.least_disk_staged`)."""
    stream = min(r.min_stream_bytes for r in rungs)
    least = min(r.min_disk_bytes for r in rungs)
    disk = ProblemBound.disk_bytes_of(host_bytes, least)
    reads = staging = 0
    if disk and all(r.disk_blocks for r in rungs) and getattr(profile, "disk_bandwidth", None):
        _, reads, staging = min(least_disk_staged(r.disk_blocks, disk, profile.disk_bandwidth,
                                                  profile.disk_latency) for r in rungs)
    return ProblemBound.of(
        min(r.compute_s for r in rungs), stream, profile, host_bytes, least,
        min(r.front_s for r in rungs), min(r.tail_s for r in rungs),
        min(r.min_stream_copies for r in rungs), reads, staging)


def known_bound(rungs: list[Rung], profile: DeviceProfile) -> float:
    """The problem's bound over the rungs so far, in seconds: its device terms (compute,
    stream, front, tail)."""
    return problem_bound(rungs, profile).seconds
