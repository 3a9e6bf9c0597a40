"""A memory-aware topological order of tasks: demand-driven, stage by stage.

Stages (layers) run one after another, so each weight block is loaded once per pass. Inside a
stage the order is the post-order of a depth-first walk from the stage's *exits* (tasks no task of
the stage consumes: in LLaMA, the layer's output rows), exits in id order: each task is preceded
exactly by what it needs that is not done yet; exits that read a weight block themselves run
grouped by that block (the logits projection's blocks: each streamed table block once for every
query block, not once per query block), and where such exits end sums over weight blocks (the
embedding gather: each token block's rows summed over the table's blocks) their sums run in
lockstep, term by term, so each table block is read once for every token block. So one row
block (a batch or sequence block, and inside attention one head) goes through the layer as far
as dependencies allow before the next starts; a reduction's row is finished (all its tiles, then the ops that read it again) before
another row is begun; tasks with no producer (fills) run just before their first consumer; and an
activation that must wait for later work (a query block's keys that a later row projects) is only
what that row needs. Among a task's producers, the one it accumulates onto goes first (tiles of a
sum run in order), then the rest by task id. Deterministic: every choice ends in a task id.

`by_weight=True` orders each stage by its weight blocks instead: the walk starts from every task
that reads the stage's first weight block (in the order above), then from every reader of the
next, and so on, then from the stage's other tasks in the order above. A weight block read by
every row block of a layer (a prefill whose sequence is cut: a projection's blocks, once per
query block) is then read by its readers one after another and can be freed at once, where the
order above holds it from the first row block's use to the last, through the rest of the layer
(llama3.2-1b prefill at 310 MB: each layer's 120 MB of weights held through the whole layer, in
a 310 MB budget); the cost is every row block's inputs and outputs of those readers live
together. The compiler plans a partition in it too where some weight block's readers in one
stage run apart (`driver._read_apart`).
"""
from __future__ import annotations

from einpage.errors import PlanError
from einpage.ir.taskgraph import TaskGraph


def memory_aware_order(tg: TaskGraph, by_weight: bool = False) -> list[int]:
    """The order (above); `by_weight`: each stage's walk started from the readers of its weight
    blocks, block by block."""
    order = _walk(tg)
    return _walk(tg, roots=_weight_roots(tg, order)) if by_weight else order


def _weight_roots(tg: TaskGraph, order: list[int]) -> list[int]:
    """Roots for a walk that runs the readers of each weight block of a stage together: per
    stage (a run of `order`), the readers of each weight block it reads, blocks in the order of
    their first read, readers in `order`; then the stage's tasks in `order` (what no weight
    reader needs)."""
    blocks, tasks = tg.blocks, tg.tasks
    roots: list[int] = []
    k = 0
    while k < len(order):
        stage = tasks[order[k]].stage
        j = k
        while j < len(order) and tasks[order[j]].stage == stage:
            j += 1
        readers: dict[int, list[int]] = {}
        for t in order[k:j]:
            for b in dict.fromkeys(tasks[t].reads):
                if blocks[b].role == "weight":
                    readers.setdefault(b, []).append(t)
        for ts in readers.values():
            roots.extend(ts)
        roots.extend(order[k:j])
        k = j
    return roots


def _walk(tg: TaskGraph, roots: list[int] | None = None) -> list[int]:
    """The post-order of the depth-first walks from `roots` (default: the stages' exits, as the
    module says)."""
    n = len(tg.tasks)
    deps = tg.deps
    writers = tg.writers
    stage = [t.stage for t in tg.tasks]
    consumed_in_stage = [False] * n
    for t in range(n):
        for d in deps[t]:
            if stage[d] == stage[t]:
                consumed_in_stage[d] = True
    blocks, host = tg.blocks, tg.host_tasks

    def weight_group(t: int) -> int:
        """The first weight block an exit reads itself (-1: none, or a task on the host, which
        reads host memory): exits that read one weight block run one after another, so a
        streamed block is loaded once for all of them."""
        if t in host:  # (a host gather: each token block's rows summed before the next's)
            return -1
        return next((b for b in tg.tasks[t].reads if blocks[b].role == "weight"), -1)

    onto = [-1] * n  # the writer an accumulating task adds onto
    for ws in writers:
        for prev, t in zip(ws, ws[1:]):
            onto[t] = prev
    if roots is None:
        exits = sorted((t for t in range(n) if not consumed_in_stage[t]),
                       key=lambda t: (stage[t], weight_group(t), t))
        roots = _lockstep(exits, lambda t: (stage[t], weight_group(t)), onto, stage,
                          lambda t: blocks[tg.tasks[t].write].bytes, lambda b: blocks[b].bytes)

    def producers(t: int) -> list[int]:
        if onto[t] < 0:
            return list(deps[t])
        return [onto[t]] + [d for d in deps[t] if d != onto[t]]

    done = [False] * n
    entered = [False] * n
    order: list[int] = []
    for root in roots:
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


#: the most weight blocks' bytes the partial sums run in lockstep may hold (`_lockstep`)
LOCKSTEP_ROOM = 2


def _lockstep(exits: list[int], group, onto: list[int], stage: list[int], written,
              weight_bytes) -> list[int]:
    """The walk's roots: `exits` in order, except that a run of exits of one weight group
    (`group(t)[1] >= 0`) that each end a sum of equally many terms (chains of `onto` in their
    stage) becomes its terms in lockstep: every exit's first term, then every exit's second, ...
    A term's walk runs its own inputs first, so the terms that read one weight block run
    together and a streamed block is loaded once for all the sums, while one partial sum per
    exit stays live: only where those partials (`written(t)` bytes each) take at most
    LOCKSTEP_ROOM weight blocks (`weight_bytes(b)`), so that a plan that had room for one sum
    at a time still has room (an embedding gather: 4 token blocks of 4 MB over 16 MB table
    blocks)."""
    roots: list[int] = []
    k = 0
    while k < len(exits):
        key = group(exits[k])
        j = k
        while j < len(exits) and group(exits[j]) == key:
            j += 1
        run = exits[k:j]
        chains = [_chain(t, onto, stage) for t in run]
        if key[1] >= 0 and len(run) > 1 and len({len(c) for c in chains}) == 1 \
                and len(chains[0]) > 1 \
                and sum(written(t) for t in run) <= LOCKSTEP_ROOM * weight_bytes(key[1]):
            roots.extend(c[i] for i in range(len(chains[0])) for c in chains)
        else:
            roots.extend(run)
        k = j
    return roots


def _chain(t: int, onto: list[int], stage: list[int]) -> list[int]:
    """The terms of the sum task `t` ends, first to last, within its stage."""
    chain = [t]
    while onto[chain[-1]] >= 0 and stage[onto[chain[-1]]] == stage[t]:
        chain.append(onto[chain[-1]])
    return chain[::-1]


def check_order(tg: TaskGraph, order: list[int]) -> None:
    """PlanError unless `order` lists every task of `tg` once, each after its dependencies."""
    if sorted(order) != list(range(len(tg.tasks))):
        raise PlanError(f"order lists {len(order)} tasks, expected each of the {len(tg.tasks)} "
                        "tasks once")
    position = {tid: p for p, tid in enumerate(order)}
    for p, tid in enumerate(order):
        late = [d for d in tg.deps[tid] if position[d] > p]
        if late:
            raise PlanError(f"order runs task {tid} at position {p} before task {late[0]} it "
                            f"depends on (position {position[late[0]]})")
