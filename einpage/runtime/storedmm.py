"""Contractions that read a stored operand as it lies: a weight (or KV block) held as f16, bf16
or a block format (`einpage.ir.storage`), multiplied on the CPU without a float32 copy of it.

NumPy's path converts such an operand whole before the BLAS reads it (`kernels.einsum`;
`quant.dequantize` for packed bytes): a pass of NumPy's element loops per step of the
conversion, each writing a float32 array as large as the operand. That conversion, not the
product, bounds every CPU pass that streams weights (RESULTS.md, "quantized weights" and "applies
placed on the host"). The compiled kernels of `einpage.runtime._cpu` instead decode each row of
the stored operand as they reach it:

- few rows on the other side (decode: a token or a few per sequence, `GEMV_ROWS` or fewer):
  `_cpu.gemv` decodes one row at a time into a buffer in L1 and dots it with every row, the
  operand's rows cut into a chunk per core (`hostpool`);
- many rows (prefill): `_cpu.dequant` decodes a tile of rows (`TILE_ELEMENTS`) and the BLAS
  multiplies it, on every core. Measured on this machine's Xeon (4096 x 4096 f16 weight): the
  BLAS repacks the other operand at every call, so tiles as small as the L2 lose to one
  conversion of the whole weight once the other side has 64 rows or more (512 rows: 105 ms
  with 64-row tiles, 63 ms with 1024-row tiles, 90 ms NumPy's cast and product); and tiles run
  side by side on the host pool lose to the BLAS's own threads.

Values are exactly the NumPy path's (packed values rounded to the logical dtype, as
`quant.dequantize(..., rounded=...)` and the GPU do); sums run in float32 in another order.

The shape of a contraction this takes (`einpage.ir.stored.layout`): two operands, a scaled product summed (`x . W`), the
stored operand W's contracted indices last (so each output element reads one run of W's bytes:
`bsm,fm->bsf`, `bsngrj,mngrj->bsm`), float32 compute; indices shared by both operands and the
output (a batch: `bsnguj,btnuj->bngst`, a decode step's attention over an f16 KV block) where the
other side has few rows. Anything else returns None and goes NumPy's way. Without the compiled
module (no C compiler at install) everything goes NumPy's way.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import time
from typing import Sequence

import numpy as np

from einpage.ir.stored import FORMAT_CODES, GEMV_ROWS, Layout
from einpage.runtime import hostpool

try:
    from einpage.runtime import _cpu
except ImportError:  # built without a C compiler: NumPy's paths only
    _cpu = None

#: Elements of a decoded tile (float32: 16 MiB; see above for why not an L2's worth).
TILE_ELEMENTS = 1 << 22
#: Stored elements per core below which `gemv` runs in one piece (a chunk's dispatch ~20 us).
POOL_ELEMENTS = 1 << 16

if _cpu is not None:
    assert [FORMAT_CODES[k] for k in ("float16", "bfloat16", "q8_0", "q4_0", "q4_1", "q4_g128")
            ] == [_cpu.F16, _cpu.BF16, _cpu.Q8_0, _cpu.Q4_0, _cpu.Q4_1, _cpu.Q4_G128]


def available() -> bool:
    """Whether the compiled kernels are installed."""
    return _cpu is not None


def isa() -> str:
    """The kernels' code path ('avx512', 'avx2', 'portable'), or 'numpy' without them."""
    return _cpu.isa() if _cpu is not None else "numpy"


def product(lay: Layout, reads: Sequence[np.ndarray]) -> np.ndarray:
    """The contraction's value (float32, the output's shape) from its two operands."""
    stored = reads[lay.w]
    nb, m, n, k = math.prod(lay.batch), lay.rows, math.prod(lay.free_w), lay.k
    view = None
    if not stored.flags.c_contiguous and m <= GEMV_ROWS and not (lay.batch or lay.transposed):
        view = _rows_as_they_lie(stored, len(lay.free_w))
    if view is not None:  # a block of a larger array (a weight cut by columns, in its file)
        raw, stride = view
        lay = dataclasses.replace(lay, row_stride=stride)
    else:
        raw = np.ascontiguousarray(stored).view(np.uint8).reshape(-1)
    x = np.ascontiguousarray(reads[1 - lay.w].transpose(lay.x_axes), dtype=np.float32)
    x = x.reshape(nb, m, k)
    if m <= GEMV_ROWS:
        out = np.empty((nb, m, n), np.float32)
        _cut(nb, n, k, lay.group if lay.transposed else 1,
             functools.partial(_gemv, lay, x, raw, out, m, n))
    else:  # (no batch here: `layout`)
        out_t = np.empty((n, m), np.float32)  # rows of W are rows here: contiguous tiles
        _tiles(lay, x[0], raw, out_t)
        out = out_t.T
    if lay.factor != 1.0:
        out *= np.float32(lay.factor)
    return out.reshape(lay.batch + lay.free_x + lay.free_w).transpose(lay.perm)


