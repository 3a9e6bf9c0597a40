"""Plans that prove what they compute (DESIGN.md, "Version 2", provenance;
`einpage.ir.translation`).

A compiled plan carries its taskgraph: each tensor names its block, each apply its task. The
validator proves the plan computes that graph, and each rule is shown refusing a plan that breaks
it: a read of the wrong block (of the same shape too), a deleted partial of a sum, a partial read
early, a task run twice, an op that does not fit its operands, a tensor posing as another block,
an output missing. The file round-trips with its hash, an edited graph is refused, a version 1
plan still loads (not proven, with a warning), every runtime validates a plan it did not make.
"""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import sympy
from test_cli import assert_one_line_error, cli

from einpage.compiler import CompileOptions, compile_graph
from einpage.errors import PlanError, SpecError
from einpage.ir import GraphBuilder, MemGraph, scalar, validate
from einpage.ir.dtypes import DType
from einpage.ir.memgraph import Access, ApplyNode
from einpage.ir.ops import CopyOp, EinsumOp, GatherOp, Piece
from einpage.ir.spec import EinsumSpec
from einpage.ir.tensors import Source
from einpage.ir.translation import op_misfit, prove
from einpage.runtime import reference, run
from einpage.runtime.stream_executor import run_streams


def _graph():
    """x @ w1 with the contraction cut (chains of partial sums), then silu, then @ w2."""
    g = GraphBuilder()
    x = g.input("x", (16, 64))
    w1 = g.input("w1", (64, 32), role="weight")
    w2 = g.input("w2", (32, 16), role="weight")
    h = g.einsum("sk,kn->sn", x, w1)
    a = g.einsum("sn->sn", h, join=scalar.silu(scalar.x(0)))
    g.output("y", g.einsum("sn,nm->sm", a, w2))
    return g.build()


WEIGHTS = {"w1": np.random.default_rng(1).standard_normal((64, 32)).astype(np.float32),
           "w2": np.random.default_rng(2).standard_normal((32, 16)).astype(np.float32)}
INPUTS = {"x": np.random.default_rng(3).standard_normal((16, 64)).astype(np.float32)}


@pytest.fixture(scope="module")
def plan() -> MemGraph:
    return compile_graph(_graph(), CompileOptions(16 << 10, block_bytes=2048)).memgraph


def _applies(mg):
    return [n for n in mg.nodes if isinstance(n, ApplyNode)]


def _with_node(mg, k, node):
    return dataclasses.replace(mg, nodes=mg.nodes[:k] + (node,) + mg.nodes[k + 1:])


def test_a_compiled_plan_is_proven(plan):
    report = validate(plan)
    assert report.proven and "proven to compute its graph" in str(report)
    assert plan.graph is not None and plan.graph_hash.startswith("sha256:")
    assert sorted(n.task for n in _applies(plan)) == list(range(len(plan.graph.tasks)))
    assert [t.block for t in plan.tensors] == list(range(len(plan.graph.blocks)))
    assert any(len(w) > 2 for w in plan.graph.writers)  # the contraction is cut: chains


def test_the_file_round_trips_with_its_hash(plan, tmp_path):
    path = tmp_path / "p.json"
    plan.save(path)
    back = MemGraph.load(path)
    assert back.graph_hash == plan.graph_hash and validate(back).proven
    assert [n.op for n in _applies(back)] == [n.op for n in _applies(plan)]
    back.save(tmp_path / "again.json")
    assert (tmp_path / "again.json").read_bytes() == path.read_bytes()
    np.testing.assert_allclose(run(back, INPUTS, WEIGHTS.__getitem__)["y"],
                               reference.evaluate(_graph(), INPUTS, WEIGHTS.__getitem__)["y"],
                               rtol=1e-5, atol=1e-4)  # outputs up to ~60 in float32: an
    # element that cancels to 0.17 keeps the rounding of its terms (1.6e-5 on this BLAS)


@pytest.mark.parametrize("edit", [
    lambda d: d["graph"]["tasks"].pop(),                         # a task deleted
    lambda d: d["graph"]["blocks"][0][2].__setitem__(0, 99),     # a block's shape
    lambda d: d["graph"].__setitem__("hash", "sha256:" + "0" * 64),
    lambda d: d["results"][0].__setitem__("name", "z"),          # the results are hashed too
])
def test_an_edited_graph_is_refused(plan, tmp_path, capsys, edit):
    data = plan.to_json()
    edit(data)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError, match="hash"):
        MemGraph.load(path)
    assert_one_line_error(capsys, cli("inspect", path), "damaged or edited")


