"""A host stand-in for CuPy, for the CuPy backend's tests (`test_cuda_source`,
`test_cuda_backend`): `FakeCupy` is the part of the CuPy v14.2.0 API the backend calls, over NumPy
arrays in raw host memory, whose `ElementwiseKernel` / `ReductionKernel` compile the generated CUDA
C for the host with g++ (`HostKernels`: batched into shared libraries, loaded with ctypes). Where
real CuPy would allocate a temporary (matmul on non-contiguous operands, a 1x1 dot, CUB
reductions, arrays made without `memptr`) it asserts or allocates through the thread's
allocator, so a test sees it.

`installed(monkeypatch, tmp_path_factory)` is a fixture body: `FakeCupy` as `sys.modules["cupy"]`
for one test, with the backend's caches of CuPy objects cleared around it (skips without g++).
"""
from __future__ import annotations

import ctypes
import hashlib
import math
import re
import shutil
import subprocess
import sys
import threading
import time
import types
import weakref
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from einpage.runtime.backends import cuda, cuda_source, gemm_plan

CXX = shutil.which("g++") or shutil.which("c++")

# ---------------------------------------------------------------------- kernels on the host (g++)

_CT = {"float16": "float16", "uint16": "unsigned short", "float32": "float",
       "float64": "double", "int64": "long long", "int32": "int"}
_NP = {"float16": np.float16, "uint16": np.uint16, "float32": np.float32, "float64": np.float64,
       "int64": np.int64, "int32": np.int32}

_HOST_HEADER = r"""
#include <math.h>
#include <string.h>
#include <stdbool.h>
#include <stddef.h>
struct float16 {
  _Float16 v;
  float16() {}
  float16(float f) : v((_Float16)f) {}
  operator float() const { return (float)v; }
};
template <class T> struct RawArr { T* p; T& operator[](long long k) const { return p[k]; } };
"""


class Param:
    def __init__(self, text: str, is_input: bool):
        words = text.split()
        self.raw = words[0] == "raw"
        self.type, self.name = words[-2], words[-1]
        self.is_input = is_input
        # our kernels' convention: a*, y are broadcast arrays; other non-raw params are scalars
        self.array = self.raw or re.fullmatch(r"a\d+|y", self.name) is not None

    @property
    def ctype(self) -> str:
        return _CT[self.type]


def kernel_params(in_params: str, out_params: str) -> list[Param]:
    return ([Param(p, True) for p in in_params.split(",") if p.strip()]
            + [Param(p, False) for p in out_params.split(",") if p.strip()])


def _offsets(arrays: list[Param], flat: str) -> str:
    n = max(len(arrays), 1)
    return (f"long long off[{n}] = {{0}}; {{ long long q = {flat}; "
            "for (int d = ndim - 1; d >= 0; --d) { long long ix = q % shape[d]; q /= shape[d]; "
            f"for (int k = 0; k < {len(arrays)}; ++k) off[k] += ix * strides[k * ndim + d]; }} }}")


def _bind(params: list[Param], arrays: list[Param]) -> str:
    lines, s = [], 0
    for p in params:
        if not p.array:
            lines.append(f"const {p.ctype} {p.name} = ({p.ctype})sc[{s}];")
            s += 1
            continue
        k = arrays.index(p)
        if p.raw:
            const = "const " if p.is_input else ""
            lines.append(f"RawArr<{const}{p.ctype}> {p.name}{{({const}{p.ctype}*)A[{k}]}};")
    return "\n".join(lines)


def _refs(arrays: list[Param], outputs: bool) -> str:
    out = []
    for k, p in enumerate(arrays):
        if p.raw or (not p.is_input) != outputs:
            continue
        const = "const " if p.is_input else ""
        out.append(f"{const}{p.ctype} &{p.name} = *({const}{p.ctype}*)(A[{k}] + off[{k}]);")
    return " ".join(out)