def _rows_as_they_lie(stored: np.ndarray, rows_axes: int) -> tuple[np.ndarray, int] | None:
    """(the bytes from W's first row to the end of its last, as one flat array; the byte
    stride of its rows) where `stored` is a view whose leading `rows_axes` axes step through
    rows at one stride and whose other axes are each row's one contiguous run, as a weight
    block cut by columns lies in its checkpoint (a host apply reads it there); None otherwise
    (it is copied then)."""
    shape, strides, item = stored.shape, stored.strides, stored.itemsize
    if rows_axes < 1 or stored.ndim <= rows_axes or any(s < 0 for s in strides):
        return None
    run = item
    for i in range(stored.ndim - 1, rows_axes - 1, -1):
        if shape[i] != 1 and strides[i] != run:
            return None
        run *= shape[i]
    # the row axes, those of one row dropped (their stride says nothing), one stride apart
    steps = [(n, st) for n, st in zip(shape[:rows_axes], strides[:rows_axes]) if n != 1]
    stride = steps[-1][1] if steps else run
    if any(st != nxt_st * nxt_n for (_, st), (nxt_n, nxt_st) in zip(steps, steps[1:])):
        return None
    if stride < run:
        return None  # rows overlap (a broadcast weight): copied
    rows = math.prod(shape[:rows_axes])
    span = (rows - 1) * stride + run
    flat = np.lib.stride_tricks.as_strided(stored, shape=(span // item,), strides=(item,))
    return flat.view(np.uint8), stride


def _cut(nb: int, n: int, k: int, step: int, work) -> None:
    """Run `work(b0, b1, n0, n1)` over the batches and outputs of W, a share per core where that
    pays: whole batches where there are enough of them, else ranges of outputs cut at
    multiples of `step` (W's groups, where they run along the outputs)."""
    count = min(hostpool.workers(), max(1, nb * n * k // POOL_ELEMENTS))
    if count < 2:
        work(0, nb, 0, n)
        return
    if nb >= count:
        cuts = [nb * i // count for i in range(count + 1)]
        jobs = [functools.partial(work, b0, b1, 0, n) for b0, b1 in zip(cuts, cuts[1:])]
    else:
        count = min(count, n // step)
        cuts = [n // step * i // count * step for i in range(count + 1)]
        jobs = [functools.partial(work, b, b + 1, n0, n1) for b in range(nb)
                for n0, n1 in zip(cuts, cuts[1:])]
    hostpool.run_all(jobs)


def _gemv(lay: Layout, x, raw, out, m: int, n: int, b0: int, b1: int, n0: int, n1: int
          ) -> None:
    _cpu.gemv(x, raw, out, lay.fmt, lay.round, m, n, lay.k, lay.offsets, lay.row_stride, b0, b1,
              n0, n1, lay.transposed)


def _tiles(lay: Layout, x, raw, out_t) -> None:
    """`out_t` (W's rows by x's) a tile of W's rows at a time: decoded, then the BLAS."""
    k, n = lay.k, out_t.shape[0]
    rows = max(1, TILE_ELEMENTS // k)
    tile = np.empty((min(rows, n), k), np.float32)
    for start in range(0, n, rows):
        stop = min(n, start + rows)
        part = tile[:stop - start]
        _cpu.dequant(raw, part, lay.fmt, lay.round, k, start, stop)
        np.matmul(part, x.T, out=out_t[start:stop])


def core_rate(fmt: str, rows: int = 1, repeats: int = 20) -> float:
    """Elements of a stored operand in format `fmt` ('f16', 'bf16' or a block format) one core
    takes through `gemv` per second against `rows` rows, the operand (64 x 4096) in cache: the
    kernels' compute rate, apart from the memory's (the median of 15 timings)."""
    from einpage.ir.quant import quantize
    from einpage.ir.storage import Storage
    rng = np.random.default_rng(0)
    n, k = 64, 4096
    w = rng.standard_normal((n, k)).astype(np.float32)
    if fmt in ("f16", "bf16"):
        raw = w.astype(np.float16 if fmt == "f16" else "bfloat16").view(np.uint8).reshape(-1)
        code = FORMAT_CODES["float16" if fmt == "f16" else "bfloat16"]
    else:
        raw, code = quantize(w, Storage(fmt, 1)).reshape(-1), FORMAT_CODES[fmt]
    x = rng.standard_normal((rows, k)).astype(np.float32)
    out = np.empty((rows, n), np.float32)
    offsets = np.zeros(1, np.int64).tobytes()
    times = []
    for _ in range(15):
        start = time.perf_counter()
        for _ in range(repeats):
            _cpu.gemv(x, raw, out, code, 1, rows, n, k, offsets, raw.size // n, 0, 1, 0, n)
        times.append((time.perf_counter() - start) / repeats)
    return n * k / statistics.median(times)


def isas() -> tuple[str, ...]:
    """The kernels' code paths this CPU can take, best last (none without the kernels)."""
    return _cpu.isas() if _cpu is not None else ()


def use_isa(name: str) -> str:
    """Make the kernels take code path `name` (one of `isas()`; tests); returns it."""
    return _cpu.use_isa(name)


__all__ = ["POOL_ELEMENTS", "TILE_ELEMENTS", "available", "core_rate",
           "isa", "isas", "product", "use_isa"]
