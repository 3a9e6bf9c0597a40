"""Hugging Face LLaMA checkpoint directories: `config.json` (both dialects) and one or many
`*.safetensors` files (sharded ones listed in `model.safetensors.index.json`).

Tensors are memory-mapped, never read whole: `array(name)` is a view of the file, and a block of
it is read only when sliced. The safetensors header (8-byte little-endian length, then JSON) is
parsed here rather than through `safetensors.safe_open`, on purpose: a plain `np.memmap` view
maps bf16 straight onto `ml_dtypes.bfloat16` without a copy, lets the runtimes slice any block of
a tensor lazily (and hand the view to a reader thread), and gives a `CheckpointError` naming the
file and tensor for every malformed entry. The tests check that the safetensors library reads
every fixture exactly as this module does, and write their checkpoints with it.
"""
from __future__ import annotations

import json
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from einpage.errors import CheckpointError, ModelError, SpecError
from einpage.ir.dtypes import DType
from einpage.models import schema
from einpage.ir.storage import storage_for
from einpage.models.config import FAMILIES, ModelConfig, RopeScaling
from einpage.models.int4 import GROUP, Int4Tensor, scheme_from_config

_ST_DTYPES = {"F16": DType.f16, "BF16": DType.bf16, "F32": DType.f32, "F64": DType.f64,
              "I64": DType.i64, "I32": np.dtype(np.int32)}  # int32: AWQ/GPTQ words


@dataclass(frozen=True, slots=True)
class TensorRef:
    """Where one tensor lies: file, byte offset of its data, dtype, shape."""
    file: Path
    offset: int
    dtype: DType | np.dtype  # np.int32 for the packed words of an AWQ/GPTQ checkpoint
    shape: tuple[int, ...]


_FLOATS = (DType.f16, DType.bf16, DType.f32, DType.f64)  # what a dense weight may be


def read_safetensors_header(path: Path) -> dict[str, TensorRef]:
    try:
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) != 8:
                raise CheckpointError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (length,) = struct.unpack("<Q", head)
            size = path.stat().st_size
            if length > size - 8:
                raise CheckpointError(f"{path}: header length {length} exceeds the file")
            header = json.loads(fh.read(length))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot read safetensors header: {exc}") from None
    base = 8 + length
    refs = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _ST_DTYPES[info["dtype"]]
            shape = tuple(int(s) for s in info["shape"])
            begin, end = (int(v) for v in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor {name!r}: unsupported or malformed entry "
                                  f"{info!r}") from None
        count = int(np.prod(shape, dtype=np.int64))
        if end - begin != count * dtype.itemsize or base + end > size:
            raise CheckpointError(f"{path}: tensor {name!r}: data range {begin}..{end} does not "
                                  f"match shape {shape} {dtype} or the file size")
        refs[name] = TensorRef(path, base + begin, dtype, shape)
    return refs


def tensor_view(ref: TensorRef, mapped: np.ndarray) -> np.ndarray:
    """The tensor `ref` as a view of its file's bytes `mapped` (a uint8 memory map)."""
    count = int(np.prod(ref.shape, dtype=np.int64))
    raw = mapped[ref.offset: ref.offset + count * ref.dtype.itemsize]
    return raw.view(getattr(ref.dtype, "numpy", ref.dtype)).reshape(ref.shape)


def load_config(directory: Path) -> ModelConfig:
    path = directory / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{directory}: no config.json") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot parse: {exc}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return config_from_json(raw, directory.name, str(path))


