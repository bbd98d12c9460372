"""``jaxserve bench serve``: a load generator for any OpenAI-compatible server (jaxserve, vLLM,
SGLang), with ``vllm bench serve``'s flags and saved JSON keys.

    jaxserve bench serve --base-url http://127.0.0.1:8000 --endpoint /v1/completions \\
        --dataset-name random --num-prompts 200 --random-input-len 256 --random-output-len 64 \\
        --request-rate 4 --burstiness 1 --max-concurrency 32 --goodput ttft:500 tpot:50 \\
        --save-result --result-dir results/

The run: resolve the model (``--model`` or the first id of ``GET /v1/models``); build the workload
(datasets.py); send ``--num-warmups`` copies of the first request (not measured); then send every
request at its arrival time (arrivals.py), at most ``--max-concurrency`` in flight (an
``asyncio.Semaphore``; a request waiting for a slot is timed from when it is sent, as in vLLM);
compute the metrics (metrics.py) over the span from the first arrival to the last response; print
the table; with ``--save-result`` write the JSON. Differences from vLLM: ``--ignore-eos`` is on by
default (``--no-ignore-eos`` turns it off) for every workload here, so output lengths are exact;
the per-request lists are always saved (vLLM now needs ``--save-detailed``); ``--metric-percentiles``
defaults to ``90,95,99`` (vLLM: ``99``) and always includes 99; ``--percentile-metrics`` defaults
to ``ttft,tpot,itl,max_itl,e2el`` and always includes ttft, itl and max_itl (each request's
largest gap); ``--goodput`` also takes ``itl`` (metrics.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import time
from datetime import datetime
from typing import Any

import numpy as np
from tqdm import tqdm

from jaxserve.bench.arrivals import arrival_offsets, paced
from jaxserve.bench.client import build_payload, first_model, send_request, server_root
from jaxserve.bench.datasets import (
    DEFAULT_TOKEN_RANGE,
    LENGTH_DISTRIBUTIONS,
    SampleRequest,
    TextCorpus,
    load_tokenizer,
    prefix_dataset,
    random_dataset,
    sharegpt_like_dataset,
)
from jaxserve.bench.metrics import (
    METRICS,
    RequestResult,
    build_result,
    format_table,
    parse_goodput,
    with_tails,
)
from jaxserve.bench.profiles import (
    DEFAULT_MAX_LEN,
    DEFAULT_SYSTEM_PROMPT_LEN,
    PROFILES,
    default_burstiness,
    profile_dataset,
)
from jaxserve.bench.traces import DEFAULT_BLOCK_SIZE, read_trace
from jaxserve.extras import require

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
DATASETS = ("random", "sharegpt-like", *PROFILES, "prefix", "prefix_repetition", "trace")


def add_dataset_args(p: argparse.ArgumentParser, num_prompts: int = 1000) -> None:
    """The workload flags (shared with ``jaxserve bench throughput`` and ``jaxserve sweep``)."""
    a = p.add_argument
    a("--dataset-name", default="random", choices=DATASETS,
      help="workload: random lengths; sharegpt-like (published ShareGPT length statistics, "
           "real text); chat-like, code-like, mixed-system-prompt (lengths and burstiness of "
           "the Azure LLM inference trace 2023, real text; jaxserve only); shared prefixes "
           "(prefix_repetition: the same); trace (--dataset-path replayed at its own "
           "arrival times)")
    a("--dataset-path", default=None,
      help="the trace file of --dataset-name trace: Mooncake-style JSONL (timestamp ms or "
           "arrival_time s; prompt, or input_length with hash_ids; output_length) or the "
           "Azure LLM inference trace's CSV (TIMESTAMP,ContextTokens,GeneratedTokens)")
    a("--trace-block-size", type=int, default=DEFAULT_BLOCK_SIZE,
      help="tokens per hash id of a JSONL trace: requests sharing leading hash_ids share that "
           "prompt prefix (512: Mooncake's traces and AIPerf; vLLM's timed_trace uses 16)")
    a("--tokenizer", default=None,
      help="tokenizer that cuts sharegpt-like and trace prompts from real text: a .gguf file, "
           "a tokenizer.json or a folder holding one (default: SmolLM2-135M-Instruct's)")
    a("--num-prompts", type=int, default=num_prompts, help="requests measured")
    a("--random-input-len", type=int, default=1024, help="mean prompt length (tokens)")
    a("--random-output-len", type=int, default=128, help="mean output length (tokens)")
    a("--random-range-ratio", type=float, default=0.0,
      help="spread r of the random lengths: uniform in [len*(1-r), len*(1+r)] (r in [0, 1)); "
           "normal: std r*len; lognormal: coefficient of variation r")
    a("--random-length-distribution", default="uniform", choices=LENGTH_DISTRIBUTIONS,
      help="distribution of the random lengths (jaxserve only; uniform is vLLM's rule)")
    a("--random-token-range", type=int, nargs=2, default=list(DEFAULT_TOKEN_RANGE),
      metavar=("LOW", "HIGH"), help="prompt token ids drawn from [LOW, HIGH) (jaxserve only)")
    a("--profile-max-len", type=int, default=DEFAULT_MAX_LEN,
      help="chat-like, code-like, mixed-system-prompt: most prompt + output tokens of a request "
           "(longer draws are rejected; leave room for a chat template with the chat endpoint)")
    a("--profile-system-prompt-len", type=int, default=DEFAULT_SYSTEM_PROMPT_LEN,
      help="mixed-system-prompt: tokens of the system prompt every request shares")
    a("--prefix-repetition-prefix-len", type=int, default=256, help="shared prefix (tokens)")
    a("--prefix-repetition-suffix-len", type=int, default=256, help="unique suffix (tokens)")
    a("--prefix-repetition-num-prefixes", type=int, default=10, help="distinct prefixes")
    a("--prefix-repetition-output-len", type=int, default=128, help="output length (tokens)")


def add_cli_args(p: argparse.ArgumentParser) -> None:
    """``jaxserve bench serve``'s flags (vLLM's names and defaults unless noted)."""
    a = p.add_argument
    a("--base-url", default="http://127.0.0.1:8000",
      help="the server's root URL (a trailing /v1 is dropped)")
    a("--endpoint", default="/v1/completions", choices=ENDPOINTS, help="API path")
    a("--model", default=None, help="model id in requests (default: first of GET /v1/models)")
    a("--label", default=None, help="result file name prefix (default: openai / openai-chat)")
    add_dataset_args(p)
    a("--request-rate", type=float, default=float("inf"),
      help="arrivals per second; inf sends every request at once")
    a("--burstiness", type=float, default=None,
      help="gamma shape of the inter-arrival times: 1 Poisson, <1 burstier, >1 more regular "
           "(default: the --dataset-name profile's, chat-like 0.84, code-like 0.2; else 1)")
    a("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    a("--goodput", nargs="+", default=None, metavar="KEY:MS",
      help="SLOs for goodput, e.g. ttft:500 tpot:50 itl:200 e2el:2000 (ms; itl: the request's "
           "largest gap, jaxserve only)")
    a("--seed", type=int, default=0, help="seed of the workload and the arrival times")
    a("--num-warmups", type=int, default=0, help="unmeasured requests sent first")
    a("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
      help="send ignore_eos so every output has exactly the asked length")
    a("--temperature", type=float, default=None, help="sampling temperature (server default)")
    a("--top-p", type=float, default=None, help="top-p (server default)")
    a("--top-k", type=int, default=None, help="top-k (server default)")
    a("--percentile-metrics", default=",".join(METRICS),
      help="comma-separated metrics with statistics: ttft,tpot,itl,max_itl,e2el (ttft, itl "
           "and max_itl, each request's largest gap, are always included)")
    a("--metric-percentiles", default="90,95,99",
      help="comma-separated percentiles (99 is always included)")
    a("--request-id-prefix", default="bench-", help="X-Request-Id prefix (then the index)")
    a("--server-pid", type=int, default=None,
      help="a local server's process id: also report the CPU seconds its process tree used "
           "during the run, per output token (Linux /proc; compare engines by work done)")
    a("--save-result", action="store_true", help="write the result JSON")
    a("--result-dir", default=None, help="directory for the JSON (default: current)")
    a("--result-filename", default=None,
      help="file name (default: {label}-{rate}qps[-concurrencyN]-{model}-{date}.json)")
    a("--disable-tqdm", action="store_true", help="no progress bar")


def arrival_burstiness(ns: argparse.Namespace) -> float:
    """``--burstiness`` if given, else the ``--dataset-name`` profile's default (profiles.py),
    else 1.0 (Poisson)."""
    return ns.burstiness if ns.burstiness is not None else default_burstiness(ns.dataset_name)


def _check(ns: argparse.Namespace, burstiness: float) -> None:
    if ns.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    if ns.max_concurrency is not None and ns.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    if ns.num_warmups < 0:
        raise ValueError("--num-warmups must be >= 0")
    if not ns.request_rate > 0 or not burstiness > 0:
        raise ValueError("--request-rate and --burstiness must be > 0")


def build_workload(ns: argparse.Namespace, chat: bool
                   ) -> tuple[list[SampleRequest], np.ndarray | None]:
    """The requests of ``--dataset-name`` (text prompts if ``chat``, else token ids), and their
    send times (s) when the workload carries its own (a trace), else None.

    Raises:
      ValueError: bad workload flags (a trace without ``--dataset-path`` or with a finite
        ``--request-rate``, bad lengths, a malformed trace line).
    """
    rng_range = (ns.random_token_range[0], ns.random_token_range[1])
    name = ns.dataset_name
    if name == "random":
        return random_dataset(ns.num_prompts, ns.random_input_len, ns.random_output_len,
                              ns.random_range_ratio, ns.seed, chat, rng_range,
                              ns.random_length_distribution), None
    if name in ("prefix", "prefix_repetition"):
        return prefix_dataset(ns.num_prompts, ns.prefix_repetition_prefix_len,
                              ns.prefix_repetition_suffix_len, ns.prefix_repetition_num_prefixes,
                              ns.prefix_repetition_output_len, ns.seed, chat, rng_range), None
    if name == "trace":
        if not ns.dataset_path:
            raise ValueError("--dataset-name trace needs --dataset-path FILE (.jsonl or .csv)")
        if not math.isinf(getattr(ns, "request_rate", math.inf)):
            raise ValueError("--request-rate does not apply to a trace (it sets its own arrival "
                             "times); leave it at inf")
    corpus = TextCorpus(load_tokenizer(ns.tokenizer))
    if name == "trace":
        return read_trace(ns.dataset_path, ns.num_prompts, ns.seed, chat, corpus,
                          ns.trace_block_size)
    if name in PROFILES:
        return profile_dataset(name, ns.num_prompts, ns.seed, chat, corpus, ns.profile_max_len,
                               ns.profile_system_prompt_len), None
    return sharegpt_like_dataset(ns.num_prompts, ns.seed, chat, corpus), None


def process_tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` and all its descendants (Linux /proc).

    Raises:
      ValueError: if ``pid`` is not a running process.
    """
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            children.setdefault(int(stat[stat.rindex(")") + 2:].split()[1]), []).append(int(d))
    if not os.path.exists(f"/proc/{pid}/stat"):
        raise ValueError(f"--server-pid {pid}: no such process")
    total, todo, tick = 0, [pid], os.sysconf("SC_CLK_TCK")
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended meanwhile
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / tick


