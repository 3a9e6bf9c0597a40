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

Picking tokens (`Sampling`, `TokenPicker`): greedy (the argmax of the float32 logits) by default;
on request, sampled from the float64 softmax of the float32 logits divided by the temperature,
cut to the `top_k` most likely tokens and then to the nucleus of mass `top_p` (transformers'
order: temperature, top-k, top-p), by inverse transform of one uniform draw per row per step
from a NumPy Generator seeded with `seed`. One draw per row per step, finished rows included,
so a row's draws do not depend on when other rows stop; the same seed gives the same tokens on
every backend and budget, since their logits agree to float32 rounding and a token changes only
where a draw falls within that rounding of a boundary of the cumulative distribution.

Stopping (transformers' rule): a row finishes at the step that picks one of `eos_ids` (the
EOS token is kept as its last new token); every later token of a finished row is `pad_id`
(default: the first EOS id) and is fed to the next step as transformers does; the generation
ends when every row has finished or at `new_tokens`.
"""
from __future__ import annotations

import math
import numbers
import secrets
import time
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, Callable, Iterable, Mapping, Protocol, Sequence

import numpy as np

from einpage.errors import InputError
from einpage.ir.graph import Graph
from einpage.models import llama
from einpage.models.config import LlamaConfig
from einpage.models.kvstore import GRANULE, KVStore, capacity_for, step_capacities

if TYPE_CHECKING:
    from einpage.models.speculative import ModelDraft, NgramDraft, SpeculationStats

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
            lengths: np.ndarray | None = None, passes: int = 1,
            last: bool = False) -> dict[str, np.ndarray]:
    """The prefill's outputs (`logits` [B, S, vocab], `cache.<l>.k|v`) for rows padded on the
    right to S; `lengths` (per row, default S) is only checked here: `last_logits` and
    `KVStore.fill` take it. With `last`, `logits` is [B, vocab]: each row's at its last real
    position alone (`llama.prefill_graph(last=True)`: what a generation needs). `passes` > 1
    (a benchmark) runs the same pass that many times in one session of `run` (a runner that
    can `open` a plan) and returns the last."""
    tokens = check_tokens(cfg, tokens)
    lengths = check_lengths(tokens, lengths)
    graph = _prefill_graph(cfg, last).bind(B=tokens.shape[0], S=tokens.shape[1])
    inputs = {"tokens": tokens}
    if last:
        inputs["last"] = last_position(lengths, tokens.shape[1], cfg.dtype.numpy)
    if passes == 1:
        out = dict(run(graph, inputs))
    else:
        with open_session(run, graph) as session:
            for _ in range(passes):
                out = dict(session.run(inputs))
    if last:
        out["logits"] = out["logits"][:, 0]
    return out


@lru_cache(maxsize=8)
def _prefill_graph(cfg: LlamaConfig, last: bool) -> Graph:
    return llama.prefill_graph(cfg, last)


def last_position(lengths: np.ndarray, seq: int, dtype) -> np.ndarray:
    """The `last` input of a prefill that picks each row's last position: [B, S, 1], one at
    `lengths[b] - 1`, zero elsewhere."""
    pick = np.zeros((len(lengths), seq, 1), dtype)
    pick[np.arange(len(lengths)), np.asarray(lengths) - 1, 0] = 1
    return pick


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


def _finite(last: np.ndarray) -> np.ndarray:
    if not np.isfinite(last).all():
        raise InputError("the model produced non-finite logits (NaN or inf): the weights or "
                         "the computation dtype overflow")
    return last


def _argmax(logits: np.ndarray, lengths: np.ndarray | None = None) -> np.ndarray:
    return np.argmax(_finite(last_logits(logits, lengths)), axis=-1).astype(np.int64)


# ------------------------------------------------------------------ picking the next token

@dataclass(frozen=True)
class Sampling:
    """How each next token is picked. `temperature` 0 (the default): greedy, the argmax; above
    0: sampled from softmax(logits / temperature) (float64), restricted to the `top_k` most
    likely tokens (0: no limit; ties at the k-th value kept, as transformers does) and then to
    the nucleus: the most likely tokens while the mass ranked above a token is below `top_p`
    (1: all), by a NumPy Generator seeded with `seed` (None: fresh entropy, see `resolved`).
    Greedy takes no `top_p`/`top_k`/`seed`: giving one is an InputError, not ignored."""
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self):
        t, p, k, seed = self.temperature, self.top_p, self.top_k, self.seed
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or not math.isfinite(t) \
                or t < 0:
            raise InputError(f"temperature must be a finite number >= 0 (0: greedy), got {t!r}")
        if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0 < p <= 1:
            raise InputError(f"top_p must be in (0, 1], got {p!r}")
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 0:
            raise InputError(f"top_k must be an integer >= 0 (0: no limit), got {k!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral)
                                 or seed < 0):
            raise InputError(f"seed must be an integer >= 0, got {seed!r}")
        if t == 0:
            given = [name for name, value, default in (("top_p", p, 1.0), ("top_k", k, 0),
                                                       ("seed", seed, None)) if value != default]
            if given:
                raise InputError(f"{' and '.join(given)} appl{'y' if len(given) > 1 else 'ies'}"
                                 " to sampling only: give a temperature > 0 (temperature 0 is "
                                 "greedy decoding)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def resolved(self) -> "Sampling":
        """This sampling with a seed: a fresh 32-bit one from the OS's entropy where none was
        given (report it: the same seed repeats the run)."""
        if self.greedy or self.seed is not None:
            return self
        return Sampling(self.temperature, self.top_p, self.top_k, secrets.randbits(32))


def probabilities(last: np.ndarray, sampling: Sampling) -> np.ndarray:
    """The distribution each row's next token is sampled from: float64 [B, vocab] from each
    row's float32 logits `last` [B, vocab] (temperature, then top-k, then top-p). Greedy: one-hot
    at the argmax."""
    last = _finite(np.asarray(last))
    batch, vocab = last.shape
    if sampling.greedy:
        probs = np.zeros((batch, vocab))
        probs[np.arange(batch), np.argmax(last, axis=-1)] = 1.0
        return probs
    x = last.astype(np.float64)
    z = (x - x.max(axis=-1, keepdims=True)) / sampling.temperature  # <= 0: no overflow
    if 0 < sampling.top_k < vocab:
        kth = np.partition(z, vocab - sampling.top_k, axis=-1)[:, vocab - sampling.top_k, None]
        z = np.where(z < kth, -np.inf, z)
    probs = np.exp(z)
    probs /= probs.sum(axis=-1, keepdims=True)
    if sampling.top_p < 1:
        order = np.argsort(-probs, axis=-1, kind="stable")  # ties: the lower id first (argmax's)
        ranked = np.take_along_axis(probs, order, axis=-1)
        above = np.cumsum(ranked, axis=-1) - ranked  # the mass ranked above each token
        keep_ranked = above < sampling.top_p
        keep_ranked[:, 0] = True
        keep = np.zeros_like(keep_ranked)
        np.put_along_axis(keep, order, keep_ranked, axis=-1)
        probs = np.where(keep, probs, 0.0)
        probs /= probs.sum(axis=-1, keepdims=True)
    return probs


def sample(last: np.ndarray, sampling: Sampling, rng: np.random.Generator | None) -> np.ndarray:
    """Each row's next token int64 [B] from its logits `last` [B, vocab]: the argmax (greedy;
    `rng` unused) or one draw `u = rng.random(B)` per row through the inverse of the cumulative
    `probabilities` in id order (the first id whose cumulative mass passes u)."""
    if sampling.greedy:
        return np.argmax(_finite(np.asarray(last)), axis=-1).astype(np.int64)
    if rng is None:
        raise InputError("sampling needs a numpy Generator (np.random.default_rng(seed))")
    probs = probabilities(last, sampling)
    u = rng.random(probs.shape[0])
    cdf = np.cumsum(probs, axis=-1)
    picked = (cdf <= (u * cdf[:, -1])[:, None]).sum(axis=-1)
    last_possible = probs.shape[1] - 1 - np.argmax(probs[:, ::-1] > 0, axis=-1)
    return np.minimum(picked, last_possible).astype(np.int64)


class TokenPicker:
    """Picks a batch's tokens step after step (`sampling`, its Generator made once) and keeps
    which rows have finished: a row finishes at the step that picks one of `eos_ids`; its later
    tokens are `pad_id` (default the first EOS id, as transformers pads with its pad token, else
    its first EOS). `new_lengths`: each row's new tokens up to and including its EOS."""

    def __init__(self, batch: int, sampling: Sampling | None = None,
                 eos_ids: Iterable[int] = (), pad_id: int | None = None):
        self.sampling = (sampling or Sampling()).resolved()
        self.rng = None if self.sampling.greedy else np.random.default_rng(self.sampling.seed)
        self.eos = np.asarray(list(eos_ids), np.int64).reshape(-1)
        self.pad = int(pad_id) if pad_id is not None else (int(self.eos[0]) if self.eos.size
                                                           else 0)
        self.finished = np.zeros(batch, bool)
        self.new_lengths = np.zeros(batch, np.int64)

    def emit(self, b: int, token: int) -> bool:
        """Row `b` (not finished) takes `token` (one picked elsewhere: a verify pass accepts
        several at once); whether the row has finished with it."""
        if self.finished[b]:
            raise InputError(f"row {b} has finished: it takes no more tokens")
        self.new_lengths[b] += 1
        if self.eos.size and int(token) in self.eos:
            self.finished[b] = True
        return bool(self.finished[b])

    def __call__(self, last: np.ndarray) -> np.ndarray:
        """The next tokens [B] from each row's logits [B, vocab]; finished rows get the pad."""
        ids = sample(last, self.sampling, self.rng)
        ids = np.where(self.finished, self.pad, ids)
        self.new_lengths += ~self.finished
        if self.eos.size:
            self.finished |= np.isin(ids, self.eos)
        return ids

    @property
    def done(self) -> bool:
        """Every row has finished (no step is left to run)."""
        return bool(self.finished.all())

    def reasons(self) -> tuple[str, ...]:
        """Why each row stopped: "eos" (it picked an EOS id) or "length" (new_tokens ran out)."""
        return tuple("eos" if f else "length" for f in self.finished)


