"""What the CuPy backend runs, planned without CuPy so that a CPU test checks it (DESIGN.md,
"Stream program"): the CUDA C of every generated kernel, the plan of every apply, and the
workspace those plans need.

- **Kernels.** Joins, fills, reductions, gathers and conversions become `cupy.ElementwiseKernel`
  / `cupy.ReductionKernel` sources (`ElementwiseSource`, `ReductionSource`): the SymPy IR printed
  once per distinct expression by SymPy's C99 printer (float literals and `expf`/`powf` where the
  computation is float32, as NumPy computes it), inside a preamble of our own that converts bf16
  (stored as `uint16`, round to nearest even) and f16 (CuPy's `float16`) to float32 and back. The
  preamble and the printed functions are also valid C99, which the tests compile with `cc`.
- **Matmuls.** A contraction whose join is a (scaled) product of two operands with `sum` runs as
  one cuBLAS GEMM (`xp.matmul(lhs, rhs, out=c)`; strided-batched when it has a batch):
  `matmul_plan` sorts its indices into batch / rows / cols / contracted groups, picks the group
  orders and the operand order (`A B` or `(B^T A^T)^T`) that copy the fewest bytes, and says
  which operands must first be materialised (transposed or converted) into workspace slots and
  whether the GEMM can write the output block itself. `execute_matmul` runs a plan on any array
  module (`xp=numpy` in the tests).
- **Applies.** `plan_apply` turns each memgraph apply into a `MatmulApply`, a `KernelApply` (one
  generated kernel over strided views of the instances) or a `CopyApply` (pieces copied with
  `copyto` or a conversion kernel), with the workspace slots it takes, in order.
- **Workspace.** `workspace_bytes(mg)`: the largest sum of slots over the plan's applies, plus a
  status word (a gather writes there when an id is out of range), all of it 256-byte aligned.

The semantics are NumPy's (`einpage.runtime.blockops`, `kernels`, `ir.scalar`); where the GPU
must differ it says so: float sums are reduced in a different order, i64 joins run in `long long`
with the C usual arithmetic conversions.
"""
from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass
from typing import Any, Sequence, Union

import numpy as np
import sympy
from sympy.codegen.ast import float32, real
from sympy.printing.c import C99CodePrinter

from einpage.errors import PlanError, SpecError
from einpage.ir import scalar
from einpage.ir.memgraph import ALIGNMENT, ApplyNode, MemGraph, TensorInfo
from einpage.ir.ops import CopyOp, EinsumOp, FillOp, GatherOp, op_text
from einpage.ir.spec import EinsumSpec
from einpage.runtime.planio import instance_bytes, tensor_info

#: bytes after the workspace slots: the status words a gather sets when an id is out of range
STATUS_BYTES = ALIGNMENT

#: the array dtype an instance of each einpage dtype is viewed as on the device (bf16 as its bits)
DEVICE_DTYPE = {"f16": np.dtype(np.float16), "bf16": np.dtype(np.uint16),
                "f32": np.dtype(np.float32), "f64": np.dtype(np.float64),
                "i64": np.dtype(np.int64)}
_PARAM = {"f16": "float16", "bf16": "uint16", "f32": "float32", "f64": "float64", "i64": "int64"}
_STORAGE_CTYPE = {"f16": "float16", "bf16": "unsigned short", "f32": "float", "f64": "double",
                  "i64": "long long"}
#: the C type each einpage dtype computes in (DType.compute)
COMPUTE_CTYPE = {"f16": "float", "bf16": "float", "f32": "float", "f64": "double",
                 "i64": "long long"}
_ITEMSIZE = {tag: d.itemsize for tag, d in DEVICE_DTYPE.items()}
_X0 = scalar.x(0)


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def tag_of(dtype: Any) -> str:
    """The einpage dtype name (`f16`, `bf16`, ...) of a device array dtype."""
    dtype = np.dtype(dtype)
    for tag, d in DEVICE_DTYPE.items():
        if d == dtype:
            return tag
    raise PlanError(f"no einpage dtype is stored as {dtype} on the device")


# ------------------------------------------------------------------ C: preamble and printer

#: Storage conversions and constants, valid CUDA C++ (NVRTC) and C99. bf16 <-> f32 by bits with
#: round to nearest even. From double, f16 goes through a round-to-odd float32, which makes the
#: second rounding exact (one rounding, as NumPy converts), and bf16 through a rounded float32
#: (two roundings, as ml_dtypes converts).
PREAMBLE = r"""
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define EP_FN __device__ __forceinline__
EP_FN unsigned int ep_f32_bits(float f) { return __float_as_uint(f); }
EP_FN float ep_bits_f32(unsigned int u) { return __uint_as_float(u); }
EP_FN double ep_bits_f64(unsigned long long u) { return __longlong_as_double((long long)u); }
#else
#include <math.h>
#include <stdbool.h>
#include <string.h>
#define EP_FN static inline
EP_FN unsigned int ep_f32_bits(float f) { unsigned int u; memcpy(&u, &f, 4); return u; }
EP_FN float ep_bits_f32(unsigned int u) { float f; memcpy(&f, &u, 4); return f; }
EP_FN double ep_bits_f64(unsigned long long u) { double d; memcpy(&d, &u, 8); return d; }
#endif
#define EP_INF ep_bits_f64(0x7ff0000000000000ULL)
#define EP_NAN ep_bits_f64(0x7ff8000000000000ULL)
#define EP_MAX(a, b) (((a) > (b) || (a) != (a)) ? (a) : (b))
#define EP_MIN(a, b) (((a) < (b) || (a) != (a)) ? (a) : (b))
#define EP_ABS(a) (((a) < 0) ? -(a) : (a))
EP_FN float ep_bf16_to_f32(unsigned short h) { return ep_bits_f32(((unsigned int)h) << 16); }
EP_FN unsigned short ep_f32_to_bf16(float f) {
  unsigned int u = ep_f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
  return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
EP_FN float ep_f64_to_f32_odd(double d) {
  float f = (float)d;
  unsigned int u;
  if (f != f || (double)f == d) return f;
  u = ep_f32_bits(f);
  if (fabs((double)f) > fabs(d)) u -= 1u;
  return ep_bits_f32(u | 1u);
}
"""


