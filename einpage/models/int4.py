"""AWQ and GPTQ checkpoints: group-wise int4 weights read as einpage's `q4_g128` storage.

A Hugging Face checkpoint quantized by AutoAWQ or GPTQ keeps each projection as three tensors
instead of `weight`: `qweight` (int32 words of eight 4-bit values), `qzeros` (the zero points,
packed the same way) and `scales` (f16), one zero and one scale per group of 128 inputs of an
output; `config.json` says which in `quantization_config`. The value of input i of output o is
`(q[i, o] - z[i // 128, o]) * s[i // 128, o]`, exactly what `q4_g128` stores per group (f16 scale,
uint8 zero, the 128 nibbles), so the weights are repacked, never rounded again: einpage computes
what the checkpoint means, and moves 4.25 bits per weight.

- AWQ (`quant_method: awq`, `version: gemm`): `qweight` [in, out/8], word c of input i holding
  outputs c*8 + [0, 2, 4, 6, 1, 3, 5, 7] in nibbles 0..7; `qzeros` [in/128, out/8] likewise.
- GPTQ (`quant_method: gptq`, `desc_act: false`): `qweight` [in/8, out], word r of output o
  holding inputs 8r..8r+7 in nibbles 0..7; `qzeros` [in/128, out/8], nibble j of word c the zero
  of output c*8 + j, stored less one (`checkpoint_format` gptq; `gptq_v2` stores it as is).

Repacking is lazy (`Int4Tensor`): a block of the plan is made from the words it covers when the
plan reads it, never a copy of the model. Group sizes other than 128, other bit widths,
act-order GPTQ (`desc_act`) and AWQ without zero points are refused by name.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from einpage.errors import CheckpointError, ModelError
from einpage.ir.storage import Storage

GROUP = 128
#: AWQ's nibble order: nibble i of a word is output column AWQ_ORDER[i] of its eight
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_AWQ_COLUMNS = np.argsort(AWQ_ORDER)  # column j of the eight is nibble _AWQ_COLUMNS[j]
_SHIFTS = np.arange(0, 32, 4, dtype=np.uint32)


@dataclass(frozen=True, slots=True)
class Int4Scheme:
    """How a checkpoint packs its int4 weights: `method` awq | gptq, `zero_offset` added to a
    stored zero point (1 for GPTQ's original format)."""
    method: str
    zero_offset: int = 0


def scheme_from_config(raw: dict, where: str) -> Int4Scheme | None:
    """The int4 scheme of a `config.json` (None: not quantized); `ModelError` for a
    quantization einpage does not read."""
    q = raw.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ModelError(f"{where}: quantization_config must be an object")
    method = str(q.get("quant_method", "")).lower()
    if method not in ("awq", "gptq"):
        raise ModelError(f"{where}: quantization {method or q!r} is not supported (einpage "
                         "reads AWQ and GPTQ int4 checkpoints)")
    bits = q.get("bits", q.get("w_bit"))
    group = q.get("group_size", q.get("q_group_size"))
    if bits != 4 or group != GROUP:
        raise ModelError(f"{where}: {method} with {bits} bits in groups of {group} is not "
                         f"supported (einpage reads 4 bits in groups of {GROUP})")
    if method == "awq":
        version = str(q.get("version", "gemm")).lower()
        if version != "gemm" or q.get("zero_point", True) is not True:
            raise ModelError(f"{where}: AWQ version {version!r} with zero_point="
                             f"{q.get('zero_point', True)} is not supported (einpage reads "
                             "the GEMM layout with zero points)")
        return Int4Scheme("awq")
    if q.get("desc_act"):
        raise ModelError(f"{where}: GPTQ with desc_act (act-order groups) is not supported: "
                         "its groups are not runs of 128 inputs")
    fmt = str(q.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ModelError(f"{where}: GPTQ checkpoint_format {fmt!r} is not supported")
    return Int4Scheme("gptq", 1 if fmt == "gptq" else 0)


class Int4Tensor:
    """One projection's weight as `q4_g128` packed bytes of its graph shape `logical` (rows: the
    last `row_axes` axes, the checkpoint's inputs): an array-like whose `shape` is the packed
    shape and whose basic slicing repacks just the words a block covers."""

    def __init__(self, scheme: Int4Scheme, qweight: np.ndarray, qzeros: np.ndarray,
                 scales: np.ndarray, logical: tuple[int, ...], row_axes: int,
                 storage: Storage, name: str):
        self.scheme, self.storage, self.name = scheme, storage, name
        self.qweight, self.qzeros, self.scales = qweight, qzeros, scales
        self.logical, self.row_axes = tuple(logical), row_axes
        self.outputs = math.prod(logical[:len(logical) - row_axes])
        self.inputs = math.prod(logical[len(logical) - row_axes:])
        self.shape = storage.packed_shape(self.logical)
        self._check()

    def _check(self) -> None:
        o, i = self.outputs, self.inputs
        want = {"awq": ((i, o // 8), (i // GROUP, o // 8), (i // GROUP, o)),
                "gptq": ((i // 8, o), (i // GROUP, o // 8), (i // GROUP, o))}[self.scheme.method]
        got = tuple(tuple(a.shape) for a in (self.qweight, self.qzeros, self.scales))
        if o % 8 or i % GROUP or got != want:
            raise CheckpointError(f"{self.name}: {self.scheme.method} tensors qweight, qzeros, "
                                  f"scales of shapes {list(got)}, expected {list(want)} for "
                                  f"{o} outputs of {i} inputs")

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = self[tuple(slice(None) for _ in self.shape)]
        return out if dtype is None else out.astype(dtype)

    def __getitem__(self, index) -> np.ndarray:
        index = index if isinstance(index, tuple) else (index,)
        if len(index) != len(self.shape) or not all(
                isinstance(s, slice) and s.step in (None, 1) for s in index):
            raise IndexError(f"{self.name}: int4 weights take one unit-step slice per axis")
        full, span = self.logical, self.storage.span
        first_in, first_span = len(full) - self.row_axes, len(full) - span
        ranges = [range(*index[d].indices(full[d])) for d in range(first_span)]
        p0, p1, _ = index[-1].indices(self.shape[-1])
        per_group = self.storage.spec.group_bytes
        g0, g1 = -(-p0 // per_group), p1 // per_group
        outs = _ravel(ranges[:first_in], full[:first_in])
        leads = _ravel(ranges[first_in:], full[first_in:first_span])
        row = math.prod(full[first_span:]) // GROUP  # groups per span row
        groups = (leads[:, None] * row + np.arange(g0, g1)[None, :]).reshape(-1)
        q, z, s = self._values(outs, groups)
        packed = _pack(q, z, s)  # [outs, groups, 68]
        box = tuple(len(r) for r in ranges) + ((g1 - g0) * per_group,)
        return packed.reshape(box)

    def _values(self, outs: np.ndarray, groups: np.ndarray):
        """(q [groups, 128, outs], zeros [groups, outs], scales f16 [groups, outs])."""
        rows = (groups[:, None] * GROUP + np.arange(GROUP)[None, :]).reshape(-1)
        scales = np.asarray(self.scales[groups][:, outs], dtype=np.float16)
        words = self.qzeros[groups][:, outs // 8].astype(np.uint32)
        if self.scheme.method == "awq":
            qw = self.qweight[rows][:, outs // 8].astype(np.uint32)
            shift = _SHIFTS[_AWQ_COLUMNS[outs % 8]]
            q = (qw >> shift) & 15
            zeros = (words >> shift) & 15
        else:
            qw = self.qweight[rows // 8][:, outs].astype(np.uint32)
            q = (qw >> _SHIFTS[rows % 8][:, None]) & 15
            zeros = (words >> _SHIFTS[outs % 8]) & 15
        zeros = zeros + self.scheme.zero_offset
        return (q.astype(np.uint8).reshape(len(groups), GROUP, len(outs)),
                zeros.astype(np.uint8), scales)


def _ravel(ranges: list[range], shape: tuple[int, ...]) -> np.ndarray:
    """Flat C-order indices of the box `ranges` of an array of `shape`."""
    if not ranges:
        return np.zeros(1, dtype=np.int64)
    grids = np.meshgrid(*[np.arange(r.start, r.stop) for r in ranges], indexing="ij")
    return np.ravel_multi_index([g.reshape(-1) for g in grids], shape).astype(np.int64)


def _pack(q: np.ndarray, zeros: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """q4_g128 groups [outs, groups, 68] from q [groups, 128, outs], zeros and scales
    [groups, outs] (`einpage.ir.quant`'s layout: scale, zero, pad, nibbles i and i + 64 sharing
    byte i)."""
    q = np.ascontiguousarray(q.transpose(2, 0, 1))  # [outs, groups, 128]
    out = np.zeros(q.shape[:2] + (4 + GROUP // 2,), np.uint8)
    out[..., 0:2] = np.ascontiguousarray(scales.T).view(np.uint8).reshape(q.shape[:2] + (2,))
    out[..., 2] = zeros.T
    out[..., 4:] = q[..., :GROUP // 2] | (q[..., GROUP // 2:] << np.uint8(4))
    return out
