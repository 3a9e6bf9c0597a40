"""One apply of a memgraph on NumPy arrays: the value a block op stores in its write.

Shared by the sequential executor and the stream backends that compute on the host (threads):
they differ in where the arrays live and when a node may run, not in what a node computes."""
from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np

from einpage.errors import PlanError
from einpage.ir import scalar
from einpage.ir.memgraph import Access, ApplyNode, ReloadNode, TensorInfo
from einpage.ir.ops import BlockOp, Box, CopyOp, EinsumOp, FillOp, GatherOp, op_text, unguarded
from einpage.ir.quant import dequantize
from einpage.ir.stored import Layout, layout
from einpage.runtime import hostpool, kernels, storedmm


def apply_into(n: ApplyNode, tensors: Sequence[TensorInfo], reads: Sequence[np.ndarray],
               write: np.ndarray, release: Callable[[Access], None] | None = None) -> None:
    """Run an apply: store its value into `write`, releasing its consumed inputs (`frees`,
    whose bytes the write may take) with `release` first. A contraction computed in the write's
    own dtype goes straight into the write (no temporary) where it overlaps no input. Packed
    (quantized) reads are dequantized first, into fresh arrays of their logical shape, unless the
    compiled kernels read them as they lie (`einpage.runtime.storedmm`)."""
    n, reads = _guarded(n, reads, write, release)
    if n is not None:
        _apply(n, tensors, reads, write, release, stored_layout(n, tensors, reads))


def host_apply_into(n: ApplyNode, tensors: Sequence[TensorInfo], reads: Sequence[np.ndarray],
                    write: np.ndarray) -> None:
    """An apply placed on the host: through the compiled kernels where they take it, else a
    contraction over unpacked operands on the host pool, a chunk per core
    (`einpage.runtime.hostpool`); anything else as `apply_into` does."""
    n, reads = _guarded(n, reads, write, None)
    if n is None:
        return
    if isinstance(n.op, GatherOp) and _gather_rows_into(n, tensors, reads, write):
        return
    lay = stored_layout(n, tensors, reads)
    if (lay is None and isinstance(n.op, EinsumOp)
            and all(tensors[a.tensor].storage is None for a in n.reads)
            and hostpool.pooled_einsum(n.op, reads, write, n.accumulate)):
        return
    _apply(n, tensors, reads, write, None, lay)


def _gather_rows_into(n: ApplyNode, tensors: Sequence[TensorInfo], reads: Sequence[np.ndarray],
                      write: np.ndarray) -> bool:
    """A gather over a table block cut by rows (`host_gather`: the host gathers an embedding
    from a table in many blocks), into `write` touching only the rows of the ids its block
    holds: the first block's task clears the write, each adds its rows (the generic path writes
    every row of the write in every block's task), a range of rows per worker of the host pool
    (`hostpool.pooled_rows`). False where the table block holds every row (the generic path
    range-checks its ids) or the write is no contiguous array."""
    info = tensors[n.reads[0].tensor]
    src = info.source
    if src is None or not src.full_shape or src.full_shape[0] == info.shape[0] or (
            info.storage is not None and not _gathers_packed_rows(n.op, info)):
        return False  # (packed across its rows: the generic path unpacks it first)
    ids = np.asarray(reads[1], dtype=np.int64).reshape(-1)
    if not write.flags.c_contiguous:
        return False
    rows = write.reshape(ids.size, -1)  # (a view: one row of the write per id)
    compute = info.dtype.compute
    table, offset, height = reads[0], n.op.row_offset, info.shape[0]

    def chunk(lo: int, hi: int) -> None:
        local = ids[lo:hi] - offset
        inside = (local >= 0) & (local < height)
        part = rows[lo:hi]
        if not n.accumulate:
            part[...] = 0
        if inside.any():
            picked = _gather(n.op, table, ids[lo:hi][inside], info).reshape(-1, part.shape[1])
            part[inside] = (part[inside].astype(compute)
                            + picked.astype(compute, copy=False)).astype(part.dtype, copy=False)

    hostpool.pooled_rows(ids.size, write.nbytes, chunk)
    return True


