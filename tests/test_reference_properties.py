"""Property tests of the dense reference: random einsums, joins, graphs and bindings against plain
NumPy computations written here."""
from __future__ import annotations

import numpy as np
import pytest
import sympy
from hypothesis import given
from hypothesis import strategies as st

from einpage.ir import GraphBuilder, scalar
from einpage.ir.graph import Einsum
from einpage.runtime import evaluate

LETTERS = "abcdefgh"
seeds = st.integers(0, 2**32 - 1)


def arrays_for(terms, sizes, seed):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(tuple(sizes[c] for c in term)) for term in terms]


@st.composite
def subset_permutation(draw, used, min_size=0):
    """At least `min_size` of `used`, in any order."""
    order = draw(st.permutations(used))
    return "".join(order[: draw(st.integers(min_size, len(used)))])


@st.composite
def einsum_cases(draw, max_operands=3):
    alphabet = draw(st.lists(st.sampled_from(LETTERS), min_size=1, max_size=6, unique=True))
    sizes = {c: draw(st.integers(1, 4)) for c in alphabet}
    n = draw(st.integers(1, max_operands))
    terms = ["".join(draw(st.lists(st.sampled_from(alphabet), max_size=3, unique=True)))
             for _ in range(n)]
    if n == 1 and not terms[0]:
        terms[0] = alphabet[0]  # "->" with one scalar operand is indistinguishable from no operand
    used = list(dict.fromkeys("".join(terms)))
    out = draw(subset_permutation(used))
    return ",".join(terms) + "->" + out, terms, sizes, draw(seeds)


@given(einsum_cases())
def test_random_einsum_matches_numpy(case):
    spec, terms, sizes, seed = case
    arrays = arrays_for(terms, sizes, seed)
    g = GraphBuilder()
    ts = [g.input(f"a{k}", a.shape, "f64") for k, a in enumerate(arrays)]
    g.output("y", g.einsum(spec, *ts))
    graph = g.build()
    assert all(len(n.inputs) <= 2 for n in graph.nodes if isinstance(n.op, Einsum))
    got = evaluate(graph, {f"a{k}": a for k, a in enumerate(arrays)}, float64=True)["y"]
    want = np.einsum(spec, *arrays)
    assert got.dtype == np.float64 and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


JOINS = {
    "x0+x1": (lambda a, b: a + b, np.add),
    "x0*x1": (lambda a, b: a * b, np.multiply),
    "exp(x0)-x1": (lambda a, b: scalar.exp(a) - b, lambda a, b: np.exp(a) - b),
}
REDUCE = {"sum": np.sum, "max": np.max, "min": np.min}


def broadcast_then_reduce(terms, out, arrays, sizes, numpy_join, agg):
    """The definition: put every operand on the whole index space (output indices, then the
    contracted ones), apply the join elementwise, reduce the contracted axes."""
    space = out + "".join(c for c in dict.fromkeys("".join(terms)) if c not in out)
    ones = np.ones(tuple(sizes[c] for c in space))
    full = [np.einsum(f"{term},{space}->{space}", a, ones) for term, a in zip(terms, arrays)]
    value = numpy_join(*full)
    contracted = tuple(range(len(out), len(space)))
    return REDUCE[agg](value, axis=contracted) if contracted else value


@st.composite
def join_cases(draw):
    """Two operands (the second possibly a scalar), a join, an aggregation and an output."""
    alphabet = draw(st.lists(st.sampled_from(LETTERS), min_size=1, max_size=5, unique=True))
    sizes = {c: draw(st.integers(1, 4)) for c in alphabet}
    terms = ["".join(draw(st.lists(st.sampled_from(alphabet), min_size=lo, max_size=3,
                                   unique=True))) for lo in (1, 0)]
    join_name, agg = draw(st.sampled_from(sorted(JOINS))), draw(st.sampled_from(sorted(REDUCE)))
    out = draw(subset_permutation(list(dict.fromkeys("".join(terms))), 0))
    return terms, out, sizes, join_name, agg, draw(seeds)


@given(join_cases())
def test_random_join_and_aggregation(case):
    terms, out, sizes, join_name, agg, seed = case
    contracted = set("".join(terms)) - set(out)
    arrays = arrays_for(terms, sizes, seed)
    sym_join, numpy_join = JOINS[join_name]
    g = GraphBuilder()
    a, b = g.input("a", arrays[0].shape, "f64"), g.input("b", arrays[1].shape, "f64")
    g.output("y", g.einsum(f"{terms[0]},{terms[1]}->{out}", a, b, join=sym_join,
                           agg=agg if contracted else None))
    got = evaluate(g.build(), {"a": arrays[0], "b": arrays[1]}, float64=True)["y"]
    want = broadcast_then_reduce(terms, out, arrays, sizes, numpy_join, agg)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("spec, shapes, join, agg", [
    ("ab->", [(2, 3)], lambda a: a, "max"),
    ("a,a->", [(3,), (3,)], lambda a, b: a + b, "sum"),
    ("->", [()], scalar.exp, None),
])
def test_elementwise_einsum_to_a_scalar(spec, shapes, join, agg):
    g = GraphBuilder()
    ts = [g.input(f"a{k}", s, "f64") for k, s in enumerate(shapes)]
    g.output("y", g.einsum(spec, *ts, join=join, agg=agg))
    arrays = [np.full(s, 0.5) for s in shapes]
    got = evaluate(g.build(), {f"a{k}": a for k, a in enumerate(arrays)}, float64=True)["y"]
    assert got.shape == ()


