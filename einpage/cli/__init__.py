"""The `einpage` command line: one module per command group, each with `add_commands(sub)` and
its `HANDLERS`; `main` builds the parser from them and turns every `EinpageError` into one line
on stderr and exit status 2.

    main      the parser, the dispatch and the error boundary
    common    helpers the groups share (token input, the logits report, device flags)
    outputs   the options that write files: checked before any work, written in order
    catalog   `models`, `devices`: what einpage knows
    plan      `compile`, `inspect`: plans and their predictions
    execute   `run`, `generate`: running models and plans
    report    the printed plan report
    progress  the progress bar; plot, dot: the pictures
"""
from einpage.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
