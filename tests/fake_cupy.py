"""A host stand-in for CuPy, for the CuPy backend's tests (`test_cuda_source`,
`test_cuda_backend`): `FakeCupy` is the part of the CuPy v14.2.0 API the backend calls (and the
cuBLAS calls the backend makes through ctypes, `cublas_lib`), over raw host memory, asynchronous
and checked as a device is (see `FakeCupy`); its `ElementwiseKernel` / `ReductionKernel` compile
the generated CUDA C for the host with g++ (`host_kernels`); its streams, errors and CUDA graphs
are `fake_streams`; its memory pointers, device arrays and kernels `fake_device`.

`installed(monkeypatch, tmp_path_factory)` is a fixture body: `FakeCupy` as `sys.modules["cupy"]`
for one test, with the backend's caches of CuPy objects cleared around it (skips without g++);
`install(kernels)` does the same for a script.
"""
from __future__ import annotations

import ctypes
import math
import random
import sys
import threading
import time
import types
import weakref
from typing import Iterator

import ml_dtypes
import numpy as np
import pytest

from einpage.runtime.backends import cublas_lib, cuda, cuda_apply, cuda_source, gemm_plan

from fake_device import Pointer, Raw, _aligned_buffer, _Array, _FakeKernel
from fake_streams import CUBLASError, CUDARuntimeError, _Capture, _Graph, _Queue
from host_kernels import CXX, HostKernels

# ---------------------------------------------------------------------- a stand-in for CuPy

#: what the stand-in charges for the CUDA context and a cuBLAS handle on a device
CONTEXT_BYTES = 300 << 20
HANDLE_BYTES = 4 << 20
#: cuBLAS's own workspace, allocated at a handle's first GEMM unless one was set
CUBLAS_DEFAULT_WORKSPACE = 32 << 20
#: cudaMalloc's granularity
ALLOC_GRANULE = 2 << 20
MEMCPY_H2D, MEMCPY_D2H = 1, 2  # cudaMemcpyKind (CuPy: runtime.memcpyHostToDevice, ...)


