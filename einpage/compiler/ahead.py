"""Lowerings started ahead of need, in forked processes, while the search waits for the one
it needs now.

The room searches (`search.climb`, and the tiered climb `tier_room.climb_tiered`) probe one
point at a time, and each probe is a lowering and a simulation (and a tiering), seconds on a
large graph: the climb cannot know the next point before the last one is weighed, but it knows
the points it will probe if each probe improves (the next on its way, and at its start both
neighbours). Those, the one it needs now first, are lowered in child processes (up to `jobs`
at once) forked then (`os.fork`: each starts with the parent's taskgraph, order and options as
they are, copied only where either side writes); a child sends back the trial's figures
(`search.Trial` without its plan: a few hundred bytes), and the parent takes them when the climb
reaches that point, in the order the serial search would have lowered them, so the plans chosen
are the same whatever `jobs` is. The children of points the climb no longer heads for are
killed (`Speculation.want`), and so are those left when it ends. A trial taken from a child has
no plan: its `Trials` lowers it again (the same plan, by the same options) only where its plan
is asked for (`Trials.best_plan`), and the tiered climb likewise its winner.

Only where it pays and is safe: on Linux (fork is cheap and, in a process with one thread,
safe), with no other thread running (a fork copies locks other threads hold), and for graphs of
at least `MIN_TASKS` tasks (below that a lowering takes less than the fork and the copies it
makes). A child that fails for any reason (an error, a signal, a broken pipe) is as if never
started: the parent lowers that point itself.
"""
from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
from contextlib import contextmanager
from typing import Callable, Hashable, Iterator

#: Graphs of fewer tasks are never lowered ahead (a lowering of 1,000 tasks takes ~30 ms)
MIN_TASKS = 1000
#: `jobs` = "auto": this many lowerings at once at most
AUTO_JOBS = 4

#: What `take` returns where no child computed the key (or it failed)
MISSING = object()


def auto_jobs() -> int:
    """Lowerings at once for `--jobs auto`: the CPUs this process may use, at most AUTO_JOBS."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(AUTO_JOBS, cpus))


class _Child:
    __slots__ = ("pid", "fd")

    def __init__(self, pid: int, fd: int):
        self.pid, self.fd = pid, fd

    def result(self) -> object:
        """What the child computed (waiting for it), or MISSING where it failed."""
        chunks = []
        try:
            while True:
                chunk = os.read(self.fd, 1 << 20)
                if not chunk:
                    break
                chunks.append(chunk)
        finally:
            os.close(self.fd)
            _, status = os.waitpid(self.pid, 0)
        if status != 0 or not chunks:
            return MISSING
        try:
            ok, value = pickle.loads(b"".join(chunks))
        except Exception:  # (a truncated message: the child died writing it)
            return MISSING
        return value if ok else MISSING

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.close(self.fd)
        os.waitpid(self.pid, 0)


class Ahead:
    """Up to `jobs` children lowering, keyed by what they compute (the parent waits)."""

    def __init__(self, jobs: int):
        self.jobs = jobs
        self._running: dict[Hashable, _Child] = {}

    def start(self, key: Hashable, work: Callable[[], object]) -> None:
        """Compute `work()` in a child for `key`, where a child is free and `key` is not under
        way. `work` must not raise for any reason the parent needs to see: a child's failure
        is reported as none (`take` returns nothing)."""
        if key in self._running or len(self._running) >= self.jobs:
            return
        read, write = os.pipe()
        sys.stdout.flush()  # (a child exits without flushing: nothing buffered twice)
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: compute, send, exit without the parent's cleanup
            code = 1
            try:
                os.close(read)
                try:
                    message = pickle.dumps((True, work()), pickle.HIGHEST_PROTOCOL)
                except BaseException:
                    message = pickle.dumps((False, None))
                with os.fdopen(write, "wb") as out:
                    out.write(message)
                code = 0
            finally:
                os._exit(code)
        os.close(write)
        self._running[key] = _Child(pid, read)

    def running(self, key: Hashable) -> bool:
        """Whether a child computes `key` (started, not yet taken)."""
        return key in self._running

    def cancel(self, which: Callable[[Hashable], bool]) -> None:
        """Kill the children of the keys `which` selects (their results no longer wanted)."""
        for key in [k for k in self._running if which(k)]:
            self._running.pop(key).kill()

    def take(self, key: Hashable) -> object:
        """The result of `key`'s child (waiting for it), or `MISSING` where none was started
        or it failed."""
        child = self._running.pop(key, None)
        return MISSING if child is None else child.result()

    def close(self) -> None:
        """Kill the children whose results were never taken."""
        for child in self._running.values():
            child.kill()
        self._running.clear()


_active: Ahead | None = None


def active(tasks: int) -> Ahead | None:
    """The lowering-ahead under way (`lowering_ahead`), where a graph of `tasks` tasks is
    worth it and no other thread runs now; else None."""
    if _active is None or tasks < MIN_TASKS or threading.active_count() > 1:
        return None
    return _active


class Speculation:
    """One search's lowerings ahead (none where `active` gives none): the children it started,
    by key."""

    def __init__(self, tasks: int):
        self.runner = active(tasks)

    def want(self, work: list[tuple[Hashable, Callable[[], object]]]) -> None:
        """The keys the search asks for next and may ask for after, the likeliest first, each
        with what computes it: started where a child is free; this search's children of keys
        not named stopped (no longer on its way)."""
        if self.runner is None:
            return
        wanted = {(id(self), key) for key, _ in work}
        self.runner.cancel(lambda k: k not in wanted and self._mine(k))
        for key, compute in work:
            self.runner.start((id(self), key), compute)

    def take(self, key: Hashable) -> object:
        """`key`'s result from its child (waiting for it), or MISSING (`taken`: none started,
        or it failed)."""
        if self.runner is None:
            return MISSING
        return self.runner.take((id(self), key))

    def stop(self) -> None:
        """Stop this search's children."""
        if self.runner is not None:
            self.runner.cancel(self._mine)

    def _mine(self, child_key: Hashable) -> bool:
        return isinstance(child_key, tuple) and child_key[0] == id(self)


@contextmanager
def lowering_ahead(jobs: int) -> Iterator[None]:
    """Lowerings ahead, `jobs` at once, within the block (none where `jobs` is 1, fork is not
    Linux's, or one is under way already: the outer one serves)."""
    global _active
    if jobs <= 1 or _active is not None or not sys.platform.startswith("linux"):
        yield
        return
    _active = Ahead(jobs)
    try:
        yield
    finally:
        ahead, _active = _active, None
        ahead.close()


def taken(value: object) -> bool:
    """Whether `take` returned a result."""
    return value is not MISSING
