"""What `einpage calibrate --backend cupy` measures on an NVIDIA GPU, through the CuPy backend's own
paths (`einpage.calibrate` fits the device profile from it; `ThreadsProbe` there is the CPU
counterpart with the same interface).

Every measurement runs on one non-blocking stream and is timed by CUDA events around the work
(`cupy.cuda.get_elapsed_time`): one warm-up (which also compiles a generated kernel and creates
the cuBLAS handle), then the median of several repeats.

- `h2d(n)` / `d2h(n)`: an async copy of `n` bytes between one pinned host buffer
  (`cupy.cuda.PinnedMemory`, as the backend's) and a raw device allocation (`cupy.cuda.Memory`).
- `memory_bandwidth()`: a device-to-device copy, read plus write: `2 * bytes / seconds`.
- `matmul_flops(dtype)`: one cuBLAS GemmEx of `n x n` matrices, as the backend issues it
  (`gemm_call`), `2 n^3` FLOPs: f16 and bf16 on the tensor cores with float32 accumulation,
  f32 and f64 natively.
- `vector_flops()`: the generated elementwise kernel of `x0 + x1` over float32, counted as the
  cost model counts a join (one FLOP per operand per element).
- `memory_bytes()`: the device's total memory; `describe()`: its name and memory.

CuPy is imported only when a probe is made; where no GPU is usable that raises `BackendError`.
"""
from __future__ import annotations

import statistics
from typing import Any, Callable

from einpage.errors import BackendError
from einpage.ir import scalar
from einpage.runtime.backends.cuda import _unusable_reason
from einpage.runtime.backends.cuda_apply import compiled
from einpage.runtime.backends.cuda_source import DEVICE_DTYPE, reduce_kernel
from einpage.runtime.backends import cublas_lib
from einpage.runtime.backends.gemm_call import gemm_call, matrix

#: timed repeats after the warm-up (their median is the measurement)
REPEATS = 5
_DTYPES = ("f16", "bf16", "f32", "f64")
#: launches per timed sample of the bandwidth and FLOP/s probes (`CupyProbe._seconds`)
_BATCH = 8


