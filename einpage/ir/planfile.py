"""A plan's file: the memgraph as JSON (DESIGN.md, "MemGraph file format", versions 1 and 2),
plain or gzip-compressed, written whole or not at all, and read back with one `PlanError` for
anything missing, corrupt or malformed. `MemGraph.to_json`, `from_json`, `save` and `load` are
these functions; a file of several ranks' programs (`einpage.ir.peers`) shares the reading and
writing."""
from __future__ import annotations

import gzip
import json
import threading
import tokenize
import zlib
from pathlib import Path
from types import MappingProxyType
from typing import Callable

from einpage import collector
from einpage.errors import EinpageError, PlanError
from einpage.outputs import atomic_open
from einpage.ir.dtypes import DType, as_dtype
from einpage.ir.memgraph import (FORMAT, PEER_KINDS, VERSION, VERSIONS, Access, ApplyNode,
                                 FreeNode, InputNode, MemGraph, MemNode, OffloadNode, OutputRef,
                                 ReadNode, RecvNode, ReloadGuard, ReloadNode, SendNode,
                                 TensorInfo)
from einpage.ir.ops import BlockOp, GuardedOp, op_from_json
from einpage.ir.provenance import graph_from_json, graph_hash, graph_json, json_int
from einpage.ir.storage import storage_from_json
from einpage.ir.taskgraph import TaskGraph
from einpage.ir.tensors import LogicalTensor, Source


def plan_json(mg: MemGraph) -> dict:
    """Version 2 with the plan's graph; version 1 for a plan without one."""
    host = {"host_arena_bytes": mg.host_arena_bytes} if mg.host_arena_bytes else {}
    graph = {}
    inputs = [_logical_json(t) for t in mg.inputs]
    results = [_logical_json(t) for t in mg.results]
    if mg.graph is not None:
        section = graph_json(mg.graph, _op_json)
        graph = {"graph": {"hash": graph_hash(section, inputs, results), **section}}
    proven = mg.graph is not None
    if not proven and any(t.storage is not None for t in mg.tensors):
        raise PlanError("a plan with storage formats is written as version 2, which "
                        "carries the plan's graph; this plan has none")
    if not proven and any(isinstance(n, (ApplyNode, ReloadNode)) and n.guard
                          for n in mg.nodes):
        raise PlanError("a plan with guarded applies is written as version 2, which "
                        "carries the plan's graph; this plan has none")
    ranks = {}
    if mg.world > 1 or any(n.kind in PEER_KINDS for n in mg.nodes):
        if not proven:
            raise PlanError("a plan for several ranks is written as version 2, which "
                            "carries the plan's graph; this plan has none")
        ranks = {"rank": mg.rank, "world": mg.world}
    return {
        "format": FORMAT, "version": VERSION if proven else 1, **ranks,
        "device_bytes": mg.device_bytes, **host,
        "tensors": [_tensor_json(t) for t in mg.tensors],
        "nodes": [_node_json(n, proven) for n in mg.nodes],
        "outputs": [{"tensor": o.tensor, "at": o.at, "offset": o.offset, "name": o.name,
                     "origin": list(o.origin)} for o in mg.outputs],
        "inputs": inputs,
        "results": results,
        "meta": dict(mg.meta),
        **graph,
    }


