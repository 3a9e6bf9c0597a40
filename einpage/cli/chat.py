"""Talking to a chat model (`einpage.models.conversation`): `einpage chat MODEL` (a terminal
conversation, each reply streamed as its tokens come, the conversation kept in the KV store
between turns so that a turn prefills only its own tokens) and `einpage generate MODEL --chat
MESSAGE | --messages FILE` (one exchange)."""
from __future__ import annotations

import json
import sys
from typing import TextIO

from einpage.errors import CheckpointError, InputError

#: the context of a conversation when neither --context nor the model's config gives one
DEFAULT_CONTEXT = 4096


def add_commands(sub) -> None:
    from einpage.cli.execute import _add_model_args, add_sampling_args
    chat = sub.add_parser("chat", help="talk to a chat model: each turn rendered with its chat "
                                       "template, the conversation kept in the KV store")
    _add_model_args(chat, prompt=False)
    add_sampling_args(chat)
    chat.add_argument("--system", help="the system message the conversation starts with")
    chat.add_argument("--max-new-tokens", type=int, default=512,
                      help="the most tokens of one reply (default 512)")
    add_context_arg(chat)
    chat.add_argument("--stats", action="store_true",
                      help="after each reply, one line on stderr: the tokens prefilled and kept, "
                           "the reply's tokens and rates")


def add_context_arg(p) -> None:
    p.add_argument("--context", type=int,
                   help=f"the most tokens a conversation holds (default: the model's context, "
                        f"at most {DEFAULT_CONTEXT}); the KV store is allocated at it")


def chat_model(args, need_template: bool = True):
    """What `chat`, `generate --chat` and `serve` need of the checkpoint the flags name: (cfg,
    weights, codec, template (None, where it has none and `need_template` is false), end-of-turn
    ids, the runner)."""
    from einpage.cli.execute import _checkpoint_dir, _resolve, _runner
    from einpage.models.chat import ChatTemplate
    from einpage.models.generation import check_special
    from einpage.models.text import TextCodec, end_of_sequence
    if getattr(args, "devices", 1) != 1 or getattr(args, "parallel", "pipeline") != "pipeline":
        from einpage.runtime.comm import mpi_world
        if mpi_world()[1] > 1:  # one process reads the terminal or serves HTTP
            raise InputError(f"{args.command} runs every rank of --devices in one process: "
                             "drop mpiexec")
    if args.kv_granule < 1:
        raise InputError(f"--kv-granule must be at least 1, got {args.kv_granule}")
    directory = _checkpoint_dir(args.model)
    if directory is None:
        raise InputError(f"{args.model}: {args.command} needs a checkpoint (its tokenizer and "
                         "chat template), not a preset")
    template = ChatTemplate.from_checkpoint(directory)
    if template is None and need_template:
        raise InputError(f"{args.model} carries no chat template (chat_template in "
                         "tokenizer_config.json, chat_template.jinja, or a GGUF file's "
                         "tokenizer.chat_template): give it text with --prompt instead")
    cfg, weights = _resolve(args)
    codec = TextCodec.from_checkpoint(directory)
    eos = end_of_sequence(directory)
    try:
        check_special(cfg, eos.ids, eos.pad_id)
    except InputError as exc:
        raise CheckpointError(f"{eos.source or args.model}: {exc}") from None
    if not eos.ids:
        raise CheckpointError(f"{args.model} names no end-of-sequence id: a reply would never "
                              "end before the most tokens asked")
    return cfg, weights, codec, template, eos.ids, _runner(args, weights)


def context_of(args, cfg) -> int:
    """--context, else the model's context (at most `DEFAULT_CONTEXT`)."""
    context = args.context if args.context is not None else min(cfg.context or DEFAULT_CONTEXT,
                                                                DEFAULT_CONTEXT)
    if context < 2:
        raise InputError(f"--context must be at least 2, got {context}")
    return context


def conversation(args, messages=None):
    """The `Conversation` the flags describe, and its runner (to close); with `messages` (one
    exchange), a store just large enough for them and the reply."""
    from einpage.cli.execute import _sampling_from_args
    from einpage.models.conversation import Conversation
    if args.max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    sampling = _sampling_from_args(args)
    cfg, weights, codec, template, eos_ids, runner = chat_model(args)
    if messages is None:
        context = context_of(args, cfg)
    else:
        context = len(codec.encode_plain(template.render(messages))) + args.max_new_tokens + 1
    return Conversation(cfg, runner, codec, template, eos_ids, context, args.kv_granule,
                        sampling), runner


