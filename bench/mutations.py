"""The mutation classes of `bench/mutants.py`: each a function of a compiled plan (`Plan`) and a
random generator that returns one mutant of the plan's version 2 JSON with a description, or
None where the class does not apply to that plan. A node is deleted or moved with its ids
renumbered and its dependents' edges mapped onto its own deps, so the rest stays well-formed.
`MUTATIONS` names them; `CONTROL` is the class a correct validator always accepts (a plan
relisted in a topological order of its edges).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import cached_property
from typing import Callable

import numpy as np
from fuzz_plans import Case

from einpage.ir.dtypes import as_dtype
from einpage.ir.memgraph import MemGraph
from einpage.runtime.executor import random_topological_order

ALIGN = 256
HOST_ALIGN = 4096

# ---------------------------------------------------------------------------------- plans
@dataclass
class Plan:
    """A compiled plan to mutate: its graph's case, the plan and its JSON."""
    case: Case
    mg: MemGraph
    label: str

    @cached_property
    def data(self) -> dict:
        return self.mg.to_json()

    @cached_property
    def applies(self) -> list[int]:
        return [n.id for n in self.mg.nodes if n.kind == "apply"]

    def nodes_of(self, kind: str) -> list[int]:
        return [n.id for n in self.mg.nodes if n.kind == kind]

    def live_at(self, k: int) -> list:
        """The device instances that node `k` may read in the plan's order."""
        return [i for i in self.mg.instances if i.start < k and (i.end is None or i.end >= k)]

    @cached_property
    def chain_applies(self) -> list[int]:
        """Applies whose task's block has two writers or more (a summation chain)."""
        writers = self.mg.graph.writers
        tasks = self.mg.graph.tasks
        return [n.id for n in self.mg.nodes
                if n.kind == "apply" and len(writers[tasks[n.task].write]) >= 2]


# ---------------------------------------------------------------------------------- JSON edits
def clone(data: dict) -> dict:
    """A copy of a plan's JSON whose nodes, tensors and outputs may be edited (the graph
    section is shared: copy it before editing it)."""
    out = dict(data)
    for key in ("nodes", "tensors", "outputs"):
        out[key] = copy.deepcopy(data[key])
    return out


def relist(data: dict, order: list[int]) -> dict:
    """`data` with its nodes in `order` (old ids; a node left out is deleted), renumbered; a dep
    that is not an earlier node in the new order is dropped."""
    new = {old: k for k, old in enumerate(order)}
    out = clone(data)
    nodes = []
    for k, old in enumerate(order):
        n = out["nodes"][old]
        n["id"] = k
        n["deps"] = sorted({new[d] for d in n["deps"] if d in new and new[d] < k})
        nodes.append(n)
    out["nodes"] = nodes
    return out


def delete_node(data: dict, k: int) -> dict:
    """`data` without node `k`; whatever depended on it depends on its deps instead."""
    own = data["nodes"][k]["deps"]
    out = clone(data)
    for n in out["nodes"][k + 1:]:
        if k in n["deps"]:
            n["deps"] = [d for d in n["deps"] if d != k] + list(own)
    return relist(out, [i for i in range(len(out["nodes"])) if i != k])


def move_node(data: dict, src: int, dst: int) -> dict:
    """`data` with node `src` moved to position `dst` < `src` (its deps after `dst` dropped)."""
    order = list(range(len(data["nodes"])))
    order.insert(dst, order.pop(src))
    return relist(data, order)


def offset_accesses(node: dict) -> list[dict]:
    """The device accesses of a node that carry an offset (dicts to edit in place)."""
    if node["kind"] == "apply":
        return [node["write"], *node["reads"]]
    if node["kind"] == "reload" or (node["kind"] == "input" and node.get("offset") is not None):
        return [node]
    return []


def _choice(rng: np.random.Generator, items: list):
    return items[int(rng.integers(len(items)))] if items else None


# ---------------------------------------------------------------------------------- mutations
# Each takes a plan and a generator and returns (mutant JSON, what was done), or None where the
# class does not apply to the plan.

def drop_edge(p: Plan, rng):
    k = _choice(rng, [n.id for n in p.mg.nodes if n.deps])
    if k is None:
        return None
    out = clone(p.data)
    deps = out["nodes"][k]["deps"]
    d = deps.pop(int(rng.integers(len(deps))))
    return out, f"node {k}: dep {d} dropped"


