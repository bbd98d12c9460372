"""Request ids: the one scheme every layer uses.

A request's id comes from the client (``X-Request-Id``), the server (``random_id``) or the
engine (``IdCounter``, for offline callers that give none). From it:

- the engine keeps one stream per id: a second request under an id in use gets ``<id>#<n>``
  (``unique``);
- a prompt of a multi-prompt completions request is ``<id>-<i>`` (``prompt_ids``);
- a choice of an ``n > 1`` request is the scheduler sequence ``<id>[<i>]`` (``choice_ids``;
  with ``n == 1`` the sequence id is the request id);
- the OpenAI ``id`` of a response is ``cmpl-<id>`` / ``chatcmpl-<id>``, and a Responses API
  object or item ``<prefix>_<32 hex digits>`` (``item_id``): stored responses are looked up by
  id, so theirs never repeat when clients reuse an ``X-Request-Id``.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Container


def random_id() -> str:
    """A fresh random id: 32 hex digits."""
    return uuid.uuid4().hex


def item_id(prefix: str) -> str:
    """A fresh ``<prefix>_<32 hex digits>`` (Responses objects and items: ``resp``, ``msg``)."""
    return f"{prefix}_{random_id()}"


def prompt_ids(request_id: str, num_prompts: int) -> list[str]:
    """The engine request id of each prompt: ``request_id`` for one, else ``<request_id>-<i>``."""
    if num_prompts == 1:
        return [request_id]
    return [f"{request_id}-{i}" for i in range(num_prompts)]


def choice_ids(request_id: str, n: int) -> list[str]:
    """The scheduler sequence id of each of a request's ``n`` choices: ``request_id`` for one,
    else ``<request_id>[<i>]``."""
    return [request_id] if n == 1 else [f"{request_id}[{i}]" for i in range(n)]


def unique(request_id: str, in_use: Container[str]) -> str:
    """``request_id``, or ``<request_id>#<n>`` with the smallest n >= 1 not ``in_use``."""
    out, n = request_id, 0
    while out in in_use:
        n += 1
        out = f"{request_id}#{n}"
    return out


class IdCounter:
    """Ids ``req-0``, ``req-1``, ... for callers that give none (``LLM.generate``)."""

    def __init__(self) -> None:
        self._ids = itertools.count()

    def next(self) -> str:
        """The next id."""
        return f"req-{next(self._ids)}"
