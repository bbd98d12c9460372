"""Serve the fake engine through the code path ``jaxserve serve`` uses after loading the model
(``logs.configure_logging``, ``server.build_app``, ``server_ops.run_server``), for the drain tests:

    python tests/support/serve_fake.py PORT [--step-s S] [--shutdown-timeout S]
        [--timeout-keep-alive S]

Logs are JSON lines on stderr; exits 0 after a SIGTERM drain.
"""

from __future__ import annotations

import argparse

from fake_engine import FakeEngine

from jaxserve.server.gate import run_server
from jaxserve.server.logs import configure_logging
from jaxserve.server.routes import build_app
from jaxserve.server_config import ServerConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("port", type=int)
    ap.add_argument("--step-s", type=float, default=0.05)
    ap.add_argument("--shutdown-timeout", type=float, default=30.0)
    ap.add_argument("--timeout-keep-alive", type=int, default=120)
    ns = ap.parse_args()
    cfg = ServerConfig(port=ns.port, shutdown_timeout=ns.shutdown_timeout,
                       timeout_keep_alive=ns.timeout_keep_alive, log_format="json")
    configure_logging(cfg.log_level, cfg.log_format)
    run_server(build_app(FakeEngine(max_model_len=100_000, step_s=ns.step_s), "fake", cfg))


if __name__ == "__main__":
    main()
