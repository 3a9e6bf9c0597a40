"""How the CuPy backend runs one planned apply on the device, on the compute queue: the
generated kernels (`compiled`: one CuPy kernel object per source, made once per process), the
copy pieces, and GEMMs through `execute_matmul` with `DeviceMatmulOps` (workspace slots,
conversions, one cuBLAS call per GEMM through `cublas_lib`, the epilogue kernel).

A plan's packed reads (`Unpack`) are dequantized first, each by its kernel into the next
workspace slot (`_bump`, on the compute stream, so in the apply's own stream order and in a
captured CUDA graph); the op's views of that read then start at the slot instead of the arena.
A gather of a packed table (`ArrayView.packed`) reads the packed bytes where they are instead.

A guarded apply (a mixture-of-experts task) first reads its guard block to the host, once per
pass per block (a synchronisation of the compute stream): off, it runs nothing but a memset of
a block it would create. A pass with guards is therefore never captured as a CUDA graph.

`DeviceApplies` is the part of `CupyBackend` that does it; it reads the backend's plan
(`mg`, `_plans`), its arena views (`_array`, `_instance`, `_at`, `_bump`, `_temp`), the compute
thread's cuBLAS handle (`_handle`) and whether `open` is warming the kernels up (`_warming`).
"""
from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np

from einpage.errors import PlanError
from einpage.ir.memgraph import Access, ApplyNode, ReloadNode
from einpage.runtime.backends import cublas_lib
from einpage.runtime.backends.apply_plan import CopyApply, KernelApply, MatmulApply
from einpage.runtime.backends.cuda_source import (DEVICE_DTYPE, NVRTC_OPTIONS, ElementwiseSource,
                                                  KernelSource, convert_kernel, tag_of)
from einpage.runtime.backends.gemm_call import GemmCall, gemm_call, matrix
from einpage.runtime.backends.gemm_plan import MatmulOps, execute_matmul

#: the CuPy kernel object of every generated source made in this process
KERNELS: dict[KernelSource, Any] = {}
KERNELS_LOCK = threading.Lock()


def compiled(src: KernelSource) -> Any:
    """The CuPy kernel object for a source, made once per process (CuPy compiles it on the
    first call for each argument layout and caches the binary on disk)."""
    kernel = KERNELS.get(src)
    if kernel is None:
        import cupy
        if isinstance(src, ElementwiseSource):
            kernel = cupy.ElementwiseKernel(src.in_params, src.out_params, src.operation,
                                            name=src.name, preamble=src.preamble, no_return=True,
                                            options=NVRTC_OPTIONS)
        else:
            kernel = cupy.ReductionKernel(src.in_params, src.out_params, src.map_expr,
                                          src.reduce_expr, src.post_map_expr, src.identity,
                                          name=src.name, reduce_type=src.reduce_type,
                                          preamble=src.preamble, options=NVRTC_OPTIONS)
        with KERNELS_LOCK:
            kernel = KERNELS.setdefault(src, kernel)
    return kernel


