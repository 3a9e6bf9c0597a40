"""One cuBLAS `GemmEx` / `GemmStridedBatchedEx` call from three strided matrices, worked out
without CuPy so that a CPU test checks it (the CuPy backend issues it; `tests/fake_cupy.py` runs
it with cuBLAS's column-major semantics).

`c = alpha * a @ b + beta * c` over row-major shapes `a (batch, m, k)`, `b (batch, k, n)`, `c
(batch, m, n)` (the batch optional), each matrix either row-major (its last stride one element)
or column-major (its second-last stride one element): a transposed view is a transpose flag,
never a copy. cuBLAS is column-major, so the call computes `c^T = b^T a^T`: cuBLAS's first
operand is `b`, its second `a`, and `c` must be row-major (`c^T` column-major).

Operands are f16, bf16, f32 or f64; half operands run on the tensor cores with float32
accumulation (`CUBLAS_COMPUTE_32F`), and their `c` may be the half type or float32. The constants
are the CUDA headers' (`library_types.h`, `cublas_api.h`), stable across CUDA 12 and 13.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from einpage.errors import PlanError

CUDA_R_32F, CUDA_R_64F, CUDA_R_16F, CUDA_R_16BF = 0, 1, 2, 14
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_64F = 68, 70
CUBLAS_GEMM_DEFAULT = -1

#: CUDA data type of each einpage dtype a GEMM operand may have
CUDA_TYPE = {"f16": CUDA_R_16F, "bf16": CUDA_R_16BF, "f32": CUDA_R_32F, "f64": CUDA_R_64F}
#: the `c` types cuBLAS accepts for each operand type (cublasGemmEx's table, compute 32F / 64F)
C_TAGS = {"f16": ("f16", "f32"), "bf16": ("bf16", "f32"), "f32": ("f32",), "f64": ("f64",)}
ITEMSIZE = {"f16": 2, "bf16": 2, "f32": 4, "f64": 8}


def compute_type(ab_tag: str) -> int:
    """cuBLAS's compute type for operands of `ab_tag`: float32 accumulation, float64 for f64."""
    return CUBLAS_COMPUTE_64F if ab_tag == "f64" else CUBLAS_COMPUTE_32F


@dataclass(frozen=True)
class Matrix:
    """A strided (batch of) matrix: row-major `shape` (batch?, rows, cols), byte `strides`."""
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    tag: str


@dataclass(frozen=True)
class GemmCall:
    """The arguments of one cuBLAS call (element counts, as cuBLAS takes them): its first
    operand is `b`, its second `a` (see the module docstring). `batch` 0: plain GemmEx."""
    transa: int
    transb: int
    m: int
    n: int
    k: int
    lda: int
    ldb: int
    ldc: int
    stride_a: int
    stride_b: int
    stride_c: int
    batch: int
    a_type: int
    b_type: int
    c_type: int
    compute: int


def layout(x: Matrix, what: str) -> tuple[int, int, int]:
    """(op, leading dimension, batch stride) in elements of `x` read as cuBLAS reads `x^T`:
    row-major `x` is column-major `x^T` (no transpose), column-major `x` needs one."""
    size = ITEMSIZE[x.tag]
    if any(s % size for s in x.strides):
        raise PlanError(f"gemm {what}: strides {list(x.strides)} are not whole {x.tag} elements")
    rows, cols = x.shape[-2:]
    strides = [s // size for s in x.strides]
    sr, sc = strides[-2], strides[-1]
    batch_stride = strides[0] if x.shape[:-2] else 0
    if sc == 1 or cols == 1:
        ld = sr if rows > 1 else max(cols, 1)
        if ld < max(cols, 1):
            raise PlanError(f"gemm {what}: rows {sr} elements apart overlap {cols} columns")
        return CUBLAS_OP_N, ld, batch_stride
    if sr == 1 or rows == 1:
        ld = sc if cols > 1 else max(rows, 1)
        if ld < max(rows, 1):
            raise PlanError(f"gemm {what}: columns {sc} elements apart overlap {rows} rows")
        return CUBLAS_OP_T, ld, batch_stride
    raise PlanError(f"gemm {what}: shape {list(x.shape)} with strides {list(x.strides)} is "
                    "neither row- nor column-major")


def gemm_call(a: Matrix, b: Matrix, c: Matrix) -> GemmCall:
    """The cuBLAS call computing `c = a @ b` (see the module docstring); raises `PlanError` for
    operands cuBLAS cannot read in place or types it does not combine."""
    if a.tag != b.tag or c.tag not in C_TAGS.get(a.tag, ()):
        raise PlanError(f"gemm of {a.tag} x {b.tag} into {c.tag}: cuBLAS takes operands of one "
                        f"type and c of {' or '.join(C_TAGS.get(a.tag, ('none',)))}")
    if not len(a.shape) == len(b.shape) == len(c.shape) in (2, 3):
        raise PlanError(f"gemm of {len(a.shape)}-d x {len(b.shape)}-d into {len(c.shape)}-d")
    m, k = a.shape[-2:]
    k2, n = b.shape[-2:]
    if k != k2 or c.shape[-2:] != (m, n) or a.shape[:-2] != b.shape[:-2] != c.shape[:-2]:
        raise PlanError(f"gemm shapes {list(a.shape)} x {list(b.shape)} -> {list(c.shape)}")
    op_b, ld_b, stride_b = layout(b, "b")
    op_a, ld_a, stride_a = layout(a, "a")
    op_c, ld_c, stride_c = layout(c, "c")
    if op_c != CUBLAS_OP_N:
        raise PlanError(f"gemm c: shape {list(c.shape)} with strides {list(c.strides)} is not "
                        "row-major")
    batch = a.shape[0] if len(a.shape) == 3 else 0
    return GemmCall(op_b, op_a, n, m, k, ld_b, ld_a, ld_c, stride_b, stride_a, stride_c, batch,
                    CUDA_TYPE[b.tag], CUDA_TYPE[a.tag], CUDA_TYPE[c.tag], compute_type(a.tag))


def matrix(shape: Sequence[int], strides: Sequence[int], tag: str) -> Matrix:
    return Matrix(tuple(int(s) for s in shape), tuple(int(s) for s in strides), tag)




__all__ = ["C_TAGS", "CUBLAS_COMPUTE_64F", "CUBLAS_GEMM_DEFAULT", "CUBLAS_OP_N", "CUDA_TYPE",
           "GemmCall", "Matrix", "compute_type", "gemm_call", "layout", "matrix"]
