"""What the bytes of each storage format (`einpage.ir.storage`) mean: quantize and dequantize
with NumPy. The reference codec of the formats, used by every layer that holds packed bytes
(the runtimes, the KV store, checkpoint readers).

`quantize` rounds exactly as the `gguf` package's quantizer (llama.cpp's reference rows), so a
checkpoint quantized here gives the bytes of a GGUF file written by it; tests hold it to that.
`dequantize` is the kernel every NumPy backend runs on a packed operand before the op; it works
group-row by group-row in chunks of `CHUNK_GROUPS` so that its temporaries stay in cache.
"""
from __future__ import annotations

import numpy as np

from einpage.ir.storage import Storage, get_format

#: Groups dequantized per pass over a block: the temporaries of one chunk (a few float32
#: copies of 64 Ki elements) stay in a core's L2 cache.
CHUNK_GROUPS = 2048


def quantize(values: np.ndarray, storage: Storage) -> np.ndarray:
    """The packed bytes (`storage.packed_shape(values.shape)`, uint8) of a logical block."""
    f = storage.spec
    if not f.writable:
        raise ValueError(f"einpage cannot quantize to {f.name}; it reads it from files only")
    shape = tuple(values.shape)
    why = storage.fits(shape)
    if why:
        raise ValueError(f"cannot store a {list(shape)} block as {f.name}: {why}")
    blocks = np.asarray(values, dtype=np.float32).reshape(-1, f.group)
    with np.errstate(over="ignore", invalid="ignore"):  # scales past f16: gguf's bytes too
        packed = _QUANTIZE[f.name](blocks)
    return packed.reshape(storage.packed_shape(shape))