def _shift(p: Plan, rng, delta: Callable[[np.random.Generator], int], what: str):
    out = clone(p.data)
    sites = [(k, j) for k, n in enumerate(out["nodes"]) for j in range(len(offset_accesses(n)))]
    k, j = _choice(rng, sites) or (None, None)
    if k is None:
        return None
    access = offset_accesses(out["nodes"][k])[j]
    step = delta(rng)
    if access["offset"] + step < 0:
        step = -step
    access["offset"] += step
    return out, f"node {k} ({out['nodes'][k]['kind']}) access {j}: offset {what} {step:+d}"


def shift_offset(p: Plan, rng):
    return _shift(p, rng, lambda r: ALIGN * int(r.choice([-4, -2, -1, 1, 2, 4])), "moved")


def misalign_offset(p: Plan, rng):
    return _shift(p, rng, lambda r: 8, "misaligned")


def _delete(p: Plan, rng, ids: list[int], what: str):
    k = _choice(rng, ids)
    if k is None:
        return None
    return delete_node(p.data, k), f"{what} node {k} deleted"


def delete_reload(p: Plan, rng):
    return _delete(p, rng, p.nodes_of("reload"), "reload")


def delete_offload(p: Plan, rng):
    return _delete(p, rng, p.nodes_of("offload"), "offload")


def delete_chain_apply(p: Plan, rng):
    return _delete(p, rng, p.chain_applies, "summation-chain apply")


def free_early(p: Plan, rng):
    """A free moved to just after its instance's creation, or to just before one of its
    readers."""
    frees = {i.end: i for i in p.mg.instances if i.end is not None and
             p.mg.nodes[i.end].kind == "free"}
    k = _choice(rng, sorted(frees))
    if k is None:
        return None
    inst = frees[k]
    readers = [n.id for n in p.mg.nodes[inst.start + 1:k]
               if inst.tensor in _read_tensors(n)]
    dst = _choice(rng, readers) if readers and rng.random() < 0.5 else inst.start + 1
    if dst >= k:
        return None
    return move_node(p.data, k, dst), f"free node {k} moved to position {dst}"


def _read_tensors(n) -> list[int]:
    if n.kind == "apply":
        return [a.tensor for a in n.reads]
    return [n.tensor] if n.kind == "offload" else []


def _swap_read(p: Plan, rng, same: bool):
    """An apply read retargeted to another tensor of the same (or another) shape and dtype:
    one live at that point of the plan's order (at its offset) where some read has one, else
    any such tensor at the read's own offset."""
    def fits(t, u) -> bool:
        return u.id != t.id and ((u.shape, u.dtype) == (t.shape, t.dtype)) == same

    sites, fallback = [], []
    for k in p.applies:
        live = p.live_at(k)
        for j, a in enumerate(p.mg.nodes[k].reads):
            t = p.mg.tensors[a.tensor]
            sites += [(k, j, i.tensor, i.offset) for i in live if fits(t, p.mg.tensors[i.tensor])]
            fallback.append((k, j, a.offset, t))
    live = bool(sites)
    if live:
        k, j, other, offset = _choice(rng, sites)
    elif fallback:
        k, j, offset, t = _choice(rng, fallback)
        other = _choice(rng, [u.id for u in p.mg.tensors if fits(t, u)])
    if not fallback or other is None:
        return None
    out = clone(p.data)
    old = out["nodes"][k]["reads"][j]["tensor"]
    out["nodes"][k]["reads"][j] = {"tensor": other, "offset": offset}
    return out, f"node {k} read {j}: %t{old} -> %t{other} @{offset}{' (live)' if live else ''}"


def swap_read_same_shape(p: Plan, rng):
    return _swap_read(p, rng, same=True)


def swap_read_other_shape(p: Plan, rng):
    return _swap_read(p, rng, same=False)


def change_shape(p: Plan, rng):
    out = clone(p.data)
    k = int(rng.integers(len(out["tensors"])))
    t = out["tensors"][k]
    if not t["shape"]:
        return None
    d = int(rng.integers(len(t["shape"])))
    old = t["shape"][d]
    t["shape"][d] = old - 1 if old > 1 and rng.random() < 0.5 else old + 1
    t["bytes"] = int(np.prod(t["shape"])) * p.mg.tensors[k].dtype.itemsize
    return out, f"tensor %t{k}: dim {d} {old} -> {t['shape'][d]} (bytes {t['bytes']})"


