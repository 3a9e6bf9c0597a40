"""Outputs that drain behind compute: the write-back tail of a pass, and an order that hides it.

A prefill whose outputs are large (a batch's logits over every position: llama3.2-1b at B=16,
S=2048 writes 7.5 GB of them, against 0.6 s of compute) produces them in its last stage, after
every layer; the device->host link then drains them at the end while the compute queue waits
for room (the stage order's pass ran 0.70 s). `tail_seconds` bounds what that costs any plan in
a given order; `drained_order` reorders the batch's rows so that most of the drain overlaps
compute.

Rows: where the batch's rows never meet (a prefill: each sequence's tokens go through every
layer apart; only weights, which every row reads, and constants made from fills, such as the
causal mask and the rotary tables, are shared), the tasks fall into *row components*: the
connected components of the tasks joined by the produced blocks that depend on an input that
is not persistent (the token ids). `drained_order` runs the components in two groups, each
through every stage: the first group's last stage (the logits projection) is spread through the
second group's compute, so its outputs drain while the second group computes, and only the
second group's own outputs are left to drain at the end. Each group streams the weights it does
not keep resident once more (the compiler keeps the order only where its plan is faster)."""
from __future__ import annotations

import math
from typing import Sequence

from einpage.ir.taskgraph import TaskGraph
from einpage.ir.tensors import PERSISTENT_ROLES

#: This share of the second group's compute must cover the first group's drain (20% to
#: spare: the drain competes for room with the blocks the compute streams; llama3.2-1b B=16 at
#: 2.6 GB: 11 rows then 5 ran 613 ms, 12 then 4 619 ms, 13 then 3 637 ms)
DRAIN_COVER = 0.8


def tail_seconds(tg: TaskGraph, order: Sequence[int], seconds: Sequence[float],
                 device_bytes: int, bandwidth: float,
                 waits: Sequence[float] | None = None) -> float:
    """The least time any plan of this taskgraph and order takes per pass, from its outputs'
    write-back: the pass's results that are not persistent (the logits, the KV rows a prefill
    returns) end on the host, or on the device where the pass ends with them there.

    The tasks run in `order`, one at a time, task t for at least `seconds[t]`, the task at
    position t starting no earlier than `waits[t]` (`resident.front_waits`: the persistent
    bytes first read up to it that no resident set can hold, over the link; 0 without them).
    So the task at position u finishes no earlier than F(u), the most over t <= u of waits[t]
    plus the seconds of the tasks from t to u. An output is final when its last writer
    finishes; a copy of it taken earlier is not its value. Let O(u) be the bytes of the outputs
    whose last writer is at position u or later: each is final at F(u) or later, and then
    either crosses the device->host link, one byte at a time at `bandwidth`, or stays on the
    device to the end, where at most `device_bytes` fit. So at least O(u) - device_bytes bytes
    cross after F(u), and

        pass >= max over u of  F(u) + max(0, O(u) - device_bytes) / bandwidth

    With `waits` and u the last position this is the front term (`resident.front_seconds`),
    never less.
    Tasks placed on the host write there and are not counted: this holds for a device-only
    plan, and for the partition's own host tasks (`TaskGraph.host_tasks`), whose outputs are
    left out."""
    host = tg.host_tasks
    outputs = {o.block for o in tg.outputs if tg.blocks[o.block].role not in PERSISTENT_ROLES
               and not (host and all(w in host for w in tg.writers[o.block]))}
    last: dict[int, int] = {}
    for k, t in enumerate(order):
        if tg.tasks[t].write in outputs:
            last[tg.tasks[t].write] = k
    after = [0] * (len(order) + 1)  # O(u): bytes of outputs whose last write is at >= u
    for b, k in last.items():
        after[k] += tg.blocks[b].bytes
    for k in range(len(order) - 1, -1, -1):
        after[k] += after[k + 1]
    bound = done = 0.0
    start = -math.inf  # the most over t <= u of waits[t] less the seconds before t
    for k, t in enumerate(order):
        start = max(start, (waits[k] if waits is not None else 0.0) - done)
        done += seconds[t]
        bound = max(bound, start + done + max(0, after[k] - device_bytes) / bandwidth)
    return bound


def row_components(tg: TaskGraph) -> list[int | None]:
    """Each task's row component (the module's docstring), named by a block of it; None for a
    task shared by every row (a constant made from fills)."""
    rowed = bytearray(len(tg.blocks))
    for b in tg.input_blocks:
        if b.role not in PERSISTENT_ROLES:
            rowed[b.id] = 1
    for t in tg.tasks:  # task ids are a topological order
        if any(rowed[b] for b in t.reads):
            rowed[t.write] = 1
    parent = list(range(len(tg.blocks)))

    def find(b: int) -> int:
        while parent[b] != b:
            parent[b] = parent[parent[b]]
            b = parent[b]
        return b

    for t in tg.tasks:
        joined = [b for b in (*t.reads, t.write) if rowed[b]]
        for b in joined[1:]:
            x, y = find(joined[0]), find(b)
            if x != y:
                parent[x] = y
    return [find(t.write) if rowed[t.write] else None for t in tg.tasks]


