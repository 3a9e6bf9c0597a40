"""Storage formats: how a weight's bytes are laid out when it is kept quantized.

A tensor with a `Storage` is still a logical tensor of its shape and dtype for every op; only its
bytes differ. They are *packed*: the trailing `span` axes, flattened, form rows cut into groups of
`group` elements, and each group is stored in `group_bytes` bytes (GGUF's block formats; the
group-wise int4 of AWQ/GPTQ checkpoints). The packed bytes of a tensor form a `uint8` array of
shape `shape[:-span] + (row // group * group_bytes,)` in C order, which is byte for byte the layout
of a GGUF tensor whose rows are the last `span` axes (or any multiple of them): groups never cross
a row, and rows follow each other.

A block of such a tensor is a box whose packed bytes are again a box of that array: the axes of
the span after the first are whole, and the first one is cut at whole groups (`packed_box`). The
partitioner cuts every quantized tensor that way; transfers, arenas and tiers count packed bytes;
an apply that reads a packed block dequantizes it (`einpage.ir.quant`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from einpage.errors import PlanError, SpecError


@dataclass(frozen=True, slots=True)
class Format:
    """A block format: `group` elements in `group_bytes` bytes. `writable`: einpage can quantize
    to it (`--quantize`); the others are read from files only (GGUF's k-quants)."""
    name: str
    group: int
    group_bytes: int
    writable: bool
    layout: str  # one line for `einpage models` and the docs

    @property
    def bits(self) -> float:
        """Bits per element, scales and minima included."""
        return 8 * self.group_bytes / self.group


#: Every storage format, by name (GGUF's type names in lower case; `q4_g128` is einpage's own).
FORMATS: dict[str, Format] = {f.name: f for f in (
    Format("q8_0", 32, 34, True, "f16 scale, 32 int8"),
    Format("q4_0", 32, 18, True, "f16 scale, 32 int4 (offset 8)"),
    Format("q4_1", 32, 20, True, "f16 scale, f16 minimum, 32 uint4"),
    Format("q4_g128", 128, 68, True, "f16 scale, uint8 zero point, pad, 128 uint4 (AWQ/GPTQ)"),
    Format("q4_k", 256, 144, False, "GGUF Q4_K: f16 scale and minimum, 8 x 6-bit, 256 uint4"),
    Format("q6_k", 256, 210, False, "GGUF Q6_K: 16 int8 scales, f16 scale, 256 int6"),
)}

#: The formats `--quantize` takes.
WRITABLE = tuple(name for name, f in FORMATS.items() if f.writable)


def get_format(name: str) -> Format:
    try:
        return FORMATS[name]
    except KeyError:
        raise SpecError(f"unknown storage format {name!r}; valid: "
                        f"{', '.join(FORMATS)}") from None


@dataclass(frozen=True, slots=True)
class Storage:
    """A tensor kept in block format `format`, its rows the trailing `span` axes."""
    format: str
    span: int

    @property
    def spec(self) -> Format:
        return get_format(self.format)

    @property
    def group(self) -> int:
        return self.spec.group

    def row(self, shape: tuple[int, ...]) -> int:
        return math.prod(shape[len(shape) - self.span:])

    def packed_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of the `uint8` array holding a tensor (or block) of logical `shape`."""
        f = self.spec
        return tuple(shape[:len(shape) - self.span]) + (self.row(shape) // f.group * f.group_bytes,)

    def nbytes(self, shape: tuple[int, ...]) -> int:
        return math.prod(self.packed_shape(shape))

    def fits(self, shape: tuple[int, ...]) -> str | None:
        """Why a tensor of `shape` cannot be stored so (None: it can)."""
        if not 1 <= self.span <= len(shape):
            return f"span {self.span} does not fit a tensor of rank {len(shape)}"
        if self.row(shape) % self.group:
            return (f"its rows of {self.row(shape)} elements are not whole groups of "
                    f"{self.group} ({self.format})")
        return None

    def quantum(self, shape: tuple[int, ...]) -> int:
        """Cut points of the span's first axis must be multiples of this (whole groups)."""
        inner = math.prod(shape[len(shape) - self.span + 1:])
        return self.group // math.gcd(self.group, inner)

    def packed_box(self, origin: tuple[int, ...], shape: tuple[int, ...],
                   full: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """`(origin, shape)` in the packed array of the block of logical `shape` at `origin` of
        a tensor of shape `full`; `PlanError` if the block does not hold whole groups."""
        k = len(full) - self.span
        for d in range(k + 1, len(full)):
            if origin[d] != 0 or shape[d] != full[d]:
                raise PlanError(f"a {self.format} block must hold whole rows in axes {k + 1}.. "
                                f"(block {list(shape)} at {list(origin)} of {list(full)})")
        inner = math.prod(full[k + 1:])
        start, count = origin[k] * inner, shape[k] * inner
        f = self.spec
        if start % f.group or count % f.group:
            raise PlanError(f"a {self.format} block must hold whole groups of {f.group} "
                            f"(block {list(shape)} at {list(origin)} of {list(full)})")
        return (tuple(origin[:k]) + (start // f.group * f.group_bytes,),
                tuple(shape[:k]) + (count // f.group * f.group_bytes,))

    def covering(self, origin: tuple[int, ...], shape: tuple[int, ...],
                 full: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The smallest box of whole groups holding the box `origin`+`shape` of a tensor of
        shape `full` (to unpack a block cut elsewhere than on groups)."""
        k = len(full) - self.span
        q = self.quantum(full)
        lo = origin[k] // q * q
        hi = -(-(origin[k] + shape[k]) // q) * q
        return (tuple(origin[:k]) + (lo,) + (0,) * (self.span - 1),
                tuple(shape[:k]) + (hi - lo,) + tuple(full[k + 1:]))

    def to_json(self) -> dict:
        return {"format": self.format, "group": self.group, "span": self.span}


def storage_from_json(data: object) -> Storage | None:
    """Inverse of `Storage.to_json` (None for None); `PlanError` on anything else."""
    if data is None:
        return None
    if not isinstance(data, dict) or set(data) != {"format", "group", "span"}:
        raise PlanError(f"storage {data!r}: expected {{format, group, span}}")
    name, span = data["format"], data["span"]
    if name not in FORMATS:
        raise PlanError(f"the plan uses storage format {name!r}, which this einpage does not "
                        f"run (it runs {', '.join(FORMATS)})")
    if data["group"] != FORMATS[name].group or not isinstance(span, int) or span < 1:
        raise PlanError(f"storage {data!r}: {name} has groups of {FORMATS[name].group} and "
                        "a positive span")
    return Storage(name, span)


def storage_for(format: str, shape: tuple[int, ...], row_axes: int) -> Storage | None:
    """The storage of a tensor of `shape` in `format` whose rows (as its file keeps them) are the
    last `row_axes` axes: the smallest span of whole groups (so blocks may cut the most), or None
    where a row is not whole groups (GGUF keeps such a tensor unquantized too)."""
    f = get_format(format)
    row = math.prod(shape[len(shape) - row_axes:])
    if not shape or row % f.group:
        return None
    for span in range(1, row_axes + 1):
        if math.prod(shape[len(shape) - span:]) % f.group == 0:
            return Storage(format, span)
    return None  # unreachable: span == row_axes divides


def tensor_bytes(shape: tuple[int, ...], dtype, storage: Storage | None) -> int:
    """The bytes a tensor (or block) of `shape` and `dtype` takes: packed with a storage."""
    if storage is not None:
        return storage.nbytes(shape)
    return math.prod(shape) * dtype.itemsize
