"""The memgraph: every block at an exact byte offset of one device arena, with explicit reload,
offload and free nodes and dependency edges (DESIGN.md, "MemGraph file format", version 1).

Node kinds: `input` (at host, or at device with an offset), `reload` (host -> device), `offload`
(device -> host; the device copy stays live), `free` (ends a device instance), `apply` (a block
op: reads, one write, optionally accumulating). `nodes` is one valid sequential order; the edges
alone must make every topological order correct (see `einpage.compiler.validator`).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from types import MappingProxyType
from typing import Mapping, Union

from einpage.errors import PlanError
from einpage.ir.dtypes import DType, as_dtype
from einpage.ir.ops import BlockOp, op_from_json, op_text
from einpage.ir.tensors import LogicalTensor, Source

FORMAT = "einpage.memgraph"
VERSION = 1
ALIGNMENT = 256


@dataclass(frozen=True, slots=True)
class TensorInfo:
    id: int
    bytes: int
    dtype: DType
    shape: tuple[int, ...]
    name: str
    role: str = "activation"  # weight | activation | cache | temp
    source: Source | None = None


@dataclass(frozen=True, slots=True)
class Access:
    tensor: int
    offset: int


@dataclass(frozen=True, slots=True)
class InputNode:
    id: int
    tensor: int
    at: str  # "host" | "device"
    offset: int | None = None
    deps: tuple[int, ...] = ()
    kind = "input"


@dataclass(frozen=True, slots=True)
class ReloadNode:
    id: int
    tensor: int
    offset: int
    deps: tuple[int, ...]
    kind = "reload"


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
    kind = "apply"


MemNode = Union[InputNode, ReloadNode, OffloadNode, FreeNode, ApplyNode]
_NODE_TYPES = (InputNode, ReloadNode, OffloadNode, FreeNode, ApplyNode)


def _tensor_ids(n: MemNode) -> list:
    if isinstance(n, ApplyNode):
        return [a.tensor for a in (*n.reads, n.write, *n.frees)]
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

    # ------------------------------------------------------------ structure
    def verify(self) -> None:
        """Check the structure every reader of a plan relies on; raise `PlanError` naming the
        first broken rule (and showing the nodes around it). Invariants:

        - `device_bytes` is a positive int;
        - `tensors[k].id == k`; every shape entry is a non-negative int; a tensor's `bytes` is
          `prod(shape) * dtype.itemsize`;
        - every node is one of the five kinds; `nodes[k].id == k`; every dep is an int id `< k`;
        - every tensor id a node or an output names exists.

        The rules of memory (liveness, overlap, host copies) are the validator's
        (`einpage.compiler.validate`), which calls this first."""
        if not isinstance(self.device_bytes, int) or self.device_bytes <= 0:
            raise PlanError(f"device_bytes is {self.device_bytes!r}, expected a positive int")
        for k, t in enumerate(self.tensors):
            if t.id != k:
                raise PlanError(f"tensor %t{k}: id is {t.id}, expected its position {k}")
            if any(not isinstance(s, int) or s < 0 for s in t.shape):
                raise PlanError(f"tensor %t{k} ({t.name}): bad shape {t.shape}")
            expected = math.prod(t.shape) * t.dtype.itemsize
            if t.bytes != expected:
                raise PlanError(f"tensor %t{k} ({t.name}): bytes is {t.bytes}, but "
                                f"{t.dtype}{list(t.shape)} takes {expected}")
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

    # ------------------------------------------------------------ summaries
    def count(self, kind: str) -> int:
        return sum(1 for n in self.nodes if n.kind == kind)

    def moved_bytes(self, kind: str) -> int:
        return sum(self.tensors[n.tensor].bytes for n in self.nodes if n.kind == kind)

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
                if not n.accumulate:
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
                [Access(n.tensor, n.offset)] if n.offset is not None else [])
            for a in accesses:
                top = max(top, a.offset + self.tensors[a.tensor].bytes)
        for o in self.outputs:
            if o.at == "device" and o.offset is not None:
                top = max(top, o.offset + self.tensors[o.tensor].bytes)
        return top

    def live_peak(self) -> int:
        """Most bytes live at once in the node order: the lower bound that a perfect,
        fragmentation-free placement of this order would need. While an `apply` runs, its output
        and the instances it frees coexist, except for the bytes the output takes over (consumed
        in place)."""
        delta = [0] * (len(self.nodes) + 1)   # bytes created (+) and ended (-) by each node
        during = [0] * len(self.nodes)        # extra bytes live only while the node runs
        writes = {}
        for n in self.nodes:
            if isinstance(n, ApplyNode) and n.frees and not n.accumulate:
                writes[n.id] = n.write
        for i in self.instances:
            delta[i.start] += i.bytes
            if i.end is not None:
                delta[i.end] -= i.bytes
                w = writes.get(i.end)
                if w is not None:  # freed by an apply: live until its write lands
                    lo, hi = w.offset, w.offset + self.tensors[w.tensor].bytes
                    overlap = max(0, min(hi, i.offset + i.bytes) - max(lo, i.offset))
                    during[i.end] += i.bytes - overlap
        live = top = 0
        for k in range(len(self.nodes)):
            top = max(top, live + delta[k] + during[k])
            live += delta[k]
            top = max(top, live)
        return top

    # ------------------------------------------------------------ printer
    def __str__(self) -> str:
        lines = [f"memgraph device_bytes={self.device_bytes} tensors={len(self.tensors)} "
                 f"nodes={len(self.nodes)}"]
        lines += [format_node(self, n) for n in self.nodes]
        lines += [f"output {o.name}{list(o.origin)} = %t{o.tensor} at {o.at}"
                  + (f" @0x{o.offset:08x}" if o.offset is not None else "") for o in self.outputs]
        return "\n".join(lines)

    # ------------------------------------------------------------ JSON
    def to_json(self) -> dict:
        return {
            "format": FORMAT, "version": VERSION, "device_bytes": self.device_bytes,
            "tensors": [_tensor_json(t) for t in self.tensors],
            "nodes": [_node_json(n) for n in self.nodes],
            "outputs": [{"tensor": o.tensor, "at": o.at, "offset": o.offset, "name": o.name,
                         "origin": list(o.origin)} for o in self.outputs],
            "inputs": [_logical_json(t) for t in self.inputs],
            "results": [_logical_json(t) for t in self.results],
            "meta": dict(self.meta),
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), separators=(",", ":")))

    @staticmethod
    def from_json(data: dict) -> "MemGraph":
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise PlanError(f"not an einpage plan (format is "
                            f"{data.get('format') if isinstance(data, dict) else type(data).__name__!r}, "
                            f"expected {FORMAT!r})")
        if data.get("version") != VERSION:
            raise PlanError(f"plan version {data.get('version')!r} is not supported "
                            f"(this einpage reads version {VERSION})")
        where = "plan"
        try:
            tensors = tuple(_tensor_from(t) for t in data["tensors"])
            nodes = []
            for k, n in enumerate(data["nodes"]):
                where = f"plan node {k}"
                nodes.append(_node_from(n))
            where = "plan outputs"
            outputs = tuple(OutputRef(int(o["tensor"]), o["at"], _opt_int(o.get("offset")),
                                      str(o.get("name", "")),
                                      tuple(int(v) for v in o.get("origin", ())))
                            for o in data["outputs"])
            inputs = tuple(_logical_from(t) for t in data.get("inputs", ()))
            results = tuple(_logical_from(t) for t in data.get("results", ()))
            return MemGraph(int(data["device_bytes"]), tensors, tuple(nodes), outputs, inputs,
                            results, MappingProxyType(dict(data.get("meta", {}))))
        except PlanError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise PlanError(f"{where}: malformed ({type(exc).__name__}: {exc})") from None

    @staticmethod
    def load(path: str | Path) -> "MemGraph":
        try:
            text = Path(path).read_text()
        except FileNotFoundError:
            raise PlanError(f"{path}: no such plan file") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise PlanError(f"{path}: cannot read: {exc}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanError(f"{path}: not JSON: {exc}") from None
        try:
            return MemGraph.from_json(data)
        except PlanError as exc:
            raise PlanError(f"{path}: {exc}") from None


def _opt_int(v):
    return None if v is None else int(v)


def _tensor_json(t: TensorInfo) -> dict:
    out = {"id": t.id, "bytes": t.bytes, "dtype": t.dtype.value, "shape": list(t.shape),
           "name": t.name, "role": t.role}
    if t.source is not None:
        out["source"] = {"input": t.source.input, "origin": list(t.source.origin),
                         "full_shape": list(t.source.full_shape),
                         "checkpoint": t.source.checkpoint}
    return out


def _tensor_from(d: dict) -> TensorInfo:
    src = d.get("source")
    source = None if src is None else Source(str(src["input"]), tuple(int(v) for v in src["origin"]),
                                             tuple(int(v) for v in src["full_shape"]),
                                             None if src.get("checkpoint") is None
                                             else str(src["checkpoint"]))
    return TensorInfo(int(d["id"]), int(d["bytes"]), as_dtype(d["dtype"]),
                      tuple(int(v) for v in d["shape"]), str(d.get("name", "")),
                      str(d.get("role", "activation")), source)


def _logical_json(t: LogicalTensor) -> dict:
    return {"name": t.name, "role": t.role, "shape": list(t.shape), "dtype": t.dtype.value}


def _logical_from(d: dict) -> LogicalTensor:
    return LogicalTensor(str(d["name"]), str(d["role"]), tuple(int(v) for v in d["shape"]),
                         as_dtype(d["dtype"]))


def _access(d: dict) -> Access:
    return Access(int(d["tensor"]), int(d["offset"]))


def _node_json(n: MemNode) -> dict:
    out: dict = {"id": n.id, "kind": n.kind}
    if isinstance(n, InputNode):
        out.update(tensor=n.tensor, at=n.at)
        if n.offset is not None:
            out["offset"] = n.offset
    elif isinstance(n, ApplyNode):
        out.update(reads=[{"tensor": a.tensor, "offset": a.offset} for a in n.reads],
                   write={"tensor": n.write.tensor, "offset": n.write.offset},
                   accumulate=n.accumulate,
                   frees=[{"tensor": a.tensor, "offset": a.offset} for a in n.frees],
                   op=n.op.to_json())
    else:
        out.update(tensor=n.tensor, offset=n.offset)
    out["deps"] = list(n.deps)
    return out


def _node_from(d: dict) -> MemNode:
    kind, nid, deps = d["kind"], int(d["id"]), tuple(int(v) for v in d.get("deps", ()))
    if kind == "input":
        return InputNode(nid, int(d["tensor"]), str(d["at"]), _opt_int(d.get("offset")), deps)
    if kind == "apply":
        return ApplyNode(nid, tuple(_access(a) for a in d["reads"]), _access(d["write"]),
                         bool(d["accumulate"]), op_from_json(d["op"]), deps,
                         tuple(_access(a) for a in d.get("frees", ())))
    cls = {"reload": ReloadNode, "offload": OffloadNode, "free": FreeNode}.get(kind)
    if cls is None:
        raise ValueError(f"unknown node kind {kind!r}")
    return cls(nid, int(d["tensor"]), int(d["offset"]), deps)


def format_node(mg: MemGraph, n: MemNode) -> str:
    """`%12 = apply einsum[bsm,nm->bsn](%t3@0x..., %t9@0x...) -> %t10 @0x00800000 deps=[4,11]`."""
    deps = f" deps=[{','.join(map(str, n.deps))}]" if n.deps else ""
    if isinstance(n, InputNode):
        where = f" @0x{n.offset:08x}" if n.at == "device" else ""
        return f"%{n.id} = input %t{n.tensor} at {n.at}{where}{deps}"
    if isinstance(n, ApplyNode):
        args = ", ".join(f"%t{a.tensor}@0x{a.offset:08x}" for a in n.reads)
        acc = " +=" if n.accumulate else ""
        return (f"%{n.id} = apply {op_text(n.op)}({args}) ->{acc} %t{n.write.tensor} "
                f"@0x{n.write.offset:08x}{deps}")
    return f"%{n.id} = {n.kind} %t{n.tensor} @0x{n.offset:08x}{deps}"
