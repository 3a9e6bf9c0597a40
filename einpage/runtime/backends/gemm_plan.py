"""How the CuPy backend runs a product contraction as one cuBLAS GEMM, planned without CuPy so
that a CPU test checks it (DESIGN.md, "Stream program"), and the strided layouts its kernels read.

A contraction whose join is a (scaled) product of two operands with `sum` runs as one cuBLAS
GEMM (`gemm_call`: GemmEx, strided-batched when it has a batch; half operands on the tensor
cores, accumulated in float32; the join's factor is its alpha): `matmul_plan` sorts its
indices into batch / rows / cols / contracted groups, picks the group orders and the operand
order (`A B` or `(B^T A^T)^T`) that copy the fewest bytes, and says which operands must first be
materialised (converted, or transposed where neither a row- nor a column-major view reads them)
into workspace slots and whether the GEMM can write the output block itself (accumulating
into it with beta 1). `execute_matmul` runs a plan on any array module through `MatmulOps`
(`xp=numpy` in the tests).

Layouts: `contiguous_strides`, `operand_layout` (an operand broadcast over a kernel's index
space) and `nocopy_reshape_strides` (NumPy's and CuPy's rule for reshaping without a copy).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from einpage.errors import PlanError
from einpage.ir.spec import EinsumSpec
from einpage.ir.dtypes import DType
from einpage.runtime.backends.cuda_source import ITEMSIZE
from einpage.runtime.backends.gemm_call import C_TAGS, CUBLAS_OP_N, layout, matrix


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
    `shape`), materialised into a C-contiguous workspace slot of the GEMM's operand type when
    `copy`, then viewed as `gemm_shape` (`(batch, rows, cols)`, or `(rows, cols)` unbatched),
    where a view may be a transposed, column-major, matrix: cuBLAS reads it with a transpose
    flag (`gemm_call`)."""
    perm: tuple[int, ...]
    shape: tuple[int, ...]
    gemm_shape: tuple[int, ...]
    copy: bool


@dataclass(frozen=True)
class MatmulPlan:
    """`out[o] (+)= factor * sum_k a[..] b[..]` as one cuBLAS call `c = alpha * lhs @ rhs + beta
    * c` over `(batch, rows, k)` and `(batch, k, cols)` (unbatched: `(rows, k)`, `(k, cols)`);
    with `swap` the left operand is `b` and `c` the output transposed. Operands are `ab_tag`
    (f16 and bf16 run on the tensor cores, accumulated in float32), `c` is `c_tag`: the output
    block itself when `direct` (then `beta` 1 accumulates into it), else a workspace slot that
    the epilogue permutes, casts and adds into the block."""
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
    ab_tag: str                  # the operands' type: f16, bf16, f32 or f64
    c_tag: str                   # c's type (the output's when direct)
    alpha: float                 # the join's factor
    beta: float                  # 1 where a direct GEMM accumulates into the block, else 0
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
             batched: bool, tag: str) -> GemmOperand:
    """`groups`: (batch, outer, inner) indices in the order the GEMM takes the operand. The
    operand needs no copy where its C-contiguous block, its axes permuted into that order, is
    a view of shape `gemm_shape` (each group's axes adjacent in memory and in order) whose
    matrices cuBLAS reads in place: row- or column-major with any leading dimension, any batch
    stride (attention's heads are `s`-major: batch stride one head, leading dimension a row)."""
    order = "".join(groups)
    perm = tuple(term.index(c) for c in order)
    shape = tuple(int(sizes[c]) for c in order)
    kept = groups if batched else groups[1:]
    gemm_shape = tuple(math.prod(int(sizes[c]) for c in g) for g in kept)
    copy = convert or not in_place(term, order, gemm_shape, sizes, tag, out=False)
    return GemmOperand(perm, shape, gemm_shape, copy)


def in_place(term: str, order: str, gemm_shape: tuple[int, ...], sizes: dict, tag: str,
             out: bool) -> bool:
    """Whether the C-contiguous block with indices `term`, its axes taken in `order`, views as
    `gemm_shape` without a copy in a layout cuBLAS reads (`out`: writes, which must be
    row-major) in place."""
    itemsize = ITEMSIZE[tag]
    own = dict(zip(term, contiguous_strides([sizes[c] for c in term], itemsize)))
    strides = nocopy_reshape_strides([int(sizes[c]) for c in order], [own[c] for c in order],
                                     gemm_shape, itemsize)
    if strides is None:
        return False
    try:
        op, _, _ = layout(matrix(gemm_shape, strides, tag), "operand")
    except PlanError:
        return False
    return op == CUBLAS_OP_N or not out


def gemm_types(in_tags: Sequence[str], compute_tag: str) -> str:
    """The operand type of a GEMM over inputs `in_tags` computed in `compute_tag`: f64 for f64
    work; two operands of one half type stay in it (tensor cores, float32 accumulation: exact
    products, float32 sums, as NumPy's float32 computation of them); anything else f32."""
    if compute_tag == "f64":
        return "f64"
    if in_tags[0] == in_tags[1] and in_tags[0] in ("f16", "bf16"):
        return in_tags[0]
    return "f32"


