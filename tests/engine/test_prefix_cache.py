"""Prefix caching, the host tier, swapping and admission on the real SmolLM2-135M engine.

Greedy outputs must not depend on where a request's K/V came from: computed, shared from the
prefix cache, loaded back from the host tier, or swapped out and back in. Every comparison is
exact; the workloads are fixed, so a near tie (which float32 rounding could break either way)
would fail every run, not now and then. Counters prove that each path ran.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from jaxserve.config import EngineConfig
from jaxserve.core.kv_manager import KVStats
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.metrics import EngineMetrics
from jaxserve.loading.load import LoadedModel
from tests.engine.test_engine import _drive, _greedy, llm  # noqa: F401  (llm: the shared-engine fixture)
from tests.support.kv import kv_manager

BLOCK = 16  # the engines' block size (EngineConfig default)


def expected_hits(prompts: list[list[int]]) -> list[int]:
    """Cached tokens each prompt should find when the prompts run one after another: its
    longest common prefix with an earlier prompt, in whole blocks, leaving >= 1 token."""
    out = []
    for i, p in enumerate(prompts):
        common = max((next((k for k, (a, b) in enumerate(zip(p, q)) if a != b),
                           min(len(p), len(q))) for q in prompts[:i]), default=0)
        out.append(min(common // BLOCK, (len(p) - 1) // BLOCK) * BLOCK)
    return out


def run_sequentially(engine: LLMEngine, prompts: list[list[int]], max_tokens: int
                     ) -> list[list[int]]:
    """Greedy outputs, each request added after the one before has finished."""
    outs = []
    for i, p in enumerate(prompts):
        engine.add_request(f"seq-{i}", p, _greedy(max_tokens))
        outs.append(_drive(engine)[f"seq-{i}"].outputs[0].token_ids)
    return outs


@pytest.mark.parametrize("system_len", [4 * BLOCK - 1, 4 * BLOCK, 4 * BLOCK + 1])
def test_prefix_caching_on_and_off_give_the_same_tokens(
    system_len: int, llm: LLMEngine, goldens: dict  # noqa: F811
) -> None:
    """A shared system prompt (a multiple of the block size, one less, one more) before three
    different questions, then a repeat of the first request: the same greedy tokens with prefix
    caching off and on; with it on each request finds exactly its shared whole blocks."""
    by_name = {p["name"]: p["prompt_token_ids"] for p in goldens["prompts"]}
    system = by_name["long_prose"][:system_len]
    questions = [by_name[n] for n in ("france_text", "alphabet_text", "mixed_unicode")]
    prompts = [system + q for q in questions] + [system + questions[0]]
    results: dict[bool, tuple[list[list[int]], KVStats]] = {}
    for caching in (False, True):
        with kv_manager(llm, caching=caching) as kv:
            results[caching] = (run_sequentially(llm, prompts, 6), kv.stats)
    (off, st_off), (on, st_on) = results[False], results[True]
    assert on == off
    assert on[3] == on[0]  # the repeated request
    assert (st_off.prefix_cache_queries, st_off.prefix_cache_hits) == (0, 0)
    hits = expected_hits(prompts)
    assert hits[1] == system_len // BLOCK * BLOCK and hits[3] == (len(prompts[3]) - 1) // BLOCK \
        * BLOCK
    assert st_on.prefix_cache_queries == sum(map(len, prompts))
    assert st_on.prefix_cache_hits == sum(hits) > 0


def test_whole_prompt_cached_still_yields_logits(llm: LLMEngine, goldens: dict) -> None:  # noqa: F811
    """A prompt that is all full blocks and fully cached recomputes its last block and still
    produces the golden continuation; an idle engine with a warm cache reads 0 usage."""
    p = next(g for g in goldens["prompts"] if g["name"] == "long_prose")
    prompt = p["prompt_token_ids"][:13 * BLOCK]
    with kv_manager(llm, caching=True) as kv:
        first, again = run_sequentially(llm, [prompt, prompt], 8)
        assert first == again
        assert kv.stats.prefix_cache_hits == 12 * BLOCK
        assert kv.device.usage == 0.0 and kv.device.num_cached_blocks >= 13


def test_prompt_logprobs_and_penalties_bypass_the_cache(llm: LLMEngine, goldens: dict) -> None:  # noqa: F811
    """Requests whose prompt tokens must all go through the model (prompt logprobs, penalty
    counts) compute the whole prompt even when it is cached, and still get every entry."""
    prompt = next(g for g in goldens["prompts"] if g["name"] == "long_prose")["prompt_token_ids"]
    prompt = prompt[:3 * BLOCK + 5]
    with kv_manager(llm, caching=True) as kv:
        run_sequentially(llm, [prompt], 2)
        llm.add_request("plp", prompt, _greedy(2, prompt_logprobs=1))
        llm.add_request("pen", prompt, _greedy(2, repetition_penalty=1.3))
        done = _drive(llm)
        assert kv.stats.prefix_cache_hits == 0  # neither looked in the cache
    plp = done["plp"].prompt_logprobs
    assert len(plp) == len(prompt) and plp[0] is None and all(e is not None for e in plp[1:])


def test_swapping_kv_managers_leaves_no_stale_prefix(llm: LLMEngine, goldens: dict) -> None:  # noqa: F811
    """A manager put back after another one ran finds none of the blocks that one rewrote: a
    prompt cached before the swap computes the same tokens after it."""
    by_name = {p["name"]: p["prompt_token_ids"] for p in goldens["prompts"]}
    prompt, other = by_name["france_chat"], by_name["long_prose"][:3 * BLOCK]
    with kv_manager(llm, caching=True):  # fresh pool: the prompt's blocks are 1, 2, 3
        [first] = run_sequentially(llm, [prompt], 8)
        with kv_manager(llm, caching=False):  # fresh pool: rewrites blocks 1, 2, 3
            run_sequentially(llm, [other], 8)
        [again] = run_sequentially(llm, [prompt], 8)
    assert again == first


# -- a small device pool with a host tier ------------------------------------------------------

SMALL_NUM_KV_BLOCKS = 24  # 23 usable blocks: 368 tokens
SMALL_HOST_GIB = 0.03  # 43 host blocks of SmolLM2's 720 KiB (float32)


@pytest.fixture(scope="module")
def small(engine: LLMEngine, monkeypatch_module) -> LLMEngine:
    """An engine with a 23-block device pool and a host tier, on the shared engine's loaded
    weights (the loader is patched to hand them over: loading again costs ~10-30 s here)."""
    import jaxserve.engine.startup as engine_module

    loaded = LoadedModel(engine.model_config, engine.runner.params, engine.tokenizer,
                         engine.model_name)
    monkeypatch_module.setattr(engine_module, "load_model", lambda *a, **kw: loaded)
    eng = LLMEngine(
        EngineConfig(max_model_len=512, num_kv_blocks=SMALL_NUM_KV_BLOCKS,
                     max_num_batched_tokens=128, max_num_seqs=8,
                     kv_offloading_size=SMALL_HOST_GIB,
                     # the swap and offload scenarios below are worked out for arrival order
                     # and plans that do not depend on measured step times
                     prefill_order="fcfs", itl_slo_ms=0, ttft_slo_ms=0,
                     compilation_cache_dir=engine.config.compilation_cache_dir),
        metrics=EngineMetrics(engine.model_name))
    eng.warmup(progress=False)
    return eng


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def _pressure_workload(goldens: dict) -> list[tuple[str, list[int], int]]:
    """Five requests whose prompts fit together (19 blocks of 23) but whose outputs do not:
    decoding preempts; then two repeats of the first prompts, whose blocks were evicted."""
    by_name = {p["name"]: p["prompt_token_ids"] for p in goldens["prompts"]}
    lp = by_name["long_prose"]
    prompts = [lp[:60], lp[40:100], by_name["system_two_turn"], lp[100:160], lp[160:200]]
    reqs = [(f"p{i}", ids, 24) for i, ids in enumerate(prompts)]
    return reqs + [("again0", prompts[0], 6), ("again1", prompts[1], 6)]


def _run(engine: LLMEngine, reqs: list[tuple[str, list[int], int]]) -> dict[str, list[int]]:
    first, repeats = reqs[:5], reqs[5:]
    add = {0: lambda: [engine.add_request(r, ids, _greedy(n)) for r, ids, n in first]}
    out = {r: o.outputs[0].token_ids for r, o in _drive(engine, add_at=add).items()}
    for r, ids, n in repeats:  # after the pool has turned over
        engine.add_request(r, ids, _greedy(n))
        out[r] = _drive(engine)[r].outputs[0].token_ids
    return out


def test_small_pool_swaps_and_offloads_without_changing_tokens(
    small: LLMEngine, llm: LLMEngine, goldens: dict  # noqa: F811
) -> None:
    """The same greedy tokens from: the big shared engine (no pressure), the small pool with
    its host tier (preemption swaps, evicted blocks go to the host and come back), and the
    small pool without one (preemption recomputes)."""
    reqs = _pressure_workload(goldens)
    with kv_manager(llm, caching=True):
        reference = _run(llm, reqs)
    preempted = small.scheduler.num_preemptions_total
    with kv_manager(small, caching=True) as kv:
        with_host = _run(small, reqs)
        host_stats = kv.stats
        assert kv.host.num_free_blocks == kv.host.num_usable_blocks  # no host block leaked
    assert with_host == reference
    assert small.scheduler.num_preemptions_total > preempted
    assert host_stats.num_swaps >= 1 and host_stats.num_swapped_in_blocks > 0
    assert host_stats.num_offloaded_blocks > 0 and host_stats.host_cache_hits > 0
    preempted = small.scheduler.num_preemptions_total
    with kv_manager(small, caching=True, num_host_blocks=0) as kv:
        without_host = _run(small, reqs)
        assert kv.stats.num_swaps == 0 and kv.stats.host_cache_hits == 0
    assert without_host == reference
    assert small.scheduler.num_preemptions_total > preempted
    pool = small.scheduler.block_pool
    assert pool.num_free_blocks == pool.num_usable_blocks and pool.usage == 0.0
    sample = lambda name: small.metrics.registry.get_sample_value(
        f"jaxserve:{name}", {"model_name": small.model_name})
    for name in ("num_swaps_total", "host_prefix_cache_hits_total", "kv_offloaded_blocks_total",
                 "prefix_cache_hits_total", "num_preemptions_total"):
        assert sample(name) > 0, name
    assert sample("kv_cache_usage_perc") == 0.0


def test_request_that_can_never_fit_is_refused_with_the_numbers(small: LLMEngine) -> None:
    """The small pool holds 368 tokens, less than max_model_len (512): a request that needs
    more is refused at once (the server answers 400), and max_tokens=None means what fits."""
    ids = list(range(100, 400))  # 300 tokens
    with pytest.raises(ValueError, match=r"prompt \(300 tokens\) \+ max_tokens \(100\) = 400 "
                                         r"tokens can never fit in the KV cache of 368 tokens"):
        small.add_request("too-long", ids, _greedy(100))
    with pytest.raises(ValueError, match="prompt has 400 tokens; the KV cache holds 368"):
        small.add_request("prompt-too-long", list(range(100, 500)), _greedy(1))
    assert small.validate(ids, _greedy(None)) == 68
    assert small.validate(ids, _greedy(68)) == 68
    assert not small.has_unfinished_requests() and not small.requests
