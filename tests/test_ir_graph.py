"""The logical graph: every node kind built with `GraphBuilder`; every typed error; `verify()` on
corrupted graphs; the printer; `bind`; the pairwise split; dtypes. The dense reference's values
are tested in `test_reference.py`."""
from __future__ import annotations

from dataclasses import replace

import ml_dtypes
import numpy as np
import pytest
import sympy

from einpage.errors import GraphError, ShapeError, SpecError
from einpage.ir import GraphBuilder, scalar
from einpage.ir.dtypes import DType
from einpage.ir.graph import Einsum, Fill, Graph, Input, Output, Role
from einpage.ir.spec import EinsumSpec
from einpage.runtime import evaluate

RNG = np.random.default_rng(0)


def rand(*shape):
    return RNG.standard_normal(shape)


def run(g: GraphBuilder, **inputs) -> dict[str, np.ndarray]:
    """Build, then evaluate in float64 (so comparisons are exact up to summation order)."""
    return evaluate(g.build(), inputs, float64=True)


# ------------------------------------------------------------------ builder


def test_einsum_agg_defaults_to_sum_when_contracting():
    g = GraphBuilder()
    x = g.input("x", (2, 3), "f64")
    y = g.einsum("ab->a", x)
    assert y.node.op.agg == "sum"
    assert g.einsum("ab->ba", x).node.op.agg is None


# ------------------------------------------------------------------ typed errors


@pytest.mark.parametrize("spec, message", [
    ("ab,bc", "expected exactly one '->'"),
    ("a->b->c", "expected exactly one '->'"),
    ("->a", "output index 'a' is in no operand"),
    ("aab->b", "operand 0 'aab' repeats an index"),
    ("ab->aa", "output 'aa' repeats an index"),
    ("a1,b->ab", "operand 0 'a1' has non-letter '1'"),
    ("ab,b.->a", "operand 1 'b.' has non-letter '.'"),
    ("ab->abc", "output index 'c' is in no operand"),
])
def test_malformed_specs(spec, message):
    with pytest.raises(SpecError, match=f"einsum spec '{spec}': " + _re(message)):
        EinsumSpec.parse(spec)
    g = GraphBuilder()
    x = g.input("x", (2, 2))
    with pytest.raises(SpecError, match=_re(message)):
        g.einsum(spec, x, x)


def _re(text):
    import re
    return re.escape(text)


def test_operand_count_mismatch():
    g = GraphBuilder()
    x = g.input("x", (2, 3))
    with pytest.raises(SpecError, match=r"einsum ab,bc->ac: 2 operand\(s\) in the spec, 1 given"):
        g.einsum("ab,bc->ac", x)
    with pytest.raises(SpecError, match=r"1 operand\(s\) in the spec, 0 given"):
        g.einsum("ab->ab")
    with pytest.raises(SpecError, match=r"3 operand\(s\) in the spec, 2 given"):
        g.einsum("ab,bc,cd->ad", x, x)


def test_index_size_mismatch_names_operands_and_sizes():
    g = GraphBuilder()
    x, y = g.input("x", (2, 3)), g.input("y", (4, 5))
    with pytest.raises(SpecError) as err:
        g.einsum("ab,bc->ac", x, y)
    assert str(err.value) == "einsum ab,bc->ac: index 'b' is 3 in operand 0 but 4 in operand 1"
    with pytest.raises(SpecError, match=r"operand 0 'abc' has rank 3 but shape \(2, 3\)"):
        g.einsum("abc->a", x)
    # the split of a 3-operand product checks sizes too
    with pytest.raises(SpecError, match="index 'c' is 5 in operand 1 but 2 in operand 2"):
        g.einsum("ab,bc,cd->ad", x, g.input("z", (3, 5)), x)


