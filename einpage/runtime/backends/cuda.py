"""The CuPy backend: the stream program on an NVIDIA GPU (DESIGN.md, "Stream program").

Memory. One raw `cupy.cuda.Memory` allocation (outside CuPy's pool) cut into 256-aligned regions
(`cuda_memory.regions`): the arena (`mg.device_bytes`), cuBLAS's workspace (set on the compute
thread's handle: cuBLAS allocates nothing itself), the apply workspace slots
(`apply_plan.workspace_bytes(mg)` unless given) and the status words a gather sets on an
out-of-range id. Each region is an `UnownedMemory` over the allocation, so only the backend
holds the allocation itself: `close` frees it at once, even while a traceback still refers to
views (never used after close). Instances are `cupy.ndarray` views at their offsets,
bounds-checked by `planio.instance_bytes`.

Host memory. One pinned buffer (`cupy.cuda.PinnedMemory`, allocated once, not CuPy's
power-of-two pinned pool) laid out by `host_layout(mg, stage_sources=True)`: each offloaded
tensor's host copy, each streamed block but weights (read from its source at `open`, so a
reload is one async copy from pinned memory), then a ring of `STAGING_SLOTS` staging slots, each
as large as the largest `input at device` block: such a block (a resident weight or KV block
loaded with the model) is read from its source into the next slot and copied asynchronously,
the slot reused once its copy's event has completed, so reads overlap copies (an activation
copied in every pass has a slot of its own, refilled before a CUDA graph's replay); then a
ring for KV rows
written between passes (`write_input`: one async copy per block from pinned memory, on the
compute stream, ordered before the next pass's reads). Last, the host arena of a plan with a
disk tier (`mg.host_arena_bytes`, page-aligned): the staging buffers its `read` nodes fill from
the checkpoint files (`runtime.diskread`, on the disk queue's reader thread) and its reloads
copy from asynchronously. Streamed weight blocks are pinned once per loaded model and shared
by its later sessions (`pinned.PinnedWeights`). A packed (quantized) block is held, staged,
pinned and copied as its packed bytes (`planio.stored`, `typed_view`) wherever it goes.

Streams. A `Stream(non_blocking=True)` per queue (`streams.QUEUES`): compute, h2d, h2d_host (the
copies back of what the host's applies wrote: `streams.queues_of`), d2h, and those of the queues
whose work the CPU does, which carry their events; a queue's worker thread runs inside
`queue_context`, which makes the device and the queue's stream current (cuBLAS and every
kernel run on the current stream) and, on the compute thread, gives its cuBLAS handle the
workspace region and the compute stream (the executor enters each context once per session).
`record` / `wait` use one `Event(disable_timing=True)` per recorded node, recorded anew each pass;
`stamp` a timing event on the queue's stream. Every CUDA call runs with the backend's device
current.

CUDA graphs. A plan with no host work in its pass (no disk reads) can be captured
(`begin_capture`: the copy streams fork from the compute stream, so all of the pass is in the
graph; `end_capture`: they join back) and replayed in one launch per pass (`replay`). Host
applies that read only the pass's inputs (a gather of embedding rows on the host:
`compiler.host_gather`) are its prologue: a replay runs them on the CPU into their host
buffers, then launches the graph, whose copies of those buffers are in it. GEMMs go
through `cublas_lib` (ctypes), whose calls capture, where CuPy's cuBLAS wrappers refuse.

Compute. `apply_plan.plan_apply` decides at `open` how each apply runs: a cuBLAS GemmEx (half
operands on the tensor cores, float32 accumulation, transposes as operation flags, the join's
factor as alpha, accumulation as beta: `gemm_plan`, `gemm_call`), operands converted or
transposed into workspace slots where needed; everything else through `ElementwiseKernel` /
`ReductionKernel`s generated once per distinct expression, compiled by NVRTC with
`cuda_source.NVRTC_OPTIONS` (no FMA contraction). A packed read is first dequantized by a
generated kernel of its format and logical dtype into a workspace slot, on the compute stream,
and the op reads the slot (`cuda_apply`; `apply_plan.workspace_bytes` counts the slots). `open`
runs every distinct apply once on the arena (before anything is loaded) so that every kernel is
compiled there, not in the first pass (`compile_s`). The compute thread runs under
`cupy.cuda.using_allocator`: any allocation CuPy makes is carved from the workspace (a bump
allocator reset after each apply, safe because one stream runs the applies in order), and
counted as `hidden_allocations`; a `MemoryHook` (`hook`) counts pool allocations on every queue.
A pass that allocates nothing leaves both at zero.
"""
from __future__ import annotations

