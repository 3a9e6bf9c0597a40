"""LLaMA in the einsum DSL (Hugging Face `LlamaForCausalLM` semantics).

Index letters, used in every spec below:
    b batch            s query position        t key position (past + new)
    m model hidden     f feed-forward hidden   v vocabulary
    n kv head          g query head within its kv head's group
    r rotary half in   u rotary half out       j position within a rotary half (head_dim / 2)

A head's `head_dim` features are stored as (half, j) = (2, head_dim/2), so Hugging Face's
rotate-half rotary embedding is one einsum with a (s, u, r, j) rotation table. Weights are graph
inputs of these logical shapes; `hf_tensor` maps each to its checkpoint tensor (a reshape of the
Hugging Face `[out, in]` matrix). The KV cache is `[b, t, n, 2, j]` per layer.

RMSNorm and softmax run in float32 and cast back as transformers does.
"""
from __future__ import annotations

import math

import numpy as np
import sympy

from einpage.ir import scalar
from einpage.ir.builder import GraphBuilder, Tensor
from einpage.ir.dtypes import DType
from einpage.ir.graph import Graph
from einpage.models.config import LlamaConfig

B, S, P = (scalar.size_symbol(n) for n in "BSP")


def weight_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Logical shape of every weight input, by graph input name."""
    n, g, j, m, f = cfg.kv_heads, cfg.group, cfg.head_dim // 2, cfg.hidden, cfg.intermediate
    shapes = {"embed": (cfg.vocab, m), "norm": (m,)}
    if not cfg.tied:
        shapes["lm_head"] = (cfg.vocab, m)
    for layer in range(cfg.layers):
        p = f"layers.{layer}."
        shapes.update({p + "attn_norm": (m,), p + "wq": (n, g, 2, j, m), p + "wk": (n, 2, j, m),
                       p + "wv": (n, 2, j, m), p + "wo": (m, n, g, 2, j), p + "ffn_norm": (m,),
                       p + "w_gate": (f, m), p + "w_up": (f, m), p + "w_down": (m, f)})
    return shapes


_HF_LAYER = {"attn_norm": "input_layernorm", "wq": "self_attn.q_proj", "wk": "self_attn.k_proj",
             "wv": "self_attn.v_proj", "wo": "self_attn.o_proj",
             "ffn_norm": "post_attention_layernorm", "w_gate": "mlp.gate_proj",
             "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}


def hf_tensor(name: str) -> str:
    """The Hugging Face checkpoint tensor holding graph weight `name`."""
    if name == "embed":
        return "model.embed_tokens.weight"
    if name == "norm":
        return "model.norm.weight"
    if name == "lm_head":
        return "lm_head.weight"
    _, layer, short = name.split(".")
    return f"model.layers.{layer}.{_HF_LAYER[short]}.weight"


def hf_shape(cfg: LlamaConfig, name: str) -> tuple[int, ...]:
    """The `[out, in]` shape Hugging Face stores graph weight `name` in."""
    shape = weight_shapes(cfg)[name]
    if len(shape) == 1 or name in ("embed", "lm_head") or name.endswith(("w_gate", "w_up",
                                                                          "w_down")):
        return shape
    if name.endswith("wo"):
        return (shape[0], math.prod(shape[1:]))
    return (math.prod(shape[:-1]), shape[-1])


class _Llama:
    """Writes one graph; `cfg` fixed, positions start at `past` (a symbol or 0)."""

    def __init__(self, cfg: LlamaConfig, past):
        self.cfg, self.past = cfg, past
        self.g = GraphBuilder()
        self.dt = cfg.dtype

    def weight(self, name: str) -> Tensor:
        return self.g.input(name, weight_shapes(self.cfg)[name], self.dt, role="weight")

    def rms_norm(self, x: Tensor, w: Tensor) -> Tensor:
        g, cfg = self.g, self.cfg
        ss = g.einsum("bsm->bs", x, join=lambda a: a * a, agg="sum", dtype=DType.f32)
        inv = g.einsum("bs->bs", ss, join=lambda a: scalar.rsqrt(a / cfg.hidden + cfg.rms_eps))
        normed = g.einsum("bsm,bs->bsm", x, inv, dtype=self.dt)
        return g.einsum("bsm,m->bsm", normed, w)

    def add(self, x: Tensor, y: Tensor) -> Tensor:
        """The residual add `x + y` of two [b, s, m] hidden states."""
        return self.g.einsum("bsm,bsm->bsm", x, y, join=lambda a, c: a + c)

    def softmax(self, scores: Tensor) -> Tensor:
        """Softmax of float32 scores[b, n, g, s, t] over the key position t (max-subtracted),
        cast back to the model dtype."""
        g = self.g
        top = g.einsum("bngst->bngs", scores, join=lambda a: a, agg="max")
        e = g.einsum("bngst,bngs->bngst", scores, top, join=lambda a, c: scalar.exp(a - c))
        total = g.einsum("bngst->bngs", e, join=lambda a: a, agg="sum")
        return g.einsum("bngst,bngs->bngst", e, total, join=lambda a, c: a / c, dtype=self.dt)

    def rotary_table(self, seq) -> Tensor:
        """rot[s, u, r, j]: cos on the diagonal, -sin / +sin off it, at position s + past."""
        cfg = self.cfg
        half = cfg.head_dim // 2

        def table(s, u, r, j):
            theta = (s + self.past) * sympy.Float(cfg.rope_theta) ** (-sympy.Float(1) * j / half)
            same = 1 - (u - r) ** 2
            return scalar.cos(theta) * same + scalar.sin(theta) * (u - r)

        return self.g.fill((seq, 2, 2, half), table, dtype=DType.f32)

    def causal_mask(self, seq, keys) -> Tensor:
        return self.g.fill((seq, keys), lambda s, t: sympy.Piecewise(
            (0, t <= s + self.past), (-sympy.oo, True)), dtype=DType.f32)

    def attention(self, x: Tensor, layer: int, cache: tuple[Tensor, Tensor] | None,
                  seq) -> tuple[Tensor, Tensor, Tensor]:
        """The attention block's output, and this call's own keys and values (the rows to add
        to the cache)."""
        g, cfg, p = self.g, self.cfg, f"layers.{layer}."
        q = g.einsum("bsm,ngrjm->bsngrj", x, self.weight(p + "wq"))
        k = g.einsum("bsm,nrjm->bsnrj", x, self.weight(p + "wk"))
        v = g.einsum("bsm,nrjm->bsnrj", x, self.weight(p + "wv"))
        rot = self.rotary_table(seq)
        q = g.einsum("bsngrj,surj->bsnguj", q, rot, dtype=self.dt)
        k = g.einsum("bsnrj,surj->bsnuj", k, rot, dtype=self.dt)
        new_k, new_v = k, v
        if cache is not None:
            k = g.concat([cache[0], k], axis=1)
            v = g.concat([cache[1], v], axis=1)
        keys = k.shape[1]
        scale = 1.0 / float(cfg.head_dim) ** 0.5
        scores = g.einsum("bsnguj,btnuj->bngst", q, k, join=lambda a, c: a * c * scale,
                          agg="sum", dtype=DType.f32)
        scores = g.einsum("bngst,st->bngst", scores, self.causal_mask(seq, keys),
                          join=lambda a, c: a + c)
        probs = self.softmax(scores)
        out = g.einsum("bngst,btnrj->bsngrj", probs, v)
        return g.einsum("bsngrj,mngrj->bsm", out, self.weight(p + "wo")), new_k, new_v

    def feed_forward(self, x: Tensor, layer: int) -> Tensor:
        g, p = self.g, f"layers.{layer}."
        gate = g.einsum("bsm,fm->bsf", x, self.weight(p + "w_gate"))
        up = g.einsum("bsm,fm->bsf", x, self.weight(p + "w_up"))
        act = g.einsum("bsf,bsf->bsf", gate, up, join=lambda a, c: scalar.silu(a) * c)
        return g.einsum("bsf,mf->bsm", act, self.weight(p + "w_down"))

    def build(self, seq, with_cache: bool) -> Graph:
        g, cfg = self.g, self.cfg
        tokens = g.input("tokens", (B, seq), DType.i64)
        embed = self.weight("embed")
        h = g.gather(embed, tokens)
        new_cache = []
        for layer in range(cfg.layers):
            with g.stage(layer + 1):
                p = f"layers.{layer}."
                cache = None
                if with_cache:
                    shape = (B, self.past, cfg.kv_heads, 2, cfg.head_dim // 2)
                    cache = (g.input(f"cache.{layer}.k", shape, self.dt, role="cache"),
                             g.input(f"cache.{layer}.v", shape, self.dt, role="cache"))
                a, k, v = self.attention(self.rms_norm(h, self.weight(p + "attn_norm")), layer,
                                         cache, seq)
                h = self.add(h, a)
                f = self.feed_forward(self.rms_norm(h, self.weight(p + "ffn_norm")), layer)
                h = self.add(h, f)
                new_cache.append((k, v))
        with g.stage(cfg.layers + 1):
            h = self.rms_norm(h, self.weight("norm"))
            head = embed if cfg.tied else self.weight("lm_head")
            g.output("logits", g.einsum("bsm,vm->bsv", h, head))
            # prefill: the whole cache; a decode step: only its own rows, which the caller
            # appends (writing the whole cache back every step would move it all twice)
            prefix = "new" if with_cache else "cache"
            for layer, (k, v) in enumerate(new_cache):
                g.output(f"{prefix}.{layer}.k", k)
                g.output(f"{prefix}.{layer}.v", v)
        return g.build()


def prefill_graph(cfg: LlamaConfig) -> Graph:
    """Prefill of `S` tokens per row for `B` rows: inputs `tokens` [B,S] and the weights;
    outputs `logits` [B,S,V] and the KV cache `cache.<l>.k|v` [B,S,n,2,j]."""
    return _Llama(cfg, 0).build(S, with_cache=False)


def decode_graph(cfg: LlamaConfig) -> Graph:
    """One decode step: `tokens` [B,1] at position `P`, caches `cache.<l>.k|v` [B,P,n,2,j] in;
    `logits` [B,1,V] and the step's keys and values `new.<l>.k|v` [B,1,n,2,j] out (append them
    to the cache along axis 1: `append_to_cache`)."""
    return _Llama(cfg, P).build(1, with_cache=True)


def append_to_cache(cache: dict, step: dict) -> dict:
    """The cache after a decode step: each `cache.<l>.k|v` with the step's `new.<l>.k|v`
    appended along the sequence axis."""
    return {name: np.concatenate([rows, step["new." + name[len("cache."):]]], axis=1)
            for name, rows in cache.items()}
