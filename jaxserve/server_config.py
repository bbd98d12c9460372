"""The HTTP server's settings: ``ServerConfig`` (``jaxserve serve`` flags that are not engine
fields) and ``RequestLimits`` (caps on one request, for ``serve`` and ``run-batch``). Apart from
``jaxserve.config`` (the engine's and the loader's) so that each file holds one concern.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")
METRICS_COMPAT = ("vllm",)
API_KEY_ENV = "JAXSERVE_API_KEY"
"""Where ``jaxserve serve`` reads the API key from when ``--api-key`` is not given."""


@dataclass(frozen=True)
class RequestLimits:
    """Caps on one request, checked before the work they bound (``serve`` and ``run-batch``);
    each field's ``help`` metadata is its ``--flag`` help.

    Raises:
      ValueError: naming the field and value, for a cap below 1.
    """

    # HTTP: 413 from the Content-Length header, else while reading; run-batch: an error line
    max_request_body_bytes: int = field(default=8 * 1024 * 1024, metadata={
        "help": "largest request body (or batch line) in bytes, refused before it is parsed "
                "(413)"})
    # chat completions and /tokenize: 400 naming ``messages``, before the chat template runs
    max_num_messages: int = field(default=1024, metadata={
        "help": "most chat messages in one request, refused before tokenising (400)"})
    # 400 naming ``n``
    max_n: int = field(default=16, metadata={
        "help": "largest n (choices per request) accepted (400 above it)"})
    # completions: 400 naming ``prompt``, before anything is tokenised
    max_num_prompts: int = field(default=1024, metadata={
        "help": "most prompts in one batched completions request (400 above it)"})

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{f.name}={value!r} must be an integer >= 1")


@dataclass(frozen=True)
class ServerConfig:
    """HTTP server settings (``jaxserve serve`` flags that are not engine fields); each field's
    ``help`` metadata is its ``--flag`` help, ``choices`` its allowed values.

    Raises:
      ValueError: naming the field and value, for invalid settings.
    """

    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=8000, metadata={"help": "port to listen on (0: any free)"})
    # else 401; /health, /ready, /metrics and /openapi.json stay open
    api_key: str | None = field(default=None, metadata={
        "help": f"require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize; when "
                f"not given, ${API_KEY_ENV} if set"})
    # counts requests accepted by the engine and not yet running
    max_waiting_requests: int = field(default=1024, metadata={
        "help": "answer 503 (Retry-After) to new generation requests while this many are "
                "waiting to run"})
    # counted from arrival; a started stream ends with an error event instead
    request_timeout_s: float | None = field(default=None, metadata={
        "help": "abort a generation request unfinished after this many seconds (504); None: no "
                "limit"})
    # vLLM's and uvicorn's flag names (seconds both); see docs/configuration.md#kubernetes
    shutdown_timeout: float = field(default=30.0, metadata={
        "help": "on SIGTERM, seconds in-flight requests get to finish before they are aborted"})
    timeout_keep_alive: int = field(default=120, metadata={
        "help": "seconds an idle keep-alive connection stays open (sent as 'Keep-Alive: "
                "timeout=N'); above the idle timeout of the proxies in front"})
    # /v1/responses: what previous_response_id and GET /v1/responses/{id} can find
    max_stored_responses: int = field(default=100, metadata={
        "help": "how many finished /v1/responses responses (with store, the default) are kept "
                "in memory, the oldest dropped first; 0: none (store: true is then a 400)"})
    enable_prompt_tokens_details: bool = field(default=False, metadata={
        "help": "report usage.prompt_tokens_details.cached_tokens (prompt tokens the prefix "
                "cache held) in completions and chat responses, as vLLM's flag (off: the "
                "usage has no such key)"})
    metrics_compat: str | None = field(default=None, metadata={
        "help": "vllm: /metrics also exports the series vLLM has under vLLM's names (vllm:*), "
                "for routers and autoscalers set up for vLLM; unset: jaxserve:* names only",
        "choices": METRICS_COMPAT})
    log_level: str = field(default="info", metadata={"help": "log level", "choices": LOG_LEVELS})
    log_format: str = field(default="text", metadata={
        "help": "text, or json: one object per line (time, level, logger, message, request_id)",
        "choices": LOG_FORMATS})

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"{self.port=} must be in [0, 65535]")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty")
        if self.max_waiting_requests < 1:
            raise ValueError(f"{self.max_waiting_requests=} must be >= 1")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError(f"{self.request_timeout_s=} must be > 0")
        if not self.shutdown_timeout >= 0:
            raise ValueError(f"{self.shutdown_timeout=} must be >= 0")
        if self.max_stored_responses < 0:
            raise ValueError(f"{self.max_stored_responses=} must be >= 0")
        if self.timeout_keep_alive < 1:
            raise ValueError(f"{self.timeout_keep_alive=} must be >= 1")
        if self.metrics_compat not in (None, *METRICS_COMPAT):
            raise ValueError(f"{self.metrics_compat=} must be None or one of {METRICS_COMPAT}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"{self.log_level=} must be debug, info, warning or error")
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"{self.log_format=} must be one of {LOG_FORMATS}")
