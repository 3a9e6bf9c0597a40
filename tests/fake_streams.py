"""The device-side model of the CuPy stand-in (`fake_cupy`): CUDA's and cuBLAS's error types as
CuPy raises them, a stream's work queue (`_Queue`: run later, in order, by a worker thread of its
own after seeded random delays, so only events order streams), and stream capture (`_Capture`:
what streams issue while capturing, with CUDA's rule that every joined stream joins back;
`_Graph`: its replay, the origin's work on the launching stream and each other stream's on a
branch queue of its own)."""
from __future__ import annotations

import random
import threading
import time
import weakref


class CUDARuntimeError(RuntimeError):
    """`cupy.cuda.runtime.CUDARuntimeError`: `status`, and CuPy's message form."""

    def __init__(self, name: str, message: str):
        self.status = name
        super().__init__(f"{name}: {message}")


class CUBLASError(RuntimeError):
    """`cupy_backends.cuda.libs.cublas.CUBLASError`."""

    def __init__(self, name: str, message: str = ""):
        self.status = name
        super().__init__(f"{name}{': ' + message if message else ''}")


class _Queue:
    """One stream's work: a FIFO of callables run by its own worker thread, each after a seeded
    random delay, so that only events order the streams (as on a device)."""

    def __init__(self, fake, rng):
        self.fake, self.rng = fake, rng
        self.items: list = []
        self.cond = threading.Condition()
        self.issued = self.completed = 0
        self.stopped = False
        self.thread = threading.Thread(target=self._work, daemon=True, name="fake-cupy-stream")
        self.thread.start()

    def put(self, fn, work: bool = True) -> int:
        """Queue `fn`; `work` False for markers (event records, waits), which take no time."""
        with self.cond:
            self.items.append((fn, work))
            self.issued += 1
            self.cond.notify_all()
            return self.issued

    def _work(self) -> None:
        while True:
            with self.cond:
                while not self.items and not self.stopped:
                    self.cond.wait()
                if self.stopped and not self.items:
                    return
                fn, work = self.items.pop(0)
            delay = self.fake.max_delay
            if work and delay and self.rng.random() < 0.5:
                time.sleep(self.rng.random() * delay)
            try:
                if self.fake.sticky is None:
                    fn()
            except CUDARuntimeError as exc:  # a device fault: every later call fails
                self.fake.sticky = exc
            except BaseException as exc:  # noqa: BLE001 - reported at the next synchronize
                self.fake.sticky = CUDARuntimeError("cudaErrorLaunchFailure",
                                                    f"{type(exc).__name__}: {exc}")
            with self.cond:
                self.completed += 1
                self.cond.notify_all()

    def wait_for(self, ticket: int) -> None:
        with self.cond:
            while self.completed < ticket:
                self.cond.wait()

    def drain(self) -> None:
        with self.cond:
            ticket = self.issued
        self.wait_for(ticket)

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()


class _Capture:
    """What streams issued while capturing a CUDA graph: per stream, in order, its work
    (`("op", fn, work)`), the events recorded on it (`("record", token)`) and the captured
    events it waits on (`("wait", token)`). `origin` began the capture; a stream joins by
    waiting on a captured event."""

    def __init__(self, origin):
        self.origin = origin
        self.ops = {origin: []}
        self.tokens: list = []      # token -> the stream that recorded it

    def check_joined(self) -> None:
        """CUDA's rule at `end_capture`: every stream that joined has joined back into the
        origin (the origin waits on an event recorded after its last work)."""
        waited = {op[1] for op in self.ops[self.origin] if op[0] == "wait"}
        for stream, ops in self.ops.items():
            if stream is self.origin:
                continue
            last = [op for op in ops if op[0] != "wait"]
            if last and not (last[-1][0] == "record" and last[-1][1] in waited):
                raise CUDARuntimeError("cudaErrorStreamCaptureUnjoined",
                                       "a stream's captured work is not joined into the origin")


class _Graph:
    """`cupy.cuda.graph.Graph`: `launch(stream)` replays the captured work, the origin's on
    `stream` and every other stream's on a branch queue of its own, the captured events
    ordering them, after what `stream` issued before."""

    def __init__(self, fake, capture: _Capture):
        self.fake, self.capture = fake, capture
        self.branches = {s: _Queue(fake, random.Random(fake.seed * 7919 + k))
                         for k, s in enumerate(capture.ops) if s is not capture.origin}
        for queue in self.branches.values():
            fake.queues.add(queue)
            weakref.finalize(self, queue.stop)
        self.launches = 0

    def launch(self, stream=None):
        fake = self.fake
        stream = fake._stream(stream)
        start = (stream.queue, stream.queue.put(lambda: None, work=False))
        queues = {s: q for s, q in self.branches.items()}
        queues[self.capture.origin] = stream.queue
        for s, queue in queues.items():
            if s is not self.capture.origin:
                queue.put(lambda: start[0].wait_for(start[1]), work=False)
        tickets: dict[int, tuple] = {}
        cursors = {s: 0 for s in queues}
        while any(cursors[s] < len(self.capture.ops[s]) for s in queues):
            progressed = False
            for s, queue in queues.items():
                ops = self.capture.ops[s]
                while cursors[s] < len(ops):
                    op = ops[cursors[s]]
                    if op[0] == "wait":
                        if op[1] not in tickets:
                            break
                        target = tickets[op[1]]
                        queue.put(lambda t=target: t[0].wait_for(t[1]), work=False)
                    elif op[0] == "record":
                        tickets[op[1]] = (queue, queue.put(lambda: None, work=False))
                    else:
                        queue.put(op[1], op[2])
                    cursors[s] += 1
                    progressed = True
            assert progressed, "the captured graph waits in a cycle"
        self.launches += 1
