"""`einpage calibrate`: measure, on the machine at hand and through a stream backend's own paths,
what the cost model uses, and make a device profile of it (`--device-file` reads it).

What is measured, each a median of several repeats after a warm-up:
- the h2d and d2h copies a backend issues, over sizes from 64 KB to 64 MB: on threads an h2d
  is a read from a memory-mapped file in the page cache into the arena (what a weight reload
  is), a d2h a copy from the arena into host memory; on cupy, pinned host <-> device copies.
  The bandwidth is the rate of the largest copies, the latency what the smallest take beyond
  their bytes at that rate;
- matmul FLOP/s per dtype through the kernels a plan uses (f16 and bf16 are computed in f32 on
  NumPy: their rate includes the conversion), elementwise FLOP/s, memory bandwidth (a large copy,
  read plus write);
- the per-node overhead: a plan of a few hundred tiny nodes run on the backend, wall time per
  node (the thread hand-offs and dispatch the cost model calls launch overhead);
- with `--disk PATH`, the drive's read bandwidth and latency (`measure_disk`): a file (PATH
  itself, or one written in the directory PATH) read in 4 MB requests with the page cache out of
  the way — `O_DIRECT` where the file system allows it, else buffered reads after
  `posix_fadvise(DONTNEED)` dropped the file's cached pages — and single 4 KB reads at random
  offsets for the latency.
"""
from __future__ import annotations

import functools
import os
import platform
import statistics
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Callable

import numpy as np

from einpage.predict.hosts import HostProfile
from einpage.runtime import storedmm
from einpage.predict.devices import DeviceProfile

SIZES = tuple(1 << k for k in range(16, 27, 2))   # 64 KB .. 64 MB
_REPEATS = 5


def median_seconds(fn: Callable[[], object], repeats: int = _REPEATS) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def fit_link(seconds_by_size: dict[int, float]) -> tuple[float, float]:
    """(bytes/s, latency s) of a copy: the rate of the largest copy, and what the smallest takes
    beyond its bytes at that rate (never negative)."""
    big, small = max(seconds_by_size), min(seconds_by_size)
    rate = big / seconds_by_size[big]
    return rate, max(0.0, seconds_by_size[small] - small / rate)


class ThreadsProbe:
    """The threads backend's paths on this CPU."""

    name = "threads"

    def __init__(self) -> None:
        top = max(SIZES)
        self.dir = tempfile.TemporaryDirectory(prefix="einpage-calibrate-")
        path = Path(self.dir.name) / "blocks.bin"
        np.random.default_rng(0).integers(0, 255, top, dtype=np.uint8).tofile(path)
        self.file = np.memmap(path, dtype=np.uint8, mode="r")
        self.arena = np.ones(top, dtype=np.uint8)
        self.host = np.ones(top, dtype=np.uint8)

    def h2d(self, n: int) -> float:
        return median_seconds(lambda: np.copyto(self.arena[:n], self.file[:n]))

    def d2h(self, n: int) -> float:
        return median_seconds(lambda: np.copyto(self.host[:n], self.arena[:n]))

    def memory_bandwidth(self) -> float:
        n = max(SIZES)
        return 2 * n / median_seconds(lambda: np.copyto(self.host, self.arena))

    def matmul_flops(self, dtype: str, n: int = 1024) -> float:
        from einpage.ir.spec import EinsumSpec
        from einpage.runtime import kernels
        rng = np.random.default_rng(0)
        np_dtype = _numpy_dtype(dtype)
        a = rng.standard_normal((n, n)).astype(np_dtype)
        b = rng.standard_normal((n, n)).astype(np_dtype)
        spec = EinsumSpec.parse("ij,jk->ik")
        compute = np.dtype(np.float64 if dtype == "f64" else np.float32)
        from einpage.ir import scalar
        join = scalar.product(2)
        return 2.0 * n ** 3 / median_seconds(
            lambda: kernels.einsum(spec, join, "sum", [a, b], compute))

    def vector_flops(self, n: int = 1 << 22) -> float:
        from einpage.ir import scalar
        from einpage.ir.spec import EinsumSpec
        from einpage.runtime import kernels
        rng = np.random.default_rng(0)
        a, b = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
        join = scalar.x(0) + scalar.x(1)
        spec = EinsumSpec.parse("i,i->i")
        return 2.0 * n / median_seconds(
            lambda: kernels.einsum(spec, join, None, [a, b], np.dtype(np.float32)))

    def memory_bytes(self) -> int:
        try:
            return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return 0

    def describe(self) -> str:
        return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"

    def close(self) -> None:
        del self.file
        self.dir.cleanup()


def _numpy_dtype(dtype: str) -> np.dtype:
    from einpage.ir.dtypes import as_dtype
    return np.dtype(as_dtype(dtype).numpy)


