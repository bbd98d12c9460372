#!/usr/bin/env bash
# lm-evaluation-harness against a real `jaxserve serve`, with lm-eval's default arguments plus
# --batch_size 4: `--model local-completions` finds the server's /tokenizer_info and tokenises
# through /tokenize (no Hugging Face tokenizer download), scores a small multiple-choice task
# (loglikelihood: batched token-id prompts with echo + logprobs) and runs a generate_until task
# (batched prompts with stop strings), then prints the scores. Both tasks are written here, with
# local jsonl data: nothing is downloaded but lm-eval itself.
#
#   scripts/check_lm_eval.sh
#
# Environment:
#   PYTHON           interpreter with jaxserve's dependencies (default: .venv/bin/python)
#   LM_EVAL_PYTHON   interpreter for lm-eval's throwaway venv (default: python3.11)
#   LM_EVAL_SPEC     what pip installs (default: "lm-eval[api]")
#   LM_EVAL_VENV     a venv to use, created there if it has no lm_eval (default: a throwaway one)
#   SERVE_ARGS       extra `jaxserve serve` flags (default: --max-model-len 1024)
#   KEEP=1           keep the work directory (venv, tasks, logs, results) and print its path
#   DRY_RUN=1        no lm-eval: write the tasks, start the server, wait for /ready, read
#                    /tokenizer_info, stop (the suite's smoke test runs it with SERVE_ARGS
#                    naming a tiny dummy model; by default it serves the default model)
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
LM_EVAL_PYTHON=${LM_EVAL_PYTHON:-python3.11}
LM_EVAL_SPEC=${LM_EVAL_SPEC:-lm-eval[api]}
SERVE_ARGS=${SERVE_ARGS:---max-model-len 1024}
MODEL=SmolLM2-135M-Instruct
WORK=$(mktemp -d "${TMPDIR:-/tmp}/jaxserve-lm-eval.XXXXXX")
VENV=${LM_EVAL_VENV:-$WORK/venv}
SERVER_PID=

