"""Tests of the memgraph validator: small memgraphs written by hand validate, in their own order and
in random topological orders of their edges; each corruption of one is rejected with a message
naming the offending node; the JSON form round-trips and a corrupt plan file is refused."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
import sympy

from einpage.ir import ValidationReport, validate
from einpage.errors import PlanError
from einpage.ir import scalar
from einpage.ir.dtypes import DType
from einpage.ir.memgraph import (Access, ApplyNode, FreeNode, InputNode, MemGraph, OffloadNode,
                                 OutputRef, ReloadNode, TensorInfo)
from einpage.ir.ops import CopyOp, EinsumOp, FillOp, Piece
from einpage.ir.spec import EinsumSpec
from einpage.runtime.executor import random_topological_order

SHAPE = (8, 8)   # f32: 256 bytes, one ALIGNMENT unit, so offsets are slot numbers * 256
SLOT = 256
MATMUL = EinsumOp(EinsumSpec.parse("ij,jk->ik"), scalar.product(2), "sum", DType.f32)
SCALE = EinsumOp(EinsumSpec.parse("ij->ij"), 2 * scalar.product(1), None, DType.f32)
MATMUL3 = EinsumOp(EinsumSpec.parse("ij,jk,kl->il"), scalar.product(3), "sum", DType.f32)
COPY = CopyOp((Piece(0, ((0, 8), (0, 8)), ((0, 8), (0, 8))),))
FILL = FillOp(sympy.Integer(0), (0, 0))


class Plan:
    """Writes a memgraph node by node; each method returns the new node's id."""

    def __init__(self, names, device_bytes=4 * SLOT):
        self.device_bytes = device_bytes
        self.tensors = [TensorInfo(k, math.prod(SHAPE) * 4, DType.f32, SHAPE, name)
                        for k, name in enumerate(names)]
        self.nodes = []

    def _add(self, make):
        self.nodes.append(make(len(self.nodes)))
        return len(self.nodes) - 1

    def input(self, t, at="host", offset=None, deps=()):
        return self._add(lambda k: InputNode(k, t, at, offset, tuple(deps)))

    def reload(self, t, offset, deps):
        return self._add(lambda k: ReloadNode(k, t, offset, tuple(deps)))

    def offload(self, t, offset, deps):
        return self._add(lambda k: OffloadNode(k, t, offset, tuple(deps)))

    def free(self, t, offset, deps):
        return self._add(lambda k: FreeNode(k, t, offset, tuple(deps)))

    def apply(self, reads, write, deps, op=MATMUL, accumulate=False, frees=()):
        return self._add(lambda k: ApplyNode(
            k, tuple(Access(t, o) for t, o in reads), Access(*write), accumulate, op,
            tuple(deps), tuple(Access(t, o) for t, o in frees)))

    def build(self, outputs):
        outs = tuple(OutputRef(t, at, off, f"out{k}", (0, 0))
                     for k, (t, at, off) in enumerate(outputs))
        return MemGraph(self.device_bytes, tuple(self.tensors), tuple(self.nodes), outs)


def streaming_plan(reload_y_deps=(4, 5, 6)) -> MemGraph:
    """A weight streamed in, a result offloaded, freed and reloaded into the weight's bytes:

    %0 input w at host       %5 free y @512       (after its offload)
    %1 input x at device @0  %6 free w @256
    %2 reload w -> @256      %7 reload y -> @256  (into w's bytes: after %6; after y's last free %5)
    %3 y = x @ w -> @512     %8 z = y @ x -> @512 (into y's old bytes: after %5)
    %4 offload y             %9 free x @0
    """
    p = Plan(["w", "x", "y", "z"])
    w, x, y, z = range(4)
    p.input(w)                                    # 0
    p.input(x, "device", 0)                       # 1
    p.reload(w, SLOT, [0])                        # 2
    p.apply([(x, 0), (w, SLOT)], (y, 2 * SLOT), [1, 2])     # 3
    p.offload(y, 2 * SLOT, [3])                   # 4
    p.free(y, 2 * SLOT, [4])                      # 5
    p.free(w, SLOT, [3])                          # 6
    p.reload(y, SLOT, reload_y_deps)              # 7
    p.apply([(y, SLOT), (x, 0)], (z, 2 * SLOT), [1, 5, 7])  # 8
    p.free(x, 0, [8])                             # 9
    return p.build([(z, "device", 2 * SLOT), (y, "host", None)])


