"""LLaMA and its descendants in the einsum DSL (Hugging Face `LlamaForCausalLM`,
`MistralForCausalLM`, `Qwen2ForCausalLM`, `Qwen3ForCausalLM`, `MixtralForCausalLM` semantics).

Index letters, used in every spec below:
    b batch            s query position        t key position (past + new)
    m model hidden     f feed-forward hidden   v vocabulary
    n kv head          g query head within its kv head's group
    r rotary half in   u rotary half out       j position within a rotary half (head_dim / 2)
    w key position among a verify step's own new tokens

A head's `head_dim` features are stored as (half, j) = (2, head_dim/2), so Hugging Face's
rotate-half rotary embedding is one einsum with a (s, u, r, j) rotation table. Weights are graph
inputs of these logical shapes (`einpage.models.schema`, whose `hf_tensor` maps each to its
checkpoint tensor, a reshape of the Hugging Face `[out, in]` matrix). The KV cache is `[b, t, n, 2, j]` per layer.

A decode step is one plan for every position: each row's position is an input `pos[b]`, and the
rotary angles and the mask over the KV store are einsums of `pos` with index fills, so positions
are run-time values (rows may be at different positions). The store has capacity `C`; the step
attends over its rows `t < pos[b]` and over its own new key, with the softmax taken over both
parts at once (one running max and one sum), so the store is read in place: never concatenated,
never copied. The step returns its new rows; the caller writes them into the store at `pos`.
A verify step (speculative decoding) is a decode step of `T` new tokens per row at positions
`pos[b] .. pos[b] + T - 1`: each attends over the store's rows `t < pos[b]` and, causally, over
the step's own new keys `w <= s`, again with one softmax over both parts; it returns `T` rows of
logits and the `T` new key and value rows per layer. Where every layer has a sliding window of W, the store is a ring of W - 1 slots
(`ModelConfig.kv_ring`): it holds exactly the rows the window sees, in slot `pos mod (W - 1)`, so
the mask is `slot < pos` and decode never reads a row outside the window (the softmax does not
care in which order the keys lie).

RMSNorm and softmax run in float32 and cast back as transformers does.

The families differ from LLaMA in a few places, each a field of `ModelConfig`:
  * rotary scaling (`llama3`, `linear`): the inverse frequency is a Piecewise fill of `j`;
  * a sliding window (Mistral): the mask keeps keys `s - W < t <= s`, so score blocks entirely
    outside the band are constant -inf and the partitioner drops their tasks, as it drops the
    blocks above the diagonal of every causal mask;
  * biases on the q, k, v (and o) projections (Qwen2; `attention_bias`);
  * RMSNorm over each head's queries and keys before the rotation (Qwen3);
  * a mixture of experts (Mixtral): a router, the top-k of E experts found by k max-reductions,
    softmax weights renormalised over the chosen experts; an expert's FFN runs on every token
    of the pass (a static plan) and is weighted by zero where unused, guarded by whether any
    token chose it, so a runtime skips the experts no token chose.
"""
from __future__ import annotations

import math

import sympy

from einpage.ir import scalar
from einpage.ir.builder import GraphBuilder, Tensor
from einpage.ir.dtypes import DType
from einpage.ir.graph import Graph
from einpage.models.config import ModelConfig
from einpage.models.schema import kv_storage, weight_shapes, weight_storage

B, S, C, T = (scalar.size_symbol(n) for n in "BSCT")


