"""`generate --devices N` with the flags a one-device generation takes: speculative decoding
(`--draft ngram` or a draft model, split over the devices as the model is) gives the tokens of
plain decoding, and `--timing` prints each rank's measured pass next to its part of the ranks'
joint simulation."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from mpi_launch import mpiexec, needs_mpi
from test_cli import assert_one_line_error as one_line
from test_cli import cli

from einpage.compiler import CompileOptions
from einpage.errors import InputError
from einpage.models.checkpoint import RandomWeights
from einpage.models import config
from einpage.runners import RanksRunner


EINPAGE = Path(sys.executable).parent / "einpage"


def _generate(capsys, *argv) -> dict:
    assert cli("generate", *argv, "--ignore-eos", "--json") == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("parallel", ["tensor", "pipeline"])
def test_ngram_drafts_on_two_devices_give_the_greedy_tokens(hf_fixture, capsys, parallel):
    path = hf_fixture("tiny-llama-f32")
    want = np.load(path / "greedy_out.npy")
    got = _generate(capsys, path, "--tokens-file", path / "greedy_prompt.npy",
                    "--max-new-tokens", 12, "--gpu-mem", "200KB", "--devices", 2,
                    "--parallel", parallel, "--draft", "ngram")
    tokens = np.array(got["tokens"])
    np.testing.assert_array_equal(tokens[:, :want.shape[1]], want)  # transformers' greedy
    assert got["draft"] == "ngram" and got["accepted"] > 0 and got["verify_passes"] < 11
    auto = _generate(capsys, path, "--tokens-file", path / "greedy_prompt.npy",
                     "--max-new-tokens", 12, "--gpu-mem", "200KB", "--devices", 2,
                     "--parallel", parallel, "--draft", "ngram", "--draft-tokens", "auto")
    assert auto["tokens"] == got["tokens"] and auto["draft_tokens"] == "auto"  # priced by the
    assert sum(auto["draft_tokens_used"].values()) == auto["verify_passes"]   # ranks' plans


def test_a_draft_model_split_over_two_devices_gives_one_devices_tokens(hf_fixture, capsys):
    model, draft = hf_fixture("tiny-llama31"), hf_fixture("tiny-llama31-draft")
    argv = (model, "--tokens", "1,5,9,22,5,9,22,5", "--max-new-tokens", 8, "--gpu-mem",
            "300KB")
    plain = _generate(capsys, *argv)
    for parallel in ("tensor", "pipeline"):
        got = _generate(capsys, *argv, "--devices", 2, "--parallel", parallel, "--draft",
                        draft, "--draft-gpu-mem", "60KB")
        assert got["tokens"] == plain["tokens"] and got["draft_model"] == str(draft)
        assert got["draft_bytes"] == 60_000 and got["verify_passes"] >= 1
    one_line(capsys, cli("generate", *argv, "--devices", 2, "--draft", draft,
                         "--draft-gpu-mem", "300KB"), "no room is left for the model")


def test_speculation_forecast_on_two_devices(hf_fixture, capsys):
    """`compile --phase decode --devices 2 --draft`: the plain step is the plan `compile
    --devices 2` makes of it, every step planned for the two devices (the verify steps on its
    stage cut), the k picked and the command that runs it."""
    path = hf_fixture("tiny-llama-f32")
    argv = (path, "--gpu-mem", "200KB", "--phase", "decode", "--past", 20, "--devices", 2,
            "--quiet")
    assert cli("compile", *argv, "--json") == 0
    plain = json.loads(capsys.readouterr().out)
    assert cli("compile", *argv, "--draft", "ngram", "--draft-tokens", 2, "--json") == 0
    f = json.loads(capsys.readouterr().out)
    assert f["devices"] == 2 and f["parallel"] == "pipeline" and f["device_bytes"] == 200_000
    assert f["plain_step_s"] == pytest.approx(plain["makespan_s"], rel=1e-9)
    (v,) = f["verify"]
    assert v["k"] == 2 and v["verify_s"] > f["plain_step_s"] and v["speedup"] > 1
    assert cli("compile", *argv, "--draft", "ngram", "--parallel", "tensor") == 0
    out = capsys.readouterr().out
    assert "on 2 devices (tensor parallel), budget 200.00 KB each" in out
    assert "--devices 2 --parallel tensor)" in out
    one_line(capsys, cli("compile", *argv, "--draft", "ngram", "--micro-batches", 2, "--batch",
                         2), "--draft forecasts generation steps, each run whole")


def test_a_draft_models_share_of_each_device_is_searched_as_compile_does(hf_fixture, capsys):
    """Without --draft-gpu-mem, `generate --devices 2 --draft MODEL` gives the draft the share
    of each device that `compile --devices 2 --draft MODEL` keeps for the same step (the
    generation's last KV bucket, k = 4, acceptance 0.7), and the tokens of plain decoding."""
    model, draft = hf_fixture("tiny-llama31"), hf_fixture("tiny-llama31-draft")
    assert cli("compile", model, "--gpu-mem", "300KB", "--phase", "decode", "--past", 8,
               "--capacity", 16, "--devices", 2, "--parallel", "tensor", "--draft", draft,
               "--draft-tokens", 4, "--quiet", "--json") == 0
    f = json.loads(capsys.readouterr().out)
    shares = [s["draft_bytes"] for s in f["draft_splits"]]
    assert len(shares) > 1 and f["draft_bytes"] in shares and f["parallel"] == "tensor"
    argv = (model, "--tokens", "1,5,9,22,5,9,22,5", "--max-new-tokens", 8, "--gpu-mem",
            "300KB")
    plain = _generate(capsys, *argv)
    got = _generate(capsys, *argv, "--devices", 2, "--parallel", "tensor", "--draft", draft)
    assert got["draft_bytes"] == f["draft_bytes"] and got["tokens"] == plain["tokens"]


def test_a_draft_that_cannot_spread_as_the_model_is_named(hf_fixture, capsys):
    """The draft has fewer layers than the model: 4 pipeline stages fit the model, not it."""
    model, draft = hf_fixture("tiny-llama31"), hf_fixture("tiny-llama31-draft")
    one_line(capsys, cli("compile", model, "--phase", "decode", "--past", 8, "--devices", 4,
                         "--draft", draft, "--gpu-mem", "300KB"),
             "the draft model tiny-llama31-draft: 4 devices for a graph of 3 stages")
    one_line(capsys, cli("generate", model, "--tokens", "1,2,3", "--max-new-tokens", 3,
                         "--devices", 4, "--draft", draft, "--gpu-mem", "300KB",
                         "--draft-gpu-mem", "50KB"),
             "the draft model tiny-llama31-draft: 4 devices for a graph of 3 stages")


def test_timing_on_two_devices_prints_every_ranks_pass_and_the_joint_prediction(hf_fixture,
                                                                               capsys):
    path = hf_fixture("tiny-llama-f32")
    assert cli("generate", path, "--tokens", "1,2,3,4,5", "--max-new-tokens", 3, "--gpu-mem",
               "100KB", "--devices", 2, "--parallel", "tensor", "--timing", "--device",
               "h100-pcie") == 0
    out = capsys.readouterr().out
    for title in ("prefill pass", "decode step 1", "decode step 2"):
        assert f"{title} on 2 devices: measured " in out and "on h100-pcie (" in out
        for r in (0, 1):
            assert f"  {title}, rank {r} on threads: measured | predicted on h100-pcie" in out
    assert out.count("h2d bytes") == 6
    assert cli("generate", path, "--tokens", "1,2,3", "--max-new-tokens", 2, "--gpu-mem",
               "100KB", "--devices", 2, "--timing") == 0
    out = capsys.readouterr().out
    assert "decode step 1 on 2 devices: measured" in out and "(no prediction" in out


def test_timing_is_refused_for_ranks_in_other_processes():
    cfg = config.preset("small")
    with pytest.raises(InputError, match="--timing with --devices measures every rank in one "
                                         "process"):
        RanksRunner(RandomWeights(cfg, 0), CompileOptions(1 << 20), 2, comm=object(),
                    timing=True)


def test_timing_of_one_plans_passes_on_two_devices_numbers_them(hf_fixture, capsys):
    path = hf_fixture("tiny-llama-f32")
    assert cli("run", path, "--tokens", "1,2,3", "--devices", 2, "--gpu-mem", "100KB",
               "--timing", "--passes", 3) == 0
    out = capsys.readouterr().out
    assert "pass 1 on 2 devices" in out and "pass 3 on 2 devices" in out
    assert "decode step" not in out


@needs_mpi
def test_a_draft_model_under_mpiexec_gives_one_devices_tokens(hf_fixture, capsys, tmp_path):
    """Each process keeps only its own rank's KV rows, the draft model's as the model's (a
    pipeline's rank holds its layers alone)."""
    model, draft = hf_fixture("tiny-llama31"), hf_fixture("tiny-llama31-draft")
    argv = [model, "--tokens", "1,5,9,22,5,9,22,5", "--max-new-tokens", 8, "--gpu-mem",
            "300KB", "--ignore-eos"]
    plain = _generate(capsys, *argv[:-1])
    for parallel in ("pipeline", "tensor"):
        rc, output, _ = mpiexec(2, [EINPAGE, "generate", *argv, "--devices", 2, "--parallel",
                                    parallel, "--draft", draft, "--draft-gpu-mem", "60KB",
                                    "--out", tmp_path / f"{parallel}.npy"])
        assert rc == 0, output
        np.testing.assert_array_equal(np.load(tmp_path / f"{parallel}.npy"),
                                      np.array(plain["tokens"]))
