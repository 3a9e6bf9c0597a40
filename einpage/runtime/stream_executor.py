"""The stream executor: a memgraph run as it was priced, its stream program on a backend with one
worker thread per queue (DESIGN.md, "Stream program"); the disk queue's thread is the reader
that fills host staging buffers from the checkpoint files ahead of the reloads.

A `StreamSession` holds a plan open on its backend for many passes (the decode steps of a
generation): the arena, the host buffers, the blocks that stay on the device and the worker
threads live from the first pass to `close`. The first pass opens the backend, starts one thread
per queue that has work (each enters `backend.queue_context(queue)` once, for the session's
life: the CUDA backend makes its device and stream current there and makes its cuBLAS handle)
and loads the resident blocks (the program's `preloaded` nodes: weights and KV-store blocks,
timed apart: the simulator prices them at zero); between passes the caller writes the KV store's
new rows in place (`write`: into the device copy of a resident block, or the backend's host copy
of a streamed one). `run_streams` is one pass of a session.

Each pass hands every worker its queue's steps (made once per session: the node, its waits, and
whether it records) and waits for all of them. A worker issues its steps in plan order; before a
step it blocks until every node it waits on has been recorded (per pass, each queue publishes the
latest node it recorded, after the backend's `record`), then has the backend wait on that
node's event. The plan's edges, through the program's waits, are the only ordering there is.

Faults: the first error on any queue (or Ctrl-C in the calling thread) sets an abort flag and
wakes every blocked worker; each stops before its next step, the session is closed (its threads
joined, then the backend closed: its arena and host memory released) and the caller gets one
typed exception: the original `EinpageError` (a checkpoint that fails to read), `ExecutionError`
naming the queue and node for anything else, `Interrupted` for Ctrl-C. Never a hang: a worker
blocks only on a node that either its producer records or the abort releases, and between
passes on its next job, which `close` sends.

A program of one rank of several runs its sends and recvs on queues of their own through the
session's `comm` (`einpage.runtime.comm.Communicator`): a recv fills its box of the input's host
buffer (the session holds one per received input, across passes), which the input's reloads then
read; a send reads its block as an output is read. A failure on any queue also aborts `comm`, so
that the peers stop too; a failure a peer reports raises here as its `CommError`.
"""
from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass
from queue import Empty, SimpleQueue
from typing import Any, Mapping, NamedTuple

import numpy as np

from einpage.errors import EinpageError, ExecutionError, Interrupted
from einpage.ir.memgraph import InputNode, MemGraph, MemNode, RecvNode, ReloadNode, SendNode
from einpage.ir.tensors import WeightSource
from einpage.ir.validator import checked
from einpage.runtime.backends.base import Backend
from einpage.runtime.measured import Measured, Span
from einpage.runtime.planio import PlanIO, received_inputs
from einpage.ir.quant import quantize
from einpage.runtime.streams import QUEUES, StreamProgram, compile_streams, queues_of

#: the queues whose nodes move a tensor's bytes (the others compute)
_COPIES = ("h2d", "h2d_host", "d2h", "disk")

#: how often a blocked caller looks up from waiting on the workers (Ctrl-C is seen between looks)
_POLL_S = 0.05


@dataclass(frozen=True)
class StreamRun:
    outputs: dict[str, np.ndarray]
    measured: Measured


def run_streams(mg: MemGraph, inputs: Mapping[str, np.ndarray] | None = None,
                weights: WeightSource | None = None, backend: Backend | str = "threads",
                program: StreamProgram | None = None, timing: bool = True,
                check: bool = True, comm=None) -> StreamRun:
    """Execute `mg` once on `backend` (a `Backend` or a registered name) and return its outputs
    by name with the measured pass. `timing` off spares the CUDA backend two events per node."""
    with StreamSession(mg, weights, backend, program, timing, check=check,
                       comm=comm) as session:
        return session.run(inputs or {})


