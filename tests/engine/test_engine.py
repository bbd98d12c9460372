"""The engine on the real SmolLM2-135M GGUF: greedy goldens alone and in a busy continuous batch,
no compiles after warm-up, preemption, seeds, stop conditions and aborts.

Every test drives the one session ``engine`` (tests/conftest.py) through the ``llm`` fixture,
which checks afterwards that the engine is idle with every KV block back in the pool. Waiting is
counted in engine steps, never seconds.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence

import jax
import numpy as np
import pytest

from jaxserve.core.step_cost import OnlineStepCost, StepCostModel
from jaxserve.core.step_policy import StepPolicy
from jaxserve.device.buckets import Bucket
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams, StructuredOutputsParams

NEAR_TIE = 1e-3  # golden top-2 margins below this may flip under float32 rounding
MAX_STEPS = 3000  # a bound on any loop here; a hang fails instead of spinning forever
GOLDEN_NAMES = [
    "france_text",
    "long_prose",
    "mixed_unicode",
    "france_chat",
    "system_two_turn",
    "alphabet_text",
]


def golden_prefix_len(margins: Sequence[float], threshold: float = NEAR_TIE) -> int:
    """How many golden greedy tokens an engine must reproduce exactly: the tokens before the
    first step whose golden top-2 logit margin is below ``threshold`` (a near tie that float32
    rounding may break either way, after which the continuations legitimately diverge)."""
    return next((i for i, m in enumerate(margins) if m < threshold), len(margins))


def _golden(goldens: dict, name: str) -> dict:
    return next(p for p in goldens["prompts"] if p["name"] == name)


def _greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def _check_golden(out: RequestOutput, p: dict) -> None:
    gold = p["greedy_token_ids"]
    got = out.outputs[0].token_ids
    k = golden_prefix_len(p["top2_margins"])
    assert out.finished and out.outputs[0].finish_reason == "length"
    assert len(got) == len(gold)
    assert got[:k] == gold[:k], (
        f"{p['name']}: first difference at output position "
        f"{next(i for i, (a, b) in enumerate(zip(got, gold)) if a != b)} (golden-exact prefix {k})"
    )


def _drive(
    engine: LLMEngine,
    *,
    add_at: dict[int, Callable[[], None]] | None = None,
    on_step: Callable[[int], None] | None = None,
) -> dict[str, RequestOutput]:
    """Step until idle; ``add_at[i]()`` runs before step ``i``, ``on_step(i)`` after it.
    Returns each finished request's last output. Fails on an unfinished request that stops
    producing outputs for good (``MAX_STEPS``)."""
    add_at = dict(add_at or {})
    done: dict[str, RequestOutput] = {}
    for i in range(MAX_STEPS):
        if i in add_at:
            add_at.pop(i)()
        if not add_at and not engine.has_unfinished_requests():
            return done
        for out in engine.step():
            assert out.request_id not in done, f"{out.request_id} output after finishing"
            if out.finished:
                done[out.request_id] = out
        if on_step is not None:
            on_step(i)
    raise AssertionError(f"engine not idle after {MAX_STEPS} steps")


def _random_prompt(rng: np.random.Generator, vocab: int, lo: int, hi: int) -> list[int]:
    return rng.integers(0, vocab, int(rng.integers(lo, hi + 1))).tolist()


@pytest.fixture
def llm(idle_engine: LLMEngine) -> LLMEngine:
    """The shared engine, checked idle afterwards (``idle_engine``)."""
    return idle_engine


# -- helper ----------------------------------------------------------------------------------


def test_golden_prefix_len() -> None:
    assert golden_prefix_len([]) == 0
    assert golden_prefix_len([0.5, 2.0, 1e-3]) == 3  # 1e-3 itself is decisive
    assert golden_prefix_len([0.5, 2.0, 9e-4, 3.0]) == 2
    assert golden_prefix_len([1e-5, 2.0]) == 0
    assert golden_prefix_len([0.5, 0.04], threshold=0.05) == 1


# -- greedy goldens --------------------------------------------------------------------------


@pytest.mark.parametrize("name", GOLDEN_NAMES)
def test_greedy_alone_matches_golden(name: str, llm: LLMEngine, goldens: dict,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Alone, a request decodes in the CPU's 1-token bucket (``device.buckets``) and keeps
    the golden tokens."""
    p = _golden(goldens, name)
    used: list[Bucket] = []
    execute = llm.runner.execute
    monkeypatch.setattr(llm.runner, "execute",
                        lambda b, packed, allowed=None: used.append(b) or execute(b, packed,
                                                                                  allowed))
    llm.add_request(name, p["prompt_token_ids"], _greedy(len(p["greedy_token_ids"])))
    done = _drive(llm)
    _check_golden(done[name], p)
    assert used.count(Bucket(1, 1)) == len(p["greedy_token_ids"]) - 1, used


