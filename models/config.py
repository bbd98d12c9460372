"""Model hyper-parameters (the Llama family, Gemma 3), and the built-in configs for dummy
weights."""

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
    """A Llama-family decoder.

    Fields: vocab_size, hidden_size, intermediate_size (SwiGLU width), num_layers, num_heads
    (query heads), num_kv_heads (GQA), head_dim, rope_theta, rope_scaling (Llama-3 scaling or
    None), rms_norm_eps, tie_word_embeddings, qkv_bias, max_position_embeddings (the model's
    own context window, tokens), sliding_window (every layer attends to the last this many
    positions, as Mistral's config says; None: full causal attention), name, architecture (the
    ``models.registry`` name).

    Raises:
      ValueError: if num_heads is not a multiple of num_kv_heads, head_dim is odd, or
        sliding_window is below 1.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    max_position_embeddings: int = 8192
    sliding_window: int | None = None
    name: str = "llama"
    architecture: str = "llama"

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
        """JSON-able fields (the ``config.json`` of an orbax checkpoint); ``from_dict`` inverts
        it."""
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
    """A Gemma 3 text decoder (``models.gemma3``).

    Fields as ``ModelConfig`` (vocab_size, hidden_size, intermediate_size: GELU-tanh gated MLP
    width, num_layers, num_heads, num_kv_heads, head_dim, rms_norm_eps, max_position_embeddings,
    name), plus:
      rope_theta: RoPE base of the global layers (1e6 in Gemma 3).
      rope_local_theta: RoPE base of the sliding-window layers (1e4).
      rope_scaling_factor: linear position scaling of the global layers only (1 for 270m and
        1B, 8 for 4B and larger).
      sliding_window: keys a local layer sees, the query's own included (512 for 270m/1B).
      sliding_window_pattern: every ``pattern``-th layer is global, the others local (6: five
        local then one global).
      query_pre_attn_scalar: attention scores are scaled by ``query_pre_attn_scalar ** -0.5``
        (head_dim, except hidden/num_heads in 27B).
    The embedding is tied to the output layer; nothing in Gemma 3 soft-caps logits. Source: the
    Gemma 3 technical report (arXiv:2503.19786) and HF transformers' ``Gemma3TextConfig``.

    Raises:
      ValueError: num_heads not a multiple of num_kv_heads, an odd head_dim, or a window or
        pattern below 1.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 1_000_000.0
    rope_local_theta: float = 10_000.0
    rope_scaling_factor: float = 1.0
    sliding_window: int = 512
    sliding_window_pattern: int = 6
    query_pre_attn_scalar: float = 256.0
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
        """Whether ``layer`` (0-based) attends to the whole context (every
        ``sliding_window_pattern``-th layer: 5, 11, 17, ... for pattern 6)."""
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