def dequantize(packed: np.ndarray, storage: Storage, shape: tuple[int, ...],
               dtype: np.dtype, rounded: np.dtype | None = None) -> np.ndarray:
    """The logical block of `shape` (in `dtype`) whose packed bytes are `packed`. With
    `rounded` (a narrower float type), the values are those of the block in `rounded`, held in
    `dtype`: what a contraction computing in float32 reads of an f16 block, without the f16
    copy (for the 4-bit formats only each group's 16 levels are rounded, then gathered)."""
    f = get_format(storage.format)
    rows = np.ascontiguousarray(packed).reshape(-1, f.group_bytes)
    out = np.empty(shape, dtype=dtype)
    flat = out.reshape(-1, f.group)
    if flat.shape[0] != rows.shape[0]:
        raise ValueError(f"{rows.shape[0]} {f.name} groups cannot fill a block of {list(shape)}")
    rounded = None if rounded is None or np.dtype(rounded) == np.dtype(dtype) else rounded
    levels = _LEVELS.get(f.name) if np.dtype(dtype) == np.float32 else None
    kernel = _DEQUANTIZE[f.name]
    for start in range(0, rows.shape[0], CHUNK_GROUPS):
        stop = start + CHUNK_GROUPS
        chunk = rows[start:stop]
        if levels is not None:  # 4 bits: 16 levels per group, rounded once each
            table = levels(chunk)
            if rounded is not None:
                table = table.astype(rounded).astype(np.float32)
            _gather_levels(table, chunk[:, f.group_bytes - f.group // 2:], flat[start:stop])
        elif rounded is not None:
            flat[start:stop] = kernel(chunk).astype(rounded)
        else:
            flat[start:stop] = kernel(chunk)
    return out


def dequantize_box(whole, storage: Storage, origin: tuple[int, ...], shape: tuple[int, ...],
                   full: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """The box `origin`+`shape` of a tensor of logical shape `full` whose packed bytes are
    `whole` (an array or memory map: only the whole groups around the box are read), in
    `dtype`; the box need not hold whole groups."""
    wide_origin, wide_shape = storage.covering(origin, shape, full)
    o, n = storage.packed_box(wide_origin, wide_shape, full)
    wide = dequantize(np.asarray(whole[tuple(slice(a, a + b) for a, b in zip(o, n))]),
                      storage, wide_shape, dtype)
    return wide[tuple(slice(a - w, a - w + b) for a, w, b in zip(origin, wide_origin, shape))]


def _gather_levels(table: np.ndarray, qs: np.ndarray, out: np.ndarray) -> None:
    """`out[g, i]` = `table[g, nibble i of group g]` (element i in the low nibble of byte i,
    element i + half in its high nibble)."""
    n, half = qs.shape
    index = np.empty((n, 2 * half), np.intp)
    np.bitwise_and(qs, 15, out=index[:, :half], casting="unsafe")
    np.right_shift(qs, 4, out=index[:, half:], casting="unsafe")
    index += (np.arange(n, dtype=np.intp) * 16)[:, None]
    table.reshape(-1).take(index, out=out)


# ------------------------------------------------------------------ GGUF's rounding

def _roundf(x: np.ndarray) -> np.ndarray:
    """C's `roundf` (half away from zero), as gguf's `np_roundf`."""
    a = np.abs(x)
    floored = np.floor(a)
    return np.sign(x) * (floored + np.floor(2 * (a - floored)))


def _inverse(d: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(d == 0, 0, 1 / d)


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """Pack uint4 values: element i and i + half share byte i (low, high nibble)."""
    half = q.shape[1] // 2
    return q[:, :half] | (q[:, half:] << np.uint8(4))


def _unnibble(qs: np.ndarray) -> np.ndarray:
    return np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=1)


def _q8_0(blocks: np.ndarray) -> np.ndarray:
    d = np.abs(blocks).max(axis=1, keepdims=True) / 127
    qs = _roundf(blocks * _inverse(d))
    return np.concatenate([_f16_bytes(d), qs.astype(np.int8).view(np.uint8)], axis=1)


def _q4_0(blocks: np.ndarray) -> np.ndarray:
    imax = np.abs(blocks).argmax(axis=-1, keepdims=True)
    d = np.take_along_axis(blocks, imax, axis=-1) / -8
    q = np.trunc(blocks * _inverse(d) + np.float32(8.5), dtype=np.float32)
    return np.concatenate([_f16_bytes(d), _nibbles(q.astype(np.uint8).clip(0, 15))], axis=1)


def _q4_1(blocks: np.ndarray) -> np.ndarray:
    top = blocks.max(axis=-1, keepdims=True)
    low = blocks.min(axis=-1, keepdims=True)
    d = (top - low) / 15
    q = np.trunc((blocks - low) * _inverse(d) + np.float32(0.5), dtype=np.float32)
    return np.concatenate([_f16_bytes(d), _f16_bytes(low),
                           _nibbles(q.astype(np.uint8).clip(0, 15))], axis=1)


def _q4_g128(blocks: np.ndarray) -> np.ndarray:
    """Asymmetric min-max int4 (AWQ's quantizer without its search): scale (max - min) / 15,
    zero point round(-min / scale), value (q - zero) * scale."""
    top = np.maximum(blocks.max(axis=-1, keepdims=True), 0)
    low = np.minimum(blocks.min(axis=-1, keepdims=True), 0)
    scale = ((top - low) / 15).astype(np.float16).astype(np.float32)
    inv = _inverse(scale)
    zero = np.clip(_roundf(-low * inv), 0, 15)
    q = np.clip(_roundf(blocks * inv) + zero, 0, 15).astype(np.uint8)
    pad = np.zeros_like(zero, dtype=np.uint8)
    return np.concatenate([_f16_bytes(scale), zero.astype(np.uint8), pad, _nibbles(q)], axis=1)


def _dq8_0(rows: np.ndarray) -> np.ndarray:
    d = rows[:, :2].copy().view(np.float16).astype(np.float32)
    return d * rows[:, 2:].view(np.int8).astype(np.float32)


def _dq4_0(rows: np.ndarray) -> np.ndarray:
    d = rows[:, :2].copy().view(np.float16).astype(np.float32)
    return d * (_unnibble(rows[:, 2:]).astype(np.float32) - 8)


def _dq4_1(rows: np.ndarray) -> np.ndarray:
    d = rows[:, :2].copy().view(np.float16).astype(np.float32)
    m = rows[:, 2:4].copy().view(np.float16).astype(np.float32)
    return d * _unnibble(rows[:, 4:]).astype(np.float32) + m


def _dq4_g128(rows: np.ndarray) -> np.ndarray:
    s = rows[:, :2].copy().view(np.float16).astype(np.float32)
    z = rows[:, 2:3].astype(np.float32)
    return (_unnibble(rows[:, 4:]).astype(np.float32) - z) * s


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's eight 6-bit scales and minima from their 12 bytes."""
    n = scales.shape[0]
    d, m, md = (scales[:, 4 * k:4 * k + 4] for k in range(3))
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.reshape(n, 8), mn.reshape(n, 8)


def _dq4_k(rows: np.ndarray) -> np.ndarray:
    n = rows.shape[0]
    d = rows[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = rows[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, mn = _k_scales(rows[:, 4:16])
    qs = rows[:, 16:].reshape(n, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    q = (qs & np.uint8(0x0F)).reshape(n, 8, 32).astype(np.float32)
    scale = (d * sc.astype(np.float32)).reshape(n, 8, 1)
    low = (dmin * mn.astype(np.float32)).reshape(n, 8, 1)
    return (scale * q - low).reshape(n, 256)


def _dq6_k(rows: np.ndarray) -> np.ndarray:
    n = rows.shape[0]
    ql, qh, scales, d = rows[:, :128], rows[:, 128:192], rows[:, 192:208], rows[:, 208:210]
    d = d.copy().view(np.float16).astype(np.float32)
    scale = (d * scales.view(np.int8).astype(np.float32)).reshape(n, 16, 1)
    lo = ql.reshape(n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    lo = (lo & np.uint8(0x0F)).reshape(n, 8, 32)
    hi = qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    hi = (hi & np.uint8(0x03)).reshape(n, 8, 32)
    q = ((lo | (hi << np.uint8(4))).astype(np.int8) - np.int8(32)).reshape(n, 16, 16)
    return (scale * q.astype(np.float32)).reshape(n, 256)


_STEPS = np.arange(16, dtype=np.float32)


def _levels4_0(rows: np.ndarray) -> np.ndarray:
    d = rows[:, :2].copy().view(np.float16).astype(np.float32)
    return d * (_STEPS - 8)


def _levels4_1(rows: np.ndarray) -> np.ndarray:
    d = rows[:, :2].copy().view(np.float16).astype(np.float32)
    m = rows[:, 2:4].copy().view(np.float16).astype(np.float32)
    return d * _STEPS + m


def _levels4_g128(rows: np.ndarray) -> np.ndarray:
    s = rows[:, :2].copy().view(np.float16).astype(np.float32)
    z = rows[:, 2:3].astype(np.float32)
    return (_STEPS - z) * s


#: the 16 values a 4-bit group's nibbles stand for, per group (the same arithmetic as the
#: dequantizers above, so a gather from them gives the same bits)
_LEVELS = {"q4_0": _levels4_0, "q4_1": _levels4_1, "q4_g128": _levels4_g128}

_QUANTIZE = {"q8_0": _q8_0, "q4_0": _q4_0, "q4_1": _q4_1, "q4_g128": _q4_g128}
_DEQUANTIZE = {"q8_0": _dq8_0, "q4_0": _dq4_0, "q4_1": _dq4_1, "q4_g128": _dq4_g128,
               "q4_k": _dq4_k, "q6_k": _dq6_k}