#: the dtype a tensor is retyped to: one of its item size where there is one (its bytes are
#: then reinterpreted), else f64 (f32 has no twin)
RETYPE = {"f32": "f64", "f64": "i64", "i64": "f64", "f16": "bf16", "bf16": "f16"}


def change_dtype(p: Plan, rng):
    """A tensor retyped (`RETYPE`), its bytes consistent with the new dtype."""
    out = clone(p.data)
    k = int(rng.integers(len(out["tensors"])))
    t = out["tensors"][k]
    old, t["dtype"] = t["dtype"], RETYPE[t["dtype"]]
    t["bytes"] = int(np.prod(t["shape"])) * as_dtype(t["dtype"]).itemsize
    return out, f"tensor %t{k}: dtype {old} -> {t['dtype']} (bytes {t['bytes']})"


def change_source(p: Plan, rng):
    """An input block names another box of its input (its origin moved by one along a dim
    where that stays inside), or another input."""
    out = clone(p.data)
    k = _choice(rng, [t.id for t in p.mg.tensors if t.source is not None])
    if k is None:
        return None
    src = out["tensors"][k]["source"]
    shape = p.mg.tensors[k].shape
    dims = [d for d, (o, n, full) in enumerate(zip(src["origin"], shape, src["full_shape"]))
            if o + n < full or o > 0]
    if dims:
        d = _choice(rng, dims)
        room = src["origin"][d] + shape[d] < src["full_shape"][d]
        src["origin"][d] += 1 if room else -1
        return out, f"tensor %t{k}: source origin -> {src['origin']}"
    names = sorted({t.source.input for t in p.mg.tensors if t.source is not None} - {
        src["input"]})
    if not names:
        return None
    old, src["input"] = src["input"], _choice(rng, names)
    return out, f"tensor %t{k}: source input {old} -> {src['input']}"


ROLES = ("weight", "activation", "cache", "temp")


def change_role(p: Plan, rng):
    """A tensor takes another role (what runtimes act on: preloading, the KV store) or another
    tensor's name."""
    out = clone(p.data)
    k = int(rng.integers(len(out["tensors"])))
    t = out["tensors"][k]
    if rng.integers(2):
        old, t["role"] = t["role"], _choice(rng, [r for r in ROLES if r != t["role"]])
        return out, f"tensor %t{k}: role {old} -> {t['role']}"
    names = sorted({u["name"] for u in out["tensors"]} - {t["name"]})
    if not names:
        return None
    old, t["name"] = t["name"], _choice(rng, names)
    return out, f"tensor %t{k}: name {old} -> {t['name']}"


def input_computed(p: Plan, rng):
    """An `input` node names a computed block of as many bytes instead of its graph input."""
    out = clone(p.data)
    inputs = [n for n in out["nodes"] if n["kind"] == "input"]
    n = _choice(rng, inputs)
    if n is None:
        return None
    size = p.mg.tensors[n["tensor"]].bytes
    computed = [t.id for t in p.mg.tensors if t.source is None and t.bytes == size]
    k = _choice(rng, computed)
    if k is None:
        return None
    old, n["tensor"] = n["tensor"], k
    return out, f"node %{n['id']} (input): %t{old} -> %t{k}"


def change_task(p: Plan, rng):
    """An apply names another task (of as many reads where one is), or two applies swap
    theirs (each task still runs once)."""
    if len(p.applies) < 2:
        return None
    out = clone(p.data)
    k = _choice(rng, p.applies)
    node = out["nodes"][k]
    if rng.random() < 0.5:
        other = _choice(rng, [j for j in p.applies if j != k])
        node["task"], out["nodes"][other]["task"] = out["nodes"][other]["task"], node["task"]
        return out, f"nodes {k} and {other} swap tasks"
    tasks = p.mg.graph.tasks
    others = [t for t in tasks if t.id != node["task"]]
    alike = [t.id for t in others if len(t.reads) == len(node["reads"])]
    new = _choice(rng, alike or [t.id for t in others])
    if new is None:
        return None
    old, node["task"] = node["task"], new
    return out, f"node {k}: task {old} -> {new}"


