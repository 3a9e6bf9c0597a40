"""A memory-aware topological order of tasks: demand-driven, stage by stage.

Stages (layers) run one after another, so each weight block is loaded once per pass. Inside a
stage the order is the post-order of a depth-first walk from the stage's *exits* (tasks no task of
the stage consumes: in LLaMA, the layer's output rows), exits in id order: each task is preceded
exactly by what it needs that is not done yet; exits that read a weight block themselves run
grouped by that block (the logits projection's blocks: each streamed table block once for every
query block, not once per query block). So one row block (a batch or sequence block, and
inside attention one head) goes through the layer as far as dependencies allow before the next
starts; a reduction's row is finished (all its tiles, then the ops that read it again) before
another row is begun; tasks with no producer (fills) run just before their first consumer; and an
activation that must wait for later work (a query block's keys that a later row projects) is only
what that row needs. Among a task's producers, the one it accumulates onto goes first (tiles of a
sum run in order), then the rest by task id. Deterministic: every choice ends in a task id.
"""
from __future__ import annotations

from einpage.ir.taskgraph import TaskGraph


def memory_aware_order(tg: TaskGraph) -> list[int]:
    n = len(tg.tasks)
    deps = tg.deps
    writers = tg.writers
    stage = [t.stage for t in tg.tasks]
    consumed_in_stage = [False] * n
    for t in range(n):
        for d in deps[t]:
            if stage[d] == stage[t]:
                consumed_in_stage[d] = True
    blocks = tg.blocks

    def weight_group(t: int) -> int:
        """The first weight block an exit reads itself (-1: none): exits that read one weight
        block run one after another, so a streamed block is loaded once for all of them."""
        return next((b for b in tg.tasks[t].reads if blocks[b].role == "weight"), -1)

    exits = sorted((t for t in range(n) if not consumed_in_stage[t]),
                   key=lambda t: (stage[t], weight_group(t), t))
    onto = [-1] * n  # the writer an accumulating task adds onto
    for ws in writers:
        for prev, t in zip(ws, ws[1:]):
            onto[t] = prev

    def producers(t: int) -> list[int]:
        if onto[t] < 0:
            return list(deps[t])
        return [onto[t]] + [d for d in deps[t] if d != onto[t]]

    done = [False] * n
    entered = [False] * n
    order: list[int] = []
    for root in exits:
        if done[root]:
            continue
        stack = [(root, producers(root), 0)]
        entered[root] = True
        while stack:
            t, todo, k = stack[-1]
            while k < len(todo) and done[todo[k]]:
                k += 1
            if k < len(todo):
                d = todo[k]
                stack[-1] = (t, todo, k + 1)
                if entered[d]:
                    raise RuntimeError(f"order: task {d} depends on itself (cyclic taskgraph?)")
                entered[d] = True
                stack.append((d, producers(d), 0))
                continue
            stack.pop()
            done[t] = True
            order.append(t)
    if len(order) != n:
        raise RuntimeError(f"order: {n - len(order)} tasks never became ready (cyclic taskgraph?)")
    return order