import ctypes
import functools
import math
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

import numpy as np

from einpage.errors import BackendError, ExecutionError, InputError, PlanError
from einpage.ir.memgraph import (HOST_ALIGNMENT, ApplyNode, InputNode, MemGraph, OffloadNode,
                                 OutputRef, ReadNode, RecvNode, ReloadNode, SendNode,
                                 boxes_meet)
from einpage.ir.tensors import PERSISTENT_ROLES
from einpage.runtime.backends import cublas_lib
from einpage.runtime.backends.apply_plan import (STATUS_BYTES, aligned, plan_applies,
                                                 workspace_bytes, workspace_for)
from einpage.runtime.backends.base import (Backend, HostLayout, host_apply, host_layout, host_view,
                                           staging_view)
from einpage.runtime.backends.cuda_apply import DeviceApplies
from einpage.runtime.backends.cuda_memory import Regions, regions
from einpage.runtime.backends.cuda_source import DEVICE_DTYPE
from einpage.runtime.backends.pinned import PinnedWeights
from einpage.runtime.diskread import DiskReader
from einpage.runtime.planio import PlanIO, instance_bytes, receive_into, stored, typed_view
from einpage.runtime.streams import QUEUES, host_prologue

__all__ = ["CupyBackend", "cuda_usable", "workspace_bytes"]

#: staging slots for `input at device` blocks: a read fills one while earlier ones are copied
STAGING_SLOTS = 4
#: pinned slots for KV rows written between passes (each as large as a resident KV block)
ROW_SLOTS = 8
#: the queues that copy between the host and the device on a stream of their own
_H2D_QUEUES = ("h2d", "h2d_host")
_COPY_QUEUES = (*_H2D_QUEUES, "d2h")
#: the queues whose work the CPU does (a wait there blocks the CPU until the event completes)
_CPU_QUEUES = ("disk", "host", "send", "recv")


def _unusable_reason(device: int = 0) -> str | None:
    """Why CuPy cannot run on `device` here, or None where it can. Imports CuPy lazily."""
    try:
        import cupy
    except Exception:  # ImportError, or a CuPy built for another CUDA failing to load
        return "cupy not installed"
    try:
        if not cupy.cuda.is_available():
            return "no CUDA driver"
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return f"CUDA unavailable: {type(exc).__name__}: {exc}"
    if count < 1:
        return "no CUDA device"
    if not 0 <= device < count:
        return f"device {device} not found; {count} device{'s' if count != 1 else ''}"
    return None


def cuda_usable() -> bool:
    """Whether CuPy is importable and sees a CUDA device. Never raises."""
    try:
        return _unusable_reason() is None
    except Exception:
        return False


@functools.lru_cache(maxsize=None)
def _hook_class():
    import cupy

    class WorkspaceHook(cupy.cuda.MemoryHook):
        """Counts allocations from CuPy's memory pool (anything the workspace did not serve)
        on every thread it is entered in."""
        name = "einpage-workspace"

        def __init__(self):
            self.lock = threading.Lock()
            self.allocations = 0
            self.bytes = 0

        def reset(self) -> None:
            with self.lock:
                self.allocations = self.bytes = 0

        def malloc_preprocess(self, **kwargs):
            with self.lock:
                self.allocations += 1
                self.bytes += int(kwargs.get("mem_size", kwargs.get("size", 0)))

    return WorkspaceHook


