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

from einpage.ir.taskgraph import TaskGraph

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


__all__ = ["KINDS", "host_blocks", "place_on_host"]
