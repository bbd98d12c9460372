"""Model hyper-parameters (the Llama family, Gemma 3) and the built-in configs for dummy weights."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 RoPE frequency scaling ("llama3" rope_type in HF transformers).

    Source: Meta's Llama 3.1 reference (``apply_scaling`` in llama/model.py).
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-family decoder; ValueError for heads not a multiple of kv heads, an odd
    head_dim, or a window below 1."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int  # SwiGLU width
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int  # GQA
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None  # Llama-3 scaling, or None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    max_position_embeddings: int = 8192  # the model's own context window, tokens
    sliding_window: int | None = None  # every layer sees the last this many (Mistral); None: all
    name: str = "llama"
    architecture: str = "llama"  # the models.registry name

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads=} must be a multiple of {self.num_kv_heads=}")
        if self.head_dim % 2:
            raise ValueError(f"{self.head_dim=} must be even (RoPE rotates pairs)")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"{self.sliding_window=} must be None or at least 1")

    def replace(self, **changes: object) -> ModelConfig:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """JSON-able fields (an orbax checkpoint's ``config.json``); ``from_dict`` inverts it."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ModelConfig:
        """A config from ``to_dict()``'s form (other keys of ``config.json`` are not allowed).

        Raises:
          ValueError: naming an unknown or missing key, or an invalid value.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        if unknown := sorted(set(data) - names):
            raise ValueError(f"unknown model config keys {unknown}; known: {sorted(names)}")
        values = dict(data)
        if isinstance(values.get("rope_scaling"), dict):
            values["rope_scaling"] = RopeScaling(**values["rope_scaling"])
        try:
            return cls(**values)
        except TypeError as e:
            raise ValueError(f"model config: {e}") from None

    @property
    def num_params(self) -> int:
        """Parameter count (embeddings included once when tied)."""
        h, i, l = self.hidden_size, self.intermediate_size, self.num_layers
        attn = h * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        per_layer = attn + 3 * h * i + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return l * per_layer + emb + h


@dataclass(frozen=True)
class Gemma3Config:
    """A Gemma 3 text decoder (``models.gemma3``): tied embedding, no logit soft-cap.

    Source: the Gemma 3 report (arXiv:2503.19786), HF transformers' ``Gemma3TextConfig``.
    ValueError as ``ModelConfig``, or a pattern below 1.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int  # GELU-tanh gated MLP width
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 1_000_000.0  # global layers
    rope_local_theta: float = 10_000.0  # sliding-window layers
    rope_scaling_factor: float = 1.0  # linear, global layers only (8 from 4B up)
    sliding_window: int = 512  # keys a local layer sees, the query's own included
    sliding_window_pattern: int = 6  # every pattern-th layer is global (6: five local, one)
    query_pre_attn_scalar: float = 256.0  # scores * this**-0.5 (head_dim; 27B: hidden/num_heads)
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    name: str = "gemma3"
    architecture: str = "gemma3"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads=} must be a multiple of {self.num_kv_heads=}")
        if self.head_dim % 2:
            raise ValueError(f"{self.head_dim=} must be even (RoPE rotates pairs)")
        if self.sliding_window < 1 or self.sliding_window_pattern < 1:
            raise ValueError(f"{self.sliding_window=} and {self.sliding_window_pattern=} must "
                             "be >= 1")

    def replace(self, **changes: object) -> Gemma3Config:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    def is_global_layer(self, layer: int) -> bool:
        """Whether 0-based ``layer`` is global (5, 11, 17, ... for pattern 6)."""
        return (layer + 1) % self.sliding_window_pattern == 0

    def to_dict(self) -> dict:
        """JSON-able fields; ``from_dict`` inverts it."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Gemma3Config:
        """A config from ``to_dict()``'s form.

        Raises:
          ValueError: naming an unknown key, or a missing or invalid value.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        if unknown := sorted(set(data) - names):
            raise ValueError(f"unknown Gemma 3 config keys {unknown}; known: {sorted(names)}")
        try:
            return cls(**data)
        except TypeError as e:
            raise ValueError(f"Gemma 3 config: {e}") from None

    @property
    def num_params(self) -> int:
        """Parameter count (the embedding once: it is tied)."""
        h, i, l, d = self.hidden_size, self.intermediate_size, self.num_layers, self.head_dim
        attn = h * d * (2 * self.num_heads + 2 * self.num_kv_heads)
        per_layer = attn + 3 * h * i + 4 * h + 2 * d
        return l * per_layer + self.vocab_size * h + h


GEMMA3_270M = Gemma3Config(
    vocab_size=262144, hidden_size=640, intermediate_size=2048, num_layers=18, num_heads=4,
    num_kv_heads=1, head_dim=256, query_pre_attn_scalar=256.0, name="gemma3-270m")


SMOLLM2_135M = ModelConfig(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
    num_kv_heads=3, head_dim=64, rope_theta=100000.0, rms_norm_eps=1e-5,
    tie_word_embeddings=True, max_position_embeddings=8192, name="smollm2-135m",
)

BUILTIN_CONFIGS: dict[str, ModelConfig | Gemma3Config] = {
    "tiny": SMOLLM2_135M.replace(
        hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8, num_kv_heads=4,
        head_dim=16, max_position_embeddings=2048, name="tiny"),
    "smollm2-135m": SMOLLM2_135M,
    "llama-3.1-8b": ModelConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
        rope_scaling=RopeScaling(), max_position_embeddings=131072, name="llama-3.1-8b"),
    "llama-3.1-70b": ModelConfig(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80,
        num_heads=64, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
        rope_scaling=RopeScaling(), max_position_embeddings=131072, name="llama-3.1-70b"),
    "gemma3-270m": GEMMA3_270M,
}


def builtin_config(name: str) -> ModelConfig | Gemma3Config:
    """The built-in config of that name.

    Raises:
      ValueError: naming the known configs, for an unknown name.
    """
    try:
        return BUILTIN_CONFIGS[name]
    except KeyError:
        raise ValueError(
            f"unknown built-in model config {name!r}; known: {sorted(BUILTIN_CONFIGS)}"
        ) from None