class _Printer(C99CodePrinter):
    """SymPy's C99 printer with the constants spelled by our preamble (no `M_PI`, `INFINITY`,
    which NVRTC lacks), float literals that are the exact float32 NumPy would use, `x*x` for
    squares and `1/sqrt(x)` as NumPy evaluates them, and max / min / abs as macros that work
    on every C type (and propagate NaN as NumPy does)."""

    def __init__(self, ctype: str):
        super().__init__({"type_aliases": {real: float32}} if ctype == "float" else {})
        self.ctype = ctype

    def _literal(self, value: float) -> str:
        if self.ctype == "float":
            with np.errstate(over="ignore"):
                value = float(np.float32(value))  # as NumPy rounds a Python float (NEP 50)
        if math.isinf(value):
            return "EP_INF" if value > 0 else "(-EP_INF)"
        if math.isnan(value):
            return "EP_NAN"
        text = format(value, ".9g") if self.ctype == "float" else repr(float(value))
        if not any(c in text for c in ".e"):
            text += ".0"
        return text + ("F" if self.ctype == "float" else "")

    def _print_Float(self, flt):
        return self._literal(float(flt))

    def _print_Pi(self, expr):
        return self._literal(math.pi)

    def _print_Exp1(self, expr):
        return self._literal(math.e)

    def _print_Infinity(self, expr):
        return "EP_INF"

    def _print_NegativeInfinity(self, expr):
        return "(-EP_INF)"

    def _print_NaN(self, expr):
        return "EP_NAN"

    def _fold(self, macro: str, args) -> str:
        out = self._print(args[-1])
        for a in reversed(args[:-1]):
            out = f"{macro}({self._print(a)}, {out})"
        return out

    def _print_Max(self, expr):  # NaN-propagating, like NumPy's maximum; any C type
        return self._fold("EP_MAX", expr.args)

    def _print_Min(self, expr):
        return self._fold("EP_MIN", expr.args)

    def _print_Abs(self, expr):
        return f"EP_ABS({self._print(expr.args[0])})"

    def _print_Pow(self, expr):
        base, exp = expr.base, expr.exp
        if exp == 2 or exp == -2:
            b = self._print(base)
            square = f"(({b})*({b}))"
            return square if exp == 2 else f"({self._literal(1.0)}/{square})"
        if exp == sympy.Rational(-1, 2):
            return f"({self._literal(1.0)}/{self._print(sympy.sqrt(base))})"
        return super()._print_Pow(expr)


def _with_defaults(expr: sympy.Expr) -> sympy.Expr:
    """A `Piecewise` without a default branch gets NaN there (what NumPy's `select` gives)."""
    def missing(e):
        return isinstance(e, sympy.Piecewise) and e.args[-1].cond != sympy.true
    return expr.replace(missing, lambda e: sympy.Piecewise(*e.args, (sympy.nan, True)))


@functools.lru_cache(maxsize=None)
def c_expression(expr: sympy.Expr, ctype: str) -> str:
    """`expr` as one C expression computing in `ctype` (`float`, `double` or `long long`)."""
    plain = expr.xreplace({s: sympy.Symbol(s.name) for s in expr.free_symbols})
    try:
        text = _Printer("float" if ctype == "float" else "double").doprint(_with_defaults(plain))
    except Exception as exc:  # SymPy raises several types for what it cannot print
        raise PlanError(f"expression {scalar.to_text(expr)!r} has no C form: {exc}") from None
    return " ".join(line.strip() for line in text.splitlines())


@functools.lru_cache(maxsize=None)
def join_function(join: sympy.Expr, nargs: int, ctype: str, name: str = "ep_join") -> str:
    """`ctype name(ctype x0, ...)`: a join over `nargs` operands, as C."""
    names = {f"x{k}" for k in range(nargs)}
    extra = sorted(s.name for s in join.free_symbols if s.name not in names)
    if extra:
        raise PlanError(f"join {scalar.to_text(join)!r} of {nargs} operands names {extra[0]!r}")
    args = ", ".join(f"{ctype} x{k}" for k in range(nargs)) or "void"
    return f"EP_FN {ctype} {name}({args}) {{ return ({ctype})({c_expression(join, ctype)}); }}\n"


@functools.lru_cache(maxsize=None)
def fill_function(expr: sympy.Expr, ndim: int, name: str = "ep_fill") -> str:
    """`double name(double i0, ...)`: a fill at global indices, evaluated in double (as NumPy
    evaluates fills in float64 before casting to the block's dtype)."""
    names = {f"i{k}" for k in range(ndim)}
    extra = sorted(s.name for s in expr.free_symbols if s.name not in names)
    if extra:
        raise PlanError(f"fill {scalar.to_text(expr)!r} of a {ndim}-d block names {extra[0]!r} "
                        "(bind every size symbol before compiling)")
    args = ", ".join(f"double i{k}" for k in range(ndim)) or "void"
    return f"EP_FN double {name}({args}) {{ return (double)({c_expression(expr, 'double')}); }}\n"


def load(tag: str, value: str, ctype: str) -> str:
    """C converting a stored `tag` value to `ctype`."""
    if tag == "bf16":
        return f"(({ctype})ep_bf16_to_f32({value}))"
    return f"(({ctype})({value}))"


