"""Errors that carry the offending field, so that callers never parse message text."""

from __future__ import annotations


class InvalidRequest(ValueError):
    """A request (prompt or sampling parameters) the engine refuses, before anything is queued.

    Args:
      message: the cause, naming the value where there is one.
      param: the request field it is about (``"prompt"``, ``"logit_bias"``, ...), or None.
      code: a machine-readable kind, as OpenAI names it (``"context_length_exceeded"``: the
        request does not fit in the context window or the KV cache), or None.
    """

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
"""``InvalidRequest.code`` of a request too long for the context window or the KV cache."""
