"""Point-to-point messages between the ranks of a multi-device (pipeline-parallel) plan.

A plan split over devices has `send` nodes (a device block's bytes to a peer rank, with an
integer tag) and `recv` nodes (bytes from a peer into a buffer); every rank runs its own program
and calls a `Communicator`. The contract is small on purpose, so that the same runtime runs on
threads of one process (`LocalCommunicator`, for tests and the in-process multi-rank executor) and
on processes started by `mpiexec` (`MpiCommunicator`):

* `send` never waits for the receiver: it keeps a private copy of the bytes, so a rank can send
  a block and free it at once, and two ranks that send to each other before receiving do not
  deadlock.
* `recv` compares bytes, not dtypes or shapes: the plan fixed both ends' layouts, so a byte
  count that differs from the buffer's is a plan bug and an error, never a silent reshape.
  Messages of one (sender, receiver, tag) arrive in send order; different tags are independent.
* Nothing waits forever. A `recv` or `barrier` gives up after `timeout` seconds with a
  `CommError` that names the ranks and the tag, and a rank that fails calls `abort(cause)`,
  which makes every other rank's pending and later calls raise `CommError("rank R failed:
  cause")` within a bounded time instead of hanging on a peer that will never send.

Tags are integers in `[0, MAX_TAG)`; `ABORT_TAG` (2**20 + 1) is reserved for abort messages on
MPI. mpi4py is imported only when an `MpiCommunicator` is made (or `mpi_world` finds a launcher),
so this module imports without it.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from einpage.errors import EinpageError

#: Seconds a `recv` or `barrier` waits when not told otherwise: a last resort against a bug (a
#: rank that fails aborts the others at once); a rank's recv waits for every rank before it,
#: first compiles and disk-tier passes included, so it is generous.
DEFAULT_TIMEOUT = 600.0
#: User tags lie in [0, MAX_TAG); MPI guarantees only 32767, MPICH gives 2**29 - 1 (checked).
MAX_TAG = 2 ** 20
#: The reserved MPI tag of abort messages: the failing rank's cause as UTF-8 bytes.
ABORT_TAG = MAX_TAG + 1
#: Polling of MPI requests: the first sleep and the cap of its doubling. The cap bounds both the
#: latency a long wait adds and how late an abort is seen; 2 ms costs little CPU while waiting.
_POLL_FIRST = 50e-6
_POLL_CAP = 2e-3
#: How long `MpiCommunicator.close` after an abort waits for the abort messages to leave.
_ABORT_FLUSH = 1.0
#: Environment variables one of which every common MPI launcher sets (MPICH's hydra, Open MPI,
#: PMIx, MVAPICH); without any of them `mpi_world` does not start MPI (see there).
_LAUNCHER_VARS = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE",
                  "MPI_LOCALNRANKS", "MV2_COMM_WORLD_SIZE")

_MPI_MISSING = "MPI needs mpi4py: pip install 'einpage[mpi]'"


class CommError(EinpageError):
    """A message that could not be exchanged: a peer that failed (aborted), a message that did
    not come in time, a size that disagrees with the buffer, a closed communicator. `rank` is the
    rank at fault (the failed rank, the silent or wrong-sized sender), or None when unknown."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank


@dataclass(frozen=True)
class Failure:
    """The first failure a rank learned of: which rank aborted, and why (one line)."""
    rank: int
    cause: str

    def error(self) -> CommError:
        return CommError(f"rank {self.rank} failed: {self.cause}", self.rank)


def _one_line(cause: str) -> str:
    """A cause as one line (errors are printed as a single line on stderr)."""
    return " ".join(str(cause).split()) or "aborted"


def _byte_view(out: np.ndarray) -> np.ndarray:
    """`out`'s bytes as a flat writable uint8 view: a receive fills it whatever the dtype."""
    if not isinstance(out, np.ndarray):
        raise TypeError(f"recv needs a numpy array to fill, got {type(out).__name__}")
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError("recv needs a C-contiguous, writable array to fill")
    return out.reshape(-1).view(np.uint8)


def _payload(data: Any) -> bytes:
    """A private copy of `data`'s bytes in C order: the sender may reuse its buffer at once."""
    return np.asarray(data).tobytes()