class _Llama:
    """Writes one graph for `cfg`: a prefill (positions 0..S-1) or a decode step (positions from
    the `pos` input, over a KV store of capacity `C`)."""

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        self.g = GraphBuilder()
        self.dt = cfg.dtype
        self.pos: Tensor | None = None  # decode: each row's position, [B] int64
        self.slots: Tensor | None = None  # a verify step over a ring: each slot's position
        self.query: Tensor | None = None  # a verify step: each new token's position
        self.masks: dict[int | None, Tensor] = {}  # by sliding window (None: causal)
        self.picks: dict[int, Tensor] = {}         # Mixtral: one-hot of each expert
        self.storage = weight_storage(cfg)         # quantized weights
        self.kv = kv_storage(cfg)                  # a quantized KV store

    def weight(self, name: str) -> Tensor:
        return self.g.input(name, weight_shapes(self.cfg)[name], self.dt, role="weight",
                            storage=self.storage.get(name))

    def rms_norm(self, x: Tensor, w: Tensor, spec: str = "bsm", over: str = "m") -> Tensor:
        """RMSNorm of `x` (indices `spec`) over the indices `over`, weighted by `w[over]`."""
        g, cfg = self.g, self.cfg
        keep = "".join(c for c in spec if c not in over)
        size = math.prod(x.shape[spec.index(c)] for c in over)
        ss = g.einsum(f"{spec}->{keep}", x, join=lambda a: a * a, agg="sum", dtype=DType.f32)
        # the inverse root inline (one op less a norm): rounded to the model dtype before the
        # weight scales it, as transformers' LlamaRMSNorm does
        normed = g.einsum(f"{spec},{keep}->{spec}", x, ss, dtype=self.dt,
                          join=lambda a, s: a * scalar.rsqrt(s / size + cfg.rms_eps))
        return g.einsum(f"{spec},{over}->{spec}", normed, w)

    def add(self, x: Tensor, y: Tensor) -> Tensor:
        """The residual add `x + y` of two [b, s, m] hidden states."""
        return self.g.einsum("bsm,bsm->bsm", x, y, join=lambda a, c: a + c)

    def bias(self, x: Tensor, spec: str, name: str) -> Tensor:
        """`x + bias` with the bias over the trailing indices of `spec` (without `bs`)."""
        w = self.weight(name)
        return self.g.einsum(f"{spec},{spec[2:]}->{spec}", x, w, join=lambda a, c: a + c)

    def masked_softmax(self, scores: Tensor, mask: Tensor) -> Tensor:
        """Softmax of float32 `scores[b, n, g, s, t] + mask[s, t]` over the key position t
        (max-subtracted), cast back to the model dtype, in three passes over the scores: the
        row maxima of the masked scores, the row sums of their exponentials, then each
        probability `exp(scores + mask - max) / sum`. Every pass reads the scores as the
        product wrote them: the masked scores and the exponentials are never stored (written
        as `scores + mask`, then `max`, `exp(x - max)`, `sum` and `e / sum` it is six passes,
        three of them writing a float32 tensor of the scores' size). The values are those of
        that chain, exponentials computed the same way twice. A block of the mask that is -inf
        throughout drops out of all three at partition time (`compiler.constants.fold`), one
        that is 0 is not read."""
        g = self.g
        top = g.einsum("bngst,st->bngs", scores, mask, join=lambda a, m: a + m, agg="max")
        total = g.einsum("bngst,st,bngs->bngs", scores, mask, top,
                         join=lambda a, m, c: scalar.exp(a + m - c), agg="sum")
        return g.einsum("bngst,st,bngs,bngs->bngst", scores, mask, top, total,
                        join=lambda a, m, c, z: scalar.exp(a + m - c) / z, dtype=self.dt)

    def _inverse_frequency(self, j) -> sympy.Expr:
        """Rotary inverse frequency of pair `j`, with the config's scaling (transformers'
        `_compute_default/linear/llama3_parameters`)."""
        cfg = self.cfg
        base = sympy.Float(cfg.rope_theta) ** (-sympy.Float(1) * j / (cfg.head_dim // 2))
        rope = cfg.rope_scaling
        if rope is None:
            return base
        factor = sympy.Float(rope.factor)
        if rope.kind == "linear":
            return base / factor
        # llama3: wavelength 2*pi/base; long waves scaled, short kept, smooth in between
        old = sympy.Float(rope.original_context)
        low, high = sympy.Float(rope.low_freq_factor), sympy.Float(rope.high_freq_factor)
        wavelen = 2 * sympy.pi / base
        smooth = (old / wavelen - low) / (high - low)
        return sympy.Piecewise((base / factor, wavelen > old / low),
                               (base, wavelen < old / high),
                               ((1 - smooth) * base / factor + smooth * base, True))

    @staticmethod
    def _rotation(theta, d) -> sympy.Expr:
        """The rotate-half entry at angle `theta`, `d = u - r`: cos on the diagonal, -sin / +sin
        off it."""
        return scalar.cos(theta) * (1 - d ** 2) + scalar.sin(theta) * d

    def rotary_table(self, seq) -> Tensor:
        """Prefill: rot[s, u, r, j] at position s."""
        position = self.g.fill((seq,), lambda s: s, dtype=DType.f32)
        return self._rotary(position, "s")

    def step_rotary_table(self) -> Tensor:
        """Decode: rot[b, u, r, j] at position pos[b] (angles computed on the device)."""
        return self._rotary(self.pos, "b")

    def verify_positions(self, seq) -> Tensor:
        """Verify step: position[b, s] = pos[b] + s of each new token (made once per graph,
        for the rotary table and the store mask)."""
        if self.query is None:
            g = self.g
            offset = g.fill((seq,), lambda s: s, dtype=DType.f32)
            self.query = g.einsum("b,s->bs", self.pos, offset, join=lambda p, o: p + o,
                                  dtype=DType.f32)
        return self.query

    def verify_rotary_table(self, seq) -> Tensor:
        """Verify step: rot[b, s, u, r, j] at position pos[b] + s."""
        return self._rotary(self.verify_positions(seq), "bs")

    def _rotary(self, position: Tensor, p: str) -> Tensor:
        """rot[p, u, r, j] for positions `position[p]`. As transformers does, the angle is the
        float32 product of the float32 position and inverse frequency, and its cos and sin are
        taken in float32 (so prefill and decode rotate alike, and both as transformers)."""
        g, half = self.g, self.cfg.head_dim // 2
        freq = g.fill((half,), self._inverse_frequency, dtype=DType.f32)
        angle = g.einsum(f"{p},j->{p}j", position, freq, join=lambda a, f: a * f,
                         dtype=DType.f32)
        offdiag = g.fill((2, 2, half), lambda u, r, j: u - r, dtype=DType.f32)
        return g.einsum(f"{p}j,urj->{p}urj", angle, offdiag, join=self._rotation,
                        dtype=DType.f32)

    @staticmethod
    def _visible(query, key, window):
        """Whether the query at position `query` sees the key at `key`: causal, and within the
        sliding window where there is one (transformers: `key > query - window`)."""
        if window is None:
            return key <= query
        return sympy.And(key <= query, query - key < window)

    def causal_mask(self, seq, window=None) -> Tensor:
        """Prefill: mask[s, t], 0 where query s sees key t, -inf elsewhere (one fill per window,
        shared by the layers)."""
        if window not in self.masks:
            self.masks[window] = self.g.fill((seq, seq), lambda s, t: sympy.Piecewise(
                (0, self._visible(s, t, window)), (-sympy.oo, True)), dtype=DType.f32)
        return self.masks[window]

    def store_mask(self, capacity, window=None) -> Tensor:
        """Decode: mask[b, t] over the store, 0 where slot t holds a past row the step sees
        (t < pos[b], and within the window)."""
        if window not in self.masks:
            g = self.g
            slot = g.fill((capacity,), lambda t: t, dtype=DType.f32)
            self.masks[window] = g.einsum(
                "b,t->bt", self.pos, slot, dtype=DType.f32, join=lambda p, t: sympy.Piecewise(
                    (0, (t < p) if window is None else sympy.And(t < p, p - t < window)),
                    (-sympy.oo, True)))
        return self.masks[window]

    def verify_store_mask(self, seq, capacity, window) -> Tensor:
        """Verify step: mask[b, s, t] over the store, 0 where query pos[b] + s sees slot t
        (t < pos[b], and within the window). A ring store's slots hold positions that the slots'
        order does not tell: the `slots` input says which (-1: empty), and query pos[b] + s sees
        the slots whose position lies inside its window, so the later new tokens no longer see
        the ring's oldest rows."""
        key = ("verify", window)
        if key not in self.masks:
            g, query = self.g, self.verify_positions(seq)
            if self.slots is not None:
                self.masks[key] = g.einsum(
                    "bs,bt->bst", query, self.slots, dtype=DType.f32,
                    join=lambda q, h: sympy.Piecewise(
                        (0, sympy.And(h >= 0, q - h < window)), (-sympy.oo, True)))
                return self.masks[key]
            slot = g.fill((capacity,), lambda t: t, dtype=DType.f32)
            self.masks[key] = g.einsum(
                "b,bs,t->bst", self.pos, query, slot, dtype=DType.f32,
                join=lambda p, q, t: sympy.Piecewise(
                    (0, (t < p) if window is None else sympy.And(t < p, q - t < window)),
                    (-sympy.oo, True)))
        return self.masks[key]

    def own_mask(self, seq, window) -> Tensor:
        """Verify step: mask[s, w] over the step's own keys, 0 where new token s sees new token
        w (causal, and within the window)."""
        key = ("own", window)
        if key not in self.masks:
            self.masks[key] = self.g.fill((seq, seq), lambda s, w: sympy.Piecewise(
                (0, self._visible(s, w, window)), (-sympy.oo, True)), dtype=DType.f32)
        return self.masks[key]

    def projections(self, x: Tensor, layer: int, rot: Tensor, rot_spec: str):
        """q, k (normed per head where the family does, then rotated) and v of the hidden state
        `x`; `rot_spec` is `surj` (prefill) or `burj` (decode)."""
        g, p, cfg = self.g, f"layers.{layer}.", self.cfg
        q = g.einsum("bsm,ngrjm->bsngrj", x, self.weight(p + "wq"))
        k = g.einsum("bsm,nrjm->bsnrj", x, self.weight(p + "wk"))
        v = g.einsum("bsm,nrjm->bsnrj", x, self.weight(p + "wv"))
        if cfg.qkv_bias:
            q = self.bias(q, "bsngrj", p + "bq")
            k = self.bias(k, "bsnrj", p + "bk")
            v = self.bias(v, "bsnrj", p + "bv")
        if cfg.qk_norm:
            q = self.rms_norm(q, self.weight(p + "q_norm"), "bsngrj", "rj")
            k = self.rms_norm(k, self.weight(p + "k_norm"), "bsnrj", "rj")
        q = g.einsum(f"bsngrj,{rot_spec}->bsnguj", q, rot, dtype=self.dt)
        k = g.einsum(f"bsnrj,{rot_spec}->bsnuj", k, rot, dtype=self.dt)
        return q, k, v

    def out_projection(self, out: Tensor, layer: int) -> Tensor:
        p = f"layers.{layer}."
        y = self.g.einsum("bsngrj,mngrj->bsm", out, self.weight(p + "wo"))
        return self.bias(y, "bsm", p + "bo") if self.cfg.o_bias else y

    @property
    def scale(self) -> float:
        return 1.0 / float(self.cfg.head_dim) ** 0.5

    def attention(self, x: Tensor, layer: int, seq, rot: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Prefill: the attention block's output, and the keys and values (the KV cache)."""
        g, scale = self.g, self.scale
        q, k, v = self.projections(x, layer, rot, "surj")
        scores = g.einsum("bsnguj,btnuj->bngst", q, k, join=lambda a, c: a * c * scale,
                          agg="sum", dtype=DType.f32)
        probs = self.masked_softmax(scores, self.causal_mask(seq, self.cfg.window(layer)))
        out = g.einsum("bngst,btnrj->bsngrj", probs, v)
        return self.out_projection(out, layer), k, v

    def step_attention(self, x: Tensor, layer: int, rot: Tensor,
                       capacity) -> tuple[Tensor, Tensor, Tensor]:
        """Decode: attention over the store's past rows and the step's own key, read in place;
        returns the output and the step's new key and value rows."""
        g, cfg, scale = self.g, self.cfg, self.scale
        shape = (B, capacity, cfg.kv_heads, 2, cfg.head_dim // 2)
        past_k = g.input(f"cache.{layer}.k", shape, self.dt, role="cache", storage=self.kv)
        past_v = g.input(f"cache.{layer}.v", shape, self.dt, role="cache", storage=self.kv)
        # a ring store (every layer windowed) holds only rows inside the window
        mask = self.store_mask(capacity, None if cfg.kv_ring else cfg.window(layer))
        q, k, v = self.projections(x, layer, rot, "burj")
        past = g.einsum("bsnguj,btnuj->bngst", q, past_k, join=lambda a, c: a * c * scale,
                        agg="sum", dtype=DType.f32)
        own = g.einsum("bsnguj,bsnuj->bngs", q, k, join=lambda a, c: a * c * scale, agg="sum",
                       dtype=DType.f32)
        # one softmax over the store's masked rows and the step's own key, in the passes of
        # `masked_softmax` (the masked scores and the exponentials never stored): the maximum
        # (max over t of max(past + mask, own) is max(max over t of past + mask, own)), the
        # sum of the store's exponentials, then the own key's added to it
        top = g.einsum("bngst,bt,bngs->bngs", past, mask, own, agg="max",
                       join=lambda a, m, o: sympy.Max(a + m, o))
        total = g.einsum("bngst,bt,bngs->bngs", past, mask, top, agg="sum",
                         join=lambda a, m, c: scalar.exp(a + m - c))
        total = g.einsum("bngs,bngs,bngs->bngs", total, own, top,
                         join=lambda z, o, c: z + scalar.exp(o - c))
        # probabilities in the model dtype, as the prefill's softmax gives them
        p_past = g.einsum("bngst,bt,bngs,bngs->bngst", past, mask, top, total, dtype=self.dt,
                          join=lambda a, m, c, z: scalar.exp(a + m - c) / z)
        p_own = g.einsum("bngs,bngs,bngs->bngs", own, top, total, dtype=self.dt,
                         join=lambda o, c, z: scalar.exp(o - c) / z)
        out = g.einsum("bngst,btnrj->bsngrj", p_past, past_v, dtype=DType.f32)
        out = g.einsum("bsngrj,bngs,bsnrj->bsngrj", out, p_own, v, dtype=self.dt,
                       join=lambda o, a, c: o + a * c)
        return self.out_projection(out, layer), k, v

    def verify_attention(self, x: Tensor, layer: int, rot: Tensor, seq,
                         capacity) -> tuple[Tensor, Tensor, Tensor]:
        """Verify step: each new token attends over the store's past rows and, causally, over
        the step's own new keys, with one softmax over both (as `step_attention` for one
        token); returns the output and the step's new key and value rows."""
        g, cfg, scale = self.g, self.cfg, self.scale
        shape = (B, capacity, cfg.kv_heads, 2, cfg.head_dim // 2)
        past_k = g.input(f"cache.{layer}.k", shape, self.dt, role="cache", storage=self.kv)
        past_v = g.input(f"cache.{layer}.v", shape, self.dt, role="cache", storage=self.kv)
        window = cfg.window(layer)
        q, k, v = self.projections(x, layer, rot, "bsurj")
        past = g.einsum("bsnguj,btnuj->bngst", q, past_k, join=lambda a, c: a * c * scale,
                        agg="sum", dtype=DType.f32)
        mask = self.verify_store_mask(seq, capacity, window)
        own = g.einsum("bsnguj,bwnuj->bngsw", q, k, join=lambda a, c: a * c * scale, agg="sum",
                       dtype=DType.f32)
        own_mask = self.own_mask(seq, window)
        # one softmax over the store's rows and the step's own keys, in the passes of
        # `masked_softmax` (masked scores and exponentials never stored): the maximum (the
        # own keys' max of max(own + mask, the store's max)), the sums of the exponentials
        top = g.einsum("bngst,bst->bngs", past, mask, join=lambda a, m: a + m, agg="max")
        top = g.einsum("bngsw,sw,bngs->bngs", own, own_mask, top, agg="max",
                       join=lambda a, m, c: sympy.Max(a + m, c))
        total = g.einsum("bngst,bst,bngs->bngs", past, mask, top, agg="sum",
                         join=lambda a, m, c: scalar.exp(a + m - c))
        total_own = g.einsum("bngsw,sw,bngs->bngs", own, own_mask, top, agg="sum",
                             join=lambda a, m, c: scalar.exp(a + m - c))
        total = g.einsum("bngs,bngs->bngs", total, total_own, join=lambda a, c: a + c)
        p_past = g.einsum("bngst,bst,bngs,bngs->bngst", past, mask, top, total, dtype=self.dt,
                          join=lambda a, m, c, z: scalar.exp(a + m - c) / z)
        p_own = g.einsum("bngsw,sw,bngs,bngs->bngsw", own, own_mask, top, total, dtype=self.dt,
                         join=lambda a, m, c, z: scalar.exp(a + m - c) / z)
        out = g.einsum("bngst,btnrj->bsngrj", p_past, past_v, dtype=DType.f32)
        mine = g.einsum("bngsw,bwnrj->bsngrj", p_own, v, dtype=DType.f32)
        out = g.einsum("bsngrj,bsngrj->bsngrj", out, mine, dtype=self.dt,
                       join=lambda o, a: o + a)
        return self.out_projection(out, layer), k, v

    def _ffn(self, x: Tensor, prefix: str) -> Tensor:
        """The SwiGLU feed-forward block with weights `<prefix>w_gate|w_up|w_down`."""
        g = self.g
        gate = g.einsum("bsm,fm->bsf", x, self.weight(prefix + "w_gate"))
        up = g.einsum("bsm,fm->bsf", x, self.weight(prefix + "w_up"))
        act = g.einsum("bsf,bsf->bsf", gate, up, join=lambda a, c: scalar.silu(a) * c)
        return g.einsum("bsf,mf->bsm", act, self.weight(prefix + "w_down"))

    def feed_forward(self, x: Tensor, layer: int) -> Tensor:
        if self.cfg.experts:
            return self.experts(x, layer)
        return self._ffn(x, f"layers.{layer}.")

    def routing(self, x: Tensor, layer: int) -> Tensor:
        """Mixtral's router: weights[b, s, e], the softmax of the router logits renormalised over
        each token's top-k experts (0 for the others), in the model dtype. The k-th largest logit
        comes from k max-reductions, each over the logits below the previous maximum."""
        g, cfg = self.g, self.cfg
        logits = g.einsum("bsm,em->bse", x, self.weight(f"layers.{layer}.router"))
        top = g.einsum("bse->bs", logits, join=lambda a: a, agg="max", dtype=DType.f32)
        kth = top
        for _ in range(cfg.experts_per_token - 1):
            kth = g.einsum("bse,bs->bs", logits, kth, agg="max", dtype=DType.f32,
                           join=lambda a, c: sympy.Piecewise((a, a < c), (-sympy.oo, True)))
        e = g.einsum("bse,bs,bs->bse", logits, top, kth, dtype=DType.f32,
                     join=lambda a, t, k: sympy.Piecewise((scalar.exp(a - t), a >= k), (0, True)))
        total = g.einsum("bse->bs", e, join=lambda a: a, agg="sum")
        return g.einsum("bse,bs->bse", e, total, join=lambda a, c: a / c, dtype=self.dt)

    def one_hot(self, e: int) -> Tensor:
        """pick[e'] = 1 at expert `e`, else 0 (one fill per expert, shared by the layers)."""
        if e not in self.picks:
            self.picks[e] = self.g.fill((self.cfg.experts,), lambda i: sympy.Piecewise(
                (1, sympy.Eq(i, e)), (0, True)), dtype=self.dt)
        return self.picks[e]

    def experts(self, x: Tensor, layer: int) -> Tensor:
        """Every expert's output scaled by its routing weight and summed in expert order
        (transformers adds the routed tokens' outputs the same way). An expert's FFN is guarded
        by `used[e]`, the largest weight any token gives it: a runtime skips the FFN of an
        expert no token chose (its output, then all zeros, is scaled by zero weights anyway).
        Prediction prices each expert at the chance that one of the pass's tokens picks it,
        1 - (1 - k/E)^tokens (tokens routed uniformly and independently)."""
        g, cfg = self.g, self.cfg
        weights = self.routing(x, layer)
        used = g.einsum("bse->e", weights, join=lambda a: a, agg="max")
        tokens = x.shape[0] * x.shape[1]
        share = 1 - sympy.Float(1 - cfg.experts_per_token / cfg.experts) ** tokens
        out = None
        for e in range(cfg.experts):
            w = g.einsum("bse,e->bs", weights, self.one_hot(e), agg="sum")
            with g.guard(used, e, share):
                y = self._ffn(x, f"layers.{layer}.experts.{e}.")
            out = (g.einsum("bsm,bs->bsm", y, w) if out is None else
                   g.einsum("bsm,bsm,bs->bsm", out, y, w, join=lambda o, a, c: o + a * c))
        return out

    def build(self, seq, capacity=None, last: bool = False) -> Graph:
        """Prefill of `seq` tokens (`capacity` None), or one decode step over a store of
        `capacity` rows (of one new token per row, or a verify step of `seq`); `last`: a prefill
        whose logits are only each row's at its last position (`prefill_graph`)."""
        g, cfg = self.g, self.cfg
        tokens = g.input("tokens", (B, seq), DType.i64)
        pick = g.input("last", (B, seq, 1), self.dt) if last else None
        verify = capacity is not None and seq != 1
        if capacity is None:
            rot = self.rotary_table(seq)
        else:
            self.pos = g.input("pos", (B,), DType.i64)
            if verify and cfg.kv_ring:
                self.slots = g.input("slots", (B, capacity), DType.i64)
            rot = self.verify_rotary_table(seq) if verify else self.step_rotary_table()
        embed = self.weight("embed")
        h = g.gather(embed, tokens)
        rows = []
        for layer in range(cfg.layers):
            with g.stage(layer + 1):
                p = f"layers.{layer}."
                x = self.rms_norm(h, self.weight(p + "attn_norm"))
                if capacity is None:
                    a, k, v = self.attention(x, layer, seq, rot)
                elif verify:
                    a, k, v = self.verify_attention(x, layer, rot, seq, capacity)
                else:
                    a, k, v = self.step_attention(x, layer, rot, capacity)
                h = self.add(h, a)
                f = self.feed_forward(self.rms_norm(h, self.weight(p + "ffn_norm")), layer)
                h = self.add(h, f)
                rows.append((k, v))
        with g.stage(cfg.layers + 1):
            if pick is not None:  # each row's last position, picked by its one-hot row
                h = g.einsum("bsu,bsm->bum", pick, h)
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


def prefill_graph(cfg: ModelConfig, last: bool = False) -> Graph:
    """Prefill of `S` tokens per row for `B` rows: inputs `tokens` [B,S] and the weights;
    outputs `logits` [B,S,V] and the KV cache `cache.<l>.k|v` [B,S,n,2,j]. With `last` (what a
    generation needs: its first token): one more input, `last` [B,S,1], one-hot at each row's
    last real position (`generation.last_position`), and `logits` [B,1,V] there alone: the
    final norm and the vocabulary projection run on one position a row, and the logits that
    leave the device are B x V, not B x S x V."""
    return _Llama(cfg).build(S, last=last)


def verify_graph(cfg: ModelConfig) -> Graph:
    """A verify step (speculative decoding): a decode step of `T` new tokens per row, inputs
    `tokens` [B,T] at positions `pos[b] .. pos[b]+T-1` and the KV store `cache.<l>.k|v`
    [B,C,n,2,j] (rows `t < pos[b]`); outputs `logits` [B,T,V] and the new rows `new.<l>.k|v`
    [B,T,n,2,j], of which the caller writes those it accepts into the store from `pos`. Over a
    ring store (`ModelConfig.kv_ring`) one more input, `slots` [B,C] int64: the position each
    slot holds, -1 where none (`KVStore.slot_positions`)."""
    return _Llama(cfg).build(T, capacity=C)


def decode_graph(cfg: ModelConfig) -> Graph:
    """One decode step for every position below the store's capacity `C`: inputs `tokens` [B,1],
    `pos` [B] (each row's position: its past length) and the KV store `cache.<l>.k|v`
    [B,C,n,2,j] (rows `t < pos[b]` hold row b's past; the rest is masked out); outputs `logits`
    [B,1,V] and the step's keys and values `new.<l>.k|v` [B,1,n,2,j], to be written into the
    store at `pos` (`models.kvstore.KVStore.write`)."""
    return _Llama(cfg).build(1, capacity=C)
