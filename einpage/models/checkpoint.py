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
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from einpage.errors import CheckpointError, ModelError, SpecError
from einpage.ir.dtypes import DType
from einpage.models import llama
from einpage.models.config import LlamaConfig

_ST_DTYPES = {"F16": DType.f16, "BF16": DType.bf16, "F32": DType.f32, "F64": DType.f64,
              "I64": DType.i64}


@dataclass(frozen=True, slots=True)
class TensorRef:
    """Where one tensor lies: file, byte offset of its data, dtype, shape."""
    file: Path
    offset: int
    dtype: DType
    shape: tuple[int, ...]


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
    return raw.view(ref.dtype.numpy).reshape(ref.shape)


def load_config(directory: Path) -> LlamaConfig:
    path = directory / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{directory}: no config.json") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot parse: {exc}") from None
    if raw.get("model_type") != "llama":
        raise ModelError(f"{path}: model_type {raw.get('model_type')!r} is not supported "
                         "(einpage runs 'llama')")
    rope = raw.get("rope_parameters") or {}
    theta = raw.get("rope_theta", rope.get("rope_theta", 10000.0))
    if rope.get("rope_type", "default") != "default" or raw.get("rope_scaling"):
        raise ModelError(f"{path}: rope scaling {rope.get('rope_type') or raw.get('rope_scaling')!r}"
                         " is not supported")
    try:
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        dtype_name = raw.get("torch_dtype") or raw.get("dtype") or "float32"
        from einpage.ir.dtypes import as_dtype
        return LlamaConfig(
            name=directory.name, vocab=int(raw["vocab_size"]), hidden=hidden,
            intermediate=int(raw["intermediate_size"]), layers=int(raw["num_hidden_layers"]),
            heads=heads, kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads), rope_theta=float(theta),
            rms_eps=float(raw.get("rms_norm_eps", 1e-6)),
            tied=bool(raw.get("tie_word_embeddings", False)), dtype=as_dtype(dtype_name))
    except KeyError as exc:
        raise CheckpointError(f"{path}: missing key {exc.args[0]!r}") from None
    except (TypeError, ValueError, SpecError) as exc:  # SpecError: an unknown torch_dtype
        raise CheckpointError(f"{path}: bad value: {exc}") from None


class Checkpoint:
    """A checkpoint directory: its config and a lazy view of every tensor."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise CheckpointError(f"{self.directory}: no such checkpoint directory")
        self.config = load_config(self.directory)
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
    """Weight source for LLaMA graphs (`einpage.runtime.WeightSource`): graph weight name ->
    a memory-mapped checkpoint view of its logical shape."""

    def __init__(self, checkpoint: Checkpoint):
        self.checkpoint = checkpoint
        self.config = checkpoint.config

    def __call__(self, name: str) -> np.ndarray:
        hf = llama.hf_tensor(name)
        view = self.checkpoint.array(hf)
        want = llama.hf_shape(self.config, name)
        if tuple(view.shape) != want:
            raise CheckpointError(f"{self.checkpoint.directory}: tensor {hf!r} has shape "
                                  f"{tuple(view.shape)}, expected {want}")
        return view.reshape(llama.weight_shapes(self.config)[name])

    def check(self) -> None:
        """Every weight the model needs is present with the right shape (reads no data)."""
        for name in llama.weight_shapes(self.config):
            self(name)


class RandomWeights:
    """Deterministic random weights for a preset, made on the fly per tensor (seed, name): a
    `einpage.runtime.WeightSource`."""

    def __init__(self, config: LlamaConfig, seed: int = 0):
        self.config, self.seed = config, seed
        self.shapes = llama.weight_shapes(config)

    def __call__(self, name: str) -> np.ndarray:
        import zlib
        shape = self.shapes[name]
        rng = np.random.default_rng([self.seed, zlib.crc32(name.encode())])
        if len(shape) == 1:  # norm weights
            return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        fan_in = shape[-1] if not name.endswith("wo") else int(np.prod(shape[1:]))
        std = 1.0 if name == "embed" else fan_in ** -0.5
        return (std * rng.standard_normal(shape)).astype(np.float32)
