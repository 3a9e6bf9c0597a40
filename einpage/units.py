"""Numbers with units, as users write them: sizes (`16GB` = 16x10^9 bytes, `16GiB` = 16x2^30,
`512KB`, `1e9`), rates (`25GB/s`, `756T`, `756TFLOPS`: decimal prefixes) and durations
(`30ms`, `0.5s`, `200us`). One parser reads them all; each kind is a table of units."""
from __future__ import annotations

import math
import re

from einpage.errors import InputError

_QUANTITY = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z/]*)\s*")

SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
              "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
SECOND_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
_PREFIXES = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15}


def rate_units(unit: str) -> dict[str, float]:
    """`unit` per second with a decimal prefix, the unit and `/s` optional: for `B`, `25G`,
    `25GB`, `25GB/s`, `25e9`."""
    u = unit.lower()
    return {p + tail: scale for p, scale in _PREFIXES.items()
            for tail in ("", u, "/s", u + "/s")}


def parse_quantity(text: str, units: dict[str, float], what: str, example: str) -> float:
    """`text` as a finite positive number times its unit (case-insensitive) from `units`;
    otherwise an `InputError` naming `what` and showing `example`."""
    match = _QUANTITY.fullmatch(str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in units:
        raise InputError(f"bad {what} {text!r}: use e.g. {example}")
    value = float(match.group(1)) * units[unit]
    if not math.isfinite(value):
        raise InputError(f"bad {what} {text!r}: too large")
    if value <= 0:
        raise InputError(f"bad {what} {text!r}: must be positive")
    return value


def parse_size(text: str, what: str = "size") -> int:
    """Bytes: `16GB` (10^9), `16GiB` (2^30), `512MB`, `1e9`, `4096`; at least one byte."""
    value = parse_quantity(text, SIZE_UNITS, what,
                           "16GB (10^9 bytes), 16GiB (2^30), 512MB, 1e9")
    if value < 1:
        raise InputError(f"bad {what} {text!r}: must be at least one byte")
    return int(value)


def parse_rate(text: str, what: str, unit: str) -> float:
    """`25GB/s`, `25e9`, `756T`, `756TFLOPS` -> a positive float (decimal prefixes)."""
    example = "25GB/s or 25e9" if unit == "B" else "756T, 756TFLOPS or 7.56e14"
    value = parse_quantity(text, rate_units(unit), what, example)
    if value < 1:  # below one unit a second every time the cost model prints is infinite
        raise InputError(f"bad {what} {text!r}: below 1 {'B' if unit == 'B' else 'FLOP'}/s")
    return value


def parse_seconds(text: str, what: str) -> float:
    """`30ms`, `0.5s`, `200us` -> seconds (a unit is required)."""
    return parse_quantity(text, SECOND_UNITS, what, "30ms, 0.5s or 200us")


def format_size(n: float) -> str:
    """`17.18 GB` style (decimal units), for reports."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"
