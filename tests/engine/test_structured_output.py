"""Structured outputs: the grammar compiler (llguidance) on the real tokenizer, and the engine on
the real SmolLM2-135M: constrained rows sample only what their grammar allows and end where it
ends, unconstrained rows beside them get exactly what they get alone, and ``min_tokens``,
``ignore_eos`` and ``n`` keep their meaning under a constraint.

Waiting is counted in engine steps or released by events, never seconds.
"""

from __future__ import annotations

import json
import threading

import jsonschema_rs
import numpy as np
import pytest

from jaxserve.engine import structured_output as so
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.errors import InvalidRequest
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams, StructuredOutputsParams
from jaxserve.tokenizer import Tokenizer

MAX_STEPS = 400


# -- the compiler -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer) -> so.GrammarCompiler:
    return so.GrammarCompiler(tokenizer, tokenizer.vocab_size, timeout_s=30.0)


def _allowed(compiler: so.GrammarCompiler, state: so.GrammarState) -> set[int]:
    out = np.full((3, so.mask_words(compiler.vocab_size)), 0, np.int32)
    compiler.fill_masks([(state, 1, ())], out)
    assert not out[0].any() and not out[2].any(), "other rows are left as they were"
    bits = np.unpackbits(out[1].view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits[:compiler.vocab_size]).tolist())


def test_choice_allows_prefixes_of_the_choices_then_only_eos(
        compiler: so.GrammarCompiler, tokenizer: Tokenizer) -> None:
    g = compiler.compile(StructuredOutputsParams(choice=["yes", "no way"]))
    state = g.start()
    first = _allowed(compiler, state)
    assert first, "some token must start a choice"
    for t in first:
        text = tokenizer.token_bytes(t)
        assert b"yes".startswith(text) or b"no way".startswith(text), (t, text)
    assert tokenizer.encode("no", add_special_tokens=False)[0] in first
    for t in tokenizer.encode("no way", add_special_tokens=False):
        assert t in _allowed(compiler, state) and state.advance(t)
    assert _allowed(compiler, state) == set(tokenizer.eos_token_ids)
    assert state.done and state.error is None


@pytest.mark.parametrize("grammar", ['start: "ab" | "cd" "e"?', 'root ::= "ab" | "cd" "e"?'])
def test_lark_and_gbnf_grammars_take_their_strings(compiler: so.GrammarCompiler,
                                                  tokenizer: Tokenizer, grammar: str) -> None:
    for text, only_eos in (("cd", False), ("cde", True), ("ab", True)):
        state = compiler.compile(StructuredOutputsParams(grammar=grammar)).start()
        assert all(state.advance(t) for t in tokenizer.encode(text, add_special_tokens=False))
        eos = set(tokenizer.eos_token_ids)
        assert eos <= _allowed(compiler, state) and (_allowed(compiler, state) == eos) == only_eos
    state = compiler.compile(StructuredOutputsParams(grammar=grammar)).start()
    assert not state.advance(tokenizer.encode("x", add_special_tokens=False)[0])


def test_withheld_ids_leave_the_mask_unless_nothing_else_is_allowed(
        compiler: so.GrammarCompiler, tokenizer: Tokenizer) -> None:
    eos = set(tokenizer.eos_token_ids)
    state = compiler.compile(StructuredOutputsParams(regex="[0-9]{1,2}")).start()
    out = np.zeros((1, so.mask_words(compiler.vocab_size)), np.int32)

    def allowed() -> set[int]:
        compiler.fill_masks([(state, 0, eos)], out)
        return set(np.flatnonzero(np.unpackbits(out[0].view(np.uint8), bitorder="little")))

    assert state.advance(tokenizer.encode("4", add_special_tokens=False)[0])
    assert eos <= _allowed(compiler, state)  # the grammar may end here ...
    first = allowed()
    assert first and not eos & first  # ... but a row short of min_tokens may not yet
    assert state.advance(tokenizer.encode("2", add_special_tokens=False)[0])
    assert allowed() == eos  # nothing else is allowed: EOS stays, the output can end


def test_fill_masks_checks_its_buffer(compiler: so.GrammarCompiler) -> None:
    state = compiler.compile(StructuredOutputsParams(regex="a")).start()
    words = so.mask_words(compiler.vocab_size)
    for bad in (np.zeros((2, words), np.uint32), np.zeros((2, words + 1), np.int32),
                np.zeros((words, 2), np.int32).T):
        with pytest.raises(ValueError, match="mask buffer"):
            compiler.fill_masks([(state, 0, ())], bad)
    with pytest.raises(ValueError, match="row index"):
        compiler.fill_masks([(state, 2, ())], np.zeros((2, words), np.int32))