class CupyProbe:
    """The CuPy backend's paths on CUDA device `device`. Raises `BackendError` where no GPU is
    usable (CuPy missing, no driver, no such device) or the probe's buffers cannot be made."""

    name = "cupy"

    def __init__(self, device: int = 0, repeats: int = REPEATS):
        reason = _unusable_reason(device)
        if reason is not None:
            raise BackendError(f"--backend cupy: no usable CUDA GPU ({reason})")
        import cupy
        self._cp = cupy
        self.device_id = device
        self.repeats = repeats
        self._device = cupy.cuda.Device(device)
        self._pinned: Any = None     # the pinned host buffer and its device twin, grown on demand
        self._pinned_ptr = 0
        self._linked: Any = None
        self._capacity = 0
        try:
            with self._device:
                self._stream = cupy.cuda.Stream(non_blocking=True)
        except Exception as exc:  # a CUDA error: the GPU is listed but cannot be used
            raise BackendError(f"--backend cupy: cannot use CUDA device {device}: "
                               f"{type(exc).__name__}: {exc}") from None

    # ------------------------------------------------------------------ timing
    def _seconds(self, issue: Callable[[], object], batch: int = 1) -> float:
        """Median seconds of `issue()` on the probe's stream (current while it runs), after a
        warm-up, between two timing events. With `batch` > 1 each sample issues it `batch`
        times back to back and counts one: the device then runs them without waiting for the
        host between (a lone launch on an idle stream also times the host's issue after the
        start event: the first H200 calibration priced a 16 M-element add at 88 us, 2.2 TB/s,
        for 47 us of memory traffic)."""
        cp, stream = self._cp, self._stream
        times = []
        with self._device, stream:
            issue()
            for _ in range(self.repeats):
                start, end = cp.cuda.Event(), cp.cuda.Event()
                start.record(stream)
                for _ in range(batch):
                    issue()
                end.record(stream)
                end.synchronize()
                times.append(cp.cuda.get_elapsed_time(start, end) / 1000.0 / batch)
        return statistics.median(times)

    # ------------------------------------------------------------------ copies
    def _link(self, n: int) -> tuple[int, Any]:
        """(pinned host address, device pointer) of buffers of at least `n` bytes."""
        if n > self._capacity:
            cp = self._cp
            self._pinned = self._linked = None
            with self._device:
                self._pinned = cp.cuda.PinnedMemory(n)
                self._pinned_ptr = int(self._pinned.ptr)
                self._linked = cp.cuda.MemoryPointer(cp.cuda.Memory(n), 0)
            self._capacity = n
        return self._pinned_ptr, self._linked

    def h2d(self, n: int) -> float:
        host, dev = self._link(n)
        return self._seconds(lambda: dev.copy_from_host_async(host, n, self._stream))

    def d2h(self, n: int) -> float:
        host, dev = self._link(n)
        return self._seconds(lambda: dev.copy_to_host_async(host, n, self._stream))

    def memory_bandwidth(self, n: int = 1 << 28) -> float:
        cp = self._cp
        with self._device:
            src = cp.cuda.MemoryPointer(cp.cuda.Memory(n), 0)
            dst = cp.cuda.MemoryPointer(cp.cuda.Memory(n), 0)
        return 2 * n / self._seconds(lambda: dst.copy_from_device_async(src, n, self._stream),
                                     _BATCH)

    # ------------------------------------------------------------------ compute
    def matmul_flops(self, dtype: str, n: int = 4096) -> float:
        """FLOP/s of an `n x n` by `n x n` product in `dtype` (f16, bf16, f32, f64) as the
        backend runs it: one cuBLAS GemmEx (`gemm_call`), half operands on the tensor cores
        accumulated in float32, into `c` of the operands' type."""
        if dtype not in _DTYPES:
            raise BackendError(f"no matmul for dtype {dtype!r}; expected one of {_DTYPES}")
        cp = self._cp
        with self._device, self._stream:
            a, b, c = (cp.random.standard_normal((n, n), dtype=cp.float32) for _ in range(3))
            if dtype == "bf16":
                a, b, c = (_bf16_bits(cp, x) for x in (a, b, c))
            else:
                a, b, c = (x.astype(DEVICE_DTYPE[dtype]) for x in (a, b, c))
            call = gemm_call(*(matrix(x.shape, x.strides, dtype) for x in (a, b, c)))
            handle = cp.cuda.device.get_cublas_handle()
            cublas_lib.set_stream(handle, self._stream.ptr)
            self._stream.synchronize()

        def run():
            cublas_lib.gemm(handle, call, a.data.ptr, b.data.ptr, c.data.ptr, 1.0, 0.0)
        return 2.0 * n ** 3 / self._seconds(run, _BATCH)

    def vector_flops(self, n: int = 1 << 13) -> float:
        """The rate of the model's elementwise FLOPs (one per element per operand:
        `predict.cost.op_work`) where memory does not bind: the generated reduction of
        `exp(x0 - x1)` over `j` of `x0[j]` and `x1[i]`, both broadcast over an `n x n` space
        (a softmax's row sum, its operands read from cache), 2 n^2 FLOPs. An elementwise
        kernel over arrays in device memory is priced by the bytes it moves
        (`hbm_bandwidth`); this is the other term of the model's max."""
        cp = self._cp
        total = compiled(reduce_kernel(scalar.exp(scalar.x(0) - scalar.x(1)), ("f32", "f32"),
                                       "float", "f32", "sum"))
        with self._device, self._stream:
            row = cp.random.standard_normal(n, dtype=cp.float32)
            col = cp.random.standard_normal(n, dtype=cp.float32)
            a0 = cp.ndarray((n, n), cp.float32, memptr=row.data, strides=(0, 4))
            a1 = cp.ndarray((n, n), cp.float32, memptr=col.data, strides=(4, 0))
            y = cp.empty(n, cp.float32)
            self._stream.synchronize()
        return 2.0 * n * n / self._seconds(lambda: total(a0, a1, 0, out=y, axis=(1,)), _BATCH)

    # ------------------------------------------------------------------ the device
    def _properties(self) -> dict:
        return self._cp.cuda.runtime.getDeviceProperties(self.device_id)

    def memory_bytes(self) -> int:
        return int(self._properties()["totalGlobalMem"])

    def describe(self) -> str:
        props = self._properties()
        name = props.get("name", b"CUDA device")
        if isinstance(name, bytes):
            name = name.decode(errors="replace")
        return f"{name}, {int(props['totalGlobalMem']) / 2 ** 30:.0f} GiB"

    def close(self) -> None:
        """Wait for the stream, then release the buffers (idempotent)."""
        try:
            self._stream.synchronize()
        except Exception:  # a device error was reported by the measurement that caused it
            pass
        self._pinned = self._linked = None
        self._pinned_ptr = self._capacity = 0


def _bf16_bits(cp, x):
    """bf16 bits (as the backend stores bf16: `uint16`) of float32 `x`, truncated."""
    return (x.view(cp.uint32) >> 16).astype(cp.uint16)


__all__ = ["REPEATS", "CupyProbe"]
