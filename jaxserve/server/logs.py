"""Logging for the server: every record carries the id of the request it was logged for.

The HTTP middleware sets ``request_id_var`` (a contextvar) for the duration of a request; the
record factory installed by ``install_request_id()`` copies it into ``record.request_id`` (None
outside a request, e.g. on the engine thread). Because the factory sees every record, this holds
for our loggers and uvicorn's (the access log line of a request carries its id) whatever
handlers are configured. ``configure_logging`` sets up the root handler in one of two formats:

  text: ``2025-01-01 12:00:00,000 INFO jaxserve.server.handlers [r-42]: message``
  json: ``{"time": "...Z", "level": "INFO", "logger": "jaxserve.server.handlers", "message": "...",
          "request_id": "r-42"}`` (plus ``"exc_info"`` with the traceback when there is one)
"""

from __future__ import annotations

import contextvars
import datetime
import json
import logging

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "jaxserve_request_id", default=None
)
_installed = False


def install_request_id() -> None:
    """Make every new LogRecord carry ``request_id`` (idempotent)."""
    global _installed
    if _installed:
        return
    base = logging.getLogRecordFactory()

    def factory(*args: object, **kwargs: object) -> logging.LogRecord:
        record = base(*args, **kwargs)
        record.request_id = request_id_var.get()
        return record

    logging.setLogRecordFactory(factory)
    _installed = True


class TextFormatter(logging.Formatter):
    """``time LEVEL logger [request_id]: message`` (the bracket only inside a request)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s%(rid)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        rid = getattr(record, "request_id", None)
        record.rid = f" [{rid}]" if rid else ""
        return super().format(record)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (UTC, ISO 8601), level, logger, message, request_id."""

    def format(self, record: logging.LogRecord) -> str:
        t = datetime.datetime.fromtimestamp(record.created, tz=datetime.UTC)
        obj = {
            "time": t.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "request_id": getattr(record, "request_id", None),
        }
        if record.exc_info:
            obj["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(obj, ensure_ascii=False)


def configure_logging(level: str = "info", fmt: str = "text") -> None:
    """Route all logging (uvicorn's included) to one stderr handler in ``fmt`` ("text"/"json")."""
    install_request_id()
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # jax logs "Unable to initialize backend 'tpu'" at INFO on every start without a TPU: it
    # read as an error to a new user; WARNING and above still show
    logging.getLogger("jax._src.xla_bridge").setLevel(max(root.level, logging.WARNING))