def matmul_plan(spec: EinsumSpec, shapes: Sequence[Sequence[int]], in_tags: Sequence[str],
                compute_tag: str, out_tag: str, factor: float, accumulate: bool,
                staged: bool = False) -> MatmulPlan | None:
    """The cheapest GEMM form of a two-operand product contraction, or None where there is none
    (one operand sums an index alone, or the computation is not in floating point). `staged`:
    the output block shares bytes with an operand, so the GEMM must not write it directly.
    Cheapest: the fewest bytes copied into workspace slots (operands transposed or converted,
    and `c` when the GEMM cannot write the block itself)."""
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

    batched = size(batch_set) > 1
    ab_tag = gemm_types(in_tags, compute_tag)

    writes_out = not staged and out_tag in C_TAGS[ab_tag]
    best = None
    for swap in (False, True):
        first, second = (b, a) if swap else (a, b)
        first_tag, second_tag = (in_tags[1], in_tags[0]) if swap else tuple(in_tags)
        row_set, col_set = (n_set, m_set) if swap else (m_set, n_set)
        c_gemm = ((size(batch_set),) if batched else ()) + (size(row_set), size(col_set))
        for batch in _orders(batch_set, out, a, b):
            for rows in _orders(row_set, out, first):
                for cols in _orders(col_set, out, second):
                    for kk in _orders(k_set, first, second):
                        left = _operand(first, (batch, rows, kk), sizes, first_tag != ab_tag,
                                        batched, ab_tag)
                        right = _operand(second, (batch, kk, cols), sizes,
                                         second_tag != ab_tag, batched, ab_tag)
                        c_order = batch + rows + cols
                        direct = writes_out and in_place(out, c_order, c_gemm, sizes,
                                                         out_tag, out=True)
                        cost = sum(math.prod(o.shape) for o in (left, right) if o.copy)
                        cost += 0 if direct else size(out) * 2
                        if best is None or cost < best[0]:
                            best = (cost, swap, batch, rows, cols, kk, left, right, direct,
                                    c_order)
    _, swap, batch, rows, cols, kk, left, right, direct, c_order = best
    c_tag = out_tag if direct else ("f64" if ab_tag == "f64" else "f32")
    c_shape = ((size(batch),) if batched else ()) + (size(rows), size(cols))
    c_full = tuple(int(sizes[c]) for c in c_order)
    c_perm = tuple(c_order.index(c) for c in out)
    temps = tuple(math.prod(o.shape) * ITEMSIZE[ab_tag] for o in (left, right) if o.copy)
    if not direct:
        temps += (math.prod(c_shape) * ITEMSIZE[c_tag],)
    return MatmulPlan(str(spec), swap, batched, batch, rows, cols, kk, left, right, direct,
                      c_shape, c_full, c_perm, ab_tag, c_tag, float(factor),
                      1.0 if direct and accumulate else 0.0, accumulate, temps)


class MatmulOps:
    """What `execute_matmul` needs of an array module: workspace slots, conversions, the GEMM,
    the epilogue. This implementation is plain NumPy (fresh arrays, in the tests); the CUDA
    backend's takes slots from its workspace, issues cuBLAS and runs generated kernels."""

    def __init__(self, xp: Any, plan: MatmulPlan):
        self.xp, self.plan = xp, plan

    def temp(self, shape: tuple[int, ...], tag: str) -> Any:
        return self.xp.empty(shape, dtype=DType(tag).numpy)

    def copy(self, dst: Any, src: Any) -> None:
        """`dst[...] = src`, converting the dtype."""
        self.xp.copyto(dst, src, casting="unsafe")

    def matmul(self, lhs: Any, rhs: Any, out: Any) -> None:
        """`out = alpha * lhs @ rhs + beta * out`, accumulated in float32 at least and rounded
        once into `out`, as cuBLAS does."""
        plan = self.plan
        acc = np.float64 if plan.ab_tag == "f64" else np.float32
        part = self.xp.matmul(lhs.astype(acc), rhs.astype(acc))
        if plan.alpha != 1.0:
            part = part * acc(plan.alpha)
        if plan.beta:
            part = part + out.astype(acc)
        out[...] = part.astype(out.dtype)

    def epilogue(self, dst: Any, src: Any) -> None:
        """`dst = cast(dst + src)` (`dst = cast(src)` unless accumulating)."""
        plan = self.plan
        part = src.astype(DType(plan.c_tag).numpy)
        if plan.accumulate:
            part = dst.astype(part.dtype) + part
        dst[...] = part.astype(dst.dtype)


def execute_matmul(plan: MatmulPlan, ops: MatmulOps, a: Any, b: Any, out: Any) -> None:
    """Run `plan` on operand blocks `a`, `b` (C-contiguous in their spec order) into `out`."""
    first, second = (b, a) if plan.swap else (a, b)
    lhs = _gemm_input(ops, first, plan.left, plan.ab_tag)
    rhs = _gemm_input(ops, second, plan.right, plan.ab_tag)
    if plan.direct:  # the block in c's axis order, viewed as c (a view: `in_place`)
        ops.matmul(lhs, rhs, out.transpose(_inverse(plan.c_perm)).reshape(plan.c_shape))
        return
    c = ops.temp(plan.c_shape, plan.c_tag)
    ops.matmul(lhs, rhs, c)
    ops.epilogue(out, c.reshape(plan.c_full).transpose(plan.c_perm))


def _inverse(perm: Sequence[int]) -> tuple[int, ...]:
    out = [0] * len(perm)
    for k, p in enumerate(perm):
        out[p] = k
    return tuple(out)


def _gemm_input(ops: MatmulOps, x: Any, operand: GemmOperand, tag: str) -> Any:
    view = x.transpose(operand.perm)
    if operand.copy:
        slot = ops.temp(operand.shape, tag)
        ops.copy(slot, view)
        view = slot
    return view.reshape(operand.gemm_shape)


__all__ = ["GemmOperand", "MatmulOps", "MatmulPlan", "contiguous_strides", "execute_matmul",
           "gemm_types", "matmul_plan", "nocopy_reshape_strides", "operand_layout"]
