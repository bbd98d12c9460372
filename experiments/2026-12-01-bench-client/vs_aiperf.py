"""jaxserve bench serve next to NVIDIA AIPerf, against one jaxserve server, on one fixed workload.

    python -m venv /tmp/aiperf-venv && /tmp/aiperf-venv/bin/pip install aiperf   # ~1.2 GB
    python experiments/2026-12-01-bench-client/vs_aiperf.py --aiperf /tmp/aiperf-venv/bin/aiperf --out results/aiperf

Starts ``jaxserve serve`` (the default SmolLM2 model unless ``--serve-args`` says otherwise),
exports the model's tokenizer to a local folder (tokenizer.json + tokenizer_config.json) for
AIPerf, then runs, against the same server, ``--rounds`` rounds of: ``jaxserve bench serve``
and ``aiperf profile`` with the same workload (fixed prompt and output lengths, EOS ignored,
closed loop at ``--concurrency``, warm-up requests first; the prompts themselves differ: each
tool writes its own text). Prints both tools' figures side by side with the relative difference
and writes ``compare.json``. Output-token counts come from the server's usage on both sides.

``--server-cpus 0 --client-cpus 1`` pins the server (all its threads, ``taskset -a``) and the
load tools to disjoint CPUs. On a small machine this matters: AIPerf runs several Python
service processes, and unpinned they take CPU from the server while it is measured, so the two
tools would measure two different servers (seen here: 2 cores, AIPerf's figures 25-40% slower,
and the server's own /metrics agreed with AIPerf during its runs). Each round uses a new seed for
both tools and the server runs without prefix caching: with one seed for every round, jaxserve's
rounds 2 and 3 resent round 1's prompts and hit the prefix cache (TTFT 324 vs 1050 ms).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shlex
import subprocess
import sys

from jaxserve.bench.sweep import ServerProcess

KEYS = [  # (label, jaxserve key, aiperf metric tag, aiperf stat)
    ("request throughput (req/s)", "request_throughput", "request_throughput", "avg"),
    ("output throughput (tok/s)", "output_throughput", "output_token_throughput", "avg"),
    ("mean TTFT (ms)", "mean_ttft_ms", "time_to_first_token", "avg"),
    ("median TTFT (ms)", "median_ttft_ms", "time_to_first_token", "p50"),
    ("p99 TTFT (ms)", "p99_ttft_ms", "time_to_first_token", "p99"),
    # AIPerf's "inter token latency" is per request (latency - TTFT) / (tokens - 1): vLLM's TPOT
    ("mean TPOT (ms)", "mean_tpot_ms", "inter_token_latency", "avg"),
    ("p99 TPOT (ms)", "p99_tpot_ms", "inter_token_latency", "p99"),
    ("mean E2E latency (ms)", "mean_e2el_ms", "request_latency", "avg"),
    ("p99 E2E latency (ms)", "p99_e2el_ms", "request_latency", "p99"),
]


def export_tokenizer(out_dir: str) -> str:
    """The default model's tokenizer as an HF folder (tokenizer.json + tokenizer_config.json)."""
    from jaxserve.loading.model_files import default_gguf_path
    from jaxserve.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(default_gguf_path())
    os.makedirs(out_dir, exist_ok=True)
    tok.backend.save(os.path.join(out_dir, "tokenizer.json"))
    token = tok.backend.id_to_token
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 8192,
           "bos_token": token(tok.bos_token_id) if tok.bos_token_id is not None else None,
           "eos_token": token(tok.eos_token_id) if tok.eos_token_id is not None else None,
           "add_bos_token": tok.add_bos_token, "clean_up_tokenization_spaces": False}
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as fh:
        json.dump(cfg, fh, indent=1)
    return out_dir