def test_aggregation_extra_unknown_and_bad_join():
    g = GraphBuilder()
    x = g.input("x", (2, 3))
    with pytest.raises(SpecError, match="'sum' given but nothing is contracted"):
        g.einsum("ab->ba", x, agg="sum")
    with pytest.raises(SpecError, match="unknown aggregation 'mean'; valid: sum, max, min"):
        g.einsum("ab->a", x, agg="mean")
    with pytest.raises(SpecError, match=r"join x0 \+ x2 mentions x2 but the einsum has 2"):
        g.einsum("ab,ab->ab", x, x, join=scalar.x(0) + scalar.x(2))
    with pytest.raises(SpecError, match="join must be a SymPy expression or a callable"):
        g.einsum("ab->ab", x, join="x0 + 1")


def test_missing_aggregation_is_rejected_by_verify():
    g = GraphBuilder()
    x = g.input("x", (2, 3))
    g.output("y", g.einsum("ab->a", x))
    nodes = list(g.build().nodes)
    nodes[1] = replace(nodes[1], op=replace(nodes[1].op, agg=None))
    with pytest.raises(SpecError, match=r"node %1 \(einsum\): einsum ab->a: aggregation required: "
                                        r"index\(es\) 'b' are contracted"):
        Graph(tuple(nodes)).verify()


def test_shape_errors():
    g = GraphBuilder()
    x, y = g.input("x", (2, 3)), g.input("y", (3, 3))
    with pytest.raises(ShapeError, match=r"node %2 \(reshape\): reshape \(2, 3\) -> \(4, 2\) "
                                         r"changes the element count \(6 vs 8\)"):
        g.reshape(x, (4, 2))
    with pytest.raises(ShapeError, match=r"node %2 \(concat\): concat operand 1 has shape "
                                         r"\(3, 3\), operand 0 has \(2, 3\) \(they may differ "
                                         r"only on axis 1\)"):
        g.concat([x, y], axis=1)
    with pytest.raises(ShapeError, match="concat axis 2 out of range for rank 2"):
        g.concat([x, x], axis=2)
    with pytest.raises(ShapeError, match=r"node %2 \(slice\): slice \[1:4\] outside axis 1 of "
                                         "size 3"):
        g.slice(x, 1, 1, 4)
    with pytest.raises(ShapeError, match=r"slice \[2:1\] outside axis 0 of size 2"):
        g.slice(x, 0, 2, 1)
    with pytest.raises(ShapeError, match=r"slice axis 2 out of range for \(2, 3\)"):
        g.slice(x, 2, 0, 1)
    np.testing.assert_equal(g.concat([x, y], axis=0).shape, (5, 3))  # the builder still works


def test_graph_errors():
    g = GraphBuilder()
    x = g.input("x", (2, 3))
    with pytest.raises(GraphError, match="input 'x' defined twice"):
        g.input("x", (2, 3))
    with pytest.raises(GraphError, match="size -1 is not a non-negative int"):
        g.input("z", (-1, 3))
    with pytest.raises(GraphError, match=r"node %1 \(gather\): gather ids %0 must be i64, not f32"):
        g.gather(x, x)
    with pytest.raises(GraphError, match="concat of nothing"):
        g.concat([], axis=0)
    h = g.input("h", (2, 3), "f16")
    with pytest.raises(GraphError, match=r"node %2 \(concat\): operand %1 is f16, the node f32"):
        g.concat([x, h], axis=0)
    other = GraphBuilder().input("x", (2, 3))
    with pytest.raises(GraphError, match="is not a tensor of this graph"):
        g.einsum("ab->ab", other)
    g.output("y", x)
    g.output("y", h)  # caught when the whole graph is verified
    with pytest.raises(GraphError, match=r"node %3 \(output\): duplicate output name 'y'"):
        g.build()


def _symbolic_graph() -> Graph:
    g = GraphBuilder()
    x = g.input("x", ("B", "S", 4))
    c = g.input("c", ("B", "P", 4))
    k = g.concat([c, x], axis=1)
    g.output("k", k)
    g.output("last", g.slice(k, 1, scalar.size_symbol("P"), scalar.size_symbol("P") + 1))
    return g.build()