def _as_version_1(plan) -> dict:
    """The JSON of `plan` as version 1 wrote it: no graph, each apply with its op."""
    data = plan.to_json()
    del data["graph"]
    data["version"] = 1
    ops = {a.id: a.op for a in _applies(plan)}
    for n in data["nodes"]:
        if n["kind"] == "apply":
            n["op"] = ops[n["id"]].to_json()
            del n["task"]
    for t in data["tensors"]:
        del t["block"]
    return data


def test_a_version_1_plan_loads_unproven_with_a_warning(plan, tmp_path, capsys):
    data = _as_version_1(plan)
    path = tmp_path / "v1.json"
    path.write_text(json.dumps(data))
    mg = MemGraph.load(path)
    assert mg.graph is None and not validate(mg).proven
    assert cli("inspect", path) == 0
    out, err = capsys.readouterr()
    assert "not proven to compute a graph" in out
    assert err.startswith("einpage: warning:") and "version 1" in err and err.count("\n") == 1


def test_a_rank_outside_its_world_is_refused(plan):
    data = plan.to_json()
    data.update(rank=2, world=2)
    with pytest.raises(PlanError, match="rank 2 of world 2: expected 0 <= rank < world"):
        MemGraph.from_json(data).verify()
    data["version"] = 1
    with pytest.raises(PlanError, match="version 1 plan cannot hold ranks"):
        MemGraph.from_json(data)


def test_guards_and_unknown_storage_formats_are_named(plan):
    data = plan.to_json()
    data["tensors"][0]["storage"] = {"format": "q3_k", "group": 256, "span": 1}
    with pytest.raises(PlanError, match="storage format 'q3_k', which this einpage does not run"):
        MemGraph.from_json(data)
    data = plan.to_json()
    next(n for n in data["nodes"] if n["kind"] == "apply")["guard"] = {"tensor": 0, "expert": 1}
    with pytest.raises(PlanError, match="names no guard of its own"):
        MemGraph.from_json(data)


def test_a_placement_the_reader_cannot_run_is_refused(plan):
    """`on` takes "device" or "host"; a host apply names host copies (no offsets); version 1
    files hold no placement."""
    data = plan.to_json()
    apply = next(n for n in data["nodes"] if n["kind"] == "apply")
    apply["on"] = "host"  # with its device offsets
    with pytest.raises(PlanError, match="host apply names host copies by tensor alone"):
        validate(MemGraph.from_json(data))
    apply["on"] = "gpu1"
    with pytest.raises(PlanError, match="on is 'gpu1'"):
        validate(MemGraph.from_json(data))
    v1 = plan.to_json()
    v1["version"] = 1
    v1.pop("graph")
    for n in v1["nodes"]:
        if n["kind"] == "apply":
            n.pop("task")
    next(n for n in v1["nodes"] if n["kind"] == "apply")["on"] = "host"
    with pytest.raises(PlanError, match="version 1 plan cannot place an apply on the host"):
        MemGraph.from_json(v1)


# ---------------------------------------------------------------- each rule refuses its mutant
def _same_shape_other_block(plan, n):
    """(read index, tensor) of another block of the same shape and dtype as a read of `n`."""
    for k, a in enumerate(n.reads):
        t = plan.tensors[a.tensor]
        for u in plan.tensors:
            if u.id != t.id and (u.shape, u.dtype) == (t.shape, t.dtype):
                return k, u.id
    return None


def test_a_read_of_another_block_of_the_same_shape(plan):
    for n in _applies(plan):
        found = _same_shape_other_block(plan, n)
        if found:
            k, other = found
            reads = list(n.reads)
            reads[k] = Access(other, reads[k].offset)
            bad = _with_node(plan, n.id, dataclasses.replace(n, reads=tuple(reads)))
            with pytest.raises(PlanError, match=f"read {k} is %t{other}"):
                prove(bad)
            return
    pytest.fail("no apply reads a block another of the same shape could pose as")


def _chain(plan):
    """The applies of one summation chain (a block with 3 or more writers), in plan order."""
    b = next(b for b, w in enumerate(plan.graph.writers) if len(w) > 2)
    return [n for n in _applies(plan) if plan.tensors[n.write.tensor].block == b]


