"""OpenAI-compatible response bodies, as msgspec Structs: what the server sends (the wire
format; ``server.protocol`` holds the requests and the error body). ``server.response_bodies``
builds them from engine outputs; fields left ``UNSET`` are omitted (a chat finish chunk's
``delta`` encodes as ``{}``, and ``usage`` is absent from stream chunks unless
``stream_options.include_usage`` asked for it).
"""

from __future__ import annotations

from typing import Literal

import msgspec
from msgspec import UNSET, UnsetType

from jaxserve.server.protocol import ToolCall


class PromptTokenUsageInfo(msgspec.Struct, kw_only=True):
    """``usage.prompt_tokens_details`` (vLLM's, with ``--enable-prompt-tokens-details``): the
    prompt tokens whose K/V came from the prefix cache."""

    cached_tokens: int


class UsageInfo(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Token counts of a response: prompt, completion and their sum; ``prompt_tokens_details``
    only where the server reports it."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokenUsageInfo | None = None


def usage(num_prompt_tokens: int, num_completion_tokens: int,
          num_cached_tokens: int | None = None) -> UsageInfo:
    """Usage with the total filled in, and ``prompt_tokens_details`` when ``num_cached_tokens``
    is given."""
    return UsageInfo(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=num_completion_tokens,
        total_tokens=num_prompt_tokens + num_completion_tokens,
        prompt_tokens_details=None if num_cached_tokens is None else PromptTokenUsageInfo(
            cached_tokens=num_cached_tokens),
    )


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    """Completions logprobs (OpenAI's legacy shape): per token its text, its offset in the
    choice's text, its logprob (None for the first prompt token under echo) and the requested
    most likely alternatives (None where the logprob is None)."""

    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class CompletionChoice(msgspec.Struct, kw_only=True):
    """One choice of a completions response."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(msgspec.Struct, kw_only=True):
    """A non-streamed ``/v1/completions`` response."""

    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionChunk(msgspec.Struct, kw_only=True):
    """One SSE chunk of a streamed ``/v1/completions`` response."""

    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None | UnsetType = UNSET


class TopLogprob(msgspec.Struct, kw_only=True):
    """One of the most likely tokens at a position, with its log-probability."""

    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(msgspec.Struct, kw_only=True):
    """A sampled token's log-probability and the top alternatives, in chat form."""

    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct, kw_only=True):
    """The ``logprobs`` of a chat choice: one entry per generated token."""

    content: list[ChatTokenLogprob]


class ChatMessageOut(msgspec.Struct, kw_only=True):
    """The assistant message of a chat choice: ``content`` is null when the reply is only tool
    calls; ``tool_calls`` is left out when there are none."""

    role: str = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | UnsetType = UNSET


class ChatChoice(msgspec.Struct, kw_only=True):
    """One choice of a chat completions response."""

    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(msgspec.Struct, kw_only=True):
    """A non-streamed ``/v1/chat/completions`` response."""

    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaFunctionCall(msgspec.Struct, kw_only=True):
    """A function call's part in a stream chunk: the name once, then pieces of arguments."""

    name: str | UnsetType = UNSET
    arguments: str | UnsetType = UNSET


class DeltaToolCall(msgspec.Struct, kw_only=True):
    """A tool call's part in a stream chunk (OpenAI's shape): ``index`` says which call of the
    choice; the first part carries ``id``, ``type`` and the function's name."""

    index: int
    id: str | UnsetType = UNSET
    type: Literal["function"] | UnsetType = UNSET
    function: DeltaFunctionCall


class DeltaMessage(msgspec.Struct, kw_only=True):
    """The new part of the assistant message in a chat stream chunk."""

    role: str | UnsetType = UNSET
    content: str | UnsetType = UNSET
    tool_calls: list[DeltaToolCall] | UnsetType = UNSET


class ChatChunkChoice(msgspec.Struct, kw_only=True):
    """One choice of a chat stream chunk."""

    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    """One SSE chunk of a streamed ``/v1/chat/completions`` response."""

    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None | UnsetType = UNSET


class ModelCard(msgspec.Struct, kw_only=True):
    """One served model: an item of ``/v1/models`` and the body of ``/v1/models/{id}``."""

    id: str
    object: str = "model"
    created: int
    owned_by: str = "jaxserve"
    max_model_len: int


class ModelList(msgspec.Struct, kw_only=True):
    """The ``/v1/models`` list."""

    object: str = "list"
    data: list[ModelCard]


class TokenizerInfoResponse(msgspec.Struct, kw_only=True):
    """``GET /tokenizer_info`` (vLLM's): the tokenizer's settings under the keys of a Hugging
    Face tokenizer config, which remote-tokenizer clients (lm-evaluation-harness) read; the
    ``/tokenize`` and ``/detokenize`` endpoints do the work. A token the model lacks is null."""

    tokenizer_class: str
    name_or_path: str
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    add_bos_token: bool
    add_eos_token: bool
    model_max_length: int
    chat_template: str | None