def test_a_refused_token_breaks_the_state_and_leaves_only_eos(
        compiler: so.GrammarCompiler, tokenizer: Tokenizer) -> None:
    state = compiler.compile(StructuredOutputsParams(regex="[0-9]+")).start()
    assert not state.advance(tokenizer.encode("x", add_special_tokens=False)[0])
    assert state.error and _allowed(compiler, state) == set(tokenizer.eos_token_ids)


def test_grammars_are_cached_by_constraint(compiler: so.GrammarCompiler) -> None:
    schema = {"type": "object", "properties": {"k": {"type": "integer"}}}
    a = compiler.compile(StructuredOutputsParams(json=schema))
    n = compiler.num_compiled
    assert compiler.compile(StructuredOutputsParams(json=json.dumps(schema))) is a
    assert compiler.compile(StructuredOutputsParams(json=dict(reversed(schema.items())))) is a
    assert compiler.num_compiled == n
    other = compiler.compile(StructuredOutputsParams(json=schema, disable_any_whitespace=True))
    assert other is not a and compiler.num_compiled == n + 1
    assert a.start() is not a.start(), "each choice gets its own state"


@pytest.mark.parametrize("spec,words", [
    ({"json": {"type": "object", "properties": {"n": {"type": "integer", "minimum": "x"}}}},
     "minimum"),
    ({"json": {"type": "strin"}}, "strin"),
    ({"json": {"$ref": "#/$defs/nope"}}, "nope"),
    ({"regex": "(ab"}, "unclosed group"),
    ({"grammar": 'start: item\nitem: "x" missing'}, "missing"),
])  # fmt: skip
def test_invalid_constraints_are_invalid_requests(compiler: so.GrammarCompiler, spec: dict,
                                                  words: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        compiler.compile(StructuredOutputsParams(**spec))
    assert e.value.param == "structured_outputs" and words in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kw", [{}, {"json": {"type": "object"}, "regex": "a"},
                                {"choice": []}, {"choice": ["a", 1]}, {"json": "[1]"},
                                {"json": "{nope"}, {"json": {"enum": {1, 2}}}, {"regex": 5},
                                {"json_object": "yes"}])
def test_malformed_constraints_are_refused_before_compiling(kw: dict) -> None:
    with pytest.raises(InvalidRequest) as e:
        StructuredOutputsParams(**kw)
    assert e.value.param == "structured_outputs"


def test_a_slow_compile_is_refused_and_then_cached(tokenizer: Tokenizer,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    compiler = so.GrammarCompiler(tokenizer, tokenizer.vocab_size, timeout_s=0.01)
    release, build = threading.Event(), compiler._build

    def slow(spec):
        release.wait()
        return build(spec)

    monkeypatch.setattr(compiler, "_build", slow)
    spec = StructuredOutputsParams(regex="a+")
    with pytest.raises(InvalidRequest) as e:
        compiler.compile(spec)
    assert e.value.param == "structured_outputs" and "longer than 0.01 s" in str(e.value)
    release.set()
    compiler.timeout_s = 30.0
    assert compiler.compile(spec).kind == "regex"
    assert compiler.num_compiled == 1  # the build that timed out was kept


def test_prepare_builds_the_tokenizer_once_for_every_grammar(tokenizer: Tokenizer) -> None:
    compiler = so.GrammarCompiler(tokenizer, tokenizer.vocab_size, timeout_s=30.0)
    lltok = compiler.prepare().result()
    assert compiler.prepare().result() is lltok
    compiler.compile(StructuredOutputsParams(regex="b+"))
    assert compiler._lltok is lltok


def test_strict_schemas_get_no_additional_properties() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {}},
                                               "b": {"additionalProperties": True,
                                                     "properties": {}}},
              "$defs": {"x": {"properties": {"y": {"type": "integer"}}}}}
    out = so.no_additional_properties(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["a"]["additionalProperties"] is False
    assert out["properties"]["b"]["additionalProperties"] is True
    assert out["$defs"]["x"]["additionalProperties"] is False
    assert "additionalProperties" not in schema, "the request's schema is not changed"


# -- the engine -------------------------------------------------------------------------------


@pytest.fixture
def llm(idle_engine: LLMEngine) -> LLMEngine:
    """The shared engine, checked idle afterwards (``idle_engine``)."""
    return idle_engine


def _run(engine: LLMEngine, requests: dict[str, tuple[str, SamplingParams]]
         ) -> dict[str, RequestOutput]:
    """Add every request (chat prompts) at once, step until idle; the final outputs."""
    tok = engine.tokenizer
    for rid, (text, params) in requests.items():
        prompt = tok.apply_chat_template([{"role": "user", "content": text}], True)
        engine.add_request(rid, tok.encode(prompt, add_special_tokens=False), params)
    done: dict[str, RequestOutput] = {}
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished_requests():
            return done
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    raise AssertionError("engine not idle")


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pets"],
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pets": {"type": "array", "maxItems": 2,
                                  "items": {"enum": ["cat", "dog", "fish"]}}}}


