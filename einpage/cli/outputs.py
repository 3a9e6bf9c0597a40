"""The command line's outputs: every option that writes a file, checked before any work starts,
and written so that a failure never loses finished work silently.

- An option that names a file einpage writes is declared with `action=OutputPath` (`-o`,
  `--out`, `--plot`, `--dot`, `--trace`); `check_outputs(args)` (called by `main` before the
  command runs) checks each one given (`einpage.outputs.check_writable`: the directory exists
  and takes a new file, the path is not a directory), that no two name the same file, and that
  matplotlib is there for `--plot`. A bad output is one line and exit 2 before compiling or
  running anything.
- Each file is written whole or not at all (`einpage.outputs.atomic_open`).
- After the work, the outputs are written in order of what they cost to make again: the plan
  (`-o`) or the results (`--out`) first, then the trace, the dot graph, the plot. A failed one
  does not stop the rest: `Deferred` runs each, the report still prints (naming the files that
  were written) and the first failure is raised last, so it is the one line on stderr and the
  exit status is 2.
"""
from __future__ import annotations

import argparse
import os
from typing import Callable

from einpage.errors import EinpageError, OutputError
from einpage.outputs import check_writable

#: the attribute of the parsed arguments where `OutputPath` records the outputs given
_KEY = "_einpage_outputs"


class OutputPath(argparse.Action):
    """`add_argument(..., action=OutputPath)`: an option whose value is a file einpage writes;
    stored like a plain option and recorded for `check_outputs`."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        given = dict(getattr(namespace, _KEY, None) or {})
        given[self.dest] = (option_string or self.option_strings[-1], values)
        setattr(namespace, _KEY, given)


def outputs_of(args) -> list[tuple[str, str]]:
    """`(flag, path)` of every output option given on the command line."""
    return [v for v in (getattr(args, _KEY, None) or {}).values() if v[1] is not None]


def check_outputs(args) -> None:
    """Before any work: every output given can be written, no two name one file, and `--plot`
    has matplotlib. Raises `OutputError` (one line, exit 2)."""
    seen: dict[str, str] = {}
    for flag, path in outputs_of(args):
        check_writable(path, flag)
        key = os.path.realpath(path)
        special = os.path.exists(key) and not os.path.isfile(key)  # /dev/null, a pipe
        if key in seen and not special:
            raise OutputError(f"{seen[key]} and {flag} both name {path}: give each its own file")
        seen[key] = flag
        if flag == "--plot":
            import importlib.util
            if importlib.util.find_spec("matplotlib") is None:
                raise OutputError("--plot needs matplotlib: pip install 'einpage[plot]'")


class Deferred:
    """Outputs written one after another after the work: `write(fn, *args)` runs one writer and
    returns whether it succeeded; an `EinpageError` it raises is kept, not raised, so the later
    outputs and the report still come. `finish()` raises the first kept error."""

    def __init__(self) -> None:
        self.errors: list[EinpageError] = []

    def write(self, fn: Callable, *args) -> bool:
        try:
            fn(*args)
        except EinpageError as exc:
            self.errors.append(exc)
            return False
        return True

    def finish(self) -> None:
        if self.errors:
            raise self.errors[0]
