"""Blocks whose value is known at partition time.

A causal mask is 0 on and below the diagonal and -inf above it, so a block of it that lies
entirely above the diagonal is the constant -inf; so is a block of `scores + mask` there, 0 a block
of `exp(scores - max)`, and nothing is added to a row's sum or to `probs @ v` by such a block. The
partitioner (`einpage.compiler.partitioner`) uses the pure functions here to find such blocks and
to drop the tasks that would compute them:

* `fill_constant`: the value of a fill block when the fill is provably constant over the block's
  box (a `Piecewise` of linear conditions in the indices, decided on the box's corners);
* `fold`: an einsum's join with some operands known constants: either a constant itself (the task's
  block is that value everywhere) or a join over the other operands only;
* `identity`: what each aggregation starts from (a partial equal to it changes nothing);
* `dtype_value`, `constant_expr`: a constant as stored in a dtype, and as a fill expression.

Every function is pure and cached: a plan has up to a million tasks, and each layer repeats the
same masks, so each distinct (expression, box) or (join, constants) is worked out with SymPy once.

Assumption of `fold`: operands that are not constant are real and finite. A mask makes scores
-inf, and `exp(-inf - top)` is 0 only for a finite row maximum `top` (a row that sees at least one
key), `0 * v` is 0 only for a finite `v`; the graphs this compiler plans (softmax over keys of
which each query sees at least itself) satisfy it.
"""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Mapping, Sequence

import numpy as np
import sympy
from sympy.logic.boolalg import And, BooleanAtom, Not, Or

from einpage.ir import scalar
from einpage.ir.dtypes import DType

_INDEX = re.compile(r"i[0-9]+")
_PLACEHOLDER = re.compile(r"x[0-9]+")

#: The value each aggregation starts from: a partial result equal to it leaves the output as is.
IDENTITY = {"sum": 0.0, "max": -math.inf, "min": math.inf}


def identity(agg: str) -> float:
    """The identity of aggregation `agg` (sum 0, max -inf, min +inf)."""
    return IDENTITY[agg]


class _Unknown(Exception):
    """The expression is outside what these rules decide: not known at partition time."""


# ------------------------------------------------------------------ fills

def fill_constant(expr: sympy.Expr, origin: Sequence[int], shape: Sequence[int]) -> float | None:
    """The value of the fill `expr` on the block at `origin` with `shape`, if provably constant
    there; None if not known.

    Rule: an expression without index symbols is constant. A `Piecewise` is resolved over the box
    when its conditions are relationals (<, <=, >, >=) of expressions linear in the index
    symbols, combined by And/Or/Not: a linear function's extremes over a box are at its corners,
    so a relation that has one truth value at all 2^k corners has it inside too (computed from
    the extremes directly, not by visiting corners). And/Or/Not combine these in three-valued
    logic: `And` is false where one side is false everywhere, `Or` true where one side is true
    everywhere (what the corner rule gives when every atom is decided, and sound otherwise). The
    first branch whose condition is true everywhere is taken, provided every earlier one is false
    everywhere; the expression is constant if, with every `Piecewise` so resolved, no index symbol
    is left. Anything else (Eq/Ne, non-linear conditions, size symbols, a non-real value, an
    empty box) is not known."""
    return _fill_constant(expr, tuple(int(o) for o in origin), tuple(int(s) for s in shape))


@functools.lru_cache(maxsize=1 << 16)
def _fill_constant(expr: sympy.Expr, origin: tuple[int, ...], shape: tuple[int, ...]
                   ) -> float | None:
    if any(s <= 0 for s in shape):
        return None
    box = tuple((o, o + s - 1) for o, s in zip(origin, shape))  # inclusive index ranges
    try:
        value = _resolve_all(expr, box)
    except _Unknown:
        return None
    if value.free_symbols:
        return None
    return _number(value)


def _resolve_all(expr: sympy.Expr, box) -> sympy.Expr:
    """`expr` with every `Piecewise` replaced by the branch it takes everywhere in `box`,
    outermost first (a branch not taken is never looked at); `_Unknown` if one is undecided."""
    if isinstance(expr, sympy.Piecewise):
        return _resolve_all(_resolve(expr, box), box)
    if not expr.args or not expr.has(sympy.Piecewise):
        return expr
    return expr.func(*[_resolve_all(a, box) for a in expr.args])


def _resolve(pw: sympy.Piecewise, box) -> sympy.Expr:
    """The branch of `pw` taken everywhere in `box`; `_Unknown` if that is not decided."""
    for branch, cond in pw.args:
        truth = _truth(cond, box)
        if truth is None:
            raise _Unknown
        if truth:
            return branch
    raise _Unknown  # no branch taken: undefined (nan)


def _truth(cond, box) -> bool | None:
    """Three-valued truth of a condition over the box: True/False everywhere, or None."""
    if isinstance(cond, BooleanAtom):
        return bool(cond)
    if isinstance(cond, And):
        values = [_truth(c, box) for c in cond.args]
        return False if False in values else (None if None in values else True)
    if isinstance(cond, Or):
        values = [_truth(c, box) for c in cond.args]
        return True if True in values else (None if None in values else False)
    if isinstance(cond, Not):
        value = _truth(cond.args[0], box)
        return None if value is None else not value
    if isinstance(cond, (sympy.StrictLessThan, sympy.LessThan, sympy.StrictGreaterThan,
                         sympy.GreaterThan)):
        op, coeffs, const = _linear(cond)
        if len(coeffs) > len(box):
            raise _Unknown  # an index the block does not have
        lo = hi = const
        for c, (a, b) in zip(coeffs, box):
            lo, hi = lo + min(c * a, c * b), hi + max(c * a, c * b)
        return _relation(op, lo, hi)
    raise _Unknown  # Eq, Ne, Xor, ...


