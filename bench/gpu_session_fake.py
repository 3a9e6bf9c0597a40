"""`bench/gpu_session.py --dry-run`: the CuPy stand-in (`tests/fake_cupy.py`) installed in this
process, with what `einpage calibrate --backend cupy` and the env step call that the stand-in
lacks, and calibration shrunk to sizes a CPU measures in seconds."""
from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).absolute().parent.parent

def install_fake(kernels: Path) -> list[str]:
    """`tests/fake_cupy.FakeCupy` as `sys.modules["cupy"]` in this process (`fake_cupy.install`),
    plus what the stand-in lacks of the CuPy API that `einpage calibrate --backend cupy`
    and the env step call (only where missing). Returns the names of those additions."""
    sys.path.insert(0, str(REPO / "tests"))
    import fake_cupy
    kernels.mkdir(parents=True, exist_ok=True)
    fake = fake_cupy.install(fake_cupy.HostKernels(kernels))
    added = _shim_fake(fake, fake_cupy)
    _shrink_calibration()
    return added


FAKE_MEMORY = 80 << 30


def _shim_fake(fake, module) -> list[str]:
    """Add to the stand-in what `CupyProbe` (calibrate) and the env step call and it lacks:
    host-side versions that keep the stand-in's rules where it has them (work issued on the
    current stream, device ranges checked)."""
    import ctypes
    import types

    import numpy as np
    added = []
    runtime = fake.cuda.runtime
    total = getattr(fake, "total", FAKE_MEMORY)
    if not hasattr(runtime, "memGetInfo"):
        def mem_get_info():  # free: what the live raw allocations leave of a nominal total
            used = sum(int(m.size) for m in list(fake.live))
            return total - used, total
        runtime.memGetInfo = mem_get_info
        added.append("cuda.runtime.memGetInfo")
    if not hasattr(runtime, "getDeviceProperties"):
        runtime.getDeviceProperties = lambda device: {"name": b"FakeCupy host stand-in",
                                                      "totalGlobalMem": total}
        added.append("cuda.runtime.getDeviceProperties")
    if not hasattr(runtime, "runtimeGetVersion"):
        runtime.runtimeGetVersion = lambda: 0
        added.append("cuda.runtime.runtimeGetVersion")
    for name in ("float16", "float32", "float64", "uint8", "uint16", "uint32", "int32", "int64"):
        if not hasattr(fake, name):
            setattr(fake, name, getattr(np, name))
            added.append(name)

    def owned(shape, dtype):  # an array that keeps its allocation alive, as CuPy's does
        shape = tuple(shape) if isinstance(shape, (tuple, list)) else (int(shape),)
        memptr = fake._alloc(max(int(np.prod(shape)) * np.dtype(dtype).itemsize, 1))
        out = fake.ndarray(shape, dtype, memptr=memptr)
        out._einpage_memptr = memptr
        return out

    def launch(fn):  # on the current stream where the stand-in queues work, else at once
        tls = getattr(fake, "_tls", None)
        if hasattr(fake, "_launch") and getattr(tls, "streams", None):
            fake._launch(fn)
        else:
            fn()

    if not hasattr(fake, "empty"):
        fake.empty = lambda shape, dtype=float: owned(shape, dtype)
        added.append("empty")
    if not hasattr(fake, "random"):
        rng = np.random.default_rng(0)

        def standard_normal(size, dtype=np.float64):
            out = owned(size, dtype)  # fresh memory no stream uses yet: filled at once
            out[...] = rng.standard_normal(out.shape).astype(dtype)
            return out
        fake.random = types.SimpleNamespace(standard_normal=standard_normal)
        added.append("random.standard_normal")
    array = getattr(module, "_Array", None)
    if array is not None and "astype" not in array.__dict__:
        def astype(self, dtype, *args, **kwargs):  # CuPy: a new device array
            out = owned(self.shape, dtype)
            source = self
            launch(lambda: np.copyto(out, np.ndarray.astype(source, dtype)))
            return out
        array.astype = astype
        added.append("ndarray.astype (into device memory)")
    if not hasattr(fake, "matmul"):
        def matmul(a, b, out=None):
            assert out is not None
            launch(lambda: np.copyto(out, np.matmul(a.astype(np.float32), b.astype(np.float32))
                                     .astype(out.dtype)))
            return out
        fake.matmul = matmul
        added.append("matmul")
    if not hasattr(fake, "__version__"):
        fake.__version__ = "fake"
    pointer = getattr(module, "Pointer", None)
    if pointer is not None and not hasattr(pointer, "copy_from_device_async"):
        def copy_from_device_async(self, src, size, stream=None):
            dst, at = self.ptr, src.ptr
            owner = getattr(self, "fake", None)
            if owner is not None and hasattr(owner, "_launch"):
                owner._device_range(dst, size, "a copy's destination")
                owner._device_range(at, size, "a copy's source")
                owner._launch(lambda: ctypes.memmove(dst, at, size), stream)
            else:
                ctypes.memmove(dst, at, size)
        pointer.copy_from_device_async = copy_from_device_async
        added.append("MemoryPointer.copy_from_device_async")
    return added


def _shrink_calibration() -> None:
    """Dry run: calibrate's probes on sizes a CPU measures in seconds."""
    import inspect

    from einpage import calibrate
    calibrate.SIZES = tuple(1 << k for k in range(16, 21, 2))
    calibrate._REPEATS = 2
    try:
        from einpage.runtime.backends.cuda_probe import CupyProbe
    except ImportError:
        return
    for method, n in (("matmul_flops", 128), ("memory_bandwidth", 1 << 20),
                      ("vector_flops", 256)):
        fn = getattr(CupyProbe, method, None)
        params = list(inspect.signature(fn).parameters.values()) if fn else []
        if params and params[-1].name == "n" and fn.__defaults__:
            fn.__defaults__ = fn.__defaults__[:-1] + (n,)
    init = CupyProbe.__init__
    if init.__defaults__ and list(inspect.signature(init).parameters)[-1] == "repeats":
        init.__defaults__ = init.__defaults__[:-1] + (2,)
