"""Python's cyclic garbage collector paused while bulk work makes millions of objects.

A compile, a taskgraph renumbered (`taskgraph.prune_dead`) and a plan file read or written
(`planfile`) make millions of small acyclic objects (blocks, tasks, plan nodes, JSON dicts) and
free what they drop by reference counting: no cyclic garbage to speak of. The collector's
passes over the generations those objects fill take 12-15% of a compile (llama3.1-70b prefill
at 24 GB 3.2 -> 2.7 s, llama3.2-1b B=16 at 2.6 GB 9.0 -> 7.8 s with the same peak memory), 60%
of a renumbering (llama-65b B=16 S=8192) and two thirds of reading a 69 MB plan (3.1 -> 1.0 s),
so it is paused for such work and resumed after (where it was running: nested and concurrent
pauses resume it once, when the last one ends).
"""
from __future__ import annotations

import gc
import threading
from contextlib import contextmanager
from typing import Iterator

_lock = threading.Lock()
_depth = 0           # pauses under way (compiles, plan files, renumberings)
_resume = False      # whether the collector ran before the first of them


@contextmanager
def paused() -> Iterator[None]:
    global _depth, _resume
    with _lock:
        if _depth == 0:
            _resume = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _resume:
                gc.enable()