def store(tag: str, value: str, ctype: str) -> str:
    """C converting a `ctype` value to the storage type of `tag`, rounded as NumPy (f16) and
    ml_dtypes (bf16: through float32) round."""
    if tag == "bf16":
        return f"ep_f32_to_bf16((float)({value}))"
    if tag == "f16":
        narrow = (f"((float)({value}))" if ctype == "float"
                  else f"ep_f64_to_f32_odd((double)({value}))")
        return f"float16({narrow})"
    return f"(({_STORAGE_CTYPE[tag]})({value}))"


def _combine(agg: str, acc: str, part: str) -> str:
    return {"sum": f"({acc} + {part})", "max": f"EP_MAX({acc}, {part})",
            "min": f"EP_MIN({acc}, {part})"}[agg]


def _identity(agg: str, ctype: str) -> str:
    if agg == "sum":
        return "0"
    if ctype == "long long":
        return "(-9223372036854775807LL - 1)" if agg == "max" else "9223372036854775807LL"
    return "(-EP_INF)" if agg == "max" else "EP_INF"


# ------------------------------------------------------------------ kernel sources

@dataclass(frozen=True)
class ElementwiseSource:
    """Arguments of `cupy.ElementwiseKernel(in_params, out_params, operation, name=...,
    preamble=...)`."""
    name: str
    in_params: str
    out_params: str
    operation: str
    preamble: str


@dataclass(frozen=True)
class ReductionSource:
    """Arguments of `cupy.ReductionKernel(in_params, out_params, map_expr, reduce_expr,
    post_map_expr, identity, name=..., reduce_type=..., preamble=...)`."""
    name: str
    in_params: str
    out_params: str
    map_expr: str
    reduce_expr: str
    post_map_expr: str
    identity: str
    reduce_type: str
    preamble: str


KernelSource = Union[ElementwiseSource, ReductionSource]


def _named(kind: str, *parts: str) -> str:
    digest = hashlib.sha1("\x00".join(parts).encode()).hexdigest()[:12]
    return f"ep_{kind}_{digest}"


def _scaled(value: str, factor: float | None, ctype: str) -> str:
    """`value * factor` in the order NumPy applies a scaled product's factor (after the sum)."""
    if factor is None or factor == 1.0:
        return value
    if ctype == "long long":  # NumPy multiplies by int64(factor)
        return f"({value} * {int(factor)}LL)"
    return f"({value} * {_Printer(ctype)._literal(factor)})"


def _finish(out_tag: str, value: str, ctype: str, combine: str | None, out: str = "y") -> str:
    """`out = value` in storage, or folded into the current `out` by `combine`."""
    if combine is not None:
        value = _combine(combine, load(out_tag, out, ctype), value)
    return f"{out} = {store(out_tag, value, ctype)}"


@functools.lru_cache(maxsize=None)
def join_kernel(join: sympy.Expr, in_tags: tuple[str, ...], ctype: str, out_tag: str,
                factor: float | None = None, combine: str | None = None) -> ElementwiseSource:
    """`y = join(a0, a1, ...) [* factor]`, computed in `ctype`, stored as `out_tag` (folded into
    `y` by `combine` when accumulating). Arrays broadcast as CuPy broadcasts them."""
    fn = join_function(join, len(in_tags), ctype)
    args = ", ".join(load(t, f"a{k}", ctype) for k, t in enumerate(in_tags))
    value = _scaled(f"ep_join({args})", factor, ctype)
    operation = _finish(out_tag, value, ctype, combine)
    in_params = ", ".join(f"{_PARAM[t]} a{k}" for k, t in enumerate(in_tags))
    out_params = f"{_PARAM[out_tag]} y"
    preamble = PREAMBLE + fn
    return ElementwiseSource(_named("join", in_params, out_params, operation, fn), in_params,
                             out_params, operation, preamble)


@functools.lru_cache(maxsize=None)
def reduce_kernel(join: sympy.Expr, in_tags: tuple[str, ...], ctype: str, out_tag: str,
                  agg: str, factor: float | None = None,
                  combine: str | None = None) -> ReductionSource:
    """`y = agg over the reduced axes of join(a0, ...) [* factor]`. The last input, `ep_nocub`
    (any int), is unused: with more than one input CuPy never takes its CUB path, which renames
    parameters inside the expressions and does not read the output back."""
    if agg not in scalar.AGGREGATIONS:
        raise PlanError(f"unknown aggregation {agg!r}; expected one of {scalar.AGGREGATIONS}")
    fn = join_function(join, len(in_tags), ctype)
    args = ", ".join(load(t, f"a{k}", ctype) for k, t in enumerate(in_tags))
    post = _finish(out_tag, _scaled("a", factor, ctype), ctype, combine)
    reduce_expr = _combine(agg, "a", "b")
    in_params = ", ".join([f"{_PARAM[t]} a{k}" for k, t in enumerate(in_tags)]
                          + ["int32 ep_nocub"])
    out_params = f"{_PARAM[out_tag]} y"
    identity = _identity(agg, ctype)
    map_expr = f"ep_join({args})"
    return ReductionSource(_named("reduce", in_params, out_params, map_expr, reduce_expr, post,
                                  identity, fn), in_params, out_params, map_expr, reduce_expr,
                           post, identity, ctype, PREAMBLE + fn)


