"""`einpage compile --devices N` and `einpage run` of the programs it writes: every rank in this
process, or one process per rank under `mpiexec -n N` (the mpich wheel's), giving the one-device
logits; a rank that fails stops them all with one line each; bad flags are one line."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from mpi_launch import mpiexec, needs_mpi, result_records
from safetensors.numpy import load_file, save_file
from test_cli import assert_one_line_error as one_line
from test_cli import cli

from einpage.runtime.backends import cuda_usable

TOKENS = "1,2,3,4,5"
#: the console script beside this Python (pip installs it with the package)
EINPAGE = Path(sys.executable).parent / "einpage"


@pytest.fixture(scope="module")
def plans(tmp_path_factory, hf_fixture):
    """The f32 fixture compiled for one device and for two, at the same budget each."""
    f32 = hf_fixture("tiny-llama-f32")
    d = tmp_path_factory.mktemp("ranks")
    for name, extra in (("one.json", ()), ("two.json", ("--devices", 2)),
                        ("three.json.gz", ("--devices", 3))):
        assert cli("compile", f32, "--gpu-mem", "200KB", "--seq", 5, "--quiet", "-o",
                   d / name, *extra) == 0
    assert cli("run", d / "one.json", "--checkpoint", f32, "--tokens", TOKENS, "--out",
               d / "one.npy") == 0
    return f32, d


@pytest.mark.parametrize("plan,backend", [("two.json", "threads"), ("two.json", "numpy"),
                                          ("three.json.gz", "auto")])
def test_every_rank_in_one_process_gives_the_one_device_logits(plans, plan, backend, capsys):
    f32, d = plans
    capsys.readouterr()
    assert cli("run", d / plan, "--checkpoint", f32, "--tokens", TOKENS, "--backend", backend,
               "--out", d / "got.npy") == 0
    assert "saved logits (1, 5, 256)" in capsys.readouterr().out
    np.testing.assert_allclose(np.load(d / "got.npy"), np.load(d / "one.npy"), rtol=1e-6,
                               atol=1e-7)


def test_the_report_says_what_each_rank_holds(plans, capsys):
    f32, _ = plans
    assert cli("compile", f32, "--gpu-mem", "200KB", "--seq", 4, "--batch", 2, "--devices", 2,
               "--micro-batches", 2, "--peer-link", "nvlink", "--json", "--quiet") == 0
    r = json.loads(capsys.readouterr().out)
    assert r["devices"] == 2 and r["micro_batches"] == 2 and r["peer_bandwidth"] == 450e9
    assert [x["rank"] for x in r["ranks"]] == [0, 1]
    assert r["ranks"][0]["stages"][0] == 0 and r["ranks"][1]["stages"][0] == \
        r["ranks"][0]["stages"][1] + 1
    assert r["ranks"][0]["sent_bytes"] > 0 and r["ranks"][1]["sent_bytes"] == 0
    assert 0 < r["efficiency"] <= 1 and 0 <= r["bubble"] < 1
    assert r["makespan_s"] >= r["bound_s"]


@pytest.mark.parametrize("argv,message", [
    (("--micro-batches", 2), "--devices must be at least 2"),
    (("--devices", 2, "--micro-batches", 3, "--batch", 2), "must divide --batch"),
    (("--devices", 2, "--peer-link", "carrier-pigeon"), "--peer-link 'carrier-pigeon'"),
    (("--devices", 9), "at most one device per stage"),
])
def test_bad_pipeline_flags_are_one_line(plans, capsys, argv, message):
    f32, _ = plans
    one_line(capsys, cli("compile", f32, "--gpu-mem", "200KB", "--seq", 5, "--quiet", *argv),
             message)


def test_inspect_validates_and_prices_the_programs_together(plans, capsys):
    f32, d = plans
    assert cli("compile", f32, "--gpu-mem", "200KB", "--seq", 5, "--devices", 2, "--json",
               "--quiet") == 0
    compiled = json.loads(capsys.readouterr().out)
    assert cli("inspect", d / "two.json", "--json") == 0
    inspected = json.loads(capsys.readouterr().out)
    for key in ("makespan_s", "bubble", "chain_s", "micro_batches", "devices"):
        assert inspected[key] == pytest.approx(compiled[key]), key
    assert [r["stages"] for r in inspected["ranks"]] == [r["stages"] for r in compiled["ranks"]]
    assert cli("inspect", d / "three.json.gz") == 0
    out = capsys.readouterr().out
    assert "3 programs, validated together" in out and "bubble" in out
    one_line(capsys, cli("inspect", d / "two.json", "--dot", d / "g.dot"), "holds 2")
    from einpage.ir import MemGraph
    from einpage.errors import PlanError
    with pytest.raises(PlanError, match="a plan for 2 devices"):
        MemGraph.load(d / "two.json")


@needs_mpi
def test_one_process_per_rank_under_mpiexec(plans, tmp_path):
    f32, d = plans
    rc, output, _ = mpiexec(2, [EINPAGE, "run", d / "two.json",
                                "--checkpoint", f32, "--tokens", TOKENS, "--out",
                                tmp_path / "mpi.npy"])
    assert rc == 0, output
    np.testing.assert_array_equal(np.load(tmp_path / "mpi.npy"), np.load(d / "one.npy"))
    rc, output, _ = mpiexec(3, [EINPAGE, "run", d / "two.json",
                                "--checkpoint", f32, "--tokens", TOKENS])
    assert rc != 0 and "use mpiexec -n 2" in output


@needs_mpi
@pytest.mark.parametrize("layer", [0, 1])
def test_a_rank_that_fails_stops_every_rank_with_one_line(plans, tmp_path, layer):
    """Rank 0 (the sender) or rank 1 (the receiver) reads a broken weight: every process stops
    within seconds, each with one line, the failing rank named by the others."""
    f32, d = plans
    broken = tmp_path / "broken"
    shutil.copytree(f32, broken)
    tensors = load_file(broken / "model.safetensors")
    name = f"model.layers.{layer}.mlp.down_proj.weight"
    tensors[name] = tensors[name][:, :-1].copy()
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    rc, output, took = mpiexec(2, [EINPAGE, "run", d / "two.json",
                                   "--checkpoint", broken, "--tokens", TOKENS], timeout=60)
    lines = [line for line in output.splitlines() if line.strip()]
    assert rc != 0 and took < 30, output
    assert all(line.startswith("einpage: error: ") for line in lines), output
    assert any(name in line for line in lines) and "Traceback" not in output
    if layer == 0:  # the receiver heard why its sender stopped
        assert any(line.startswith("einpage: error: rank 0 failed:") for line in lines), output


def test_micro_batches_run_as_passes_that_follow_each_other(plans, tmp_path, capsys):
    f32, _ = plans
    tokens = tmp_path / "ids.npy"
    np.save(tokens, np.array([[1, 2, 3, 4, 5], [9, 8, 7, 6, 5]]))
    assert cli("compile", f32, "--gpu-mem", "200KB", "--seq", 5, "--batch", 2, "--quiet", "-o",
               tmp_path / "one.json") == 0
    assert cli("compile", f32, "--gpu-mem", "200KB", "--seq", 5, "--batch", 2, "--devices", 2,
               "--micro-batches", 2, "--quiet", "-o", tmp_path / "two.json") == 0
    for plan in ("one", "two"):
        assert cli("run", tmp_path / f"{plan}.json", "--checkpoint", f32, "--tokens-file", tokens,
                   "--out", tmp_path / f"{plan}.npy") == 0
    capsys.readouterr()
    got, want = np.load(tmp_path / "two.npy"), np.load(tmp_path / "one.npy")
    assert got.shape == want.shape == (2, 5, 256)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_generation_over_two_devices_gives_transformers_tokens(plans, tmp_path, capsys):
    """In one process: the greedy tokens transformers made for the fixture."""
    f32, _ = plans
    assert cli("generate", f32, "--tokens-file", f32 / "greedy_prompt.npy", "--max-new-tokens",
               5, "--ignore-eos", "--gpu-mem", "200KB", "--devices", 2, "--out",
               tmp_path / "new.npy") == 0
    capsys.readouterr()
    np.testing.assert_array_equal(np.load(tmp_path / "new.npy"), np.load(f32 / "greedy_out.npy"))


@needs_mpi
def test_generation_with_one_process_per_device(plans, tmp_path):
    f32, _ = plans
    rc, output, _ = mpiexec(2, [EINPAGE, "generate", f32, "--tokens-file",
                                f32 / "greedy_prompt.npy", "--max-new-tokens", 5,
                                "--ignore-eos", "--gpu-mem", "200KB", "--devices", 2, "--out",
                                tmp_path / "new.npy"])
    assert rc == 0, output
    assert output.count("saved new tokens") == 1, output  # rank 0 alone reports
    np.testing.assert_array_equal(np.load(tmp_path / "new.npy"), np.load(f32 / "greedy_out.npy"))
    rc, output, _ = mpiexec(2, [EINPAGE, "generate", f32, "--tokens", TOKENS, "--max-new-tokens",
                                2, "--gpu-mem", "200KB", "--devices", 3])
    assert rc != 0 and "--devices 3 but mpiexec started 2 processes" in output


def test_bad_device_flags_for_run_and_generate_are_one_line(plans, capsys):
    f32, _ = plans
    one_line(capsys, cli("generate", f32, "--tokens", TOKENS, "--max-new-tokens", 2,
                         "--devices", 2), "--devices N needs --gpu-mem")
    one_line(capsys, cli("run", f32, "--tokens", TOKENS, "--gpu-mem", "200KB", "--devices", 2,
                         "--backend", "numpy"), "plans for several devices run on threads")
    one_line(capsys, cli("generate", f32, "--tokens", TOKENS, "--max-new-tokens", 2,
                         "--devices", 2, "--arena", "100KB"), "an --arena is a plan's for one")
    from einpage.errors import InputError
    from einpage.runners import RanksRunner
    with pytest.raises(InputError, match="--trace with --devices measures every rank in one"):
        RanksRunner(None, None, 2, comm=object(), timing="--trace")


def _slices(path) -> list[dict]:
    return [e for e in json.loads(Path(path).read_text())["traceEvents"] if e["ph"] == "X"]


def _processes(path) -> dict[int, str]:
    return {e["pid"]: e["args"]["name"] for e in json.loads(Path(path).read_text())["traceEvents"]
            if e["ph"] == "M" and e["name"] == "process_name"}


def test_the_predicted_trace_of_several_devices_has_a_process_per_rank(plans, tmp_path, capsys):
    """`compile --devices --trace`: the ranks' joint simulation, each micro-batch's slices
    named, every message sent on rank 0 and received on rank 1, ending at the makespan;
    `inspect --trace` of the saved programs writes the same trace."""
    f32, _ = plans
    assert cli("compile", f32, "--gpu-mem", "200KB", "--seq", 5, "--batch", 2, "--devices", 2,
               "--micro-batches", 2, "--quiet", "--json", "-o", tmp_path / "mb.json",
               "--trace", tmp_path / "compiled.json") == 0
    report = json.loads(capsys.readouterr().out)
    assert any(n.startswith("trace: ") for n in report["notes"])
    assert _processes(tmp_path / "compiled.json") == {1: "rank 0 predicted (h100-pcie)",
                                                      2: "rank 1 predicted (h100-pcie)"}
    slices = _slices(tmp_path / "compiled.json")
    sends = [e for e in slices if e["cat"] == "send"]
    recvs = [e for e in slices if e["cat"] == "recv"]
    assert sends and {e["pid"] for e in sends} == {1} and {e["pid"] for e in recvs} == {2}
    assert len(sends) == len(recvs) and all(" to rank 1" in e["name"] for e in sends)
    assert {e["name"][:4] for e in slices} == {"mb0 ", "mb1 "}
    assert all(e["dur"] >= 0 for e in slices)
    end = max(e["ts"] + e["dur"] for e in slices)
    # (the trace's ts and dur are each rounded to 0.001 us)
    assert end == pytest.approx(report["makespan_s"] * 1e6, abs=2e-3)
    assert cli("inspect", tmp_path / "mb.json", "--trace", tmp_path / "inspected.json") == 0
    assert "trace: " in capsys.readouterr().out
    assert _slices(tmp_path / "inspected.json") == slices


def test_a_saved_plan_of_several_devices_is_timed_and_traced(plans, tmp_path, capsys):
    """`run PLAN --timing --trace --passes 2` of two ranks (two micro-batches each): every pass
    of every rank measured, beside the prediction; the logits those of one device."""
    f32, _ = plans
    tokens = tmp_path / "ids.npy"
    np.save(tokens, np.array([[1, 2, 3, 4, 5], [9, 8, 7, 6, 5]]))
    for name, extra in (("one.json", ()), ("two.json", ("--devices", 2, "--micro-batches", 2))):
        assert cli("compile", f32, "--gpu-mem", "200KB", "--seq", 5, "--batch", 2, "--quiet",
                   "-o", tmp_path / name, *extra) == 0
    assert cli("run", tmp_path / "one.json", "--checkpoint", f32, "--tokens-file", tokens,
               "--out", tmp_path / "one.npy") == 0
    capsys.readouterr()
    assert cli("run", tmp_path / "two.json", "--checkpoint", f32, "--tokens-file", tokens,
               "--timing", "--passes", 2, "--device", "h100-pcie", "--trace",
               tmp_path / "t.json", "--out", tmp_path / "two.npy") == 0
    out = capsys.readouterr().out
    assert "wrote the measured trace of 2 pass(es) of 2 ranks" in out
    for title in ("pass 1 on 2 devices: measured", "pass 2 on 2 devices: measured",
                  "pass 2, rank 1 on threads: measured"):
        assert title in out, out
    assert "predicted" in out.split("pass 1 on 2 devices")[1].splitlines()[0]
    np.testing.assert_allclose(np.load(tmp_path / "two.npy"), np.load(tmp_path / "one.npy"),
                               rtol=1e-6, atol=1e-7)
    assert _processes(tmp_path / "t.json") == {1: "rank 0 measured (threads)",
                                               2: "rank 1 measured (threads)"}
    slices = _slices(tmp_path / "t.json")
    assert {e["name"][:7] for e in slices} == {"pass 1 ", "pass 2 "}
    assert any(e["cat"] == "recv" and e["pid"] == 2 for e in slices)
    assert any(e["cat"] == "send" and e["pid"] == 1 for e in slices)


def test_a_generation_on_several_devices_is_traced(plans, tmp_path, capsys):
    f32, _ = plans
    assert cli("generate", f32, "--tokens", TOKENS, "--max-new-tokens", 3, "--gpu-mem",
               "200KB", "--devices", 2, "--parallel", "tensor", "--trace",
               tmp_path / "g.json") == 0
    assert "wrote the measured trace of 3 pass(es) of 2 ranks" in capsys.readouterr().out
    slices = _slices(tmp_path / "g.json")
    assert {e["pid"] for e in slices} == {1, 2}
    assert {e["name"][:7] for e in slices} == {"pass 1 ", "pass 2 ", "pass 3 "}
    for pid in (1, 2):  # tensor parallel: every rank sends its partial sums and receives
        assert {e["cat"] for e in slices if e["pid"] == pid} >= {"apply", "send", "recv"}


@needs_mpi
@pytest.mark.parametrize("seed", [1, 2])
def test_ranks_over_mpi_with_random_delays_per_queue_and_rank(seed):
    worker = Path(__file__).parent / "mpi_ranks_worker.py"
    rc, output, _ = mpiexec(2, [sys.executable, worker, seed])
    assert rc == 0, output
    (result,) = result_records(output)
    assert result["rank"] == 1 and result["recvs"] >= 2 and result["error"] < 1e-5, result


def test_micro_batches_auto_keeps_the_fastest_count(plans, capsys):
    f32, _ = plans
    assert cli("compile", f32, "--gpu-mem", "200KB", "--seq", 4, "--batch", 4, "--devices", 2,
               "--micro-batches", "auto", "--json", "--quiet") == 0
    r = json.loads(capsys.readouterr().out)
    (note,) = [n for n in r["notes"] if n.startswith("tried: ")]
    tried = dict(part.split(": ") for part in note.split("; ")[0][len("tried: "):].split(", "))
    assert set(tried) == {"pipeline x 1", "pipeline x 2", "pipeline x 4"}
    assert f"kept pipeline x {r['micro_batches']}" in note
    one_line(capsys, cli("compile", f32, "--gpu-mem", "200KB", "--devices", 2,
                         "--micro-batches", "many"), "--micro-batches 'many': a count or auto")


@pytest.mark.parametrize("argv,message", [
    (("--devices", 2, "--max-new-tokens", 3), "--max-new-tokens is an option of a plan for one"),
    (("--peer-link", "nvlink"), "--peer-link is the link between devices: add --devices N"),
])
def test_options_of_one_device_are_refused_with_several(plans, capsys, argv, message):
    f32, _ = plans
    one_line(capsys, cli("compile", f32, "--gpu-mem", "200KB", "--quiet", *argv), message)


def test_a_decode_plan_for_several_devices_is_run_by_generate(plans, tmp_path, capsys):
    f32, _ = plans
    assert cli("compile", f32, "--gpu-mem", "200KB", "--phase", "decode", "--past", 4,
               "--devices", 2, "--quiet", "-o", tmp_path / "dec.json") == 0
    capsys.readouterr()
    one_line(capsys, cli("run", tmp_path / "dec.json", "--checkpoint", f32, "--tokens", TOKENS),
             "is a decode step")


@pytest.mark.skipif(cuda_usable(), reason="a GPU is usable here")
def test_cupy_ranks_without_a_gpu_are_one_line(plans, capsys):
    f32, _ = plans
    for argv in (("run", f32, "--tokens", TOKENS), ("generate", f32, "--tokens", TOKENS,
                                                    "--max-new-tokens", 2)):
        one_line(capsys, cli(*argv, "--devices", 2, "--gpu-mem", "200KB", "--backend", "cupy"),
                 "--backend cupy: no usable CUDA GPU")
