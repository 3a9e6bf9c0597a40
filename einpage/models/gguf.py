"""GGUF files (llama.cpp's format) as einpage models: config, weights and tokenizer.

Supported:
  * architectures `llama` (LLaMA 1/2/3/3.x, Mistral; with `llama.expert_count`, a Mixtral-style
    mixture of experts stacked in `blk.N.ffn_{gate,up,down}_exps`), `qwen2` (q/k/v biases),
    `qwen3` (q/k RMSNorm); attention biases are read wherever the file has them;
  * tensor types F32, F16, BF16 (dense: an array in the file's dtype) and Q8_0, Q4_0, Q4_1, Q4_K,
    Q6_K (kept packed: a `uint8` array of `Storage.packed_shape`, listed by `storages()`);
  * rotary scaling `linear` (`rope.scaling.*`) and Llama 3's, fitted to the `rope_freqs` factors
    llama.cpp's converter writes (`llama3_scaling`; the fit must reproduce them);
  * tokenizers `gpt2` (byte-level BPE; `tokenizer.ggml.pre` gpt-2, llama-bpe/llama3 (Llama 3),
    qwen2, default) and `llama` (SentencePiece BPE with byte fallback, merges ranked by score),
    built as `tokenizers` objects the way transformers converts them, in a `TextCodec`.

Layout: GGUF lists dims innermost first, so a tensor's numpy shape is HF's `[out, in]` and a
GGUF row (`ne0`) is HF's `in`. For arch `llama` llama.cpp's converter permutes the rows of
`attn_q` / `attn_k` (and their biases) from rotate-half order to interleaved pairs; the weight
source undoes it with a strided view (whole rows move, so packed rows are exact too), and every
weight the graph sees has HF's layout. Every weight is a view of the file's memory map.

The header is parsed here (`read_gguf`; `gguf.GGUFReader` builds numpy arrays per element of the
token and merge lists, about 25 us each: 10+ s for a Llama 3 vocabulary); the `gguf` package
gives the tensor types and their block sizes, and the tests check this parser against its reader.

Refused in one line (`CheckpointError`: a file einpage cannot read; `ModelError`: a model it does
not run): not GGUF, truncated, big-endian or version 1; another architecture; per-layer head
counts, partial rotary, other rope scalings; another tensor type (named with the tensor); a
tensor missing or of a shape the metadata disagrees with; other tokenizers. Mistral's GGUF has
no sliding window (llama.cpp's converter writes none, and llama.cpp runs none); a
`llama.attention.sliding_window` key applies to every layer.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from einpage.errors import CheckpointError, ModelError
from einpage.ir.dtypes import DType, as_dtype
from einpage.ir.storage import Storage, get_format, storage_for
from einpage.models import schema
from einpage.models.config import ModelConfig, RopeScaling
from einpage.models.text import EndOfSequence, TextCodec

ARCHITECTURES = ("llama", "qwen2", "qwen3")
DENSE_TYPES = {"F32": DType.f32, "F16": DType.f16, "BF16": DType.bf16}
PACKED_TYPES = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1", "Q4_K": "q4_k", "Q6_K": "q6_k"}

_TOP = {"embed": "token_embd.weight", "norm": "output_norm.weight", "lm_head": "output.weight"}
_LAYER = {"attn_norm": "attn_norm.weight", "wq": "attn_q.weight", "wk": "attn_k.weight",
          "wv": "attn_v.weight", "wo": "attn_output.weight", "bq": "attn_q.bias",
          "bk": "attn_k.bias", "bv": "attn_v.bias", "bo": "attn_output.bias",
          "q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight",
          "ffn_norm": "ffn_norm.weight", "w_gate": "ffn_gate.weight", "w_up": "ffn_up.weight",
          "w_down": "ffn_down.weight", "router": "ffn_gate_inp.weight"}
_EXPERTS = {"w_gate": "ffn_gate_exps.weight", "w_up": "ffn_up_exps.weight",
            "w_down": "ffn_down_exps.weight"}
_MISSING = object()


# ---------------------------------------------------------------------- the file

@dataclass(frozen=True, slots=True)
class GGUFTensor:
    """One tensor of a GGUF file: its GGML type's name, numpy shape (outermost first), and
    where its bytes lie in the file."""
    name: str
    type: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def is_gguf(path: str | Path) -> bool:
    """Whether `path` is a file that starts with GGUF's magic."""
    try:
        with open(path, "rb") as fh:
            return fh.read(4) == b"GGUF"
    except OSError:
        return False


