"""The device objects of the CuPy stand-in (`fake_cupy.FakeCupy`): memory pointers (copies and
memsets issued on a stream, bounds-checked against live allocations, refused on a capturing
stream as CuPy 14 refuses them), device arrays (NumPy views whose `.data` is a pointer), and the
elementwise and reduction kernels (the generated CUDA C compiled for the host, `host_kernels`,
launched with CuPy's broadcasting and checked dtypes)."""
from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import numpy as np

from einpage.runtime.backends import cuda_source

from host_kernels import _NP, Param, _call, kernel_params

if TYPE_CHECKING:
    from fake_cupy import FakeCupy


class Raw:
    def __init__(self, ptr: int, size: int = 0):
        self.ptr, self.size = ptr, size


def _aligned_buffer(size: int, alignment: int = 256) -> tuple[np.ndarray, int]:
    raw = np.zeros(max(int(size), 1) + alignment, np.uint8)
    skip = (-raw.ctypes.data) % alignment
    return raw, raw.ctypes.data + skip


class Pointer:
    """`cupy.cuda.MemoryPointer`: copies and memsets are issued on a stream (default: the
    current one), bounds-checked against live device allocations."""

    def __init__(self, fake: FakeCupy, mem, offset: int):
        self.fake, self.mem = fake, mem
        self.ptr = mem.ptr + int(offset)

    def __add__(self, n: int):
        return Pointer(self.fake, self.mem, self.ptr - self.mem.ptr + int(n))

    def memset_async(self, value, size, stream=None):
        self.fake._device_range(self.ptr, size, "memset")
        ptr = self.ptr
        self.fake._launch(lambda: ctypes.memset(ptr, value, size), stream,
                          [(ptr, size, "memset")])

    # CuPy 14 refuses these two on a capturing stream, even from pinned memory, where CUDA
    # would capture the copy (cupy/cuda/memory.pyx): a captured pass copies through
    # `runtime.memcpyAsync`. The first GPU run failed here (2026-11-27).
    def copy_from_host_async(self, mem, size, stream=None):
        if self.fake._stream(stream).capture is not None:
            raise RuntimeError("the current stream is capturing, so H2D transfers are "
                               "disallowed")
        self.fake._device_range(self.ptr, size, "a copy's destination")
        self.fake._copy(self.ptr, int(mem), size, int(mem), stream)

    def copy_to_host_async(self, mem, size, stream=None):
        if self.fake._stream(stream).capture is not None:
            raise RuntimeError("the current stream is capturing, so D2H transfers are "
                               "disallowed")
        self.fake._device_range(self.ptr, size, "a copy's source")
        self.fake._copy(int(mem), self.ptr, size, int(mem), stream)


class _Array(np.ndarray):
    """A device array: a NumPy view whose `.data` is a memory pointer, as CuPy's is."""

    def __array_finalize__(self, obj):
        self._fake = getattr(obj, "_fake", None)

    @property
    def data(self):
        fake = getattr(self, "_fake", None)
        return Pointer(fake, Raw(self.ctypes.data), 0)


class _FakeKernel:
    def __init__(self, cp: FakeCupy, src, options: tuple[str, ...]):
        assert options == cuda_source.NVRTC_OPTIONS, options
        self.cp, self.src = cp, src
        self.params = kernel_params(src.in_params, src.out_params)

    def _check(self, p: Param, a) -> None:
        assert np.dtype(a.dtype) == np.dtype(_NP[p.type]), f"{p.name}: {a.dtype} for {p.type}"

    def __call__(self, *args, out=None, axis=None):
        cp = self.cp
        fn = cp.host.function(self.src.name)
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
        ranges = cp._check_arrays(self.src.name, *arrays)
        key = (self.src.name, tuple(str(a.dtype) for a in arrays), max(a.ndim for a in arrays))
        cp.compiles.setdefault(key, self.src.name)
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
            cp._launch(lambda: _call(fn, arrays, shape, strides, scalars), ranges=ranges)
            return
        shape = np.broadcast_shapes(*broadcast)
        axes = tuple(sorted(axis))
        nout = len(shape) - len(axes)
        assert axes == tuple(range(nout, len(shape))) and out.shape == shape[:nout]
        strides = [np.broadcast_to(a, shape).strides for a in arrays[:-1]]
        strides.append(tuple(out.strides) + (0,) * len(axes))
        cp._launch(lambda: _call(fn, arrays, shape, strides, scalars, nout), ranges=ranges)
