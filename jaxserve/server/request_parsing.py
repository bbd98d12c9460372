"""Request bodies to engine inputs: strict decoding (no type coercion; unknown fields ignored;
known but unimplemented fields refused), the configured caps checked first, then prompts,
messages and ``SamplingParams``. Every client mistake is a ``protocol.RequestError``."""

from __future__ import annotations

import re

import msgspec
from msgspec import UNSET

from jaxserve.errors import InvalidRequest
from jaxserve.sampling_params import SamplingParams, StructuredOutputsParams
from jaxserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    RequestError,
    TokenizeRequest,
    _SamplingFields,
)
from jaxserve.server.tools import history_tool_calls
from jaxserve.server_config import RequestLimits

_completion_decoder = msgspec.json.Decoder(CompletionRequest)
_chat_decoder = msgspec.json.Decoder(ChatCompletionRequest)
_tokenize_decoder = msgspec.json.Decoder(TokenizeRequest)
_detokenize_decoder = msgspec.json.Decoder(DetokenizeRequest)

UNSUPPORTED = "unsupported_parameter"
"""The error ``code`` (OpenAI's) of a field refused because the feature is not built."""

_AT_FIELD = re.compile(r"at `\$\.([A-Za-z_][A-Za-z0-9_]*)")
_MISSING_TOP_FIELD = re.compile(r"missing required field `([A-Za-z_][A-Za-z0-9_]*)`$")


_NULL_DEFAULTS = {"ignore_eos": False, "include_stop_str_in_output": False,
                  "skip_special_tokens": True, "stream": False, "n": 1, "echo": False,
                  "add_generation_prompt": True}


def _fill_nulls[T](req: T) -> T:
    for name, default in _NULL_DEFAULTS.items():
        if getattr(req, name, default) is None:
            setattr(req, name, default)
    return req


def decode_body[T](decoder: msgspec.json.Decoder[T], body: bytes) -> T:
    """``body`` decoded by ``decoder``, explicit nulls of defaulted flags read as their
    defaults; raises RequestError (a bad field's name as ``param`` where msgspec gives one)."""
    try:
        return _fill_nulls(decoder.decode(body))
    except RecursionError:
        raise RequestError("invalid JSON body: nested too deeply") from None
    except msgspec.DecodeError as exc:
        if isinstance(exc, msgspec.ValidationError):
            # A nested field's error ends "- at `$.messages[0]`"; a missing top-level field's
            # names only the field.
            m = _AT_FIELD.search(str(exc)) or _MISSING_TOP_FIELD.search(str(exc))
            raise RequestError(f"invalid request: {exc}", param=m.group(1) if m else None)
        raise RequestError(f"invalid JSON body: {exc}")


_DEFAULT_LIMITS = RequestLimits()


def _check_limits(req: _SamplingFields | TokenizeRequest, limits: RequestLimits) -> None:
    """The configured caps, checked before any other check and before anything is tokenised."""
    n = getattr(req, "n", 1)
    if n > limits.max_n:
        raise RequestError(f"n must be at most {limits.max_n} (--max-n), got {n}", param="n")
    prompt = getattr(req, "prompt", None)  # a batch: a list of strings or of id lists
    batch = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
    if batch and len(prompt) > limits.max_num_prompts:
        raise RequestError(f"prompt holds {len(prompt)} prompts; the limit is "
                           f"{limits.max_num_prompts} (--max-num-prompts)", param="prompt")
    messages = getattr(req, "messages", None) or []
    if len(messages) > limits.max_num_messages:
        raise RequestError(
            f"messages holds {len(messages)} messages; the limit is {limits.max_num_messages} "
            "(--max-num-messages)",
            param="messages",
        )


def decode_completion_request(
    body: bytes, limits: RequestLimits = _DEFAULT_LIMITS
) -> CompletionRequest:
    """Decode and check a completions body against ``limits``; raises RequestError."""
    req = decode_body(_completion_decoder, body)
    _check_limits(req, limits)
    if req.top_logprobs is not None:
        raise RequestError("top_logprobs is a chat field; completions take logprobs=<int>",
                           param="top_logprobs")
    for name, used in (("tools", bool(req.tools)),
                       ("tool_choice", req.tool_choice not in (None, "none"))):
        if used:
            raise RequestError(f"{name} is a chat field (POST /v1/chat/completions)",
                               param=name, code=UNSUPPORTED)
    _check_common(req)
    return req


