"""Bring your own model: examples/tiny_gpt.py (a GPT-2-style Flax model outside models/),
registered by name, written as an orbax checkpoint and served end to end over HTTP."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import openai
import pytest

from jaxserve.config import EngineConfig, LoadConfig
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.server.routes import build_app
from models.registry import get_architecture
from tests.support.http_server import serve_app
from tests.support.prefill import prefill_logits

REPO_ROOT = Path(__file__).resolve().parents[2]
# paged (ragged batch) vs dense reference logits of the example, float32: measured max abs diff
# 4.2e-7 with logits up to ~0.8 in magnitude; the tolerance is ~20x.
ATOL = 1e-5
_PAD = 32


@pytest.fixture(scope="module")
def tiny_gpt():
    spec = importlib.util.spec_from_file_location("tiny_gpt", REPO_ROOT / "examples" /
                                                  "tiny_gpt.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    module.register()
    return module


@pytest.fixture(scope="module")
def checkpoint_dir(tiny_gpt, tokenizer, tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("byo") / "tiny-gpt")
    tiny_gpt.write_checkpoint(path, tiny_gpt.TinyGPTConfig(), tokenizer, seed=1)
    return path


def _greedy_reference(tiny_gpt, params, cfg, ids: list[int], n: int) -> list[int]:
    """n greedy tokens from the dense reference (one compile: ids padded to 32 tokens)."""
    out = list(ids)
    for _ in range(n):
        padded = jnp.asarray(out + [0] * (_PAD - len(out)), jnp.int32)
        logits = tiny_gpt.reference_logits(params, cfg, padded)
        out.append(int(np.argmax(np.asarray(logits[len(out) - 1]))))
    return out[len(ids):]


def test_registered_by_name(tiny_gpt) -> None:
    assert get_architecture("tiny-gpt") is tiny_gpt.ARCHITECTURE


def test_serves_over_http_as_its_reference_computes(tiny_gpt, checkpoint_dir, tokenizer) -> None:
    eng = LLMEngine(EngineConfig(dtype="float32", max_model_len=64, num_kv_blocks=16,
                                 max_num_seqs=2, max_num_batched_tokens=16,
                                 compilation_cache_dir=str(REPO_ROOT / ".jax_cache")),
                    LoadConfig(checkpoint_dir))
    assert isinstance(eng.model, tiny_gpt.TinyGPT) and eng.model_name == "tiny-gpt"
    params, cfg = eng.runner.params, eng.model_config
    prompts = ["The capital city of France is", "Once upon a time, in a land far away,"]
    ids = [tokenizer.encode(p) for p in prompts]
    for got, seq in zip(prefill_logits(eng.model, params, ids), ids, strict=True):
        padded = jnp.asarray(seq + [0] * (_PAD - len(seq)), jnp.int32)
        want = np.asarray(tiny_gpt.reference_logits(params, cfg, padded))[:len(seq)]
        assert float(np.max(np.abs(got - want))) <= ATOL

    aeng = AsyncEngine(eng)
    aeng.start(warmup=True, progress=False)
    try:
        with serve_app(build_app(aeng, eng.model_name)) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="none")
            assert [m.id for m in client.models.list().data] == ["tiny-gpt"]
            for prompt, seq in zip(prompts, ids, strict=True):
                r = client.completions.create(model="tiny-gpt", prompt=prompt, max_tokens=8,
                                              temperature=0, extra_body={"ignore_eos": True})
                want = _greedy_reference(tiny_gpt, params, cfg, seq, 8)
                assert r.choices[0].text == tokenizer.decode(want)
                assert r.usage.completion_tokens == 8
    finally:
        aeng.shutdown()