def _apply(n: ApplyNode, tensors: Sequence[TensorInfo], reads: Sequence[np.ndarray],
           write: np.ndarray, release: Callable[[Access], None] | None,
           lay: Layout | None) -> None:
    """`apply_into` of an unguarded apply, through the kernels where `lay` says how."""
    op = n.op
    if lay is not None:
        result = _finish(n, tensors[n.write.tensor], storedmm.product(lay, reads),
                         op.dtype.compute, op.agg, reads, write)
    else:
        reads = unpacked(n, tensors, reads)
        if (not n.accumulate and isinstance(op, EinsumOp) and op.dtype.compute == write.dtype
                and kernels.einsum_into(op.spec, op.join, op.agg, reads, write)):
            _release(n, release)
            return
        result = apply_value(n, tensors, reads, write)
    _release(n, release)
    write[...] = result


def _release(n: ApplyNode, release: Callable[[Access], None] | None) -> None:
    for a in n.frees if release is not None else ():
        release(a)


def stored_layout(n: ApplyNode, tensors: Sequence[TensorInfo], reads: Sequence[np.ndarray]
                  ) -> Layout | None:
    """How the compiled kernels compute contraction `n` reading its stored operand as it lies
    (`einpage.runtime.storedmm`), or None where NumPy's path does."""
    if not isinstance(n.op, EinsumOp) or not storedmm.available():
        return None
    infos = [tensors[a.tensor] for a in n.reads]
    return layout(n.op, tuple(tuple(t.shape) if t.storage is not None else r.shape
                              for t, r in zip(infos, reads)),
                  tuple(r.dtype for r in reads), tuple(t.storage for t in infos),
                  tuple(t.dtype.numpy for t in infos))


def guard_on(view: Callable[[int, int], np.ndarray], n: ReloadNode) -> bool:
    """Whether guarded reload `n` copies: its guard element, read from the instance `view`
    (tensor, offset) returns."""
    g = n.guard
    return bool(view(g.access.tensor, g.access.offset).flat[g.index])


def _guarded(n: ApplyNode, reads: Sequence[np.ndarray], write: np.ndarray,
             release: Callable[[Access], None] | None):
    """(the apply without its guard, the reads without the guard block) to run, or (None,
    None) where the guard is off and the apply is skipped: then its frees are released and a
    write that creates its block is zeroed (a partial adds nothing)."""
    op, guard = unguarded(n.op)
    if guard is None:
        return n, reads
    if reads[-1].flat[guard.index]:
        return n.unguarded(), reads[:-1]
    _release(n, release)
    if not n.accumulate:
        write[...] = 0
    return None, None


def unpacked(n: ApplyNode, tensors: Sequence[TensorInfo], reads: Sequence[np.ndarray]
             ) -> Sequence[np.ndarray]:
    """`reads` with every packed block (`einpage.ir.storage`) dequantized into its logical
    shape, in the dtype the ops compute in (float32 for f16/bf16) holding the values of its
    logical dtype: the contraction reads them without converting a copy of its own."""
    if not any(tensors[a.tensor].storage is not None for a in n.reads):
        return reads
    out = []
    for k, (a, r) in enumerate(zip(n.reads, reads)):
        t = tensors[a.tensor]
        if t.storage is None or (k == 0 and _gathers_packed_rows(n.op, t)):
            out.append(r)  # (a gather dequantizes the rows it takes: `_gather`)
        else:
            out.append(dequantize(r, t.storage, tuple(t.shape), t.dtype.compute,
                                  rounded=t.dtype.numpy))
    return out


def _gathers_packed_rows(op: BlockOp, table: TensorInfo) -> bool:
    """Whether `op` gathers whole packed rows of `table` (its rows are not in the span)."""
    return (isinstance(op, GatherOp) and table.storage is not None
            and table.storage.span < len(table.shape))


def apply_value(n: ApplyNode, tensors: Sequence[TensorInfo], reads: Sequence[np.ndarray],
                write: np.ndarray) -> np.ndarray:
    """The array an apply stores into `write` (its current instance): the op's block, folded into
    `write` when accumulating, cast to the write's dtype. Never a view of `reads` or `write`, so
    the caller may release consumed inputs (whose bytes the write may take) before storing it."""
    info = tensors[n.write.tensor]
    part, compute, agg = _compute(n.op, reads, [tensors[a.tensor] for a in n.reads], info)
    return _finish(n, info, part, compute, agg, reads, write)