def plan_from_json(data: dict) -> MemGraph:
    """A plan from its JSON (`MemGraph.from_json`); one `PlanError` for anything malformed."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise PlanError(f"not an einpage plan (format is "
                        f"{data.get('format') if isinstance(data, dict) else type(data).__name__!r}, "
                        f"expected {FORMAT!r})")
    version = data.get("version")
    if version not in VERSIONS:
        raise PlanError(f"plan version {version!r} is not supported (this einpage reads "
                        f"versions {', '.join(map(str, VERSIONS))})")
    where = "plan"
    try:
        _refuse_misplaced(data)
        if version < 2 and ("rank" in data or "world" in data or any(
                isinstance(n, dict) and n.get("kind") in PEER_KINDS for n in data["nodes"])):
            raise PlanError("a version 1 plan cannot hold ranks, sends or recvs (they came "
                            "with version 2)")
        inputs_json, results_json = data.get("inputs", []), data.get("results", [])
        inputs = tuple(_logical_from(t) for t in inputs_json)
        results = tuple(_logical_from(t) for t in results_json)
        graph = None
        if version >= 2:
            if "graph" not in data:
                raise PlanError("a version 2 plan carries its graph, but this one has no "
                                "'graph'")
            graph = graph_from_json(data["graph"], inputs, results, inputs_json,
                                    results_json, _op_from, MALFORMED)
        where = "plan tensors"
        tensors = tuple(_tensor_from(t) for t in data["tensors"])
        if version < 2 and any(t.storage is not None for t in tensors):
            raise PlanError("a version 1 plan cannot hold storage formats (they came with "
                            "version 2)")
        nodes = []
        for k, n in enumerate(data["nodes"]):
            where = f"plan node {k}"
            nodes.append(_node_from(n, graph))
        where = "plan outputs"
        outputs = tuple(OutputRef(int(o["tensor"]), o["at"], _opt_int(o.get("offset")),
                                  str(o.get("name", "")),
                                  tuple(int(v) for v in o.get("origin", ())))
                        for o in data["outputs"])
        mg = MemGraph(int(data["device_bytes"]), tensors, tuple(nodes), outputs, inputs,
                      results, MappingProxyType(dict(data.get("meta", {}))),
                      int(data.get("host_arena_bytes", 0)), graph,
                      json_int(data.get("rank", 0)), json_int(data.get("world", 1)))
        if graph is not None:  # checked against its content by `graph_from_json`
            mg.__dict__["graph_hash"] = data["graph"]["hash"]
        return mg
    except PlanError:
        raise
    except MALFORMED as exc:
        raise PlanError(f"{where}: malformed ({type(exc).__name__}: {exc})") from None


def load_plan_file(path: str | Path) -> MemGraph:
    """Read a plan file: JSON (DESIGN.md, version 1 or 2) or the same JSON gzip-compressed (told
    apart by its first bytes, whatever the name). Every failure is one `PlanError` naming
    the file: missing, unreadable, a corrupt or truncated gzip stream, not JSON, not a
    plan."""
    data = read_plan_json(path)
    if isinstance(data, dict) and data.get("format") == RANKS_FORMAT:
        raise PlanError(f"{path}: a plan for {data.get('world')!r} devices, one program per "
                        "rank (`einpage.ir.peers.load_programs`; `einpage run` runs it)")
    try:
        with collector.paused():
            return plan_from_json(data)
    except PlanError as exc:
        raise PlanError(f"{path}: {exc}") from None


def plan_graph_hash(mg: MemGraph) -> str:
    """The hash of the plan's graph (`einpage.ir.provenance`), as its file records it."""
    with collector.paused():
        section = graph_json(mg.graph, _op_json)
    return graph_hash(section, [_logical_json(t) for t in mg.inputs],
                      [_logical_json(t) for t in mg.results])


#: the format of a file holding the programs of several ranks (`einpage.ir.peers`)
RANKS_FORMAT = "einpage.ranks"


def write_plan_json(path: str | Path, make: Callable[[], object]) -> None:
    """Write the JSON of `make()` to `path`: compact, gzip-compressed when the name ends in
    `.gz`; whole or not at all (`einpage.outputs.atomic_open`: an `OutputError` on failure)."""
    with collector.paused():
        _ops_json.cache = {}  # ops many nodes share are printed once
        try:
            data = json.dumps(make(), separators=(",", ":")).encode()
        finally:
            _ops_json.cache = None
    with atomic_open(path, "wb") as fh:
        if str(path).lower().endswith(".gz"):
            with gzip.GzipFile(filename="", mode="wb", fileobj=fh, compresslevel=GZIP_LEVEL,
                               mtime=0) as gz:  # no name, no time: the same plan, same bytes
                gz.write(data)
        else:
            fh.write(data)


def read_plan_json(path: str | Path) -> object:
    """The JSON of a plan file, plain or gzip-compressed (told apart by its first bytes); every
    failure one `PlanError` naming the file: missing, unreadable, corrupt gzip, not JSON."""
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise PlanError(f"{path}: no such plan file") from None
    except OSError as exc:
        raise PlanError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if raw[:2] == GZIP_MAGIC:
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as exc:
            raise PlanError(f"{path}: corrupt gzip file ({exc})") from None
    with collector.paused():
        try:
            return json.loads(raw)
        except UnicodeDecodeError as exc:
            raise PlanError(f"{path}: cannot read: not UTF-8 text ({exc.reason} at byte "
                            f"{exc.start})") from None
        except json.JSONDecodeError as exc:
            raise PlanError(f"{path}: not JSON: {exc}") from None