@functools.lru_cache(maxsize=None)
def fill_kernel(expr: sympy.Expr, ndim: int, out_tag: str,
                combine: str | None = None) -> ElementwiseSource:
    """A fill over the flat C-order index `i` of its block: inputs `o0, n0, o1, n1, ...` (each
    dim's origin and size); the value, computed in double, is stored as `out_tag` (and folded
    into `y` in the block's compute type by `combine`, as `blockops` does)."""
    fn = fill_function(expr, ndim)
    lines = ["ptrdiff_t ep_r = i;"]
    for k in reversed(range(ndim)):
        lines.append(f"const double i{k} = (double)(o{k} + ep_r % n{k}); ep_r /= n{k};")
    lines.append(f"const double ep_v = ep_fill({', '.join(f'i{k}' for k in range(ndim))});")
    if combine is None:
        lines.append(f"y = {store(out_tag, 'ep_v', 'double')}")
    else:
        ctype = COMPUTE_CTYPE[out_tag]
        lines.append(f"const {_STORAGE_CTYPE[out_tag]} ep_s = {store(out_tag, 'ep_v', 'double')};")
        lines.append(_finish(out_tag, load(out_tag, "ep_s", ctype), ctype, combine))
    operation = "\n".join(lines)
    in_params = ", ".join(f"int64 o{k}, int64 n{k}" for k in range(ndim))
    out_params = f"{_PARAM[out_tag]} y"
    return ElementwiseSource(_named("fill", in_params, out_params, operation, fn), in_params,
                             out_params, operation, PREAMBLE + fn)


@functools.lru_cache(maxsize=None)
def gather_kernel(table_tag: str, out_tag: str, combine: str | None = None) -> ElementwiseSource:
    """Rows of a table block for an ids block, over the flat index `i` of the output. Inputs:
    `table` and `ids` (raw, flat), `rows`, `row_elems`, `row_offset`, `partial`. An id outside
    the block's rows gives 0; unless `partial` it also sets `status[0..2] = 1, id, rows`, which
    the backend reports after the pass (the NumPy executor raises at once)."""
    ctype = "long long" if table_tag == "i64" and out_tag == "i64" else COMPUTE_CTYPE[out_tag]
    operation = "\n".join([
        "const long long ep_r = i / row_elems;",
        "const long long ep_c = i - ep_r * row_elems;",
        "const long long ep_id = ids[ep_r];",
        "const long long ep_local = ep_id - row_offset;",
        "const bool ep_in = ep_local >= 0 && ep_local < rows;",
        "if (!ep_in && !partial) { status[0] = 1; status[1] = ep_id; status[2] = rows; }",
        f"const {ctype} ep_v = ep_in ? "
        f"{load(table_tag, 'table[ep_local * row_elems + ep_c]', ctype)} : ({ctype})0;",
        _finish(out_tag, "ep_v", ctype, combine),
    ])
    in_params = (f"raw {_PARAM[table_tag]} table, raw int64 ids, int64 rows, int64 row_elems, "
                 "int64 row_offset, int32 partial")
    out_params = f"{_PARAM[out_tag]} y, raw int64 status"
    return ElementwiseSource(_named("gather", in_params, out_params, operation), in_params,
                             out_params, operation, PREAMBLE)


def convert_kernel(src_tag: str, dst_tag: str, combine: str | None = None) -> ElementwiseSource:
    """`y = a0` across dtypes (one rounding), or `y = y + a0` with `combine`."""
    if src_tag == dst_tag == "i64":
        ctype = "long long"
    elif "f64" in (src_tag, dst_tag) or "i64" in (src_tag, dst_tag):
        ctype = "double"
    else:
        ctype = "float"
    return join_kernel(_X0, (src_tag,), ctype, dst_tag, None, combine)


# ------------------------------------------------------------------ layouts

def contiguous_strides(shape: Sequence[int], itemsize: int) -> tuple[int, ...]:
    out, step = [], itemsize
    for n in reversed(shape):
        out.append(step)
        step *= max(int(n), 1)
    return tuple(reversed(out))