class FakeCupy(types.ModuleType):
    """The CuPy v14.2.0 API the backend calls, on the host, asynchronous as a device is: each
    stream runs its work later on its own worker thread with seeded random delays (`seed`,
    `max_delay` seconds), events order them, and the host sees results only after it
    synchronizes. It checks what CUDA and cuBLAS would reject, raising their errors:

    - device memory: raw allocations (`Memory`, 256-aligned, charged in 2 MiB granules against
      `total` bytes per device, after the context); every copy, memset, kernel operand and GEMM
      operand must lie inside a live allocation; every region (`UnownedMemory`) starts
      256-aligned, every view at a multiple of its element size;
    - streams and devices: work is never issued on the legacy null stream nor on a stream of
      another device than the current one (a kernel launch fails there), events are recorded
      only on streams of their own device; a device fault is sticky: every later call raises;
    - host memory: copies with pinned memory (`PinnedMemory`) run in order on their stream and
      read or write the host bytes when they run; copies with pageable memory synchronize and
      are counted (`pageable_copies`);
    - kernels: compiled once per (kernel, argument types, ndim) with the NVRTC options the
      backend passes (counted in `compiles`); cuBLAS: GemmEx / GemmStridedBatchedEx with
      column-major semantics, leading dimensions and alignment checked, on the calling thread's
      current stream through a handle made per thread and device; a handle without a
      workspace set (`cublas_set_workspace`) allocates cuBLAS's own at its first GEMM.

    Where real CuPy would allocate a temporary (arrays made without `memptr`) it allocates
    through the thread's allocator, so a test sees it."""

    def __init__(self, host: HostKernels, seed: int = 0, max_delay: float = 2e-4,
                 devices: int = 1, total: int = 80 << 30):
        super().__init__("cupy")
        self.host = host
        self.seed, self.max_delay = seed, max_delay
        self.live = weakref.WeakSet()   # raw device allocations not yet freed
        self.pinned_live = weakref.WeakSet()
        self.sticky: CUDARuntimeError | None = None
        self.pageable_copies = 0
        self.compiles: dict[tuple, tuple[str, ...]] = {}
        self.gemms = 0
        self.total = total
        self.used = [0] * devices          # bytes taken per device (context, handles, memory)
        self.contexts = [False] * devices
        self.allocations: dict[int, tuple[int, int]] = {}   # start -> (end, device)
        self.pinned: dict[int, int] = {}                     # start -> end
        self.handles: dict[tuple[int, int], dict] = {}       # (thread, device) -> handle state
        self._streams = 0
        self.queues = weakref.WeakSet()
        self.streams = weakref.WeakSet()
        self._lock = threading.Lock()
        tls = self._tls = threading.local()
        fake = self

        def current_device() -> int:
            return getattr(tls, "device", [0])[-1] if getattr(tls, "device", None) else 0

        self.current_device = current_device

        class Memory:
            def __init__(self, size):
                fake._check_sticky()
                self.device_id = current_device()
                self.size = int(size)
                fake._charge(self.device_id, -(-max(self.size, 1) // ALLOC_GRANULE)
                             * ALLOC_GRANULE)
                self.buf, self.ptr = _aligned_buffer(self.size)
                fake.allocations[self.ptr] = (self.ptr + self.size, self.device_id)
                fake.live.add(self)
                weakref.finalize(self, fake._release, self.ptr, self.device_id,
                                 -(-max(self.size, 1) // ALLOC_GRANULE) * ALLOC_GRANULE)

        class PinnedMemory:
            def __init__(self, size):
                fake._check_sticky()
                self.size = int(size)
                self.buf, self.ptr = _aligned_buffer(self.size, 4096)
                fake.pinned[self.ptr] = self.ptr + self.size
                fake.pinned_live.add(self)
                weakref.finalize(self, fake.pinned.pop, self.ptr, None)

        class UnownedMemory:
            def __init__(self, ptr, size, owner, device_id=-1):
                assert ptr % 256 == 0, f"a region at {ptr:#x} is not 256-byte aligned"
                fake._device_range(ptr, size, "a region")
                self.ptr, self.size, self.owner = ptr, size, owner
                self.device_id = device_id

        def unsupported(what):
            return CUDARuntimeError("cudaErrorStreamCaptureUnsupported",
                                    f"{what} while a stream captures")

        class Stream:
            def __init__(self, null=False, non_blocking=False, ptds=False, priority=None):
                assert non_blocking and not null, "the backend's streams are non-blocking"
                fake._check_sticky()
                self.device_id = current_device()
                fake._streams += 1
                self.ptr = 0x5000 + fake._streams
                self.queue = _Queue(fake, random.Random(fake.seed * 1009 + fake._streams))
                self.capture: _Capture | None = None
                fake.queues.add(self.queue)
                fake.streams.add(self)
                weakref.finalize(self, self.queue.stop)

            def put(self, fn, work: bool = True):
                """Issue `fn`: queued, or recorded into the graph this stream captures."""
                if self.capture is not None:
                    self.capture.ops[self].append(("op", fn, work))
                    return None
                return self.queue.put(fn, work)

            def __enter__(self):
                tls.__dict__.setdefault("streams", []).append(self)
                return self

            def __exit__(self, *exc):
                tls.streams.pop()
                return False

            def synchronize(self):
                if self.capture is not None:
                    raise unsupported("a stream synchronize")
                self.queue.drain()
                fake._check_sticky()

            @property
            def done(self):
                return self.queue.completed >= self.queue.issued

            def wait_event(self, event):
                fake._check_sticky()
                target = event.target
                if target is None:  # an event never recorded is complete
                    return
                if target[0] == "captured":  # this stream joins the capture
                    capture = target[1]
                    if self.capture is None:
                        self.capture = capture
                        capture.ops.setdefault(self, [])
                    capture.ops[self].append(("wait", target[2]))
                    return
                if self.capture is not None:
                    raise CUDARuntimeError("cudaErrorStreamCaptureIsolation",
                                           "a captured stream waits on an event from outside")
                self.queue.put(lambda: target[0].wait_for(target[1]), work=False)

            def record(self, event=None):
                event = Event() if event is None else event
                event.record(self)
                return event

            def begin_capture(self, mode=None):
                assert self.capture is None, "already capturing"
                self.capture = _Capture(self)

            def end_capture(self):
                capture = self.capture
                assert capture is not None and capture.origin is self, "not capturing here"
                for stream in capture.ops:
                    stream.capture = None
                capture.check_joined()
                return _Graph(fake, capture)

            def is_capturing(self):
                return self.capture is not None

        class Event:
            def __init__(self, block=False, disable_timing=False, interprocess=False):
                fake._check_sticky()
                self.device_id = current_device()
                self.timing = not disable_timing
                self.target = None
                self.t = None

            def record(self, stream=None):
                stream = fake._stream(stream)
                if stream.device_id != self.device_id:
                    raise CUDARuntimeError("cudaErrorInvalidResourceHandle",
                                           "invalid resource handle")
                self.t = None
                if stream.capture is not None:
                    capture = stream.capture
                    token = len(capture.tokens)
                    capture.tokens.append(stream)
                    capture.ops[stream].append(("record", token))
                    self.target = ("captured", capture, token)
                    return

                def stamp():
                    self.t = time.perf_counter()
                self.target = (stream.queue, stream.queue.put(stamp, work=False))

            def synchronize(self):
                if self.target is not None:
                    if self.target[0] == "captured":
                        raise unsupported("an event synchronize on a captured event")
                    self.target[0].wait_for(self.target[1])
                fake._check_sticky()

            @property
            def done(self):
                if self.target is not None and self.target[0] == "captured":
                    raise unsupported("an event query on a captured event")
                return self.target is None or self.target[0].completed >= self.target[1]

        class Device:
            def __init__(self, device=None):
                self.id = current_device() if device is None else int(device)

            def __enter__(self):
                if not 0 <= self.id < len(fake.used):
                    raise CUDARuntimeError("cudaErrorInvalidDevice", "invalid device ordinal")
                tls.__dict__.setdefault("device", []).append(self.id)
                fake._context(self.id)
                return self

            def __exit__(self, *exc):
                tls.device.pop()
                return False

        class MemoryHook:
            name = "MemoryHook"

            def __enter__(self):
                hooks = tls.__dict__.setdefault("hooks", {})
                assert self.name not in hooks
                hooks[self.name] = self
                return self

            def __exit__(self, *exc):
                del tls.hooks[self.name]

        def get_elapsed_time(a, b):
            assert a.timing and b.timing, "timing needs events made without disable_timing"
            for e in (a, b):
                if e.t is None:
                    raise CUDARuntimeError("cudaErrorNotReady", "device not ready")
            return (b.t - a.t) * 1000.0

        class using_allocator:
            def __init__(self, allocator=None):
                self.allocator = allocator

            def __enter__(self):
                self.previous = getattr(tls, "allocator", None)
                tls.allocator = self.allocator

            def __exit__(self, *exc):
                tls.allocator = self.previous

        def alloc(nbytes):
            allocator = getattr(tls, "allocator", None)
            if allocator is not None:
                return allocator(nbytes)
            for hook in getattr(tls, "hooks", {}).values():
                hook.malloc_preprocess(device_id=0, size=nbytes, mem_size=nbytes)
            mem = Memory(nbytes)
            return Pointer(fake, mem, 0)

        def mem_get_info():
            device = current_device()
            fake._context(device)
            return fake.total - fake.used[device], fake.total

        def get_cublas_handle():
            device = current_device()
            fake._context(device)
            key = (threading.get_ident(), device)
            with fake._lock:
                if key not in fake.handles:
                    fake.handles[key] = {"id": 0x7000 + len(fake.handles), "device": device,
                                         "workspace": None, "own_workspace": False}
                    fake.used[device] += HANDLE_BYTES
                return fake.handles[key]["id"]

        def memcpy_async(dst, src, size, kind, stream_ptr):
            """cudaMemcpyAsync between host and device on the stream whose handle is
            `stream_ptr` (0, the legacy stream, is refused as everywhere here); captured
            like any work when the stream captures, from pinned memory only."""
            stream = next((s for s in list(fake.streams) if s.ptr == stream_ptr), None)
            assert stream is not None, f"memcpyAsync on an unknown stream {stream_ptr:#x}"
            if kind == MEMCPY_H2D:
                fake._device_range(int(dst), size, "a copy's destination")
                host = int(src)
            elif kind == MEMCPY_D2H:
                fake._device_range(int(src), size, "a copy's source")
                host = int(dst)
            else:
                raise CUDARuntimeError("cudaErrorInvalidMemcpyDirection",
                                       f"memcpyAsync kind {kind} (the backend copies "
                                       "host<->device only)")
            fake._copy(int(dst), int(src), int(size), host, stream)

        runtime = types.SimpleNamespace(
            getDeviceCount=lambda: len(fake.used), memGetInfo=mem_get_info,
            getDevice=current_device, CUDARuntimeError=CUDARuntimeError,
            memcpyAsync=memcpy_async, memcpyHostToDevice=MEMCPY_H2D,
            memcpyDeviceToHost=MEMCPY_D2H)
        self.cuda = types.SimpleNamespace(
            is_available=lambda: True, runtime=runtime,
            Memory=Memory, UnownedMemory=UnownedMemory,
            MemoryPointer=lambda mem, offset: Pointer(fake, mem, offset),
            PinnedMemory=PinnedMemory, Stream=Stream, Event=Event, Device=Device,
            MemoryHook=MemoryHook, get_elapsed_time=get_elapsed_time,
            using_allocator=using_allocator,
            device=types.SimpleNamespace(get_cublas_handle=get_cublas_handle))
        self._alloc = alloc

    # ------------------------------------------------------------------ device state
    def drain(self) -> None:
        """Wait until every stream has run what was issued on it (a test's end: work left in
        flight must still find its memory)."""
        for queue in list(self.queues):
            queue.drain()

    def _check_sticky(self) -> None:
        if self.sticky is not None:
            raise self.sticky

    def _context(self, device: int) -> None:
        with self._lock:
            if not self.contexts[device]:
                self.contexts[device] = True
                self.used[device] += CONTEXT_BYTES

    def _charge(self, device: int, nbytes: int) -> None:
        self._context(device)
        with self._lock:
            if self.used[device] + nbytes > self.total:
                raise CUDARuntimeError("cudaErrorMemoryAllocation", "out of memory")
            self.used[device] += nbytes

    def _release(self, ptr: int, device: int, nbytes: int) -> None:
        with self._lock:
            self.allocations.pop(ptr, None)
            self.used[device] -= nbytes

    def _device_range(self, ptr: int, size: int, what: str) -> int:
        """The device of the live allocation holding `[ptr, ptr + size)`; an illegal address
        otherwise."""
        for start, (end, device) in list(self.allocations.items()):
            if start <= ptr and ptr + size <= end:
                return device
        raise CUDARuntimeError("cudaErrorIllegalAddress",
                               f"{what} [{ptr:#x}, +{size}) lies outside every allocation")

    def _pinned_host(self, ptr: int, size: int) -> bool:
        return any(start <= ptr and ptr + size <= end for start, end in
                   list(self.pinned.items()))

    def _stream(self, stream=None):
        """`stream`, or the thread's current one; never the legacy null stream."""
        self._check_sticky()
        if stream is None:
            streams = getattr(self._tls, "streams", None)
            assert streams, "work issued on the legacy null stream (no stream is current)"
            stream = streams[-1]
        return stream

    def _launch(self, fn, stream=None, ranges=()) -> None:
        """Issue device work (a kernel, a memset, a GEMM) on `stream` (default: current).
        `ranges` ((address, bytes, what)) must still lie in live device allocations when the
        work runs: memory released while work on it was in flight is an illegal address."""
        stream = self._stream(stream)
        if stream.device_id != self.current_device():
            raise CUDARuntimeError("cudaErrorInvalidResourceHandle",
                                   f"a launch on a stream of device {stream.device_id} while "
                                   f"device {self.current_device()} is current")
        stream.put(self._checked(fn, ranges))

    def _checked(self, fn, ranges, host=None):
        def run():
            for ptr, size, what in ranges:
                self._device_range(ptr, size, what)
            if host is not None and not self._pinned_host(*host):
                raise CUDARuntimeError("cudaErrorIllegalAddress",
                                       "a copy's pinned host buffer was freed before it ran")
            fn()
        return run

    def _copy(self, dst: int, src: int, size: int, host: int, stream) -> None:
        """A copy between device and host memory (`host` is the host side's address)."""
        stream = self._stream(stream)
        if size == 0:
            return
        device = src if host == dst else dst
        if self._pinned_host(host, size):
            stream.put(self._checked(lambda: ctypes.memmove(dst, src, size),
                                     [(device, size, "a copy")], (host, size)))
            return
        if stream.capture is not None:
            raise CUDARuntimeError("cudaErrorStreamCaptureUnsupported",
                                   "a pageable copy (synchronous) while a stream captures")
        self.pageable_copies += 1  # pageable: synchronous, through a staging buffer
        stream.synchronize()
        ctypes.memmove(dst, src, size)

    @staticmethod
    def _extent(a) -> tuple[int, int]:
        lo = min(0, *((n - 1) * s for n, s in zip(a.shape, a.strides)))
        hi = sum((n - 1) * s for n, s in zip(a.shape, a.strides) if s > 0)
        return a.ctypes.data + lo, hi - lo + a.itemsize

    # ------------------------------------------------------------------ cuBLAS
    def _handle(self, handle: int) -> dict:
        key = (threading.get_ident(), self.current_device())
        state = self.handles.get(key)
        assert state is not None and state["id"] == handle, \
            "a cuBLAS handle is used on the thread and device that made it"
        return state

    def cublas_set_workspace(self, handle: int, ptr: int, size: int) -> None:
        """cublasSetWorkspace: 256-byte aligned, inside an allocation (cuBLAS's documented
        requirements); the handle then allocates nothing itself."""
        state = self._handle(handle)
        if ptr % 256:
            raise CUBLASError("CUBLAS_STATUS_INVALID_VALUE", "workspace not 256-byte aligned")
        self._device_range(ptr, size, "the cuBLAS workspace")
        state["workspace"] = (ptr, size)

    def cublas_set_stream(self, handle: int, stream: int) -> None:
        """cublasSetStream: the handle's GEMMs run on the stream whose `ptr` is `stream`."""
        state = self._handle(handle)
        found = [q for q in list(self.streams) if q.ptr == stream]
        assert found, f"no stream {stream:#x}"
        state["stream"] = found[0]

    def _matrix(self, ptr, tag, op, rows, cols, ld, what) -> np.ndarray:
        """op(X) as a (rows, cols) view of column-major X at `ptr` with leading dimension
        `ld` (cuBLAS's reading)."""
        size = np.dtype(_CUDA_NP[tag]).itemsize
        stored_rows = rows if op == 0 else cols
        if ld < max(1, stored_rows):
            raise CUBLASError("CUBLAS_STATUS_INVALID_VALUE", f"ld{what} {ld} < {stored_rows}")
        if ptr % size:
            raise CUDARuntimeError("cudaErrorMisalignedAddress",
                                   f"{what} at {ptr:#x} is not {size}-byte aligned")
        strides = (size, ld * size) if op == 0 else (ld * size, size)
        extent = ((rows - 1) * strides[0] + (cols - 1) * strides[1] + size
                  if rows and cols else 0)
        self._device_range(ptr, extent, f"gemm operand {what}")
        buf = (ctypes.c_ubyte * max(extent, 1)).from_address(ptr)
        return np.ndarray((rows, cols), _CUDA_NP[tag], buffer=buf, strides=strides)

    def cublas_gemm(self, handle: int, call, a: int, b: int, c: int, alpha: float,
                    beta: float) -> None:
        """`cublas_lib.gemm`: cublasGemmEx / cublasGemmStridedBatchedEx of `call` on the handle's
        stream, with cuBLAS's column-major reading of its operands (its first is `b`, its
        second `a`: `c^T = b^T a^T`), types, leading dimensions and alignment checked."""
        state = self._handle(handle)
        assert state.get("stream") is not None, "a GEMM on the handle's default (null) stream"
        if state["workspace"] is None and not state["own_workspace"]:
            state["own_workspace"] = True  # cuBLAS allocates its own, outside any budget
            self._charge(state["device"], CUBLAS_DEFAULT_WORKSPACE)
        if (call.compute == _COMPUTE_64F) != (call.a_type == 1):
            raise CUBLASError("CUBLAS_STATUS_NOT_SUPPORTED", f"compute {call.compute}")
        if call.a_type != call.b_type or call.c_type not in _C_TYPES[call.a_type]:
            raise CUBLASError("CUBLAS_STATUS_NOT_SUPPORTED",
                              f"types {call.a_type} {call.b_type} {call.c_type}")
        acc = np.float64 if call.compute == _COMPUTE_64F else np.float32
        self.gemms += 1
        x_ptr, y_ptr = b, a  # cuBLAS's first operand is ours `b`

        def run():
            for i in range(max(call.batch, 1)):
                x = self._matrix(x_ptr + i * call.stride_a * _SIZE[call.a_type], call.a_type,
                                 call.transa, call.m, call.k, call.lda, "a")
                y = self._matrix(y_ptr + i * call.stride_b * _SIZE[call.b_type], call.b_type,
                                 call.transb, call.k, call.n, call.ldb, "b")
                z = self._matrix(c + i * call.stride_c * _SIZE[call.c_type], call.c_type, 0,
                                 call.m, call.n, call.ldc, "c")
                part = _as_float(x, acc) @ _as_float(y, acc) * acc(alpha)
                if beta:
                    part = part + acc(beta) * _as_float(z, acc)
                _store(z, part)
        self._launch(run, state["stream"])

    # ------------------------------------------------------------------ arrays
    def adopt(self, array: np.ndarray):
        """A device view of a live host array (tests run kernels on it): its bytes registered
        as a device allocation of the current device for as long as the array lives."""
        owner = array
        while isinstance(owner.base, np.ndarray):
            owner = owner.base
        start = owner.ctypes.data
        self.allocations[start] = (start + owner.nbytes, self.current_device())
        weakref.finalize(owner, self.allocations.pop, start, None)
        start = array.ctypes.data
        return self.ndarray(array.shape, array.dtype, memptr=Pointer(self, Raw(start), 0),
                            strides=array.strides)

    def ndarray(self, shape, dtype=float, memptr=None, strides=None):
        dtype = np.dtype(dtype)
        shape = tuple(int(s) for s in shape)
        if memptr is None:
            memptr = self._alloc(math.prod(shape) * dtype.itemsize)
        if strides is None:
            strides = gemm_plan.contiguous_strides(shape, dtype.itemsize)
        assert all(s >= 0 for s in strides)
        assert memptr.ptr % dtype.itemsize == 0, \
            f"a {dtype} view at {memptr.ptr:#x} is not aligned to its element size"
        assert all(s % dtype.itemsize == 0 for s in strides), (dtype, strides)
        extent = (sum((n - 1) * s for n, s in zip(shape, strides)) + dtype.itemsize
                  if math.prod(shape) else 0)
        buf = (ctypes.c_ubyte * max(extent, 1)).from_address(memptr.ptr)
        out = np.ndarray(shape, dtype, buffer=buf, strides=tuple(strides)).view(_Array)
        out._fake = self
        return out

    def copyto(self, dst, src):
        assert dst.dtype == src.dtype and dst.shape == src.shape, (dst.dtype, src.dtype)
        ranges = self._check_arrays("copyto", dst, src)
        self._launch(lambda: np.copyto(dst, src), ranges=ranges)

    def _check_arrays(self, what: str, *arrays) -> list[tuple[int, int, str]]:
        """The device ranges of `arrays` (checked live now; `_launch` checks them again when the
        work runs)."""
        ranges = [(*self._extent(a), what) for a in arrays if a.size]
        for ptr, size, _ in ranges:
            self._device_range(ptr, size, what)
        return ranges

    def ElementwiseKernel(self, in_params, out_params, operation, name="kernel",
                          reduce_dims=True, preamble="", no_return=False, options=(),
                          **kwargs):
        src = cuda_source.ElementwiseSource(name, in_params, out_params, operation, preamble)
        self.host.add(src)
        return _FakeKernel(self, src, tuple(options))

    def ReductionKernel(self, in_params, out_params, map_expr, reduce_expr, post_map_expr,
                        identity, name="reduce_kernel", reduce_type=None, reduce_dims=True,
                        preamble="", options=()):
        src = cuda_source.ReductionSource(name, in_params, out_params, map_expr, reduce_expr,
                                          post_map_expr, identity, reduce_type, preamble)
        self.host.add(src)
        return _FakeKernel(self, src, tuple(options))


_CUDA_NP = {0: np.float32, 1: np.float64, 2: np.float16, 14: np.uint16}
_SIZE = {0: 4, 1: 8, 2: 2, 14: 2}
_C_TYPES = {0: (0,), 1: (1,), 2: (2, 0), 14: (14, 0)}
_COMPUTE_64F = 70


def _as_float(x: np.ndarray, acc) -> np.ndarray:
    if x.dtype == np.uint16:  # bf16 bits
        return (x.astype(np.uint32) << 16).view(np.float32).astype(acc)
    return x.astype(acc)


def _store(z: np.ndarray, part: np.ndarray) -> None:
    if z.dtype == np.uint16:  # round to nearest even bf16
        z[...] = part.astype(np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)
    else:
        z[...] = part.astype(z.dtype)


# ---------------------------------------------------------------------- fixture bodies

_SHARED: list = []  # [(tmp_path_factory, HostKernels)]: one per test session


def host_kernels(tmp_path_factory) -> HostKernels:
    """The session's `HostKernels` (shared by every test module), or skip without g++."""
    if CXX is None:
        pytest.skip("no C++ compiler (g++) to run the generated kernels on the host")
    if not _SHARED or _SHARED[0][0] is not tmp_path_factory:
        _SHARED[:] = [(tmp_path_factory, HostKernels(tmp_path_factory.mktemp("host-kernels")))]
    return _SHARED[0][1]


def install(kernels: HostKernels, **options) -> FakeCupy:
    """`FakeCupy(kernels, **options)` as the `cupy` module of this process (and as the cuBLAS
    calls of `cublas_lib`), the backend's caches of CuPy objects cleared: for scripts
    (`bench/gpu_session.py --dry-run`); tests use `installed`."""
    fake = FakeCupy(kernels, **options)
    sys.modules["cupy"] = fake
    cublas_lib.set_workspace = fake.cublas_set_workspace
    cublas_lib.set_stream = fake.cublas_set_stream
    cublas_lib.gemm = fake.cublas_gemm
    cuda._hook_class.cache_clear()
    cuda_apply.KERNELS.clear()
    cuda._HANDLE_BYTES.clear()
    return fake


def installed(monkeypatch, tmp_path_factory, **options) -> Iterator[FakeCupy]:
    """`FakeCupy` as the `cupy` module while the generator is suspended (a fixture body:
    `yield from installed(monkeypatch, tmp_path_factory)`), the backend's kernel and hook caches
    cleared before and after."""
    fake = FakeCupy(host_kernels(tmp_path_factory), **options)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(cublas_lib, "set_workspace", fake.cublas_set_workspace)
    monkeypatch.setattr(cublas_lib, "set_stream", fake.cublas_set_stream)
    monkeypatch.setattr(cublas_lib, "gemm", fake.cublas_gemm)
    cuda._hook_class.cache_clear()
    cuda_apply.KERNELS.clear()
    monkeypatch.setattr(cuda, "_HANDLE_BYTES", {})
    yield fake
    cuda._hook_class.cache_clear()
    cuda_apply.KERNELS.clear()
    fake.drain()
    assert fake.sticky is None, f"a device fault no call reported: {fake.sticky}"