def accumulate_plan(consume_deps=(4, 5)) -> MemGraph:
    """A partial sum accumulated, offloaded, then consumed in place by an elementwise apply:

    %0 input a at device @0   %4 c += b @ a           %6 d = 2c -> @512, frees c (in place)
    %1 input b at host        %5 offload c            %7 free b
    %2 reload b -> @256
    %3 c = a @ b -> @512
    """
    p = Plan(["a", "b", "c", "d"])
    a, b, c, d = range(4)
    p.input(a, "device", 0)                                          # 0
    p.input(b)                                                       # 1
    p.reload(b, SLOT, [1])                                           # 2
    p.apply([(a, 0), (b, SLOT)], (c, 2 * SLOT), [0, 2])              # 3
    p.apply([(b, SLOT), (a, 0)], (c, 2 * SLOT), [3], accumulate=True)  # 4
    p.offload(c, 2 * SLOT, [4])                                      # 5
    p.apply([(c, 2 * SLOT)], (d, 2 * SLOT), consume_deps, op=SCALE,
            frees=[(c, 2 * SLOT)])                                   # 6
    p.free(b, SLOT, [4])                                             # 7
    return p.build([(d, "device", 2 * SLOT), (c, "host", None), (a, "device", 0)])


def stale_plan(offload_first: bool) -> MemGraph:
    """A weight-like block reloaded, accumulated into, freed and reloaded: stale unless the
    accumulated version is offloaded before the free."""
    p = Plan(["a", "b"])
    a, b = range(2)
    p.input(a, "device", 0)                                           # 0
    p.input(b)                                                        # 1
    p.reload(b, SLOT, [1])                                            # 2
    p.apply([(a, 0)], (b, SLOT), [0, 2], accumulate=True, op=COPY)    # 3
    last = [3]
    if offload_first:
        last = [p.offload(b, SLOT, [3])]                              # 4
    freed = p.free(b, SLOT, last)
    p.reload(b, SLOT, [*last, freed])
    return p.build([(b, "device", SLOT)])


# ------------------------------------------------------------------------- rewriting helpers
def replace_node(mg: MemGraph, k: int, **changes) -> MemGraph:
    nodes = list(mg.nodes)
    nodes[k] = dataclasses.replace(nodes[k], **changes)
    return dataclasses.replace(mg, nodes=tuple(nodes))


def renumber(mg: MemGraph, order: list[int]) -> MemGraph:
    """The nodes in `order` (old ids; ids left out are dropped, with the deps on them)."""
    new = {old: k for k, old in enumerate(order)}
    nodes = tuple(dataclasses.replace(mg.nodes[old], id=k,
                                      deps=tuple(new[d] for d in mg.nodes[old].deps if d in new))
                  for k, old in enumerate(order))
    return dataclasses.replace(mg, nodes=nodes)



def rejects(mg: MemGraph, *fragments: str) -> str:
    with pytest.raises(PlanError) as info:
        validate(mg)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, message
    return message


# ------------------------------------------------------------------------- valid plans
@pytest.mark.parametrize("make", [streaming_plan, accumulate_plan,
                                  lambda: stale_plan(offload_first=True)])
def test_hand_written_plans_validate(make):
    mg = make()
    report = validate(mg)
    assert isinstance(report, ValidationReport)
    assert report.nodes == len(mg.nodes)
    assert report.peak_bytes == mg.high_water()
    assert report.live_peak_bytes <= report.peak_bytes <= mg.device_bytes


def test_report_of_streaming_plan():
    report = validate(streaming_plan())
    # instances: x, w, y, y again, z; at most three 256-byte blocks live at once
    assert (report.instances, report.peak_bytes, report.live_peak_bytes) == (5, 768, 768)
    assert (report.reloads, report.reload_bytes, report.offloads, report.offload_bytes) == (
        2, 512, 1, 256)
    assert "10 nodes" in str(report)


def test_live_peak_below_high_water_when_placement_leaves_a_gap():
    p = Plan(["x"])
    p.input(0, "device", 3 * SLOT)
    report = validate(p.build([(0, "device", 3 * SLOT)]))
    assert (report.peak_bytes, report.live_peak_bytes) == (4 * SLOT, SLOT)