def _host_source(src) -> str:
    ns = f"ns_{src.name}"
    head = f"namespace {ns} {{\n{src.preamble}\n}}\n"
    sig = (f'extern "C" void {src.name}(void** A_, const long long* shape, '
           "const long long* strides, int ndim, long long size, int nout, const long long* sc)")
    if isinstance(src, cuda_source.ElementwiseSource):
        params = kernel_params(src.in_params, src.out_params)
        arrays = [p for p in params if p.array]
        return head + f"""{sig} {{
  using namespace {ns};
  char** A = (char**)A_; (void)nout;
  {_bind(params, arrays)}
  for (long long i = 0; i < size; ++i) {{
    {_offsets(arrays, "i")}
    {_refs(arrays, False)} {_refs(arrays, True)}
    {src.operation};
  }}
}}
"""
    params = kernel_params(src.in_params, src.out_params)
    arrays = [p for p in params if p.array]
    return head + f"""#define REDUCE(a, b) ({src.reduce_expr})
#define POST_MAP(a) ({src.post_map_expr})
{sig} {{
  using namespace {ns};
  typedef {src.reduce_type} _type_reduce;
  char** A = (char**)A_;
  {_bind(params, arrays)}
  long long outsize = 1, redsize = 1;
  for (int d = 0; d < ndim; ++d) {{ if (d < nout) outsize *= shape[d]; else redsize *= shape[d]; }}
  for (long long o = 0; o < outsize; ++o) {{
    _type_reduce _s = _type_reduce({src.identity});
    for (long long r = 0; r < redsize; ++r) {{
      {_offsets(arrays, "o * redsize + r")}
      {_refs(arrays, False)}
      _type_reduce _a = static_cast<_type_reduce>({src.map_expr});
      _s = REDUCE(_s, _a);
    }}
    {{ {_offsets(arrays, "o * redsize")}
      {_refs(arrays, True)}
      POST_MAP(_s); }}
  }}
}}
#undef REDUCE
#undef POST_MAP
"""


class HostKernels:
    """Generated kernels compiled for the host by g++, in batches, loaded with ctypes."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.pending: dict = {}
        self.functions: dict = {}

    def add(self, src) -> None:
        if src.name not in self.functions:
            self.pending[src.name] = src

    def function(self, name: str):
        if name not in self.functions:
            self.build()
        return self.functions[name]

    def build(self) -> None:
        sources = list(self.pending.values())
        self.pending = {}
        if not sources:
            return
        text = _HOST_HEADER + "\n".join(_host_source(s) for s in sources)
        digest = hashlib.sha1(text.encode()).hexdigest()[:16]
        lib = self.directory / f"k_{digest}.so"
        if not lib.exists():
            cpp = self.directory / f"k_{digest}.cpp"
            cpp.write_text(text)
            result = subprocess.run([CXX, "-O1", "-shared", "-fPIC", "-w", "-o", str(lib),
                                     str(cpp)], capture_output=True, text=True)
            assert result.returncode == 0, result.stderr[-4000:]
        dll = ctypes.CDLL(str(lib))
        for s in sources:
            fn = getattr(dll, s.name)
            fn.restype = None
            self.functions[s.name] = fn


def _call(fn, arrays, shape, strides, scalars, nout=0):
    ptrs = (ctypes.c_void_p * max(len(arrays), 1))(*[a.ctypes.data for a in arrays])
    shp = np.asarray(shape, np.int64)
    std = np.asarray(strides, np.int64).reshape(-1)
    sc = np.asarray(list(scalars) or [0], np.int64)
    size = int(np.prod(shape)) if len(shape) else 1
    fn(ptrs, shp.ctypes.data_as(ctypes.c_void_p), std.ctypes.data_as(ctypes.c_void_p),
       ctypes.c_int(len(shape)), ctypes.c_longlong(size), ctypes.c_int(nout),
       sc.ctypes.data_as(ctypes.c_void_p))


# ---------------------------------------------------------------------- a stand-in for CuPy

class Raw:
    def __init__(self, ptr: int):
        self.ptr = ptr


class Pointer:
    """`cupy.cuda.MemoryPointer` over host memory: copies and memsets run at once."""

    def __init__(self, mem, offset: int):
        self.mem = mem
        self.ptr = mem.ptr + offset

    def __add__(self, n: int):
        return Pointer(self.mem, self.ptr - self.mem.ptr + int(n))

    def memset_async(self, value, size, stream=None):
        ctypes.memset(self.ptr, value, size)

    def copy_from_host_async(self, mem, size, stream=None):
        ctypes.memmove(self.ptr, mem, size)

    def copy_to_host_async(self, mem, size, stream=None):
        ctypes.memmove(mem, self.ptr, size)


class _Array(np.ndarray):
    """A device array: a NumPy view whose `.data` is a memory pointer, as CuPy's is."""

    @property
    def data(self):
        return Pointer(Raw(self.ctypes.data), 0)