def drained_order(tg: TaskGraph, order: Sequence[int], seconds: Sequence[float],
                  bandwidth: float) -> list[int] | None:
    """`order` with the row components in two groups (the module's docstring); None where the
    tasks are one component, nothing drains, or moving the last stage would run a task before
    one it reads.

    The components run in the order of their first task in `order`, the second group the fewest
    last ones whose compute covers the first group's drain (its outputs' bytes over
    `bandwidth`) with DRAIN_COVER to spare. The first group's tasks (and the shared ones) run
    in `order`, but for its last stage, whose tasks are spread through the second group's tasks
    before that group's own last stage, by compute seconds; then that stage. The second group's
    first stage (the embedding gather) runs right after the first group's, so a table both read
    streams once (qwen2.5-7b B=16 at 1.9 GB: 1.805 -> 1.787 s). Every task still follows what
    it reads (checked: stages are a hint): the groups share no produced block but the shared
    ones, which run with the first group where `order` puts them."""
    comp = row_components(tg)
    first: dict[int, int] = {}
    for t in order:
        if comp[t] is not None:
            first.setdefault(comp[t], len(first))
    if len(first) < 2:
        return None
    compute = [0.0] * len(first)
    drain = [0.0] * len(first)
    for t in order:
        if comp[t] is not None:
            compute[first[comp[t]]] += seconds[t]
    for o in tg.outputs:  # every output a row writes (a prefill's KV rows too: a heuristic)
        blk = tg.blocks[o.block]
        writer = tg.writers[o.block]
        if blk.role not in PERSISTENT_ROLES and writer and comp[writer[-1]] is not None:
            drain[first[comp[writer[-1]]]] += blk.bytes / bandwidth
    n = len(first)
    split = next((k for k in range(n - 1, 0, -1)
                  if sum(compute[k:]) * DRAIN_COVER >= sum(drain[:k])), None)
    if split is None or not any(drain[:split]):
        return None
    group = {c: int(i >= split) for c, i in first.items()}
    stage = [t.stage for t in tg.tasks]
    ahead = [t for t in order if comp[t] is None or group[comp[t]] == 0]
    behind = [t for t in order if comp[t] is not None and group[comp[t]] == 1]
    last_a = max(stage[t] for t in ahead)
    last_b = max(stage[t] for t in behind)
    carried = [t for t in ahead if stage[t] == last_a and comp[t] is not None]
    moved = set(carried)
    first_a = min(stage[t] for t in ahead if comp[t] is not None)
    early = [t for t in behind if stage[t] == first_a < last_b]  # (the embedding gather: its
    out = []                                                     # table streamed once)
    for k, t in enumerate(ahead):
        if t not in moved:
            out.append(t)
        if early and stage[t] == first_a and (k + 1 == len(ahead)
                                               or stage[ahead[k + 1]] != first_a):
            out.extend(early)
            early = []
    taken = set(out)
    body = [t for t in behind if stage[t] != last_b and t not in taken]
    out.extend(_spread(carried, body, seconds))
    out.extend(t for t in behind if stage[t] == last_b and t not in taken)
    return out if _follows_reads(tg, out) else None


def _follows_reads(tg: TaskGraph, order: list[int]) -> bool:
    """Whether every task of `order` comes after the tasks it depends on: stages are the
    model's hint, not a promise (a task built outside every stage, reading the last stage's
    outputs, is at stage 0), so an order moved by stage is checked."""
    at = [0] * len(tg.tasks)
    for k, t in enumerate(order):
        at[t] = k
    return all(at[d] < at[t] for t in order for d in tg.deps[t])


def _spread(carried: list[int], body: list[int], seconds: Sequence[float]) -> list[int]:
    """`body` with `carried` spread through it, in their order, by compute seconds: carried
    task j after the body task that brings the body's seconds past (j + 1) / len(carried) of
    its total (the first one first)."""
    total = sum(seconds[t] for t in body)
    out: list[int] = []
    done = 0.0
    j = 0
    for t in body:
        out.append(t)
        done += seconds[t]
        while j < len(carried) and (j + 1) * total <= done * len(carried) * (1 + 1e-12):
            out.append(carried[j])
            j += 1
    out.extend(carried[j:])
    return out

