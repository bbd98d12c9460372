#!/usr/bin/env bash
# The benchmark client and configuration sweep figures, rerunnable.
# CPU figures on a shared machine are noisy; run one part at a time, nothing else running.
#   bash experiments/2026-12-01-bench-client/run.sh throughput|sweep|aiperf|all   (results under results/bench-client/)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
OUT=results/bench-client
mkdir -p "$OUT"
part=${1:-all}

if [[ $part == throughput || $part == all ]]; then
  # continuous vs static batching: 128 sharegpt-like requests at max_num_seqs 32 on SmolLM2
  "$PY" -m jaxserve.cli.main bench throughput --dataset-name sharegpt-like --num-prompts 128 \
      --max-num-seqs 32 --max-num-batched-tokens 512 --max-model-len 4096 --kv-cache-memory-gib 4 \
      --output-json "$OUT/throughput-sharegpt-like-128-mns32.json" | tee "$OUT/throughput.txt"
fi

if [[ $part == sweep || $part == all ]]; then
  # SmolLM2 on this machine: two max_num_seqs values, each on a fresh server
  "$PY" -m jaxserve.cli.main sweep --serve-args "--max-model-len 512" --grid max_num_seqs=8,32 \
      --dataset-name random --random-input-len 128 --random-output-len 32 \
      --random-range-ratio 0.5 --num-prompts 16 --prompts-per-concurrency 2 \
      --max-concurrency-limit 64 --percentile 99 --goodput ttft:2000 tpot:300 \
      --output-dir "$OUT/sweep" | tee "$OUT/sweep.txt"
fi

if [[ $part == aiperf || $part == all ]]; then
  # an independent load tool on the same server and workload (AIPerf in its own venv)
  AIPERF=${AIPERF:-/tmp/aiperf-venv/bin/aiperf}
  PYTHONPATH=. "$PY" experiments/2026-12-01-bench-client/vs_aiperf.py --aiperf "$AIPERF" --out "$OUT/aiperf" | tee "$OUT/aiperf.txt"
fi