def decode_chat_request(
    body: bytes, limits: RequestLimits = _DEFAULT_LIMITS
) -> ChatCompletionRequest:
    """Decode and check a chat-completions body against ``limits``; raises RequestError."""
    return check_chat_request(decode_body(_chat_decoder, body), limits)


def check_chat_request(
    req: ChatCompletionRequest, limits: RequestLimits = _DEFAULT_LIMITS
) -> ChatCompletionRequest:
    """Check a decoded (or built: ``server.responses.handler``) chat request against ``limits`` and
    the fields not built; returns it; raises RequestError."""
    _check_limits(req, limits)
    unsupported_chat = {
        "audio": req.audio is not None,
        "modalities": req.modalities not in (None, ["text"]),
        "prediction": req.prediction is not None,
        "web_search_options": req.web_search_options is not None,
    }
    for name, used in unsupported_chat.items():
        if used:
            raise RequestError(f"{name} is not supported", param=name, code=UNSUPPORTED)
    if req.top_logprobs is not None and not req.logprobs:
        raise RequestError("top_logprobs requires logprobs=true", param="top_logprobs")
    if req.echo:
        raise RequestError("echo is not supported yet", param="echo", code=UNSUPPORTED)
    if not req.messages:
        raise RequestError("messages must hold at least one message", param="messages")
    _check_common(req)
    return req


def _check_common(req: _SamplingFields) -> None:
    if req.n < 1:
        raise RequestError(f"n must be at least 1, got {req.n}", param="n")
    unsupported = {
        "functions": bool(req.functions),
        "function_call": req.function_call not in (None, "none"),
        "best_of": req.best_of not in (None, 1),
        "suffix": bool(req.suffix),
        "use_beam_search": bool(req.use_beam_search),
        "length_penalty": req.length_penalty not in (None, 1.0),
        # the HTTP form of prompt logprobs is echo=true with logprobs (completions)
        "prompt_logprobs": req.prompt_logprobs is not None,
    }
    for name, used in unsupported.items():
        if used:
            raise RequestError(f"{name} is not supported", param=name, code=UNSUPPORTED)
    if req.stream_options is not None and not req.stream:
        raise RequestError(
            "stream_options is only allowed with stream=true", param="stream_options"
        )


_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def constraint_field(req: _SamplingFields) -> str | None:
    """The request field the output's constraint comes from: ``response_format`` (other than
    ``text``), ``structured_outputs`` or one of vLLM's older ``guided_*``; None: none.

    Raises:
      RequestError: two of them set, naming the second.
    """
    rf = req.response_format
    used = [name for name, on in (
        ("response_format", rf is not None and rf.type != "text"),
        ("structured_outputs", req.structured_outputs is not None),
        *((g, getattr(req, g) is not None) for g in _GUIDED)) if on]
    if len(used) > 1:
        raise RequestError(f"{used[0]} and {used[1]} both constrain the output; send one of "
                           "them", param=used[1])
    return used[0] if used else None