class StreamSession:
    """`mg` held open on `backend` for many passes (see the module docstring): `run(inputs)` per
    pass, `write(name, lead, values)` between passes, `close()` (or a `with` block) at the end:
    it joins the worker threads, then closes the backend. Any error closes the session (memory
    released) before it reaches the caller. A session dropped without `close` ends its threads
    when it is collected. With `graphs` (the default) and a backend that can
    (`Backend.can_capture`: CUDA graphs on cupy), the second pass is captured and every pass
    from then on is one replay of it: one launch, no Python per node. `timing` times every node
    of the passes the workers issue (the first, or all of them without graphs); the pass that is
    captured (issued under capture, then launched: `Measured.captured`) and every replay
    (`Measured.replayed`) are timed as a whole (their wall; no spans), so `--timing` measures
    the passes a run without it would run. The plan is validated first
    (`einpage.ir.validator.checked`), unless `check` is off (see `NumpyExecutor.run`)."""

    def __init__(self, mg: MemGraph, weights: WeightSource | None = None,
                 backend: Backend | str = "threads", program: StreamProgram | None = None,
                 timing: bool = True, graphs: bool = True, check: bool = True, comm=None):
        if check:
            checked(mg)
        self.comm = comm
        self.received = received_inputs(mg)
        if mg.world > 1 and comm is None:
            raise ExecutionError(f"rank {mg.rank} of {mg.world}: a program of several ranks "
                                 "runs with a communicator (einpage run starts them)")
        if isinstance(backend, str):
            from einpage.runtime.backends import make_backend
            backend = make_backend(backend)
        if mg.world > 1 and not backend.peers:
            raise ExecutionError(f"the {backend.name} backend does not run the sends and recvs "
                                 "of a plan for several devices yet; use --backend threads")
        self.mg, self.weights, self.backend, self.timing = mg, weights, backend, timing
        self.program = program if program is not None else compile_streams(mg, preload=True)
        self.io: PlanIO | None = None
        self.closed = False
        self.passes = 0
        self._blocks = _store_blocks(mg)
        self._crew: _Crew | None = None
        self.graphs = graphs
        self.replays = 0      # passes run as one replay of the captured pass
        self._captured = False

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
            inputs = {**inputs, **self.received} if self.received else inputs
            if self.io is None:
                self.io = PlanIO(self.mg, inputs, self.weights)
                self.backend.open(self.mg, self.io)
                self._crew = _Crew(self.mg, self.program, self.backend, self.comm,
                                   self.received)
                weakref.finalize(self, self._crew.dismiss)  # dropped without `close`: threads end
                self._crew.start()
                load_s = self._preload()
            else:
                self.io.set_inputs(inputs)
                self.backend.begin_pass()
            result = self._pass(load_s)
            self.passes += 1
            return result
        except KeyboardInterrupt:
            self._close_after_error(abort=True)
            raise Interrupted("interrupted: every queue stopped, memory released") from None
        except BaseException:
            self._close_after_error()
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
            t = self.mg.tensors[tid]
            try:
                part = (quantize(part, t.storage) if t.storage is not None
                        else np.ascontiguousarray(part, dtype=t.dtype.numpy))
                self.backend.write_input(tid, offset, local, part)
            except BaseException:
                self._close_after_error()
                raise

    def close(self) -> None:
        """Join the worker threads (each leaves its queue context on its own thread), then close
        the backend. Idempotent. Raises `ExecutionError`, once everything is released, if a
        queue's context failed to exit."""
        if self.closed:
            return
        self.closed = True
        try:
            if self._crew is not None:
                self._crew.stop()
        finally:
            self.backend.close()

    def _close_after_error(self, abort: bool = False) -> None:
        """Close while an error propagates (that error is the one the caller gets); `abort` first
        stops the workers before their next step (Ctrl-C: they may be mid-pass)."""
        if abort and self._crew is not None:
            self._crew.abort()
        try:
            self.close()
        except ExecutionError:
            pass

    # ------------------------------------------------------------------ the two phases
    def _preload(self) -> float:
        """Load the resident blocks (once per session); returns the seconds it took."""
        t0 = time.perf_counter()
        self._crew.preload()
        self._finish()
        return time.perf_counter() - t0

    def _pass(self, load_s: float | None) -> StreamRun:
        """One pass; `load_s` the preload's seconds when this is the session's first pass."""
        mg, backend = self.mg, self.backend
        replay = self._captured or (self.graphs and self.passes >= 1 and backend.can_capture())
        capturing = replay and not self._captured  # issued under capture, then launched
        timed = self.timing and not replay
        origin = backend.stamp("compute") if timed else None
        t0 = time.perf_counter()
        if replay:
            self._replay()
            stamps = None
        else:
            stamps = self._crew.run(timed)
        self._finish()
        wall = time.perf_counter() - t0
        spans = _spans(mg, backend, origin, stamps, self._crew.skipped) if timed else ()
        load_bytes = (sum(mg.tensors[mg.nodes[i].tensor].bytes for i in self.program.preloaded)
                      if load_s is not None else 0)
        outputs = self.io.results(backend.output)
        compile_s = getattr(backend, "compile_s", 0.0) if load_s is not None else 0.0
        return StreamRun(outputs, Measured(backend.name, wall, load_s or 0.0, load_bytes, spans,
                                           compile_s, replayed=replay and not capturing,
                                           captured=capturing))

    def _replay(self) -> None:
        """The pass as one replay of the captured one (captured first, on the workers, where
        it was not yet)."""
        if not self._captured:
            self.backend.begin_capture()
            try:
                self._crew.run(False)
            except BaseException:
                self.backend.end_capture(failed=True)
                raise
            self.backend.end_capture()
            self._captured = True
        self.backend.replay()
        self.replays += 1

    def _finish(self) -> None:
        try:
            self.backend.finish()
        except EinpageError:
            raise
        except Exception as exc:
            raise ExecutionError(f"{self.backend.name}: {type(exc).__name__}: {exc}") from exc


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


