"""The CUDA C of every kernel the CuPy backend generates (DESIGN.md, "Stream program"), made
without CuPy so that a CPU test compiles and runs it.

Joins, fills, reductions, gathers and conversions become `cupy.ElementwiseKernel` /
`cupy.ReductionKernel` sources (`ElementwiseSource`, `ReductionSource`): the SymPy IR printed once
per distinct expression by SymPy's C99 printer (float literals and `expf`/`powf` where the
computation is float32, as NumPy computes it), inside a preamble of our own that converts bf16
(stored as `uint16`, round to nearest even) and f16 (CuPy's `float16`) to float32 and back. The
preamble and the printed functions are also valid C99, which the tests compile with `cc`.

The semantics are NumPy's (`einpage.runtime.blockops`, `kernels`, `ir.scalar`); where the GPU
must differ it says so: float sums are reduced in a different order, i64 joins run in `long long`
with the C usual arithmetic conversions.
"""
from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass
from typing import Any, Union

import numpy as np
import sympy
from sympy.codegen.ast import float32, real
from sympy.printing.c import C99CodePrinter

from einpage.errors import PlanError
from einpage.ir import scalar

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
#: NVRTC options of every generated kernel. `--fmad=false`: no contraction of `a*b+c` into one
#: fused multiply-add, so the device rounds each `*` and `+` as NumPy and the host build of the
#: same source (the stand-in's g++, `-ffp-contract=off`) do (bench/fma_check.py: contraction
#: changes 17,190 of 65,536 float32 outputs of decode attention's `o + p*v`, by up to 6,516
#: ulps). The kernels are memory-bound elementwise passes (every GEMM is cuBLAS's, unaffected),
#: so the separate multiply and add cost nothing measurable. What still differs from NumPy:
#: `exp`/`sin`/`cos` (CUDA's implementations), and float32 subnormals, which the device flushes
#: to zero (CuPy appends `-ftz=true` after these options, and the last one wins).
NVRTC_OPTIONS = ("--std=c++17", "--fmad=false")
#: bytes per element of each einpage dtype on the device
ITEMSIZE = {tag: d.itemsize for tag, d in DEVICE_DTYPE.items()}
_X0 = scalar.x(0)


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


#: a gather's prologue, per output element `i`: its row `ep_r` and column `ep_c`, the id, the
#: row in the block `ep_local` and whether it is there `ep_in` (else status 1, id, rows
#: unless `partial`)
_GATHER_ROW = (
    "const long long ep_r = i / row_elems;",
    "const long long ep_c = i - ep_r * row_elems;",
    "const long long ep_id = ids[ep_r];",
    "const long long ep_local = ep_id - row_offset;",
    "const bool ep_in = ep_local >= 0 && ep_local < rows;",
    "if (!ep_in && !partial) { status[0] = 1; status[1] = ep_id; status[2] = rows; }",
)


@functools.lru_cache(maxsize=None)
def gather_kernel(table_tag: str, out_tag: str, combine: str | None = None) -> ElementwiseSource:
    """Rows of a table block for an ids block, over the flat index `i` of the output. Inputs:
    `table` and `ids` (raw, flat), `rows`, `row_elems`, `row_offset`, `partial`. An id outside
    the block's rows gives 0; unless `partial` it also sets `status[0..2] = 1, id, rows`, which
    the backend reports after the pass (the NumPy executor raises at once)."""
    ctype = "long long" if table_tag == "i64" and out_tag == "i64" else COMPUTE_CTYPE[out_tag]
    operation = "\n".join([
        *_GATHER_ROW,
        f"const {ctype} ep_v = ep_in ? "
        f"{load(table_tag, 'table[ep_local * row_elems + ep_c]', ctype)} : ({ctype})0;",
        _finish(out_tag, "ep_v", ctype, combine),
    ])
    in_params = (f"raw {_PARAM[table_tag]} table, raw int64 ids, int64 rows, int64 row_elems, "
                 "int64 row_offset, int32 partial")
    out_params = f"{_PARAM[out_tag]} y, raw int64 status"
    return ElementwiseSource(_named("gather", in_params, out_params, operation), in_params,
                             out_params, operation, PREAMBLE)


# ------------------------------------------------------------------ dequantization

