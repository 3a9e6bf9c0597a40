"""Writes GGUF files from the tiny Hugging Face fixtures (tests/fixtures/tiny-*) with
`gguf.GGUFWriter`, laid out as llama.cpp lays them out: `convert_hf_to_gguf.py`'s tensor names,
q/k row permutation (arch `llama`), metadata keys and tokenizer metadata (`gguf.SpecialVocab`
for merges, special ids and add_bos_token, as the converter uses it), its tensor types (a matrix
in the chosen type, quantized with `gguf.quants.quantize`, the converter's own quantizer, F16
where a row is not whole blocks; norms, 1-D tensors, biases and the MoE router F32), and for
Q4_0 / Q4_1 what `llama-quantize` does to the output matrix (`output.weight`, or the tied
`token_embd.weight`): Q6_K, which falls back to Q8_0 where its rows are not whole 256-blocks.
Where llama.cpp's own files exist (tests/fixtures/gguf/), tests/test_gguf.py checks that these
are the same tensors, byte for byte, and the same metadata (but `general.*`).

`gguf_spec(src, ttype)` returns a `GGUFSpec` (metadata and tensors, editable: tests break it on
purpose) and `GGUFSpec.write(path)` writes it.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import ml_dtypes
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V

from einpage.models.checkpoint import Checkpoint

TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1")
_QTYPE = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0,
          "q4_1": Q.Q4_1}
#: llama_ftype of each (general.file_type)
_FTYPE = {"f32": 0, "f16": 1, "bf16": 32, "q8_0": 7, "q4_0": 2, "q4_1": 3}
_ARCH = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2",
         "qwen3": "qwen3"}
_LAYER = {"input_layernorm.weight": "attn_norm.weight",
          "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
          "self_attn.v_proj.weight": "attn_v.weight",
          "self_attn.o_proj.weight": "attn_output.weight",
          "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
          "self_attn.v_proj.bias": "attn_v.bias", "self_attn.o_proj.bias": "attn_output.bias",
          "self_attn.q_norm.weight": "attn_q_norm.weight",
          "self_attn.k_norm.weight": "attn_k_norm.weight",
          "post_attention_layernorm.weight": "ffn_norm.weight",
          "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
          "mlp.down_proj.weight": "ffn_down.weight",
          "block_sparse_moe.gate.weight": "ffn_gate_inp.weight"}
_EXPERT = {"w1": "ffn_gate_exps.weight", "w2": "ffn_down_exps.weight",
           "w3": "ffn_up_exps.weight"}


@dataclass
class GGUFSpec:
    """What a GGUF file holds: `meta` key -> (value, GGUFValueType, array item type) and
    `tensors` name -> (array, GGML type); a packed or BF16 array is its uint8 bytes."""
    arch: str
    meta: dict = field(default_factory=dict)
    tensors: dict = field(default_factory=dict)

    def set(self, key: str, value, vtype: V | None = None, sub: V | None = None) -> None:
        if vtype is None:
            vtype = (V.BOOL if isinstance(value, bool) else V.UINT32 if isinstance(value, int)
                     else V.FLOAT32 if isinstance(value, float) else V.STRING)
        self.meta[key] = (value, vtype, sub)

    def tensor(self, name: str, values: np.ndarray, qtype: Q = Q.F32) -> None:
        self.tensors[name] = (np.ascontiguousarray(values), qtype)

    def write(self, path: Path) -> Path:
        writer = gguf.GGUFWriter(path, self.arch)
        for key, (value, vtype, sub) in self.meta.items():
            writer.add_key_value(key, value, vtype, sub)
        for name, (array, qtype) in self.tensors.items():
            writer.add_tensor(name, array, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return Path(path)


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute`: each head's rows from (half, j) to (j, half)."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def encode(values: np.ndarray, ttype: str, matrix: bool) -> tuple[np.ndarray, Q]:
    """A tensor in type `ttype` as the converter stores it: matrices in that type (F16 where a
    row is not whole blocks), the rest F32."""
    values = np.asarray(values)
    if not matrix or ttype == "f32":
        return values.astype(np.float32), Q.F32
    if ttype == "f16":
        return values.astype(np.float32).astype(np.float16), Q.F16
    if ttype == "bf16":
        return values.astype(ml_dtypes.bfloat16).view(np.uint8), Q.BF16
    try:
        return gguf.quants.quantize(values.astype(np.float32), _QTYPE[ttype]), _QTYPE[ttype]
    except gguf.quants.QuantError:
        return values.astype(np.float32).astype(np.float16), Q.F16


def rope_factors(rope: dict, theta: float, head_dim: int) -> np.ndarray:
    """`LlamaModel.generate_extra_tensors`' llama3 factors."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor, low = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0)
    high = rope.get("high_freq_factor", 4.0)
    old = rope.get("original_max_position_embeddings", 8192)
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def gguf_spec(src: Path, ttype: str = "f32", pre: str = "gpt-2") -> GGUFSpec:
    """The GGUF file of HF fixture directory `src` with matrices in `ttype`; `pre`: the
    `tokenizer.ggml.pre` of its byte-level BPE."""
    src = Path(src)
    hp = json.loads((src / "config.json").read_text())
    arch = _ARCH[hp["model_type"]]
    spec, p = GGUFSpec(arch), arch + "."
    heads, hidden = hp["num_attention_heads"], hp["hidden_size"]
    kv_heads = hp.get("num_key_value_heads", heads)
    head_dim = hp.get("head_dim") or hidden // heads
    rope = hp.get("rope_parameters") or hp.get("rope_scaling") or {}
    theta = float(hp.get("rope_theta", rope.get("rope_theta", 10000.0)))
    spec.set("general.name", src.name)
    spec.set(p + "block_count", hp["num_hidden_layers"])
    spec.set(p + "context_length", hp["max_position_embeddings"])
    spec.set(p + "embedding_length", hidden)
    spec.set(p + "feed_forward_length", hp["intermediate_size"])
    spec.set(p + "attention.head_count", heads)
    spec.set(p + "attention.head_count_kv", kv_heads)
    spec.set(p + "rope.freq_base", theta)
    spec.set(p + "attention.layer_norm_rms_epsilon", float(hp["rms_norm_eps"]))
    if hp.get("num_local_experts"):
        spec.set(p + "expert_count", hp["num_local_experts"])
        spec.set(p + "expert_used_count", hp["num_experts_per_tok"])
    spec.set("general.file_type", _FTYPE[ttype])
    if hp.get("head_dim") is not None:
        spec.set(p + "attention.key_length", hp["head_dim"])
        spec.set(p + "attention.value_length", hp["head_dim"])
    if arch == "llama":
        spec.set(p + "vocab_size", hp["vocab_size"])
        spec.set(p + "rope.dimension_count", head_dim)
    if rope.get("rope_type") == "linear":
        spec.set(p + "rope.scaling.type", "linear")
        spec.set(p + "rope.scaling.factor", float(rope["factor"]))
    _tokenizer(spec, src, hp["vocab_size"], pre)
    spec.set("general.quantization_version", 2)

    if rope.get("rope_type") == "llama3":
        spec.tensor("rope_freqs.weight", rope_factors(rope, theta, head_dim))
    ckpt = Checkpoint(src)
    output = "output.weight" if "lm_head.weight" in ckpt.tensors else "token_embd.weight"
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for name in ckpt.tensors:
        data = np.asarray(ckpt.array(name)).astype(np.float32)
        if name == "model.embed_tokens.weight":
            new = "token_embd.weight"
        elif name == "model.norm.weight":
            new = "output_norm.weight"
        elif name == "lm_head.weight":
            new = "output.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            if ".experts." in rest:  # block_sparse_moe.experts.<e>.<w>.weight
                _, _, e, wid, _ = rest.split(".")
                experts.setdefault((int(layer), wid), {})[int(e)] = data
                group = experts[(int(layer), wid)]
                if len(group) < hp["num_local_experts"]:
                    continue
                data = np.stack([group[k] for k in range(len(group))])
                new = f"blk.{layer}.{_EXPERT[wid]}"
            else:
                new = f"blk.{layer}.{_LAYER[rest]}"
                if arch == "llama" and rest.startswith("self_attn.q_proj"):
                    data = permute(data, heads)
                elif arch == "llama" and rest.startswith("self_attn.k_proj"):
                    data = permute(data, kv_heads)
        matrix = (data.ndim >= 2 and new.endswith(".weight") and "_norm" not in new
                  and "ffn_gate_inp" not in new)
        if new == output and ttype in ("q4_0", "q4_1"):  # llama-quantize: Q6_K, else Q8_0
            if data.shape[-1] % 256 == 0:
                raise NotImplementedError("Q6_K (the gguf package does not quantize to it)")
            spec.tensor(new, *encode(data, "q8_0", True))
            continue
        spec.tensor(new, *encode(data, ttype, matrix))
    return spec


