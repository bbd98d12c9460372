"""Offline batch files: ``jaxserve run-batch -i in.jsonl -o out.jsonl`` (OpenAI Batch format).

Each input line is one request of the OpenAI Batch API::

    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

and each output line answers one input line, in input order::

    {"id": "batch_req_<hex>", "custom_id": "q1",
     "response": {"status_code": 200, "request_id": "chatcmpl-<hex>", "body": {...}},
     "error": null}

Data flow: the whole file is read first (a missing file fails before the model loads). Each line
is decoded with msgspec, its ``body`` kept as raw JSON bytes and handed to the HTTP server's own
request path, ``server.OpenAIServer.prepare`` (decode, checks, limits, tokenise) then ``respond``
(the engine run and the response body), so a line gets exactly the answer a non-streamed HTTP
request with that body would get. Up to ``max_in_flight`` lines run at once in the
``AsyncEngine``, which batches them continuously; results are written as soon as every line
before them is written, and a tqdm bar counts finished lines.

Errors, one line each, and the run goes on:
  - a line that is not a JSON object of the four fields, a ``method`` other than POST, a ``url``
    other than the two generation endpoints, or a line longer than ``max_request_body_bytes``:
    ``response: null`` and ``error: {"code", "message"}`` (the request was never run);
  - a body the server would refuse (400, 404 for another model, 413), ``"stream": true`` (400: a
    batch has no stream), or an engine failure (500): ``response`` carries that status and the
    server's OpenAI-style error body, and ``error`` is null, as the OpenAI Batch API reports HTTP
    errors.
Whitespace-only lines are skipped (no output line).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections import Counter
from pathlib import Path
from typing import IO

import msgspec
from tqdm import tqdm

from jaxserve.server import protocol as p
from jaxserve.server.handlers import OpenAIServer

logger = logging.getLogger(__name__)

BATCH_URLS = {"/v1/completions": False, "/v1/chat/completions": True}  # url -> chat


class BatchInput(msgspec.Struct, kw_only=True):
    """One input line; unknown keys are ignored."""

    custom_id: str
    method: str
    url: str
    body: msgspec.Raw


class BatchResponse(msgspec.Struct, kw_only=True):
    """An output line's ``response``: the HTTP status the server would have answered, the
    request id, and the response (or OpenAI-style error) body as raw JSON."""

    status_code: int
    request_id: str
    body: msgspec.Raw


class BatchError(msgspec.Struct, kw_only=True):
    """An output line's ``error`` for a line that is not a request at all: ``code`` is one of
    ``invalid_json_line``, ``invalid_request``, ``invalid_method``, ``invalid_url``,
    ``line_too_large``; ``message`` says what was wrong."""

    code: str
    message: str


class BatchOutput(msgspec.Struct, kw_only=True):
    """One output line: exactly one of ``response`` and ``error`` is not null."""

    id: str
    custom_id: str | None
    response: BatchResponse | None
    error: BatchError | None


_input_decoder = msgspec.json.Decoder(BatchInput)
_encoder = msgspec.json.Encoder()


def _custom_id_of(line: bytes) -> str | None:
    """The line's ``custom_id`` when it can be read at all (for the error line of a bad line)."""
    try:
        obj = msgspec.json.decode(line)
    except (msgspec.DecodeError, RecursionError):
        return None
    cid = obj.get("custom_id") if isinstance(obj, dict) else None
    return cid if isinstance(cid, str) else None


def _line_error(line: bytes, code: str, message: str) -> BatchOutput:
    return BatchOutput(id=f"batch_req_{p.random_id()}", custom_id=_custom_id_of(line),
                       response=None, error=BatchError(code=code, message=message))


