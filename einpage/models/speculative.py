"""Speculative decoding: several tokens per pass of the target model (issue "Many tokens per
streamed pass"): prompt-lookup drafts and draft models, greedy acceptance, and the speculative
sampling rule when sampling; `--draft-tokens auto` (`AutoTokens`).

When the weights do not fit, a decode step costs one trip of the streamed weights over the link
whatever it computes, so checking `k` proposed tokens in one pass costs nearly what one token
does. Each pass here is a *verify step* (`llama.verify_graph`: `T = k + 1` new tokens per row at
positions `pos .. pos + k`, the KV store read in place): its inputs are each row's last token
and `k` proposals, its outputs the target's logits at those `T` positions and their new key and
value rows.

Acceptance (greedy): the target's own pick at each position is the argmax of its logits there
(`generation.sample`, as plain decoding picks). A row accepts its proposals while they equal the
target's picks; the first pick that differs, or the pick after the last proposal, is a token the
target chose itself. So a pass emits `1 + accepted` tokens per row, each the token plain greedy
decoding emits at that position: the output is plain decoding's, token for token. Only the KV
rows of the tokens that were fed and kept (the last token and the accepted proposals) go into
the store (`KVStore.write_rows`); rejected rows are dropped, and nothing is copied back.

Acceptance (sampling, `accept_sampled`): the speculative sampling rule for a draft that
proposes each token for certain; each token the pass emits is distributed exactly as the
target's own next token (its temperature, top-k and top-p applied), though not the token plain
sampling draws with the same seed (the draws differ).

Drafts: `NgramDraft` proposes from the row's own text (prompt-lookup decoding): the tokens that
followed the latest earlier occurrence of its last n-gram (n from `max_ngram` down to 1).
`ModelDraft` runs a smaller model of the same vocabulary greedily, with its own plans and KV
store, `k + 1` decode steps per pass. A row that finishes (EOS, or its `new_tokens`) stops there; rows accept different counts and
keep their own positions. Plans: one per (bucket, T), cached by the runner as decode plans are.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from einpage.errors import InputError
from einpage.ir.graph import Graph
from einpage.models import llama
from einpage.models.config import LlamaConfig
from einpage.models.kvstore import KVStore, capacity_for

#: the drafts `--draft` takes
DRAFTS = ("ngram",)


class RowDraft:
    """A draft that proposes row by row from the row's tokens so far (`propose(history)`,
    `tokens` proposals), with no state of its own to keep."""
    name = "row"
    tokens: int

    def propose(self, history: Sequence[int]) -> list[int]:
        raise NotImplementedError

    def proposals(self, history: list[list[int]], last: np.ndarray, going: np.ndarray,
                  pad: int, k: int) -> np.ndarray:
        """int64 [B, k] (k <= tokens): each going row's first k proposals (`propose`), pads
        for the others."""
        return np.array([self.propose(history[b])[:k] if going[b] else [pad] * k
                         for b in range(len(history))], np.int64)

    def advance(self, pos: np.ndarray) -> None:
        """The target kept its rows below `pos`: nothing to follow here."""

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class NgramDraft(RowDraft):
    """Prompt-lookup proposals: `tokens` of them per pass, from the tokens that followed the
    latest earlier occurrence of the row's last `n` tokens (n = `max_ngram` .. 1); where the
    continuation is shorter than `tokens` its last token is repeated, and without any match the
    row's last token is (a proposal that is wrong costs nothing but its own acceptance)."""
    tokens: int
    max_ngram: int = 3

    def __post_init__(self):
        for what, value in (("draft tokens", self.tokens), ("the n-gram length", self.max_ngram)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise InputError(f"{what} must be an integer >= 1, got {value!r}")

    @property
    def name(self) -> str:
        return "ngram"

    def propose(self, history: Sequence[int]) -> list[int]:
        """`tokens` proposals to follow `history` (a row's prompt and its tokens so far)."""
        h = list(history)
        for n in range(min(self.max_ngram, len(h) - 1), 0, -1):
            tail = h[-n:]
            for start in range(len(h) - n - 1, -1, -1):  # the latest earlier occurrence
                if h[start:start + n] == tail:
                    follow = h[start + n:start + n + self.tokens]
                    return follow + [follow[-1]] * (self.tokens - len(follow))
        return [h[-1]] * self.tokens


class ModelDraft:
    """A smaller model of the same vocabulary proposes each row's next `tokens` greedily, run by
    its own runner (`run`: its plans on the same backend) with its own KV store. Per pass it runs
    `tokens + 1` decode steps feeding the row's last token and its proposals: the last step only
    writes the row of the last proposal, so that after any acceptance every row the target kept
    is in the draft's store too, and `advance` moves the draft's positions back to the target's
    (its rows past them are overwritten later). Its distribution is a point mass at each
    proposal, so the sampling rule of `accept_sampled` holds for it as for prompt lookup."""

    name = "model"

    def __init__(self, cfg: LlamaConfig, run, tokens: int, granule: int):
        NgramDraft(tokens)  # the same check of `tokens`
        self.cfg, self.run, self.tokens, self.granule = cfg, run, tokens, granule
        self.store: KVStore | None = None
        self._session, self._capacity = None, 0

    def start(self, prompt: np.ndarray, lengths: np.ndarray, capacity: int) -> None:
        """The draft's prefill of the prompt; its store holds `capacity` (the target's) slots
        and the rows a pass writes past them."""
        from einpage.models.generation import prefill
        out = prefill(self.cfg, prompt, self.run, lengths, last=True)  # its KV rows
        self.store = KVStore(self.cfg, prompt.shape[0], capacity + self.tokens + 1,
                             names=getattr(self.run, "kv_names", None))
        self.store.fill(out, lengths)

    def step_seconds(self, batch: int) -> float | None:
        """The predicted seconds of one draft step (its runner's plan of the current bucket),
        or None where the runner has no plans (the dense reference)."""
        from einpage.models.generation import decode_step_graph
        predicted = getattr(self.run, "predicted_s", None)
        if predicted is None or self.store is None:
            return None
        need = min(capacity_for(int(self.store.pos.max()) + 1, self.granule),
                   self.store.capacity)
        return predicted(decode_step_graph(self.cfg, batch, need))

    def proposals(self, history: list[list[int]], last: np.ndarray, going: np.ndarray,
                  pad: int, k: int) -> np.ndarray:
        from einpage.models.generation import decode_step_graph, last_logits, open_session
        store, fed, out = self.store, np.where(going, last, pad).astype(np.int64), []
        for step in range(k + 1):
            need = min(capacity_for(int(store.pos.max()) + 1, self.granule), store.capacity)
            if need != self._capacity:
                if self._session is not None:
                    self._session.close()
                self._capacity = need
                self._session = open_session(self.run, decode_step_graph(self.cfg, store.batch,
                                                                         need))
            result = self._session.run({"tokens": fed[:, None], "pos": store.pos.copy(),
                                        **store.view(need)})
            for name, lead, row in store.write(result):
                self._session.write(name, lead, row)
            if step < k:
                fed = np.argmax(last_logits(result["logits"]), axis=-1).astype(np.int64)
                out.append(fed)
        return np.stack(out, axis=1)

    def advance(self, pos: np.ndarray) -> None:
        self.store.pos = np.asarray(pos, np.int64).copy()

    def close(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None


def draft_bytes(cfg: LlamaConfig, batch: int, capacity: int) -> int:
    """The device bytes a draft model takes of a budget by default: 1.25x its weights and a KV
    store of `capacity` slots, so that a plan at that budget keeps them resident."""
    kv = 2 * cfg.layers * batch * capacity * cfg.kv_heads * cfg.head_dim * cfg.dtype.itemsize
    return int(1.25 * (cfg.weight_bytes() + kv))


def check_vocabulary(draft: LlamaConfig, cfg: LlamaConfig, draft_path: str,
                     model_path: str) -> None:
    """A draft proposes the model's own token ids: the same vocabulary size, and where both
    checkpoints carry a tokenizer.json, the same vocabulary (InputError otherwise)."""
    if draft.vocab != cfg.vocab:
        raise InputError(f"the draft {draft_path} has a vocabulary of {draft.vocab}, the model "
                         f"{cfg.vocab}: a draft proposes the model's own token ids")
    a, b = Path(draft_path) / "tokenizer.json", Path(model_path) / "tokenizer.json"
    if not (a.is_file() and b.is_file()):
        return
    from tokenizers import Tokenizer
    try:
        same = Tokenizer.from_file(str(a)).get_vocab() == Tokenizer.from_file(str(b)).get_vocab()
    except Exception as exc:  # noqa: BLE001 - a malformed file: one line
        raise InputError(f"cannot compare the tokenizers of {draft_path} and {model_path}: "
                         f"{exc}") from None
    if not same:
        raise InputError(f"the draft {draft_path} has another tokenizer than {model_path}: a "
                         "draft proposes the model's own token ids")


def expected_tokens(k: int, acceptance: float) -> float:
    """Tokens a row gets from one verify pass of `k` proposals when each is accepted with
    probability `acceptance`, independently, until the first rejection: 1 + a + ... + a^k
    (the accepted run, then the target's own token)."""
    if acceptance >= 1.0:
        return k + 1.0
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


#: the proposal counts `--draft-tokens auto` chooses from
AUTO_TOKENS = (1, 2, 4, 8)
#: the acceptance it assumes before any is measured, and with the weight of that many proposals
PRIOR_ACCEPTANCE, PRIOR_PROPOSALS = 0.5, 4


class AutoTokens:
    """`--draft-tokens auto`: before each pass, the k of `AUTO_TOKENS` with the most expected
    tokens per second, `(1 + a + ... + a^k) / t(k)`: `a` the acceptance measured so far (the
    accepted over the proposed, with a prior of `PRIOR_ACCEPTANCE` worth `PRIOR_PROPOSALS`
    proposals), `t(k)` the predicted seconds of a pass (the runner's plan of the verify step
    of k + 1 tokens, and k + 1 draft steps for a draft model), or 1 where the runner has no
    plans to price (then the largest k wins)."""

    def __init__(self, candidates: Sequence[int] = AUTO_TOKENS):
        self.candidates = tuple(candidates)

    def pick(self, stats: "SpeculationStats", pass_seconds) -> int:
        accepted = stats.accepted + PRIOR_ACCEPTANCE * PRIOR_PROPOSALS
        a = min(accepted / (stats.proposed + PRIOR_PROPOSALS), 1.0)

        def rate(k: int) -> float:
            expected = expected_tokens(k, a)
            seconds = pass_seconds(k)
            return expected / seconds if seconds else expected
        return max(self.candidates, key=lambda k: (rate(k), -k))


@dataclass
class SpeculationStats:
    """What the verify passes did: `passes` run, draft tokens `proposed` to rows still going and
    `accepted` of them, and tokens `emitted` (accepted plus the target's own pick, per row per
    pass), over `row_passes` (a row counted in each pass it took part in)."""
    draft: str
    draft_tokens: int | str   # k, or "auto"
    passes: int = 0
    row_passes: int = 0
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0
    capacities: list[int] = field(default_factory=list)
    used: dict[int, int] = field(default_factory=dict)  # passes run with each k

    @property
    def acceptance(self) -> float | None:
        """Accepted over proposed draft tokens."""
        return self.accepted / self.proposed if self.proposed else None

    @property
    def tokens_per_pass(self) -> float | None:
        """Tokens a row gets from one pass of the target (1 + its accepted proposals)."""
        return self.emitted / self.row_passes if self.row_passes else None

    def to_json(self) -> dict:
        return {"draft": self.draft, "draft_tokens": self.draft_tokens,
                "draft_tokens_used": {str(k): n for k, n in sorted(self.used.items())},
                "verify_passes": self.passes, "proposed": self.proposed,
                "accepted": self.accepted, "acceptance": self.acceptance,
                "tokens_per_pass": self.tokens_per_pass}


@lru_cache(maxsize=16)
def _unbound_verify(cfg: LlamaConfig) -> Graph:
    return llama.verify_graph(cfg)


@lru_cache(maxsize=32)
def verify_step_graph(cfg: LlamaConfig, batch: int, capacity: int, tokens: int) -> Graph:
    """The verify step of `batch` rows of `tokens` new tokens over a store of `capacity` slots
    (built once per process for each `(cfg, batch, capacity, tokens)`)."""
    return _unbound_verify(cfg).bind(B=batch, C=capacity, T=tokens)


def draw(probs: np.ndarray, u: float) -> int:
    """One token from `probs` [vocab] by the inverse of its cumulative mass in id order at the
    uniform `u` (as `generation.sample` draws; never an id of probability 0)."""
    cdf = np.cumsum(probs)
    picked = int((cdf <= u * cdf[-1]).sum())
    return min(picked, len(probs) - 1 - int(np.argmax(probs[::-1] > 0)))


def accept_sampled(probs: np.ndarray, proposals: Sequence[int], rng: np.random.Generator
                   ) -> tuple[list[int], int]:
    """Speculative sampling for one row: (its new tokens, proposals accepted). `probs` [k+1,
    vocab] is the target's distribution at each position of the verify step, `proposals` [k] a
    draft that proposes each token for certain (q = 1 at it, as prompt lookup does). Proposal
    `d` is accepted with probability min(1, p(d) / q(d)) = p(d); the first one rejected is
    replaced by a draw from the normalised max(0, p - q), which is p without d; all accepted,
    one more token is drawn from the last position. Each new token is then distributed exactly
    as the target's own next token: P(d) = p(d), and P(x) = (1 - p(d)) p(x) / (1 - p(d)) for
    every x != d."""
    for i, d in enumerate(proposals):
        p = probs[i]
        if rng.random() < p[d]:
            continue
        residual = p.copy()
        residual[d] = 0.0
        return list(proposals[:i]) + [draw(residual, rng.random())], i
    return list(proposals) + [draw(probs[len(proposals)], rng.random())], len(proposals)




def speculate(cfg: LlamaConfig, store: KVStore, first: np.ndarray, steps: int, run,
              granule: int, on_token: Callable[[np.ndarray], None] | None, picker,
              draft: "RowDraft | ModelDraft", history: list[list[int]],
              auto: AutoTokens | None = None
              ) -> tuple[np.ndarray, tuple[int, ...], SpeculationStats]:
    """Up to `steps` more tokens per row after `first` [B] (the prefill's pick), several per
    verify pass (see the module docstring): int64 [B, tokens] (rows padded after they stop, as
    plain decoding pads them), the bucket capacities the passes ran, in order, and the stats.
    `history[b]`: row b's prompt and `first[b]`, extended as tokens come. `picker` keeps the
    rows' stops (`TokenPicker.emit`). With `auto` the proposals per pass are chosen before
    each pass (`AutoTokens`; at most `draft.tokens`), else `draft.tokens`."""
    from einpage.models.generation import open_session, probabilities, sample
    batch = store.batch
    last = np.asarray(first, np.int64).copy()
    left = np.full(batch, steps, np.int64)  # tokens each row may still take
    rows: list[list[int]] = [[] for _ in range(batch)]
    stats = SpeculationStats(draft.name, "auto" if auto else draft.tokens)
    session, capacity, k = None, 0, draft.tokens
    predicted = getattr(run, "predicted_s", None)
    priced: dict[tuple[int, int], float | None] = {}  # (bucket, k) -> predicted pass seconds

    def pass_seconds(n: int, bucket: int) -> float | None:
        if (bucket, n) not in priced:
            if predicted is None:
                priced[bucket, n] = None
            else:
                graph = verify_step_graph(cfg, batch, bucket, n + 1)
                step = draft.step_seconds(batch) if hasattr(draft, "step_seconds") else 0.0
                priced[bucket, n] = predicted(graph) + (n + 1) * (step or 0.0)
        return priced[bucket, n]

    try:
        while not picker.done and (left[~picker.finished] > 0).any():
            going = ~picker.finished & (left > 0)
            need = min(capacity_for(int(store.pos.max()) + 1, granule), store.capacity)
            chosen = (auto.pick(stats, lambda n: pass_seconds(n, need)) if auto is not None
                      else draft.tokens)
            if need != capacity or chosen != k:
                if session is not None:
                    session.close()
                if need != capacity:
                    stats.capacities.append(need)
                capacity, k = need, chosen
                session = open_session(run, verify_step_graph(cfg, batch, capacity, k + 1))
            stats.used[k] = stats.used.get(k, 0) + 1
            proposals = draft.proposals(history, last, going, picker.pad, k)
            fed = np.concatenate([last[:, None], proposals], axis=1)
            ring = {"slots": store.slot_positions(capacity)} if cfg.kv_ring else {}
            out = session.run({"tokens": fed, "pos": store.pos.copy(), **ring,
                               **store.view(capacity)})
            logits = np.asarray(out["logits"])
            greedy = picker.sampling.greedy
            if greedy:
                picks = np.stack([sample(logits[:, s], picker.sampling, None)
                                  for s in range(k + 1)], axis=1)
            kept = np.zeros(batch, np.int64)  # new tokens (and fed rows kept) per row
            for b in np.flatnonzero(going):
                if greedy:
                    match = np.flatnonzero(proposals[b] != picks[b, :k])
                    accepted = int(match[0]) if match.size else k
                    candidates = picks[b, :accepted + 1].tolist()
                else:
                    candidates, accepted = accept_sampled(
                        probabilities(logits[b], picker.sampling), proposals[b].tolist(),
                        picker.rng)
                stats.proposed += k
                n = 0
                for token in candidates[:int(left[b])]:
                    n += 1
                    rows[b].append(token)
                    history[b].append(token)
                    if picker.emit(b, token):
                        break
                kept[b] = n
                stats.accepted += min(n, accepted)
                stats.emitted += n
                stats.row_passes += 1
                left[b] -= n
                last[b] = rows[b][-1]
            stats.passes += 1
            for name, lead, row in store.write_rows(out, kept):
                session.write(name, lead, row)
            draft.advance(store.pos)
            if on_token is not None:  # a column per new token (pads where a row has none)
                for j in range(int(kept.max())):
                    on_token(np.array([rows[b][len(rows[b]) - int(kept[b]) + j]
                                       if j < kept[b] else picker.pad
                                       for b in range(batch)], np.int64))
    finally:
        if session is not None:
            session.close()
        draft.close()
    width = max((len(r) for r in rows), default=0)
    tokens = np.full((batch, width), picker.pad, np.int64)
    for b, r in enumerate(rows):
        tokens[b, :len(r)] = r
    return tokens, tuple(stats.capacities), stats


__all__ = ["AUTO_TOKENS", "AutoTokens", "DRAFTS", "ModelDraft", "NgramDraft", "RowDraft",
           "SpeculationStats",
           "accept_sampled", "check_vocabulary", "draft_bytes", "draw", "expected_tokens",
           "speculate",
           "verify_step_graph"]