def operand_layout(term: str, order: str, sizes: dict, itemsize: int
                   ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """`(shape, strides)` (bytes) of a C-contiguous operand with indices `term`, viewed over the
    index space `order`: stride 0 along indices it lacks (broadcast)."""
    own = dict(zip(term, contiguous_strides([sizes[c] for c in term], itemsize)))
    return tuple(int(sizes[c]) for c in order), tuple(own.get(c, 0) for c in order)


def nocopy_reshape_strides(shape: Sequence[int], strides: Sequence[int],
                           newshape: Sequence[int], itemsize: int) -> tuple[int, ...] | None:
    """Strides that view a strided array as `newshape` without copying, or None where no view
    can (NumPy's and CuPy's rule: merge dims that are contiguous with each other, then split)."""
    size = math.prod(shape)
    if math.prod(newshape) != size:
        raise PlanError(f"cannot view {list(shape)} as {list(newshape)}")
    if size <= 1:
        return contiguous_strides(newshape, itemsize)
    dims: list[list[int]] = []
    for n, s in zip(shape, strides):
        if n == 1:
            continue
        if dims and dims[-1][1] == n * s:
            dims[-1] = [dims[-1][0] * n, s]
        else:
            dims.append([n, s])
    out, k = [], 0
    last = dims[0][0] * dims[0][1]
    for n in newshape:
        if n <= 1:
            out.append(last)
            continue
        if k >= len(dims) or dims[k][0] % n:
            return None
        dims[k][0] //= n
        last = dims[k][0] * dims[k][1]
        out.append(last)
        if dims[k][0] == 1:
            k += 1
    return tuple(out)


def _strip(indices: str, sizes: dict) -> str:
    """`indices` without those of size 1 (which lie anywhere in a contiguous layout)."""
    return "".join(c for c in indices if sizes[c] != 1)


# ------------------------------------------------------------------ matmul plans

@dataclass(frozen=True)
class GemmOperand:
    """One GEMM operand: its axes taken in `perm` order (its groups in GEMM order, giving
    `shape`), materialised into a C-contiguous workspace slot of the GEMM dtype when `copy`,
    then viewed as `gemm_shape` (`(batch, rows, cols)`, or `(rows, cols)` unbatched, where a
    view may be a transposed, F-contiguous, matrix: cuBLAS reads it with a transpose flag)."""
    perm: tuple[int, ...]
    shape: tuple[int, ...]
    gemm_shape: tuple[int, ...]
    copy: bool


@dataclass(frozen=True)
class MatmulPlan:
    """`out[o] (+)= factor * sum_k a[..] b[..]` as `c = lhs @ rhs` over `(batch, rows, k)` and
    `(batch, k, cols)` (unbatched: `(rows, k)`, `(k, cols)`); with `swap` the left operand is
    `b` and `c` the output transposed."""
    spec: str
    swap: bool
    batched: bool
    batch: str
    rows: str
    cols: str
    k: str
    left: GemmOperand
    right: GemmOperand
    direct: bool                 # the GEMM writes the output block itself
    c_shape: tuple[int, ...]
    c_full: tuple[int, ...]      # c with every index apart (batch + rows + cols)
    c_perm: tuple[int, ...]      # axes of c_full in the output's order
    dtype: np.dtype              # the GEMM's dtype: float32, float64, or float16 (unbatched,
                                 # accumulated in float32 by cuBLAS)
    factor: float
    accumulate: bool
    temps: tuple[int, ...]       # bytes of the workspace slots: left, right, c (those needed)


def _groups(spec: EinsumSpec) -> tuple[str, str, str, str] | None:
    a, b = spec.inputs
    out = spec.output
    if any(c not in out for c in set(a) ^ set(b)):
        return None  # an index summed inside one operand: not a GEMM
    batch = "".join(c for c in out if c in a and c in b)
    m = "".join(c for c in out if c in a and c not in b)
    n = "".join(c for c in out if c in b and c not in a)
    k = "".join(c for c in a if c in b and c not in out)
    return batch, m, n, k


def _orders(group: str, *terms: str) -> list[str]:
    """Distinct orders of `group`'s indices as they appear in each of `terms`."""
    out = []
    for t in terms:
        o = "".join(c for c in t if c in group)
        if o not in out:
            out.append(o)
    return out


def _operand(term: str, groups: tuple[str, ...], sizes: dict, convert: bool,
             batched: bool) -> GemmOperand:
    """`groups`: (batch, outer, inner) indices in the order the GEMM takes the operand. A C
    layout needs no copy; unbatched, neither does a transposed one (inner before outer)."""
    order = "".join(groups)
    perm = tuple(term.index(c) for c in order)
    shape = tuple(int(sizes[c]) for c in order)
    kept = groups if batched else groups[1:]
    gemm_shape = tuple(math.prod(int(sizes[c]) for c in g) for g in kept)
    fits = [order] if batched else [order, groups[0] + groups[2] + groups[1]]
    copy = convert or all(_strip(f, sizes) != _strip(term, sizes) for f in fits)
    return GemmOperand(perm, shape, gemm_shape, copy)


def matmul_plan(spec: EinsumSpec, shapes: Sequence[Sequence[int]], in_tags: Sequence[str],
                compute_tag: str, out_tag: str, factor: float, accumulate: bool,
                staged: bool = False) -> MatmulPlan | None:
    """The cheapest GEMM form of a two-operand product contraction, or None where there is none
    (one operand sums an index alone, or the computation is not in floating point). `staged`:
    the output block shares bytes with an operand, so the GEMM must not write it directly.

    Unbatched GEMMs are 2-d (`cupy.matmul` then calls cuBLAS with transpose flags, so operands
    stored transposed need no copy), except 1x1 outputs, which CuPy would reduce with a
    temporary; batched ones are 3-d strided-batched GEMMs, whose operands must be C-contiguous."""
    if len(spec.inputs) != 2 or not spec.contracted or compute_tag == "i64":
        return None
    groups = _groups(spec)
    if groups is None:
        return None
    sizes = spec.sizes(shapes)
    batch_set, m_set, n_set, k_set = groups
    a, b = spec.inputs
    out = spec.output

    def size(indices: str) -> int:
        return math.prod(int(sizes[c]) for c in indices)

    batched = size(batch_set) > 1 or size(m_set) * size(n_set) == 1
    # f16 x f16 -> f16 without a scale or a sum into the block: cuBLAS accumulates in float32
    # and rounds once, as NumPy's float32 einsum cast to f16 does; no conversions needed
    native = (compute_tag == "f16" and tuple(in_tags) == ("f16", "f16") and out_tag == "f16"
              and factor == 1.0 and not accumulate and not staged and not batched)
    for gemm_tag in (("f16",) if native else ()) + ("f64" if compute_tag == "f64" else "f32",):
        best = None
        for swap in (False, True):
            first, second = (b, a) if swap else (a, b)
            first_tag, second_tag = (in_tags[1], in_tags[0]) if swap else tuple(in_tags)
            row_set, col_set = (n_set, m_set) if swap else (m_set, n_set)
            for batch in _orders(batch_set, out, a, b):
                for rows in _orders(row_set, out, first):
                    for cols in _orders(col_set, out, second):
                        for kk in _orders(k_set, first, second):
                            left = _operand(first, (batch, rows, kk), sizes,
                                            first_tag != gemm_tag, batched)
                            right = _operand(second, (batch, kk, cols), sizes,
                                             second_tag != gemm_tag, batched)
                            c_order = batch + rows + cols
                            direct = (not accumulate and not staged and out_tag == gemm_tag
                                      and _strip(c_order, sizes) == _strip(out, sizes))
                            cost = sum(math.prod(o.shape) for o in (left, right) if o.copy)
                            cost += 0 if direct else size(out) * 2
                            if best is None or cost < best[0]:
                                best = (cost, swap, batch, rows, cols, kk, left, right, direct,
                                        c_order)
        if best[8] or gemm_tag != "f16":
            break  # a native f16 GEMM only where it writes the block itself
    itemsize = _ITEMSIZE[gemm_tag]
    _, swap, batch, rows, cols, kk, left, right, direct, c_order = best
    c_shape = ((size(batch),) if batched else ()) + (size(rows), size(cols))
    c_full = tuple(int(sizes[c]) for c in c_order)
    c_perm = tuple(c_order.index(c) for c in out)
    temps = tuple(math.prod(o.shape) * itemsize for o in (left, right) if o.copy)
    if not direct:
        temps += (math.prod(c_shape) * itemsize,)
    return MatmulPlan(str(spec), swap, batched, batch, rows, cols, kk, left, right, direct,
                      c_shape, c_full, c_perm, DEVICE_DTYPE[gemm_tag], float(factor), accumulate,
                      temps)


class MatmulOps:
    """What `execute_matmul` needs of an array module: workspace slots, conversions, the
    epilogue. This implementation is plain `xp` (fresh arrays; NumPy in the tests); the CUDA
    backend's takes slots from its workspace and runs generated kernels."""

    def __init__(self, xp: Any, plan: MatmulPlan):
        self.xp, self.plan = xp, plan

    def temp(self, shape: tuple[int, ...], dtype: np.dtype) -> Any:
        return self.xp.empty(shape, dtype=dtype)

    def copy(self, dst: Any, src: Any) -> None:
        """`dst[...] = src`, converting the dtype."""
        self.xp.copyto(dst, src, casting="unsafe")

    def matmul(self, lhs: Any, rhs: Any, out: Any) -> None:
        """`out = lhs @ rhs`, accumulated in float32 at least (as cuBLAS does for f16)."""
        if np.dtype(out.dtype) == np.float16:
            f32 = np.dtype(np.float32)
            out[...] = self.xp.matmul(lhs.astype(f32), rhs.astype(f32)).astype(out.dtype)
        else:
            self.xp.matmul(lhs, rhs, out=out)

    def epilogue(self, dst: Any, src: Any) -> None:
        """`dst = cast(dst + src * factor)` (without `dst +` unless accumulating)."""
        plan = self.plan
        part = src.astype(plan.dtype)
        if plan.factor != 1.0:
            part = part * plan.dtype.type(plan.factor)
        if plan.accumulate:
            part = dst.astype(plan.dtype) + part
        dst[...] = part.astype(dst.dtype)


def execute_matmul(plan: MatmulPlan, ops: MatmulOps, a: Any, b: Any, out: Any) -> None:
    """Run `plan` on operand blocks `a`, `b` (C-contiguous in their spec order) into `out`."""
    first, second = (b, a) if plan.swap else (a, b)
    lhs = _gemm_input(ops, first, plan.left, plan.dtype)
    rhs = _gemm_input(ops, second, plan.right, plan.dtype)
    if plan.direct:
        ops.matmul(lhs, rhs, out.reshape(plan.c_shape))
        if plan.factor != 1.0:
            ops.epilogue(out, out)
        return
    c = ops.temp(plan.c_shape, plan.dtype)
    ops.matmul(lhs, rhs, c)
    ops.epilogue(out, c.reshape(plan.c_full).transpose(plan.c_perm))


def _gemm_input(ops: MatmulOps, x: Any, operand: GemmOperand, dtype: np.dtype) -> Any:
    view = x.transpose(operand.perm)
    if operand.copy:
        slot = ops.temp(operand.shape, dtype)
        ops.copy(slot, view)
        view = slot
    return view.reshape(operand.gemm_shape)


# ------------------------------------------------------------------ apply plans

@dataclass(frozen=True)
class ArrayView:
    """Kernel input: read `read` of the apply viewed with `shape` and byte `strides`."""
    read: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]