def node_overhead(backend: str, nodes: int = 300) -> tuple[float, float | None]:
    """Wall seconds per node of a plan of `nodes` tiny elementwise applies on `backend`, issued
    node by node (one pass of a fresh session, as `einpage run` runs a plan), and replayed as
    one captured graph (the passes after the second of one session, where the backend
    captures; else None)."""
    from einpage.compiler import CompileOptions, compile_graph
    from einpage.ir import GraphBuilder
    from einpage.runtime.backends import make_backend
    from einpage.runtime.stream_executor import StreamSession, run_streams
    g = GraphBuilder()
    x = g.input("x", (8,), "f32")
    for _ in range(nodes):
        x = g.einsum("i,i->i", x, x, join=lambda a, b: a * 0.5 + b * 0.5)
    g.output("y", x)
    mg = compile_graph(g.build(), CompileOptions(1 << 20)).memgraph
    inputs = {"x": np.ones(8, dtype=np.float32)}
    applies = mg.count("apply")
    walls = [run_streams(mg, inputs, None, make_backend(backend), timing=False).measured.wall_s
             for _ in range(_REPEATS)]
    issued = statistics.median(walls) / applies
    with StreamSession(mg, None, make_backend(backend), timing=False) as session:
        runs = [session.run(inputs).measured for _ in range(_REPEATS + 2)]
    replays = [m.wall_s for m in runs if m.replayed]  # not the pass that captured
    return issued, (statistics.median(replays) / applies if replays else None)


DISK_CHUNK = 4 << 20
DISK_FILE_BYTES = 1 << 30


def _drop_cache(fd: int) -> None:
    try:
        os.fsync(fd)
    except OSError:
        pass
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def _open_direct(path: Path) -> tuple[int, str]:
    """An fd for reading `path` past the page cache: O_DIRECT, else a plain fd (cache dropped)."""
    flag = getattr(os, "O_DIRECT", 0)
    if flag:
        try:
            return os.open(path, os.O_RDONLY | flag), "O_DIRECT"
        except OSError:
            pass
    return os.open(path, os.O_RDONLY), "buffered after posix_fadvise(DONTNEED)"


