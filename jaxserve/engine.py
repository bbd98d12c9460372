"""The synchronous engine core: requests in, one batched step at a time, outputs out.

``LLMEngine.step()`` is the whole data flow of design.md:
  ``schedule(state)`` (pure Python plan) -> ``runner.pack_step`` (numpy, padded to a bucket) ->
  ``runner.execute`` (one compiled XLA program, KV cache donated, sampling on device) ->
  ``update(state, sampled)`` (token-id stop checks, block frees) -> incremental detokenisation and
  stop strings -> ``RequestOutput`` per request that changed.
The async server (``AsyncEngine``) and the offline ``LLM`` both drive this object.
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve import scheduler as sched
from jaxserve.config import EngineConfig, LoadConfig
from jaxserve.detokenizer import IncrementalDetokenizer
from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.runner import ModelRunner, RowParams
from jaxserve.sampling_params import SamplingParams
from jaxserve.tokenizer import Tokenizer
from models.config import ModelConfig
from pallas_kernels import allocate_kv_cache, attention_fn_for_backend, kv_cache_bytes_per_block

GIB = 1 << 30


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # u64
    seq: sched.SeqState
    detok: IncrementalDetokenizer
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_emitted_tokens: int = 0


def setup_compilation_cache(cache_dir: str) -> None:
    """Turn on JAX's persistent compilation cache in ``cache_dir`` ("" leaves it off)."""
    if not cache_dir:
        return
    path = os.path.expanduser(cache_dir)
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def resolve_dtype(name: str) -> jnp.dtype:
    """"auto" -> float32 on the CPU, bfloat16 on accelerators."""
    if name == "auto":
        return jnp.dtype(jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)
    return jnp.dtype(name)


def load_model(load: LoadConfig, dtype: jnp.dtype, seed: int
               ) -> tuple[ModelConfig, object, Tokenizer, str]:
    """(model config, params, tokenizer, served name) for a LoadConfig.

    GGUF: weights and tokenizer from the file. Dummy: random weights of a built-in config with
    the SmolLM2 tokenizer. Raises ValueError / FileNotFoundError with the reason.
    """
    from jaxserve.model_files import default_gguf_path
    from models.config import builtin_config
    from models.loader import dummy_params, gguf_name, load_gguf_params
    from models.registry import get_architecture

    if load.load_format == "dummy":
        cfg = builtin_config(load.model or "smollm2-135m")
        params = dummy_params(get_architecture(cfg.architecture).model(cfg, dtype), seed)
        return cfg, params, Tokenizer.from_gguf(default_gguf_path()), cfg.name
    path = load.model or default_gguf_path()
    if os.path.isdir(path) or not path.lower().endswith(".gguf"):
        raise ValueError(
            f"model {path!r} is not a GGUF file; serve a .gguf file, or a built-in config "
            f"with --load-format dummy")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"model file {path!r} does not exist")
    cfg, params = load_gguf_params(path, dtype)
    return cfg, params, Tokenizer.from_gguf(path), gguf_name(path)