@dataclass(frozen=True)
class KernelApply:
    """One generated kernel: `kernel(*arrays, *scalars, out)` (elementwise), with `axis=axes`
    (reduction), the write passed flat (`flat`: fills, gathers) and followed by the status words
    (`status`: gathers). `staged`: computed into a workspace copy of the write (first slot),
    then copied in, because the write shares bytes with a read."""
    kernel: KernelSource
    arrays: tuple[ArrayView, ...]
    scalars: tuple[int, ...]
    axes: tuple[int, ...] | None
    flat: bool
    status: bool
    staged: bool
    temps: tuple[int, ...]


@dataclass(frozen=True)
class MatmulApply:
    """A GEMM (`execute_matmul`); `epilogue` scales, accumulates and casts into the write;
    `kernels` lists every generated kernel it may run (conversions, epilogue)."""
    plan: MatmulPlan
    epilogue: ElementwiseSource | None
    kernels: tuple[KernelSource, ...]
    temps: tuple[int, ...]


@dataclass(frozen=True)
class PiecePlan:
    """Copy the `src_shape` box at byte `src_offset` of read `src` to the box at `dst_offset` of
    the target (viewed with `dst_shape`, `dst_strides`). The source viewed as `dst_shape` has
    strides `src_view` (None: first copied contiguous into a workspace slot of `temp` bytes).
    `convert`: the kernel when the dtypes differ (else `copyto`)."""
    src: int
    src_offset: int
    src_shape: tuple[int, ...]
    src_strides: tuple[int, ...]
    dst_offset: int
    dst_shape: tuple[int, ...]
    dst_strides: tuple[int, ...]
    src_view: tuple[int, ...] | None
    temp: int
    convert: ElementwiseSource | None


@dataclass(frozen=True)
class CopyApply:
    """A copy op: the target (the write, or with `staged` a workspace block in the first slot)
    is zeroed unless the pieces cover it exactly once, the pieces copied in order, then a staged
    block is copied into the write, or folded into it by `fold` when accumulating."""
    pieces: tuple[PiecePlan, ...]
    zero: bool
    staged: bool
    fold: ElementwiseSource | None
    temps: tuple[int, ...]


