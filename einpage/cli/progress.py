"""The compile progress bar, drawn by tqdm on stderr: shown only on a terminal (or when asked),
only once a stage has run for `delay` seconds, redrawn at most ten times a second, and cleared
when done. The compiler reports `(stage, done, total)`; each new stage gets a bar of its own."""
from __future__ import annotations

import sys

from tqdm import tqdm


class Progress:
    def __init__(self, enabled: bool | None = None, stream=None, delay: float = 2.0):
        self.stream = stream if stream is not None else sys.stderr
        if enabled is None:
            enabled = bool(getattr(self.stream, "isatty", lambda: False)())
        self.enabled, self.delay = enabled, delay
        self.bar: tqdm | None = None
        self.stage: str | None = None

    def __call__(self, stage: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        if stage != self.stage or self.bar is None:
            self.close()
            self.stage = stage
            self.bar = tqdm(total=total, initial=done, desc=stage, unit="task", file=self.stream,
                            delay=self.delay, mininterval=0.1, leave=False, dynamic_ncols=True)
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
            self.stage = None
