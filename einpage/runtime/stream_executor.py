"""The stream executor: a memgraph run as it was priced, its stream program on a backend with one
worker thread per queue (DESIGN.md, "Stream program"); the disk queue's thread is the reader
that fills host staging buffers from the checkpoint files ahead of the reloads.

A `StreamSession` holds a plan open on its backend for many passes (the decode steps of a
generation): the arena, the host buffers and the blocks that stay on the device live from the
first pass to `close`. The first pass loads the resident blocks (the program's `preloaded`
nodes: weights and KV-store blocks, timed apart: the simulator prices them at zero); between
passes the caller writes the KV store's new rows in place (`write`: into the device copy of a
resident block, or the backend's host copy of a streamed one). `run_streams` is one pass of a
session. Each pass: each worker issues its
queue's steps in plan order; before a step it blocks until every node it waits on has been
recorded (a host-side flag set after the backend's `record`), then has the backend wait on that
node's event. The plan's edges, through the program's waits, are the only ordering there is.

Faults: the first error on any queue (or Ctrl-C in the calling thread) sets an abort flag and
wakes every blocked worker; each stops before its next step, the backend is closed (its arena and
host memory released) and the caller gets one typed exception: the original `EinpageError` (a
checkpoint that fails to read), `ExecutionError` naming the queue and node for anything else,
`Interrupted` for Ctrl-C. Never a hang: a worker blocks only on a flag that either its producer
sets or the abort sets.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np

from einpage.errors import EinpageError, ExecutionError, Interrupted
from einpage.ir.memgraph import InputNode, MemGraph
from einpage.ir.tensors import WeightSource
from einpage.runtime.backends.base import Backend
from einpage.runtime.measured import Measured, Span
from einpage.runtime.planio import PlanIO
from einpage.runtime.streams import QUEUES, StreamProgram, compile_streams

#: how often a blocked caller looks up from joining the workers (Ctrl-C is seen between looks)
_POLL_S = 0.05


@dataclass(frozen=True)
class StreamRun:
    outputs: dict[str, np.ndarray]
    measured: Measured


def run_streams(mg: MemGraph, inputs: Mapping[str, np.ndarray] | None = None,
                weights: WeightSource | None = None, backend: Backend | str = "threads",
                program: StreamProgram | None = None, timing: bool = True) -> StreamRun:
    """Execute `mg` once on `backend` (a `Backend` or a registered name) and return its outputs
    by name with the measured pass. `timing` off spares the CUDA backend two events per node."""
    with StreamSession(mg, weights, backend, program, timing) as session:
        return session.run(inputs or {})


class StreamSession:
    """`mg` held open on `backend` for many passes (see the module docstring): `run(inputs)` per
    pass, `write(name, lead, values)` between passes, `close()` (or a `with` block) at the end.
    Any error closes the session (memory released) before it reaches the caller."""

    def __init__(self, mg: MemGraph, weights: WeightSource | None = None,
                 backend: Backend | str = "threads", program: StreamProgram | None = None,
                 timing: bool = True):
        if isinstance(backend, str):
            from einpage.runtime.backends import make_backend
            backend = make_backend(backend)
        self.mg, self.weights, self.backend, self.timing = mg, weights, backend, timing
        self.program = program if program is not None else compile_streams(mg, preload=True)
        self.io: PlanIO | None = None
        self.closed = False
        self.passes = 0
        self._blocks = _store_blocks(mg)

    def __enter__(self) -> "StreamSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def run(self, inputs: Mapping[str, np.ndarray]) -> StreamRun:
        """One pass with these activation inputs (and the current KV store)."""
        if self.closed:
            raise ExecutionError("this plan's session is closed")
        try:
            load_s = None
            if self.io is None:
                self.io = PlanIO(self.mg, inputs, self.weights)
                self.backend.open(self.mg, self.io)
                load_s = _Pass(self).preload()
            else:
                self.io.set_inputs(inputs)
                self.backend.begin_pass()
            result = _Pass(self).run(self.io, load_s)
            self.passes += 1
            return result
        except KeyboardInterrupt:  # between the phases: no worker is running
            self.close()
            raise Interrupted("interrupted: every queue stopped, memory released") from None
        except BaseException:
            self.close()
            raise

    def write(self, name: str, lead: tuple[int, ...], values: np.ndarray) -> None:
        """Between passes: `values` over `input[name][lead]` (a KV-store row: `lead` = (row,
        slot)) in every copy the backend holds of the blocks it falls in. The input array the
        caller passes to `run` is the caller's to update."""
        if self.io is None or self.closed:
            return  # nothing is held yet: the next `run` reads the caller's input
        values = np.asarray(values)
        for tid, origin, shape, offset in self._blocks.get(name, ()):
            k = len(lead)
            if not all(o <= i < o + n for i, o, n in zip(lead, origin[:k], shape[:k])):
                continue
            part = values[tuple(slice(o, o + n) for o, n in zip(origin[k:], shape[k:]))]
            local = tuple(i - o for i, o in zip(lead, origin))
            dtype = self.mg.tensors[tid].dtype.numpy
            try:
                self.backend.write_input(tid, offset, local,
                                         np.ascontiguousarray(part, dtype=dtype))
            except BaseException:
                self.close()
                raise

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.backend.close()


def _store_blocks(mg: MemGraph) -> dict[str, list[tuple[int, tuple, tuple, int | None]]]:
    """KV-store input blocks by input name: (tensor, origin, shape, arena offset or None for a
    block that streams from the host)."""
    out: dict[str, list] = {}
    for n in mg.nodes:
        if isinstance(n, InputNode) and 0 <= n.tensor < len(mg.tensors):
            t = mg.tensors[n.tensor]
            if t.role == "cache" and t.source is not None:
                out.setdefault(t.source.input, []).append(
                    (n.tensor, tuple(t.source.origin), tuple(t.shape),
                     n.offset if n.at == "device" else None))
    return out