#: Reading packed groups (`einpage.ir.storage`), valid CUDA C++ and C99: a little-endian f16 from
#: its two bytes, exactly (NumPy's conversion: subnormals as `m * 2**-24`, which is a normal
#: float32, so the device's flush to zero never meets one), the nibble of element `e` in a run of
#: `half` bytes holding `2 * half` uint4 (element `e` in the low nibble of byte `e`, element
#: `e + half` in the high one), and Q4_K's 6-bit scale and minimum of sub-block `j` from their
#: 12 bytes at `s`.
DEQUANT_PREAMBLE = r"""
EP_FN float ep_f16_at(const unsigned char* b) {
  const unsigned int h = (unsigned int)b[0] | ((unsigned int)b[1] << 8);
  const unsigned int s = (h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0x1fu) return ep_bits_f32(s | 0x7f800000u | (m << 13));
  if (e == 0u) {
    const float v = (float)m * 5.9604644775390625e-08F;
    return s ? -v : v;
  }
  return ep_bits_f32(s | ((e + 112u) << 23) | (m << 13));
}
EP_FN unsigned int ep_nibble(const unsigned char* qs, int e, int half) {
  return ((unsigned int)qs[e % half] >> ((e / half) * 4)) & 15u;
}
EP_FN float ep_k_scale(const unsigned char* s, int j, float d, float dmin, float* low) {
  unsigned int sc, mn;
  if (j < 4) {
    sc = s[j] & 63u;
    mn = s[j + 4] & 63u;
  } else {
    sc = (s[j + 4] & 15u) | ((s[j - 4] >> 2) & 0x30u);
    mn = ((unsigned int)s[j + 4] >> 4) | ((s[j] >> 2) & 0x30u);
  }
  *low = dmin * (float)mn;
  return d * (float)sc;
}
"""

#: The body of `float ep_dequant(const unsigned char* b, int e)`: element `e` of the group whose
#: bytes start at `b`, in float32 with each operation rounded as `einpage.ir.quant` rounds
#: it in NumPy (no contraction: `--fmad=false`).
DEQUANT_BODY = {
    "q8_0": "return ep_f16_at(b) * (float)(signed char)b[2 + e];",
    "q4_0": "return ep_f16_at(b) * ((float)ep_nibble(b + 2, e, 16) - 8.0F);",
    "q4_1": "return ep_f16_at(b) * (float)ep_nibble(b + 4, e, 16) + ep_f16_at(b + 2);",
    "q4_g128": "return ((float)ep_nibble(b + 4, e, 64) - (float)b[2]) * ep_f16_at(b);",
    "q4_k": ("const int j = e / 32;\n"
             "  float low;\n"
             "  const float scale = ep_k_scale(b + 4, j, ep_f16_at(b), ep_f16_at(b + 2), &low);\n"
             "  const unsigned int q = ((unsigned int)b[16 + (j / 2) * 32 + e % 32] "
             ">> ((j % 2) * 4)) & 15u;\n"
             "  return scale * (float)q - low;"),
    "q6_k": ("const int h = e / 128;\n"
             "  const unsigned int lo = ((unsigned int)b[h * 64 + e % 64] >> (((e / 64) % 2) * 4))"
             " & 15u;\n"
             "  const unsigned int hi = ((unsigned int)b[128 + h * 32 + e % 32] "
             ">> (((e / 32) % 4) * 2)) & 3u;\n"
             "  const float scale = ep_f16_at(b + 208) * (float)(signed char)b[192 + e / 16];\n"
             "  return scale * (float)((int)(lo | (hi << 4)) - 32);"),
}


@functools.lru_cache(maxsize=None)
def dequant_kernel(format: str, out_tag: str) -> ElementwiseSource:
    """Dequantize a packed block (`einpage.ir.storage`: `format`'s groups, byte for byte the
    layout of `einpage.ir.quant`) into its logical block in C order: `raw uint8 q` (the
    packed bytes, flat) to `y` (the logical elements, flat, `out_tag`), one thread per element
    `i` (group `i / group`, element `i % group` of it), computed in float32 exactly as
    `quant.dequantize` computes it and rounded once to `out_tag` (as NumPy and ml_dtypes round
    a float32)."""
    from einpage.ir.storage import get_format
    spec = get_format(format)
    if format not in DEQUANT_BODY:
        raise PlanError(f"the CUDA backend cannot dequantize {format}")
    if out_tag not in ("f16", "bf16", "f32"):
        raise PlanError(f"a {format} block dequantizes to f16, bf16 or f32, not {out_tag}")
    fn = ("EP_FN float ep_dequant(const unsigned char* b, int e) {\n  "
          + DEQUANT_BODY[format] + "\n}\n")
    operation = "\n".join([
        f"const long long ep_g = (long long)i / {spec.group};",
        f"const int ep_e = (int)((long long)i - ep_g * {spec.group});",
        f"const float ep_v = ep_dequant(&q[ep_g * {spec.group_bytes}], ep_e);",
        f"y = {store(out_tag, 'ep_v', 'float')}",
    ])
    in_params = "raw uint8 q"
    out_params = f"{_PARAM[out_tag]} y"
    preamble = PREAMBLE + DEQUANT_PREAMBLE + fn
    return ElementwiseSource(_named(f"dequant_{format}", in_params, out_params, operation, fn),
                             in_params, out_params, operation, preamble)


