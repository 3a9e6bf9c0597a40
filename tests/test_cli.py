"""The command line, run in-process: what it prints and saves, and that every user error ends in
exactly one line on stderr with exit status 2."""
from __future__ import annotations

import json

import llama_oracle
import numpy as np
import pytest
from checkpoints import write_checkpoint, write_safetensors

from einpage.cli import main


def cli(*argv) -> int:
    """`einpage ARGV...`; the exit status (argparse's own errors exit through SystemExit)."""
    try:
        return main([str(a) for a in argv])
    except SystemExit as exc:
        return exc.code


def assert_one_line_error(capsys, code, message):
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith("einpage: error: ") and "Traceback" not in err
    assert message in err, err
    return err


@pytest.fixture
def f32_fixture(hf_fixture):
    return hf_fixture("tiny-llama-f32")


def test_models_lists_presets(capsys):
    assert cli("models") == 0
    out, err = capsys.readouterr()
    assert err == ""
    lines = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert {"llama-7b", "llama-65b", "llama2-70b", "llama3-8b", "tiny"} <= set(lines)
    assert "65.29B" in lines["llama-65b"] and "130.57 GB" in lines["llama-65b"]
    assert {"llama3.1-8b", "llama3.1-70b", "llama3.1-405b", "llama3.2-1b", "llama3.2-3b",
            "mistral-7b", "qwen2.5-7b", "qwen2.5-72b", "qwen3-8b", "qwen3-32b", "mixtral-8x7b",
            "mixtral-8x22b"} <= set(lines)
    mixtral = lines["mixtral-8x7b"].split()
    assert mixtral[1:5] == ["mixtral", "46.70B", "12.88B", "93.41"]
    assert lines["mixtral-8x7b"].endswith("top-2 of 8 experts")
    assert "window 4096" in lines["mistral-7b"] and "rope llama3 x8" in lines["llama3.1-70b"]


@pytest.mark.parametrize("argv", [
    "compile mixtral-8x7b --gpu-mem 16GB --json",
    "compile llama3.1-70b --gpu-mem 24GB --json",
    "compile qwen3-8b --gpu-mem 8GB --phase decode --past 512 --batch 4 --json",
    "compile mistral-7b --gpu-mem 8GB --seq 4096 --json",
])
def test_family_presets_compile(capsys, argv):
    # efficiency against the problem's bound; a host budget of this machine's memory would make
    # it depend on the machine (the disk tier), so the host budget is unlimited
    assert cli(*argv.split(), "--cpu-mem", "unlimited") == 0
    report = json.loads(capsys.readouterr().out)
    assert report["efficiency"] > 0.9


def test_run_prints_next_token(capsys, f32_fixture):
    assert cli("run", f32_fixture, "--tokens", "1,2,3") == 0
    out, err = capsys.readouterr()
    cfg, weights = llama_oracle.load_hf_checkpoint(f32_fixture)
    logits, _ = llama_oracle.forward(cfg, weights, np.array([[1, 2, 3]]))
    assert out == f"row 0: next token {int(np.argmax(logits[0, -1]))}\n"
    assert err == ""


def test_run_saves_logits(capsys, tmp_path, f32_fixture, record_error):
    out_file = tmp_path / "logits.npy"
    assert cli("run", f32_fixture, "--tokens-file", f32_fixture / "input_ids.npy",
               "--out", out_file) == 0
    assert "saved logits (2, 17, 256)" in capsys.readouterr().out
    got = np.load(out_file)
    want = np.load(f32_fixture / "logits.npy")
    assert got.dtype == np.float32 and got.shape == want.shape
    err = float(np.abs(got - want).max())
    record_error("tiny-llama-f32: CLI run vs transformers", err)
    assert err < 1e-5


def test_generate_saves_new_tokens(capsys, tmp_path, f32_fixture):
    out_file = tmp_path / "new.npy"
    assert cli("generate", f32_fixture, "--tokens-file", f32_fixture / "greedy_prompt.npy",
               "--max-new-tokens", 5, "--out", out_file) == 0
    assert "saved new tokens (2, 5)" in capsys.readouterr().out
    got = np.load(out_file)
    assert got.dtype == np.int64 and got.shape == (2, 5)
    np.testing.assert_array_equal(got, np.load(f32_fixture / "greedy_out.npy"))


def test_generate_prints_rows(capsys, f32_fixture):
    prompt = np.load(f32_fixture / "greedy_prompt.npy")[:1]
    want = np.load(f32_fixture / "greedy_out.npy")[0, :3]
    assert cli("generate", f32_fixture, "--tokens", ",".join(map(str, prompt[0])),
               "--max-new-tokens", 3) == 0
    rows, rates = capsys.readouterr().out.splitlines()
    assert rows == "row 0: " + ",".join(map(str, want))
    assert rates.startswith("prefill: 1x9 tokens in ") and "decode: 2 steps in" in rates


