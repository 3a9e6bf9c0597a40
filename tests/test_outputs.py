"""Outputs that are never lost or half-written (issue 16): every output checked before any work,
written whole or not at all, a failure one line and exit 2 after the work already done is
saved and reported; plan files in JSON or gzip, both read by every loader."""
from __future__ import annotations

import errno
import gzip
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from test_cli import assert_one_line_error, cli

from einpage.cli import execute, plan
from einpage.errors import OutputError, PlanError
from einpage.ir.memgraph import MemGraph
from einpage.outputs import atomic_open, check_writable, save_npy, write_text

SMALL = ("compile", "tiny", "--gpu-mem", "64MB", "--seq", "64", "--quiet")


def _leftovers(directory: Path) -> list[str]:
    """Temporary files an interrupted write would leave: `.NAME.XXXXXXXX.tmp`."""
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


def _no_work(monkeypatch):
    """Every command handler replaced by one that fails the test: an output error must come
    before any of them runs."""
    def boom(args):
        raise AssertionError("the command ran before its outputs were checked")
    for group in (plan, execute):
        for name in group.HANDLERS:
            monkeypatch.setitem(group.HANDLERS, name, boom)
    import einpage.compiler
    monkeypatch.setattr(einpage.compiler, "compile_graph", boom)


# ---------------------------------------------------------------- checked before any work

@pytest.mark.parametrize("argv, flag", [
    ("compile llama-65b --gpu-mem 300MB -o {missing}/p.json", "-o"),
    ("compile llama-65b --gpu-mem 300MB --output {missing}/p.json", "--output"),
    ("compile llama-65b --gpu-mem 300MB --trace {missing}/t.json", "--trace"),
    ("compile llama-65b --gpu-mem 300MB --plot {missing}/t.png", "--plot"),
    ("inspect {plan} --dot {missing}/g.dot", "--dot"),
    ("run tiny --random-weights --tokens 1,2 --out {missing}/x.npy", "--out"),
    ("generate tiny --random-weights --tokens 1,2 --max-new-tokens 2 --out {missing}/x.npy",
     "--out"),
    ("generate tiny --random-weights --tokens 1,2 --max-new-tokens 2 --trace {missing}/t.json",
     "--trace"),
])
def test_missing_directory_fails_before_work(capsys, monkeypatch, tmp_path, argv, flag):
    _no_work(monkeypatch)
    words = argv.format(missing=tmp_path / "nonexistent", plan=tmp_path / "p.json").split()
    start = time.perf_counter()
    code = cli(*words)
    assert time.perf_counter() - start < 2.0  # the 85 s compile never started
    err = assert_one_line_error(capsys, code, "no such directory")
    assert f"{flag} " in err
    assert not (tmp_path / "nonexistent").exists()


def test_unwritable_compile_output_fails_fast_for_real(capsys, tmp_path):
    """The reported case, unpatched: llama-65b at 300 MB compiles for 85+ s; a bad -o must
    end at once."""
    start = time.perf_counter()
    code = cli("compile", "llama-65b", "--gpu-mem", "300MB", "-o", "/nonexistent/p.json")
    assert time.perf_counter() - start < 5.0
    assert_one_line_error(capsys, code, "cannot write -o /nonexistent/p.json: no such directory")


@pytest.mark.parametrize("make, message", [
    (lambda d: (d / "out").mkdir() or d / "out", "is a directory"),
    (lambda d: (d / "f").write_text("x") and d / "f" / "p.json", "is not a directory"),
])
def test_bad_output_paths(capsys, monkeypatch, tmp_path, make, message):
    _no_work(monkeypatch)
    target = make(tmp_path)
    assert_one_line_error(capsys, cli(*SMALL, "-o", target), message)


def test_two_outputs_naming_one_file(capsys, monkeypatch, tmp_path):
    _no_work(monkeypatch)
    p = tmp_path / "same.json"
    err = assert_one_line_error(capsys, cli(*SMALL, "-o", p, "--trace", p), "both name")
    assert "-o" in err and "--trace" in err
    assert not p.exists()


def test_read_only_directory(capsys, monkeypatch, tmp_path):
    _no_work(monkeypatch)
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    # root writes into a read-only directory, but not into /proc
    target = Path("/proc/self") if os.geteuid() == 0 else locked
    try:
        assert_one_line_error(capsys, cli(*SMALL, "-o", target / "p.json"),
                              "cannot create a file")
    finally:
        locked.chmod(0o700)


def test_check_leaves_nothing_behind(tmp_path):
    check_writable(tmp_path / "p.json", "-o")
    assert list(tmp_path.iterdir()) == []


