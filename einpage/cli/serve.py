"""`einpage serve MODEL`: an OpenAI-compatible server (`einpage.serving`) on one plan runner,
requests batched continuously. Needs the `serve` extra (Starlette, uvicorn)."""
from __future__ import annotations

import sys

from einpage.errors import InputError

#: seconds the requests in flight have to finish after Ctrl-C before the engine cancels them
GRACE = 5
#: seconds after that before uvicorn cancels the connections' tasks itself (a stream the engine
#: ended closes at once; this only bounds a client that never reads)
GRACE_MARGIN = 5


def add_commands(sub) -> None:
    from einpage.cli.chat import add_context_arg
    from einpage.cli.execute import _add_model_args
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/chat/completions, "
                                     "/v1/completions), requests batched continuously")
    _add_model_args(p, prompt=False, host_profile=False)
    p.add_argument("--host", dest="listen", default="127.0.0.1",
                   help="the address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8080, help="default 8080")
    p.add_argument("--api-key", help="requests must carry Authorization: Bearer <key>")
    p.add_argument("--name", help="the model's name in the API (default: the directory's)")
    p.add_argument("--max-batch", type=int, default=16,
                   help="the most requests decoded at once (default 16); more wait their turn")
    p.add_argument("--max-tokens", type=int, default=256,
                   help="a request's max_tokens where it gives none (default 256)")
    p.add_argument("--kv-granule", type=int, default=256,
                   help="KV and prompt buckets come in multiples of this (one plan each)")
    add_context_arg(p)


def build_service(args):
    """The engine and its `Service` as the flags say (no server started)."""
    from pathlib import Path

    from einpage.cli.chat import chat_model, context_of
    from einpage.serving.app import Service
    from einpage.serving.engine import Engine
    for flag, value, least in (("--max-batch", args.max_batch, 1), ("--port", args.port, 0),
                               ("--max-tokens", args.max_tokens, 1)):
        if value < least:
            raise InputError(f"{flag} must be at least {least}, got {value}")
    cfg, _, codec, template, eos_ids, runner = chat_model(args, need_template=False)
    engine = Engine(cfg, runner, codec, args.max_batch, context_of(args, cfg), args.kv_granule)
    return Service(engine, args.name or Path(args.model).name, codec, template, eos_ids,
                   args.api_key, args.max_tokens)


def cmd_serve(args) -> None:
    try:
        import uvicorn

        from einpage.serving.app import create_app
    except ImportError as exc:
        raise InputError(f"einpage serve needs the serve extra ({exc.name} is missing): "
                         "pip install 'einpage[serve]'") from None
    service = build_service(args)
    print(f"einpage: serving {service.name} on http://{args.listen}:{args.port}/v1 (batches of "
          f"up to {args.max_batch}, {service.engine.context} tokens of context"
          f"{', chat template' if service.template else ', no chat template'}"
          f"{', API key required' if args.api_key else ''}); Ctrl-C stops", file=sys.stderr)
    config = uvicorn.Config(create_app(service), host=args.listen, port=args.port,
                            log_level="warning",
                            timeout_graceful_shutdown=GRACE + GRACE_MARGIN)
    _graceful(uvicorn.Server, service.engine)(config).run()


def _graceful(server_class, engine):
    """uvicorn's server, which on Ctrl-C gives the requests in flight GRACE seconds, then has
    the engine cancel them: each stream ends (its last chunk, then `[DONE]`) and its connection
    closes, before uvicorn's own timeout would cancel the connection's task mid-response (which
    logs a traceback)."""
    import asyncio
    import threading

    class Server(server_class):
        async def shutdown(self, sockets=None):
            timer = asyncio.get_running_loop().call_later(
                GRACE, lambda: threading.Thread(target=engine.stop, daemon=True).start())
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

    return Server


HANDLERS = {"serve": cmd_serve}
