"""The communication layer of multi-device plans (einpage.runtime.comm): ranks as threads
(`LocalCommunicator`) and as MPI processes (`MpiCommunicator`, run under the mpiexec of the
`mpich` wheel by tests/mpi_comm_worker.py; skipped without mpi4py or mpiexec)."""
from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from mpi_launch import mpiexec, needs_mpi, result_records

from einpage.errors import EinpageError
from einpage.runtime import comm as comm_mod
from einpage.runtime.comm import (CommError, LocalCommunicator, MpiCommunicator,
                                  communicator_for, mpi_world)

WORKER = Path(__file__).resolve().parent / "mpi_comm_worker.py"


def run_ranks(comms, fn, join_timeout=10.0):
    """Run `fn(comm)` for every rank on its own thread; the results, or the exceptions raised,
    by rank. A thread still running after `join_timeout` fails the test (a hang)."""
    out: list = [None] * len(comms)

    def body(c):
        try:
            out[c.rank] = fn(c)
        except BaseException as e:
            out[c.rank] = e

    threads = [threading.Thread(target=body, args=(c,), daemon=True) for c in comms]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_timeout)
        assert not t.is_alive(), "a rank hung"
    return out


def raise_any(results):
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def sample_arrays(rank: int) -> list[np.ndarray]:
    rng = np.random.default_rng(rank)
    return [rng.standard_normal((3, 5)).astype(np.float32),
            rng.integers(-2**50, 2**50, size=9, dtype=np.int64),
            rng.integers(0, 256, size=17, dtype=np.uint8),
            rng.standard_normal((2, 2, 2)).astype(np.float16),
            rng.standard_normal(6).astype(ml_dtypes.bfloat16),
            (rng.standard_normal(4) + 1j * rng.standard_normal(4)).astype(np.complex64),
            np.array([True, False, True]),
            np.array(7.25),                       # 0-d
            np.zeros((0, 4), np.float32)]         # empty


# ------------------------------------------------------------------ local ranks

@pytest.mark.parametrize("world", [2, 3])
def test_local_round_trip_of_dtypes_in_a_ring(world):
    comms = LocalCommunicator.group(world, timeout=5.0)

    def rank_fn(c):
        dst, src = (c.rank + 1) % world, (c.rank - 1) % world
        for i, a in enumerate(sample_arrays(c.rank)):
            c.send(a, dst, tag=i)
        got = []
        for i, a in enumerate(sample_arrays(src)):
            out = np.empty_like(a)
            c.recv(out, src, tag=i)
            got.append(out.tobytes() == a.tobytes())
        c.barrier()
        return got

    for got in raise_any(run_ranks(comms, rank_fn)):
        assert got == [True] * len(sample_arrays(0))


def test_local_order_per_tag_and_tags_independent():
    a, b = LocalCommunicator.group(2, timeout=2.0)
    for k in range(5):
        a.send(np.array([k], np.int32), 1, tag=3)
    a.send(np.array([99], np.int32), 1, tag=4)
    out = np.empty(1, np.int32)
    b.recv(out, 0, tag=4)  # the later tag first: it does not wait behind tag 3
    assert out[0] == 99
    seen = []
    for _ in range(5):
        b.recv(out, 0, tag=3)
        seen.append(int(out[0]))
    assert seen == [0, 1, 2, 3, 4]


def test_local_send_copies_and_takes_any_layout():
    a, b = LocalCommunicator.group(2, timeout=2.0)
    data = np.arange(12, dtype=np.float64).reshape(3, 4)
    a.send(data[:, ::2], 1, tag=0)  # not contiguous: sent in C order
    data[:] = -1                    # the sender may reuse its buffer at once
    out = np.empty((3, 2))
    b.recv(out, 0, tag=0)
    assert out.tolist() == [[0, 2], [4, 6], [8, 10]]
    with pytest.raises(ValueError, match="C-contiguous"):
        b.recv(np.empty((3, 4))[:, ::2], 0, tag=0)
    with pytest.raises(ValueError, match="peer 2"):
        a.send(data, 2, tag=0)
    with pytest.raises(ValueError, match="tag"):
        a.send(data, 1, tag=comm_mod.ABORT_TAG)