def test_a_deleted_partial_of_a_sum(plan):
    victim = _chain(plan)[-1]
    bad = dataclasses.replace(plan, nodes=tuple(n for n in plan.nodes if n is not victim))
    with pytest.raises(PlanError, match=r"after \d+ of the \d+ tasks that write its block"):
        prove(bad)


def test_a_partial_read_early(plan):
    """The chain's last partial moved after a reader of the block: the reader sees an
    incomplete sum (the memory rules would also refuse the order; the proof names the sum)."""
    last = _chain(plan)[-1]
    reader = next(n for n in _applies(plan)
                  if any(a.tensor == last.write.tensor for a in n.reads))
    nodes = list(plan.nodes)
    nodes.remove(last)
    nodes.insert(nodes.index(reader) + 1, last)
    with pytest.raises(PlanError, match="tasks that write its block"):
        prove(dataclasses.replace(plan, nodes=tuple(nodes)))


def test_a_task_run_twice(plan):
    a, b = _applies(plan)[:2]
    bad = _with_node(plan, b.id, dataclasses.replace(b, task=a.task))
    with pytest.raises(PlanError, match=f"runs task {a.task}, which node %{a.id} ran already"):
        prove(bad)


def test_an_apply_naming_no_task(plan):
    n = _applies(plan)[0]
    with pytest.raises(PlanError, match="names task None"):
        prove(_with_node(plan, n.id, dataclasses.replace(n, task=None)))


def test_an_accumulate_flag_flipped(plan):
    n = _chain(plan)[1]
    with pytest.raises(PlanError, match="accumulate is False"):
        prove(_with_node(plan, n.id, dataclasses.replace(n, accumulate=False)))


def test_another_op(plan):
    n = next(n for n in _applies(plan) if isinstance(n.op, EinsumOp) and n.op.join != 0)
    other = dataclasses.replace(n.op, join=n.op.join * 2)
    with pytest.raises(PlanError, match=f"but task {n.task} runs"):
        prove(_with_node(plan, n.id, dataclasses.replace(n, op=other)))


@pytest.mark.parametrize("change,message", [
    (lambda t, plan: dataclasses.replace(t, block=(t.block + 1) % len(plan.tensors)),
     "is tensor|but its block"),
    (lambda t, plan: dataclasses.replace(t, block=None), "names block None"),
    (lambda t, plan: dataclasses.replace(t, source=Source("w9", (0, 0), (64, 32))),
     "comes from w9"),
])
def test_a_tensor_posing_as_another_block(plan, change, message):
    k = next(t.id for t in plan.tensors if t.source is not None)
    tensors = list(plan.tensors)
    tensors[k] = change(tensors[k], plan)
    with pytest.raises(PlanError, match=message):
        prove(dataclasses.replace(plan, tensors=tuple(tensors)))


def test_an_output_missing_or_twice(plan):
    with pytest.raises(PlanError, match="missing from the plan's outputs"):
        prove(dataclasses.replace(plan, outputs=plan.outputs[1:]))
    with pytest.raises(PlanError, match="named twice"):
        prove(dataclasses.replace(plan, outputs=plan.outputs + plan.outputs[:1]))


# ---------------------------------------------------------------- ops fit their operands
def _t(shape, tid=0, dtype=DType.f32):
    """A tensor of `shape`; a trailing dtype name in `shape` sets its dtype."""
    from einpage.ir.memgraph import TensorInfo
    if shape and isinstance(shape[-1], str):
        shape, dtype = shape[:-1], DType(shape[-1])
    return TensorInfo(tid, int(np.prod(shape)) * dtype.itemsize, dtype, tuple(shape), f"t{tid}")


MATMUL = EinsumOp(EinsumSpec.parse("ij,jk->ik"), scalar.product(2), "sum", DType.f32)


