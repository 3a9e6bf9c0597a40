"""The one small interface a stream backend implements (DESIGN.md, "Stream program"): an arena,
host buffers, a copy each way, running an op, and events. Everything else — which node runs on
which queue, the waits, stopping every queue on an error, timing, assembling outputs — is the
stream executor's (`einpage.runtime.stream_executor`), shared by every backend.

The executor calls a backend from one worker thread per queue: `copy_h2d` only from the h2d
and h2d_host threads (a reload of a block a host apply wrote runs on the second:
`streams.queues_of`), `copy_d2h` only from the d2h thread, `run` only from the compute thread,
`run_host` only from the host thread (an apply on host copies, done on the CPU before the call
returns), `read_disk` only from the disk thread (the reader: checkpoint file -> host staging
buffer, done on the host before the call returns; a `wait` of the disk queue blocks the reader
until the awaited node is complete, since the staging bytes it overwrites may still be in use).
A call *issues* the node on its queue: the threads backend does the work before returning, the
CUDA backend enqueues it on the queue's stream. `record(queue, node)` makes an event after what the
queue has issued; the executor calls `wait(queue, node)` only after that node's `record` returned,
and the wait makes later work of `queue` start after the event (a no-op where `record` is issued
after completed work).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, ContextManager

import numpy as np

from einpage.errors import PlanError
from einpage.ir.memgraph import (ALIGNMENT, HOST_ALIGNMENT, ApplyNode, InputNode, MemGraph,
                                 OffloadNode, OutputRef, ReadNode, RecvNode, ReloadNode, SendNode)
from einpage.runtime.blockops import host_apply_into
from einpage.runtime.planio import PlanIO, receive_into, typed_view


class Backend(ABC):
    """Runs the nodes of one memgraph on three queues. `open` before the pass, `close` after
    (always, also after an error); a backend object runs one plan at a time."""

    name: str = ""
    #: runs the sends and recvs of a program of one rank of several (`send`, `recv`)
    peers: bool = False

    @abstractmethod
    def open(self, mg: MemGraph, io: PlanIO) -> None:
        """Allocate the arena (`mg.device_bytes`) and host buffers for `mg`."""

    def queue_context(self, queue: str) -> ContextManager:
        """Entered by the worker thread of `queue` around all its calls (the CUDA backend makes
        the device and the queue's stream current there)."""
        return nullcontext()

    @abstractmethod
    def copy_h2d(self, n: ReloadNode | InputNode) -> None:
        """Issue a block's copy into the arena: from its host copy (an earlier offload), its
        staging buffer (a reload with a `host_offset`, filled by a `read`) or its source (a
        weight block from the checkpoint, an activation input)."""

    def guard_on(self, n: ReloadNode) -> bool:
        """Whether guarded reload `n` copies: element `n.guard.index` of its guard block's
        instance is nonzero. Called on the h2d queue, after `wait` on the guard's writers; a
        reload it turns off is not issued (it moves no byte)."""
        raise NotImplementedError(f"the {self.name} backend runs no guarded reload")

    @abstractmethod
    def copy_d2h(self, n: OffloadNode) -> None:
        """Issue a copy of an instance into the tensor's host buffer."""

    @abstractmethod
    def read_disk(self, n: ReadNode) -> None:
        """Read a block from its checkpoint file into the host arena's staging buffer at
        `n.host_offset` (see `staging_view`); done when the call returns."""

    @abstractmethod
    def run(self, n: ApplyNode) -> None:
        """Issue an apply: read its instances, write (or accumulate into) its write."""

    @abstractmethod
    def run_host(self, n: ApplyNode) -> None:
        """Run an apply on the host (`n.on_host`): read host copies (an earlier offload or host
        write, see `host_reads`, or the input's source), write the tensor's host copy; done when
        the call returns."""

    @abstractmethod
    def record(self, queue: str, node: int) -> None:
        """Make an event after what `queue` has issued, for others to wait on (`node` names it)."""

    @abstractmethod
    def wait(self, queue: str, node: int) -> None:
        """Make what `queue` issues next start after the event recorded for `node`."""

    @abstractmethod
    def stamp(self, queue: str) -> Any:
        """A time mark after what `queue` has issued (for timing)."""

    @abstractmethod
    def seconds(self, start: Any, end: Any) -> float:
        """Seconds between two stamps; called only after `finish`."""

    @abstractmethod
    def finish(self) -> None:
        """Block until every queue has completed what it issued (raises a device error here)."""

    @abstractmethod
    def output(self, ref: OutputRef) -> np.ndarray:
        """An output block as a host array (after `finish`)."""

    def send(self, n: SendNode, comm) -> None:
        """From the send queue's thread: `n`'s block (its instance, or its host copy) to its
        peer through `comm`; the block is complete (the executor waited for its writer)."""
        ref = OutputRef(n.tensor, "host" if n.offset is None else "device", n.offset, "", ())
        comm.send(np.ascontiguousarray(self.output(ref)), n.peer, n.tag)

    def recv(self, n: RecvNode, comm, whole: np.ndarray) -> None:
        """From the recv queue's thread: `n`'s box of its input into `whole`, that input's host
        buffer, which the reloads of its blocks then read."""
        receive_into(whole, n, comm)

    def begin_pass(self) -> None:
        """Between passes of a plan held open: the activation inputs (`io.set_inputs`) changed;
        refresh any copy of them the backend made. Nothing runs during the call."""

    @abstractmethod
    def write_input(self, tid: int, offset: int | None, lead: tuple[int, ...],
                    values: np.ndarray) -> None:
        """Between passes: write `values` over `block[lead]` of persistent input block `tid` (a
        row of the KV store). `offset`: the block stays on the device there; None: it streams
        from the host, where a backend that keeps its own host copy updates that copy (the
        caller has already updated the input itself). `values` is C-contiguous, in the block's
        dtype, of the shape `block.shape[len(lead):]`: one contiguous run of the block (for a
        packed block, `planio.stored`: its packed bytes, the session quantized them)."""

    def can_capture(self) -> bool:
        """Whether the pass of the open plan can be recorded once and replayed (CUDA graphs):
        then, from a session's second pass on, the executor issues one pass between
        `begin_capture` and `end_capture` and every pass is one `replay`."""
        return False

    def begin_capture(self) -> None:
        """Record what the queues issue from now on instead of running it."""
        raise NotImplementedError

    def end_capture(self, failed: bool = False) -> None:
        """Stop recording (`failed`: a queue failed meanwhile; release what was recorded and
        raise nothing of the capture's own)."""
        raise NotImplementedError

    def replay(self) -> None:
        """Issue the recorded pass once more (the activation inputs refreshed from `io`)."""
        raise NotImplementedError

    @abstractmethod
    def close(self) -> None:
        """Release the arena and host buffers. Idempotent; called after an error too."""

    def abort(self) -> None:
        """Called from any thread when the pass must stop: stop blocking calls soon (optional)."""


@dataclass(frozen=True)
class HostLayout:
    """Where each host-side tensor lives in one host buffer allocated once: offsets aligned to
    `ALIGNMENT`, `nbytes` in all. `copied` holds every tensor whose host copy the plan makes (an
    `offload` copies it out, or an apply on the host writes it); `streamed` every input block
    that a `reload` reads from its source (a weight block that does not stay resident), for
    backends that stage those in (pinned) host memory."""
    offsets: dict[int, int]
    nbytes: int
    copied: frozenset[int]
    streamed: frozenset[int]


def host_layout(mg: MemGraph, stage_sources: bool,
                exclude: frozenset[int] = frozenset()) -> HostLayout:
    """The host buffer of `mg`: every tensor whose host copy the plan makes, and with
    `stage_sources` every input block that a reload reads from its source (but those in
    `exclude`, which the backend keeps elsewhere), each once, in order of first use."""
    copied = {n.tensor for n in mg.nodes if isinstance(n, OffloadNode)}
    copied |= mg.host_written()
    at_host = {n.tensor for n in mg.nodes if isinstance(n, InputNode) and n.at == "host"}
    streamed = {n.tensor for n in mg.nodes
                if isinstance(n, ReloadNode) and n.tensor in at_host and n.tensor not in copied}
    wanted = copied | ((streamed - exclude) if stage_sources else set())
    offsets, end = {}, 0
    for n in mg.nodes:
        if isinstance(n, ApplyNode):
            tids = [n.write.tensor] if n.on_host else []
        else:
            tids = [] if isinstance(n, RecvNode) else [n.tensor]
        for tid in tids:
            if tid in wanted and tid not in offsets:
                offsets[tid] = end
                end += -(-mg.tensors[tid].bytes // ALIGNMENT) * ALIGNMENT
    return HostLayout(offsets, end, frozenset(copied), frozenset(streamed))


def host_apply(n: ApplyNode, mg: MemGraph, io: PlanIO, host: np.ndarray,
               layout: HostLayout) -> None:
    """Run apply `n` on the host: it reads the host copies in `host` (laid out by `layout`), or
    for a tensor the plan never copies, its input's source (a weight block in host memory, a
    block of the KV store), and writes (or accumulates into) the host copy of its write."""
    reads = [host_view(host, mg, layout, a.tensor) if a.tensor in layout.copied
             else io.source_block(a.tensor) for a in n.reads]
    host_apply_into(n, mg.tensors, reads, host_view(host, mg, layout, n.write.tensor))


def host_view(buffer: np.ndarray, mg: MemGraph, layout: HostLayout, tid: int) -> np.ndarray:
    """The host copy of tensor `tid`: a typed view of `buffer` (a `uint8` host array)."""
    return typed_view(buffer, layout.offsets[tid], mg.tensors[tid])


def staging_view(arena: np.ndarray, mg: MemGraph, tid: int, host_offset: int) -> np.ndarray:
    """The staging buffer of tensor `tid` at `host_offset` of the host arena (a `uint8` array of
    `mg.host_arena_bytes`): a typed view."""
    t = mg.tensors[tid]
    if host_offset < 0 or host_offset + t.bytes > len(arena):
        raise PlanError(f"%t{tid} at host offset {host_offset} lies outside the host arena of "
                        f"{len(arena)} bytes")
    return typed_view(arena, host_offset, t)


def aligned_empty(nbytes: int) -> np.ndarray:
    """A `uint8` array of `nbytes` whose start is aligned to `HOST_ALIGNMENT`."""
    raw = np.empty(nbytes + HOST_ALIGNMENT, dtype=np.uint8)
    skip = (-raw.ctypes.data) % HOST_ALIGNMENT
    return raw[skip:skip + nbytes]