def test_local_size_mismatch_names_both_sizes_and_consumes_the_message():
    a, b = LocalCommunicator.group(2, timeout=2.0)
    a.send(np.zeros(3, np.float32), 1, tag=2)
    a.send(np.ones(4, np.float32), 1, tag=2)
    with pytest.raises(CommError, match=r"^rank 1: message from rank 0 \(tag 2\) has 12 bytes, "
                                        r"the buffer 16$") as info:
        b.recv(np.empty(4, np.float32), 0, tag=2)
    assert info.value.rank == 0
    out = np.empty(2, np.float64)  # same bytes, another dtype: bytes are what counts
    b.recv(out, 0, tag=2)
    assert out.view(np.float32).tolist() == [1, 1, 1, 1]


def test_local_timeout_names_ranks_and_tag():
    a, b = LocalCommunicator.group(2, timeout=0.2)
    start = time.monotonic()
    with pytest.raises(CommError) as info:
        b.recv(np.empty(1), 0, tag=5)  # the group's default timeout
    took = time.monotonic() - start
    assert str(info.value) == "rank 1: nothing from rank 0 (tag 5) within 0.2 s"
    assert info.value.rank == 0 and isinstance(info.value, EinpageError)
    assert 0.2 <= took < 2.0
    with pytest.raises(CommError, match=r"^rank 0: nothing from rank 1 \(tag 0\) within 0.05 s$"):
        a.recv(np.empty(1), 1, tag=0, timeout=0.05)


def test_local_abort_wakes_a_blocked_receiver_and_stops_every_call():
    comms = LocalCommunicator.group(3, timeout=30.0)
    started = threading.Event()

    def rank_fn(c):
        if c.rank == 1:
            started.wait(5)
            time.sleep(0.05)  # rank 0 is inside recv by now (or will find the failure there)
            c.abort("RuntimeError: boom\n  in layer 3")
            return None
        start = time.monotonic()
        started.set()
        try:
            if c.rank == 0:
                c.recv(np.empty(4), 1, tag=0)
            else:
                c.barrier()
        except CommError as e:
            return e, time.monotonic() - start
        return None

    results = run_ranks(comms, rank_fn)
    for r in (0, 2):
        err, took = results[r]
        assert str(err) == "rank 1 failed: RuntimeError: boom in layer 3"
        assert err.rank == 1 and took < 2.0
    for c in comms:  # later calls, the aborting rank's own included, raise the same
        with pytest.raises(CommError, match="^rank 1 failed: RuntimeError: boom in layer 3$"):
            c.send(np.zeros(1), (c.rank + 1) % 3, tag=0)
        with pytest.raises(CommError, match="rank 1 failed"):
            c.recv(np.zeros(1), (c.rank + 1) % 3, tag=0)
        with pytest.raises(CommError, match="rank 1 failed"):
            c.barrier()
    comms[2].abort("later failure")  # the first failure is the one reported
    with pytest.raises(CommError, match="^rank 1 failed"):
        comms[0].send(np.zeros(1), 1, tag=0)


def test_local_barrier_waits_for_all_and_times_out():
    comms = LocalCommunicator.group(3, timeout=5.0)
    arrived: list[int] = []
    lock = threading.Lock()

    def rank_fn(c):
        time.sleep(0.02 * c.rank)
        with lock:
            arrived.append(c.rank)
        c.barrier()
        with lock:
            return len(arrived)

    assert raise_any(run_ranks(comms, rank_fn)) == [3, 3, 3]
    with pytest.raises(CommError, match=r"^rank 0: not every rank reached the barrier within "
                                        r"0.1 s$"):
        comms[0].barrier(timeout=0.1)
    # the timed-out rank withdrew: the next barrier of all three still meets
    assert raise_any(run_ranks(comms, lambda c: c.barrier())) == [None] * 3


