"""Placement: which tasks run on the host, where the bytes they read lie (DESIGN.md, "Host
compute and quantized weights").

A decode step's attention reads the whole KV store for a few FLOPs per byte, and a
mixture-of-experts layer reads every expert's weights though each token uses two: where those
blocks stay in host memory, computing on them there costs less than carrying them over the link.
A placement starts from a set of persistent blocks kept in host memory (`host_blocks`: the KV
store, the experts' weights) and puts on the host every task that reads one of them, and every
task after those that reads more bytes from the host side than from the device side (so the
softmax around host scores stays with them, and a projection by a device weight goes back to the
device). Every writer of a block runs in one place (a partial sum is never split between two
memories): a block whose writers disagree goes to the device with all of them, and the walk is
repeated until nothing moves. The planner lowers and simulates each candidate beside the
device-only plan and keeps the fastest (`einpage.compiler.driver`).
"""
from __future__ import annotations

from typing import Sequence

from einpage.compiler.lower_options import GUARDED_RELOAD_SHARE
from einpage.ir.taskgraph import TaskGraph, reload_guards

#: the candidate sets of blocks kept in host memory, by name (`host_blocks`)
KINDS = ("kv", "experts", "kv+experts")


def host_blocks(tg: TaskGraph, kind: str) -> frozenset[int]:
    """The persistent blocks candidate `kind` keeps in host memory: the KV store's ("kv"), the
    experts' weights ("experts": a weight named `...experts.<e>...`), or both."""
    parts = kind.split("+")
    out = set()
    for b in tg.input_blocks:
        if "kv" in parts and b.role == "cache":
            out.add(b.id)
        elif ("experts" in parts and b.role == "weight" and b.source is not None
              and ".experts." in f".{b.source.input}"):
            out.add(b.id)
    read = {b for t in tg.tasks for b in t.reads}
    return frozenset(out & read)


def place_on_host(tg: TaskGraph, order: list[int], kept: frozenset[int]) -> frozenset[int]:
    """The tasks that run on the host when the blocks `kept` stay in host memory (see the
    module docstring). Deterministic; empty when `kept` is."""
    if not kept:
        return frozenset()
    tasks, blocks, writers = tg.tasks, tg.blocks, tg.writers
    seeds = {t.id for t in tasks if any(b in kept for b in t.reads)}
    host = set(seeds)
    device: set[int] = set()  # writers of a block whose writers disagreed: never moved again
    for _ in range(len(tasks)):
        def hosted(b: int) -> bool:
            return b in kept or (bool(writers[b]) and all(w in host for w in writers[b]))

        for tid in order:  # readers come after every writer of what they read
            if tid in seeds or tid in device:
                continue
            side = [0, 0]  # bytes read from the device side, from the host side
            for b in tasks[tid].reads:
                side[hosted(b)] += blocks[b].bytes
            if side[1] > side[0]:
                host.add(tid)
            else:
                host.discard(tid)
        split = [w for b in {tasks[t].write for t in host}
                 if not all(x in host for x in writers[b]) for w in writers[b]]
        if not split:
            break
        host.difference_update(split)
        seeds.difference_update(split)
        device.update(split)
    return frozenset(host)


def critical_path(tg: TaskGraph, order: Sequence[int], seconds: Sequence[float]) -> float:
    """The longest chain of tasks in `seconds` (each task after every writer of each block it
    reads, an accumulating write after the block's earlier writers): no plan of the taskgraph
    runs a pass faster with its tasks where `seconds` prices them (each on the device or the
    host), however its blocks move (a transfer only lengthens a chain). `order` is
    topological (readers after every writer of what they read).
    Where a placement moves a decode step's attention to the host, its host and device tasks
    alternate layer by layer, and the chain is their sum."""
    ready = [0.0] * len(tg.blocks)  # when the writers of each block seen so far are done
    longest = 0.0
    for tid in order:
        t = tg.tasks[tid]
        start = max((ready[b] for b in t.reads), default=0.0)
        if t.accumulate and ready[t.write] > start:
            start = ready[t.write]
        end = start + seconds[tid]
        if end > ready[t.write]:
            ready[t.write] = end
        if end > longest:
            longest = end
    return longest


def separated_seconds(tg: TaskGraph, on_host: frozenset[int], seconds: Sequence[float]) -> float:
    """The host's compute and the device's between it: no plan of the placement `on_host` (a
    pass whose tasks take `seconds`, each where the placement runs it; the partition's own
    `host_tasks` run on the host too) takes less.

    The host runs its tasks one at a time (one queue), and so does the device. Call a device
    task *separating* where every host task is an ancestor or a descendant of it (each task
    after every writer of each block it reads). While a separating task runs, no host task can:
    each is done before it starts, or starts after it ends. So the time some host task runs and
    the time some separating task runs are disjoint, and each is at least its tasks' sum:

        pass >= sum of the host tasks' seconds + sum of the separating tasks' seconds

    A decode step with its attention on the host alternates: every row's attention of a layer
    is read by the layer's output projection, and the next layer's attention reads what the
    projections, the feed-forward and the next query projection made of it, so those device
    tasks separate (llama-7b B=16 at 16 GB with a 20 GB host: 119.5 ms of host attention and
    9.6 ms of device tasks between: 129.1 ms, where the host alone bounds 119.5). (Only data
    edges are counted: a plan adds edges, never drops one.)"""
    tasks, writers = tg.tasks, tg.writers
    bit: dict[int, int] = {}
    for t in sorted(on_host | tg.host_tasks):  # (the partition's own: its gathers)
        bit[t] = 1 << len(bit)
    if not bit:
        return 0.0
    every = (1 << len(bit)) - 1
    before: list[int] = [0] * len(tasks)  # the host tasks each task comes after (a bit each)
    deps: list[set[int]] = []
    for t in tasks:  # (task ids are a topological order)
        mine = {w for b in t.reads for w in writers[b] if w != t.id}
        deps.append(mine)
        seen = 0
        for w in mine:
            seen |= before[w] | bit.get(w, 0)
        before[t.id] = seen
    after: list[int] = [0] * len(tasks)  # the host tasks each task comes before
    for t in reversed(tasks):
        below = after[t.id] | bit.get(t.id, 0)
        for w in deps[t.id]:
            after[w] |= below
    return (sum(seconds[t] for t in bit)
            + sum(seconds[t.id] for t in tasks
                  if t.id not in bit and (before[t.id] | after[t.id]) == every))