class _Pass:
    def __init__(self, session: StreamSession):
        self.mg, self.program = session.mg, session.program
        self.backend, self.timing = session.backend, session.timing
        program = self.program
        self.recorded = {node: threading.Event() for node in program.events}
        self.aborted = threading.Event()
        self.failure: tuple[str, int, BaseException] | None = None
        self.lock = threading.Lock()
        self.stamps: dict[str, list[tuple[int, object, object]]] = {q: [] for q in QUEUES}
        self.current: dict[str, int] = {}  # queue -> the node it is issuing

    # ------------------------------------------------------------------ the two phases
    def preload(self) -> float:
        """Load the resident blocks (once per session); returns the seconds it took."""
        t0 = time.perf_counter()
        self._on_queues({"h2d": self._preload})
        self._finish()
        return time.perf_counter() - t0

    def run(self, io: PlanIO, load_s: float | None) -> StreamRun:
        """One pass; `load_s` the preload's seconds when this is the session's first pass."""
        mg, backend = self.mg, self.backend
        steps_of = {q: [s for s in self.program.steps if s.queue == q] for q in QUEUES}
        self.origin = backend.stamp("compute") if self.timing else None
        t0 = time.perf_counter()
        self._on_queues({q: (lambda q=q: self._queue(q, steps_of[q])) for q in QUEUES
                         if steps_of[q]})
        self._finish()
        wall = time.perf_counter() - t0
        spans = self._spans() if self.timing else ()
        load_bytes = (sum(mg.tensors[mg.nodes[i].tensor].bytes for i in self.program.preloaded)
                      if load_s is not None else 0)
        outputs = io.results(backend.output)
        return StreamRun(outputs, Measured(backend.name, wall, load_s or 0.0, load_bytes, spans))

    def _preload(self) -> None:
        for nid in self.program.preloaded:
            self._check_abort()
            self._issue("h2d", nid)

    def _queue(self, queue: str, steps) -> None:
        backend = self.backend
        for step in steps:
            for w in step.waits:
                self.recorded[w].wait()
                self._check_abort()
                backend.wait(queue, w)
            self._check_abort()
            before = backend.stamp(queue) if self.timing else None
            self._issue(queue, step.node)
            if self.timing:
                self.stamps[queue].append((step.node, before, backend.stamp(queue)))
            if step.node in self.recorded:
                backend.record(queue, step.node)
                self.recorded[step.node].set()

    def _issue(self, queue: str, nid: int) -> None:
        n = self.mg.nodes[nid]
        self.current[queue] = nid
        if queue == "compute":
            self.backend.run(n)
        elif queue == "h2d":
            self.backend.copy_h2d(n)
        elif queue == "d2h":
            self.backend.copy_d2h(n)
        else:
            self.backend.read_disk(n)

    # ------------------------------------------------------------------ workers and faults
    def _on_queues(self, work: dict[str, Callable[[], None]]) -> None:
        threads: list[threading.Thread] = []
        try:
            for q, fn in work.items():
                threads.append(threading.Thread(target=self._worker, args=(q, fn),
                                                name=f"einpage-{q}", daemon=True))
                threads[-1].start()
            for t in threads:
                while t.is_alive():
                    t.join(_POLL_S)
        except KeyboardInterrupt:
            self._abort()
            for t in threads:
                t.join()
            raise Interrupted("interrupted: every queue stopped, memory released") from None
        if self.failure is not None:
            queue, nid, exc = self.failure
            if isinstance(exc, EinpageError):
                raise exc
            n = self.mg.nodes[nid] if nid >= 0 else None
            where = f"node %{nid} ({n.kind})" if n is not None else "start"
            raise ExecutionError(f"{queue} queue failed at {where}: {type(exc).__name__}: "
                                 f"{exc}") from exc

    def _finish(self) -> None:
        try:
            self.backend.finish()
        except EinpageError:
            raise
        except Exception as exc:
            raise ExecutionError(f"{self.backend.name}: {type(exc).__name__}: {exc}") from exc

    def _worker(self, queue: str, fn: Callable[[], None]) -> None:
        try:
            with self.backend.queue_context(queue):
                fn()
        except _Aborted:
            pass
        except BaseException as exc:  # noqa: BLE001 - every error stops every queue
            with self.lock:
                if self.failure is None:
                    self.failure = (queue, self.current.get(queue, -1), exc)
            self._abort()

    def _abort(self) -> None:
        self.aborted.set()
        self.backend.abort()
        for flag in self.recorded.values():
            flag.set()  # wake every waiter: it sees the abort and stops

    def _check_abort(self) -> None:
        if self.aborted.is_set():
            raise _Aborted

    # ------------------------------------------------------------------ timing
    def _spans(self) -> tuple[Span, ...]:
        mg, backend = self.mg, self.backend
        spans = []
        origin = self.origin
        for q, marks in self.stamps.items():
            for nid, a, b in marks:
                n = mg.nodes[nid]
                nbytes = mg.tensors[n.tensor].bytes if q != "compute" else 0
                spans.append(Span(nid, q, backend.seconds(origin, a), backend.seconds(origin, b),
                                  nbytes))
        return tuple(sorted(spans, key=lambda s: (s.start, s.node)))


class _Aborted(Exception):
    """Raised inside a worker that must stop because another queue failed."""
