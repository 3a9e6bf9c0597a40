"""`--backend`, `--timing`, `--trace` and `einpage calibrate` on the command line: the backends
agree with transformers' logits, the traces are Chrome trace-event files with one track per
queue (measured and predicted alike), and a backend that cannot run ends with one line."""
from __future__ import annotations

import json

import numpy as np
import pytest
from test_cli import assert_one_line_error, cli

from einpage.predict import load_device_file
from einpage.runtime.backends import cuda_usable


@pytest.fixture
def f32(hf_fixture):
    return hf_fixture("tiny-llama-f32")


@pytest.mark.parametrize("backend", ["threads", "numpy", "reference", "auto"])
def test_backends_match_transformers(capsys, tmp_path, f32, backend):
    ids = np.load(f32 / "input_ids.npy")
    np.save(tmp_path / "ids.npy", ids)
    budget = [] if backend in ("reference", "auto") else ["--gpu-mem", "200KB"]
    assert cli("run", f32, "--tokens-file", tmp_path / "ids.npy", "--backend", backend,
               *budget, "--out", tmp_path / "logits.npy") == 0
    got = np.load(tmp_path / "logits.npy")
    np.testing.assert_allclose(got, np.load(f32 / "logits.npy"), rtol=1e-4, atol=2e-5)


def trace_tracks(path) -> dict[str, list[dict]]:
    events = json.loads(path.read_text())["traceEvents"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e["ph"] == "M" and e["name"] == "thread_name"}
    tracks: dict[str, list[dict]] = {}
    for e in events:
        if e["ph"] == "X":
            assert e["dur"] >= 0 and e["ts"] >= 0
            tracks.setdefault(names[(e["pid"], e["tid"])], []).append(e)
    return tracks


def test_timing_and_trace_of_a_paged_run(capsys, tmp_path, f32):
    profile = tmp_path / "cpu.json"
    assert cli("calibrate", "-o", profile) == 0
    load_device_file(profile)
    capsys.readouterr()
    assert cli("run", f32, "--tokens", "1,2,3,4,5,6", "--gpu-mem", "200KB", "--backend",
               "threads", "--timing", "--trace", tmp_path / "m.json",
               "--device-file", profile) == 0
    out = capsys.readouterr().out
    assert "prefill pass on threads: measured | predicted on threads-calibrated" in out
    for label in ("wall", "compute busy", "compute stall", "h2d bytes", "h2d hidden"):
        assert label in out
    tracks = trace_tracks(tmp_path / "m.json")
    assert set(tracks) == {"compute", "h2d", "d2h"}
    assert all("bytes" in e["args"] for e in tracks["h2d"])
    compute = sorted(tracks["compute"], key=lambda e: e["ts"])
    assert all(a["ts"] + a["dur"] <= b["ts"] + 1e-3 for a, b in zip(compute, compute[1:]))


def test_compile_and_inspect_write_the_predicted_trace(capsys, tmp_path):
    assert cli("compile", "small", "--gpu-mem", "300KB", "--seq", "32", "--quiet", "-o",
               tmp_path / "p.json", "--trace", tmp_path / "pred.json") == 0
    assert "predicted trace written to" in capsys.readouterr().out
    tracks = trace_tracks(tmp_path / "pred.json")
    assert {"compute", "h2d"} <= set(tracks)
    assert cli("inspect", tmp_path / "p.json", "--trace", tmp_path / "again.json") == 0
    assert trace_tracks(tmp_path / "again.json").keys() == tracks.keys()


def test_a_plan_file_runs_on_threads(capsys, tmp_path, f32):
    assert cli("compile", f32, "--gpu-mem", "200KB", "--seq", "5", "--quiet", "-o",
               tmp_path / "p.json") == 0
    capsys.readouterr()
    for backend in ("threads", "numpy"):
        assert cli("run", tmp_path / "p.json", "--checkpoint", f32, "--tokens", "1,2,3,4,5",
                   "--backend", backend, "--out", tmp_path / f"{backend}.npy") == 0
    np.testing.assert_allclose(np.load(tmp_path / "threads.npy"),
                               np.load(tmp_path / "numpy.npy"), rtol=1e-6, atol=1e-7)


@pytest.mark.skipif(cuda_usable(), reason="a GPU is usable here")
def test_cupy_without_a_gpu_is_one_line(capsys, f32):
    code = cli("run", f32, "--tokens", "1,2,3", "--backend", "cupy")
    assert_one_line_error(capsys, code, "cupy")


def test_reference_takes_no_budget(capsys, f32):
    code = cli("run", f32, "--tokens", "1,2,3", "--backend", "reference", "--gpu-mem", "1MB")
    assert_one_line_error(capsys, code, "--backend reference runs no plan")


def test_calibrate_to_an_unwritable_path_fails_before_measuring(capsys, tmp_path):
    code = cli("calibrate", "-o", tmp_path / "no" / "such" / "dir" / "p.json")
    assert_one_line_error(capsys, code, "cannot write")


@pytest.mark.skipif(cuda_usable(), reason="a GPU is usable here")
def test_calibrate_cupy_without_a_gpu_is_one_line(capsys):
    code = cli("calibrate", "--backend", "cupy")
    assert_one_line_error(capsys, code, "--backend cupy: no usable CUDA GPU (")


@pytest.mark.parametrize("plan_file", [False, True])
def test_passes_repeat_the_pass_in_one_session(capsys, tmp_path, f32, plan_file):
    """`--passes N`: the same answer; --timing prints the first pass and the median of the
    others next to the prediction, and the trace holds every pass."""
    ids = np.load(f32 / "input_ids.npy")
    np.save(tmp_path / "ids.npy", ids)
    if plan_file:
        assert cli("compile", f32, "--gpu-mem", "200KB", "--batch", ids.shape[0], "--seq",
                   ids.shape[1], "--quiet", "-o", tmp_path / "p.json") == 0
        model = [tmp_path / "p.json", "--checkpoint", f32]
    else:
        model = [f32, "--gpu-mem", "200KB"]
    capsys.readouterr()
    assert cli("run", *model, "--tokens-file", tmp_path / "ids.npy", "--backend", "threads",
               "--passes", 4, "--timing", "--device", "h100-pcie", "--trace",
               tmp_path / "m.json", "--out", tmp_path / "logits.npy") == 0
    out = capsys.readouterr().out
    assert "pass 1 of 4 (the first) on threads: measured | predicted on h100-pcie" in out
    assert "median of passes 2-4 on threads: measured | predicted on h100-pcie" in out
    assert "passes 2-4 wall: min " in out and out.count("  wall ") == 2
    np.testing.assert_allclose(np.load(tmp_path / "logits.npy"), np.load(f32 / "logits.npy"),
                               rtol=1e-4, atol=2e-5)
    assert "wrote the measured trace of 4 pass(es)" in out
    assert cli("run", *model, "--tokens-file", tmp_path / "ids.npy", "--backend", "threads",
               "--passes", 2, "--timing") == 0
    assert "pass 2 of 2 on threads: measured" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--passes", "0"], "--passes must be >= 1, got 0"),
    (["--passes", "3", "--backend", "reference"], "--backend reference runs no plan"),
])
def test_bad_passes_are_one_line(capsys, f32, args, message):
    assert_one_line_error(capsys, cli("run", f32, "--tokens", "1,2", *args), message)
