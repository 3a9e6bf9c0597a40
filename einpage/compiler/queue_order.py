"""Copies that wait on the host, moved back in the link's queue.

Every queue runs its nodes in plan order (DESIGN.md, "Stream program"), so a reload of a block
that a task on the host writes (the rows a host gather picks: `host_gather`; the output of host
attention: `placement`) holds every copy behind it until the host has written the block.
llama-7b prefill at 4 GB idled its link for the first 0.65 ms of every pass while the host
gathered the first token block's rows, with the first layer's weights queued behind them. Where
the design says to fix such an order, not the runtime, this pass moves each such reload later
in the plan: past the copies the link ends before the host is done, by the predicted seconds
(the host's queue from the start of the pass, the link's), and never past a node that depends
on it. Where a node that depends on it comes before the host is done and the host's work is
the partition's own (`TaskGraph.host_tasks`: the gathers that open the pass), the copies after
that node whose dependencies are all placed already are moved before it instead, while the
link would end them before the host is done (HOIST_SCAN nodes ahead at most): llama-7b and
qwen2.5-7b prefill at 4 and 3.8 GB idled their link 0.1-0.3 ms at the start of each pass, the
rows of the first token block queued before the first layer's later weights, which the
lowering reserves only once the gathers have run. (Only there: the predicted clocks hold at
the start of a pass, and the copies of host attention's outputs later in a decode step are
on its critical path: moving weights before them by those clocks made llama-7b decode B=16 at
16 GB / 20 GB 35% slower.) Edges are kept (the design's edges make any topological order
correct), so the plan is as valid as before; only its order moves.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Sequence

from einpage.ir.memgraph import ApplyNode, ReloadNode

#: How many nodes past a copy's first dependent are searched for copies to move before it
HOIST_SCAN = 256


def defer_host_copies(nodes: Sequence, host_seconds: Callable[[ApplyNode], float],
                      copy_seconds: Callable[[ReloadNode], float],
                      opens: Callable[[ApplyNode], bool] = lambda n: False) -> list:
    """`nodes` (a plan's, ids = positions) with each reload that depends on an apply on the host
    moved later, past the copies that the link (its predicted clock: the seconds of the reloads
    before them) ends before the host's predicted finish of that apply (its queue's seconds so
    far), and never past its first dependent; where that dependent comes first and every host
    apply the reload waits on `opens` the pass, the copies after it (HOIST_SCAN nodes at most)
    whose dependencies are placed already go before the reload while the link ends them
    before the host is done. Renumbered. The copy waits no longer than its host. `nodes`
    itself where nothing moves."""
    done: dict[int, float] = {}  # host apply id -> its predicted finish (the host's queue alone)
    opening: set[int] = set()  # ... of those, the ones that open the pass
    clock = 0.0
    for n in nodes:
        if isinstance(n, ApplyNode) and n.on_host:
            clock += host_seconds(n)
            done[n.id] = clock
            if opens(n):
                opening.add(n.id)
    if not done:
        return list(nodes)
    out: list = []
    placed: set[int] = set()  # the ids in `out`
    waiting: dict[int, float] = {}  # reload id -> when its host writer is done
    link = 0.0

    def ready(n) -> float:
        return max((done[d] for d in n.deps if d in done), default=0.0)

    def place(n) -> None:
        nonlocal link
        out.append(n)
        placed.add(n.id)
        if isinstance(n, ReloadNode):
            link += copy_seconds(n)

    def hoist(after: int, until: float) -> None:
        """Place the copies after position `after` whose dependencies are placed, while the
        link ends them by `until`."""
        for m in nodes[after + 1:after + 1 + HOIST_SCAN]:
            if link >= until:
                return
            if (isinstance(m, ReloadNode) and m.id not in placed and m.id not in waiting
                    and link + copy_seconds(m) <= until and ready(m) <= link
                    and all(d in placed for d in m.deps)):
                place(m)

    def emit(n) -> None:
        stack = [n]
        while stack:  # (a waiting reload it depends on goes first)
            first = next((d for d in stack[-1].deps if d in waiting), None)
            if first is not None:
                at = waiting.pop(first)
                if at > link and all(d in opening for d in nodes[first].deps if d in done):
                    hoist(n.id, at)  # the link would idle until the host is done
                stack.append(nodes[first])
                continue
            place(stack.pop())

    def release(by: float) -> None:
        for r in [r for r, at in waiting.items() if at <= by]:
            if r in waiting:
                del waiting[r]
                emit(nodes[r])

    for n in nodes:
        if n.id in placed:  # (a copy moved before a waiting one)
            continue
        if isinstance(n, ReloadNode):
            at = ready(n)
            if at > link:
                waiting[n.id] = at
                continue
            if waiting:  # a waiting copy goes first where this one would end after its host
                release(link + copy_seconds(n))  # is done: it waits no longer than its host
                if n.id in placed:  # (moved before that copy as it went)
                    continue
        if waiting:
            emit(n)
            release(link)
        else:  # (the common case: nothing waits)
            place(n)
    for r in list(waiting):
        if r in waiting:
            del waiting[r]
            emit(nodes[r])
    moved = {n.id: k for k, n in enumerate(out) if n.id != k}  # (a few: the copies moved and
    if not moved:                                             # the nodes they moved past)
        return list(nodes)
    return [n if n.id == k and not any(d in moved for d in n.deps) else
            replace(n, id=k, deps=tuple(sorted(moved.get(d, d) for d in n.deps)))
            for k, n in enumerate(out)]