def test_greedy_batched_matches_golden(llm: LLMEngine, goldens: dict) -> None:
    """The golden prompts join a busy batch at different steps (mixed prefill chunks and
    decodes, 16 other requests of 5..400 random tokens, some sampled with seeds), and still
    produce their golden continuations."""
    rng = np.random.default_rng(20240601)
    vocab = llm.tokenizer.vocab_size
    # prompt lengths spread log-uniformly over 5..400 (about 1500 tokens in all: the CPU
    # prefills ~120 tokens/s, so this is what keeps the test near half a minute)
    lengths = rng.permutation(np.geomspace(5, 400, 16).round().astype(int))
    others = []
    for i, n in enumerate(lengths):
        sampled = i % 3 == 0
        params = SamplingParams(
            max_tokens=int(rng.integers(1, 65)),
            ignore_eos=i % 5 != 0,
            temperature=0.8 if sampled else 0.0,
            seed=1000 + i if sampled else None,
            top_k=50 if i % 6 == 0 else 0,
        )
        others.append((f"other-{i}", rng.integers(0, vocab, n).tolist(), params))
    prompts = {p["name"]: p for p in goldens["prompts"]}

    def add_others(lo: int, hi: int) -> Callable[[], None]:
        return lambda: [llm.add_request(rid, ids, sp) for rid, ids, sp in others[lo:hi]]

    def add_golden(names: list[str]) -> Callable[[], None]:
        def add() -> None:
            for n in names:
                llm.add_request(
                    n, prompts[n]["prompt_token_ids"], _greedy(len(prompts[n]["greedy_token_ids"]))
                )

        return add

    steps_with_golden_running = []

    def on_step(i: int) -> None:
        running = {s.seq_id for s in llm.scheduler.running}
        if running & set(GOLDEN_NAMES) and len(running) > 1:
            steps_with_golden_running.append(i)

    add_at = {
        0: add_others(0, 5),
        3: add_golden(["long_prose", "france_text"]),
        4: add_others(5, 9),
        9: add_golden(["mixed_unicode", "france_chat"]),
        10: add_others(9, 13),
        14: add_golden(["system_two_turn", "alphabet_text"]),
        20: add_others(13, 16),
    }
    done = _drive(llm, add_at=add_at, on_step=on_step)
    assert set(done) == set(GOLDEN_NAMES) | {rid for rid, _, _ in others}
    for name in GOLDEN_NAMES:
        _check_golden(done[name], prompts[name])
    for rid, ids, sp in others:
        out = done[rid].outputs[0]
        assert 1 <= len(out.token_ids) <= sp.max_tokens
        if sp.ignore_eos:
            assert out.finish_reason == "length" and len(out.token_ids) == sp.max_tokens
    assert len(steps_with_golden_running) >= 20  # goldens really shared steps with others


@pytest.mark.parametrize("slo", [False, True], ids=["gap-fcfs", "both-slo-order"])
def test_objectives_keep_goldens_and_compile_nothing(
    llm: LLMEngine, goldens: dict, monkeypatch: pytest.MonkeyPatch, slo: bool
) -> None:
    """The busy batch above under a 30 ms gap objective (the CPU prior predicts 24 ms for an
    empty step, so prefill beside decodes is cut to its minimum chunks): the same golden
    tokens, and only compiled buckets run. ``slo``: with a 1 s first-token objective too, the
    SLO order and the model refitted online every 4 steps, as ``jaxserve serve`` runs."""
    prior = StepCostModel.prior(32, 0.75e-3)
    cfg = dataclasses.replace(llm.scheduler.config, itl_slo_s=0.03, step_cost=prior,
                              ttft_slo_s=1.0 if slo else 0.0,
                              prefill_order="slo" if slo else "fcfs")
    policy = StepPolicy(cfg)
    # the policy's own online model (fixed without ``slo``: no refit in the test's steps)
    online = OnlineStepCost(prior, refit_every=4) if slo else \
        OnlineStepCost(prior, refit_every=10**9, refit_after_s=1e9)
    monkeypatch.setattr(policy, "_cost", online)
    monkeypatch.setattr(llm.scheduler, "config", cfg)
    monkeypatch.setattr(llm.scheduler, "policy", policy)
    budgets: list[int] = []  # prefill tokens each step may take
    budget_of = policy.prefill_budget
    monkeypatch.setattr(policy, "prefill_budget",
                        lambda *a: budgets.append(budget_of(*a)) or budgets[-1])
    compiles_before = llm.runner.num_compiles
    test_greedy_batched_matches_golden(llm, goldens)
    assert llm.runner.num_compiles == compiles_before
    assert sum(b < cfg.max_num_batched_tokens for b in budgets) >= 20  # prefill was cut
    if slo:  # the steps were measured and the scheduler planned with the refitted model (the
        # fit returns the prior where the measured steps say tokens cost nothing, as on a
        # machine loaded by something else: refitting is what is checked, not the figures)
        assert online.num_observed >= 20 and online.num_fits >= 4
        assert llm.scheduler.step_cost is online.model