def test_bind_substitutes_every_size():
    graph = _symbolic_graph()
    assert {s.name for s in graph.symbols} == {"B", "S", "P"} and not graph.is_concrete
    bound = graph.bind(B=2, S=3, P=5)
    assert bound.is_concrete
    assert [n.shape for n in bound.nodes] == [(2, 3, 4), (2, 5, 4), (2, 8, 4), (2, 8, 4),
                                              (2, 1, 4), (2, 1, 4)]
    assert all(type(s) is int for n in bound.nodes for s in n.shape)
    assert (bound.nodes[4].op.start, bound.nodes[4].op.stop) == (5, 6)
    x, c = rand(2, 3, 4), rand(2, 5, 4)
    out = evaluate(bound, {"x": x, "c": c}, float64=True)
    np.testing.assert_array_equal(out["last"], x[:, :1])
    with pytest.raises(GraphError, match="bind the graph's size symbols first: B, P, S"):
        evaluate(graph, {"x": x, "c": c})


@pytest.mark.parametrize("sizes, message", [
    (dict(B=1, S=2, P=3, Q=4), "bind: graph has no size symbol 'Q' (it has B, P, S)"),
    (dict(B=1, S=2), "bind: no size given for symbol(s) P"),
    (dict(B=1, S=-2, P=0), "bind: size S=-2 is not a non-negative integer"),
    (dict(B=True, S=2, P=0), "bind: size B=True is not a non-negative integer"),
    (dict(B=1.0, S=2, P=0), "bind: size B=1.0 is not a non-negative integer"),
])
def test_bad_bind(sizes, message):
    with pytest.raises(GraphError, match=_re(message)):
        _symbolic_graph().bind(**sizes)


def test_bind_fill_with_size_symbols():
    g = GraphBuilder()
    P = scalar.size_symbol("P")
    g.output("m", g.fill((2, P + 2), lambda s, t: sympy.Piecewise((0, t <= s + P),
                                                                  (-sympy.oo, True))))
    bound = g.build().bind(P=1)
    assert bound.nodes[0].shape == (2, 3)
    want = np.where(np.arange(3)[None, :] <= np.arange(2)[:, None] + 1, 0.0, -np.inf)
    np.testing.assert_array_equal(evaluate(bound)["m"], want)


# ------------------------------------------------------------------ verify on corrupted graphs


def _valid_graph() -> Graph:
    g = GraphBuilder()
    x = g.input("x", (2, 3))                                     # %0
    w = g.input("w", (3, 4), role="weight")                      # %1
    ids = g.input("ids", (2,), "i64")                            # %2
    y = g.einsum("ab,bc->ac", x, w)                              # %3
    e = g.gather(w, ids)                                         # %4
    r = g.reshape(y, (4, 2))                                     # %5
    f = g.fill((2, 4), lambda i, j: i + j)                       # %6
    c = g.concat([y, f], axis=0)                                 # %7
    s = g.slice(c, 0, 1, 3)                                      # %8
    g.output("s", s)                                             # %9
    g.output("e", e)                                             # %10
    g.output("r", r)                                             # %11
    return g.build()


def _corrupt(k, **changes):
    nodes = list(_valid_graph().nodes)
    if "op" in changes and isinstance(changes["op"], dict):
        changes["op"] = replace(nodes[k].op, **changes["op"])
    nodes[k] = replace(nodes[k], **changes)
    return Graph(tuple(nodes))