#: what reading a malformed plan raises before it is turned into one `PlanError`: Python's own
#: errors on wrong types and values, numbers too big for an int, a bad dtype, spec or expression
MALFORMED = (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError,
             SyntaxError, tokenize.TokenError, EinpageError)

#: `save`'s gzip level for a `.gz` name: zlib's default (level 9 is slower for ~5% less)
GZIP_LEVEL = 6
GZIP_MAGIC = b"\x1f\x8b"




#: an op's JSON text (the `repr` of its dict: equal text, equal op) -> the op, parsed once: the
#: nodes of a plan share a few dozen distinct ops (sympy parsing dominated `load`)
_ops_from: dict[str, BlockOp] = {}
_OPS_FROM_LIMIT = 1 << 16


def _op_from(data: dict) -> BlockOp:
    key = repr(data)
    op = _ops_from.get(key)
    if op is None:
        if len(_ops_from) >= _OPS_FROM_LIMIT:
            _ops_from.clear()
        op = _ops_from[key] = op_from_json(data)
    return op


#: `cache`: op -> its JSON dict while one `save` runs (per thread; None otherwise, so that
#: `to_json` callers never share a dict between nodes)
_ops_json = threading.local()


def _op_json(op: BlockOp) -> dict:
    cache = getattr(_ops_json, "cache", None)
    if cache is None:
        return op.to_json()
    try:
        out = cache.get(op)
    except TypeError:  # an op that cannot be hashed: printed every time
        return op.to_json()
    if out is None:
        out = cache[op] = op.to_json()
    return out


def _opt_int(v):
    return None if v is None else int(v)


def _opt_index(v):
    """None, or a provenance index (`json_int`)."""
    return None if v is None else json_int(v)


def _refuse_misplaced(data: dict) -> None:
    """A field a version 2 reader knows but finds where it does not belong, refused by name
    rather than misread: a `guard` on an apply (a guarded apply's guard is its task's op)."""
    tensors, nodes = data.get("tensors", ()), data.get("nodes", ())
    if not isinstance(tensors, list) or not isinstance(nodes, list):
        raise TypeError("tensors and nodes must be lists")
    for n in nodes:
        if isinstance(n, dict) and "guard" in n and n.get("kind") != "reload":
            raise PlanError(f"node {n.get('id')!r}: an apply names no guard of its own; a "
                            "guarded apply's op is a guarded op (its task's)")


def _tensor_json(t: TensorInfo) -> dict:
    out = {"id": t.id, "bytes": t.bytes, "dtype": t.dtype.value, "shape": list(t.shape),
           "name": t.name, "role": t.role}
    if t.block is not None:
        out["block"] = t.block
    if t.storage is not None:
        out["storage"] = t.storage.to_json()
    if t.source is not None:
        out["source"] = {"input": t.source.input, "origin": list(t.source.origin),
                         "full_shape": list(t.source.full_shape),
                         "checkpoint": t.source.checkpoint}
    return out


def _tensor_from(d: dict) -> TensorInfo:
    src = d.get("source")
    source = None if src is None else Source(str(src["input"]), tuple(map(int, src["origin"])),
                                             tuple(map(int, src["full_shape"])),
                                             None if src.get("checkpoint") is None
                                             else str(src["checkpoint"]))
    dtype = d["dtype"]
    return TensorInfo(int(d["id"]), int(d["bytes"]), _DTYPES.get(dtype) or as_dtype(dtype),
                      tuple(map(int, d["shape"])), str(d.get("name", "")),
                      str(d.get("role", "activation")), source, _opt_index(d.get("block")),
                      storage_from_json(d.get("storage")))


_DTYPES = {d.value: d for d in DType}  # a plan's dtype names, looked up without an Enum call


def _logical_json(t: LogicalTensor) -> dict:
    return {"name": t.name, "role": t.role, "shape": list(t.shape), "dtype": t.dtype.value}


def _logical_from(d: dict) -> LogicalTensor:
    return LogicalTensor(str(d["name"]), str(d["role"]), tuple(int(v) for v in d["shape"]),
                         as_dtype(d["dtype"]))


def _access(d: dict) -> Access:
    return Access(int(d["tensor"]), _opt_int(d["offset"]))


