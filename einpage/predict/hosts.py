"""Host profiles for the cost model: what an apply placed on the host costs (DESIGN.md, "Host
compute and quantized weights").

einpage runs a host apply with NumPy on the host queue's one thread: a contraction through the
BLAS (every core), anything elementwise through NumPy's ufuncs (one core), operands held as f16
or bf16 converted to float32 first, a contraction cut into a chunk per core
(`einpage.runtime.hostpool`). A profile holds those rates: `matmul_flops` (float32 GEMM over all
cores), `vector_flops` (elementwise work on one core, one FLOP per operand per element as the
device model counts it), `memory_bandwidth` (all cores streaming, as the BLAS reads a weight) and
`core_bandwidth` (one core), `convert_rate` (f16 or bf16 elements converted to float32 per
second on one core: NumPy's cast, ~1.2 ns each), `dequant_rate` (packed weights dequantized per
second on one core by NumPy), `cores`, and `apply_overhead` (the Python and NumPy dispatch of
one apply). With einpage's compiled kernels (`kernels`: `einpage.runtime.storedmm`), a
contraction that reads a stored operand as it lies (`einpage.ir.stored.layout`: a weight, an
f16 KV block) costs instead its elements at `stored_rate` (f16/bf16) or `packed_rate` (block
formats) per core, decoded and multiplied with one row of the other side, on every core, or its
bytes over the memory bandwidth, whichever is longer. Presets are registered by name, each with its source; `einpage calibrate
--host-out FILE` measures the machine at hand, and `--host NAME | --host-file FILE` picks one.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from einpage.errors import InputError

G = 1e9
T = 1e12


@dataclass(frozen=True)
class HostProfile:
    name: str
    matmul_flops: float        # float32 GEMM, all cores (FLOP/s)
    vector_flops: float        # elementwise, one core (FLOP/s)
    memory_bandwidth: float    # bytes/s, all cores
    core_bandwidth: float      # bytes/s, one core
    cores: int
    convert_rate: float = 0.8e9    # f16/bf16 -> f32 elements per second, one core (NumPy)
    dequant_rate: float = 0.28e9   # packed (quantized) weights -> f32 per second, one core (NumPy)
    apply_overhead: float = 30e-6  # seconds per host apply (dispatch)
    source: str = ""
    kernels: bool = True           # einpage's compiled kernels built (`runtime.storedmm`)
    stored_rate: float = 6.5e9     # f16/bf16 elements through the kernels per second, one core
    packed_rate: float = 4.0e9     # packed elements through the kernels per second, one core

    def to_json(self) -> dict:
        return {"name": self.name, "matmul_flops": self.matmul_flops,
                "vector_flops": self.vector_flops, "memory_bandwidth": self.memory_bandwidth,
                "core_bandwidth": self.core_bandwidth, "cores": self.cores,
                "convert_rate": self.convert_rate, "dequant_rate": self.dequant_rate,
                "apply_overhead": self.apply_overhead, "kernels": self.kernels,
                "stored_rate": self.stored_rate, "packed_rate": self.packed_rate,
                "source": self.source}


#: Elements per cycle per core through the compiled kernels' AVX2 path, one row of the other
#: side, operand in cache: measured on the development machine's Xeon at 2.6 GHz (`python
#: bench/kernel_bench.py`: f16 6.8-8.2 G/s, q4_0 4.3, q8_0 5.0, q4_1 3.9; the low end).
AVX2_STORED_PER_CYCLE = 2.6
AVX2_PACKED_PER_CYCLE = 1.6


def _host(name: str, cores: int, ghz: float, flops_per_cycle: int, memory: float,
          source: str) -> HostProfile:
    """A preset from its cores, clock and float32 FLOPs per core per cycle (AVX2 with two FMA
    units: 32; AVX-512 with two: 64), at the shares a tuned BLAS and NumPy reach in practice:
    GEMM 75% of peak; one core's ufuncs about 1 FLOP per cycle per operand (they are bound by
    memory and by their loops, not by SIMD width), one core streaming about 12 GB/s; the
    compiled kernels at the AVX2 rates measured here, per cycle."""
    return HostProfile(name, 0.75 * cores * ghz * G * flops_per_cycle, 1.0 * ghz * G, memory,
                       min(memory, 12 * G), cores, source=source,
                       stored_rate=AVX2_STORED_PER_CYCLE * ghz * G,
                       packed_rate=AVX2_PACKED_PER_CYCLE * ghz * G)


HOSTS: dict[str, HostProfile] = {h.name: h for h in (
    _host("server-16c", 16, 2.5, 32, 100 * G,
          "a 16-core server (the issue's reference host): AVX2 with two FMA units at 2.5 GHz, "
          "100 GB/s of memory bandwidth (8 channels of DDR4-3200 at ~50% of 204.8 GB/s)"),
    _host("server-64c", 64, 2.4, 32, 300 * G,
          "a 64-core EPYC-class server: AVX2 (two FMA pipes) at 2.4 GHz, 12 channels of "
          "DDR5-4800 (460.8 GB/s raw) at ~65%"),
    _host("desktop-8c", 8, 4.0, 32, 60 * G,
          "an 8-core desktop: AVX2 with two FMA units at 4 GHz, dual-channel DDR5-5600 "
          "(89.6 GB/s raw) at ~65%"),
    _host("laptop-4c", 4, 3.0, 32, 40 * G,
          "a 4-core laptop: AVX2 with two FMA units at 3 GHz, dual-channel LPDDR5 at ~40 GB/s"),
)}

DEFAULT_HOST = "server-16c"


def get_host(name: str) -> HostProfile:
    try:
        return HOSTS[name]
    except KeyError:
        raise InputError(f"unknown host {name!r}; known: {', '.join(HOSTS)} "
                         "(or --host-file profile.json)") from None


_KEYS = ("matmul_flops", "vector_flops", "memory_bandwidth", "core_bandwidth", "cores")


def load_host_file(path: str | Path) -> HostProfile:
    """A host profile from JSON (the keys of `HostProfile.to_json`; `einpage calibrate
    --host-out` writes one). Every rate is required and positive."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise InputError(f"{path}: no such host profile") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{path}: not a JSON host profile ({exc})") from None
    if not isinstance(data, dict):
        raise InputError(f"{path}: a host profile is a JSON object")
    missing = [k for k in _KEYS if k not in data]
    if missing:
        raise InputError(f"{path}: host profile lacks {', '.join(missing)}")
    unknown = set(data) - set(HostProfile.__dataclass_fields__)
    if unknown:
        raise InputError(f"{path}: unknown host profile key {sorted(unknown)[0]!r}")
    values = {}
    if "kernels" in data and not isinstance(data["kernels"], bool):
        raise InputError(f"{path}: kernels must be true or false, got {data['kernels']!r}")
    for key in (*_KEYS, "convert_rate", "dequant_rate", "apply_overhead", "stored_rate",
                "packed_rate"):
        if key not in data:
            continue
        v = data[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v < 0 or (
                v == 0 and key != "apply_overhead") or v == float("inf"):
            raise InputError(f"{path}: {key} must be a positive number, got {v!r}")
        values[key] = float(v)
    return HostProfile(str(data.get("name", Path(path).stem)), values["matmul_flops"],
                       values["vector_flops"], values["memory_bandwidth"],
                       values["core_bandwidth"], int(values["cores"]),
                       values.get("convert_rate", 0.8e9), values.get("dequant_rate", 0.28e9),
                       values.get("apply_overhead", 30e-6),
                       str(data.get("source", f"host file {path}")),
                       # a profile written before the kernels: NumPy's paths
                       bool(data.get("kernels", "stored_rate" in data)),
                       values.get("stored_rate", 6.5e9), values.get("packed_rate", 4.0e9))
