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

A decode step is one plan for every position: each row's position is an input `pos[b]`, and the
rotary angles and the mask over the KV store are einsums of `pos` with index fills, so positions
are run-time values (rows may be at different positions). The store has capacity `C`; the step
attends over its rows `t < pos[b]` and over its own new key, with the softmax taken over both
parts at once (one running max and one sum), so the store is read in place: never concatenated,
never copied. The step returns its new rows; the caller writes them into the store at `pos`.

RMSNorm and softmax run in float32 and cast back as transformers does.
"""
from __future__ import annotations

import math

import sympy

from einpage.ir import scalar
from einpage.ir.builder import GraphBuilder, Tensor
from einpage.ir.dtypes import DType
from einpage.ir.graph import Graph
from einpage.models.config import LlamaConfig

B, S, C = (scalar.size_symbol(n) for n in "BSC")


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
    """Writes one graph for `cfg`: a prefill (positions 0..S-1) or a decode step (positions from
    the `pos` input, over a KV store of capacity `C`)."""

    def __init__(self, cfg: LlamaConfig):
        self.cfg = cfg
        self.g = GraphBuilder()
        self.dt = cfg.dtype
        self.pos: Tensor | None = None  # decode: each row's position, [B] int64

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

    def _inverse_frequency(self, j) -> sympy.Expr:
        cfg = self.cfg
        return sympy.Float(cfg.rope_theta) ** (-sympy.Float(1) * j / (cfg.head_dim // 2))

    @staticmethod
    def _rotation(theta, d) -> sympy.Expr:
        """The rotate-half entry at angle `theta`, `d = u - r`: cos on the diagonal, -sin / +sin
        off it."""
        return scalar.cos(theta) * (1 - d ** 2) + scalar.sin(theta) * d

    def rotary_table(self, seq) -> Tensor:
        """Prefill: rot[s, u, r, j] at position s."""
        half = self.cfg.head_dim // 2
        return self.g.fill((seq, 2, 2, half), lambda s, u, r, j: self._rotation(
            s * self._inverse_frequency(j), u - r), dtype=DType.f32)

    def step_rotary_table(self) -> Tensor:
        """Decode: rot[b, u, r, j] at position pos[b] (angles computed on the device)."""
        g, half = self.g, self.cfg.head_dim // 2
        freq = g.fill((half,), self._inverse_frequency, dtype=DType.f32)
        angle = g.einsum("b,j->bj", self.pos, freq, join=lambda p, f: p * f, dtype=DType.f32)
        offdiag = g.fill((2, 2, half), lambda u, r, j: u - r, dtype=DType.f32)
        return g.einsum("bj,urj->burj", angle, offdiag, join=self._rotation, dtype=DType.f32)

    def causal_mask(self, seq) -> Tensor:
        return self.g.fill((seq, seq), lambda s, t: sympy.Piecewise(
            (0, t <= s), (-sympy.oo, True)), dtype=DType.f32)

    def store_mask(self, capacity) -> Tensor:
        """Decode: mask[b, t] over the store, 0 where slot t holds a past row (t < pos[b])."""
        g = self.g
        slot = g.fill((capacity,), lambda t: t, dtype=DType.f32)
        return g.einsum("b,t->bt", self.pos, slot, dtype=DType.f32, join=lambda p, t:
                        sympy.Piecewise((0, t < p), (-sympy.oo, True)))

    def projections(self, x: Tensor, layer: int, rot: Tensor, rot_spec: str):
        """q, k (rotated) and v of the hidden state `x`; `rot_spec` is `surj` (prefill) or
        `burj` (decode)."""
        g, p = self.g, f"layers.{layer}."
        q = g.einsum("bsm,ngrjm->bsngrj", x, self.weight(p + "wq"))
        k = g.einsum("bsm,nrjm->bsnrj", x, self.weight(p + "wk"))
        v = g.einsum("bsm,nrjm->bsnrj", x, self.weight(p + "wv"))
        q = g.einsum(f"bsngrj,{rot_spec}->bsnguj", q, rot, dtype=self.dt)
        k = g.einsum(f"bsnrj,{rot_spec}->bsnuj", k, rot, dtype=self.dt)
        return q, k, v

    @property
    def scale(self) -> float:
        return 1.0 / float(self.cfg.head_dim) ** 0.5

    def attention(self, x: Tensor, layer: int, seq, rot: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Prefill: the attention block's output, and the keys and values (the KV cache)."""
        g, p, scale = self.g, f"layers.{layer}.", self.scale
        q, k, v = self.projections(x, layer, rot, "surj")
        scores = g.einsum("bsnguj,btnuj->bngst", q, k, join=lambda a, c: a * c * scale,
                          agg="sum", dtype=DType.f32)
        scores = g.einsum("bngst,st->bngst", scores, self.causal_mask(seq),
                          join=lambda a, c: a + c)
        probs = self.softmax(scores)
        out = g.einsum("bngst,btnrj->bsngrj", probs, v)
        return g.einsum("bsngrj,mngrj->bsm", out, self.weight(p + "wo")), k, v

    def step_attention(self, x: Tensor, layer: int, rot: Tensor, mask: Tensor,
                       capacity) -> tuple[Tensor, Tensor, Tensor]:
        """Decode: attention over the store's past rows and the step's own key, read in place;
        returns the output and the step's new key and value rows."""
        g, cfg, p, scale = self.g, self.cfg, f"layers.{layer}.", self.scale
        shape = (B, capacity, cfg.kv_heads, 2, cfg.head_dim // 2)
        past_k = g.input(f"cache.{layer}.k", shape, self.dt, role="cache")
        past_v = g.input(f"cache.{layer}.v", shape, self.dt, role="cache")
        q, k, v = self.projections(x, layer, rot, "burj")
        past = g.einsum("bsnguj,btnuj->bngst", q, past_k, join=lambda a, c: a * c * scale,
                        agg="sum", dtype=DType.f32)
        past = g.einsum("bngst,bt->bngst", past, mask, join=lambda a, c: a + c)
        own = g.einsum("bsnguj,bsnuj->bngs", q, k, join=lambda a, c: a * c * scale, agg="sum",
                       dtype=DType.f32)
        top = g.einsum("bngst->bngs", past, join=lambda a: a, agg="max")
        top = g.einsum("bngs,bngs->bngs", top, own, join=lambda a, c: sympy.Max(a, c))
        e_past = g.einsum("bngst,bngs->bngst", past, top, join=lambda a, c: scalar.exp(a - c))
        e_own = g.einsum("bngs,bngs->bngs", own, top, join=lambda a, c: scalar.exp(a - c))
        total = g.einsum("bngst->bngs", e_past, join=lambda a: a, agg="sum")
        total = g.einsum("bngs,bngs->bngs", total, e_own, join=lambda a, c: a + c)
        # probabilities in the model dtype, as the prefill's softmax gives them
        p_past = g.einsum("bngst,bngs->bngst", e_past, total, join=lambda a, c: a / c,
                          dtype=self.dt)
        p_own = g.einsum("bngs,bngs->bngs", e_own, total, join=lambda a, c: a / c, dtype=self.dt)
        out = g.einsum("bngst,btnrj->bsngrj", p_past, past_v, dtype=DType.f32)
        out = g.einsum("bsngrj,bngs,bsnrj->bsngrj", out, p_own, v, dtype=self.dt,
                       join=lambda o, a, c: o + a * c)
        return g.einsum("bsngrj,mngrj->bsm", out, self.weight(p + "wo")), k, v

    def feed_forward(self, x: Tensor, layer: int) -> Tensor:
        g, p = self.g, f"layers.{layer}."
        gate = g.einsum("bsm,fm->bsf", x, self.weight(p + "w_gate"))
        up = g.einsum("bsm,fm->bsf", x, self.weight(p + "w_up"))
        act = g.einsum("bsf,bsf->bsf", gate, up, join=lambda a, c: scalar.silu(a) * c)
        return g.einsum("bsf,mf->bsm", act, self.weight(p + "w_down"))

    def build(self, seq, capacity=None) -> Graph:
        """Prefill of `seq` tokens (`capacity` None), or one decode step over a store of
        `capacity` rows."""
        g, cfg = self.g, self.cfg
        tokens = g.input("tokens", (B, seq), DType.i64)
        if capacity is None:
            rot, mask = self.rotary_table(seq), None
        else:
            self.pos = g.input("pos", (B,), DType.i64)
            rot, mask = self.step_rotary_table(), self.store_mask(capacity)
        embed = self.weight("embed")
        h = g.gather(embed, tokens)
        rows = []
        for layer in range(cfg.layers):
            with g.stage(layer + 1):
                p = f"layers.{layer}."
                x = self.rms_norm(h, self.weight(p + "attn_norm"))
                if capacity is None:
                    a, k, v = self.attention(x, layer, seq, rot)
                else:
                    a, k, v = self.step_attention(x, layer, rot, mask, capacity)
                h = self.add(h, a)
                f = self.feed_forward(self.rms_norm(h, self.weight(p + "ffn_norm")), layer)
                h = self.add(h, f)
                rows.append((k, v))
        with g.stage(cfg.layers + 1):
            h = self.rms_norm(h, self.weight("norm"))
            head = embed if cfg.tied else self.weight("lm_head")
            g.output("logits", g.einsum("bsm,vm->bsv", h, head))
            # prefill: the whole cache; a decode step: only its own rows, which the caller
            # writes into the store at `pos` (a row per layer, never the store)
            prefix = "cache" if capacity is None else "new"
            for layer, (k, v) in enumerate(rows):
                g.output(f"{prefix}.{layer}.k", k)
                g.output(f"{prefix}.{layer}.v", v)
        return g.build()


def prefill_graph(cfg: LlamaConfig) -> Graph:
    """Prefill of `S` tokens per row for `B` rows: inputs `tokens` [B,S] and the weights;
    outputs `logits` [B,S,V] and the KV cache `cache.<l>.k|v` [B,S,n,2,j]."""
    return _Llama(cfg).build(S)


def decode_graph(cfg: LlamaConfig) -> Graph:
    """One decode step for every position below the store's capacity `C`: inputs `tokens` [B,1],
    `pos` [B] (each row's position: its past length) and the KV store `cache.<l>.k|v`
    [B,C,n,2,j] (rows `t < pos[b]` hold row b's past; the rest is masked out); outputs `logits`
    [B,1,V] and the step's keys and values `new.<l>.k|v` [B,1,n,2,j], to be written into the
    store at `pos` (`models.kvstore.KVStore.write`)."""
    return _Llama(cfg).build(1, capacity=C)
