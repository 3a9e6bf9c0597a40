"""Continuous batching: many requests on one model, the weights streamed once per step for all.

The engine holds one KV store of `max_batch` rows (slots) and runs a loop on a thread of its
own. At each step boundary it admits waiting requests into free slots, lowest first (as many as
keep the pass within `prefill_tokens` rows x padded width), and prefills them together (one
pass of their prompts padded to a multiple of `prompt_granule` tokens, each row's logits
picking its request's first token, its rows written into its slot: `KVStore.fill_row`; rows
padded on the right see no padding, as a generation's rows do), then one decode step runs for
every active row at once (`decode_step_graph` of the smallest batch bucket, a power of two,
that covers the highest active slot, at most `max_batch`, over the smallest KV bucket that
covers the longest row; rows at their own positions). A row leaves when it stops (an
end-of-turn id, a stop string, `max_tokens`, its KV slots used up) or is cancelled (its client
went away): its
slot is free at the next step. Each (batch, KV) bucket's plan is compiled once by the runner
and kept (`PlanRunner` caches plans by graph); the step's session is held open while the
bucket stays the same and no row joined.

A row's tokens do not depend on the others: the decode step computes each row on its own
(its position, its KV rows, masked to them), so with temperature 0 every response is what the
request run alone gives (up to float32 rounding of differently blocked products). Each request
samples with its own `Sampling` (its seed) from its own row's logits.

Events go to each request's `sink` (called on the engine's thread): `Token(id, text, logprob,
top)` as tokens come (text: what can be shown now, a character held back until complete; a
stop string is never shown), then one `Done(finish, prompt_tokens, completion_tokens, text)`
or `Failed(message)`. A prefill or step that fails ends its rows with `Failed` and the engine
goes on; a sink that raises cancels its own request only.
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import numpy as np

from einpage.errors import EinpageError, InputError
from einpage.models.config import LlamaConfig
from einpage.models.generation import (Runner, Sampling, TokenPicker, decode_step_graph,
                                       open_session, prefill)
from einpage.models.kvstore import GRANULE, KVStore, capacity_for


@dataclass(frozen=True)
class Token:
    id: int
    text: str                      # new text to show (may be "")
    logprob: float | None = None   # of the token picked, where asked
    top: tuple[tuple[int, float], ...] = ()  # the most likely tokens and their logprobs
    end: bool = False              # an end id (not part of the completion)


@dataclass(frozen=True)
class Done:
    finish: str                    # "stop" (an end id or a stop string), "length", "cancelled"
    prompt_tokens: int
    completion_tokens: int
    text: str                      # the whole completion, up to a stop string


@dataclass(frozen=True)
class Failed:
    message: str


Event = Token | Done | Failed


class Unavailable(EinpageError):
    """The engine takes no request: it is stopping, or it failed (a 503, not the request's
    fault)."""


def _send(req: "Request", event: "Event") -> None:
    """`event` to `req`'s sink; a sink that fails (its client's loop closed) is the request's
    loss, not the engine's."""
    try:
        req.sink(event)
    except Exception:  # noqa: BLE001 - nothing a client does may stop the engine
        req.cancelled = True


def _bucket(n: int, most: int) -> int:
    """The smallest power of two at least `n`, at most `most`."""
    b = 1
    while b < n:
        b *= 2
    return min(b, most)


@dataclass
class Request:
    """What to generate: `prompt` ids, at most `max_tokens`, `sampling`, the ids that end it
    (`stop_ids`), strings that end it (`stop`, not shown), `logprobs` (None: none; k >= 0:
    the picked token's and the k most likely)."""
    prompt: Sequence[int]
    max_tokens: int
    sampling: Sampling = field(default_factory=Sampling)
    stop_ids: Sequence[int] = ()
    stop: Sequence[str] = ()
    logprobs: int | None = None
    sink: Callable[[Event], None] = lambda event: None
    # the engine's
    cancelled: bool = False
    slot: int | None = None