def test_local_close_and_context_manager():
    a, b = LocalCommunicator.group(2, timeout=1.0)
    with a:
        a.send(np.zeros(1), 1, tag=0)
    with pytest.raises(CommError, match="^rank 0: communicator is closed$"):
        a.send(np.zeros(1), 1, tag=0)
    out = np.empty(1)
    b.recv(out, 0, tag=0)  # what was sent before close still arrives
    b.close()
    b.close()  # idempotent


def test_without_mpi_everything_is_local(monkeypatch):
    for var in comm_mod._LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)
    assert mpi_world() == (0, 1)
    comms = communicator_for(3, timeout=1.0)
    assert [type(c) for c in comms] == [LocalCommunicator] * 3
    assert [c.rank for c in comms] == [0, 1, 2] and comms[0].timeout == 1.0


def test_missing_mpi4py_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # import fails as if not installed
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", None)
    with pytest.raises(CommError, match=r"^MPI needs mpi4py: pip install 'einpage\[mpi\]'$"):
        MpiCommunicator()
    monkeypatch.setenv("PMI_RANK", "1")  # under a launcher, but no mpi4py: alone
    assert mpi_world() == (0, 1)


# ------------------------------------------------------------------ MPI processes

def mpirun(scenario: str, timeout: float = 60.0):
    """`mpiexec -n 2 python tests/mpi_comm_worker.py SCENARIO`: (exit status, RESULT records,
    output, seconds). On a timeout the whole process group is killed and the test fails."""
    rc, output, took = mpiexec(2, [sys.executable, WORKER, scenario], timeout)
    records = result_records(output)
    return rc, records, output, took


@needs_mpi
def test_mpi_ping_pong_bytes_equal():
    rc, records, output, _ = mpirun("pingpong")
    assert rc == 0, output
    assert len(records) == 5, output
    assert all(r["equal"] for r in records), output
    assert max(r["nbytes"] for r in records) == 1 << 20  # one message past the eager limit


@needs_mpi
def test_mpi_abort_stops_a_blocked_receiver():
    rc, records, output, took = mpirun("abort", timeout=60.0)
    assert rc != 0, output
    by_rank = {r["rank"]: r for r in records}
    assert by_rank[1]["aborted"], output
    err = by_rank[0]
    assert err["error"] == "rank 1 failed: RuntimeError: disk on fire", output
    assert err["failed_rank"] == 1 and err["seconds"] < 5.0, output
    assert took < 30.0, output


@needs_mpi
def test_mpi_receive_without_sender_times_out():
    rc, records, output, _ = mpirun("timeout")
    assert rc == 0, output
    (rec,) = records
    assert rec["error"] == "rank 0: nothing from rank 1 (tag 7) within 0.3 s", output
    assert rec["failed_rank"] == 1 and 0.3 <= rec["seconds"] < 3.0, output


@needs_mpi
def test_mpi_a_bug_on_one_rank_stops_every_rank():
    """An unexpected exception in one process's command (a bug outside any plan's run): its
    traceback, one line naming the rank and the cause, and every rank stopped at once."""
    rc, records, output, took = mpirun("bug", timeout=60.0)
    assert rc != 0 and not records, output
    assert "einpage: error: rank 1 failed: KeyError: 'cache.0.k'; stopping every rank" in output
    assert "Traceback" in output and took < 15.0, output


@needs_mpi
def test_mpi_a_rank_that_dies_ends_the_others():
    """A process killed mid-run (no abort sent): the launcher ends the rest at once, far
    inside the 60 s the waiting rank would give its peer."""
    rc, records, output, took = mpirun("die", timeout=60.0)
    assert rc != 0 and not records, output
    assert took < 15.0, output
