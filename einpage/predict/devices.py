"""Device profiles for the cost model, registered by name, each with its source.

A profile holds what the cost model needs to turn a memgraph node into seconds: peak dense FLOP/s
per dtype for matrix products (`matmul_flops`) and for elementwise work (`vector_flops`), HBM
bandwidth, host<->device bandwidth each way (pinned memory), copy latency, kernel-launch overhead
and memory, and the machine's disk: read bandwidth and latency of the drive the checkpoint lies
on (the third tier).

Where the numbers come from: FLOP/s and HBM bandwidth are the vendor datasheet figures (dense, no
structured sparsity). Host links are not measured on einpage's target machines (no GPU host was
available to calibrate): they are the PCIe generation's per-direction raw rate times 0.8, the share
that pinned copies reach in practice (about 24-26 of 31.5 GB/s on PCIe Gen4; see
shared/reference/PEERS.md), except where a measured figure is cited. `with_overrides` (the command line's `--h2d-bandwidth`,
`--flops`) and device files override them; a profile measured on your own host is the better input.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from einpage.errors import InputError
from einpage.predict.hosts import DEFAULT_HOST, HOSTS, HostProfile

_PCIE = {3: 15.75e9, 4: 31.5e9, 5: 63.0e9}  # raw bytes/s per direction, x16
_PINNED_SHARE = 0.8

#: The disk a profile assumes unless told (`--disk-bandwidth`, `einpage calibrate --disk`): a
#: mainstream PCIe Gen3 x4 NVMe drive's sequential read, 3.0-3.5 GB/s on datasheets (Samsung
#: 970 EVO Plus 3.5, WD SN750 3.4 GB/s), taken at the lower 3 GB/s; Gen4 drives reach 7 GB/s.
#: Latency per read request (queue depth 1, a large block): about 0.1 ms.
DEFAULT_DISK_BANDWIDTH = 3.0e9
DEFAULT_DISK_LATENCY = 100e-6


def _pcie(gen: int) -> float:
    return _PCIE[gen] * _PINNED_SHARE


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    matmul_flops: dict = field(hash=False)   # dtype name -> dense FLOP/s for contractions
    vector_flops: dict = field(hash=False)   # dtype name -> FLOP/s for elementwise work
    hbm_bandwidth: float                     # bytes/s
    h2d_bandwidth: float                     # bytes/s, pinned host -> device
    d2h_bandwidth: float                     # bytes/s, device -> pinned host
    memory_bytes: int
    copy_latency: float = 10e-6              # seconds per transfer
    launch_overhead: float = 5e-6            # seconds per kernel
    source: str = ""
    disk_bandwidth: float = DEFAULT_DISK_BANDWIDTH  # bytes/s, checkpoint file -> host memory
    disk_latency: float = DEFAULT_DISK_LATENCY      # seconds per read
    #: the host the device sits in: what an apply placed on the host costs (`--host`)
    host: HostProfile = field(default=HOSTS[DEFAULT_HOST], compare=False)
    #: seconds per kernel of a pass replayed as one CUDA graph (the CuPy backend replays every
    #: pass after the first of a plan it can capture); None: priced as issued node by node
    graph_launch_overhead: float | None = None
    #: bytes/s from this device to a peer device (a pipeline's sends); None: a PCIe peer copy,
    #: at the host link's rate (`PEER_LINKS` names others)
    peer_bandwidth: float | None = None
    #: bytes/s among the devices of one tensor-parallel group of a pipeline of them (one
    #: machine's GPUs over NVLink, where the groups talk over a network); None: the peer link
    group_bandwidth: float | None = None

    @property
    def peer_rate(self) -> float:
        return self.peer_bandwidth if self.peer_bandwidth is not None else self.d2h_bandwidth

    @property
    def group_rate(self) -> float:
        return self.group_bandwidth if self.group_bandwidth is not None else self.peer_rate

    def replayed(self) -> "DeviceProfile":
        """This profile for a pass replayed as one captured graph: each kernel costs the graph's
        launch gap instead of the host's issue (the same profile where that is not known)."""
        if self.graph_launch_overhead is None:
            return self
        return replace(self, launch_overhead=self.graph_launch_overhead)

    def flops(self, dtype: str, matmul: bool) -> float:
        table = self.matmul_flops if matmul else self.vector_flops
        if dtype in table:
            return table[dtype]
        return table.get("f32", min(table.values()))

    def to_json(self) -> dict:
        return {"name": self.name, "matmul_flops": dict(self.matmul_flops),
                "vector_flops": dict(self.vector_flops), "hbm_bandwidth": self.hbm_bandwidth,
                "h2d_bandwidth": self.h2d_bandwidth, "d2h_bandwidth": self.d2h_bandwidth,
                "memory_bytes": self.memory_bytes, "copy_latency": self.copy_latency,
                "launch_overhead": self.launch_overhead, "source": self.source,
                "disk_bandwidth": self.disk_bandwidth, "disk_latency": self.disk_latency,
                **({"graph_launch_overhead": self.graph_launch_overhead}
                   if self.graph_launch_overhead is not None else {}),
                **({"peer_bandwidth": self.peer_bandwidth}
                   if self.peer_bandwidth is not None else {}),
                **({"group_bandwidth": self.group_bandwidth}
                   if self.group_bandwidth is not None else {})}


