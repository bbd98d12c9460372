"""``jaxserve serve`` and ``jaxserve run-batch``.

serve: bind the HTTP port at once (``/health`` and ``/ready`` answer from then on), load the
model and compile every step program on a thread (``/ready`` reports the stage), open the
model endpoints, and serve until SIGTERM has drained the server (or SIGINT stops it).
run-batch: load and compile, then run an OpenAI Batch file."""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
import typing

import jax

from jaxserve.cli.multihost import initialize
from jaxserve.config import EngineConfig, LoadConfig
from jaxserve.config_args import (
    engine_config_from_args,
    limits_from_args,
    load_config_from_args,
    server_config_from_args,
)
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.engine.data_parallel import DataParallelEngine, build_data_parallel
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.metrics import EngineMetrics
from jaxserve.loading.load import served_name
from jaxserve.platform import current_platform
from jaxserve.platform.process import freeze_heap, freeze_heap_when
from jaxserve.server.batch import read_lines, run_batch_file
from jaxserve.server.gate import run_server
from jaxserve.server.handlers import OpenAIServer
from jaxserve.server.lifecycle import Lifecycle
from jaxserve.server.logs import configure_logging
from jaxserve.server.routes import build_app


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


def start_engine(cfg: EngineConfig, load: LoadConfig, out: typing.TextIO) -> AsyncEngine:
    """Load the model and compile every step program, printing progress to ``out``."""
    t0 = time.perf_counter()
    engine = LLMEngine(cfg, load, metrics=EngineMetrics(served_name(load)))
    print(f"loaded {engine.model_name} in {engine.load_s:.1f} s ({engine.weights_summary()}, "
          f"{engine.num_blocks} KV blocks of {cfg.block_size} tokens "
          f"({engine.kv_layout.summary()}), max_model_len "
          f"{engine.max_model_len}, {attention_summary(engine)})", file=out, flush=True)
    aeng = AsyncEngine(engine)
    aeng.start(warmup=True, progress=True)
    st = aeng.warmup_stats
    print(compiled_line(st, time.perf_counter() - t0), file=out, flush=True)
    return aeng


BATCH_INVARIANT_COST = "up to 19% of the tokens: docs/configuration.md#batch-invariance"
"""What the start-up line says the batch-invariant mode costs (measured on an AVX512-BF16 CPU,
docs/decisions/0046-batch-invariance-opt-in.md)."""


def attention_summary(engine: LLMEngine) -> str:
    """"<backend> attention", and ", batch-invariant (costs ...)" where the engine runs that
    mode (``Platform.batch_invariant``, ``BATCH_INVARIANT_COST``)."""
    invariant = engine.platform.batch_invariant(engine.config)
    return f"{engine.attention_backend} attention" + (
        f", batch-invariant (costs {BATCH_INVARIANT_COST})" if invariant else "")


def compiled_line(warmup_stats: dict[str, float], ready_in_s: float) -> str:
    """The start-up line "compiled N programs in X s; ready in Y s", and how many programs
    compile after ready (``EngineConfig.background_compile``), if any."""
    st = warmup_stats
    line = (f"compiled {int(st['num_programs'])} programs in {st['compile_s']:.1f} s; ready in "
            f"{ready_in_s:.1f} s")
    if st.get("pending_programs"):
        line += f"; {int(st['pending_programs'])} more compile in the background"
    return line


def check_platform(cfg: EngineConfig) -> None:
    """Raise ValueError naming the flag (``--attention-backend``, ``--cpu-kernels``,
    ``--batch-invariant``) if this platform cannot run the settings (``Platform.check``: a GPU
    kernel on a CPU, native CPU kernels that cannot load or off the CPU)."""
    try:
        current_platform().check(cfg)
    except (ValueError, RuntimeError) as e:
        msg = str(e)
        for name in ("attention_backend", "cpu_kernels", "batch_invariant", "quantization",
                     "tensor_parallel_size"):
            msg = msg.replace(f"{name}=", f"--{name.replace('_', '-')}=", 1)
        raise ValueError(msg) from None


def startup_stages_line(engine: LLMEngine, warmup_stats: dict[str, float],
                        ready_in_s: float) -> str:
    """One line with each start-up stage's seconds after the imports (``jaxserve bench
    startup`` reads it): the engine's stages (``LLMEngine.startup_s``), the step programs'
    compile (wall, and the compile threads' CPU seconds), the probe step, and ``ready_in``,
    the seconds from ``serve()`` to ready."""
    stages = {**engine.startup_s, "compile": warmup_stats["compile_s"],
              "compile_cpu": warmup_stats.get("compile_cpu_s", 0.0),
              "probe": warmup_stats.get("probe_s", 0.0), "ready_in": ready_in_s}
    return "start-up stages (s): " + " ".join(f"{k}={v:.3f}" for k, v in stages.items())