def config_from_json(raw: dict, name: str, where: str) -> ModelConfig:
    """A `ModelConfig` from a Hugging Face `config.json` (both dialects: `rope_scaling` and
    `rope_theta` at the top, or `rope_parameters`); an option einpage does not run is a
    `ModelError` naming it, never ignored."""
    family = raw.get("model_type")
    if family not in FAMILIES:
        raise ModelError(f"{where}: model_type {family!r} is not supported (einpage runs "
                         f"{', '.join(FAMILIES)})")

    def unsupported(what: str) -> ModelError:
        return ModelError(f"{what} is not supported")

    try:
        if raw.get("hidden_act", "silu") != "silu":
            raise unsupported(f"hidden_act {raw['hidden_act']!r}")
        if raw.get("mlp_bias"):
            raise unsupported("mlp_bias")
        heads = _int(raw, "num_attention_heads")
        hidden = _int(raw, "hidden_size")
        layers = _int(raw, "num_hidden_layers")
        kv_heads = _int(raw, "num_key_value_heads", heads)
        head_dim = _int(raw, "head_dim", None)  # 0 is refused by ModelConfig, not defaulted
        head_dim = hidden // heads if head_dim is None else head_dim
        biased = _flag(raw, "attention_bias")
        experts = _int(raw, "num_local_experts", 0) if family == "mixtral" else 0
        window, window_layers = _window(raw, family, layers, unsupported)
        return ModelConfig(
            name=name, vocab=_int(raw, "vocab_size"), hidden=hidden,
            intermediate=_int(raw, "intermediate_size"), layers=layers, heads=heads,
            kv_heads=kv_heads, head_dim=head_dim, rope_theta=_rope_theta(raw),
            rms_eps=_float(raw, "rms_norm_eps", 1e-6), tied=_flag(raw, "tie_word_embeddings"),
            dtype=_dtype(raw), family=family, rope_scaling=_rope_scaling(raw, unsupported),
            sliding_window=window, window_layers=window_layers,
            qkv_bias=family == "qwen2" or biased, o_bias=biased and family != "qwen2",
            qk_norm=family == "qwen3", experts=experts,
            experts_per_token=_int(raw, "num_experts_per_tok", 0) if experts else 0,
            context=_int(raw, "max_position_embeddings", None))
    except KeyError as exc:
        raise CheckpointError(f"{where}: missing key {exc.args[0]!r}") from None
    except (TypeError, ValueError, SpecError) as exc:  # SpecError: an unknown torch_dtype
        raise CheckpointError(f"{where}: bad value: {exc}") from None
    except ModelError as exc:
        raise ModelError(f"{where}: {exc}") from None


_MISSING = object()


def _int(raw: dict, key: str, default=_MISSING) -> int | None:
    value = raw.get(key)
    if value is None:
        if default is _MISSING:
            raise KeyError(key)
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{key} must be a non-negative integer, got {value!r}")
    return value


def _float(raw: dict, key: str, default: float) -> float:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{key} must be a positive number, got {value!r}")
    return float(value)


def _flag(raw: dict, key: str) -> bool:
    value = raw.get(key, False)
    if not isinstance(value, bool):
        raise ValueError(f"{key} must be true or false, got {value!r}")
    return value


def _dtype(raw: dict) -> DType:
    from einpage.ir.dtypes import as_dtype
    return as_dtype(raw.get("torch_dtype") or raw.get("dtype") or "float32")


def _rope(raw: dict) -> dict:
    """The rope settings, from `rope_parameters` (newer) or `rope_scaling` (older)."""
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ValueError(f"rope settings must be an object, got {rope!r}")
    return rope


def _rope_theta(raw: dict) -> float:
    rope = _rope(raw)
    if raw.get("rope_theta") is not None:
        return _float(raw, "rope_theta", 10000.0)
    return _float(rope, "rope_theta", 10000.0)


def _rope_scaling(raw: dict, unsupported) -> RopeScaling | None:
    rope = _rope(raw)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in (None, "default"):
        return None
    if kind == "linear":
        return RopeScaling("linear", _float(rope, "factor", 1.0))
    if kind == "llama3":
        return RopeScaling("llama3", _float(rope, "factor", 1.0),
                           _float(rope, "low_freq_factor", 1.0),
                           _float(rope, "high_freq_factor", 4.0),
                           _int(rope, "original_max_position_embeddings"))
    raise unsupported(f"rope_type {kind!r} (einpage runs default, linear, llama3)")