class Communicator:
    """One rank's end of a group of `world` ranks (see the module's docstring for the contract).

    A context manager: leaving the block closes it. Subclasses implement `send`, `recv`,
    `abort`, `barrier` and `close`."""

    rank: int
    world: int
    timeout: float

    def send(self, data: np.ndarray, peer: int, tag: int) -> None:
        """Queue a copy of `data`'s bytes to `peer` under `tag`; returns without waiting for the
        receiver. Raises `CommError` once the group was aborted."""
        raise NotImplementedError

    def recv(self, out: np.ndarray, peer: int, tag: int, timeout: float | None = None) -> None:
        """Fill `out` (C-contiguous, writable, any dtype) with the next message of `peer` under
        `tag`. Raises `CommError` when its byte count is not `out.nbytes`, when none comes in
        `timeout` seconds (default `self.timeout`), or when a rank aborts meanwhile."""
        raise NotImplementedError

    def abort(self, cause: str) -> None:
        """This rank failed: make every rank's pending and later calls raise `CommError("rank
        R failed: cause")`. Never blocks; the caller stops (exits) afterwards."""
        raise NotImplementedError

    def barrier(self, timeout: float | None = None) -> None:
        """Wait until every rank reached the barrier (at most `timeout`, default
        `self.timeout`)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release this rank's end; later calls raise `CommError`."""
        raise NotImplementedError

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.close()
        except CommError:
            if exc_type is None:
                raise  # otherwise the error already propagating is the one to report

    # ---------------------------------------------------------- shared checks

    def _check_peer_tag(self, peer: int, tag: int) -> None:
        if not 0 <= peer < self.world:
            raise ValueError(f"rank {self.rank}: peer {peer} is not a rank of a world of "
                             f"{self.world}")
        if not 0 <= tag < MAX_TAG:
            raise ValueError(f"rank {self.rank}: tag {tag} is not in [0, {MAX_TAG})")

    def _wait_for(self, timeout: float | None) -> float:
        return self.timeout if timeout is None else _check_timeout(timeout)

    def _closed_error(self) -> CommError:
        return CommError(f"rank {self.rank}: communicator is closed", self.rank)

    def _timeout_error(self, peer: int, tag: int, seconds: float) -> CommError:
        return CommError(f"rank {self.rank}: nothing from rank {peer} (tag {tag}) within "
                         f"{seconds:g} s", peer)

    def _size_error(self, peer: int, tag: int, got: int, want: int) -> CommError:
        return CommError(f"rank {self.rank}: message from rank {peer} (tag {tag}) has {got} "
                         f"bytes, the buffer {want}", peer)

    def _barrier_timeout_error(self, seconds: float) -> CommError:
        return CommError(f"rank {self.rank}: not every rank reached the barrier within "
                         f"{seconds:g} s")


def _check_timeout(timeout: float) -> float:
    t = float(timeout)
    if not t > 0:
        raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
    return t


# ------------------------------------------------------------------ threads of one process

class _LocalGroup:
    """The state the ranks of one `LocalCommunicator.group` share, under one condition variable:
    a FIFO of payloads per (source, destination, tag), the first failure, the barrier's count.
    Every wait is a `Condition.wait` with a deadline, woken by the change it waits for."""

    def __init__(self, world: int):
        self.world = world
        self.cond = threading.Condition()
        self.queues: defaultdict[tuple[int, int, int], deque[bytes]] = defaultdict(deque)
        self.failure: Failure | None = None
        self.arrived = 0
        self.generation = 0


