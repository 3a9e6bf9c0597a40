"""Which persistent blocks — weights and KV-store blocks — stay on the device for every pass.

A plan is one pass run again and again, so a block kept resident is loaded once (with the model,
or when the store is opened) and streams zero bytes per pass; every other persistent block
streams its bytes once per pass. A weight byte and a KV byte cost the same per pass, so both
compete for one room: the resident set is the largest set of persistent bytes that fits beside
the memory the pass itself needs (activations at their peak, the largest task's working set,
and room to double-buffer the streamed blocks), spread evenly over the pass so streaming
overlaps compute throughout.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Iterable, Mapping, Sequence

from einpage.compiler.allocator import aligned
from einpage.ir.taskgraph import TaskGraph, reload_guards
from einpage.ir.tensors import PERSISTENT_ROLES


def device_tasks(tg: TaskGraph) -> list[int]:
    """The tasks that run on the device (all but the partition's `TaskGraph.host_tasks`)."""
    host = tg.host_tasks
    return [t.id for t in tg.tasks if t.id not in host] if host else list(range(len(tg.tasks)))


def working_set(tg: TaskGraph, task_id: int) -> int:
    """The aligned bytes task `task_id` needs on the device at once: its reads and its write."""
    t = tg.tasks[task_id]
    return sum(aligned(tg.blocks[b].bytes) for b in set(t.reads) | {t.write})


@dataclass(frozen=True)
class PassNeeds:
    weight_bytes: int          # all weight blocks, aligned
    kv_bytes: int              # all KV-store (cache) input blocks, aligned
    input_bytes: int           # activation input blocks, aligned
    activation_peak: int       # peak of live produced blocks over the order
    written_back_peak: int     # the same with outputs leaving after their last use (a pass
                               # that streams writes each back to the host once final)
    max_working_set: int       # the largest task's blocks
    max_task_weights: int      # the most persistent (weight, KV) bytes one task reads

    @property
    def outputs_held(self) -> int:
        """What the outputs add to the activation peak where they stay to the pass's end."""
        return self.activation_peak - self.written_back_peak

    @property
    def persistent_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes


def touches(tg: TaskGraph, order: list[int]) -> tuple[dict[int, int], dict[int, int]]:
    """({block: the position of the first device task touching it}, {block: of the last}): a
    task on the host (`TaskGraph.host_tasks`) touches no device memory."""
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    host = tg.host_tasks
    for p, tid in enumerate(order):
        if tid in host:
            continue
        t = tg.tasks[tid]
        for b in (*t.reads, t.write):
            first.setdefault(b, p)
            last[b] = p
    return first, last


def produced_peak(tg: TaskGraph, order: list[int], outputs_stay: bool = True,
                  size: Callable[[int], int] = aligned,
                  touched: tuple[dict[int, int], dict[int, int]] | None = None) -> int:
    """The most bytes of produced blocks (activations, partial sums) live at once over the order,
    each live from the task that first touches it to the task that last does; with
    `outputs_stay=False` output blocks leave the device after their last use (written back to
    the host) instead of staying to the end. `size` maps a block's bytes (aligned by default);
    `touched`: `touches(tg, order)`, where the caller has it."""
    first, last = touches(tg, order) if touched is None else touched
    outputs = {o.block for o in tg.outputs} if outputs_stay else set()
    delta = [0] * (len(order) + 1)
    for b, p in first.items():
        blk = tg.blocks[b]
        if blk.source is None:
            delta[p] += size(blk.bytes)
            if b not in outputs:
                delta[last[b] + 1] -= size(blk.bytes)
    peak = live = 0
    for d in delta:
        live += d
        peak = max(peak, live)
    return peak


def pass_needs(tg: TaskGraph, order: list[int], outputs_stay: bool = True) -> PassNeeds:
    """What one pass needs on the device; with `outputs_stay=False` output blocks leave the
    device after their last use (written back to the host) instead of staying to the end. Tasks
    on the host (`TaskGraph.host_tasks`) and the inputs only they read need none of it."""
    touched = touches(tg, order)
    peak = produced_peak(tg, order, outputs_stay, touched=touched)
    written_back = (peak if not outputs_stay
                    else produced_peak(tg, order, outputs_stay=False, touched=touched))
    inputs = [b for b in tg.input_blocks if b.id in tg.device_read]
    tasks = device_tasks(tg)

    def total(role: str) -> int:
        return sum(aligned(b.bytes) for b in inputs if b.role == role)

    return PassNeeds(
        weight_bytes=total("weight"), kv_bytes=total("cache"),
        input_bytes=sum(aligned(b.bytes) for b in inputs if b.role not in PERSISTENT_ROLES),
        activation_peak=peak, written_back_peak=written_back,
        max_working_set=max((working_set(tg, t) for t in tasks), default=0),
        max_task_weights=max((sum(aligned(tg.blocks[b].bytes) for b in set(tg.tasks[t].reads)
                                  if tg.blocks[b].role in PERSISTENT_ROLES) for t in tasks),
                             default=0))


def min_stream_bytes(tg: TaskGraph, order: list[int], device_bytes: int,
                     positions: list | None = None) -> int:
    """The fewest bytes that any plan of this taskgraph and order must copy host->device per pass
    under `device_bytes`, whatever its policy and resident choice (raw bytes; a lower bound).

    Fix a position p of the order. Let A(p) be the produced blocks live at p (first to last
    touch, outputs leaving after their last use) and P the persistent blocks (weights, KV) some
    task on the device reads (a task the partition runs on the host, `TaskGraph.host_tasks`,
    reads host memory: a plan moves what only it reads nowhere). Count what each byte costs in
    copies against where it is while task p runs (the device holds at most `device_bytes`
    then):

    - a byte of A(p) not on the device at p was spilled and comes back before its last use: 1;
    - a persistent byte not resident streams at least once per pass: 1, unless it is on the
      device at p, either resident (0) or held there between two of its uses;
    - a persistent byte *spanning* p (read by tasks before p and after p, written by none) that
      is not on the device at p streams twice, once for the reads on each side: 2; held at p,
      1; resident, 0.

    So the copies are at least `sum(value * bytes)` over every byte, less what the bytes on the
    device at p save: at most 1 per byte of A(p) or of a non-spanning block, 2 per byte of a
    spanning one, `device_bytes` bytes in all. The fractional knapsack (the highest savings
    first) gives the bound. With nothing spanning p it is `P + A(p) - device_bytes` (the bound
    this had before); a table read at both ends of a pass (tied embeddings: the gather, then the
    logits) adds what of it exceeds the budget, which must cross twice.

    A block whose reloads may be guarded (`taskgraph.reload_guards`: an expert's weights, copied
    only where the router chose it) crosses at its share s <= 1 in expectation: its values and
    savings are s and 2s. The bound is the largest over two positions: where A peaks, and where
    A plus the spanning bytes peak (`stream_positions`, or `positions` where the caller has
    them)."""
    bound = 0.0
    for live, persistent, across in positions or stream_positions(tg, order):
        items = [(1.0, sum(live))]
        items += [(share * (2 if b in across else 1), nbytes) for b, nbytes, share in persistent]
        bound = max(bound, _unsaved(items, device_bytes, lambda v, nb: v * nb))
    return max(0, round(bound))


def min_stream_copies(tg: TaskGraph, order: list[int], device_bytes: int,
                      positions: list | None = None) -> float:
    """The fewest host->device copies that any plan of this taskgraph and order must make per
    pass under `device_bytes` (in expectation where reloads are guarded; a lower bound). Each
    copy carries one block and pays the link's latency besides its bytes, so no pass streams in
    less than `min_stream_bytes / bandwidth + min_stream_copies * latency`: the least of a sum is
    at least the sum of the leasts.

    The count of `min_stream_bytes`, by block instead of by byte: at a position p, a block of
    A(p) not on the device at p comes back once (1 copy), a persistent block not resident
    streams once (1; a spanning one not on the device at p twice: 2; each times its share where
    guarded), and the blocks on the device at p (`device_bytes` in all) save at most their own
    copies. The fractional knapsack by copies per byte (the smallest blocks first) bounds what
    they save: a plan's blocks held at p are one of its choices. (`positions`: as
    `min_stream_bytes`.)"""
    bound = 0.0
    for live, persistent, across in positions or stream_positions(tg, order):
        items = [(1.0, nbytes) for nbytes in live]
        items += [(share * (2 if b in across else 1), nbytes) for b, nbytes, share in persistent]
        bound = max(bound, _unsaved(items, device_bytes, lambda v, nb: v))
    return max(0.0, round(bound, 9))  # (no rounding noise above a plan's whole count)


def stream_positions(tg: TaskGraph, order: list[int]) -> list:
    """For the two positions p of the stream bounds (where the produced bytes live peak, and
    where they and the persistent bytes spanning p do): (the bytes of each produced block live
    at p, every persistent block read as (block, bytes, share), the persistent blocks spanning
    p)."""
    n = len(order)
    if n == 0:
        return []
    first, last = touches(tg, order)
    shares = {b: key[2] for b, key in reload_guards(tg).items()}
    persistent = [(b.id, b.bytes, shares.get(b.id, 1.0)) for b in tg.input_blocks
                  if b.role in PERSISTENT_ROLES and b.id in first]
    produced = [b for b in first if tg.blocks[b].source is None]
    live = [0] * (n + 1)   # produced bytes live at p
    span = [0.0] * (n + 1)  # expected bytes of the persistent blocks spanning p
    for b in produced:
        live[first[b]] += tg.blocks[b].bytes
        live[last[b] + 1] -= tg.blocks[b].bytes
    spanning = [(b, nbytes, share) for b, nbytes, share in persistent
                if not tg.writers[b] and last[b] - first[b] >= 2]  # (a write may need no copy)
    for b, nbytes, share in spanning:
        span[first[b] + 1] += share * nbytes
        span[last[b]] -= share * nbytes
    for p in range(1, n + 1):
        live[p] += live[p - 1]
        span[p] += span[p - 1]
    positions = {max(range(n), key=lambda p: live[p]),
                 max(range(n), key=lambda p: live[p] + span[p])}
    return [([tg.blocks[b].bytes for b in produced if first[b] <= p <= last[b]], persistent,
             {b for b, _, _ in spanning if first[b] < p < last[b]}) for p in sorted(positions)]


def _unsaved(items: list[tuple[float, int]], room: int,
             cost: Callable[[float, int], float]) -> float:
    """The least total cost of `items` ((copies, bytes) each, costing `cost(copies, bytes)`
    off the device) less what `room` bytes on the device save at most: the fractional knapsack,
    the most saved per byte first."""
    items = [it for it in items if it[1] > 0]  # (a block of no bytes is held for nothing)
    total = sum(cost(v, nb) for v, nb in items)
    saved = 0.0
    for v, nb in sorted(items, key=lambda it: -cost(*it) / it[1]):
        if room <= 0:
            break
        take = min(nb, room)
        saved, room = saved + cost(v, nb) * take / nb, room - take
    return total - saved


def least_disk_bytes(tg: TaskGraph, order: list[int], device_bytes: int,
                     host_bytes: int | None) -> int:
    """The fewest bytes any plan of this taskgraph and order must read from disk per pass with
    `device_bytes` on the device and `host_bytes` of host memory (None: unlimited, 0).

    A persistent byte some task reads (a weight, the KV store) that is not read from disk in a
    pass is held from one pass to the next: resident on the device or pinned in host memory, at
    every moment of the pass. At position p of the order, so is every produced block live at p
    (touched before and after: on the device, or spilled to the host) and every output finished
    before p (the logits, the KV rows a prefill writes: they are the pass's results, kept to
    its end). So held persistent bytes + L(p) <= device + host at every p, and the disk supplies
    at least `P + max_p L(p) - device_bytes - host_bytes`. (The stream bound's disk term, the
    bytes that must cross the link less the host budget, ignores the outputs: a prefill writing
    1 GB of KV rows to the host holds 1 GB fewer weights there.)"""
    if host_bytes is None:
        return 0
    read = {b for t in tg.tasks for b in t.reads}
    held = sum(b.bytes for b in tg.input_blocks if b.role in PERSISTENT_ROLES and b.id in read)
    outputs = {o.block for o in tg.outputs}
    first, last = touches(tg, order)
    delta = [0] * (len(order) + 2)
    for b, p in first.items():
        if tg.blocks[b].source is None:  # produced: live from p, and an output to the end
            delta[p] += tg.blocks[b].bytes
            if b not in outputs:
                delta[last[b] + 1] -= tg.blocks[b].bytes
    most = live = 0
    for d in delta:
        live += d
        most = max(most, live)
    return max(0, held + most - device_bytes - host_bytes)


def disk_block_sizes(tg: TaskGraph) -> tuple[int, ...]:
    """The bytes of each persistent block some task reads, largest first: what a plan may read
    from disk, one read per block (`least_disk_reads`)."""
    read = {b for t in tg.tasks for b in t.reads}
    return tuple(sorted((b.bytes for b in tg.input_blocks
                         if b.role in PERSISTENT_ROLES and b.id in read), reverse=True))


def least_disk_reads(sizes: Sequence[int], disk_bytes: int) -> int | None:
    """The fewest blocks of `sizes` (largest first) whose bytes reach `disk_bytes` (None where
    all of them do not)."""
    if disk_bytes <= 0:
        return 0
    total = 0
    for k, size in enumerate(sizes, 1):
        total += size
        if total >= disk_bytes:
            return k
    return None


def least_disk_staged(sizes: Sequence[int], disk_bytes: int, bandwidth: float,
                      latency: float) -> tuple[float, int, int]:
    """(seconds, reads, staging bytes): the least time in which a disk supplies `disk_bytes`
    (> 0) that no plan can hold on the device or in host memory (counted with the whole host
    budget), for plans whose persistent blocks are `sizes` (`disk_block_sizes`, largest first),
    each read paying `latency` besides its bytes at `bandwidth`.

    A plan reads a block from disk whole, one read per block (a `read` node), into a staging
    buffer in the host arena, which it holds for the whole pass beside the blocks pinned in
    host memory (DESIGN.md, "Tiers"). With m the largest block it reads from disk, its arena
    holds at least m bytes, so host memory holds m bytes fewer of anything else at every
    moment and the disk supplies at least D + m bytes (D = `disk_bytes`), in blocks of at most
    m bytes: at least k(m) reads, the fewest of the largest such blocks whose bytes reach
    D + m (no k blocks hold more). So the disk takes at least (D + m) / B + k(m) L, and no plan
    beats the least of that over the sizes m it could read largest (one with no k(m) cannot
    read that much in such blocks). Over several partitions: each plan's partition reads at
    least the least disk bytes of all, so the least of this over the partitions bounds every
    plan. Tested against every disk set and staging arena of small plans
    (`tests/test_stream_bound.py`)."""
    best = (math.inf, 0, 0)
    for m in sorted(set(sizes)):
        least = least_disk_reads([s for s in sizes if s <= m], disk_bytes + m)
        if least is not None:
            best = min(best, ((disk_bytes + m) / bandwidth + least * latency, least, m))
    if best[0] == math.inf:  # no blocks reach it: no plan reads it (the bytes alone)
        return disk_bytes / bandwidth, 0, 0
    return best


def front_seconds(tg: TaskGraph, order: list[int], seconds: Sequence[float],
                  device_bytes: int, bandwidth: float,
                  waits: Sequence[float] | None = None) -> float:
    """The least time any plan of this taskgraph and order takes per pass, from when its tasks'
    persistent bytes can have crossed the link: the first blocks a pass reads (a table gathered
    at its start, larger than the budget) overlap no compute.

    The tasks run in `order`, one at a time (the device's compute queue), task t for at least
    `seconds[t]` (0 for a task on the host: `TaskGraph.host_tasks`, whose reads are no W); the
    link copies one byte at a time at `bandwidth`. A persistent block no task writes is on the
    device before its first reader starts: resident (on the device for the
    whole pass) or copied in the pass. Let W(t) be the bytes of such blocks first read by the
    tasks up to t in the order, and X the most a resident set can hold: it stays beside every
    task's produced blocks, so X <= device_bytes - max_t A(t), A(t) the bytes of task t's
    non-persistent blocks. Whatever the resident set R, at most min(X, W(t)) of W(t) is
    resident, so at least W(t) - X bytes cross before task t starts, which is then no earlier
    than (W(t) - X) / bandwidth, and the pass no shorter than that plus the seconds of t and
    every task after it:

        pass >= max over t of  max(0, W(t) - X) / bandwidth + sum of seconds[t:]

    Guarded blocks (an expert copied only when chosen) and blocks some task writes (the KV
    rows a pass appends) are left out of W: the bound only falls by it. Where X covers every
    such block it is the compute time, no more. (`waits`: `front_waits` of these arguments,
    where the caller has them.)"""
    if waits is None:
        waits = front_waits(tg, order, device_bytes, bandwidth)
    bound = after = 0.0
    for k in range(len(order) - 1, -1, -1):
        after += seconds[order[k]]
        bound = max(bound, waits[k] + after)
    return bound


def front_waits(tg: TaskGraph, order: list[int], device_bytes: int,
                bandwidth: float) -> list[float]:
    """Position by position of `order`, the earliest any plan can start its task:
    `max(0, W(t) - X) / bandwidth` (`front_seconds`)."""
    guarded = reload_guards(tg)
    on_device = tg.device_read
    counted = {b.id for b in tg.input_blocks if b.role in PERSISTENT_ROLES
               and not tg.writers[b.id] and b.id not in guarded and b.id in on_device}
    persistent = sum(b.bytes for b in tg.input_blocks
                     if b.role in PERSISTENT_ROLES and b.id in on_device)
    seen: set[int] = set()
    first = [0] * len(order)  # W(t), position by position
    most_produced = read = 0
    host = tg.host_tasks
    for k, tid in enumerate(order):
        if tid in host:  # (a host task takes no device memory and reads nothing there)
            first[k] = read
            continue
        t = tg.tasks[tid]
        produced = 0
        for b in dict.fromkeys((*t.reads, t.write)):
            if b in counted:
                if b not in seen:
                    seen.add(b)
                    read += tg.blocks[b].bytes
            elif tg.blocks[b].role not in PERSISTENT_ROLES:
                produced += tg.blocks[b].bytes
        first[k] = read
        most_produced = max(most_produced, produced)
    room = max(0, min(persistent, device_bytes - most_produced))
    return [max(0, w - room) / bandwidth for w in first]


def streamed_bytes(tg: TaskGraph, resident: frozenset[int] = frozenset(),
                   shares: Mapping[int, float] = MappingProxyType({}),
                   readers: Iterable[int] | None = None) -> int:
    """The raw bytes of the persistent blocks that some task (of `readers`, the tasks on the
    device; default: every task but the partition's `host_tasks`) reads and `resident` leaves
    off the device: each crosses the link at least once per pass; with `shares`, the expected
    bytes: a block whose reload the lowering guards at its share (`taskgraph.reload_guards`)."""
    tasks = [tg.tasks[t] for t in (device_tasks(tg) if readers is None else readers)]
    read = {b for t in tasks for b in t.reads}
    return round(sum(b.bytes * shares.get(b.id, 1.0) for b in tg.input_blocks
                     if b.role in PERSISTENT_ROLES and b.id in read and b.id not in resident))


def memory_lower_bound(tg: TaskGraph, resident: frozenset[int]) -> int:
    """The fewest device bytes a plan keeping `resident` on the device can live in (raw bytes):
    the resident blocks, live through the pass, and beside them the largest task's other blocks
    (its reads and its write are live together while it runs). Never above the plan's live peak."""
    kept = sum(tg.blocks[b].bytes for b in resident)
    task = max((sum(tg.blocks[b].bytes for b in {*tg.tasks[t].reads, tg.tasks[t].write}
                    - resident) for t in device_tasks(tg)), default=0)
    return kept + task


def persistent_blocks(tg: TaskGraph) -> frozenset[int]:
    """Every weight and KV-store input block some device task reads: the candidates to stay
    resident (a table only the host gathers from stays there: `host_gather`)."""
    on_device = tg.device_read
    return frozenset(b.id for b in tg.input_blocks
                     if b.role in PERSISTENT_ROLES and b.id in on_device)


def everything_fits(needs: PassNeeds, device_bytes: int) -> bool:
    return (needs.persistent_bytes + needs.input_bytes + needs.activation_peak * 1.05
            + needs.max_working_set) <= device_bytes


def pass_reserve(needs: PassNeeds) -> int:
    """Memory the streaming pass keeps for itself."""
    return needs.activation_peak + needs.max_working_set + 2 * needs.max_task_weights


def first_reads(tg: TaskGraph, order: list[int]) -> dict[int, int]:
    """Each block some device task reads -> the position in `order` of the first device task
    that reads it (tasks on the host: `TaskGraph.host_tasks`, read from host memory)."""
    first: dict[int, int] = {}
    host = tg.host_tasks
    for p, tid in enumerate(order):
        if tid in host:
            continue
        for b in tg.tasks[tid].reads:
            first.setdefault(b, p)
    return first


def choose_resident(tg: TaskGraph, order: list[int], budget: int) -> frozenset[int]:
    """Persistent blocks (weights, KV) to keep resident within `budget` bytes, spread evenly over
    the pass.

    Walking them in order of first use, a block stays resident while the resident share so
    far is below the share the budget allows overall (`budget / weight bytes`), so streamed
    blocks are interleaved with resident ones from the first layer to the last: the host->device
    engine has work from the start of the pass to its end while resident layers compute, instead
    of idling through a resident head (or the compute stream idling through a streamed tail)."""
    first = first_reads(tg, order)
    weights = sorted((b for b in tg.input_blocks if b.role in PERSISTENT_ROLES
                      and b.id in tg.device_read),
                     key=lambda b: (first.get(b.id, len(order)), b.id))
    total = sum(aligned(b.bytes) for b in weights)
    if total == 0 or budget <= 0:
        return frozenset()
    share = min(1.0, budget / total)
    chosen, used, seen = set(), 0, 0
    for b in weights:
        size = aligned(b.bytes)
        seen += size
        if used + size <= budget and used + size <= share * seen + size / 2:
            chosen.add(b.id)
            used += size
    for b in weights:  # fill what rounding left over, earliest first
        size = aligned(b.bytes)
        if b.id not in chosen and used + size <= budget:
            chosen.add(b.id)
            used += size
    return frozenset(chosen)


#: Blocks below 1/SMALL_BLOCK_SHARE of the largest candidate stay resident in a paced set
#: (`paced_resident`): llama-7b's decode step at 14 GB streamed 59 of its 65 norm weights of
#: 8 KB each, 0.59 ms of copy latency on a link that bounds the 15.7 ms step (15.41 ms kept);
#: llama3.1-8b prefill at 8 GB copied 66 (0.66 ms: 178.37 -> 177.71 ms). (It was kept to
#: decode steps while the blocks that stay were placed by stamp: qwen2.5-7b prefill at 16 GB
#: ran 3.5% slower with it then; packed from below (`lowering`), 1.000 with it.)
SMALL_BLOCK_SHARE = 256


def paced_resident(tg: TaskGraph, order: list[int], budget: int, seconds: Sequence[float],
                   largest: int, roles: frozenset[str] = PERSISTENT_ROLES,
                   exclude: frozenset[int] = frozenset(), by_size: bool = False
                   ) -> frozenset[int]:
    """Persistent blocks to keep resident within `budget` bytes, the streamed ones paced by the
    pass's predicted compute time (`seconds`: each task's, by task id) rather than by bytes.

    Let T be the pass's compute time, t(b) the compute before block b's first use and
    S = (persistent bytes) - budget the bytes that must stream. Walking the blocks in order of
    first use, b streams while the bytes streamed so far, b included, stay within S * t(b) / T
    (half a block of slack): the link then carries the same share of S through every stretch of
    the compute, never more than it could have fetched by then. So the first blocks stay
    resident (t = 0: nothing could have been fetched, and compute starts at once while the link
    fetches what follows), and streamed blocks are spread evenly in time, not in bytes: a layer
    that computes long hides more streaming than one that computes briefly. Blocks above
    `largest` bytes stay resident (their prefetch would need that much room free at once, which
    the pass near its activation peak does not have: the lm_head of an 8B model is 1 GB), and
    so do those below 1/SMALL_BLOCK_SHARE of the largest (a norm's weights: each copy costs
    the link its latency, more than its bytes; keeping it streams as many bytes more of a
    block that streams anyway; its pace still goes to the blocks after it); if the walk
    streams less than S, it is walked again with a proportionally faster pace, and what still
    exceeds `budget` streams from the end. Only blocks of `roles` are candidates, and none in
    `exclude` (blocks kept in host memory for the tasks placed there). `by_size`: the pace
    streams the largest blocks it allows (`_streamed_by_size`), not the first ones."""
    first = first_reads(tg, order)
    clock = [0.0]
    host = tg.host_tasks
    for tid in order:  # (the device's compute: a task on the host runs beside it)
        clock.append(clock[-1] + (0.0 if tid in host else seconds[tid]))
    total = clock[-1]
    blocks = sorted((b for b in tg.input_blocks if b.role in roles and b.id not in exclude
                     and b.id in tg.device_read),
                    key=lambda b: (first.get(b.id, len(order)), b.id))
    sizes = [aligned(b.bytes) for b in blocks]
    at = [clock[first.get(b.id, len(order))] for b in blocks]
    must = sum(sizes) - max(0, budget)
    if must <= 0:
        return frozenset(b.id for b in blocks)
    rate = must / total if total > 0 else float("inf")
    small = max(sizes, default=0) // SMALL_BLOCK_SHARE
    for _ in range(8):
        streamed, kept = (_streamed_by_size if by_size else _streamed_in_order)(
            sizes, at, must, rate, largest, small)
        if streamed >= must or rate == float("inf"):
            break
        rate *= must / max(streamed, 1)
    kept = [(blocks[k].id, sizes[k]) for k in kept]
    used = sum(size for _, size in kept)
    chosen = dict(kept)
    for b, size in reversed(kept):
        if used <= budget:
            break
        del chosen[b]
        used -= size
    return frozenset(chosen)


def _streamed_in_order(sizes: list[int], at: list[float], must: int, rate: float,
                       largest: int, small: int) -> tuple[int, list[int]]:
    """`paced_resident`'s walk: (the bytes streamed, the indices of the blocks kept, in order).
    Each block streams while the bytes streamed so far, it included, keep the pace."""
    streamed, kept = 0, []
    for k, (size, t) in enumerate(zip(sizes, at)):
        if streamed < must and size <= largest and streamed + size <= rate * t + size / 2:
            streamed += size  # a small block's pace goes to the blocks after it
            if size > small:
                continue
        kept.append(k)
    return streamed, kept


def _streamed_by_size(sizes: list[int], at: list[float], must: int, rate: float,
                      largest: int, small: int) -> tuple[int, list[int]]:
    """`_streamed_in_order` streaming the largest blocks the pace allows: each block streams,
    and while the bytes streamed so far exceed the pace (or reach `must` without it) the
    smallest block streamed so far stays instead (the latest of equal ones: blocks of one size
    walk as in order). The same bytes in fewer copies, each of which costs the link its latency
    besides its bytes; larger blocks in flight take more room."""
    streamed, kept, going = 0, [], []  # going: a heap of (size, -index) of the streamed blocks
    for k, (size, t) in enumerate(zip(sizes, at)):
        if size <= small or size > largest:
            if size <= small and streamed < must and streamed + size <= rate * t + size / 2:
                streamed += size
            kept.append(k)
            continue
        streamed = take_largest(going, streamed, k, size, rate * t + size / 2, must, kept)
    return streamed, sorted(kept)


def take_largest(going: list, taken: int, k: int, size: int, pace: float, must: int,
                 left: list[int]) -> int:
    """One step of a walk that takes the largest blocks a pace allows (`_streamed_by_size`,
    `tiers._disk_by_size`): block `k` of `size` bytes is taken (pushed on the heap `going` of
    (size, -index)), and while the bytes taken exceed `pace` or reach `must` without the
    smallest taken block, that block is left (its index appended to `left`; the latest of
    equal ones). Returns the bytes taken."""
    heapq.heappush(going, (size, -k))
    taken += size
    while going and (taken > pace or taken - going[0][0] >= must):
        gone, j = heapq.heappop(going)
        taken -= gone
        left.append(-j)
    return taken


def kept_bytes(tg: TaskGraph, blocks) -> int:
    """The device bytes `blocks` take, each aligned."""
    return sum(aligned(tg.blocks[b].bytes) for b in blocks)


def weights_first(tg: TaskGraph, order: list[int], budget: int, seconds: Sequence[float],
                  largest: int) -> frozenset[int]:
    """A paced resident set of `budget` bytes that keeps weights before KV-store blocks: for a
    host budget that cannot hold every streamed block. The runtime keeps the whole KV store in
    host memory whichever blocks the device holds, so a resident KV block saves link bytes only,
    while a resident weight saves the same link bytes and its place in host memory too, which
    would otherwise be read from disk."""
    weights = paced_resident(tg, order, budget, seconds, largest, frozenset({"weight"}))
    used = kept_bytes(tg, weights)
    return weights | paced_resident(tg, order, budget - used, seconds, largest,
                                    frozenset({"cache"}))


def paced_at(tg: TaskGraph, order: list[int], peak: int, budget: int, at: float,
             seconds: Sequence[float], exclude: frozenset = frozenset(),
             by_size: bool = False) -> frozenset:
    """The paced resident set (`resident.paced_resident`) that leaves the pass `at` of the
    budget as room beside `peak` bytes of activations (the blocks of `exclude` kept elsewhere):
    `PassNeeds.activation_peak`, outputs kept to the pass's end, for the coarse room search
    (whose grid was measured so), or `PassNeeds.written_back_peak`, outputs leaving once
    written back as a pass that streams does, for the fine one (which may then keep resident
    the room that the KV rows a prefill writes would otherwise take: 1.07 GB of llama-7b's
    4 GB). `by_size`: as `paced_resident`'s."""
    return paced_resident(tg, order, *_room_at(peak, budget, at, seconds), exclude=exclude,
                          by_size=by_size)


def weights_first_at(tg: TaskGraph, order: list[int], peak: int, budget: int, at: float,
                     seconds: Sequence[float]) -> frozenset:
    """The resident set of `paced_at`'s bytes with weights kept before KV-store blocks
    (`weights_first`): for the room climb of a pass whose host budget sends weights to disk."""
    return weights_first(tg, order, *_room_at(peak, budget, at, seconds))


def _room_at(peak: int, budget: int, at: float, seconds: Sequence[float]
             ) -> tuple[int, Sequence[float], int]:
    """(the resident bytes, `seconds`, the largest streamed block) of a paced set that leaves
    `at` of the budget as room beside `peak` bytes."""
    return int(budget - peak - at * budget), seconds, max(1, int(at * budget / 2))


def guarded_shares(tg: TaskGraph, share: float) -> dict[int, float]:
    """Each block whose reload the lowering guards where its guard is on in at most `share` of
    the passes (an expert copied only when chosen): its expected share of the passes."""
    return {b: key[2] for b, key in reload_guards(tg, share).items()}