class FakeCupy(types.ModuleType):
    """Just the CuPy v14.2.0 API the backend calls, on the host. Streams run work when it is
    issued (the executor's host flags then order it, as for the threads backend). Where real
    CuPy would allocate a temporary (matmul on non-contiguous operands, a 1x1 dot, CUB
    reductions, arrays made without `memptr`) this one asserts or allocates through the
    thread's allocator, so a test sees it."""

    def __init__(self, host: HostKernels):
        super().__init__("cupy")
        self.host = host
        self.live = weakref.WeakSet()   # raw device allocations not yet freed
        self.pinned_live = weakref.WeakSet()
        tls = threading.local()
        fake = self

        class Memory:
            def __init__(self, size):
                self.buf = np.zeros(max(int(size), 1), np.uint8)
                self.ptr, self.size = self.buf.ctypes.data, int(size)
                fake.live.add(self)

        class PinnedMemory(Memory):
            def __init__(self, size):
                super().__init__(size)
                fake.live.discard(self)
                fake.pinned_live.add(self)

        class UnownedMemory:
            def __init__(self, ptr, size, owner, device_id=-1):
                self.ptr, self.size, self.owner = ptr, size, owner

        class Stream:
            def __init__(self, null=False, non_blocking=False, ptds=False, priority=None):
                assert non_blocking

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

            def synchronize(self):
                pass

            def wait_event(self, event):
                assert event.recorded

        class Event:
            def __init__(self, block=False, disable_timing=False, interprocess=False):
                self.recorded, self.timing, self.t = False, not disable_timing, 0.0

            def record(self, stream=None):
                self.recorded, self.t = True, time.perf_counter()

            def synchronize(self):
                pass

        class Device:
            def __init__(self, device=0):
                self.id = device

            def __enter__(self):
                return self

            def __exit__(self, *exc):
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
            assert a.timing and b.timing
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
            return Pointer(Memory(nbytes), 0)

        cuda = types.SimpleNamespace(
            is_available=lambda: True, runtime=types.SimpleNamespace(getDeviceCount=lambda: 1),
            Memory=Memory, UnownedMemory=UnownedMemory, MemoryPointer=Pointer,
            PinnedMemory=PinnedMemory, Stream=Stream, Event=Event, Device=Device,
            MemoryHook=MemoryHook, get_elapsed_time=get_elapsed_time,
            using_allocator=using_allocator,
            device=types.SimpleNamespace(get_cublas_handle=lambda: 1))
        self.cuda = cuda
        self._alloc = alloc

    # ------------------------------------------------------------------ arrays
    def ndarray(self, shape, dtype=float, memptr=None, strides=None):
        dtype = np.dtype(dtype)
        shape = tuple(int(s) for s in shape)
        if memptr is None:
            memptr = self._alloc(math.prod(shape) * dtype.itemsize)
        if strides is None:
            strides = gemm_plan.contiguous_strides(shape, dtype.itemsize)
        assert all(s >= 0 for s in strides)
        extent = (sum((n - 1) * s for n, s in zip(shape, strides)) + dtype.itemsize
                  if math.prod(shape) else 0)
        buf = (ctypes.c_ubyte * max(extent, 1)).from_address(memptr.ptr)
        return np.ndarray(shape, dtype, buffer=buf, strides=tuple(strides)).view(_Array)

    def copyto(self, dst, src):
        assert dst.dtype == src.dtype and dst.shape == src.shape, (dst.dtype, src.dtype)
        np.copyto(dst, src)

    def matmul(self, a, b, out=None):
        assert out is not None and a.dtype == b.dtype == out.dtype
        assert out.flags.c_contiguous
        assert not np.may_share_memory(out, a) and not np.may_share_memory(out, b)
        if a.ndim <= 2 and b.ndim <= 2:
            assert a.ndim == b.ndim == 2
            assert a.dtype in (np.float16, np.float32, np.float64)
            for x in (a, b):  # CuPy's dot passes C or F matrices to cuBLAS, else copies
                assert x.flags.c_contiguous or x.flags.f_contiguous
            assert out.shape != (1, 1), "CuPy reduces a 1x1 dot with temporaries"
        else:  # strided-batched GEMM: ascontiguousarray copies anything else (f16 to f32)
            assert a.dtype in (np.float32, np.float64)
            assert a.ndim == b.ndim == out.ndim == 3 and a.shape[0] == b.shape[0]
            assert a.flags.c_contiguous and b.flags.c_contiguous
        if out.dtype == np.float16:  # cuBLAS: float32 compute type, one rounding
            out[...] = np.matmul(a.astype(np.float32), b.astype(np.float32))
        else:
            np.matmul(a, b, out=out)

    def ElementwiseKernel(self, in_params, out_params, operation, name="kernel",
                          reduce_dims=True, preamble="", no_return=False, **kwargs):
        src = cuda_source.ElementwiseSource(name, in_params, out_params, operation, preamble)
        self.host.add(src)
        return _FakeKernel(self, src)

    def ReductionKernel(self, in_params, out_params, map_expr, reduce_expr, post_map_expr,
                        identity, name="reduce_kernel", reduce_type=None, reduce_dims=True,
                        preamble="", options=()):
        src = cuda_source.ReductionSource(name, in_params, out_params, map_expr, reduce_expr,
                                 post_map_expr, identity, reduce_type, preamble)
        self.host.add(src)
        return _FakeKernel(self, src)