class DeviceApplies:
    """Runs apply nodes by their plans (mixed into `CupyBackend`). `_gemm_calls`: the cuBLAS
    call of each GEMM plan, made at its first run."""

    _gemm_calls: dict[MatmulApply, GemmCall]
    #: the workspace slot each dequantized read of the running apply is in (by read index)
    _unpacked: dict[int, Any]
    #: the guard blocks read this pass, by tensor (`_guard_on`)
    _guards: dict[int, np.ndarray]

    def _apply(self, n: ApplyNode) -> None:
        plan = self._plans[n.id]
        if n.guard is not None:
            if not (self._warming or self._guard_on(n)):
                if not n.accumulate:  # skipped: a block it would create is all zeros
                    ptr, nbytes = self._instance(n.write.tensor, n.write.offset)
                    ptr.memset_async(0, nbytes, self._streams["compute"])
                return
            n = n.unguarded()
        self._top = 0
        try:
            self._unpacked = self._unpack(plan, n) if plan.unpacks else {}
            write = self._array(n.write.tensor, n.write.offset)
            if isinstance(plan, MatmulApply):
                a, b = (self._operand(n, k) for k in range(len(n.reads)))
                execute_matmul(plan.plan, DeviceMatmulOps(self, plan), a, b, write)
            elif isinstance(plan, KernelApply):
                self._run_kernel(plan, n, write)
            elif isinstance(plan, CopyApply):
                self._run_copy(plan, n, write)
            else:
                raise PlanError(f"apply %{n.id}: no plan")
        finally:
            self._top = 0
            self._unpacked = {}

    def _guard_on(self, n: ApplyNode) -> bool:
        """Whether a guarded apply's guard element is nonzero: its guard block, copied to the
        host once per pass (a guard block is written once per pass and read only when
        complete), which waits for the compute stream's work before it."""
        return bool(self._guard_values(n.reads[-1], "compute").flat[n.guard.index])

    def guard_on(self, n: ReloadNode) -> bool:
        """Whether guarded reload `n` copies: its guard block copied to the host on the stream
        of the copy queue that runs `n` (h2d, or h2d_host: `streams.queues_of`), which has
        waited for the guard's writers (the same values a guarded apply reads: the validator's
        rule 11 gives both the same version of the block)."""
        return bool(self._guard_values(n.guard.access, self._copy_queue()).flat[n.guard.index])

    def _guard_values(self, access: Access, queue: str) -> np.ndarray:
        """Guard block `access` on the host, copied once per pass on `queue`'s stream."""
        values = self._guards.get(access.tensor)
        if values is None:
            src, nbytes = self._instance(access.tensor, access.offset)
            t = self.mg.tensors[access.tensor]
            values = np.empty(tuple(t.shape), DEVICE_DTYPE[t.dtype.value])
            # into pageable memory: returns once the copy is complete
            src.copy_to_host_async(values.ctypes.data, nbytes, self._streams[queue])
            self._guards[access.tensor] = values
        return values

    def _unpack(self, plan, n: ApplyNode) -> dict[int, Any]:
        """Dequantize the plan's packed reads, each into the next workspace slot: their
        pointers by read index."""
        cp, out = self._cp, {}
        for u in plan.unpacks:
            read = n.reads[u.read]
            t = self.mg.tensors[read.tensor]
            src, nbytes = self._instance(read.tensor, read.offset)
            slot = self._bump(u.nbytes)
            packed = cp.ndarray((nbytes,), np.uint8, memptr=src)
            logical = cp.ndarray((math.prod(t.shape),), DEVICE_DTYPE[t.dtype.value],
                                 memptr=slot)
            compiled(u.kernel)(packed, logical)
            out[u.read] = slot
        return out

    def _operand(self, n: ApplyNode, k: int) -> Any:
        """Read `k` of the apply as a C-contiguous array of its logical block: its instance,
        or the slot it was dequantized into."""
        slot = self._unpacked.get(k)
        if slot is None:
            read = n.reads[k]
            return self._array(read.tensor, read.offset)
        t = self.mg.tensors[n.reads[k].tensor]
        return self._cp.ndarray(tuple(t.shape), DEVICE_DTYPE[t.dtype.value], memptr=slot)

    def _view(self, n: ApplyNode, k: int, shape, strides, offset: int = 0,
              packed: bool = False) -> Any:
        """Read `k` of the apply viewed with `shape` and byte `strides` from byte `offset` of
        its instance (or of the slot it was dequantized into); `packed`: its packed bytes, as
        `uint8`, read where they are (a gather dequantizing the rows it picks)."""
        read = n.reads[k]
        ptr = None if packed else self._unpacked.get(k)
        if ptr is None:
            ptr, _ = self._instance(read.tensor, read.offset)
        dtype = (np.dtype(np.uint8) if packed
                 else DEVICE_DTYPE[self.mg.tensors[read.tensor].dtype.value])
        return self._cp.ndarray(tuple(shape), dtype, memptr=ptr + offset,
                                strides=tuple(strides))

    def _run_kernel(self, plan: KernelApply, n: ApplyNode, write: Any) -> None:
        cp = self._cp
        target = write
        if plan.staged:
            target = self._temp(write.shape, write.dtype)
            if n.accumulate:
                cp.copyto(target, write)
        args = [self._view(n, v.read, v.shape, v.strides, packed=v.packed) for v in plan.arrays]
        args += list(plan.scalars)
        out = cp.ndarray((target.size,), target.dtype, memptr=target.data) if plan.flat \
            else target
        kernel = compiled(plan.kernel)
        if plan.axes is not None:
            kernel(*args, out=out, axis=plan.axes)
        elif plan.status:
            status = cp.ndarray((3,), np.int64, memptr=self._at("status", 0))
            kernel(*args, out, status)
        else:
            kernel(*args, out)
        if plan.staged:
            cp.copyto(write, target)

    def _run_copy(self, plan: CopyApply, n: ApplyNode, write: Any) -> None:
        cp = self._cp
        target = self._temp(write.shape, write.dtype) if plan.staged else write
        if plan.zero:
            target.data.memset_async(0, target.nbytes)
        wdt = write.dtype
        for p in plan.pieces:
            if p.src_view is None:
                box = self._view(n, p.src, p.src_shape, p.src_strides, p.src_offset)
                slot = self._temp(p.src_shape, box.dtype)
                cp.copyto(slot, box)
                src = cp.ndarray(p.dst_shape, box.dtype, memptr=slot.data)
            else:
                src = self._view(n, p.src, p.dst_shape, p.src_view, p.src_offset)
            dst = cp.ndarray(p.dst_shape, wdt, memptr=target.data + p.dst_offset,
                             strides=p.dst_strides)
            if p.convert is not None:
                compiled(p.convert)(src, dst)
            else:
                cp.copyto(dst, src)
        if plan.staged:
            if plan.fold is not None:
                compiled(plan.fold)(target, write)
            else:
                cp.copyto(write, target)


