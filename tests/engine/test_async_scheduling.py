"""Async scheduling on the real SmolLM2-135M GGUF: the async loop and the synchronous one give
identical tokens, text and finish reasons, alone and in a busy batch, with stop strings, stop
token ids, EOS, max_tokens, n > 1, penalties, logprobs, min_tokens, a structured-output
request, aborts and preemptions; no output follows a finish; every block and penalty slot
comes back. Both loops run on the shared session engine (``set_async_scheduling``). The
zero-compiles check is tests/engine/test_engine.py::test_no_compiles_after_warmup, which runs
with async scheduling on (the default).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.sampling_params import SamplingParams, StructuredOutputsParams

MAX_STEPS = 3000

Result = tuple[tuple[int, ...], str, str | None, str | int | None]  # ids, text, finish, reason


@pytest.fixture
def llm(idle_engine: LLMEngine) -> LLMEngine:
    """The shared engine, checked idle afterwards (``idle_engine``)."""
    return idle_engine


def _run(llm: LLMEngine, async_on: bool, add_at: dict[int, Callable[[], None]],
         abort_at: dict[int, list[str]] | None = None) -> tuple[dict[str, list[Result]], int]:
    """Drive the engine until idle; returns each request's final choices and the number of
    steps that returned with a step still in flight. Checks that the streamed deltas add up
    to the final outputs and that nothing follows a request's finish."""
    llm.set_async_scheduling(async_on)
    add_at, abort_at = dict(add_at), dict(abort_at or {})
    streamed: dict[tuple[str, int], tuple[list[int], str]] = {}
    done: dict[str, list[Result]] = {}
    num_overlapped = 0
    for i in range(MAX_STEPS):
        if i in add_at:
            add_at.pop(i)()
        if i in abort_at:
            llm.abort_request(abort_at.pop(i))
        if not add_at and not abort_at and not llm.has_unfinished_requests():
            break
        for out in llm.step():
            assert out.request_id not in done, f"{out.request_id}: output after its finish"
            for c in out.outputs:
                ids, text = streamed.setdefault((out.request_id, c.index), ([], ""))
                ids.extend(c.delta_token_ids)
                streamed[out.request_id, c.index] = (ids, text + c.delta_text)
            if out.finished:
                done[out.request_id] = [(tuple(c.token_ids), c.text, c.finish_reason,
                                         c.stop_reason) for c in out.outputs]
                for c in out.outputs:
                    assert streamed[out.request_id, c.index] == (c.token_ids, c.text)
        num_overlapped += llm._inflight is not None
    else:
        raise AssertionError(f"engine not idle after {MAX_STEPS} steps")
    return done, num_overlapped


def _busy_batch(llm: LLMEngine) -> tuple[dict[int, Callable[[], None]], list[str]]:
    """Requests joining at different steps with every per-request feature that interacts with
    reading tokens one step late; returns their add schedule and the ids added."""
    rng = np.random.default_rng(20261201)
    vocab = llm.tokenizer.vocab_size
    tok = llm.tokenizer
    text = lambda s: tok.encode(s, add_special_tokens=False)
    chat = text("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                "<|im_start|>assistant\n")
    greedy = {"temperature": 0.0}
    reqs: list[tuple[str, list[int], SamplingParams]] = [
        ("greedy", text("The history of the printing press begins"),
         SamplingParams(max_tokens=24, ignore_eos=True, **greedy)),
        ("seeded", text("Once upon a time"),
         SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)),
        ("eos", chat, SamplingParams(max_tokens=40, **greedy)),
        ("stop-str", text("The capital of France is"),
         SamplingParams(max_tokens=24, stop=["Paris", "\n"], **greedy)),
        ("stop-id", text("1, 2, 3, 4,"),
         SamplingParams(max_tokens=24, stop_token_ids=text(" 7"), ignore_eos=True, **greedy)),
        ("max1", text("Hello"), SamplingParams(max_tokens=1, ignore_eos=True, **greedy)),
        ("n3", text("My favourite colour is"),
         SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=11, ignore_eos=True)),
        ("penalties", text("the the the the the"),
         SamplingParams(max_tokens=16, repetition_penalty=1.3, frequency_penalty=0.5,
                        presence_penalty=0.3, ignore_eos=True, logit_bias={13: 2.0}, **greedy)),
        ("logprobs", text("Water boils at"),
         SamplingParams(max_tokens=10, logprobs=3, prompt_logprobs=2, ignore_eos=True,
                        temperature=0.7, seed=3)),
        ("min-tokens", chat, SamplingParams(max_tokens=30, min_tokens=12, **greedy)),
        ("json", text("A colour:"),
         SamplingParams(max_tokens=16, structured_outputs=StructuredOutputsParams(
             regex="(red|green|blue)( and (red|green|blue))?"), **greedy)),
    ]
    for i in range(6):  # unseeded-free fillers: random prompts, some sampled with seeds
        sp = SamplingParams(max_tokens=int(rng.integers(2, 20)), ignore_eos=True,
                            temperature=0.8 if i % 2 else 0.0, seed=100 + i)
        reqs.append((f"fill-{i}", rng.integers(0, vocab, int(rng.integers(5, 120))).tolist(),
                     sp))

    def add(lo: int, hi: int) -> Callable[[], None]:
        return lambda: [llm.add_request(rid, ids, sp) for rid, ids, sp in reqs[lo:hi]]

    return {0: add(0, 6), 2: add(6, 11), 5: add(11, 14), 9: add(14, len(reqs))}, \
        [rid for rid, _, _ in reqs]


