"""Text in and out (issue 13): the checkpoint's own tokenizer against the ids and text Hugging Face
transformers wrote into `tests/fixtures/tiny-<family>/`, ragged batches (rows padded on the
right) whose every row answers as its own run, on the reference and on plans under a budget,
and the command line's `--prompt` / `--prompt-file` / `--json` text, streamed output and
one-line errors. The last tests run the real fixtures end to end: `einpage generate DIR --prompt
"$(cat prompt.txt)" --max-new-tokens 8` prints exactly `generated.txt`."""
from __future__ import annotations

import io
import json
import shutil

import numpy as np
import pytest
from checkpoints import write_checkpoint
from conftest import FIXTURES
from test_cli import assert_one_line_error, cli

from einpage.cli.execute import TextPrinter, cmd_generate
from einpage.cli.main import build_parser
from einpage.compiler import CompileOptions
from einpage.errors import CheckpointError
from einpage.models import generation, resolve
from einpage.models.text import TextCodec
from einpage.runners import PlanRunner, dense_runner

TEXT_FIXTURES = ("tiny-llama31", "tiny-mistral", "tiny-qwen2", "tiny-qwen3", "tiny-mixtral")
F32_ATOL = 1e-5

#: the 8 greedy ids behind each fixture's generated.txt (einpage's, whose text equals it)
GENERATED_IDS = {"tiny-llama31": [96, 84, 167, 87, 207, 168, 73, 240],
                 "tiny-mistral": [215, 220, 251, 51, 30, 33, 80, 198],
                 "tiny-mixtral": [112, 164, 49, 143, 50, 29, 221, 55],
                 "tiny-qwen2": [134, 192, 26, 257, 34, 11, 217, 10],
                 "tiny-qwen3": [46, 9, 133, 70, 28, 186, 189, 189]}


def text_fixture(name: str):
    """`tests/fixtures/<name>` with its tokenizer and texts, or skip."""
    path = FIXTURES / name
    if not all((path / f).is_file() for f in ("tokenizer.json", "prompt.txt", "generated.txt",
                                              "model.safetensors")):
        pytest.skip(f"fixture {path} with a tokenizer not found (expected in tests/fixtures/)")
    return path


def read(path) -> str:
    return path.read_text(encoding="utf-8")


@pytest.fixture
def text_ckpt(tmp_path):
    """A synthetic checkpoint of vocabulary 260 with tiny-llama31's tokenizer."""
    source = text_fixture("tiny-llama31")
    path = write_checkpoint(tmp_path / "ckpt", vocab=260, seed=5)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, path / name)
    return path


# ------------------------------------------------------------------ the codec

@pytest.mark.parametrize("name", TEXT_FIXTURES)
def test_encode_equals_transformers_ids(name):
    path = text_fixture(name)
    codec = TextCodec.from_checkpoint(path)
    assert codec.encode(read(path / "prompt.txt")) == np.load(path / "prompt_ids.npy")[0].tolist()
    assert (codec.bos_id, codec.eos_id) == (0, 1)


@pytest.mark.parametrize("name", TEXT_FIXTURES)
def test_decode_all_new_ids_equals_generated_text(name):
    """No generated id is special, so both skip_special_tokens settings reproduce the text; the
    codec keeps special tokens (transformers' decode default)."""
    path = text_fixture(name)
    codec = TextCodec.from_checkpoint(path)
    assert codec.decode(GENERATED_IDS[name]) == read(path / "generated.txt")


def test_decode_keeps_special_tokens_and_decodes_all_ids_at_once():
    codec = TextCodec.from_checkpoint(text_fixture("tiny-llama31"))
    assert codec.decode([0, 85, 1]) == "<s>t</s>"
    ids = codec.encode("é")[1:]  # two byte-level tokens for one character
    assert len(ids) == 2 and codec.decode(ids) == "é"
    assert "".join(codec.decode([i]) for i in ids) == "\ufffd\ufffd"


def _tokenizer_dir(tmp_path, config):
    path = tmp_path / "tok"
    path.mkdir(parents=True)
    shutil.copy(text_fixture("tiny-llama31") / "tokenizer.json", path / "tokenizer.json")
    if config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("config, head, tail", [
    ({"bos_token": "<s>", "add_bos_token": True}, [0], []),
    ({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, "add_eos_token": True},
     [0], [1]),
    ({"bos_token": "<s>", "add_bos_token": False}, [], []),
    ({"bos_token": {"content": "<s>", "special": True}, "eos_token": "</s>",
      "add_eos_token": True}, [], [1]),
    ({"bos_token": "<s>"}, [0], []),   # no add_*_token: the post-processor adds <s>
    (None, [0], []),                   # no tokenizer_config.json at all
])
def test_bos_rule(tmp_path, config, head, tail):
    codec = TextCodec.from_checkpoint(_tokenizer_dir(tmp_path, config))
    plain = [85, 73, 70]  # "the"
    assert codec.encode("the") == head + plain + tail