async def run_benchmark(ns: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """Run the benchmark; returns (the result JSON dict, the model id).

    Raises:
      ValueError: bad flags, or a server that cannot be reached.
      MissingExtraError: httpx (the ``bench`` extra) is not installed.
    """
    burstiness = arrival_burstiness(ns)
    _check(ns, burstiness)
    httpx = require("httpx", "bench", "jaxserve bench serve")
    goodput = parse_goodput(ns.goodput)
    metrics_sel, percentiles = with_tails(
        [m.strip() for m in ns.percentile_metrics.split(",") if m.strip()],
        [float(x) for x in ns.metric_percentiles.split(",") if x.strip()])
    base = server_root(ns.base_url)
    url = base + ns.endpoint
    chat = ns.endpoint.endswith("chat/completions")
    samples, offsets = build_workload(ns, chat)
    if offsets is None:
        offsets = arrival_offsets(len(samples), ns.request_rate, burstiness,
                                  np.random.default_rng(ns.seed))
    extra = {k: v for k, v in (("temperature", ns.temperature), ("top_p", ns.top_p),
                               ("top_k", ns.top_k)) if v is not None}
    cap = ns.max_concurrency
    limits = httpx.Limits(max_connections=cap, max_keepalive_connections=cap)
    timeout = httpx.Timeout(6 * 3600.0, connect=60.0, pool=None)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        model = ns.model or await first_model(client, base)
        sem: contextlib.AbstractAsyncContextManager[Any] = (
            asyncio.Semaphore(cap) if cap else contextlib.nullcontext())

        async def one(s: SampleRequest, rid: str, pbar: Any) -> RequestResult:
            async with sem:
                body = build_payload(s, model, chat, ns.ignore_eos, extra)
                r = await send_request(client, url, body, s.prompt_len, chat, {"X-Request-Id": rid})
            if pbar is not None:
                pbar.update(1)
            return r

        if ns.num_warmups:
            print(f"Warming up with {ns.num_warmups} requests...", flush=True)
            await asyncio.gather(*(one(samples[0], f"{ns.request_id_prefix}warmup-{k}", None)
                                   for k in range(ns.num_warmups)))
        dist = "Poisson process" if burstiness == 1.0 else "Gamma distribution"
        print(f"Traffic request rate: {ns.request_rate}\nBurstiness factor: {burstiness} "
              f"({dist})\nMaximum request concurrency: {cap}", flush=True)
        pbar = None
        if not ns.disable_tqdm:
            pbar = tqdm(total=len(samples))
        cpu0 = process_tree_cpu_s(ns.server_pid) if ns.server_pid else None
        start = time.perf_counter()
        tasks = [asyncio.create_task(one(samples[i], f"{ns.request_id_prefix}{i}", pbar))
                 async for i in paced(offsets)]
        outputs = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        cpu_s = process_tree_cpu_s(ns.server_pid) - cpu0 if cpu0 is not None else None
        if pbar is not None:
            pbar.close()
    failed = [o.error for o in outputs if not o.success]
    for k, err in enumerate(failed[:10]):
        print(f"Error {k}: {err.strip()}")
    res = build_result(outputs, duration, percentiles, metrics_sel, goodput)
    if cpu_s is not None:
        res["server_cpu_s"] = cpu_s
        res["server_cpu_s_per_output_token"] = cpu_s / max(res["total_output_tokens"], 1)
    print(format_table(res, metrics_sel, percentiles, cap, ns.request_rate), flush=True)
    if cpu_s is not None:
        print(f"Server CPU seconds: {cpu_s:.1f} ({res['server_cpu_s_per_output_token'] * 1e3:.1f}"
              " ms per output token)", flush=True)
    head = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "openai-chat" if chat else "openai",
        "endpoint": ns.endpoint,
        "label": ns.label,
        "model_id": model,
        "dataset_name": ns.dataset_name,
        "num_prompts": ns.num_prompts,
        "request_rate": ns.request_rate if not math.isinf(ns.request_rate) else "inf",
        "burstiness": burstiness,
        "max_concurrency": cap,
        "goodput_slos_ms": goodput or None,
        "ignore_eos": ns.ignore_eos,
        "seed": ns.seed,
    }
    return {**head, **res}, model


def result_path(ns: argparse.Namespace, result: dict[str, Any], model: str) -> str:
    """Where ``--save-result`` writes: vLLM's default name, ``--result-filename`` and
    ``--result-dir`` (created) applied."""
    conc = f"-concurrency{ns.max_concurrency}" if ns.max_concurrency is not None else ""
    label = ns.label or result["backend"]
    name = ns.result_filename or (
        f"{label}-{ns.request_rate}qps{conc}-{model.split('/')[-1]}-{result['date']}.json")
    if ns.result_dir:
        os.makedirs(ns.result_dir, exist_ok=True)
        name = os.path.join(ns.result_dir, name)
    return name


def run(ns: argparse.Namespace) -> int:
    """Entry point of ``jaxserve bench serve``; returns the exit status (1 if every request
    failed).

    Raises:
      ValueError: bad flags, or the server cannot be reached / lists no model.
    """
    result, model = asyncio.run(run_benchmark(ns))
    if ns.save_result:
        path = result_path(ns, result, model)
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(result, fh)
        print(f"Saved result to {path}")
    return 0 if result["completed"] else 1
