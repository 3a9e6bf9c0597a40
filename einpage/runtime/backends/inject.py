"""Backends that wrap another to test the stream executor: seeded random delays per queue (the
plan's edges must be the only ordering there is) and a failure injected at the k-th node of one
queue (every queue must stop, memory must be released, the caller must get one typed error)."""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Any, ContextManager, Iterator

import numpy as np

from einpage.ir.memgraph import MemGraph, OutputRef
from einpage.runtime.backends.base import Backend
from einpage.runtime.planio import PlanIO
from einpage.runtime.streams import QUEUES


class Wrapped(Backend):
    """Delegates every call to `inner`; subclasses hook `_before(queue)`."""

    def __init__(self, inner: Backend):
        self.inner = inner
        self.name = inner.name
        self.peers = inner.peers
        self._local = threading.local()  # per worker: its queue (two queues copy h2d)

    def _before(self, queue: str) -> None:
        pass

    def open(self, mg: MemGraph, io: PlanIO) -> None:
        self.inner.open(mg, io)

    def queue_context(self, queue: str) -> ContextManager:
        return self._queue_context(queue)

    @contextmanager
    def _queue_context(self, queue: str) -> Iterator[None]:
        self._local.queue = queue
        with self.inner.queue_context(queue):
            yield

    def copy_h2d(self, n) -> None:
        self._before(getattr(self._local, "queue", "h2d"))
        self.inner.copy_h2d(n)

    def guard_on(self, n) -> bool:
        return self.inner.guard_on(n)

    def copy_d2h(self, n) -> None:
        self._before("d2h")
        self.inner.copy_d2h(n)

    def read_disk(self, n) -> None:
        self._before("disk")
        self.inner.read_disk(n)

    def run(self, n) -> None:
        self._before("compute")
        self.inner.run(n)

    def run_host(self, n) -> None:
        self._before("host")
        self.inner.run_host(n)

    def send(self, n, comm) -> None:
        self._before("send")
        self.inner.send(n, comm)

    def recv(self, n, comm, whole) -> None:
        self._before("recv")
        self.inner.recv(n, comm, whole)

    def record(self, queue: str, node: int) -> None:
        self.inner.record(queue, node)

    def wait(self, queue: str, node: int) -> None:
        self.inner.wait(queue, node)

    def stamp(self, queue: str) -> Any:
        return self.inner.stamp(queue)

    def seconds(self, start: Any, end: Any) -> float:
        return self.inner.seconds(start, end)

    def finish(self) -> None:
        self.inner.finish()

    def output(self, ref: OutputRef) -> np.ndarray:
        return self.inner.output(ref)

    def begin_pass(self) -> None:
        self.inner.begin_pass()

    def write_input(self, tid, offset, lead, values) -> None:
        self.inner.write_input(tid, offset, lead, values)

    def close(self) -> None:
        self.inner.close()

    def abort(self) -> None:
        self.inner.abort()


class Delayed(Wrapped):
    """Sleeps a random time in [0, max_delay_s) before every node, drawn per queue from
    `default_rng([seed, queue index])`: the same seed gives each queue the same delays."""

    def __init__(self, inner: Backend, seed: int, max_delay_s: float = 1e-3):
        super().__init__(inner)
        self.max_delay_s = max_delay_s
        self.rngs = {q: np.random.default_rng([seed, k])
                     for k, q in enumerate(QUEUES)}

    def _before(self, queue: str) -> None:
        time.sleep(float(self.rngs[queue].random()) * self.max_delay_s)


class InjectedFault(RuntimeError):
    """The failure `Faulty` raises."""


class Faulty(Wrapped):
    """Raises `error` (default `InjectedFault`) before the `at`-th node (0-based) issued on
    `queue`, counting preloaded nodes on h2d."""

    def __init__(self, inner: Backend, queue: str, at: int = 0,
                 error: BaseException | None = None):
        super().__init__(inner)
        self.queue, self.at = queue, at
        self.error = error if error is not None else InjectedFault(f"injected fault on {queue}")
        self.count = 0

    def _before(self, queue: str) -> None:
        if queue == self.queue:
            self.count += 1
            if self.count > self.at:
                raise self.error