def live_peak_of_instances(mg: MemGraph) -> int:
    """`MemGraph.live_peak` as a sum over `MemGraph.instances`: each instance's bytes from the
    node that creates it to the node that ends it, and, while an apply that frees instances
    runs, their bytes its write does not take over."""
    created = [0] * len(mg.nodes)
    ended = [0] * len(mg.nodes)
    during = [0] * len(mg.nodes)
    for i in mg.instances:
        created[i.start] += i.bytes
        if i.end is None:
            continue
        ended[i.end] += i.bytes
        n = mg.nodes[i.end]
        if isinstance(n, ApplyNode) and n.frees and not n.accumulate:
            lo, hi = n.write.offset, n.write.offset + mg.tensors[n.write.tensor].bytes
            during[i.end] += i.bytes - max(0, min(hi, i.offset + i.bytes) - max(lo, i.offset))
    live = top = 0
    for k in range(len(mg.nodes)):
        live += created[k] - ended[k]
        top = max(top, live + during[k])
    return top


def frees_apart_plan() -> MemGraph:
    """`accumulate_plan` whose last apply writes d beside c (@768) while freeing it: both live
    while it runs."""
    return replace_node(accumulate_plan(), 6, write=Access(3, 3 * SLOT))


def rewrite_plan() -> MemGraph:
    """A malformed plan (the validator refuses it): b written twice with no free between, the
    second apply freeing a: b's first instance ends where its second is made, and counts as a
    freed one does while that apply runs."""
    p = Plan(["a", "b"])
    p.input(0, "device", 0)                                            # 0
    p.apply([(0, 0)], (1, SLOT), [0], op=SCALE)                        # 1
    p.apply([(0, 0)], (1, 2 * SLOT), [1], op=SCALE, frees=[(0, 0)])    # 2
    return p.build([(1, "device", 2 * SLOT)])


@pytest.mark.parametrize("make", [streaming_plan, accumulate_plan, frees_apart_plan,
                                  rewrite_plan,
                                  lambda: stale_plan(offload_first=True),
                                  lambda: stale_plan(offload_first=False)])
def test_live_peak_counts_every_instance(make):
    """The one-pass live peak (the compiler's search asks it of every plan) is the instances'
    count, in place and apart, in the plan's order and in random topological orders."""
    mg = make()
    assert mg.live_peak() == live_peak_of_instances(mg) > 0
    for seed in range(10):
        other = renumber(mg, random_topological_order(mg, seed))
        assert other.live_peak() == live_peak_of_instances(other)


def test_live_peak_of_compiled_plans_counts_every_instance():
    """... and of plans the compiler lowered (streamed, offloaded, written back)."""
    from test_compile import random_graphs
    from hypothesis import HealthCheck, given, settings

    from einpage.compiler import CompileOptions, compile_graph
    from einpage.errors import BudgetError

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
    @given(random_graphs())
    def check(case):
        graph, _, _ = case
        probe = compile_graph(graph, CompileOptions(1 << 30, block_bytes=512, validate=False))
        least = probe.report.compiled.min_budget_bytes
        for slack in (1.0, 1.5):
            budget = max(4096, int(least * slack))
            try:
                mg = compile_graph(graph, CompileOptions(budget, block_bytes=512,
                                                         validate=False)).memgraph
            except BudgetError:
                continue
            assert mg.live_peak() == live_peak_of_instances(mg)

    check()


@pytest.mark.parametrize("make", [streaming_plan, accumulate_plan,
                                  lambda: stale_plan(offload_first=True)])
def test_every_topological_order_of_a_valid_plan_validates(make):
    mg = make()
    for seed in range(25):
        order = random_topological_order(mg, seed)
        assert validate(renumber(mg, order)).peak_bytes == mg.high_water()


