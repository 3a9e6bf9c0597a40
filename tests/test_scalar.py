"""Scalar expressions: joins and fills translated to NumPy, and the text form plan files use."""
from __future__ import annotations

import numpy as np
import pytest
import sympy

from einpage.ir import scalar
from einpage.ir.spec import EinsumSpec
from einpage.runtime import kernels

x0, x1 = scalar.x(0), scalar.x(1)
i0, i1 = scalar.index(0), scalar.index(1)
P = scalar.size_symbol("P")
GRID = np.linspace(-3.0, 3.0, 13)


def join(expr, *args):
    return scalar.join_function(expr, len(args))(*args)


@pytest.mark.parametrize("expr, numpy", [
    (scalar.silu(x0), lambda a: a / (1 + np.exp(-a))),
    (scalar.rsqrt(x0 * x0 + 1e-6), lambda a: 1 / np.sqrt(a * a + 1e-6)),
    (scalar.exp(x0), np.exp),
    (scalar.exp(x0 - 2), lambda a: np.exp(a - 2)),
    (scalar.cos(x0) * 3 + scalar.sin(x0), lambda a: 3 * np.cos(a) + np.sin(a)),
    (sympy.Max(x0, 0), lambda a: np.maximum(a, 0)),
])
def test_unary_joins(expr, numpy):
    np.testing.assert_allclose(join(expr, GRID), numpy(GRID), rtol=1e-14)


def test_binary_joins_broadcast():
    a, b = GRID[:, None], GRID[None, :5]
    np.testing.assert_allclose(join(scalar.silu(x0) * x1, a, b), a / (1 + np.exp(-a)) * b,
                               rtol=1e-14)
    np.testing.assert_allclose(join(scalar.exp(x0 - x1), a, b), np.exp(a - b), rtol=1e-14)
    np.testing.assert_allclose(join(x0 / x1, a, b + 10), a / (b + 10), rtol=1e-14)


def test_join_translation_is_cached():
    expr = scalar.silu(x0) * x1
    assert scalar.join_function(expr, 2) is scalar.join_function(scalar.silu(x0) * x1, 2)


def test_product_and_scaled_product():
    assert scalar.product(3) == x0 * x1 * scalar.x(2)
    assert scalar.scaled_product_factor(x0 * x1, 2) == 1.0
    assert scalar.scaled_product_factor(0.125 * x0 * x1, 2) == 0.125
    assert scalar.scaled_product_factor(x0 * x1 / 4, 2) == 0.25
    assert scalar.scaled_product_factor(x0 + x1, 2) is None
    assert scalar.scaled_product_factor(x0 * x0, 2) is None
    assert scalar.scaled_product_factor(x0, 2) is None
    assert scalar.free_operands(x0 * scalar.x(3) + 1) == {0, 3}


def test_scaled_product_runs_as_blas_with_factor():
    a, b = np.arange(6.0).reshape(2, 3), np.arange(12.0).reshape(3, 4)
    spec = EinsumSpec.parse("ab,bc->ac")
    got = kernels.einsum(spec, -0.5 * x0 * x1, "sum", [a, b], np.dtype(np.float64))
    np.testing.assert_array_equal(got, -0.5 * (a @ b))


def test_fill_piecewise_mask_with_minus_infinity():
    mask = sympy.Piecewise((0, i1 <= i0 + P), (-sympy.oo, True)).xreplace({P: 2})
    got = scalar.evaluate_fill(mask, (0, 0), (3, 6), np.dtype(np.float32))
    want = np.where(np.arange(6)[None, :] <= np.arange(3)[:, None] + 2, 0.0, -np.inf)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, want)
    # a block of it, at an origin
    block = scalar.evaluate_fill(mask, (1, 2), (2, 3), np.dtype(np.float16))
    assert block.dtype == np.float16
    np.testing.assert_array_equal(block, want[1:3, 2:5])


def test_fill_rotary_table_and_constants():
    theta = (i0 + 1) * sympy.Float(10000.0) ** (-i1 / 4)
    got = scalar.evaluate_fill(scalar.cos(theta), (0, 0), (3, 4), np.dtype(np.float64))
    s, j = np.arange(3)[:, None], np.arange(4)[None, :]
    np.testing.assert_allclose(got, np.cos((s + 1) * 10000.0 ** (-j / 4)), rtol=1e-13)
    zero = scalar.evaluate_fill(sympy.Integer(0), (0, 0), (2, 3), np.dtype(np.float32))
    np.testing.assert_array_equal(zero, np.zeros((2, 3), np.float32))
    scalar_fill = scalar.evaluate_fill(sympy.Float(2.5), (), (), np.dtype(np.float64))
    assert scalar_fill.shape == () and scalar_fill == 2.5


ROUND_TRIP = [
    scalar.silu(x0) * x1,
    scalar.rsqrt(x0 * x0 / 64 + 1e-6),
    scalar.exp(x0 - x1),
    0.35355339059327373 * x0 * x1,
    sympy.Max(x0, x1) - sympy.Min(x0, 0) + sympy.Abs(x1),
    sympy.Piecewise((0, i1 <= i0 + P), (-sympy.oo, True)),
    scalar.cos((i0 + P) * sympy.Float(500000.0) ** (-1.0 * i1 / 64)) * (1 - (i0 - i1) ** 2),
    sympy.sqrt(sympy.pi) * sympy.E ** x0 + sympy.log(x1 + 10),
]


