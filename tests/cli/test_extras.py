"""The server needs neither httpx nor matplotlib (the ``bench`` and ``autoscaling`` extras).

In a subprocess where both fail to import: the command's module imports and its parser builds,
``jaxserve serve --help`` prints, ``plan-autoscaling`` plans, and the commands that do need an
extra (``bench serve``, ``sweep``, ``plan-autoscaling --sim-plot``) exit 2 before doing any work,
with one line naming the extra to install.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.autoscaling.test_command import STEPS
from tests.autoscaling.test_plan import _sweep

ROOT = Path(__file__).resolve().parents[2]
BLOCKED = ("httpx", "matplotlib")

RUNNER = """
import contextlib, importlib.abc, io, json, sys
blocked = set(sys.argv[1].split(","))

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
        return None

sys.meta_path.insert(0, Block())
import jaxserve.cli.main as cli

cli.build_parser()
plan = ["plan-autoscaling", sys.argv[2], "--slo", "ttft:800", "--time-to-ready-s", "30",
        "--growth-concurrency", "0.05"]
runs = {"serve --help": ["serve", "--help"],
        "bench serve": ["bench", "serve", "--base-url", "http://127.0.0.1:9", "--num-prompts", "1"],
        "sweep": ["sweep", "--base-url", "http://127.0.0.1:9", "--output-dir", sys.argv[3]],
        "plan-autoscaling": plan,
        "plan-autoscaling --sim-plot": plan + ["--simulate", "--sim-plot", sys.argv[3] + "/p.png"]}
out = {}
for name, argv in runs.items():
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            code = cli.main(argv)
        except SystemExit as e:
            code = e.code
    out[name] = {"code": code, "stdout": stdout.getvalue(), "stderr": stderr.getvalue()}
out["imported"] = sorted(m for m in sys.modules if m.split(".")[0] in blocked)
print(json.dumps(out))
"""


def test_the_command_needs_no_bench_or_autoscaling_extra(tmp_path: Path) -> None:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-c", RUNNER, ",".join(BLOCKED), str(_sweep(tmp_path, [STEPS])),
         str(tmp_path / "out")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(proc.stdout.splitlines()[-1])
    assert runs.pop("imported") == []
    assert runs["serve --help"]["code"] == 0 and "--max-num-seqs" in runs["serve --help"]["stdout"]
    assert runs["plan-autoscaling"]["code"] == 0, runs["plan-autoscaling"]["stderr"]
    assert "met up to concurrency 8" in runs["plan-autoscaling"]["stdout"]
    for name, extra, package in (("bench serve", "bench", "httpx"), ("sweep", "bench", "httpx"),
                                 ("plan-autoscaling --sim-plot", "autoscaling", "matplotlib")):
        r = runs[name]
        assert r["code"] == 2, (name, r)
        assert r["stderr"] == (f"jaxserve: error: jaxserve {name} needs {package}, which is not "
                               f"installed: pip install 'jaxserve[{extra}]'\n"), name
    assert not (tmp_path / "out" / "p.png").exists()
