"""The threads backend: the stream program on any machine. The arena is one NumPy buffer; a
queue's calls do their work before returning (so `record` and `wait` need nothing beyond the
executor's host-side flags), and the three worker threads overlap for real: NumPy drops the GIL
in BLAS and in large copies. A reload of a weight block reads it from its source — for a
checkpoint, the memory-mapped safetensors file — straight into the arena on the h2d thread, so
on a CPU the "link" is the disk or the page cache, and those reads overlap compute. A plan with a
disk tier has a host arena of staging buffers: its reader (the disk queue's thread) reads each
block a `read` names from the checkpoint file (`runtime.diskread`), and the reload copies it from
there into the arena.
"""
from __future__ import annotations

import time

import numpy as np

from einpage.ir.memgraph import (ApplyNode, InputNode, MemGraph, OffloadNode, OutputRef, ReadNode,
                                 ReloadNode)
from einpage.runtime.backends.base import (Backend, HostLayout, aligned_empty, host_apply,
                                           host_layout, host_view, staging_view)
from einpage.runtime.blockops import apply_into, guard_on
from einpage.runtime.diskread import DiskReader
from einpage.runtime.planio import PlanIO, arena_view


class ThreadsBackend(Backend):
    name = "threads"
    peers = True

    def __init__(self, poison: bool = False, drop_cache: bool = False) -> None:
        """`poison` fills the arena with 0xFF first (NaN in every float dtype), so a read of
        bytes no node wrote yet shows up in the answer (for tests); `drop_cache` drops the pages
        of every disk read from the page cache (`DiskReader`), so each pass reads the drive."""
        self.poison, self.drop_cache = poison, drop_cache
        self.arena: np.ndarray | None = None
        self.host: np.ndarray | None = None
        self.staging: np.ndarray | None = None
        self.reader: DiskReader | None = None

    def open(self, mg: MemGraph, io: PlanIO) -> None:
        self.mg, self.io = mg, io
        self.layout: HostLayout = host_layout(mg, stage_sources=False)
        # the bytes the plan uses are touched here, so that the pass does not page-fault them in
        # (what a long-lived process, holding its arena across passes, never pays per pass)
        self.arena = np.empty(mg.device_bytes, dtype=np.uint8)
        self.arena[:mg.high_water()] = 0xFF if self.poison else 0
        self.host = np.zeros(self.layout.nbytes, dtype=np.uint8)
        self.host[:] = 0
        self.staging = aligned_empty(mg.host_arena_bytes)
        self.staging[:] = 0xFF if self.poison else 0
        self.reader = DiskReader(io, self.drop_cache)

    def _view(self, tid: int, offset: int | None) -> np.ndarray:
        return arena_view(self.arena, self.mg, tid, offset)

    def read_disk(self, n: ReadNode) -> None:
        self.reader.read(n.tensor, staging_view(self.staging, self.mg, n.tensor, n.host_offset))

    def copy_h2d(self, n: ReloadNode | InputNode) -> None:
        out = self._view(n.tensor, n.offset)
        if isinstance(n, ReloadNode) and n.host_offset is not None:
            np.copyto(out, staging_view(self.staging, self.mg, n.tensor, n.host_offset))
        elif n.tensor in self.layout.copied and isinstance(n, ReloadNode):
            np.copyto(out, host_view(self.host, self.mg, self.layout, n.tensor))
        else:
            self.io.read_into(n.tensor, out)

    def guard_on(self, n: ReloadNode) -> bool:
        return guard_on(self._view, n)

    def copy_d2h(self, n: OffloadNode) -> None:
        np.copyto(host_view(self.host, self.mg, self.layout, n.tensor),
                  self._view(n.tensor, n.offset))

    def run(self, n: ApplyNode) -> None:
        reads = [self._view(a.tensor, a.offset) for a in n.reads]
        write = self._view(n.write.tensor, n.write.offset)
        apply_into(n, self.mg.tensors, reads, write)

    def run_host(self, n: ApplyNode) -> None:
        host_apply(n, self.mg, self.io, self.host, self.layout)

    def write_input(self, tid: int, offset: int | None, lead: tuple[int, ...],
                    values: np.ndarray) -> None:
        if offset is not None:  # a streamed block is read from the input at each reload
            self._view(tid, offset)[lead] = values

    def record(self, queue: str, node: int) -> None:
        pass  # the work is done when the call returns: the executor's flag is the event

    def wait(self, queue: str, node: int) -> None:
        pass

    def stamp(self, queue: str) -> float:
        return time.perf_counter()

    def seconds(self, start: float, end: float) -> float:
        return end - start

    def finish(self) -> None:
        pass

    def output(self, ref: OutputRef) -> np.ndarray:
        if ref.at == "device":
            return self._view(ref.tensor, ref.offset).copy()
        if ref.tensor in self.layout.copied:
            return host_view(self.host, self.mg, self.layout, ref.tensor).copy()
        return self.io.source_block(ref.tensor)

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
        self.arena = self.host = self.staging = self.reader = None