@functools.lru_cache(maxsize=None)
def dequant_gather_kernel(format: str, out_tag: str, table_tag: str | None = None,
                          combine: str | None = None) -> ElementwiseSource:
    """`gather_kernel` over a packed table block (`format`'s groups; its span leaves out axis
    0, so each row is whole groups): per output element `i`, the id of its row, then only that
    element dequantized from the packed row (`DEQUANT_BODY`), with no dequantized copy of the
    table. Inputs: `q` (the packed bytes, raw, flat), `ids` (raw, flat), `rows`, `row_elems`
    (logical elements per row), `row_offset`, `partial`. The value, computed in float32 as
    `quant.dequantize` computes it, is rounded to the table's logical dtype `table_tag`
    (default `out_tag`) as `blockops` rounds it, then stored as `out_tag` (or folded into `y`
    by `combine`). An id outside the block's rows gives 0 (what a group of zero bytes reads as:
    -0.0 in some formats); unless `partial` it also sets `status[0..2] = 1, id, rows`, as
    `gather_kernel` does."""
    from einpage.ir.storage import get_format
    spec = get_format(format)
    table_tag = out_tag if table_tag is None else table_tag
    if format not in DEQUANT_BODY:
        raise PlanError(f"the CUDA backend cannot dequantize {format}")
    if table_tag not in ("f16", "bf16", "f32"):
        raise PlanError(f"a {format} block dequantizes to f16, bf16 or f32, not {table_tag}")
    if out_tag not in ("f16", "bf16", "f32", "f64"):
        raise PlanError(f"a gather of a {format} table writes a float block, not {out_tag}")
    ctype = COMPUTE_CTYPE[out_tag]
    fn = ("EP_FN float ep_dequant(const unsigned char* b, int e) {\n  "
          + DEQUANT_BODY[format] + "\n}\n")
    # outside the block: what a group of zero bytes reads as (the NumPy runtimes gather a row
    # of zero bytes there), -0.0 for some formats, so that partial sums agree bit for bit
    from einpage.ir.quant import dequantize
    from einpage.ir.storage import Storage
    zeros = dequantize(np.zeros(spec.group_bytes, np.uint8), Storage(format, 1), (spec.group,),
                       np.dtype(np.float32))
    zero = "-0.0F" if np.signbit(zeros[0]) else "0.0F"
    rounded = load(table_tag, store(table_tag, "ep_q", "float"), ctype)
    operation = "\n".join([
        *_GATHER_ROW,
        f"float ep_q = {zero};",
        "if (ep_in) {",
        "  const long long ep_f = ep_local * row_elems + ep_c;",
        f"  const long long ep_g = ep_f / {spec.group};",
        f"  ep_q = ep_dequant(&q[ep_g * {spec.group_bytes}], (int)(ep_f - ep_g * {spec.group}));",
        "}",
        f"const {ctype} ep_v = {rounded};",
        _finish(out_tag, "ep_v", ctype, combine),
    ])
    in_params = ("raw uint8 q, raw int64 ids, int64 rows, int64 row_elems, int64 row_offset, "
                 "int32 partial")
    out_params = f"{_PARAM[out_tag]} y, raw int64 status"
    preamble = PREAMBLE + DEQUANT_PREAMBLE + fn
    return ElementwiseSource(_named(f"dequant_gather_{format}", in_params, out_params, operation,
                                    fn), in_params, out_params, operation, preamble)


def convert_kernel(src_tag: str, dst_tag: str, combine: str | None = None) -> ElementwiseSource:
    """`y = a0` across dtypes (one rounding), or `y = y + a0` with `combine`."""
    if src_tag == dst_tag == "i64":
        ctype = "long long"
    elif "f64" in (src_tag, dst_tag) or "i64" in (src_tag, dst_tag):
        ctype = "double"
    else:
        ctype = "float"
    return join_kernel(_X0, (src_tag,), ctype, dst_tag, None, combine)


__all__ = ["COMPUTE_CTYPE", "DEQUANT_BODY", "DEQUANT_PREAMBLE", "DEVICE_DTYPE", "ITEMSIZE",
           "PREAMBLE", "ElementwiseSource", "KernelSource", "ReductionSource", "c_expression",
           "convert_kernel", "dequant_gather_kernel", "dequant_kernel", "fill_function",
           "fill_kernel", "gather_kernel", "join_function", "join_kernel", "load",
           "reduce_kernel", "store", "tag_of"]
