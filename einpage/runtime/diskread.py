"""Reading weight blocks from the checkpoint files: what a `read` node does (disk -> a staging
buffer in host memory), on the runtime's disk queue.

A weight source that lies in files (`CheckpointWeights`) says where each weight is
(`locate(name)`: file, byte offset, file dtype, logical shape; a safetensors tensor is C-ordered,
so a block of it is a set of contiguous byte runs). A block is read with `os.preadv` straight into
its staging buffer when the file holds the plan's dtype and the runs are few; otherwise the
smallest byte range covering it is read once into a scratch buffer and the block is copied out of
it (converting the dtype on the way). Reads use plain buffered I/O: the page cache may serve
them. `drop_cache` (for measurements: `bench/disk_bench.py`) tells the kernel to drop the pages
read (`posix_fadvise(DONTNEED)`), so that every pass reads the drive again.

A weight source without files (random weights, arrays in memory) is read through
`PlanIO.read_into`: the "disk" is whatever holds the source.
"""
from __future__ import annotations

import math
import os
import threading
from pathlib import Path

import numpy as np

from einpage.errors import CheckpointError
from einpage.ir.tensors import FileTensor
from einpage.runtime.planio import PlanIO, tensor_info

#: a block of at most this many byte runs is read run by run, straight into its buffer
MAX_RUNS = 64


def block_runs(full: tuple[int, ...], origin: tuple[int, ...], shape: tuple[int, ...],
               itemsize: int) -> tuple[np.ndarray, int]:
    """(start byte of every contiguous run, bytes per run) of the box `origin`+`shape` of a
    C-ordered array of shape `full`, in the box's C order."""
    k = len(full) - 1
    while k > 0 and shape[k] == full[k]:
        k -= 1
    inner = math.prod(full[k + 1:])
    run = shape[k] * inner * itemsize
    strides = [math.prod(full[j + 1:]) * itemsize for j in range(len(full))]
    base = sum(o * s for o, s in zip(origin, strides))
    starts = np.zeros(1, dtype=np.int64) + base
    for j in range(k):
        starts = (starts[:, None] + np.arange(shape[j], dtype=np.int64) * strides[j]).ravel()
    return starts, run


class DiskReader:
    """Reads input blocks of a plan into host buffers (one reader thread calls `read`)."""

    def __init__(self, io: PlanIO, drop_cache: bool = False):
        self.io, self.drop_cache = io, drop_cache
        self._files: dict[Path, int] = {}
        self._located: dict[str, FileTensor | None] = {}
        self._lock = threading.Lock()
        self.bytes_read = 0  # bytes that came from files (runs, or covering ranges)

    def _locate(self, name: str) -> FileTensor | None:
        if name not in self._located:
            locate = getattr(self.io.weights, "locate", None)
            self._located[name] = locate(name) if locate is not None else None
        return self._located[name]

    def _fd(self, path: Path) -> int:
        with self._lock:
            fd = self._files.get(path)
            if fd is None:
                try:
                    fd = os.open(path, os.O_RDONLY)
                except OSError as exc:
                    raise CheckpointError(f"{path}: cannot open for reading: {exc}") from None
                self._files[path] = fd
            return fd

    def read(self, tid: int, out: np.ndarray) -> None:
        """Block `tid` into `out` (C-contiguous, the plan's dtype and the block's shape)."""
        t = tensor_info(self.io.mg, tid)
        src = t.source
        where = self._locate(src.input) if src is not None and t.role == "weight" else None
        if (where is None or tuple(where.shape) != tuple(src.full_shape)
                or where.storage != t.storage):  # converted (quantized) as the source reads it
            self.io.read_into(tid, out)
            return
        full, origin, shape = tuple(where.shape), tuple(src.origin), tuple(t.shape)
        if t.storage is None:
            itemsize, dtype, same = where.dtype.itemsize, where.dtype.numpy, where.dtype == t.dtype
        else:  # packed bytes, as the file holds them
            origin, shape = t.storage.packed_box(origin, shape, full)
            full, itemsize, dtype, same = t.storage.packed_shape(full), 1, np.uint8, True
        starts, run = block_runs(full, origin, shape, itemsize)
        starts = starts + where.offset
        fd = self._fd(where.path)
        raw = out.reshape(-1).view(np.uint8)
        if same and len(starts) <= MAX_RUNS:
            for k, start in enumerate(starts):
                self._pread(fd, raw[k * run:(k + 1) * run], int(start), where.path)
        else:
            lo, hi = int(starts[0]), int(starts[-1]) + run
            scratch = np.empty(hi - lo, dtype=np.uint8)
            self._pread(fd, scratch, lo, where.path)
            strides = tuple(math.prod(full[j + 1:]) * itemsize for j in range(len(full)))
            block = np.lib.stride_tricks.as_strided(scratch.view(dtype), shape, strides,
                                                    writeable=False)
            np.copyto(out, block, casting="unsafe")

    def _pread(self, fd: int, into: np.ndarray, offset: int, path: Path) -> None:
        view = memoryview(into)
        done = 0
        while done < len(view):
            got = os.preadv(fd, [view[done:]], offset + done)
            if got <= 0:
                raise CheckpointError(f"{path}: short read at byte {offset + done} (the file "
                                      "changed or is truncated)")
            done += got
        self.bytes_read += done
        if self.drop_cache:
            os.posix_fadvise(fd, offset, done, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        with self._lock:
            for fd in self._files.values():
                os.close(fd)
            self._files.clear()
