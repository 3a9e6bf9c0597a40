"""Lowering: `TaskGraph` + order -> `MemGraph`, by simulated execution with two horizons.

The *allocation horizon* `a` walks the order reserving memory: the blocks task `a` reads that are
not on the device are reloaded (prefetch) and its output is allocated. The *execution horizon*
`e <= a` emits the apply of task `e` and frees the blocks it used for the last time. While the
next task's memory can be had without evicting (and the look-ahead limit allows), `a` advances;
otherwise, if `a > e`, `e` advances and frees memory; if `a == e`, blocks are evicted by the
policy (a contiguous address window, so fragmentation cannot block the allocation). Eviction is
clean for blocks with a valid host copy (weights, activations offloaded and unchanged since):
a free with no transfer.

In the thesis' terms: `_allocate` is simMalloc, a reload is simMallocForceReld, and `_make_room`
is simMallocOffld.

Resident blocks (weights that stay on the device for every pass) are placed at fixed offsets at
the bottom of the arena as `input at device` and never freed or evicted.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

from einpage.compiler.allocator import Allocation, Allocator, aligned
from einpage.compiler.policies import Candidate, Policy
from einpage.errors import BudgetError
from einpage.ir.memgraph import (Access, ApplyNode, FreeNode, InputNode, MemGraph, OffloadNode,
                                 OutputRef, ReloadNode, TensorInfo)
from einpage.ir.ops import op_text
from einpage.ir.taskgraph import TaskGraph
from einpage.units import format_size


@dataclass(frozen=True)
class LowerOptions:
    device_bytes: int
    policy: Policy
    resident: frozenset[int] = frozenset()       # weight blocks kept on the device
    inputs_at_device: bool = False               # activation/cache inputs start on the device
    outputs_to_host: bool = False                # write outputs back as soon as they are final
    lookahead_bytes: int | None = None           # cap on bytes reserved ahead of execution
    lookahead_seconds: float | None = None       # cap on predicted compute ahead of execution
    task_seconds: tuple[float, ...] = ()         # predicted seconds of each task, by task id
    progress: object = None                      # callable(done_tasks, total_tasks) or None


def working_set(tg: TaskGraph, task_id: int) -> int:
    t = tg.tasks[task_id]
    return sum(aligned(tg.blocks[b].bytes) for b in set(t.reads) | {t.write})


class _Lowering:
    def __init__(self, tg: TaskGraph, order: list[int], opt: LowerOptions):
        self.tg, self.order, self.opt, self.policy = tg, order, opt, opt.policy
        self.n = len(order)
        nb = len(tg.blocks)
        self.nodes: list = []
        self.uses: list[list[int]] = [[] for _ in range(nb)]
        for p, tid in enumerate(order):
            t = tg.tasks[tid]
            for b in {*t.reads, t.write}:
                self.uses[b].append(p)
        self.is_output = [False] * nb
        for o in tg.outputs:
            self.is_output[o.block] = True
        self.size = [aligned(b.bytes) for b in tg.blocks]
        self.offset: list[int | None] = [None] * nb
        self.last_writer: list[int | None] = [None] * nb
        self.accesses: list[list[int]] = [[] for _ in range(nb)]
        self.since_write: list[list[int]] = [[] for _ in range(nb)]
        self.host_node: list[int | None] = [None] * nb
        self.host_valid = [False] * nb
        self.pins = [0] * nb
        self.last_touch = [-1] * nb
        self.last_free: list[int | None] = [None] * nb  # end of a block's previous instance
        self.pending: dict[int, Allocation] = {}
        self.live: set[int] = set()  # blocks with a device instance (or reservation), not resident
        self.stage_pins: dict[int, list[int]] = {}
        self.stage_last: dict[int, int] = {}
        for p, tid in enumerate(order):
            self.stage_last[tg.tasks[tid].stage] = p
        resident_bytes = sum(self.size[b] for b in opt.resident)
        if resident_bytes > opt.device_bytes:
            raise BudgetError(f"resident weights need {format_size(resident_bytes)}, more than the "
                              f"budget {format_size(opt.device_bytes)}", resident_bytes,
                              opt.device_bytes)
        self.resident_bytes = resident_bytes
        self.alloc = Allocator(resident_bytes, opt.device_bytes)

    # ------------------------------------------------------------ emission
    def emit(self, node) -> int:
        self.nodes.append(node)
        return node.id

    def _next_id(self) -> int:
        return len(self.nodes)

    def next_use(self, b: int, p: int) -> int:
        uses = self.uses[b]
        k = bisect.bisect_left(uses, p)
        return uses[k] if k < len(uses) else self.n

    # ------------------------------------------------------------ start
    def start(self) -> None:
        tg, opt = self.tg, self.opt
        at = 0
        for blk in tg.input_blocks:
            b = blk.id
            if b in opt.resident:
                nid = self.emit(InputNode(self._next_id(), b, "device", at))
                self.offset[b], at = at, at + self.size[b]
                self.last_writer[b] = nid
                self.accesses[b] = [nid]
                self.host_valid[b] = True
            elif opt.inputs_at_device and blk.role != "weight" and self.uses[b]:
                a = self.alloc.allocate(self.size[b])
                if a is None:
                    raise BudgetError("inputs do not fit on the device", self.size[b], 0)
                nid = self.emit(InputNode(self._next_id(), b, "device", a.offset))
                self._created(b, a.offset, nid)
            else:
                nid = self.emit(InputNode(self._next_id(), b, "host"))
                self.host_node[b], self.host_valid[b] = nid, True

    def _created(self, b: int, offset: int, nid: int) -> None:
        self.offset[b] = offset
        self.last_writer[b] = nid
        self.accesses[b] = [nid]
        self.since_write[b] = []
        self.live.add(b)

    # ------------------------------------------------------------ reservation
    def _needs(self, p: int) -> list[int]:
        t = self.tg.tasks[self.order[p]]
        need = [b for b in dict.fromkeys((*t.reads, t.write)) if self.offset[b] is None]
        if self.policy.whole_layer_weights and t.stage not in self.stage_pins:
            layer = [b for q in range(p, self.stage_last[t.stage] + 1)
                     for b in self.tg.tasks[self.order[q]].reads
                     if self.tg.blocks[b].role == "weight"]
            self.stage_pins[t.stage] = list(dict.fromkeys(layer))
            for b in self.stage_pins[t.stage]:
                self.pins[b] += 1
            need += [b for b in self.stage_pins[t.stage] if self.offset[b] is None and b not in need]
        return sorted(need, key=lambda b: (-self.size[b], b))

    def reserve(self, p: int, may_evict: bool) -> int | None:
        """Reserve task `p`'s memory; returns the bytes reserved, or None (nothing changed)."""
        t = self.tg.tasks[self.order[p]]
        for b in (*t.reads, t.write):
            self.pins[b] += 1
        need = self._needs(p)
        got: list[tuple[int, Allocation]] = []
        for b in need:
            a = self.alloc.allocate(self.size[b])
            if a is None and may_evict:
                a = self._make_room(b, p)
            if a is None:
                for _, done in reversed(got):
                    self.alloc.rollback(done)
                if not may_evict:
                    for x in (*t.reads, t.write):
                        self.pins[x] -= 1
                    return None
                got = self._compact(p, need)
                break
            got.append((b, a))
        for b, a in got:
            if b == t.write and not t.accumulate:
                self.pending[b] = a
                self.offset[b] = a.offset
                self.live.add(b)
            else:
                deps = {self.host_node[b], *a.deps}
                if self.last_free[b] is not None:  # its previous instance ends first
                    deps.add(self.last_free[b])
                deps = tuple(sorted(deps))
                nid = self.emit(ReloadNode(self._next_id(), b, a.offset, deps))
                self._created(b, a.offset, nid)
            self.last_touch[b] = p
        return sum(a.size for _, a in got)

    def _candidates(self, p: int) -> list[tuple[int, int, int | None]]:
        """Arena items by offset: (start, end, block or None for free bytes)."""
        items = [(lo, hi, None) for lo, hi in zip(self.alloc._lo, self.alloc._hi)]
        items += [(self.offset[b], self.offset[b] + self.size[b], b) for b in self.live]
        items.sort(key=lambda it: (it[0], -1 if it[2] is None else it[2]))
        return items

    def _make_room(self, block: int, p: int) -> Allocation | None:
        """Evict the cheapest contiguous window that frees `size[block]` bytes."""
        if not self.policy.evicts:
            return None
        need = self.size[block]
        items = self._candidates(p)
        cost_of = {}
        for _, _, b in items:
            if b is not None and self.pins[b] == 0:
                cost_of[b] = self.policy.score(Candidate(
                    b, self.size[b], not self.host_valid[b], self.next_use(b, p),
                    self.last_touch[b], p))
        best = None
        combine = self.policy.combine
        for left in range(len(items)):
            if items[left][2] is not None and items[left][2] not in cost_of:
                continue
            right, costs = left, []
            while right < len(items):
                b = items[right][2]
                if b is not None and b not in cost_of:
                    break
                if right > left and items[right][0] != items[right - 1][1]:
                    break  # a gap means a resident or pending region in between
                if b is not None:
                    costs.append(cost_of[b])
                if items[right][1] - items[left][0] >= need:
                    key = (combine(costs) if costs else 0.0, items[left][0])
                    if best is None or key < best[0]:
                        best = (key, left, right)
                    break
                right += 1
        if best is None:
            return None
        _, left, right = best
        for _, _, b in items[left:right + 1]:
            if b is not None:
                self._evict(b)
        return self.alloc.allocate(need) or None

    def _compact(self, p: int, need: list[int]) -> list[tuple[int, Allocation]]:
        """Last resort at the execution horizon: evict everything not pinned, then the task's own
        blocks too, and place its working set from scratch. A policy that never evicts fails."""
        t = self.tg.tasks[self.order[p]]
        if not self.policy.evicts:
            live = sum(self.size[b] for b in self.live)
            need_all = self.resident_bytes + live + sum(self.size[b] for b in need)
            raise BudgetError(
                f"budget {format_size(self.opt.device_bytes)} does not hold the pass without "
                f"offloading (policy {self.policy.name}): task {t.id} ({op_text(t.op)}) needs "
                f"{format_size(need_all)} beside what is live; choose an evicting policy",
                need_all, self.opt.device_bytes)
        for b in sorted(self.live):
            if self.pins[b] == 0:
                self._evict(b)
        own = list(dict.fromkeys((*t.reads, t.write)))
        got = self._try_all(need)
        if got is None:
            for b in own:
                if b in self.live and b not in self.pending:
                    self._evict(b)
            need = sorted({*need, *[b for b in own if self.offset[b] is None]},
                          key=lambda b: (-self.size[b], b))
            got = self._try_all(need)
        if got is None:
            ws = sum(self.size[b] for b in own)
            layer = [b for b in self.stage_pins.get(t.stage, ()) if b not in own]
            if self.policy.whole_layer_weights and layer:
                need_all = self.resident_bytes + ws + sum(self.size[b] for b in layer)
                raise BudgetError(
                    f"budget {format_size(self.opt.device_bytes)} is too small for layerwise "
                    f"streaming: stage {t.stage}'s weights ({format_size(need_all - ws)}) must "
                    f"stay on the device with task {t.id} ({op_text(t.op)}, "
                    f"{format_size(ws)}); it needs at least {format_size(need_all)}",
                    need_all, self.opt.device_bytes)
            raise BudgetError(
                f"budget {format_size(self.opt.device_bytes)} is too small: task "
                f"{t.id} ({op_text(t.op)}) needs {format_size(ws)} at once beside "
                f"{format_size(self.resident_bytes)} of resident weights; the smallest budget "
                f"that would work is {format_size(self.resident_bytes + ws)}",
                self.resident_bytes + ws, self.opt.device_bytes)
        return got

    def _try_all(self, need: list[int]):
        got = []
        for b in need:
            a = self.alloc.allocate(self.size[b])
            if a is None:
                for _, done in reversed(got):
                    self.alloc.rollback(done)
                return None
            got.append((b, a))
        return got

    def _evict(self, b: int) -> None:
        deps = list(self.accesses[b])
        if not self.host_valid[b]:
            oid = self.emit(OffloadNode(self._next_id(), b, self.offset[b],
                                        (self.last_writer[b],)))
            self.host_node[b], self.host_valid[b] = oid, True
            deps.append(oid)
        self._free(b, deps)

    def _free(self, b: int, deps) -> None:
        fid = self.emit(FreeNode(self._next_id(), b, self.offset[b], tuple(sorted(set(deps)))))
        self.alloc.free(self.offset[b], self.size[b], fid)
        self.last_free[b] = fid
        self.offset[b] = None
        self.accesses[b], self.since_write[b] = [], []
        self.live.discard(b)

    # ------------------------------------------------------------ execution
    def execute(self, p: int) -> None:
        t = self.tg.tasks[self.order[p]]
        deps = {self.last_writer[b] for b in t.reads}
        w = t.write
        if t.accumulate:
            deps.add(self.last_writer[w])
            deps.update(self.since_write[w])
        else:
            deps.update(self.pending.pop(w).deps)
        reads = tuple(Access(b, self.offset[b]) for b in t.reads)
        nid = self.emit(ApplyNode(self._next_id(), reads, Access(w, self.offset[w]),
                                  t.accumulate, t.op, tuple(sorted(deps))))
        for b in dict.fromkeys(t.reads):
            self.accesses[b].append(nid)
            self.since_write[b].append(nid)
        if t.accumulate:
            self.accesses[w].append(nid)
        else:
            self.accesses[w] = [nid]
        self.since_write[w] = []
        self.last_writer[w] = nid
        self.host_valid[w] = False
        for b in (*t.reads, w):
            self.pins[b] -= 1
            self.last_touch[b] = p
        if self.policy.whole_layer_weights and self.stage_last.get(t.stage) == p:
            for b in self.stage_pins.get(t.stage, ()):
                self.pins[b] -= 1
        for b in dict.fromkeys((*t.reads, w)):
            if (self.uses[b][-1] == p and b not in self.opt.resident
                    and self.offset[b] is not None and self.pins[b] == 0):
                if not self.is_output[b]:
                    self._free(b, self.accesses[b])
                elif self.opt.outputs_to_host:
                    self._evict(b)  # final: offload it (the d2h engine hides it) and free

    # ------------------------------------------------------------ driver
    def run(self) -> MemGraph:
        self.start()
        opt = self.opt
        e = a = 0
        # prefix sums over positions: bytes reserved and predicted seconds of tasks in [e, a)
        ahead_bytes = [0]
        ahead_secs = [0.0]
        secs = ([opt.task_seconds[tid] for tid in self.order]
                if opt.lookahead_seconds is not None else None)
        step = max(1, self.n // 200)
        while e < self.n:
            room = a == e or (
                (opt.lookahead_bytes is None or ahead_bytes[a] - ahead_bytes[e] < opt.lookahead_bytes)
                and (secs is None or ahead_secs[a] - ahead_secs[e] < opt.lookahead_seconds))
            if a < self.n and room:
                got = self.reserve(a, may_evict=(a == e))
                if got is not None:
                    ahead_bytes.append(ahead_bytes[-1] + got)
                    ahead_secs.append(ahead_secs[-1] + (secs[a] if secs is not None else 0.0))
                    a += 1
                    continue
            self.execute(e)
            e += 1
            if opt.progress is not None and e % step == 0:
                opt.progress(e, self.n)
        return self.finish()

    def finish(self) -> MemGraph:
        tg = self.tg
        outputs = []
        for o in tg.outputs:
            b = o.block
            if self.offset[b] is not None:
                outputs.append(OutputRef(b, "device", self.offset[b], o.name, o.origin))
            else:
                outputs.append(OutputRef(b, "host", None, o.name, o.origin))
        tensors = tuple(TensorInfo(b.id, b.bytes, b.dtype, b.shape, b.name, b.role, b.source)
                        for b in tg.blocks)
        return MemGraph(self.opt.device_bytes, tensors, tuple(self.nodes), tuple(outputs),
                        tg.inputs, tg.results)


def lower(tg: TaskGraph, order: list[int], options: LowerOptions) -> MemGraph:
    """The memgraph of running `tg` in `order` within `options.device_bytes`."""
    return _Lowering(tg, order, options).run()
