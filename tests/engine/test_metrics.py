"""The metrics contract (jaxserve.engine.metrics): names and the ``model_name`` label, no
``_created`` series, the vLLM-named copies that routers and autoscalers read, the work-left
gauges against a real engine held between steps, and the compiles counted after warm-up."""

from __future__ import annotations

import asyncio
import threading
import time

import jax
import numpy as np
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.config import EngineConfig, LoadConfig
from jaxserve.core.kv_manager import KVStats
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.engine.compile_events import counting_compiles
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.metrics import EngineMetrics, vllm_compat
from jaxserve.sampling_params import SamplingParams
from tests.conftest import REPO_ROOT

# What the Gateway API Inference Extension's model-server protocol reads (queue, running and
# KV-usage gauges: its defaults for vLLM) and what vLLM's other dashboards and autoscaler
# recipes read, by exposed sample name.
GIE_GAUGES = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc")
VLLM_SAMPLES = (
    *GIE_GAUGES, "vllm:gpu_cache_usage_perc", "vllm:cache_config_info",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
    "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total", "vllm:time_to_first_token_seconds_bucket",
    "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
    "vllm:request_queue_time_seconds_bucket", "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket",
)


def _families(text: str) -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _samples(text: str) -> dict[tuple[str, frozenset], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def _recorded() -> EngineMetrics:
    m = EngineMetrics("m")
    m.set_batch_limits(8, 512)
    m.set_cache_config(block_size=16, num_blocks=160)
    m.record_step(num_running=2, num_waiting=1, kv_usage=0.25, num_prompt_tokens=10,
                  num_generation_tokens=2, num_preemptions=1)
    m.record_kv_stats(KVStats(prefix_cache_queries=32, prefix_cache_hits=16), None)
    m.record_first_token(ttft_s=0.05, queue_s=0.01)
    m.record_inter_token(0.004)
    m.record_finished("stop", 0.5, num_prompt_tokens=10, num_generation_tokens=3)
    m.record_finished("abort", 0.1, num_prompt_tokens=4, num_generation_tokens=1)
    return m


def test_every_series_carries_model_name_and_none_is_created() -> None:
    text = _recorded().render().decode()
    got = _samples(text)
    model = ("model_name", "m")
    for name, value in (
        ("jaxserve:num_requests_running", 2), ("jaxserve:num_requests_waiting", 1),
        ("jaxserve:kv_cache_usage_perc", 0.25), ("jaxserve:prompt_tokens_total", 10),
        ("jaxserve:generation_tokens_total", 2), ("jaxserve:num_preemptions_total", 1),
        ("jaxserve:num_aborted_requests_total", 1), ("jaxserve:prefix_cache_queries_total", 32),
        ("jaxserve:prefix_cache_hits_total", 16),
        ("jaxserve:time_to_first_token_seconds_count", 1),
        ("jaxserve:inter_token_latency_seconds_count", 1),
        ("jaxserve:e2e_request_latency_seconds_count", 1),
        ("jaxserve:request_queue_time_seconds_count", 1),
        ("jaxserve:request_prompt_tokens_sum", 10),  # the aborted request enters no histogram
        ("jaxserve:request_generation_tokens_sum", 3),
    ):
        assert got[(name, frozenset({model}))] == value, name
    assert got[("jaxserve:request_success_total",
                frozenset({model, ("finished_reason", "stop")}))] == 1
    assert got[("jaxserve:request_success_total",
                frozenset({model, ("finished_reason", "length")}))] == 0
    assert got[("jaxserve:cache_config_info", frozenset(
        {model, ("block_size", "16"), ("num_gpu_blocks", "160")}))] == 1
    assert all(dict(labels).get("model_name") == "m" for _, labels in got)
    assert all(name.startswith("jaxserve:") for name, _ in got)
    assert "_created" not in text
    buckets = [dict(labels)["le"] for name, labels in got
               if name == "jaxserve:request_prompt_tokens_bucket"]
    assert buckets[:4] == ["1.0", "2.0", "5.0", "10.0"] and buckets[-1] == "+Inf"


def test_vllm_names_only_on_request_and_as_vllm_types() -> None:
    m = _recorded()
    ours = m.render().decode()
    assert "vllm:" not in ours
    text = generate_latest(vllm_compat(m.registry)).decode()
    got = _samples(text)
    names = {name for name, _ in got}
    for name in VLLM_SAMPLES:
        assert name in names, name
    fam = _families(text)
    for name in GIE_GAUGES:
        assert fam[name].type == "gauge", name
    # the same values under both names, labels included
    theirs = _samples(ours)
    for (name, labels), value in got.items():
        base = name.removeprefix("vllm:").replace("gpu_cache_usage_perc", "kv_cache_usage_perc")
        assert theirs[("jaxserve:" + base, labels)] == value, name
    assert got[("vllm:kv_cache_usage_perc", frozenset({("model_name", "m")}))] == 0.25
    assert "_created" not in text
    assert not any(n.startswith("vllm:num_tokens_in_flight") for n in names)  # ours only


def test_tokens_in_flight_and_prefill_backlog_follow_the_engine() -> None:
    """A real engine (tiny dummy model, 16-token step budget) held between steps: after every
    step the work-left gauges equal the scheduler's state, and the histograms the lengths."""
    metrics = EngineMetrics("tiny")
    # arrival order and no ITL target: the counts below follow "a" then "b" in fixed chunks
    eng = LLMEngine(EngineConfig(max_model_len=128, num_kv_blocks=24, max_num_seqs=4,
                                 max_num_batched_tokens=16, prefill_order="fcfs", itl_slo_ms=0, ttft_slo_ms=0,
                                 compilation_cache_dir=str(REPO_ROOT / ".jax_cache")),
                    LoadConfig(model="tiny", load_format="dummy"), metrics=metrics)
    eng.warmup(progress=False)
    greedy = {"temperature": 0.0, "ignore_eos": True}
    eng.add_request("a", list(range(1, 41)), SamplingParams(max_tokens=5, **greedy))
    eng.add_request("b", list(range(1, 11)), SamplingParams(max_tokens=3, **greedy))
    label = {"model_name": "tiny"}
    gauge = lambda name: metrics.registry.get_sample_value(f"jaxserve:{name}", label)
    eng.step()  # 16 of a's 40 prompt tokens, still on the device (async scheduling)
    assert gauge("num_tokens_in_flight") == (40 - 16) + 10 + 5 + 3
    assert metrics.prefill_tokens_per_s is None  # known once the step's ids are read
    eng.step()  # a's next 16; the first step is read
    rate = metrics.prefill_tokens_per_s
    assert rate is not None and rate > 0
    assert gauge("prefill_tokens_per_second") == pytest.approx(rate)
    assert gauge("prefill_backlog_seconds") == pytest.approx((8 + 10) / rate)
    steps = 2
    while eng.has_unfinished_requests():
        eng.step()
        steps += 1
        prefill, decode = eng.scheduler.num_tokens_pending()
        assert gauge("num_tokens_in_flight") == prefill + decode
        rate = metrics.prefill_tokens_per_s
        assert gauge("prefill_backlog_seconds") == pytest.approx(prefill / rate)
    assert steps >= 6 and gauge("num_tokens_in_flight") == 0
    assert gauge("prefill_backlog_seconds") == 0
    assert gauge("request_prompt_tokens_sum") == 50 and gauge("request_prompt_tokens_count") == 2
    assert gauge("request_generation_tokens_sum") == 8
    assert metrics.registry.get_sample_value(
        "jaxserve:cache_config_info",
        {**label, "block_size": "16", "num_gpu_blocks": str(eng.num_blocks)}) == 1
    assert eng.probe() > 0  # the start-up probe step leaves no trace in the series
    assert gauge("prompt_tokens_total") == 50


def _jit_new_program() -> None:
    # a fresh function each call: jax compiles it (or looks it up in the persistent cache)
    jax.jit(lambda x: x * 3 + 1)(np.zeros(5, np.float32)).block_until_ready()


def test_compiles_are_counted_on_the_watching_thread_only() -> None:
    watched, other = EngineMetrics("w"), EngineMetrics("o")
    count = lambda m: m.registry.get_sample_value(
        "jaxserve:num_compiles_after_warmup_total", {"model_name": m.model_name})

    def engine_thread() -> None:
        with counting_compiles(watched):
            _jit_new_program()
            _jit_new_program()
        _jit_new_program()  # after the engine loop ended

    t = threading.Thread(target=engine_thread)
    t.start()
    t.join()
    _jit_new_program()  # another thread's compile
    assert (count(watched), count(other)) == (2, 0)


def _tiny_async_engine() -> tuple[EngineMetrics, LLMEngine, AsyncEngine]:
    """The tiny dummy model's engine behind a started, warmed-up ``AsyncEngine`` (the caller
    shuts it down), with its metrics."""
    metrics = EngineMetrics("tiny")
    eng = LLMEngine(EngineConfig(max_model_len=128, num_kv_blocks=24, max_num_seqs=4,
                                 max_num_batched_tokens=16,
                                 compilation_cache_dir=str(REPO_ROOT / ".jax_cache")),
                    LoadConfig(model="tiny", load_format="dummy"), metrics=metrics)
    aeng = AsyncEngine(eng)
    aeng.start(warmup=True, progress=False)
    return metrics, eng, aeng


def test_serving_after_warmup_compiles_nothing_and_a_compile_is_counted() -> None:
    """The real engine behind ``AsyncEngine``: warm-up's compiles are not counted, requests of
    every prompt bucket compile nothing, and a compile on the engine thread is counted."""
    metrics, eng, aeng = _tiny_async_engine()
    count = lambda: metrics.registry.get_sample_value(
        "jaxserve:num_compiles_after_warmup_total", {"model_name": "tiny"})

    async def run(prompt_len: int, rid: str) -> None:
        params = SamplingParams(max_tokens=3, temperature=0.7, seed=1, ignore_eos=True)
        async for out in aeng.generate(list(range(1, prompt_len + 1)), params, rid):
            last = out
        assert last.finished

    try:
        for n in (1, 5, 9, 16, 40):  # every token bucket up to 16, and a chunked prefill
            asyncio.run(run(n, f"r{n}"))
        assert count() == 0
        step = eng.step

        def compiling_step():
            _jit_new_program()
            return step()

        eng.step = compiling_step  # the engine thread now compiles before each step
        asyncio.run(run(3, "compiles"))
        assert count() >= 1
    finally:
        aeng.shutdown()


def test_a_request_arrives_when_it_reaches_the_async_engine_not_the_next_step() -> None:
    """A request sent while a step runs arrives at ``generate()``: its arrival (and so its TTFT
    and first-token deadline) counts the wait for that step, as a client's clock does."""
    metrics, eng, aeng = _tiny_async_engine()
    step, in_step, slow = eng.step, threading.Event(), 0.3

    def slow_step():
        in_step.set()
        time.sleep(slow)  # the step in flight when the second request comes
        return step()

    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    async def run() -> tuple[float, dict[str, float]]:
        async def drain(rid: str) -> dict[str, float]:
            async for out in aeng.generate([1, 2, 3], params, rid):
                last = out
            return last.metrics

        first = asyncio.create_task(drain("first"))
        await asyncio.to_thread(in_step.wait, 5.0)
        sent = time.monotonic()
        second = await drain("second")
        await first
        return sent, second

    eng.step = slow_step
    try:
        sent, m = asyncio.run(run())
    finally:
        aeng.shutdown()
    assert sent <= m["arrival_time"] < sent + 0.05
    assert m["first_token_time"] - m["arrival_time"] > slow / 2  # it waited for the step
    ttft = metrics.registry.get_sample_value(
        "jaxserve:time_to_first_token_seconds_sum", {"model_name": "tiny"})
    assert ttft >= m["first_token_time"] - m["arrival_time"]
