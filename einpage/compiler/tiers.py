"""The third tier: which streamed weight blocks stay in host memory and which are read from the
checkpoint files every pass, under a host budget (DESIGN.md, "Tiers").

Host memory holds, besides weights, what no plan can put on disk: the host copies of offloaded
blocks and written-back outputs (the runtimes give each its own slot), the KV store (the runtime
keeps the whole store as its backup, resident blocks included) and the activation inputs. What
is left of `--cpu-mem` holds the staging buffers of the disk reads and the weight blocks that stay
*pinned* in host memory; every other streamed weight block starts `input at disk`, and each of
its reloads is preceded by a `read` (disk -> staging buffer) on the disk queue.

One resident choice across the tiers: the device's resident set is the lowering's (it minimises
the bytes crossing the host link); given it, the pinned set minimises the bytes read from disk:
blocks reloaded more than once first, then the rest spread evenly along the pass (by bytes), so
the disk queue has the same share of every stretch of the pass to read and can run ahead of it.
The staging arena's size trades against the pinned bytes (every staging byte is a weight byte
read from disk): a few sizes are lowered and simulated, smallest first, until one is slower than
the best (the makespan falls while a larger arena lets the disk run further ahead and rises once
the bytes it takes from the pinned set dominate: on the planner grid's disk rows it rises from
the first or second size on; a size whose disk reads alone take longer than the best is not
tiered to see it), and the plan of least predicted makespan is kept (ties: fewer disk bytes).

Staging buffers are placed like device memory: exact offsets in a host arena of
`host_arena_bytes`, aligned to `HOST_ALIGNMENT`, with reuse edges (a read into bytes that an
earlier buffer held depends on the reload that consumed it). Reads are issued in the order of
the reloads they feed, each as early in the node order as its staging bytes allow, so the disk
queue runs ahead of the link by the staging arena's size.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from einpage.errors import BudgetError
from einpage.ir.memgraph import (HOST_ALIGNMENT, ApplyNode, InputNode, MemGraph, MemNode,
                                 OffloadNode, ReadNode, ReloadNode, renumbered)
from einpage.compiler.resident import take_largest
from einpage.predict.devices import DeviceProfile
from einpage.predict.cost import disk_seconds
from einpage.predict.simulator import Simulation, node_seconds, simulate
from einpage.units import format_size

#: staging arena sizes tried, in multiples of the largest block read from disk
STAGING_BLOCKS = (2, 4, 8, 16, 32)


def host_aligned(nbytes: int) -> int:
    return -(-nbytes // HOST_ALIGNMENT) * HOST_ALIGNMENT


@dataclass(frozen=True, slots=True)
class HostNeeds:
    """Host memory a plan needs whatever its tier choice (`fixed_bytes`), and the weight blocks it
    streams, which may stay pinned in host memory or be read from disk."""
    offload_bytes: int          # host copies of offloaded blocks, written-back outputs and the
                                # blocks applies on the host write
    kv_bytes: int               # the KV store's backup on the host
    input_bytes: int            # activation inputs (token ids, positions), and the weight blocks
                                # only applies on the host read (they stay in host memory)
    streamed: tuple[int, ...]   # weight tensors a reload reads from the host, in first-use order
    streamed_bytes: int
    reloads: dict               # tensor -> how many reloads read it

    @property
    def fixed_bytes(self) -> int:
        return self.offload_bytes + self.kv_bytes + self.input_bytes


def host_needs(mg: MemGraph) -> HostNeeds:
    tensors = mg.tensors
    offloaded = {n.tensor for n in mg.nodes if isinstance(n, OffloadNode)}
    offloaded |= mg.host_written()
    host_read = {a.tensor for n in mg.nodes if isinstance(n, ApplyNode) and n.on_host
                 for a in n.reads}
    inputs: dict[int, str] = {}
    for n in mg.nodes:
        if isinstance(n, InputNode):
            inputs.setdefault(n.tensor, n.at)
    kv = {t for t in inputs if tensors[t].role == "cache"}
    acts = {t for t, at in inputs.items()
            if at == "host" and tensors[t].role not in ("weight", "cache")}
    reloads: dict[int, int] = {}
    order: list[int] = []
    for n in mg.nodes:
        if (isinstance(n, ReloadNode) and inputs.get(n.tensor) in ("host", "disk")
                and tensors[n.tensor].role == "weight" and n.tensor not in offloaded):
            if n.tensor not in reloads:
                order.append(n.tensor)
            reloads[n.tensor] = reloads.get(n.tensor, 0) + 1
    size = lambda ts: sum(host_aligned(tensors[t].bytes) for t in ts)  # noqa: E731
    # weights applies on the host read stay in host memory (never at disk), reloaded or not
    weights_on_host = {t for t in host_read if inputs.get(t) == "host"
                       and tensors[t].role == "weight"}
    order = [t for t in order if t not in weights_on_host]
    return HostNeeds(size(offloaded), size(kv - offloaded),
                     size((acts - offloaded) | weights_on_host), tuple(order), size(order),
                     {t: k for t, k in reloads.items() if t not in weights_on_host})


@dataclass(frozen=True, slots=True)
class TierChoice:
    """The host side of a plan: the budget, what it holds, and what is read from disk."""
    host_bytes: int | None       # the host budget (None: unlimited)
    fixed_bytes: int             # offloaded blocks, KV store, inputs
    pinned_bytes: int            # streamed weight blocks kept in host memory
    disk_bytes: int              # weight blocks at disk (read at least once per pass)
    staging_bytes: int           # the host arena of the reads' staging buffers
    disk_blocks: int

    @property
    def host_peak_bytes(self) -> int:
        return self.fixed_bytes + self.pinned_bytes + self.staging_bytes

    def to_json(self) -> dict:
        return {"host_bytes": self.host_bytes, "host_peak_bytes": self.host_peak_bytes,
                "host_fixed_bytes": self.fixed_bytes, "pinned_bytes": self.pinned_bytes,
                "disk_weight_bytes": self.disk_bytes, "staging_bytes": self.staging_bytes,
                "disk_blocks": self.disk_blocks}


def choose_pinned(needs: HostNeeds, sizes: Callable[[int], int], capacity: int,
                  by_size: bool = False) -> frozenset[int]:
    """The streamed weight blocks that stay in host memory within `capacity` bytes: those read
    more than once first (each pinned byte saves a disk byte per reload), then the rest spread
    evenly along the pass by bytes, then whatever still fits, earliest first. `by_size`: of the
    rest, the smallest the spread allows (`_disk_by_size`): the disk reads the same bytes in
    fewer reads, each of which costs its latency besides its bytes."""
    pinned: set[int] = set()
    left = capacity
    for t in sorted((t for t in needs.streamed if needs.reloads[t] > 1),
                    key=lambda t: -needs.reloads[t]):
        if sizes(t) <= left:
            pinned.add(t)
            left -= sizes(t)
    rest = [t for t in needs.streamed if t not in pinned]
    total = sum(sizes(t) for t in rest)
    if total and left > 0:
        share, credit = min(1.0, left / total), 0.0
        if by_size:
            for t in _disk_by_size(rest, sizes, total - left):
                if sizes(t) <= left:
                    pinned.add(t)
                    left -= sizes(t)
        else:
            for t in rest:
                credit += sizes(t) * share
                if credit >= sizes(t) and sizes(t) <= left:
                    pinned.add(t)
                    left -= sizes(t)
                    credit -= sizes(t)
        for t in rest:
            if t not in pinned and sizes(t) <= left:
                pinned.add(t)
                left -= sizes(t)
    return frozenset(pinned)


def _disk_by_size(blocks: list[int], sizes: Callable[[int], int], must: int) -> list[int]:
    """Of `blocks` (in first-use order), the ones to pin, so that the rest, read from disk, are
    at least `must` bytes spread evenly along the pass by bytes, the largest the spread allows:
    each block goes to disk, and while the disk's bytes so far exceed their share of the bytes
    walked (half a block of slack) or reach `must` without it, the smallest of them is pinned
    instead (the latest of equal ones: blocks of one size spread as in order). Smallest pinned
    first."""
    total = sum(sizes(t) for t in blocks)
    rate = must / total if total else 0.0
    disk, seen, going, kept = 0, 0, [], []  # going: a heap of (size, -index) on disk
    for k, t in enumerate(blocks):
        size = sizes(t)
        seen += size
        disk = take_largest(going, disk, k, size, rate * seen + size / 2, must, kept)
    return [blocks[k] for k in sorted(kept, key=lambda k: (sizes(blocks[k]), k))]


def with_disk_tier(mg: MemGraph, disk: frozenset[int], staging_bytes: int) -> MemGraph:
    """`mg` with the weight blocks `disk` at disk: each reload of one reads from a staging buffer
    that a `read` filled (see the module docstring). Pure; `mg` is not changed."""
    if not disk:
        return mg
    tensors = mg.tensors
    # phase 1: a staging buffer for every reload of a disk block, in plan order (FIFO ring)
    staged: dict[int, tuple[int, list[int]]] = {}  # reload id -> (host offset, reuse deps)
    live: list[tuple[int, int, int]] = []          # (lo, hi, reload) of buffers not reused yet
    head = 0
    last_reload: dict[int, int] = {}
    for n in mg.nodes:
        if not (isinstance(n, ReloadNode) and n.tensor in disk):
            continue
        size = host_aligned(tensors[n.tensor].bytes)
        if size > staging_bytes:
            raise BudgetError(f"staging arena of {staging_bytes} bytes cannot hold "
                              f"%t{n.tensor} ({size} bytes)", size, staging_bytes)
        if head + size > staging_bytes:
            head = 0
        lo, hi = head, head + size
        deps, kept = [], []
        for a, b, r in live:  # bytes of an earlier buffer that this one does not take stay its
            if a < hi and lo < b:
                deps.append(r)
                kept += [(a, min(b, lo), r)] if a < lo else []
                kept += [(max(a, hi), b, r)] if hi < b else []
            else:
                kept.append((a, b, r))
        live = kept
        if n.tensor in last_reload:  # one staging buffer of a tensor at a time
            deps.append(last_reload[n.tensor])
        live.append((lo, hi, n.id))
        last_reload[n.tensor] = n.id
        staged[n.id] = (lo, deps)
        head = hi
    # phase 2: each read as early as its deps allow, in reload order; ids renumbered
    input_of = {n.tensor: n.id for n in mg.nodes if isinstance(n, InputNode)}
    after: dict[int, list[int]] = {}  # old node id -> reloads whose read goes right after it
    previous = -1
    for rid, (_, deps) in staged.items():
        anchor = max([*deps, input_of[mg.nodes[rid].tensor], previous])
        previous = anchor
        after.setdefault(anchor, []).append(rid)
    new_id: dict[int, int] = {}
    read_of: dict[int, int] = {}  # reload old id -> its read's new id
    out: list[MemNode] = []

    def emit_reads(reloads: list[int]) -> None:
        for rid in reloads:
            r = mg.nodes[rid]
            offset, deps = staged[rid]
            read_of[rid] = len(out)
            out.append(ReadNode(len(out), r.tensor, offset,
                                tuple(sorted({new_id[input_of[r.tensor]],
                                              *(new_id[d] for d in deps)}))))

    for n in mg.nodes:
        k = len(out)
        deps = tuple(new_id[d] for d in n.deps)
        if isinstance(n, InputNode) and n.tensor in disk:
            node: MemNode = renumbered(n, k, deps, at="disk")
        elif isinstance(n, ReloadNode) and n.id in staged:
            node = renumbered(n, k, tuple(sorted({*deps, read_of[n.id]})),
                              host_offset=staged[n.id][0])
        else:
            node = renumbered(n, k, deps)
        new_id[n.id] = k
        out.append(node)
        emit_reads(after.get(n.id, []))
    return replace(mg, nodes=tuple(out), host_arena_bytes=staging_bytes)


def tiered_seconds(tiered: MemGraph, seconds: list[float],
                   profile: DeviceProfile) -> list[float]:
    """The predicted duration of every node of `tiered` (`with_disk_tier` of a plan whose nodes
    take `seconds`: `simulator.node_seconds`): its reads', and those of the plan's nodes, which
    keep their order among them."""
    tensors = tiered.tensors
    plan = iter(seconds)
    return [disk_seconds(profile, tensors[n.tensor].bytes) if isinstance(n, ReadNode)
            else next(plan) for n in tiered.nodes]


@dataclass(frozen=True)
class Tiered:
    memgraph: MemGraph
    simulation: Simulation
    choice: TierChoice


def place_tiers(mg: MemGraph, simulation: Simulation, host_bytes: int | None,
                profile: DeviceProfile, by_size: bool = False,
                seconds: list[float] | None = None) -> Tiered:
    """The plan of least predicted makespan with every host need inside `host_bytes` (None:
    unlimited; nothing is read from disk). Raises `BudgetError` with the host budget that would
    work when the blocks that must stay in host memory do not fit. `by_size`: the pinned blocks
    the smallest the spread allows (`choose_pinned`). `seconds`: `mg`'s node seconds
    (`simulator.node_seconds`), where the caller has them."""
    needs = host_needs(mg)
    sizes = {t: host_aligned(mg.tensors[t].bytes) for t in needs.streamed}
    if host_bytes is None or needs.fixed_bytes + needs.streamed_bytes <= host_bytes:
        return Tiered(mg, simulation, TierChoice(host_bytes, needs.fixed_bytes,
                                                 needs.streamed_bytes, 0, 0, 0))
    largest = max(sizes.values(), default=0)
    smallest = needs.fixed_bytes + STAGING_BLOCKS[0] * largest
    if host_bytes < smallest:
        what = (f"offloaded blocks {format_size(needs.offload_bytes)}, KV store "
                f"{format_size(needs.kv_bytes)}, inputs {format_size(needs.input_bytes)}")
        raise BudgetError(f"host budget {format_size(host_bytes)} is too small: this plan keeps "
                          f"{format_size(needs.fixed_bytes)} in host memory ({what}) and needs "
                          f"{format_size(STAGING_BLOCKS[0] * largest)} to stage disk reads; the "
                          f"smallest host budget that would work is {format_size(smallest)} "
                          f"(--cpu-mem)", smallest, host_bytes)
    best: Tiered | None = None
    if seconds is None:  # (each tiering's nodes are these and its reads)
        seconds = node_seconds(mg, profile)
    for arena in (k * largest for k in STAGING_BLOCKS):
        capacity = host_bytes - needs.fixed_bytes - arena
        if capacity < 0 or (best is not None and arena >= needs.streamed_bytes):
            break
        pinned = choose_pinned(needs, sizes.__getitem__, capacity, by_size)
        disk = frozenset(needs.streamed) - pinned
        if best is not None and sum(disk_seconds(profile, mg.tensors[t].bytes) for t in disk) \
                > best.simulation.makespan_s * (1 + 1e-9):
            break  # its disk alone, each block read once, is slower than the best: no need to
            # tier it to see (the disk queue reads one block at a time)
        tiered = with_disk_tier(mg, disk, arena)
        sim = simulate(tiered, profile, tiered_seconds(tiered, seconds, profile), verify=False)
        here = Tiered(tiered, sim, TierChoice(host_bytes, needs.fixed_bytes,
                                              sum(sizes[t] for t in pinned),
                                              sum(sizes[t] for t in disk), arena, len(disk)))
        if best is None or _faster(here.simulation, best.simulation):
            best = here
        elif here.simulation.makespan_s > best.simulation.makespan_s:
            break  # past the best size: every larger one reads more bytes from disk
    assert best is not None
    return best


def by_size_tiers(mg: MemGraph | None, simulation: Simulation, tiered: Tiered,
                  host_bytes: int | None, profile: DeviceProfile) -> Tiered:
    """`tiered` (`mg` tiered by `place_tiers`), or `mg` tiered with the pinned blocks the
    smallest the spread allows where that runs faster: the disk then reads the same bytes in
    larger blocks, fewer reads that each pay the disk's latency (llama-30b prefill at 8 GB with
    a 32 GB host: 9859.0 -> 9790.0 ms; llama-7b prefill at 4 GB with an 8 GB host: 997.7 ->
    988.5 ms). Tried on the compile's last plan only: tiering every plan the climbs weigh both
    ways took a fifth more compile time on the grid's disk rows (llama-7b at 4 GB / 8 GB 7 ->
    9 s) and found less (996.9 ms there); by size at the staging arena `tiered` has only, it
    finds less again (llama-30b 9829.9 ms)."""
    if not tiered.choice.disk_bytes or mg is None:
        return tiered
    other = place_tiers(mg, simulation, host_bytes, profile, by_size=True)
    return other if _faster(other.simulation, tiered.simulation) else tiered


def _faster(a: Simulation, b: Simulation) -> bool:
    """Whether `a` runs faster than `b` (ties: fewer disk bytes)."""
    return (a.makespan_s, a.disk_bytes) < (b.makespan_s, b.disk_bytes)


__all__ = ["HostNeeds", "TierChoice", "Tiered", "by_size_tiers", "choose_pinned", "host_needs",
           "place_tiers", "with_disk_tier", "STAGING_BLOCKS"]