class _Row:
    """An admitted request's state in its slot."""

    def __init__(self, req: Request, codec):
        self.req = req
        self.picker = TokenPicker(1, req.sampling.resolved(), req.stop_ids)
        self.stream = codec.stream()
        self.tokens: list[int] = []
        self.text = ""      # shown so far
        self.held = ""      # decoded but held back: it may begin a stop string
        self.last = 0

    def take(self, token: int, logits: np.ndarray, full: bool = False) -> str | None:
        """Emit `token` (`full`: the row has no KV slot for another); the finish reason where
        the row stops here."""
        self.tokens.append(token)
        self.last = token
        logprob, top = None, ()
        if self.req.logprobs is not None:
            shifted = logits.astype(np.float64) - logits.max()
            lp = shifted - np.log(np.exp(shifted).sum())
            logprob = float(lp[token])
            if self.req.logprobs:
                best = np.argsort(-lp, kind="stable")[:self.req.logprobs]
                top = tuple((int(i), float(lp[i])) for i in best)
        end = bool(self.picker.finished[0])
        if end:  # an end id: not text; what the stream held back is
            new, finish = self.stream.finish(), "stop"
        else:
            new = self.stream.push([token])
            finish = "length" if full or len(self.tokens) >= self.req.max_tokens else None
            if finish is not None:
                new += self.stream.finish()
        return self._emit(Token(token, "", logprob, top, end), new, finish)

    def _emit(self, event: Token, new: str, finish: str | None) -> str | None:
        """Show `new` text, holding back a tail that may begin a stop string until the next
        token (or the end) says; the finish reason, "stop" where a stop string appeared."""
        pending = self.held + new
        found = [at for at in (pending.find(s) for s in self.req.stop) if at >= 0]
        if found:  # the earliest stop string in the text ends it
            at = min(found)
            self.text += pending[:at]
            self.held = ""
            _send(self.req, replace(event, text=pending[:at]))
            return "stop"
        keep = 0
        if finish is None:
            for s in self.req.stop:
                for k in range(min(len(s) - 1, len(pending)), 0, -1):
                    if s.startswith(pending[-k:]):
                        keep = max(keep, k)
                        break
        shown, self.held = pending[:len(pending) - keep], pending[len(pending) - keep:]
        self.text += shown
        _send(self.req, replace(event, text=shown))
        return finish


