"""Decode steps of a plan held open in a `StreamSession`, for the tests that compare backends on
one session: the prompt prefilled by the dense reference into a KV store, then `steps` passes,
each writing its rows into the store and the session's device copies."""
from __future__ import annotations

from typing import Callable

import numpy as np


def held_decode_steps(cfg, weights, mg, prompt: np.ndarray, backend, timing: bool,
                      capacity: int = 8, steps: int = 3,
                      after_pass: Callable | None = None) -> tuple[np.ndarray, int]:
    """(the logits of every step, stacked; the session's replays). `after_pass(backend)` runs
    after each pass (checks of what the backend did)."""
    from einpage.models.generation import prefill
    from einpage.models.kvstore import KVStore
    from einpage.runtime import evaluate
    from einpage.runtime.stream_executor import StreamSession
    store = KVStore(cfg, prompt.shape[0], capacity)
    out = prefill(cfg, prompt, lambda g, i: evaluate(g, i, weights))
    store.fill(out)
    last = np.argmax(out["logits"][:, -1], axis=-1)
    logits = []
    with StreamSession(mg, weights, backend, timing=timing) as session:
        for _ in range(steps):
            step = session.run({"tokens": last[:, None], "pos": store.pos.copy(),
                                **store.view(capacity)}).outputs
            if after_pass is not None:
                after_pass(backend)
            for name, lead, row in store.write(step):
                session.write(name, lead, row)
            last = np.argmax(step["logits"][:, -1], axis=-1)
            logits.append(step["logits"])
        replays = session.replays
    return np.stack(logits), replays
