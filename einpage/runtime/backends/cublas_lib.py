"""The cuBLAS calls the CuPy backend makes through ctypes, on the libcublas CuPy loaded (found in
`/proc/self/maps`, so the handle CuPy made goes to the same library): `cublasSetWorkspace`,
which CuPy 14 does not wrap, and `cublasSetStream` / `cublasGemmEx` /
`cublasGemmStridedBatchedEx`, because CuPy's wrappers refuse to run while a stream captures a
CUDA graph (they reset the handle's stream, which capture forbids): the backend sets the compute
thread's handle's stream once, and every GEMM then runs on it, captured or not.

`tests/fake_cupy.py` stands in for these functions on a machine without a GPU.
"""
from __future__ import annotations

import ctypes
import functools

import numpy as np

from einpage.errors import BackendError
from einpage.runtime.backends.gemm_call import CUBLAS_COMPUTE_64F, CUBLAS_GEMM_DEFAULT, GemmCall

_P, _I, _LL = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong


@functools.lru_cache(maxsize=None)
def _lib() -> ctypes.CDLL:
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps
                            if "/libcublas.so" in line})
    except OSError as exc:
        raise BackendError(f"cannot find the loaded libcublas: {exc}") from None
    if not paths:
        raise BackendError("libcublas is not loaded (no cuBLAS handle made yet)")
    lib = ctypes.CDLL(paths[0])
    lib.cublasSetWorkspace_v2.argtypes = (_P, _P, ctypes.c_size_t)
    lib.cublasSetStream_v2.argtypes = (_P, _P)
    lib.cublasGemmEx.argtypes = (_P, _I, _I, _I, _I, _I, _P, _P, _I, _I, _P, _I, _I, _P, _P,
                                 _I, _I, _I, _I)
    lib.cublasGemmStridedBatchedEx.argtypes = (_P, _I, _I, _I, _I, _I, _P, _P, _I, _I, _LL, _P,
                                               _I, _I, _LL, _P, _P, _I, _I, _LL, _I, _I, _I)
    for fn in (lib.cublasSetWorkspace_v2, lib.cublasSetStream_v2, lib.cublasGemmEx,
               lib.cublasGemmStridedBatchedEx):
        fn.restype = _I
    return lib


def _check(status: int, what: str) -> None:
    if status != 0:
        raise BackendError(f"{what} failed with cuBLAS status {status}")


def set_workspace(handle: int, ptr: int, nbytes: int) -> None:
    """cublasSetWorkspace: cuBLAS takes its workspace from `[ptr, ptr + nbytes)` (256-aligned)
    and allocates none of its own."""
    _check(_lib().cublasSetWorkspace_v2(handle, ptr, nbytes), "cublasSetWorkspace")


def set_stream(handle: int, stream: int) -> None:
    """cublasSetStream: the handle's GEMMs run on `stream` (a `cupy.cuda.Stream.ptr`)."""
    _check(_lib().cublasSetStream_v2(handle, stream), "cublasSetStream")


def gemm(handle: int, call: GemmCall, a: int, b: int, c: int, alpha: float,
         beta: float) -> None:
    """Issue `call` (`c = alpha * a @ b + beta * c`, `gemm_call`) on the handle's stream. alpha
    and beta are host scalars of the compute type, read before the call returns (captured by
    value in a CUDA graph)."""
    scalar = np.float64 if call.compute == CUBLAS_COMPUTE_64F else np.float32
    scalars = np.array([alpha, beta], scalar)
    al, be = scalars.ctypes.data, scalars.ctypes.data + scalars.itemsize
    lib = _lib()
    if call.batch:
        status = lib.cublasGemmStridedBatchedEx(
            handle, call.transa, call.transb, call.m, call.n, call.k, al, b, call.a_type,
            call.lda, call.stride_a, a, call.b_type, call.ldb, call.stride_b, be, c,
            call.c_type, call.ldc, call.stride_c, call.batch, call.compute, CUBLAS_GEMM_DEFAULT)
    else:
        status = lib.cublasGemmEx(
            handle, call.transa, call.transb, call.m, call.n, call.k, al, b, call.a_type,
            call.lda, a, call.b_type, call.ldb, be, c, call.c_type, call.ldc, call.compute,
            CUBLAS_GEMM_DEFAULT)
    _check(status, "cublasGemmEx")


__all__ = ["gemm", "set_stream", "set_workspace"]
