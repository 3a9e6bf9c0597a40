"""LLaMA configurations: the published shapes of each preset, plus small ones for tests."""
from __future__ import annotations

from dataclasses import dataclass, replace

from einpage.errors import ModelError
from einpage.ir.dtypes import DType


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    name: str
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    tied: bool = False
    dtype: DType = DType.f16

    def __post_init__(self):
        if self.heads % self.kv_heads:
            raise ModelError(f"{self.name}: {self.heads} heads is not a multiple of "
                             f"{self.kv_heads} kv heads")
        if self.head_dim % 2:
            raise ModelError(f"{self.name}: head_dim {self.head_dim} must be even for rotary")

    @property
    def group(self) -> int:
        """Query heads per kv head."""
        return self.heads // self.kv_heads

    @property
    def parameters(self) -> int:
        m, f, d = self.hidden, self.intermediate, self.head_dim
        attn = m * d * (2 * self.heads + 2 * self.kv_heads)
        layer = attn + 3 * m * f + 2 * m
        heads = self.vocab * m * (1 if self.tied else 2)
        return self.layers * layer + heads + m

    def weight_bytes(self, dtype: DType | None = None) -> int:
        return self.parameters * (dtype or self.dtype).itemsize

    def with_dtype(self, dtype: DType) -> "LlamaConfig":
        return replace(self, dtype=dtype)


def _preset(name, vocab, hidden, inter, layers, heads, kv=None, theta=1e4, eps=1e-6, tied=False):
    return LlamaConfig(name, vocab, hidden, inter, layers, heads, kv or heads, hidden // heads,
                       theta, eps, tied, DType.f16)


PRESETS: dict[str, LlamaConfig] = {c.name: c for c in (
    _preset("llama-7b", 32000, 4096, 11008, 32, 32),
    _preset("llama-13b", 32000, 5120, 13824, 40, 40),
    _preset("llama-30b", 32000, 6656, 17920, 60, 52),
    _preset("llama-65b", 32000, 8192, 22016, 80, 64),
    _preset("llama2-7b", 32000, 4096, 11008, 32, 32, eps=1e-5),
    _preset("llama2-13b", 32000, 5120, 13824, 40, 40, eps=1e-5),
    _preset("llama2-70b", 32000, 8192, 28672, 80, 64, 8, eps=1e-5),
    _preset("llama3-8b", 128256, 4096, 14336, 32, 32, 8, theta=5e5, eps=1e-5),
    _preset("llama3-70b", 128256, 8192, 28672, 80, 64, 8, theta=5e5, eps=1e-5),
    # small presets for tests and quick runs
    LlamaConfig("tiny", 64, 32, 48, 2, 4, 2, 8, dtype=DType.f32),
    LlamaConfig("tiny-tied", 64, 32, 48, 2, 4, 1, 8, tied=True, dtype=DType.f32),
    LlamaConfig("small", 256, 128, 352, 4, 8, 2, 16, dtype=DType.f32),
)}


def preset(name: str) -> LlamaConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ModelError(f"unknown model {name!r}; presets: {', '.join(PRESETS)} "
                         "(or give a checkpoint directory)") from None