_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
           11: "<q", 12: "<d"}


def read_gguf(path: Path) -> tuple[dict, dict[str, GGUFTensor], np.memmap]:
    """(metadata, tensors, the file as a read-only uint8 memory map) of GGUF file `path`. String
    arrays are lists of str, numeric arrays numpy arrays, FLOAT32 scalars their shortest decimal
    (1e-06, not 9.99999997e-07)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(8)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read: {exc}") from None
    if head[:4] != b"GGUF":
        raise CheckpointError(f"{path}: not a GGUF file (it starts with {head[:4]!r}, not "
                              "b'GGUF')")
    data = np.memmap(path, dtype=np.uint8, mode="r")
    view, pos = memoryview(data), 4

    def take(fmt: str):
        nonlocal pos
        (value,) = struct.unpack_from(fmt, view, pos)
        pos += struct.calcsize(fmt)
        return value

    def count(n: int, least: int) -> int:  # a count of items of at least `least` bytes
        if n * least > size - pos:
            raise ValueError(f"{n} items at byte {pos} run past the end")
        return n

    def string() -> str:
        nonlocal pos
        n = count(take("<Q"), 1)
        pos += n
        return str(view[pos - n:pos], "utf-8")

    def value(kind: int):
        nonlocal pos
        if kind == 8:
            return string()
        if kind == 9:
            item, n = take("<I"), take("<Q")
            if item == 8:
                return [string() for _ in range(count(n, 8))]
            if item not in _SCALAR:
                raise ValueError(f"array of value type {item}")
            dtype = np.dtype(_SCALAR[item])
            array = np.frombuffer(view, dtype, count(n, dtype.itemsize), pos).copy()
            pos += array.nbytes
            return array
        if kind not in _SCALAR:
            raise ValueError(f"value type {kind}")
        v = take(_SCALAR[kind])
        return float(str(np.float32(v))) if kind == 6 else v

    try:
        version = take("<I")
        if version not in (2, 3):
            raise CheckpointError(f"{path}: " + (
                "a big-endian GGUF file, which einpage does not read" if not version & 0xFFFF
                else f"GGUF version {version} is not supported (einpage reads 2 and 3)"))
        n_tensors, n_keys = take("<Q"), take("<Q")
        metadata = {}
        for _ in range(count(n_keys, 12)):
            key = string()
            if key in metadata:
                raise ValueError(f"key {key!r} twice")
            metadata[key] = value(take("<I"))
        infos = {}
        for _ in range(count(n_tensors, 24)):
            name = string()
            if name in infos:
                raise ValueError(f"tensor {name!r} twice")
            dims = [take("<Q") for _ in range(count(take("<I"), 8))]
            infos[name] = (take("<I"), tuple(reversed(dims)), take("<Q"))
    except struct.error:
        raise CheckpointError(f"{path}: truncated GGUF file (it ends inside the header, at "
                              f"byte {size})") from None
    except (ValueError, UnicodeDecodeError, OverflowError) as exc:
        raise CheckpointError(f"{path}: malformed GGUF header ({exc})") from None
    align = metadata.get("general.alignment", 32)
    if not isinstance(align, int) or align < 1 or align & (align - 1):
        raise CheckpointError(f"{path}: general.alignment {align!r} is not a power of two")
    start = -(-pos // align) * align
    tensors = {}
    for name, (kind, shape, offset) in infos.items():
        try:
            ggml = GGMLQuantizationType(kind).name
            block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        except (ValueError, KeyError):
            ggml, block, block_bytes = f"type {kind}", 1, 0
        if shape and shape[-1] % block:
            raise CheckpointError(f"{path}: tensor {name!r}: rows of {shape[-1]} are not whole "
                                  f"{ggml} blocks of {block}")
        nbytes = math.prod(shape) // block * block_bytes
        if start + offset + nbytes > size:
            raise CheckpointError(f"{path}: truncated GGUF file: tensor {name!r} ends at byte "
                                  f"{start + offset + nbytes} of {size}")
        tensors[name] = GGUFTensor(name, ggml, shape, start + offset, nbytes)
    return metadata, tensors, data


# ---------------------------------------------------------------------- the model

@dataclass(frozen=True, slots=True)
class Slot:
    """Where graph weight lies in the file: the GGUF `tensor`, its numpy shape there
    (`file_shape`), the graph's logical `shape`, the heads whose rows llama.cpp permuted (0:
    none), its index in a stacked tensor of experts, and how many trailing graph axes make a
    file row."""
    tensor: str
    file_shape: tuple[int, ...]
    shape: tuple[int, ...]
    heads: int = 0
    expert: int | None = None
    row_axes: int = 1


def slots(cfg: ModelConfig, permuted: bool) -> dict[str, Slot]:
    """Every graph weight's `Slot`; `permuted`: the file has llama.cpp's q/k row order."""
    out = {}
    for name, shape in schema.weight_shapes(cfg).items():
        parts = name.split(".")
        short, expert = parts[-1], None
        file_shape = schema.hf_shape(cfg, name)  # HF's [out, in], or flat
        if len(parts) == 5:  # layers.<l>.experts.<e>.<w>: one of a stacked [E, out, in]
            tensor, expert = f"blk.{parts[1]}.{_EXPERTS[short]}", int(parts[3])
            file_shape = (cfg.experts,) + file_shape
        elif len(parts) == 3:
            tensor = f"blk.{parts[1]}.{_LAYER[short]}"
        else:
            tensor = _TOP[name]
        heads = {"wq": cfg.heads, "bq": cfg.heads, "wk": cfg.kv_heads,
                 "bk": cfg.kv_heads}.get(short, 0) if permuted else 0
        out[name] = Slot(tensor, file_shape, shape, heads, expert, schema.row_axes(cfg, name))
    return out


class GGUFModel:
    """A GGUF file as a model: `config`, `weights`, `storages()`, `codec()`,
    `end_of_sequence()`. `dtype`: the config's dtype (default f16, whatever the file holds)."""

    def __init__(self, path: str | Path, dtype: DType | str | None = None):
        self.path = Path(path)
        self.metadata, self.tensors, self.data = read_gguf(self.path)
        self.arch = self._need("general.architecture", _MISSING, (str,), "a string")
        self.config = self._config(as_dtype(dtype) if dtype is not None else DType.f16)
        self.slots = slots(self.config, permuted=self.arch == "llama")
        self.weights = GGUFWeights(self)

    def _need(self, key: str, default, kinds: tuple[type, ...], what: str):
        """Metadata `key` of one of `kinds`; `default` where absent (`_MISSING`: an error)."""
        value = self.metadata.get(key)
        if value is None:
            if default is _MISSING:
                raise CheckpointError(f"{self.path}: missing metadata key {key!r}")
            return default
        if not isinstance(value, kinds) or (bool not in kinds and isinstance(value, bool)):
            text = repr(value.tolist() if isinstance(value, np.ndarray) else value)
            raise CheckpointError(f"{self.path}: metadata {key!r} must be {what}, got "
                                  f"{text if len(text) <= 60 else text[:57] + '...'}")
        return value

    def _int(self, key: str, default=_MISSING) -> int | None:
        return self._need(key, default, (int,), "one integer (per-layer values are not "
                          "supported)")

    def _float(self, key: str, default=_MISSING) -> float | None:
        return self._need(key, default, (int, float), "a number")

    def _config(self, dtype: DType) -> ModelConfig:
        arch, p = self.arch, self.arch + "."
        if arch not in ARCHITECTURES:
            raise ModelError(f"{self.path}: architecture {arch!r} is not supported (einpage "
                             f"reads GGUF files of {', '.join(ARCHITECTURES)})")
        hidden, heads = self._int(p + "embedding_length"), self._int(p + "attention.head_count")
        head_dim = self._int(p + "attention.key_length", None)
        head_dim = head_dim if head_dim is not None else hidden // heads if heads else 0
        if self._int(p + "attention.value_length", head_dim) != head_dim:
            raise ModelError(f"{self.path}: keys and values of different lengths are not "
                             "supported")
        rope_dims = self._int(p + "rope.dimension_count", head_dim)
        if rope_dims != head_dim:
            raise ModelError(f"{self.path}: partial rotary ({rope_dims} of {head_dim} dims) is "
                             "not supported")
        experts = self._int(p + "expert_count", 0)
        if experts and arch != "llama":
            raise ModelError(f"{self.path}: a mixture of experts of architecture {arch!r} is "
                             "not supported (einpage runs Mixtral-style llama ones)")
        embed = self.tensor("token_embd.weight")
        vocab = embed.shape[0] if len(embed.shape) == 2 else 0
        if self._int(p + "vocab_size", vocab) != vocab:
            raise CheckpointError(f"{self.path}: tensor 'token_embd.weight' has shape "
                                  f"{embed.shape}, but {p}vocab_size is "
                                  f"{self.metadata[p + 'vocab_size']}")
        theta = self._float(p + "rope.freq_base", 10000.0)
        rope = self._rope(p, theta, head_dim)
        try:
            return ModelConfig(
                name=self.path.stem, vocab=vocab, hidden=hidden,
                intermediate=self._int(p + "feed_forward_length"),
                layers=self._int(p + "block_count"), heads=heads,
                kv_heads=self._int(p + "attention.head_count_kv", heads), head_dim=head_dim,
                rope_theta=theta, rms_eps=self._float(p + "attention.layer_norm_rms_epsilon"),
                tied="output.weight" not in self.tensors, dtype=dtype,
                family="mixtral" if experts else arch, rope_scaling=rope,
                sliding_window=(self._int(p + "attention.sliding_window", None)
                                if arch == "llama" else None),
                qkv_bias="blk.0.attn_q.bias" in self.tensors,
                o_bias="blk.0.attn_output.bias" in self.tensors, qk_norm=arch == "qwen3",
                experts=experts,
                experts_per_token=self._int(p + "expert_used_count") if experts else 0,
                context=self._int(p + "context_length", None))
        except ModelError as exc:  # ModelConfig's own checks, which name the model
            raise ModelError(f"{self.path}: {str(exc).removeprefix(self.path.stem + ': ')}") \
                from None

    def _rope(self, p: str, theta: float, head_dim: int) -> RopeScaling | None:
        kind = self._need(p + "rope.scaling.type", "none", (str,), "a string")
        factors = self.tensors.get("rope_freqs.weight")
        if kind not in ("none", "linear") or (kind == "linear" and factors is not None):
            raise ModelError(f"{self.path}: rope scaling {kind!r} is not supported (einpage runs "
                             "linear, and llama3 from rope_freqs)")
        if kind == "linear":
            factor = self._float(p + "rope.scaling.factor", 1.0)
            return None if factor == 1.0 else RopeScaling("linear", factor)
        if factors is None:
            return None
        if factors.type != "F32" or factors.shape != (head_dim // 2,):
            raise CheckpointError(f"{self.path}: tensor 'rope_freqs.weight' is {factors.type} "
                                  f"{factors.shape}, expected F32 {(head_dim // 2,)}")
        values = self.data[factors.offset:factors.offset + factors.nbytes].view(np.float32)
        original = self._int(p + "rope.scaling.original_context_length", None)
        return llama3_scaling(values, theta, head_dim, original, where=str(self.path))

    def tensor(self, name: str) -> GGUFTensor:
        """GGUF tensor `name` (CheckpointError where the file has none)."""
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: missing tensor {name!r}") from None

    def kind(self, name: str) -> DType | str:
        """Tensor `name`'s dense dtype, or its storage format's name."""
        t = self.tensor(name)
        if t.type in DENSE_TYPES:
            return DENSE_TYPES[t.type]
        if t.type in PACKED_TYPES:
            return PACKED_TYPES[t.type]
        raise CheckpointError(f"{self.path}: tensor {name!r} is {t.type}, which einpage does not "
                              f"read (it reads {', '.join([*DENSE_TYPES, *PACKED_TYPES])})")

    def storages(self) -> dict[str, Storage]:
        """Graph weight name -> `Storage`, for every weight the file keeps quantized."""
        out = {name: self.weights.storage(name) for name in self.slots}
        return {name: storage for name, storage in out.items() if storage is not None}

    def codec(self) -> TextCodec:
        """The tokenizer the file carries (CheckpointError where it has none)."""
        return _codec(self)

    def end_of_sequence(self) -> EndOfSequence:
        """What ends a row: the EOS id, then EOT and EOM where the file names them."""
        ids = [self.token_id(k) for k in ("eos", "eot", "eom")]
        return EndOfSequence(tuple(dict.fromkeys(i for i in ids if i is not None)),
                             self.token_id("padding"), str(self.path))

    def token_id(self, which: str) -> int | None:
        """`tokenizer.ggml.<which>_token_id`, checked against the token list."""
        key = f"tokenizer.ggml.{which}_token_id"
        value, tokens = self._int(key, None), self.metadata.get("tokenizer.ggml.tokens")
        if value is not None and isinstance(tokens, list) and value >= len(tokens):
            raise CheckpointError(f"{self.path}: {key} {value} is not a token id (the file has "
                                  f"{len(tokens)} tokens)")
        return value


class GGUFWeights:
    """The weight source of a `GGUFModel` (`einpage.ir.tensors.WeightSource`): a dense weight is
    an array of its logical graph shape in the file's dtype, a quantized one the `uint8` array
    of `storage(name).packed_shape(shape)`; both views of the file's memory map."""

    def __init__(self, model: GGUFModel):
        self.model, self.config = model, model.config

    def _checked(self, name: str) -> tuple[Slot, GGUFTensor, DType | str]:
        model = self.model
        if name not in model.slots:
            raise CheckpointError(f"{model.path}: {name!r} is not a weight of this model")
        slot = model.slots[name]
        t, kind = model.tensor(slot.tensor), model.kind(slot.tensor)
        if t.shape != slot.file_shape:
            raise CheckpointError(f"{model.path}: tensor {slot.tensor!r} has shape {t.shape}, "
                                  f"but the metadata makes it {slot.file_shape}")
        return slot, t, kind

    def storage(self, name: str) -> Storage | None:
        """How weight `name` is packed (None: dense)."""
        slot, _, kind = self._checked(name)
        if isinstance(kind, DType):
            return None
        st = storage_for(kind, slot.shape, slot.row_axes)
        if st is None:
            raise CheckpointError(f"{self.model.path}: tensor {slot.tensor!r} is {kind}, but its "
                                  f"rows of {slot.file_shape[-1]} values are not whole groups of "
                                  f"{get_format(kind).group}")
        return st

    def __call__(self, name: str) -> np.ndarray:
        slot, t, kind = self._checked(name)
        raw, shape = self.model.data[t.offset:t.offset + t.nbytes], slot.file_shape
        if isinstance(kind, DType):
            array, target = raw.view(kind.numpy).reshape(shape), slot.shape
        else:
            f = get_format(kind)
            array = raw.reshape(shape[:-1] + (shape[-1] // f.group * f.group_bytes,))
            target = self.storage(name).packed_shape(slot.shape)
        if slot.expert is not None:
            array = array[slot.expert]
        if slot.heads:  # llama.cpp's (head, j, half) rows back to HF's (head, half, j)
            array = array.reshape(slot.heads, array.shape[0] // slot.heads // 2, 2,
                                  *array.shape[1:]).swapaxes(1, 2)
        return array.reshape(target)

    def locate(self, name: str):
        """Where a dense, unpermuted weight lies in the file (`FileTensor`) for the disk tier's
        reader; None for the others, which are read through the memory map."""
        from einpage.ir.tensors import FileTensor
        slot, t, kind = self._checked(name)
        if slot.heads:  # rows permuted: read through the memory map
            return None
        if isinstance(kind, DType):
            step = math.prod(slot.file_shape[1:]) * kind.itemsize
            return FileTensor(self.model.path, t.offset + (slot.expert or 0) * step, kind,
                              tuple(slot.shape))
        st = self.storage(name)
        step = math.prod(st.packed_shape(tuple(slot.shape)))
        return FileTensor(self.model.path, t.offset + (slot.expert or 0) * step,
                          self.config.dtype, tuple(slot.shape), st)

    def check(self) -> None:
        """Every weight the graph needs is present, of a type einpage reads and of the right
        shape (reads no tensor data)."""
        for name in self.model.slots:
            self.storage(name)


# ---------------------------------------------------------------------- llama3 rope

def llama3_factors(rope: RopeScaling, theta: float, head_dim: int) -> np.ndarray:
    """The `rope_freqs` llama.cpp's converter writes for `rope` (each frequency's divisor)."""
    wave = 2 * math.pi * theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    low, high, old = rope.low_freq_factor, rope.high_freq_factor, rope.original_context
    smooth = (old / wave - low) / (high - low)
    mid = 1 / ((1 - smooth) / rope.factor + smooth)
    return np.where(wave < old / high, 1.0, np.where(wave > old / low, rope.factor, mid))


def llama3_scaling(factors: np.ndarray, theta: float, head_dim: int,
                   original: int | None = None, where: str = "rope_freqs") -> RopeScaling | None:
    """The llama3 scaling with these factors. They fix only the factor (the largest) and the
    wavelength bounds: two or more interpolated factors give both bounds, one gives them with
    Llama 3's ratio of 4, none any bounds between the kept and the divided ones (`original` or
    8192 where they fit). The context is `original`, else the low bound (low_freq_factor 1).
    ModelError where the result does not reproduce the factors."""
    f = np.asarray(factors, np.float64)
    if not np.all(np.isfinite(f)) or f.min() < 1:
        raise ModelError(f"{where}: rope_freqs must be factors of at least 1")
    if np.all(f == 1):
        return None
    factor = float(f.max())
    wave = 2 * math.pi * theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    one, top = np.isclose(f, 1, rtol=1e-6, atol=0), np.isclose(f, factor, rtol=1e-6, atol=0)
    mid = ~one & ~top
    s = (1 / f[mid] - 1 / factor) / (1 - 1 / factor)  # 1/wave = (1 - s)/low_wave + s/high_wave
    if mid.sum() >= 2:
        (a, b), *_ = np.linalg.lstsq(np.stack([1 - s, s], axis=1), 1 / wave[mid], rcond=None)
        low_wave, high_wave = 1 / a, 1 / b
    else:
        if mid.sum() == 1:
            low_wave = float(wave[mid][0] * (1 + 3 * s[0]))
        else:
            lo = 4 * wave[one].max() if one.any() else 0.0
            hi = wave[top].min() if top.any() else math.inf
            fits = [c for c in (original, 8192, math.floor(lo) + 1) if c and lo < c < hi]
            low_wave = fits[0] if fits else (lo + hi) / 2
        high_wave = low_wave / 4
    context = original or max(1, round(low_wave))
    try:
        rope = RopeScaling("llama3", _snap(factor), _snap(context / low_wave),
                           _snap(context / high_wave), int(context))
    except ModelError as exc:
        raise ModelError(f"{where}: rope_freqs are no llama3 scaling: {exc}") from None
    if not np.allclose(llama3_factors(rope, theta, head_dim), f, rtol=1e-5, atol=0):
        raise ModelError(f"{where}: rope_freqs {np.round(f, 4).tolist()} are not a llama3 "
                         "scaling einpage can express")
    return rope


def _snap(x: float) -> float:
    """`x` rounded to 1/1024 where that moves it by at most 1e-5 of itself."""
    r = round(x * 1024) / 1024
    return r if abs(r - x) <= 1e-5 * abs(x) else float(x)


# ---------------------------------------------------------------------- tokenizer

#: Llama 3's and Qwen2's pre-tokenizer regexes (their tokenizer.json); llama.cpp runs
#: hand-expanded equivalents under these `tokenizer.ggml.pre` names
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
           r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
#: llama.cpp's `default`: these regexes, each splitting the pieces of the one before
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+",
            r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
            r"\p{N}+", r"[0-9][0-9][0-9]")


@dataclass(frozen=True, slots=True)
class PreTokenizer:
    """A `tokenizer.ggml.pre`: its split regexes (None: GPT-2's, ByteLevel's own) and what
    llama.cpp (merges, BOS) and the model's tokenizer config (clean-up, NFC) do with it."""
    regexes: tuple[str, ...] | None
    ignore_merges: bool = False   # a word that is a token is that token (Llama 3)
    add_bos: bool = False         # llama.cpp's default where the file has no add_bos_token
    clean_up: bool = False        # clean_up_tokenization_spaces
    nfc: bool = False


_LLAMA3_PRE = PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True, clean_up=True)
PRE_TOKENIZERS = {"gpt-2": PreTokenizer(None), "default": PreTokenizer(_DEFAULT),
                  "llama-bpe": _LLAMA3_PRE, "llama3": _LLAMA3_PRE, "llama-v3": _LLAMA3_PRE,
                  "qwen2": PreTokenizer((_QWEN2,), nfc=True)}
_NORMAL, _USER, _SPECIAL = 1, 4, (2, 3)  # token types: unknown and control ones are special


def _codec(model: GGUFModel) -> TextCodec:
    from tokenizers import AddedToken
    path, meta = model.path, model.metadata
    kind = model._need("tokenizer.ggml.model", "none", (str,), "a string")
    if kind == "none":
        raise CheckpointError(f"{path}: the file carries no tokenizer (give token ids with "
                              "--tokens or --tokens-file)")
    tokens, types = meta.get("tokenizer.ggml.tokens"), meta.get("tokenizer.ggml.token_type")
    if not isinstance(tokens, list) or not tokens:
        raise CheckpointError(f"{path}: tokenizer.ggml.tokens must be a list of strings")
    types = np.full(len(tokens), _NORMAL) if types is None else np.asarray(types, np.int64)
    if types.shape != (len(tokens),):
        raise CheckpointError(f"{path}: tokenizer.ggml.token_type has {types.size} entries for "
                              f"{len(tokens)} tokens")
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    if kind == "gpt2":
        tokenizer, add_bos, clean_up = _byte_level_bpe(model, vocab)
    elif kind == "llama":
        tokenizer, add_bos, clean_up = _sentencepiece(model, tokens, types, vocab), True, False
    else:
        raise CheckpointError(f"{path}: tokenizer model {kind!r} is not supported (einpage "
                              "reads gpt2 and llama)")
    tokenizer.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                  for i in np.flatnonzero(np.isin(types, _SPECIAL))])
    tokenizer.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                          for i in np.flatnonzero(types == _USER)])
    ids = {k: model.token_id(k) for k in ("bos", "eos", "padding")}
    flag = (bool,), "true or false"
    config = {"add_bos_token": model._need("tokenizer.ggml.add_bos_token", add_bos, *flag),
              "add_eos_token": model._need("tokenizer.ggml.add_eos_token", False, *flag),
              "clean_up_tokenization_spaces": clean_up}
    config.update({key: tokens[ids[which]] for key, which in (
        ("bos_token", "bos"), ("eos_token", "eos"), ("pad_token", "padding"))
        if ids[which] is not None})
    codec = TextCodec(tokenizer, config, f"{path} (tokenizer.ggml.*)", f"{path} (metadata)")
    codec.bos_id, codec.eos_id, codec.pad_id = ids["bos"], ids["eos"], ids["padding"]
    return codec


