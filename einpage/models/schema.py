"""The weights a model has: their graph names and logical shapes, the checkpoint tensor each one
is (Hugging Face names and `[out, in]` shapes), and which of them are kept quantized (storage
formats, `einpage.ir.storage`). No SymPy and no graph: `einpage models` and the checkpoint
readers use it without building a model."""
from __future__ import annotations

import functools
import math
from dataclasses import replace
from types import MappingProxyType

from einpage.errors import ModelError
from einpage.ir.dtypes import DType
from einpage.ir.storage import Storage, get_format, storage_for, tensor_bytes
from einpage.models.config import ModelConfig


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Logical shape of every weight input, by graph input name."""
    return dict(_shapes(cfg))


@functools.lru_cache(maxsize=64)
def _shapes(cfg: ModelConfig):
    """`weight_shapes`, built once per config (read-only): the per-weight helpers below look
    one name up (a Mixtral-8x22b has 4,000 weights; building them all per lookup made
    `einpage models` take seconds)."""
    n, g, j, m, f = cfg.kv_heads, cfg.group, cfg.head_dim // 2, cfg.hidden, cfg.intermediate
    shapes = {"embed": (cfg.vocab, m), "norm": (m,)}
    if not cfg.tied:
        shapes["lm_head"] = (cfg.vocab, m)
    for layer in range(cfg.layers):
        p = f"layers.{layer}."
        shapes.update({p + "attn_norm": (m,), p + "wq": (n, g, 2, j, m), p + "wk": (n, 2, j, m),
                       p + "wv": (n, 2, j, m), p + "wo": (m, n, g, 2, j), p + "ffn_norm": (m,)})
        if cfg.qkv_bias:
            shapes.update({p + "bq": (n, g, 2, j), p + "bk": (n, 2, j), p + "bv": (n, 2, j)})
        if cfg.o_bias:
            shapes[p + "bo"] = (m,)
        if cfg.qk_norm:
            shapes.update({p + "q_norm": (2, j), p + "k_norm": (2, j)})
        if cfg.experts:
            shapes[p + "router"] = (cfg.experts, m)
            for e in range(cfg.experts):
                shapes.update({f"{p}experts.{e}.w_gate": (f, m), f"{p}experts.{e}.w_up": (f, m),
                               f"{p}experts.{e}.w_down": (m, f)})
        else:
            shapes.update({p + "w_gate": (f, m), p + "w_up": (f, m), p + "w_down": (m, f)})
    return MappingProxyType(shapes)


#: weights `--quantize` stores in a block format: every matrix but a MoE router (llama.cpp
#: keeps `ffn_gate_inp` in float too); norms and biases stay in the model dtype
_QUANTIZABLE = {"embed", "lm_head", "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"}


def row_axes(cfg: ModelConfig, name: str) -> int:
    """How many trailing axes of weight `name`'s graph shape form one row of its checkpoint
    tensor (the `in` of Hugging Face's `[out, in]`; GGUF's `ne0`): quantization groups run
    along it."""
    shape, row = _shapes(cfg)[name], hf_shape(cfg, name)[-1]
    for k in range(1, len(shape) + 1):
        if math.prod(shape[len(shape) - k:]) == row:
            return k
    raise ValueError(f"{name}: no trailing axes of {shape} make a row of {row}")


def quantized(cfg: ModelConfig, format: str | None) -> ModelConfig:
    """`cfg` with every matrix weight kept in `format` (None: none), as `--quantize` does; a
    weight whose rows are not whole groups stays unpacked (as GGUF's converter keeps it)."""
    if format is None:
        return replace(cfg, formats=())
    get_format(format)  # SpecError for an unknown name
    formats = []
    for name, shape in weight_shapes(cfg).items():
        if name.rsplit(".", 1)[-1] in _QUANTIZABLE and storage_for(
                format, shape, row_axes(cfg, name)) is not None:
            formats.append((name, format))
    return replace(cfg, formats=tuple(sorted(formats)))


def weight_storage(cfg: ModelConfig) -> dict[str, Storage]:
    """The storage of every weight `cfg` keeps quantized, by graph weight name."""
    shapes, out = weight_shapes(cfg), {}
    for name, format in cfg.formats:
        if name not in shapes:
            raise ModelError(f"{cfg.name}: quantized weight {name!r} is not a weight of the model")
        st = storage_for(format, shapes[name], row_axes(cfg, name))
        if st is None:
            raise ModelError(f"{cfg.name}: weight {name!r} {list(shapes[name])} cannot be "
                             f"stored as {format}: its rows are not whole groups of "
                             f"{get_format(format).group}")
        out[name] = st
    return out


def kv_storage(cfg: ModelConfig) -> Storage | None:
    """The storage of the KV store's `[b, t, kv_heads, 2, head_dim/2]` tensors under
    `cfg.kv_format`: groups along each head's row of `head_dim` values (llama.cpp's `-ctk q8_0`
    layout); None without a format. `ModelError` where a head's row is not whole groups."""
    if cfg.kv_format is None:
        return None
    st = storage_for(cfg.kv_format, (cfg.kv_heads, 2, cfg.head_dim // 2), 2)
    if st is None:
        raise ModelError(f"{cfg.name}: --kv-dtype {cfg.kv_format} needs head_dim a multiple of "
                         f"{get_format(cfg.kv_format).group}, not {cfg.head_dim}")
    return st


def weight_bytes_by_format(cfg: ModelConfig, dtype: DType) -> dict[str, int]:
    """Bytes of the model's weights per storage format (the unpacked ones under `dtype`'s
    name)."""
    storage = weight_storage(cfg)
    out: dict[str, int] = {}
    for name, shape in weight_shapes(cfg).items():
        st = storage.get(name)
        key = st.format if st else dtype.value
        out[key] = out.get(key, 0) + tensor_bytes(shape, dtype, st)
    return out


_HF_LAYER = {"attn_norm": "input_layernorm.weight", "wq": "self_attn.q_proj.weight",
             "wk": "self_attn.k_proj.weight", "wv": "self_attn.v_proj.weight",
             "wo": "self_attn.o_proj.weight", "bq": "self_attn.q_proj.bias",
             "bk": "self_attn.k_proj.bias", "bv": "self_attn.v_proj.bias",
             "bo": "self_attn.o_proj.bias", "q_norm": "self_attn.q_norm.weight",
             "k_norm": "self_attn.k_norm.weight", "ffn_norm": "post_attention_layernorm.weight",
             "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight",
             "w_down": "mlp.down_proj.weight", "router": "block_sparse_moe.gate.weight"}
# Mixtral's experts: w1 is the gate projection, w3 the up projection, w2 the down projection
_HF_EXPERT = {"w_gate": "w1", "w_up": "w3", "w_down": "w2"}


def hf_tensor(name: str) -> str:
    """The Hugging Face checkpoint tensor holding graph weight `name`."""
    if name == "embed":
        return "model.embed_tokens.weight"
    if name == "norm":
        return "model.norm.weight"
    if name == "lm_head":
        return "lm_head.weight"
    parts = name.split(".")
    if len(parts) == 5:  # layers.<l>.experts.<e>.<w>
        _, layer, _, expert, short = parts
        return f"model.layers.{layer}.block_sparse_moe.experts.{expert}.{_HF_EXPERT[short]}.weight"
    _, layer, short = parts
    return f"model.layers.{layer}.{_HF_LAYER[short]}"


def hf_shape(cfg: ModelConfig, name: str) -> tuple[int, ...]:
    """The shape Hugging Face stores graph weight `name` in: `[out, in]` for a projection,
    flat for a bias or a per-head norm."""
    shape = _shapes(cfg)[name]
    short = name.rsplit(".", 1)[-1]
    if short in ("wq", "wk", "wv"):
        return (math.prod(shape[:-1]), shape[-1])
    if short == "wo":
        return (shape[0], math.prod(shape[1:]))
    if short in ("bq", "bk", "bv", "q_norm", "k_norm"):
        return (math.prod(shape),)
    return shape
