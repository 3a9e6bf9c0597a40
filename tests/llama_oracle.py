"""Independent plain-NumPy reference for the Hugging Face LLaMA forward pass and its
descendants: Llama 3.x rope scaling (llama3, linear), Mistral's sliding window, Qwen2's q/k/v
biases, Qwen3's per-head q/k RMSNorm and head_dim, Mixtral's top-k mixture of experts.

Written without any einpage code, from transformers' semantics; used as a test oracle. All math
in float64.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

_SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


# ---------------------------------------------------------------- loading


def read_safetensors(path) -> dict[str, np.ndarray]:
    """Parse a .safetensors file by hand; returns float64 arrays."""
    raw = Path(path).read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + header_len])
    data = raw[8 + header_len :]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = info["dtype"]
        if dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"unsupported safetensors dtype {dtype} for {name}")
        start, end = info["data_offsets"]
        arr = np.frombuffer(data[start:end], dtype=np.dtype(_SAFETENSORS_DTYPES[dtype]).newbyteorder("<"))
        if dtype == "BF16":
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        out[name] = arr.reshape(info["shape"]).astype(np.float64)
    return out


def _read_config(dirpath: Path) -> dict:
    raw = json.loads((dirpath / "config.json").read_text())
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope_theta = raw.get("rope_theta")
    if rope_theta is None:
        rope_theta = rope.get("rope_theta", 10000.0)
    heads = raw["num_attention_heads"]
    layers = raw["num_hidden_layers"]
    family = raw.get("model_type", "llama")
    window = raw.get("sliding_window")
    if family in ("qwen2", "qwen3"):
        if not raw.get("use_sliding_window"):
            window = None
        types = raw.get("layer_types") or [
            "sliding_attention" if i >= raw.get("max_window_layers", 0) else "full_attention"
            for i in range(layers)]
        windows = [window if t == "sliding_attention" else None for t in types]
    elif family in ("mistral", "mixtral"):
        windows = [window] * layers
    else:
        windows = [None] * layers
    return {
        "hidden_size": raw["hidden_size"],
        "intermediate_size": raw["intermediate_size"],
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": raw.get("num_key_value_heads") or heads,
        "head_dim": raw.get("head_dim") or raw["hidden_size"] // heads,
        "vocab_size": raw["vocab_size"],
        "rms_norm_eps": raw.get("rms_norm_eps", 1e-6),
        "rope_theta": float(rope_theta),
        "rope": dict(rope),
        "windows": windows,
        "num_experts_per_tok": raw.get("num_experts_per_tok"),
        "num_local_experts": raw.get("num_local_experts"),
        "tie_word_embeddings": bool(raw.get("tie_word_embeddings", False)),
    }


def load_hf_checkpoint(dirpath) -> tuple[dict, dict[str, np.ndarray]]:
    """Read config.json and (possibly sharded) safetensors weights as float64."""
    dirpath = Path(dirpath)
    cfg = _read_config(dirpath)
    index = dirpath / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    weights: dict[str, np.ndarray] = {}
    for f in files:
        weights.update(read_safetensors(dirpath / f))
    if "lm_head.weight" not in weights:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    return cfg, weights


# ---------------------------------------------------------------- math


def rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def linear(x, w):
    """HF Linear: weight is [out, in]."""
    return x @ w.T


def silu(x):
    return x / (1.0 + np.exp(-x))


def softmax(x, axis=-1):
    x = x - np.max(x, axis=axis, keepdims=True)
    e = np.exp(x)
    return e / np.sum(e, axis=axis, keepdims=True)


def inverse_frequencies(head_dim, theta, rope=None):
    """Rotary inverse frequencies, with Llama 3's or linear scaling when `rope` says so."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    kind = (rope or {}).get("rope_type", (rope or {}).get("type", "default"))
    if kind == "linear":
        return inv_freq / rope["factor"]
    if kind == "llama3":
        factor, old = rope["factor"], rope["original_max_position_embeddings"]
        low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
        out = np.empty_like(inv_freq)
        for i, f in enumerate(inv_freq):
            wavelen = 2 * np.pi / f
            if wavelen < old / high:        # high frequency: kept
                out[i] = f
            elif wavelen > old / low:       # low frequency: scaled down
                out[i] = f / factor
            else:                           # in between: interpolated
                t = (old / wavelen - low) / (high - low)
                out[i] = (1 - t) * f / factor + t * f
        return out
    assert kind == "default", kind
    return inv_freq


def rope_cos_sin(positions, head_dim, theta, rope=None):
    """cos/sin of shape (S, D), HF layout (frequencies duplicated, not interleaved)."""
    inv_freq = inverse_frequencies(head_dim, theta, rope)
    freqs = np.outer(np.asarray(positions, dtype=np.float64), inv_freq)
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb), np.sin(emb)


def rotate_half(x):
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rope(x, cos, sin):
    """x: (B, heads, S, D); cos/sin: (S, D)."""
    return x * cos + rotate_half(x) * sin


