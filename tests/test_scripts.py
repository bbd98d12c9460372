"""Every script the docs tell users to run, run here in a dry or tiny mode, so none can rot.

A script under ``scripts/`` or ``examples/`` that README.md, docs/*.md or deploy/README.md names
is either run by a test (``COVERED``: this file, or the test file named) or listed in ``NOT_RUN``
with the reason; a newly documented script fails ``test_every_documented_script_is_run`` until
it is one or the other. The scripts that start a server use the ``tiny`` dummy model with the
repository's compilation cache and must wait for ``/ready`` (``/health`` answers before the
model is loaded); each test stays under a minute on a 2-core CPU.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "deploy" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TINY = ["tiny", "--load-format", "dummy", "--max-model-len", "128", "--max-num-seqs", "4",
        "--max-num-batched-tokens", "32", "--num-kv-blocks", "32",
        "--compilation-cache-dir", str(ROOT / ".jax_cache")]

COVERED = {
    "scripts/check_lm_eval.sh": "test_check_lm_eval_dry_run",
    "scripts/check_dashboard.sh": "test_check_dashboard_dry_run",
    "scripts/gpu_tune_attention.py": "test_gpu_tune_attention_dry_run",
    "examples/tiny_gpt.py": "test_example_writes_and_serves",
    "examples/nnx_llama.py": "test_example_writes_and_serves",
    "scripts/gpu_check.py": "tests/test_gpu_check.py (--dry-run)",
    "scripts/gpu_check.sh": "tests/test_gpu_check.py (the .py it runs, --dry-run)",
    "scripts/device_run.sh": "tests/test_device_run.py (--dry-run)",
    "scripts/device_run.py": "tests/test_device_run.py (device_run.sh --dry-run runs it)",
    "scripts/device_correctness.py": "tests/test_device_run.py (the dry run runs it)",
    "scripts/device_server.py": "tests/test_device_run.py (the dry run runs it)",
}
NOT_RUN = {
    "scripts/setup.sh": "installs from PyPI into .venv (network, minutes): every `make test` "
                        "runs it; tests/deploy/test_container.py checks the image uses it",
    "scripts/make_goldens.py": "regenerates the goldens with transformers and torch, which are "
                               "not dependencies",
    "scripts/make_gemma3_goldens.py": "as make_goldens.py",
    "scripts/make_hf_goldens.py": "as make_goldens.py",
    "scripts/make_gemma_lib_goldens.py": "regenerates the goldens with Google DeepMind's gemma "
                                         "library, whose import needs TensorFlow (~1.3 GB; "
                                         "docs/decisions/0045-foreign-checkpoints.md)",
    "scripts/build_wheelhouse.sh": "downloads wheels from the package registry (network); "
                                   "tests/test_device_run.py checks its selection and budget",
    "scripts/build_wheelhouse.py": "as build_wheelhouse.sh",
}


def _env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=path, PYTHON=sys.executable,
                PYTHONUNBUFFERED="1")


def _run(cmd: list[str], timeout_s: float = 120, **env: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=ROOT, env={**_env(), **env}, capture_output=True, text=True,
                          timeout=timeout_s, check=False)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def test_every_documented_script_is_run() -> None:
    documented = {m for doc in DOCS
                  for m in re.findall(r"(?:scripts|examples)/[\w.-]+\.(?:sh|py)", doc.read_text())}
    assert documented <= COVERED.keys() | NOT_RUN.keys(), documented - COVERED.keys() - NOT_RUN.keys()
    assert all((ROOT / p).is_file() for p in COVERED | NOT_RUN)


@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "scripts").glob("*.sh")))
def test_shell_scripts_parse(script: str) -> None:
    _run(["bash", "-n", f"scripts/{script}"], timeout_s=30)


def test_check_lm_eval_dry_run() -> None:
    """Writes the tasks, serves, waits for /ready and reads /tokenizer_info (503 before ready,
    so a wait on /health fails here), then stops the server; no lm-eval."""
    out = _run(["bash", "scripts/check_lm_eval.sh"], DRY_RUN="1",
               SERVE_ARGS=" ".join(TINY)).stdout
    assert "== dry run: no lm-eval venv" in out and "== dry run: the server is ready" in out
    assert '{"tokenizer_class":' in out  # the first 300 characters of /tokenizer_info


def test_check_dashboard_dry_run() -> None:
    """Reads every dashboard query and rule, serves, waits for /ready, sends the bench load, and
    stops the server with a drain; no Prometheus."""
    out = _run(["bash", "scripts/check_dashboard.sh", "--dry-run", "--num-prompts", "2", "--",
                *TINY]).stdout
    assert re.search(r"^\d+ queries and rules to evaluate$", out, re.MULTILINE)
    assert "jaxserve ready after" in out and "load: 2 requests, exit 0" in out
    assert "jaxserve exited 0" in out


def test_gpu_tune_attention_dry_run(tmp_path: Path) -> None:
    """The tuner's sweep at tiny shapes with the Pallas kernel in interpret mode."""
    _run([sys.executable, "scripts/gpu_tune_attention.py", "--dry-run", "--json",
          str(tmp_path / "tune.json")])
    assert json.loads((tmp_path / "tune.json").read_text())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/ready", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):  # 503 while loading and compiling, or no socket
        return False


@pytest.mark.parametrize("name", ["tiny_gpt", "nnx_llama"])
def test_example_writes_and_serves(name: str, tmp_path: Path) -> None:
    """docs/models.md's two commands for each example model: ``write DIR`` then ``serve DIR``;
    one completion."""
    ckpt = str(tmp_path / name.replace("_", "-"))
    script = f"examples/{name}.py"
    assert f"wrote {ckpt}" in _run([sys.executable, script, "write", ckpt]).stdout
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with open(tmp_path / "serve.log", "wb") as log:
        server = subprocess.Popen(
            [sys.executable, script, "serve", ckpt, "--port", str(port), *TINY[3:]],
            cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not _ready(url):
            assert server.poll() is None and time.monotonic() < deadline, \
                (tmp_path / "serve.log").read_text()[-3000:]
            time.sleep(0.5)
        body = json.dumps({"model": name.replace("_", "-"), "prompt": "Hello",
                           "max_tokens": 4}).encode()
        req = urllib.request.Request(url + "/v1/completions", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            reply = json.loads(r.read())
        assert reply["usage"]["completion_tokens"] >= 1
    finally:
        server.send_signal(signal.SIGTERM)  # drains, exits 0
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    assert server.returncode == 0, (tmp_path / "serve.log").read_text()[-3000:]
