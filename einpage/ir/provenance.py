"""The graph a plan was made from, as a version 2 plan file carries it (DESIGN.md, "Version 2",
provenance): the taskgraph the lowering translated, with a hash.

    "graph": {"hash": "sha256:<hex>",
              "ops":     [<op JSON>, ...],                           distinct ops, first use first
              "blocks":  [[node, origin, shape, dtype, role, name, source|null], ...],
              "tasks":   [[node, stage, reads, write, accumulate, op index], ...],
              "outputs": [[block, name, origin], ...]}

Tensor `k` of the plan names its block (`"block": b`), every `apply` its task (`"task": t`) and
takes its op from it (a version 2 apply carries no `op` of its own: one truth per task). The hash
is SHA-256 over the canonical JSON (sorted keys, no spaces) of the section without `hash`, plus
the plan's `inputs` and `results`: a reader recomputes it and refuses a section damaged (or edited
without recomputing it), and two plans of one graph show the same hash (`einpage inspect`). It
guards integrity and gives a graph an identity to compare; it is no signature (anyone may edit the
graph and hash it anew, and the plan is then proven against that graph).

What the validator proves with it is in `einpage.ir.translation`.
"""
from __future__ import annotations

import hashlib
import json

from einpage.errors import GraphError, PlanError
from einpage.ir.dtypes import as_dtype
from einpage.ir.ops import BlockOp
from einpage.ir.storage import storage_from_json
from einpage.ir.taskgraph import Block, OutputBlock, Task, TaskGraph
from einpage.ir.tensors import LogicalTensor, Source

HASH_PREFIX = "sha256:"


def graph_json(tg: TaskGraph, op_json) -> dict:
    """The `graph` section of `tg` without its hash; `op_json(op)` prints an op."""
    ops: dict[BlockOp, int] = {}
    op_list = []

    def op_index(op: BlockOp) -> int:
        k = ops.get(op)
        if k is None:
            k = ops[op] = len(op_list)
            op_list.append(op_json(op))
        return k

    tasks = [[t.node, t.stage, list(t.reads), t.write, int(t.accumulate), op_index(t.op)]
             for t in tg.tasks]
    return {
        "ops": op_list,
        "blocks": [[b.node, list(b.origin), list(b.shape), b.dtype.value, b.role, b.name,
                    _source_json(b.source), *([b.storage.to_json()] if b.storage else [])]
                   for b in tg.blocks],
        "tasks": tasks,
        "outputs": [[o.block, o.name, list(o.origin)] for o in tg.outputs],
    }


def graph_hash(section: dict, inputs: list, results: list) -> str:
    """The hash of a `graph` section (without `hash`) and the plan's `inputs` and `results`,
    all as JSON values."""
    body = dict(section)
    body.pop("hash", None)
    text = json.dumps({"graph": body, "inputs": inputs, "results": results}, sort_keys=True,
                      separators=(",", ":"), ensure_ascii=True)
    return HASH_PREFIX + hashlib.sha256(text.encode()).hexdigest()


def graph_from_json(section: dict, inputs: tuple[LogicalTensor, ...],
                    results: tuple[LogicalTensor, ...], inputs_json: list, results_json: list,
                    op_from, malformed: tuple[type, ...]) -> TaskGraph:
    """The taskgraph of a `graph` section, after checking its hash; `op_from(data)` parses an op.
    Raises `PlanError` naming what is wrong (for every exception of `malformed`)."""
    if not isinstance(section, dict):
        raise PlanError(f"plan graph: expected an object, got {type(section).__name__}")
    want = section.get("hash")
    got = graph_hash(section, inputs_json, results_json)
    if want != got:
        raise PlanError(f"plan graph: its hash is {want!r}, but its content hashes to {got}: "
                        "the graph section (or the plan's inputs or results) was damaged or "
                        "edited")
    where = "plan graph ops"
    try:
        ops = []
        for k, d in enumerate(section["ops"]):
            where = f"plan graph op {k}"
            ops.append(op_from(d))
        where = "plan graph blocks"
        blocks = []
        for k, fields in enumerate(section["blocks"]):
            where = f"plan graph block {k}"
            if not isinstance(fields, list) or len(fields) not in (7, 8):
                raise ValueError(f"expected [node, origin, shape, dtype, role, name, source"
                                 f"(, storage)], got {fields!r}")
            node, origin, shape, dtype, role, name, source = fields[:7]
            storage = storage_from_json(fields[7]) if len(fields) == 8 else None
            blocks.append(Block(k, json_int(node), _ints(origin), _ints(shape),
                                as_dtype(dtype), str(role), str(name), _source_from(source),
                                storage))
        where = "plan graph tasks"
        tasks = []
        for k, (node, stage, reads, write, accumulate, op) in enumerate(section["tasks"]):
            where = f"plan graph task {k}"
            if not 0 <= json_int(op) < len(ops):
                raise ValueError(f"op index {op} out of range (the graph has {len(ops)} ops)")
            if not isinstance(accumulate, int):  # 0, 1, true or false
                raise TypeError(f"accumulate is {accumulate!r}, expected 0 or 1")
            tasks.append(Task(k, _ints(reads), json_int(write), bool(accumulate), ops[op],
                              json_int(node), json_int(stage)))
        where = "plan graph outputs"
        outputs = tuple(OutputBlock(int(b), str(name), _ints(origin))
                        for b, name, origin in section["outputs"])
    except PlanError:
        raise
    except malformed as exc:
        raise PlanError(f"{where}: malformed ({type(exc).__name__}: {exc})") from None
    tg = TaskGraph(tuple(blocks), tuple(tasks), outputs, inputs, results)
    try:
        tg.verify()
    except GraphError as exc:
        raise PlanError(f"plan graph: {exc}") from None
    return tg


def json_int(value) -> int:
    """An index a plan file gives: a JSON integer (a float or a string is malformed, never
    truncated)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{value!r} is not an integer")
    return value


def _ints(values) -> tuple[int, ...]:
    return tuple(map(json_int, values))


def _source_json(s: Source | None):
    if s is None:
        return None
    return [s.input, list(s.origin), list(s.full_shape), s.checkpoint]


def _source_from(d) -> Source | None:
    if d is None:
        return None
    name, origin, full_shape, checkpoint = d
    return Source(str(name), _ints(origin), _ints(full_shape),
                  None if checkpoint is None else str(checkpoint))
