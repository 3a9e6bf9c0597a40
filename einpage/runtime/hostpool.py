"""The host queue's worker pool: a contraction placed on the host runs on every core.

NumPy's BLAS already spreads one matrix product over the cores, but the host applies of a decode
step are thin products (a few query rows against a block of the KV store, one token's row against
an expert's weights) over operands held as f16 or bf16, which NumPy converts to float32 on one
core, element by element, before the product: the conversion, not the product, is the cost. So a
host contraction is cut along one free index of its output into a chunk per worker (the index
that partitions the most bytes of its operands: a block of keys along its rows), and each worker
converts and multiplies its own slice, cache-sized, while NumPy has released the GIL. Chunks
write disjoint slices of the output, so the result is the one apply's, bit for bit in the
operands' precision (each output element is computed by one worker, with the same reduction).
"""
from __future__ import annotations

import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

import numpy as np

from einpage.ir.ops import EinsumOp
from einpage.runtime import kernels

#: below this many operand bytes an apply runs in one piece (a chunk's dispatch costs ~20 us)
MIN_POOLED_BYTES = 1 << 20

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def workers() -> int:
    """The pool's size: the cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def run_all(jobs: Sequence[Callable[[], object]]) -> None:
    """Run `jobs` on the pool (made at first use, `workers()` threads) and wait for all of them;
    the first failure is raised."""
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=workers(), thread_name_prefix="einpage-host")
        pool = _pool
    for f in [pool.submit(job) for job in jobs]:
        f.result()


def split_axis(op: EinsumOp, shapes: Sequence[tuple[int, ...]]) -> str | None:
    """The output index to cut a contraction along: the free index (in the output) that
    partitions the most operand elements, among those of size >= 2; None if there is none."""
    spec = op.spec
    best, key = None, None
    sizes = spec.sizes(shapes)
    for c in spec.output:
        if int(sizes[c]) < 2:
            continue
        cut = sum(int(np.prod(s)) for term, s in zip(spec.inputs, shapes) if c in term)
        k = (cut, int(sizes[c]))
        if key is None or k > key:
            best, key = c, k
    return best


def pooled_einsum(op: EinsumOp, reads: Sequence[np.ndarray], write: np.ndarray,
                  accumulate: bool) -> bool:
    """Compute einsum `op` into `write` (folding into it when `accumulate`) on the pool, a chunk
    per worker; False (nothing done) where it is not worth cutting: one core, small operands, or
    no free index to cut."""
    count = workers()
    if count < 2 or sum(r.nbytes for r in reads) < MIN_POOLED_BYTES:
        return False
    c = split_axis(op, [r.shape for r in reads])
    if c is None:
        return False
    spec = op.spec
    size = write.shape[spec.output.index(c)]
    pieces = min(count, size)
    bounds = [size * k // pieces for k in range(pieces + 1)]

    def cut(term: str, array: np.ndarray, lo: int, hi: int) -> np.ndarray:
        if c not in term:
            return array
        index = [slice(None)] * array.ndim
        index[term.index(c)] = slice(lo, hi)
        return array[tuple(index)]

    def chunk(lo: int, hi: int) -> None:
        part_reads = [cut(term, r, lo, hi) for term, r in zip(spec.inputs, reads)]
        out = cut(spec.output, write, lo, hi)
        part = kernels.einsum(spec, op.join, op.agg, part_reads, op.dtype.compute)
        if accumulate:
            part = kernels.combine(op.agg, out.astype(op.dtype.compute),
                                   part.astype(op.dtype.compute, copy=False))
        out[...] = part.astype(write.dtype, copy=False)

    run_all([functools.partial(chunk, lo, hi) for lo, hi in zip(bounds, bounds[1:]) if hi > lo])
    return True


def pooled_rows(count: int, nbytes: int, job: Callable[[int, int], None]) -> None:
    """`job(lo, hi)` over rows [0, count) of a write of `nbytes`: on the pool, a range of rows
    per worker, where there are several workers and the write is at least MIN_POOLED_BYTES;
    else in one piece (a gather of embedding rows on the host: each row is one worker's)."""
    pieces = min(workers(), count) if nbytes >= MIN_POOLED_BYTES else 1
    if pieces < 2:
        job(0, count)
        return
    bounds = [count * k // pieces for k in range(pieces + 1)]
    run_all([functools.partial(job, lo, hi) for lo, hi in zip(bounds, bounds[1:]) if hi > lo])


__all__ = ["MIN_POOLED_BYTES", "pooled_einsum", "pooled_rows", "run_all", "split_axis",
           "workers"]
