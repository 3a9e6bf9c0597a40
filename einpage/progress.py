"""A progress bar on stderr for long compiles: shown only on a terminal, only once a compile has
run for `delay` seconds, redrawn at most ten times a second, and cleared when done."""
from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, enabled: bool | None = None, stream=None, delay: float = 2.0,
                 width: int = 30):
        self.stream = stream if stream is not None else sys.stderr
        if enabled is None:
            enabled = bool(getattr(self.stream, "isatty", lambda: False)())
        self.enabled, self.delay, self.width = enabled, delay, width
        self.t0 = time.monotonic()
        self.last = 0.0
        self.shown = False

    def __call__(self, stage: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self.t0 < self.delay or (now - self.last < 0.1 and done < total):
            return
        self.last = now
        share = done / total if total else 1.0
        filled = int(share * self.width)
        bar = "#" * filled + "." * (self.width - filled)
        self.stream.write(f"\r{stage}: [{bar}] {share:4.0%} ({done}/{total} tasks, "
                          f"{now - self.t0:.0f} s)")
        self.stream.flush()
        self.shown = True

    def close(self) -> None:
        if self.shown:
            self.stream.write("\r" + " " * (self.width + 60) + "\r")
            self.stream.flush()
            self.shown = False