class Engine:
    """The continuous-batching loop (the module's docstring) over `run` (a plan runner, or the
    dense reference), for requests of at most `context` tokens each."""

    def __init__(self, cfg: LlamaConfig, run: Runner, codec, max_batch: int = 16,
                 context: int = 2048, granule: int = GRANULE, prefill_tokens: int = 8192,
                 prompt_granule: int = 16):
        if max_batch < 1 or context < 2:
            raise InputError(f"a server needs --max-batch >= 1 and --context >= 2, got "
                             f"{max_batch} and {context}")
        self.cfg, self.run, self.codec = cfg, run, codec
        self.max_batch, self.granule = max_batch, granule
        self.prompt_granule = prompt_granule  # prompts pad to a multiple (a plan per width)
        self.prefill_tokens = prefill_tokens  # the most rows x padded width one admission runs
        self.context = context  # the most positions a row may reach
        self.store = KVStore(cfg, max_batch, context)  # a ring: fewer slots, the window's
        self.rows: list[_Row | None] = [None] * max_batch
        self.waiting: deque[Request] = deque()
        self.lock = threading.Condition()
        self.stopping = False
        self.thread: threading.Thread | None = None
        self.steps = 0
        self.step_rows = 0   # rows summed over the steps (the mean batch is their ratio)
        self.failure: str | None = None
        self._session = None
        self._bucket: tuple[int, int] | None = None

    # ------------------------------------------------------------- the outside
    def start(self) -> None:
        self.thread = threading.Thread(target=self._loop, name="einpage-engine", daemon=True)
        self.thread.start()

    def submit(self, req: Request) -> Request:
        """Queue `req`; its events go to `req.sink`. InputError for a prompt it cannot hold."""
        if not req.prompt:
            raise InputError("the prompt is empty")
        if len(req.prompt) + 1 > self.context:
            raise InputError(f"the prompt is {len(req.prompt)} tokens; the server's context "
                             f"holds {self.context} (with room for one new token)")
        if req.max_tokens < 1:
            raise InputError(f"max_tokens must be at least 1, got {req.max_tokens}")
        with self.lock:
            if self.stopping or self.failure:
                raise Unavailable(self.failure or "the server is shutting down")
            self.waiting.append(req)
            self.lock.notify()
        return req

    def cancel(self, req: Request) -> None:
        """Free `req`'s slot at the next step boundary (its client went away)."""
        with self.lock:
            req.cancelled = True
            self.lock.notify()

    def stop(self, timeout: float | None = None) -> None:
        """End the loop after its step in progress: every request in flight or waiting gets
        `Done("cancelled")`, and the loop's thread closes its plan session and the runner
        (`timeout`: the most seconds to wait for it; None, until it has)."""
        with self.lock:
            self.stopping = True
            self.lock.notify()
        if self.thread is None:
            self._close()
        else:
            self.thread.join(timeout)

    def _close(self) -> None:
        self._close_session()
        getattr(self.run, "close", lambda: None)()

    @property
    def active(self) -> int:
        return sum(r is not None for r in self.rows)

    # ------------------------------------------------------------- the loop
    def _loop(self) -> None:
        try:
            while True:
                with self.lock:
                    while not self.stopping and not self.waiting and not self.active:
                        self.lock.wait()
                    if self.stopping:
                        break
                    admitted = self._admit()
                self._drop_cancelled()
                admitted = [slot for slot in admitted if self.rows[slot] is not None]
                if admitted:
                    self._guarded(self._prefill, admitted)
                if self.active:
                    self._guarded(self._step, [s for s, r in enumerate(self.rows)
                                               if r is not None])
        except Exception as exc:  # the loop itself: every request hears why, new ones are refused
            self.failure = f"the server's engine failed: {type(exc).__name__}: {exc}"
            for r in self.rows:
                if r is not None:
                    _send(r.req, Failed(self.failure))
            with self.lock:
                for req in self.waiting:
                    _send(req, Failed(self.failure))
                self.waiting.clear()
            self._close()
            return
        for slot, r in enumerate(self.rows):  # stopping: everything in flight is cancelled
            if r is not None:
                self._finish(slot, "cancelled")
        with self.lock:
            for req in self.waiting:
                self._finish_unstarted(req, "cancelled")
            self.waiting.clear()
        self._close()

    def _admit(self) -> list[int]:
        """Waiting requests into free slots, lowest first, while their prefill (rows x padded
        width, both bucketed) stays within `prefill_tokens` (one request at least)."""
        admitted, longest = [], 0
        while self.waiting and None in self.rows:
            req = self.waiting[0]
            if req.cancelled:
                self.waiting.popleft()
                self._finish_unstarted(req, "cancelled")
                continue
            width = capacity_for(max(longest, len(req.prompt)), self.prompt_granule)
            if admitted and _bucket(len(admitted) + 1, 1 << 30) * width > self.prefill_tokens:
                break
            self.waiting.popleft()
            longest = max(longest, len(req.prompt))
            slot = self.rows.index(None)
            req.slot = slot
            self.rows[slot] = _Row(req, self.codec)
            admitted.append(slot)
        return admitted

    def _guarded(self, work, slots: list[int]) -> None:
        """`work(slots)`; where it fails, those rows end with the failure (the others, and
        the server, go on)."""
        try:
            work(slots)
        except Exception as exc:  # noqa: BLE001 - a row's failure is its request's
            self._close_session()
            message = f"{type(exc).__name__}: {exc}".splitlines()[0]
            for slot in slots:
                row = self.rows[slot]
                if row is not None:
                    self.rows[slot] = None
                    _send(row.req, Failed(message))

    def _finish_unstarted(self, req: Request, finish: str) -> None:
        _send(req, Done(finish, len(req.prompt), 0, ""))

    def _finish(self, slot: int, finish: str) -> None:
        row = self.rows[slot]
        self.rows[slot] = None
        _send(row.req, Done(finish, len(row.req.prompt), len(row.tokens), row.text))

    def _drop_cancelled(self) -> None:
        for slot, r in enumerate(self.rows):
            if r is not None and r.req.cancelled:
                self._finish(slot, "cancelled")

    def _prefill(self, slots: list[int]) -> None:
        """The requests just admitted, together: one prefill pass of their prompts (rows
        padded on the right to a multiple of `prompt_granule`, the batch to a power of two: a
        pass streams the weights once for all), each row's positions into its slot, each
        request's first token from its own last position."""
        prompts = [self.rows[s].req.prompt for s in slots]
        longest = max(len(p) for p in prompts)
        width = min(capacity_for(longest, self.prompt_granule), self.context)
        batch = _bucket(len(slots), 1 << 30)
        tokens = np.zeros((batch, width), np.int64)
        lengths = np.ones(batch, np.int64)
        for k, p in enumerate(prompts):
            tokens[k, :len(p)] = p
            lengths[k] = len(p)
        self._close_session()  # one plan's arena at a time; and it has not seen these rows
        out = prefill(self.cfg, tokens, self.run, lengths, last=True)
        for k, slot in enumerate(slots):
            n = int(lengths[k])
            self.store.fill_row(slot, {name: value[k:k + 1] for name, value in out.items()
                                       if name.startswith("cache.")}, n)
            self._take(slot, np.asarray(out["logits"][k], np.float32))

    def _take(self, slot: int, logits: np.ndarray) -> None:
        row = self.rows[slot]
        token = int(row.picker(logits[None, :])[0])
        # no KV slot left for the token just picked: the row ends with it
        finish = row.take(token, logits, full=int(self.store.pos[slot]) >= self.context)
        if finish is not None:
            self._finish(slot, finish)

    def _step(self, active: list[int]) -> None:
        """One decode step of the `active` rows (the batch: the first rows of the store, up to
        the highest active slot, bucketed)."""
        batch = _bucket(active[-1] + 1, self.max_batch)
        longest = int(self.store.pos[active].max()) + 1
        capacity = min(capacity_for(longest, self.granule), self.store.capacity)
        if self._bucket != (batch, capacity):
            self._close_session()
            self._session = open_session(self.run, decode_step_graph(self.cfg, batch, capacity))
            self._bucket = (batch, capacity)
        tokens = np.zeros((batch, 1), np.int64)
        pos = np.zeros(batch, np.int64)
        for s in active:
            tokens[s, 0] = self.rows[s].last
            pos[s] = self.store.pos[s]
        out = self._session.run({"tokens": tokens, "pos": pos,
                                 **self.store.view_rows(batch, capacity)})
        for name, lead, value in self.store.write_slots(out, active):
            self._session.write(name, lead, value)
        logits = np.asarray(out["logits"], np.float32)
        self.steps += 1
        self.step_rows += len(active)
        for s in active:
            self._take(s, logits[s, -1])

    def _close_session(self) -> None:
        if self._session is not None:
            self._session.close()
        self._session, self._bucket = None, None


def wait_for(engine: Engine, req: Request, timeout: float | None = None) -> tuple[list, Done]:
    """Submit `req` and wait for its end (for scripts and tests): its `Token` events, and its
    `Done`; InputError for a `Failed`."""
    events: list = []
    done = threading.Event()

    def sink(event):
        events.append(event)
        if isinstance(event, (Done, Failed)):
            done.set()

    req.sink = sink
    engine.submit(req)
    if not done.wait(timeout):
        engine.cancel(req)
        raise TimeoutError("the request did not finish in time")
    last = events[-1]
    if isinstance(last, Failed):
        raise InputError(last.message)
    return [e for e in events if isinstance(e, Token)], last


