"""Data-parallel replicas behind one server (jaxserve.engine.data_parallel), on simulated CPU devices."""

from __future__ import annotations

import concurrent.futures

import httpx
import jax
import pytest

from jaxserve.config import EngineConfig, LoadConfig
from jaxserve.engine.data_parallel import build_data_parallel
from jaxserve.server.routes import build_app
from jaxserve.server_config import ServerConfig
from tests.support.http_server import serve_app

pytestmark = pytest.mark.skipif(
    len(jax.devices()) < 4, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count>=4")

CFG = EngineConfig(max_model_len=128, num_kv_blocks=24, max_num_seqs=4,
                   max_num_batched_tokens=16, compilation_cache_dir="")
TINY = LoadConfig(model="tiny", load_format="dummy")


def test_refuses_more_replicas_than_devices() -> None:
    with pytest.raises(ValueError, match=r"data_parallel_size=3 x tensor_parallel_size=2 "
                                         r"needs 6 devices; 4 available"):
        build_data_parallel(CFG.replace(tensor_parallel_size=2), TINY, 3,
                            devices=jax.devices()[:4])
    with pytest.raises(ValueError, match="data_parallel_size must be a positive integer"):
        build_data_parallel(CFG, TINY, 0)


def test_two_replicas_serve_concurrent_requests_through_one_server() -> None:
    """Eight concurrent greedy completions through one HTTP server over two replicas on
    devices 0 and 1: both replicas take requests, every answer equals the same prompt's answer
    from a lone request, and /metrics labels each replica's series."""
    dp = build_data_parallel(CFG, TINY, 2)
    assert [r.engine.runner.kv_cache.k.devices() for r in dp.replicas] == \
        [{jax.devices()[0]}, {jax.devices()[1]}]
    dp.start(warmup=True, progress=False)
    # each replica left its 8-token program for its background compile, started once both
    # were warm
    assert dp.warmup_stats["pending_programs"] == 2
    assert all(r.background is not None for r in dp.replicas)
    try:
        with serve_app(build_app(dp, "tiny", ServerConfig())) as url:
            def complete(prompt: str) -> str:
                r = httpx.post(url + "/v1/completions", timeout=120, json={
                    "model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0,
                    "ignore_eos": True})
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["text"]

            prompts = [f"request number {i} says" for i in range(8)]
            alone = {p: complete(p) for p in prompts[:2]}
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                answers = list(pool.map(complete, prompts))
            assert all(dp.routed), dp.routed  # both replicas served
            assert sum(dp.routed) == 10
            for p in prompts[:2]:
                assert answers[prompts.index(p)] == alone[p]
            metrics = httpx.get(url + "/metrics").text
            assert 'engine="0"' in metrics and 'engine="1"' in metrics
            finished = [line for line in metrics.splitlines()
                        if line.startswith("jaxserve:request_success_total")]
            assert sum(float(line.rsplit(" ", 1)[1]) for line in finished) == 10
    finally:
        dp.shutdown()
