"""The prepared GPU check runs where only jax, flax and numpy are installed (the lent GPU machine).

``scripts/gpu_check.py --dry-run`` runs in a subprocess in which every other dependency of the
server (gguf, tokenizers, tqdm, starlette, ...) fails to import, so a module-level import of one
of them on the kernel or engine-step path shows up here rather than as a failed row on the GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The project's dependencies that the GPU machine lacks (pyproject's list minus jax, flax, numpy
# and what flax itself pulls in).
SERVER_ONLY = ["gguf", "tokenizers", "safetensors", "starlette", "uvicorn", "msgspec", "jinja2",
               "prometheus_client", "tqdm", "httpx", "matplotlib", "llguidance"]

RUNNER = """
import importlib.abc, runpy, sys
blocked = set(sys.argv[1].split(","))

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
        return None

sys.meta_path.insert(0, Block())
sys.argv = ["gpu_check.py", "--dry-run", "--json", sys.argv[2]]
runpy.run_path("scripts/gpu_check.py", run_name="__main__")
"""


def test_gpu_check_dry_run_needs_only_jax_flax_numpy(tmp_path):
    out = tmp_path / "rows.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-c", RUNNER, ",".join(SERVER_ONLY), str(out)],
        check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    failed = [r for r in rows if r["status"] != "ok" and not (
        r["check"] == "engine mosaic" and r["status"].startswith("skipped (dry run"))]
    assert not failed, failed
    names = [r["check"] for r in rows]
    # the Mosaic GPU kernel's rows ran in GPU interpret mode, beside the Triton kernel's
    for prefix in ("mosaic correct", "decode mosaic", "decode pallas", "prefill mosaic",
                   "prefill pallas"):
        assert any(n.startswith(prefix) for n in names), (prefix, names)
    # the engine rows are the ones that import jaxserve and models; they must have run
    assert sum(1 for n in names if n and n.startswith("engine")) >= 2, names
