"""Lowering: `TaskGraph` + order -> `MemGraph`, by simulated execution with three horizons.

The *allocation horizon* `a` walks the order reserving memory: the blocks task `a` reads that are
not on the device are reloaded (prefetch). Its output is placed later, by the *finalize horizon*
`f` (e <= f <= a) once the execution horizon is fewer than FINALIZE_AHEAD tasks behind it, into
the room free then; until then the allocation horizon keeps that many bytes free (CLAIM_SHARE),
without choosing where. A prefill's allocation horizon runs tens of tasks ahead, and placing
every output there at once cut the free room into holes: llama3.1-8b at 8 GB held 0.2-0.6 GB of
reserved outputs whenever the next weight could not be placed. The *execution horizon*
`e <= f` emits the apply of task `e` and frees the blocks it used for the last time. While the
next task's memory can be had without evicting (and the look-ahead limit allows), `a` advances
(with `evict_ahead`, also where it can be had by letting go clean blocks not needed for more
than half the rest of the order: `_far`, a tied table between the gather and the logits, a
weight the second group of a drained order reads again);
otherwise, if `a > e`, `e` advances and frees memory; if `a == e` (or `f == e`), blocks are
evicted by the policy (a contiguous address window, so fragmentation cannot block the
allocation), the reads reserved for later tasks let go first (`unreserve`). Eviction is clean
for blocks with a valid host copy (weights, activations offloaded and unchanged since): a free
with no transfer.

In the thesis' terms: `reserve` is simMalloc, a reload is simMallocForceReld, and `_make_room`
is simMallocOffld.

Each block's state during the walk is one `BlockState` record. The policy chooses victims
(`score`, `combine`) and may ask for groups of weights that stay on the device together
(`Policy.groups`: layerwise streaming pins a whole stage's weights from its first task to its
last); the allocator places the bytes.

Where a block goes (`_allocate`): a produced block a later task touches is packed first fit
from the bottom of the room (`LowerOptions.pack_low`); a weight's reload and a block no later
task touches (an output written back) go where bytes were freed longest ago (the allocator's
rule: it waits on no recent free). Placed all by that rule, the blocks that stay cut the room
into holes: llama3.1-8b prefill at 8 GB had 299 MB free in runs of at most 103 MB for a 134 MB
softmax output, and evicted 21 MB of activations for it, 26 times a pass (0.29 GB of link).

Resident blocks (weights and KV-store blocks that stay on the device for every pass) are placed at fixed offsets at
the bottom of the arena as `input at device` and never freed or evicted.

A weight block read only by tasks guarded by one element of one guard block (a mixture of
experts' expert, run only where the router chose it) whose guard is expected on in at most
`guarded_reload_share` of the passes is reloaded *guarded*: only where that element is nonzero,
so an expert nobody chose crosses no link. Such a reload waits for the guard's writers (it
depends on the router's apply and reads its block), so the allocation horizon does not reserve
it before the execution horizon has passed them: a guarded expert is fetched when chosen, never
ahead of its layer. Where the guard's block has no device instance then, the reload is plain.

Tasks placed on the host (`LowerOptions.on_host`, and the partition's `TaskGraph.host_tasks`:
`host_gather`) take no device memory: at the execution horizon each becomes an apply on host
copies, after an offload of every block it reads that has no current host copy; the block it
writes then has a host copy only, which a device task reloads like any other (its reservation
waits until every host writer of the block has run). Every writer of a block runs in one place.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from einpage.compiler.allocator import Allocation, Allocator, aligned
from einpage.compiler.evict_window import cheapest_window
from einpage.compiler.lower_options import LowerOptions
from einpage.compiler.order import check_order
from einpage.compiler.writebacks import keep_idle_outputs
from einpage.compiler.policies import Candidate, Group
from einpage.errors import BudgetError, PlanError
from einpage.ir.memgraph import (ALIGNMENT, Access, ApplyNode, FreeNode, InputNode, MemGraph,
                                 OffloadNode, OutputRef, ReloadGuard, ReloadNode, block_tensors)
from einpage.ir.ops import op_text
from einpage.ir.taskgraph import TaskGraph, reload_guards
from einpage.ir.tensors import PERSISTENT_ROLES
from einpage.units import format_size


#: A task's fresh write is placed once the execution horizon is fewer than this many tasks
#: behind it (`_Lowering.finalize`)
FINALIZE_AHEAD = 2
#: The reads reserved ahead leave free at least this share of the bytes of the writes deferred
#: so far (each write counted once, by the task that makes it): less lets the prefetch take room
#: the writes then need, and the reads it reserved for later tasks are let go and reloaded again
#: (llama3.1-8b prefill at 8 GB: 0.195 s at 1.0, 0.189 s at 2.0 and 3.0; llama-7b at 1.7 GB:
#: 0.256, 0.257, 0.262 s; 6 more rows within 0.5% from 1.0 to 3.0; with a quarter of the claim
#: 0.261 s where the whole gave 0.196 s). A byte look-ahead (`lookahead_bytes`) counts the same
#: claim, so a given window reaches further ahead than when reads made later counted twice.
CLAIM_SHARE = 2.0
#: With `evict_ahead`, a clean block whose next use lies further than this share of the
#: positions left may be let go for the prefetch (`_Lowering._far`)
FAR_SHARE = 0.5


@dataclass(slots=True)
class BlockState:
    """One block during the walk (mutable: this is the simulation's state)."""
    size: int                       # aligned bytes
    uses: list[int]                 # positions of the tasks that touch it, ascending
    is_output: bool
    offset: int | None = None       # its device instance (or reservation), if any
    last_writer: int | None = None  # node that last wrote its device instance
    accesses: list[int] = field(default_factory=list)    # nodes that touched the instance
    since_write: list[int] = field(default_factory=list)  # reads since its last write
    host_node: int | None = None    # node that made its host copy
    host_valid: bool = False        # the host copy holds the current data
    pins: int = 0                   # reasons it may not be evicted now
    last_touch: int = -1            # position of the last task that touched it
    last_free: int | None = None    # node that ended its previous instance


class _Lowering:
    def __init__(self, tg: TaskGraph, order: list[int], opt: LowerOptions):
        self.tg, self.order, self.opt, self.policy = tg, order, opt, opt.policy
        self.n = len(order)
        self.claim = CLAIM_SHARE if opt.claim_share is None else opt.claim_share
        self.nodes: list = []
        # the task at each position, the blocks it touches and those it reads (each once)
        self.at = [tg.tasks[tid] for tid in order]
        self.touched = [tg.touched[tid] for tid in order]
        self.read_once = [tg.read_once[tid] for tid in order]
        uses: list[list[int]] = [[] for _ in tg.blocks]
        for p, touched in enumerate(self.touched):
            for b in touched:
                uses[b].append(p)
        outputs = {o.block for o in tg.outputs}
        self.blocks = [BlockState(aligned(blk.bytes), uses[blk.id], blk.id in outputs)
                       for blk in tg.blocks]
        self.e = 0  # the execution horizon (`run`)
        # the blocks `_allocate` packs from below where they outlive the task placing them
        self.packs = [opt.pack_low and blk.role not in PERSISTENT_ROLES for blk in tg.blocks]
        self.guard_of = reload_guards(tg, opt.guarded_reload_share)
        # guard block -> the position of its last writer (a guarded reload comes after it)
        position = {tid: p for p, tid in enumerate(order)}
        self.guard_ready = {g: max(position[w] for w in tg.writers[g])
                            for g, _, _ in self.guard_of.values()}
        self.pending: dict[int, Allocation] = {}
        # Deferred writes (`reserve`, `finalize`): position -> bytes its finalize will place
        self.later: dict[int, int] = {}
        self.deferred = 0  # their sum
        self.live: set[int] = set()  # blocks with a device instance (or reservation), not resident
        groups = opt.policy.groups(tg, order)
        self.group_at: dict[int, list[Group]] = {}    # first position -> groups pinned there
        self.group_until: dict[int, list[Group]] = {}  # last position -> groups released there
        self.group_of_stage: dict[int, Group] = {}
        for g in groups:
            self.group_at.setdefault(g.start, []).append(g)
            self.group_until.setdefault(g.end, []).append(g)
            self.group_of_stage[g.stage] = g
        self.pinned_groups: set[int] = set()  # stages whose group is pinned now or was
        # Place fresh writes at the last moment (`FINALIZE_AHEAD`); a policy's groups pin
        # whole stages at reservation, so with groups every task is finalized as it is reserved.
        self.defer = not groups and opt.policy.evicts
        self.written_back: dict[int, int] = {}  # output block -> the free after its write-back
        resident_bytes = sum(self.blocks[b].size for b in opt.resident)
        if resident_bytes > opt.device_bytes:
            raise BudgetError(f"resident weights need {format_size(resident_bytes)}, more than the "
                              f"budget {format_size(opt.device_bytes)}", resident_bytes,
                              opt.device_bytes)
        self.resident_bytes = resident_bytes
        self.alloc = Allocator(resident_bytes, opt.device_bytes)
        # block -> host writers not yet run (a device reader's reservation waits for them)
        self.host_pending: dict[int, int] = {}
        # tasks on the host: the placement's and the partition's own (its gathers)
        self.on_host = opt.on_host | tg.host_tasks
        for tid in self.on_host:
            w = tg.tasks[tid].write
            self.host_pending[w] = self.host_pending.get(w, 0) + 1
        for w, count in self.host_pending.items():
            if count != len(tg.writers[w]):
                raise PlanError(f"block {w} ({tg.blocks[w].name}) has writers on the host and on "
                                "the device; every writer of a block runs in one place")

    # ------------------------------------------------------------ emission
    def emit(self, node) -> int:
        self.nodes.append(node)
        return node.id

    def _next_id(self) -> int:
        return len(self.nodes)

    # ------------------------------------------------------------ start
    def start(self) -> None:
        tg, opt = self.tg, self.opt
        at = 0
        for blk in tg.input_blocks:
            b, st = blk.id, self.blocks[blk.id]
            if b in opt.resident:
                nid = self.emit(InputNode(self._next_id(), b, "device", at))
                st.offset, at = at, at + st.size
                st.last_writer = nid
                st.accesses = [nid]
                st.host_valid = True
                if blk.role == "weight":  # its host copy: the checkpoint's (a host task reads it)
                    st.host_node = nid
            elif (opt.inputs_at_device and blk.role not in PERSISTENT_ROLES and st.uses
                  and b in tg.device_read):  # (one only host tasks read stays there)
                a = self.alloc.allocate(st.size)
                if a is None:
                    raise BudgetError("inputs do not fit on the device", st.size, 0)
                nid = self.emit(InputNode(self._next_id(), b, "device", a.offset))
                self._created(b, a.offset, nid)
            else:
                nid = self.emit(InputNode(self._next_id(), b, "host"))
                st.host_node, st.host_valid = nid, True

    def _created(self, b: int, offset: int, nid: int) -> None:
        st = self.blocks[b]
        st.offset = offset
        st.last_writer = nid
        st.accesses = [nid]
        st.since_write = []
        self.live.add(b)

    # ------------------------------------------------------------ reservation
    def _needs(self, p: int, own: bool = True) -> list[int]:
        """The blocks task `p` needs placed: (`own`) its reads and write not on the device,
        then, the first time `p` is asked for, the blocks not on the device of a group the
        policy keeps together that starts at `p` (the group pinned then). Not sorted:
        `_by_size` orders them for placing."""
        blocks = self.blocks
        need = [b for b in self.touched[p] if blocks[b].offset is None] if own else []
        for g in self.group_at.get(p, ()):  # a group the policy keeps together starts here
            if g.stage in self.pinned_groups:  # pinned at an earlier try to reserve `p`
                continue
            self.pinned_groups.add(g.stage)
            for b in g.blocks:
                blocks[b].pins += 1
            need += [b for b in g.blocks if blocks[b].offset is None and b not in need]
        return need

    def _by_size(self, need: list[int]) -> list[int]:
        """`need` in the order blocks are placed: the largest first, then by id."""
        if len(need) < 2:
            return need
        blocks = self.blocks
        return sorted(need, key=lambda b: (-blocks[b].size, b))

    def reserve(self, p: int, may_evict: bool, far: bool = False) -> int | None:
        """Reserve task `p`'s reads ahead (the allocation horizon): pin its blocks and reload
        those that have a current host copy; where writes are deferred (`defer`), its fresh
        write and any read no finished writer has made yet wait for `finalize`, but the
        bytes left free must still cover `CLAIM_SHARE` (`claim_share`) of the writes deferred
        so far. `far`: where that room is short, clean blocks not needed for more than
        FAR_SHARE of the positions left are evicted for it (`_far`). Returns the bytes
        reserved, or None (nothing changed; with `far`, the far blocks may have been let go)."""
        t = self.at[p]
        blocks = self.blocks
        host = t.id in self.on_host
        if not host and self.host_pending and any(self.host_pending.get(b) for b in t.reads):
            return None  # its host writers have not run (a == e never gets here: they came first)
        if not host and self.guard_of and any(
                b in self.guard_of and blocks[b].offset is None
                and self.guard_ready[self.guard_of[b][0]] >= self.e for b in t.reads):
            return None  # a guarded reload waits for its guard's writers (a == e: they ran)
        need = self._needs(p, own=not host)
        later = 0
        if self.defer and not host:
            # its own fresh write is claimed here; a read not on the device and with no
            # current host copy (a writer before `t` has not run) is its writer's claim
            w, fresh_write = t.write, not t.accumulate
            now, nbytes = [], 0
            for b in need:
                st = blocks[b]
                if b == w and fresh_write:
                    later = st.size
                elif st.host_valid:
                    now.append(b)
                    nbytes += st.size
            need = now
            short = nbytes + self.claim * (self.deferred + later) - self.alloc.free_bytes
            if not may_evict and short > 0 and far:
                short -= self._evict_far(p, short)
            if not may_evict and short > 0:
                return None
        for b in (*t.reads, t.write):
            blocks[b].pins += 1
        got = self._place(p, self._by_size(need), may_evict, unpin=True, far=far)
        if got is None:
            return None
        self.later[p] = later
        self.deferred += later
        return got + later  # the look-ahead counts a deferred write where it was claimed

    def finalize(self, p: int, may_evict: bool) -> int | None:
        """Place what `reserve` left to the last moment for task `p`: its fresh write (a read
        made later is placed by its writer's `finalize`, and pinned by `p` since `reserve`).
        None if that does not fit without evicting."""
        t = self.at[p]
        blocks = self.blocks
        if t.id in self.on_host:
            got = 0
        else:
            need = [b for b in self.touched[p] if blocks[b].offset is None]
            got = self._place(p, self._by_size(need), may_evict, unpin=False) if need else 0
            if got is None:
                return None
        self.deferred -= self.later.pop(p, 0)
        return got

    def unreserve(self, start: int, stop: int) -> None:
        """Release the pins of the tasks at positions [start, stop), reserved ahead but not
        finalized, so that their blocks (reloaded weights, clean; activations made earlier,
        offloaded first where they have no host copy) may be evicted for the task at the
        execution horizon; they are reserved again when the horizon comes back to them."""
        blocks = self.blocks
        for p in range(start, stop):
            t = self.at[p]
            for b in (*t.reads, t.write):
                blocks[b].pins -= 1
            self.deferred -= self.later.pop(p, 0)

    def _far(self, st: BlockState, p: int) -> bool:
        """Whether block `st` may be let go to reserve for task `p` ahead of the execution
        horizon: clean (its host copy current: a free with no transfer) and not needed for more
        than FAR_SHARE of the positions left after `p` (a tied table, gathered first and read
        again by the logits; a weight the first group of a drained order read and the second
        reads again). Counted in stages (two stages after `p`'s, as this was first), a drained
        order's groups share their stages, and the blocks two layers ahead, just prefetched,
        were let go instead: qwen2.5-7b B=16 at 1.9 GB streamed 40 GB, 2073 ms; counted in
        positions, 29 GB, 1771 ms. Never a block needed within the prefetch's depth past `p`
        (near the end of the order half the positions left is a few)."""
        if not st.host_valid:
            return False
        u = bisect.bisect_left(st.uses, p)
        return u == len(st.uses) or (
            st.uses[u] - p > max(FAR_SHARE * (self.n - p), p - self.e))

    def _evict_far(self, p: int, short: int) -> int:
        """Evict unpinned far blocks (`_far`), farthest next use first, until `short` bytes are
        free; none where they cannot free that many (they would stream again for nothing).
        Returns the bytes freed."""
        blocks = self.blocks
        far = []
        for b in self.live:
            st = blocks[b]
            if st.pins == 0 and b not in self.opt.resident and self._far(st, p):
                u = bisect.bisect_left(st.uses, p)
                far.append((-(st.uses[u] if u < len(st.uses) else self.n), b))
        if sum(blocks[b].size for _, b in far) < short:
            return 0
        freed = 0
        for _, b in sorted(far):
            if freed >= short:
                break
            freed += blocks[b].size
            self._evict(b)
        return freed

    def _place(self, p: int, need: list[int], may_evict: bool, unpin: bool,
               far: bool = False) -> int | None:
        """Allocate `need` for task `p` (reloads, its fresh write); returns the bytes, or None
        with nothing allocated (and `p`'s pins released where `unpin`); `far`: evicting far
        blocks only (`_far`) where an allocation fails (those evictions stay)."""
        t = self.at[p]
        blocks = self.blocks
        got: list[tuple[int, Allocation]] = []
        for b in need:
            a = self._allocate(b, p)
            if a is None and may_evict:
                a = self._make_room(b, p)
            elif a is None and far:
                a = self._make_room(b, p, far=True)
            if a is None:
                for _, done in reversed(got):
                    self.alloc.rollback(done)
                if not may_evict:
                    if unpin:
                        for x in (*t.reads, t.write):
                            blocks[x].pins -= 1
                    return None
                got = self._compact(p, need)
                break
            got.append((b, a))
        for b, a in got:
            st = blocks[b]
            if b == t.write and not t.accumulate:
                self.pending[b] = a
                st.offset = a.offset
                self.live.add(b)
            else:
                deps = {st.host_node, *a.deps}
                if st.last_free is not None:  # its previous instance ends first
                    deps.add(st.last_free)
                guard = self._reload_guard(b)
                if guard is not None:
                    deps.add(blocks[guard.access.tensor].last_writer)
                nid = self.emit(ReloadNode(self._next_id(), b, a.offset, tuple(sorted(deps)),
                                           guard=guard))
                if guard is not None:  # it reads the guard's instance
                    gs = blocks[guard.access.tensor]
                    gs.accesses.append(nid)
                    gs.since_write.append(nid)
                self._created(b, a.offset, nid)
            st.last_touch = p
        return sum(a.size for _, a in got)

    def _reload_guard(self, b: int) -> ReloadGuard | None:
        """The guard of block `b`'s reload now: its readers' guard where that guard's writers
        have all run and its block has a current device instance; None: a plain reload."""
        if b not in self.guard_of:
            return None
        g, index, share = self.guard_of[b]
        gs = self.blocks[g]
        if (self.guard_ready[g] >= self.e or gs.offset is None or g in self.pending
                or self.host_pending.get(g)):
            return None
        return ReloadGuard(Access(g, gs.offset), index, share)

    def _candidates(self) -> list[tuple[int, int, int | None]]:
        """Arena items by offset: (start, end, block or None for free bytes)."""
        blocks = self.blocks
        items = [(lo, hi, None) for lo, hi in self.alloc.free_segments()]
        items += [(blocks[b].offset, blocks[b].offset + blocks[b].size, b) for b in self.live]
        items.sort(key=lambda it: (it[0], -1 if it[2] is None else it[2]))
        return items

    def _make_room(self, block: int, p: int, far: bool = False) -> Allocation | None:
        """Evict the cheapest contiguous window that frees `blocks[block].size` bytes
        (`evict_window.cheapest_window`: over the arena's free segments and the blocks none of
        the tasks reserved pins, each priced by the policy's `score`), and place the block
        there. `far`: of the blocks, only far ones (`_far`: reserving ahead)."""
        if not self.policy.evicts:
            return None
        blocks = self.blocks
        need = blocks[block].size
        items = self._candidates()
        n = len(items)
        costs: list[float] = []   # the costs of the evictable blocks, in offset order
        before = [0] * (n + 1)    # evictable blocks among items[:k]
        ok = [True] * n           # free bytes, or a block no reserved task pins
        score, last = self.policy.score, self.n
        for k, (_, _, b) in enumerate(items):
            if b is not None:
                st = blocks[b]
                if st.pins == 0 and (not far or self._far(st, p)):
                    uses = st.uses  # its next use at or after p (len(order) if none)
                    u = bisect.bisect_left(uses, p)
                    costs.append(score(Candidate(b, st.size, not st.host_valid,
                                                 uses[u] if u < len(uses) else last,
                                                 st.last_touch, p)))
                else:
                    ok[k] = False
            before[k + 1] = len(costs)
        window = cheapest_window(items, ok, costs, before, need, self.policy.combine)
        if window is None:
            return None
        left, right = window
        for _, _, b in items[left:right + 1]:
            if b is not None:
                self._evict(b)
        return self._allocate(block, p) or None

    def _allocate(self, b: int, p: int) -> Allocation | None:
        """Block `b`'s bytes for the task at position `p` (the module's docstring)."""
        st = self.blocks[b]
        if self.packs[b] and st.uses[-1] > p:
            return self.alloc.allocate_lowest(st.size)
        return self.alloc.allocate(st.size)

    def _compact(self, p: int, need: list[int]) -> list[tuple[int, Allocation]]:
        """Last resort at the execution horizon: evict everything not pinned, then the task's own
        blocks too, and place its working set from scratch. A policy that never evicts fails."""
        t = self.at[p]
        blocks = self.blocks
        if not self.policy.evicts:
            live = sum(blocks[b].size for b in self.live)
            need_all = self.resident_bytes + live + sum(blocks[b].size for b in need)
            raise BudgetError(
                f"budget {format_size(self.opt.device_bytes)} does not hold the pass without "
                f"offloading (policy {self.policy.name}): task {t.id} ({op_text(t.op)}) needs "
                f"{format_size(need_all)} beside what is live; choose an evicting policy",
                need_all, self.opt.device_bytes)
        for b in sorted(self.live):
            if blocks[b].pins == 0:
                self._evict(b)
        own = self.touched[p]
        got = self._try_all(need)
        if got is None:
            for b in own:
                if b in self.live and b not in self.pending:
                    self._evict(b)
            need = sorted({*need, *[b for b in own if blocks[b].offset is None]},
                          key=lambda b: (-blocks[b].size, b))
            got = self._try_all(need)
            if got is None:  # placed by stamp they can split the room: pack them from below
                got = self._try_all(need, self.alloc.allocate_lowest)
        if got is None:
            ws = sum(blocks[b].size for b in own)
            group = self.group_of_stage.get(t.stage)
            together = ([b for b in group.blocks if b not in own]
                        if group is not None and t.stage in self.pinned_groups else [])
            if together:
                need_all = self.resident_bytes + ws + sum(blocks[b].size for b in together)
                raise BudgetError(
                    f"budget {format_size(self.opt.device_bytes)} is too small for "
                    f"{self.policy.name} streaming: stage {t.stage}'s weights "
                    f"({format_size(need_all - ws)}) must stay on the device with task {t.id} "
                    f"({op_text(t.op)}, {format_size(ws)}); it needs at least "
                    f"{format_size(need_all)}", need_all, self.opt.device_bytes)
            budget = self.opt.device_bytes
            least = self.resident_bytes + ws
            if least > budget:
                why = (f"needs {format_size(ws)} at once beside {format_size(self.resident_bytes)} "
                       f"of resident weights: at least {format_size(least)}")
            else:  # the sum fits, its placement did not: what had to stay cut the free room
                held = sum(blocks[b].size for b in self.live if b not in own)
                least = (budget // ALIGNMENT + 1) * ALIGNMENT  # the next aligned budget
                why = (f"needs {format_size(ws)} at once, and beside the "
                       f"{format_size(held)} that had to stay (resident weights and blocks "
                       f"in flight) no contiguous room was left: it needs at least "
                       f"{format_size(least)}, likely a little more")
            raise BudgetError(f"budget {format_size(budget)} is too small: task {t.id} "
                              f"({op_text(t.op)}) {why}", least, budget)
        return got

    def _try_all(self, need: list[int], allocate=None):
        allocate = allocate or self.alloc.allocate
        got = []
        for b in need:
            a = allocate(self.blocks[b].size)
            if a is None:
                for _, done in reversed(got):
                    self.alloc.rollback(done)
                return None
            got.append((b, a))
        return got

    def _evict(self, b: int) -> None:
        st = self.blocks[b]
        deps = list(st.accesses)
        if not st.host_valid:
            oid = self.emit(OffloadNode(self._next_id(), b, st.offset, (st.last_writer,)))
            st.host_node, st.host_valid = oid, True
            deps.append(oid)
        self._free(b, deps)

    def _free(self, b: int, deps) -> None:
        st = self.blocks[b]
        fid = self.emit(FreeNode(self._next_id(), b, st.offset, tuple(sorted(set(deps)))))
        self.alloc.free(st.offset, st.size, fid)
        st.last_free = fid
        st.offset = None
        st.accesses, st.since_write = [], []
        self.live.discard(b)

    # ------------------------------------------------------------ execution
    def _host_apply(self, t) -> None:
        """Task `t` on the host: its reads' host copies (offloaded first where the device holds
        the only current one), its write's host copy."""
        blocks = self.blocks
        deps = set()
        for b in dict.fromkeys(t.reads):
            st = blocks[b]
            if not st.host_valid or st.host_node is None:  # (a resident KV block: no host copy)
                oid = self.emit(OffloadNode(self._next_id(), b, st.offset, (st.last_writer,)))
                st.host_node, st.host_valid = oid, True
                st.accesses.append(oid)
                st.since_write.append(oid)
            deps.add(st.host_node)
        w, ws = t.write, blocks[t.write]
        if t.accumulate:
            deps.add(ws.host_node)
        reads = tuple(Access(b, None) for b in t.reads)
        nid = self.emit(ApplyNode(self._next_id(), reads, Access(w, None), t.accumulate, t.op,
                                  tuple(sorted(deps)), task=t.id, on="host"))
        ws.host_node, ws.host_valid = nid, True
        self.host_pending[w] -= 1
        if not self.host_pending[w]:  # (once every host task ran, reservations ask nothing)
            del self.host_pending[w]

    def execute(self, p: int) -> None:
        t = self.at[p]
        blocks = self.blocks
        if t.id in self.on_host:
            self._host_apply(t)
            self._release(t, p)
            return
        deps = {blocks[b].last_writer for b in t.reads}
        w, ws = t.write, blocks[t.write]
        if t.accumulate:
            deps.add(ws.last_writer)
            deps.update(ws.since_write)
        else:
            deps.update(self.pending.pop(w).deps)
        reads = tuple([Access(b, blocks[b].offset) for b in t.reads])
        nid = self.emit(ApplyNode(self._next_id(), reads, Access(w, ws.offset),
                                  t.accumulate, t.op, tuple(sorted(deps)), task=t.id))
        for b in self.read_once[p]:
            st = blocks[b]
            st.accesses.append(nid)
            st.since_write.append(nid)
        if t.accumulate:
            ws.accesses.append(nid)
        else:
            ws.accesses = [nid]
        ws.since_write = []
        ws.last_writer = nid
        ws.host_valid = False
        self._release(t, p)

    def _release(self, t, p: int) -> None:
        """After task `t` at position `p` ran: unpin its blocks (and the groups that end here),
        and free the device instances it used for the last time."""
        blocks, w = self.blocks, t.write
        for b in (*t.reads, w):
            st = blocks[b]
            st.pins -= 1
            st.last_touch = p
        for g in self.group_until.get(p, ()):  # a group the policy kept together ends here
            for b in g.blocks:  # pinned when its first task was reserved, before this one ran
                blocks[b].pins -= 1
        resident = self.opt.resident
        for b in self.touched[p]:
            st = blocks[b]
            if (st.uses[-1] == p and st.offset is not None and st.pins == 0
                    and b not in resident):
                if not st.is_output:
                    self._free(b, st.accesses)
                elif self.opt.outputs_to_host:
                    self._evict(b)  # final: offload it (the d2h engine hides it) and free
                    self.written_back[b] = len(self.nodes) - 1

    # ------------------------------------------------------------ driver
    def run(self) -> MemGraph:
        self.start()
        opt = self.opt
        e = a = f = 0  # execution, allocation and finalize horizons: e <= f <= a
        ahead = FINALIZE_AHEAD if self.defer else self.n
        # prefix sums over positions: bytes reserved and predicted seconds of tasks in [e, a)
        ahead_bytes = [0]
        ahead_secs = [0.0]
        secs = ([opt.task_seconds[tid] for tid in self.order]
                if opt.lookahead_seconds is not None else None)
        step = max(1, self.n // 200)
        while e < self.n:
            if f < a and f - e < ahead:
                if self.finalize(f, may_evict=False) is not None:
                    f += 1
                    continue
                if f == e:  # the reads ahead hold the room: let them go, evict, place
                    self.unreserve(e + 1, a)
                    del ahead_bytes[e + 2:], ahead_secs[e + 2:]
                    a = e + 1
                    self.finalize(f, may_evict=True)
                    f += 1
                    continue
            else:
                room = a == e or (
                    (opt.lookahead_bytes is None or ahead_bytes[a] - ahead_bytes[e] < opt.lookahead_bytes)
                    and (secs is None or ahead_secs[a] - ahead_secs[e] < opt.lookahead_seconds))
                if a < self.n and room:
                    got = self.reserve(a, may_evict=(a == e))
                    if got is None and a > e and opt.evict_ahead:
                        got = self.reserve(a, may_evict=False, far=True)
                    if got is not None:
                        ahead_bytes.append(ahead_bytes[-1] + got)
                        ahead_secs.append(ahead_secs[-1] + (secs[a] if secs is not None else 0.0))
                        a += 1
                        continue
                if f == e:  # nothing to run yet (f == a: its reads could not be reserved)
                    raise PlanError(f"lowering stalled at task {self.order[e]}")
            self.execute(e)
            e += 1
            self.e = e
            if opt.progress is not None and e % step == 0:
                opt.progress(e, self.n)
        return self.finish()

    def finish(self) -> MemGraph:
        tg = self.tg
        nodes, at = keep_idle_outputs(self.nodes, self.written_back)
        outputs = []
        for o in tg.outputs:
            b = o.block
            offset = self.blocks[b].offset if b not in at else at[b]
            if offset is not None:
                outputs.append(OutputRef(b, "device", offset, o.name, o.origin))
            else:
                outputs.append(OutputRef(b, "host", None, o.name, o.origin))
        return MemGraph(self.opt.device_bytes, block_tensors(tg), tuple(nodes), tuple(outputs),
                        tg.inputs, tg.results, graph=tg)


def lower(tg: TaskGraph, order: list[int], options: LowerOptions) -> MemGraph:
    """The memgraph of running `tg` in `order` within `options.device_bytes`. `order` must be
    every task once, each after the tasks it depends on (PlanError otherwise)."""
    check_order(tg, order)
    return _Lowering(tg, order, options).run()