def _decode(cfg: LlamaConfig, store: KVStore, last: np.ndarray, steps: int, run: Runner,
            granule: int, on_token, picker: TokenPicker) -> tuple[np.ndarray, tuple[int, ...]]:
    """`decode`, and the bucket capacities it opened sessions for, in order."""
    last = np.asarray(last, np.int64)
    if last.shape != (store.batch,):
        raise InputError(f"{last.shape[0] if last.ndim else 0} last tokens for a batch of "
                         f"{store.batch}")
    picked, opened = [], []
    session, capacity = None, 0
    try:
        for _ in range(steps):
            if picker.done:
                break
            if store.full:
                raise InputError(f"the KV store of {store.capacity} slots cannot take position "
                                 f"{int(store.pos.max())}")
            need = min(capacity_for(int(store.pos.max()) + 1, granule), store.capacity)
            if need != capacity:
                if session is not None:
                    session.close()
                capacity = need
                opened.append(capacity)
                session = open_session(run, decode_step_graph(cfg, store.batch, capacity))
            out = session.run({"tokens": last[:, None], "pos": store.pos.copy(),
                               **store.view(capacity)})
            for name, lead, row in store.write(out):
                session.write(name, lead, row)
            last = picker(last_logits(out["logits"]))
            picked.append(last)
            if on_token is not None:
                on_token(last)
    finally:
        if session is not None:
            session.close()
    tokens = np.stack(picked, axis=1) if picked else np.zeros((store.batch, 0), np.int64)
    return tokens, tuple(opened)