@pytest.mark.parametrize("k, changes, error, message", [
    (3, dict(id=7), GraphError, "node at position 3 has id 7"),
    (3, dict(inputs=(0, 5)), GraphError, r"node %3 \(einsum\): input %5 is not an earlier node"),
    (3, dict(inputs=(0, 3)), GraphError, r"node %3 \(einsum\): input %3 is not an earlier node"),
    (3, dict(shape=(2, 5)), ShapeError,
     r"node %3 \(einsum\): einsum ab,bc->ac gives shape \(2, 4\), node says \(2, 5\)"),
    (3, dict(inputs=(0, 0)), SpecError,
     r"node %3 \(einsum\): einsum ab,bc->ac: index 'b' is 3 in operand 0 but 2 in operand 1"),
    (3, dict(inputs=(0,)), SpecError, r"node %3 \(einsum\): einsum ab,bc->ac: 2 operands in the "
                                      r"spec, 1 given"),
    (3, dict(op=dict(agg="mean")), SpecError, r"node %3 \(einsum\): unknown aggregation 'mean'"),
    (3, dict(op=dict(join=scalar.x(0) * scalar.x(3))), SpecError,
     r"node %3 \(einsum\): join x0\*x3 mentions x3 but the einsum has 2 operand\(s\)"),
    (1, dict(op=Input("x", Role.weight)), GraphError,
     r"node %1 \(input\): duplicate input name 'x'"),
    (0, dict(inputs=(1,)), GraphError, r"node %0 \(input\): input %1 is not an earlier node"),
    (6, dict(op=Fill(scalar.index(2))), GraphError,
     r"node %6 \(fill\): fill uses i2 but has rank 2"),
    (6, dict(inputs=(0,)), GraphError, r"node %6 \(fill\): expected 0 input\(s\), got 1"),
    (4, dict(inputs=(1, 0)), GraphError, r"node %4 \(gather\): gather ids %0 must be i64, not f32"),
    (4, dict(shape=(2, 3)), ShapeError, r"node %4 \(gather\): gather of table \(3, 4\) by ids "
                                        r"\(2,\) gives \(2, 4\), node says \(2, 3\)"),
    (4, dict(dtype=DType.f16), GraphError, r"node %4 \(gather\): operand %1 is f32, the node f16"),
    (5, dict(shape=(4, 3)), ShapeError, r"node %5 \(reshape\): reshape \(2, 4\) -> \(4, 3\) "
                                        r"changes the element count \(8 vs 12\)"),
    (5, dict(dtype=DType.f16), GraphError, r"node %5 \(reshape\): operand %3 is f32, the node f16"),
    (7, dict(shape=(5, 4)), ShapeError, r"node %7 \(concat\): concat gives \(4, 4\), node says "
                                        r"\(5, 4\)"),
    (7, dict(inputs=()), GraphError, r"node %7 \(concat\): concat of nothing"),
    (8, dict(op=dict(stop=5), shape=(4, 4)), ShapeError,
     r"node %8 \(slice\): slice \[1:5\] outside axis 0 of size 4"),
    (8, dict(shape=(3, 4)), ShapeError, r"node %8 \(slice\): slice gives \(2, 4\), node says "
                                        r"\(3, 4\)"),
    (9, dict(shape=(3, 4)), GraphError,
     r"node %9 \(output\): output differs from its input in shape or dtype"),
    (9, dict(dtype=DType.f16), GraphError,
     r"node %9 \(output\): output differs from its input in shape or dtype"),
    (10, dict(op=Output("s")), GraphError, r"node %10 \(output\): duplicate output name 's'"),
    (10, dict(inputs=(4, 5)), GraphError, r"node %10 \(output\): expected 1 input\(s\), got 2"),
])
def test_verify_rejects_corrupted_graph(k, changes, error, message):
    _valid_graph().verify()  # the uncorrupted graph is fine
    with pytest.raises(error, match=message):
        _corrupt(k, **changes).verify()


def test_corrupted_graph_fails_bind_too():
    nodes = list(_symbolic_graph().nodes)
    nodes[2] = replace(nodes[2], shape=(scalar.size_symbol("B"), scalar.size_symbol("S"), 4))
    with pytest.raises(ShapeError, match=r"node %2 \(concat\)"):
        Graph(tuple(nodes)).bind(B=1, S=2, P=3)


# ------------------------------------------------------------------ printer