def aiperf_metrics(artifact_dir: str) -> dict:
    """The metrics of AIPerf's JSON export (profile_export_aiperf.json) in ``artifact_dir``."""
    paths = glob.glob(os.path.join(artifact_dir, "**", "*aiperf*.json"), recursive=True)
    paths = [p for p in paths if "inputs" not in os.path.basename(p)]
    if not paths:
        raise SystemExit(f"no AIPerf JSON export under {artifact_dir}")
    with open(min(paths)) as fh:
        data = json.load(fh)
    return data.get("records", data)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--aiperf", default="/tmp/aiperf-venv/bin/aiperf")
    # prefix caching off: each round's prompts are new to the server whichever tool sends them
    p.add_argument("--serve-args", default="--max-model-len 512 --max-num-seqs 16 "
                   "--no-enable-prefix-caching")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--num-warmups", type=int, default=4)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--out", default="results/aiperf")
    p.add_argument("--server-cpus", default=None, help="CPU list for the server, e.g. 0")
    p.add_argument("--client-cpus", default=None, help="CPU list for both load tools, e.g. 1")
    a = p.parse_args()
    pin = ["taskset", "-c", a.client_cpus] if a.client_cpus else []
    os.makedirs(a.out, exist_ok=True)
    tok_dir = export_tokenizer(os.path.join(a.out, "tokenizer"))
    version = subprocess.run([a.aiperf, "--version"], capture_output=True, text=True,
                             check=True).stdout
    rows: dict[str, list] = {"jaxserve": [], "aiperf": []}
    with ServerProcess(shlex.split(a.serve_args), 900.0,
                       os.path.join(a.out, "server.log")) as server:
        if a.server_cpus:
            subprocess.run(["taskset", "-a", "-p", "-c", a.server_cpus, str(server.proc.pid)],
                           check=True, capture_output=True)
        model = json.loads(subprocess.run(
            ["curl", "-s", f"{server.url}/v1/models"], capture_output=True, text=True,
            check=True).stdout)["data"][0]["id"]
        for r in range(a.rounds):
            name = f"jaxserve-{r}.json"
            subprocess.run([*pin, sys.executable, "-m", "jaxserve.cli.main", "bench", "serve",
                            "--base-url", server.url, "--dataset-name", "random",
                            "--random-input-len", str(a.input_len), "--random-output-len",
                            str(a.output_len), "--num-prompts", str(a.num_prompts),
                            "--max-concurrency", str(a.concurrency), "--num-warmups",
                            str(a.num_warmups), "--metric-percentiles", "50,99",
                            "--save-result", "--result-dir", a.out, "--result-filename", name,
                            "--seed", str(r), "--disable-tqdm"], check=True)
            with open(os.path.join(a.out, name)) as fh:
                rows["jaxserve"].append(json.load(fh))
            art = os.path.join(a.out, f"aiperf-{r}")
            subprocess.run([*pin, a.aiperf, "profile", "--model", model, "--url", server.url,
                            "--endpoint-type", "completions", "--streaming",
                            "--tokenizer", tok_dir, "--use-server-token-count",
                            "--prompt-input-tokens-mean", str(a.input_len),
                            "--prompt-input-tokens-stddev", "0",
                            "--prompt-output-tokens-mean", str(a.output_len),
                            "--prompt-output-tokens-stddev", "0",
                            "--extra-inputs", "ignore_eos:true",
                            "--concurrency", str(a.concurrency),
                            "--request-count", str(a.num_prompts),
                            "--warmup-request-count", str(a.num_warmups),
                            "--random-seed", str(r), "--ui-type", "none",
                            "--workers-max", "1",  # a small machine: keep the client light
                            "--output-artifact-dir", art], check=True)
            rows["aiperf"].append(aiperf_metrics(art))
    table = []
    for label, jk, ak, stat in KEYS:
        jv = sum(x[jk] for x in rows["jaxserve"]) / a.rounds
        av = sum(x[ak][stat] for x in rows["aiperf"]) / a.rounds
        table.append({"metric": label, "jaxserve": jv, "aiperf": av,
                      "aiperf_unit": rows["aiperf"][0][ak].get("unit"),
                      "rel_diff": av / jv - 1 if jv else None})
    print(f"AIPerf {version.strip()}; {a.num_prompts} requests x {a.rounds} rounds, input "
          f"{a.input_len}, output {a.output_len}, concurrency {a.concurrency}")
    print(f"{'metric':<30}{'jaxserve':>12}{'aiperf':>12}{'diff':>8}   per round (jaxserve/aiperf)")
    for (label, jk, ak, stat), t in zip(KEYS, table):
        per = "  ".join(f"{x[jk]:.1f}/{y[ak][stat]:.1f}"
                        for x, y in zip(rows["jaxserve"], rows["aiperf"]))
        print(f"{t['metric']:<30}{t['jaxserve']:>12.2f}{t['aiperf']:>12.2f}"
              f"{t['rel_diff']:>+8.1%}   {per}")
    with open(os.path.join(a.out, "compare.json"), "w") as fh:
        json.dump({"aiperf_version": version.strip(), "args": vars(a), "table": table,
                   "jaxserve_runs": [{k: v for k, v in x.items() if not isinstance(v, list)}
                                     for x in rows["jaxserve"]],
                   "aiperf_runs": rows["aiperf"]}, fh, indent=1)


if __name__ == "__main__":
    main()