def change_block(p: Plan, rng):
    """A tensor names another block (of its shape and dtype where one is: then the two
    tensors swap blocks, so each block is still named once)."""
    out = clone(p.data)
    k = int(rng.integers(len(out["tensors"])))
    t = p.mg.tensors[k]
    alike = [u.id for u in p.mg.tensors if u.id != k and (u.shape, u.dtype) == (t.shape, t.dtype)]
    other = _choice(rng, alike)
    if other is not None:
        a, b = out["tensors"][k], out["tensors"][other]
        a["block"], b["block"] = b["block"], a["block"]
        return out, f"tensors %t{k} and %t{other} swap blocks"
    new = _choice(rng, [b for b in range(len(p.mg.graph.blocks)) if b != t.block])
    if new is None:
        return None
    out["tensors"][k]["block"] = new
    return out, f"tensor %t{k}: block {t.block} -> {new}"


def _edit_task_write(out: dict, graph: dict) -> None:
    task = graph["tasks"][-1]
    task[3] = (task[3] + 1) % len(graph["blocks"])


def _edit_task_accumulate(out: dict, graph: dict) -> None:
    graph["tasks"][0][4] = 1 - graph["tasks"][0][4]


def _edit_block_shape(out: dict, graph: dict) -> None:
    graph["blocks"][0][2] = [*graph["blocks"][0][2], 1]


def _edit_op(out: dict, graph: dict) -> None:
    graph["ops"][0] = {"kind": "gather", "row_offset": 7}


def _edit_result(out: dict, graph: dict) -> None:
    out["results"] = [{**out["results"][0], "name": out["results"][0]["name"] + "_"},
                      *out["results"][1:]]


def _edit_hash(out: dict, graph: dict) -> None:
    graph["hash"] = "sha256:" + "0" * 64


GRAPH_EDITS = {"a task's write": _edit_task_write, "a task's accumulate flag":
               _edit_task_accumulate, "a block's shape": _edit_block_shape, "an op": _edit_op,
               "a result's name (hashed too)": _edit_result, "the hash": _edit_hash}


def edit_graph(p: Plan, rng):
    """The graph section (or the hashed results) edited, its hash left alone."""
    out = clone(p.data)
    out["graph"] = copy.deepcopy(p.data["graph"])
    what = _choice(rng, [w for w in GRAPH_EDITS if out["graph"]["tasks"] or "task" not in w])
    GRAPH_EDITS[what](out, out["graph"])
    return out, f"graph section: {what} edited"


def repeat_partial(p: Plan, rng):
    """An accumulating apply runs twice: a copy right after it, depending on it."""
    k = _choice(rng, [j for j in p.applies if p.mg.nodes[j].accumulate])
    if k is None:
        return None
    out = clone(p.data)
    twin = copy.deepcopy(out["nodes"][k])
    twin["deps"] = [*twin["deps"], k]
    order = list(range(len(out["nodes"])))
    order.insert(k + 1, len(order))
    out["nodes"].append(twin)
    return relist(out, order), f"accumulating apply node {k} repeated"


def flip_accumulate(p: Plan, rng):
    k = _choice(rng, p.applies)
    if k is None:
        return None
    out = clone(p.data)
    node = out["nodes"][k]
    node["accumulate"] = not node["accumulate"]
    return out, f"node {k}: accumulate -> {node['accumulate']}"


def swap_operands(p: Plan, rng):
    """Two reads of an apply trade places (reads of one shape where there are)."""
    sites = []
    for k in p.applies:
        reads = p.mg.nodes[k].reads
        pairs = [(i, j) for i in range(len(reads)) for j in range(i + 1, len(reads))
                 if reads[i].tensor != reads[j].tensor]
        alike = [(i, j) for i, j in pairs
                 if p.mg.tensors[reads[i].tensor].shape == p.mg.tensors[reads[j].tensor].shape]
        sites += [(k, ij) for ij in (alike or pairs)]
    k, (i, j) = _choice(rng, sites) or (None, (None, None))
    if k is None:
        return None
    out = clone(p.data)
    reads = out["nodes"][k]["reads"]
    reads[i], reads[j] = reads[j], reads[i]
    return out, f"node {k}: reads {i} and {j} swapped"


