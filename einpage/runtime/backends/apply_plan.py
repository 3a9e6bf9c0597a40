"""How the CuPy backend runs each apply, and the workspace it needs, planned without CuPy so
that a CPU test checks it (DESIGN.md, "Stream program").

- **Applies.** `plan_apply` turns each memgraph apply into a `MatmulApply` (a cuBLAS GEMM,
  `gemm_plan`, for a product contraction summing more than `SHORT_SUM` terms per output), a
  `KernelApply` (one generated kernel, `cuda_source`, over strided views of the instances) or a
  `CopyApply` (pieces copied with `copyto` or a conversion kernel), with the workspace slots it
  takes, in order.
- **Packed reads.** An apply reading a packed (quantized) block (`einpage.ir.storage`) first
  dequantizes it (`Unpack`: a `cuda_source.dequant_kernel` of its format and logical dtype) into
  a workspace slot holding its logical block in C order, and the op reads that slot where it
  would read the instance: the plan is made over the logical shapes and dtypes as for any read.
  A gather whose table is packed by rows (a quantized embedding: its span leaves out axis 0)
  is the exception: one `cuda_source.dequant_gather_kernel` reads the packed table and
  dequantizes only the elements of the rows its ids pick, with no slot for the table.
- **Workspace.** `workspace_bytes(mg)`: the largest sum of slots over the plan's applies (its
  dequantized operands included), plus a status word (a gather writes there when an id is out
  of range), all of it 256-byte aligned.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Union

from einpage.errors import PlanError, SpecError
from einpage.ir import scalar
from einpage.ir.memgraph import ALIGNMENT, ApplyNode, MemGraph, TensorInfo
from einpage.ir.ops import CopyOp, EinsumOp, FillOp, GatherOp, op_text
from einpage.runtime.backends.cuda_source import (COMPUTE_CTYPE, ITEMSIZE, ElementwiseSource,
                                                  KernelSource, convert_kernel,
                                                  dequant_gather_kernel, dequant_kernel,
                                                  fill_kernel, gather_kernel,
                                                  join_kernel, reduce_kernel)
from einpage.runtime.backends.gemm_plan import (MatmulPlan, contiguous_strides, matmul_plan,
                                                nocopy_reshape_strides, operand_layout)
from einpage.runtime.planio import instance_bytes, tensor_info

#: bytes after the workspace slots: the status words a gather sets when an id is out of range
STATUS_BYTES = ALIGNMENT
#: a product contraction summing at most this many terms per output runs as one reduction
#: kernel, not a GEMM: it is memory-bound either way, and as a GEMM (rotary embeddings' 2x2
#: rotations: 65,536 batched 4x2 @ 2x2 products at 2,048 tokens) it costs operand copies, an
#: epilogue and four launches; 1.3 ms per block on an H200 (bench/RESULTS.md, 2026-11-27)
SHORT_SUM = 4
_X0 = scalar.x(0)


def aligned(nbytes: int) -> int:
    """`nbytes` rounded up to the workspace's alignment (256 bytes)."""
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


# ------------------------------------------------------------------ apply plans

@dataclass(frozen=True)
class Unpack:
    """Before the op: dequantize read `read` (a packed block) with `kernel` into a workspace
    slot of `nbytes` (its logical block, C order), which the op then reads in its place."""
    read: int
    kernel: ElementwiseSource
    nbytes: int


@dataclass(frozen=True)
class ArrayView:
    """Kernel input: read `read` of the apply viewed with `shape` and byte `strides`; with
    `packed`, its packed bytes (`uint8`) rather than its logical dtype."""
    read: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    packed: bool = False


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
    unpacks: tuple[Unpack, ...] = ()