# ------------------------------------------------------------------------- corruptions
def test_errors_end_with_the_nodes_around_the_failing_one():
    """verify, validate and the executor show the failing node in its neighbourhood (marked
    `>`), torch.fx style; the command line prints only the first line."""
    from einpage.runtime import run
    message = rejects(replace_node(streaming_plan(), 3, deps=(1,)), "node %3 (apply)")
    lines = message.splitlines()
    assert lines[0].startswith("node %3 (apply)")
    assert [line[:4] for line in lines[1:]] == ["  %1", "  %2", "> %3", "  %4", "  %5"]
    with pytest.raises(PlanError) as info:  # MemGraph.verify
        replace_node(streaming_plan(), 4, deps=(9,)).verify()
    assert "> %4 = " in str(info.value) and "  %6 = " in str(info.value)
    with pytest.raises(PlanError) as info:  # the executor (x is given no value)
        run(streaming_plan())
    assert str(info.value).startswith("while executing node %1 (input)")
    assert "\n> %1 = input %t1" in str(info.value) and "\n  %3 = apply" in str(info.value)


def test_dropped_data_edge():
    # %3 reads w, which %2 reloads; without the edge the read may run before the reload
    rejects(replace_node(streaming_plan(), 3, deps=(1,)),
            "node %3 (apply)", "reads %t0 (w) @0x00000100", "node %2 (reload) is not an ancestor")


def test_dropped_memory_reuse_edge():
    # %7 reloads y into the bytes %6 freed; without the edge it may overwrite w while %3 reads it
    rejects(streaming_plan(reload_y_deps=(4, 5)),
            "node %7 (reload)", "bytes last held by %t0 (w)",
            "node %6 (free), which freed them, is not an ancestor")


@pytest.mark.parametrize("big_deps, missing", [((2,), "node %3 (free)"), ((3,), "node %2 (free)"),
                                               ((2, 3), None)])
def test_reuse_across_two_freed_blocks(big_deps, missing):
    # a 512-byte block written over the bytes of two freed 256-byte ones must follow both frees
    p = Plan(["a", "b"])
    p.tensors.append(TensorInfo(2, 512, DType.f32, (8, 16), "big"))
    p.input(0, "device", 0)          # 0
    p.input(1, "device", SLOT)       # 1
    p.free(0, 0, [0])                # 2
    p.free(1, SLOT, [1])             # 3
    p.apply([], (2, 0), big_deps, op=FILL)
    p.free(2, 0, [4])                # 5
    p.input(0, "device", SLOT, [3, 5])  # 6: inside big's old bytes, after its free
    mg = p.build([(0, "device", SLOT)])
    if missing is None:
        assert validate(mg).peak_bytes == 512
    else:
        rejects(mg, "node %4 (apply)", f"{missing}, which freed them")


def test_new_instance_of_a_tensor_must_follow_the_end_of_its_previous_one():
    rejects(streaming_plan(reload_y_deps=(4, 6)),
            "node %7 (reload)", "previous instance, node %5 (free), is not an ancestor")


def test_offset_shifted_into_a_live_tensor():
    mg = replace_node(streaming_plan(), 3, write=Access(2, 0))
    rejects(mg, "node %3 (apply)", "overlaps live %t1 (x)", "node %1 (input)")


def test_offset_out_of_range():
    mg = replace_node(streaming_plan(), 8, write=Access(3, 4 * SLOT))
    rejects(mg, "node %8 (apply)", "outside the arena [0, 1024)")


def test_partly_out_of_range():
    mg = dataclasses.replace(streaming_plan(), device_bytes=3 * SLOT - 8)
    rejects(mg, "node %3 (apply)", "outside the arena")


def test_misaligned_offset():
    rejects(replace_node(streaming_plan(), 2, offset=SLOT + 64),
            "node %2 (reload)", "not aligned to 256")


def test_dropped_reload():
    # without %7, %8 (now %7) reads y at @256, whose only instance was freed by %5
    mg = renumber(streaming_plan(), [0, 1, 2, 3, 4, 5, 6, 8, 9])
    rejects(mg, "node %7 (apply)", "reads %t2 (y) @0x00000100", "not live",
            "freed by node %5 (free)")


def test_reload_without_host_copy_ancestor():
    rejects(replace_node(streaming_plan(), 2, deps=()),
            "node %2 (reload)", "no host copy", "node %0 (input)")


def test_reload_of_a_tensor_never_on_host():
    p = Plan(["x"])
    p.reload(0, 0, [])
    rejects(p.build([]), "node %0 (reload)", "no host copy")


def test_stale_reload_after_accumulate():
    rejects(stale_plan(offload_first=False),
            "node %5 (reload)", "stale", "node %3 (apply) wrote")