def test_unconstrained_rows_beside_constrained_ones_get_what_they_get_alone(
        llm: LLMEngine) -> None:
    free = {f"free{i}": (q, SamplingParams(max_tokens=24, temperature=0.0))
            for i, q in enumerate(["Name a colour.", "What is 2 + 2?"])}
    alone = _run(llm, free)
    masked_steps = []
    execute = llm.runner.execute

    def spy(bucket, packed, allowed=None):
        masked_steps.append(allowed is not None)
        return execute(bucket, packed, allowed)

    llm.runner.execute = spy
    try:
        mixed = _run(llm, {**{k + "-again": v for k, v in free.items()}, **{
            f"json{i}": (f"Describe person {i} as JSON.", SamplingParams(
                max_tokens=60, temperature=0.0,
                structured_outputs=StructuredOutputsParams(json=PERSON)))
            for i in range(3)}})
    finally:
        del llm.runner.execute
    assert sum(masked_steps) >= 10, "the constrained rows decoded beside the free ones"
    for rid, out in alone.items():
        assert mixed[rid + "-again"].outputs[0].token_ids == out.outputs[0].token_ids
    for i in range(3):
        o = mixed[f"json{i}"].outputs[0]
        assert o.finish_reason == "stop" and jsonschema_rs.is_valid(PERSON, json.loads(o.text))


def test_min_tokens_and_ignore_eos_under_a_constraint(llm: LLMEngine) -> None:
    digits = StructuredOutputsParams(regex="[0-9]{1,12}")
    out = _run(llm, {
        # min_tokens keeps EOS out while the grammar allows more digits ...
        "long": ("Write a number.", SamplingParams(max_tokens=30, temperature=0.0,
                                                   min_tokens=6, structured_outputs=digits)),
        # ... and gives way where the grammar allows nothing else
        "yes": ("Say yes.", SamplingParams(max_tokens=30, temperature=0.0, min_tokens=8,
                                           structured_outputs=StructuredOutputsParams(
                                               choice=["yes"]))),
        # the request ends once its grammar has taken EOS, even if it ignores EOS
        "ignore": ("Say no.", SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True,
                                             structured_outputs=StructuredOutputsParams(
                                                 choice=["no"]))),
    })
    long = out["long"].outputs[0]
    assert long.text.isdigit() and 6 <= len(long.token_ids) and len(long.text) <= 12
    for rid, text in (("yes", "yes"), ("ignore", "no")):
        o = out[rid].outputs[0]
        assert (o.text, o.finish_reason) == (text, "stop")
        assert o.token_ids[-1] in llm.tokenizer.eos_token_ids


def test_each_choice_follows_its_own_grammar_state(llm: LLMEngine) -> None:
    params = SamplingParams(max_tokens=60, temperature=1.0, seed=11, n=3,
                            structured_outputs=StructuredOutputsParams(json=PERSON))
    outs = _run(llm, {"n3": ("Describe a person as JSON.", params)})["n3"].outputs
    assert len(outs) == 3
    for o in outs:
        assert o.finish_reason == "stop" and jsonschema_rs.is_valid(PERSON, json.loads(o.text))


def test_an_invalid_constraint_is_refused_before_anything_is_queued(llm: LLMEngine) -> None:
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "nope"}))
    with pytest.raises(InvalidRequest) as e:
        llm.add_request("bad", [1, 2, 3], bad)
    assert e.value.param == "structured_outputs"
    assert not llm.has_unfinished_requests() and "bad" not in llm.requests
