"""The stream executor: a memgraph run as it was priced, its stream program on a backend with one
worker thread per queue (DESIGN.md, "Stream program").

First the weights that stay on the device are loaded (the program's `preloaded` nodes, once per
plan, timed apart: the simulator prices them at zero). Then the pass: each worker issues its
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
from einpage.ir.memgraph import MemGraph
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
    if isinstance(backend, str):
        from einpage.runtime.backends import make_backend
        backend = make_backend(backend)
    program = program if program is not None else compile_streams(mg, preload=True)
    io = PlanIO(mg, inputs, weights)
    try:
        backend.open(mg, io)
        return _Pass(mg, program, backend, timing).run(io)
    except KeyboardInterrupt:  # between the phases: no worker is running
        raise Interrupted("interrupted: every queue stopped, memory released") from None
    finally:
        backend.close()


class _Pass:
    def __init__(self, mg: MemGraph, program: StreamProgram, backend: Backend, timing: bool):
        self.mg, self.program, self.backend, self.timing = mg, program, backend, timing
        self.recorded = {node: threading.Event() for node in program.events}
        self.aborted = threading.Event()
        self.failure: tuple[str, int, BaseException] | None = None
        self.lock = threading.Lock()
        self.stamps: dict[str, list[tuple[int, object, object]]] = {q: [] for q in QUEUES}
        self.current: dict[str, int] = {}  # queue -> the node it is issuing

    # ------------------------------------------------------------------ the two phases
    def run(self, io: PlanIO) -> StreamRun:
        mg, backend = self.mg, self.backend
        t0 = time.perf_counter()
        self._on_queues({"h2d": self._preload})
        self._finish()
        load_s = time.perf_counter() - t0
        steps_of = {q: [s for s in self.program.steps if s.queue == q] for q in QUEUES}
        self.origin = backend.stamp("compute") if self.timing else None
        t0 = time.perf_counter()
        self._on_queues({q: (lambda q=q: self._queue(q, steps_of[q])) for q in QUEUES})
        self._finish()
        wall = time.perf_counter() - t0
        spans = self._spans() if self.timing else ()
        load_bytes = sum(mg.tensors[mg.nodes[i].tensor].bytes for i in self.program.preloaded)
        outputs = io.results(backend.output)
        return StreamRun(outputs, Measured(backend.name, wall, load_s, load_bytes, spans))

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
        else:
            self.backend.copy_d2h(n)

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
