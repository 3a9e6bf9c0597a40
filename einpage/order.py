"""A memory-aware topological order of tasks.

Stage by stage (a stage is a layer: finishing one before starting the next loads each weight once
per pass); inside a stage, depth first: of the ready tasks, the one of the latest graph node goes
first, so consumers finish what producers started before new producers allocate more. Tasks with
no producer task (fills, reads of inputs only) are released only when a consumer needs them,
so they are not made long before their use. Ties break on the task id: deterministic.
"""
from __future__ import annotations

import heapq

from einpage.ir.taskgraph import TaskGraph


def memory_aware_order(tg: TaskGraph) -> list[int]:
    n = len(tg.tasks)
    deps = tg.deps
    consumers: list[list[int]] = [[] for _ in range(n)]
    for t, ds in enumerate(deps):
        for d in ds:
            consumers[d].append(t)
    is_source = [not deps[t] for t in range(n)]
    waiting = [sum(1 for d in deps[t] if not is_source[d]) for t in range(n)]  # non-source deps
    waiting_src = [sum(1 for d in deps[t] if is_source[d]) for t in range(n)]
    released = [False] * n
    heap: list[tuple] = []

    def key(t: int) -> tuple:
        task = tg.tasks[t]
        return (task.stage, -task.node, t)

    def push(t: int) -> None:
        if not released[t]:
            released[t] = True
            heapq.heappush(heap, key(t))

    def demand(t: int) -> None:
        """All non-source deps of `t` are done: release its source deps, or `t` itself."""
        for d in deps[t]:
            if is_source[d]:
                push(d)
        if waiting_src[t] == 0:
            push(t)

    for t in range(n):
        if not is_source[t] and waiting[t] == 0:
            demand(t)
        elif is_source[t] and not consumers[t]:
            push(t)  # a source nothing consumes (e.g. an output fill)
    order: list[int] = []
    while heap:
        t = heapq.heappop(heap)[-1]
        order.append(t)
        for c in consumers[t]:
            if is_source[t]:
                waiting_src[c] -= 1
                if waiting_src[c] == 0 and waiting[c] == 0:
                    push(c)
            else:
                waiting[c] -= 1
                if waiting[c] == 0:
                    demand(c)
    if len(order) != n:
        raise RuntimeError(f"order: {n - len(order)} tasks never became ready (cyclic taskgraph?)")
    return order