def causal_attention(q, k, v, past_len, window=None):
    """q: (B, H, S, D); k, v: (B, KV, P+S, D). Grouped-query, causal from past_len; with a
    sliding `window`, a query sees only the `window` latest keys (itself included)."""
    n_heads, n_kv = q.shape[1], k.shape[1]
    group = n_heads // n_kv
    k = np.repeat(k, group, axis=1)  # query head h -> kv head h // group
    v = np.repeat(v, group, axis=1)
    s, total = q.shape[2], k.shape[2]
    scores = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    q_pos = past_len + np.arange(s)[:, None]
    k_pos = np.arange(total)[None, :]
    mask = k_pos > q_pos
    if window is not None:
        mask |= q_pos - k_pos >= window
    scores = np.where(mask, -np.inf, scores)
    return softmax(scores) @ v


# ---------------------------------------------------------------- model


def _split_heads(x, n):
    b, s, _ = x.shape
    return x.reshape(b, s, n, -1).transpose(0, 2, 1, 3)


def _merge_heads(x):
    b, h, s, d = x.shape
    return x.transpose(0, 2, 1, 3).reshape(b, s, h * d)


def _project(w, name, x):
    out = linear(x, w[name + ".weight"])
    return out + w[name + ".bias"] if name + ".bias" in w else out


def _attention_block(cfg, w, prefix, x, cos, sin, past, past_len, window):
    eps = cfg["rms_norm_eps"]
    q = _split_heads(_project(w, prefix + "q_proj", x), cfg["num_attention_heads"])
    k = _split_heads(_project(w, prefix + "k_proj", x), cfg["num_key_value_heads"])
    v = _split_heads(_project(w, prefix + "v_proj", x), cfg["num_key_value_heads"])
    if prefix + "q_norm.weight" in w:  # Qwen3: RMSNorm over each head's dims, before rotary
        q = rms_norm(q, w[prefix + "q_norm.weight"], eps)
        k = rms_norm(k, w[prefix + "k_norm.weight"], eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if past is not None:
        k = np.concatenate([past[0], k], axis=2)
        v = np.concatenate([past[1], v], axis=2)
    out = causal_attention(q, k, v, past_len, window)
    return _project(w, prefix + "o_proj", _merge_heads(out)), (k, v)


def _mlp_block(w, prefix, x):
    gate = linear(x, w[prefix + "gate_proj.weight"])
    up = linear(x, w[prefix + "up_proj.weight"])
    return linear(silu(gate) * up, w[prefix + "down_proj.weight"])


def _moe_block(cfg, w, prefix, x):
    """Mixtral: softmax over the router logits, the top-k experts per token, their weights
    renormalised to sum to one; each token's output is the weighted sum of its experts'."""
    top_k = cfg["num_experts_per_tok"]
    flat = x.reshape(-1, x.shape[-1])
    probs = softmax(linear(flat, w[prefix + "gate.weight"]))
    out = np.zeros_like(flat)
    for i, token in enumerate(flat):
        chosen = np.argsort(-probs[i], kind="stable")[:top_k]
        weights = probs[i, chosen] / probs[i, chosen].sum()
        for e, wt in zip(chosen, weights):
            p = f"{prefix}experts.{e}."
            hidden = silu(linear(token, w[p + "w1.weight"])) * linear(token, w[p + "w3.weight"])
            out[i] += wt * linear(hidden, w[p + "w2.weight"])
    return out.reshape(x.shape)


def forward(cfg, weights, input_ids, past_kv=None):
    """Logits (B, S, V) float64 and the updated per-layer (k, v) cache, each (B, KV, P+S, D)."""
    ids = np.asarray(input_ids, dtype=np.int64)
    eps = cfg["rms_norm_eps"]
    past_len = 0 if past_kv is None else past_kv[0][0].shape[2]
    cos, sin = rope_cos_sin(past_len + np.arange(ids.shape[1]), cfg["head_dim"], cfg["rope_theta"],
                            cfg.get("rope"))

    h = weights["model.embed_tokens.weight"][ids]
    new_kv = []
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        past = None if past_kv is None else past_kv[i]
        attn, kv = _attention_block(
            cfg, weights, p + "self_attn.", rms_norm(h, weights[p + "input_layernorm.weight"], eps), cos, sin, past, past_len,
            cfg.get("windows", [None] * cfg["num_hidden_layers"])[i],
        )
        new_kv.append(kv)
        h = h + attn
        x = rms_norm(h, weights[p + "post_attention_layernorm.weight"], eps)
        if p + "block_sparse_moe.gate.weight" in weights:
            h = h + _moe_block(cfg, weights, p + "block_sparse_moe.", x)
        else:
            h = h + _mlp_block(weights, p + "mlp.", x)
    h = rms_norm(h, weights["model.norm.weight"], eps)
    return linear(h, weights["lm_head.weight"]), new_kv


def greedy(cfg, weights, prompt, n_new) -> np.ndarray:
    """Greedy decoding with the KV cache: prefill, then one token per step."""
    logits, kv = forward(cfg, weights, prompt)
    tokens = []
    for step in range(n_new):
        nxt = np.argmax(logits[:, -1, :], axis=-1).astype(np.int64)
        tokens.append(nxt)
        if step + 1 < n_new:
            logits, kv = forward(cfg, weights, nxt[:, None], kv)
    return np.stack(tokens, axis=1) if tokens else np.zeros((np.shape(prompt)[0], 0), np.int64)
