#!/usr/bin/env bash
# The prepared GPU check (see scripts/gpu_check.py): bandwidth, kernel correctness on the device,
# attention timings at Llama-3.1-8B shapes against XLA and the HBM roofline, write_kv, and engine
# steps of a dummy Llama-3.1-8B in bf16; a table last, within 5 minutes. Needs jax (with its CUDA
# plugin), flax and numpy only; no network. Extra arguments go to the script (--dry-run runs it on
# the CPU at tiny shapes, --json PATH writes the rows).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
# the engine's own allocator settings: most of the device for the 8B weights + KV cache
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
exec timeout 300 "$PY" -u scripts/gpu_check.py "$@"