def _spans(mg: MemGraph, backend: Backend, origin: Any,
           stamps: dict[str, list[tuple[int, Any, Any]]],
           skipped: set[int] = frozenset()) -> tuple[Span, ...]:
    """Every timed node of a pass, from its queue's stamps, in order of start (a guarded reload
    `skipped` moved no byte). Time zero is the origin stamped on the compute queue, or the
    earliest start before it: the queues are not ordered after the origin, so a copy queue may
    begin a hair earlier."""
    spans = []
    for q, marks in stamps.items():
        for nid, a, b in marks:
            nbytes = (mg.tensors[mg.nodes[nid].tensor].bytes
                      if q in _COPIES and nid not in skipped else 0)
            spans.append(Span(nid, q, backend.seconds(origin, a), backend.seconds(origin, b),
                              nbytes))
    early = min((s.start for s in spans), default=0.0)
    if early < 0:
        spans = [Span(s.node, s.queue, s.start - early, s.end - early, s.nbytes) for s in spans]
    return tuple(sorted(spans, key=lambda s: (s.start, s.node)))


class _Step(NamedTuple):
    """A step as its queue's worker runs it (made once per session; a tuple, unpacked in the hot
    loop)."""
    node: MemNode
    waits: tuple[tuple[int, int], ...]  # (producer worker, node) for each node it waits on
    records: bool                       # whether it records an event (someone waits on it)


class _Board:
    """Within a pass, the latest node each worker has recorded (its queue records in plan order,
    so a node is recorded once its queue's latest is at or past it). A worker that needs a node
    not yet recorded sleeps on its own condition, woken only when that node is recorded (or the
    pass is aborted): no thread is woken for nothing."""

    def __init__(self, workers: int):
        self.lock = threading.Lock()
        self.wakeups = [threading.Condition(self.lock) for _ in range(workers)]
        self.last = [-1] * workers  # read without the lock: a stale value only means a sleep
        self.wants: list[tuple[int, int] | None] = [None] * workers  # (producer, node) awaited
        self.sleeping = 0
        self.aborted = False

    def reset(self) -> None:
        """Before a pass (no worker is running): nothing recorded."""
        self.last[:] = [-1] * len(self.last)

    def publish(self, producer: int, node: int) -> None:
        """`producer` recorded `node`: wake the workers sleeping for it (once each)."""
        with self.lock:
            self.last[producer] = node
            if self.sleeping:
                for k, want in enumerate(self.wants):
                    if want is not None:
                        awaited_producer, awaited = want
                        if awaited_producer == producer and awaited <= node:
                            self._wake(k)

    def sleep_until(self, worker: int, producer: int, node: int) -> None:
        """Block `worker` until `producer` has recorded `node`, or the pass is aborted."""
        with self.lock:
            if self.last[producer] >= node:
                return  # recorded since the worker looked
            self.wants[worker] = (producer, node)
            self.sleeping += 1
            while self.wants[worker] is not None and not self.aborted:
                self.wakeups[worker].wait()
            if self.wants[worker] is not None:  # aborted: no one else clears it
                self._forget(worker)

    def _wake(self, worker: int) -> None:
        self._forget(worker)
        self.wakeups[worker].notify()

    def _forget(self, worker: int) -> None:
        """(Holding the lock.) `worker` no longer sleeps for a node."""
        self.wants[worker] = None
        self.sleeping -= 1

    def abort(self) -> None:
        with self.lock:
            self.aborted = True
            for wakeup in self.wakeups:
                wakeup.notify_all()


