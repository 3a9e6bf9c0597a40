"""The memgraph validator: checks that the dependency edges ALONE make every topological order of a
`MemGraph` correct (DESIGN.md, "MemGraph file format", "Correct means").

The node list is replayed once, in its order, to know which device instance of each tensor is live
where; every ordering claim is then checked against the dep DAG ("u is an ancestor of v"), never
against list positions. `validate` raises `PlanError` naming the node (`node %17 (apply): ...`) at
the first broken rule, or returns a `ValidationReport`.

Vocabulary. A device *instance* of a tensor starts at an `input` at device, a `reload`, or an
`apply` whose write does not accumulate (its *creator*); it ends at a `free` of it, or at an
`apply` that lists it in `frees` (its *ender*). Its *writers* are its creator and every
accumulating `apply` into it; its *accesses* are its writers, its readers (`apply` reads,
`offload`s) and its ender. A tensor's *version* counts the `apply` writes to it so far; an
`input` (at host or device) holds version 0, an `offload` copies the current version to host.
"Ancestor" is reflexive where one node plays both parts (an `apply` that frees an instance and
writes into its bytes).

Invariants:

1. Structure: `MemGraph.verify()` (ids are positions, deps name earlier ids, duplicates
   allowed; tensor ids named exist; a tensor's `bytes` is `prod(shape) * dtype.itemsize`, or
   its packed size with a `storage`);
   besides, `input.at` and `output.at` are `host` or `device`; an input at device and an
   output at device carry an offset, an input at host carries none.
2. Placement: every instance lies inside `[0, device_bytes)`, at an offset that is a multiple of
   `ALIGNMENT` (256).
3. Reads: every read (an `apply` read, the instance an accumulating `apply` writes, an `offload`)
   names a tensor with a live instance at exactly that offset, and every writer of that instance
   so far is an ancestor of the reader.
4. Write-after-read and free-after-use: an accumulating `apply`, a `free`, and an `apply` that
   lists an instance in `frees`, have every earlier access of that instance as an ancestor. An
   `apply` may not free the instance it accumulates into.
5. Memory reuse: two instances whose byte ranges overlap never coexist, and every access of the
   older one (its ender included) is an ancestor of the newer one's creator.
6. Host copies: every `reload` has a host copy of its tensor (an `input` at host or an `offload`)
   among its ancestors, and that copy is current: it holds the tensor's latest version (a reload
   of a copy made before a later `apply` write is stale). An `input` holds the initial data, so
   no `input` of a tensor follows an `apply` write of it, and an `apply` that writes a tensor
   has the tensor's inputs at host as ancestors.
7. Outputs: at the end, an output at device has a live instance at its offset; an output at host
   has a current host copy.
8. One instance per tensor: a tensor is never created while it has a live instance; a `free`,
   `offload` or `frees` entry names a live instance; and the ender of a tensor's previous instance
   is an ancestor of its next creator (so "one live instance at a time" holds in every order).
9. The disk tier, by the same rules on the host arena: a `read` has an `input` at disk of its
   tensor among its ancestors, and the tensor was never written (the file holds its initial
   data); its staging buffer lies inside `[0, host_arena_bytes)` at a multiple of
   `HOST_ALIGNMENT`, never overlaps a live staging buffer, and every access of the buffer's
   earlier occupant (its read and the reload that consumed it) is an ancestor of the read. A
   `reload` with a `host_offset` consumes the live staging buffer of its tensor at exactly that
   offset, whose read is an ancestor; a tensor has one staging buffer at a time, and every read
   is consumed by the end.

10. Applies on the host (`on: "host"`, version 2) read and write host copies, not instances:
    every tensor it reads has a current host copy (its latest version), one of whose makers is
    an ancestor (a weight's input, at host or at device: the checkpoint's bytes, which no pass
    changes); its write makes the tensor's host copy (a new version), so the tensor has no
    live device instance then (that instance would hold a stale version), an accumulating host
    write has the host copy's maker and every reader of it since as ancestors, and so does any
    node that replaces a host copy with a newer version (an offload, a host write): every
    reader of the copy it replaces (a reload, a host apply) is its ancestor.

11. Guarded reloads (version 2): a `reload` with a `guard` copies only where element `index` of
    the guard's instance is nonzero, so the instance it creates holds garbage where the guard is
    off. The guard names a live instance at exactly its offset, whose writers are ancestors
    (rule 3: it is read like an apply read, so its free and later writes wait for the reload);
    `index` lies inside that tensor and `share` in (0, 1]. Every apply that reads the guarded
    instance, or accumulates into it, is guarded by the same element of the same version of the
    guard tensor, at the same share (it is skipped exactly when the copy was); no `offload`
    reads it, and it is no output at the end.

12. Peers (version 2, a program of several ranks): a `send` reads its tensor like an offload
    (rule 3 on its instance, or rule 6 on its host copy with `offset` null), the tensor is an
    output of the plan and the version it sends is the last. The `recv`s that name an input
    tile it exactly (no box twice, none missed), and an `input` of a block of such an input has
    every recv whose box meets its own as an ancestor: the caller supplies no byte of it.
    Matching sends to recvs across ranks, and freedom from deadlock, are
    `einpage.ir.peers.validate_ranks`'.

With 10, every write of a tensor, every reload and every offload of it are totally ordered by
the edges (by 3, 4, 6 and 8 on the device side), so its versions, and the host copy each reload
or host apply reads, are the same in every topological order.

Cost. Checks reduce to few ancestor queries by transitivity: the last writer of an instance has
every earlier access of it as an ancestor (4), so 3 checks only the last writer and 4 only the last
writer and the reads since; the ender has every access as an ancestor, so 5 checks only the ender
of the most recent occupant of each byte (a sorted segment map, bisect). A query first looks at
the direct deps and a pre-numbered spanning forest of the DAG, then runs one backward search
pruned below the smallest id sought (an ancestor always has a smaller id), stopping when
everything is found (see `einpage.ir.ancestry.Ancestry`).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable

from einpage.errors import PlanError
from einpage.ir.memgraph import (ALIGNMENT, HOST_ALIGNMENT, ApplyNode, FreeNode, InputNode,
                                 MemGraph, MemNode, OffloadNode, ReadNode, RecvNode, ReloadNode,
                                 SendNode, boxes_meet)
from einpage.ir.ancestry import Ancestry, Arena, LiveInstance
from einpage.ir.ancestry import at_offset as _at
from einpage.ir.translation import check_ops, prove

__all__ = ["ValidationReport", "validate", "checked", "vouch"]


@dataclass(frozen=True, slots=True)
class ValidationReport:
    """What a valid memgraph needs: `peak_bytes`, the highest byte any instance reaches;
    `live_peak_bytes`, the most bytes live at once in the node order (the lower bound a perfect,
    fragmentation-free placement of that order would need); and the traffic it moves."""
    device_bytes: int
    nodes: int
    instances: int
    peak_bytes: int
    live_peak_bytes: int
    reloads: int
    reload_bytes: int
    offloads: int
    offload_bytes: int
    reads: int = 0            # disk -> host staging reads (the disk tier)
    read_bytes: int = 0
    host_arena_bytes: int = 0
    host_applies: int = 0     # applies on the host (placement, version 2)
    #: proven to compute the graph the plan carries (`einpage.ir.translation`); False for a plan
    #: without one (a version 1 file): its memory and order were checked, its computation not
    proven: bool = False

    def __str__(self) -> str:
        return (f"valid memgraph: {self.nodes} nodes, {self.instances} instances, peak "
                f"{self.peak_bytes} B (live {self.live_peak_bytes} B) of {self.device_bytes} B, "
                f"reload {self.reloads}x {self.reload_bytes} B, offload {self.offloads}x "
                f"{self.offload_bytes} B"
                + (f", read {self.reads}x {self.read_bytes} B through a host arena of "
                   f"{self.host_arena_bytes} B" if self.reads else "")
                + (f", {self.host_applies} applies on the host" if self.host_applies else "")
                + ("; proven to compute its graph" if self.proven else
                   "; not proven to compute a graph (the plan carries none)"))


#: where a plan remembers its report (`MemGraph` is frozen; `dataclasses.replace` makes a new
#: plan, which must be checked again)
_REPORT = "_validation_report"


def validate(mg: MemGraph) -> ValidationReport:
    """Check every invariant of the module docstring; raise `PlanError` at the first broken one
    (rule 1 over the whole plan first, then the others node by node, then the outputs). Then
    that every apply fits its op and, where the plan carries its graph, that it computes it
    (`einpage.ir.translation`). The plan remembers the report (`checked`)."""
    mg.verify()
    report = _Checker(mg).run()
    check_ops(mg)
    if mg.graph is not None:
        prove(mg)
        report = dataclasses.replace(report, proven=True)
    vouch(mg, report)
    return report


def checked(mg: MemGraph) -> ValidationReport:
    """The report of `mg`: remembered from an earlier `validate` of this very plan object (the
    compiler's, in this process), else `validate(mg)`. Every runtime calls it before it runs a
    plan."""
    report = mg.__dict__.get(_REPORT)
    return report if report is not None else validate(mg)


def vouch(mg: MemGraph, report: ValidationReport) -> None:
    """Remember `report` as `mg`'s: for its maker, who validated an equal plan in this process
    (the compiler validates, then attaches the plan's meta, which no rule reads)."""
    mg.__dict__[_REPORT] = report


# ---------------------------------------------------------------------------------- checker
class _Checker:
    def __init__(self, mg: MemGraph):
        self.mg = mg
        self.nodes = mg.nodes
        self.tensors = mg.tensors
        self.ancestry = Ancestry(mg.nodes)
        self.arena = Arena(mg.device_bytes)
        self.live: dict[int, LiveInstance] = {}        # tensor -> its live instance
        self.last_end: dict[int, int] = {}          # tensor -> ender of its last instance
        self.version: dict[int, int] = {}           # tensor -> apply writes so far
        self.last_write: dict[int, int] = {}        # tensor -> the apply that last wrote it
        self.host_version: dict[int, int] = {}      # tensor -> version its host copy holds
        self.host_nodes: dict[int, list[int]] = {}  # tensor -> nodes that made that host copy
        self.host_readers: dict[int, list[int]] = {}  # tensor -> readers of that host copy
        self.host_applies = 0
        self.host_inputs: dict[int, list[int]] = {}  # tensor -> its inputs at host
        #: weight tensor -> its input at device: the checkpoint's bytes, which no pass changes,
        #: are a host apply's host copy of it (rule 10; no reload's or output's: rules 6, 7)
        self.weights_at_device: dict[int, int] = {}
        self.instances = 0
        self.traffic = {"reload": [0, 0], "offload": [0, 0], "read": [0, 0]}
        self.host_arena = Arena(max(mg.host_arena_bytes, 1))
        self.staged: dict[int, LiveInstance] = {}      # tensor -> its live staging buffer
        self.disk_inputs: dict[int, list[int]] = {}  # tensor -> its inputs at disk
        self.buffers = 0
        self.received: dict[str, list[RecvNode]] = {}  # input -> the recvs that fill it
        for n in mg.nodes:
            if isinstance(n, RecvNode):
                self.received.setdefault(n.input, []).append(n)
        self.sent: list[tuple[SendNode, int]] = []  # each send and the version it sent

    # ------------------------------------------------------------ driver
    def run(self) -> ValidationReport:
        handlers = {"input": self._input, "read": self._read, "reload": self._reload,
                    "offload": self._offload, "free": self._free, "apply": self._apply,
                    "send": self._send, "recv": lambda node: None}
        for node in self.nodes:
            handlers[node.kind](node)
        self._check_peers()
        for inst in self.staged.values():
            raise self.mg.error(inst.creator, f"{self._kind(inst.creator)} reads "
                                              f"{self._name(inst.tensor)} from disk, but no "
                                              "reload consumes its staging buffer")
        self._check_outputs()
        traffic = self.traffic
        return ValidationReport(
            device_bytes=self.mg.device_bytes, nodes=len(self.nodes), instances=self.instances,
            peak_bytes=self.mg.high_water(), live_peak_bytes=self.mg.live_peak(),
            reloads=traffic["reload"][0], reload_bytes=traffic["reload"][1],
            offloads=traffic["offload"][0], offload_bytes=traffic["offload"][1],
            reads=traffic["read"][0], read_bytes=traffic["read"][1],
            host_arena_bytes=self.mg.host_arena_bytes, host_applies=self.host_applies)

    # ------------------------------------------------------------ messages
    def _occupy(self, arena: Arena, node, inst: LiveInstance, doing: Callable[[], str],
                live: Callable[[LiveInstance], str], held: Callable[[LiveInstance], str],
                ended: str, edge: str) -> None:
        """Make `inst` the occupant of its bytes in `arena` (the device arena or host staging):
        each previous occupant must have ended, and the node that ended it (`ended` its bytes)
        must be an ancestor of `node`, the `edge`-reuse edge. `doing` says what `node` does;
        `live` and `held` name a previous occupant: the messages of the two failures, formatted
        only on failure (this runs once per instance of a plan of millions of nodes)."""
        previous = arena.claim(inst.offset, inst.offset + inst.nbytes, inst)
        for occ in previous:
            if occ.ender is None:
                self._fail(node, f"{doing()}, which overlaps {live(occ)}")
        missing = self.ancestry.missing([occ.ender for occ in previous], node.id)
        if missing:
            occ = next(o for o in previous if o.ender == missing[0])
            self._fail(node, f"{doing()}, bytes last held by {held(occ)}, but "
                             f"{self._kind(occ.ender)}, which {ended} them, is not an ancestor "
                             f"(a missing {edge}-reuse edge)")

    def _fail(self, node: MemNode, message: str):
        raise self.mg.error(node.id, f"node %{node.id} ({node.kind}): {message}")

    def _kind(self, k: int) -> str:
        return f"node %{k} ({self.nodes[k].kind})"

    def _name(self, t: int) -> str:
        name = self.tensors[t].name
        return f"%t{t} ({name})" if name else f"%t{t}"

    # ------------------------------------------------------------ shared checks
    def _tensor(self, node: MemNode, t: object) -> int:
        if not isinstance(t, int) or not 0 <= t < len(self.tensors):
            self._fail(node, f"names tensor {t!r}, but the plan has tensors %t0..%t"
                             f"{len(self.tensors) - 1}")
        return t

    def _offset(self, node: MemNode, t: int, offset: object) -> int:
        if not isinstance(offset, int):
            self._fail(node, f"{self._name(t)} has offset {offset!r}, expected an int")
        return offset

    def _placed(self, node: MemNode, t: int, offset: object) -> int:
        nbytes = self.tensors[t].bytes
        self._offset(node, t, offset)
        if offset % ALIGNMENT:
            self._fail(node, f"{self._name(t)} {_at(offset)} is not aligned to {ALIGNMENT} bytes")
        if offset < 0 or offset + nbytes > self.mg.device_bytes:
            self._fail(node, f"{self._name(t)} at [{offset}, {offset + nbytes}) lies outside the "
                             f"arena [0, {self.mg.device_bytes})")
        return nbytes

    def _live(self, node: MemNode, t: int, offset: int, verb: str) -> LiveInstance:
        """The live instance of `t`, which must be at `offset` (rules 3 and 8)."""
        self._offset(node, t, offset)
        inst = self.live.get(t)
        if inst is None:
            ended = self.last_end.get(t)
            why = (f"its last instance was freed by {self._kind(ended)}" if ended is not None
                   else "it was never placed on the device")
            self._fail(node, f"{verb} {self._name(t)} {_at(offset)}, which is not live ({why})")
        if inst.offset != offset:
            self._fail(node, f"{verb} {self._name(t)} {_at(offset)}, but its live instance is at "
                             f"{_at(inst.offset)} (created by {self._kind(inst.creator)})")
        return inst

    def _check_written(self, node: MemNode, inst: LiveInstance, verb: str) -> None:
        """Rule 3: the last writer (hence every writer, by rule 4) is an ancestor."""
        if self.ancestry.missing([inst.last_writer], node.id):
            self._fail(node, f"{verb} {self._name(inst.tensor)} {_at(inst.offset)}, but its writer "
                             f"{self._kind(inst.last_writer)} is not an ancestor")

    def _check_after_uses(self, node: MemNode, inst: LiveInstance, verb: str) -> None:
        """Rule 4: every earlier access is an ancestor (the last writer and the reads since)."""
        missing = self.ancestry.missing([inst.last_writer, *inst.readers], node.id)
        if missing:
            u = missing[0]
            role = "writer" if u == inst.last_writer else "reader"
            self._fail(node, f"{verb} {self._name(inst.tensor)} {_at(inst.offset)}, but its "
                             f"earlier {role} {self._kind(u)} is not an ancestor")

    def _end(self, node: MemNode, inst: LiveInstance) -> None:
        inst.ender = node.id
        del self.live[inst.tensor]
        self.last_end[inst.tensor] = node.id

    def _create(self, node: MemNode, t: int, offset: object) -> LiveInstance:
        """Rules 2, 5 and 8 for a new instance of `t` created by `node`."""
        nbytes = self._placed(node, t, offset)
        old = self.live.get(t)
        if old is not None:
            self._fail(node, f"creates {self._name(t)} {_at(offset)} while it already has a "
                             f"live instance at {_at(old.offset)} (created by "
                             f"{self._kind(old.creator)})")
        ended = self.last_end.get(t)
        if ended is not None and self.ancestry.missing([ended], node.id):
            self._fail(node, f"creates a new instance of {self._name(t)}, but the end of its "
                             f"previous instance, {self._kind(ended)}, is not an ancestor")
        inst = LiveInstance(self.instances, t, offset, nbytes, node.id)
        self._occupy(self.arena, node, inst,
                     lambda: f"writes {self._name(t)} at [{offset}, {offset + nbytes})",
                     lambda o: f"live {self._name(o.tensor)} at [{o.offset}, "
                               f"{o.offset + o.nbytes}) (created by {self._kind(o.creator)})",
                     lambda o: f"{self._name(o.tensor)} {_at(o.offset)}", "freed", "memory")
        self.live[t] = inst
        self.instances += 1
        return inst

    def _host_copy(self, node: MemNode, t: int) -> None:
        """`node` leaves the tensor's current version on the host (rule 10: a newer version
        replaces the old copy only after every reader of it)."""
        v = self.version.get(t, 0)
        if self.host_version.get(t) == v:
            self.host_nodes[t].append(node.id)
            return
        missing = self.ancestry.missing(self.host_readers.get(t, []), node.id)
        if missing:
            self._fail(node, f"replaces the host copy of {self._name(t)}, but "
                             f"{self._kind(missing[0])}, which reads that copy, is not an "
                             "ancestor (a missing write-after-read edge on the host)")
        writers = [h for h in self.host_nodes.get(t, ()) if self.nodes[h].kind != "input"]
        missing = self.ancestry.missing(writers, node.id)
        if missing:
            self._fail(node, f"replaces the host copy of {self._name(t)}, but "
                             f"{self._kind(missing[0])}, which wrote that copy, is not an "
                             "ancestor (a missing write-after-write edge on the host)")
        self.host_version[t] = v
        self.host_nodes[t] = [node.id]
        self.host_readers[t] = []

    def _host_current(self, node: MemNode, t: int, verb: str) -> None:
        """Rules 6 and 10: `node` reads the host copy of `t`, which holds its latest version and
        was made by an ancestor."""
        host = self.host_nodes.get(t)
        if host is None:
            disk = " (it is at disk: a read must stage it)" if t in self.disk_inputs else ""
            self._fail(node, f"{verb} {self._name(t)}, which has no host copy (no input at host "
                             f"or offload of it comes before){disk}")
        if self.host_version[t] != self.version.get(t, 0):
            self._fail(node, f"{verb} a stale host copy of {self._name(t)}: made by "
                             f"{self._kind(host[-1])}, but {self._kind(self.last_write[t])} wrote "
                             f"the tensor since")
        if not self.ancestry.any_of(host, node.id):
            made = ", ".join(self._kind(h) for h in host)
            self._fail(node, f"{verb} {self._name(t)}, but no host copy of it ({made}) is an "
                             f"ancestor")

    # ------------------------------------------------------------ one method per node kind
    def _input(self, node: InputNode) -> None:
        t = self._tensor(node, node.tensor)
        if t in self.last_write:
            self._fail(node, f"input of {self._name(t)} comes after "
                             f"{self._kind(self.last_write[t])} wrote it")
        source = self.tensors[t].source
        if source is not None and source.input in self.received:
            box = (source.origin, self.tensors[t].shape)
            meets = [r.id for r in self.received[source.input]
                     if boxes_meet(r.origin, r.shape, *box)]
            missing = self.ancestry.missing(meets, node.id)
            if missing:
                self._fail(node, f"input of {self._name(t)} reads {source.input!r}, which "
                                 f"{self._kind(missing[0])} fills, but that recv is not an "
                                 "ancestor")
        if node.at == "host":
            if node.offset is not None:
                self._fail(node, f"input of {self._name(t)} at host has an offset ({node.offset})")
            self._host_copy(node, t)
            self.host_inputs.setdefault(t, []).append(node.id)
        elif node.at == "device":
            if node.offset is None:
                self._fail(node, f"input of {self._name(t)} at device has no offset")
            self._create(node, t, node.offset)
            if self.tensors[t].role == "weight":  # (rule 10: what a host apply may read)
                self.weights_at_device[t] = node.id
        elif node.at == "disk":
            if node.offset is not None:
                self._fail(node, f"input of {self._name(t)} at disk has an offset ({node.offset})")
            self.disk_inputs.setdefault(t, []).append(node.id)
            self.host_inputs.setdefault(t, []).append(node.id)
        else:
            self._fail(node, f"at is {node.at!r}, expected 'host', 'device' or 'disk'")

    def _read(self, node: ReadNode) -> None:
        """Rule 9 for a read: a staging buffer of the host arena, filled from the file."""
        t = self._tensor(node, node.tensor)
        at = node.host_offset
        nbytes = self.tensors[t].bytes
        if not isinstance(at, int):
            self._fail(node, f"{self._name(t)} has host_offset {at!r}, expected an int")
        if at % HOST_ALIGNMENT:
            self._fail(node, f"staging buffer of {self._name(t)} at host {_at(at)} is not "
                             f"aligned to {HOST_ALIGNMENT} bytes")
        if at < 0 or at + nbytes > self.mg.host_arena_bytes:
            self._fail(node, f"staging buffer of {self._name(t)} at [{at}, {at + nbytes}) lies "
                             f"outside the host arena [0, {self.mg.host_arena_bytes})")
        disk = self.disk_inputs.get(t)
        if not disk or not self.ancestry.any_of(disk, node.id):
            self._fail(node, f"reads {self._name(t)} from disk, but no input of it at disk is "
                             "an ancestor")
        if t in self.last_write:
            self._fail(node, f"reads {self._name(t)} from disk after "
                             f"{self._kind(self.last_write[t])} wrote it (the file is stale)")
        old = self.staged.get(t)
        if old is not None:
            self._fail(node, f"reads {self._name(t)} while its staging buffer at host "
                             f"{_at(old.offset)} (filled by {self._kind(old.creator)}) is not "
                             "yet consumed")
        inst = LiveInstance(self.buffers, t, at, nbytes, node.id)
        self.buffers += 1
        self._occupy(self.host_arena, node, inst,
                     lambda: f"reads {self._name(t)} into host [{at}, {at + nbytes})",
                     lambda o: f"the live staging buffer of {self._name(o.tensor)} at "
                               f"[{o.offset}, {o.offset + o.nbytes}) (filled by "
                               f"{self._kind(o.creator)})",
                     lambda o: self._name(o.tensor), "consumed", "host")
        self.staged[t] = inst
        self.traffic["read"][0] += 1
        self.traffic["read"][1] += nbytes

    def _reload(self, node: ReloadNode) -> None:
        t = self._tensor(node, node.tensor)
        guard = self._reload_guard(node) if node.guard is not None else None
        self._create(node, t, node.offset).guard = guard
        if node.host_offset is not None:
            self._reload_staged(node, t)
            return
        self._host_current(node, t, "reloads")
        self.host_readers.setdefault(t, []).append(node.id)
        self.traffic["reload"][0] += 1
        self.traffic["reload"][1] += self.tensors[t].bytes

    def _reload_guard(self, node: ReloadNode) -> tuple[int, int, int, float]:
        """Rule 11 at a guarded reload: its guard is read like an apply read."""
        g = node.guard
        a = g.access
        gt = self._tensor(node, a.tensor)
        inst = self._live(node, gt, a.offset, "guards its reload by")
        self._check_written(node, inst, "guards its reload by")
        size = 1
        for s in self.tensors[gt].shape:
            size *= s
        if not isinstance(g.index, int) or not 0 <= g.index < size:
            self._fail(node, f"guards its reload by element {g.index!r} of {self._name(gt)}, "
                             f"which has {size} elements")
        if not (isinstance(g.share, float) and 0 < g.share <= 1):
            self._fail(node, f"guard share {g.share!r} is not in (0, 1]")
        inst.readers.append(node.id)
        return gt, self.version.get(gt, 0), g.index, g.share

    def _check_guarded(self, node: ApplyNode, inst: LiveInstance, verb: str) -> None:
        """Rule 11 at an apply: an instance a guarded reload made is touched only under the
        same guard (the same element of the same version of the guard tensor)."""
        gt, version, index, share = inst.guard
        g = node.guard
        same = (g is not None and node.reads[-1].tensor == gt and g.index == index
                and g.share == share and self.version.get(gt, 0) == version)
        if not same:
            why = ("is not guarded" if g is None else
                   f"is guarded by element {g.index} of {self._name(node.reads[-1].tensor)}"
                   f" (version {self.version.get(node.reads[-1].tensor, 0)}, share {g.share})")
            self._fail(node, f"{verb} {self._name(inst.tensor)} {_at(inst.offset)}, which "
                             f"{self._kind(inst.creator)} reloaded only where element {index} "
                             f"of {self._name(gt)} (version {version}) is nonzero (share "
                             f"{share}), but it {why}")

    def _reload_staged(self, node: ReloadNode, t: int) -> None:
        """Rule 9 for a reload from a staging buffer: it consumes the buffer."""
        inst = self.staged.get(t)
        if inst is None or inst.offset != node.host_offset:
            where = ("no staging buffer of it is live" if inst is None else
                     f"its staging buffer is at host {_at(inst.offset)}")
            self._fail(node, f"reloads {self._name(t)} from host {_at(node.host_offset)}, but "
                             f"{where}")
        if self.ancestry.missing([inst.creator], node.id):
            self._fail(node, f"reloads {self._name(t)} from host {_at(inst.offset)}, but "
                             f"{self._kind(inst.creator)}, which reads it from disk, is not an "
                             "ancestor")
        inst.ender = node.id
        del self.staged[t]
        self.traffic["reload"][0] += 1
        self.traffic["reload"][1] += self.tensors[t].bytes

    def _offload(self, node: OffloadNode) -> None:
        t = self._tensor(node, node.tensor)
        inst = self._live(node, t, node.offset, "offloads")
        self._check_written(node, inst, "offloads")
        if inst.guard is not None:
            self._fail(node, f"offloads {self._name(t)} {_at(inst.offset)}, which "
                             f"{self._kind(inst.creator)} reloaded under a guard (its bytes "
                             "are garbage where the guard is off)")
        inst.readers.append(node.id)
        self._host_copy(node, t)
        self.traffic["offload"][0] += 1
        self.traffic["offload"][1] += inst.nbytes

    def _send(self, node: SendNode) -> None:
        t = self._tensor(node, node.tensor)
        if node.offset is None:
            self._host_current(node, t, "sends")
            self.host_readers.setdefault(t, []).append(node.id)
        else:
            inst = self._live(node, t, node.offset, "sends")
            self._check_written(node, inst, "sends")
            if inst.guard is not None:
                self._fail(node, f"sends {self._name(t)} {_at(inst.offset)}, which "
                                 f"{self._kind(inst.creator)} reloaded under a guard")
            inst.readers.append(node.id)
        if not any(o.tensor == t for o in self.mg.outputs):
            self._fail(node, f"sends {self._name(t)}, which is no output of the plan (a rank "
                             "sends the values its graph outputs)")
        self.sent.append((node, self.version.get(t, 0)))

    def _check_peers(self) -> None:
        """Rule 12's parts that need the whole program: each send sent the last version, the
        recvs of each input tile it."""
        for node, version in self.sent:
            if version != self.version.get(node.tensor, 0):
                self._fail(node, f"sends {self._name(node.tensor)} at version {version}, but "
                                 f"{self._kind(self.last_write[node.tensor])} writes it after")
        shapes = {t.name: t.shape for t in self.mg.inputs}
        for name, recvs in self.received.items():
            total = math.prod(shapes[name])
            got = 0
            for k, a in enumerate(recvs):
                got += math.prod(a.shape)
                for b in recvs[k + 1:]:
                    if boxes_meet(a.origin, a.shape, b.origin, b.shape):
                        self._fail(b, f"receives a box of {name!r} that {self._kind(a.id)} "
                                      "receives too")
            if got != total:
                self._fail(recvs[-1], f"the recvs of {name!r} fill {got} of its {total} "
                                      "elements")

    def _free(self, node: FreeNode) -> None:
        t = self._tensor(node, node.tensor)
        inst = self._live(node, t, node.offset, "frees")
        self._check_after_uses(node, inst, "frees")
        self._end(node, inst)

    def _apply(self, node: ApplyNode) -> None:
        if node.on_host:
            self._host_apply(node)
            return
        read = []
        for a in node.reads:
            inst = self._live(node, self._tensor(node, a.tensor), a.offset, "reads")
            self._check_written(node, inst, "reads")
            if inst.guard is not None:
                self._check_guarded(node, inst, "reads")
            read.append(inst)
        w = self._tensor(node, node.write.tensor)
        self._offset(node, w, node.write.offset)
        target = None
        if node.accumulate:
            target = self._live(node, w, node.write.offset, "accumulates into")
            self._check_after_uses(node, target, "accumulates into")
            if target.guard is not None:
                self._check_guarded(node, target, "accumulates into")
        for a in node.frees:
            inst = self._live(node, self._tensor(node, a.tensor), a.offset, "frees")
            if inst is target:
                self._fail(node, f"frees {self._name(w)} {_at(a.offset)}, the instance it "
                                 f"accumulates into")
            self._check_after_uses(node, inst, "frees")
            self._end(node, inst)
        missing = self.ancestry.missing(self.host_inputs.get(w, []), node.id)
        if missing:
            self._fail(node, f"writes {self._name(w)}, but its {self._kind(missing[0])} at host "
                             f"is not an ancestor")
        for inst in read:
            inst.readers.append(node.id)
        self.version[w] = self.version.get(w, 0) + 1
        self.last_write[w] = node.id
        if target is not None:
            target.last_writer = node.id
            target.readers = []
        else:
            self._create(node, w, node.write.offset)

    def _host_apply(self, node: ApplyNode) -> None:
        """Rule 10: an apply on host copies."""
        reads = [self._tensor(node, a.tensor) for a in node.reads]
        for t in reads:
            at_device = self.weights_at_device.get(t)
            if at_device is None or t in self.host_nodes or t in self.last_write:
                self._host_current(node, t, "reads on the host")
            elif not self.ancestry.any_of([at_device], node.id):
                self._fail(node, f"reads on the host {self._name(t)}, but its input "
                                 f"{self._kind(at_device)} is not an ancestor")
        w = self._tensor(node, node.write.tensor)
        inst = self.live.get(w)
        if inst is not None:
            self._fail(node, f"writes {self._name(w)} on the host while it has a live device "
                             f"instance at {_at(inst.offset)} (created by "
                             f"{self._kind(inst.creator)}), which would hold a stale version")
        if node.accumulate:
            self._host_current(node, w, "accumulates on the host into")
            missing = self.ancestry.missing(self.host_readers.get(w, []), node.id)
            if missing:
                self._fail(node, f"accumulates into the host copy of {self._name(w)}, but its "
                                 f"reader {self._kind(missing[0])} is not an ancestor")
        missing = self.ancestry.missing(self.host_inputs.get(w, []), node.id)
        if missing:
            self._fail(node, f"writes {self._name(w)}, but its {self._kind(missing[0])} at host "
                             f"is not an ancestor")
        for t in dict.fromkeys(reads):
            self.host_readers.setdefault(t, []).append(node.id)
        self.version[w] = self.version.get(w, 0) + 1
        self.last_write[w] = node.id
        self._host_copy(node, w)
        self.host_applies += 1

    # ------------------------------------------------------------ the end
    def _check_outputs(self) -> None:
        for o in self.mg.outputs:
            t = o.tensor
            where = f"output {o.name!r}{list(o.origin)}"
            if not isinstance(t, int) or not 0 <= t < len(self.tensors):
                raise PlanError(f"{where}: names tensor {t!r}, which does not exist")
            where = f"{where} {self._name(t)}"
            if o.at == "device":
                inst = self.live.get(t)
                if inst is None:
                    ended = self.last_end.get(t)
                    why = (f"its instance was freed by {self._kind(ended)}" if ended is not None
                           else "it was never placed on the device")
                    raise PlanError(f"{where}: not on the device at the end ({why})")
                if inst.offset != o.offset:
                    raise PlanError(f"{where}: expected at {o.offset!r}, but its instance at the "
                                    f"end is at {_at(inst.offset)} (created by "
                                    f"{self._kind(inst.creator)})")
                if inst.guard is not None:
                    raise PlanError(f"{where}: its instance at the end was reloaded under a "
                                    f"guard by {self._kind(inst.creator)} (garbage where the "
                                    "guard is off)")
            elif o.at == "host":
                host = self.host_nodes.get(t)
                if host is None:
                    raise PlanError(f"{where}: no host copy at the end (no offload of it)")
                if self.host_version[t] != self.version.get(t, 0):
                    raise PlanError(f"{where}: the host copy made by {self._kind(host[-1])} is "
                                    f"stale; {self._kind(self.last_write[t])} wrote the tensor "
                                    f"after it")
            else:
                raise PlanError(f"{where}: at is {o.at!r}, expected 'host' or 'device'")
