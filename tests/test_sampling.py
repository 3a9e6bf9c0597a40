"""`generate` stops a row at end-of-sequence and samples on request (issue 16): the EOS ids a
checkpoint names, rows that stop early padded as transformers pads them, `--ignore-eos`,
transformers' greedy tokens unchanged, seeded sampling equal on every backend and budget, its
limits (temperature -> 0, a tiny top-p) equal greedy, sampled frequencies equal the softmax, and
bad values refused in one line."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from conftest import FIXTURES
from test_cli import assert_one_line_error, cli

from einpage.compiler import CompileOptions
from einpage.errors import CheckpointError, InputError
from einpage.models import generation, resolve
from einpage.models.generation import Sampling, TokenPicker, probabilities, sample
from einpage.models.text import EndOfSequence, TextCodec, end_of_sequence
from einpage.runners import PlanRunner, dense_runner

ALL_FIXTURES = ("tiny-llama-f32", "tiny-llama-bf16", "tiny-llama31", "tiny-mistral",
                "tiny-mixtral", "tiny-qwen2", "tiny-qwen3")


def _fixture(hf_fixture, name="tiny-llama-f32"):
    path = hf_fixture(name)
    cfg, weights = resolve(str(path))
    return path, cfg, weights, np.load(path / "greedy_prompt.npy"), np.load(
        path / "greedy_out.npy")


def _with_eos(tmp_path, source, eos, pad=None):
    """A copy of the fixture `source` whose generation_config.json names `eos` (and `pad`)."""
    path = tmp_path / source.name
    shutil.copytree(source, path)
    config = json.loads((path / "generation_config.json").read_text())
    config["eos_token_id"] = eos
    if pad is not None:
        config["pad_token_id"] = pad
    (path / "generation_config.json").write_text(json.dumps(config))
    return path


# ------------------------------------------------------------------ where EOS ids come from

def test_end_of_sequence_of_the_fixtures():
    for name in ALL_FIXTURES:
        if not (FIXTURES / name / "generation_config.json").is_file():
            pytest.skip(f"fixture {name} not found")
        want = (2,) if name.startswith("tiny-llama-") else (1,)
        assert end_of_sequence(FIXTURES / name).ids == want
    assert end_of_sequence(None) == EndOfSequence()  # a preset: never stops early


def test_end_of_sequence_precedence(tmp_path):
    def write(name, value):
        (tmp_path / name).write_text(json.dumps(value))
    assert end_of_sequence(tmp_path) == EndOfSequence()
    write("config.json", {"eos_token_id": 7, "pad_token_id": 3})
    assert end_of_sequence(tmp_path) == EndOfSequence((7,), 3, str(tmp_path / "config.json"))
    write("generation_config.json", {"eos_token_id": [9, 7], "bos_token_id": 1})
    got = end_of_sequence(tmp_path)
    assert got.ids == (9, 7) and got.pad_id == 3 and got.source.endswith("generation_config.json")
    write("generation_config.json", {"eos_token_id": None})  # null: not named here
    assert end_of_sequence(tmp_path).ids == (7,)
    write("config.json", {})
    write("generation_config.json", {})
    source = FIXTURES / "tiny-llama31"
    if (source / "tokenizer.json").is_file():  # the tokenizer's eos_token, the last resort
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(source / name, tmp_path / name)
        got = end_of_sequence(tmp_path)
        assert got.ids == (TextCodec.from_checkpoint(tmp_path).eos_id,) == (1,)
    for bad in ("2", -1, [], [1, 2.5], True):
        write("generation_config.json", {"eos_token_id": bad})
        with pytest.raises(CheckpointError, match="eos_token_id must be a token id"):
            end_of_sequence(tmp_path)


# ------------------------------------------------------------------ stopping

@pytest.mark.parametrize("name", ALL_FIXTURES)
def test_fixture_greedy_tokens_unchanged_with_eos(hf_fixture, name):
    """transformers' greedy tokens (no fixture row reaches its EOS) with the checkpoint's EOS
    ids on: every row equals them up to its EOS, and runs to the end."""
    path, cfg, weights, prompt, want = _fixture(hf_fixture, name)
    eos = end_of_sequence(path)
    got = generation.generate(cfg, prompt, want.shape[1], dense_runner(weights), eos_ids=eos.ids,
                              pad_id=eos.pad_id)
    for b, n in enumerate(got.new_lengths):
        np.testing.assert_array_equal(got.tokens[b, :n], want[b, :n])
    np.testing.assert_array_equal(got.tokens, want)
    assert got.finish == ("length",) * want.shape[0] and got.seed is None


def test_rows_stop_at_eos_and_are_padded(hf_fixture):
    """EOS forced: the id row 0 picks at its second step. Row 0 stops there and is padded with
    the first EOS id (or pad_id), row 1 runs on unchanged; two EOS ids stop both rows and end
    the generation early (fewer steps, fewer buckets)."""
    _, cfg, weights, prompt, want = _fixture(hf_fixture)
    run = dense_runner(weights)
    eos = int(want[0, 1])
    assert eos not in want[1].tolist()
    got = generation.generate(cfg, prompt, 5, run, granule=2, eos_ids=[eos])
    assert got.tokens[0].tolist() == [want[0, 0], eos, eos, eos, eos]
    np.testing.assert_array_equal(got.tokens[1], want[1])
    assert got.new_lengths == (2, 5) and got.finish == ("eos", "length")
    assert got.rows() == [want[0, :2].tolist(), want[1].tolist()]
    padded = generation.generate(cfg, prompt, 5, run, eos_ids=[eos], pad_id=5)
    assert padded.tokens[0, 2:].tolist() == [5, 5, 5]
    both = [eos, int(want[1, 2])]
    early = generation.generate(cfg, prompt, 5, run, granule=2, eos_ids=both)
    np.testing.assert_array_equal(early.tokens, [[want[0, 0], eos, both[0]], want[1, :3]])
    assert early.new_lengths == (2, 3) and early.finish == ("eos", "eos")
    assert early.decode_steps == 2 and early.capacities == (10, 12)  # not 13: never reached
    first = generation.generate(cfg, prompt, 5, run, eos_ids=want[:, 0].tolist())
    assert first.tokens.shape == (2, 1) and first.capacities == () and first.decode_steps == 0
    assert generation.greedy(cfg, prompt, 5, run, eos_ids=both).shape == (2, 3)


def test_ignore_eos_runs_to_max_new_tokens(hf_fixture):
    _, cfg, weights, prompt, want = _fixture(hf_fixture)
    got = generation.generate(cfg, prompt, 5, dense_runner(weights), eos_ids=want[:, 1].tolist(),
                              ignore_eos=True)
    np.testing.assert_array_equal(got.tokens, want)
    assert got.finish == ("length", "length") and got.new_lengths == (5, 5)


def test_picker_pads_finished_rows():
    picker = TokenPicker(3, eos_ids=[4, 2])
    logits = np.eye(6, dtype=np.float32)[[4, 1, 2]]
    assert picker(logits).tolist() == [4, 1, 2] and picker.finished.tolist() == [1, 0, 1]
    assert picker(np.eye(6)[[1, 2, 3]]).tolist() == [4, 2, 4]  # pad: the first EOS id
    assert picker.done and picker.new_lengths.tolist() == [1, 2, 1]
    assert picker.reasons() == ("eos", "eos", "eos")


def test_cli_stops_at_eos_and_says_where(capsys, tmp_path, hf_fixture):
    source, _, _, prompt, want = _fixture(hf_fixture)
    eos = int(want[0, 1])
    path = _with_eos(tmp_path, source, eos)
    ids = ["--tokens-file", source / "greedy_prompt.npy", "--max-new-tokens", 5]
    assert cli("generate", path, *ids, "--json") == 0
    got = json.loads(capsys.readouterr().out)
    assert got["tokens"] == [[want[0, 0], eos, eos, eos, eos], want[1].tolist()]
    assert got["new_lengths"] == [2, 5] and got["finish_reason"] == ["eos", "length"]
    assert got["eos_token_ids"] == [eos] and got["pad_token_id"] == eos
    assert got["sampling"] is None
    assert cli("generate", path, *ids) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"row 0: {want[0, 0]},{eos}"
    assert lines[1] == "row 1: " + ",".join(map(str, want[1]))
    assert lines[2] == ("stopped at EOS row 0 after 2 new tokens; 1 other row ran to "
                        f"--max-new-tokens (padded with id {eos} after it)")
    assert lines[3].startswith("prefill: ") and len(lines) == 4
    assert cli("generate", path, *ids, "--ignore-eos", "--json") == 0
    got = json.loads(capsys.readouterr().out)
    assert got["tokens"] == want.tolist() and got["finish_reason"] == ["length", "length"]
    assert got["eos_token_ids"] == [] and got["pad_token_id"] is None


def test_cli_text_ends_at_eos(capsys, tmp_path):
    """The tiny-llama31 fixture, its EOS set to the third id of its greedy continuation: the text
    is the decoded ids up to and including that EOS (special tokens kept, as transformers'
    decode does)."""
    source = FIXTURES / "tiny-llama31"
    if not (source / "tokenizer.json").is_file():
        pytest.skip("fixture tiny-llama31 not found")
    prompt = (source / "prompt.txt").read_text(encoding="utf-8")
    codec = TextCodec.from_checkpoint(source)
    cfg, weights = resolve(str(source))
    ids = generation.greedy(cfg, np.asarray([codec.encode(prompt)]), 8,
                            dense_runner(weights))[0].tolist()
    path = _with_eos(tmp_path, source, ids[2])
    assert cli("generate", path, "--prompt", prompt, "--max-new-tokens", 8,
               "--backend", "reference", "--json") == 0
    got = json.loads(capsys.readouterr().out)
    assert got["text"] == [codec.decode(ids[:3])] and got["new_lengths"] == [3]
    assert got["tokens"] == [ids[:3]] and got["finish_reason"] == ["eos"]
    assert cli("generate", path, "--prompt", prompt, "--max-new-tokens", 8,
               "--backend", "reference") == 0
    out = capsys.readouterr().out
    assert out.startswith(codec.decode(ids[:3]) + "\nstopped at EOS after 3 new tokens\n")


# ------------------------------------------------------------------ sampling

def test_seeded_sampling_is_reproducible_on_every_backend_and_budget(hf_fixture):
    _, cfg, weights, prompt, want = _fixture(hf_fixture)
    options = dict(temperature=1.0, top_p=0.95, seed=7)
    dense = generation.generate(cfg, prompt, 6, dense_runner(weights), granule=2, **options)
    assert dense.seed == 7 and dense.finish == ("length", "length")
    again = generation.generate(cfg, prompt, 6, dense_runner(weights), **options)
    np.testing.assert_array_equal(again.tokens, dense.tokens)
    for backend, budget in (("numpy", None), ("threads", None),
                            ("threads", cfg.weight_bytes() // 4)):
        runner = PlanRunner(weights, CompileOptions(budget), backend)
        got = generation.generate(cfg, prompt, 6, runner, granule=2, **options)
        np.testing.assert_array_equal(got.tokens, dense.tokens, err_msg=f"{backend} {budget}")
    other = generation.generate(cfg, prompt, 6, dense_runner(weights), temperature=1.0,
                                top_p=0.95, seed=8)
    assert not np.array_equal(other.tokens, dense.tokens)
    assert not np.array_equal(dense.tokens[:, :5], want)  # sampled, not the greedy tokens


def test_unseeded_sampling_reports_its_seed(hf_fixture):
    _, cfg, weights, prompt, _ = _fixture(hf_fixture)
    run = dense_runner(weights)
    got = generation.generate(cfg, prompt, 3, run, temperature=0.7)
    assert isinstance(got.seed, int) and 0 <= got.seed < 2 ** 32
    again = generation.generate(cfg, prompt, 3, run, temperature=0.7, seed=got.seed)
    np.testing.assert_array_equal(again.tokens, got.tokens)


def test_sampling_limits_equal_greedy(hf_fixture):
    """Temperature -> 0 and a nucleus of one token are the argmax."""
    _, cfg, weights, prompt, want = _fixture(hf_fixture)
    run = dense_runner(weights)
    for options in (dict(temperature=1e-6, seed=1), dict(temperature=1e-300, seed=2),
                    dict(temperature=1.0, top_p=1e-9, seed=3),
                    dict(temperature=5.0, top_k=1, seed=4)):
        got = generation.generate(cfg, prompt, 5, run, **options)
        np.testing.assert_array_equal(got.tokens, want, err_msg=str(options))


def test_sampled_frequencies_match_the_softmax():
    rng = np.random.default_rng(0)
    logits = (2 * rng.standard_normal(12)).astype(np.float32)
    draws = 200_000
    batch = np.broadcast_to(logits, (draws, logits.size))
    for sampling in (Sampling(1.0, seed=0), Sampling(0.5, seed=1), Sampling(2.0, top_k=4, seed=2),
                     Sampling(1.0, top_p=0.8, seed=3)):
        p = probabilities(logits[None], sampling)[0]
        got = np.bincount(sample(batch, sampling, np.random.default_rng(sampling.seed)),
                          minlength=logits.size) / draws
        tolerance = 5 * np.sqrt(p * (1 - p) / draws) + 1e-12
        assert (np.abs(got - p) <= tolerance).all(), (sampling, got, p)
        assert (got[p == 0] == 0).all()
    z = logits.astype(np.float64) / 0.5
    softmax = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
    np.testing.assert_allclose(probabilities(logits[None], Sampling(0.5))[0], softmax, rtol=1e-12)


def test_top_k_and_top_p_keep_what_transformers_keeps():
    p = np.array([0.15, 0.5, 0.05, 0.3])
    logits = np.log(p)[None].astype(np.float32)
    kept = lambda **kw: np.flatnonzero(probabilities(logits, Sampling(1.0, **kw))[0]).tolist()
    assert kept(top_p=0.8) == [1, 3]           # 0.15 has 0.8 ranked above it: out
    assert kept(top_p=0.81) == [0, 1, 3]
    assert kept(top_p=1e-9) == [1] and kept(top_p=1.0) == [0, 1, 2, 3]
    assert kept(top_k=2) == [1, 3] and kept(top_k=9) == [0, 1, 2, 3]
    assert kept(top_k=3, top_p=0.5) == [1]     # top-k first, then the nucleus
    np.testing.assert_allclose(probabilities(logits, Sampling(1.0, top_k=2))[0],
                               [0, 0.625, 0, 0.375], rtol=1e-6)
    tie = np.array([[1.0, 3.0, 3.0, 0.0]], np.float32)
    assert kept_tie(tie, top_p=1e-9) == [1]     # a tie: the lower id, as the argmax
    assert kept_tie(tie, top_k=1) == [1, 2]     # ties at the k-th value stay (transformers)
    assert probabilities(tie, Sampling()).tolist() == [[0, 1, 0, 0]]  # greedy: the argmax


def kept_tie(logits, **kw):
    return np.flatnonzero(probabilities(logits, Sampling(1.0, **kw))[0]).tolist()


def test_sampling_refuses_non_finite_logits():
    with pytest.raises(InputError, match="non-finite logits"):
        sample(np.array([[0.0, np.nan]]), Sampling(1.0, seed=0), np.random.default_rng(0))


# ------------------------------------------------------------------ bad values

@pytest.mark.parametrize("options, message", [
    (dict(temperature=-1.0), "temperature must be a finite number >= 0"),
    (dict(temperature=float("nan")), "temperature must be a finite number >= 0"),
    (dict(temperature=float("inf")), "temperature must be a finite number >= 0"),
    (dict(temperature=1.0, top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(temperature=1.0, top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(temperature=1.0, top_p=float("nan")), r"top_p must be in \(0, 1\]"),
    (dict(temperature=1.0, top_k=-1), "top_k must be an integer >= 0"),
    (dict(temperature=1.0, top_k=2.5), "top_k must be an integer >= 0"),
    (dict(temperature=1.0, seed=-1), "seed must be an integer >= 0"),
    (dict(temperature=1.0, seed="7"), "seed must be an integer >= 0"),
    (dict(top_p=0.9), "top_p applies to sampling only"),
    (dict(top_k=5, seed=1), "top_k and seed apply to sampling only"),
    (dict(eos_ids=[300]), "an EOS id 300 out of range for a vocabulary of 256"),
    (dict(eos_ids=[-1]), "an EOS id -1 out of range"),
    (dict(eos_ids=[2], pad_id=256), "the pad id 256 out of range"),
    (dict(eos_ids=["2"]), "an EOS id must be an integer"),
])
def test_api_bad_values_are_input_errors(hf_fixture, options, message):
    _, cfg, weights, prompt, _ = _fixture(hf_fixture)
    with pytest.raises(InputError, match=message):
        generation.generate(cfg, prompt, 2, dense_runner(weights), **options)


@pytest.mark.parametrize("flags, message", [
    ("--temperature -0.5", "--temperature must be a finite number >= 0 (0: greedy), got -0.5"),
    ("--temperature nan", "--temperature must be a finite number >= 0"),
    ("--temperature inf", "--temperature must be a finite number >= 0"),
    ("--temperature 1 --top-p 0", "--top-p must be in (0, 1], got 0.0"),
    ("--temperature 1 --top-p 1.01", "--top-p must be in (0, 1], got 1.01"),
    ("--temperature 1 --top-k 0", "--top-k must be at least 1"),
    ("--temperature 1 --seed -3", "--seed must be >= 0, got -3"),
    ("--top-p 0.9", "--top-p applies to sampling only"),
    ("--top-p 0.9 --top-k 3", "--top-p and --top-k apply to sampling only"),
    ("--seed 3", "--seed seeds --random-weights and sampling, and this run has neither"),
    ("--temperature x", "argument --temperature: invalid float value: 'x'"),
])
def test_cli_bad_values_are_one_line(capsys, hf_fixture, flags, message):
    path = hf_fixture("tiny-llama-f32")
    code = cli("generate", path, "--tokens", "1,2", "--max-new-tokens", 2, *flags.split())
    assert_one_line_error(capsys, code, message)


def test_cli_samples_a_preset_with_one_seed(capsys):
    """A preset has no EOS ids (never stops early); `--seed` seeds its random weights and the
    sampler, and the run repeats."""
    argv = ("generate", "tiny", "--random-weights", "--tokens", "1,2,3", "--max-new-tokens", 4,
            "--temperature", 0.8, "--top-k", 20, "--seed", 5, "--backend", "reference")
    assert cli(*argv, "--json") == 0
    got = json.loads(capsys.readouterr().out)
    assert got["sampling"] == {"temperature": 0.8, "top_p": 1.0, "top_k": 20, "seed": 5}
    assert got["finish_reason"] == ["length"] and got["eos_token_ids"] == []
    assert cli(*argv, "--json") == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == got["tokens"]
    assert cli(*argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "sampled at temperature 0.8, top-k 20, seed 5 (--seed repeats it)"
    assert cli("generate", "tiny", "--random-weights", "--tokens", "1", "--max-new-tokens", 2,
               "--seed", 5, "--backend", "reference") == 0  # greedy: --seed seeds the weights


def test_cli_eos_outside_the_vocabulary_names_its_file(capsys, tmp_path, hf_fixture):
    path = _with_eos(tmp_path, hf_fixture("tiny-llama-f32"), [2, 999])
    code = cli("generate", path, "--tokens", "1,2", "--max-new-tokens", 2)
    err = assert_one_line_error(capsys, code, "an EOS id 999 out of range for a vocabulary of 256")
    assert "generation_config.json: " in err
    (path / "generation_config.json").write_text('{"eos_token_id": "</s>"}')
    code = cli("generate", path, "--tokens", "1,2", "--max-new-tokens", 2)
    assert_one_line_error(capsys, code, "eos_token_id must be a token id or a list of token ids")
