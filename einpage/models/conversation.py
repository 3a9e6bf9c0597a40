"""A conversation held across turns, its past kept in the KV store (issue 34: `einpage chat`).

Each turn renders the whole conversation with the model's chat template (`models.chat`) and
tokenizes it without adding special tokens (the template writes them). The store holds the
tokens of the turns before: the rows of the longest common prefix of those tokens and the new
rendering are kept (a template may re-render an earlier turn differently: Qwen3 drops the
reasoning of past replies), the store's position is cut back to it, and only the rest is
prefilled, as one *extend* pass: a verify step (`llama.verify_graph`) of those tokens over the
store, whose attention reads the kept rows in place and its own new keys causally, the same
graph speculative decoding runs. Its new rows go into the store (`KVStore.write_rows`), its
last logits pick the reply's first token, and decode steps (`generation.decode`) the rest, up to
an end-of-turn id or `max_new_tokens`. So a turn costs the prefill of its own tokens, not of the
history. The extend pass is padded to a bucket of `granule` tokens (one plan per bucket and
store capacity); the padding comes after the real tokens, which causal attention keeps them
from seeing, and its rows are not written.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from einpage.errors import InputError
from einpage.models.chat import ChatTemplate
from einpage.models.config import LlamaConfig
from einpage.models.generation import Runner, Sampling, TokenPicker, decode, open_session
from einpage.models.kvstore import GRANULE, KVStore, capacity_for


@dataclass(frozen=True)
class Turn:
    """One reply: its text and ids (the end-of-turn id, where it stopped at one, not in the
    text), why it stopped, the tokens it prefilled and those whose rows it kept from the turns
    before, and where its time went."""
    text: str
    tokens: tuple[int, ...]
    finish: str          # "eos" or "length"
    prefilled: int       # tokens the extend pass computed
    reused: int          # tokens whose KV rows the store kept
    prefill_s: float
    decode_s: float

    @property
    def decode_rate(self) -> float | None:
        steps = max(0, len(self.tokens) - 1)
        return steps / self.decode_s if steps and self.decode_s > 0 else None


@dataclass
class Conversation:
    """Turns of a chat with one model on one runner (a plan runner, or the dense reference):
    `codec` a `models.text.TextCodec`, `template` its `ChatTemplate`, `eos_ids` the ids that
    end a reply, `capacity` the most tokens the conversation may hold (the store is allocated
    once at it), `template_kwargs` extra variables for the template (`enable_thinking`)."""
    cfg: LlamaConfig
    run: Runner
    codec: Any
    template: ChatTemplate
    eos_ids: Sequence[int]
    capacity: int
    granule: int = GRANULE
    sampling: Sampling = field(default_factory=Sampling)
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    messages: list = field(default_factory=list)

    def __post_init__(self):
        if self.capacity < 2:
            raise InputError(f"a conversation needs a context of 2 tokens or more, got "
                             f"{self.capacity}")
        self.store = KVStore(self.cfg, 1, self.capacity,
                             names=getattr(self.run, "kv_names", None))
        self.held: list[int] = []  # the tokens whose rows the store holds, in position order
        self.turns = 0

    def reset(self) -> None:
        """Forget every message (the store's rows are overwritten from position 0)."""
        self.messages.clear()
        self.held = []
        self.store.pos[:] = 0

    def say(self, message: str | Mapping[str, Any] | Sequence[Mapping[str, Any]],
            max_new_tokens: int, on_token: Callable[[int], None] | None = None) -> Turn:
        """Add the user's `message` (text, one message, or several) and reply to it; the reply
        joins the conversation as the assistant's message."""
        if isinstance(message, str):
            added = [{"role": "user", "content": message}]
        elif isinstance(message, Mapping):
            added = [dict(message)]
        else:
            added = [dict(m) for m in message]
        text = self.template.render(self.messages + added, add_generation_prompt=True,
                                    **self.template_kwargs)
        ids = self.codec.encode_plain(text)
        if len(ids) + 1 > self.capacity:
            raise InputError(f"the conversation is {len(ids)} tokens; its context holds "
                             f"{self.capacity} (with room for one reply token at least)")
        turn = self._reply(ids, max_new_tokens, on_token)
        self.messages.extend(added)
        self.messages.append({"role": "assistant", "content": turn.text})
        return turn

    def _reply(self, ids: list[int], max_new_tokens: int,
               on_token: Callable[[int], None] | None) -> Turn:
        if max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        keep = 0
        for a, b in zip(self.held, ids):
            if a != b:
                break
            keep += 1
        keep = min(keep, len(ids) - 1)  # the last token is fed again: its logits pick the reply
        if self.store.wraps and len(self.held) > self.store.capacity and keep < len(self.held):
            keep = 0  # a ring past its capacity has overwritten the rows a cut would go back to
        self.store.pos[:] = keep
        self.held = self.held[:keep]
        new = ids[keep:]
        seed = None if self.sampling.seed is None else self.sampling.seed + self.turns
        picker = TokenPicker(1, Sampling(self.sampling.temperature, self.sampling.top_p,
                                         self.sampling.top_k, seed), self.eos_ids)
        t0 = time.perf_counter()
        logits = self._extend(new)
        first = picker(logits[None, :])
        prefill_s = time.perf_counter() - t0
        self.held += new
        if on_token is not None:
            on_token(int(first[0]))
        room = self.capacity - int(self.store.pos[0])
        steps = min(max_new_tokens - 1, room)
        t0 = time.perf_counter()
        rest = np.zeros((1, 0), np.int64)
        if steps > 0 and not picker.done:
            rest = decode(self.cfg, self.store, first, steps, self.run, self.granule,
                          (lambda t: on_token(int(t[0]))) if on_token else None, picker)
        decode_s = time.perf_counter() - t0
        reply = [int(first[0]), *rest[0].tolist()]
        if picker.finished[0]:  # the pads after the end-of-turn id are not the reply
            reply = reply[:int(picker.new_lengths[0])]
        self.held += reply[:-1]  # the last token picked was not fed: its row is not held
        if len(self.held) != int(self.store.pos[0]):
            raise AssertionError(f"the store holds {int(self.store.pos[0])} rows, the "
                                 f"conversation {len(self.held)} tokens")
        self.turns += 1
        finished = bool(picker.finished[0])
        text = self.codec.decode(reply[:-1] if finished else reply)
        return Turn(text, tuple(reply), "eos" if finished else "length", len(new), keep,
                    prefill_s, decode_s)

    def _extend(self, new: list[int]) -> np.ndarray:
        """One pass of `new` tokens over the store from its position: their rows written, the
        logits of the last [vocab]."""
        from einpage.models.speculative import verify_step_graph
        n = len(new)
        width = capacity_for(n, self.granule)
        pos = int(self.store.pos[0])
        capacity = min(capacity_for(max(pos, 1), self.granule), self.store.capacity)
        fed = np.zeros((1, width), np.int64)
        fed[0, :n] = new
        ring = {"slots": self.store.slot_positions(capacity)} if self.cfg.kv_ring else {}
        session = open_session(self.run, verify_step_graph(self.cfg, 1, capacity, width))
        try:
            out = session.run({"tokens": fed, "pos": self.store.pos.copy(), **ring,
                               **self.store.view(capacity)})
            self.store.write_rows(out, np.array([n]))
        finally:
            session.close()
        return np.asarray(out["logits"])[0, n - 1]