class LocalCommunicator(Communicator):
    """A rank that is a thread of this process; make the ranks together with `group`."""

    def __init__(self, group: _LocalGroup, rank: int, timeout: float = DEFAULT_TIMEOUT):
        self._group = group
        self.rank = rank
        self.world = group.world
        self.timeout = _check_timeout(timeout)
        self._closed = False

    @classmethod
    def group(cls, world: int, timeout: float = DEFAULT_TIMEOUT) -> list[LocalCommunicator]:
        """The `world` ranks of a new group, rank i at index i: run each on its own thread."""
        if world < 1:
            raise ValueError(f"a group needs at least one rank, got {world}")
        shared = _LocalGroup(world)
        return [cls(shared, r, timeout) for r in range(world)]

    def _check_usable(self) -> None:
        """Under the group's lock: raise for a closed communicator or a failed group."""
        if self._group.failure is not None:
            raise self._group.failure.error()
        if self._closed:
            raise self._closed_error()

    def send(self, data: np.ndarray, peer: int, tag: int) -> None:
        self._check_peer_tag(peer, tag)
        payload = _payload(data)
        g = self._group
        with g.cond:
            self._check_usable()
            g.queues[(self.rank, peer, tag)].append(payload)
            g.cond.notify_all()

    def recv(self, out: np.ndarray, peer: int, tag: int, timeout: float | None = None) -> None:
        view = _byte_view(out)
        self._check_peer_tag(peer, tag)
        seconds = self._wait_for(timeout)
        deadline = time.monotonic() + seconds
        g = self._group
        key = (peer, self.rank, tag)
        with g.cond:
            while True:
                self._check_usable()
                queue = g.queues.get(key)
                if queue:
                    payload = queue.popleft()
                    if not queue:
                        del g.queues[key]  # plans may use a fresh tag per message
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._timeout_error(peer, tag, seconds)
                g.cond.wait(left)
        if len(payload) != view.nbytes:
            raise self._size_error(peer, tag, len(payload), view.nbytes)
        view[:] = np.frombuffer(payload, np.uint8)

    def abort(self, cause: str) -> None:
        g = self._group
        with g.cond:
            if g.failure is None:  # the first failure is the one every rank reports
                g.failure = Failure(self.rank, _one_line(cause))
            g.cond.notify_all()

    def barrier(self, timeout: float | None = None) -> None:
        seconds = self._wait_for(timeout)
        deadline = time.monotonic() + seconds
        g = self._group
        with g.cond:
            self._check_usable()
            generation = g.generation
            g.arrived += 1
            if g.arrived == g.world:
                g.arrived = 0
                g.generation += 1
                g.cond.notify_all()
                return
            while g.generation == generation:
                if g.failure is not None:
                    g.arrived -= 1
                    raise g.failure.error()
                left = deadline - time.monotonic()
                if left <= 0:
                    g.arrived -= 1  # withdraw, so a later barrier counts right
                    raise self._barrier_timeout_error(seconds)
                g.cond.wait(left)

    def close(self) -> None:
        with self._group.cond:
            self._closed = True


# ------------------------------------------------------------------ MPI processes

def _mpi() -> Any:
    """mpi4py's `MPI` module (importing it initialises MPI), or a `CommError` saying how to get
    it: it is an optional dependency."""
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise CommError(_MPI_MISSING) from e
    except RuntimeError as e:  # mpi4py present but no MPI library it can load
        raise CommError(f"{_MPI_MISSING} ({_one_line(str(e))})") from e
    return MPI


def _under_launcher() -> bool:
    return any(v in os.environ for v in _LAUNCHER_VARS)


def mpi_world() -> tuple[int, int]:
    """(rank, size) of MPI's COMM_WORLD; (0, 1) when not started by an MPI launcher or when
    mpi4py is missing. MPI is not initialised unless a launcher's variables are set: a plain run
    should not start an MPI singleton (files in /dev/shm, a process manager) to learn it is
    alone."""
    if not _under_launcher():
        return 0, 1
    try:
        MPI = _mpi()
    except CommError:
        return 0, 1
    return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


def abort_world(cause: str) -> None:
    """A process of several under an MPI launcher failed outside any plan's run (a bug raised
    in the driver): stop every process of COMM_WORLD now (`MPI_Abort`), rather than leave the
    peers waiting for messages this one will never send. Nothing when not under MPI."""
    rank, size = mpi_world()
    if size > 1:
        print(f"einpage: error: rank {rank} failed: {_one_line(cause)}; stopping every rank",
              file=sys.stderr, flush=True)
        _mpi().COMM_WORLD.Abort(1)


