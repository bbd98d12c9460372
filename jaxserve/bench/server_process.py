"""A local ``jaxserve serve`` subprocess for the measuring commands (``jaxserve sweep``), and a
free local port (also ``jaxserve bench startup``'s)."""

from __future__ import annotations

import shlex
import signal
import socket
import subprocess
import sys
import time
from typing import Self

from jaxserve.extras import require


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A ``jaxserve serve`` subprocess on a free local port, ready once ``/ready`` answers 200.

    Args:
      args: the ``jaxserve serve`` arguments (host and port are added).
      timeout_s: how long loading and compiling may take.
    Raises (on entering):
      ValueError: the server exited or was not ready in time (its last output quoted).
    """

    def __init__(self, args: list[str], timeout_s: float, log_path: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "jaxserve.cli.main", "serve", *args, "--host", "127.0.0.1",
                    "--port", str(self.port)]
        self.timeout_s = timeout_s
        self.log_path = log_path

    def __enter__(self) -> Self:
        self.log = open(self.log_path, "w", encoding="utf-8")  # closed in __exit__
        print(f"starting: {shlex.join(self.cmd)}", flush=True)
        httpx = require("httpx", "bench", "jaxserve sweep")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.__exit__(None, None, None)
                raise ValueError(f"server exited with {self.proc.returncode}: {self._tail()}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.__exit__(None, None, None)
        raise ValueError(f"server not ready after {self.timeout_s} s: {self._tail()}")

    def _tail(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as fh:
            return fh.read()[-2000:]

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # drains (nothing in flight), exits 0
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
