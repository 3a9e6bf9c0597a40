"""Scalar expressions: the elementwise part of an einsum (its *join*, over placeholders `x0, x1,
...`) and the body of a fill (over index symbols `i0, i1, ...` and size symbols such as `P`).

Expressions are SymPy; each distinct expression is translated to NumPy code once and cached, so no
SymPy runs inside a kernel loop.
"""
from __future__ import annotations

import functools
import re
from typing import Callable, Sequence

import numpy as np
import sympy


#: A size symbol: positive integer, e.g. `B`, `S`, `P`.
def size_symbol(name: str) -> sympy.Symbol:
    return sympy.Symbol(name, integer=True, nonnegative=True)


def x(i: int) -> sympy.Symbol:
    """Placeholder for operand `i` of a join."""
    return sympy.Symbol(f"x{i}")


def index(i: int) -> sympy.Symbol:
    """Symbol for dimension `i` of a fill's output."""
    return sympy.Symbol(f"i{i}", integer=True, nonnegative=True)


# Built-ins a model needs, as plain SymPy so they print, compare and translate like anything else.
exp = sympy.exp
sqrt = sympy.sqrt
cos = sympy.cos
sin = sympy.sin


def silu(e: sympy.Expr) -> sympy.Expr:
    return e / (1 + sympy.exp(-e))


def rsqrt(e: sympy.Expr) -> sympy.Expr:
    return 1 / sympy.sqrt(e)


def product(n: int) -> sympy.Expr:
    """The default join: the product of all `n` operands."""
    return sympy.Mul(*[x(i) for i in range(n)])


AGGREGATIONS = ("sum", "max", "min")


def scaled_product_factor(join: sympy.Expr, n: int) -> float | None:
    """If `join` is `c * x0 * ... * x{n-1}` (each operand once), return `c`, else None.
    Such joins run as BLAS contractions; anything else is evaluated elementwise."""
    coeff, rest = join.as_coeff_Mul()
    if rest == product(n) and coeff.is_number:
        return float(coeff)
    return None


def free_operands(join: sympy.Expr) -> set[int]:
    """Operand numbers a join mentions."""
    out = set()
    for s in join.free_symbols:
        if s.name.startswith("x") and s.name[1:].isdigit():
            out.add(int(s.name[1:]))
    return out


@functools.lru_cache(maxsize=None)
def numpy_function(expr: sympy.Expr, arg_names: tuple[str, ...]) -> Callable[..., np.ndarray]:
    """NumPy function of the named symbols, translated once per distinct expression."""
    args = [sympy.Symbol(n) for n in arg_names]
    # Symbols carry assumptions; rebuild the expression over plain symbols of the same names.
    plain = expr.xreplace({s: sympy.Symbol(s.name) for s in expr.free_symbols})
    fn = sympy.lambdify(args, plain, modules="numpy")
    if plain.has(sympy.And, sympy.Or):
        # printed as `logical_and.reduce((a, b))`, which needs operands of one shape: a join's
        # broadcast operands and a fill's open index grids are brought to it first
        return lambda *values: fn(*np.broadcast_arrays(*values))
    return fn


def join_function(join: sympy.Expr, n: int) -> Callable[..., np.ndarray]:
    return numpy_function(join, tuple(f"x{i}" for i in range(n)))


def evaluate_fill(expr: sympy.Expr, origin: Sequence[int], shape: Sequence[int],
                  dtype: np.dtype) -> np.ndarray:
    """The block of a fill at `origin` with `shape`: `expr` evaluated at every index, in float64
    (or int64), then cast to `dtype`."""
    names = tuple(f"i{k}" for k in range(len(shape)))
    grids = np.ogrid[tuple(slice(o, o + s) for o, s in zip(origin, shape))] if shape else []
    with np.errstate(all="ignore"):
        value = numpy_function(expr, names)(*[g.astype(np.float64) for g in grids])
    return np.broadcast_to(np.asarray(value), tuple(shape)).astype(dtype)


def to_text(expr: sympy.Expr) -> str:
    """Readable, canonical text of an expression (printers, plan files, cache keys)."""
    return sympy.sstr(expr, order="lex")


#: The one vocabulary of expressions: every function a join or fill may use, by the name `to_text`
#: prints for it, and the constants and truth values it may print. The graph builder holds each
#: expression to it (`portable`: it must print within it and parse back) and the plan
#: reader parses nothing else (`from_text`), so a model cannot write what a plan cannot carry.
#: (Comparisons print as `<`, `>=`, ...; `&`, `|`, `~` as themselves; `Eq`, `Ne` by name.) The
#: kernels translate every entry: NumPy through `numpy_function`, CUDA in
#: `einpage.runtime.backends.cuda_source` (a test holds both to this list).
FUNCTIONS = {"exp": sympy.exp, "log": sympy.log, "cos": sympy.cos, "sin": sympy.sin,
             "sqrt": sympy.sqrt, "Abs": sympy.Abs, "Max": sympy.Max, "Min": sympy.Min,
             "Piecewise": sympy.Piecewise, "Eq": sympy.Eq, "Ne": sympy.Ne, "And": sympy.And,
             "Or": sympy.Or, "Not": sympy.Not}
CONSTANTS = {"oo": sympy.oo, "pi": sympy.pi, "E": sympy.E, "True": sympy.true,
             "False": sympy.false}
_NAMES = set(FUNCTIONS) | set(CONSTANTS)
# Numbers first, so the exponent of `1.0e-6` is not read as a name `e`.
_TOKEN = re.compile(r"(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|[A-Za-z_][A-Za-z_0-9]*")
_SYMBOL = re.compile(r"[xi][0-9]+|[A-Z]")


def from_text(text: str) -> sympy.Expr:
    """Inverse of `to_text`. Only the functions joins and fills use, placeholders `x<k>`, indices
    `i<k>` and one-letter size symbols are accepted, so a plan file cannot smuggle in code."""
    for name in _names(text):
        if name not in _NAMES and not _SYMBOL.fullmatch(name):
            raise ValueError(f"expression {text!r}: unknown name {name!r}")
    return _parse(text)


@functools.lru_cache(maxsize=4096)
def portable(expr: sympy.Expr) -> str | None:
    """Why a plan file could not carry `expr` (a name outside the vocabulary, or text that does
    not parse back over the same symbols), or None when it can. (Floats print with 15 digits, so
    a constant may read back rounded in its last bit.)"""
    text = to_text(expr)
    try:
        back = from_text(text)
    except ValueError as exc:
        return str(exc)
    except Exception as exc:  # SymPy's parser on text it printed itself
        return f"expression {text!r} does not parse back ({type(exc).__name__}: {exc})"
    if {str(v) for v in back.free_symbols} != {str(v) for v in expr.free_symbols}:
        return f"expression {text!r} reads back as {to_text(back)!r}"
    return None


def _names(text: str) -> list[str]:
    return [t for t in _TOKEN.findall(text) if t[0].isalpha() or t[0] == "_"]


@functools.lru_cache(maxsize=None)
def _parse(text: str) -> sympy.Expr:
    # Bind every symbol name explicitly: otherwise SymPy's namespace turns `S`, `N`, `I`, `O`,
    # `Q` into its own objects (`I` silently into the imaginary unit).
    local = {n: sympy.Symbol(n) for n in _names(text) if n not in _NAMES and _SYMBOL.fullmatch(n)}
    return sympy.parse_expr(text, local_dict=local, evaluate=True)
