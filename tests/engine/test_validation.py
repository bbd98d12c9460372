"""Request validation (``jaxserve.engine.validation``) against small bounds, without an engine:
each refusal is an ``InvalidRequest`` naming its field, and the effective max_tokens is capped by
the context window, or by the KV cache when max_tokens is None."""

from __future__ import annotations

import pytest

from jaxserve.engine.validation import RequestBounds, truncate_prompt, validate_request
from jaxserve.errors import InvalidRequest
from jaxserve.sampling_params import MAX_MIN_TOKENS_STOP_IDS, MAX_TEMPERATURE
from jaxserve.sampling_params import SamplingParams as SP

# a 4-block cache of 8 tokens (32) and a 40-token window: requests are capped at 32 tokens
BOUNDS = RequestBounds(vocab_size=100, max_model_len=40, num_blocks=5, block_size=8,
                       multiprocess=False)


@pytest.mark.parametrize(("ids", "params", "bounds", "param", "match"), [
    ([], SP(), BOUNDS, "prompt", r"prompt must not be empty \(it has 0 tokens\)"),
    ([1, 100], SP(), BOUNDS, "prompt", r"prompt token id 100 is out of range \[0, 100\)"),
    ([1, True], SP(), BOUNDS, "prompt", "prompt token id True"),
    ([1] * 40, SP(), BOUNDS, "prompt", "max_model_len is 40, which leaves no room"),
    ([1] * 32, SP(), BOUNDS, "prompt", r"KV cache holds 32 tokens \(4 blocks of 8\)"),
    ([1], SP(stop_token_ids=[100]), BOUNDS, "stop_token_ids", "stop_token_ids holds 100"),
    ([1], SP(logit_bias={100: 1.0}), BOUNDS, "logit_bias", "logit_bias holds token id 100"),
    ([1], SP(logit_bias={5: 1.0}), RequestBounds(100, 40, 5, 8, multiprocess=True),
     "logit_bias", "spans several processes"),
    ([1], SP(truncate_prompt_tokens=41), BOUNDS, "truncate_prompt_tokens",
     r"truncate_prompt_tokens \(41\) is greater than max_model_len \(40\)"),
    ([1], SP(min_tokens=1, stop_token_ids=list(range(MAX_MIN_TOKENS_STOP_IDS))),
     RequestBounds(100, 40, 5, 8, multiprocess=False, eos_token_ids=frozenset({99})),
     "stop_token_ids", f"min_tokens takes at most {MAX_MIN_TOKENS_STOP_IDS} distinct stop ids"),
    ([1] * 10, SP(max_tokens=25), BOUNDS, "max_tokens",
     r"prompt \(10 tokens\) \+ max_tokens \(25\) = 35 tokens can never fit .* at most 22"),
])
def test_refusals_name_the_field(ids, params, bounds, param: str, match: str) -> None:
    with pytest.raises(InvalidRequest, match=match) as exc:
        validate_request(ids, params, bounds)
    assert exc.value.param == param


def test_effective_max_tokens() -> None:
    assert validate_request([1] * 10, SP(max_tokens=None), BOUNDS) == 22  # what the cache leaves
    assert validate_request([1] * 10, SP(max_tokens=5), BOUNDS) == 5
    roomy = RequestBounds(100, 40, 101, 8, multiprocess=False)
    assert validate_request([1] * 10, SP(max_tokens=1000), roomy) == 30  # the window's rest


def test_temperature_is_bounded() -> None:
    SP(temperature=MAX_TEMPERATURE)
    for bad in (MAX_TEMPERATURE * 1.01, 1e30, 1e308):
        with pytest.raises(ValueError, match="temperature must be") as e:
            SP(temperature=bad)
        assert e.value.param == "temperature"


def test_sampling_params_are_checked_again() -> None:
    params = SP()
    params.temperature = -1.0  # changed after construction
    with pytest.raises(ValueError, match="temperature must be"):
        validate_request([1], params, BOUNDS)


def test_truncate_prompt_keeps_the_last_tokens() -> None:
    """vLLM's left truncation; -1 keeps what the window holds with room for one output token,
    and the length checks see the truncated prompt."""
    ids = list(range(60))
    assert truncate_prompt(ids, SP(truncate_prompt_tokens=5), BOUNDS) == ids[-5:]
    assert truncate_prompt(ids[:3], SP(truncate_prompt_tokens=5), BOUNDS) == ids[:3]
    assert truncate_prompt(ids, SP(), BOUNDS) == ids
    assert truncate_prompt(ids, SP(truncate_prompt_tokens=-1), BOUNDS) == ids[-39:]
    # 60 tokens would not fit; their last 20 leave 12 tokens of the 32-token cache
    assert validate_request(ids, SP(max_tokens=None, truncate_prompt_tokens=20), BOUNDS) == 12


def test_min_tokens_stop_ids_counted_with_eos_unless_ignored() -> None:
    """The stop-id limit of min_tokens counts EOS, except with ignore_eos, and only applies
    to requests with min_tokens."""
    bounds = RequestBounds(100, 40, 5, 8, multiprocess=False, eos_token_ids=frozenset({99}))
    full = list(range(MAX_MIN_TOKENS_STOP_IDS))
    assert validate_request([1], SP(min_tokens=1, stop_token_ids=full[:-1]), bounds) == 16
    assert validate_request([1], SP(min_tokens=1, stop_token_ids=full, ignore_eos=True),
                            bounds) == 16
    assert validate_request([1], SP(stop_token_ids=full), bounds) == 16
