"""The dense reference interpreter (`einpage.runtime.evaluate`) against NumPy: inputs and weight
sources, einsum joins and aggregations, fills, gather, reshape, concat and slice values."""
from __future__ import annotations

import numpy as np
import pytest
import sympy

from einpage.errors import GraphError, InputError
from einpage.ir import GraphBuilder, scalar
from einpage.ir.graph import Role
from einpage.runtime import evaluate

RNG = np.random.default_rng(0)


def rand(*shape):
    return RNG.standard_normal(shape)


def run(g: GraphBuilder, **inputs) -> dict[str, np.ndarray]:
    """Build, then evaluate in float64 (so comparisons are exact up to summation order)."""
    return evaluate(g.build(), inputs, float64=True)


def one_output(spec, *arrays, **kw):
    """Evaluate a single einsum of f64 inputs; returns the output array."""
    g = GraphBuilder()
    ts = [g.input(f"a{k}", a.shape, "f64") for k, a in enumerate(arrays)]
    g.output("y", g.einsum(spec, *ts, **kw))
    return run(g, **{f"a{k}": a for k, a in enumerate(arrays)})["y"]


# ------------------------------------------------------------------ node kinds


def test_input_and_output_pass_values_through():
    x = rand(2, 3)
    g = GraphBuilder()
    g.output("y", g.input("x", (2, 3), "f64"))
    out = run(g, x=x)
    assert list(out) == ["y"]
    np.testing.assert_array_equal(out["y"], x)


def test_weight_input_comes_from_the_weight_source():
    w = rand(3, 2)
    g = GraphBuilder()
    g.output("y", g.input("w", (3, 2), "f64", role="weight"))
    graph = g.build()
    assert graph.input("w").op.role is Role.weight
    out = evaluate(graph, {}, weights=lambda name: w if name == "w" else None)
    np.testing.assert_array_equal(out["y"], w)
    with pytest.raises(InputError, match="no weights given for weight input 'w'"):
        evaluate(graph, {})


def test_missing_and_misshaped_activation_inputs():
    g = GraphBuilder()
    g.output("y", g.input("x", (2, 3)))
    graph = g.build()
    with pytest.raises(InputError, match=r"missing input 'x' \(activation, shape \(2, 3\)\)"):
        evaluate(graph, {})
    with pytest.raises(InputError, match=r"input 'x': expected shape \(2, 3\), got \(3, 2\)"):
        evaluate(graph, {"x": np.zeros((3, 2))})


@pytest.mark.parametrize("spec, shapes", [
    ("ab,bc->ac", [(2, 3), (3, 4)]),                  # matmul
    ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]),         # batched matmul
    ("ab,b->ab", [(3, 4), (4,)]),                     # broadcasting product
    ("abc->ca", [(2, 3, 4)]),                         # sum + transpose
    ("a,b->ab", [(3,), (4,)]),                        # outer product
    ("ab,ab->", [(3, 4), (3, 4)]),                    # full contraction to a scalar
])
def test_einsum_default_join_is_the_product_summed(spec, shapes):
    arrays = [rand(*s) for s in shapes]
    np.testing.assert_allclose(one_output(spec, *arrays), np.einsum(spec, *arrays), rtol=1e-12)


def test_einsum_scaled_product_join():
    a, b = rand(2, 3), rand(3, 4)
    got = one_output("ab,bc->ac", a, b, join=lambda x, y: 0.25 * x * y)
    np.testing.assert_allclose(got, 0.25 * a @ b, rtol=1e-12)


def test_einsum_custom_join_elementwise_broadcast():
    a, b = rand(3, 4), rand(4)
    got = one_output("ab,b->ab", a, b, join=lambda x, y: x + y)
    np.testing.assert_allclose(got, a + b[None, :], rtol=1e-12)
    got = one_output("ab->ba", a, join=scalar.silu)
    np.testing.assert_allclose(got, (a / (1 + np.exp(-a))).T, rtol=1e-12)