def test_free_reordered_before_a_read():
    # free x (deps on %3 only) moved before %8, the apply that still reads x
    mg = replace_node(streaming_plan(), 9, deps=(3,))
    rejects(renumber(mg, [0, 1, 2, 3, 4, 5, 6, 7, 9, 8]),
            "node %9 (apply)", "reads %t1 (x) @0x00000000", "not live", "node %8 (free)")


def test_free_not_after_all_uses():
    # same order, but the free no longer depends on the reads of x
    rejects(replace_node(streaming_plan(), 9, deps=(1,)),
            "node %9 (free)", "reader node %3 (apply) is not an ancestor")


def test_missing_output():
    mg = dataclasses.replace(streaming_plan(), outputs=(OutputRef(0, "device", SLOT, "w", ()),))
    rejects(mg, "output 'w'", "not on the device at the end", "node %6 (free)")


def test_output_at_wrong_offset():
    mg = dataclasses.replace(streaming_plan(), outputs=(OutputRef(3, "device", 0, "z", ()),))
    rejects(mg, "output 'z'", "node %8 (apply)")


def test_host_output_never_offloaded():
    mg = dataclasses.replace(streaming_plan(), outputs=(OutputRef(3, "host", None, "z", ()),))
    rejects(mg, "output 'z'", "no host copy")


def test_stale_host_output():
    # offload c before the accumulate: the host holds the partial sum
    mg = accumulate_plan()
    mg = renumber(replace_node(replace_node(mg, 5, deps=(3,)), 4, deps=(3, 5)),
                  [0, 1, 2, 3, 5, 4, 6, 7])
    rejects(mg, "output 'out1'", "stale", "node %5 (apply) wrote")


def test_dep_on_later_id():
    rejects(replace_node(streaming_plan(), 3, deps=(1, 2, 4)),
            "node %3 (apply)", "dep 4 is not an earlier node id")


def test_id_not_position():
    rejects(replace_node(streaming_plan(), 4, id=5), "node %5 (offload)", "expected its position 4")


def test_wrong_tensor_bytes():
    mg = streaming_plan()
    tensors = list(mg.tensors)
    tensors[2] = dataclasses.replace(tensors[2], bytes=255)
    rejects(dataclasses.replace(mg, tensors=tuple(tensors)),
            "tensor %t2 (y)", "bytes is 255", "takes 256")


def test_unknown_tensor():
    rejects(replace_node(streaming_plan(), 4, tensor=9), "node %4 (offload)", "tensor 9")


def test_read_at_wrong_offset():
    mg = replace_node(streaming_plan(), 8, reads=(Access(2, 2 * SLOT), Access(1, 0)))
    rejects(mg, "node %8 (apply)", "live instance is at @0x00000100", "node %7 (reload)")


def test_double_free():
    mg = replace_node(streaming_plan(), 9, tensor=0, offset=SLOT)
    rejects(mg, "node %9 (free)", "not live", "freed by node %6 (free)")


def test_offload_of_a_freed_instance():
    mg = streaming_plan()
    nodes = list(mg.nodes)
    nodes[6] = OffloadNode(6, 2, 2 * SLOT, (5,))  # y, freed by %5
    rejects(dataclasses.replace(mg, nodes=tuple(nodes)),
            "node %6 (offload)", "offloads %t2 (y)", "not live", "freed by node %5 (free)")


def test_created_while_live():
    p = Plan(["x"])
    p.input(0)
    p.reload(0, 0, [0])
    p.reload(0, SLOT, [0, 1])
    rejects(p.build([]), "node %2 (reload)", "already has a live instance", "node %1 (reload)")


def test_accumulate_before_an_earlier_read_finished():
    # %3 reads c; the accumulate %4 must wait for it (write after read)
    p = Plan(["a", "c", "e"])
    a, c, e = range(3)
    p.input(a, "device", 0)                                          # 0
    p.apply([(a, 0)], (c, SLOT), [0], op=COPY)                       # 1
    p.apply([(a, 0)], (e, 2 * SLOT), [0], op=COPY)                   # 2
    p.apply([(c, SLOT)], (e, 2 * SLOT), [1, 2], op=COPY, accumulate=True)  # 3 reads c
    p.apply([(a, 0)], (c, SLOT), [1], op=COPY, accumulate=True)      # 4 writes c
    rejects(p.build([]), "node %4 (apply)", "accumulates into %t1 (c)",
            "reader node %3 (apply) is not an ancestor")