def _relation(op: str, lo, hi) -> bool | None:
    """Truth of `L op 0` for every L in [lo, hi]."""
    if op == "<":
        return True if hi < 0 else (False if lo >= 0 else None)
    if op == "<=":
        return True if hi <= 0 else (False if lo > 0 else None)
    if op == ">":
        return True if lo > 0 else (False if hi <= 0 else None)
    return True if lo >= 0 else (False if hi < 0 else None)  # >=


_OPS = {sympy.StrictLessThan: "<", sympy.LessThan: "<=", sympy.StrictGreaterThan: ">",
        sympy.GreaterThan: ">="}


@functools.lru_cache(maxsize=1 << 12)
def _linear(rel) -> tuple[str, tuple, object]:
    """`lhs op rhs` as `L op 0` with L = sum(coeffs[k] * i_k) + const (coefficients per index
    symbol i0..i{n-1}, as exact Python numbers where SymPy's are); `_Unknown` unless L is linear
    in index symbols with real numeric coefficients."""
    form = sympy.expand(rel.lhs - rel.rhs)
    syms = form.free_symbols
    if any(not _INDEX.fullmatch(s.name) for s in syms):
        raise _Unknown  # size symbols or anything else
    ranks = sorted(int(s.name[1:]) for s in syms)
    gens = {int(s.name[1:]): s for s in syms}
    n = ranks[-1] + 1 if ranks else 0
    if not syms:
        return _OPS[type(rel)], (), _exact(form)
    try:
        poly = sympy.Poly(form, *[gens[k] for k in ranks])
    except sympy.PolynomialError:
        raise _Unknown from None
    if poly.total_degree() > 1:
        raise _Unknown
    coeffs = [0] * n
    for k in ranks:
        coeffs[k] = _exact(poly.coeff_monomial(gens[k]))
    return _OPS[type(rel)], tuple(coeffs), _exact(poly.coeff_monomial(1))


def _exact(v: sympy.Expr):
    """A real SymPy number as an int, a Fraction or a float; `_Unknown` otherwise."""
    if v.is_Integer:
        return int(v)
    if v.is_Rational:
        return Fraction(int(v.p), int(v.q))
    if v.is_number and v.is_real and v.is_finite:
        return float(v)
    raise _Unknown


def _number(value: sympy.Expr) -> float | None:
    """A closed SymPy expression as a float (+-inf allowed); None for nan or non-real values."""
    if value is sympy.oo:
        return math.inf
    if value is sympy.S.NegativeInfinity:
        return -math.inf
    if not value.is_number or value.has(sympy.nan, sympy.zoo) or value.is_real is False:
        return None
    try:
        out = complex(value)
    except (TypeError, ValueError):
        return None
    if out.imag != 0 or math.isnan(out.real):
        return None
    return out.real


# ------------------------------------------------------------------ joins

@dataclass(frozen=True, slots=True)
class Folded:
    """A join with some operands replaced by their constant values. Either `value` is set (the
    join is that constant whatever the other operands hold), or `join` is the rest of it over
    the operands `kept` (every operand that was not constant, in order), renumbered x0, x1, ..."""
    value: float | None
    join: sympy.Expr | None
    kept: tuple[int, ...]


def fold(join: sympy.Expr, consts: Mapping[int, float], n: int) -> Folded | None:
    """Substitute the constant operands `consts` (operand number -> value) into `join`, an
    expression of the `n` placeholders x0..x{n-1}. The other operands are taken to be real and
    finite, so `x0 + -oo` is -oo, `exp(-oo - x1)` 0, `0 / x1` and `0 * x1` 0. Returns the constant
    or the reduced join (`Folded`), or None where the substitution gives no real value (nan)."""
    return _fold(join, tuple(sorted((int(k), float(v)) for k, v in consts.items())), int(n))


@functools.lru_cache(maxsize=1 << 14)
def _fold(join: sympy.Expr, consts: tuple[tuple[int, float], ...], n: int) -> Folded | None:
    known = dict(consts)
    kept = tuple(k for k in range(n) if k not in known)
    # placeholders by name (a join read from a plan file carries no assumptions)
    table = {}
    for s in join.free_symbols:
        if _PLACEHOLDER.fullmatch(s.name):
            k = int(s.name[1:])
            table[s] = (constant_expr(known[k]) if k in known
                        else sympy.Symbol(s.name, real=True, finite=True))
    value = join.xreplace(table)
    rest = {s for s in value.free_symbols if _PLACEHOLDER.fullmatch(s.name)}
    if value.free_symbols - rest:
        return None  # not a join of placeholders alone
    if not rest:
        number = _number(value)
        return None if number is None else Folded(number, None, ())
    if value.has(sympy.nan, sympy.zoo):
        return None
    renumber = {k: j for j, k in enumerate(kept)}
    reduced = value.xreplace({s: scalar.x(renumber[int(s.name[1:])]) for s in rest})
    return Folded(None, reduced, kept)


# ------------------------------------------------------------------ values

def dtype_value(value: float, dtype: DType) -> float | None:
    """`value` as a block of `dtype` stores it (rounded to the dtype), or None where the dtype
    cannot hold it exactly as a fill would write it (a non-integral or infinite integer)."""
    if dtype is DType.i64:
        if not math.isfinite(value) or value != int(value):
            return None
        return float(int(value))
    return float(np.asarray(value, np.float64).astype(dtype.numpy))


def constant_expr(value: float) -> sympy.Expr:
    """A constant as a fill expression: +-oo, an integer, or a float printed to round-trip."""
    if math.isinf(value):
        return sympy.oo if value > 0 else -sympy.oo
    if value == int(value) and abs(value) < 2 ** 53:
        return sympy.Integer(int(value))
    return sympy.Float(value, 17)