@pytest.mark.parametrize("op,reads,write,problem", [
    (MATMUL, [(4, 8), (8, 2)], (4, 2), None),
    (MATMUL, [(4, 8), (8, 2), (2, 2)], (4, 2), "reads 3 blocks; its spec has 2"),
    (MATMUL, [(4, 8), (6, 2)], (4, 2), "index 'j' is 6 there but 8"),
    (MATMUL, [(4, 8, 1), (8, 2)], (4, 2), "rank 3, not 2"),
    (MATMUL, [(4, 8), (8, 2)], (4, 3), "its spec makes [4, 2]"),
    (GatherOp(0), [(10, 4), (3,)], (3, 4), None),
    (GatherOp(0), [(10, 4), (3,)], (3, 5), "that gather makes [3, 4]"),
    (GatherOp(0), [(10, 4)], (3, 4), "a gather reads (table, ids)"),
    (GatherOp(0), [(10, 4), (3, "f32")], (3, 4), "ids are integers"),
    (CopyOp((Piece(0, ((0, 2), (0, 2)), ((0, 2), (0, 2))),)), [(2, 2)], (2, 2), None),
    (CopyOp((Piece(1, ((0, 2), (0, 2)), ((0, 2), (0, 2))),)), [(2, 2)], (2, 2),
     "reads operand 1"),
    (CopyOp((Piece(0, ((0, 3), (0, 2)), ((0, 3), (0, 2))),)), [(2, 2)], (3, 2),
     "does not lie in a block of shape [2, 2]"),
    (CopyOp((Piece(0, ((0, 2), (0, 2)), ((0, 1), (0, 2))),)), [(2, 2)], (2, 2),
     "copies 4 elements into 2"),
    (CopyOp((), view=(5,)), [], (2, 2), "another number of elements"),
])
def test_op_misfit(op, reads, write, problem):
    ids = DType.i64 if isinstance(op, GatherOp) else DType.f32  # a gather's ids: integers
    got = op_misfit(op, [_t(s, k, ids if k == 1 else DType.f32) for k, s in enumerate(reads)],
                    _t(write, 9))
    assert (got is None) if problem is None else (problem in got), got


def test_a_misfit_op_is_refused_by_validate(plan):
    n = next(n for n in _applies(plan) if len(n.reads) == 2)
    bad = _with_node(plan, n.id, dataclasses.replace(n, reads=n.reads[:1]))
    with pytest.raises(PlanError, match="reads 1 blocks; its spec has 2 operands"):
        validate(dataclasses.replace(bad, graph=None))


# ---------------------------------------------------------------- one load path
def _overlapping_v1_file(plan, tmp_path):
    """The plan as version 1, with one apply's write moved onto another live block's bytes."""
    data = _as_version_1(plan)
    applies = [n for n in data["nodes"] if n["kind"] == "apply" and n["reads"]]
    victim = applies[len(applies) // 2]
    victim["write"]["offset"] = victim["reads"][0]["offset"]
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(data))
    return path


def test_every_runtime_validates_a_plan_it_did_not_make(plan, tmp_path):
    mg = MemGraph.load(_overlapping_v1_file(plan, tmp_path))
    with pytest.raises(PlanError):
        run(mg, INPUTS, WEIGHTS.__getitem__)
    with pytest.raises(PlanError):
        run_streams(mg, INPUTS, WEIGHTS.__getitem__, "threads")
    run(mg, INPUTS, WEIGHTS.__getitem__, check=False)  # a harness may run it unchecked


def test_a_compiled_plan_is_not_validated_again(plan, monkeypatch):
    import einpage.ir.validator as validator
    monkeypatch.setattr(validator, "validate", lambda mg: pytest.fail("validated again"))
    run(plan, INPUTS, WEIGHTS.__getitem__)


# ---------------------------------------------------------------- one vocabulary
def test_an_expression_a_plan_cannot_carry_is_refused_where_it_is_written():
    g = GraphBuilder()
    x = g.input("x", (4,))
    with pytest.raises(SpecError, match="unknown name 'tanh'"):
        g.einsum("i->i", x, join=sympy.tanh(scalar.x(0)))
    with pytest.raises(SpecError, match="unknown name 'erf'"):
        g.fill((4,), sympy.erf(scalar.index(0)))


@pytest.mark.parametrize("name", sorted(scalar.FUNCTIONS))
def test_every_function_of_the_vocabulary_runs_on_both_kernels(name):
    from einpage.runtime.backends import cuda_source
    x0 = scalar.x(0)
    head = scalar.FUNCTIONS[name]
    expr = {"Piecewise": sympy.Piecewise((x0, x0 > 0), (0, True)),
            "Eq": sympy.Piecewise((1, sympy.Eq(x0, 1)), (0, True)),
            "Ne": sympy.Piecewise((1, sympy.Ne(x0, 1)), (0, True)),
            "And": sympy.Piecewise((1, sympy.And(x0 > 0, x0 < 2)), (0, True)),
            "Or": sympy.Piecewise((1, sympy.Or(x0 < 0, x0 > 2)), (0, True)),
            "Not": sympy.Piecewise((1, sympy.Not(x0 > 0)), (0, True)),
            "Max": sympy.Max(x0, 1), "Min": sympy.Min(x0, 1)}.get(name) or head(x0)
    assert scalar.portable(expr) is None
    assert np.isfinite(scalar.join_function(expr, 1)(np.array([1.5]))).all()
    assert cuda_source.c_expression(expr, "float")


