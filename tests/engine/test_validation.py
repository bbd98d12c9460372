"""Request validation (``jaxserve.engine.validation``) against small bounds, without an engine:
each refusal is an ``InvalidRequest`` naming its field, and the effective max_tokens is capped by
the context window, or by the KV cache when max_tokens is None."""

from __future__ import annotations

import pytest

from jaxserve.engine.validation import RequestBounds, validate_request
from jaxserve.errors import InvalidRequest
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


def test_sampling_params_are_checked_again() -> None:
    params = SP()
    params.temperature = -1.0  # changed after construction
    with pytest.raises(ValueError, match="temperature must be"):
        validate_request([1], params, BOUNDS)