def _window(raw: dict, family: str, layers: int, unsupported):
    """`(sliding_window, window_layers)`: Mistral and Mixtral window every layer when
    `sliding_window` is set; Qwen2/Qwen3 only with `use_sliding_window`, on the layers
    `layer_types` marks (or from `max_window_layers` on)."""
    if family == "llama":
        return None, None
    window = _int(raw, "sliding_window", None)
    if family in ("mistral", "mixtral"):
        return window, None
    if not _flag(raw, "use_sliding_window") or window is None:
        return None, None
    types = raw.get("layer_types")
    if types is None:
        first = _int(raw, "max_window_layers", 0)
        return window, tuple(range(first, layers))
    if not isinstance(types, list) or len(types) != layers:
        raise ValueError(f"layer_types must list {layers} layers, got {types!r}")
    for kind in types:
        if kind not in ("full_attention", "sliding_attention"):
            raise unsupported(f"layer type {kind!r}")
    return window, tuple(k for k, kind in enumerate(types) if kind == "sliding_attention")


class Checkpoint:
    """A checkpoint directory: its config and a lazy view of every tensor."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise CheckpointError(f"{self.directory}: no such checkpoint directory")
        self.config = load_config(self.directory)
        self.int4 = scheme_from_config(json.loads((self.directory / "config.json").read_text()),
                                       str(self.directory / "config.json"))
        self.tensors = self._index()
        self._maps: dict[Path, np.memmap] = {}

    def _index(self) -> dict[str, TensorRef]:
        index = self.directory / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{index}: malformed index: {exc}") from None
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.directory.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{self.directory}: no *.safetensors files")
        refs: dict[str, TensorRef] = {}
        for name in files:
            path = self.directory / name
            if not path.exists():
                raise CheckpointError(f"{path}: listed in the index but missing")
            refs.update(read_safetensors_header(path))
        return refs

    def array(self, name: str) -> np.ndarray:
        """A read-only memory-mapped view of tensor `name`."""
        try:
            ref = self.tensors[name]
        except KeyError:
            raise CheckpointError(f"{self.directory}: missing tensor {name!r}") from None
        if ref.file not in self._maps:
            self._maps[ref.file] = np.memmap(ref.file, dtype=np.uint8, mode="r")
        return tensor_view(ref, self._maps[ref.file])


class CheckpointWeights:
    """Weight source for the model graphs (`einpage.runtime.WeightSource`): graph weight name ->
    a memory-mapped checkpoint view of its logical shape."""

    def __init__(self, checkpoint: Checkpoint):
        self.checkpoint = checkpoint
        self.config = checkpoint.config

    def __call__(self, name: str) -> np.ndarray:
        hf = schema.hf_tensor(name)
        packed = self._int4(name)
        if packed is not None:
            return packed
        view = self.checkpoint.array(hf)
        if self.checkpoint.tensors[hf].dtype not in _FLOATS:
            raise CheckpointError(f"{self.checkpoint.directory}: tensor {hf!r} is {view.dtype}; a "
                                  "weight is f16, bf16, f32 or f64 (int32 only in an AWQ/GPTQ "
                                  "projection's qweight, qzeros)")
        want = schema.hf_shape(self.config, name)
        if tuple(view.shape) != want:
            raise CheckpointError(f"{self.checkpoint.directory}: tensor {hf!r} has shape "
                                  f"{tuple(view.shape)}, expected {want}")
        return view.reshape(schema.weight_shapes(self.config)[name])

    def _int4(self, name: str):
        """An AWQ/GPTQ projection as q4_g128 bytes (`einpage.models.int4`), or None."""
        hf = schema.hf_tensor(name)
        ck = self.checkpoint
        if ck.int4 is None or hf in ck.tensors or not hf.endswith(".weight"):
            return None
        stem = hf[:-len("weight")]
        if stem + "qweight" not in ck.tensors:
            return None
        st = self.storage(name)
        shape = schema.weight_shapes(self.config)[name]
        if st is None:
            raise CheckpointError(f"{ck.directory}: {stem}qweight: rows of "
                                  f"{schema.hf_shape(self.config, name)[-1]} inputs are not "
                                  f"groups of {GROUP}")
        parts = [ck.array(stem + part) for part in ("qweight", "qzeros", "scales")]
        return Int4Tensor(ck.int4, *parts, shape, schema.row_axes(self.config, name), st,
                          f"{ck.directory}: {stem}*")

    def storage(self, name: str):
        """The storage the checkpoint holds weight `name` in: q4_g128 for an AWQ/GPTQ
        projection, None (unpacked) for the others."""
        ck, hf = self.checkpoint, schema.hf_tensor(name)
        if ck.int4 is None or hf in ck.tensors or hf[:-len("weight")] + "qweight" not in ck.tensors:
            return None
        return storage_for("q4_g128", schema.weight_shapes(self.config)[name],
                           schema.row_axes(self.config, name))

    def storages(self) -> dict:
        """Every weight the checkpoint holds packed, with its storage."""
        out = {}
        for name in schema.weight_shapes(self.config):
            st = self.storage(name)
            if st is not None:
                out[name] = st
        return out

    def locate(self, name: str):
        """Where weight `name` lies in the files (`runtime.diskread.FileTensor`): the disk tier
        reads its blocks with `preadv` instead of through the memory map (None for an AWQ/GPTQ
        projection, repacked as it is read)."""
        from einpage.ir.tensors import FileTensor
        self(name)  # checks the shape
        if self.storage(name) is not None:
            return None
        ref = self.checkpoint.tensors[schema.hf_tensor(name)]
        return FileTensor(ref.file, ref.offset, ref.dtype,
                          tuple(schema.weight_shapes(self.config)[name]))

    def check(self) -> None:
        """Every weight the model needs is present with the right shape (reads no data)."""
        for name in schema.weight_shapes(self.config):
            self(name)


class RandomWeights:
    """Deterministic random weights for a preset: a `einpage.runtime.WeightSource` whose
    `weights(name)` is a `RandomArray`, made block by block as the runtime reads it (never the
    whole tensor, so a 7B model runs on random weights in little memory). Each element depends
    only on (seed, name, its index): every block, budget and backend sees the same weights.
    Norm gains are about 1 (spread 0.1), biases small (0.02), matrices of spread
    1/sqrt(fan-in) (the embedding 1), each uniform with that standard deviation."""

    def __init__(self, config: ModelConfig, seed: int = 0):
        self.config, self.seed = config, seed
        self.shapes = schema.weight_shapes(config)

    def __call__(self, name: str) -> "RandomArray":
        import zlib
        shape = self.shapes[name]
        key = _mix64((int(self.seed) & _MASK64) * _GAMMA + zlib.crc32(name.encode()))
        short = name.rsplit(".", 1)[-1]
        if short.endswith("norm"):
            return RandomArray(shape, key, 1.0, 0.1)
        if short in ("bq", "bk", "bv", "bo"):
            return RandomArray(shape, key, 0.0, 0.02)
        fan_in = shape[-1] if short != "wo" else int(np.prod(shape[1:]))
        return RandomArray(shape, key, 0.0, 1.0 if name == "embed" else fan_in ** -0.5)


_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment (2^64 / golden ratio)


def _mix64(z: int) -> int:
    """SplitMix64's finalizer on a Python int (the per-tensor key)."""
    z &= _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


