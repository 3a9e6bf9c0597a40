"""The OpenAI API's request bodies, checked: `/v1/completions` and `/v1/chat/completions`.

Every field einpage reads is checked for its type and range; a wrong one is a `BadRequest`
naming the field (a 400 with an OpenAI-style error object). `n` and the penalties are accepted
where their value changes nothing (`n: 1`, penalties of 0) and refused otherwise. Ignored:
`user`, `echo`, `best_of`, `suffix`, `logit_bias`, `response_format`, `tool_choice`,
`parallel_tool_calls`, and any field the API does not define (as OpenAI's server ignores those).
`tools` reach the chat template (the model is told of them), but a reply is text: tool calls in
it are not parsed into `tool_calls`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

#: the most stop strings, as OpenAI allows
MAX_STOP = 4
#: the most alternatives `top_logprobs` (chat) may ask for, and `logprobs` (completions)
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5


class BadRequest(Exception):
    """A request the API refuses (400): `message`, and the field at fault."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message, self.param = message, param


@dataclass(frozen=True)
class Params:
    """What one request asks of the engine."""
    max_tokens: int | None
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    logprobs: int | None        # None: none; k: the picked token's and k alternatives


def _get(body: dict, name: str, kinds, default=None, what: str = ""):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise BadRequest(f"'{name}' must be {what}, got {value!r}", name)
    if not isinstance(value, kinds):
        raise BadRequest(f"'{name}' must be {what}, got {type(value).__name__}", name)
    return value


def _number(body: dict, name: str, default: float, lo: float, hi: float,
            lo_open: bool = False) -> float:
    value = float(_get(body, name, (int, float), default, "a number"))
    if not math.isfinite(value) or value > hi or value < lo or (lo_open and value == lo):
        side = "(" if lo_open else "["
        raise BadRequest(f"'{name}' must be in {side}{lo:g}, {hi:g}], got {value!r}", name)
    return value


def common(body: Any, chat: bool) -> Params:
    """The sampling and output fields both endpoints share."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    _get(body, "model", str, None, "a string")
    max_name = "max_tokens"
    max_tokens = _get(body, "max_tokens", int, None, "an integer")
    if chat and body.get("max_completion_tokens") is not None:
        max_name = "max_completion_tokens"
        max_tokens = _get(body, max_name, int, None, "an integer")
    if max_tokens is not None and max_tokens <= 0:
        raise BadRequest(f"'{max_name}' must be at least 1, got {max_tokens}", max_name)
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    seed = _get(body, "seed", int, None, "an integer")
    if seed is not None and seed < 0:
        raise BadRequest(f"'seed' must be >= 0, got {seed}", "seed")
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    else:
        raise BadRequest("'stop' must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOP or any(not s for s in stops):
        raise BadRequest(f"'stop' holds at most {MAX_STOP} non-empty strings", "stop")
    stream = _get(body, "stream", bool, False, "true or false")
    options = _get(body, "stream_options", dict, {}, "an object")
    include_usage = _get(options, "include_usage", bool, False, "true or false")
    n = _get(body, "n", int, 1, "an integer")
    if n != 1:
        raise BadRequest(f"'n' must be 1 (one choice per request), got {n}", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        if _number(body, name, 0.0, -2.0, 2.0) != 0.0:
            raise BadRequest(f"'{name}' is not supported (only 0)", name)
    if chat:
        want = _get(body, "logprobs", bool, False, "true or false")
        top = _get(body, "top_logprobs", int, None, "an integer")
        if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
            raise BadRequest(f"'top_logprobs' must be in [0, {MAX_TOP_LOGPROBS}]",
                             "top_logprobs")
        if top is not None and not want:
            raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        logprobs = (top or 0) if want else None
    else:
        logprobs = _get(body, "logprobs", int, None, "an integer")
        if logprobs is not None and not 0 <= logprobs <= MAX_COMPLETION_LOGPROBS:
            raise BadRequest(f"'logprobs' must be in [0, {MAX_COMPLETION_LOGPROBS}]",
                             "logprobs")
    return Params(max_tokens, temperature, top_p, seed, stops, stream, include_usage,
                  logprobs)


def chat_messages(body: dict) -> tuple[list[dict], list | None]:
    """The conversation of a chat request (checked as the template will read it) and its
    tools."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list of messages", "messages")
    for k, m in enumerate(messages):
        where = f"messages[{k}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"{where} must be an object with a string 'role'", where)
        content = m.get("content")
        if isinstance(content, list):  # content parts: the text ones, joined
            if not all(isinstance(p, dict) and p.get("type") == "text"
                       and isinstance(p.get("text"), str) for p in content):
                raise BadRequest(f"{where}.content: only text parts are supported",
                                 f"{where}.content")
        elif content is not None and not isinstance(content, str):
            raise BadRequest(f"{where}.content must be a string or a list of text parts",
                             f"{where}.content")
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list)
                              or not all(isinstance(t, dict) for t in tools)):
        raise BadRequest("'tools' must be a list of objects", "tools")
    return messages, tools


def completion_prompt(body: dict) -> str | list[int]:
    """The prompt of a completions request: text, or token ids; one prompt per request."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("'prompt' is empty", "prompt")
        return prompt
    if (isinstance(prompt, list) and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)):
        return prompt
    raise BadRequest("'prompt' must be a non-empty string or list of token ids (one prompt "
                     "per request)", "prompt")