def test_accumulate_without_its_writer():
    rejects(replace_node(accumulate_plan(), 4, deps=(0, 2)),
            "node %4 (apply)", "accumulates into %t2 (c)", "writer node %3 (apply)")


def test_in_place_consumer_must_follow_every_use():
    # %6 frees c and writes into its bytes; the offload %5 still reads c
    rejects(accumulate_plan(consume_deps=(4,)),
            "node %6 (apply)", "frees %t2 (c)", "reader node %5 (offload) is not an ancestor")


def test_apply_may_not_free_what_it_accumulates_into():
    mg = replace_node(accumulate_plan(), 4, frees=(Access(2, 2 * SLOT),))
    rejects(mg, "node %4 (apply)", "the instance it accumulates into")


def test_input_at_device_without_offset():
    rejects(replace_node(streaming_plan(), 1, offset=None), "node %1 (input)", "no offset")


def test_bad_input_location():
    rejects(replace_node(streaming_plan(), 0, at="tape"), "node %0 (input)", "'tape'")


# ------------------------------------------------------------------------- JSON
@pytest.mark.parametrize("make", [streaming_plan, accumulate_plan])
def test_json_round_trip_validates_identically(make, tmp_path):
    mg = make()
    again = MemGraph.from_json(json.loads(json.dumps(mg.to_json())))
    assert again == mg
    assert validate(again) == validate(mg)
    mg.save(tmp_path / "plan.json")
    assert validate(MemGraph.load(tmp_path / "plan.json")) == validate(mg)


def test_corrupt_json_plan_is_rejected_by_the_validator(tmp_path):
    data = streaming_plan().to_json()
    data["nodes"][3]["deps"] = [1]
    (tmp_path / "plan.json").write_text(json.dumps(data))
    rejects(MemGraph.load(tmp_path / "plan.json"), "node %3 (apply)", "node %2 (reload)")


def _corrupt(data: dict, how: str):
    if how == "format":
        data["format"] = "something.else"
    elif how == "version":
        data["version"] = 99
    elif how == "missing tensors":
        del data["tensors"]
    elif how == "missing node key":
        del data["nodes"][2]["offset"]
    elif how == "unknown kind":
        data["nodes"][2]["kind"] = "teleport"
    return json.dumps(data)


@pytest.mark.parametrize("how, fragment", [
    ("not json", "not JSON"), ("format", "not an einpage plan"), ("version", "version 99"),
    ("missing tensors", "malformed"), ("missing node key", "plan node 2"),
    ("unknown kind", "teleport")])
def test_load_of_a_corrupt_file(tmp_path, how, fragment):
    path = tmp_path / "plan.json"
    text = "{\"format\": " if how == "not json" else _corrupt(streaming_plan().to_json(), how)
    path.write_text(text)
    with pytest.raises(PlanError, match=fragment):
        MemGraph.load(path)


def test_load_of_a_missing_file(tmp_path):
    with pytest.raises(PlanError, match="no such plan file"):
        MemGraph.load(tmp_path / "absent.json")


