"""Gathers on the host: a pass that does not fit on the device picks its embedding rows where the
table lies.

A token embedding gathers B x S rows of a V-row table: 16 MB of rows from llama3.1-8b's 1.05 GB
table in a 2048-token prefill, 8 KB a token in a decode step. On the device the gather needs the
whole table there: resident (a gigabyte of the budget held for megabytes of rows) or streamed
every pass (and a tied table, read again by the logits at the end of the pass, crosses twice).
The host holds every weight anyway (the checkpoint, pinned or memory-mapped), so it reads only
the rows it picks; the rows then cross the link as any block a host task writes does
(`lowering`: a task placed on the host). So where a pass does not fit on the device, every
gather whose table is a weight input and whose ids are an input runs on the host
(`TaskGraph.host_tasks`) where the host picks its rows in less time than its table takes over
the link (`host_gathers`: llama-7b at B=16 and S=2048 gathers 268 MB of rows from its 262 MB
table, which the link carries faster than one core picks them; a slow host gathers none).

Only where the link (nearly) binds the pass (`rungs.Partitions`: the bytes no plan can keep on
the device take the link at least LINK_SHARE of its compute): the room a table frees, or the
table's own bytes, shorten a pass only then, while the host's rows add a copy before the first
layer (qwen3-8b prefill at 16 GB, compute-bound: 121.37 -> 121.41 ms gathered on the host).
And only where the host budget holds every persistent block: a table the host gathers from
stays in host memory, and where weights go to disk its place is read from disk instead
(llama-7b prefill at 4 GB with an 8 GB host: 997.7 -> 1005.6 ms).

The problem's bound counts what the device must read (`resident`: persistent blocks some device
task reads; the device's compute), so it holds for these plans and for plans that gather on the
device alike: a host gather only drops reads and tasks from what the device does.
"""
from __future__ import annotations

from dataclasses import replace

from einpage.ir.ops import GatherOp
from einpage.ir.taskgraph import TaskGraph
from einpage.predict.cost import host_apply_seconds
from einpage.predict.devices import DeviceProfile

#: Gathers go to the host only where the bytes no plan can keep on the device take the link at
#: least this share of the pass's compute: llama3.2-1b prefill at 310 MB, 0.93 by its bound,
#: streams its tied table twice and is link-bound in every plan (74.97 -> 62.04 ms gathered on
#: the host); the compute-bound passes of the planner grid are at 0.5 or less
LINK_SHARE = 0.9


def host_gathers(tg: TaskGraph, profile: DeviceProfile, room: int | None = None
                 ) -> frozenset[int]:
    """The gather tasks that run on the host (see the module docstring): by graph node, every
    task of a gather whose table blocks are weight inputs and whose ids blocks are inputs, each
    block it writes written by those tasks alone, where the host's seconds for all of them
    (`cost.host_apply_seconds` on `profile.host`) are less than its table's bytes over the
    link; of a table other tasks read too (tied to the logits), only where it is larger than
    `room` (the most the device can keep resident; None: no limit): a table that can stay
    resident for the logits costs the device gather nothing (llama3.2-3b decode B=4 at
    1.6 GB: its 788 MB table resident, 177.31 ms; gathered on the host 178.67 ms)."""
    blocks, writers = tg.blocks, tg.writers
    readers: dict[int, set[int]] = {}
    for t in tg.tasks:
        for b in t.reads:
            readers.setdefault(b, set()).add(t.node)
    by_node: dict[int, list] = {}
    for t in tg.tasks:
        if isinstance(t.op, GatherOp):
            by_node.setdefault(t.node, []).append(t)
    out: set[int] = set()
    for tasks in by_node.values():
        ids = {t.id for t in tasks}
        tables = {t.reads[0] for t in tasks}
        if not (all(blocks[b].source is not None and blocks[b].role == "weight" for b in tables)
                and all(blocks[t.reads[1]].source is not None for t in tasks)
                and all(w in ids for t in tasks for w in writers[t.write])):
            continue
        table = sum(blocks[b].bytes for b in tables)
        shared = any(readers[b] != {tasks[0].node} for b in tables)
        if shared and room is not None and table <= room:
            continue
        host_s = sum(host_apply_seconds(profile.host, t.op, [blocks[b] for b in t.reads],
                                        blocks[t.write], t.accumulate) for t in tasks)
        if host_s < table / profile.h2d_bandwidth:
            out.update(ids)
    return frozenset(out)


def with_host_gathers(tg: TaskGraph, profile: DeviceProfile, room: int | None = None
                      ) -> TaskGraph:
    """`tg` with its host gathers (`host_gathers`) as its `host_tasks`; `tg` itself where there
    are none."""
    host = host_gathers(tg, profile, room)
    return replace(tg, host_tasks=host) if host else tg