class RandomArray:
    """A lazy float32 array: element `i` (flat, C order) is `loc + scale * u`, with `u` uniform
    of unit variance on [-sqrt(3), sqrt(3)) from SplitMix64 of `(key, i)`, a counter-based
    generator: any box is made directly from its indices, in memory of the box's size. Slicing
    (`a[box]`, ints and slices as NumPy's basic indexing) returns an ndarray; `np.asarray(a)` the
    whole."""

    dtype = np.dtype(np.float32)
    _CHUNK = 1 << 16  # elements hashed at a time: the temporaries stay in cache
    _PARALLEL_CHUNKS = 16  # a box of this many chunks or more is hashed on every core

    def __init__(self, shape: tuple[int, ...], key: int, loc: float, scale: float):
        self.shape, self.key = tuple(int(s) for s in shape), key
        self.loc, self.scale = loc, scale
        self.ndim = len(self.shape)
        self.size = int(np.prod(self.shape, dtype=np.int64))

    def __len__(self) -> int:
        return self.shape[0]

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        whole = self[...]
        return whole if dtype is None else whole.astype(dtype)

    def __getitem__(self, index) -> np.ndarray:
        axes = _basic_index(index, self.ndim)
        strides = np.cumprod((self.shape[1:] + (1,))[::-1])[::-1]
        picked = [np.arange(n, dtype=np.int64)[sub] for n, sub in zip(self.shape, axes)]
        kept = [p for p in picked if p.ndim == 1]
        base = sum(int(p) * int(st) for p, st in zip(picked, strides) if p.ndim == 0)
        out = np.empty(tuple(len(p) for p in kept), np.float32)
        if out.size == 0:
            return out
        steps = [p * int(st) for p, st in zip(picked, strides) if p.ndim == 1]
        rows = out.reshape(len(kept[0]) if kept else 1, -1)
        per_row = max(1, self._CHUNK // max(rows.shape[1], 1))
        inner = np.zeros(1, np.int64)
        if len(steps) > 1:  # the offsets of one row's elements, in C order
            inner = sum(np.ix_(*steps[1:]), np.zeros((), np.int64)).ravel()
        lead = steps[0] if steps else np.zeros(1, np.int64)

        def fill(start: int) -> None:
            flat = (base + lead[start:start + per_row, None] + inner[None, :]).astype(np.uint64)
            rows[start:start + per_row] = self._values(flat)

        starts = range(0, rows.shape[0], per_row)
        if len(starts) < self._PARALLEL_CHUNKS:
            for start in starts:
                fill(start)
        else:  # NumPy's ufuncs release the GIL: chunks in parallel on every core
            list(_pool().map(fill, starts))
        return out

    def _values(self, flat: np.ndarray) -> np.ndarray:
        """SplitMix64 of `flat` (consumed) in place, then `loc + scale * u` (u of unit variance):
        `2u - 1` is exact in float32, the affine map in float64, rounded once to float32."""
        z = flat
        z *= np.uint64(_GAMMA)
        z += np.uint64(self.key)
        t = z >> np.uint64(30)
        z ^= t
        z *= np.uint64(0xBF58476D1CE4E5B9)
        np.right_shift(z, np.uint64(27), out=t)
        z ^= t
        z *= np.uint64(0x94D049BB133111EB)
        np.right_shift(z, np.uint64(31), out=t)
        z ^= t
        z >>= np.uint64(40)
        u = z.astype(np.float32)  # 24 bits: [0, 2^24), exact
        u *= np.float32(2.0 ** -23)
        u -= np.float32(1.0)  # 2u - 1 with u in [0, 1), exact
        w = t.view(np.float64)  # the shift buffer, reused
        np.multiply(u, self.scale * np.sqrt(3.0), out=w)
        w += self.loc
        return w.astype(np.float32)


_POOL = None
_POOL_LOCK = threading.Lock()


def _pool():
    """The process's pool for hashing large boxes (one thread per core, made on first use)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            from concurrent.futures import ThreadPoolExecutor
            _POOL = ThreadPoolExecutor(max_workers=os.cpu_count() or 1,
                                       thread_name_prefix="einpage-random-weights")
        return _POOL


def _basic_index(index, ndim: int) -> list:
    """`index` (an int, a slice, Ellipsis or a tuple of them) as one int or slice per axis."""
    parts = list(index) if isinstance(index, tuple) else [index]
    if any(p is None or isinstance(p, (list, np.ndarray)) for p in parts):
        raise TypeError("RandomArray takes basic indexing only (ints, slices, ...)")
    if Ellipsis in parts:
        at = parts.index(Ellipsis)
        parts[at:at + 1] = [slice(None)] * (ndim - len(parts) + 1)
    if len(parts) > ndim:
        raise IndexError(f"too many indices for a {ndim}-d array")
    return parts + [slice(None)] * (ndim - len(parts))