def test_random_weights_are_deterministic(capsys, tmp_path):
    runs = []
    for k, seed in enumerate((3, 3, 4)):
        path = tmp_path / f"{k}.npy"
        assert cli("run", "tiny", "--random-weights", "--seed", seed, "--tokens", "1,2",
                   "--out", path) == 0
        runs.append(np.load(path))
    np.testing.assert_array_equal(runs[0], runs[1])
    assert runs[0].shape == (1, 2, 64) and not np.array_equal(runs[0], runs[2])
    capsys.readouterr()
    assert cli("run", "tiny", "--random-weights", "--seed", 3, "--tokens", "1,2") == 0
    first = capsys.readouterr().out
    assert cli("run", "tiny", "--random-weights", "--seed", 3, "--tokens", "1,2") == 0
    assert capsys.readouterr().out == first == (
        f"row 0: next token {int(np.argmax(runs[0][0, -1]))}\n")


# ------------------------------------------------------------------ errors


def test_no_such_directory(capsys, tmp_path):
    code = cli("run", tmp_path / "absent", "--tokens", "1")
    assert_one_line_error(capsys, code, "absent: no such checkpoint directory")


def test_unknown_preset(capsys):
    code = cli("run", "llama-8b", "--random-weights", "--tokens", "1")
    assert_one_line_error(capsys, code, "unknown model 'llama-8b'; presets: llama-7b")


def test_preset_without_random_weights(capsys):
    code = cli("generate", "llama-7b", "--tokens", "1", "--max-new-tokens", 2)
    assert_one_line_error(capsys, code, "llama-7b: a preset has no weights; pass --random-weights")


def test_unknown_model_type(capsys, tmp_path):
    path = write_checkpoint(tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "gpt_neox"
    (path / "config.json").write_text(json.dumps(config))
    code = cli("run", path, "--tokens", "1")
    assert_one_line_error(capsys, code, "model_type 'gpt_neox' is not supported")


def test_missing_tensor(capsys, tmp_path):
    path = write_checkpoint(tmp_path / "ckpt")
    tensors = llama_oracle.read_safetensors(path / "model.safetensors")
    del tensors["model.norm.weight"]
    write_safetensors(path / "model.safetensors", tensors)
    code = cli("run", path, "--tokens", "1")
    assert_one_line_error(capsys, code, "missing tensor 'model.norm.weight'")


@pytest.mark.parametrize("content, message", [
    (b"1,2,3\n", "not a .npy array"),
    (np.array([1, 2, 3]), "integer array of shape (batch, length), got int64 (3,)"),
    (np.array([[1.0, 2.0]]), "integer array of shape (batch, length), got float64 (1, 2)"),
    (None, "no such token file"),
])
def test_bad_token_file(capsys, tmp_path, content, message):
    path = tmp_path / "ids.npy"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        np.save(path, content)
    code = cli("run", "tiny", "--random-weights", "--tokens-file", path)
    assert_one_line_error(capsys, code, message)


@pytest.mark.parametrize("tokens, message", [
    ("1,2,64", "token id 64 out of range for a vocabulary of 64"),
    ("=-3,2", "token id -3 out of range for a vocabulary of 64"),
    ("1,x", "--tokens '1,x': expected comma-separated integers"),
    (",", "--tokens is empty"),
])
def test_bad_tokens(capsys, tokens, message):
    args = ["--tokens" + tokens] if tokens.startswith("=") else ["--tokens", tokens]
    code = cli("run", "tiny", "--random-weights", *args)
    assert_one_line_error(capsys, code, message)


def test_token_out_of_range_in_file(capsys, tmp_path, f32_fixture):
    np.save(tmp_path / "ids.npy", np.array([[1, 256]]))
    code = cli("generate", f32_fixture, "--tokens-file", tmp_path / "ids.npy",
               "--max-new-tokens", 2)
    assert_one_line_error(capsys, code, "token id 256 out of range for a vocabulary of 256")


def test_max_new_tokens_zero(capsys):
    code = cli("generate", "tiny", "--random-weights", "--tokens", "1", "--max-new-tokens", 0)
    assert_one_line_error(capsys, code, "--max-new-tokens must be at least 1, got 0")


@pytest.mark.parametrize("argv, message", [
    (["run", "tiny", "--random-weights"],
     "one of the arguments --prompt --prompt-file --tokens --tokens-file is required"),
    (["generate", "tiny", "--tokens", "1"], "--max-new-tokens"),
    (["run", "tiny", "--tokens", "1", "--dtype", "f8"], "invalid choice: 'f8'"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
])
def test_bad_arguments(capsys, argv, message):
    assert_one_line_error(capsys, cli(*argv), message)