#: Shares tried around the balanced one (`balanced_shares`)
SHARE_STEPS = (1.0,)


def balanced_shares(tg: TaskGraph, kept: frozenset[int], on_host: frozenset[int],
                    seconds: Sequence[float], profile,
                    resident: frozenset[int] = frozenset(),
                    guarded: float = GUARDED_RELOAD_SHARE) -> list[float]:
    """Shares of `kept` (blocks the device must otherwise stream) to keep in host memory so
    that the host computes while the link copies the rest. Where the host takes H seconds for
    the tasks of all of them (`on_host`, `place_on_host` of them, priced `seconds`), the link L
    to copy them all and Lr to copy those the device-only plan keeps resident (`resident`), a
    share f keeps the host busy f H and the link (1 - f) L - Lr, equal at f = (L - Lr) /
    (H + L); the device-only plan's resident set overstates what a placed plan keeps of `kept`
    (it searches its own), so the balance lies between that share and L / (H + L): both ends
    and the middle are tried, each with its neighbours (`SHARE_STEPS`), each below 1 (all of
    them is a candidate of its own). The link counts a block the lowering reloads under a
    guard (an expert copied only when chosen: on in at most `guarded` of the passes) at its
    expected share, as H counts a guarded task. None where nothing is kept or there is no host
    to balance."""
    if not kept or profile.host is None:
        return []
    host = sum(seconds[t] for t in on_host)
    shares = {b: key[2] for b, key in reload_guards(tg, guarded).items()}

    def link(blocks) -> float:
        return sum(tg.blocks[b].bytes * shares.get(b, 1.0) for b in blocks) / profile.h2d_bandwidth

    every = link(kept)
    if host <= 0 or every <= 0:
        return []
    low, high = max(0.0, every - link(kept & resident)) / (host + every), every / (host + every)
    return sorted(r for r in {round(f * k, 3) for f in {low, (low + high) / 2, high}
                              for k in SHARE_STEPS} if 0 < r < 1)


def share_of(tg: TaskGraph, blocks: frozenset[int], share: float) -> frozenset[int]:
    """About `share` of `blocks` in whole groups (`groups`: blocks whose tasks add into the
    same block go together, or the writers of that block would disagree and all go to the
    device), the groups spread evenly in id order (layer by layer, and over each layer's), so
    that every layer has work for both the host and the link."""
    out = set()
    for i, group in enumerate(groups(tg, blocks)):
        if int((i + 1) * share) > int(i * share):
            out |= group
    return frozenset(out)


def streamed_groups(tg: TaskGraph, kept: frozenset[int], resident: frozenset[int]
                    ) -> list[frozenset[int]]:
    """The blocks of `kept` a device-only plan with `resident` streams, in whole groups: the
    groups it streams entirely (what it keeps resident stays on the device with the rest of
    its group), and the groups it streams any of (moved whole: their resident part too)."""
    parts = [g for g in groups(tg, kept) if g - resident]
    return [frozenset().union(*[g for g in parts if not g & resident]),
            frozenset().union(*parts)]


def groups(tg: TaskGraph, blocks: frozenset[int]) -> list[frozenset[int]]:
    """`blocks` in groups that must stay in one place: two blocks are together where one task
    reads both or two tasks that read them write the same block (a sum split over them). In
    order of their least block id."""
    parent = {b: b for b in blocks}

    def root(b: int) -> int:
        while parent[b] != b:
            parent[b] = parent[parent[b]]
            b = parent[b]
        return b

    first: dict[int, int] = {}  # written block -> a kept block one of its writers reads
    for t in tg.tasks:
        mine = [b for b in t.reads if b in parent]
        if not mine:
            continue
        for b in mine[1:] + ([first[t.write]] if t.write in first else []):
            parent[root(b)] = root(mine[0])
        first.setdefault(t.write, mine[0])
    out: dict[int, set[int]] = {}
    for b in sorted(blocks):
        out.setdefault(root(b), set()).add(b)
    return sorted((frozenset(g) for g in out.values()), key=min)


__all__ = ["KINDS", "SHARE_STEPS", "balanced_shares", "groups", "host_blocks",
           "place_on_host", "separated_seconds", "share_of", "streamed_groups"]