def test_printer_golden():
    g = GraphBuilder()
    x = g.input("x", ("B", 4), "f16")
    w = g.input("w", (3, 4), "f16", role="weight")
    ids = g.input("ids", ("B",), "i64")
    y = g.einsum("bm,nm->bn", x, w)
    z = g.einsum("bn->bn", y, join=scalar.silu, dtype="f32")
    m = g.einsum("bn->b", z, join=lambda a: a, agg="max")
    f = g.fill(("B", 3), lambda i, j: sympy.Piecewise((0, j <= i), (-sympy.oo, True)))
    e = g.gather(w, ids)
    r = g.reshape(e, ("B", 2, 2))
    c = g.concat([z, f], axis=1)
    s = g.slice(c, 1, 1, "B")
    g.output("m", m)
    g.output("s", s)
    g.output("r", r)
    graph = g.build()
    assert str(graph) == """\
%0 = input[activation] 'x' f16[B,4]
%1 = input[weight] 'w' f16[3,4]
%2 = input[activation] 'ids' i64[B]
%3 = einsum[bm,nm->bn, agg=sum](%0, %1) f16[B,3]
%4 = einsum[bn->bn, join=x0/(1 + exp(-x0))](%3) f32[B,3]
%5 = einsum[bn->b, agg=max](%4) f32[B]
%6 = fill[Piecewise((0, i0 >= i1), (-oo, True))] f32[B,3]
%7 = gather(%1, %2) f16[B,4]
%8 = reshape(%7) f16[B,2,2]
%9 = concat[axis=1](%4, %6) f32[B,6]
%10 = slice[axis=1, 1:B](%9) f32[B,B - 1]
%11 = output 'm'(%5) f32[B]
%12 = output 's'(%10) f32[B,B - 1]
%13 = output 'r'(%8) f16[B,2,2]"""
    assert str(graph.bind(B=5)).splitlines()[10] == "%10 = slice[axis=1, 1:5](%9) f32[5,4]"


def test_users_are_derived_from_inputs():
    graph = _valid_graph()
    assert graph.users(1) == (3, 4)
    assert graph.users(3) == (5, 7)
    assert graph.users(11) == ()
    assert [n.op.name for n in graph.outputs] == ["s", "e", "r"]
    assert [n.op.name for n in graph.inputs] == ["x", "w", "ids"]
    with pytest.raises(GraphError, match="graph has no input named 'nope'"):
        graph.input("nope")


# ------------------------------------------------------------------ pairwise split


@pytest.mark.parametrize("spec, shapes", [
    ("ab,bc,cd->ad", [(2, 3), (3, 4), (4, 5)]),
    ("ab,bc,cd->da", [(2, 3), (3, 4), (4, 5)]),
    ("ab,bc,cd,de->ae", [(2, 3), (3, 4), (4, 5), (5, 2)]),
    ("ab,bc,ca->", [(2, 3), (3, 4), (4, 2)]),
    ("a,b,c->abc", [(2,), (3,), (4,)]),
    ("abc,cd,bd,e->ae", [(2, 3, 4), (4, 2), (3, 2), (3,)]),
])
def test_product_of_three_or_more_operands_is_split_pairwise(spec, shapes):
    arrays = [rand(*s) for s in shapes]
    g = GraphBuilder()
    ts = [g.input(f"a{k}", s, "f64") for k, s in enumerate(shapes)]
    g.output("y", g.einsum(spec, *ts))
    graph = g.build()
    einsums = [n for n in graph.nodes if isinstance(n.op, Einsum)]
    assert len(einsums) >= len(shapes) - 1
    assert all(len(n.inputs) <= 2 for n in einsums), str(graph)
    got = evaluate(graph, {f"a{k}": a for k, a in enumerate(arrays)}, float64=True)["y"]
    np.testing.assert_allclose(got, np.einsum(spec, *arrays), rtol=1e-10, atol=1e-12)


def test_pairwise_split_with_symbolic_sizes_and_dtype():
    g = GraphBuilder()
    a, b, c = g.input("a", ("B", 3), "f16"), g.input("b", (3, "S")), g.input("c", ("S", 2))
    y = g.einsum("ab,bc,cd->ad", a, b, c, dtype="f32")
    g.output("y", y)
    graph = g.build()
    assert y.shape == (scalar.size_symbol("B"), 2) and y.dtype is DType.f32
    assert all(len(n.inputs) <= 2 and n.dtype is DType.f32
               for n in graph.nodes if isinstance(n.op, Einsum))
    arrays = [rand(4, 3).astype(np.float16), rand(3, 5), rand(5, 2)]
    got = evaluate(graph.bind(B=4, S=5), dict(zip("abc", arrays)), float64=True)["y"]
    np.testing.assert_allclose(got, np.einsum("ab,bc,cd->ad", *arrays), rtol=1e-10)