def communicator_for(world: int, timeout: float = DEFAULT_TIMEOUT) -> list[Communicator]:
    """The communicators this process runs for a plan of `world` ranks: under an MPI launcher
    with more than one process, this process's rank alone (`[MpiCommunicator]`, whose COMM_WORLD
    size must be `world`); otherwise all `world` ranks as threads (`LocalCommunicator.group`)."""
    rank, size = mpi_world()
    if size > 1:
        if size != world:
            raise CommError(f"rank {rank}: the plan has {world} ranks but MPI started {size} "
                            f"processes (mpiexec -n {world})")
        return [MpiCommunicator(timeout=timeout)]
    return list(LocalCommunicator.group(world, timeout))


class MpiCommunicator(Communicator):
    """A rank that is an MPI process (`comm`, default `MPI.COMM_WORLD`).

    Sends are `Isend`s of a private copy; the request and buffer are kept until the request
    completes (tested at every call, and waited for on `close`). A receive matches the next
    message of (peer, tag) with `Improbe`, polled with a short backoff, so that its byte count is
    known before any byte lands in `out` (a wrong size is reported exactly, not as MPI's
    truncation error) and nothing posted is left to cancel on a timeout; the matched message is
    then received with `Irecv`, polled with `Test`. Matched probes are thread-safe, so queues on
    several threads may receive at once. While polling, a rank looks for abort messages
    (`ABORT_TAG`, from any source): `abort` `Isend`s the cause to every other rank."""

    def __init__(self, comm: Any = None, timeout: float = DEFAULT_TIMEOUT):
        self._MPI = MPI = _mpi()
        self._comm = MPI.COMM_WORLD if comm is None else comm
        self.rank = self._comm.Get_rank()
        self.world = self._comm.Get_size()
        self.timeout = _check_timeout(timeout)
        if MPI.Query_thread() != MPI.THREAD_MULTIPLE:  # a rank's queues call MPI at once
            raise CommError(f"rank {self.rank}: this MPI runs with thread level "
                            f"{MPI.Query_thread()}, einpage needs MPI_THREAD_MULTIPLE "
                            f"({MPI.THREAD_MULTIPLE}): its send and recv queues are threads")
        tag_ub = self._comm.Get_attr(MPI.TAG_UB)
        if tag_ub is not None and tag_ub < ABORT_TAG:
            raise CommError(f"rank {self.rank}: this MPI allows tags up to {tag_ub}, einpage "
                            f"needs {ABORT_TAG}")
        self._lock = threading.Lock()
        self._pending: list[tuple[Any, bytes, bool]] = []  # request, buffer, is an abort
        self._failure: Failure | None = None
        self._closed = False
        self._barrier_req: Any = None

    # ---------------------------------------------------------- bookkeeping

    def _progress(self) -> None:
        """Drop the sends that completed (MPI frees a request once `Test` returns True)."""
        with self._lock:
            self._pending = [p for p in self._pending if not p[0].Test()]

    def _poll_abort(self) -> Failure | None:
        """Take in any abort message; the first failure heard of sticks."""
        MPI = self._MPI
        status = MPI.Status()
        while True:
            msg = self._comm.Improbe(MPI.ANY_SOURCE, ABORT_TAG, status)
            if msg is None:
                break
            buf = bytearray(status.Get_count(MPI.BYTE))
            msg.Recv([buf, MPI.BYTE])
            with self._lock:
                if self._failure is None:
                    self._failure = Failure(status.Get_source(),
                                            _one_line(buf.decode("utf-8", "replace")))
        return self._failure

    def _check_usable(self) -> None:
        if self._closed:
            raise self._closed_error()
        failure = self._poll_abort()
        if failure is not None:
            raise failure.error()

    # ---------------------------------------------------------- the API

    def send(self, data: np.ndarray, peer: int, tag: int) -> None:
        self._check_peer_tag(peer, tag)
        self._check_usable()
        payload = _payload(data)
        req = self._comm.Isend([payload, self._MPI.BYTE], dest=peer, tag=tag)
        with self._lock:
            self._pending.append((req, payload, False))
        self._progress()

    def recv(self, out: np.ndarray, peer: int, tag: int, timeout: float | None = None) -> None:
        view = _byte_view(out)
        self._check_peer_tag(peer, tag)
        seconds = self._wait_for(timeout)
        deadline = time.monotonic() + seconds
        MPI = self._MPI
        status = MPI.Status()
        delay = _POLL_FIRST
        while True:
            self._check_usable()
            msg = self._comm.Improbe(peer, tag, status)
            if msg is not None:
                break
            self._progress()
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._timeout_error(peer, tag, seconds)
            time.sleep(min(delay, left))
            delay = min(2 * delay, _POLL_CAP)
        got = status.Get_count(MPI.BYTE)
        if got != view.nbytes:
            msg.Recv([bytearray(got), MPI.BYTE])  # take it off the queue: the next one is next
            raise self._size_error(peer, tag, got, view.nbytes)
        req = msg.Irecv([view, MPI.BYTE])
        delay = _POLL_FIRST
        while not req.Test():
            # Matched and sent: only a failing sender can stop the bytes now. The request
            # cannot be cancelled, so after an abort this communicator is not used again.
            self._check_usable()
            time.sleep(delay)
            delay = min(2 * delay, _POLL_CAP)

    def abort(self, cause: str) -> None:
        line = _one_line(cause)
        with self._lock:
            if self._failure is None:
                self._failure = Failure(self.rank, line)
        payload = line.encode("utf-8")
        for peer in range(self.world):
            if peer == self.rank:
                continue
            try:
                req = self._comm.Isend([payload, self._MPI.BYTE], dest=peer, tag=ABORT_TAG)
            except self._MPI.Exception:
                continue  # that peer is gone already; tell the others
            with self._lock:
                self._pending.append((req, payload, True))
        self._progress()

    def barrier(self, timeout: float | None = None) -> None:
        seconds = self._wait_for(timeout)
        deadline = time.monotonic() + seconds
        self._check_usable()
        # A barrier that timed out is still in flight on MPI (a collective cannot be
        # cancelled): finish it first, so that this call matches the peers' next barrier.
        if self._barrier_req is not None:
            self._wait_barrier(deadline, seconds)
        self._barrier_req = self._comm.Ibarrier()
        self._wait_barrier(deadline, seconds)

    def _wait_barrier(self, deadline: float, seconds: float) -> None:
        delay = _POLL_FIRST
        while not self._barrier_req.Test():
            self._check_usable()
            self._progress()
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._barrier_timeout_error(seconds)
            time.sleep(min(delay, left))
            delay = min(2 * delay, _POLL_CAP)
        self._barrier_req = None

    def close(self) -> None:
        """Wait for this rank's sends to be taken (at most `timeout`), then release the rank's
        end. Raises `CommError` when, with no failure, sends are still unreceived at the
        deadline (the receivers never came). COMM_WORLD (or the `comm` given) is left to MPI's
        own finalisation.

        After a failure, close waits at most a second: for the abort messages to leave, and
        while it waits it takes in (and drops) every message that reached this rank unreceived.
        MPICH's finalisation fails an assertion on an unmatched large (rendezvous) message, and a
        sender's pending send to this rank completes once it is taken. Data sends that will
        never be received cannot be cancelled, so they are abandoned (MPICH then warns "pending
        references" at exit). Call `close` after `abort`, before exiting."""
        if self._closed:
            return
        self._closed = True
        start = time.monotonic()
        delay = _POLL_FIRST
        while True:
            failed = self._poll_abort() is not None
            if failed:
                self._drain(start + _ABORT_FLUSH)
            self._progress()
            with self._lock:
                waiting = [p for p in self._pending if p[2] or not failed]
            if not waiting:
                return
            if time.monotonic() - start >= (_ABORT_FLUSH if failed else self.timeout):
                break
            time.sleep(delay)
            delay = min(2 * delay, _POLL_CAP)
        if not failed:
            raise CommError(f"rank {self.rank}: {len(waiting)} sends not received within "
                            f"{self.timeout:g} s of close")

    def _drain(self, deadline: float) -> None:
        """Take in and drop every message that has reached this rank, until `deadline`."""
        MPI = self._MPI
        status = MPI.Status()
        while time.monotonic() < deadline:
            msg = self._comm.Improbe(MPI.ANY_SOURCE, MPI.ANY_TAG, status)
            if msg is None:
                return
            req = msg.Irecv([bytearray(status.Get_count(MPI.BYTE)), MPI.BYTE])
            while not req.Test():
                if time.monotonic() >= deadline:
                    return
                time.sleep(_POLL_CAP)
