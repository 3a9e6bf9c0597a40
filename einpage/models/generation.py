"""Prefill and greedy decoding over any graph runner (the dense reference, or a compiled plan on a
backend).

A generation is one prefill, then decode steps that each run one plan per KV-store bucket: the
positions are an input (`pos`), so the plan of a bucket serves every step until the positions
outgrow it (`kvstore.step_capacities` says which buckets a generation uses, up front). The
store's rows are written in place after each step (`KVStore.write`); nothing is concatenated.

Rows of different lengths go in one batch padded on the right (`pad_rows`): row b's real tokens
at positions 0..lengths[b]-1, pads after them. Causal attention means no real position sees a
pad, so each row's logits at its real positions, its first new token (from its own last real
position) and, with the store filled with its real rows only (`KVStore.fill(cache, lengths)`),
every later token equal the row's own run.

A runner is a callable `(graph, inputs) -> outputs`. One that also has `open(graph)` returns a
*session*: the plan held open on its backend across steps (`run(inputs)`, `write(name, (b, slot),
row)` for the store rows it keeps on the device, `close()`). A plain callable runs each step from
the host store.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Mapping, Protocol, Sequence

import numpy as np

from einpage.errors import InputError
from einpage.ir.graph import Graph
from einpage.models import llama
from einpage.models.config import LlamaConfig
from einpage.models.kvstore import GRANULE, KVStore, capacity_for, step_capacities

#: runs a concrete graph: (graph, inputs by name) -> outputs by name
Runner = Callable[[Graph, Mapping[str, np.ndarray]], Mapping[str, np.ndarray]]


class Session(Protocol):
    def run(self, inputs: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]: ...

    def write(self, name: str, lead: tuple[int, ...], values: np.ndarray) -> None: ...

    def close(self) -> None: ...


class _CallSession:
    """A plain runner as a session: every step reads the host store."""

    def __init__(self, run: Runner, graph: Graph):
        self._run, self._graph = run, graph

    def run(self, inputs):
        return self._run(self._graph, inputs)

    def write(self, name, lead, values) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> "_CallSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_session(run: Runner, graph: Graph) -> Session:
    """`run.open(graph)` where the runner holds plans open, else `run` called per step."""
    opener = getattr(run, "open", None)
    return opener(graph) if opener is not None else _CallSession(run, graph)


def check_tokens(cfg: LlamaConfig, tokens: np.ndarray) -> np.ndarray:
    tokens = np.asarray(tokens)
    if tokens.ndim != 2 or tokens.shape[0] == 0 or tokens.shape[1] == 0:
        raise InputError(f"token ids must have shape (batch, length), got {tokens.shape}")
    if not np.issubdtype(tokens.dtype, np.integer):
        raise InputError(f"token ids must be integers, got dtype {tokens.dtype}")
    if tokens.min() < 0 or tokens.max() >= cfg.vocab:
        bad = int(tokens.min() if tokens.min() < 0 else tokens.max())
        raise InputError(f"token id {bad} out of range for a vocabulary of {cfg.vocab}")
    return tokens.astype(np.int64)


def check_lengths(tokens: np.ndarray, lengths: np.ndarray | None) -> np.ndarray:
    """Each row's real length (default: all of `tokens`' length), int64 [B], each 1..S."""
    batch, seq = tokens.shape
    if lengths is None:
        return np.full(batch, seq, np.int64)
    lengths = np.asarray(lengths)
    if lengths.shape != (batch,) or not np.issubdtype(lengths.dtype, np.integer):
        raise InputError(f"row lengths must be {batch} integers, got {lengths.dtype} "
                         f"{lengths.shape}")
    if lengths.min() < 1 or lengths.max() > seq:
        raise InputError(f"row lengths {lengths.tolist()} outside 1..{seq}")
    return lengths.astype(np.int64)


def pad_rows(rows: Sequence[Sequence[int]], pad: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Rows of token ids as one batch padded on the right with `pad` (any valid id: no real
    position sees it): (tokens int64 [B, longest], lengths int64 [B])."""
    lengths = np.array([len(r) for r in rows], np.int64)
    if lengths.size == 0 or lengths.min() < 1:
        raise InputError("every row needs at least one token")
    tokens = np.full((len(rows), int(lengths.max())), pad, np.int64)
    for b, row in enumerate(rows):
        tokens[b, :len(row)] = row
    return tokens, lengths


