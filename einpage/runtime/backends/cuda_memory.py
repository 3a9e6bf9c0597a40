"""The CuPy backend's device memory: how one raw allocation is cut into regions, and what a
`--gpu-mem` budget holds besides the plan's arena (DESIGN.md, "Stream program").

**Regions.** One `cudaMalloc` holds, each region starting 256-byte aligned (CUDA's and cuBLAS's
requirement: a misaligned kernel or cuBLAS operand is a sticky `cudaErrorMisalignedAddress`):
the arena (`mg.device_bytes`), cuBLAS's workspace (`cublas_workspace`, handed to the compute
thread's handle by `cublas_lib.set_workspace`, so cuBLAS allocates nothing of its own), the
workspace slots the plan's applies take, and the status words a gather sets.

**Budget.** `--gpu-mem X` means the process takes at most X of the device. Besides the regions
the process holds the CUDA context and its cuBLAS handles, measured by `memGetInfo` before any
allocation (`Reservation.context`): the plan's arena gets what is left (`reserve`). Where a
plan's arena is given instead (`--arena`), the rest comes on top (`around`).

Pure: needs no CuPy.
"""
from __future__ import annotations

from dataclasses import dataclass

from einpage.errors import BudgetError
from einpage.ir.memgraph import ALIGNMENT
from einpage.runtime.backends.apply_plan import STATUS_BYTES, aligned
from einpage.units import format_size

#: cuBLAS's workspace: NVIDIA's recommendation for Hopper (cublasSetWorkspace: 32 MiB; 4 MiB
#: elsewhere); a GEMM with less may pick a slower kernel, never fail
CUBLAS_WORKSPACE_BYTES = 32 << 20


def cublas_workspace(arena: int) -> int:
    """cuBLAS's workspace beside an arena of `arena` bytes: the recommended 32 MiB, or a
    sixteenth of a smaller arena (a small model's GEMMs need little)."""
    return min(CUBLAS_WORKSPACE_BYTES, aligned(max(arena, 0) // 16))


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
    """The largest arena a budget leaves once the context, cuBLAS's workspace (which grows with
    the arena, `cublas_workspace`) and the apply workspace (`workspace`: slots and status
    words) are taken, with cudaMalloc's granule to spare; `BudgetError` where none is left."""
    rest = budget - context - aligned(workspace) - GRANULE
    if rest >= 17 * CUBLAS_WORKSPACE_BYTES:
        arena = rest - CUBLAS_WORKSPACE_BYTES
    else:
        arena = rest * 16 // 17
    arena = arena // ALIGNMENT * ALIGNMENT
    while arena > 0 and arena + aligned(cublas_workspace(arena)) > rest:
        arena -= ALIGNMENT
    if arena <= 0:
        raise BudgetError(f"a device budget of {format_size(budget)} holds no plan: the CUDA "
                          f"context and cuBLAS handles take {format_size(context)} and the "
                          f"plan's kernels {format_size(workspace)}; a budget counts all the "
                          "process takes of the device (to page a small model on a GPU, give "
                          "the plan's --arena instead)", budget - rest + ALIGNMENT, budget)
    return around(arena, context, workspace, budget)


def around(arena: int, context: int, workspace: int, budget: int | None = None
           ) -> Reservation:
    """What the process takes of the device for a plan's arena of `arena` bytes: `budget`
    (default: the least that holds it all, with cudaMalloc's granule to spare)."""
    cublas = cublas_workspace(arena)
    total = context + aligned(cublas) + aligned(workspace) + arena + GRANULE
    budget = total if budget is None else budget
    return Reservation(budget, context, cublas, workspace,
                       budget - context - cublas - workspace - arena, arena)


__all__ = ["CUBLAS_WORKSPACE_BYTES", "GRANULE", "Regions", "Reservation", "around",
           "cublas_workspace", "regions", "reserve"]
