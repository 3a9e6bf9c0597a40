"""Every model family, both phases, through the plan file: `einpage compile -o`, `einpage inspect`
(the plan proves what it computes), and a run of the plan read back, on the family's Hugging Face
fixture. Prefill runs through `einpage run` and meets transformers' logits; a decode step (which
`run` does not take: it lives inside a generation) runs through the API from the file and meets
the dense reference on a random KV store. Budgets are a quarter of the weights: every plan pages.

This is the test behind "a model cannot write what a reader refuses": a family whose graph uses
an expression the plan reader does not know fails here at `inspect` (as Mixtral's router once
did with `Eq`)."""
from __future__ import annotations

import numpy as np
import pytest
from test_cli import cli

from einpage.ir import MemGraph
from einpage.models import llama, resolve
from einpage.runtime import reference, run

FIXTURES = ["tiny-llama-f32", "tiny-llama-bf16", "tiny-llama31", "tiny-mistral", "tiny-qwen2",
            "tiny-qwen3", "tiny-mixtral"]


def _budget(cfg) -> str:
    return f"{max(16, cfg.weight_bytes() // 4 // 1000)}KB"


def _compile_and_inspect(capsys, path, tmp_path, *flags) -> MemGraph:
    cfg, _ = resolve(str(path))
    plan = tmp_path / "plan.json"
    assert cli("compile", path, "--gpu-mem", _budget(cfg), "--quiet", "-o", plan, *flags) == 0
    capsys.readouterr()
    assert cli("inspect", plan) == 0
    out, err = capsys.readouterr()
    assert "proven to compute its graph sha256:" in out and not err, (out, err)
    mg = MemGraph.load(plan)
    assert mg.count("reload") > 0  # it pages
    return mg


@pytest.mark.parametrize("name", FIXTURES)
def test_prefill_plan_file_runs_right(capsys, hf_fixture, tmp_path, name):
    path = hf_fixture(name)
    ids = np.load(path / "input_ids.npy")
    np.save(tmp_path / "ids.npy", ids)
    _compile_and_inspect(capsys, path, tmp_path, "--batch", ids.shape[0], "--seq", ids.shape[1])
    out = tmp_path / "logits.npy"
    assert cli("run", tmp_path / "plan.json", "--checkpoint", path, "--tokens-file",
               tmp_path / "ids.npy", "--out", out) == 0
    want = np.load(path / "logits.npy")
    got = np.load(out)
    assert got.shape == want.shape
    # float32 blocked sums against transformers' float32: rounding of ~1e-5 at logits of ~3
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", FIXTURES)
def test_decode_plan_file_runs_right(capsys, hf_fixture, tmp_path, name):
    path = hf_fixture(name)
    cfg, weights = resolve(str(path))
    past = 5
    mg = _compile_and_inspect(capsys, path, tmp_path, "--phase", "decode", "--past", past)
    capacity = mg.meta["capacity"]
    rng = np.random.default_rng(0)
    inputs = {"tokens": rng.integers(0, cfg.vocab, (1, 1)), "pos": np.array([past])}
    for t in mg.inputs:
        if t.role == "cache":
            inputs[t.name] = rng.standard_normal(t.shape).astype(t.dtype.numpy)
    got = run(mg, inputs, weights)  # validated from the file: the one load path
    want = reference.evaluate(llama.decode_graph(cfg).bind(B=1, C=capacity), inputs, weights)
    assert set(got) == set(want)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], atol=1e-4, rtol=1e-5, err_msg=key)
