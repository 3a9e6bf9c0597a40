"""Models written in the einsum DSL, and how to load them."""
from __future__ import annotations

from pathlib import Path

from einpage.ir.dtypes import DType
from einpage.models.config import PRESETS, LlamaConfig, preset


def resolve(model: str, *, random_weights: bool = False, seed: int = 0, dtype: DType | None = None,
            quantize: str | None = None, kv_dtype: str | None = None):
    """`(config, weight source)` for a preset name (with `random_weights`) or a checkpoint
    directory. `weights` is None for a preset without `random_weights` (compile needs none).
    The computation dtype defaults to the checkpoint's, except that bf16 is computed in float32:
    NumPy has no bf16 arithmetic. `quantize` (a storage format, `einpage.ir.storage.WRITABLE`)
    keeps every matrix weight in that block format, quantized block by block as plans read it;
    `kv_dtype` (`q8_0`) keeps the KV store so."""
    cfg, weights = _resolve(model, random_weights, seed, dtype, quantize)
    if kv_dtype is not None:
        from dataclasses import replace

        from einpage.models.schema import kv_storage
        cfg = replace(cfg, kv_format=kv_dtype)
        kv_storage(cfg)  # ModelError where a head's row is not whole groups
        if getattr(weights, "config", None) is not None:
            weights.config = cfg
    return cfg, weights


def _resolve(model: str, random_weights: bool, seed: int, dtype: DType | None,
             quantize: str | None):
    from einpage.errors import ModelError
    from einpage.models.checkpoint import Checkpoint, CheckpointWeights, RandomWeights

    path = Path(model)
    if path.is_file():  # a GGUF file (its weights may come quantized)
        if random_weights:
            raise ModelError("--random-weights takes a preset name, not a GGUF file")
        return _gguf(path, dtype, quantize)
    if model in PRESETS and not path.is_dir():
        cfg = preset(model)
        weights = RandomWeights(cfg, seed) if random_weights else None
    elif path.is_dir():
        if random_weights:
            raise ModelError("--random-weights takes a preset name, not a checkpoint directory")
        ckpt = Checkpoint(path)
        weights = CheckpointWeights(ckpt)
        weights.check()
        cfg = ckpt.config
        if ckpt.int4 is not None:  # AWQ/GPTQ: its projections are q4_g128 as they lie
            from dataclasses import replace
            from einpage.errors import InputError
            if quantize is not None:
                raise InputError(f"--quantize quantizes an f16/bf16/f32 checkpoint; {path} is "
                                 f"{ckpt.int4.method.upper()}-quantized already")
            cfg = replace(cfg, formats=tuple(sorted((n, s.format)
                                                    for n, s in weights.storages().items())))
            weights.config = cfg
    elif path.suffix or "/" in model:
        from einpage.errors import CheckpointError
        raise CheckpointError(f"{model}: no such checkpoint directory")
    else:
        cfg = preset(model)  # raises with the list of presets
        weights = None
    if dtype is not None:
        cfg = cfg.with_dtype(dtype)
    elif cfg.dtype is DType.bf16:
        cfg = cfg.with_dtype(DType.f32)
    if quantize is not None:
        from einpage.errors import InputError
        from einpage.ir.storage import WRITABLE
        from einpage.models.schema import quantized
        if quantize not in WRITABLE:
            raise InputError(f"--quantize {quantize!r}: einpage quantizes to "
                             f"{', '.join(WRITABLE)}")
        cfg = quantized(cfg, quantize)
    return cfg, weights


def _gguf(path: Path, dtype: DType | None, quantize: str | None):
    """`(config, weights)` of a GGUF file: the config records the storage of every weight the
    file keeps quantized, so plans move its packed bytes as they lie."""
    from dataclasses import replace

    from einpage.errors import CheckpointError, InputError
    from einpage.models.gguf import GGUFModel, is_gguf
    if not is_gguf(path):
        raise CheckpointError(f"{path}: not a checkpoint directory or a GGUF file")
    if quantize is not None:
        raise InputError(f"--quantize quantizes an f16/bf16/f32 checkpoint; {path.name} is a "
                         "GGUF file, whose weights are stored as they are")
    model = GGUFModel(path, dtype=dtype)
    model.weights.check()
    cfg = replace(model.config, formats=tuple(sorted((name, st.format) for name, st
                                                     in model.storages().items())))
    model.weights.config = cfg
    return cfg, model.weights


__all__ = ["LlamaConfig", "PRESETS", "preset", "resolve"]
