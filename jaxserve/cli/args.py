"""Flags to configs: one ``--flag`` per ``EngineConfig`` field, the server and request-limit
flags, and ``--config FILE.yaml`` (the same keys as the flags; flags given on the command line
win). Unknown flags and keys are errors."""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing

import yaml

from jaxserve.config import LOG_FORMATS, EngineConfig, RequestLimits, ServerConfig

API_KEY_ENV = "JAXSERVE_API_KEY"

ENGINE_HELP = {
    "block_size": "tokens per KV-cache block (power of two)",
    "num_kv_blocks": "number of KV-cache blocks (overrides both memory settings; block 0 is "
                     "reserved)",
    "kv_cache_memory_gib": "KV-cache size in GiB (CPU default when unset: 2 GiB)",
    "kv_cache_memory_fraction": "fraction of free device memory after weights for the KV cache "
                                "on accelerators",
    "max_num_seqs": "most sequences in one step",
    "max_num_batched_tokens": "most tokens (prefill chunks + decode tokens) in one step; the "
                              "largest compiled bucket",
    "long_prefill_token_threshold": "when > 0, the most prompt tokens one request computes in a "
                                    "step, leaving budget to admit others behind a long prompt; "
                                    "0: off",
    "max_model_len": "context window, prompt + output tokens (default: the model's)",
    "enable_prefix_caching": "reuse the KV cache of full blocks shared with earlier requests "
                             "(chained block hashes)",
    "kv_offloading_size": "GiB of pinned host memory for a second KV tier: evicted cached "
                          "blocks go there and are found again; preempted requests swap there "
                          "(default: no host tier)",
    "dtype": "weights and activations: auto (float32 on CPU, bfloat16 on accelerators), "
             "float32, bfloat16, float16",
    "kv_cache_dtype": "KV-cache storage: auto (the serving dtype), fp8 (float8 e4m3) or int8, "
                      "8-bit with per-(layer, kv-head) scales calibrated at start",
    "kv_calibration_file": "text file whose K/V magnitudes set the 8-bit KV scales (default: "
                           "a short passage shipped with jaxserve)",
    "kv_scale_mode": "advanced: calibrated (scales from the calibration text) or unit (every "
                     "scale 1.0, the accuracy-losing default of some engines; for comparison)",
    "kv_calibration_percentile": "advanced: percentile of |K|, |V| per (layer, head) that maps "
                                 "to the 8-bit maximum (100: the absolute maximum)",
    "seed": "seed for dummy weights and for requests without one",
    "attention_backend": "auto (Pallas kernel on GPUs, pure-jnp op elsewhere), reference, pallas, "
                         "or pallas-interpret (the kernel in the Pallas interpreter; CPU tests)",
    "compilation_cache_dir": "persistent XLA compilation cache directory ('' disables it)",
    "tensor_parallel_size": "devices one model is split over (heads, MLP and vocabulary); "
    "must divide num_heads",
    "quantization": "weight quantisation at load time: none, int8 (per output channel), int4 "
                    "(group-wise asymmetric, two per byte) or fp8 (e4m3, per channel); "
                    "every linear of the decoder layers",
    "quantization_group_size": "input rows per int4 scale and zero point; must divide the "
                               "quantised weights' input dims (576 and 1536 for SmolLM2)",
    "quantize_embeddings": "also quantise the embedding table and the LM head (needs "
                           "--quantization)",
}


def _field_type(f: dataclasses.Field) -> type:
    hints = typing.get_type_hints(EngineConfig)
    t = hints[f.name]
    args = [a for a in typing.get_args(t) if a is not type(None)]
    return args[0] if args else t


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """One ``--flag`` per EngineConfig field, default None (= the field's default)."""
    g = p.add_argument_group("engine")
    for f in dataclasses.fields(EngineConfig):
        default = f.default
        if _field_type(f) is bool:  # --flag / --no-flag
            g.add_argument("--" + f.name.replace("_", "-"), dest=f.name,
                           action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                           help=f"{ENGINE_HELP[f.name]} (default: {default})")
            continue
        g.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=_field_type(f),
                       default=argparse.SUPPRESS, metavar=f.name.upper(),
                       help=f"{ENGINE_HELP[f.name]} (default: {default})")