def measure_disk(path: str | Path, nbytes: int = DISK_FILE_BYTES, repeats: int = 3
                 ) -> tuple[float, float, str]:
    """(read bytes/s, latency s, how) of the drive holding `path`: a file, read whole, or a
    directory, in which a file of `nbytes` is written (and removed after). The bandwidth is the
    median of `repeats` whole reads in 4 MB requests, each with the file out of the page cache;
    the latency the median of 64 single 4 KB reads at random aligned offsets."""
    from einpage.errors import InputError
    from einpage.runtime.backends.base import aligned_empty
    target = Path(path)
    made = None
    if target.is_dir():
        made = target / f".einpage-disk-probe-{os.getpid()}"
        try:
            block = np.random.default_rng(0).integers(0, 255, DISK_CHUNK, dtype=np.uint8)
            with open(made, "wb") as fh:
                for _ in range(max(1, nbytes // DISK_CHUNK)):
                    fh.write(block.data)
                fh.flush()
                os.fsync(fh.fileno())
        except OSError as exc:
            made.unlink(missing_ok=True)
            raise InputError(f"--disk {path}: cannot write a probe file there: {exc}") from None
        target = made
    elif not target.is_file():
        raise InputError(f"--disk {path}: no such file or directory")
    try:
        size = target.stat().st_size
        if size < DISK_CHUNK:
            raise InputError(f"--disk {path}: the file has {size} bytes; give one of at least "
                             f"{DISK_CHUNK} bytes, or a directory")
        buffer = aligned_empty(DISK_CHUNK)
        whole = size - size % 4096
        times, how = [], ""
        for _ in range(repeats):
            fd, how = _open_direct(target)
            try:
                _drop_cache(fd)
                t0, done = time.perf_counter(), 0
                while done + DISK_CHUNK <= whole:
                    got = os.preadv(fd, [buffer], done)
                    if got <= 0:
                        break
                    done += got
                times.append((time.perf_counter() - t0, done))
            finally:
                os.close(fd)
        rate = statistics.median(done / t for t, done in times)
        rng = np.random.default_rng(1)
        small = buffer[:4096]
        fd, _ = _open_direct(target)
        try:
            _drop_cache(fd)
            lat = []
            for off in rng.integers(0, whole // 4096, 64) * 4096:
                t0 = time.perf_counter()
                os.preadv(fd, [small], int(off))
                lat.append(time.perf_counter() - t0)
        finally:
            os.close(fd)
        return rate, statistics.median(lat), how
    except OSError as exc:
        raise InputError(f"--disk {path}: cannot read: {exc}") from None
    finally:
        if made is not None:
            made.unlink(missing_ok=True)


def calibrate(backend: str = "threads", progress: Callable[[str], None] | None = None,
              disk: str | Path | None = None) -> DeviceProfile:
    """A device profile measured through `backend`'s paths on this machine (and, with `disk`,
    the drive holding that file or directory)."""
    say = progress or (lambda _: None)
    probe = _probe(backend)
    try:
        say("copies host -> device")
        h2d_rate, h2d_latency = fit_link({n: probe.h2d(n) for n in SIZES})
        say("copies device -> host")
        d2h_rate, d2h_latency = fit_link({n: probe.d2h(n) for n in SIZES})
        say("matmul")
        matmul = {d: probe.matmul_flops(d) for d in ("f16", "bf16", "f32", "f64")}
        say("elementwise and memory")
        vector = probe.vector_flops()
        memory = probe.memory_bandwidth()
        say("per-node overhead")
        overhead, graph_overhead = node_overhead(backend)
        name = f"{backend}-calibrated"
        source = (f"einpage calibrate --backend {backend} on {platform.node() or 'this host'} "
                  f"({probe.describe()}), {date.today().isoformat()}")
        extra = {}
        if disk is not None:
            say(f"disk reads ({disk})")
            rate, latency, how = measure_disk(disk)
            extra = {"disk_bandwidth": rate, "disk_latency": latency}
            source += f"; disk: {disk}, {how}"
        return DeviceProfile(**extra,
            name=name, matmul_flops=matmul, vector_flops={d: vector for d in matmul},
            hbm_bandwidth=memory, h2d_bandwidth=h2d_rate, d2h_bandwidth=d2h_rate,
            memory_bytes=probe.memory_bytes(), copy_latency=(h2d_latency + d2h_latency) / 2,
            launch_overhead=overhead, graph_launch_overhead=graph_overhead, source=source)
    finally:
        probe.close()


def calibrate_host(progress: Callable[[str], None] | None = None) -> HostProfile:
    """A host profile (`einpage.predict.hosts`) measured with NumPy on this machine: what a
    host apply costs in einpage's runtime (the BLAS over every core, NumPy's casts and ufuncs
    on one, the host pool's copies over every core)."""
    from einpage.ir.quant import dequantize, quantize
    from einpage.ir.storage import storage_for
    from einpage.runtime import hostpool, kernels
    from einpage.ir.scalar import x as arg
    from einpage.ir.spec import EinsumSpec
    say = progress or (lambda _: None)
    rng = np.random.default_rng(0)
    say("host matmul (float32, every core)")
    n = 1024
    a = rng.standard_normal((n, n)).astype(np.float32)
    b = rng.standard_normal((n, n)).astype(np.float32)
    matmul = 2 * n ** 3 / median_seconds(lambda: a @ b)
    say("host memory (one core, every core)")
    size = 1 << 24
    src = np.ones(size * 4, np.float32)
    dst = np.empty_like(src)
    core = 2 * src.nbytes / median_seconds(lambda: np.copyto(dst, src))
    cores = hostpool.workers()
    parts = np.array_split(np.arange(src.size), cores)

    def pooled_copy() -> None:
        hostpool.run_all([functools.partial(np.copyto, dst[p[0]:p[-1] + 1], src[p[0]:p[-1] + 1])
                          for p in parts if len(p)])

    memory = max(core, 2 * src.nbytes / median_seconds(pooled_copy))
    say("host elementwise, casts and dequantization (one core)")
    x, y = src[:size], dst[:size]
    vector = 2 * size / median_seconds(lambda: np.add(x, x, out=y))
    half = np.ones(size, np.float16)
    convert = size / median_seconds(lambda: np.copyto(y, half))
    w = rng.standard_normal((256, 4096)).astype(np.float32)
    q4 = storage_for("q4_0", w.shape, 1)
    packed = quantize(w, q4)
    dequant = w.size / median_seconds(lambda: dequantize(packed, q4, w.shape, np.float32))
    say("host kernels (one core)")
    stored_rate, packed_rate = kernel_rates()
    spec = EinsumSpec.parse("ij,jk->ik")
    small = [np.ones((8, 8), np.float32)] * 2
    overhead = median_seconds(lambda: kernels.einsum(spec, arg(0) * arg(1), "sum", small,
                                                     np.dtype(np.float32)))
    return HostProfile(
        name=f"{platform.node() or 'this-host'}-calibrated", matmul_flops=matmul,
        vector_flops=vector, memory_bandwidth=memory, core_bandwidth=core, cores=cores,
        convert_rate=convert, dequant_rate=dequant, apply_overhead=overhead + 10e-6,
        kernels=stored_rate is not None, stored_rate=stored_rate or convert,
        packed_rate=packed_rate or dequant,
        source=f"einpage calibrate --host-out on {platform.node() or 'this host'} "
               f"({cores} cores, NumPy {np.__version__}, kernels: {storedmm.isa()}), "
               f"{date.today().isoformat()}")


def kernel_rates() -> tuple[float | None, float | None]:
    """(f16, Q4_0) elements per second one core takes through the compiled kernels against one
    row, the operand in cache (its memory bandwidth is the profile's other bound); (None,
    None) where the kernels are not built."""
    if not storedmm.available():
        return None, None
    return storedmm.core_rate("f16"), storedmm.core_rate("q4_0")


def _probe(backend: str):
    if backend == "threads":
        return ThreadsProbe()
    from einpage.runtime.backends.cuda_probe import CupyProbe
    return CupyProbe()