def test_clean_up_tokenization_spaces(tmp_path):
    codec = TextCodec.from_checkpoint(_tokenizer_dir(tmp_path, {
        "clean_up_tokenization_spaces": True, "add_bos_token": False}))
    assert codec.decode(codec.encode("a , b .")) == "a, b."
    plain = TextCodec.from_checkpoint(_tokenizer_dir(tmp_path / "x", {"add_bos_token": False}))
    assert plain.decode(plain.encode("a , b .")) == "a , b ."


def test_stream_holds_back_an_incomplete_character():
    codec = TextCodec.from_checkpoint(text_fixture("tiny-llama31"))
    ids = codec.encode("hé y")[1:]
    stream = codec.stream()
    pieces = [stream.push([i]) for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + stream.finish() == "hé y"
    assert pieces[1] == ""  # the first byte of é: held until the second comes


@pytest.mark.parametrize("files, message", [
    ({}, "no tokenizer.json: this checkpoint has no tokenizer"),
    ({"tokenizer.json": "{not json"}, "not a tokenizer the tokenizers library can read"),
    ({"tokenizer.json": "{}"}, "not a tokenizer the tokenizers library can read"),
    ({"tokenizer_config.json": "[1, 2"}, "tokenizer_config.json: not valid JSON"),
    ({"tokenizer_config.json": "[1]"}, "expected a JSON object, got list"),
    ({"tokenizer_config.json": '{"add_bos_token": true}'},
     "add_bos_token is set but bos_token names no token"),
    ({"tokenizer_config.json": '{"add_bos_token": true, "bos_token": 3}'},
     "bos_token must be a string"),
])
def test_codec_errors(tmp_path, files, message):
    path = _tokenizer_dir(tmp_path, None)
    if "tokenizer.json" not in files and not files:
        (path / "tokenizer.json").unlink()
    for name, text in files.items():
        (path / name).write_text(text)
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(")):
        TextCodec.from_checkpoint(path)


# ------------------------------------------------------------------ ragged batches

PROMPTS = ["the memory graph of a large model", "paged", "of a large"]


def _ragged(text_ckpt):
    cfg, weights = resolve(str(text_ckpt))
    codec = TextCodec.from_checkpoint(text_ckpt)
    rows = [codec.encode(p) for p in PROMPTS]
    tokens, lengths = generation.pad_rows(rows)
    assert lengths.tolist() == [len(r) for r in rows] and len(set(lengths.tolist())) == 3
    return cfg, weights, rows, tokens, lengths


@pytest.mark.parametrize("paged", [False, True])
def test_each_ragged_row_answers_as_its_own_run(text_ckpt, paged):
    cfg, weights, rows, tokens, lengths = _ragged(text_ckpt)
    dense = dense_runner(weights)
    run = (PlanRunner(weights, CompileOptions(cfg.weight_bytes() // 4), "threads") if paged
           else dense)
    out = generation.prefill(cfg, tokens, run, lengths)
    done = generation.generate(cfg, tokens, 6, run, granule=4, lengths=lengths)
    assert done.lengths == tuple(lengths.tolist())
    last = generation.last_logits(out["logits"], lengths)
    for b, row in enumerate(rows):
        alone = np.asarray([row])
        own = generation.prefill(cfg, alone, dense)["logits"][0]
        assert np.abs(out["logits"][b, :len(row)] - own).max() < F32_ATOL
        assert np.abs(last[b] - own[-1]).max() < F32_ATOL
        np.testing.assert_array_equal(done.tokens[b],
                                      generation.greedy(cfg, alone, 6, dense, granule=4)[0])
    if paged:
        assert any(p.compiled.report.traffic.reload_bytes > 0 for p in run.passes)


def test_ragged_rates_count_real_tokens(text_ckpt):
    cfg, weights, rows, tokens, lengths = _ragged(text_ckpt)
    done = generation.generate(cfg, tokens, 2, dense_runner(weights), lengths=lengths)
    assert done.rates()["prefill_tokens_per_s"] == pytest.approx(
        sum(len(r) for r in rows) / done.prefill_s)


@pytest.mark.parametrize("lengths, message", [
    ([3, 0, 1], "outside 1.."), ([1, 2], "must be 3 integers"), ([1.0, 2.0, 3.0], "integers")])
def test_bad_lengths(text_ckpt, lengths, message):
    cfg, weights, _, tokens, _ = _ragged(text_ckpt)
    from einpage.errors import InputError
    with pytest.raises(InputError, match=message):
        generation.generate(cfg, tokens, 2, dense_runner(weights), lengths=np.array(lengths))


# ------------------------------------------------------------------ command line

def test_generate_prompt_prints_text_then_rates(capsys, text_ckpt):
    cfg, weights = resolve(str(text_ckpt))
    codec = TextCodec.from_checkpoint(text_ckpt)
    want = generation.greedy(cfg, np.asarray([codec.encode("the memory")]), 5,
                             dense_runner(weights))[0]
    assert cli("generate", text_ckpt, "--prompt", "the memory", "--max-new-tokens", 5) == 0
    out = capsys.readouterr().out
    text = codec.decode(want)
    assert out.startswith(text + "\n")
    rates = out[len(text) + 1:]
    assert rates.startswith("prefill: 1x11 tokens in ") and rates.count("\n") == 1


def test_generate_json_batch(capsys, tmp_path, text_ckpt):
    cfg, weights = resolve(str(text_ckpt))
    codec = TextCodec.from_checkpoint(text_ckpt)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n", encoding="utf-8")
    assert cli("generate", text_ckpt, "--prompt-file", prompts, "--max-new-tokens", 4,
               "--gpu-mem", cfg.weight_bytes() // 4, "--backend", "threads", "--json") == 0
    got = json.loads(capsys.readouterr().out)
    rows = [codec.encode(p) for p in PROMPTS]
    assert got["prompt_lengths"] == [len(r) for r in rows] and got["batch"] == 3
    for b, row in enumerate(rows):
        alone = generation.greedy(cfg, np.asarray([row]), 4, dense_runner(weights))[0]
        assert got["tokens"][b] == alone.tolist()
        assert got["text"][b] == codec.decode(alone)
    for key in ("plans_compiled", "prefill_s", "decode_s", "decode_tokens_per_s",
                "kv_capacities", "new_tokens", "prompt"):
        assert key in got


def test_generate_batch_prints_each_row(capsys, text_ckpt):
    assert cli("generate", text_ckpt, "--prompt", "the", "--prompt", "a large model",
               "--max-new-tokens", 2) == 0
    out = capsys.readouterr().out
    assert out.startswith("row 0: ") and "\nrow 1: " in out
    assert "prefill: 18 (2 rows of 4..14) tokens in" in out


def test_generate_tokens_keep_ids_output_and_json_adds_text(capsys, text_ckpt):
    assert cli("generate", text_ckpt, "--tokens", "0,85,73,70", "--max-new-tokens", 3) == 0
    assert capsys.readouterr().out.startswith("row 0: ")
    assert cli("generate", text_ckpt, "--tokens", "0,85,73,70", "--max-new-tokens", 3,
               "--json") == 0
    got = json.loads(capsys.readouterr().out)
    codec = TextCodec.from_checkpoint(text_ckpt)
    assert got["text"] == [codec.decode(got["tokens"][0])] and got["prompt_lengths"] == [4]


def test_run_prompt_prints_next_token_and_text(capsys, text_ckpt):
    cfg, weights = resolve(str(text_ckpt))
    codec = TextCodec.from_checkpoint(text_ckpt)
    assert cli("run", text_ckpt, "--prompt", PROMPTS[0], "--prompt", PROMPTS[1]) == 0
    lines = capsys.readouterr().out.splitlines()
    for b, prompt in enumerate(PROMPTS[:2]):
        logits = generation.prefill(cfg, np.asarray([codec.encode(prompt)]),
                                    dense_runner(weights))["logits"]
        token = int(np.argmax(logits[0, -1]))
        assert lines[b] == (f"row {b}: next token {token} "
                            f"{json.dumps(codec.decode([token]), ensure_ascii=False)}")


def test_run_prompt_saves_padded_logits(capsys, tmp_path, text_ckpt):
    out_file = tmp_path / "logits.npy"
    assert cli("run", text_ckpt, "--prompt", PROMPTS[0], "--prompt", PROMPTS[1],
               "--out", out_file) == 0
    out = capsys.readouterr().out
    assert "saved logits (2, 34, 260)" in out and "row lengths 34,6" in out
    assert np.load(out_file).shape == (2, 34, 260)


class FakeTTY(io.StringIO):
    def __init__(self):
        super().__init__()
        self.writes: list[str] = []

    def isatty(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.writes.append(text)
        return super().write(text)


def test_generate_streams_one_row_on_a_terminal(text_ckpt):
    args = build_parser().parse_args(["generate", str(text_ckpt), "--prompt", "the memory",
                                      "--max-new-tokens", "6"])
    tty = FakeTTY()
    cmd_generate(args, out=tty)
    codec = TextCodec.from_checkpoint(text_ckpt)
    cfg, weights = resolve(str(text_ckpt))
    new = generation.greedy(cfg, np.asarray([codec.encode("the memory")]), 6,
                            dense_runner(weights))[0]
    text = codec.decode(new)
    assert tty.getvalue().startswith(text + "\n")
    streamed = tty.writes[:tty.writes.index(next(w for w in tty.writes if w.endswith("\n")))]
    assert len(tty.writes) > 2 and all(not w.endswith("\ufffd") for w in streamed)


def test_text_printer_streams_as_tokens_come():
    codec = TextCodec.from_checkpoint(text_fixture("tiny-llama31"))
    ids = codec.encode("hé y")[1:]
    tty = FakeTTY()
    printer = TextPrinter(codec, 1, tty)
    for i in ids:
        printer.on_token(np.array([i]))
        if i == ids[1]:
            assert tty.getvalue() == "h"  # the first byte of é is held back
    printer.finish([codec.decode(ids)])
    assert tty.getvalue() == "hé y\n" and len(tty.writes) >= 3
    plain = io.StringIO()  # not a terminal: the text once, at the end
    printer = TextPrinter(codec, 1, plain)
    printer.on_token(np.array([ids[0]]))
    assert plain.getvalue() == ""
    printer.finish([codec.decode(ids)])
    assert plain.getvalue() == "hé y\n"


# ------------------------------------------------------------------ errors

def test_prompt_without_tokenizer(capsys, tmp_path):
    path = write_checkpoint(tmp_path / "ckpt", vocab=260)
    code = cli("generate", path, "--prompt", "hi", "--max-new-tokens", 2)
    assert_one_line_error(capsys, code, "no tokenizer.json: this checkpoint has no tokenizer")


def test_prompt_with_a_preset(capsys):
    code = cli("run", "tiny", "--random-weights", "--prompt", "hi")
    assert_one_line_error(capsys, code, "need a checkpoint directory with a tokenizer.json")


def test_malformed_tokenizer(capsys, text_ckpt):
    (text_ckpt / "tokenizer.json").write_text('{"model": 3')
    code = cli("run", text_ckpt, "--prompt", "hi")
    assert_one_line_error(capsys, code, "not a tokenizer the tokenizers library can read")


@pytest.mark.parametrize("content, message", [
    (b"", "the prompt file is empty"),
    (b"\n", "the prompt file is empty"),
    (b"one\n\nthree\n", "line 2 is empty"),
    (b"\xff\xfe\x00bad", "not UTF-8 text"),
    (None, "no such prompt file"),
    ("dir", "cannot read prompt file"),
])
def test_bad_prompt_file(capsys, tmp_path, text_ckpt, content, message):
    path = tmp_path / "prompts.txt"
    if content == "dir":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    code = cli("generate", text_ckpt, "--prompt-file", path, "--max-new-tokens", 2)
    assert_one_line_error(capsys, code, message)


@pytest.mark.parametrize("argv, message", [
    (["--prompt", ""], "--prompt is empty"),
    (["--prompt", "a", "--prompt", ""], "--prompt 2 is empty"),
    (["--prompt", "x" * 200], "a prompt of 201 tokens needs 201 positions; the model's context "
                              "is 128"),
    (["--prompt", "x" * 120, "--max-new-tokens", "20"], "a prompt of 121 tokens and 20 new "
                                                        "tokens needs 140 positions"),
    (["--prompt", "a", "--tokens", "1"], "not allowed with argument"),
])
def test_bad_prompt(capsys, text_ckpt, argv, message):
    command = "generate" if "--max-new-tokens" in argv else "run"
    assert_one_line_error(capsys, cli(command, text_ckpt, *argv), message)


def test_missing_input_names_every_option(capsys, text_ckpt):
    assert_one_line_error(capsys, cli("run", text_ckpt), "one of the arguments --prompt "
                                                         "--prompt-file --tokens --tokens-file")


# ------------------------------------------------------------------ the real fixtures, end to end

@pytest.mark.parametrize("paged", [False, True], ids=["reference", "paged"])
@pytest.mark.parametrize("name", TEXT_FIXTURES)
def test_fixture_generate_prints_generated_text(capsys, name, paged):
    """`einpage generate DIR --prompt "$(cat prompt.txt)" --max-new-tokens 8` prints exactly
    transformers' generated.txt: on the reference, and on plans with a quarter of the weights."""
    path = text_fixture(name)
    if paged:
        cfg, _ = resolve(str(path))
        backend = ["--gpu-mem", str(cfg.weight_bytes() // 4), "--backend", "threads"]
    else:
        backend = ["--backend", "reference"]
    assert cli("generate", path, "--prompt", read(path / "prompt.txt"), "--max-new-tokens", 8,
               *backend) == 0
    out = capsys.readouterr().out
    want = read(path / "generated.txt")
    assert out.startswith(want + "\n"), (out, want)
    assert out[len(want) + 1:].startswith("prefill: 1x")
