"""Copies that wait on the host, moved back in the link's queue.

Every queue runs its nodes in plan order (DESIGN.md, "Stream program"), so a reload of a block
that a task on the host writes (the rows a host gather picks: `host_gather`; the output of host
attention: `placement`) holds every copy behind it until the host has written the block.
llama-7b prefill at 4 GB idled its link for the first 0.65 ms of every pass while the host
gathered the first token block's rows, with the first layer's weights queued behind them. Where
the design says to fix such an order, not the runtime, this pass moves each such reload later
in the plan: past the copies the link ends before the host is done, by the predicted seconds
(the host's queue from the start of the pass, the link's), and never past a node that depends
on it. Edges are kept, so the plan is as valid as before; only its order moves.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Sequence

from einpage.ir.memgraph import ApplyNode, ReloadNode


def defer_host_copies(nodes: Sequence, host_seconds: Callable[[ApplyNode], float],
                      copy_seconds: Callable[[ReloadNode], float]) -> list:
    """`nodes` (a plan's, ids = positions) with each reload that depends on an apply on the host
    moved later, past the copies that the link (its predicted clock: the seconds of the reloads
    before them) ends before the host's predicted finish of that apply (its queue's seconds so
    far), and never past its first dependent; renumbered. The copy waits no longer than its
    host. `nodes` itself where nothing moves."""
    done: dict[int, float] = {}  # host apply id -> its predicted finish (the host's queue alone)
    clock = 0.0
    for n in nodes:
        if isinstance(n, ApplyNode) and n.on_host:
            clock += host_seconds(n)
            done[n.id] = clock
    if not done:
        return list(nodes)
    out: list = []
    waiting: dict[int, float] = {}  # reload id -> when its host writer is done
    link = 0.0

    def emit(n) -> None:
        nonlocal link
        stack = [n]
        while stack:  # (a waiting reload it depends on goes first)
            first = next((d for d in stack[-1].deps if d in waiting), None)
            if first is not None:
                del waiting[first]
                stack.append(nodes[first])
                continue
            top = stack.pop()
            out.append(top)
            if isinstance(top, ReloadNode):
                link += copy_seconds(top)

    def release(by: float) -> None:
        for r in [r for r, at in waiting.items() if at <= by]:
            if r in waiting:
                del waiting[r]
                emit(nodes[r])

    for n in nodes:
        if isinstance(n, ReloadNode):
            ready = max((done[d] for d in n.deps if d in done), default=0.0)
            if ready > link:
                waiting[n.id] = ready
                continue
            if waiting:  # a waiting copy goes first where this one would end after its host
                release(link + copy_seconds(n))  # is done: it waits no longer than its host
        if waiting:
            emit(n)
            release(link)
        else:  # (the common case: nothing waits)
            out.append(n)
            if isinstance(n, ReloadNode):
                link += copy_seconds(n)
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