@st.composite
def dag_cases(draw):
    """Inputs over letters a-d, then 1-5 einsum steps each reading one or two earlier tensors
    (inputs or results): chains and DAGs with shared operands."""
    sizes = {c: draw(st.integers(1, 4)) for c in "abcd"}
    terms = ["".join(draw(st.lists(st.sampled_from("abcd"), min_size=1, max_size=3, unique=True)))
             for _ in range(draw(st.integers(1, 3)))]
    n_inputs = len(terms)
    steps = []
    for _ in range(draw(st.integers(1, 5))):
        picked = draw(st.lists(st.integers(0, len(terms) - 1), min_size=1, max_size=2))
        used = list(dict.fromkeys("".join(terms[k] for k in picked)))
        out = draw(subset_permutation(used))
        steps.append((picked, out))
        terms.append(out)
    return sizes, terms, n_inputs, steps, draw(seeds)


@given(dag_cases())
def test_random_graph_matches_composed_einsums(case):
    sizes, terms, n_inputs, steps, seed = case
    values = arrays_for(terms[:n_inputs], sizes, seed)
    g = GraphBuilder()
    tensors = [g.input(f"in{k}", v.shape, "f64") for k, v in enumerate(values)]
    for k, (picked, out) in enumerate(steps):
        spec = ",".join(terms[p] for p in picked) + "->" + out
        tensors.append(g.einsum(spec, *[tensors[p] for p in picked]))
        values.append(np.einsum(spec, *[values[p] for p in picked]))
        g.output(f"step{k}", tensors[-1])
    got = evaluate(g.build(), {f"in{k}": v for k, v in enumerate(values[:n_inputs])},
                   float64=True)
    for k in range(len(steps)):
        want = values[n_inputs + k]
        np.testing.assert_allclose(got[f"step{k}"], want, rtol=1e-9,
                                   atol=1e-12 * max(1.0, float(np.abs(want).max(initial=0))))


B, S, P = (scalar.size_symbol(n) for n in "BSP")


def symbolic_attention_graph():
    """A small graph over `B`, `S`, `P` with every shape-changing op: a cache concat, a slice
    at a symbolic offset, a reshape, a causal mask fill and scores over the past."""
    g = GraphBuilder()
    x = g.input("x", (B, S, 4), "f64")
    cache = g.input("cache", (B, P, 4), "f64", role="cache")
    keys = g.concat([cache, x], axis=1)                                     # (B, P+S, 4)
    g.output("new", g.slice(keys, 1, P, P + S))                             # (B, S, 4)
    split = g.reshape(x, (B, S, 2, 2))
    g.output("swapped", g.einsum("bsij->bsji", split))
    mask = g.fill((S, P + S), lambda s, t: sympy.Piecewise((0, t <= s + P), (-sympy.oo, True)),
                  dtype="f64")
    scores = g.einsum("bsd,btd->bst", x, keys)
    g.output("masked", g.einsum("bst,st->bst", scores, mask, join=lambda a, m: a + m))
    return g.build()


@given(st.integers(1, 3), st.integers(1, 4), st.integers(0, 4), seeds)
def test_bind_shapes_equal_symbolic_shapes_substituted(b, s, p, seed):
    graph = symbolic_attention_graph()
    bound = graph.bind(B=b, S=s, P=p)
    table = {B: b, S: s, P: p}
    for sym, node in zip(graph.nodes, bound.nodes):
        want = tuple(int(sympy.sympify(d).xreplace(table)) for d in sym.shape)
        assert node.shape == want, f"%{node.id}: {node.shape} != {want}"
    rng = np.random.default_rng(seed)
    x, cache = rng.standard_normal((b, s, 4)), rng.standard_normal((b, p, 4))
    out = evaluate(bound, {"x": x, "cache": cache}, float64=True)
    keys = np.concatenate([cache, x], axis=1)
    np.testing.assert_array_equal(out["new"], x)
    np.testing.assert_array_equal(out["swapped"], x.reshape(b, s, 2, 2).swapaxes(2, 3))
    causal = np.arange(p + s)[None, :] <= np.arange(s)[:, None] + p
    want = np.where(causal, np.einsum("bsd,btd->bst", x, keys), -np.inf)
    np.testing.assert_allclose(out["masked"], want, rtol=1e-12, atol=1e-15)  # cancellation near 0