@dataclass(frozen=True)
class MatmulApply:
    """A GEMM (`execute_matmul`); `epilogue` permutes, casts and adds `c` into the write;
    `kernels` lists every generated kernel it may run (conversions, epilogue)."""
    plan: MatmulPlan
    epilogue: ElementwiseSource | None
    kernels: tuple[KernelSource, ...]
    temps: tuple[int, ...]
    unpacks: tuple[Unpack, ...] = ()


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
    unpacks: tuple[Unpack, ...] = ()


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
    """How the CUDA backend runs apply `n` (a guarded one: its op when the guard is on); raises
    `PlanError` naming the node for an op it cannot run."""
    n = n.unguarded()
    try:
        reads = [tensor_info(mg, a.tensor) for a in n.reads]
        write = tensor_info(mg, n.write.tensor)
        if write.storage is not None:
            raise PlanError(f"writes %t{write.id}, a packed ({write.storage.format}) block; "
                            "only inputs are packed")
        staged = overlaps_reads(mg, n)
        plan = _plan_op(n, reads, write, staged)
        unpacks = tuple(_unpack(k, r) for k, r in enumerate(reads) if r.storage is not None
                        and not (k == 0 and gathers_packed_rows(n, r)))
        return replace(plan, unpacks=unpacks) if unpacks else plan
    except SpecError as exc:
        raise PlanError(f"{_where(n)}: {exc}") from None
    except PlanError as exc:
        if str(exc).startswith("apply %"):
            raise
        raise PlanError(f"{_where(n)}: {exc}") from None


def _plan_op(n: ApplyNode, reads: list[TensorInfo], write: TensorInfo,
             staged: bool) -> ApplyPlan:
    if isinstance(n.op, EinsumOp):
        return _plan_einsum(n, reads, write, staged)
    if isinstance(n.op, FillOp):
        return _plan_fill(n, write)
    if isinstance(n.op, GatherOp):
        return _plan_gather(n, reads, write, staged)
    if isinstance(n.op, CopyOp):
        return _plan_copy(n, reads, write, staged)
    raise PlanError(f"unknown op {type(n.op).__name__}")


def gathers_packed_rows(n: ApplyNode, table: TensorInfo) -> bool:
    """Whether apply `n` gathers whole packed rows of `table` (its first read, packed with a
    span that leaves out axis 0): then its kernel dequantizes the rows it picks itself (as
    `blockops._gathers_packed_rows` does on the host)."""
    return (isinstance(n.op, GatherOp) and table.storage is not None
            and table.storage.span < len(table.shape))


def _unpack(k: int, read: TensorInfo) -> Unpack:
    """Read `k`, a packed block, dequantized into a slot of its logical block."""
    why = read.storage.fits(tuple(read.shape))
    if why:
        raise PlanError(f"reads %t{read.id}, a {read.storage.format} block "
                        f"{list(read.shape)}: {why}")
    kernel = dequant_kernel(read.storage.format, read.dtype.value)
    return Unpack(k, kernel, math.prod(read.shape) * ITEMSIZE[read.dtype.value])


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
    if product and math.prod(int(sizes[c]) for c in spec.contracted) > SHORT_SUM:
        mm = matmul_plan(spec, [r.shape for r in reads], tags, compute, out_tag, factor,
                         n.accumulate, staged)
        if mm is not None:
            return _matmul_apply(mm, tags, out_tag)
    join, scale = (scalar.product(len(reads)), factor) if product else (op.join, None)
    order = spec.join_indices
    arrays = tuple(ArrayView(k, *operand_layout(term, order, sizes, ITEMSIZE[tags[k]]))
                   for k, term in enumerate(spec.inputs))
    if spec.contracted:
        kernel = reduce_kernel(join, tags, ctype, out_tag, op.agg, scale, combine)
        axes = tuple(range(len(spec.output), len(order)))
        return KernelApply(kernel, arrays, (0,), axes, False, False, staged,
                           _staging(staged, write))
    kernel = join_kernel(join, tags, ctype, out_tag, scale, combine)
    return KernelApply(kernel, arrays, (), None, False, False, staged, _staging(staged, write))


