"""Element types. NumPy has no bf16 arithmetic, so bf16 is stored as `ml_dtypes.bfloat16` and
computed in float32; f16 is computed in float32 as GPUs accumulate it."""
from __future__ import annotations

import enum

import ml_dtypes
import numpy as np


class DType(enum.Enum):
    f16 = "f16"
    bf16 = "bf16"
    f32 = "f32"
    f64 = "f64"
    i64 = "i64"

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]

    @property
    def numpy(self) -> np.dtype:
        """The NumPy storage dtype."""
        return _NUMPY[self]

    @property
    def compute(self) -> np.dtype:
        """The NumPy dtype arithmetic on this type is done in (at least float32 for floats)."""
        return np.dtype(np.float64) if self is DType.f64 else (
            np.dtype(np.int64) if self is DType.i64 else np.dtype(np.float32))

    @property
    def is_float(self) -> bool:
        return self is not DType.i64

    def __str__(self) -> str:
        return self.value


_ITEMSIZE = {DType.f16: 2, DType.bf16: 2, DType.f32: 4, DType.f64: 8, DType.i64: 8}
_NUMPY = {
    DType.f16: np.dtype(np.float16),
    DType.bf16: np.dtype(ml_dtypes.bfloat16),
    DType.f32: np.dtype(np.float32),
    DType.f64: np.dtype(np.float64),
    DType.i64: np.dtype(np.int64),
}
_ALIASES = {"float16": DType.f16, "half": DType.f16, "bfloat16": DType.bf16, "float32": DType.f32,
            "float": DType.f32, "float64": DType.f64, "double": DType.f64, "int64": DType.i64}


def as_dtype(value: "DType | str") -> DType:
    """`DType` from a DType, its short name (`f16`) or a long alias (`float16`, `bfloat16`)."""
    from einpage.errors import SpecError

    if isinstance(value, DType):
        return value
    try:
        return DType(value)
    except ValueError:
        if value in _ALIASES:
            return _ALIASES[value]
        valid = ", ".join(d.value for d in DType)
        raise SpecError(f"unknown dtype {value!r}; valid: {valid}") from None


def from_numpy(dtype: np.dtype) -> DType:
    for d, nd in _NUMPY.items():
        if nd == dtype:
            return d
    raise TypeError(f"no einpage dtype for numpy dtype {dtype}")