T = 1e12

#: device-to-device links a pipeline's sends may cross (bytes/s one way): `pcie` (None) is a
#: peer copy over PCIe at the profile's host link rate; NVLink 4 (H100 SXM) 450 GB/s each way;
#: a 100 Gb/s and a 400 Gb/s network between machines
PEER_LINKS: dict[str, float | None] = {"pcie": None, "nvlink": 450e9, "net-100g": 12.5e9,
                                       "net-400g": 50e9}


def _profile(name, f16, f32, f64, vec32, hbm, link, memory_gb, source, bf16=None, vec16=None):
    bf16 = f16 if bf16 is None else bf16
    vec16 = 2 * vec32 if vec16 is None else vec16
    return DeviceProfile(
        name, matmul_flops={"f16": f16, "bf16": bf16, "f32": f32, "f64": f64},
        vector_flops={"f16": vec16, "bf16": vec16 if bf16 == f16 else vec32, "f32": vec32,
                      "f64": f64},
        hbm_bandwidth=hbm, h2d_bandwidth=link, d2h_bandwidth=link,
        memory_bytes=int(memory_gb * 1e9), source=source)


PROFILES: dict[str, DeviceProfile] = {p.name: p for p in (
    _profile("h100-pcie", 756 * T, 51.2 * T, 25.6 * T, 51.2 * T, 2.0e12, _pcie(5), 80,
             "NVIDIA H100 datasheet (PCIe 80GB): FP16/BF16 tensor 756 TFLOPS dense, FP32 51 TF, "
             "FP64 26 TF, HBM2e 2.0 TB/s; PCIe Gen5 x16 at 80% of 63 GB/s"),
    _profile("h100-sxm", 989 * T, 67 * T, 34 * T, 67 * T, 3.35e12, _pcie(5), 80,
             "NVIDIA H100 datasheet (SXM5 80GB): FP16/BF16 tensor 989 TFLOPS dense, FP32 67 TF, "
             "FP64 34 TF, HBM3 3.35 TB/s; host link PCIe Gen5 x16 at 80% of 63 GB/s"),
    _profile("h200", 989 * T, 67 * T, 34 * T, 67 * T, 4.8e12, _pcie(5), 141,
             "NVIDIA H200 datasheet (SXM 141GB): FP16/BF16 tensor 989 TFLOPS dense, FP32 67 TF, "
             "FP64 34 TF, HBM3e 4.8 TB/s; host link PCIe Gen5 x16 at 80% of 63 GB/s"),
    _profile("a100-pcie", 312 * T, 19.5 * T, 9.7 * T, 19.5 * T, 1.935e12, _pcie(4), 80,
             "NVIDIA A100 datasheet (PCIe 80GB): FP16/BF16 tensor 312 TFLOPS dense, FP32 19.5 "
             "TF, FP64 9.7 TF, HBM2e 1.935 TB/s; PCIe Gen4 x16 at 80% of 31.5 GB/s"),
    _profile("a100-sxm", 312 * T, 19.5 * T, 9.7 * T, 19.5 * T, 2.039e12, _pcie(4), 80,
             "NVIDIA A100 datasheet (SXM4 80GB): FP16/BF16 tensor 312 TFLOPS dense, FP32 19.5 "
             "TF, FP64 9.7 TF, HBM2e 2.039 TB/s; host link PCIe Gen4 x16 at 80% of 31.5 GB/s"),
    _profile("v100", 125 * T, 15.7 * T, 7.8 * T, 15.7 * T, 0.9e12, _pcie(3), 32,
             "NVIDIA V100 datasheet (SXM2 32GB): FP16 tensor 125 TFLOPS, FP32 15.7 TF, FP64 7.8 "
             "TF, HBM2 900 GB/s, no bf16 (runs at the FP32 rate); PCIe Gen3 x16 at 80% of "
             "15.75 GB/s", bf16=15.7 * T),
    _profile("p100", 18.7 * T, 9.3 * T, 4.7 * T, 9.3 * T, 0.732e12, _pcie(3), 16,
             "NVIDIA P100 datasheet (PCIe 16GB): FP16 18.7 TFLOPS (no tensor cores), FP32 9.3 "
             "TF, FP64 4.7 TF, HBM2 732 GB/s, no bf16 (FP32 rate); PCIe Gen3 x16 at 80% of "
             "15.75 GB/s", bf16=9.3 * T, vec16=18.7 * T),
    DeviceProfile(
        "t4", matmul_flops={"f16": 65 * T, "bf16": 8.1 * T, "f32": 8.1 * T, "f64": 0.25 * T},
        vector_flops={"f16": 16.2 * T, "bf16": 8.1 * T, "f32": 8.1 * T, "f64": 0.25 * T},
        hbm_bandwidth=320e9, h2d_bandwidth=12.89e9, d2h_bandwidth=12.89e9,
        memory_bytes=16 * 10**9,
        source="NVIDIA T4 datasheet: FP16 tensor 65 TFLOPS, FP32 8.1 TF, GDDR6 320 GB/s, no "
               "bf16 (FP32 rate); host->device 12.89 GB/s as fitted by FlexGen on a T4 "
               "(experimental/cost_model.py, shared/reference/PEERS.md)"),
    _profile("rtx4090", 165.2 * T, 82.6 * T, 1.29 * T, 82.6 * T, 1.008e12, _pcie(4), 24,
             "NVIDIA Ada whitepaper (RTX 4090): FP16/BF16 tensor with FP32 accumulate 165.2 "
             "TFLOPS dense, FP32 82.6 TF, FP64 1.3 TF, GDDR6X 1008 GB/s; PCIe Gen4 x16 at 80% "
             "of 31.5 GB/s", vec16=82.6 * T),
)}