def prefill(cfg: LlamaConfig, tokens: np.ndarray, run: Runner,
            lengths: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The prefill's outputs (`logits` [B, S, vocab], `cache.<l>.k|v`) for rows padded on the
    right to S; `lengths` (per row, default S) is only checked here: `last_logits` and
    `KVStore.fill` take it."""
    tokens = check_tokens(cfg, tokens)
    check_lengths(tokens, lengths)
    graph = llama.prefill_graph(cfg).bind(B=tokens.shape[0], S=tokens.shape[1])
    return dict(run(graph, {"tokens": tokens}))


def last_logits(logits: np.ndarray, lengths: np.ndarray | None = None) -> np.ndarray:
    """Each row's logits at its last real position [B, vocab] (`lengths` default: all)."""
    lengths = check_lengths(logits[..., 0], lengths)
    return logits[np.arange(logits.shape[0]), lengths - 1]


@lru_cache(maxsize=32)
def _decode_graph(cfg: LlamaConfig, batch: int, capacity: int) -> Graph:
    return _unbound_decode(cfg).bind(B=batch, C=capacity)


@lru_cache(maxsize=16)
def _unbound_decode(cfg: LlamaConfig) -> Graph:
    return llama.decode_graph(cfg)


def decode_step_graph(cfg: LlamaConfig, batch: int, capacity: int) -> Graph:
    """The decode step of `batch` rows over a store of `capacity` slots (built once per process
    for each `(cfg, batch, capacity)`)."""
    return _decode_graph(cfg, batch, capacity)


def _argmax(logits: np.ndarray, lengths: np.ndarray | None = None) -> np.ndarray:
    last = last_logits(logits, lengths)
    if not np.isfinite(last).all():
        raise InputError("the model produced non-finite logits (NaN or inf): the weights or "
                         "the computation dtype overflow")
    return np.argmax(last, axis=-1).astype(np.int64)


def decode(cfg: LlamaConfig, store: KVStore, last: np.ndarray, steps: int, run: Runner,
           granule: int = GRANULE, on_token: Callable[[np.ndarray], None] | None = None
           ) -> np.ndarray:
    """`steps` greedy decode steps from each row's `last` token [B] and the store's positions
    (rows may be at different positions): int64 [B, steps] tokens. Each step's rows go into the
    store. One session per bucket capacity (`capacity_for`, cut to the store's own capacity),
    opened when the positions reach it."""
    last = np.asarray(last, np.int64)
    if last.shape != (store.batch,):
        raise InputError(f"{last.shape[0] if last.ndim else 0} last tokens for a batch of "
                         f"{store.batch}")
    picked = []
    session, capacity = None, 0
    try:
        for _ in range(steps):
            if store.full:
                raise InputError(f"the KV store of {store.capacity} slots cannot take position "
                                 f"{int(store.pos.max())}")
            need = min(capacity_for(int(store.pos.max()) + 1, granule), store.capacity)
            if need != capacity:
                if session is not None:
                    session.close()
                capacity = need
                session = open_session(run, decode_step_graph(cfg, store.batch, capacity))
            out = session.run({"tokens": last[:, None], "pos": store.pos.copy(),
                               **store.view(capacity)})
            for name, lead, row in store.write(out):
                session.write(name, lead, row)
            last = _argmax(out["logits"])
            picked.append(last)
            if on_token is not None:
                on_token(last)
    finally:
        if session is not None:
            session.close()
    return np.stack(picked, axis=1) if picked else np.zeros((store.batch, 0), np.int64)


@dataclass(frozen=True)
class Generated:
    """A generation's new tokens [B, N] (row b's N new tokens), each row's prompt length, and
    where its time went."""
    tokens: np.ndarray
    prefill_s: float
    decode_s: float
    capacities: tuple[int, ...]   # the decode buckets, in order
    lengths: tuple[int, ...]      # each row's real prompt tokens

    @property
    def decode_steps(self) -> int:
        return self.tokens.shape[1] - 1

    def rates(self) -> dict[str, float | None]:
        """Prefill tokens/s (real prompt tokens, pads not counted) and decode tokens/s."""
        batch = self.tokens.shape[0]
        return {"prefill_tokens_per_s": sum(self.lengths) / self.prefill_s
                if self.prefill_s > 0 else None,
                "decode_tokens_per_s": batch * self.decode_steps / self.decode_s
                if self.decode_s > 0 and self.decode_steps else None}


def generate(cfg: LlamaConfig, prompt: np.ndarray, new_tokens: int, run: Runner,
             granule: int = GRANULE, on_token: Callable[[np.ndarray], None] | None = None,
             lengths: np.ndarray | None = None) -> Generated:
    """`new_tokens` greedy tokens per row: the prefill picks the first (each row from its last
    real position; `lengths`: rows padded on the right, default all of the prompt), each decode
    step one more (rows at their own positions). The store is allocated once at the largest
    bucket the generation needs."""
    if new_tokens < 1:
        raise InputError(f"new_tokens must be at least 1, got {new_tokens}")
    prompt = check_tokens(cfg, prompt)
    lengths = check_lengths(prompt, lengths)
    batch, length = prompt.shape[0], int(lengths.max())
    t0 = time.perf_counter()
    out = prefill(cfg, prompt, run, lengths)
    first = _argmax(out["logits"], lengths)
    prefill_s = time.perf_counter() - t0
    if on_token is not None:
        on_token(first)
    caps = step_capacities(length, new_tokens, granule, cfg.kv_ring)
    t0 = time.perf_counter()
    rest = np.zeros((batch, 0), np.int64)
    if caps:
        store = KVStore(cfg, batch, caps[-1])
        store.fill(out, lengths)
        rest = decode(cfg, store, first, new_tokens - 1, run, granule, on_token)
    decode_s = time.perf_counter() - t0
    return Generated(np.concatenate([first[:, None], rest], axis=1), prefill_s, decode_s, caps,
                     tuple(int(n) for n in lengths))


def greedy(cfg: LlamaConfig, prompt: np.ndarray, new_tokens: int, run: Runner,
           granule: int = GRANULE, lengths: np.ndarray | None = None) -> np.ndarray:
    """`new_tokens` greedy tokens per row, int64 (batch, new_tokens) (`generate`'s tokens)."""
    return generate(cfg, prompt, new_tokens, run, granule, lengths=lengths).tokens