def test_start_up_calibration_fits_the_step_cost_and_compiles_nothing(
    llm: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``probe`` (run at start-up) times prompt steps of 1 and 128 tokens on the padding
    block and plans with the fitted model from then on; probes beyond what a program holds
    are refused."""
    prior = StepCostModel.prior(32, 0.75e-3)
    online = OnlineStepCost(prior)
    monkeypatch.setattr(llm.scheduler.policy, "_cost", online)
    compiles_before = llm.runner.num_compiles
    assert llm.probe() > 0
    model = llm.scheduler.step_cost
    assert model is online.model is online.prior and model != prior
    assert model.per_token_s > 0 and model.predict(128) > model.predict(1)
    assert llm.runner.num_compiles == compiles_before
    with pytest.raises(ValueError, match="num_tokens"):
        llm.runner.probe(0)
    with pytest.raises(ValueError, match="num_tokens"):
        llm.runner.probe(10**6)


# -- compilation -----------------------------------------------------------------------------


def test_no_compiles_after_warmup(llm: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A random workload (prompt lengths across every token bucket, chunked prefill, mixed
    sampling settings, stop strings, structured outputs, aborts of waiting and running
    requests) triggers no tracing, lowering, compilation or compilation-cache lookup."""
    watched = ("/jax/core/compile/", "/jax/compilation_cache/")
    events: collections.Counter[str] = collections.Counter()

    def on_duration(event: str, duration: float, **kwargs) -> None:
        if event.startswith(watched):
            events[event] += 1

    def on_event(event: str, **kwargs) -> None:
        if event.startswith(watched):
            events[event] += 1

    rng = np.random.default_rng(7)
    vocab = llm.tokenizer.vocab_size
    # added in groups (see add_at below) so that steps fill every token bucket, 8 .. 512;
    # c9 (600 tokens) is prefilled in chunks
    lengths = [1, 3, 9, 17, 40, 100, 200, 6, 12, 600, 70, 25, 33, 8, 5, 7, 11, 4, 9, 14]
    requests = []
    for i, n in enumerate(lengths):
        params = SamplingParams(
            max_tokens=int(rng.integers(1, 24)) if i < 10 else int(rng.integers(4, 24)),
            temperature=[0.0, 0.7, 1.0, 1.3][i % 4],
            top_k=[0, 5, -1, 40][(i // 2) % 4],
            top_p=[1.0, 0.9, 0.5][i % 3],
            seed=int(rng.integers(2**63)) if i % 2 else None,
            ignore_eos=i % 3 != 0,
            stop=["the"] if i % 5 == 0 else [],
            structured_outputs=StructuredOutputsParams(regex="[a-z ]{1,40}")
            if i % 6 == 3 else None,
        )
        requests.append((f"c{i}", rng.integers(0, vocab, n).tolist(), params))
    # c9 is aborted before its prefill completes, c13 while decoding
    requests[13] = (
        "c13",
        requests[13][1],
        SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.9, top_p=0.8),
    )
    compiles_before = llm.runner.num_compiles
    buckets_used = set()
    masked_buckets = set()
    execute = llm.runner.execute

    def spy(bucket, packed, allowed=None):
        buckets_used.add(bucket)
        if allowed is not None:
            masked_buckets.add(bucket)
        return execute(bucket, packed, allowed)

    monkeypatch.setattr(llm.runner, "execute", spy)

    def add(lo: int, hi: int) -> Callable[[], None]:
        return lambda: [llm.add_request(rid, ids, sp) for rid, ids, sp in requests[lo:hi]]

    def abort(ids: list[str]) -> Callable[[], None]:
        return lambda: llm.abort_request(ids)

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    jax.monitoring.register_event_listener(on_event)
    try:
        # control: the listeners do see a compile (guards against renamed jax events)
        jax.jit(lambda x: x * 3 + 1)(np.zeros(3, np.float32)).block_until_ready()
        assert events["/jax/core/compile/backend_compile_duration"] >= 1, dict(events)
        events.clear()
        done = _drive(
            llm,
            add_at={
                0: add(0, 4),  # 30 tokens
                2: add(4, 5),  # 40 tokens + decodes
                4: add(5, 6),  # 100 + decodes
                6: add(6, 7),  # 200 + decodes
                8: add(7, 10),  # 618
                9: abort(["c9"]),
                11: add(10, 20),  # 186, then 10+ decodes
                15: abort(["c13", "no-such-id"]),
            },
        )
        # then three requests, then one alone: their decodes run the CPU's 4- and 1-token
        # buckets; then a 20-token prompt alone, whose prefill fills the CPU's 24-token one
        for i, n in ((20, 9), (21, 9), (22, 9), (23, 9), (24, 20)):
            requests.append((f"c{i}", rng.integers(0, vocab, n).tolist(),
                             SamplingParams(max_tokens=4, temperature=0.8, seed=i,
                                            ignore_eos=True)))
        done.update(_drive(llm, add_at={0: add(20, 23)}))
        done.update(_drive(llm, add_at={0: add(23, 24)}))
        done.update(_drive(llm, add_at={0: add(24, 25)}))
    finally:
        jax.monitoring.unregister_event_duration_listener(on_duration)
        jax.monitoring.unregister_event_listener(on_event)
    assert set(done) == {rid for rid, _, _ in requests} - {"c9", "c13"}
    assert not events, f"jax compiled during serving: {dict(events)}"
    assert llm.runner.num_compiles == compiles_before
    unused = sorted(set(llm.runner.buckets) - buckets_used, key=lambda b: b.num_tokens)
    assert not unused, f"the workload should use every program; unused: {unused}"
    assert len(masked_buckets) >= 2, "constrained rows should run in steps of several buckets"


# -- preemption ------------------------------------------------------------------------------


def test_preemption_keeps_goldens_and_frees_blocks(llm: LLMEngine, goldens: dict) -> None:
    """Four 560-token requests and the 220-token golden prompt fill the 159-block pool with
    prompts; decoding then needs more blocks than are left, so the newest request (the golden
    one) is preempted, recomputed later, and still produces its golden continuation."""
    pool = llm.scheduler.block_pool
    assert pool.num_usable_blocks == 159  # the sizes below are worked out for this pool
    rng = np.random.default_rng(3)
    vocab = llm.tokenizer.vocab_size
    p = _golden(goldens, "long_prose")
    preemptions_before = llm.scheduler.num_preemptions_total
    for i in range(4):  # 4 x 35 prompt blocks, growing to 38 each
        llm.add_request(f"long-{i}", rng.integers(0, vocab, 560).tolist(), _greedy(40))
    llm.add_request("golden", p["prompt_token_ids"], _greedy(len(p["greedy_token_ids"])))
    seq = llm.requests.choice("golden").seq
    done = _drive(llm)
    assert llm.scheduler.num_preemptions_total > preemptions_before
    assert seq.num_preemptions >= 1, "the golden request was never preempted"
    _check_golden(done["golden"], p)
    for i in range(4):
        assert len(done[f"long-{i}"].outputs[0].token_ids) == 40
    assert pool.num_free_blocks == pool.num_usable_blocks


# -- seeds -----------------------------------------------------------------------------------


def test_seeded_sampling_is_reproducible_and_batch_independent(
    llm: LLMEngine, goldens: dict
) -> None:
    gold = _golden(goldens, "france_text")
    prompt = gold["prompt_token_ids"]

    def seeded(seed: int) -> SamplingParams:
        return SamplingParams(max_tokens=16, temperature=0.8, seed=seed, ignore_eos=True)

    llm.add_request("alone", prompt, seeded(42))
    alone = _drive(llm)["alone"].outputs[0].token_ids
    assert len(alone) == 16

    rng = np.random.default_rng(11)
    vocab = llm.tokenizer.vocab_size
    for i in range(3):  # unseeded batch-mates, sampled
        llm.add_request(
            f"mate-{i}",
            _random_prompt(rng, vocab, 5, 60),
            SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True),
        )
    llm.step()
    llm.step()
    llm.add_request("batched", prompt, seeded(42))
    llm.add_request("other-seed", prompt, seeded(43))
    llm.add_request("high-bits", prompt, seeded(42 + 2**32))  # all 64 bits key the stream
    # sampling that keeps only the top token is greedy whatever the seed
    for rid, kw in (("top-k-1", {"top_k": 1}), ("tiny-top-p", {"top_p": 1e-6})):
        llm.add_request(
            rid, prompt, SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True, **kw)
        )
    done = _drive(llm)
    assert done["batched"].outputs[0].token_ids == alone
    assert done["other-seed"].outputs[0].token_ids != alone
    assert done["high-bits"].outputs[0].token_ids != alone
    k = min(16, golden_prefix_len(gold["top2_margins"]))
    for rid in ("top-k-1", "tiny-top-p"):
        assert done[rid].outputs[0].token_ids[:k] == gold["greedy_token_ids"][:k], rid


