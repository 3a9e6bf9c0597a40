"""Model configurations: one record for every family einpage runs (LLaMA 1/2/3.x, Mistral,
Qwen2/2.5, Qwen3, Mixtral), the published shapes of each preset, and small ones for tests.

A family is a few fields of difference from LLaMA, not a separate class: rope scaling, a
sliding window, biases on the attention projections, RMSNorm on each head's queries and keys, a
mixture of experts in place of the feed-forward block.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from einpage.errors import ModelError
from einpage.ir.dtypes import DType

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "mixtral")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Hugging Face's rotary frequency scaling: `linear` divides every inverse frequency by
    `factor`; `llama3` divides the low frequencies (wavelength above `original_context /
    low_freq_factor`) by `factor`, keeps the high ones (wavelength below `original_context /
    high_freq_factor`) and interpolates between."""
    kind: str                     # "linear" | "llama3"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context: int = 8192

    def __post_init__(self):
        if self.kind not in ("linear", "llama3"):
            raise ModelError(f"rope scaling {self.kind!r} is not supported (linear, llama3)")
        if not self.factor > 0:
            raise ModelError(f"rope scaling factor must be positive, got {self.factor}")
        if self.kind == "llama3" and not (0 < self.low_freq_factor < self.high_freq_factor
                                          and self.original_context > 0):
            raise ModelError("llama3 rope scaling needs 0 < low_freq_factor < high_freq_factor "
                             f"and a positive original context, got {self.low_freq_factor}, "
                             f"{self.high_freq_factor}, {self.original_context}")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    name: str
    vocab: int
    hidden: int
    intermediate: int             # per expert for a mixture of experts
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    tied: bool = False
    dtype: DType = DType.f16
    family: str = "llama"
    rope_scaling: RopeScaling | None = None
    sliding_window: int | None = None          # keys within this many positions (incl. own)
    window_layers: tuple[int, ...] | None = None  # layers with the window (None: all)
    qkv_bias: bool = False                     # Qwen2; `attention_bias` of Llama / Qwen3
    o_bias: bool = False                       # `attention_bias` of Llama / Qwen3
    qk_norm: bool = False                      # Qwen3: RMSNorm on each head's q and k
    experts: int = 0                           # Mixtral: experts per layer (0: dense FFN)
    experts_per_token: int = 0                 # top-k
    context: int | None = None                 # max_position_embeddings
    #: weights kept quantized: (graph weight name, storage format) pairs, sorted by name
    #: (`einpage.models.schema.quantized`); the others are stored in `dtype`
    formats: tuple[tuple[str, str], ...] = ()
    #: the KV store kept in a block format (`--kv-dtype q8_0`: one f16 scale per 32 values of a
    #: head's row), None: in `dtype`
    kv_format: str | None = None

    def __post_init__(self):
        for field in ("vocab", "hidden", "intermediate", "layers", "heads", "kv_heads",
                      "head_dim"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ModelError(f"{self.name}: {field} must be a positive integer, got "
                                 f"{value!r}")
        if self.family not in FAMILIES:
            raise ModelError(f"{self.name}: unknown family {self.family!r} "
                             f"({', '.join(FAMILIES)})")
        if self.heads % self.kv_heads:
            raise ModelError(f"{self.name}: {self.heads} heads is not a multiple of "
                             f"{self.kv_heads} kv heads")
        if self.head_dim % 2:
            raise ModelError(f"{self.name}: head_dim {self.head_dim} must be even for rotary")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ModelError(f"{self.name}: sliding_window must be at least 1, got "
                             f"{self.sliding_window}")
        if self.window_layers is not None and any(not 0 <= k < self.layers
                                                  for k in self.window_layers):
            raise ModelError(f"{self.name}: window layers {self.window_layers} outside "
                             f"0..{self.layers - 1}")
        if self.experts and not 1 <= self.experts_per_token <= self.experts:
            raise ModelError(f"{self.name}: {self.experts_per_token} experts per token of "
                             f"{self.experts}")
        if not self.experts and self.experts_per_token:
            raise ModelError(f"{self.name}: experts_per_token without experts")
        if not self.rms_eps > 0 or not self.rope_theta > 0:
            raise ModelError(f"{self.name}: rms_eps and rope_theta must be positive")

    @property
    def group(self) -> int:
        """Query heads per kv head."""
        return self.heads // self.kv_heads

    def window(self, layer: int) -> int | None:
        """The sliding window of `layer`'s attention, or None (full causal attention)."""
        if self.sliding_window is None:
            return None
        if self.window_layers is not None and layer not in self.window_layers:
            return None
        return self.sliding_window

    @property
    def kv_ring(self) -> int | None:
        """Slots of a KV store kept as a ring, where every layer has a sliding window W: a
        decode step sees its own key and the W - 1 before it, so the store holds the last W - 1
        rows (position q in slot q mod (W - 1)) and never grows past them. None: the store
        keeps every row."""
        if self.sliding_window is None or self.sliding_window < 2:
            return None
        if self.window_layers is not None and len(set(self.window_layers)) < self.layers:
            return None
        return self.sliding_window - 1

    @property
    def parameters(self) -> int:
        m, f, d = self.hidden, self.intermediate, self.head_dim
        q, kv = self.heads * d, self.kv_heads * d
        attn = m * (2 * q + 2 * kv)
        attn += (q + 2 * kv) * self.qkv_bias + m * self.o_bias + 2 * d * self.qk_norm
        ffn = 3 * m * f * max(1, self.experts) + self.experts * m
        heads = self.vocab * m * (1 if self.tied else 2)
        return self.layers * (attn + ffn + 2 * m) + heads + m

    @property
    def active_parameters(self) -> int:
        """Parameters a token uses (a mixture of experts runs only its top-k experts)."""
        if not self.experts:
            return self.parameters
        unused = self.experts - self.experts_per_token
        return self.parameters - self.layers * unused * 3 * self.hidden * self.intermediate

    def weight_bytes(self, dtype: DType | None = None) -> int:
        """Bytes of all weights in `dtype` (default: the config's), the quantized ones packed."""
        from einpage.models.schema import weight_bytes_by_format
        per = weight_bytes_by_format(self, dtype or self.dtype)
        return sum(per.values())

    def with_dtype(self, dtype: DType) -> "ModelConfig":
        return replace(self, dtype=dtype)


#: the record was LLaMA's first; the name stays for the API
LlamaConfig = ModelConfig


def _preset(name, vocab, hidden, inter, layers, heads, kv=None, theta=1e4, eps=1e-6, tied=False,
            head_dim=None, **family):
    return ModelConfig(name, vocab, hidden, inter, layers, heads, kv or heads,
                       head_dim or hidden // heads, theta, eps, tied, DType.f16, **family)


def _llama31(name, hidden, inter, layers, heads, tied=False, head_dim=None, factor=8.0):
    return _preset(name, 128256, hidden, inter, layers, heads, 8, theta=5e5, eps=1e-5,
                   tied=tied, head_dim=head_dim, context=131072,
                   rope_scaling=RopeScaling("llama3", factor, 1.0, 4.0, 8192))


PRESETS: dict[str, ModelConfig] = {c.name: c for c in (
    _preset("llama-7b", 32000, 4096, 11008, 32, 32, context=2048),
    _preset("llama-13b", 32000, 5120, 13824, 40, 40, context=2048),
    _preset("llama-30b", 32000, 6656, 17920, 60, 52, context=2048),
    _preset("llama-65b", 32000, 8192, 22016, 80, 64, context=2048),
    _preset("llama2-7b", 32000, 4096, 11008, 32, 32, eps=1e-5, context=4096),
    _preset("llama2-13b", 32000, 5120, 13824, 40, 40, eps=1e-5, context=4096),
    _preset("llama2-70b", 32000, 8192, 28672, 80, 64, 8, eps=1e-5, context=4096),
    _preset("llama3-8b", 128256, 4096, 14336, 32, 32, 8, theta=5e5, eps=1e-5, context=8192),
    _preset("llama3-70b", 128256, 8192, 28672, 80, 64, 8, theta=5e5, eps=1e-5, context=8192),
    _llama31("llama3.1-8b", 4096, 14336, 32, 32),
    _llama31("llama3.1-70b", 8192, 28672, 80, 64),
    _llama31("llama3.1-405b", 16384, 53248, 126, 128),
    _llama31("llama3.2-1b", 2048, 8192, 16, 32, tied=True, head_dim=64, factor=32.0),
    _llama31("llama3.2-3b", 3072, 8192, 28, 24, tied=True, head_dim=128, factor=32.0),
    # Mistral-7B-v0.1: the release with the 4096-token sliding window
    _preset("mistral-7b", 32000, 4096, 14336, 32, 32, 8, eps=1e-5, family="mistral",
            sliding_window=4096, context=32768),
    _preset("qwen2.5-7b", 152064, 3584, 18944, 28, 28, 4, theta=1e6, family="qwen2",
            qkv_bias=True, context=131072),
    _preset("qwen2.5-72b", 152064, 8192, 29568, 80, 64, 8, theta=1e6, eps=1e-5,
            family="qwen2", qkv_bias=True, context=131072),
    _preset("qwen3-8b", 151936, 4096, 12288, 36, 32, 8, theta=1e6, head_dim=128,
            family="qwen3", qk_norm=True, context=40960),
    _preset("qwen3-32b", 151936, 5120, 25600, 64, 64, 8, theta=1e6, head_dim=128,
            family="qwen3", qk_norm=True, context=40960),
    _preset("mixtral-8x7b", 32000, 4096, 14336, 32, 32, 8, theta=1e6, eps=1e-5,
            family="mixtral", experts=8, experts_per_token=2, context=32768),
    _preset("mixtral-8x22b", 32768, 6144, 16384, 56, 48, 8, theta=1e6, eps=1e-5,
            family="mixtral", experts=8, experts_per_token=2, context=65536),
    # small presets for tests and quick runs
    ModelConfig("tiny", 64, 32, 48, 2, 4, 2, 8, dtype=DType.f32),
    ModelConfig("tiny-tied", 64, 32, 48, 2, 4, 1, 8, tied=True, dtype=DType.f32),
    ModelConfig("small", 256, 128, 352, 4, 8, 2, 16, dtype=DType.f32),
)}


def preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ModelError(f"unknown model {name!r}; presets: {', '.join(PRESETS)} "
                         "(or give a checkpoint directory)") from None