def decode(cfg: LlamaConfig, store: KVStore, last: np.ndarray, steps: int, run: Runner,
           granule: int = GRANULE, on_token: Callable[[np.ndarray], None] | None = None,
           picker: TokenPicker | None = None) -> np.ndarray:
    """Up to `steps` decode steps from each row's `last` token [B] and the store's positions
    (rows may be at different positions): int64 [B, steps run] tokens, picked by `picker`
    (default: greedy, no stop; with EOS ids, the steps end once every row has finished). Each
    step's rows go into the store. One session per bucket capacity (`capacity_for`, cut to the
    store's own capacity), opened when the positions reach it."""
    picker = picker or TokenPicker(store.batch)
    return _decode(cfg, store, last, steps, run, granule, on_token, picker)[0]


@dataclass(frozen=True)
class Generated:
    """A generation's new tokens [B, N] (N: the steps run; a row that finished early is padded
    after its EOS), each row's prompt length, where its time went, each row's new tokens up to
    and including its EOS (`new_lengths`) and why it stopped (`finish`: "eos" or "length"), and
    the sampling seed (None: greedy)."""
    tokens: np.ndarray
    prefill_s: float
    decode_s: float
    capacities: tuple[int, ...]   # the decode buckets run, in order
    lengths: tuple[int, ...]      # each row's real prompt tokens
    new_lengths: tuple[int, ...] = field(default=())
    finish: tuple[str, ...] = field(default=())
    seed: int | None = None
    speculation: "SpeculationStats | None" = None  # with a draft: what its passes did

    @property
    def decode_steps(self) -> int:
        """Tokens per row after the prefill's (with a draft, several come from one pass:
        `speculation.passes` counts the passes)."""
        return self.tokens.shape[1] - 1

    def rows(self) -> list[list[int]]:
        """Each row's new tokens up to and including its EOS (no pads)."""
        ends = self.new_lengths or (self.tokens.shape[1],) * self.tokens.shape[0]
        return [row[:n] for row, n in zip(self.tokens.tolist(), ends)]

    def rates(self) -> dict[str, float | None]:
        """Prefill tokens/s (real prompt tokens, pads not counted) and decode tokens/s (each
        row's own new tokens after its first, up to its EOS: pads not counted)."""
        batch = self.tokens.shape[0]
        decoded = (sum(self.new_lengths) - batch if self.new_lengths
                   else batch * self.decode_steps)
        return {"prefill_tokens_per_s": sum(self.lengths) / self.prefill_s
                if self.prefill_s > 0 else None,
                "decode_tokens_per_s": decoded / self.decode_s
                if self.decode_s > 0 and decoded else None}