class LLMEngine:
    """Continuous-batching engine over a paged KV cache.

    Args:
      config: engine settings.
      load: where weights come from.
      metrics: an ``EngineMetrics`` (or None) updated every step.
    Raises:
      ValueError: invalid settings (max_model_len above the model's, a KV cache too small for
        one full-length request).
    """

    def __init__(self, config: EngineConfig | None = None, load: LoadConfig | None = None,
                 metrics=None) -> None:
        from models.registry import get_architecture

        self.config = config = config or EngineConfig()
        self.load_config = load = load or LoadConfig()
        self.metrics = metrics
        setup_compilation_cache(config.compilation_cache_dir)
        t0 = time.perf_counter()
        self.dtype = resolve_dtype(config.dtype)
        self.model_config, params, self.tokenizer, name = load_model(load, self.dtype,
                                                                     config.seed)
        self.model_name = load.served_model_name or name
        mc = self.model_config
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        if self.max_model_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's context "
                             f"window of {mc.max_position_embeddings}")
        self.num_blocks = self._num_kv_blocks(params)
        max_blocks = -(-self.max_model_len // config.block_size)
        if self.num_blocks - 1 < max_blocks:
            raise ValueError(
                f"the KV cache has {self.num_blocks - 1} usable blocks of {config.block_size} "
                f"tokens, fewer than one request of max_model_len={self.max_model_len} needs "
                f"({max_blocks}); raise num_kv_blocks / kv_cache_memory_gib or lower "
                f"max_model_len")
        kv = allocate_kv_cache(mc.num_layers, self.num_blocks, config.block_size,
                               mc.num_kv_heads, mc.head_dim, self.dtype)
        self.model = get_architecture(mc.architecture).model(
            mc, self.dtype, attention_fn=attention_fn_for_backend(config.attention_backend))
        vocab_limit = self.tokenizer.vocab_size if self.tokenizer.vocab_size < mc.vocab_size \
            else None
        self.runner = ModelRunner(self.model, params, kv,
                                  max_num_batched_tokens=config.max_num_batched_tokens,
                                  max_num_seqs=config.max_num_seqs,
                                  max_blocks_per_seq=max_blocks, vocab_limit=vocab_limit)
        self.state = sched.new_state(sched.SchedulerConfig.from_engine_config(
            config, self.num_blocks, self.max_model_len))
        if metrics is not None:
            metrics.set_batch_limits(config.max_num_seqs, config.max_num_batched_tokens)
        self.requests: dict[str, _Request] = {}
        self._rng = np.random.default_rng(config.seed)
        self._ids = itertools.count()
        self.load_s = time.perf_counter() - t0

    def _num_kv_blocks(self, params) -> int:
        c, mc = self.config, self.model_config
        if c.num_kv_blocks is not None:
            return c.num_kv_blocks
        per_block = kv_cache_bytes_per_block(mc.num_layers, c.block_size, mc.num_kv_heads,
                                             mc.head_dim, self.dtype)
        if c.kv_cache_memory_gib is not None:
            budget = c.kv_cache_memory_gib * GIB
        else:
            stats = jax.devices()[0].memory_stats() or {}
            if "bytes_limit" in stats:
                free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
                budget = c.kv_cache_memory_fraction * free
            else:  # the CPU reports no statistics
                budget = 2 * GIB
        return max(2, int(budget // per_block))

    def warmup(self, progress: bool = True) -> dict[str, float]:
        """Compile every step program; returns {"num_programs", "compile_s"}."""
        return self.runner.warmup(progress)

    # -- requests ------------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Check a request without touching engine state (safe from any thread).

        Returns the effective max_tokens (clamped to the context window).
        Raises ValueError naming the problem: empty prompt, prompt too long, ids out of range,
        or a request the KV cache can never hold.
        """
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt must not be empty (it has 0 tokens)")
        vocab = self.tokenizer.vocab_size
        for t in prompt_token_ids:
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < vocab:
                raise ValueError(f"prompt token id {t!r} is out of range [0, {vocab})")
        if n >= self.max_model_len:
            raise ValueError(
                f"prompt has {n} tokens; max_model_len is {self.max_model_len}, which leaves no "
                f"room for output (the prompt must have at most {self.max_model_len - 1})")
        params.validate()
        for t in params.stop_token_ids:
            if t >= vocab:
                raise ValueError(f"stop_token_ids holds {t}, outside the vocabulary [0, {vocab})")
        room = self.max_model_len - n
        return room if params.max_tokens is None else min(params.max_tokens, room)

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams | None = None, prompt: str | None = None,
                    arrival_time: float | None = None) -> None:
        """Queue a request. Raises ValueError (see ``validate``; also a duplicate id)."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        max_tokens = self.validate(prompt_token_ids, params)
        prompt_token_ids = [int(t) for t in prompt_token_ids]
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= set(self.tokenizer.eos_token_ids)
        seq = sched.SeqState(request_id=request_id, token_ids=list(prompt_token_ids),
                             num_prompt_tokens=len(prompt_token_ids), max_tokens=max_tokens,
                             stop_token_ids=frozenset(stop_ids))
        self.state = sched.add_request(self.state, seq)
        seed = params.seed % 2**64 if params.seed is not None else int(self._rng.integers(2**63))
        self.requests[request_id] = _Request(
            request_id, prompt, prompt_token_ids, params, seed, seq,
            IncrementalDetokenizer(self.tokenizer, prompt_token_ids,
                                   skip_special_tokens=params.skip_special_tokens,
                                   stop=params.stop,
                                   include_stop_str_in_output=params.include_stop_str_in_output),
            arrival_time if arrival_time is not None else time.monotonic())

    def abort_request(self, request_ids: str | list[str]) -> list[str]:
        """Abort requests (unknown ids ignored); their blocks go back at once."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.state, aborted = sched.abort_requests(self.state, ids)
        for rid in ids:
            req = self.requests.pop(rid, None)
            if req is not None and self.metrics is not None:
                self.metrics.record_finished("abort", time.monotonic() - req.arrival_time)
        if aborted:
            self._record_step()  # the gauges must show the freed blocks even if no step follows
        return aborted

    def _record_step(self, num_prompt_tokens: int = 0, num_generation_tokens: int = 0,
                     num_preemptions: int = 0, plan: sched.SchedulerOutput | None = None) -> None:
        if self.metrics is not None:
            self.metrics.record_step(len(self.state.running), len(self.state.waiting),
                                     self.state.block_pool.usage, num_prompt_tokens,
                                     num_generation_tokens, num_preemptions)
            if plan is not None:  # batch occupancy of the step that ran (0, 0 when idle)
                self.metrics.record_batch(len(plan.scheduled), plan.num_scheduled_tokens)

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running."""
        return sched.has_unfinished(self.state)

    @property
    def num_running(self) -> int:
        return len(self.state.running)

    @property
    def num_waiting(self) -> int:
        return len(self.state.waiting)

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns outputs of requests with new text or a finish."""
        preempted_before = self.state.num_preemptions_total
        self.state, plan = sched.schedule(self.state)
        if plan.is_empty:
            self._record_step(plan=plan)
            return []
        now = time.monotonic()
        rows, num_prompt_tokens = [], 0
        for s in plan.scheduled:
            req = self.requests[s.request_id]
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            p = req.params
            top_k = p.top_k if 0 < p.top_k < self.tokenizer.vocab_size else 0  # else: off
            rows.append(RowParams(p.temperature, top_k, p.top_p, req.seed,
                                  s.start_pos + len(s.token_ids) - len(req.prompt_token_ids)))
            num_prompt_tokens += max(0, min(len(req.prompt_token_ids),
                                            s.start_pos + len(s.token_ids)) - s.start_pos)
        bucket, packed = self.runner.pack_step([s.token_ids for s in plan.scheduled],
                                               [s.start_pos for s in plan.scheduled],
                                               [s.block_ids for s in plan.scheduled], rows)
        ids = self.runner.execute(bucket, packed)
        sampled = [int(ids[i]) if s.sample else None for i, s in enumerate(plan.scheduled)]
        self.state, result = sched.update(self.state, plan, sampled)
        now = time.monotonic()
        outputs = [self._process(rid, tok, result.finished.get(rid), now)
                   for rid, tok in result.new_token_ids.items()]
        self._record_step(num_prompt_tokens, len(result.new_token_ids),
                          self.state.num_preemptions_total - preempted_before, plan)
        return [o for o in outputs if o is not None]

    def _process(self, rid: str, token: int, finish: str | None, now: float
                 ) -> RequestOutput | None:
        req = self.requests[rid]
        req.output_token_ids.append(token)
        m = self.metrics
        if req.first_token_time is None:
            req.first_token_time = now
            if m is not None:
                m.record_first_token(now - req.arrival_time,
                                     (req.first_scheduled_time or now) - req.arrival_time)
        elif m is not None:
            m.record_inter_token(now - (req.last_token_time or now))
        req.last_token_time = now
        stop_reason: str | int | None = None
        if finish == "stop":
            # a stop token's own text is not part of the output (as vLLM)
            delta = ""
            if token not in self.tokenizer.eos_token_ids or token in req.params.stop_token_ids:
                stop_reason = token
        else:
            delta = req.detok.add_tokens([token])
            if req.detok.stopped:
                finish, stop_reason = "stop", req.detok.stop_reason
                self.state = sched.finish_requests(self.state, [rid], "stop")
        if finish is not None and not req.detok.stopped:
            delta += req.detok.finish()
        new_ids = req.output_token_ids[req.num_emitted_tokens:]
        if not delta and finish is None:
            return None  # text held back (partial UTF-8 or a possible stop string)
        req.num_emitted_tokens = len(req.output_token_ids)
        out = CompletionOutput(index=0, text=req.detok.text, token_ids=list(req.output_token_ids),
                               finish_reason=finish, stop_reason=stop_reason, delta_text=delta,
                               delta_token_ids=new_ids)
        metrics = {"arrival_time": req.arrival_time, "first_token_time": req.first_token_time}
        if req.first_scheduled_time is not None:
            metrics["first_scheduled_time"] = req.first_scheduled_time
        if finish is not None:
            metrics["finished_time"] = now
            del self.requests[rid]
            if m is not None:
                m.record_finished(finish, now - req.arrival_time)
        return RequestOutput(rid, req.prompt, req.prompt_token_ids, [out],
                             finished=finish is not None, metrics=metrics)

    def next_request_id(self) -> str:
        """A fresh id for callers that have none."""
        return f"req-{next(self._ids)}"
