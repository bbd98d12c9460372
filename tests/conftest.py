"""Shared pytest fixtures."""

from __future__ import annotations

import json
import os
from pathlib import Path

# Eight simulated CPU devices for the tensor-parallel tests (tests/test_sharding.py); set before
# jax initialises its backend. Everything else runs on device 0 as before.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()

import numpy as np
import pytest

from jaxserve.platform import configure_process
from jaxserve.tokenizer import Tokenizer

# The process settings `jaxserve serve` and `LLM()` apply (XLA:CPU flags, malloc), so that the
# engines built in-process here run as served; before jax opens its backend.
configure_process()


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    """The real SmolLM2-135M-Instruct tokenizer, built from its GGUF (about 2 s, once)."""
    from jaxserve.loading.model_files import default_gguf_path

    return Tokenizer.from_gguf(default_gguf_path())


# -- the real engine and the model goldens (tests/models/test_model_goldens.py, tests/engine/test_engine.py) --

REPO_ROOT = Path(__file__).resolve().parent.parent
GOLDENS_DIR = Path(__file__).resolve().parent / "goldens"

# The shared engine's KV cache: 159 usable blocks of 16 tokens (2544 tokens). One full-length
# request (max_model_len 1024) needs 64, so a handful of long requests exhausts the pool and
# forces preemption (tests/engine/test_engine.py::test_preemption_keeps_goldens_and_frees_blocks).
ENGINE_NUM_KV_BLOCKS = 160
ENGINE_MAX_MODEL_LEN = 1024


@pytest.fixture(scope="session")
def goldens() -> dict:
    """tests/goldens/smollm2.json with each prompt's first-step logits row (``"logits"``,
    ``f32[vocab]``) from smollm2_logits.npz attached."""
    data = json.loads((GOLDENS_DIR / "smollm2.json").read_text())
    with np.load(GOLDENS_DIR / data["logits_npz"].split()[0]) as rows:
        for p in data["prompts"]:
            p["logits"] = np.asarray(rows[p["name"]], np.float32)
    return data


@pytest.fixture(scope="session")
def engine():
    """One warmed-up ``LLMEngine`` on the real SmolLM2-135M GGUF for the whole session.

    Building it costs about 10 s of loading plus warm-up; the persistent compilation cache in
    ``<repo>/.jax_cache`` (git-ignored) makes warm-up cheap on reruns. Tests must leave it idle
    with every block free (tests/engine/test_engine.py checks after each test).
    """
    from jaxserve.config import EngineConfig
    from jaxserve.engine.llm_engine import LLMEngine

    eng = LLMEngine(
        EngineConfig(
            dtype="float32",  # the goldens are float32 references (HF transformers)
            max_model_len=ENGINE_MAX_MODEL_LEN,
            max_num_batched_tokens=512,  # tests/engine/test_engine.py fills buckets 8 .. 512
            num_kv_blocks=ENGINE_NUM_KV_BLOCKS,
            compilation_cache_dir=str(REPO_ROOT / ".jax_cache"),
            # plans that do not depend on measured step times (the objectives' model is
            # refitted from them), in arrival order (the preemption scenarios of
            # test_engine.py are worked out for it); test_engine.py runs the serving
            # defaults on their own (test_objectives_keep_goldens_and_compile_nothing)
            ttft_slo_ms=0,
            itl_slo_ms=0,
            prefill_order="fcfs",
        )
    )
    eng.warmup(progress=False)
    return eng


@pytest.fixture
def idle_engine(engine):
    """The shared engine, checked after the test: left idle with every KV block and penalty
    slot back and async scheduling on. Leftover requests are aborted first, so that one
    failure does not cascade into the following tests."""
    yield engine
    unfinished = engine.request_ids()
    if unfinished:
        engine.abort_request(unfinished)
    engine.set_async_scheduling(True)
    assert not unfinished, f"test left requests unfinished: {unfinished}"
    assert not engine.has_unfinished_requests()
    pool = engine.scheduler.block_pool
    assert pool.num_free_blocks == pool.num_usable_blocks, (
        f"{pool.num_usable_blocks - pool.num_free_blocks} KV blocks leaked")
    assert not engine.slots.holders
