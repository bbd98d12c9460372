#!/usr/bin/env bash
# Evaluate every Grafana dashboard query and Prometheus rule once on a real Prometheus (Debian's
# prometheus package) scraping a real `jaxserve serve` under a short load; prints one line per
# query (scripts/check_dashboard.py says how). Arguments after -- go to jaxserve serve:
#   bash scripts/check_dashboard.sh [--num-prompts N] [-- SERVE_ARGS...]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
exec "$PY" scripts/check_dashboard.py "$@"
