"""Chat templates (`einpage.models.chat`): the real templates of Llama 3.1, Mistral Nemo, Qwen2.5
and Qwen3 render every conversation of `fixtures/chat/cases.json` byte for byte as transformers
rendered them (`fixtures/make_chat_fixtures.py`), refuse what transformers refuses, run in a
sandbox, and are found where a checkpoint keeps them."""
from __future__ import annotations

import json
import sys
from datetime import datetime
from pathlib import Path

import pytest

from einpage.errors import CheckpointError, InputError
from einpage.models.chat import ChatTemplate, ChatTemplateError

HERE = Path(__file__).parent / "fixtures" / "chat"
sys.path.insert(0, str(HERE.parent))
from make_chat_fixtures import SPECIAL  # noqa: E402  (each template's special tokens)

RENDERED = json.loads((HERE / "rendered.json").read_text(encoding="utf-8"))["rendered"]
CASES = json.loads((HERE / "cases.json").read_text(encoding="utf-8"))


def _template(name: str) -> ChatTemplate:
    return ChatTemplate((HERE / "templates" / f"{name}.jinja").read_text(encoding="utf-8"),
                        SPECIAL[name], name)


@pytest.mark.parametrize("name", sorted(SPECIAL))
@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_a_real_template_renders_as_transformers_does(name, case):
    want = RENDERED[name][case["name"]]
    render = lambda: _template(name).render(  # noqa: E731
        case["messages"], case.get("add_generation_prompt", True), tools=case.get("tools"),
        **case.get("kwargs", {}))
    if isinstance(want, dict):  # transformers raised: the template's own message here too
        message = want["error"].split(": ", 1)[1]
        with pytest.raises(ChatTemplateError, match=message[:40].replace("(", r"\(")):
            render()
    else:
        assert render() == want


def test_every_template_was_rendered_for_every_case():
    assert set(RENDERED) == set(SPECIAL)
    assert all(set(r) == {c["name"] for c in CASES} for r in RENDERED.values())
    errors = sum(isinstance(v, dict) for r in RENDERED.values() for v in r.values())
    assert 0 < errors < len(CASES)  # Mistral's alternation rule, at least


def test_strftime_now_gives_the_date_of_the_render():
    text = ChatTemplate("{{ strftime_now('%d %b %Y') }}").render(
        [{"role": "user", "content": "hi"}])
    assert text == datetime.now().strftime("%d %b %Y")


def test_the_sandbox_keeps_a_template_from_pythons_inside():
    msgs = [{"role": "user", "content": "x"}]
    for source in ("{{ ''.__class__.__mro__ }}", "{% set ns = namespace(_x=1) %}{{ ns._x }}",
                   "{{ dict.__call__.__globals__ }}"):
        with pytest.raises(ChatTemplateError):
            ChatTemplate(source).render(msgs)
    assert "class" not in ChatTemplate("{{ messages.__class__ }}").render(msgs)
    # tojson does not escape HTML, as transformers' filter does not
    t = ChatTemplate("{{ messages[0].content | tojson }}")
    assert t.render([{"role": "user", "content": "<b>é</b>"}]) == '"<b>é</b>"'


@pytest.mark.parametrize("messages,message", [
    ([], "non-empty list"),
    ("hello", "non-empty list"),
    ([{"content": "no role"}], "message 0 has no role"),
    ([{"role": "user", "content": 3}], "content must be text"),
    ([{"role": "user", "content": "x"}, 7], "message 1 is not an object"),
])
def test_a_malformed_conversation_is_an_input_error(messages, message):
    with pytest.raises(InputError, match=message):
        ChatTemplate("{{ messages }}").render(messages)


def test_a_checkpoint_keeps_its_template_in_one_of_three_ways(tmp_path):
    assert ChatTemplate.from_checkpoint(tmp_path) is None  # none at all
    config = {"bos_token": {"content": "<s>"}, "eos_token": "</s>",
              "chat_template": "{{ bos_token }}{% for m in messages %}{{ m.content }}"
                               "{% endfor %}{{ eos_token }}"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    msgs = [{"role": "user", "content": "hi"}]
    assert ChatTemplate.from_checkpoint(tmp_path).render(msgs) == "<s>hi</s>"
    config["chat_template"] = [{"name": "default", "template": "plain {{ messages|length }}"},
                               {"name": "tool_use", "template": "tools {{ tools|length }}"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    t = ChatTemplate.from_checkpoint(tmp_path)
    assert t.render(msgs) == "plain 1"
    assert t.render(msgs, tools=[{"type": "function"}]) == "tools 1"
    (tmp_path / "chat_template.jinja").write_text("file {{ eos_token }}")
    assert ChatTemplate.from_checkpoint(tmp_path).render(msgs) == "file </s>"


@pytest.mark.parametrize("config,message", [
    ({"chat_template": 5}, "must be a string or a list"),
    ({"chat_template": [{"name": "tool_use", "template": "x"}]}, "no template named default"),
    ({"chat_template": [{"template": "x"}]}, "objects with a name and a template"),
    ({"chat_template": "{% if %}"}, "not a template Jinja2 can read"),
])
def test_a_broken_template_in_a_checkpoint_is_a_checkpoint_error(tmp_path, config, message):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=message):
        ChatTemplate.from_checkpoint(tmp_path)


def test_a_gguf_file_carries_its_template_and_special_tokens(hf_fixture, tmp_path):
    from gguf_files import gguf_spec
    src = hf_fixture("tiny-llama31")
    spec = gguf_spec(src, "f32")
    path = tmp_path / "model.gguf"
    assert ChatTemplate.from_checkpoint(spec.write(path)) is None  # none written: none read
    spec.set("tokenizer.chat_template", "{{ bos_token }}{% for m in messages %}[{{ m.role }}]"
                                        "{{ m.content }}{% endfor %}{{ eos_token }}")
    spec.write(path)
    config = json.loads((src / "tokenizer_config.json").read_text())
    t = ChatTemplate.from_checkpoint(path)
    assert t.render([{"role": "user", "content": "hi"}]) == \
        f"{config['bos_token']}[user]hi{config['eos_token']}"