#: bytes a cuBLAS handle took on each device, measured at this process's first
_HANDLE_BYTES: dict[int, int] = {}
class CupyBackend(DeviceApplies, Backend):
    """Runs a memgraph's stream program on CUDA device `device`. `workspace_bytes`: the device
    bytes reserved for apply slots and status words (default: exactly what the plan needs,
    `apply_plan.workspace_bytes(mg)`). Raises `BackendError` where no GPU is usable."""

    name = "cupy"
    #: a rank's sends and recvs go through host memory: a send copies its block out on the send
    #: queue's stream, a recv refills the pinned copies of the blocks its box meets
    peers = True

    def __init__(self, device: int = 0, workspace_bytes: int | None = None):
        reason = _unusable_reason(device)
        if reason is not None:
            raise BackendError(f"--backend cupy: no usable CUDA GPU ({reason})")
        if workspace_bytes is not None and workspace_bytes < 0:
            raise BackendError(f"--backend cupy: workspace_bytes is {workspace_bytes}, "
                               "expected a non-negative byte count")
        import cupy
        self._cp = cupy
        self.device_id = device
        self._device = cupy.cuda.Device(device)
        self._workspace_request = workspace_bytes
        self.hook = _hook_class()()
        self.hidden_allocations = 0
        self.hidden_bytes = 0
        self.compile_s = 0.0
        self.taken_bytes = 0         # device bytes `open` took, measured by memGetInfo
        self._local = threading.local()  # per worker: its queue (`_copy_queue`)
        self._reset_state()

    def _reset_state(self) -> None:
        self.arena: Any = None       # the arena as a cupy uint8 array (None once closed)
        self.host: np.ndarray | None = None
        self.workspace_bytes = 0
        self._mem = None             # the raw allocation (the only owner)
        self._regions: Regions | None = None
        self._region: dict[str, Any] = {}  # UnownedMemory over each region
        self._pinned = None
        self._pinned_ptr = 0
        self._host_at: dict[int, int] = {}  # host address of each tensor's host copy
        self._store: PinnedWeights | None = None
        self._store_keys: tuple = ()
        self._streams: dict[str, Any] = {}
        self._events: dict[int, Any] = {}
        self._staging: list[Any] = []  # events of the last copy out of each staging slot
        self._next_slot = 0
        self._rows: list[Any] = []     # events of the last copy out of each KV-row slot
        self._next_row = 0
        self._arena_at = 0           # where the host arena (disk staging buffers) starts
        self.reader: DiskReader | None = None
        self._plans: dict = {}
        self._top = 0                # bump pointer into the workspace slots (compute thread)
        self._unpacked: dict = {}    # read index -> its dequantized slot (the running apply)
        self._guards: dict = {}      # guard blocks read this pass (DeviceApplies._guard_on)
        self._warming = False
        self._handle = 0             # the compute thread's cuBLAS handle
        self._gemm_calls = {}        # MatmulApply -> its cuBLAS call (DeviceApplies)
        self._fixed: dict[int, int] = {}  # activation input node -> its pinned slot
        self._on_cpu: set[int] = set()    # recorded nodes of the CPU's queues (`record`)
        self._graph = None           # the captured pass (CUDA graph)

    def context_bytes(self) -> int:
        """Device bytes the process holds besides its allocations, measured: the CUDA context
        and this thread's cuBLAS handle (`total - free` once both exist; other processes on the
        device count too), plus one handle more for the compute thread's own (a handle's size
        measured when this process made its first)."""
        with self._device:
            before = self._cp.cuda.runtime.memGetInfo()[0]
            self._cp.cuda.device.get_cublas_handle()
            free, total = self._cp.cuda.runtime.memGetInfo()
        handle = _HANDLE_BYTES.setdefault(self.device_id, max(before - free, 0))
        return total - free + handle

    # ------------------------------------------------------------------ open / close
    def open(self, mg: MemGraph, io: PlanIO) -> None:
        cp = self._cp
        self.mg, self.io = mg, io
        self.hook.reset()
        self.hidden_allocations = self.hidden_bytes = 0
        plans = plan_applies(mg)
        need = workspace_for(plans)
        workspace = need if self._workspace_request is None else self._workspace_request
        if workspace < need:
            raise BackendError(f"--backend cupy: a workspace of {workspace} bytes is below the "
                               f"{need} bytes this plan's applies need")
        store = PinnedWeights.for_source(cp, io.weights)
        weights = frozenset(tid for tid in host_layout(mg, stage_sources=True).streamed
                            if mg.tensors[tid].role == "weight"
                            and mg.tensors[tid].source is not None) if store else frozenset()
        layout: HostLayout = host_layout(mg, stage_sources=True, exclude=weights)
        slot = max((aligned(mg.tensors[n.tensor].bytes) for n in mg.nodes
                    if isinstance(n, InputNode) and n.at == "device"), default=0)
        row = max((aligned(mg.tensors[n.tensor].bytes) for n in mg.nodes
                   if isinstance(n, InputNode) and n.at == "device"
                   and mg.tensors[n.tensor].role == "cache"), default=0)
        staging_at = layout.nbytes
        rows_at = staging_at + STAGING_SLOTS * slot
        fixed, end = {}, rows_at + ROW_SLOTS * row
        for n in mg.nodes:  # activations copied in every pass: a slot each (no host wait)
            if (isinstance(n, InputNode) and n.at == "device"
                    and mg.tensors[n.tensor].role not in PERSISTENT_ROLES):
                fixed[n.id] = end
                end += aligned(mg.tensors[n.tensor].bytes)
        arena_at = -(-end // HOST_ALIGNMENT) * HOST_ALIGNMENT
        try:
            with self._device:
                free_before = cp.cuda.runtime.memGetInfo()[0]
                self._open_device(cp, mg.device_bytes, workspace)
                self._open_host(cp, arena_at + mg.host_arena_bytes)
                self.taken_bytes = free_before - cp.cuda.runtime.memGetInfo()[0]
        except BaseException as exc:
            self.close()
            if isinstance(exc, (BackendError, PlanError)):
                raise
            if isinstance(exc, Exception):
                raise BackendError(f"--backend cupy: cannot allocate {mg.device_bytes} + "
                                   f"{workspace} device bytes and {arena_at} pinned host bytes "
                                   f"on device {self.device_id}: {type(exc).__name__}: "
                                   f"{exc}") from exc
            raise
        self.workspace_bytes = workspace
        self._plans = plans
        self.layout = layout
        self._host_at = {tid: self._pinned_ptr + at for tid, at in layout.offsets.items()}
        received = {n.input for n in mg.nodes if isinstance(n, RecvNode)}
        self._received: dict[str, list[int]] = {}
        for tid in layout.offsets:  # the pinned copies a recv refills
            src = mg.tensors[tid].source
            if src is not None and src.input in received:
                self._received.setdefault(src.input, []).append(tid)
        self._slot, self._staging_at = slot, staging_at
        self._row, self._rows_at = row, rows_at
        self._fixed = fixed
        self._arena_at = arena_at
        self.reader = DiskReader(io)
        try:
            self._compile_kernels()
            self._pin_weights(store, weights)
            self._fill_host(mg, io)
        except BaseException:
            self.close()
            raise

    def _open_device(self, cp, device_bytes: int, workspace: int) -> None:
        r = regions(device_bytes, workspace - STATUS_BYTES)
        self._regions = r
        self._mem = cp.cuda.Memory(r.total)
        base = self._mem.ptr
        for name, at, size in (("arena", 0, r.arena), ("cublas", r.cublas_at, r.cublas),
                               ("slots", r.slots_at, r.slots),
                               ("status", r.status_at, STATUS_BYTES)):
            self._region[name] = cp.cuda.UnownedMemory(base + at, max(size, 1), None,
                                                       self.device_id)
        self.arena = cp.ndarray((device_bytes,), np.uint8, memptr=self._at("arena", 0))
        # the disk queue's reads, the host queue's applies and the messages of a rank of several
        # (recv, and send after its copy out) run on the CPU: those streams carry their events
        # (recorded once the CPU work is done) and the send's copy
        self._streams = {q: cp.cuda.Stream(non_blocking=True) for q in QUEUES}
        self._at("status", 0).memset_async(0, STATUS_BYTES, self._streams["compute"])
        # an event per pinned slot, recorded after each copy out of it (one never recorded is
        # complete): a slot is reused once its event is
        self._staging = [cp.cuda.Event(block=True, disable_timing=True)
                         for _ in range(STAGING_SLOTS)]
        self._rows = [cp.cuda.Event(block=True, disable_timing=True) for _ in range(ROW_SLOTS)]

    def _open_host(self, cp, nbytes: int) -> None:
        if nbytes == 0:
            self.host = np.zeros(0, np.uint8)
            return
        self._pinned = cp.cuda.PinnedMemory(nbytes)
        self._pinned_ptr = int(self._pinned.ptr)
        # a view that does not own the pinned memory: `close` releases it deterministically
        self.host = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(self._pinned_ptr))

    def _compile_kernels(self) -> None:
        """Run every distinct apply plan once on the arena, which holds nothing yet, so that
        CuPy compiles (or loads from its disk cache) every kernel the plan needs now and not in
        the first pass; GEMMs are skipped (cuBLAS compiles nothing). The status words a gather
        may set on the arena's garbage are cleared after."""
        t0 = time.perf_counter()
        seen: set = set()
        compute = self._streams["compute"]
        with self._queue_context("compute", warm=True):
            for n in self.mg.nodes:
                if isinstance(n, ApplyNode) and not n.on_host and self._plans[n.id] not in seen:
                    seen.add(self._plans[n.id])
                    self._apply(n)
            self._at("status", 0).memset_async(0, STATUS_BYTES, compute)
        with self._device:
            compute.synchronize()
        self.hidden_allocations = self.hidden_bytes = 0
        self.hook.reset()
        self.compile_s = time.perf_counter() - t0

    def _pin_weights(self, store: PinnedWeights | None, tids: frozenset[int]) -> None:
        """The streamed weight blocks' host copies: pinned once for the loaded model
        (`pinned.PinnedWeights`), shared with the later sessions of its plans."""
        if store is None or not tids:
            return
        mg, io = self.mg, self.io
        keys, wanted = {}, {}
        for tid in sorted(tids):
            t = mg.tensors[tid]
            dtype, shape = stored(t)  # a packed block: its packed bytes
            keys[tid] = (t.source.input, tuple(t.source.origin), tuple(t.shape), t.dtype.value,
                         t.storage)
            wanted[keys[tid]] = (math.prod(shape) * dtype.itemsize,
                                 lambda buf, tid=tid, t=t: io.read_into(
                                     tid, typed_view(buf, 0, t)))
        with self._device:
            addresses = store.acquire(wanted)
        self._store, self._store_keys = store, tuple(wanted)
        for tid, key in keys.items():
            self._host_at[tid] = addresses[key]

    def _fill_host(self, mg: MemGraph, io: PlanIO, activations_only: bool = False) -> None:
        """Streamed input blocks (weights, KV-store blocks, activations) start as their source's
        values in pinned memory; between passes only the activations change."""
        at_host = {n.tensor for n in mg.nodes if isinstance(n, InputNode) and n.at == "host"}
        for tid in self.layout.offsets:
            if tid in at_host and not (activations_only
                                       and mg.tensors[tid].role in PERSISTENT_ROLES):
                io.read_into(tid, host_view(self.host, mg, self.layout, tid))

    def begin_pass(self) -> None:
        self._guards = {}
        self._fill_host(self.mg, self.io, activations_only=True)

    def write_input(self, tid: int, offset: int | None, lead: tuple[int, ...],
                    values: np.ndarray) -> None:
        t = self.mg.tensors[tid]
        dtype, shape = stored(t)  # a packed KV block takes packed rows
        if offset is None:
            if tid in self.layout.offsets:  # its pinned copy is what the reloads read
                host_view(self.host, self.mg, self.layout, tid)[lead] = values
            return
        start, _ = instance_bytes(self.mg, tid, offset)
        rest = math.prod(shape[len(lead):])
        first = int(np.ravel_multi_index(lead, shape[:len(lead)])) if lead else 0
        values = np.ascontiguousarray(values, dtype=dtype)
        if values.size != rest:
            raise PlanError(f"write into %t{tid}: {values.size} values for a run of {rest}")
        if values.nbytes > self._row:
            raise PlanError(f"write into %t{tid}: {values.nbytes} bytes exceed a KV row slot "
                            f"of {self._row}")
        k = self._next_row
        self._next_row = (k + 1) % ROW_SLOTS
        compute = self._streams["compute"]
        with self._device:
            self._rows[k].synchronize()  # the slot's last copy has read it
            at = self._rows_at + k * self._row
            self.host[at:at + values.nbytes] = values.view(np.uint8).reshape(-1)
            # on the compute stream: after this pass's reads, before the next pass's
            self._at("arena", start + first * rest * dtype.itemsize).copy_from_host_async(
                self._pinned_ptr + at, values.nbytes, compute)
            self._rows[k].record(compute)

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
        with self._device:
            for stream in self._streams.values():
                try:
                    stream.synchronize()  # nothing may still read or write what is freed below
                except Exception:  # a device error is reported by finish(); release regardless
                    pass
        if self._store is not None:
            self._store.release(self._store_keys)
        self._reset_state()

    def abort(self) -> None:
        """Nothing to interrupt: a queue's calls only enqueue work (a staging slot's wait is
        one bounded copy), and `close` synchronizes before releasing."""

    # ------------------------------------------------------------------ queues
    def queue_context(self, queue: str):
        return self._queue_context(queue)

    @contextmanager
    def _queue_context(self, queue: str, warm: bool = False) -> Iterator[None]:
        with self._device, self._streams[queue], self.hook:
            if queue != "compute":
                self._local.queue = queue
                yield
                return
            if not warm:  # this thread's handle (made once per thread): the region, the stream
                self._handle = self._cp.cuda.device.get_cublas_handle()
                cublas_lib.set_workspace(self._handle, self._region["cublas"].ptr,
                                         self._regions.cublas)
                cublas_lib.set_stream(self._handle, self._streams["compute"].ptr)
            self._warming = warm
            try:
                with self._cp.cuda.using_allocator(self._allocate):
                    yield
            finally:
                self._warming = False

    def record(self, queue: str, node: int) -> None:
        """Record the node's event, made at its first record and recorded anew every pass (a
        pass's waits come after its records, and passes do not overlap)."""
        if queue in _CPU_QUEUES:  # its work is done (on the CPU) once the worker records it
            self._on_cpu.add(node)
            return
        event = self._events.get(node)
        with self._device:
            if event is None:
                event = self._events[node] = self._cp.cuda.Event(disable_timing=True)
            event.record(self._streams[queue])

    def wait(self, queue: str, node: int) -> None:
        """Make `queue` wait for `node` (which its worker saw recorded): a stream waits on the
        node's event; a CPU queue synchronizes on it (the CPU touches the bytes now). A node a
        CPU queue ran is done already: nothing to wait on (a captured stream could not wait on
        an event recorded outside the capture)."""
        if node in self._on_cpu:
            return
        if queue in _CPU_QUEUES:  # the CPU touches the bytes now: the work must be done
            self._events[node].synchronize()
            return
        self._streams[queue].wait_event(self._events[node])

    def stamp(self, queue: str) -> Any:
        with self._device:
            event = self._cp.cuda.Event()
            event.record(self._streams[queue])
        return event

    def seconds(self, start: Any, end: Any) -> float:
        return self._cp.cuda.get_elapsed_time(start, end) / 1000.0

    def finish(self) -> None:
        with self._device:
            for stream in self._streams.values():
                stream.synchronize()
            status = np.zeros(3, np.int64)  # pageable: the copy returns once it is complete
            compute = self._streams["compute"]
            self._at("status", 0).copy_to_host_async(status.ctypes.data, status.nbytes, compute)
            if status[0]:  # cleared before the next pass's kernels (on the same stream)
                self._at("status", 0).memset_async(0, STATUS_BYTES, compute)
                raise InputError(f"gather: index {int(status[1])} out of range for a table of "
                                 f"{int(status[2])} rows")

    # ------------------------------------------------------------------ CUDA graphs
    def can_capture(self) -> bool:
        """A pass with no host work in it (no disk reads, no applies on the host, no messages
        to or from other ranks) and no guards (a branch on data: a guarded apply or reload)
        replays as one CUDA graph."""
        prologue = {n.id for n in host_prologue(self.mg)}
        return not any(isinstance(n, (ReadNode, SendNode, RecvNode)) or (
            isinstance(n, ApplyNode) and ((n.on_host and n.id not in prologue)
                                          or n.guard is not None)) or (
                isinstance(n, ReloadNode) and n.guard is not None)
            for n in self.mg.nodes)

    # ------------------------------------------------------------------ messages
    def send(self, n: SendNode, comm) -> None:
        """The block to host memory on the send stream (after the wait on its writer: the CPU
        waited), then to the peer."""
        if n.offset is None:  # its host copy, which an offload made
            data = host_view(self.host, self.mg, self.layout, n.tensor)
        else:
            src, nbytes = self._instance(n.tensor, n.offset)
            dtype, shape = stored(self.mg.tensors[n.tensor])
            data = np.empty(shape, dtype)
            with self._device:  # into pageable memory: returns once the copy is complete
                src.copy_to_host_async(data.ctypes.data, nbytes, self._streams["send"])
        comm.send(np.ascontiguousarray(data), n.peer, n.tag)

    def recv(self, n: RecvNode, comm, whole: np.ndarray) -> None:
        """The box into the input's host buffer, then every pinned copy of a block of that
        input the box meets read again from it (the reloads read the pinned copies; each
        waits for the recvs of its box)."""
        receive_into(whole, n, comm)
        for tid in self._received.get(n.input, ()):
            t = self.mg.tensors[tid]
            if boxes_meet(t.source.origin, t.shape, n.origin, n.shape):
                self.io.read_into(tid, host_view(self.host, self.mg, self.layout, tid))

    def begin_capture(self) -> None:
        """The compute stream captures; the copy streams join it by waiting on its first
        event (a fork), so all of the pass is in the graph."""
        compute = self._streams["compute"]
        with self._device:
            compute.begin_capture()
            fork = self._cp.cuda.Event(disable_timing=True)
            fork.record(compute)
            for q in _COPY_QUEUES:
                self._streams[q].wait_event(fork)

    def end_capture(self, failed: bool = False) -> None:
        """Join the copy streams back into the compute stream, end the capture and keep the
        graph (discarded where a queue failed meanwhile)."""
        compute = self._streams["compute"]
        with self._device:
            try:
                for q in _COPY_QUEUES:
                    join = self._cp.cuda.Event(disable_timing=True)
                    join.record(self._streams[q])
                    compute.wait_event(join)
            finally:
                try:
                    graph = compute.end_capture()
                except Exception:
                    if not failed:
                        raise
                    graph = None
        self._graph = None if failed else graph

    def replay(self) -> None:
        """Refill the activations' slots, run the prologue's host applies
        (`streams.host_prologue`: the last pass has finished, so nothing reads their buffers),
        then launch the graph on the compute stream (after the KV rows written since the last
        pass, which went there too)."""
        for nid, at in self._fixed.items():
            tid = self.mg.nodes[nid].tensor
            self._read_input(tid, at, instance_bytes(self.mg, tid, self.mg.nodes[nid].offset)[1])
        for n in host_prologue(self.mg):
            self.run_host(n)
        with self._device:
            self._graph.launch(self._streams["compute"])

    # ------------------------------------------------------------------ device memory
    def _at(self, region: str, offset: int):
        """A pointer `offset` bytes into a region of the allocation."""
        return self._cp.cuda.MemoryPointer(self._region[region], offset)

    def _instance(self, tid: int, offset: int | None) -> tuple[Any, int]:
        start, nbytes = instance_bytes(self.mg, tid, offset)
        return self._at("arena", start), nbytes

    def _array(self, tid: int, offset: int | None) -> Any:
        """The instance of `tid` at `offset`: a C-contiguous view of the arena (of a packed
        block: its bytes, `uint8` in its packed shape)."""
        ptr, _ = self._instance(tid, offset)
        t = self.mg.tensors[tid]
        if t.storage is not None:
            return self._cp.ndarray(stored(t)[1], np.uint8, memptr=ptr)
        return self._cp.ndarray(tuple(t.shape), DEVICE_DTYPE[t.dtype.value], memptr=ptr)

    def _bump(self, nbytes: int):
        size = aligned(max(int(nbytes), 1))
        if self._top + size > self._regions.slots:
            raise ExecutionError(f"cupy workspace overflow: {self._top + size} bytes wanted, "
                                 f"{self._regions.slots} reserved (workspace_bytes(mg) plans "
                                 "them)")
        ptr = self._at("slots", self._top)
        self._top += size
        return ptr

    def _allocate(self, nbytes: int):
        """CuPy's allocator in the compute thread: workspace, counted as hidden."""
        self.hidden_allocations += 1
        self.hidden_bytes += int(nbytes)
        return self._bump(nbytes)

    def _temp(self, shape: tuple[int, ...], dtype: Any) -> Any:
        dtype = np.dtype(dtype)
        return self._cp.ndarray(tuple(shape), dtype,
                                memptr=self._bump(math.prod(shape) * dtype.itemsize))

    # ------------------------------------------------------------------ copies
    def _host_ptr(self, tid: int) -> int:
        return self._host_at[tid]

    def read_disk(self, n: ReadNode) -> None:
        arena = self.host[self._arena_at:]
        self.reader.read(n.tensor, staging_view(arena, self.mg, n.tensor, n.host_offset))

    def _h2d(self, dst: Any, host_ptr: int, nbytes: int) -> None:
        """Pinned host memory -> the device on the calling worker's copy stream (h2d, or
        h2d_host for what the host's applies wrote: `streams.queues_of`). Through
        cudaMemcpyAsync itself: CuPy's `MemoryPointer.copy_from_host_async` refuses a capturing
        stream (CuPy 14), where CUDA captures a copy from pinned memory as a graph node."""
        rt = self._cp.cuda.runtime
        rt.memcpyAsync(dst.ptr, host_ptr, nbytes, rt.memcpyHostToDevice,
                       self._streams[self._copy_queue()].ptr)

    def _copy_queue(self) -> str:
        """The host->device queue the calling worker runs (h2d where it runs none)."""
        queue = getattr(self._local, "queue", None)
        return queue if queue in _H2D_QUEUES else "h2d"

    def copy_h2d(self, n: ReloadNode | InputNode) -> None:
        dst, nbytes = self._instance(n.tensor, n.offset)
        if isinstance(n, ReloadNode) and n.host_offset is not None:
            self._h2d(dst, self._pinned_ptr + self._arena_at + n.host_offset, nbytes)
            return
        if isinstance(n, ReloadNode):
            if n.tensor not in self._host_at:
                raise PlanError(f"reload %{n.id}: %t{n.tensor} has no host copy")
            self._h2d(dst, self._host_ptr(n.tensor), nbytes)
            return
        if n.at != "device":
            raise PlanError(f"input %{n.id} at {n.at!r} is not copied to the device")
        if n.id in self._fixed:  # an activation: its own slot, refilled before every replay
            at = self._fixed[n.id]
            self._read_input(n.tensor, at, nbytes)
            self._h2d(dst, self._pinned_ptr + at, nbytes)
            return
        k = self._next_slot
        self._next_slot = (k + 1) % STAGING_SLOTS
        self._staging[k].synchronize()  # the slot's last copy has read it
        at = self._staging_at + k * self._slot
        self._read_input(n.tensor, at, nbytes)
        self._h2d(dst, self._pinned_ptr + at, nbytes)
        self._staging[k].record(self._streams["h2d"])

    def _read_input(self, tid: int, at: int, nbytes: int) -> None:
        """Read input block `tid` into pinned memory at `at` (a packed block: its bytes)."""
        self.io.read_into(tid, typed_view(self.host, at, self.mg.tensors[tid]))

    def copy_d2h(self, n: OffloadNode) -> None:
        src, nbytes = self._instance(n.tensor, n.offset)
        if n.tensor not in self.layout.offsets:
            raise PlanError(f"offload %{n.id}: %t{n.tensor} has no host slot")
        rt = self._cp.cuda.runtime  # not CuPy's copy_to_host_async: see _h2d
        rt.memcpyAsync(self._host_ptr(n.tensor), src.ptr, nbytes, rt.memcpyDeviceToHost,
                       self._streams["d2h"].ptr)

    def output(self, ref: OutputRef) -> np.ndarray:
        t = self.mg.tensors[ref.tensor]
        if ref.at == "device":
            src, nbytes = self._instance(ref.tensor, ref.offset)
            dtype, shape = stored(t)
            out = np.empty(shape, dtype)
            compute = self._streams["compute"]
            with self._device:  # into pageable memory: returns once the copy is complete
                src.copy_to_host_async(out.ctypes.data, nbytes, compute)
            return out
        if ref.tensor in self.layout.copied:
            return host_view(self.host, self.mg, self.layout, ref.tensor).copy()
        return self.io.source_block(ref.tensor)

    # ------------------------------------------------------------------ compute
    def run(self, n: ApplyNode) -> None:
        self._apply(n)

    def run_host(self, n: ApplyNode) -> None:
        """On the CPU, on the pinned host copies (the offloads it waited for are complete)."""
        host_apply(n, self.mg, self.io, self.host, self.layout)