def serve(ns: argparse.Namespace) -> None:
    """Bind the port, load and compile on a thread, then serve until SIGTERM has drained the
    server or SIGINT stops it (the module docstring). Every "ready" figure it prints, logs and
    exports counts from here (``Lifecycle``), after the imports."""
    t0 = time.monotonic()
    if ns.model and ns.model_opt and ns.model != ns.model_opt:
        raise ValueError(f"MODEL {ns.model!r} and --model {ns.model_opt!r} disagree")
    server_cfg = server_config_from_args(ns)
    limits = limits_from_args(ns)
    multi = initialize(ns.coordinator_address, ns.num_processes, ns.process_id)
    if multi and ns.data_parallel_size > 1:
        raise ValueError("--data-parallel-size > 1 with --num-processes > 1 is not supported")
    if multi:
        tp = engine_config_from_args(ns).tensor_parallel_size
        if tp != len(jax.devices()):
            raise ValueError(
                f"with --num-processes {ns.num_processes} the model spans every process's "
                f"devices: --tensor-parallel-size must be {len(jax.devices())}, got {tp}")
    if ns.process_id == 0:
        check_port_free(server_cfg.host, server_cfg.port)  # a clear error before anything runs
    configure_logging(server_cfg.log_level, server_cfg.log_format)
    cfg = engine_config_from_args(ns)
    check_platform(cfg)  # before the port is served and the weights are read
    load = load_config_from_args(ns, ns.model or ns.model_opt)
    name = served_name(load)
    if multi and ns.process_id != 0:  # a follower: same programs, steps from process 0
        engine = _load(cfg, load, ns, name)[1]
        engine.warmup(progress=False)
        freeze_heap()  # its collections would stall process 0's steps too
        steps = engine.runner.follow()
        print(f"process {ns.process_id}: process 0 stopped after {steps} steps", flush=True)
        return
    started: list[tuple[AsyncEngine | DataParallelEngine, LLMEngine]] = []

    def start(lifecycle: Lifecycle) -> AsyncEngine | DataParallelEngine:
        aeng, engine = _load(cfg, load, ns, name)
        started.append((aeng, engine))
        aeng.start(warmup=True, progress=True, on_compiled=lifecycle.compiling)
        # the start-up's objects out of every later collection's walk; a full collection
        # here, before ready, and the background compiles' objects once those end
        freeze_heap()
        replicas = aeng.replicas if isinstance(aeng, DataParallelEngine) else [aeng]
        freeze_heap_when([r.background.done for r in replicas if r.background is not None])
        st = aeng.warmup_stats
        ready_in = lifecycle.startup_done()  # the gate's "ready" log line says the same
        print(compiled_line(st, ready_in), flush=True)
        print(startup_stages_line(engine, st, ready_in), flush=True)
        return aeng

    finished = False
    try:
        finished = run_server(build_app(None, name, server_cfg, limits, started=t0), start)
    finally:
        for aeng, engine in started:
            aeng.shutdown()
            if multi and finished:
                engine.runner.stop_followers()
    if not finished:  # stopped during start-up: the loading thread cannot be cancelled
        print("stopped before the model was ready", file=sys.stderr, flush=True)
        os._exit(0)


def _load(cfg: EngineConfig, load: LoadConfig, ns: argparse.Namespace, name: str
          ) -> tuple[AsyncEngine | DataParallelEngine, LLMEngine]:
    """Load the engine(s) (unstarted) and print the start-up line; returns the engine the
    server talks to and the first ``LLMEngine``."""
    if ns.data_parallel_size > 1:
        dp = build_data_parallel(cfg, load, ns.data_parallel_size)
        aeng: AsyncEngine | DataParallelEngine = dp
        engine = dp.replicas[0].engine
    else:
        engine = LLMEngine(cfg, load, metrics=EngineMetrics(name))
        aeng = AsyncEngine(engine)
    print(f"loaded {engine.model_name} in {engine.load_s:.1f} s ({engine.weights_summary()}, "
          f"{engine.num_blocks} KV blocks of {cfg.block_size} tokens "
          f"({engine.kv_layout.summary()}), max_model_len "
          f"{engine.max_model_len}, {attention_summary(engine)}, "
          f"{ns.data_parallel_size} replica(s) x "
          f"{cfg.tensor_parallel_size} device(s))", flush=True)
    return aeng, engine


def run_batch(ns: argparse.Namespace) -> None:
    """Read the input, load and compile, run every line, write the output (stdout stays free
    of progress output: load and compile lines, the bars and the summary go to stderr)."""
    limits = limits_from_args(ns)
    cfg = engine_config_from_args(ns)
    check_platform(cfg)
    if ns.max_in_flight is not None and ns.max_in_flight < 1:
        raise ValueError(f"--max-in-flight must be >= 1, got {ns.max_in_flight}")
    lines = read_lines(ns.input_file)  # fail before minutes of loading
    try:
        open(ns.output_file, "ab").close()
    except OSError as e:
        raise ValueError(f"cannot write output file {ns.output_file}: {e.strerror or e}") from None
    configure_logging("warning", "text")
    aeng = start_engine(cfg, load_config_from_args(ns, ns.model), sys.stderr)
    try:
        api = OpenAIServer(aeng, aeng.model_name, limits)
        run_batch_file(api, lines, ns.output_file, ns.max_in_flight or 2 * cfg.max_num_seqs)
    finally:
        aeng.shutdown()