@pytest.mark.parametrize("agg, reduce", [("sum", np.sum), ("max", np.max), ("min", np.min)])
def test_einsum_aggregations(agg, reduce):
    a, b = rand(3, 4), rand(4, 5)
    # custom join, contracted b: out[a, c] = agg_b (a[a,b] - b[b,c])^2
    got = one_output("ab,bc->ac", a, b, join=lambda x, y: (x - y) ** 2, agg=agg)
    want = reduce((a[:, :, None] - b[None, :, :]) ** 2, axis=1)
    np.testing.assert_allclose(got, want, rtol=1e-12)
    # product join with a non-sum aggregation: tropical matmul, not BLAS
    got = one_output("ab,bc->ac", a, b, agg=agg)
    np.testing.assert_allclose(got, reduce(a[:, :, None] * b[None, :, :], axis=1), rtol=1e-12)
    # a plain reduction over two axes
    c = rand(3, 2, 2)
    got = one_output("abc->b", c, join=lambda x: x, agg=agg)
    np.testing.assert_allclose(got, reduce(c, axis=(0, 2)), rtol=1e-12)


def test_fill_of_index_expression():
    g = GraphBuilder()
    g.output("f", g.fill((3, 4), lambda i, j: 10 * i + j, dtype="f64"))
    g.output("c", g.fill((2,), 1.5, dtype="f64"))
    g.output("v", g.fill((5,), lambda i: i * i, dtype="f64"))
    out = run(g)
    np.testing.assert_array_equal(out["f"], 10 * np.arange(3)[:, None] + np.arange(4)[None, :])
    np.testing.assert_array_equal(out["c"], [1.5, 1.5])
    np.testing.assert_array_equal(out["v"], np.arange(5) ** 2)


def test_fill_causal_mask():
    g = GraphBuilder()
    g.output("m", g.fill((3, 4), lambda s, t: sympy.Piecewise((0, t <= s), (-sympy.oo, True))))
    m = run(g)["m"]
    want = np.where(np.arange(4)[None, :] <= np.arange(3)[:, None], 0.0, -np.inf)
    np.testing.assert_array_equal(m, want)


def test_gather_rows():
    table, ids = rand(5, 3), np.array([[4, 0], [2, 2]])
    g = GraphBuilder()
    t = g.input("t", (5, 3), "f64", role="weight")
    i = g.input("ids", (2, 2), "i64")
    g.output("y", g.gather(t, i))
    out = evaluate(g.build(), {"ids": ids}, weights=lambda name: table)
    np.testing.assert_array_equal(out["y"], table[ids])
    with pytest.raises(InputError, match="index 5 out of range for a table of 5 rows"):
        evaluate(g.build(), {"ids": ids + 1}, weights=lambda name: table)


def test_reshape_split_and_merge():
    x = rand(2, 6)
    g = GraphBuilder()
    a = g.input("x", (2, 6), "f64")
    split = g.reshape(a, (2, 2, 3))
    g.output("split", split)
    g.output("merged", g.reshape(split, (4, 3)))
    out = run(g, x=x)
    np.testing.assert_array_equal(out["split"], x.reshape(2, 2, 3))
    np.testing.assert_array_equal(out["merged"], x.reshape(4, 3))


def test_concat_and_slice():
    a, b = rand(2, 3), rand(2, 1)
    g = GraphBuilder()
    ta, tb = g.input("a", (2, 3), "f64"), g.input("b", (2, 1), "f64")
    c = g.concat([ta, tb, ta], axis=1)
    assert c.shape == (2, 7)
    g.output("c", c)
    g.output("s", g.slice(c, 1, 2, 5))
    g.output("rows", g.slice(c, 0, 1, 2))
    out = run(g, a=a, b=b)
    full = np.concatenate([a, b, a], axis=1)
    np.testing.assert_array_equal(out["c"], full)
    np.testing.assert_array_equal(out["s"], full[:, 2:5])
    np.testing.assert_array_equal(out["rows"], full[1:2])
    g.output("empty", g.slice(c, 1, 3, 3))  # a result of size 0 is refused, by name
    with pytest.raises(GraphError, match="size 0"):
        g.build()