# ---------------------------------------------------------------- found in review
def test_a_tensor_with_another_role_or_name_is_refused(plan):
    """Runtimes act on a tensor's role (preloading inputs, the KV store): it must be its
    block's, or a plan could preload an activation once and reuse its bytes."""
    k = next(t.id for t in plan.tensors if t.name.startswith("x"))
    for change in ({"role": "weight"}, {"name": "w1[0,0]"}):
        tensors = list(plan.tensors)
        tensors[k] = dataclasses.replace(tensors[k], **change)
        with pytest.raises(PlanError, match="but its block"):
            prove(dataclasses.replace(plan, tensors=tuple(tensors)))


def test_inputs_and_results_are_the_graphs(plan):
    r0 = plan.results[0]
    with pytest.raises(PlanError, match="inputs or results are not its graph's"):
        prove(dataclasses.replace(plan, results=(dataclasses.replace(r0, dtype=DType.i64),)))


def test_only_graph_inputs_enter_by_an_input_node(plan):
    t = next(n.write.tensor for n in _applies(plan))
    from einpage.ir.memgraph import InputNode
    bad = dataclasses.replace(plan, nodes=(InputNode(0, t, "host"),) + plan.nodes[1:])
    with pytest.raises(PlanError, match="computed by the graph, not one of its inputs"):
        prove(bad)


def test_a_plan_of_lists_is_refused(plan):
    """A validated plan must not change under its report: its sequences are tuples."""
    with pytest.raises(PlanError, match="nodes is a list, expected a tuple"):
        validate(dataclasses.replace(plan, nodes=list(plan.nodes)))


@pytest.mark.parametrize("edit", [
    lambda d: d.__setitem__("tensors", 5),
    lambda d: d.__setitem__("nodes", None),
    lambda d: d["tensors"][0].__setitem__("block", 0.5),
    lambda d: next(n for n in d["nodes"] if n["kind"] == "apply").__setitem__("task", 1e400),
    lambda d: d["graph"]["blocks"][0].__setitem__(3, "f99"),
    lambda d: d["graph"]["ops"][0].__setitem__("spec", "ab->c"),
    lambda d: d["graph"]["ops"][0].__setitem__("join", "x0 +* ("),
    lambda d: d["graph"]["tasks"][0].__setitem__(5, 0.9),
    lambda d: d["graph"].__setitem__("blocks", 5),
], ids=["tensors", "nodes", "block-float", "task-inf", "dtype", "spec", "join", "op-float",
        "blocks"])
def test_malformed_version_2_is_one_plan_error(plan, edit):
    from einpage.ir.provenance import graph_hash
    data = json.loads(json.dumps(plan.to_json()))
    edit(data)
    if isinstance(data.get("graph"), dict):  # hashed anew: the reader must still refuse it
        data["graph"]["hash"] = graph_hash(data["graph"], data["inputs"], data["results"])
    with pytest.raises(PlanError):
        MemGraph.from_json(data)


def test_tiling_of_results():
    from einpage.ir.translation import _tiling_misfit
    assert _tiling_misfit([((0, 0), (2, 4)), ((2, 0), (2, 4))], (4, 4)) is None
    assert "twice" in _tiling_misfit([((0, 0), (2, 4)), ((0, 0), (2, 4))], (2, 4))
    assert "cells" in _tiling_misfit([((0, 0), (2, 4))], (4, 4))
    assert "include" in _tiling_misfit([((0, 0), (2, 4)), ((2, 0), (0, 4))], (2, 4))
    assert _tiling_misfit([((0,), (0,))], (0,)) is None
    assert "spans a cut" in _tiling_misfit([((0, 0), (2, 4)), ((1, 0), (3, 4))], (4, 4))


def test_a_numpy_integer_budget_compiles():
    assert compile_graph(_graph(), CompileOptions(np.int64(16 << 10), block_bytes=2048)
                         ).memgraph.device_bytes == 16 << 10