@pytest.mark.parametrize("expr", ROUND_TRIP, ids=lambda e: scalar.to_text(e)[:40])
def test_text_round_trip(expr):
    text = scalar.to_text(expr)
    back = scalar.from_text(text)
    assert scalar.to_text(back) == text
    names = sorted(s.name for s in expr.free_symbols)
    assert sorted(s.name for s in back.free_symbols) == names
    # numerically the same at every point of a small grid of each symbol
    rng = np.random.default_rng(1)
    values = {n: (rng.integers(0, 7, size=20).astype(np.float64) if n[0] in "iP"
                  else rng.uniform(-2, 2, size=20)) for n in names}
    f = scalar.numpy_function(expr, tuple(names))
    g = scalar.numpy_function(back, tuple(names))
    np.testing.assert_allclose(g(*values.values()), f(*values.values()), rtol=1e-14)


@pytest.mark.parametrize("name", ["S", "N", "I", "O", "Q", "B"])
def test_size_symbols_parse_as_symbols(name):
    """SymPy's parser would read `S`, `N`, `I`, `O`, `Q` as its own objects (`I` as the
    imaginary unit); a size symbol must stay a symbol."""
    expr = scalar.from_text(f"Piecewise((0, i1 <= i0 + {name}), (-oo, True))")
    assert {s.name for s in expr.free_symbols} == {"i0", "i1", name}
    assert scalar.from_text(f"{name} + i0").free_symbols == {sympy.Symbol(name),
                                                             sympy.Symbol("i0")}


def test_text_is_canonical():
    assert scalar.to_text(x1 * x0) == scalar.to_text(x0 * x1) == "x0*x1"
    assert scalar.to_text(x1 + x0) == "x0 + x1"


@pytest.mark.parametrize("text", [
    "__import__('os')",
    "__import__('os').system('true')",
    "x0.__class__",
    "eval('1')",
    "lambda: 1",
    "open('f')",
    "y0 + x0",
    "sympy.exp(x0)",
    "Symbol('x0')",
    "Xy + 1",
])
def test_from_text_rejects_unknown_names(text):
    with pytest.raises(ValueError, match="unknown name"):
        scalar.from_text(text)


def test_size_symbol_assumptions():
    B = scalar.size_symbol("B")
    assert B.is_integer and B.is_nonnegative
    assert scalar.index(2).name == "i2" and scalar.x(3).name == "x3"


def test_every_llama_expression_round_trips():
    """The joins and fills a real model uses (RMSNorm's `1.0e-6`, rotary tables, the causal mask
    with the past length `P`) survive the text form."""
    from einpage.ir.graph import Einsum, Fill
    from einpage.models import llama
    from einpage.models.config import preset

    cfg = preset("tiny")
    seen = set()
    for graph in (llama.prefill_graph(cfg), llama.decode_graph(cfg)):
        for node in graph.nodes:
            if isinstance(node.op, (Einsum, Fill)):
                expr = node.op.join if isinstance(node.op, Einsum) else node.op.expr
                text = scalar.to_text(expr)
                seen.add(text)
                assert scalar.to_text(scalar.from_text(text)) == text
    assert any("e-6" in t for t in seen) and any("Piecewise" in t for t in seen)


def test_equalities_round_trip_through_plan_text():
    """Mixtral's one-hot expert fills hold `Eq` (a plan file of it once failed to load)."""
    import sympy

    from einpage.ir.scalar import from_text, index, to_text
    i0, i1 = index(0), index(1)
    for expr in (sympy.Piecewise((1, sympy.Eq(i0, 0)), (0, True)),
                 sympy.Piecewise((0, sympy.Ne(i0, i1)), (1, True))):
        text = to_text(expr)
        assert to_text(from_text(text)) == text


def test_and_or_over_operands_of_two_shapes():
    """`And` / `Or` print as `logical_and.reduce((a, b))`, which needs one shape: a join's
    broadcast operands and a fill's open index grids are brought to it first (found by
    bench/fuzz_plans.py)."""
    x0, x1 = scalar.x(0), scalar.x(1)
    join = sympy.Piecewise((x0 * x1, sympy.And(x0 > 0, x1 > 0)), (0, True))
    a, b = np.array([[1.0], [-1.0]]), np.array([2.0, -2.0, 3.0])
    np.testing.assert_array_equal(scalar.join_function(join, 2)(a, b),
                                  [[2.0, 0.0, 3.0], [0.0, 0.0, 0.0]])
    i0, i1 = scalar.index(0), scalar.index(1)
    fill = sympy.Piecewise((1, sympy.Or(i0 > 0, i1 > 1)), (0, True))
    np.testing.assert_array_equal(scalar.evaluate_fill(fill, (0, 0), (2, 3), np.float32),
                                  [[0, 0, 1], [1, 1, 1]])