def _finish(n: ApplyNode, info: TensorInfo, part: np.ndarray, compute: np.dtype,
            agg: str | None, reads: Sequence[np.ndarray], write: np.ndarray) -> np.ndarray:
    """`apply_value` from the op's block `part` (computed in `compute`)."""
    if part.shape != write.shape:
        raise PlanError(f"{op_text(n.op)} produced shape {part.shape}, but the write "
                        f"%t{info.id} is {info.dtype}{list(info.shape)}")
    if n.accumulate:
        part = kernels.combine(agg, write.astype(compute), part.astype(compute, copy=False))
    result = part.astype(info.dtype.numpy, copy=False)
    if any(np.may_share_memory(result, a) for a in (write, *reads)):
        result = result.copy()  # e.g. an identity einsum returns a view of its input
    return result


def _compute(op: BlockOp, reads: Sequence[np.ndarray], read_infos: Sequence[TensorInfo],
             info: TensorInfo) -> tuple[np.ndarray, np.dtype, str | None]:
    """(the op's block, the dtype to accumulate in, the aggregation that accumulates it)."""
    if isinstance(op, EinsumOp):
        compute = op.dtype.compute
        return kernels.einsum(op.spec, op.join, op.agg, reads, compute), compute, op.agg
    if isinstance(op, FillOp):
        value = scalar.evaluate_fill(op.expr, op.origin, info.shape, info.dtype.numpy)
        return value, info.dtype.compute, "sum"
    if isinstance(op, GatherOp):
        if len(reads) != 2:
            raise PlanError(f"gather reads (table, ids), got {len(reads)} blocks")
        return _gather(op, reads[0], reads[1], read_infos[0]), info.dtype.compute, "sum"
    if isinstance(op, CopyOp):
        return _copy(op, reads, info), info.dtype.compute, "sum"
    raise PlanError(f"unknown op {type(op).__name__}")


def _gather(op: GatherOp, table: np.ndarray, ids: np.ndarray, table_info: TensorInfo
            ) -> np.ndarray:
    """A table block that holds every row range-checks its ids; a row block of a table cut by
    rows gives zeros for ids outside its rows (its partial results are summed)."""
    src = table_info.source
    rows = table_info.shape[0] if table_info.shape else 0
    whole = src is not None and len(src.full_shape) > 0 and src.full_shape[0] == rows
    if not _gathers_packed_rows(op, table_info):
        return kernels.gather(table, ids, op.row_offset, partial=not whole)
    # a packed table (a quantized embedding): take the packed rows, dequantize only those (an id
    # outside a partial block takes a row of zero bytes, which every format reads as zeros)
    picked = kernels.gather(table, ids, op.row_offset, partial=not whole)
    shape = tuple(np.shape(ids)) + tuple(table_info.shape[1:])
    return dequantize(picked, table_info.storage, shape, table_info.dtype.compute,
                      rounded=table_info.dtype.numpy)


def _copy(op: CopyOp, reads: Sequence[np.ndarray], info: TensorInfo) -> np.ndarray:
    out = np.zeros(info.shape, dtype=info.dtype.numpy)
    target = out
    if op.view is not None:
        if math.prod(op.view) != out.size:
            raise PlanError(f"copy view {list(op.view)} does not hold the {out.size} elements "
                            f"of the write {list(info.shape)}")
        target = out.reshape(op.view)
    for k, p in enumerate(op.pieces):
        if not 0 <= p.src < len(reads):
            raise PlanError(f"copy piece {k} reads block {p.src}; the apply reads {len(reads)}")
        src = reads[p.src][_slices(p.src_box, reads[p.src].shape, f"piece {k} source")]
        dst = target[_slices(p.dst_box, target.shape, f"piece {k} destination")]
        if src.shape != dst.shape:
            if src.size != dst.size:
                raise PlanError(f"copy piece {k}: source box {list(src.shape)} and destination "
                                f"box {list(dst.shape)} differ in size")
            src = src.reshape(dst.shape)
        dst[...] = src
    return out


def _slices(box: Box, shape: tuple[int, ...], what: str) -> tuple[slice, ...]:
    if len(box) != len(shape) or any(not 0 <= a <= b <= n for (a, b), n in zip(box, shape)):
        raise PlanError(f"copy {what} box {[list(b) for b in box]} does not fit a block of "
                        f"shape {list(shape)}")
    return tuple(slice(a, b) for a, b in box)
