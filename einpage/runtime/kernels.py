"""NumPy kernels shared by the dense reference and the NumPy executor.

Every kernel computes in the compute dtype (float32 for f16/bf16, float64 when asked) and returns
an array the caller casts or stores."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import sympy

from einpage.errors import InputError
from einpage.ir import scalar
from einpage.ir.spec import EinsumSpec

_REDUCE = {"sum": np.sum, "max": np.max, "min": np.min}
_COMBINE = {"sum": np.add, "max": np.maximum, "min": np.minimum}


def einsum(spec: EinsumSpec, join: sympy.Expr, agg: str | None, arrays: Sequence[np.ndarray],
           compute: np.dtype) -> np.ndarray:
    """`agg over contracted of join(arrays)`, computed in `compute`."""
    arrays = [np.asarray(a, dtype=compute) for a in arrays]
    factor = scalar.scaled_product_factor(join, len(arrays))
    if factor is not None and agg in (None, "sum"):
        out = np.einsum(str(spec), *arrays, optimize=len(arrays) > 1)
        if factor != 1.0:
            out = out * compute.type(factor)
        return np.asarray(out, dtype=compute)
    return _einsum_elementwise(spec, join, agg, arrays, compute)


def einsum_into(spec: EinsumSpec, join: sympy.Expr, agg: str | None,
                arrays: Sequence[np.ndarray], out: np.ndarray) -> bool:
    """A two-operand contraction written straight into `out` as one (batched) BLAS matmul, with
    no temporary for the result: where the join is a scaled product summed, the operands and
    `out` share its dtype, `out` overlaps neither, and the output's indices run batch, rows,
    columns (or batch, columns, rows). Returns False, having written nothing, otherwise."""
    factor = scalar.scaled_product_factor(join, len(arrays))
    if (factor is None or agg not in (None, "sum") or len(arrays) != 2
            or not out.flags.c_contiguous):
        return False
    if any(a.dtype != out.dtype or np.may_share_memory(a, out) for a in arrays):
        return False
    (ta, tb), to = spec.inputs, spec.output
    sizes = spec.sizes([a.shape for a in arrays])
    if out.shape != tuple(sizes[c] for c in to):
        return False  # the caller reports the mismatch
    batch = [c for c in to if c in ta and c in tb]
    rows = [c for c in to if c in ta and c not in tb]
    cols = [c for c in to if c in tb and c not in ta]
    inner = [c for c in ta if c in tb and c not in to]
    if set(ta) | set(tb) != set(to) | set(inner) or len(set(ta)) != len(ta) \
            or len(set(tb)) != len(tb) or not inner:
        return False  # an index summed out of one operand alone, a repeated index: not a matmul
    if list(to) == batch + rows + cols:
        lhs, rhs, m, n = (arrays[0], ta, rows), (arrays[1], tb, cols), rows, cols
    elif list(to) == batch + cols + rows:
        lhs, rhs, m, n = (arrays[1], tb, cols), (arrays[0], ta, rows), cols, rows
    else:
        return False

    def size(idx):
        return int(np.prod([sizes[c] for c in idx], dtype=np.int64))

    def matrix(array, term, outer, outer_first):
        order = batch + (outer + inner if outer_first else inner + outer)
        view = array.transpose([term.index(c) for c in order])
        shape = (size(batch), size(outer), size(inner)) if outer_first else \
            (size(batch), size(inner), size(outer))
        return view.reshape(shape)  # a view where the layout allows, else a copy

    target = out.reshape(size(batch), size(m), size(n))
    np.matmul(matrix(lhs[0], lhs[1], lhs[2], True), matrix(rhs[0], rhs[1], rhs[2], False),
              out=target)
    if factor != 1.0:
        out *= out.dtype.type(factor)
    return True


def _einsum_elementwise(spec, join, agg, arrays, compute) -> np.ndarray:
    """General path: broadcast every operand over the join space, apply, reduce."""
    order = spec.join_indices
    sizes = spec.sizes([a.shape for a in arrays])
    views = []
    for term, a in zip(spec.inputs, arrays):
        perm = sorted(range(len(term)), key=lambda k: order.index(term[k]))
        a = a.transpose(perm)
        present = sorted(term, key=order.index)
        shape = [sizes[c] if c in present else 1 for c in order]
        views.append(a.reshape(shape))
    with np.errstate(all="ignore"):
        value = scalar.join_function(join, len(arrays))(*views)
    value = np.broadcast_to(np.asarray(value, dtype=compute), tuple(sizes[c] for c in order))
    if spec.contracted:
        axes = tuple(range(len(spec.output), len(order)))
        value = _REDUCE[agg](value, axis=axes)
    return np.asarray(value, dtype=compute, order="C")  # keeps a 0-d result 0-d


def combine(agg: str, acc: np.ndarray, part: np.ndarray) -> np.ndarray:
    """Fold a partial result into an accumulator (a contracted index cut into blocks)."""
    return _COMBINE[agg or "sum"](acc, part)


def gather(table: np.ndarray, ids: np.ndarray, row_offset: int = 0,
           partial: bool = False) -> np.ndarray:
    """Rows of `table` for `ids`. With `partial`, `table` holds rows [row_offset, row_offset+len)
    of a bigger table and ids outside that range give zeros (a block of a gather whose table is
    cut by rows; the blocks' results are summed). Otherwise an id outside the table is an error."""
    ids = np.asarray(ids, dtype=np.int64)
    local = ids - row_offset
    if not partial and local.size and (local.min() < 0 or local.max() >= table.shape[0]):
        bad = int(local.min() if local.min() < 0 else local.max())
        raise InputError(f"gather: index {bad} out of range for a table of {table.shape[0]} rows")
    inside = (local >= 0) & (local < table.shape[0])
    out = np.take(table, np.where(inside, local, 0), axis=0)
    if not inside.all():
        out = np.where(inside.reshape(inside.shape + (1,) * (table.ndim - 1)), out, 0)
    return out