ApplyPlan = Union[KernelApply, MatmulApply, CopyApply]


def _where(n: ApplyNode) -> str:
    return f"apply %{n.id} ({op_text(n.op)})"


def overlaps_reads(mg: MemGraph, n: ApplyNode) -> bool:
    """Whether the write's bytes meet a read's (an input consumed in place)."""
    w0, wn = instance_bytes(mg, n.write.tensor, n.write.offset)
    for a in n.reads:
        r0, rn = instance_bytes(mg, a.tensor, a.offset)
        if r0 < w0 + wn and w0 < r0 + rn and wn and rn:
            return True
    return False


def plan_apply(mg: MemGraph, n: ApplyNode) -> ApplyPlan:
    """How the CUDA backend runs apply `n`; raises `PlanError` naming the node for an op it
    cannot run."""
    try:
        reads = [tensor_info(mg, a.tensor) for a in n.reads]
        write = tensor_info(mg, n.write.tensor)
        staged = overlaps_reads(mg, n)
        if isinstance(n.op, EinsumOp):
            return _plan_einsum(n, reads, write, staged)
        if isinstance(n.op, FillOp):
            return _plan_fill(n, write)
        if isinstance(n.op, GatherOp):
            return _plan_gather(n, reads, write, staged)
        if isinstance(n.op, CopyOp):
            return _plan_copy(n, reads, write, staged)
        raise PlanError(f"unknown op {type(n.op).__name__}")
    except SpecError as exc:
        raise PlanError(f"{_where(n)}: {exc}") from None
    except PlanError as exc:
        if str(exc).startswith("apply %"):
            raise
        raise PlanError(f"{_where(n)}: {exc}") from None


def _staging(staged: bool, write: TensorInfo) -> tuple[int, ...]:
    return (write.bytes,) if staged else ()


def _plan_einsum(n: ApplyNode, reads: list[TensorInfo], write: TensorInfo,
                 staged: bool) -> ApplyPlan:
    op = n.op
    spec = op.spec
    sizes = spec.sizes([r.shape for r in reads])
    out_shape = tuple(sizes[c] for c in spec.output)
    if out_shape != tuple(write.shape):
        raise PlanError(f"produces shape {out_shape}, but the write %t{write.id} is "
                        f"{write.dtype}{list(write.shape)}")
    tags = tuple(r.dtype.value for r in reads)
    compute, out_tag = op.dtype.value, write.dtype.value
    ctype = COMPUTE_CTYPE[compute]
    combine = (op.agg or "sum") if n.accumulate else None
    factor = scalar.scaled_product_factor(op.join, len(reads))
    product = factor is not None and op.agg in (None, "sum")
    if product:
        mm = matmul_plan(spec, [r.shape for r in reads], tags, compute, out_tag, factor,
                         n.accumulate, staged)
        if mm is not None:
            return _matmul_apply(mm, tags, out_tag)
    join, scale = (scalar.product(len(reads)), factor) if product else (op.join, None)
    order = spec.join_indices
    arrays = tuple(ArrayView(k, *operand_layout(term, order, sizes, _ITEMSIZE[tags[k]]))
                   for k, term in enumerate(spec.inputs))
    if spec.contracted:
        kernel = reduce_kernel(join, tags, ctype, out_tag, op.agg, scale, combine)
        axes = tuple(range(len(spec.output), len(order)))
        return KernelApply(kernel, arrays, (0,), axes, False, False, staged,
                           _staging(staged, write))
    kernel = join_kernel(join, tags, ctype, out_tag, scale, combine)
    return KernelApply(kernel, arrays, (), None, False, False, staged, _staging(staged, write))


def _matmul_apply(mm: MatmulPlan, tags: tuple[str, ...], out_tag: str) -> MatmulApply:
    gemm_tag = tag_of(mm.dtype)
    first = (tags[1], tags[0]) if mm.swap else tags
    kernels: list[KernelSource] = [convert_kernel(t, gemm_tag) for t, o in
                                   zip(first, (mm.left, mm.right)) if o.copy and t != gemm_tag]
    epilogue = None
    if not mm.direct or mm.factor != 1.0:
        epilogue = join_kernel(_X0, (gemm_tag,), COMPUTE_CTYPE[gemm_tag], out_tag,
                               mm.factor if mm.factor != 1.0 else None,
                               "sum" if mm.accumulate else None)
        kernels.append(epilogue)
    return MatmulApply(mm, epilogue, tuple(kernels), mm.temps)


def _plan_fill(n: ApplyNode, write: TensorInfo) -> KernelApply:
    op = n.op
    ndim = len(write.shape)
    if len(op.origin) != ndim:
        raise PlanError(f"fill origin {list(op.origin)} does not match the {ndim}-d write")
    kernel = fill_kernel(op.expr, ndim, write.dtype.value, "sum" if n.accumulate else None)
    scalars = tuple(v for o, s in zip(op.origin, write.shape) for v in (int(o), int(s)))
    return KernelApply(kernel, (), scalars, None, True, False, False, ())


