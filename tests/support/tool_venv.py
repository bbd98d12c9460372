"""A load generator's own released package in a throwaway venv, for the peer-tool smoke tests.

GuideLLM and AIPerf are run as their users run them: their command line, from a venv of their
own (Python 3.11, which both support), built with ``pip install`` from the package index and
kept in ``$JAXSERVE_TEST_CACHE`` or ``~/.cache/jaxserve-tests/venvs``. Neither can be a test
extra: GuideLLM 0.8.1 declares torch (the package index's build is CUDA's, GBs; the venv takes
``torch==2.13.0``, which pip finds as a CPU build where the machine has one on disk), and AIPerf
0.13.0 pins ~45 dependencies below ours (pyzmq, prometheus-client, rich, pillow, psutil).

The tests run by default, in CI too: a venv is built once per machine (``cold_build`` records
what that took here, minutes) and reused after. They skip, saying why, only where a tool cannot
install (no Python 3.11, no package index, a failed build) or where ``JAXSERVE_PEER_TOOLS=0``
asks a quick local run to leave them out.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.released_wheel import cache_dir

ENABLE = "JAXSERVE_PEER_TOOLS"
BUILD_TIMEOUT_S = 1800


@dataclass(frozen=True)
class Tool:
    """A load generator's venv: its pip requirements and what building it cost here."""

    name: str
    requirements: tuple[str, ...]
    cold_build: str  # measured on the development machine, for the skip message


# without a pip cache, on the shared 2-core development machine (its torch from local disk)
GUIDELLM = Tool("guidellm-0.8.1", ("torch==2.13.0", "guidellm==0.8.1"),
                "155 s, 1.5 GB: torch 2.13 CPU and 80 other packages")
AIPERF = Tool("aiperf-0.13.0", ("aiperf==0.13.0",), "207 s, 1.2 GB: 140 packages")


def requires(tool: Tool) -> pytest.MarkDecorator:
    """Skip a module's tests where ``$JAXSERVE_PEER_TOOLS`` is ``0`` (before any fixture runs);
    they run otherwise."""
    return pytest.mark.skipif(
        os.environ.get(ENABLE, "1").strip() == "0",
        reason=f"{ENABLE}=0 leaves {tool.name} out (building its venv takes {tool.cold_build} "
               "the first time)")


def tool_bin(tool: Tool) -> Path:
    """The ``bin`` directory of ``tool``'s venv, built once (``pip install`` of its
    requirements under ``python3.11``); skips the test when Python 3.11 is missing or the build
    fails (no package index). Modules mark their tests with ``requires(tool)``."""
    venv = cache_dir() / "venvs" / tool.name
    done = venv / ".complete"
    if done.exists():
        return venv / "bin"
    python = shutil.which("python3.11")
    if python is None:
        pytest.skip(f"{tool.name} runs in a Python 3.11 venv and python3.11 is not installed")
    if venv.exists():
        shutil.rmtree(venv)  # a build that did not finish
    t0 = time.monotonic()
    try:
        subprocess.run([python, "-m", "venv", str(venv)], check=True, capture_output=True,
                       timeout=120)
        r = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", *tool.requirements],
                           check=False, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.skip(f"{tool.name}'s venv did not build in {BUILD_TIMEOUT_S} s")
    if r.returncode != 0:
        pytest.skip(f"{tool.name}'s venv could not be built: {r.stderr.strip()[-500:]}")
    done.write_text(f"built in {time.monotonic() - t0:.0f} s\n")
    return venv / "bin"