def check_special(cfg: LlamaConfig, eos_ids: Iterable[int] | None, pad_id: int | None
                  ) -> tuple[tuple[int, ...], int | None]:
    """EOS ids and a pad id as ints inside the vocabulary (InputError otherwise)."""
    def check(what: str, value) -> int:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise InputError(f"{what} must be an integer, got {value!r}")
        if not 0 <= value < cfg.vocab:
            raise InputError(f"{what} {value} out of range for a vocabulary of {cfg.vocab}")
        return int(value)
    if isinstance(eos_ids, numbers.Integral):
        eos_ids = (eos_ids,)
    ids = tuple(check("an EOS id", i) for i in (eos_ids or ()))
    return ids, None if pad_id is None else check("the pad id", pad_id)


def generate(cfg: LlamaConfig, prompt: np.ndarray, new_tokens: int, run: Runner,
             granule: int = GRANULE, on_token: Callable[[np.ndarray], None] | None = None,
             lengths: np.ndarray | None = None, *, eos_ids: Iterable[int] | None = None,
             ignore_eos: bool = False, pad_id: int | None = None, temperature: float = 0.0,
             top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
             draft: "NgramDraft | ModelDraft | None" = None,
             auto_tokens: bool = False) -> Generated:
    """Up to `new_tokens` tokens per row: the prefill picks the first (each row from its last
    real position; `lengths`: rows padded on the right, default all of the prompt), each decode
    step one more (rows at their own positions). Greedy by default; `temperature` > 0 samples
    (`Sampling`: `top_p`, `top_k`, `seed`). A row stops at one of `eos_ids` (None: never;
    `ignore_eos`: never) and is padded with `pad_id` (default its first EOS id); the steps end
    when every row has stopped. The store is allocated once at the largest bucket
    `new_tokens` could need. With a `draft` (`speculative.NgramDraft`, `ModelDraft`: a smaller
    model of the same vocabulary, `start`ed here on the prompt) each pass of the target
    verifies the draft's proposals and yields one token or more per row: greedy, the same
    tokens; sampling, the same distribution (`speculative`); `auto_tokens`: the proposals per
    pass chosen before each pass (`speculative.AutoTokens`, at most `draft.tokens`).
    InputError for a bad option."""
    if isinstance(new_tokens, bool) or not isinstance(new_tokens, numbers.Integral) \
            or new_tokens < 1:
        raise InputError(f"new_tokens must be at least 1, got {new_tokens!r}")
    sampling = Sampling(temperature, top_p, top_k, seed).resolved()
    eos_ids, pad_id = check_special(cfg, eos_ids, pad_id)
    prompt = check_tokens(cfg, prompt)
    lengths = check_lengths(prompt, lengths)
    batch, length = prompt.shape[0], int(lengths.max())
    picker = TokenPicker(batch, sampling, () if ignore_eos else eos_ids, pad_id)
    t0 = time.perf_counter()
    out = prefill(cfg, prompt, run, lengths, last=True)
    first = picker(out["logits"])
    prefill_s = time.perf_counter() - t0
    if on_token is not None:
        on_token(first)
    caps = step_capacities(length, new_tokens, granule, cfg.kv_ring)
    t0 = time.perf_counter()
    rest, opened, stats = np.zeros((batch, 0), np.int64), (), None
    if caps and not picker.done:
        store = KVStore(cfg, batch, caps[-1], names=getattr(run, "kv_names", None))
        store.fill(out, lengths)
        if draft is None:
            rest, opened = _decode(cfg, store, first, new_tokens - 1, run, granule, on_token,
                                   picker)
        else:
            from einpage.models.speculative import AutoTokens, speculate
            history = [prompt[b, :n].tolist() + [int(first[b])]
                       for b, n in enumerate(lengths.tolist())]
            if hasattr(draft, "start"):  # a draft model: its own prefill and store
                draft.start(prompt, lengths, store.capacity)
            auto = (AutoTokens([k for k in AutoTokens().candidates if k <= draft.tokens])
                    if auto_tokens else None)
            rest, opened, stats = speculate(cfg, store, first, new_tokens - 1, run, granule,
                                            on_token, picker, draft, history, auto)
    decode_s = time.perf_counter() - t0
    return Generated(np.concatenate([first[:, None], rest], axis=1), prefill_s, decode_s, opened,
                     tuple(int(n) for n in lengths),
                     tuple(int(n) for n in picker.new_lengths), picker.reasons(),
                     None if sampling.greedy else sampling.seed, stats)


def greedy(cfg: LlamaConfig, prompt: np.ndarray, new_tokens: int, run: Runner,
           granule: int = GRANULE, lengths: np.ndarray | None = None, *,
           eos_ids: Iterable[int] | None = None, pad_id: int | None = None) -> np.ndarray:
    """`new_tokens` greedy tokens per row, int64 (batch, N) (`generate`'s tokens; with
    `eos_ids`, N is where the last row stopped and finished rows are padded)."""
    return generate(cfg, prompt, new_tokens, run, granule, lengths=lengths, eos_ids=eos_ids,
                    pad_id=pad_id).tokens
