"""Prefill and greedy decoding with the KV cache, over any graph runner (the dense reference, or
a compiled plan on an executor)."""
from __future__ import annotations

from typing import Callable, Mapping

import numpy as np

from einpage.errors import InputError
from einpage.ir.graph import Graph
from einpage.models import llama
from einpage.models.config import LlamaConfig

#: runs a concrete graph: (graph, inputs by name) -> outputs by name
Runner = Callable[[Graph, Mapping[str, np.ndarray]], Mapping[str, np.ndarray]]


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


def prefill(cfg: LlamaConfig, tokens: np.ndarray, run: Runner) -> dict[str, np.ndarray]:
    tokens = check_tokens(cfg, tokens)
    graph = llama.prefill_graph(cfg).bind(B=tokens.shape[0], S=tokens.shape[1])
    return dict(run(graph, {"tokens": tokens}))


def greedy(cfg: LlamaConfig, prompt: np.ndarray, new_tokens: int, run: Runner) -> np.ndarray:
    """`new_tokens` greedy tokens per row, int64 (batch, new_tokens): one prefill, then one decode
    step per further token with the KV cache."""
    if new_tokens < 1:
        raise InputError(f"new_tokens must be at least 1, got {new_tokens}")
    prompt = check_tokens(cfg, prompt)
    out = prefill(cfg, prompt, run)
    batch, past = prompt.shape
    picked = [np.argmax(out["logits"][:, -1, :], axis=-1).astype(np.int64)]
    step = llama.decode_graph(cfg)
    cache = {k: v for k, v in out.items() if k.startswith("cache.")}
    for _ in range(new_tokens - 1):
        out = dict(run(step.bind(B=batch, P=past), {"tokens": picked[-1][:, None], **cache}))
        cache = llama.append_to_cache(cache, out)
        past += 1
        picked.append(np.argmax(out["logits"][:, -1, :], axis=-1).astype(np.int64))
    return np.stack(picked, axis=1)