def test_non_product_join_of_three_operands_stays_one_node():
    arrays = [rand(2, 3), rand(3), rand(2)]
    g = GraphBuilder()
    ts = [g.input(f"a{k}", a.shape, "f64") for k, a in enumerate(arrays)]
    y = g.einsum("ab,b,a->a", *ts, join=lambda p, q, r: p * q + r, agg="max")
    assert len(y.node.inputs) == 3
    g.output("y", y)
    got = run(g, **{f"a{k}": a for k, a in enumerate(arrays)})["y"]
    want = np.max(arrays[0] * arrays[1][None, :] + arrays[2][:, None], axis=1)
    np.testing.assert_allclose(got, want, rtol=1e-12)


# ------------------------------------------------------------------ dtypes


def test_storage_dtypes():
    g = GraphBuilder()
    for name, dt in (("h", "f16"), ("b", "bf16"), ("s", "f32"), ("i", "i64")):
        g.output(name + "_out", g.einsum("a->a", g.input(name, (3,), dt)) if dt != "i64"
                 else g.input(name, (3,), dt))
    graph = g.build()
    x = np.array([1.0, 1 / 3, -2.5])
    inputs = {"h": x, "b": x, "s": x, "i": np.array([1, 2, 3])}
    out = evaluate(graph, inputs)
    assert out["h_out"].dtype == np.float16
    assert out["b_out"].dtype == np.dtype(ml_dtypes.bfloat16)
    assert out["s_out"].dtype == np.float32
    assert out["i_out"].dtype == np.int64
    np.testing.assert_array_equal(out["h_out"], x.astype(np.float16))
    np.testing.assert_array_equal(out["b_out"].astype(np.float64),
                                  x.astype(ml_dtypes.bfloat16).astype(np.float64))
    wide = evaluate(graph, inputs, float64=True)
    assert {k: v.dtype for k, v in wide.items()} == {"h_out": np.float64, "b_out": np.float64,
                                                     "s_out": np.float64, "i_out": np.int64}
    np.testing.assert_array_equal(wide["s_out"], x)  # no rounding to the node's dtype


def test_einsum_to_f32_on_f16_inputs_computes_in_f32():
    a = np.array([[1000.0, 0.1], [3.0, -7.0]], dtype=np.float16)
    b = np.array([[0.1, 2.0], [1000.0, 0.5]], dtype=np.float16)
    g = GraphBuilder()
    ta, tb = g.input("a", (2, 2), "f16"), g.input("b", (2, 2), "f16")
    g.output("wide", g.einsum("ab,bc->ac", ta, tb, dtype="f32"))
    g.output("narrow", g.einsum("ab,bc->ac", ta, tb))
    out = evaluate(g.build(), {"a": a, "b": b})
    assert out["wide"].dtype == np.float32 and out["narrow"].dtype == np.float16
    exact = a.astype(np.float32) @ b.astype(np.float32)
    np.testing.assert_array_equal(out["wide"], exact)
    np.testing.assert_array_equal(out["narrow"], exact.astype(np.float16))


def test_dtype_names():
    from einpage.ir.dtypes import as_dtype, from_numpy
    assert as_dtype("bfloat16") is DType.bf16 and as_dtype("half") is DType.f16
    assert from_numpy(np.dtype(ml_dtypes.bfloat16)) is DType.bf16
    assert [d.itemsize for d in DType] == [2, 2, 4, 8, 8]
    with pytest.raises(SpecError, match="unknown dtype 'f8'; valid: f16, bf16, f32, f64, i64"):
        as_dtype("f8")
    with pytest.raises(SpecError, match="unknown dtype"):
        GraphBuilder().input("x", (2,), "int8")