def structured_outputs_of(req: _SamplingFields) -> StructuredOutputsParams | None:
    """The request's output constraint (``constraint_field`` says where it came from), or None.

    ``response_format`` ``json_object`` is any JSON object, ``json_schema`` its ``schema``
    (``strict`` true: no keys beyond ``properties`` where the schema does not say);
    ``guided_whitespace_pattern`` applies to whichever field set the constraint.

    Raises:
      RequestError: two constraints, a ``json_schema`` without ``schema``, a
        ``structural_tag`` (not built), ``guided_whitespace_pattern`` without a constraint, or
        a constraint of the wrong shape, naming the field.
    """
    field = constraint_field(req)
    ws = req.guided_whitespace_pattern
    if field is None:
        if ws is not None:
            raise RequestError("guided_whitespace_pattern needs a JSON constraint "
                               "(response_format, structured_outputs or guided_json)",
                               param="guided_whitespace_pattern")
        return None
    try:
        if field == "response_format":
            rf = req.response_format
            if rf.type == "structural_tag":
                raise RequestError("response_format type structural_tag is not supported",
                                   param=field, code=UNSUPPORTED)
            if rf.type == "json_object":
                return StructuredOutputsParams(json_object=True, whitespace_pattern=ws)
            if rf.json_schema is None or rf.json_schema.schema is None:
                raise RequestError("response_format of type json_schema needs "
                                   "json_schema.schema (a JSON Schema object)", param=field)
            return StructuredOutputsParams(
                json=rf.json_schema.schema, whitespace_pattern=ws,
                disable_additional_properties=bool(rf.json_schema.strict))
        if field == "structured_outputs":
            so = req.structured_outputs
            if so.structural_tag is not None:
                raise RequestError("structured_outputs.structural_tag is not supported",
                                   param=field, code=UNSUPPORTED)
            return StructuredOutputsParams(
                json=so.json, regex=so.regex, choice=so.choice, grammar=so.grammar,
                json_object=so.json_object, disable_any_whitespace=so.disable_any_whitespace,
                disable_additional_properties=so.disable_additional_properties,
                whitespace_pattern=so.whitespace_pattern if so.whitespace_pattern is not None
                else ws)
        return StructuredOutputsParams(**{field.removeprefix("guided_"): getattr(req, field)},
                                       whitespace_pattern=ws)
    except InvalidRequest as exc:
        raise RequestError(str(exc), param=field) from exc


def decode_tokenize_request(
    body: bytes, limits: RequestLimits = _DEFAULT_LIMITS
) -> TokenizeRequest:
    """Decode a /tokenize body; exactly one of prompt / messages; raises RequestError."""
    req = decode_body(_tokenize_decoder, body)
    _check_limits(req, limits)
    if (req.prompt is None) == (req.messages is None):
        raise RequestError("exactly one of prompt and messages is required", param="prompt")
    if req.messages is not None and not req.messages:
        raise RequestError("messages must hold at least one message", param="messages")
    return req


def decode_detokenize_request(body: bytes) -> DetokenizeRequest:
    """Decode a /detokenize body; raises RequestError."""
    return decode_body(_detokenize_decoder, body)


def completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    """The prompts of a completions request, in order: one string or token-id list, or a batch
    (a list of strings, or a list of token-id lists; ``decode_completion_request`` capped its
    length).

    Raises:
      RequestError: an empty list, or a list mixing strings, ids and lists (naming ``prompt``).
    """
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if not p:
        raise RequestError("prompt must not be empty", param="prompt")
    if all(isinstance(t, int) for t in p):
        return [p]  # type: ignore[list-item]
    if not (all(isinstance(t, str) for t in p) or all(isinstance(t, list) for t in p)):
        raise RequestError("prompt must be a string, a list of token ids, a list of strings or "
                           "a list of token-id lists (not a mix)", param="prompt")
    return p  # type: ignore[return-value]


DEFAULT_COMPLETION_MAX_TOKENS = 16
"""``max_tokens`` of a completions request that sends none (OpenAI's and vLLM's default)."""


def completion_max_tokens(req: CompletionRequest) -> int | None:
    """The requested output length of a completions request: ``max_completion_tokens`` or
    ``max_tokens`` (default 16; null: up to the window). 0 is returned as sent (with ``echo``
    it asks for the prompt's logprobs alone).

    Raises:
      RequestError: both given (not null) with different values, naming
        ``max_completion_tokens``.
    """
    mt, mct = req.max_tokens, req.max_completion_tokens
    if mct is None:
        return DEFAULT_COMPLETION_MAX_TOKENS if mt is UNSET else mt
    if mt is not UNSET and mt is not None and mt != mct:
        raise RequestError(f"max_tokens ({mt}) and max_completion_tokens ({mct}) differ; send "
                           "one of them", param="max_completion_tokens")
    return mct


