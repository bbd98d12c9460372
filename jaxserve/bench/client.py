"""One streamed request to an OpenAI-compatible endpoint, timed chunk by chunk (httpx).

The request asks for ``stream=true`` and ``stream_options.include_usage``. Timestamps are taken
with ``time.perf_counter`` as each SSE event is parsed. A *token chunk* is a chunk whose choice
carries non-empty ``text`` (completions) or ``delta.content`` (chat); the chat role chunk and a
trailing finish chunk with an empty delta are not tokens (a stream whose only choice chunk is a
finish chunk with no text still counts that chunk as its first token, so a one-token reply whose
token decodes to nothing succeeds). TTFT is the time to the first token chunk, ITLs the gaps
between successive token chunks, latency the time to the last chunk with choices (the usage
chunk and ``[DONE]`` excluded, as in vLLM). Output and prompt token counts come from the usage
chunk; a server that sends none is counted one output token per token chunk, with the prompt
length the dataset's. A non-200 status, an ``error`` event, no token chunk, or a transport error
fails the request with its error text.
"""

from __future__ import annotations

import json
import time
import traceback
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from jaxserve.bench.datasets import SampleRequest
from jaxserve.bench.metrics import RequestResult

if TYPE_CHECKING:  # httpx is the bench extra's; its callers require it (jaxserve.extras)
    import httpx


def build_payload(
    sample: SampleRequest,
    model: str,
    chat: bool,
    ignore_eos: bool,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The JSON body for ``sample`` (``max_tokens`` = its expected output length)."""
    body: dict[str, Any] = {"model": model, "stream": True,
                            "stream_options": {"include_usage": True}}
    if chat:
        body["messages"] = [{"role": "user", "content": sample.prompt}]
        body["max_completion_tokens"] = sample.expected_output_len
    else:
        body["prompt"] = sample.prompt
        body["max_tokens"] = sample.expected_output_len
    if ignore_eos:
        body["ignore_eos"] = True
    body.update(extra or {})
    return body


def _token_text(choice: dict[str, Any], chat: bool) -> str:
    if chat:
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


async def send_request(
    client: httpx.AsyncClient,
    url: str,
    payload: dict[str, Any],
    prompt_len: int,
    chat: bool,
    headers: dict[str, str] | None = None,
) -> RequestResult:
    """POST ``payload`` to ``url`` and measure the streamed reply; never raises (except
    cancellation): failures come back as ``success=False`` with ``error`` set."""
    out = RequestResult(prompt_len=prompt_len)
    st = time.perf_counter()
    out.start_time = st
    last_token = last_choice = st
    first = False
    n_chunks = 0
    text: list[str] = []
    usage: dict[str, Any] | None = None
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                out.error = f"HTTP {resp.status_code}: {body[:1000]}"
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, SSE comments (pings), other fields
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:
                    err = chunk["error"]
                    msg = err.get("message", err) if isinstance(err, dict) else err
                    out.error = f"stream error: {msg}"
                    return out
                if chunk.get("usage"):
                    usage = chunk["usage"]
                choices = chunk.get("choices") or []
                if not choices:
                    continue
                last_choice = now
                piece = _token_text(choices[0], chat)
                is_token = bool(piece) or (not first and bool(choices[0].get("finish_reason")))
                if not is_token:
                    continue
                if not first:
                    first, out.ttft = True, now - st
                else:
                    out.itl.append(now - last_token)
                last_token = now
                n_chunks += 1
                text.append(piece)
        if not first:
            out.error = "no token chunk in the stream (cannot measure TTFT)"
            return out
        out.success = True
        out.latency = last_choice - st
        out.generated_text = "".join(text)
        if usage is not None:
            out.output_tokens = int(usage.get("completion_tokens") or 0)
            if usage.get("prompt_tokens") is not None:
                out.prompt_len = int(usage["prompt_tokens"])
        else:
            out.output_tokens = n_chunks
    except Exception:  # noqa: BLE001 -- any transport or protocol fault fails this request only
        out.success = False
        out.error = traceback.format_exc(limit=3)
    return out


def server_root(base_url: str) -> str:
    """The server's root URL from ``--base-url``: a trailing ``/`` and a trailing ``/v1`` (the
    base URL OpenAI's clients take) dropped, so that ``/v1/models`` and ``/metrics`` are found
    under it. ``http://h:8000/v1/`` -> ``http://h:8000``.

    Raises:
      ValueError: naming --base-url, for a URL that is not http(s)://HOST[:PORT][/PATH].
    """
    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--base-url must be http(s)://HOST[:PORT], got {base_url!r}")
    root = base_url.rstrip("/")
    return root.removesuffix("/v1")


def error_text(resp: httpx.Response, limit: int = 300) -> str:
    """What a failed response says, for an error line: its body up to ``limit`` characters, or
    a note that it is an HTML page (a web server or proxy, not an OpenAI-compatible API)."""
    body = resp.text.strip()
    if "html" in resp.headers.get("content-type", "") or body[:1] == "<":
        return "an HTML page (is this an OpenAI-compatible server's root URL?)"
    return body[:limit]


async def first_model(client: httpx.AsyncClient, base_url: str) -> str:
    """The first model id of ``GET {base_url}/v1/models``.

    Raises:
      ValueError: the server is unreachable, answers non-200, or lists no model.
    """
    import httpx  # the caller's client is an httpx one: it is installed

    try:
        resp = await client.get(f"{base_url}/v1/models")
    except httpx.HTTPError as e:
        raise ValueError(f"cannot reach {base_url}/v1/models: {e!r}") from e
    if resp.status_code != 200:
        raise ValueError(f"GET {base_url}/v1/models: HTTP {resp.status_code}: "
                         f"{error_text(resp)}")
    try:
        data = resp.json().get("data") or []
    except (ValueError, AttributeError):
        raise ValueError(f"GET {base_url}/v1/models did not answer a model list: "
                         f"{error_text(resp)}; pass --model") from None
    if not data:
        raise ValueError(f"{base_url}/v1/models lists no model; pass --model")
    return str(data[0]["id"])
