"""The CPU kernels' rate (`einpage.runtime.storedmm`): elements of a stored operand one core
takes per second against one row (and four rows) of x, the operand (64 x 4096) in cache, on each
code path this CPU has, for every format the kernels read; and the same per cycle at the clock
`/proc/cpuinfo` reports (what the host presets' `stored_rate` / `packed_rate` are made from).

    python bench/kernel_bench.py
"""
from __future__ import annotations

import platform
import re
from pathlib import Path

from einpage.runtime import storedmm

FORMATS = ("f16", "bf16", "q8_0", "q4_0", "q4_1", "q4_g128")


def clock_ghz() -> float | None:
    try:
        found = re.search(r"cpu MHz\s*:\s*([\d.]+)", Path("/proc/cpuinfo").read_text())
    except OSError:
        return None
    return float(found.group(1)) / 1e3 if found else None


def main() -> None:
    if not storedmm.available():
        raise SystemExit("einpage.runtime._cpu is not built (no C compiler at install)")
    ghz = clock_ghz()
    clock = f"{ghz:.2f} GHz" if ghz else "clock unknown"
    print(f"{platform.processor() or platform.machine()}, {clock}; G elements/s per core (per "
          "cycle), one row | four rows of x")
    print("| path | " + " | ".join(FORMATS) + " |")
    print("|---|" + "---:|" * len(FORMATS))
    best = storedmm.isas()[-1]
    try:
        for isa in reversed(storedmm.isas()):
            storedmm.use_isa(isa)
            cells = []
            for fmt in FORMATS:
                one, four = storedmm.core_rate(fmt), storedmm.core_rate(fmt, rows=4)
                per = f" ({one / ghz / 1e9:.2f}/cycle)" if ghz else ""
                cells.append(f"{one / 1e9:.2f}{per} \\| {four / 1e9:.2f}")
            print(f"| {isa} | " + " | ".join(cells) + " |", flush=True)
    finally:
        storedmm.use_isa(best)


if __name__ == "__main__":
    main()
