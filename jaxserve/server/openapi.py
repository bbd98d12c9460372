"""The OpenAPI 3.1 document served at ``GET /openapi.json``.

Request and response schemas are generated from the msgspec Structs of ``protocol.py``
(``msgspec.json.schema_components``), so the document cannot drift from what the decoder accepts.
Streams are described as ``text/event-stream`` whose events carry the chunk schemas.
"""

from __future__ import annotations

import msgspec

from jaxserve import __version__
from jaxserve.server import output_protocol as o
from jaxserve.server import protocol as p
from jaxserve.server.gate import is_protected
from jaxserve.server.lifecycle import ReadyStatus
from jaxserve.server.responses import protocol as rp

_REF = "#/components/schemas/{name}"
_STRUCTS = (
    p.CompletionRequest, p.ChatCompletionRequest, p.TokenizeRequest, p.DetokenizeRequest,
    o.CompletionResponse, o.ChatCompletionResponse, o.CompletionChunk, o.ChatCompletionChunk,
    o.ModelList, o.ModelCard, p.TokenizeResponse, p.DetokenizeResponse, o.TokenizerInfoResponse,
    p.ErrorResponse, ReadyStatus, rp.ResponsesRequest, rp.ResponseObject, rp.DeletedResponse,
    rp.LifecycleEvent, rp.OutputItemEvent, rp.ContentPartEvent, rp.TextDeltaEvent,
    rp.TextDoneEvent, rp.ArgumentsDeltaEvent, rp.ArgumentsDoneEvent, rp.ErrorEvent,
)  # fmt: skip
_EVENTS = ("LifecycleEvent", "OutputItemEvent", "ContentPartEvent", "TextDeltaEvent",
           "TextDoneEvent", "ArgumentsDeltaEvent", "ArgumentsDoneEvent", "ErrorEvent")
_ERRORS = {
    "400": "invalid request",
    "401": "missing or wrong API key (only with --api-key)",
    "404": "unknown model (or stored response)",
    "413": "request body larger than --max-request-body-bytes",
    "500": "the engine thread has died",
    "503": "not ready yet, overloaded (queue full) or shutting down; Retry-After says when to "
           "retry",
    "504": "the request timed out (--request-timeout-s)",
}


def _ref(struct: type) -> dict:
    return {"$ref": _REF.format(name=struct.__name__)}


def _json(struct: type, description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": _ref(struct)}}}


def _op(summary: str, ok: dict, body: type | None = None, errors: tuple[str, ...] = ()) -> dict:
    op: dict = {"summary": summary, "responses": {"200": ok}}
    if body is not None:
        op["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": _ref(body)}},
        }
    for code in errors:
        op["responses"][code] = _json(p.ErrorResponse, _ERRORS[code])
    return op


def _generation(summary: str, body: type, response: type, chunk: type) -> dict:
    name = chunk.__name__
    ok = _json(response, f"the completion; with stream=true, server-sent events "
                         f"`data: <{name}>` ending with `data: [DONE]`")
    # before OpenAPI 3.2 (no itemSchema) the schema of an event stream describes one event
    event = {"type": "object", "required": ["data"], "properties": {
        "data": {"type": "string", "description": f"a JSON {name}, or [DONE] last"},
        "event": {"type": "string"}, "id": {"type": "string"}}}  # fmt: skip
    ok["content"]["text/event-stream"] = {"schema": event}
    return _op(summary, ok, body, ("400", "404", "413", "503", "504"))


def _responses() -> dict:
    ok = _json(rp.ResponseObject, "the response; with stream=true, server-sent events "
                                  "`event: <type>` and `data: <event>` (no [DONE])")
    event = {"type": "object", "required": ["data"], "properties": {
        "data": {"type": "string", "description": "a JSON event, one of " + ", ".join(_EVENTS)},
        "event": {"type": "string", "description": "the event's type"}}}  # fmt: skip
    ok["content"]["text/event-stream"] = {"schema": event}
    return _op("Create a model response (the Responses API)", ok, rp.ResponsesRequest,
               ("400", "404", "413", "503", "504"))


def openapi_document(api_key: bool) -> dict:
    """The OpenAPI document; with ``api_key`` the protected operations declare bearer auth."""
    _, schemas = msgspec.json.schema_components(_STRUCTS, ref_template=_REF)
    text = {"description": "text", "content": {"text/plain": {"schema": {"type": "string"}}}}
    status = {"description": "alive", "content": {"application/json": {"schema": {
        "type": "object", "properties": {"status": {"type": "string"}}}}}}  # fmt: skip
    response_id = {"name": "response_id", "in": "path", "required": True,
                   "schema": {"type": "string"}}
    paths = {
        "/v1/completions": {"post": _generation(
            "Text completion", p.CompletionRequest, o.CompletionResponse, o.CompletionChunk)},
        "/v1/chat/completions": {"post": _generation(
            "Chat completion", p.ChatCompletionRequest, o.ChatCompletionResponse,
            o.ChatCompletionChunk)},
        "/v1/responses": {"post": _responses()},
        "/v1/responses/{response_id}": {
            "get": {**_op("A stored response", _json(rp.ResponseObject, "the response"),
                          errors=("400", "404")), "parameters": [response_id]},
            "delete": {**_op("Forget a stored response",
                             _json(rp.DeletedResponse, "the response is forgotten"),
                             errors=("404",)), "parameters": [response_id]}},
        "/v1/models": {"get": _op("The served model", _json(o.ModelList, "the model list"))},
        "/v1/models/{model_id}": {"get": {
            **_op("The served model by id", _json(o.ModelCard, "the model"), errors=("404",)),
            "parameters": [{"name": "model_id", "in": "path", "required": True,
                            "schema": {"type": "string"}}]}},
        "/tokenizer_info": {"get": _op(
            "The tokenizer's special tokens, chat template and settings (vLLM's)",
            _json(o.TokenizerInfoResponse, "the tokenizer settings"))},
        "/tokenize": {"post": _op("Token ids of a prompt or chat messages",
                                  _json(p.TokenizeResponse, "the token ids"),
                                  p.TokenizeRequest, ("400", "404", "413"))},
        "/detokenize": {"post": _op("Text of token ids", _json(p.DetokenizeResponse, "the text"),
                                    p.DetokenizeRequest, ("400", "404", "413"))},
        "/health": {"get": _op("Liveness: 200 from process start while the engine thread lives",
                               status, errors=("500",))},
        "/ready": {"get": {"summary": "Readiness: 200 once every program is compiled and a probe "
                                      "step ran; 503 before and from the start of a drain",
                           "responses": {"200": _json(ReadyStatus, "ready"),
                                         "503": _json(ReadyStatus, "loading, compiling or "
                                                                   "draining")}}},
        "/metrics": {"get": _op("Prometheus metrics", text)},
        "/openapi.json": {"get": _op("This document", {"description": "the OpenAPI document"})},
    }  # fmt: skip
    components: dict = {"schemas": schemas}
    if api_key:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, ops in paths.items():
            if is_protected(path):
                for op in ops.values():
                    op["security"] = [{"bearer": []}]
                    op["responses"]["401"] = _json(p.ErrorResponse, _ERRORS["401"])
    return {
        "openapi": "3.1.0",
        "info": {"title": "jaxserve", "version": __version__,
                 "description": "OpenAI-compatible LLM serving API"},
        "paths": paths,
        "components": components,
    }  # fmt: skip