def _tokenizer(spec: GGUFSpec, src: Path, vocab_size: int, pre: str) -> None:
    """`TextModel._set_vocab_gpt2` (or `_set_vocab_none` without a tokenizer.json)."""
    if not (src / "tokenizer.json").exists():
        spec.set("tokenizer.ggml.model", "none")
        return
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    reverse = {i: t for t, i in tok.get_vocab(with_added_tokens=True).items()}
    added = {i: t for i, t in tok.get_added_tokens_decoder().items()}
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(int(gguf.TokenType.UNUSED))
        elif i in added:
            tokens.append(added[i].content)
            types.append(int(gguf.TokenType.CONTROL if added[i].special
                             else gguf.TokenType.USER_DEFINED))
        else:
            tokens.append(reverse[i])
            types.append(int(gguf.TokenType.NORMAL))
    spec.set("tokenizer.ggml.model", "gpt2")
    spec.set("tokenizer.ggml.pre", pre)
    spec.set("tokenizer.ggml.tokens", tokens, V.ARRAY, V.STRING)
    spec.set("tokenizer.ggml.token_type", types, V.ARRAY, V.INT32)
    special = gguf.SpecialVocab(src, load_merges=True, n_vocab=len(tokens))
    spec.set("tokenizer.ggml.merges", special.merges, V.ARRAY, V.STRING)
    for typ, tid in special.special_token_ids.items():
        key = {"unk": "unknown", "pad": "padding", "sep": "seperator"}.get(typ, typ)
        spec.set(f"tokenizer.ggml.{key}_token_id", tid)
    for typ, value in special.add_special_token.items():
        spec.set(f"tokenizer.ggml.add_{typ}_token", value)


def write_gguf(src: Path, path: Path, ttype: str = "f32", pre: str = "gpt-2") -> Path:
    """Write the GGUF file of fixture `src` (matrices in `ttype`) to `path`."""
    return gguf_spec(src, ttype, pre).write(path)