# -- stop conditions -------------------------------------------------------------------------


def test_stop_string(llm: LLMEngine, goldens: dict) -> None:
    prompt = _golden(goldens, "france_text")["prompt_token_ids"]  # greedy: " Paris.\n\n..."
    llm.add_request("cut", prompt, _greedy(16, stop=["Paris"]))
    llm.add_request("kept", prompt, _greedy(16, stop=["Paris"], include_stop_str_in_output=True))
    done = _drive(llm)
    cut, kept = done["cut"].outputs[0], done["kept"].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == "Paris"
    assert "Paris" not in cut.text
    assert len(cut.token_ids) < 16
    assert kept.finish_reason == "stop" and kept.text.endswith("Paris")


def test_max_tokens_finishes_with_length(llm: LLMEngine, goldens: dict) -> None:
    p = _golden(goldens, "alphabet_text")
    llm.add_request("five", p["prompt_token_ids"], _greedy(5))
    out = _drive(llm)["five"].outputs[0]
    assert out.finish_reason == "length" and out.stop_reason is None
    assert out.token_ids == p["greedy_token_ids"][:5]


def test_chat_stops_at_eos_without_special_tokens(llm: LLMEngine, goldens: dict) -> None:
    p = _golden(goldens, "france_chat")
    eos = p["eos_positions"][0]  # the golden continuation's first <|im_end|>
    assert p["greedy_token_ids"][eos] == 2
    llm.add_request("chat", p["prompt_token_ids"], SamplingParams(max_tokens=64, temperature=0))
    out = _drive(llm)["chat"].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason is None
    assert out.token_ids == p["greedy_token_ids"][: eos + 1]  # the EOS token is reported
    assert out.text == "The capital of France is Paris."
    assert "<|" not in out.text


