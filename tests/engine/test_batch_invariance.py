"""Batch invariance on the real SmolLM2-135M GGUF, bfloat16 weights, ``batch_invariant="on"``:
a request's tokens and logprobs are bit-identical alone and in a busy batch whose prompts are
chunked elsewhere, which preempts it and recomputes its KV, and after a prefix-cache hit;
seeded sampling too (docs/configuration.md#batch-invariance).

With ``batch_invariant="off"`` the same test fails on this machine's kind of CPU (bfloat16
weights round the paths' last-bit differences into other logprobs), which is what it guards.
"""

from __future__ import annotations

import numpy as np
import pytest

from cpu_kernels import attention as cpu_attention
from jaxserve.config import EngineConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.eval.inputs import DEFAULT_CORPUS
from jaxserve.sampling_params import SamplingParams
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.skipif(not cpu_attention.available(),
                                reason="batch invariance needs the native CPU attention kernel "
                                       "(jaxserve build-kernels)")

PROBE_LENS = (15, 16, 17, 33, 70)  # about the 16-token block boundaries, and a longer prompt
MAX_STEPS = 3000


@pytest.fixture(scope="module")
def inv_engine():
    eng = LLMEngine(EngineConfig(
        dtype="bfloat16", batch_invariant="on", max_model_len=512, max_num_batched_tokens=64,
        max_num_seqs=8,
        num_kv_blocks=64, compilation_cache_dir=str(REPO_ROOT / ".jax_cache"), itl_slo_ms=0, ttft_slo_ms=0,
        prefill_order="fcfs"))
    eng.warmup(progress=False)
    assert eng.platform.batch_invariant(eng.config)
    return eng


def _drive(engine: LLMEngine) -> dict:
    done = {}
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished_requests():
            return done
        for out in engine.step():
            if out.finished:
                o = out.outputs[0]
                lps = [lp[t].logprob for t, lp in zip(o.token_ids, o.logprobs or ())]
                done[out.request_id] = (list(o.token_ids), lps)
    raise AssertionError(f"engine not idle after {MAX_STEPS} steps")


def test_tokens_and_logprobs_do_not_depend_on_the_load(inv_engine: LLMEngine) -> None:
    eng = inv_engine
    with open(DEFAULT_CORPUS, encoding="utf-8") as fh:
        text = eng.tokenizer.encode(fh.read())
    rng = np.random.default_rng(5)

    def cut(n: int) -> list[int]:
        start = int(rng.integers(0, len(text) - n))
        return text[start:start + n]

    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=0)
    seeded = SamplingParams(max_tokens=24, temperature=0.9, seed=1234, ignore_eos=True,
                            logprobs=0)
    probes = [cut(n) for n in PROBE_LENS]
    alone = {}
    for i, p in enumerate(probes):
        for kind, params in (("greedy", greedy), ("seeded", seeded)):
            eng.add_request(f"alone-{kind}-{i}", p, params)
            alone[(kind, i)] = _drive(eng)[f"alone-{kind}-{i}"]
    # a busy batch: long prompts chunked by the 64-token budget, arriving before and after the
    # probes, and more KV than the 63-block pool holds, so requests are preempted and recomputed
    before = eng.scheduler.num_preemptions_total
    for j in range(5):
        eng.add_request(f"busy-{j}", cut(int(rng.integers(150, 260))), SamplingParams(
            max_tokens=int(rng.integers(20, 60)), temperature=1.0, ignore_eos=True))
    eng.step()
    for i, p in enumerate(probes):
        for kind, params in (("greedy", greedy), ("seeded", seeded)):
            eng.add_request(f"busy-{kind}-{i}", p, params)
    busy = _drive(eng)
    assert eng.scheduler.num_preemptions_total > before, "the pool never ran short"
    for (kind, i), want in alone.items():
        got = busy[f"busy-{kind}-{i}"]
        assert got[0] == want[0], f"{kind} probe of {PROBE_LENS[i]} tokens: other tokens"
        assert got[1] == want[1], f"{kind} probe of {PROBE_LENS[i]} tokens: other logprobs"
    # once more alone: the prompts' full blocks are now prefix-cache hits (if not evicted)
    for i, p in enumerate(probes):
        eng.add_request(f"again-{i}", p, greedy)
        assert _drive(eng)[f"again-{i}"] == alone[("greedy", i)]
    pool = eng.scheduler.block_pool
    assert pool.num_free_blocks == pool.num_usable_blocks