class _Crew:
    """The worker threads of a session, one per queue with work, each inside its queue context
    from `start` to `stop`; between passes a worker sleeps on its job box. `preload` and `run`
    hand out jobs and return when every worker is done, raising the first failure."""

    def __init__(self, mg: MemGraph, program: StreamProgram, backend: Backend, comm=None,
                 received: Mapping[str, np.ndarray] | None = None):
        self.backend, self.comm = backend, comm
        self.queues = tuple(q for q in QUEUES if any(s.queue == q for s in program.steps)
                            or (q == "h2d" and program.preloaded))
        self.steps = _queue_steps(mg, program, self.queues)
        #: the guarded reloads skipped this pass (their guard was off: no byte moved)
        self.skipped: set[int] = set()
        if any(isinstance(n, ReloadNode) and n.guard is not None for n in mg.nodes):
            def copy_h2d(n, copy=backend.copy_h2d, on=backend.guard_on, skipped=self.skipped):
                if isinstance(n, ReloadNode) and n.guard is not None and not on(n):
                    skipped.add(n.id)
                else:
                    copy(n)
        else:
            copy_h2d = backend.copy_h2d
        def send(n: SendNode) -> None:
            backend.send(n, comm)

        def recv(n: RecvNode) -> None:
            backend.recv(n, comm, received[n.input])

        issue = {"compute": backend.run, "h2d": copy_h2d, "h2d_host": copy_h2d,
                 "d2h": backend.copy_d2h,
                 "disk": backend.read_disk, "host": backend.run_host, "send": send,
                 "recv": recv}
        self.issue = tuple(issue[q] for q in self.queues)
        self.preloaded = tuple(_Step(mg.nodes[n], (), False) for n in program.preloaded)
        self.board = _Board(len(self.queues))
        self.jobs: list[SimpleQueue] = [SimpleQueue() for _ in self.queues]
        self.done: SimpleQueue = SimpleQueue()
        self.threads: list[threading.Thread] = []
        self.lock = threading.Lock()
        self.failure: tuple[str, str, BaseException] | None = None  # (queue, where, error)
        self.left_badly: tuple[str, BaseException] | None = None  # a context that failed to exit

    # ------------------------------------------------------------------ the caller's side
    def start(self) -> None:
        """Start the workers; return once each has entered its queue context."""
        for k, q in enumerate(self.queues):
            self.threads.append(threading.Thread(target=self._serve, args=(k,),
                                                 name=f"einpage-{q}", daemon=True))
            self.threads[-1].start()
        self._collect(len(self.threads))

    def preload(self) -> None:
        """The preloaded nodes on the h2d worker."""
        if self.preloaded:
            self.jobs[self.queues.index("h2d")].put((self.preloaded, None))
            self._collect(1)

    def run(self, timing: bool) -> dict[str, list[tuple[int, Any, Any]]]:
        """One pass; with `timing`, each queue's (node, stamp before, stamp after)."""
        self.board.reset()
        self.skipped.clear()
        stamps = {q: [] for q in self.queues}
        busy = [k for k, steps in enumerate(self.steps) if steps]  # h2d may only preload
        for k in busy:
            self.jobs[k].put((self.steps[k], stamps[self.queues[k]] if timing else None))
        self._collect(len(busy))
        return stamps

    def abort(self) -> None:
        """Stop every worker before its next step (from any thread); the peers too."""
        self.board.abort()
        self.backend.abort()
        if self.comm is not None:
            failure = self.failure
            self.comm.abort(f"{failure[0]} queue failed at {failure[1]}: "
                            f"{type(failure[2]).__name__}: {failure[2]}" if failure
                            else "interrupted")

    def dismiss(self) -> None:
        """Tell every worker to end once its job is done (without waiting for it; a worker that
        has ended already ignores it)."""
        for box in self.jobs:
            box.put(None)

    def stop(self) -> None:
        """End the workers: each finishes its job, leaves its queue context and exits; then
        raise `ExecutionError` if a context failed to exit."""
        self.dismiss()
        for t in self.threads:
            t.join()
        if self.left_badly is not None:
            queue, exc = self.left_badly
            raise ExecutionError(f"{queue} queue failed to leave its context: "
                                 f"{type(exc).__name__}: {exc}") from exc

    def _collect(self, jobs: int) -> None:
        """Wait for `jobs` workers to report done (looking up for Ctrl-C, which propagates),
        then raise the first failure: the original `EinpageError`, else `ExecutionError`."""
        for _ in range(jobs):
            while True:
                try:
                    self.done.get(timeout=_POLL_S)
                    break
                except Empty:
                    continue
        if self.failure is not None:
            queue, where, exc = self.failure
            if isinstance(exc, EinpageError):
                raise exc
            raise ExecutionError(f"{queue} queue failed at {where}: {type(exc).__name__}: "
                                 f"{exc}") from exc

    # ------------------------------------------------------------------ the workers' side
    def _serve(self, k: int) -> None:
        """Worker `k`'s thread: inside its queue context, run jobs until told to stop (None)."""
        queue, entered = self.queues[k], False
        try:
            with self.backend.queue_context(queue):
                entered = True
                self.done.put(None)
                while (job := self.jobs[k].get()) is not None:
                    try:
                        self._work(k, *job)
                    finally:
                        self.done.put(None)
        except BaseException as exc:  # noqa: BLE001 - entering or leaving the queue's context
            if entered:
                with self.lock:
                    self.left_badly = self.left_badly or (queue, exc)
            else:
                self._fail(queue, "start", exc)
                self.done.put(None)

    def _work(self, k: int, steps: tuple[_Step, ...], stamps: list | None) -> None:
        """Issue `steps` on worker `k`'s queue (the hot loop: one pass of one queue)."""
        queue, backend, board, issue = self.queues[k], self.backend, self.board, self.issue[k]
        last = board.last
        node = None
        try:
            for node, waits, records in steps:
                for producer, w in waits:
                    if last[producer] < w:
                        board.sleep_until(k, producer, w)
                    if board.aborted:
                        return
                    backend.wait(queue, w)
                if board.aborted:
                    return
                if stamps is None:
                    issue(node)
                else:
                    before = backend.stamp(queue)
                    issue(node)
                    stamps.append((node.id, before, backend.stamp(queue)))
                if records:
                    backend.record(queue, node.id)
                    board.publish(k, node.id)
        except BaseException as exc:  # noqa: BLE001 - every error stops every queue
            where = f"node %{node.id} ({node.kind})" if node is not None else "start"
            self._fail(queue, where, exc)

    def _fail(self, queue: str, where: str, exc: BaseException) -> None:
        with self.lock:
            if self.failure is None:
                self.failure = (queue, where, exc)
        self.abort()


def _queue_steps(mg: MemGraph, program: StreamProgram,
                 queues: tuple[str, ...]) -> tuple[tuple[_Step, ...], ...]:
    """Each queue's steps, in plan order, as its worker runs them."""
    worker = {q: k for k, q in enumerate(queues)}
    queue_of_node = queues_of(mg)
    out: list[list[_Step]] = [[] for _ in queues]
    for s in program.steps:
        waits = tuple((worker[queue_of_node[w]], w) for w in s.waits)
        out[worker[s.queue]].append(_Step(mg.nodes[s.node], waits, s.node in program.events))
    return tuple(tuple(steps) for steps in out)
