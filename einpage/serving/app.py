"""The OpenAI-compatible HTTP API over the continuous-batching engine (Starlette; run by
uvicorn: `einpage serve`).

Routes: `GET /health`, `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions`
(the conversation rendered with the model's chat template), each answering in the shapes of
OpenAI's API (replies are text: tool calls in them are not parsed into `tool_calls`), `stream: true` as server-sent events (`data: {chunk}` lines, then `data: [DONE]`). With
an API key every route but `/health` wants `Authorization: Bearer <key>` (else 401). A bad
request is a 400 with `{"error": {"message", "type": "invalid_request_error", "param", "code"}}`
and touches nothing else. A client that goes away (a closed stream, a dropped connection) has its
row freed at the engine's next step.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from typing import Any

from einpage.errors import EinpageError
from einpage.models.generation import Sampling
from einpage.serving.engine import Done, Engine, Failed, Request, Token, Unavailable
from einpage.serving.protocol import (BadRequest, chat_messages, common, completion_prompt)

#: how often a non-streaming request looks whether its client is still there
_POLL_S = 0.25


def _error(status: int, message: str, kind: str = "invalid_request_error",
           param: str | None = None, code: str | None = None):
    from starlette.responses import JSONResponse
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": code}}, status_code=status)


class Service:
    """What the routes share: the engine, the model's name, tokenizer, chat template and the
    ids that end a reply, the default `max_tokens`, and the API key (None: none asked)."""

    def __init__(self, engine: Engine, name: str, codec, template, eos_ids, api_key=None,
                 default_max_tokens: int = 256):
        self.engine, self.name, self.codec, self.template = engine, name, codec, template
        self.eos_ids, self.api_key = tuple(eos_ids), api_key
        self.default_max_tokens = default_max_tokens
        self.created = int(time.time())

    def authorized(self, request) -> bool:
        if self.api_key is None:
            return True
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            token.strip().encode("utf-8", "surrogateescape"), self.api_key.encode("utf-8"))

    def token_text(self, token: int) -> str:
        return self.codec.decode([token])


def create_app(service: Service):
    """The Starlette application (its lifespan starts and stops the engine)."""
    from contextlib import asynccontextmanager

    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    @asynccontextmanager
    async def lifespan(app):
        service.engine.start()
        try:
            yield
        finally:  # Ctrl-C: what is still in flight is cancelled, the loop joined
            await asyncio.to_thread(service.engine.stop)

    async def health(request):
        if service.engine.failure:
            return _error(503, service.engine.failure, "server_error")
        return JSONResponse({"status": "ok", "active": service.engine.active})

    async def models(request):
        if not service.authorized(request):
            return _unauthorized()
        return JSONResponse({"object": "list", "data": [
            {"id": service.name, "object": "model", "created": service.created,
             "owned_by": "einpage"}]})

    async def completions(request):
        return await _generate(service, request, chat=False)

    async def chat_completions(request):
        return await _generate(service, request, chat=True)

    async def not_found(request, exc):
        return _error(404, f"no route {request.method} {request.url.path}", code="not_found")

    async def not_allowed(request, exc):
        return _error(405, f"{request.method} is not allowed on {request.url.path}")

    routes = [Route("/health", health), Route("/v1/models", models),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat_completions, methods=["POST"])]
    return Starlette(routes=routes, lifespan=lifespan,
                     exception_handlers={404: not_found, 405: not_allowed})


def _unauthorized():
    return _error(401, "a valid API key is needed: Authorization: Bearer <key>",
                  code="invalid_api_key")


def _plain_content(messages: list[dict]) -> list[dict]:
    """Messages whose content is a list of text parts, joined to one string."""
    out = []
    for m in messages:
        if isinstance(m.get("content"), list):
            m = {**m, "content": "".join(p["text"] for p in m["content"])}
        out.append(m)
    return out


async def _generate(service: Service, request, chat: bool):
    if not service.authorized(request):
        return _unauthorized()
    try:
        body = json.loads(await request.body())
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        return _error(400, f"the body is not JSON einpage reads: {str(exc)[:200]}")
    try:
        params = common(body, chat)
        if chat:
            if service.template is None:
                raise BadRequest(f"{service.name} carries no chat template: use /v1/completions",
                                 "messages")
            messages, tools = chat_messages(body)

            def tokens() -> list[int]:  # a template is code: off the event loop
                return service.codec.encode_plain(service.template.render(
                    _plain_content(messages), add_generation_prompt=True, tools=tools))
        else:
            given = completion_prompt(body)

            def tokens() -> list[int]:
                return service.codec.encode(given) if isinstance(given, str) else list(given)
        prompt = await asyncio.to_thread(tokens)
        if prompt and max(prompt) >= service.engine.cfg.vocab:
            raise BadRequest(f"token id {max(prompt)} is outside the model's vocabulary of "
                             f"{service.engine.cfg.vocab}", "messages" if chat else "prompt")
        # temperature 0 is greedy: top_p and seed change nothing then (OpenAI takes them)
        sampling = (Sampling() if params.temperature == 0 else
                    Sampling(params.temperature, params.top_p, 0, params.seed))
        req = Request(prompt, params.max_tokens or service.default_max_tokens, sampling,
                      service.eos_ids, params.stop, params.logprobs)
    except BadRequest as exc:
        return _error(400, exc.message, param=exc.param)
    except EinpageError as exc:  # a template that refuses the conversation, a bad option
        return _error(400, str(exc).splitlines()[0])
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    req.sink = lambda event: loop.call_soon_threadsafe(events.put_nowait, event)
    try:
        service.engine.submit(req)
    except Unavailable as exc:
        return _error(503, str(exc).splitlines()[0], "server_error")
    except EinpageError as exc:
        return _error(400, str(exc).splitlines()[0], param="messages" if chat else "prompt")
    ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    if params.stream:
        return _streaming(service, request, req, events, ident, chat, params)
    return await _whole(service, request, req, events, ident, chat)


async def _next(events: asyncio.Queue, request, req: Request, engine: Engine):
    """The next event, watching the client meanwhile (gone: the request is cancelled)."""
    while True:
        try:
            return await asyncio.wait_for(events.get(), _POLL_S)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                engine.cancel(req)


async def _whole(service: Service, request, req: Request, events, ident: str, chat: bool):
    from starlette.responses import JSONResponse
    tokens: list[Token] = []
    try:
        while True:
            event = await _next(events, request, req, service.engine)
            if isinstance(event, Token):
                tokens.append(event)
            elif isinstance(event, Failed):
                return _error(500, event.message, "server_error")
            else:
                break
    except asyncio.CancelledError:
        service.engine.cancel(req)
        raise
    done: Done = event
    choice: dict[str, Any] = {"index": 0, "finish_reason": _finish(done),
                              "logprobs": _logprobs(service, tokens, chat, req.logprobs)}
    if chat:
        choice["message"] = {"role": "assistant", "content": done.text}
    else:
        choice["text"] = done.text
    return JSONResponse({"id": ident, "object": "chat.completion" if chat else "text_completion",
                         "created": int(time.time()), "model": service.name,
                         "choices": [choice], "usage": _usage(done)})


def _streaming(service: Service, request, req: Request, events, ident: str, chat: bool,
               params):
    from starlette.responses import StreamingResponse
    created = int(time.time())
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(delta: dict | None, text: str | None, finish=None, logprobs=None, usage=None):
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": logprobs}
        if chat:
            choice["delta"] = delta or {}
        else:
            choice["text"] = text or ""
        out = {"id": ident, "object": kind, "created": created, "model": service.name,
               "choices": [choice] if usage is None else []}
        if params.include_usage:
            out["usage"] = usage
        return f"data: {json.dumps(out)}\n\n"

    async def body():
        offset = 0  # of the completion's text so far (the legacy logprobs' text_offset)
        try:
            if chat:
                yield chunk({"role": "assistant", "content": ""}, None)
            while True:
                event = await _next(events, request, req, service.engine)
                if isinstance(event, Token):
                    if event.text or (req.logprobs is not None and not event.end):
                        lp = _logprobs(service, [event], chat, req.logprobs, offset)
                        offset += len(event.text)
                        yield chunk({"content": event.text}, event.text, logprobs=lp)
                elif isinstance(event, Failed):
                    yield f"data: {json.dumps({'error': {'message': event.message, 'type': 'server_error'}})}\n\n"
                    return
                else:
                    yield chunk({}, "", finish=_finish(event))
                    if params.include_usage:
                        yield chunk(None, None, usage=_usage(event))
                    yield "data: [DONE]\n\n"
                    return
        finally:  # the client closed the stream: its row is freed at the next step
            service.engine.cancel(req)

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


def _finish(done: Done) -> str:
    return "length" if done.finish == "length" else "stop"


def _usage(done: Done) -> dict:
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens}


def _logprobs(service: Service, tokens: list[Token], chat: bool, k: int | None,
              offset: int = 0):
    """OpenAI's logprobs object of these tokens (None where none were asked), an end id left
    out; `offset`: where the completion's text stood before them."""
    if k is None:
        return None
    tokens = [t for t in tokens if not t.end]
    if chat:
        def entry(token, logprob):
            text = service.token_text(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
        return {"content": [{**entry(t.id, t.logprob),
                             "top_logprobs": [entry(i, lp) for i, lp in t.top]}
                            for t in tokens]}
    texts = [service.token_text(t.id) for t in tokens]
    offsets, at = [], offset
    for text in texts:
        offsets.append(at)
        at += len(text)
    tops = []
    for t in tokens:  # by text, as the legacy format has it: the likelier of two same texts
        top: dict[str, float] = {}
        for i, lp in t.top:
            top.setdefault(service.token_text(i), lp)
        tops.append(top)
    return {"tokens": texts, "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": tops, "text_offset": offsets}