def _matmul_apply(mm: MatmulPlan, tags: tuple[str, ...], out_tag: str) -> MatmulApply:
    first = (tags[1], tags[0]) if mm.swap else tags
    kernels: list[KernelSource] = [convert_kernel(t, mm.ab_tag) for t, o in
                                   zip(first, (mm.left, mm.right)) if o.copy and t != mm.ab_tag]
    epilogue = None
    if not mm.direct:
        epilogue = join_kernel(_X0, (mm.c_tag,), COMPUTE_CTYPE[mm.c_tag], out_tag, None,
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
    combine = "sum" if n.accumulate else None
    ids_view = ArrayView(1, (math.prod(ids.shape),), (8,))
    if gathers_packed_rows(n, table):  # dequantizes only the picked elements: no slot
        why = table.storage.fits(tuple(table.shape))
        if why:
            raise PlanError(f"reads %t{table.id}, a {table.storage.format} block "
                            f"{list(table.shape)}: {why}")
        arrays = (ArrayView(0, (table.storage.nbytes(tuple(table.shape)),), (1,), True),
                  ids_view)
        kernel = dequant_gather_kernel(table.storage.format, write.dtype.value,
                                       table.dtype.value, combine)
    else:
        arrays = (ArrayView(0, (math.prod(table.shape),), (ITEMSIZE[table.dtype.value],)),
                  ids_view)
        kernel = gather_kernel(table.dtype.value, write.dtype.value, combine)
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
    t_strides = contiguous_strides(target, ITEMSIZE[w_tag])
    staged = staged or n.accumulate
    temps = list(_staging(staged, write))
    pieces, boxes = [], []
    for k, p in enumerate(op.pieces):
        if not 0 <= p.src < len(reads):
            raise PlanError(f"copy piece {k} reads block {p.src}; the apply reads {len(reads)}")
        src = reads[p.src]
        s_tag = src.dtype.value
        s_strides = contiguous_strides(src.shape, ITEMSIZE[s_tag])
        s_origin, s_shape = _box(p.src_box, src.shape, f"piece {k} source")
        d_origin, d_shape = _box(p.dst_box, target, f"piece {k} destination")
        if math.prod(s_shape) != math.prod(d_shape):
            raise PlanError(f"copy piece {k}: source box {list(s_shape)} and destination box "
                            f"{list(d_shape)} differ in size")
        view = (s_strides if s_shape == d_shape
                else nocopy_reshape_strides(s_shape, s_strides, d_shape, ITEMSIZE[s_tag]))
        temp = 0 if view is not None else math.prod(s_shape) * ITEMSIZE[s_tag]
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
    """The plan of every apply of `mg` that runs on the device, by node id."""
    return {n.id: plan_apply(mg, n) for n in mg.nodes if isinstance(n, ApplyNode) and not n.on_host}


def slot_bytes(plan: ApplyPlan) -> int:
    """Workspace bytes an apply takes: its dequantized operands and its slots, each 256-byte
    aligned."""
    return (sum(aligned(u.nbytes) for u in plan.unpacks)
            + sum(aligned(t) for t in plan.temps))


def workspace_for(plans: dict[int, ApplyPlan]) -> int:
    return max((slot_bytes(p) for p in plans.values()), default=0) + STATUS_BYTES


def workspace_bytes(mg: MemGraph) -> int:
    """The device bytes the CUDA backend reserves after the arena for `mg`: the most any one
    apply takes (slots are reused from one apply to the next: one stream runs them in order)
    plus the status words. Pure; needs no CuPy."""
    return workspace_for(plan_applies(mg))


def plan_kernels(plan: ApplyPlan) -> tuple[KernelSource, ...]:
    """Every generated kernel an apply plan may run (to compile ahead, or in tests): its
    dequantization kernels first."""
    first = tuple(dict.fromkeys(u.kernel for u in plan.unpacks))
    if isinstance(plan, KernelApply):
        return first + (plan.kernel,)
    if isinstance(plan, MatmulApply):
        return first + plan.kernels
    out = [p.convert for p in plan.pieces if p.convert is not None]
    return first + tuple(out + ([plan.fold] if plan.fold is not None else []))


__all__ = ["STATUS_BYTES", "ApplyPlan", "ArrayView", "CopyApply", "KernelApply", "MatmulApply",
           "PiecePlan", "Unpack", "aligned", "gathers_packed_rows", "overlaps_reads",
           "plan_applies", "plan_apply", "plan_kernels", "slot_bytes", "workspace_bytes",
           "workspace_for"]