def _plan_gather(n: ApplyNode, reads: list[TensorInfo], write: TensorInfo,
                 staged: bool) -> KernelApply:
    if len(reads) != 2:
        raise PlanError(f"gather reads (table, ids), got {len(reads)} blocks")
    table, ids = reads
    if ids.dtype.value != "i64":
        raise PlanError(f"gather ids %t{ids.id} are {ids.dtype}, expected i64")
    if len(table.shape) < 1 or tuple(write.shape) != tuple(ids.shape) + tuple(table.shape[1:]):
        raise PlanError(f"gather of table {list(table.shape)} by ids {list(ids.shape)} does not "
                        f"give the write {list(write.shape)}")
    src = table.source
    whole = src is not None and len(src.full_shape) > 0 and src.full_shape[0] == table.shape[0]
    rows, row_elems = int(table.shape[0]), math.prod(table.shape[1:])
    arrays = (ArrayView(0, (math.prod(table.shape),), (_ITEMSIZE[table.dtype.value],)),
              ArrayView(1, (math.prod(ids.shape),), (8,)))
    kernel = gather_kernel(table.dtype.value, write.dtype.value, "sum" if n.accumulate else None)
    scalars = (rows, row_elems, int(n.op.row_offset), int(not whole))
    return KernelApply(kernel, arrays, scalars, None, True, True, staged, _staging(staged, write))


def _box(box, shape, what: str) -> tuple[int, tuple[int, ...]]:
    if len(box) != len(shape) or any(not 0 <= a <= b <= s for (a, b), s in zip(box, shape)):
        raise PlanError(f"copy {what} box {[list(b) for b in box]} does not fit a block of shape "
                        f"{list(shape)}")
    return tuple(a for a, _ in box), tuple(b - a for a, b in box)


def _plan_copy(n: ApplyNode, reads: list[TensorInfo], write: TensorInfo,
               staged: bool) -> CopyApply:
    op = n.op
    w_tag = write.dtype.value
    target = tuple(op.view) if op.view is not None else tuple(write.shape)
    if math.prod(target) != math.prod(write.shape):
        raise PlanError(f"copy view {list(target)} does not hold the {math.prod(write.shape)} "
                        f"elements of the write {list(write.shape)}")
    t_strides = contiguous_strides(target, _ITEMSIZE[w_tag])
    staged = staged or n.accumulate
    temps = list(_staging(staged, write))
    pieces, boxes = [], []
    for k, p in enumerate(op.pieces):
        if not 0 <= p.src < len(reads):
            raise PlanError(f"copy piece {k} reads block {p.src}; the apply reads {len(reads)}")
        src = reads[p.src]
        s_tag = src.dtype.value
        s_strides = contiguous_strides(src.shape, _ITEMSIZE[s_tag])
        s_origin, s_shape = _box(p.src_box, src.shape, f"piece {k} source")
        d_origin, d_shape = _box(p.dst_box, target, f"piece {k} destination")
        if math.prod(s_shape) != math.prod(d_shape):
            raise PlanError(f"copy piece {k}: source box {list(s_shape)} and destination box "
                            f"{list(d_shape)} differ in size")
        view = (s_strides if s_shape == d_shape
                else nocopy_reshape_strides(s_shape, s_strides, d_shape, _ITEMSIZE[s_tag]))
        temp = 0 if view is not None else math.prod(s_shape) * _ITEMSIZE[s_tag]
        if temp:
            temps.append(temp)
        convert = None if s_tag == w_tag else convert_kernel(s_tag, w_tag)
        pieces.append(PiecePlan(p.src, sum(o * s for o, s in zip(s_origin, s_strides)), s_shape,
                                s_strides, sum(o * s for o, s in zip(d_origin, t_strides)),
                                d_shape, t_strides, view, temp, convert))
        boxes.append(tuple(zip(d_origin, d_shape)))
    zero = not _cover_exactly(boxes, target)
    fold = convert_kernel(w_tag, w_tag, "sum") if n.accumulate else None
    return CopyApply(tuple(pieces), zero, staged, fold, tuple(temps))


def _cover_exactly(boxes: list, shape: tuple[int, ...]) -> bool:
    """Whether disjoint boxes fill `shape` (then the target needs no zeroing first)."""
    def disjoint(p, q):
        return any(a + m <= b or b + n <= a for (a, m), (b, n) in zip(p, q))
    if sum(math.prod(m for _, m in b) for b in boxes) != math.prod(shape):
        return False
    return all(disjoint(p, q) for i, p in enumerate(boxes) for q in boxes[i + 1:])


def plan_applies(mg: MemGraph) -> dict[int, ApplyPlan]:
    """The plan of every apply of `mg`, by node id."""
    return {n.id: plan_apply(mg, n) for n in mg.nodes if isinstance(n, ApplyNode)}


def slot_bytes(plan: ApplyPlan) -> int:
    """Workspace bytes an apply takes: its slots, each 256-byte aligned."""
    return sum(aligned(t) for t in plan.temps)


def workspace_for(plans: dict[int, ApplyPlan]) -> int:
    return max((slot_bytes(p) for p in plans.values()), default=0) + STATUS_BYTES


def workspace_bytes(mg: MemGraph) -> int:
    """The device bytes the CUDA backend reserves after the arena for `mg`: the most any one
    apply takes (slots are reused from one apply to the next: one stream runs them in order)
    plus the status words. Pure; needs no CuPy."""
    return workspace_for(plan_applies(mg))


def plan_kernels(plan: ApplyPlan) -> tuple[KernelSource, ...]:
    """Every generated kernel an apply plan may run (to compile ahead, or in tests)."""
    if isinstance(plan, KernelApply):
        return (plan.kernel,)
    if isinstance(plan, MatmulApply):
        return plan.kernels
    out = [p.convert for p in plan.pieces if p.convert is not None]
    return tuple(out + ([plan.fold] if plan.fold is not None else []))


__all__ = ["ArrayView", "CopyApply", "ElementwiseSource", "KernelApply", "MatmulApply",
           "MatmulOps", "MatmulPlan", "PREAMBLE", "PiecePlan", "ReductionSource",
           "STATUS_BYTES", "execute_matmul", "matmul_plan", "plan_applies", "plan_apply",
           "plan_kernels", "workspace_bytes"]