def test_busy_batch_gives_the_synchronous_outputs(llm: LLMEngine) -> None:
    add_at, ids = _busy_batch(llm)
    sync, overlapped_sync = _run(llm, False, add_at)
    add_at, _ = _busy_batch(llm)
    asyn, overlapped = _run(llm, True, add_at)
    assert overlapped_sync == 0 and overlapped >= 20, "the async loop should overlap steps"
    assert set(sync) == set(asyn) == set(ids)
    for rid in ids:
        assert asyn[rid] == sync[rid], rid
    # the stops really happened, each at its own kind of condition
    assert sync["stop-str"][0][2] == "stop" and "Paris" not in sync["stop-str"][0][1]
    assert sync["stop-id"][0][2:] == ("stop", sync["stop-id"][0][0][-1])
    assert sync["eos"][0][2] == "stop" and sync["eos"][0][3] is None
    assert sync["max1"][0][2] == "length" and len(sync["max1"][0][0]) == 1
    assert len({c[0] for c in sync["n3"]}) == 3
    assert len(sync["min-tokens"][0][0]) >= 12


def test_aborts_give_the_synchronous_prefix_and_free_everything(llm: LLMEngine) -> None:
    """Requests aborted while decoding, in chunked prefill (the first chunk still in flight)
    and right after being added (their prefill in flight): the survivors get the synchronous
    loop's tokens."""
    rng = np.random.default_rng(5)
    vocab = llm.tokenizer.vocab_size
    prompts = {rid: rng.integers(0, vocab, n).tolist()
               for rid, n in (("keep", 40), ("decoding", 30), ("prefill", 900), ("fresh", 20),
                              ("keep2", 12))}
    sp = SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.0)
    seeded = SamplingParams(max_tokens=20, ignore_eos=True, temperature=1.0, seed=5)

    def add(*rids: str) -> Callable[[], None]:
        return lambda: [llm.add_request(r, prompts[r], seeded if r == "keep2" else sp)
                        for r in rids]

    add_at = {0: add("keep", "decoding", "prefill", "keep2"), 4: add("fresh")}
    abort_at = {1: ["prefill"], 5: ["fresh"], 7: ["decoding"]}
    sync, _ = _run(llm, False, add_at, abort_at)
    asyn, _ = _run(llm, True, add_at, abort_at)
    assert set(sync) == set(asyn) == {"keep", "keep2"}
    assert asyn == sync


def test_preemption_gives_the_synchronous_outputs(llm: LLMEngine) -> None:
    """Five long greedy requests outgrow the 159-block pool while decoding, so some are
    preempted and recomputed; both loops give the same tokens."""
    rng = np.random.default_rng(3)
    vocab = llm.tokenizer.vocab_size
    prompts = [rng.integers(0, vocab, 480).tolist() for _ in range(5)]
    sp = SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.0)

    def add() -> None:
        for i, p in enumerate(prompts):
            llm.add_request(f"long-{i}", p, sp)

    results, preemptions = {}, {}
    for async_on in (False, True):
        before = llm.scheduler.num_preemptions_total
        results[async_on], _ = _run(llm, async_on, {0: add})
        preemptions[async_on] = llm.scheduler.num_preemptions_total - before
    assert preemptions[False] >= 1 and preemptions[True] >= 1
    assert results[True] == results[False]
    assert all(len(r[0][0]) == 40 for r in results[True].values())