def retarget_output(p: Plan, rng):
    """An output names another tensor of its shape (where it is at the end), or another
    origin."""
    out = clone(p.data)
    o = _choice(rng, out["outputs"])
    t = p.mg.tensors[o["tensor"]]
    alike = [u.id for u in p.mg.tensors
             if u.id != t.id and (u.shape, u.dtype) == (t.shape, t.dtype)]
    other = _choice(rng, alike)
    if other is not None:
        at_end = [i for i in p.mg.instances if i.tensor == other and i.end is None]
        o["tensor"] = other
        if o["at"] == "device" and at_end:
            o["offset"] = at_end[0].offset
        return out, f"output {o['name']}{o['origin']}: tensor %t{t.id} -> %t{other}"
    if not o["origin"]:
        return None
    o["origin"][0] += 1
    return out, f"output {o['name']}: origin -> {o['origin']}"


def consume_in_place(p: Plan, rng):
    """An apply lists one of its reads in `frees` (it ends that instance), and the `free` node
    that ended it is deleted: valid only where no other node reads it after or beside the
    apply."""
    sites = [(k, a) for k in p.applies for a in p.mg.nodes[k].reads
             if a.tensor != p.mg.nodes[k].write.tensor]
    k, a = _choice(rng, sites) or (None, None)
    if k is None:
        return None
    out = clone(p.data)
    out["nodes"][k]["frees"].append({"tensor": a.tensor, "offset": a.offset})
    ender = next((i.end for i in p.mg.instances if i.tensor == a.tensor and i.start < k and
                  i.end is not None and i.end >= k), None)
    what = f"node {k} frees its read %t{a.tensor}"
    if ender is None or p.mg.nodes[ender].kind != "free":
        return out, what
    return delete_node(out, ender), f"{what}; free node {ender} deleted"


def shrink_arena(p: Plan, rng):
    out = clone(p.data)
    top = p.mg.high_water()
    out["device_bytes"] = max(ALIGN, top - ALIGN * int(rng.integers(1, 3)))
    return out, f"device_bytes {p.mg.device_bytes} -> {out['device_bytes']} (high water {top})"


def disk_read(p: Plan, rng):
    """The disk tier: a read's staging offset moved, or a read deleted."""
    k = _choice(rng, p.nodes_of("read"))
    if k is None:
        return None
    if rng.random() < 0.5:
        return delete_node(p.data, k), f"read node {k} deleted"
    out = clone(p.data)
    node = out["nodes"][k]
    step = HOST_ALIGN * int(rng.choice([-2, -1, 1, 2]))
    if node["host_offset"] + step < 0:
        step = -step
    node["host_offset"] += step
    return out, f"read node {k}: host_offset {step:+d}"


def relist_topological(p: Plan, rng):
    """Control: the same plan listed in a random topological order of its edges."""
    order = random_topological_order(p.mg, int(rng.integers(1 << 31)))
    return relist(p.data, order), f"relisted in topological order {order[:6]}..."


MUTATIONS: dict[str, Callable] = {
    "drop an edge": drop_edge,
    "shift an offset (+-256k)": shift_offset,
    "misalign an offset (+8)": misalign_offset,
    "delete a reload": delete_reload,
    "delete an offload": delete_offload,
    "delete a summation-chain apply": delete_chain_apply,
    "move a free earlier": free_early,
    "swap a read (same shape)": swap_read_same_shape,
    "swap a read (other shape)": swap_read_other_shape,
    "change a tensor's shape": change_shape,
    "change a tensor's dtype": change_dtype,
    "change an input block's source": change_source,
    "change a tensor's role or name": change_role,
    "input a computed block": input_computed,
    "change an apply's task": change_task,
    "change a tensor's block": change_block,
    "edit the graph section": edit_graph,
    "repeat a partial": repeat_partial,
    "flip accumulate": flip_accumulate,
    "swap an apply's operands": swap_operands,
    "retarget an output": retarget_output,
    "consume a read in place (frees)": consume_in_place,
    "shrink the arena": shrink_arena,
    "disk tier: move or delete a read": disk_read,
    "control: relist in a topological order": relist_topological,
}
CONTROL = "control: relist in a topological order"
