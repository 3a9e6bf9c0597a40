"""How a contraction reads a stored operand row by row: the layout of `x . W` over a weight (or
a KV block) held as f16, bf16 or a block format, which the CPU kernels run
(`einpage.runtime.storedmm`) and the host's cost model prices (`einpage.predict.cost`).

A layout maps the contraction onto `out[b, m, n] = sum_k x[b, m, k] * W_b[n, k]`: W's
contracted indices last (so each output element reads one run of K elements of W's bytes), its
free indices together (rows one stride apart), any index shared by both operands and the output
a batch (each W_b at its own byte offset). `layout` says None where the kernels do not take a
contraction; it is pure, so the cost model asks it whether the kernels are built or not.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from einpage.ir import scalar
from einpage.ir.ops import EinsumOp
from einpage.ir.storage import get_format

#: At most this many rows of the other operand: one pass of `gemv` (each stored row decoded
#: once, dotted with every row); more: tiles decoded for the BLAS. On this machine's Xeon, a
#: 4096 x 4096 f16 weight of 16 rows: gemv 4.2-8.7 ms, tiles 8.7-9.1 ms (three runs on a shared
#: machine; gemv's time grows as 1 + (rows - 1) / 8 of one row's, as `predict.cost` prices it:
#: 1.46 ms for 1 row, 2.72 for 8, 4.16 for 16 in one run); 24 rows: tiles 9.8-10.1 ms, gemv
#: 12.0. In a decode step of 16 rows (LLaMA-7B shapes, 2 layers, threads backend, every weight
#: resident) gemv takes 249 ms where tiles took 384, so up to 16 rows go through gemv.
GEMV_ROWS = 16
#: Stored operands smaller than this go NumPy's way (a call's dispatch is a few microseconds).
MIN_ELEMENTS = 1 << 14
#: The kernels' format codes (`einpage.runtime._cpu`'s, checked where it loads), by storage format or array dtype
FORMAT_CODES = {"float16": 1, "bfloat16": 2, "q8_0": 3, "q4_0": 4, "q4_1": 5, "q4_g128": 6}
_ROUND = {"float16": 1, "bfloat16": 2}


@dataclass(frozen=True, slots=True)
class Layout:
    """How one contraction maps onto `out[b, m, n] = sum_k x[b, m, k] * W_b[n, k]`: row n of
    W_b starts `offsets[b] + n * row_stride` bytes into the stored operand's bytes (transposed:
    W_b[k, n], row k at `offsets[b] + k * row_stride`)."""
    w: int                     # which operand is stored (0 or 1)
    x_axes: tuple[int, ...]    # x's axes in (batch, free, contracted) order
    batch: tuple[int, ...]     # sizes of the batch indices (in W's order)
    free_x: tuple[int, ...]    # sizes of x's free indices (M is their product)
    free_w: tuple[int, ...]    # sizes of W's free indices (N)
    k: int                     # contracted elements per row (K)
    row_stride: int            # bytes from one row of W_b to the next
    offsets: bytes             # int64 byte offset of each W_b
    perm: tuple[int, ...]      # (batch + free_x + free_w) -> the output's order
    fmt: int                   # `_cpu` format code
    round: int                 # 0, or the logical dtype packed values round to (1 f16, 2 bf16)
    factor: float
    transposed: bool = False   # W_b held as K rows of N elements (its free indices last)
    group: int = 1             # elements per group of W's format (columns are cut at them)

    @property
    def rows(self) -> int:
        """M: the rows of x (per batch)."""
        return math.prod(self.free_x)


@functools.lru_cache(maxsize=4096)
def layout(op: EinsumOp, shapes: tuple[tuple[int, ...], ...], dtypes: tuple[np.dtype, ...],
           storages: tuple, logical: tuple[np.dtype, ...]) -> Layout | None:
    """The layout of `op` over operands of logical `shapes` held as `dtypes` (the arrays' own)
    with `storages` (a Storage for packed bytes, else None) and `logical` dtypes; None where the
    kernels do not take it. Pure (the cost model asks it too, kernels built or not) and cached:
    a plan runs the same few shapes over and over.

    W's contracted indices come last and its free indices run together (a batch index may
    stand before or after them: a KV block `btnuj` read per (b, n) has rows t, `nuj` elements
    apart), or W's free indices come last and its contracted ones run together (transposed: a
    value block `btnrj` read per (b, n) has rows t of `rj` columns). With a batch or
    transposed, x has at most `GEMV_ROWS` rows (a decode step's attention)."""
    if len(shapes) != 2 or op.agg not in (None, "sum"):
        return None
    if np.dtype(op.dtype.compute) != np.float32:
        return None
    factor = scalar.scaled_product_factor(op.join, 2)
    if factor is None:
        return None
    codes = [_format(d, s) for d, s in zip(dtypes, storages)]
    candidates = [i for i in (0, 1) if codes[i] is not None]
    if not candidates:
        return None
    w = max(candidates, key=lambda i: math.prod(shapes[i]))
    x = 1 - w
    if storages[x] is not None:
        return None  # the other side packed too (in a format the kernels do not read)
    tw, tx, to = op.spec.inputs[w], op.spec.inputs[x], op.spec.output
    if any(len(set(t)) != len(t) for t in (tw, tx, to)):
        return None
    if set(tw) | set(tx) != set(to) | (set(tw) & set(tx)):
        return None  # an index summed out of one operand alone
    inner = [c for c in tw if c in tx and c not in to]
    batch = [c for c in tw if c in tx and c in to]
    free_w = [c for c in tw if c not in tx]
    free_x = [c for c in tx if c not in tw]
    if not inner:
        return None
    if _run(tw, inner) and tw.endswith("".join(inner)) and (not free_w or _run(tw, free_w)):
        transposed, rows, row = False, free_w, inner  # W[n, k]: its contracted indices last
    elif free_w and tw.endswith("".join(free_w)) and _run(tw, inner):
        transposed, rows, row = True, inner, free_w  # W[k, n]: its free indices last
    else:
        return None  # rows of W not one stride apart, or a row not one run of bytes
    sizes = {c: int(v) for c, v in op.spec.sizes(shapes).items()}
    k, n = math.prod(sizes[c] for c in inner), math.prod(sizes[c] for c in free_w)
    m = math.prod(sizes[c] for c in free_x)
    storage = storages[w]
    if storage is not None and math.prod(sizes[c] for c in row) % _group(storage):
        return None  # a row of W is not whole groups
    if not (k and n and m and all(sizes[c] for c in batch)):
        return None  # nothing to compute
    if k * n < MIN_ELEMENTS or ((batch or transposed) and m > GEMV_ROWS):
        return None  # too small to pay; the BLAS's tiles take neither a batch nor columns
    strides = {c: math.prod(sizes[d] for d in tw[i + 1:]) for i, c in enumerate(tw)}

    def nbytes(elements: int) -> int:
        if storage is None:
            return elements * np.dtype(dtypes[w]).itemsize
        return elements // _group(storage) * _group_bytes(storage)

    offsets = np.zeros(1, np.int64)
    for c in batch:
        offsets = (offsets[:, None] + np.arange(sizes[c]) * nbytes(strides[c])).reshape(-1)
    order = batch + free_x + free_w
    rnd = _ROUND.get(np.dtype(logical[w]).name, 0) if storage is not None else 0
    contracted = [c for c in tw if c in inner]  # x's contracted indices in W's order
    return Layout(w, tuple(tx.index(c) for c in batch + free_x + contracted),
                  tuple(sizes[c] for c in batch), tuple(sizes[c] for c in free_x),
                  tuple(sizes[c] for c in free_w), k,
                  nbytes(strides[rows[-1]]) if rows else nbytes(k), offsets.tobytes(),
                  tuple(order.index(c) for c in to), codes[w], rnd, float(factor), transposed,
                  _group(storage) if storage is not None else 1)


def _run(term: str, indices: list[str]) -> bool:
    """Whether `indices` stand together in `term`, in that order."""
    return not indices or "".join(indices) in term


def _group(storage) -> int:
    return get_format(storage.format).group


def _group_bytes(storage) -> int:
    return get_format(storage.format).group_bytes


def _format(dtype: np.dtype, storage) -> int | None:
    if storage is not None:
        return FORMAT_CODES.get(storage.format)
    name = np.dtype(dtype).name
    return FORMAT_CODES[name] if name in ("float16", "bfloat16") else None


__all__ = ["FORMAT_CODES", "GEMV_ROWS", "Layout", "MIN_ELEMENTS", "layout"]