async def process_line(api: OpenAIServer, line: bytes) -> BatchOutput:
    """The output line answering one input line; never raises (errors become the line)."""
    cap = api.limits.max_request_body_bytes
    if len(line) > cap:
        return BatchOutput(
            id=f"batch_req_{p.random_id()}", custom_id=None, response=None,
            error=BatchError(code="line_too_large", message=(
                f"the line holds {len(line)} bytes; the limit is {cap} "
                "(--max-request-body-bytes)")),
        )  # fmt: skip
    try:
        item = _input_decoder.decode(line)
    except RecursionError:
        return _line_error(line, "invalid_json_line", "the line is nested too deeply")
    except msgspec.DecodeError as exc:
        if isinstance(exc, msgspec.ValidationError):  # the typed decoder stops at the first
            try:  # wrong type, before it has seen the whole line: is it JSON at all?
                msgspec.json.decode(line)
            except msgspec.DecodeError as syntax:
                exc = syntax
            except RecursionError:
                return _line_error(line, "invalid_json_line", "the line is nested too deeply")
            else:
                return _line_error(line, "invalid_request", f"invalid batch line: {exc}")
        return _line_error(line, "invalid_json_line", f"the line is not valid JSON: {exc}")
    if item.method != "POST":
        return _line_error(line, "invalid_method",
                           f"method must be POST, got {item.method!r}")
    if item.url not in BATCH_URLS:
        return _line_error(line, "invalid_url",
                           f"url must be one of {sorted(BATCH_URLS)}, got {item.url!r}")
    chat = BATCH_URLS[item.url]
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{p.random_id()}"
    try:
        job = await api.prepare(chat, bytes(item.body))
        if job.stream:
            raise p.RequestError("stream=true is not supported in a batch file", param="stream")
        status, body = 200, _encoder.encode(await api.respond(job, request_id))
    except p.RequestError as exc:
        status, body = exc.status, p.request_error_body(exc)
    except Exception as exc:  # an engine fault fails this line, not the run
        logger.exception("line %r failed", item.custom_id)
        status = 500
        body = p.error_body(f"internal server error: {type(exc).__name__}: {exc}",
                            "server_error")
    return BatchOutput(
        id=f"batch_req_{p.random_id()}", custom_id=item.custom_id, error=None,
        response=BatchResponse(status_code=status, request_id=request_id,
                               body=msgspec.Raw(body)),
    )  # fmt: skip


def read_lines(path: str | Path) -> list[bytes]:
    """The non-blank lines of a JSONL file, as bytes.

    Raises:
      ValueError: the file cannot be read (naming it and the cause).
    """
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read input file {path}: {exc.strerror or exc}") from None
    return [line for line in data.splitlines() if line.strip()]


async def run_batch(
    api: OpenAIServer,
    lines: list[bytes],
    out: IO[bytes],
    max_in_flight: int,
    progress: bool = True,
) -> Counter[str]:
    """Run every line through ``api`` with at most ``max_in_flight`` at once; write one output
    line per input line to ``out`` in input order (each as soon as the lines before it are
    written). Returns counts: ``"ok"`` (status 200), ``"failed"`` (everything else)."""
    if max_in_flight < 1:
        raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
    slots = asyncio.Semaphore(max_in_flight)
    done: dict[int, BatchOutput] = {}
    counts: Counter[str] = Counter()
    next_to_write = 0
    bar = tqdm(total=len(lines), desc="run-batch", unit="req", disable=not progress,
               file=sys.stderr)

    def write_ready() -> None:
        nonlocal next_to_write
        while next_to_write in done:
            result = done.pop(next_to_write)
            ok = result.response is not None and result.response.status_code == 200
            counts["ok" if ok else "failed"] += 1
            out.write(_encoder.encode(result) + b"\n")
            next_to_write += 1

    async def one(i: int, line: bytes) -> None:
        try:
            done[i] = await process_line(api, line)
        finally:
            slots.release()
            bar.update(1)
        write_ready()

    tasks: set[asyncio.Task] = set()
    try:
        for i, line in enumerate(lines):
            await slots.acquire()
            task = asyncio.create_task(one(i, line))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.gather(*tasks)
    finally:
        bar.close()
    write_ready()
    out.flush()
    return counts


def run_batch_file(
    api: OpenAIServer, lines: list[bytes], output_path: str | Path, max_in_flight: int,
    progress: bool = True,
) -> Counter[str]:
    """``run_batch`` of ``lines`` (from ``read_lines``) into a JSONL file (created or
    truncated); prints a summary line to stderr. Raises ValueError if the output cannot be
    written."""
    t0 = time.perf_counter()
    try:
        fh = open(output_path, "wb")  # noqa: SIM115 (closed below, after the run)
    except OSError as exc:
        raise ValueError(f"cannot write output file {output_path}: {exc.strerror or exc}") from None
    with fh:
        counts = asyncio.run(run_batch(api, lines, fh, max_in_flight, progress))
    print(f"run-batch: {len(lines)} lines, {counts['ok']} succeeded, {counts['failed']} failed, "
          f"in {time.perf_counter() - t0:.1f} s; wrote {output_path}", file=sys.stderr, flush=True)
    return counts