class _FakeKernel:
    def __init__(self, cp: FakeCupy, src):
        self.cp, self.src = cp, src
        self.params = kernel_params(src.in_params, src.out_params)

    def _check(self, p: Param, a) -> None:
        assert np.dtype(a.dtype) == np.dtype(_NP[p.type]), f"{p.name}: {a.dtype} for {p.type}"

    def __call__(self, *args, out=None, axis=None):
        fn = self.cp.host.function(self.src.name)
        if isinstance(self.src, cuda_source.ReductionSource):
            assert out is not None and len(args) == len(self.params) - 1
            assert len(args) >= 2, "one input: CuPy would take its CUB path"
            args = (*args, out)
        assert len(args) == len(self.params)
        arrays, scalars, broadcast = [], [], []
        for p, a in zip(self.params, args):
            if p.array:
                self._check(p, a)
                arrays.append(a)
                if p.raw:
                    assert a.ndim == 1 and a.flags.c_contiguous
                elif p.is_input:
                    broadcast.append(a.shape)
            else:
                assert isinstance(a, (int, np.integer)), (p.name, a)
                scalars.append(int(a))
        if isinstance(self.src, cuda_source.ElementwiseSource):
            shape = np.broadcast_shapes(*broadcast, *[a.shape for p, a in zip(self.params, args)
                                                      if p.array and not p.raw
                                                      and not p.is_input])
            strides = []
            for p, a in zip(self.params, args):
                if p.array:
                    if p.raw:
                        strides.append([0] * len(shape))
                    else:
                        assert p.is_input or a.shape == shape
                        strides.append(np.broadcast_to(a, shape).strides)
            _call(fn, arrays, shape, strides, scalars)
            return
        shape = np.broadcast_shapes(*broadcast)
        axes = tuple(sorted(axis))
        nout = len(shape) - len(axes)
        assert axes == tuple(range(nout, len(shape))) and out.shape == shape[:nout]
        strides = [np.broadcast_to(a, shape).strides for a in arrays[:-1]]
        strides.append(tuple(out.strides) + (0,) * len(axes))
        _call(fn, arrays, shape, strides, scalars, nout)


# ---------------------------------------------------------------------- fixture bodies

_SHARED: list = []  # [(tmp_path_factory, HostKernels)]: one per test session


def host_kernels(tmp_path_factory) -> HostKernels:
    """The session's `HostKernels` (shared by every test module), or skip without g++."""
    if CXX is None:
        pytest.skip("no C++ compiler (g++) to run the generated kernels on the host")
    if not _SHARED or _SHARED[0][0] is not tmp_path_factory:
        _SHARED[:] = [(tmp_path_factory, HostKernels(tmp_path_factory.mktemp("host-kernels")))]
    return _SHARED[0][1]


def installed(monkeypatch, tmp_path_factory) -> Iterator[FakeCupy]:
    """`FakeCupy` as the `cupy` module while the generator is suspended (a fixture body:
    `yield from installed(monkeypatch, tmp_path_factory)`), the backend's kernel and hook caches
    cleared before and after."""
    fake = FakeCupy(host_kernels(tmp_path_factory))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    cuda._hook_class.cache_clear()
    cuda._KERNELS.clear()
    yield fake
    cuda._hook_class.cache_clear()
    cuda._KERNELS.clear()
