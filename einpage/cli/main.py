"""The parser, the dispatch to each command group, and the error boundary: every user error ends
with one line on stderr and exit status 2."""
from __future__ import annotations

import argparse
import sys

from einpage import __version__
from einpage.cli import catalog, chat, execute, plan, serve
from einpage.cli.outputs import check_outputs
from einpage.errors import EinpageError, Interrupted
from einpage.outputs import ignore_file_size_signal

GROUPS = (catalog, plan, execute, chat, serve)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse prints usage too; keep it to one line)
        self.exit(2, f"einpage: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="einpage", description="Run einsum tensor programs that do not fit in "
                                                 "GPU memory.")
    parser.add_argument("--version", action="version", version=f"einpage {__version__}",
                        help="print einpage's version and exit")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for group in GROUPS:
        group.add_commands(sub)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handlers = {name: handler for group in GROUPS for name, handler in group.HANDLERS.items()}
    ignore_file_size_signal()  # past `ulimit -f` a write fails (one line), no SIGXFSZ kill
    try:
        check_outputs(args)  # every output writable before any work (einpage.cli.outputs)
        handlers[args.command](args)
    except Interrupted as exc:  # Ctrl-C inside a run: its queues stopped, memory released
        print(f"einpage: {str(exc).splitlines()[0] if str(exc) else 'interrupted'}",
              file=sys.stderr)
        return 130
    except EinpageError as exc:  # one line: the context an API caller sees stays in the message
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"einpage: error: {first}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("einpage: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as exc:  # a bug: its traceback; under mpiexec every rank stops with it
        import traceback
        traceback.print_exc()
        from einpage.runtime.comm import abort_world
        abort_world(f"{type(exc).__name__}: {exc}")
        raise SystemExit(1) from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