class DeviceMatmulOps(MatmulOps):
    """`execute_matmul` on the GPU: slots from the workspace, conversions by `copyto` or a
    generated kernel, the GEMM by cuBLAS GemmEx on the current stream, the apply's epilogue
    kernel."""

    def __init__(self, backend: DeviceApplies, apply: MatmulApply):
        super().__init__(backend._cp, apply.plan)
        self.backend, self.apply = backend, apply

    def temp(self, shape, tag):
        return self.backend._temp(shape, DEVICE_DTYPE[tag])

    def copy(self, dst, src) -> None:
        if dst.dtype == src.dtype:
            self.xp.copyto(dst, src)
        else:
            compiled(convert_kernel(tag_of(src.dtype), tag_of(dst.dtype)))(src, dst)

    def matmul(self, lhs, rhs, out) -> None:
        if self.backend._warming:
            return  # cuBLAS compiles nothing; the arena holds nothing yet
        plan = self.plan
        call = self.backend._gemm_calls.get(self.apply)
        if call is None:  # the same views every pass: worked out once per apply plan
            call = self.backend._gemm_calls[self.apply] = gemm_call(
                matrix(lhs.shape, lhs.strides, plan.ab_tag),
                matrix(rhs.shape, rhs.strides, plan.ab_tag),
                matrix(out.shape, out.strides, plan.c_tag))
        cublas_lib.gemm(self.backend._handle, call, lhs.data.ptr, rhs.data.ptr, out.data.ptr,
                        plan.alpha, plan.beta)

    def epilogue(self, dst, src) -> None:
        compiled(self.apply.epilogue)(src, dst)


__all__ = ["DeviceApplies", "DeviceMatmulOps", "KERNELS", "compiled"]
