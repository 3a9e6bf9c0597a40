"""Shared test set-up: hypothesis profiles, the tests directory on `sys.path` (for the helper
modules `llama_oracle` and `checkpoints`), the Hugging Face fixtures, and a summary of the
numerical errors the tests measured."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from hypothesis import settings

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

settings.register_profile("default", deadline=None, max_examples=50)
settings.register_profile("ci", parent=settings.get_profile("default"), derandomize=True,
                          deadline=None, database=None)
settings.load_profile("ci" if os.environ.get("CI") else "default")

#: The command line's default host budget is this machine's available memory; tests that do not
#: set `--cpu-mem` get the same plans on every machine (tests/test_tiers.py sets it).
os.environ["EINPAGE_CPU_MEM"] = "unlimited"

#: The compiled kernels that read stored weights as they lie (einpage.runtime.storedmm) take
#: operands of every size in tests, so the tiny models run them as a real model would; the NumPy
#: path they replace is held to them in tests/test_storedmm.py.
from einpage.ir import stored as _stored  # noqa: E402

_stored.MIN_ELEMENTS = 0

#: Tiny checkpoints written by Hugging Face transformers, with its logits and greedy tokens
#: (tests/fixtures/README.md): part of the repository, so a fresh clone tests everything.
FIXTURES = TESTS / "fixtures"


@pytest.fixture(scope="session")
def hf_fixture():
    """`hf_fixture(name)`: the fixture directory `tests/fixtures/<name>` (a missing one is a
    skip the conftest hook fails)."""
    def locate(name: str) -> Path:
        path = FIXTURES / name
        if not (path / "model.safetensors").exists():
            pytest.skip(f"Hugging Face fixture {path} not found (expected in tests/fixtures/)")
        return path
    return locate


_ERRORS: dict[str, float] = {}


@pytest.fixture(scope="session")
def record_error():
    """`record_error(label, value)`: keep the largest measured error per label; printed at the
    end of the run so accuracy is visible without reading assertion messages."""
    def record(label: str, value: float) -> None:
        _ERRORS[label] = max(float(value), _ERRORS.get(label, 0.0))
    return record


def _merge_errors(errors) -> None:
    for label, value in dict(errors).items():
        _ERRORS[label] = max(float(value), _ERRORS.get(label, 0.0))


def pytest_sessionfinish(session):
    """Under pytest-xdist a worker sends its measured errors to the controller, which prints
    them (`pytest_testnodedown`)."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["measured_errors"] = dict(_ERRORS)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: absent without it
def pytest_testnodedown(node, error):  # the controller: a worker is done
    _merge_errors(getattr(node, "workeroutput", {}).get("measured_errors", {}))


def pytest_terminal_summary(terminalreporter):
    if _ERRORS:
        terminalreporter.section("measured max abs errors")
        for label in sorted(_ERRORS):
            terminalreporter.write_line(f"{label:<60} {_ERRORS[label]:.3e}")


#: The only reasons a test may skip for (a skip for any other reason hides a broken test, as
#: `fake_cupy.install()` once did): the machine has no GPU, or no CUDA compiler, or it has a GPU
#: (a test of what happens without one), or no MPI (the GPU machines have no package index to
#: install the `mpi` extra from; CI installs it with `test`).
SKIP_REASONS = ("no GPU", "no CUDA compiler", "a GPU is usable here",
                "MPI tests need mpi4py and mpiexec")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and isinstance(report.longrepr, tuple):
        reason = str(report.longrepr[2]).removeprefix("Skipped: ")
        if not reason.startswith(SKIP_REASONS):
            report.outcome = "failed"
            report.longrepr = (f"skipped for a reason that is not allowed ({reason!r}): only "
                               f"{' / '.join(SKIP_REASONS)} may skip a test (tests/conftest.py)")
