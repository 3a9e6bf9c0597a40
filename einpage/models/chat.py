"""Chat templates: a conversation rendered to the text a chat model was trained on, exactly as
Hugging Face transformers' `apply_chat_template(..., tokenize=False)` renders it.

A checkpoint carries its template as `chat_template.jinja`, or as `chat_template` in
`tokenizer_config.json` (a string, or a list of named templates: `default` is used, or the one
named `tool_use` when tools are given and it exists); a GGUF file as `tokenizer.chat_template`.
Templates are untrusted code from model hubs, so they run in Jinja2's immutable sandbox, with
what transformers gives them and nothing more: `trim_blocks` and `lstrip_blocks`, the
`loopcontrols` extension (`break`, `continue`), a `tojson` filter that does not escape HTML
(`json.dumps` with `ensure_ascii=False` and its `indent`, `separators`, `sort_keys`), the
globals `raise_exception(message)` (a `ChatTemplateError`), `strftime_now(format)`, `dict` and a
`namespace` that refuses underscore-prefixed names, and the variables `messages`, `tools`,
`documents`, `add_generation_prompt`, the special tokens of the tokenizer's config (`bos_token`,
`eos_token`, ...) and any extra keyword (`enable_thinking`, `date_string`).

As transformers does, each message loses the keys whose value is None (`content: null` of an
API client), and a message's reasoning under any of `reasoning_content`, `thinking` or
`reasoning` is given under `reasoning_content` and `thinking` both. The outside truth is
`tests/fixtures/chat/`: the real templates of Llama 3.1, Mistral (Nemo), Qwen2.5 and Qwen3 (as
llama.cpp keeps them), rendered by transformers for a set of conversations
(`tests/fixtures/make_chat_fixtures.py`); einpage's rendering equals them byte for byte.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Mapping, Sequence

from einpage.errors import CheckpointError, InputError

#: the special tokens transformers passes to a template (`special_tokens_map`)
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
TEMPLATE_FILE = "chat_template.jinja"


class ChatTemplateError(InputError):
    """A conversation the template refuses (its `raise_exception`), or a template that does not
    render."""


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _raise(message):
    import jinja2
    raise jinja2.exceptions.TemplateError(message)


class _TemplateDict:
    """`dict(...)` for templates, without the attributes of the type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _environment():
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Namespace(jinja2.utils.Namespace):
        """Jinja's namespace, refusing underscore-prefixed names (no way to CPython's inside)."""

        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"a chat template cannot store {name!r} on a namespace")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = Namespace
    return env


def _plain(value: Any) -> Any:
    """`value` rebuilt of JSON types only (what the sandbox sees of the caller's data)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return f"<{type(value).__name__}>"


def normalize_messages(messages: Any) -> list[dict]:
    """The conversation as a template reads it (the module's docstring); `InputError` for one
    that is not a list of messages with a string role."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InputError("a conversation is a non-empty list of messages")
    out = []
    for k, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise InputError(f"message {k} is not an object with a role and content")
        if not isinstance(m.get("role"), str):
            raise InputError(f"message {k} has no role (a string: system, user, assistant, "
                             "tool)")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise InputError(f"message {k}: content must be text or a list of parts")
        m = {key: value for key, value in m.items() if value is not None}
        reasoning = next((m[key] for key in REASONING_FIELDS if m.get(key) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(_plain(m))
    return out


class ChatTemplate:
    """One model's chat template, compiled once; `special`: its tokenizer's special tokens."""

    def __init__(self, source: str, special: Mapping[str, str] | None = None,
                 where: str = "the chat template", named: Mapping[str, str] | None = None):
        import jinja2
        self.source, self.where = source, where
        self.special = {k: v for k, v in (special or {}).items() if v is not None}
        self.named = dict(named or {})  # every named template of the config, the default too
        env = _environment()
        try:
            self._compiled = env.from_string(source)
            self._tool_use = (env.from_string(self.named["tool_use"])
                              if "tool_use" in self.named else None)
        except jinja2.exceptions.TemplateError as exc:
            raise CheckpointError(f"{where}: not a template Jinja2 can read: {exc}") from None

    @classmethod
    def from_checkpoint(cls, directory: str | Path) -> "ChatTemplate | None":
        """The template a checkpoint directory (or GGUF file) carries; None where it has none."""
        path = Path(directory)
        if path.is_file():
            from einpage.models.gguf import GGUFModel
            model = GGUFModel(path)
            text = model.metadata.get("tokenizer.chat_template")
            if not isinstance(text, str):
                return None
            special = {}
            for which in ("bos", "eos", "unk", "pad"):
                tid = model.token_id(which)
                if tid is not None:
                    special[f"{which}_token"] = model.metadata["tokenizer.ggml.tokens"][tid]
            return cls(text, special, f"{path}: tokenizer.chat_template")
        config_path = path / "tokenizer_config.json"
        config = {}
        if config_path.is_file():
            try:
                config = json.loads(config_path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise CheckpointError(f"{config_path}: not JSON ({exc})") from None
        special = {}
        for key in SPECIAL_TOKENS:
            value = config.get(key)
            if isinstance(value, dict):  # a serialized AddedToken
                value = value.get("content")
            if isinstance(value, str):
                special[key] = value
        extra = config.get("additional_special_tokens")
        if isinstance(extra, list):
            special["additional_special_tokens"] = [
                t.get("content") if isinstance(t, dict) else t for t in extra]
        jinja_file = path / TEMPLATE_FILE
        if jinja_file.is_file():
            return cls(jinja_file.read_text(encoding="utf-8"), special, str(jinja_file))
        template = config.get("chat_template")
        if template is None:
            return None
        where = f"{config_path}: chat_template"
        if isinstance(template, list):
            named = {}
            for t in template:
                if not (isinstance(t, dict) and isinstance(t.get("name"), str)
                        and isinstance(t.get("template"), str)):
                    raise CheckpointError(f"{where}: a list of templates holds objects with a "
                                          "name and a template")
                named[t["name"]] = t["template"]
            if "default" not in named:
                raise CheckpointError(f"{where}: no template named default among "
                                      f"{', '.join(sorted(named))}")
            return cls(named["default"], special, where, named)
        if not isinstance(template, str):
            raise CheckpointError(f"{where}: must be a string or a list of named templates")
        return cls(template, special, where)

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None,
               documents: Sequence[Mapping[str, Any]] | None = None, **kwargs: Any) -> str:
        """The text of `messages` (`add_generation_prompt`: ending with the header of the
        assistant's next turn); `kwargs` reach the template as variables, over the special
        tokens. `ChatTemplateError` where the template refuses the conversation."""
        import jinja2
        chat = normalize_messages(messages)
        if tools is not None and (not isinstance(tools, (list, tuple))
                                  or not all(isinstance(t, Mapping) for t in tools)):
            raise InputError("tools must be a list of JSON schemas (objects)")
        if documents is not None and not all(isinstance(d, Mapping) for d in documents):
            raise InputError("documents must be a list of objects with a title and text")
        compiled = self._tool_use if (tools and self._tool_use is not None) else self._compiled
        variables = _plain({**self.special, **kwargs})
        try:
            return compiled.render(messages=chat, tools=_plain(tools), documents=_plain(documents),
                                   add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"{self.where}: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - a template is someone else's code
            raise ChatTemplateError(f"{self.where} failed on this conversation: "
                                    f"{type(exc).__name__}: {str(exc)[:200]}") from None
