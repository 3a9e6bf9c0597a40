"""Writer of tiny Hugging Face-format LLaMA checkpoints for tests (files written by the
safetensors library)."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

_NUMPY = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16}


def bf16_bits(x) -> np.ndarray:
    """float -> bfloat16 bit patterns (uint16), rounding to nearest even."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


def write_safetensors(path, tensors: dict[str, np.ndarray], dtype: str = "f32") -> int:
    """Write tensors to a .safetensors file with the safetensors library (bf16 through
    ml_dtypes, rounded to nearest even); returns the data size in bytes."""
    if dtype not in _NUMPY:
        raise ValueError(f"unknown dtype {dtype!r}")
    arrays = {name: np.ascontiguousarray(a, dtype=np.float32).astype(_NUMPY[dtype])
              for name, a in tensors.items()}
    save_file(arrays, str(path))
    return sum(a.nbytes for a in arrays.values())


def make_weights(*, hidden, layers, heads, kv_heads, intermediate, vocab, head_dim, tied, seed):
    """Random float32 weights with HF names and [out, in] shapes."""
    rng = np.random.default_rng(seed)

    def mat(*shape):
        return (0.1 * rng.standard_normal(shape)).astype(np.float32)

    def norm():
        return (1.0 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)

    w = {"model.embed_tokens.weight": mat(vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm()
        w[p + "self_attn.q_proj.weight"] = mat(heads * head_dim, hidden)
        w[p + "self_attn.k_proj.weight"] = mat(kv_heads * head_dim, hidden)
        w[p + "self_attn.v_proj.weight"] = mat(kv_heads * head_dim, hidden)
        w[p + "self_attn.o_proj.weight"] = mat(hidden, heads * head_dim)
        w[p + "post_attention_layernorm.weight"] = norm()
        w[p + "mlp.gate_proj.weight"] = mat(intermediate, hidden)
        w[p + "mlp.up_proj.weight"] = mat(intermediate, hidden)
        w[p + "mlp.down_proj.weight"] = mat(hidden, intermediate)
    w["model.norm.weight"] = norm()
    if not tied:
        w["lm_head.weight"] = mat(vocab, hidden)
    return w


def make_config(*, hidden, layers, heads, kv_heads, intermediate, vocab, head_dim, tied, dtype, dialect, rope_theta, rms_eps):
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "num_hidden_layers": layers,
        "vocab_size": vocab,
        "rms_norm_eps": rms_eps,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "tie_word_embeddings": tied,
        "max_position_embeddings": 128,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}[dtype],
    }
    if dialect == "top":
        cfg["rope_theta"] = rope_theta
    elif dialect == "rope_parameters":
        cfg["rope_parameters"] = {"rope_theta": rope_theta, "rope_type": "default"}
    else:
        raise ValueError(f"unknown dialect {dialect!r}")
    return cfg


def _shard_names(names, shards):
    """Split sorted names into `shards` contiguous, non-empty groups."""
    names = sorted(names)
    shards = max(1, min(shards, len(names)))
    return [list(chunk) for chunk in np.array_split(np.array(names, dtype=object), shards)]


def write_checkpoint(
    dirpath,
    *,
    hidden=32,
    layers=2,
    heads=4,
    kv_heads=2,
    intermediate=48,
    vocab=64,
    head_dim=None,
    tied=False,
    dtype="f32",
    dialect="top",
    rope_theta=10000.0,
    shards=1,
    seed=0,
    rms_eps=1e-6,
) -> Path:
    """Write a tiny random LLaMA checkpoint (config.json + safetensors) into dirpath."""
    dirpath = Path(dirpath)
    dirpath.mkdir(parents=True, exist_ok=True)
    head_dim = head_dim or hidden // heads
    shape = dict(
        hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
        intermediate=intermediate, vocab=vocab, head_dim=head_dim, tied=tied,
    )
    weights = make_weights(**shape, seed=seed)
    cfg = make_config(**shape, dtype=dtype, dialect=dialect, rope_theta=rope_theta, rms_eps=rms_eps)
    (dirpath / "config.json").write_text(json.dumps(cfg, indent=2))

    if shards <= 1:
        write_safetensors(dirpath / "model.safetensors", weights, dtype)
        return dirpath

    groups = _shard_names(weights, shards)
    weight_map, total = {}, 0
    for k, group in enumerate(groups, start=1):
        fname = f"model-{k:05d}-of-{len(groups):05d}.safetensors"
        total += write_safetensors(dirpath / fname, {n: weights[n] for n in group}, dtype)
        weight_map.update({n: fname for n in group})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (dirpath / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return dirpath