def engine_config_from_args(ns: argparse.Namespace) -> EngineConfig:
    """EngineConfig from --config FILE.yaml then the flags given.

    Raises:
      ValueError: unknown keys in the file, or invalid values (naming the field).
    """
    values: dict[str, object] = {}
    if getattr(ns, "config", None):
        try:
            with open(ns.config, encoding="utf-8") as fh:
                data = yaml.safe_load(fh) or {}
        except OSError as e:
            raise ValueError(f"cannot read config file {ns.config}: {e.strerror or e}") from None
        except yaml.YAMLError as e:
            raise ValueError(f"config file {ns.config} is not valid YAML: "
                             f"{str(e).splitlines()[0]}") from None
        if not isinstance(data, dict):
            raise ValueError(f"config file {ns.config} must hold a mapping of flag: value")
        names = {f.name for f in dataclasses.fields(EngineConfig)}
        for k, v in data.items():
            key = str(k).replace("-", "_")
            if key not in names:
                raise ValueError(f"config file {ns.config}: unknown key {k!r}")
            values[key] = v
    for f in dataclasses.fields(EngineConfig):
        v = getattr(ns, f.name, None)
        if v is not None:
            values[f.name] = v
    return EngineConfig(**values)  # type: ignore[arg-type]


def add_server_args(p: argparse.ArgumentParser) -> None:
    """The ServerConfig flags (defaults from ServerConfig)."""
    d = ServerConfig()
    g = p.add_argument_group("server")
    g.add_argument("--host", default=d.host, help="address to listen on")
    g.add_argument("--port", type=int, default=d.port, help="port to listen on (0: any free)")
    g.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize; "
                        f"when not given, ${API_KEY_ENV} if set")
    g.add_argument("--max-waiting-requests", type=int, default=d.max_waiting_requests,
                   help="answer 503 (Retry-After) to new generation requests while this many "
                        "are waiting to run")
    g.add_argument("--request-timeout-s", type=float, default=d.request_timeout_s,
                   help="abort a generation request unfinished after this many seconds (504); "
                        "None: no limit")
    g.add_argument("--drain-timeout-s", type=float, default=d.drain_timeout_s,
                   help="on SIGTERM, seconds in-flight requests get to finish before they are "
                        "aborted")
    g.add_argument("--log-level", default=d.log_level,
                   choices=["debug", "info", "warning", "error"], help="log level")
    g.add_argument("--log-format", default=d.log_format, choices=LOG_FORMATS,
                   help="text, or json: one object per line (time, level, logger, message, "
                        "request_id)")


def add_limit_args(p: argparse.ArgumentParser) -> None:
    """The RequestLimits flags (defaults from RequestLimits)."""
    d = RequestLimits()
    g = p.add_argument_group("request limits")
    g.add_argument("--max-request-body-bytes", type=int, default=d.max_request_body_bytes,
                   help="largest request body (or batch line) in bytes, refused before it is "
                        "parsed (413)")
    g.add_argument("--max-num-messages", type=int, default=d.max_num_messages,
                   help="most chat messages in one request, refused before tokenising (400)")
    g.add_argument("--max-n", type=int, default=d.max_n,
                   help="largest n (choices per request) accepted (400 above it)")


def limits_from_args(ns: argparse.Namespace) -> RequestLimits:
    """RequestLimits from the flags."""
    return RequestLimits(max_request_body_bytes=ns.max_request_body_bytes,
                         max_num_messages=ns.max_num_messages, max_n=ns.max_n)


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--load-format", default="auto", choices=["auto", "gguf", "dummy"],
                   help="dummy: random weights of a built-in config")
    p.add_argument("--served-model-name", default=None,
                   help="the model id in /v1/models and requests (default: from the model)")
    p.add_argument("--config", default=None, help="YAML file with engine settings (flag names)")


def server_config_from_args(ns: argparse.Namespace) -> ServerConfig:
    """ServerConfig from the flags; the API key falls back to $JAXSERVE_API_KEY."""
    return ServerConfig(
        host=ns.host, port=ns.port, api_key=ns.api_key or os.environ.get(API_KEY_ENV) or None,
        max_waiting_requests=ns.max_waiting_requests, request_timeout_s=ns.request_timeout_s,
        drain_timeout_s=ns.drain_timeout_s, log_level=ns.log_level, log_format=ns.log_format,
    )  # fmt: skip
