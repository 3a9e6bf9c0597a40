"""The memgraph: every block at an exact byte offset of one device arena, with explicit reload,
offload and free nodes and dependency edges (DESIGN.md, "MemGraph file format", version 1).

Node kinds: `input` (at host, or at device with an offset), `reload` (host -> device), `offload`
(device -> host; the device copy stays live), `free` (ends a device instance), `apply` (a block
op: reads, one write, optionally accumulating). `nodes` is one valid sequential order; the edges
alone must make every topological order correct (see `einpage.compiler.validator`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Union

from einpage.errors import PlanError
from einpage.ir.dtypes import DType, as_dtype
from einpage.ir.ops import BlockOp, op_from_json, op_text

FORMAT = "einpage.memgraph"
VERSION = 1
ALIGNMENT = 256


@dataclass(frozen=True, slots=True)
class Source:
    """Where an input block's data comes from: graph input `input` (a weight's checkpoint tensor
    is `checkpoint`), the box at `origin` of the logical tensor of shape `full_shape`."""
    input: str
    origin: tuple[int, ...]
    full_shape: tuple[int, ...]
    checkpoint: str | None = None


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


@dataclass(frozen=True, slots=True)
class OutputRef:
    """Block `tensor` of graph output `name`, at `origin` in it; where it is at the end."""
    tensor: int
    at: str
    offset: int | None
    name: str
    origin: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class LogicalTensor:
    """A whole graph input or output, for callers: name, role, shape, dtype."""
    name: str
    role: str
    shape: tuple[int, ...]
    dtype: DType


@dataclass(frozen=True)
class MemGraph:
    device_bytes: int
    tensors: tuple[TensorInfo, ...]
    nodes: tuple[MemNode, ...]
    outputs: tuple[OutputRef, ...]
    inputs: tuple[LogicalTensor, ...] = ()
    results: tuple[LogicalTensor, ...] = ()
    meta: dict = field(default_factory=dict, compare=False)

    # ------------------------------------------------------------ summaries
    def count(self, kind: str) -> int:
        return sum(1 for n in self.nodes if n.kind == kind)

    def moved_bytes(self, kind: str) -> int:
        return sum(self.tensors[n.tensor].bytes for n in self.nodes if n.kind == kind)

    def high_water(self) -> int:
        """Highest byte any instance reaches (the arena the plan really needs)."""
        top = 0
        for n in self.nodes:
            if isinstance(n, ApplyNode):
                top = max(top, n.write.offset + self.tensors[n.write.tensor].bytes)
            elif isinstance(n, (ReloadNode,)) or (isinstance(n, InputNode) and n.at == "device"):
                top = max(top, n.offset + self.tensors[n.tensor].bytes)
        return top

    def live_peak(self) -> int:
        """Most bytes live at once in the node order (instances from creation to free)."""
        live = top = 0
        for n in self.nodes:
            if isinstance(n, ApplyNode):
                for a in n.frees:
                    live -= self.tensors[a.tensor].bytes
                if not n.accumulate:
                    live += self.tensors[n.write.tensor].bytes
            elif isinstance(n, ReloadNode) or (isinstance(n, InputNode) and n.at == "device"):
                live += self.tensors[n.tensor].bytes
            elif isinstance(n, FreeNode):
                live -= self.tensors[n.tensor].bytes
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
            "meta": self.meta,
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
                            results, dict(data.get("meta", {})))
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
