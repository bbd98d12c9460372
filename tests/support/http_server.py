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
