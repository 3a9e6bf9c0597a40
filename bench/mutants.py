"""Mutation harness for the plan validator: mutate version 2 plans at their JSON level, and check
that every mutant that computes something wrong is refused by `MemGraph.from_json` or `validate`.

Plans come from the graphs of `bench/fuzz_plans.py` (random einsum DAGs and tiny LLaMA passes,
every policy, budgets from the smallest up, host budgets that put weights on the disk tier): for
each graph, its fuzz sweep (which checks every plan it makes) and then a few of its plans, those
with disk reads and summation chains first. Each mutation class (`MUTATIONS`, one function each)
makes a few random mutants per plan, where it applies. A node is deleted or moved with its ids
renumbered and its dependents' edges mapped onto its own deps, so the rest stays well-formed.

For every mutant:
- *rejected*: `MemGraph.from_json` refuses it (it never becomes a plan: "unparsed") or
  `validate` raises `PlanError`;
- *harmful*: run unchecked (`run(..., check=False)`) in the plan's order and in 4 seeded random
  topological orders, a run raises or differs from the dense reference (the tolerance of
  `fuzz_plans.mismatch`). Unparsed mutants cannot run and are not classified.
- *equivalent*: neither rejected nor harmful (a redundant edge dropped, a leak).

The table gives, per class: mutants; rejected, of which unparsed, and of which rejected by the
proof only (the rules that need no graph, all a version 1 plan gets, accept them); harmful;
harmful and accepted (must be 0); equivalent and accepted; the parsed rejected ones split into
harmful and equivalent (refusing an equivalent mutant is allowed); crashes (an exception other
than `PlanError` from `from_json` or `validate`: a failure too). The control class relists a
plan in a random topological order of its edges: a correct validator accepts every such
mutant (one it rejects is listed as over-strict).

    python bench/mutants.py [--count 100] [--seed 0] [--quick] [--workers 2] [--json PATH]
    python bench/mutants.py --seed S --graph G [--only CLASS] [-v]   # replay one graph

`--count` is the number of mutants wanted per class (graphs are mutated in index order until
every class has them, or 40 + count graphs were used). Exits 1 if a harmful mutant was accepted,
the validator crashed, or an unmutated plan failed its fuzz checks.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import multiprocessing
import sys
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

HERE = Path(__file__).absolute().parent
if str(HERE) not in sys.path:  # fuzz_plans beside this file (also when loaded by path)
    sys.path.insert(0, str(HERE))
from fuzz_plans import Case, Sweep, execute, make_case, plan_traits  # noqa: E402

from einpage.errors import PlanError  # noqa: E402
from einpage.ir.dtypes import as_dtype  # noqa: E402
from einpage.ir.memgraph import MemGraph  # noqa: E402
from einpage.ir.validator import validate  # noqa: E402
from einpage.runtime.executor import random_topological_order  # noqa: E402

ALIGN = 256
HOST_ALIGN = 4096
RUN_ORDERS = 4          # random topological orders a mutant runs in, besides the plan's own
PLANS_PER_GRAPH = 2
PER_PLAN = 2            # mutants per class and plan


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


def pick_plans(plans: list[tuple[MemGraph, str]], rng: np.random.Generator) -> list:
    """`PLANS_PER_GRAPH` distinct plans, each drawn from the plans not chosen yet that have disk
    reads, else summation chains, else offloads, else reloads, else from all of them."""
    chosen: list = []
    while len(chosen) < PLANS_PER_GRAPH:
        left = [p for p in plans if not any(p is c for c in chosen)]
        if not left:
            break
        for want in ("read", "accumulate", "offload", "reload"):
            pool = [p for p in left if want in plan_traits(p[0])]
            if pool:
                break
        pool = pool or left
        chosen.append(pool[int(rng.integers(len(pool)))])
    return chosen


def graph_plans(seed: int, index: int) -> tuple[Case, list[Plan], list[str]]:
    """The plans of graph `index` to mutate, and the problems its fuzz sweep found."""
    case = make_case(seed, index)
    made: list[tuple[MemGraph, str]] = []

    def keep(a, mg):
        if not a.problems:
            made.append((mg, f"policy={a.policy} device_bytes={a.device_bytes} "
                             f"block_bytes={a.block_bytes} host_bytes={a.host_bytes}"))

    result = Sweep(case, seed, index, on_plan=keep).run()
    problems = [p for a in result.attempts for p in a.problems]
    if result.error:
        problems.append(result.error)
    rng = np.random.default_rng([seed, index, 2])
    plans = [Plan(case, mg, label) for mg, label in pick_plans(made, rng)]
    return case, plans, problems


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
    alike = [u.id for u in p.mg.tensors if u.id != t.id and (u.shape, u.dtype) == (t.shape, t.dtype)]
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


# ---------------------------------------------------------------------------------- verdicts
@dataclass
class Verdict:
    """What became of one mutant."""
    cls: str
    where: str              # reproducer: graph, plan, class, mutant number
    what: str               # the mutation
    unparsed: bool = False
    rejected: bool = False
    proof_only: bool = False  # rejected, but the rules without the graph accept it
    harmful: bool = False
    raised: bool = False    # harmful: a run raised
    crash: str | None = None
    reason: str = ""        # the first line of the refusal, or of the harm


def judge(case: Case, mutant: dict, cls: str, where: str, what: str, seed: int) -> Verdict:
    v = Verdict(cls, where, what)
    try:
        mg = MemGraph.from_json(json.loads(json.dumps(mutant)))
    except PlanError as exc:
        v.unparsed = v.rejected = True
        v.reason = _first_line(exc)
        return v
    except Exception as exc:
        v.crash = f"from_json raised {type(exc).__name__}: {_first_line(exc)}"
        return v
    try:
        validate(mg)
    except PlanError as exc:
        v.rejected, v.reason = True, _first_line(exc)
        v.proof_only = accepted_without_graph(mg)
    except Exception as exc:
        v.crash = f"validate raised {type(exc).__name__}: {_first_line(exc)}"
    harm = harm_of(case, mg, seed)
    if harm is not None:
        v.harmful, v.raised = True, harm.startswith("raised")
        if not v.rejected:
            v.reason = harm
    return v


def accepted_without_graph(mg: MemGraph) -> bool:
    """Whether the rules that need no graph (memory, order, ops fit their operands: all a
    version 1 plan gets) accept `mg`."""
    try:
        validate(dataclasses.replace(mg, graph=None))
    except PlanError:
        return False
    return True


def harm_of(case: Case, mg: MemGraph, seed: int) -> str | None:
    """How running `mg` unchecked goes wrong (in its order or a random one), or None."""
    for order in ("sequential", *range(seed, seed + RUN_ORDERS)):
        try:
            with warnings.catch_warnings(), np.errstate(all="ignore"):
                warnings.simplefilter("ignore")  # the NaNs of poisoned bytes
                wrong = execute(case, mg, order, check=False)
        except Exception as exc:
            return f"raised in order {order}: {type(exc).__name__}: {_first_line(exc)}"
        if wrong:
            return f"order {order}: {wrong}"
    return None


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


@dataclass
class GraphMutants:
    index: int
    name: str
    plans: int = 0
    verdicts: list = field(default_factory=list)
    problems: list = field(default_factory=list)   # the fuzz sweep's, on the originals


def mutate_graph(seed: int, index: int, only: str | None = None) -> GraphMutants:
    """Every mutant of graph `index`: `PER_PLAN` per class and plan (of class `only`)."""
    case, plans, problems = graph_plans(seed, index)
    result = GraphMutants(index, case.name, len(plans), problems=problems)
    for p_index, plan in enumerate(plans):
        for c_index, (cls, mutate) in enumerate(MUTATIONS.items()):
            if only is not None and cls != only:
                continue
            for j, (mutant, what) in enumerate(distinct_mutants(
                    plan, mutate, [seed, index, p_index, c_index])):
                where = (f"bench/mutants.py --seed {seed} --graph {index} --only '{cls}' (plan {p_index}: "
                         f"{plan.label}; mutant {j})")
                result.verdicts.append(judge(case, mutant, cls, where, what,
                                             seed + 1000 * j + 7))
    return result


def distinct_mutants(plan: Plan, mutate: Callable, key: list[int]) -> list[tuple[dict, str]]:
    """Up to `PER_PLAN` mutants of `plan` with distinct descriptions (a few draws each)."""
    out: dict[str, dict] = {}
    for j in range(3 * PER_PLAN):
        made = mutate(plan, np.random.default_rng([*key, j]))
        if made is None:
            break
        out.setdefault(made[1], made[0])
        if len(out) == PER_PLAN:
            break
    return [(mutant, what) for what, mutant in out.items()]


def _mutate_job(job: tuple[int, int]) -> GraphMutants:
    return mutate_graph(*job)


def graph_mutants(seed: int, count: int, workers: int) -> Iterator[GraphMutants]:
    """Graph results in index order until every class has `count` mutants (or 40 + count
    graphs were mutated)."""
    jobs = ((seed, k) for k in range(40 + count))
    have: Counter = Counter()
    pool = multiprocessing.get_context("fork").Pool(workers) if workers > 1 else None
    results = pool.imap(_mutate_job, jobs) if pool is not None else map(_mutate_job, jobs)
    try:
        for r in results:
            yield r
            have.update(v.cls for v in r.verdicts)
            if all(have[c] >= count for c in MUTATIONS):
                break
    finally:
        if pool is not None:
            pool.terminate()


# ---------------------------------------------------------------------------------- report
COLUMNS = ("mutants", "rejected", "unparsed", "proof_only", "harmful", "harmful_accepted",
           "equivalent_accepted", "rejected_harmful", "rejected_equivalent", "crashes")
HEADINGS = {"proof_only": "rejected by the proof only"}


@dataclass
class Tally:
    seed: int
    graphs: int = 0
    plans: int = 0
    rows: dict = field(default_factory=lambda: {c: Counter() for c in MUTATIONS})
    harmful_accepted: list = field(default_factory=list)
    crashes: list = field(default_factory=list)
    over_strict: list = field(default_factory=list)  # control mutants rejected
    originals: list = field(default_factory=list)    # problems of unmutated plans
    seconds: float = 0.0

    def add(self, r: GraphMutants) -> None:
        self.graphs += 1
        self.plans += r.plans
        self.originals += [f"bench/fuzz_plans.py --seed {self.seed} --graph {r.index} ({r.name}): {p}"
                           for p in r.problems]
        for v in r.verdicts:
            row = self.rows[v.cls]
            row["mutants"] += 1
            row["crashes"] += v.crash is not None
            if v.crash is not None:
                self.crashes.append(f"{v.where}: {v.what}: {v.crash}")
                continue
            row["rejected"] += v.rejected
            row["unparsed"] += v.unparsed
            row["proof_only"] += v.proof_only
            row["harmful"] += v.harmful
            if v.unparsed:
                continue
            if v.rejected:
                row["rejected_harmful" if v.harmful else "rejected_equivalent"] += 1
                if v.cls == CONTROL:
                    self.over_strict.append(f"{v.where}: {v.what}: {v.reason}")
            elif v.harmful:
                row["harmful_accepted"] += 1
                self.harmful_accepted.append(f"{v.where}: {v.what}: {v.reason}")
            else:
                row["equivalent_accepted"] += 1

    def table(self) -> str:
        head = ("| class | " + " | ".join(HEADINGS.get(c, c.replace("_", " ")) for c in COLUMNS)
                + " |")
        lines = [head, "| --- |" + " ---: |" * len(COLUMNS)]
        total: Counter = Counter()
        for cls, row in self.rows.items():
            total.update(row)
            lines.append(f"| {cls} | " + " | ".join(str(row[c]) for c in COLUMNS) + " |")
        lines.append("| **all** | " + " | ".join(f"**{total[c]}**" for c in COLUMNS) + " |")
        return "\n".join(lines)

    def failed(self) -> bool:
        return bool(self.harmful_accepted or self.crashes or self.originals)

    def summary(self) -> str:
        n = sum(r["mutants"] for r in self.rows.values())
        rejected = sum(r["rejected"] for r in self.rows.values())
        harmful = sum(r["harmful"] for r in self.rows.values())
        return (f"mutants: {n} mutants of {self.plans} plans ({self.graphs} graphs), "
                f"{rejected} rejected, {harmful} harmful, {len(self.harmful_accepted)} harmful "
                f"accepted, {len(self.crashes)} crashes, {len(self.over_strict)} control "
                f"mutants rejected, {self.seconds:.0f} s")

    def to_json(self) -> dict:
        return {"seed": self.seed, "graphs": self.graphs, "plans": self.plans,
                "classes": {c: dict(r) for c, r in self.rows.items()},
                "harmful_accepted": self.harmful_accepted, "crashes": self.crashes,
                "over_strict": self.over_strict, "original_problems": self.originals,
                "seconds": round(self.seconds, 1)}


def mutate(seed: int = 0, count: int = 100, workers: int = 2, graph: int | None = None,
           only: str | None = None, verbose: bool = False) -> Tally:
    """The harness: graphs from index 0 until every class has `count` mutants (or graph
    `graph` alone, of class `only`)."""
    tally = Tally(seed)
    t0 = time.perf_counter()
    results = ([mutate_graph(seed, graph, only)] if graph is not None
               else graph_mutants(seed, count, workers))
    for r in results:
        tally.add(r)
        if verbose:
            for v in r.verdicts:
                verdict = ("CRASH" if v.crash else "rejected" if v.rejected else
                           "HARMFUL-ACCEPTED" if v.harmful else "equivalent")
                print(f"{verdict:<17} {'harmful ' if v.harmful else ''}{v.where}: {v.what}: "
                      f"{v.crash or v.reason}")
    tally.seconds = time.perf_counter() - t0
    return tally


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=100, help="mutants per class (100)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a short run: 10 per class")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--graph", type=int, help="mutate this graph only (a reproducer)")
    parser.add_argument("--only", choices=list(MUTATIONS), help="with --graph: this class only")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every mutant")
    parser.add_argument("--json", type=Path, help="write the table and findings here")
    args = parser.parse_args(argv)
    count = 10 if args.quick else args.count
    tally = mutate(args.seed, count, args.workers, args.graph, args.only, args.verbose)
    print(tally.table())
    for line in tally.harmful_accepted:
        print(f"HARMFUL ACCEPTED {line}")
    for line in tally.crashes:
        print(f"CRASH {line}")
    for line in tally.over_strict:
        print(f"CONTROL REJECTED {line}")
    for line in tally.originals:
        print(f"ORIGINAL PLAN FAILED {line}")
    print(tally.summary())
    if args.json:
        args.json.write_text(json.dumps(tally.to_json(), indent=1) + "\n")
    return 1 if tally.failed() else 0


if __name__ == "__main__":
    sys.exit(main())