def _node_json(n: MemNode, proven: bool) -> dict:
    """A node's JSON; in a plan with its graph (`proven`) an apply names its task instead of
    carrying its op."""
    out: dict = {"id": n.id, "kind": n.kind}
    if isinstance(n, InputNode):
        out.update(tensor=n.tensor, at=n.at)
        if n.offset is not None:
            out["offset"] = n.offset
    elif isinstance(n, ApplyNode):
        out.update(reads=[{"tensor": a.tensor, "offset": a.offset} for a in n.reads],
                   write={"tensor": n.write.tensor, "offset": n.write.offset},
                   accumulate=n.accumulate,
                   frees=[{"tensor": a.tensor, "offset": a.offset} for a in n.frees])
        if proven:
            out["task"] = n.task
        else:
            out["op"] = _op_json(n.op)
        if n.on_host:
            out["on"] = n.on
    elif isinstance(n, ReadNode):
        out.update(tensor=n.tensor, host_offset=n.host_offset)
    elif isinstance(n, SendNode):
        out.update(tensor=n.tensor, offset=n.offset, peer=n.peer, tag=n.tag)
    elif isinstance(n, RecvNode):
        out.update(input=n.input, origin=list(n.origin), shape=list(n.shape), peer=n.peer,
                   tag=n.tag)
    else:
        out.update(tensor=n.tensor, offset=n.offset)
        if isinstance(n, ReloadNode) and n.host_offset is not None:
            out["host_offset"] = n.host_offset
        if isinstance(n, ReloadNode) and n.guard is not None:
            g = n.guard
            out["guard"] = {"tensor": g.access.tensor, "offset": g.access.offset,
                            "index": g.index, "share": g.share}
    out["deps"] = list(n.deps)
    return out


def _node_from(d: dict, graph: TaskGraph | None) -> MemNode:
    kind, nid, deps = d["kind"], int(d["id"]), tuple(map(int, d.get("deps", ())))
    if kind == "input":
        return InputNode(nid, int(d["tensor"]), str(d["at"]), _opt_int(d.get("offset")), deps)
    if kind == "apply":
        on = d.get("on", "device")
        if on != "device" and graph is None:
            raise PlanError("a version 1 plan cannot place an apply on the host (placement "
                            "came with version 2)")
        task = None
        if graph is None:
            op = _op_from(d["op"])
            if isinstance(op, GuardedOp):
                raise PlanError("a version 1 plan cannot guard an apply (guards came with "
                                "version 2)")
        else:  # version 2: the op is the task's
            if "op" in d:
                raise ValueError("a version 2 apply takes its op from its task; this one "
                                 "carries an op of its own")
            task = json_int(d["task"])
            if not 0 <= task < len(graph.tasks):
                raise ValueError(f"task {task} out of range (the graph has "
                                 f"{len(graph.tasks)} tasks)")
            op = graph.tasks[task].op
        return ApplyNode(nid, tuple(map(_access, d["reads"])), _access(d["write"]),
                         bool(d["accumulate"]), op, deps,
                         tuple(map(_access, d.get("frees", ()))), task, str(on))
    if kind == "read":
        return ReadNode(nid, int(d["tensor"]), int(d["host_offset"]), deps)
    if kind == "reload":
        guard = d.get("guard")
        if guard is not None:
            if graph is None:
                raise PlanError("a version 1 plan cannot guard a reload (guards came with "
                                "version 2)")
            share = float(guard["share"])
            if not 0 < share <= 1:
                raise ValueError(f"a reload's guard has share {share}, expected one in (0, 1]")
            guard = ReloadGuard(Access(json_int(guard["tensor"]), json_int(guard["offset"])),
                                json_int(guard["index"]), share)
        return ReloadNode(nid, int(d["tensor"]), int(d["offset"]), deps,
                          _opt_int(d.get("host_offset")), guard)
    if kind == "send":
        return SendNode(nid, json_int(d["tensor"]), _opt_index(d["offset"]), json_int(d["peer"]),
                        json_int(d["tag"]), deps)
    if kind == "recv":
        return RecvNode(nid, str(d["input"]), tuple(map(json_int, d["origin"])),
                        tuple(map(json_int, d["shape"])), json_int(d["peer"]),
                        json_int(d["tag"]), deps)
    cls = {"offload": OffloadNode, "free": FreeNode}.get(kind)
    if cls is None:
        raise ValueError(f"unknown node kind {kind!r}")
    return cls(nid, int(d["tensor"]), int(d["offset"]), deps)