# ------------------------------------------------------------------------- scale
def chain_plan(layers: int, slots: int = 16, chain_deps: bool = False) -> MemGraph:
    """A synthetic streamed chain: `x = x @ w_l` for every layer with each weight reloaded, and
    every 8th layer a skip copy offloaded, freed, reloaded 4 layers later and accumulated back in.
    A resident weight `r` (input at device) is read by every layer. Blocks take slots of a FIFO
    allocator; a new block depends on the last free of its slot. With `chain_deps`, every node
    depends only on the node before it instead (a total order; all other orderings transitive)."""
    names = ["r", "x0"]
    p = Plan(names, device_bytes=(slots + 1) * SLOT)
    free_slots = [(k * SLOT, None) for k in range(1, slots + 1)]

    def new_tensor(name):
        p.tensors.append(TensorInfo(len(p.tensors), SLOT, DType.f32, SHAPE, name))
        return len(p.tensors) - 1

    def take():
        offset, ender = free_slots.pop(0)
        return offset, [] if ender is None else [ender]

    def release(offset, ender):
        free_slots.append((offset, ender))

    r_node = p.input(0, "device", 0)
    x, (x_off, reuse) = 1, take()
    x_node = p.apply([(0, 0)], (x, x_off), [r_node, *reuse], op=COPY)
    x_readers = []  # readers of x since its last writer, besides the next layer
    pending = {}
    for layer in range(layers):
        w = new_tensor(f"w{layer}")
        host = p.input(w)
        w_off, reuse = take()
        reload = p.reload(w, w_off, [host, *reuse])
        y = new_tensor(f"x{layer + 1}")
        y_off, reuse = take()
        y_node = p.apply([(x, x_off), (w, w_off), (0, 0)], (y, y_off), [x_node, reload, r_node,
                                                                         *reuse], op=MATMUL3)
        release(w_off, p.free(w, w_off, [y_node]))
        release(x_off, p.free(x, x_off, [y_node, *x_readers]))
        x, x_off, x_node, x_readers = y, y_off, y_node, []
        if layer % 8 == 0:
            s = new_tensor(f"skip{layer}")
            s_off, reuse = take()
            copy = p.apply([(x, x_off)], (s, s_off), [x_node, *reuse], op=COPY)
            x_readers.append(copy)
            off = p.offload(s, s_off, [copy])
            ender = p.free(s, s_off, [off])
            release(s_off, ender)
            pending[layer + 4] = (s, off, ender)
        if layer in pending:
            s, off, ender = pending.pop(layer)
            s_off, reuse = take()
            back = p.reload(s, s_off, [off, ender, *reuse])
            x_node = p.apply([(s, s_off)], (x, x_off), [back, x_node, *x_readers], op=COPY,
                             accumulate=True)
            x_readers = []
            release(s_off, p.free(s, s_off, [x_node]))
    mg = p.build([(x, "device", x_off)])
    if chain_deps:
        mg = dataclasses.replace(mg, nodes=tuple(
            dataclasses.replace(n, deps=(n.id - 1,) if n.id else ()) for n in mg.nodes))
    return mg


@pytest.mark.parametrize("chain_deps", [False, True])
def test_chain_plan_validates(chain_deps):
    mg = chain_plan(200, chain_deps=chain_deps)
    report = validate(mg)
    assert report.nodes == len(mg.nodes) > 1000
    assert report.peak_bytes <= mg.device_bytes


def test_chain_plan_with_a_dropped_edge_is_rejected():
    mg = chain_plan(50)
    k = next(n.id for n in mg.nodes if n.kind == "reload" and n.id > 200
             and mg.tensors[n.tensor].name.startswith("w"))
    rejects(replace_node(mg, k, deps=mg.nodes[k].deps[1:]), f"node %{k} (reload)", "no host copy")


@pytest.mark.slow
@pytest.mark.parametrize("chain_deps", [False, True])
def test_chain_plan_of_50k_nodes_validates(chain_deps):
    mg = chain_plan(9000, chain_deps=chain_deps)
    assert validate(mg).nodes >= 50_000


# ------------------------------------------------------------------------- edges alone
def _without_edge(mg: MemGraph, k: int, d: int) -> MemGraph:
    return replace_node(mg, k, deps=tuple(e for e in mg.nodes[k].deps if e != d))


@pytest.mark.parametrize("make", [streaming_plan, accumulate_plan,
                                  lambda: stale_plan(offload_first=True), lambda: chain_plan(9)])
def test_what_validates_validates_in_every_topological_order(make):
    """Drop each edge in turn: the validator either rejects the plan, or the edge was redundant
    and every random topological order of what is left validates too."""
    mg = make()
    seeds = iter(range(10**6))
    outcomes = {"rejected": 0, "accepted": 0}
    for node in mg.nodes:
        for d in sorted(set(node.deps)):
            cut = _without_edge(mg, node.id, d)
            try:
                validate(cut)
            except PlanError as exc:
                assert f"node %{node.id} (" in str(exc) or "output" in str(exc)
                outcomes["rejected"] += 1
                continue
            outcomes["accepted"] += 1
            for _ in range(5):
                validate(renumber(cut, random_topological_order(cut, next(seeds))))
    assert outcomes["rejected"] > 0
