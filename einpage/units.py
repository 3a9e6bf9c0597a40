"""Byte sizes on the command line: `16GB` (10^9), `16GiB` (2^30), `512KB`, `1e9`, `4096`."""
from __future__ import annotations

import re

from einpage.errors import EinpageError

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_PATTERN = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*")


def parse_size(text: str) -> int:
    match = _PATTERN.fullmatch(str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise EinpageError(f"bad size {text!r}: use e.g. 16GB (10^9 bytes), 16GiB (2^30), "
                           "512MB, 1e9")
    value = float(match.group(1)) * _UNITS[unit]
    if value < 1:
        raise EinpageError(f"bad size {text!r}: must be at least one byte")
    return int(value)


def format_size(n: float) -> str:
    """`17.18 GB` style (decimal units), for reports."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"
