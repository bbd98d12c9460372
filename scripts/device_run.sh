#!/usr/bin/env bash
# The prepared run for a GPU machine, within about 8 minutes (scripts/device_run.py says what it
# measures): install the wheels carried in .carry/ (made here by scripts/build_wheelhouse.sh)
# into a venv over the machine's own jax, flax and numpy, then jaxserve from this tree with
# --no-deps, then run the stages; one JSON and one PNG:
#   bash scripts/device_run.sh --json $OUT/device_run.json --png $OUT/device_run.png
# --dry-run runs the stages on the CPU at tiny sizes in this machine's Python (PYTHON, else
# .venv/bin/python) and installs nothing. On the GPU machine PYTHON is the interpreter that has
# jax (default python3) and JAXSERVE_VENV where the venv goes (default /tmp/jaxserve-device-venv).
set -euo pipefail
cd "$(dirname "$0")/.."
CARRY=.carry
for arg in "$@"; do
  if [ "$arg" = --dry-run ]; then
    exec "${PYTHON:-.venv/bin/python}" -u scripts/device_run.py "$@"
  fi
done

BASE=${PYTHON:-python3}
VENV=${JAXSERVE_VENV:-/tmp/jaxserve-device-venv}
shopt -s nullglob
wheels=("$CARRY"/wheelhouse/*.whl)
if [ ${#wheels[@]} -eq 0 ]; then
  echo "error: no wheels in $CARRY/wheelhouse: run scripts/build_wheelhouse.sh on a development machine and carry $CARRY" >&2
  exit 1
fi
"$BASE" -m venv --system-site-packages "$VENV" 2>/dev/null \
  || "$BASE" -m venv --system-site-packages --without-pip "$VENV"
PYV=$VENV/bin/python
# A base interpreter that is itself a venv (the GPU image's python3 is one): the new venv's
# --system-site-packages reaches that interpreter's installation, not the venv's packages, so
# a .pth file adds those (with their own .pth files) behind the new venv's own.
if ! "$PYV" -c 'import jax, flax, numpy' 2>/dev/null; then
  site=$("$PYV" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  "$BASE" -c 'import site; print("import site; " + "; ".join(
    f"site.addsitedir({p!r})" for p in site.getsitepackages()))' >"$site/_device_run_base.pth"
fi
"$PYV" -c 'import jax, flax, numpy' || { echo "error: $BASE has no jax, flax and numpy" >&2; exit 1; }
PIP=("$PYV" -m pip)
"$PYV" -m pip --version >/dev/null 2>&1 || PIP=("$BASE" -m pip --python "$PYV")
"${PIP[@]}" install -q --no-index --no-cache-dir --find-links "$CARRY/wheelhouse" "${wheels[@]}"
jaxserve=editable
"${PIP[@]}" install -q --no-index --no-deps --no-build-isolation --no-cache-dir -e . \
  || jaxserve="editable install failed: run from the tree on PYTHONPATH"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
install=$(printf '{"install_s": %d, "num_wheels": %d, "jaxserve": "%s", "venv": "%s"}' \
  "$SECONDS" "${#wheels[@]}" "$jaxserve" "$VENV")
echo "installed in $SECONDS s: $install"
exec timeout 560 "$PYV" -u scripts/device_run.py --install "$install" "$@"
