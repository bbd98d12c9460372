"""Serve an ASGI app with a real uvicorn server on 127.0.0.1, on an ephemeral port.

    with serve_app(build_app(engine, "m")) as base_url:
        client = openai.OpenAI(base_url=base_url + "/v1", api_key="none")

The server runs in a background thread with its own event loop; the app (and the engine's
asyncio work) runs on that loop.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import uvicorn
from starlette.types import ASGIApp


@contextlib.contextmanager
def serve_app(app: ASGIApp, timeout_s: float = 30.0) -> Iterator[str]:
    """Start uvicorn on 127.0.0.1:0 in a thread; yield ``http://127.0.0.1:<port>``; stop it."""
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=0,
        log_level="warning",
        lifespan="off",
        timeout_graceful_shutdown=5,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("uvicorn exited before it started")
        if time.monotonic() > deadline:
            server.should_exit = True
            raise TimeoutError(f"uvicorn did not start within {timeout_s} s")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout_s)


@contextlib.contextmanager
def serve_engine(engine, model: str, *, caching: bool | None = None) -> Iterator[str]:
    """An ``LLMEngine`` behind ``AsyncEngine`` and the app, over real HTTP; yields the base URL.

    ``caching``: None leaves the engine's prefix caching as it is; False turns it off for the
    block (tests comparing two requests' floats exactly: a reused prefix computes only the rest,
    which can change the last bits). Afterwards the engine holds no request.
    """
    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.server.routes import build_app
    from tests.support.kv import kv_manager

    with kv_manager(engine, caching=caching) if caching is not None else contextlib.nullcontext():
        aeng = AsyncEngine(engine)
        aeng.start(warmup=False)
        try:
            with serve_app(build_app(aeng, model)) as url:
                yield url
        finally:
            aeng.shutdown()
    assert not engine.has_unfinished_requests()