cleanup() {
  if [[ -n $SERVER_PID ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -INT "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
  fi
  if [[ ${KEEP:-0} == 1 ]]; then echo "work directory kept: $WORK"; else rm -rf "$WORK"; fi
}
trap cleanup EXIT

if [[ ${DRY_RUN:-0} == 1 ]]; then
  echo "== dry run: no lm-eval venv"
else
  echo "== lm-eval venv $VENV"
  if [[ ! -x $VENV/bin/lm_eval ]]; then
    "$LM_EVAL_PYTHON" -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --disable-pip-version-check "$LM_EVAL_SPEC"
  fi
  "$VENV/bin/python" -c 'import importlib.metadata as m; print("lm-eval", m.version("lm-eval"))'
fi

echo "== tasks in $WORK/tasks"
mkdir -p "$WORK/tasks"
cat >"$WORK/tasks/mc.jsonl" <<'EOF'
{"question": "What is the capital of France?", "choices": ["Paris", "London", "Berlin", "Madrid"], "answer": 0}
{"question": "How many legs does a spider have?", "choices": ["six", "eight", "ten", "four"], "answer": 1}
{"question": "What color is the sky on a clear day?", "choices": ["green", "red", "blue", "yellow"], "answer": 2}
{"question": "Which animal says moo?", "choices": ["a dog", "a cat", "a cow", "a duck"], "answer": 2}
{"question": "What is 2 + 2?", "choices": ["3", "4", "5", "22"], "answer": 1}
{"question": "What do bees make?", "choices": ["milk", "silk", "honey", "wool"], "answer": 2}
{"question": "Which planet do we live on?", "choices": ["Mars", "Earth", "Venus", "Jupiter"], "answer": 1}
{"question": "What is frozen water called?", "choices": ["steam", "ice", "sand", "glass"], "answer": 1}
EOF
cat >"$WORK/tasks/gen.jsonl" <<'EOF'
{"question": "What is the capital of France?", "answer": "Paris"}
{"question": "What is 3 + 4?", "answer": "7"}
{"question": "What color is grass?", "answer": "green"}
{"question": "What is the opposite of hot?", "answer": "cold"}
{"question": "How many days are in a week?", "answer": "7"}
{"question": "What is the largest ocean on Earth?", "answer": "Pacific"}
EOF
cat >"$WORK/tasks/jaxserve_mc.yaml" <<EOF
task: jaxserve_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: $WORK/tasks/mc.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{question}}\nAnswer:"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
EOF
cat >"$WORK/tasks/jaxserve_gen.yaml" <<EOF
task: jaxserve_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: $WORK/tasks/gen.jsonl
test_split: test
output_type: generate_until
# three worked examples (in the prompt: lm-eval's few-shot sampling needs a second split)
doc_to_text: "Question: What is the capital of Italy?\nAnswer: Rome\n\nQuestion: How many legs does a dog have?\nAnswer: 4\n\nQuestion: What color is snow?\nAnswer: white\n\nQuestion: {{question}}\nAnswer:"
doc_to_target: answer
generation_kwargs:
  until: ["\n"]
  max_gen_toks: 32
  do_sample: false
filter_list:
  - name: first_word
    filter:
      - function: regex
        regex_pattern: "(\\\\w+)"
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
EOF

PORT=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
echo "== jaxserve serve on port $PORT ($SERVE_ARGS)"
cd "$ROOT"
# shellcheck disable=SC2086  # SERVE_ARGS is a list of flags
PYTHONPATH=$ROOT "$PYTHON" -m jaxserve.cli.main serve --port "$PORT" $SERVE_ARGS \
  >"$WORK/serve.log" 2>&1 &
SERVER_PID=$!
# /ready, not /health: /health answers as soon as the port is bound, /tokenizer_info and the
# completions answer 503 until the model is loaded and compiled
READY=
for _ in $(seq 600); do
  if "$PYTHON" -c "import sys, urllib.request as u; sys.exit(u.urlopen('http://127.0.0.1:$PORT/ready', timeout=2).status != 200)" 2>/dev/null; then
    READY=1; break
  fi
  if ! kill -0 "$SERVER_PID" 2>/dev/null; then
    echo "the server exited:"; tail -30 "$WORK/serve.log"; exit 1
  fi
  sleep 1
done
if [[ -z $READY ]]; then
  echo "the server was not ready after 600 s:"; tail -30 "$WORK/serve.log"; exit 1
fi
"$PYTHON" -c "import urllib.request as u; print(u.urlopen('http://127.0.0.1:$PORT/tokenizer_info').read().decode()[:300])"
if [[ ${DRY_RUN:-0} == 1 ]]; then
  echo "== dry run: the server is ready; lm_eval skipped"
  exit 0
fi

echo "== lm_eval"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
START=$(date +%s)
status=0
"$VENV/bin/lm_eval" --model local-completions \
  --model_args "base_url=http://127.0.0.1:$PORT/v1/completions,model=$MODEL" \
  --tasks jaxserve_mc,jaxserve_gen --include_path "$WORK/tasks" --batch_size 4 \
  --output_path "$WORK/results" --log_samples || status=$?
echo "lm_eval exit status $status after $(( $(date +%s) - START )) s"
if [[ $status != 0 ]]; then
  echo "server log (last lines):"; tail -30 "$WORK/serve.log"; exit "$status"
fi

echo "== scores"
"$VENV/bin/python" - "$WORK/results" <<'EOF'
import glob, json, sys
(path,) = glob.glob(f"{sys.argv[1]}/**/results_*.json", recursive=True)
for task, r in sorted(json.load(open(path))["results"].items()):
    print(task, {k: round(v, 4) for k, v in r.items() if isinstance(v, float)})
EOF
echo "requests served:"
grep -c '"POST /v1/completions' "$WORK/serve.log" | sed 's/^/  POST \/v1\/completions: /' || true