DEFAULT_DEVICE = "h100-pcie"


def get_device(name: str) -> DeviceProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise InputError(f"unknown device {name!r}; known: {', '.join(PROFILES)} "
                         "(or --device-file profile.json)") from None


_REQUIRED = ("matmul_flops", "hbm_bandwidth", "h2d_bandwidth")


def load_device_file(path: str | Path, name: str | None = None) -> DeviceProfile:
    """A profile from JSON: the keys of `DeviceProfile.to_json`. `matmul_flops`, `hbm_bandwidth`
    and `h2d_bandwidth` are required; `vector_flops` defaults to `matmul_flops`, `d2h_bandwidth`
    to `h2d_bandwidth`, the rest to the defaults of `DeviceProfile`. The file holds one profile
    (`einpage calibrate -o`) or several (`einpage devices --json`: an object of profiles by
    name, or a list of profiles): `name` picks one of several; without it the file must hold
    exactly one."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise InputError(f"{path}: no such device profile") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{path}: not a JSON device profile ({exc})") from None
    data = _pick_profile(data, path, name)
    missing = [k for k in _REQUIRED if k not in data]
    if missing:
        raise InputError(f"{path}: device profile lacks {', '.join(missing)}")
    unknown = set(data) - set(DeviceProfile.__dataclass_fields__)
    if unknown:
        raise InputError(f"{path}: unknown device profile key {sorted(unknown)[0]!r}")
    try:
        matmul = _rates(data["matmul_flops"], "matmul_flops")
        vector = _rates(data.get("vector_flops", matmul), "vector_flops")
        h2d = _positive(data["h2d_bandwidth"], "h2d_bandwidth")
        profile = DeviceProfile(
            name=str(data.get("name", Path(path).stem)), matmul_flops=matmul, vector_flops=vector,
            hbm_bandwidth=_positive(data["hbm_bandwidth"], "hbm_bandwidth"), h2d_bandwidth=h2d,
            d2h_bandwidth=_positive(data.get("d2h_bandwidth", h2d), "d2h_bandwidth"),
            memory_bytes=int(_positive(data.get("memory_bytes", 80e9), "memory_bytes")),
            copy_latency=_non_negative(data.get("copy_latency", 10e-6), "copy_latency"),
            launch_overhead=_non_negative(data.get("launch_overhead", 5e-6), "launch_overhead"),
            source=str(data.get("source", f"device file {path}")),
            disk_bandwidth=_positive(data.get("disk_bandwidth", DEFAULT_DISK_BANDWIDTH),
                                     "disk_bandwidth"),
            disk_latency=_non_negative(data.get("disk_latency", DEFAULT_DISK_LATENCY),
                                       "disk_latency"),
            graph_launch_overhead=(None if data.get("graph_launch_overhead") is None else
                                   _non_negative(data["graph_launch_overhead"],
                                                 "graph_launch_overhead")),
            peer_bandwidth=(None if data.get("peer_bandwidth") is None else
                            _positive(data["peer_bandwidth"], "peer_bandwidth")),
            group_bandwidth=(None if data.get("group_bandwidth") is None else
                             _positive(data["group_bandwidth"], "group_bandwidth")))
    except InputError as exc:
        raise InputError(f"{path}: {exc}") from None
    return profile


def _pick_profile(data, path, name: str | None) -> dict:
    """The one profile of a device file: `data` itself, or the entry called `name` (or the only
    entry) of an object of profiles by name or of a list of profiles."""
    if isinstance(data, dict) and data and not any(k in data for k in _REQUIRED) and all(
            isinstance(v, dict) for v in data.values()):
        entries = [(str(key), {"name": key, **value}) for key, value in data.items()]
    elif isinstance(data, list) and data and all(isinstance(v, dict) for v in data):
        entries = [(str(v.get("name", k)), v) for k, v in enumerate(data)]
    elif isinstance(data, dict):
        if name is not None and str(data.get("name", name)) != name:
            raise InputError(f"{path}: the profile is {data['name']!r}, not --device {name!r}")
        return data
    else:
        raise InputError(f"{path}: a device profile is a JSON object (or several: a list, or "
                         "an object of them by name)")
    if name is None:
        if len(entries) == 1:
            return entries[0][1]
        raise InputError(f"{path} holds {len(entries)} profiles: pick one with --device "
                         f"({', '.join(n for n, _ in entries)})")
    for entry_name, entry in entries:
        if entry_name == name:
            return entry
    raise InputError(f"{path}: no profile {name!r}; it holds "
                     f"{', '.join(n for n, _ in entries)}")

def _number(value, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(f"{key} must be a number, got {value!r}")
    value = float(value)
    if value != value or value in (float("inf"), float("-inf")):
        raise InputError(f"{key} must be finite, got {value!r}")
    return value


def _positive(value, key: str) -> float:
    value = _number(value, key)
    if value <= 0:
        raise InputError(f"{key} must be positive, got {value!r}")
    return value


def _non_negative(value, key: str) -> float:
    value = _number(value, key)
    if value < 0:
        raise InputError(f"{key} must not be negative, got {value!r}")
    return value


def _rates(value, key: str) -> dict:
    if isinstance(value, dict):
        if not value:
            raise InputError(f"{key} is empty")
        return {str(k): _positive(v, f"{key}[{k}]") for k, v in value.items()}
    rate = _positive(value, key)
    return {d: rate for d in ("f16", "bf16", "f32", "f64")}


def with_overrides(profile: DeviceProfile, h2d_bandwidth: float | None = None,
                   flops: float | None = None,
                   disk_bandwidth: float | None = None) -> DeviceProfile:
    """`profile` with a measured host link (both directions), matmul peak (every dtype) or disk
    read bandwidth."""
    if disk_bandwidth is not None:
        profile = replace(profile, disk_bandwidth=disk_bandwidth)
    if h2d_bandwidth is not None:
        profile = replace(profile, h2d_bandwidth=h2d_bandwidth, d2h_bandwidth=h2d_bandwidth)
    if flops is not None:
        profile = replace(profile, matmul_flops={d: flops for d in profile.matmul_flops})
    return profile