# -- abort -----------------------------------------------------------------------------------


def test_abort_returns_blocks_and_engine_keeps_serving(llm: LLMEngine, goldens: dict) -> None:
    pool = llm.scheduler.block_pool
    rng = np.random.default_rng(5)
    vocab = llm.tokenizer.vocab_size
    gold = _golden(goldens, "france_text")
    # a 600-token prompt still in chunked prefill and a decoding request, aborted together
    llm.add_request("long", rng.integers(0, vocab, 600).tolist(), _greedy(30))
    llm.add_request("short", _golden(goldens, "mixed_unicode")["prompt_token_ids"], _greedy(30))
    llm.step()
    llm.step()
    assert pool.num_free_blocks < pool.num_usable_blocks
    assert sorted(llm.abort_request(["long", "short", "never-added"])) == ["long", "short"]
    assert llm.abort_request("long") == []
    assert pool.num_free_blocks == pool.num_usable_blocks
    assert not llm.has_unfinished_requests() and not llm.requests
    assert llm.step() == []

    # abort one request while another keeps running: the survivor is still golden
    llm.add_request("keep", gold["prompt_token_ids"], _greedy(len(gold["greedy_token_ids"])))
    llm.add_request("drop", rng.integers(0, vocab, 100).tolist(), _greedy(30))
    llm.step()
    llm.step()
    llm.abort_request("drop")
    done = _drive(llm)
    assert set(done) == {"keep"}
    _check_golden(done["keep"], gold)