class _Streamer:
    """Prints a reply as its tokens come (a character held back until complete), without the
    end-of-turn token."""

    def __init__(self, conv, out: TextIO):
        self.stream, self.out = conv.codec.stream(), out
        self.eos = set(int(i) for i in conv.eos_ids)

    def __call__(self, token: int) -> None:
        if token not in self.eos:
            self._write(self.stream.push([token]))

    def finish(self) -> None:
        self._write(self.stream.finish() + "\n")

    def _write(self, text: str) -> None:
        if text:
            self.out.write(text)
            self.out.flush()


def _stats(turn) -> str:
    rate = turn.decode_rate
    return (f"[{turn.prefilled} tokens prefilled in {turn.prefill_s:.2f} s ({turn.reused} kept "
            f"from before); {len(turn.tokens)} new tokens"
            + (f", {rate:.1f} tokens/s" if rate else "") + f"; stopped at {turn.finish}]")


def cmd_chat(args, stdin: TextIO | None = None, out: TextIO | None = None) -> None:
    """Read the user's turns, one line each, from stdin until its end (or /exit); /reset starts
    over. Each reply streams to stdout."""
    stdin, out = stdin or sys.stdin, out or sys.stdout
    conv, runner = conversation(args)
    interactive = bool(getattr(stdin, "isatty", lambda: False)())
    system = [{"role": "system", "content": args.system}] if args.system else []
    conv.messages.extend(system)
    try:
        while True:
            if interactive:
                out.write("> ")
                out.flush()
            line = stdin.readline()
            if not line:
                break
            text = line.rstrip("\n")
            if not text.strip():
                continue
            if text.strip() in ("/exit", "/quit"):
                break
            if text.strip() == "/reset":
                conv.reset()
                conv.messages.extend(system)
                continue
            printer = _Streamer(conv, out)
            turn = conv.say(text, args.max_new_tokens, printer)
            printer.finish()
            if args.stats:
                print(_stats(turn), file=sys.stderr)
    finally:
        getattr(runner, "close", lambda: None)()


def generate_chat(args, out: TextIO) -> None:
    """`generate --chat MESSAGE` (after --system) or `--messages FILE`: the reply, streamed on
    a terminal; `--json`: one object (text, tokens, finish_reason, prefill and decode)."""
    for flag, given in (("--draft", args.draft), ("--out", args.out), ("--ignore-eos", args.ignore_eos),
                        ("--timing", args.timing), ("--trace", args.trace)):
        if given:
            raise InputError(f"{flag} is not taken with --chat or --messages")
    if args.messages is not None:
        if args.system is not None:
            raise InputError("--system goes with --chat; put it in the --messages file")
        messages = _read_messages(args.messages)
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.chat}]
    conv, runner = conversation(args, messages)
    tty = bool(getattr(out, "isatty", lambda: False)()) and not args.json
    printer = _Streamer(conv, out) if tty else None
    try:
        turn = conv.say(messages, args.max_new_tokens, printer)
    finally:
        getattr(runner, "close", lambda: None)()
    if args.json:
        print(json.dumps({"text": turn.text, "tokens": list(turn.tokens),
                          "finish_reason": turn.finish, "prompt": turn.prefilled,
                          "prefill_s": turn.prefill_s, "decode_s": turn.decode_s,
                          "decode_tokens_per_s": turn.decode_rate,
                          "backend": getattr(runner, "backend", "reference")},
                         sort_keys=True), file=out)
        return
    if printer is not None:
        printer.finish()
    else:
        print(turn.text, file=out)
    print(_stats(turn), file=sys.stderr)


def _read_messages(path: str) -> list:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as exc:
        raise InputError(f"--messages {path}: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"--messages {path}: not JSON ({exc})") from None
    if isinstance(data, dict) and "messages" in data:  # an API request's body
        data = data["messages"]
    if not isinstance(data, list) or not data:
        raise InputError(f"--messages {path}: expected a list of {{role, content}} messages")
    return data


HANDLERS = {"chat": cmd_chat}
