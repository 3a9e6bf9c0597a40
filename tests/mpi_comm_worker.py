"""One rank of a `tests/test_comm.py` MPI scenario: `mpiexec -n 2 python tests/mpi_comm_worker.py
SCENARIO`. Each rank prints one `RESULT {json}` line per result (the test parses them) and exits
with a status that says how it ended:

    pingpong  rank 0 sends arrays of several dtypes (one large enough for MPI's rendezvous
              protocol), rank 1 sends each back; rank 0 compares bytes. Both exit 0.
    abort     rank 1 fails (an exception) and aborts with its cause, then exits 1; rank 0, blocked
              in a recv from rank 1, reports the CommError it got and exits 3.
    timeout   rank 0 receives from rank 1, which sends nothing; rank 0 reports the CommError,
              then both meet at a barrier and exit 0.
    die       rank 1 exits at once (os._exit, as if killed) while rank 0 waits in a recv with a
              60 s timeout: the launcher ends rank 0 too.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # einpage, even if not installed

import numpy as np  # noqa: E402

from einpage.runtime.comm import CommError, MpiCommunicator  # noqa: E402

#: Exit status of rank 0 when it saw the peer's abort as a CommError.
SAW_ABORT = 3


def result(**fields) -> None:
    print("RESULT " + json.dumps(fields), flush=True)


def arrays() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [np.arange(12, dtype=np.float32).reshape(3, 4),
            rng.integers(-2**40, 2**40, size=7, dtype=np.int64),
            rng.integers(0, 256, size=13, dtype=np.uint8),
            np.array(2.5, dtype=np.float64),
            rng.standard_normal((512, 1024)).astype(np.float16)]  # 1 MiB: rendezvous


def pingpong(comm: MpiCommunicator) -> int:
    for i, a in enumerate(arrays()):
        if comm.rank == 0:
            comm.send(a, peer=1, tag=i)
            back = np.empty_like(a)
            comm.recv(back, peer=1, tag=i)
            result(rank=0, scenario="pingpong", index=i, dtype=str(a.dtype), nbytes=a.nbytes,
                   equal=back.tobytes() == a.tobytes())
        else:
            got = np.empty_like(a)
            comm.recv(got, peer=0, tag=i)
            comm.send(got, peer=0, tag=i)
    comm.close()
    return 0


def abort(comm: MpiCommunicator) -> int:
    if comm.rank == 1:
        time.sleep(0.3)  # let rank 0 block in its recv first
        try:
            raise RuntimeError("disk on fire")
        except RuntimeError as e:
            comm.abort(f"{type(e).__name__}: {e}")
        comm.close()
        result(rank=1, scenario="abort", aborted=True)
        return 1
    start = time.monotonic()
    try:
        comm.recv(np.empty(4, np.float32), peer=1, tag=0, timeout=30.0)
    except CommError as e:
        result(rank=0, scenario="abort", error=str(e), failed_rank=e.rank,
               seconds=time.monotonic() - start)
        comm.close()
        return SAW_ABORT
    result(rank=0, scenario="abort", error=None)
    return 0


def timeout(comm: MpiCommunicator) -> int:
    if comm.rank == 0:
        start = time.monotonic()
        try:
            comm.recv(np.empty(4, np.float32), peer=1, tag=7, timeout=0.3)
            result(rank=0, scenario="timeout", error=None)
        except CommError as e:
            result(rank=0, scenario="timeout", error=str(e), failed_rank=e.rank,
                   seconds=time.monotonic() - start)
    comm.barrier(timeout=10.0)
    comm.close()
    return 0


def die(comm: MpiCommunicator) -> int:
    """Rank 1 dies without a word (as a killed process would): the launcher must end rank 0,
    blocked in a recv with a long timeout, at once."""
    if comm.rank == 1:
        time.sleep(0.3)
        os._exit(9)
    comm.recv(np.empty(4, np.float32), peer=1, tag=0, timeout=60.0)
    result(rank=0, scenario="die", error=None)
    return 0


def bug(comm: MpiCommunicator) -> int:
    """Rank 1's command raises an unexpected exception (a bug, not an EinpageError) in the CLI's
    `main`, outside any plan's run: every rank must stop at once (`comm.abort_world`), not leave
    rank 0 in its recv."""
    import importlib
    cli_main = importlib.import_module("einpage.cli.main")

    def command(args) -> None:
        if comm.rank == 1:
            time.sleep(0.3)
            raise KeyError("cache.0.k")
        comm.recv(np.empty(4, np.float32), peer=1, tag=0, timeout=60.0)

    cli_main.check_outputs = command  # the first thing `main` calls with the parsed args
    return cli_main.main(["models"])


SCENARIOS = {"pingpong": pingpong, "abort": abort, "timeout": timeout, "die": die, "bug": bug}


def main(argv: list[str]) -> int:
    comm = MpiCommunicator(timeout=20.0)
    return SCENARIOS[argv[1]](comm)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
