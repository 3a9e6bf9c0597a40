"""The memgraph: every block at an exact byte offset of one device arena, with explicit reload,
offload and free nodes and dependency edges (DESIGN.md, "MemGraph file format", versions 1 and
2). A plan made by the compiler carries the taskgraph it translates (`graph`): each tensor names
its block, each apply its task, and a version 2 file records that graph with its hash
(`einpage.ir.provenance`), so that the validator can prove the plan computes it.

Node kinds: `input` (at host, at disk, or at device with an offset), `read` (disk -> a staging
buffer at `host_offset` of the host arena), `reload` (host -> device; from the staging buffer at
`host_offset` when it has one; a *guarded* reload, version 2, only where an element of a guard
block on the device is nonzero), `offload` (device -> host; the device copy stays live), `free`
(ends a device instance), `apply` (a block op: reads, one write, optionally accumulating; on the
device, or `on: "host"`: it reads and writes host copies, named by tensor, with no offsets).
A plan for several devices (version 2) is one program per rank (`rank`, `world`): a `send` (a
block of a tensor the plan makes, from its device instance or its host copy, to a peer rank with
a tag) and a `recv` (a box of a logical input of the plan, from a peer, into that input's host
copy, which the input blocks of it then read) carry the tensors that cross ranks
(`einpage.compiler.pipeline`).
`nodes` is one valid sequential order; the edges alone must make every topological order correct
(see `einpage.ir.validator`). The JSON form and the file are `einpage.ir.planfile`'s.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from types import MappingProxyType
from typing import Mapping, Union

from einpage.errors import PlanError
from einpage.ir.dtypes import DType
from einpage.ir.ops import BlockOp, GuardedOp, op_text
from einpage.ir.storage import Storage, tensor_bytes
from einpage.ir.taskgraph import TaskGraph
from einpage.ir.tensors import LogicalTensor, Source

FORMAT = "einpage.memgraph"
#: what `save` writes for a plan with provenance (a plan without one is written as version 1)
VERSION = 2
VERSIONS = (1, 2)
#: where an apply may run (`ApplyNode.on`)
PLACES = ("device", "host")
ALIGNMENT = 256
#: staging buffers in the host arena start at page boundaries (direct I/O needs them)
HOST_ALIGNMENT = 4096


@dataclass(frozen=True, slots=True)
class TensorInfo:
    id: int
    bytes: int
    dtype: DType
    shape: tuple[int, ...]
    name: str
    role: str = "activation"  # weight | activation | cache | temp
    source: Source | None = None
    block: int | None = None  # provenance: the block of the plan's graph this tensor is
    storage: Storage | None = None  # packed weight or KV bytes (`einpage.ir.storage`)


#: id(taskgraph) -> its `block_tensors` (a compile's search lowers one taskgraph dozens of
#: times; dropped with the taskgraph)
_BLOCK_TENSORS: dict[int, tuple[TensorInfo, ...]] = {}


def block_tensors(tg: TaskGraph) -> tuple[TensorInfo, ...]:
    """The tensors a memgraph lowered from `tg` lists: one per block, made once per taskgraph
    (the same tuple for every plan of it)."""
    got = _BLOCK_TENSORS.get(id(tg))
    if got is None:
        got = _BLOCK_TENSORS[id(tg)] = tuple(
            TensorInfo(b.id, b.bytes, b.dtype, b.shape, b.name, b.role, b.source, block=b.id,
                       storage=b.storage) for b in tg.blocks)
        weakref.finalize(tg, _BLOCK_TENSORS.pop, id(tg), None)
    return got


@dataclass(frozen=True, slots=True)
class Access:
    tensor: int
    offset: int | None  # None: the tensor's host copy (an apply on the host)


@dataclass(frozen=True, slots=True)
class InputNode:
    id: int
    tensor: int
    at: str  # "host" | "device" | "disk" (read from the checkpoint file each pass)
    offset: int | None = None
    deps: tuple[int, ...] = ()
    kind = "input"


@dataclass(frozen=True, slots=True)
class ReloadGuard:
    """A reload done only where element `index` (flat, C order) of the guard block's instance
    `access` is nonzero: a mixture-of-experts weight block loaded only when the router chose its
    expert (the guard of every apply that reads the instance, whose guard reads the same version
    of that block; the validator's rule 11). Skipped, it moves no byte and the instance holds
    garbage no apply reads. `share`: the expected fraction of passes it is on (its readers'),
    which prediction prices the copy at."""
    access: Access
    index: int
    share: float = 1.0


@dataclass(frozen=True, slots=True)
class ReloadNode:
    id: int
    tensor: int
    offset: int
    deps: tuple[int, ...]
    host_offset: int | None = None  # from the staging buffer a `read` filled; None: host copy
    guard: ReloadGuard | None = None
    kind = "reload"


@dataclass(frozen=True, slots=True)
class ReadNode:
    """Disk -> host: the tensor's block read from its checkpoint file into the staging buffer
    `[host_offset, host_offset + bytes)` of the host arena; the reload that names the same
    `host_offset` consumes it (its bytes may then take another read)."""
    id: int
    tensor: int
    host_offset: int
    deps: tuple[int, ...]
    kind = "read"


@dataclass(frozen=True, slots=True)
class OffloadNode:
    id: int
    tensor: int
    offset: int
    deps: tuple[int, ...]
    kind = "offload"


@dataclass(frozen=True, slots=True)
class FreeNode:
    id: int
    tensor: int
    offset: int
    deps: tuple[int, ...]
    kind = "free"


@dataclass(frozen=True, slots=True)
class ApplyNode:
    id: int
    reads: tuple[Access, ...]
    write: Access
    accumulate: bool
    op: BlockOp
    deps: tuple[int, ...]
    frees: tuple[Access, ...] = ()
    task: int | None = None  # provenance: the task of the plan's graph this apply runs
    #: where it runs: "device" (on the arena's instances) or "host" (on host copies, on a queue
    #: of its own; its accesses carry no offset and it frees nothing)
    on: str = "device"
    kind = "apply"

    @property
    def on_host(self) -> bool:
        return self.on == "host"

    @property
    def guard(self) -> GuardedOp | None:
        """The guard of a guarded op (`einpage.ir.ops.GuardedOp`; its block the last read)."""
        return self.op if isinstance(self.op, GuardedOp) else None

    def unguarded(self) -> "ApplyNode":
        """The apply its guard runs when on: its op, reading all but the guard block."""
        op = self.op
        return replace(self, op=op.op, reads=self.reads[:-1]) if isinstance(op, GuardedOp) else self


@dataclass(frozen=True, slots=True)
class SendNode:
    """Tensor `tensor`'s current bytes to rank `peer` under `tag`: its device instance at
    `offset`, or (`offset` None) its host copy. A pipeline stage's boundary block, sent once
    final; the instance or copy stays."""
    id: int
    tensor: int
    offset: int | None
    peer: int
    tag: int
    deps: tuple[int, ...]
    kind = "send"


@dataclass(frozen=True, slots=True)
class RecvNode:
    """The box `origin` + `shape` of logical input `input` (an activation of this rank's
    program) from rank `peer` under `tag`, into that input's host copy: an input block of it is
    read only after every recv whose box meets its own (its input node depends on them)."""
    id: int
    input: str
    origin: tuple[int, ...]
    shape: tuple[int, ...]
    peer: int
    tag: int
    deps: tuple[int, ...]
    kind = "recv"


def renumbered(n: MemNode, node_id: int, deps: tuple[int, ...], **changes) -> MemNode:
    """`dataclasses.replace(n, id=node_id, deps=deps, **changes)` for a node (a frozen, slotted
    record) without `replace`'s checks of the fields: 1.05 against 1.53 us a node. The disk
    tier renumbers a plan's every node for each tiering it weighs (780k nodes in one llama-30b
    compile at 8 GB / 32 GB: its compile 13.9 -> 13.4 s, llama-7b decode B=8 at 8 GB / 14 GB
    11.9 -> 10.9 s, side by side)."""
    cls = type(n)
    new = object.__new__(cls)
    set_ = object.__setattr__
    for name in cls.__slots__:
        set_(new, name, changes[name] if name in changes else getattr(n, name))
    set_(new, "id", node_id)
    set_(new, "deps", deps)
    return new


def boxes_meet(origin_a, shape_a, origin_b, shape_b) -> bool:
    """Whether two boxes of one tensor share an element (a recv's box and an input block's)."""
    return all(a < b + m and b < a + n
               for a, n, b, m in zip(origin_a, shape_a, origin_b, shape_b))


MemNode = Union[InputNode, ReadNode, ReloadNode, OffloadNode, FreeNode, ApplyNode, SendNode,
                RecvNode]
_NODE_TYPES = (InputNode, ReadNode, ReloadNode, OffloadNode, FreeNode, ApplyNode, SendNode,
               RecvNode)
#: the kinds a program for one rank of several may hold beyond one device's
PEER_KINDS = ("send", "recv")


def _check_place(mg: "MemGraph", n: ApplyNode) -> None:
    """An apply runs on the device with an offset for every access, or on the host with none
    and no `frees` (it touches no device instance)."""
    if n.on not in PLACES:
        raise mg.error(n.id, f"node %{n.id} (apply): on is {n.on!r}, expected one of "
                             f"{', '.join(PLACES)}")
    accesses = (*n.reads, n.write)
    if n.on_host:
        if n.frees:
            raise mg.error(n.id, f"node %{n.id} (apply on host): frees device instances; a host "
                                 "apply touches none (a free node ends them)")
        if any(a.offset is not None for a in accesses):
            raise mg.error(n.id, f"node %{n.id} (apply on host): an access has a device offset; "
                                 "a host apply names host copies by tensor alone")
    elif any(a.offset is None for a in (*accesses, *n.frees)):
        raise mg.error(n.id, f"node %{n.id} (apply): an access has no offset (only an apply on "
                             "the host names host copies)")


def _check_peer(mg: "MemGraph", n) -> None:
    """A send or recv names another rank of the world and a tag; a recv, a box of an activation
    input of the plan."""
    if not isinstance(n.peer, int) or not 0 <= n.peer < mg.world or n.peer == mg.rank:
        raise mg.error(n.id, f"node %{n.id} ({n.kind}): peer {n.peer!r} is not another rank of "
                             f"this program's world (rank {mg.rank} of {mg.world})")
    if not isinstance(n.tag, int) or n.tag < 0:
        raise mg.error(n.id, f"node %{n.id} ({n.kind}): tag {n.tag!r} is not a non-negative int")
    if isinstance(n, RecvNode):
        whole = {t.name: t for t in mg.inputs}.get(n.input)
        if whole is None or whole.role != "activation":
            raise mg.error(n.id, f"node %{n.id} (recv): {n.input!r} is not an activation input "
                                 "of the plan")
        if not len(n.origin) == len(n.shape) == len(whole.shape) or any(
                not isinstance(o, int) or not isinstance(e, int) or o < 0 or e < 1 or o + e > f
                for o, e, f in zip(n.origin, n.shape, whole.shape)):
            raise mg.error(n.id, f"node %{n.id} (recv): box {list(n.shape)} at "
                                 f"{list(n.origin)} lies outside input {n.input!r} of shape "
                                 f"{list(whole.shape)}")
    elif n.offset is not None and not isinstance(n.offset, int):
        raise mg.error(n.id, f"node %{n.id} (send): offset {n.offset!r} is not an int or null")


def _tensor_ids(n: MemNode) -> list:
    if isinstance(n, ApplyNode):
        return [a.tensor for a in (*n.reads, n.write, *n.frees)]
    if isinstance(n, ReloadNode) and n.guard is not None:
        return [n.tensor, n.guard.access.tensor]
    if isinstance(n, RecvNode):
        return []
    return [n.tensor]


@dataclass(frozen=True, slots=True)
class Instance:
    """One device copy of a tensor: its bytes `[offset, offset + bytes)`, live from node `start`
    (which creates it) to node `end` (which ends it; None: still live at the end)."""
    tensor: int
    offset: int
    bytes: int
    start: int
    end: int | None


@dataclass(frozen=True, slots=True)
class OutputRef:
    """Block `tensor` of graph output `name`, at `origin` in it; where it is at the end."""
    tensor: int
    at: str
    offset: int | None
    name: str
    origin: tuple[int, ...]


@dataclass(frozen=True)
class MemGraph:
    device_bytes: int
    tensors: tuple[TensorInfo, ...]
    nodes: tuple[MemNode, ...]
    outputs: tuple[OutputRef, ...]
    inputs: tuple[LogicalTensor, ...] = ()
    results: tuple[LogicalTensor, ...] = ()
    meta: Mapping[str, object] = field(default_factory=lambda: MappingProxyType({}),
                                       compare=False)  # what the plan was made for; read-only
    host_arena_bytes: int = 0  # the staging buffers of `read` nodes: one host arena
    #: provenance: the taskgraph this plan translates (None: a plan that does not say, such as a
    #: version 1 file; the validator then cannot prove what it computes)
    graph: TaskGraph | None = field(default=None, compare=False, repr=False)
    rank: int = 0   # several devices: this program's rank of `world` (send, recv)
    world: int = 1

    # ------------------------------------------------------------ structure
    def verify(self) -> None:
        """Check the structure every reader of a plan relies on; raise `PlanError` naming the
        first broken rule (and showing the nodes around it). Invariants:

        - its sequences are tuples (a plan is immutable, so a validation report stays true);
        - `device_bytes` is a positive int; `host_arena_bytes` a non-negative int;
        - `tensors[k].id == k`; every shape entry is a non-negative int; a tensor's `bytes` is
          `prod(shape) * dtype.itemsize`, or its packed size with a `storage`;
        - every node is one of the six kinds; `nodes[k].id == k`; every dep is an int id `< k`;
        - every tensor id a node or an output names exists;
        - `0 <= rank < world`; a send or recv names a peer rank other than its own, a
          non-negative tag, and a recv a box inside an activation input of the plan.

        The rules of memory (liveness, overlap, host copies) are the validator's
        (`einpage.ir.validate`), which calls this first."""
        for name in ("tensors", "nodes", "outputs", "inputs", "results"):
            if not isinstance(getattr(self, name), tuple):  # a report must outlive no change
                raise PlanError(f"{name} is a {type(getattr(self, name)).__name__}, expected a "
                                "tuple (a plan is immutable)")
        if not isinstance(self.device_bytes, int) or self.device_bytes <= 0:
            raise PlanError(f"device_bytes is {self.device_bytes!r}, expected a positive int")
        if not isinstance(self.host_arena_bytes, int) or self.host_arena_bytes < 0:
            raise PlanError(f"host_arena_bytes is {self.host_arena_bytes!r}, expected a "
                            "non-negative int")
        for k, t in enumerate(self.tensors):
            if t.id != k:
                raise PlanError(f"tensor %t{k}: id is {t.id}, expected its position {k}")
            if any(not isinstance(s, int) or s < 0 for s in t.shape):
                raise PlanError(f"tensor %t{k} ({t.name}): bad shape {t.shape}")
            if t.storage is not None and t.storage.fits(t.shape):
                raise PlanError(f"tensor %t{k} ({t.name}): cannot be stored as "
                                f"{t.storage.format}: {t.storage.fits(t.shape)}")
            expected = tensor_bytes(t.shape, t.dtype, t.storage)
            if t.bytes != expected:
                packed = f" as {t.storage.format}" if t.storage is not None else ""
                raise PlanError(f"tensor %t{k} ({t.name}): bytes is {t.bytes}, but "
                                f"{t.dtype}{list(t.shape)}{packed} takes {expected}")
        if (not isinstance(self.world, int) or not isinstance(self.rank, int) or self.world < 1
                or not 0 <= self.rank < self.world):
            raise PlanError(f"rank {self.rank!r} of world {self.world!r}: expected "
                            "0 <= rank < world")
        count = len(self.tensors)
        for k, node in enumerate(self.nodes):
            if not isinstance(node, _NODE_TYPES):
                raise PlanError(f"node {k}: {type(node).__name__} is not a memgraph node")
            if node.id != k:
                raise self.error(k, f"node %{node.id} ({node.kind}): id is {node.id}, expected "
                                    f"its position {k}")
            for d in node.deps:
                if not isinstance(d, int) or not 0 <= d < k:
                    raise self.error(k, f"node %{k} ({node.kind}): dep {d!r} is not an earlier "
                                        f"node id (deps name ids < {k})")
            for t in _tensor_ids(node):
                if not isinstance(t, int) or not 0 <= t < count:
                    raise self.error(k, f"node %{k} ({node.kind}): names tensor {t!r}, but the "
                                        f"plan has tensors %t0..%t{count - 1}")
            if isinstance(node, ApplyNode):
                _check_place(self, node)
            elif isinstance(node, (SendNode, RecvNode)):
                _check_peer(self, node)
        for o in self.outputs:
            if not isinstance(o.tensor, int) or not 0 <= o.tensor < count:
                raise PlanError(f"output {o.name!r}{list(o.origin)}: names tensor {o.tensor!r}, "
                                "which does not exist")

    def error(self, node_id: int, message: str) -> PlanError:
        """A `PlanError` whose message ends with the nodes around `node_id` (torch.fx style)."""
        return PlanError(f"{message}\n{self.around(node_id)}")

    def around(self, node_id: int, radius: int = 2) -> str:
        """The listing of the nodes within `radius` of `node_id`, that one marked with `>`."""
        lines = []
        for k in range(max(0, node_id - radius), min(len(self.nodes), node_id + radius + 1)):
            try:
                text = format_node(self, self.nodes[k])
            except Exception:  # a node malformed enough not to print
                text = repr(self.nodes[k])
            lines.append(f"{'>' if k == node_id else ' '} {text}")
        return "\n".join(lines)

    @cached_property
    def graph_hash(self) -> str | None:
        """The hash of the plan's graph (`einpage.ir.provenance`); None without one."""
        if self.graph is None:
            return None
        from einpage.ir.planfile import plan_graph_hash
        return plan_graph_hash(self)

    # ------------------------------------------------------------ summaries
    def count(self, kind: str) -> int:
        return sum(1 for n in self.nodes if n.kind == kind)

    def moved_bytes(self, kind: str) -> int:
        return sum(self.tensors[n.tensor].bytes for n in self.nodes if n.kind == kind)

    def host_written(self) -> frozenset[int]:
        """The tensors applies on the host write (their host copies are where they are made; a
        reload of one runs on the `h2d_host` queue: `runtime.streams.queues_of`)."""
        return frozenset(n.write.tensor for n in self.nodes
                         if isinstance(n, ApplyNode) and n.on_host)

    def host_arena_peak(self) -> int:
        """Highest byte of the host arena a `read` names (0 without a disk tier)."""
        return max((n.host_offset + self.tensors[n.tensor].bytes for n in self.nodes
                    if isinstance(n, ReadNode)), default=0)

    @cached_property
    def instances(self) -> tuple[Instance, ...]:
        """Every device instance, replayed once in node order: where it lies, the node that
        creates it (`input` at device, `reload`, non-accumulating `apply`) and the node that ends
        it (`free`, or an `apply` listing it in `frees`; None: live at the end). Nodes naming no
        live instance are skipped (the validator reports them)."""
        out: list[Instance] = []
        live: dict[int, int] = {}  # tensor -> index in `out`

        def end(tensor: int, node: int) -> None:
            k = live.pop(tensor, None)
            if k is not None:
                out[k] = replace(out[k], end=node)

        def create(tensor: int, offset, node: int) -> None:
            if isinstance(offset, int):
                end(tensor, node)
                live[tensor] = len(out)
                out.append(Instance(tensor, offset, self.tensors[tensor].bytes, node, None))

        for n in self.nodes:
            if isinstance(n, ApplyNode):
                for a in n.frees:
                    end(a.tensor, n.id)
                if not n.accumulate and not n.on_host:
                    create(n.write.tensor, n.write.offset, n.id)
            elif isinstance(n, ReloadNode) or (isinstance(n, InputNode) and n.at == "device"):
                create(n.tensor, n.offset, n.id)
            elif isinstance(n, FreeNode):
                end(n.tensor, n.id)
        return tuple(out)

    def high_water(self) -> int:
        """Highest arena byte the plan names (the arena it really needs): every instance, and
        every access and device output, so that a malformed plan is covered too."""
        top = max((i.offset + i.bytes for i in self.instances), default=0)
        for n in self.nodes:
            accesses = (*n.reads, n.write, *n.frees) if isinstance(n, ApplyNode) else (
                [Access(n.tensor, n.offset)] if getattr(n, "offset", None) is not None else [])
            for a in accesses:
                if a.offset is not None:
                    top = max(top, a.offset + self.tensors[a.tensor].bytes)
        for o in self.outputs:
            if o.at == "device" and o.offset is not None:
                top = max(top, o.offset + self.tensors[o.tensor].bytes)
        return top

    def live_peak(self) -> int:
        """Most bytes live at once in the node order: the lower bound that a perfect,
        fragmentation-free placement of this order would need. While an `apply` runs, its output
        and the instances it frees coexist, except for the bytes the output takes over (consumed
        in place). The instances as `instances` replays them, in one pass that makes none (the
        compiler's search asks this of every plan it lowers)."""
        tensors = self.tensors
        live: dict[int, tuple[int, int]] = {}  # tensor -> (offset, bytes) of its instance
        now = top = 0

        def create(tensor: int, offset) -> int:
            if not isinstance(offset, int):
                return 0
            nbytes = tensors[tensor].bytes
            old = live.get(tensor)
            live[tensor] = (offset, nbytes)
            return nbytes - (old[1] if old is not None else 0)

        def beside(gone: tuple[int, int], w: Access) -> int:
            """The bytes of an instance (offset, bytes) ended by an apply that writes `w`
            which stay live until that write lands: those outside its bytes."""
            (at, nbytes), lo = gone, w.offset
            hi = lo + tensors[w.tensor].bytes
            return nbytes - max(0, min(hi, at + nbytes) - max(lo, at))

        for n in self.nodes:
            during = 0  # bytes live only while the node runs
            if isinstance(n, ApplyNode):
                for a in n.frees:
                    gone = live.pop(a.tensor, None)
                    if gone is not None:
                        now -= gone[1]
                        if not n.accumulate:
                            during += beside(gone, n.write)
                if not n.accumulate and not n.on_host:
                    w = n.write
                    gone = live.get(w.tensor) if n.frees and isinstance(w.offset, int) else None
                    if gone is not None:  # (ended by this write, as a freed one: malformed)
                        during += beside(gone, w)
                    now += create(w.tensor, w.offset)
            elif isinstance(n, ReloadNode) or (isinstance(n, InputNode) and n.at == "device"):
                now += create(n.tensor, n.offset)
            elif isinstance(n, FreeNode):
                gone = live.pop(n.tensor, None)
                if gone is not None:
                    now -= gone[1]
            top = max(top, now + during)
        return top

    # ------------------------------------------------------------ printer
    def __str__(self) -> str:
        host = f" host_arena_bytes={self.host_arena_bytes}" if self.host_arena_bytes else ""
        lines = [f"memgraph device_bytes={self.device_bytes}{host} tensors={len(self.tensors)} "
                 f"nodes={len(self.nodes)}"]
        lines += [format_node(self, n) for n in self.nodes]
        lines += [f"output {o.name}{list(o.origin)} = %t{o.tensor} at {o.at}"
                  + (f" @0x{o.offset:08x}" if o.offset is not None else "") for o in self.outputs]
        return "\n".join(lines)

    # ------------------------------------------------------------ JSON (einpage.ir.planfile)
    def to_json(self) -> dict:
        """Version 2 with the plan's graph; version 1 for a plan without one."""
        from einpage.ir.planfile import plan_json
        return plan_json(self)

    def save(self, path: str | Path) -> None:
        """Write the plan to `path`: compact JSON (DESIGN.md; version 2 with its graph, else
        version 1), gzip-compressed when the name ends in `.gz` (about 10x smaller; `load` reads
        both, by content). Whole or not at all: a temporary file beside `path` renamed into
        place (`einpage.outputs`); a failure (no such directory, a full disk, a file-size
        limit) is an `OutputError`."""
        from einpage.ir.planfile import write_plan_json
        write_plan_json(path, self.to_json)

    @staticmethod
    def from_json(data: dict) -> "MemGraph":
        from einpage.ir.planfile import plan_from_json
        return plan_from_json(data)

    @staticmethod
    def load(path: str | Path) -> "MemGraph":
        """Read a plan file: JSON (DESIGN.md, version 1 or 2) or the same JSON gzip-compressed
        (told apart by its first bytes, whatever the name). Every failure is one `PlanError`
        naming the file: missing, unreadable, a corrupt or truncated gzip stream, not JSON, not
        a plan."""
        from einpage.ir.planfile import load_plan_file
        return load_plan_file(path)


def format_node(mg: MemGraph, n: MemNode) -> str:
    """`%12 = apply einsum[bsm,nm->bsn](%t3@0x..., %t9@0x...) -> %t10 @0x00800000 deps=[4,11]`."""
    deps = f" deps=[{','.join(map(str, n.deps))}]" if n.deps else ""
    if isinstance(n, InputNode):
        where = f" @0x{n.offset:08x}" if n.at == "device" else ""
        return f"%{n.id} = input %t{n.tensor} at {n.at}{where}{deps}"
    if isinstance(n, ReadNode):
        return f"%{n.id} = read %t{n.tensor} -> host @0x{n.host_offset:08x}{deps}"
    if isinstance(n, ReloadNode) and (n.host_offset is not None or n.guard is not None):
        src = f" host @0x{n.host_offset:08x} ->" if n.host_offset is not None else ""
        g = n.guard
        when = (f" if %t{g.access.tensor}@0x{g.access.offset:08x}[{g.index}]"
                if g is not None else "")
        return f"%{n.id} = reload %t{n.tensor}{src} @0x{n.offset:08x}{when}{deps}"
    if isinstance(n, SendNode):
        where = f"@0x{n.offset:08x}" if n.offset is not None else " host"
        return f"%{n.id} = send %t{n.tensor}{where} -> rank {n.peer} tag {n.tag}{deps}"
    if isinstance(n, RecvNode):
        return (f"%{n.id} = recv {n.input}{list(n.shape)} at {list(n.origin)} <- rank {n.peer} "
                f"tag {n.tag}{deps}")
    if isinstance(n, ApplyNode):
        def at(a: Access) -> str:
            return f"%t{a.tensor}@0x{a.offset:08x}" if a.offset is not None else f"%t{a.tensor}"
        args = ", ".join(at(a) for a in n.reads)
        acc = " +=" if n.accumulate else ""
        place = " on host" if n.on_host else ""
        out = at(n.write).replace("@", " @")
        return f"%{n.id} = apply{place} {op_text(n.op)}({args}) ->{acc} {out}{deps}"
    return f"%{n.id} = {n.kind} %t{n.tensor} @0x{n.offset:08x}{deps}"
