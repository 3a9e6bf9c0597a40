"""The CuPy backend's device memory: how one raw allocation is cut into regions, and what a
`--gpu-mem` budget holds besides the plan's arena (DESIGN.md, "Stream program").

**Regions.** One `cudaMalloc` holds, each region starting 256-byte aligned (CUDA's and cuBLAS's
requirement: a misaligned kernel or cuBLAS operand is a sticky `cudaErrorMisalignedAddress`):
the arena (`mg.device_bytes`), cuBLAS's workspace (`CUBLAS_WORKSPACE_BYTES`, handed to the
compute thread's handle by `cublasSetWorkspace`, so cuBLAS allocates nothing of its own), the
workspace slots the plan's applies take, and the status words a gather sets.

**Budget.** `--gpu-mem X` means the process takes at most X of the device. Besides the regions
the process holds the CUDA context and its cuBLAS handles, measured by `memGetInfo` before any
allocation (`Reservation.context`): the plan's arena gets what is left (`reserve`).

Pure, apart from `set_cublas_workspace` (ctypes into the libcublas CuPy loaded).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

from einpage.errors import BackendError, BudgetError
from einpage.ir.memgraph import ALIGNMENT
from einpage.runtime.backends.apply_plan import STATUS_BYTES, aligned
from einpage.units import format_size

#: cuBLAS's workspace: NVIDIA's recommendation for Hopper (cublasSetWorkspace: 32 MiB; 4 MiB
#: elsewhere); a GEMM with less may pick a slower kernel, never fail
CUBLAS_WORKSPACE_BYTES = 32 << 20


def cublas_workspace(budget: int) -> int:
    """cuBLAS's workspace under a budget of `budget` bytes: the recommended 32 MiB, or a
    sixteenth of a smaller budget (a small model's GEMMs need little)."""
    return min(CUBLAS_WORKSPACE_BYTES, aligned(max(budget, 0) // 16))
#: what memGetInfo's free bytes move by: cudaMalloc's granularity
GRANULE = 2 << 20


@dataclass(frozen=True)
class Regions:
    """Byte offsets of the regions of the backend's one allocation of `total` bytes."""
    arena: int
    cublas_at: int
    cublas: int
    slots_at: int
    slots: int
    status_at: int
    total: int


def regions(device_bytes: int, slot_bytes: int, cublas: int | None = None) -> Regions:
    """The regions for an arena of `device_bytes`, `slot_bytes` of apply slots and `cublas`
    bytes of cuBLAS workspace (default `cublas_workspace(device_bytes)`)."""
    cublas = cublas_workspace(device_bytes) if cublas is None else cublas
    cublas_at = aligned(device_bytes)
    slots_at = cublas_at + aligned(cublas)
    status_at = slots_at + aligned(slot_bytes)
    return Regions(device_bytes, cublas_at, cublas, slots_at, slot_bytes, status_at,
                   status_at + STATUS_BYTES)


@dataclass(frozen=True)
class Reservation:
    """What a budget of `budget` device bytes holds: the CUDA context and cuBLAS handles
    (`context`, measured), cuBLAS's workspace, the apply slots and status words (`workspace`),
    padding to 256-byte regions and cudaMalloc's granule, and the plan's `arena`."""
    budget: int
    context: int
    cublas: int
    workspace: int
    padding: int
    arena: int

    def lines(self) -> list[str]:
        return [f"device budget {format_size(self.budget)}: plan arena "
                f"{format_size(self.arena)}, CUDA context and cuBLAS handles "
                f"{format_size(self.context)} (measured), cuBLAS workspace "
                f"{format_size(self.cublas)}, apply workspace {format_size(self.workspace)}, "
                f"alignment {format_size(self.padding)}"]


def reserve(budget: int, context: int, workspace: int) -> Reservation:
    """The arena a budget leaves once the context, cuBLAS's workspace and the apply workspace
    (`workspace`: slots and status words) are taken; `BudgetError` where nothing is left."""
    cublas = cublas_workspace(budget)
    fixed = context + aligned(cublas) + aligned(workspace)
    # the allocation is rounded to cudaMalloc's granule; the arena to 256 bytes
    arena = (budget - fixed - GRANULE) // ALIGNMENT * ALIGNMENT
    if arena <= 0:
        raise BudgetError(f"a device budget of {format_size(budget)} holds no plan: the CUDA "
                          f"context and cuBLAS handles take {format_size(context)}, cuBLAS's "
                          f"workspace {format_size(cublas)} and the plan's kernels "
                          f"{format_size(workspace)}; a budget counts all the process takes of "
                          "the device (to page a small model on a GPU, compile a plan for a "
                          "small arena and run the plan file)", fixed + GRANULE + ALIGNMENT,
                          budget)
    return Reservation(budget, context, cublas, workspace,
                       budget - context - cublas - workspace - arena, arena)


def _libcublas() -> ctypes.CDLL:
    """The libcublas CuPy loaded into this process (its path from /proc/self/maps), so that the
    handle CuPy made is passed to the same library."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcublas.so" in line}
    except OSError as exc:
        raise BackendError(f"cannot find the loaded libcublas: {exc}") from None
    if not paths:
        raise BackendError("libcublas is not loaded (no cuBLAS handle made yet)")
    return ctypes.CDLL(sorted(paths)[0])


def set_cublas_workspace(handle: int, ptr: int, nbytes: int) -> None:
    """cublasSetWorkspace(handle, ptr, nbytes): cuBLAS then takes its workspace from there (CuPy
    14 does not wrap the call)."""
    fn = _libcublas().cublasSetWorkspace_v2
    fn.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    fn.restype = ctypes.c_int
    status = fn(ctypes.c_void_p(handle), ctypes.c_void_p(ptr), ctypes.c_size_t(nbytes))
    if status != 0:
        raise BackendError(f"cublasSetWorkspace failed with status {status}")


__all__ = ["CUBLAS_WORKSPACE_BYTES", "GRANULE", "cublas_workspace", "Regions", "Reservation", "regions", "reserve",
           "set_cublas_workspace"]