def scores_prompt_only(req: CompletionRequest) -> bool:
    """Whether a completions request only scores its prompt: ``echo`` with ``max_tokens`` 0
    (OpenAI's form; the response holds the prompt and its logprobs, no generated token)."""
    return bool(req.echo) and completion_max_tokens(req) == 0


def chat_messages(req: ChatCompletionRequest | TokenizeRequest) -> list[dict]:
    """The messages as plain dicts for the chat template; text content parts are joined; an
    assistant message's ``tool_calls`` carry their arguments as objects, a tool message its
    ``tool_call_id``."""
    out: list[dict] = []
    for i, m in enumerate(req.messages or []):
        if isinstance(m.content, list):
            texts = []
            for part in m.content:
                if part.type != "text":
                    raise RequestError(
                        f"messages[{i}]: only text content parts are supported, got {part.type!r}",
                        param="messages",
                    )
                if part.text is None:
                    raise RequestError(
                        f"messages[{i}]: a text content part needs a 'text' string",
                        param="messages",
                    )
                texts.append(part.text)
            content = "\n".join(texts)
        elif m.content is None and m.role != "assistant":
            raise RequestError(f"messages[{i}].content is required for role {m.role!r}",
                               param="messages")
        else:
            content = m.content or ""
        msg: dict = {"role": m.role, "content": content}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_calls:
            if m.role != "assistant":
                raise RequestError(f"messages[{i}]: only assistant messages carry tool_calls",
                                   param="messages")
            msg["tool_calls"] = history_tool_calls(m.tool_calls)
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def to_sampling_params(req: CompletionRequest | ChatCompletionRequest) -> SamplingParams:
    """The request's SamplingParams; an invalid value raises RequestError naming the field."""
    chat = isinstance(req, ChatCompletionRequest)
    if chat:
        max_tokens = req.max_tokens
        if req.max_completion_tokens is not None:
            max_tokens = req.max_completion_tokens
    else:
        max_tokens = completion_max_tokens(req)
        if max_tokens == 0 and not req.echo:
            name = "max_tokens" if req.max_completion_tokens is None else "max_completion_tokens"
            raise RequestError(f"{name} must be at least 1, got 0 (0 is allowed with echo=true, "
                               "to score the prompt)", param=name)
        if max_tokens == 0:  # scoring: the prompt's logprobs come with the first step, whose
            max_tokens = 1   # token the response leaves out
    stop = req.stop if req.stop is not None else []
    bias = None
    if req.logit_bias:
        # plain ASCII decimal keys only: int() would also take " 5", "+5", "5_0" and
        # non-ASCII digits, reading another token id than the client meant
        bad = [k for k in req.logit_bias if not (k.isascii() and k.isdigit())]
        if bad:
            raise RequestError(f"logit_bias keys must be token ids written as decimal digits, "
                               f"got {bad[0]!r}", param="logit_bias")
        bias = {int(k): v for k, v in req.logit_bias.items()}
    if chat:
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        prompt_logprobs = None
    else:
        logprobs = req.logprobs
        prompt_logprobs = req.logprobs if req.echo else None
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            seed=req.seed,
            stop=[stop] if isinstance(stop, str) else list(stop),
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos,
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens,
            n=req.n,
            min_p=0.0 if req.min_p is None else req.min_p,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            logit_bias=bias,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            min_tokens=req.min_tokens or 0,
            truncate_prompt_tokens=req.truncate_prompt_tokens,
            structured_outputs=structured_outputs_of(req),
            cache_salt=req.cache_salt,
        )
    except InvalidRequest as exc:
        # the engine's field name -> the request's (the message starts with the field name)
        param, msg = exc.param, str(exc)
        if param in ("logprobs", "prompt_logprobs") and chat:
            rename = "top_logprobs"
        elif param == "prompt_logprobs":
            rename = "logprobs"
        elif param == "max_tokens" and req.max_completion_tokens is not None:
            rename = "max_completion_tokens"
        else:
            rename = param
        if param is not None and rename != param:
            msg = msg.replace(param, rename, 1)
        raise RequestError(msg, param=rename) from exc