def test_calibrate_output_checked_before_measuring(capsys, monkeypatch, tmp_path):
    import einpage.calibrate

    def boom(*args, **kwargs):
        raise AssertionError("measured before -o was checked")
    monkeypatch.setattr(einpage.calibrate, "calibrate", boom)
    assert_one_line_error(capsys, cli("calibrate", "-o", tmp_path / "no" / "cpu.json"),
                          "no such directory")


# ---------------------------------------------------------------- whole or not at all

def _limited(argv: list[str], cwd: Path, limit: int) -> subprocess.CompletedProcess:
    """`einpage ARGV` in a child whose files may not grow past `limit` bytes (`ulimit -f`). The
    child ignores SIGXFSZ itself (einpage.outputs.ignore_file_size_signal), so the write fails
    with EFBIG instead of the signal killing it."""
    def limit_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    code = "import sys; from einpage.cli import main; sys.exit(main(sys.argv[1:]))"
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run([sys.executable, "-c", code, *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, preexec_fn=limit_files, timeout=120)


@pytest.mark.parametrize("name", ["plan.json", "plan.json.gz"])
def test_file_size_limit_leaves_no_partial_plan(tmp_path, name):
    done = _limited([*SMALL, "-o", name], tmp_path, limit=1024)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith(f"einpage: error: cannot write {name}: File too large")
    assert list(tmp_path.iterdir()) == []  # no truncated plan, no temporary file


def test_file_size_limit_keeps_the_old_file(tmp_path):
    old = tmp_path / "plan.json"
    old.write_text("the plan of yesterday")
    done = _limited([*SMALL, "-o", "plan.json"], tmp_path, limit=4096)
    assert done.returncode == 2, done.stderr
    assert old.read_text() == "the plan of yesterday"
    assert _leftovers(tmp_path) == []


def test_failed_write_removes_temp_and_keeps_target(tmp_path):
    target = tmp_path / "out.txt"
    target.write_text("old")
    with pytest.raises(OutputError, match="cannot write .*out.txt: No space left on device"):
        with atomic_open(target, "w") as fh:
            fh.write("half")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert target.read_text() == "old"
    assert _leftovers(tmp_path) == []
    with pytest.raises(KeyError):  # any other failure: no file either, the error unchanged
        with atomic_open(tmp_path / "new.txt", "w") as fh:
            fh.write("half")
            raise KeyError("boom")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.txt"]


def test_symlink_target_replaced_link_kept(tmp_path):
    real = tmp_path / "real.txt"
    real.write_text("old")
    real.chmod(0o640)
    link = tmp_path / "link.txt"
    link.symlink_to(real)
    write_text(link, "new")
    assert link.is_symlink() and real.read_text() == "new"
    assert real.stat().st_mode & 0o777 == 0o640  # the old permission bits kept


# ---------------------------------------------------------------- names and messages

def test_out_without_extension_written_as_named(capsys, tmp_path):
    target = tmp_path / "noext"
    assert cli("run", "tiny", "--random-weights", "--tokens", "1,2,3", "--out", target) == 0
    out = capsys.readouterr().out
    assert f"to {target}" in out and f"{target}.npy" not in out
    assert not (tmp_path / "noext.npy").exists()
    assert np.load(target).shape[:2] == (1, 3)
    assert cli("generate", "tiny", "--random-weights", "--tokens", "1,2", "--max-new-tokens",
               "2", "--out", tmp_path / "ids") == 0
    assert f"to {tmp_path / 'ids'}\n" in capsys.readouterr().out
    assert np.load(tmp_path / "ids").shape == (1, 2)


def test_save_npy_exact_name(tmp_path):
    save_npy(tmp_path / "a.bin", np.arange(3))
    assert [p.name for p in tmp_path.iterdir()] == ["a.bin"]
    assert np.load(tmp_path / "a.bin").tolist() == [0, 1, 2]


def _fail_savefig(monkeypatch):
    """The PNG write fails as on a full disk (after the checks, after the work)."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    def full(self, fh, **kwargs):
        fh.write(b"\x89PNG partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(Figure, "savefig", full)


def test_failed_plot_keeps_plan_and_prints_report(capsys, monkeypatch, tmp_path):
    _fail_savefig(monkeypatch)
    p, png, trace = tmp_path / "p.json", tmp_path / "t.png", tmp_path / "trace.json"
    code = cli(*SMALL, "-o", p, "--plot", png, "--trace", trace)
    out, err = capsys.readouterr()
    assert code == 2
    assert err == f"einpage: error: cannot write {png}: No space left on device\n"
    assert "einpage plan: tiny" in out  # the report printed
    assert f"plan written to {p}" in out and f"predicted trace written to {trace}" in out
    assert "timeline written to" not in out
    assert MemGraph.load(p).nodes and json.loads(trace.read_text())
    assert not png.exists() and _leftovers(tmp_path) == []


def test_failed_plot_json_report(capsys, monkeypatch, tmp_path):
    _fail_savefig(monkeypatch)
    p, png = tmp_path / "p.json", tmp_path / "t.png"
    code = cli(*SMALL, "--json", "-o", p, "--plot", png)
    out, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1
    report = json.loads(out)
    assert report["plan"] == str(p) and "plot" not in report


def test_failed_out_still_prints_the_result(capsys, monkeypatch, tmp_path):
    """`run --out` on a full disk: each row's next token printed, then one line."""
    def full(path, array):
        raise OutputError(f"cannot write {path}: No space left on device")
    import einpage.outputs
    monkeypatch.setattr(einpage.outputs, "save_npy", full)
    code = cli("run", "tiny", "--random-weights", "--tokens", "1,2,3", "--out", tmp_path / "x")
    out, err = capsys.readouterr()
    assert code == 2 and "No space left on device" in err and err.count("\n") == 1
    assert out.startswith("row 0: next token ")


def test_failed_generate_out_still_prints_the_rows(capsys, monkeypatch, tmp_path):
    def full(path, array):
        raise OutputError(f"cannot write {path}: No space left on device")
    monkeypatch.setattr(execute, "save_npy", full)
    code = cli("generate", "tiny", "--random-weights", "--tokens", "1,2", "--max-new-tokens",
               "2", "--out", tmp_path / "ids.npy")
    out, err = capsys.readouterr()
    assert code == 2 and "No space left on device" in err and err.count("\n") == 1
    assert out.startswith("row 0: ") and "saved new tokens" not in out


# ---------------------------------------------------------------- plan files: JSON and gzip

@pytest.fixture
def small_plan(tmp_path) -> Path:
    p = tmp_path / "p.json"
    assert cli(*SMALL, "-o", p) == 0
    return p


def test_gz_round_trip(capsys, tmp_path, small_plan):
    assert cli(*SMALL, "-o", tmp_path / "compiled.json.gz") == 0  # compile -o writes it too
    capsys.readouterr()
    assert MemGraph.load(tmp_path / "compiled.json.gz").nodes
    gz = tmp_path / "p.json.gz"
    a = MemGraph.load(small_plan)
    a.save(gz)
    raw = gz.read_bytes()
    assert raw[:2] == b"\x1f\x8b" and len(raw) < small_plan.stat().st_size / 3
    b = MemGraph.load(gz)
    assert a == b and a.meta == b.meta
    # the same JSON inside, and the same bytes for the same plan (no name, no time in it)
    assert json.loads(gzip.decompress(raw))["nodes"] == json.loads(small_plan.read_text())["nodes"]
    b.save(tmp_path / "again.json.gz")
    assert (tmp_path / "again.json.gz").read_bytes() == raw
    # read by content, not by name
    (tmp_path / "renamed.json").write_bytes(raw)
    assert MemGraph.load(tmp_path / "renamed.json") == a
    assert cli("inspect", gz, "--json") == 0
    assert json.loads(capsys.readouterr().out)["nodes"] == len(a.nodes)


def test_json_save_is_the_v2_format(small_plan, tmp_path):
    data = json.loads(small_plan.read_text())
    assert data["format"] == "einpage.memgraph" and data["version"] == 2 and "graph" in data
    mg = MemGraph.from_json(data)
    assert mg.to_json()["nodes"] == data["nodes"]
    mg.save(tmp_path / "again.json")
    assert (tmp_path / "again.json").read_bytes() == small_plan.read_bytes()


@pytest.mark.parametrize("corrupt", [
    lambda raw: raw[: len(raw) // 2],                                   # truncated
    lambda raw: raw[:20] + bytes(b ^ 0xFF for b in raw[20:40]) + raw[40:],  # bad deflate data
    lambda raw: raw[:-8] + b"\0" * 8,                                   # bad CRC and length
])
def test_corrupt_gz_is_one_line(capsys, tmp_path, small_plan, corrupt):
    gz = tmp_path / "bad.json.gz"
    gz.write_bytes(corrupt(gzip.compress(small_plan.read_bytes())))
    with pytest.raises(PlanError, match="bad.json.gz: corrupt gzip file"):
        MemGraph.load(gz)
    assert_one_line_error(capsys, cli("inspect", gz), "corrupt gzip file")


def test_gz_of_something_else(capsys, tmp_path):
    gz = tmp_path / "notaplan.json.gz"
    gz.write_bytes(gzip.compress(b"\xff\xfe not text"))
    assert_one_line_error(capsys, cli("inspect", gz), "not UTF-8")
    gz.write_bytes(gzip.compress(b'{"format": "x"}'))
    assert_one_line_error(capsys, cli("inspect", gz), "not an einpage plan")
