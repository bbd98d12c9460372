"""Sampling features through the offline API on the real model (the shared session engine):
greedy four ways, a seeded request independent of its batch-mates, n choices distinct and
reproducible, the penalties' semantics, logprob entries that agree with the tokens, many choices
finishing, logit_bias, and prompt logprobs (echo) checked against the logprobs of generated
tokens. Semantics as docs/api.md#behaviour-chosen-where-the-openai-api-leaves-room.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest

from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.llm import LLM
from jaxserve.sampling_params import SamplingParams as SP

PROMPT = "The history of the printing press begins"


@pytest.fixture(scope="module")
def llm(engine: LLMEngine) -> LLM:
    return LLM.from_engine(engine)


@pytest.fixture(autouse=True)
def _engine_left_idle(engine: LLMEngine):
    yield
    assert not engine.has_unfinished_requests() and not engine.requests
    pool = engine.scheduler.block_pool
    assert pool.num_free_blocks == pool.num_usable_blocks
    assert not engine.slots.holders and len(engine.slots.free) == engine.runner.num_penalty_slots


def _ids(llm: LLM, prompt, sp: SP) -> list[int]:
    return llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids


def test_argmax_four_ways(llm: LLM) -> None:
    """temperature 0 == (T=1, top_k=1) == (T=0.7, top_p=1e-9) == min_p=1, each alone."""
    n = 12
    greedy = _ids(llm, PROMPT, SP(temperature=0, max_tokens=n, ignore_eos=True))
    assert len(greedy) == n
    for sp in (SP(temperature=1.0, top_k=1, max_tokens=n, ignore_eos=True, seed=1),
               SP(temperature=0.7, top_p=1e-9, max_tokens=n, ignore_eos=True, seed=2),
               SP(min_p=1.0, max_tokens=n, ignore_eos=True, seed=3)):
        assert _ids(llm, PROMPT, sp) == greedy, sp
    with pytest.raises(ValueError, match="top_p"):
        SP(top_p=0.0)  # top_p = 0 is refused (HTTP 400), not read as greedy


def test_seeded_request_ignores_its_batch_mates(llm: LLM) -> None:
    a = SP(temperature=0.8, seed=42, max_tokens=8, ignore_eos=True)
    runs = []
    for b_seed, b_prompt in ((None, "Hi"), (7, PROMPT * 3), (8, "Tell me a story about a cat")):
        outs = llm.generate([PROMPT, b_prompt],
                            [a, SP(temperature=0.8, seed=b_seed, max_tokens=10)], use_tqdm=False)
        runs.append(outs[0].outputs[0].token_ids)
    runs.append(_ids(llm, PROMPT, a))  # alone
    assert all(r == runs[0] for r in runs), runs


def test_n_choices_distinct_and_reproducible(llm: LLM) -> None:
    sp = SP(n=8, temperature=1.0, max_tokens=8, ignore_eos=True, seed=123)
    out = llm.generate([PROMPT], sp, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == list(range(8))
    texts = [tuple(c.token_ids) for c in out.outputs]
    assert len(set(texts)) >= 4, texts
    again = llm.generate([PROMPT], sp, use_tqdm=False)[0]
    assert [tuple(c.token_ids) for c in again.outputs] == texts  # the set, choice by choice
    # choice 0 is what an n=1 request with the same seed draws
    assert _ids(llm, PROMPT, SP(temperature=1.0, max_tokens=8, ignore_eos=True,
                                seed=123)) == list(texts[0])
    unseeded = llm.generate([PROMPT], SP(n=8, temperature=1.0, max_tokens=8, ignore_eos=True),
                            use_tqdm=False)[0]
    assert len({tuple(c.token_ids) for c in unseeded.outputs}) >= 4


BANANA = "banana banana banana banana. The fruit I like best is"


def test_penalty_semantics(llm: LLM) -> None:
    base = _ids(llm, BANANA, SP(temperature=0, max_tokens=1))
    for kw in ({"presence_penalty": 2.0}, {"frequency_penalty": 2.0},
               {"presence_penalty": -2.0}):
        # no generated token yet: presence / frequency cannot change the first token
        assert _ids(llm, BANANA, SP(temperature=0, max_tokens=1, **kw)) == base, kw
    # the repetition penalty counts the prompt: " banana", greedy's next token, is pushed down
    bananas = "banana banana banana banana banana banana"
    rep = _ids(llm, bananas, SP(temperature=0, max_tokens=1))
    assert llm.get_tokenizer().decode(rep) == " banana"
    assert _ids(llm, bananas, SP(temperature=0, max_tokens=1, repetition_penalty=1.5)) != rep
    assert _ids(llm, bananas, SP(temperature=0, max_tokens=1, presence_penalty=2.0)) == rep

    def most_repeats(**kw) -> int:
        ids = _ids(llm, "Repeat after me: yes yes yes yes yes yes yes",
                   SP(temperature=0, max_tokens=12, ignore_eos=True, **kw))
        return Counter(ids).most_common(1)[0][1]

    assert most_repeats(frequency_penalty=2.0) < most_repeats()


def test_logit_bias_forces_and_bans_tokens(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    target = tok.encode(" zebra")[0]
    ids = _ids(llm, PROMPT, SP(temperature=0, max_tokens=4, logit_bias={target: 100.0}))
    assert ids == [target] * 4
    # several choices, one slot each: every choice is forced
    out = llm.generate([PROMPT], SP(n=3, temperature=1.0, max_tokens=3,
                                    logit_bias={target: 100.0}), use_tqdm=False)[0]
    assert all(c.token_ids == [target] * 3 for c in out.outputs)
    greedy = _ids(llm, PROMPT, SP(temperature=0, max_tokens=4, ignore_eos=True))
    banned = _ids(llm, PROMPT, SP(temperature=0, max_tokens=4, ignore_eos=True,
                                  logit_bias={greedy[0]: -100.0}))
    assert banned[0] != greedy[0]
    # a later request in the same slot gets a clean bias row
    assert _ids(llm, PROMPT, SP(temperature=0, max_tokens=4, ignore_eos=True,
                                presence_penalty=0.01)) [:1] == greedy[:1]
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate([PROMPT], SP(logit_bias={tok.vocab_size: 1.0}), use_tqdm=False)


def test_logprob_entries_agree_with_the_tokens(llm: LLM) -> None:
    tok = llm.engine.tokenizer
    out = llm.generate([PROMPT], SP(temperature=0, max_tokens=16, logprobs=5),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids)
    total = 0.0
    for t, entry in zip(out.token_ids, out.logprobs):
        top = list(entry.items())
        assert len(top) == 5 and top[0][0] == t  # greedy: the token is the top entry
        assert entry[t].rank == 1 and entry[t].logprob == top[0][1].logprob <= 0
        assert [v.logprob for _, v in top] == sorted((v.logprob for _, v in top), reverse=True)
        total += entry[t].logprob
    assert math.isclose(out.cumulative_logprob, total, rel_tol=1e-6)
    joined = b"".join(tok.token_bytes(t) for t in out.token_ids)
    if out.finish_reason == "length":
        assert joined.decode("utf-8", "replace") == out.text
    # raw distribution: temperature, top_p, top_k and penalties do not change the values
    sampled = llm.generate([PROMPT], SP(temperature=0.5, top_p=0.5, top_k=3, max_tokens=1,
                                        repetition_penalty=1.3, logprobs=5),
                           use_tqdm=False)[0].outputs[0]
    ref = out.logprobs[0]
    assert list(ref) == list(sampled.logprobs[0])[:5]
    for t, v in sampled.logprobs[0].items():
        assert math.isclose(v.logprob, ref[t].logprob, abs_tol=1e-4)


def test_prompt_logprobs_match_generation_logprobs_across_chunks(llm: LLM,
                                                                 engine: LLMEngine) -> None:
    """The prompt logprob of token x at position p equals the logprob the engine gave x when
    it generated x at p; the prompt is longer than one step's token budget, so the checked
    position's logits come from the last token of the first chunk."""
    tok = llm.get_tokenizer()
    budget = engine.config.max_num_batched_tokens
    base = tok.encode("The river wound slowly through the quiet valley. " * 60)[:budget]
    gen = llm.generate([{"prompt_token_ids": base}], SP(temperature=0, max_tokens=1, logprobs=0),
                       use_tqdm=False)[0].outputs[0]
    x = gen.token_ids[0]
    full = base + [x]
    out = llm.generate([{"prompt_token_ids": full}],
                       SP(temperature=0, max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    plp = out.prompt_logprobs
    assert len(plp) == len(full) and plp[0] is None
    assert all(e is not None and full[i] in e for i, e in enumerate(plp) if i)
    assert math.isclose(plp[-1][x].logprob, gen.logprobs[0][x].logprob, abs_tol=1e-3)
    assert all(len(e) in (2, 3) and all(v.logprob <= 0 for v in e.values()) for e in plp[1:])


def test_many_choices_finish(llm: LLM, engine: LLMEngine) -> None:
    """n above max_num_seqs: the choices queue like requests and all finish, in a number of
    steps proportional to the work (no hang)."""
    n = engine.config.max_num_seqs + 16
    rid = engine.next_request_id()
    engine.add_request(rid, llm.get_tokenizer().encode("Hi"),
                       SP(n=n, temperature=1.0, max_tokens=3, ignore_eos=True))
    steps, final = 0, None
    while engine.has_unfinished_requests():
        steps += 1
        assert steps <= 20, "n choices should finish in a few steps"
        for o in engine.step():
            if o.finished:
                final = o
    assert final is not None and len(final.outputs) == n
    assert all(len(c.token_ids) == 3 and c.finish_reason == "length" for c in final.outputs)
