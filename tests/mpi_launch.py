"""Launching tests under MPI: the mpiexec of the `mpich` wheel (beside this Python), the flags it
needs in a container, and one run of `mpiexec -n N ...` that never hangs the suite."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from einpage.runtime import comm as comm_mod


def find_mpiexec() -> str | None:
    """The mpiexec beside this Python (the `mpich` wheel's, matching the MPI library mpi4py
    loads), else one on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else shutil.which("mpiexec")


MPIEXEC = find_mpiexec()
needs_mpi = pytest.mark.skipif(
    importlib.util.find_spec("mpi4py") is None or MPIEXEC is None,
    reason="MPI tests need mpi4py and mpiexec: pip install 'einpage[mpi]'")


def launcher_flags() -> list[str]:
    """MPICH's hydra starts local ranks with fork when told to: no ssh, which a container may
    lack. Other mpiexecs get no extra flag."""
    try:
        version = subprocess.run([MPIEXEC, "--version"], capture_output=True, text=True,
                                 timeout=20, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return ["-launcher", "fork"] if "HYDRA" in version else []


def mpiexec(n: int, argv: list[str], timeout: float = 60.0) -> tuple[int, str, float]:
    """`mpiexec -n N ARGV...`: (exit status, output with stderr, seconds). On a timeout the whole
    process group is killed and the test fails."""
    cmd = [MPIEXEC, *launcher_flags(), "-n", str(n), *map(str, argv)]
    env = {k: v for k, v in os.environ.items() if k not in comm_mod._LAUNCHER_VARS}
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"mpiexec {' '.join(map(str, argv))} hung past {timeout} s:\n{output}")
    return proc.returncode, output, time.monotonic() - start


def result_records(output: str) -> list[dict]:
    """The JSON records the worker processes print after `RESULT ` (two processes' lines may
    interleave on the one pipe, a record then following another on its line)."""
    decoder = json.JSONDecoder()
    records, at = [], output.find("RESULT ")
    while at >= 0:
        record, end = decoder.raw_decode(output, at + len("RESULT "))
        records.append(record)
        at = output.find("RESULT ", end)
    return records
