"""Conversations (`einpage.models.conversation`, `einpage chat`, `generate --chat`): each turn
rendered with the checkpoint's chat template, the KV rows of the turns before kept, only the
new tokens prefilled; a reply equals what a fresh conversation given the whole history
replies, and what `generate` makes from the rendered text."""
from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from test_cli import assert_one_line_error as one_line
from test_cli import cli

from einpage import runners
from einpage.compiler import CompileOptions
from einpage.errors import InputError
from einpage.models import resolve
from einpage.models.chat import ChatTemplate
from einpage.models.conversation import Conversation
from einpage.models.generation import generate
from einpage.models.text import TextCodec, end_of_sequence

TEMPLATES = Path(__file__).parent / "fixtures" / "chat" / "templates"


def chat_checkpoint(hf_fixture, tmp_path_factory):
    """The Llama 3.1 fixture with Qwen2.5's chat template in its tokenizer_config.json: (its
    directory, config, weights, codec, template)."""
    src = hf_fixture("tiny-llama31")
    d = tmp_path_factory.mktemp("chat") / "tiny-chat"
    shutil.copytree(src, d)
    config = json.loads((d / "tokenizer_config.json").read_text())
    config["chat_template"] = (TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    cfg, weights = resolve(str(d))
    return d, cfg, weights, TextCodec.from_checkpoint(d), ChatTemplate.from_checkpoint(d)


@pytest.fixture(scope="module")
def chat_model(hf_fixture, tmp_path_factory):
    return chat_checkpoint(hf_fixture, tmp_path_factory)


def _conversation(chat_model, run, eos_ids=None, capacity=1024):
    """A conversation that stops where the checkpoint's own EOS ids say (as the CLI's)."""
    d, cfg, _, codec, template = chat_model
    eos_ids = end_of_sequence(d).ids if eos_ids is None else eos_ids
    return Conversation(cfg, run, codec, template, eos_ids, capacity, granule=64)


@pytest.mark.parametrize("paged", [False, True])
def test_a_second_turn_prefills_its_own_tokens_and_replies_as_a_fresh_run(chat_model, paged):
    _, cfg, weights, _, _ = chat_model
    run = (runners.PlanRunner(weights, CompileOptions(200_000)) if paged
           else runners.dense_runner(weights))
    conv = _conversation(chat_model, run)
    first = conv.say("Hello there", 6)
    second = conv.say("Tell me more", 6)
    assert first.reused == 0 and second.reused >= first.prefilled  # at least the first prompt
    held = second.reused + second.prefilled
    assert held == len(conv.codec.encode_plain(conv.template.render(conv.messages[:-1])))
    fresh = _conversation(chat_model, run).say(conv.messages[:-1], 6)
    assert fresh.prefilled == held and fresh.reused == 0
    assert second.tokens == fresh.tokens and second.text == fresh.text
    assert conv.messages[-1] == {"role": "assistant", "content": second.text}
    assert int(conv.store.pos[0]) == len(conv.held) == held + len(second.tokens) - 1


def test_the_first_reply_is_generates_from_the_rendered_text(chat_model):
    _, cfg, weights, codec, template = chat_model
    run = runners.dense_runner(weights)
    turn = _conversation(chat_model, run).say([{"role": "system", "content": "Be brief."},
                                               {"role": "user", "content": "Hi"}], 5)
    ids = codec.encode_plain(template.render([{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": "Hi"}]))
    want = generate(cfg, np.array([ids]), 5, run, granule=64).tokens[0].tolist()
    assert list(turn.tokens) == want


def test_a_reply_stops_at_an_end_of_turn_id_and_leaves_it_out_of_the_text(chat_model):
    _, _, weights, codec, _ = chat_model
    run = runners.dense_runner(weights)
    free = _conversation(chat_model, run, eos_ids=()).say("Hello", 4)
    stop = free.tokens[2]
    turn = _conversation(chat_model, run, eos_ids=(stop,)).say("Hello", 4)
    k = free.tokens.index(stop)
    assert turn.finish == "eos" and turn.tokens == free.tokens[:k + 1]
    assert turn.text == codec.decode(free.tokens[:k])


def test_a_changed_history_cuts_the_store_back_to_the_common_prefix(chat_model):
    run = runners.dense_runner(chat_model[2])
    conv = _conversation(chat_model, run)
    conv.say("Hello there", 3)
    conv.messages[-1]["content"] = "something else entirely"  # the reply edited
    turn = conv.say("And now?", 3)
    fresh = _conversation(chat_model, run).say(conv.messages[:-1], 3)
    assert 0 < turn.reused < fresh.prefilled and turn.tokens == fresh.tokens
    conv.reset()
    assert conv.messages == [] and conv.say("Hello there", 3).reused == 0


def test_a_conversation_longer_than_its_context_is_an_input_error(chat_model):
    conv = _conversation(chat_model, runners.dense_runner(chat_model[2]), capacity=64)
    with pytest.raises(InputError, match="its context holds 64"):
        conv.say("Hello there", 3)
    assert conv.messages == []  # nothing of the refused turn stays


def test_generate_chat_and_messages_print_the_reply(chat_model, tmp_path, capsys):
    d, _, weights, _, _ = chat_model
    want = _conversation(chat_model, runners.dense_runner(weights)).say(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], 4)
    assert cli("generate", d, "--chat", "Hi", "--system", "Be brief.", "--max-new-tokens", 4,
               "--backend", "reference", "--json") == 0
    got = json.loads(capsys.readouterr().out)
    assert got["tokens"] == list(want.tokens) and got["text"] == want.text
    assert got["prompt"] == want.prefilled
    path = tmp_path / "conv.json"
    path.write_text(json.dumps({"messages": [{"role": "system", "content": "Be brief."},
                                             {"role": "user", "content": "Hi"}]}))
    assert cli("generate", d, "--messages", path, "--max-new-tokens", 4, "--gpu-mem",
               "200KB") == 0
    captured = capsys.readouterr()
    assert captured.out == want.text + "\n" and "tokens prefilled" in captured.err


def test_chat_keeps_the_conversation_between_lines(chat_model, capsys, monkeypatch):
    d, _, weights, _, _ = chat_model
    conv = _conversation(chat_model, runners.dense_runner(weights))
    replies = [conv.say("Hello there", 4).text, conv.say("Tell me more", 4).text]
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello there\n\nTell me more\n/reset\n"
                                                 "Hello there\n/exit\nnever read\n"))
    assert cli("chat", d, "--max-new-tokens", 4, "--backend", "reference", "--stats") == 0
    captured = capsys.readouterr()
    assert captured.out == "".join(t + "\n" for t in (*replies, replies[0]))
    kept = [line for line in captured.err.splitlines() if "kept from before" in line]
    assert len(kept) == 3 and "(0 kept" in kept[0] and "(0 kept" not in kept[1]
    assert "(0 kept" in kept[2]  # after /reset


def test_bad_chat_flags_are_one_line(chat_model, hf_fixture, tmp_path, capsys):
    d = chat_model[0]
    one_line(capsys, cli("generate", hf_fixture("tiny-llama-f32"), "--chat", "hi",
                         "--max-new-tokens", 2), "carries no chat template")
    path = tmp_path / "m.json"
    path.write_text("[]")
    one_line(capsys, cli("generate", d, "--messages", path, "--max-new-tokens", 2),
             "expected a list of {role, content} messages")
    path.write_text('[{"role": "user", "content": "x"}]')
    one_line(capsys, cli("generate", d, "--messages", path, "--system", "s",
                         "--max-new-tokens", 2), "--system goes with --chat")
    one_line(capsys, cli("generate", d, "--prompt", "x", "--system", "s",
                         "--max-new-tokens", 2), "--system is the system message of --chat")
    one_line(capsys, cli("chat", d, "--context", 1), "--context must be at least 2")
    one_line(capsys, cli("chat", d, "--parallel", "tensor", "--gpu-mem", "200KB"),
             "add --devices 2 or more")


def test_a_chat_over_two_devices_replies_as_on_one(chat_model, capsys):
    d = chat_model[0]
    assert cli("generate", d, "--chat", "Hi", "--max-new-tokens", 4, "--backend", "reference",
               "--json") == 0
    want = json.loads(capsys.readouterr().out)
    assert cli("generate", d, "--chat", "Hi", "--max-new-tokens", 4, "--gpu-mem", "200KB",
               "--devices", 2, "--parallel", "tensor", "--json") == 0
    got = json.loads(capsys.readouterr().out)
    assert got["tokens"] == want["tokens"] and got["text"] == want["text"]