def _byte_level_bpe(model: GGUFModel, vocab: dict[str, int]):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    name = model._need("tokenizer.ggml.pre", "default", (str,), "a string")
    pre = PRE_TOKENIZERS.get(name)
    if pre is None:
        raise CheckpointError(f"{model.path}: BPE pre-tokenizer {name!r} is not supported "
                              f"(einpage reads {', '.join(PRE_TOKENIZERS)})")
    merges = model.metadata.get("tokenizer.ggml.merges")
    if not isinstance(merges, list) or not all(m.count(" ") == 1 for m in merges):
        raise CheckpointError(f"{model.path}: tokenizer.ggml.merges must list 'left right' "
                              "pairs")
    tokenizer = Tokenizer(models.BPE(vocab, [tuple(m.split(" ")) for m in merges],
                                     ignore_merges=pre.ignore_merges))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre.regexes is None)
    tokenizer.pre_tokenizer = byte_level if pre.regexes is None else pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
        + [byte_level])
    if pre.nfc:
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer, pre.add_bos, pre.clean_up


def _sentencepiece(model: GGUFModel, tokens: list[str], types: np.ndarray,
                   vocab: dict[str, int]):
    """SentencePiece BPE as transformers' LlamaConverter builds it: merges ranked by the merged
    piece's score (SentencePiece merges the best-scored pair first), byte fallback, spaces as
    U+2581 (one prepended where `add_space_prefix`)."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    scores = model.metadata.get("tokenizer.ggml.scores")
    if not isinstance(scores, np.ndarray) or scores.shape != (len(tokens),):
        raise CheckpointError(f"{model.path}: a llama tokenizer needs tokenizer.ggml.scores, "
                              "one per token")
    ranked = []
    for i, piece in enumerate(tokens):
        if types[i] in (_NORMAL, _USER) and vocab[piece] == i:
            ranked += [(-float(scores[i]), i, vocab[piece[:k]], vocab[piece[k:]], k)
                       for k in range(1, len(piece))
                       if piece[:k] in vocab and piece[k:] in vocab]
    ranked.sort()
    merges = [(tokens[i][:k], tokens[i][k:]) for _, i, _, _, k in ranked]
    unk = model.token_id("unknown")
    tokenizer = Tokenizer(models.BPE(vocab, merges, unk_token=None if unk is None
                                     else tokens[unk], fuse_unk=True, byte_fallback=True))
    prefix = model._need("tokenizer.ggml.add_space_prefix", True, (bool,), "true or false")
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend("\u2581")] * prefix + [normalizers.Replace(" ", "\u2581")])
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        + [decoders.Strip(" ", 1, 0)] * prefix)
    return tokenizer
